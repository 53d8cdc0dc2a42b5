"""Lowering of the NCCL node kinds (`AllReduce`, `AllGather`, `ReduceScatter`, `Broadcast`,
`Send`, `Recv`): one NCCL call on the node's stream.

    resolve     the communicator's handle and a `Lease` on it (the communicator is destroyed
                only after every prepared plan and graph exec that enqueues its collectives let
                go), NCCL's element type and operator; a closed communicator, two ranks of one
                communicator in one graph (one thread would issue both: NCCL then needs group
                calls and may deadlock; run each rank on its own thread or process) or a
                communicator on another device are refused before any CUDA call
    stream      ncclAllReduce / ncclAllGather / ncclReduceScatter / ncclBroadcast / ncclSend /
                ncclRecv on the stream, eagerly and inside a stream capture alike (NCCL
                records its kernels into the capture; it may add several graph nodes)
    graph       the call captured on a scratch stream of the device (cuStreamBeginCapture,
                thread-local) into a child graph, added with cuGraphAddChildGraphNode
    replay      nothing: NCCL's captured nodes are not rewritten (their buffers are baked in)
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.check import cu
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import AllGather, AllReduce, Broadcast, Recv, ReduceScatter, Send

_THREAD_LOCAL = _d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL


class CollectiveCall:
    """A resolved collective node: ``fn`` (the `NcclAPI` method), ``comm`` (the handle),
    ``lease`` (on the communicator), ``static`` (the call's arguments besides the buffer
    addresses and the stream: count, element type, operator / root / peer).

    Thread-safety: not thread-safe: one per prepared plan or built graph, called on the thread that
    enqueues it, under its executor's lock (NCCL operations on one communicator are issued by
    one thread at a time).
    """

    __slots__ = ("fn", "comm", "lease", "static", "node")

    def __init__(self, node, fn, comm, lease, static: tuple):
        self.node = node
        self.fn = fn
        self.comm = comm
        self.lease = lease
        self.static = static

    def __call__(self, addresses, stream: int) -> None:
        """The NCCL call with ``addresses`` (one per range field, offsets added)."""
        self.fn(*addresses, *self.static, self.comm, stream)

    def release(self) -> None:
        """End the lease on the communicator (once the work that used it is done)."""
        self.lease.release()


def check_ranks(graph) -> None:
    """`NcclUsageError` when ``graph`` holds collectives of two ranks of one communicator:
    one thread would issue both, which NCCL allows only inside group calls and which may
    deadlock when captured; each rank gets its own thread (`run_per_device`) or process."""
    from orchestra.nccl.errors import NcclUsageError

    seen: dict = {}
    for node in graph.nodes:
        comm = getattr(node, "comm", None)
        if comm is None:
            continue
        clique = getattr(comm, "clique", None)
        if clique is None:
            clique = id(comm)
        first = seen.setdefault(clique, (comm.rank, node.name))
        if first[0] != comm.rank:
            raise NcclUsageError(
                f"nodes {first[1]} (rank {first[0]}) and {node.name} (rank {comm.rank}) use two "
                "ranks of one communicator in one graph; run each rank's graph on its own "
                "thread (orchestra.nccl.run_per_device) or process (python -m orchestra.launch)")


class _CollectiveLowering(Lowering):
    graph_node = "collective"
    driver_node_type = "CU_GRAPH_NODE_TYPE_GRAPH"  # graph-build: a child graph
    captures_one_node = False
    method: str  # the NcclAPI method
    #: the node field the call takes after count and element type: "op" (as NCCL's
    #: operator), "root" or "peer" (ints as they are), None for no further argument
    last_arg: str | None = None

    def static_args(self, node, api) -> tuple:
        """The call's arguments between the addresses and the communicator: count, NCCL's
        element type, then ``last_arg``'s value."""
        args = (node.count, api.dtype(node.dtype))
        if self.last_arg is None:
            return args
        if self.last_arg == "op":
            return (*args, api.op(node.op))
        return (*args, getattr(node, self.last_arg))

    def resolve(self, node, executor):
        from orchestra.nccl.errors import NcclUsageError

        comm = node.comm
        api = getattr(comm, "api", None)
        if api is None or not hasattr(comm, "lease"):
            raise NcclUsageError(f"node {node.name}: comm must be an orchestra.nccl."
                                 f"Communicator to run, got {type(comm).__name__}")
        if comm.device != node.device:
            raise NcclUsageError(f"node {node.name}: the communicator is on device "
                                 f"{comm.device}, the node on device {node.device}")
        lease = comm.lease()  # ResourceClosedError for a closed communicator
        return CollectiveCall(node, getattr(api, self.method), lease.handle, lease,
                              self.static_args(node, api))

    def stream(self, node, ctx, stream):
        call: CollectiveCall = ctx.resolved[node.name]
        a = ctx.addresses
        ranges = [getattr(node, f) for f in node.range_fields]
        slots = [(a.device_slot(r.buffer.name), r.offset) for r in ranges]
        ptrs, sh = a.ptrs, int(stream.handle)
        if ctx.capture:
            ctx.record(node, None)
            ctx.built.keep_alive.append(call)
        if len(slots) == 2:
            (s0, o0), (s1, o1) = slots

            def step():
                call((ptrs[s0] + o0, ptrs[s1] + o1), sh)
            return step
        (s0, o0), = slots

        def step():
            call((ptrs[s0] + o0,), sh)
        return step

    def graph(self, node, ctx, deps):
        call: CollectiveCall = ctx.resolved[node.name]
        addresses = tuple(ctx.device_address(getattr(node, f).buffer.name)
                          + getattr(node, f).offset for f in node.range_fields)
        api = ctx.api
        scratch = api.stream(ctx.device)
        try:
            cu(api.cuStreamBeginCapture, scratch.handle, _THREAD_LOCAL)
            try:
                call(addresses, int(scratch.handle))
            except BaseException:
                err, g = api.cuStreamEndCapture(scratch.handle)
                if not err and g:
                    api.cuGraphDestroy(g)
                raise
            child = cu(api.cuStreamEndCapture, scratch.handle)
        finally:
            scratch.close()
        try:
            gnode = ctx.add("cuGraphAddChildGraphNode", deps, child)  # the child is cloned
        finally:
            api.cuGraphDestroy(child)
        ctx.built.keep_alive.append(call)
        return ctx.record(node, gnode, None)


@register
class AllReduceLowering(_CollectiveLowering):
    """The lowering of `AllReduce` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = AllReduce
    method = "all_reduce"
    last_arg = "op"


@register
class AllGatherLowering(_CollectiveLowering):
    """The lowering of `AllGather` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = AllGather
    method = "all_gather"


@register
class ReduceScatterLowering(_CollectiveLowering):
    """The lowering of `ReduceScatter` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = ReduceScatter
    method = "reduce_scatter"
    last_arg = "op"


@register
class BroadcastLowering(_CollectiveLowering):
    """The lowering of `Broadcast` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = Broadcast
    method = "broadcast"
    last_arg = "root"


@register
class SendLowering(_CollectiveLowering):
    """The lowering of `Send` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = Send
    method = "send"
    last_arg = "peer"


@register
class RecvLowering(_CollectiveLowering):
    """The lowering of `Recv` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = Recv
    method = "recv"
    last_arg = "peer"


__all__ = ["AllGatherLowering", "AllReduceLowering", "BroadcastLowering", "CollectiveCall",
           "RecvLowering", "ReduceScatterLowering", "SendLowering", "check_ranks"]

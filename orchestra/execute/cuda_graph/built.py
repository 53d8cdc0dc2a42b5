"""What a graph executor built: the ``CUgraph`` and orchestra's own record of every node.

Both graph executors (`CaptureExecutor`, `GraphBuildExecutor`) produce a `BuiltGraph`, which a
`GraphExec` instantiates and keeps: replays and updates work from these records, never from
parameters read back from the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time: tracing and host nodes are optional
    from orchestra.execute.hostfunc import HostCallbacks
    from orchestra.trace import GraphTracer


class NodeRecord:
    """One orchestra node in a CUDA graph: ``gnode`` (the ``CUgraphNode`` per-node updates
    name: a node of the graph the exec was instantiated from), ``kind`` (the CUDA graph node
    kind: the node lowering's ``graph_node``) and ``params`` (the ``CUDA_MEMCPY3D`` /
    ``CUDA_KERNEL_NODE_PARAMS`` / ``CUDA_MEMSET_NODE_PARAMS`` / ``CUDA_HOST_NODE_PARAMS`` /
    ``CUDA_MEM_ALLOC_NODE_PARAMS`` object it was created with, or None), ``container`` (the
    node whose body holds it, None at the top level).

    Thread-safety: not thread-safe: part of a `BuiltGraph`; its ``params`` are rewritten by replays
    under the owning `GraphExec`'s lock.
    """

    __slots__ = ("name", "kind", "gnode", "params", "container", "__weakref__")

    def __init__(self, name: str, kind: str, gnode, params=None, container: str | None = None):
        self.name = name
        self.kind = kind
        self.gnode = gnode
        self.params = params
        self.container = container

    def __repr__(self) -> str:
        return f"<NodeRecord {self.name} ({self.kind})>"


class BuiltGraph:
    """What a graph executor built: the ``CUgraph`` and everything it refers to.

    Attributes:
        cugraph: the ``CUgraph`` handle (owned: destroyed by the exec).
        taskgraph, plan: the orchestra graph (and plan, when there is one).
        executor: ``"capture"`` or ``"graph-build"``.
        order: orchestra node names in node-creation order (how `update` pairs nodes).
        records: name -> `NodeRecord` of the top-level nodes.
        inner: name -> `NodeRecord` of the nodes inside bodies (``container`` says whose);
            not in ``order``: per-node updates never address them.
        bindings: the `BindingTable`: what is bound to each host buffer and external device
            buffer (leased), and every parameter field each one's address is written to.
        leases: the `Lease` on the `Module` of every kernel the graph launches (docs/errors.md,
            "Lifetimes"); `keeps` is what its holder releases once no launch can use it.
        kernels: kernel node name -> `KernelArgs` (its ``packed`` struct is what
            ``params.kernelParams`` points into).
        copies: host copy node name -> `CopyKernelArgs` of each copy lowered to the copy
            kernel (its node's ``kernelParams`` points into the packed struct kept here).
        allocs: buffer name -> device address of each graph allocation.
        unfreed: device addresses of allocations no free node releases (auto_free graphs).
        callbacks: the `HostCallbacks` table behind host nodes (None without host nodes).
        tracer: the `GraphTracer` whose events the graph records (None untraced).
        build_ms: host time spent building. meta: what the executor adds (the graph-build
            translation as ``meta["spec"]``).

    Thread-safety: not thread-safe: filled by the one build that makes it, then owned by its
    `GraphExec`, which reads and changes it only under the exec's lock.
    """

    def __init__(self, cugraph, taskgraph, plan, executor: str, bindings=None):
        self.cugraph = cugraph
        self.taskgraph = taskgraph
        self.plan = plan
        self.executor = executor
        self.order: list[str] = []
        self.records: dict[str, NodeRecord] = {}
        self.inner: dict[str, NodeRecord] = {}
        self.bindings = bindings
        self.leases: list = []
        self.kernels: dict = {}
        self.copies: dict = {}
        self.allocs: dict[str, int] = {}
        self.unfreed: list[int] = []
        self.callbacks: HostCallbacks | None = None
        self.tracer: GraphTracer | None = None
        self.build_ms = 0.0
        self.meta: dict = {}
        self.keep_alive: list = []  # what the graph's nodes use: communicators' leases

    @property
    def keeps(self) -> tuple:
        """What keeps the memory and code the graph refers to alive: ``(bindings, leases)``,
        for `orchestra.execute.bindings.release_keep` once no launch of it can run."""
        return (self.bindings, self.leases)

    def record(self, name: str, kind: str, gnode, params) -> NodeRecord:
        """A new `NodeRecord`, added in creation order."""
        rec = NodeRecord(name, kind, gnode, params)
        self.order.append(name)
        self.records[name] = rec
        return rec

    def inner_record(self, name: str, kind: str, container: str) -> NodeRecord:
        """The `NodeRecord` of a node inside the body of ``container`` (made on first call)."""
        rec = self.inner.get(name)
        if rec is None:
            rec = self.inner[name] = NodeRecord(name, kind, None, None, container)
        return rec

    def node_name(self, gnode) -> str | None:
        """The orchestra node whose ``CUgraphNode`` is ``gnode`` (None if none)."""
        if gnode is None:
            return None
        key = int(gnode)
        if key == 0:
            return None
        for r in (*self.records.values(), *self.inner.values()):
            if r.gnode is not None and int(r.gnode) == key:
                return r.name
        return None


__all__ = ["BuiltGraph", "NodeRecord"]

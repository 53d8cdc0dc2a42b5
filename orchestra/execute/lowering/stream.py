"""A plan lowered onto streams: the steps the eager and the capture executor both run.

`lower_plan` turns a plan's issue order into a `StreamProgram`: one step per node (its
`Lowering.stream`), per event record (``cuEventRecord``) and per event wait
(``cuStreamWaitEvent``), each a closure that makes exactly one driver call. The eager executor
builds the program once per (graph, plan) and calls its steps on every run; the capture
executor builds it in capture mode (``StreamContext.capture``: each node also records its graph
node's parameter struct) and calls the steps once, inside the stream capture.

Steps find addresses in an `Addresses` table when they run, not when they are built: an
allocation step writes the address it got into its slot, later steps of the buffer read it;
bound host arrays and external device buffers are slots the binding table writes
(`orchestra.execute.bindings.SlotUser`). So a program is built before the first run's
allocations exist and serves every run.
"""

from __future__ import annotations

import copy
from typing import Any

from orchestra.driver.check import error_from_result
from orchestra.execute.bindings import BindingUser, SlotUser
from orchestra.execute.hostfunc import HostCallbacks
from orchestra.execute.lowering.bodies import InnerUser
from orchestra.execute.lowering.table import lowering_for
from orchestra.schedule import RecordEvent, RunNode


class Addresses:
    """The address slots a program's steps read and write.

    ``ptrs`` (device address per slot), ``objs`` (the ``CUdeviceptr`` per allocation slot, None
    while not allocated), ``alloc_stream`` (per slot: the ``CUstream`` that allocated it, None
    for an external buffer), ``alloc_slots``; ``hptrs`` (host address per host buffer slot);
    ``host`` / ``external`` (binding name -> slot); ``current`` (device buffer -> its slot at
    the point of the issue order being lowered); ``live_at_end`` (allocation slots no Free of
    the plan releases, -> the Alloc node).

    Thread-safety: not thread-safe: part of one build or run, used by the thread that makes it,
    under its executor's lock (or a `GraphExec`'s); never share one.
    """

    def __init__(self, table, *, slot_users: bool):
        """Slots for every binding of ``table`` (a `BindingTable`); with ``slot_users`` the
        slots are registered as the bindings' users, so ``table.bind`` writes them."""
        self.ptrs: list[int] = []
        self.objs: list = []
        self.alloc_stream: list = []
        self.alloc_slots: list[int] = []
        self.live_at_end: dict[int, str] = {}
        self.hptrs: list[int] = []
        self.host: dict[str, int] = {}
        self.external: dict[str, int] = {}
        self.current: dict[str, int] = {}
        for name in table.host:
            self.host[name] = len(self.hptrs)
            self.hptrs.append(0)
            if slot_users:
                table.use(name, SlotUser(self.hptrs, self.host[name]))
        for name in table.external:
            slot = self.current[name] = self.external[name] = len(self.ptrs)
            self.ptrs.append(0)
            self.objs.append(None)
            self.alloc_stream.append(None)
            if slot_users:
                table.use(name, SlotUser(self.ptrs, slot))

    def fill(self, table) -> None:
        """Write every binding's current address into its slot."""
        for name, slot in self.host.items():
            self.hptrs[slot] = table.host[name].address
        for name, slot in self.external.items():
            self.ptrs[slot] = table.external[name].address

    def device_slot(self, buffer: str) -> int:
        """The slot of device buffer ``buffer`` at this point of the issue order."""
        return self.current[buffer]

    def host_slot(self, buffer: str) -> int:
        return self.host[buffer]

    def allocate(self, node, stream_handle) -> int:
        """A new slot for the allocation ``node`` (an `Alloc`) makes on ``stream_handle``."""
        slot = self.current[node.buffer.name] = len(self.ptrs)
        self.ptrs.append(0)
        self.objs.append(None)
        self.alloc_stream.append(stream_handle)
        self.alloc_slots.append(slot)
        self.live_at_end[slot] = node.name
        return slot

    def free(self, node) -> int:
        """The slot ``node`` (a `Free`) releases."""
        slot = self.current[node.buffer.name]
        self.live_at_end.pop(slot, None)
        return slot


class StreamContext:
    """What a `Lowering.stream` reads and fills.

    Attributes: ``api`` (the `DriverAPI`: bind the functions a step calls when building it),
    ``executor_name``, ``capture`` (True: the steps run inside a stream capture, so record the
    graph node's parameter struct with `record` and the fields bindings write with `use`),
    ``addresses`` (`Addresses`), ``resolved`` (node name -> what the entry's `resolve`
    returned), ``pool`` (the ``CUmemoryPool`` handle allocations come from), ``device`` (the
    `Device`), ``tokens`` (host-function tokens added for this program), ``allocations``
    (capture: Alloc node name -> address, filled when the step runs), ``built`` (capture: the
    `BuiltGraph` being captured; else None), ``pools`` (device ordinal -> its pool handle;
    `pool_for`), ``stream_devices`` (plan stream name -> `Device`, for plans over several
    devices; None for one), ``copies`` (the `CopyPolicy` the nodes were resolved with: which
    host copies are copy kernels, in bodies too), ``handles`` (condition name -> its
    conditional handle as an int, filled when the graph that holds it exists: capture; empty
    eagerly, so kernels get handle 0), ``container`` (the node whose body is being lowered,
    None at the top), ``depth`` (how many bodies deep), ``side_streams`` (capture: depth ->
    the pooled stream bodies at that depth are captured from; None eagerly). `sub` makes the
    context of a body (`orchestra.execute.lowering.bodies`).

    Thread-safety: not thread-safe: part of one build or run, used by the thread that makes it,
    under its executor's lock (or a `GraphExec`'s); never share one.
    """

    def __init__(self, api, executor_name: str, addresses: Addresses, resolved: dict, pool,
                 device, *, callbacks=None, built=None, bindings=None, pools=None,
                 stream_devices=None, copies=None, side_streams=None):
        self.api = api
        self.copies = copies
        self.executor_name = executor_name
        self.addresses = addresses
        self.resolved = resolved
        self.pool = pool
        self.pools = pools if pools is not None else {device.ordinal: pool}
        self.stream_devices = stream_devices
        self.device = device
        self.built = built
        self.capture = built is not None
        self.bindings = bindings
        self.tokens: list[int] = []
        self.allocations: dict[str, tuple[str, int]] = {}
        self.handles: dict[str, int] = {}
        self.container: str | None = None
        self.depth = 0
        self.side_streams = side_streams
        self._callbacks = [callbacks]  # one cell the contexts of bodies share (`sub`)

    def pool_for(self, ordinal: int):
        """The memory pool handle allocations on device ``ordinal`` come from."""
        return self.pools.get(ordinal, self.pool)

    @property
    def callbacks(self):
        """The `HostCallbacks` table host-function steps register with (capture: the built
        graph's own, made on first use)."""
        cell = self._callbacks
        if cell[0] is None:
            cell[0] = HostCallbacks()
            if self.built is not None:
                self.built.callbacks = cell[0]
        return cell[0]

    def sub(self, container: str) -> "StreamContext":
        """The context of a body of node ``container``: everything shared (slots, resolutions,
        handles, callbacks, tokens), one level deeper."""
        sub = copy.copy(self)
        sub.container = container
        sub.depth = self.depth + 1
        return sub

    def record(self, node, params):
        """Capture: the `NodeRecord` of ``node`` (`lower_plan` made it, or `lower_body` for a
        body node; its graph node is filled in once captured) with ``params``, the parameter
        struct the captured call used (None when replays rewrite nothing of it); eager:
        None."""
        if self.built is None:
            return None
        rec = self.built.records.get(node.name) if self.container is None else None
        if rec is None:
            rec = self.built.inner[node.name]
        rec.params = params
        return rec

    def bound_field(self, buffer: str, struct, field: str, offset: int) -> bool:
        """Eager: when ``buffer`` is a binding (a host array or an external device buffer),
        make ``struct.<field>`` (a packed kernel argument) one of its users, so the binding
        table writes the address when the binding changes and the step need not write it on
        every run; True when it did. Capture (the steps run once) and graph allocations:
        False (the step writes the field from the address slots)."""
        if self.built is not None or self.bindings is None:
            return False
        b = self.bindings.get(buffer)
        if b is None:
            return False
        self.bindings.use(buffer, BindingUser(None, struct, field, offset))
        return True

    def use(self, binding: str, record, params, field: str, offset: int) -> None:
        """Capture: ``params.<field>`` of ``record`` holds binding ``binding``'s address +
        ``offset`` (what a replay rewrites; inside a body an `InnerUser`, which replays
        refuse); eager: nothing (the slots are the users)."""
        if self.built is not None and self.bindings is not None:
            if self.container is None:
                user = BindingUser(record, params, field, offset)
            else:
                user = InnerUser(record, params, field, offset, self.container)
            self.bindings.use(binding, user)


class StreamProgram:
    """A lowered plan: ``steps`` (callables, one driver call each), and per step ``labels``
    (what it is, for errors), ``nodes`` (``(stream name, node)`` for node steps, None for event
    steps), ``streams`` (the orchestra `Stream` it enqueues on), ``sites`` (``(stream name,
    event name or None)``); counts ``node_count``, ``event_count`` (records), ``wait_count``.

    Thread-safety: not thread-safe: its steps write the run's address slots; one belongs to one
    prepared plan and runs under its executor's lock, one run at a time.
    """

    __slots__ = ("steps", "labels", "nodes", "streams", "sites", "node_count", "event_count",
                 "wait_count")

    def __init__(self):
        self.steps: list = []
        self.labels: list[str] = []
        self.nodes: list[Any] = []
        self.streams: list = []
        self.sites: list[tuple] = []
        self.node_count = 0
        self.event_count = 0
        self.wait_count = 0


def lower_plan(issue, graph, ctx: StreamContext, streams: dict, events: list,
               slots: dict[int, int]) -> StreamProgram:
    """The program of ``issue`` (``[(stream name, step)]``, the plan's issue order) for
    ``graph``: ``streams`` maps plan stream names to orchestra `Stream` objects, ``events``
    are the event handles by slot and ``slots`` the issue index -> event slot of every record
    and wait (`prepare.assign_event_slots`); a wait with no slot orders nothing and is left
    out."""
    program = StreamProgram()
    record, wait = ctx.api.cuEventRecord, ctx.api.cuStreamWaitEvent
    sdev = ctx.stream_devices
    if sdev is not None and len({d.ordinal for d in sdev.values()}) < 2:
        sdev = None  # one device: its context is made current once per run
    current = None
    for i, (sname, step) in enumerate(issue):
        stream = streams[sname]
        if sdev is not None and sdev[sname] is not current:
            # several devices: the driver calls that read the current context (launches of a
            # device's function, its allocations) run with their stream's device current
            current = sdev[sname]
            program.steps.append(current.make_current)
            program.streams.append(stream)
            program.nodes.append(None)
            program.sites.append((sname, None))
            program.labels.append(f"make device {current.ordinal} current")
        if isinstance(step, RunNode):
            node = graph.node(step.node)
            entry = lowering_for(node)
            if ctx.built is not None:  # capture: every node gets its record, in issue order
                ctx.built.record(node.name, entry.graph_node_of(node, ctx.copies), None, None)
            fn = entry.stream(node, ctx, stream)
            program.nodes.append((sname, node))
            program.sites.append((sname, None))
            program.labels.append(f"node {node.name} ({node.kind}) on stream {sname}")
            program.node_count += 1
        elif i in slots:
            ev = events[slots[i]]
            if isinstance(step, RecordEvent):
                fn = record_step(record, ev, stream.handle)
                program.event_count += 1
                what = "record"
            else:
                fn = wait_step(wait, stream.handle, ev)
                program.wait_count += 1
                what = "wait for"
            program.nodes.append(None)
            program.sites.append((sname, step.event))
            program.labels.append(f"{what} event {step.event} on stream {sname}")
        else:
            continue  # a wait for an event nothing records orders nothing
        program.steps.append(fn)
        program.streams.append(stream)
    return program


def record_step(record, ev, sh):
    """``cuEventRecord(ev, sh)`` (``record``: the bound driver function)."""
    def step():
        (err,) = record(ev, sh)
        if err:
            raise error_from_result("cuEventRecord", err)
    return step


def wait_step(wait, sh, ev):
    """``cuStreamWaitEvent(sh, ev, 0)`` (``wait``: the bound driver function)."""
    def step():
        (err,) = wait(sh, ev, 0)
        if err:
            raise error_from_result("cuStreamWaitEvent", err)
    return step


__all__ = ["Addresses", "StreamContext", "StreamProgram", "lower_plan", "record_step",
           "wait_step"]

"""`GraphExec`: an instantiated CUDA graph, launched and replayed with new inputs.

Both graph executors (`CaptureExecutor`, `GraphBuildExecutor`) produce a `BuiltGraph` (the
``CUgraph`` plus orchestra's own record of every node) and wrap it in a `GraphExec`:

    exe = GraphBuildExecutor().build(graph, bindings={"b0.host_in": x, "b0.host_out": y})
    exe.launch(); exe.synchronize()                       # its own non-blocking stream
    exe.replay({"b0.host_in": x2, "b0.host_out": y2})     # new pinned arrays, no re-instantiate
    exe.replay(scalars={"b0.kernel": {"iters": 8}})      # new scalar kernel arguments
    exe.update(other_graph)                               # cuGraphExecUpdate, else re-instantiate
    exe.dot("graph.dot"); exe.close()

Replay updates are per node of the instantiated graph (``cuGraphExecMemcpyNodeSetParams``,
``cuGraphExecKernelNodeSetParams``), with parameters built from orchestra's own records: each
memcpy / kernel node keeps the ``CUDA_MEMCPY3D`` / ``CUDA_KERNEL_NODE_PARAMS`` object (and the
packed kernel argument struct its ``kernelParams`` points into) created when the graph was
built, and a replay changes only the field that changed (``srcHost`` / ``dstHost``, one packed
scalar) before handing the same object to the driver. Parameters are never read back from the
driver. A host binding whose array object is the one already bound costs nothing; a new array is
checked (C-contiguous, same byte size, writable if the graph writes it, page-locked: orchestra's
own pinned ranges first, the driver only for memory pinned elsewhere, remembered). An array
checked before (a pool of staging arrays bound in turn) is remembered by weak reference and
skips those checks, except writability, until orchestra's pinned ranges lose a range (a
`PinnedBuffer` closed, a registration undone) or an `update` changes the build.

Lifetime: the exec holds every host array it is bound to, every external device buffer, the
packed argument structs, the host-function trampoline and the timing events, until `close()`
(idempotent; also a ``with`` block and a finalizer). A replay that rebinds an array while
earlier launches may still run keeps the old array alive until `synchronize()`. Rebinding only
changes what later launches read (the driver copies node parameters when they are set), so
reusing a pinned staging array for the next request never changes what an earlier launch reads.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Mapping

import attrs
import numpy as np
from cuda.bindings import driver as _d

from orchestra.driver import Device, Stream, cu
from orchestra.driver import host as _host
from orchestra.driver.check import error_from_result
from orchestra.driver.device import context_alive
from orchestra.driver.entry_points import exec_update
from orchestra.driver.stream import check_stream
from orchestra.errors import (
    ClosedError,
    CudaError,
    KernelArgumentTypeError,
    KernelArgumentValueError,
    OrchestraError,
    prefixed,
)
from orchestra.execute.bindings import (
    PinnedCheck,
    as_host_array,
    check_host_array,
    check_writable,
    host_address,
)
from orchestra.execute.closable import Closable
from orchestra.execute.errors import BindingError, HostFunctionError
from orchestra.schedule import verify

if TYPE_CHECKING:  # imported lazily at run time: tracing and host nodes are optional
    from orchestra.execute.hostfunc import HostCallbacks
    from orchestra.trace import GraphTracer, Timeline

log = logging.getLogger(__name__)

_graph_launch = _d.cuGraphLaunch
_set_memcpy = _d.cuGraphExecMemcpyNodeSetParams
_set_kernel = _d.cuGraphExecKernelNodeSetParams

AUTO_FREE_ON_LAUNCH = int(
    _d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)


# -- records ---------------------------------------------------------------------------------


class NodeRecord:
    """One orchestra node in a CUDA graph: ``gnode`` (the ``CUgraphNode`` per-node updates
    name: a node of the graph the exec was instantiated from), ``kind`` (CUDA node kind) and
    ``params`` (the ``CUDA_MEMCPY3D`` / ``CUDA_KERNEL_NODE_PARAMS`` / ``CUDA_MEMSET_NODE_PARAMS``
    / ``CUDA_HOST_NODE_PARAMS`` / ``CUDA_MEM_ALLOC_NODE_PARAMS`` object it was created with, or
    None)."""

    __slots__ = ("name", "kind", "gnode", "params")

    def __init__(self, name: str, kind: str, gnode, params=None):
        self.name = name
        self.kind = kind
        self.gnode = gnode
        self.params = params

    def __repr__(self) -> str:
        return f"<NodeRecord {self.name} ({self.kind})>"


class BuiltGraph:
    """What a graph executor built: the ``CUgraph`` and everything it refers to.

    Attributes:
        cugraph: the ``CUgraph`` handle (owned: destroyed by the exec).
        taskgraph, plan: the orchestra graph (and plan, when there is one).
        executor: ``"capture"`` or ``"graph-build"``.
        order: orchestra node names in node-creation order (how `update` pairs nodes).
        records: name -> `NodeRecord`.
        host_users: host buffer name -> ``[(record, field, offset)]`` (memcpy nodes reading or
            writing it; ``field`` is ``"srcHost"`` or ``"dstHost"``).
        host_nbytes: host buffer name -> bytes; host_written: names of host buffers the graph
            writes (D2H destinations: the bound array must be writable).
        bound: host buffer name -> the object given in bindings; arrays: -> its numpy array.
        kernels: kernel node name -> `KernelArgs` (its ``packed`` struct is what
            ``params.kernelParams`` points into).
        external: external device buffer name -> the bound object (kept alive).
        allocs: buffer name -> device address of each graph allocation.
        unfreed: device addresses of allocations no free node releases (auto_free graphs).
        callbacks: the `HostCallbacks` table behind host nodes (None without host nodes).
        tracer: the `GraphTracer` whose events the graph records (None untraced).
        build_ms: host time spent building.
    """

    def __init__(self, cugraph, taskgraph, plan, executor: str):
        self.cugraph = cugraph
        self.taskgraph = taskgraph
        self.plan = plan
        self.executor = executor
        self.order: list[str] = []
        self.records: dict[str, NodeRecord] = {}
        self.host_users: dict[str, list] = {}
        self.host_nbytes: dict[str, int] = {}
        self.host_written: dict[str, str] = {}
        self.bound: dict[str, Any] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.kernels: dict[str, Any] = {}
        self.external: dict[str, Any] = {}
        self.allocs: dict[str, int] = {}
        self.unfreed: list[int] = []
        self.callbacks: HostCallbacks | None = None
        self.tracer: GraphTracer | None = None
        self.build_ms = 0.0
        self.meta: dict = {}

    def add(self, record: NodeRecord) -> NodeRecord:
        self.order.append(record.name)
        self.records[record.name] = record
        return record

    def node_name(self, gnode) -> str | None:
        """The orchestra node whose ``CUgraphNode`` is ``gnode`` (None if none)."""
        if gnode is None:
            return None
        key = int(gnode)
        if key == 0:
            return None
        for r in self.records.values():
            if r.gnode is not None and int(r.gnode) == key:
                return r.name
        return None


@attrs.frozen
class UpdateResult:
    """What `GraphExec.update` did: ``updated`` (``cuGraphExecUpdate`` accepted the new graph)
    or ``reinstantiated`` (it refused: ``reason`` is the ``CUgraphExecUpdateResult`` name,
    ``node`` / ``from_node`` the offending orchestra nodes when the driver named them,
    ``message`` one line saying so)."""

    updated: bool
    reinstantiated: bool
    reason: str | None = None
    node: str | None = None
    from_node: str | None = None
    message: str = ""


# -- host arrays -----------------------------------------------------------------------------


# Byte offsets of the host pointers in CUDA_MEMCPY3D (the C ABI, unchanged since CUDA 3.2:
# eight 8-byte source fields, then the memory type, srcHost at 40; dstHost at 128). A replay
# writes the new address straight into the record's struct through a ctypes cell (0.1 µs
# instead of 0.5 µs for the cuda-bindings property); `_host_cell` checks the offset against the
# property first and returns None (use the property) if it does not match.
_HOST_FIELD_OFFSETS = {"srcHost": 40, "dstHost": 128}
_PROBE = 0x0123456789ABCDEF


def _host_cell(params, field: str):
    """A ``ctypes.c_uint64`` over ``params.<field>`` inside the struct, or None."""
    try:
        cell = ctypes.c_uint64.from_address(int(params.getPtr()) + _HOST_FIELD_OFFSETS[field])
        old = int(getattr(params, field))
        setattr(params, field, _PROBE)
        hit = cell.value == _PROBE
        setattr(params, field, old)
        return cell if hit and cell.value == old else None
    except Exception:  # noqa: BLE001 - the property path always works
        return None


class _HostUser:
    """One memcpy node reading or writing a host buffer: where its address lives."""

    __slots__ = ("rec", "params", "field", "offset", "cell", "gnode")

    def __init__(self, rec: NodeRecord, field: str, offset: int):
        self.rec = rec
        self.params = rec.params
        self.field = field
        self.offset = offset
        self.cell = _host_cell(rec.params, field)
        self.gnode = rec.gnode

    def set(self, addr: int) -> None:
        if self.cell is not None:
            self.cell.value = addr + self.offset
        else:
            setattr(self.params, self.field, addr + self.offset)


class _KernelEntry:
    """A kernel node's replay state: its packed struct, params record, graph node, and the
    per-parameter (field, converter) slots looked up once."""

    __slots__ = ("ka", "rec", "params", "gnode", "struct", "layout", "pointers", "slots")

    def __init__(self, ka, rec: NodeRecord):
        self.ka = ka
        self.rec = rec
        self.params = rec.params
        self.gnode = rec.gnode
        self.struct = ka.packed.struct
        self.layout = ka.packed.layout
        self.pointers = frozenset(p.index for p in ka.pointers)
        self.slots: dict = {}

    def slot(self, node: str, key):
        slot = self.slots.get(key)
        if slot is None:
            layout = self.layout
            i = layout.resolve(key)
            if i in self.pointers or layout.params[i].is_pointer:
                raise KernelArgumentTypeError(
                    f"scalars[{node!r}]: parameter {layout.params[i].name} is a "
                    "pointer the graph binds to its buffers; only scalar "
                    "parameters can be replayed with new values")
            slot = self.slots[key] = (layout.field_names[i], layout.converters[i])
        return slot


# -- the exec --------------------------------------------------------------------------------


class _State:
    """Everything the finalizer releases (no reference back to the `GraphExec`)."""

    def __init__(self, device: Device):
        self.device = device
        self.exec = None  # CUgraphExec
        self.graphs: list = []  # every CUgraph the exec owns (instantiation graph first)
        self.tracers: list = []
        self.unfreed: list[int] = []
        self.launched = False
        self.streams: dict[int, Stream] = {}  # streams launched on since the last synchronize
        self.own_stream: Stream | None = None
        self.owns_stream = True  # False when the caller gave the stream: not closed here
        self.keep: list = []  # BuiltGraphs (arrays, packed args, callbacks) kept alive


def _release(state: _State) -> None:
    """Destroy the exec, free what it left allocated, destroy its graphs, close its tracers.
    Runs on `close()` or from the finalizer (then inside ``device.pushed()``)."""
    dev = state.device
    if context_alive(dev.ordinal):
        with dev.pushed():
            own = [state.own_stream] if state.own_stream is not None else []
            for s in list(state.streams.values()) + own:
                try:
                    if not s.closed:
                        s.synchronize()
                except CudaError:
                    pass
            if state.exec is not None:
                _d.cuGraphExecDestroy(state.exec)
            if state.unfreed and state.launched:
                # auto_free graphs: the last launch's allocations are live (the opt-in); a
                # graph allocation may be freed with cuMemFree once its work is done.
                for dptr in state.unfreed:
                    _d.cuMemFree(dptr)
            for g in state.graphs:
                _d.cuGraphDestroy(g)
    state.exec = None
    state.graphs.clear()
    state.unfreed = []
    for t in state.tracers:
        try:
            t.close()
        except Exception:  # noqa: BLE001 - events die with the context anyway
            pass
    state.tracers.clear()
    state.streams.clear()
    if state.own_stream is not None:
        if state.owns_stream:
            state.own_stream.close()
        state.own_stream = None
    state.keep.clear()


class GraphExec(Closable):
    """An instantiated CUDA graph of an orchestra task graph (make one with a graph executor's
    ``build``).

    Args:
        built: the `BuiltGraph` (ownership of its ``CUgraph`` passes to the exec).
        device: the `Device`.
        flags: ``cuGraphInstantiate`` flags (``AUTO_FREE_ON_LAUNCH`` for auto_free graphs).
        upload: ``cuGraphUpload`` right after instantiating (maps the graph's memory now, so
            the first launch costs no more than later ones).
        rebuild: ``rebuild(taskgraph, plan, bindings) -> BuiltGraph`` used by `update`.

    Attributes: ``device``, ``stream`` (the exec's own non-blocking stream), ``executor``,
    ``taskgraph``, ``plan``, ``flags``, ``launches`` (count), ``last_update`` (`UpdateResult`),
    ``timeline`` (the last traced launch's `Timeline`), ``instantiate_ms``, ``build_ms``.

    Thread-safe: every method holds the exec's lock (one launch/replay at a time).
    """

    def __init__(self, built: BuiltGraph, device: Device, *, flags: int = 0, upload: bool = True,
                 rebuild=None, stream: Stream | None = None):
        self.device = device
        self.flags = int(flags)
        self._rebuild = rebuild
        self._lock = threading.RLock()
        self._closed = False
        self._state = _State(device)
        self._finalizer = weakref.finalize(self, _release, self._state)
        self._finalizer.atexit = False
        self._pinned = PinnedCheck()
        self._checked: dict[int, tuple] = {}  # see _rebind
        self._pending_timeline = False
        self._own_pending = False  # a launch on the exec's own stream since the last sync
        self._retired: list = []  # arrays unbound while launches were pending
        self._host_errors: list = []  # (node, exception) from host functions, not yet raised
        self.launches = 0
        self.wall_ms: float | None = None  # set by an executor's run()
        self.last_update: UpdateResult | None = None
        self.timeline: Timeline | None = None
        device.make_current()
        self._ctx = device.context
        self._state.own_stream = stream if stream is not None else Stream(device)
        self._state.owns_stream = stream is None
        self.stream = self._state.own_stream
        self._sh = self.stream.handle  # the raw CUstream: no property lookups per launch
        self._state.graphs.append(built.cugraph)
        self._adopt(built)
        try:
            t0 = time.perf_counter_ns()
            self._state.exec = cu(_d.cuGraphInstantiate, built.cugraph, self.flags)
            self.instantiate_ms = (time.perf_counter_ns() - t0) / 1e6
            self._inst_nodes = [built.records[n].gnode for n in built.order]
            if upload:
                self._upload(None)
        except BaseException:
            self.close()
            raise
        self._exec = self._state.exec

    # -- adopting a build ---------------------------------------------------------------------

    def _adopt(self, built: BuiltGraph) -> None:
        self._built = built
        self.taskgraph = built.taskgraph
        self.plan = built.plan
        self.executor = built.executor
        self.build_ms = built.build_ms
        self._records = built.records
        self._host_users = {name: [_HostUser(rec, field, off) for rec, field, off in users]
                            for name, users in built.host_users.items()}
        self._host_nbytes = built.host_nbytes
        self._host_written = built.host_written
        self._checked = {}  # sizes may differ in a new build: check every array again
        self._bound = dict(built.bound)
        self._arrays = dict(built.arrays)
        self._kernels = {name: _KernelEntry(ka, built.records[name])
                         for name, ka in built.kernels.items()}
        self._callbacks = built.callbacks
        self._tracer = built.tracer
        self._state.keep.append(built)
        if built.tracer is not None:
            self._state.tracers.append(built.tracer)
        # auto_free graphs: what the last launch may have left allocated (union across
        # updates; freeing an address twice at close is refused by the driver, harmlessly)
        self._state.unfreed = list(dict.fromkeys(self._state.unfreed + list(built.unfreed)))

    # -- queries ------------------------------------------------------------------------------

    @property
    def handle(self):
        """The ``CUgraphExec``."""
        self._check_open()
        return self._state.exec

    @property
    def cugraph(self):
        """The ``CUgraph`` of the current parameters (the last one built)."""
        self._check_open()
        return self._built.cugraph

    @property
    def nodes(self) -> dict:
        """orchestra node name -> ``CUgraphNode`` (of the instantiation graph)."""
        return {n: r.gnode for n, r in self._records.items()}

    @property
    def node_count(self) -> int:
        return len(self._records)

    @property
    def bindings(self) -> dict:
        """host buffer name -> the bound object (what the next launch reads and writes)."""
        return dict(self._bound)

    # -- launch -------------------------------------------------------------------------------

    def upload(self, stream: Stream | None = None) -> None:
        """``cuGraphUpload`` on ``stream`` (default: the exec's own)."""
        with self._lock:
            self._check_open()
            self._upload(stream)

    def _upload(self, stream) -> None:
        if stream is None:
            cu(_d.cuGraphUpload, self._state.exec, self._sh)
            self._own_pending = True
        else:
            s = check_stream(stream, "GraphExec.upload")
            cu(_d.cuGraphUpload, self._state.exec, s.handle)
            self._state.streams[id(s)] = s

    def launch(self, stream: Stream | None = None, *, sync: bool = False):
        """``cuGraphLaunch`` on ``stream`` (default: the exec's own non-blocking stream).

        With ``sync=True`` waits and returns what `synchronize` returns. Launches of one exec
        run one after the other, in launch order, whatever the streams.
        """
        with self._lock:
            self._check_open()
            return self._launch(stream, sync)

    def _launch(self, stream, sync):
        tracer = self._tracer
        if stream is None:
            if tracer is not None:
                tracer.mark_launch(self.stream)
                self._pending_timeline = True
            (err,) = _graph_launch(self._exec, self._sh)
            if err:
                self._launch_error(err)
            self._own_pending = True
        else:
            s = check_stream(stream, "GraphExec.launch")
            if tracer is not None:
                tracer.mark_launch(s)
                self._pending_timeline = True
            (err,) = _graph_launch(self._exec, s.handle)
            if err:
                self._launch_error(err)
            self._state.streams[id(s)] = s
        self._state.launched = True
        self.launches += 1
        if sync:
            return self._synchronize()
        return None

    def _launch_error(self, err):
        raise error_from_result("cuGraphLaunch", err,
                                context=f"{self.executor} graph of {self.node_count} nodes")

    @property
    def pending(self) -> bool:
        """True while launches may be running (until `synchronize`)."""
        return self._own_pending or bool(self._state.streams)

    def synchronize(self):
        """Wait for every launch so far; return the last launch's `Timeline` when traced (also
        kept as ``timeline``), else None.

        Releases arrays a replay unbound while launches were pending. Raises `CudaError` if the
        work failed, `HostFunctionError` if a host node's function raised.
        """
        with self._lock:
            self._check_open()
            return self._synchronize()

    def _synchronize(self, raise_host_errors: bool = True):
        if self._own_pending:
            self.stream.synchronize()
            self._own_pending = False
        streams = self._state.streams
        for s in list(streams.values()):
            s.synchronize()
        streams.clear()
        # host-function errors of every build launched since the last synchronize (an update
        # swaps the table: launches made before it report into the earlier build's table)
        for b in self._state.keep:
            if b.callbacks is not None:
                self._host_errors.extend(b.callbacks.take_errors())
        del self._state.keep[:-1]  # earlier builds / arrays unbound while launches ran
        self._retired.clear()
        if self._host_errors and raise_host_errors:
            errors, self._host_errors = self._host_errors, []
            self._pending_timeline = False
            node, exc = errors[0]
            raise HostFunctionError(node, exc, errors[1:]) from exc
        tracer = self._tracer
        if self._pending_timeline and tracer is not None:  # pending: only traced execs
            self._pending_timeline = False
            self.timeline = tracer.finish()
            return self.timeline
        return None

    # -- replay -------------------------------------------------------------------------------

    def replay(self, bindings: Mapping[str, Any] | None = None,
               scalars: Mapping[str, Mapping] | None = None, *, stream: Stream | None = None,
               sync: bool = True):
        """Launch again with new host arrays and/or new scalar kernel arguments.

        Args:
            bindings: host buffer name -> pinned array (numpy array, `PinnedBuffer`,
                `HostRegistration`), only those that change; a name bound to the very same
                object as before costs nothing. Same byte size as the graph's host buffer,
                C-contiguous, writable for outputs, page-locked.
            scalars: kernel node name -> {parameter name or index: value} (scalar parameters
                only; checked like ``Kernel.pack``). Values persist for later launches.
            stream: launch stream (default: the exec's own).
            sync: wait for the launch (default) and return the `Timeline` when traced.

        Each change becomes one ``cuGraphExec*NodeSetParams`` per affected node of the
        instantiated graph; nothing is re-instantiated. Raises `BindingError` /
        `PageableMemoryError` / ``TypeError`` / ``ValueError`` before anything is launched
        (changes already applied stay applied).
        """
        with self._lock:
            if self._closed:
                raise ClosedError("this GraphExec is closed")
            if bindings:
                bound = self._bound
                try:
                    items = bindings.items()
                except AttributeError:
                    raise BindingError(f"bindings must be a mapping of host buffer name -> "
                                       f"array; got {type(bindings).__name__}") from None
                for name, value in items:
                    if bound.get(name) is not value:
                        self._rebind(name, value)
            if scalars:
                try:
                    items = scalars.items()
                except AttributeError:
                    raise KernelArgumentTypeError(
                        "scalars must map kernel node name -> {parameter: value}; "
                        f"got {type(scalars).__name__}") from None
                for node, values in items:
                    self._set_scalars(node, values)
            if stream is None and self._tracer is None:  # the common path, inlined
                (err,) = _graph_launch(self._exec, self._sh)
                if err:
                    self._launch_error(err)
                self._own_pending = True
                self._state.launched = True
                self.launches += 1
                return self._synchronize() if sync else None
            return self._launch(stream, sync)

    # arrays a replay already checked: id -> (weak reference, binding name, address, version
    # of the pinned ranges then); a hit skips the layout, size and pinned checks
    _CHECKED_MAX = 64

    def _rebind(self, name: str, value) -> None:
        users = self._host_users.get(name)
        if users is None:
            raise BindingError(self._unknown_binding(name))
        ranges = _host.pinned_ranges()
        hit = self._checked.get(id(value))
        if hit is not None and hit[0]() is value and hit[1] == name and hit[3] == ranges.version:
            a = value if type(value) is np.ndarray else as_host_array(name, value)
            addr = hit[2]
            check_writable(name, a, self._host_written.get(name))
        else:
            a, addr = self._check_binding(name, value, ranges)
        exec_, ctx = self._exec, self._ctx
        for u in users:
            cell = u.cell
            if cell is not None:
                cell.value = addr + u.offset
            else:
                setattr(u.params, u.field, addr + u.offset)
            (err,) = _set_memcpy(exec_, u.gnode, u.params, ctx)
            if err:
                self._rollback(name, users, u)
                raise error_from_result("cuGraphExecMemcpyNodeSetParams", err,
                                        context=f"node {u.rec.name}, rebinding {name}")
        if self._own_pending or self._state.streams:
            self._retired.append(self._arrays.get(name))  # launches may still read it
        self._bound[name] = value
        self._arrays[name] = a

    def _check_binding(self, name: str, value, ranges) -> tuple[np.ndarray, int]:
        """Every check of a new host array (see `replay`): its array and address. Remembers
        the array (weakly) so that binding it again skips the checks."""
        version = ranges.version  # read first: a range removed meanwhile forgets this check
        a = check_host_array(name, value, self._host_nbytes[name], self._host_written.get(name),
                             self._pinned)
        addr = host_address(a)
        try:
            ref = weakref.ref(value)
        except TypeError:  # no weak references: checked every time
            return a, addr
        if len(self._checked) >= self._CHECKED_MAX:
            self._checked.clear()
        self._checked[id(value)] = (ref, name, addr, version)
        return a, addr

    def _rollback(self, name: str, users, failed) -> None:
        """Put the nodes changed so far (up to ``failed``) back on the old array, so the exec
        stays consistent after a refused update."""
        prev = self._arrays.get(name)
        if prev is None:
            return
        paddr = host_address(prev)
        for u in users:
            u.set(paddr)
            _set_memcpy(self._exec, u.gnode, u.params, self._ctx)
            if u is failed:
                break

    def _unknown_binding(self, name: str) -> str:
        if name in self._built.external:
            return (f"binding {name}: external device buffer {name} is baked into the graph "
                    "(its address is in the graph's nodes); build a new exec to change it")
        if name in self._built.allocs:
            return f"binding {name}: buffer {name} is allocated by the graph itself"
        known = ", ".join(sorted(self._host_users)) or "none"
        return f"binding {name}: not a host buffer of this graph (host buffers: {known})"

    def _set_scalars(self, node: str, values: Mapping) -> None:
        entry = self._kernels.get(node)
        if entry is None:
            known = ", ".join(sorted(self._kernels)) or "none"
            raise KernelArgumentValueError(
                f"scalars: {node!r} is not a kernel node of this graph (kernel "
                f"nodes: {known})")
        struct = entry.struct
        try:
            items = values.items()
        except AttributeError:
            raise KernelArgumentTypeError(
                f"scalars[{node!r}] must map parameter name or index -> value; got "
                f"{type(values).__name__}") from None
        for key, value in items:
            field, conv = entry.slot(node, key)
            try:
                setattr(struct, field, conv(value))
            except (TypeError, ValueError) as exc:
                raise prefixed(exc, f"kernel node {node}: ", KernelArgumentTypeError,
                               KernelArgumentValueError) from exc
        (err,) = _set_kernel(self._exec, entry.gnode, entry.params)
        if err:
            raise error_from_result("cuGraphExecKernelNodeSetParams", err, context=f"node {node}")

    def scalars(self, node: str) -> dict:
        """The current packed arguments of kernel node ``node``: {parameter name: value}."""
        packed = self._kernels[node].ka.packed
        return {p.name: v for p, v in zip(packed.layout.params, packed.values())}

    # -- topology change ----------------------------------------------------------------------

    def update(self, taskgraph, plan=None, bindings: Mapping[str, Any] | None = None
               ) -> UpdateResult:
        """Make this exec run ``taskgraph`` (a new structure or new sizes with the same node
        kinds and order): build its CUDA graph the way this exec was built (with ``plan``, else
        the current plan while it is still valid for ``taskgraph``, else a new schedule), try
        ``cuGraphExecUpdate``; when the driver refuses, report its ``CUgraphExecUpdateResult``
        and the offending node (``last_update``, a log warning) and instantiate the new graph
        instead. ``bindings`` default: the current ones (they must fit the new graph).
        Returns the `UpdateResult`."""
        with self._lock:
            self._check_open()
            if self._rebuild is None:
                raise OrchestraError("this GraphExec was not made by an executor; it cannot "
                                     "rebuild for update()")
            if bindings is None:  # the current host arrays and external device buffers
                bindings = {**self._built.external, **self._bound}
            built = self._rebuild(taskgraph, self._plan_for(taskgraph, plan), bindings)
            try:
                self.device.make_current()
                err, result, error_node, error_from = exec_update(self._state.exec,
                                                                  built.cugraph, _d)
            except BaseException:
                self._discard(built)
                raise
            ok = not err and result == 0
            if ok:
                # Per-node updates keep naming nodes of the instantiation graph; the updated
                # graph is topologically identical and built in the same order, so the i-th
                # orchestra node of the new build pairs with the i-th of the first.
                for rec, gnode in zip((built.records[n] for n in built.order), self._inst_nodes):
                    rec.gnode = gnode
                self._state.graphs.append(built.cugraph)  # kept: its nodes back the update
                self._adopt(built)
                self.last_update = UpdateResult(True, False, None, None, None,
                                                "cuGraphExecUpdate accepted the new graph")
                return self.last_update
            if result is None:
                reason = "unknown (the result info was not available)"
            else:
                try:
                    reason = _d.CUgraphExecUpdateResult(result).name
                except ValueError:
                    reason = f"CUgraphExecUpdateResult({result})"
            node = built.node_name(error_node)
            from_node = built.node_name(error_from)
            msg = f"cuGraphExecUpdate refused the new graph: {reason}"
            if err:
                try:
                    msg += f" ({_d.CUresult(err).name})"
                except ValueError:
                    msg += f" (CUresult {err})"
            if node:
                msg += f" at node {node}"
            if from_node:
                msg += f" (edge from {from_node})"
            msg += "; instantiated the new graph instead"
            log.warning(msg)
            self._reinstantiate(built)
            self.last_update = UpdateResult(False, True, reason, node, from_node, msg)
            return self.last_update

    def _plan_for(self, taskgraph, plan):
        """The plan to rebuild ``taskgraph`` with: the one given; else the current plan when it
        runs exactly the new graph's nodes and the hazard verifier finds nothing wrong with it
        for the new graph (same stream order, same topology: what ``cuGraphExecUpdate`` needs,
        where a fresh schedule of new sizes may order the nodes differently); else None (the
        executor schedules anew)."""
        old = self.plan
        if plan is not None or old is None:
            return plan
        if set(old.node_stream) != {n.name for n in taskgraph.nodes}:
            return None
        try:
            return old if not verify(old, taskgraph) else None
        except OrchestraError:  # e.g. the new graph has a cycle: let the rebuild report it
            return None

    def _discard(self, built: BuiltGraph) -> None:
        try:
            _d.cuGraphDestroy(built.cugraph)
        finally:
            if built.tracer is not None:
                built.tracer.close()

    def _reinstantiate(self, built: BuiltGraph) -> None:
        try:
            new_exec = cu(_d.cuGraphInstantiate, built.cugraph, self.flags)
        except BaseException:
            self._discard(built)
            raise
        # the old exec: wait for its launches, destroy it and its graphs (a host function of
        # those launches that raised is reported by the next synchronize, not here: the swap
        # must complete)
        self._synchronize(raise_host_errors=False)
        old = self._state
        _d.cuGraphExecDestroy(old.exec)
        if old.unfreed and old.launched:
            for dptr in old.unfreed:
                _d.cuMemFree(dptr)
        old.unfreed = []
        for g in old.graphs:
            _d.cuGraphDestroy(g)
        for t in old.tracers:
            t.close()
        old.graphs = [built.cugraph]
        old.tracers = []
        old.keep = []
        old.launched = False
        old.exec = new_exec
        self._exec = new_exec
        self._adopt(built)
        self._inst_nodes = [built.records[n].gnode for n in built.order]
        self._upload(None)

    # -- debugging ------------------------------------------------------------------------------

    def dot(self, path, *, verbose: bool = False) -> str:
        """Write the graph as DOT with ``cuGraphDebugDotPrint`` (``verbose``: node parameters
        too); returns the path."""
        import os

        with self._lock:
            self._check_open()
            path = os.fspath(path)
            flags = int(_d.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE) if verbose else 0
            cu(_d.cuGraphDebugDotPrint, self._built.cugraph, path.encode(), flags)
            return path

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending launches, destroy the exec and its graphs, free what an auto_free
        graph left allocated, close the tracer and the exec's stream; drop every reference to
        bound arrays, argument structs and host functions. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer()

    def __repr__(self) -> str:
        if self._closed:
            return "<GraphExec closed>"
        return (f"<GraphExec {self.executor}: {self.node_count} nodes, {self.launches} launches"
                f" on device {self.device.ordinal}>")


__all__ = ["AUTO_FREE_ON_LAUNCH", "BuiltGraph", "GraphExec", "NodeRecord", "UpdateResult"]

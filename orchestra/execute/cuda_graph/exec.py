"""`GraphExec`: an instantiated CUDA graph, launched and replayed with new inputs.

Both graph executors (`CaptureExecutor`, `GraphBuildExecutor`) produce a `BuiltGraph` (the
``CUgraph`` plus orchestra's own record of every node, `cuda_graph.built`) and wrap it in a
`GraphExec`:

    exe = GraphBuildExecutor().build(graph, bindings={"b0.host_in": x, "b0.host_out": y})
    exe.launch(); exe.synchronize()                       # its own non-blocking stream
    exe.replay({"b0.host_in": x2, "b0.host_out": y2})     # new pinned arrays, no re-instantiate
    exe.replay(scalars={"b0.kernel": {"iters": 8}})      # new scalar kernel arguments
    exe.update(other_graph)                               # cuGraphExecUpdate, else re-instantiate
    exe.disable("b0.debug_copy"); exe.enable(...)         # cuGraphNodeSetEnabled
    exe.dot("graph.dot"); exe.close()

This module instantiates (``cuGraphInstantiate``, ``cuGraphUpload``), launches
(``cuGraphLaunch``), synchronizes and releases; replays (`cuda_graph.replay`), updates
(`cuda_graph.update`) and node enable / disable (`cuda_graph.toggle`) are the exec's other
parts. Every driver call goes through the
exec's `DriverAPI`, the functions its launches and replays call bound once.

Lifetime (docs/errors.md, "Lifetimes"): the exec holds a lease on everything its graph refers
to, until `close()` (idempotent; also a ``with`` block and a finalizer): every external device
buffer, the `PinnedBuffer` / `HostRegistration` (a `StagingPool` slot) behind every bound host
array (the array itself for memory pinned outside orchestra), and the `Module` of every kernel.
Their owners may close them at any time: the memory stays allocated, and the replays right,
until the exec closes; binding a closed object again is refused (`ClosedBindingError`). A
replay that rebinds while earlier launches may still run keeps the old lease until
`synchronize()`. Rebinding only changes what later launches read (the driver copies node
parameters when they are set), so reusing a pinned staging array for the next request never
changes what an earlier launch reads. `close()` drops every reference the exec holds (bound
arrays, buffers, argument structs, records, callbacks, tracer, graphs); the closed object
answers ``closed`` and ``repr`` only.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import TYPE_CHECKING

from cuda.bindings import driver as _d

from orchestra.driver import Device, Stream, cu
from orchestra.driver.api import default_api
from orchestra.driver.check import error_from_result
from orchestra.driver.device import _tls
from orchestra.driver.owner import CLOSE_EPOCH
from orchestra.errors import CudaError
from orchestra.execute.bindings import release_keep
from orchestra.execute.closable import Closable
from orchestra.execute.cuda_graph.built import BuiltGraph
from orchestra.execute.cuda_graph.replay import SET_PARAMS, KernelScalars, Replay, plan_rebinds
from orchestra.execute.cuda_graph.state import ExecState, release_exec
from orchestra.execute.cuda_graph.toggle import Toggle
from orchestra.execute.cuda_graph.update import Update, UpdateResult
from orchestra.execute.errors import HostFunctionError

if TYPE_CHECKING:  # imported lazily at run time: tracing is optional
    from orchestra.trace import Timeline

AUTO_FREE_ON_LAUNCH = int(
    _d.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)


class GraphExec(Replay, Update, Toggle, Closable):
    """An instantiated CUDA graph of an orchestra task graph (make one with a graph executor's
    ``build``).

    Args:
        built: the `BuiltGraph` (ownership of its ``CUgraph`` passes to the exec).
        device: the `Device`.
        flags: ``cuGraphInstantiate`` flags (``AUTO_FREE_ON_LAUNCH`` for auto_free graphs).
        upload: ``cuGraphUpload`` right after instantiating (maps the graph's memory now, so
            the first launch costs no more than later ones).
        rebuild: ``rebuild(taskgraph, plan, bindings) -> BuiltGraph`` used by `update`.
        stream: the default launch stream (default: a new non-blocking one the exec owns).
        driver: the `DriverAPI` every driver call goes through (default: the process's; the
            executors pass their own).

    Attributes: ``device``, ``stream`` (the exec's own non-blocking stream), ``executor``,
    ``taskgraph``, ``plan``, ``flags``, ``launches`` (count), ``last_update`` (`UpdateResult`),
    ``timeline`` (the last traced launch's `Timeline`), ``instantiate_ms``, ``build_ms``.

    ``repoint_updates`` counts rebindings the driver could not apply per node, done by
    updating the whole exec instead (see `replay`).

    Thread-safety: may be shared between threads: every method holds the exec's lock (one
    launch/replay at a time, as launches of one ``CUgraphExec`` serialize anyway; a replay with
    ``sync=True`` keeps it until its launch is done), and `launch`, `replay`, `synchronize`
    make the exec's device current on a host thread that does not have it yet
    (``cuCtxSetCurrent``, once per thread). For launches that overlap, use one exec per thread
    (or a `GraphCache` / serving engine with several instances).
    """

    def __init__(self, built: BuiltGraph, device: Device, *, flags: int = 0, upload: bool = True,
                 rebuild=None, stream: Stream | None = None, driver=None):
        self._api = api = driver if driver is not None else default_api()
        # the driver calls of launches and replays, bound once (no lookup per call)
        self._graph_launch = api.cuGraphLaunch
        self._set_memcpy = api.cuGraphExecMemcpyNodeSetParams
        self._set_kernel = api.cuGraphExecKernelNodeSetParams
        self._rebinds: dict = {}  # binding name -> its prebuilt Rebind (after instantiation)
        self._close_epoch = CLOSE_EPOCH[0]  # leased closes seen by the last synchronize
        self.repoint_updates = 0
        self.device = device
        self.flags = int(flags)
        self._rebuild = rebuild
        self._lock = threading.RLock()
        self._closed = False
        self._state = ExecState(device, api)
        self._finalizer = weakref.finalize(self, release_exec, self._state)
        self._finalizer.atexit = False
        self._pending_timeline = False
        self._own_pending = False  # a launch on the exec's own stream since the last sync
        self._host_errors: list = []  # (node, exception) from host functions, not yet raised
        self._disabled: set = set()  # nodes switched off (cuGraphNodeSetEnabled)
        self.launches = 0
        self.wall_ms: float | None = None  # set by an executor's run()
        self.last_update: UpdateResult | None = None
        self.timeline: Timeline | None = None
        device.make_current()
        self._ctx = device.context
        self._ctx_key = getattr(device, "_ctx_int", None)  # what make_current caches per thread
        self._state.own_stream = stream if stream is not None else api.stream(device)
        self._state.owns_stream = stream is None
        self.stream = self._state.own_stream
        self._sh = self.stream.handle  # the raw CUstream: no property lookups per launch
        self._state.graphs.append(built.cugraph)
        self._adopt(built)
        try:
            t0 = time.perf_counter_ns()
            self._state.exec = cu(api.cuGraphInstantiate, built.cugraph, self.flags)
            self.instantiate_ms = (time.perf_counter_ns() - t0) / 1e6
            self._inst_nodes = [built.records[n].gnode for n in built.order]
            self._plan_replays()
            if upload:
                self._upload(None)
        except BaseException:
            self.close()
            raise
        self._exec = self._state.exec

    # -- adopting a build ---------------------------------------------------------------------

    def _adopt(self, built: BuiltGraph) -> None:
        self._built = built
        self._copy_kernels = len(built.copies)
        self.taskgraph = built.taskgraph
        self.plan = built.plan
        self.executor = built.executor
        self.build_ms = built.build_ms
        self._records = built.records
        # a new build brings its own table (what it checked is not remembered: sizes may
        # differ); its users name the records' nodes, which an update may have re-pointed
        self._table = table = built.bindings
        self._host = table.host
        for b in (*table.host.values(), *table.external.values()):
            for u in b.users:
                u.gnode = u.record.gnode if u.record is not None else None
        # kernels inside bodies have no per-node replay (see lowering.bodies): not listed
        self._kernels = {name: KernelScalars(ka, built.records[name])
                         for name, ka in built.kernels.items() if name in built.records}
        self._table.where = f"a {built.executor} GraphExec"
        self._callbacks = built.callbacks
        self._tracer = built.tracer
        self._state.keep.append(built)
        if built.tracer is not None:
            self._state.tracers.append(built.tracer)
        # auto_free graphs: what the last launch may have left allocated (union across
        # updates; freeing an address twice at close is refused by the driver, harmlessly)
        self._state.unfreed = list(dict.fromkeys(self._state.unfreed + list(built.unfreed)))

    def _plan_replays(self) -> None:
        """Prebuild every binding's `Rebind` and every kernel node's scalar update for the
        current instantiation (its ``CUgraphExec``): one SetParams call per node with its
        arguments bound. Run after every instantiation and in-place update."""
        api, exec_ = self._api, self._state.exec
        setters = {}
        for kind, call in SET_PARAMS.items():
            try:
                setters[kind] = getattr(api, call)
            except AttributeError:  # a driver without it: such nodes are updated whole
                pass
        self._rebinds = plan_rebinds(self._table, setters, exec_, self._ctx)
        set_kernel = self._set_kernel
        for entry in self._kernels.values():
            entry.gnode = entry.rec.gnode
            entry.apply = functools.partial(set_kernel, exec_, entry.gnode, entry.params)

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
    def copy_kernels(self) -> int:
        """Host copies of the graph built as the copy kernel (kernel nodes); kept after
        `close`."""
        return self._copy_kernels

    @property
    def bindings(self) -> dict:
        """host buffer name -> the bound object (what the next launch reads and writes); empty
        once closed."""
        return {name: b.value for name, b in self._host.items()}

    @property
    def device_bindings(self) -> dict:
        """external device buffer name -> the bound object; empty once closed."""
        table = self._table
        return {} if table is None else {n: b.value for n, b in table.external.items()}

    # -- launch -------------------------------------------------------------------------------

    def upload(self, stream: Stream | None = None) -> None:
        """``cuGraphUpload`` on ``stream`` (default: the exec's own)."""
        with self._lock:
            self._check_open()
            self.device.make_current()
            self._upload(stream)

    def _upload(self, stream) -> None:
        if stream is None:
            cu(self._api.cuGraphUpload, self._state.exec, self._sh)
            self._own_pending = True
        else:
            s = self._api.check_stream(stream, "GraphExec.upload")
            cu(self._api.cuGraphUpload, self._state.exec, s.handle)
            self._state.streams[id(s)] = s

    def launch(self, stream: Stream | None = None, *, sync: bool = False):
        """``cuGraphLaunch`` on ``stream`` (default: the exec's own non-blocking stream).

        With ``sync=True`` waits and returns what `synchronize` returns. Launches of one exec
        run one after the other, in launch order, whatever the streams.
        """
        with self._lock:
            self._check_open()
            if getattr(_tls, "ctx", None) != self._ctx_key:  # another host thread
                self.device.make_current()
            return self._launch(stream, sync)

    def _launch(self, stream, sync):
        tracer = self._tracer
        if stream is None:
            if tracer is not None:
                tracer.mark_launch(self.stream)
                self._pending_timeline = True
            (err,) = self._graph_launch(self._exec, self._sh)
            if err:
                self._launch_error(err)
            self._own_pending = True
        else:
            s = self._api.check_stream(stream, "GraphExec.launch")
            if tracer is not None:
                tracer.mark_launch(s)
                self._pending_timeline = True
            (err,) = self._graph_launch(self._exec, s.handle)
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
            if getattr(_tls, "ctx", None) != self._ctx_key:  # another host thread
                self.device.make_current()
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
        state = self._state
        if len(state.keep) > 1 or state.retired:  # earlier builds, arrays unbound meanwhile
            release_keep([b.keeps for b in state.keep[:-1]] + state.retired)
            del state.keep[:-1]
            state.retired.clear()
        table = self._table
        if CLOSE_EPOCH[0] != self._close_epoch or table.held > table.HELD_MAX:
            self._close_epoch = CLOSE_EPOCH[0]  # a leased object was closed somewhere
            table.sweep()  # unused leases on closed owners end (nothing is pending)
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

    # -- debugging ------------------------------------------------------------------------------

    def dot(self, path, *, verbose: bool = False) -> str:
        """Write the graph as DOT with ``cuGraphDebugDotPrint`` (``verbose``: node parameters
        too); returns the path."""
        import os

        with self._lock:
            self._check_open()
            path = os.fspath(path)
            flags = int(_d.CUgraphDebugDot_flags.CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE) if verbose else 0
            cu(self._api.cuGraphDebugDotPrint, self._built.cugraph, path.encode(), flags)
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
            try:
                self._finalizer()
            finally:
                self._drop_references()

    def _drop_references(self) -> None:
        """After the release: forget everything the graph referred to, so bound arrays,
        buffers, packed structs, records, callbacks and the tracer can be collected while the
        closed exec object lives."""
        self._built = None  # type: ignore[assignment]
        self._records = {}
        self._table = None  # type: ignore[assignment]
        self._host = {}
        self._kernels = {}
        self._rebinds = {}
        self._callbacks = None
        self._tracer = None
        self._inst_nodes = []
        self._rebuild = None
        self._exec = None
        self._host_errors = []
        self.taskgraph = None
        self.plan = None
        self.timeline = None

    def __repr__(self) -> str:
        if self._closed:
            return "<GraphExec closed>"
        return (f"<GraphExec {self.executor}: {self.node_count} nodes, {self.launches} launches"
                f" on device {self.device.ordinal}>")


__all__ = ["AUTO_FREE_ON_LAUNCH", "GraphExec", "UpdateResult"]

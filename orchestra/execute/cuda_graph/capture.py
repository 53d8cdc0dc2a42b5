"""The capture executor: a plan enqueued inside one stream capture becomes a CUDA graph.

    with CaptureExecutor(mode="thread-local") as ex:
        exe = ex.build(graph, bindings={...})      # a GraphExec (see graph_exec)
        exe.launch(sync=True)

How a plan is captured (`capture_plan.capture_steps`, checked by `check_capture_steps` before
anything is enqueued):

1. checks, all before the capture: graph and plan structure, hazards (``verify``), the
   graph-memory policy, kernels compiled and arguments packed, bindings resolved, streams and
   sync-only events taken from the executor's pools, the default memory pool configured at
   executor setup (no pool attribute is touched during a capture), tracer events created;
2. ``cuStreamBeginCapture(origin, mode)`` on the executor's origin stream (not a plan stream);
   ``mode`` is ``thread-local`` by default (another thread's CUDA calls cannot invalidate it),
   ``global`` or ``relaxed`` on request;
3. fork: one event recorded on the origin, every plan stream waits for it;
4. the plan's steps in ``plan.issue_order()``, one driver call per node, as the eager executor
   makes them (its own table here): ``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync`` become
   memory nodes, copies go through ``cuMemcpy3DAsync`` with the node's own ``CUDA_MEMCPY3D``
   record (the very struct replays later rewrite), kernels ``cuLaunchKernel`` /
   ``cuLaunchKernelEx``, memsets ``cuMemsetD8/16/32Async``, host functions
   ``cuLaunchHostFunc`` (the driver's own entry point, `hostfunc.launch_host_func`: cuda-bindings'
   wrapper would capture a one-shot record that the first launch frees), plan events
   ``cuEventRecord`` / ``cuStreamWaitEvent``. After each node,
   ``cuStreamGetCaptureInfo`` on its stream returns the stream's dependency set, which is then
   exactly the node just captured: that ``CUgraphNode`` is what replays update;
5. join: every plan stream records an event the origin waits for; then each stream's capture
   status is checked (ACTIVE, nothing added since its join), and ``cuStreamEndCapture(origin)``.

If anything fails on the way (a driver call refused, an illegal call made during the capture
such as a stream query or synchronize, which invalidates the capture), the executor joins
what it can, ends the capture on the origin, destroys whatever graph came back, checks that every
stream has left capture mode, and raises `CaptureError` naming the failing call and the node
being captured. Nothing leaks: streams and events are the executor's pooled ones, graph
allocations die with the discarded graph. An eager run of the same graph works afterwards.

The begin / fork / join / end discipline itself is the driver layer's `CaptureSession`
(`orchestra.driver.capture`), which hand-made captures use too.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

from cuda.bindings import driver as _d

from orchestra.compiler.launch import build_launch_config
from orchestra.driver import Event, Stream, cu
from orchestra.driver.capture import (
    MODES,
    CaptureSession,
    UnjoinedStreamError,
    capture_mode,
    capture_status,
    is_capturing,
)
from orchestra.driver.check import error_from_result
from orchestra.driver.device import context_alive
from orchestra.errors import CudaError, OrchestraError
from orchestra.execute.cuda_graph.capture_plan import capture_steps, check_capture_steps
from orchestra.execute.errors import ExecutorArgumentTypeError
from orchestra.execute.cuda_graph.exec import BuiltGraph, NodeRecord
from orchestra.execute.cuda_graph.executor import (
    GraphExecutorBase,
    kernel_params,
    memcpy_params,
    memset_params,
)
from orchestra.execute.cuda_graph.spec import check_findings, check_graph_memory
from orchestra.driver.entry_points import launch_host_func
from orchestra.execute.hostfunc import HostCallbacks
from orchestra.execute.prepare import assign_event_slots, check_run
from orchestra.execute.resources import MEMSET_ASYNC, StreamPool
from orchestra.graph import Node, TaskGraph
from orchestra.schedule import RecordEvent, RunNode, verify

_CS = _d.CUstreamCaptureStatus
_ACTIVE = _CS.CU_STREAM_CAPTURE_STATUS_ACTIVE
_NONE = _CS.CU_STREAM_CAPTURE_STATUS_NONE

_memset = MEMSET_ASYNC


class CaptureError(CudaError):
    """A stream capture failed. Every stream has left capture mode and the partial graph was
    discarded (``still_capturing`` lists streams the driver still reports capturing: empty
    unless the driver refused to end the capture).

    Attributes (besides `CudaError`'s ``call``, ``code``, ``name``, ``message``): ``node`` (the
    orchestra node being captured when it failed, or None), ``stream`` (its plan stream)."""

    def __init__(self, call: str, code: int, name: str, message: str = "", context: str = "",
                 node: str | None = None, stream: str | None = None, still_capturing=()):
        self.node = node
        self.stream = stream
        self.still_capturing = tuple(still_capturing)
        super().__init__(call, code, name, message, context)

    def with_context(self, context: str) -> "CaptureError":
        return type(self)(self.call, self.code, self.name, self.message, context, self.node,
                          self.stream, self.still_capturing)

    def __reduce__(self):
        return (type(self), (self.call, self.code, self.name, self.message, self.context,
                             self.node, self.stream, self.still_capturing))


def _shutdown(pool: StreamPool) -> None:
    if context_alive(pool.device.ordinal):
        pool.synchronize()
    pool.release()


class CaptureExecutor(GraphExecutorBase):
    """Captures plans into CUDA graphs (see the module doc).

    Args:
        device: a `Device`, an ordinal or None (device 0).
        mode: ``"thread-local"`` (default), ``"global"`` or ``"relaxed"``.
        verify: run the hazard verifier before capturing (`HazardError`).
        kernel_resolver: a shared `KernelResolver`.
        auto_free: the opt-in to allocations the graph does not free (see `GraphExecutorBase.build`).

    ``build(graph, plan=None, bindings, *, policy, streams, trace, hook=None, ...)``:
    ``hook(stream, node)``, when given, is called right after each node is captured (a test
    seam: a test injects an illegal stream query there). Streams (one per plan `StreamSpec`, by priority),
    the origin stream and sync-only events are pooled and reused by every capture; one capture
    at a time per executor.
    """

    executor_name = "capture"

    def __init__(self, device=None, *, mode="thread-local", verify: bool = True,
                 kernel_resolver=None, auto_free: bool = False):
        super().__init__(device, verify=verify, kernel_resolver=kernel_resolver,
                         auto_free=auto_free)
        self.mode = capture_mode(mode)
        self._lock = threading.RLock()
        self._pool = StreamPool(self.device, Stream, Event)
        self._origin = Stream(self.device)
        self._pool.streams.append(self._origin)
        self._finalizer = weakref.finalize(self, _shutdown, self._pool)
        self._finalizer.atexit = False
        self.captures = 0

    @property
    def origin(self) -> Stream:
        """The stream every capture begins and ends on."""
        return self._origin

    def _drop_stream(self, s: Stream) -> None:
        """A stream the driver still reports capturing after a failed capture: never reuse."""
        for pool in self._pool.by_priority.values():
            if s in pool:
                pool.remove(s)

    # -- capturing ----------------------------------------------------------------------------

    def _build_graph(self, graph: TaskGraph, plan, bindings, *, trace: bool, policy: str,
                     streams: int, costs, auto_free: bool, hook: Callable | None = None,
                     mode=None) -> BuiltGraph:
        with self._lock:
            self._check_open()
            return self._capture(graph, plan, bindings, trace, policy, streams, costs,
                                 auto_free, hook, capture_mode(mode) if mode else self.mode)

    def _capture(self, graph, plan, bindings, trace, policy, streams, costs, auto_free, hook,
                 mode) -> BuiltGraph:
        t0 = time.perf_counter_ns()
        if not isinstance(graph, TaskGraph):
            raise ExecutorArgumentTypeError(
                f"capture takes a TaskGraph, got {type(graph).__name__}")
        plan = self._plan(graph, plan, policy, streams, costs, need=True)
        issue = check_run(plan, graph, verify=False)  # structure, issue order, alloc order
        unfreed = check_graph_memory(graph, auto_free=auto_free)
        if self.verify:
            check_findings(verify(plan, graph), auto_free=auto_free)
        check_capture_steps(capture_steps(plan, issue))  # every stream forked and joined
        self._check_devices(graph)
        kargs = self._resolve_kernels(graph)
        built, resolved = self._new_built(None, graph, plan, bindings)
        dev = self.device
        dev.make_current()
        sm = self._pool.take_streams(plan)
        slots, nslots = assign_event_slots(issue)
        events = [self._pool.event(i).handle for i in range(nslots)]
        fork_join = (self._pool.event(nslots), self._pool.event(nslots + 1))
        tracer = None
        if trace:
            from orchestra.trace import GraphTracer

            tracer = GraphTracer(dev, executor="capture")
            for _ in range(2 * len(graph)):  # create the events now, not during the capture
                tracer.pool.take()
            tracer.begin(sm, policy=plan.policy, meta={"nodes": len(graph)})
            built.tracer = tracer
        hostfn = None
        if any(n.kind == "host" for n in graph.nodes):
            built.callbacks = HostCallbacks()
            hostfn = built.callbacks.address  # the trampoline's C address (an int)
        addr = {name: b.address for name, b in resolved.device.items()}
        haddr = {name: b.address for name, b in resolved.host.items()}
        dptrs: dict[str, object] = {}
        alloc_of: dict[str, int] = {}
        ordered = [(name, sm[name]) for name in plan.stream_names]
        names = [n for n, _ in ordered]
        session = CaptureSession(self._origin, mode, events=fork_join)
        current: tuple[Node | None, Any] | None = None  # (node being captured, its stream)
        try:
            session.begin()
            session.fork(*(s for _, s in ordered), names=names)
            for i, (sname, step) in enumerate(issue):
                s = sm[sname]
                if isinstance(step, RunNode):
                    node = graph.node(step.node)
                    current = (node, sname)
                    if tracer is not None:
                        tracer.before(sname, node)
                    self._enqueue(node, s, built, addr, haddr, kargs, hostfn, dptrs, alloc_of)
                    if tracer is not None:
                        tracer.after(sname, node)
                    if hook is not None:
                        hook(s, node)
                elif i in slots:
                    ev = events[slots[i]]
                    if isinstance(step, RecordEvent):
                        (err,) = _d.cuEventRecord(ev, s.handle)
                        call = "cuEventRecord"
                    else:
                        (err,) = _d.cuStreamWaitEvent(s.handle, ev, 0)
                        call = "cuStreamWaitEvent"
                    if err:
                        current = (None, sname)
                        raise error_from_result(call, err, context=f"event {step.event}")
            current = None
            session.join(*(s for _, s in ordered), names=names)
            built.cugraph = session.end()
        except BaseException as exc:
            left = session.abort()
            for _, s in left:
                self._drop_stream(s)
            if tracer is not None:
                tracer.abort()
                tracer.close()
            self.captures += 1
            raise self._capture_error(exc, current, left) from exc
        self.captures += 1
        built.unfreed = [alloc_of[a] for a, _ in unfreed]
        built.build_ms = (time.perf_counter_ns() - t0) / 1e6
        return built

    @staticmethod
    def _capture_error(exc, current, left):
        node, sname = current if current else (None, None)
        where = (f"while capturing node {node.name} ({node.kind}) on stream {sname}"
                 if node is not None else
                 ("at an event step on stream " + sname if sname else "at the end of the capture"))
        cleanup = ("every stream left capture mode and the graph was discarded" if not left else
                   "the driver still reports stream(s) " + ", ".join(n for n, _ in left)
                   + " capturing (they are not reused)")
        if isinstance(exc, UnjoinedStreamError):
            return exc
        if isinstance(exc, CudaError):
            return CaptureError(exc.call, exc.code, exc.name, exc.message,
                                f"stream capture failed {where}"
                                + (f" ({exc.context})" if exc.context else "") + f"; {cleanup}",
                                node.name if node is not None else None, sname,
                                [n for n, _ in left])
        exc.add_note(f"stream capture failed {where}; {cleanup}")
        return exc

    def _enqueue(self, node, s: Stream, built, addr, haddr, kargs, hostfn, dptrs, alloc_of):
        """One node, one driver call (plus ``cuStreamGetCaptureInfo`` for its graph node)."""
        sh = s.handle
        kind = node.kind
        params = None
        if kind == "alloc":
            err, dptr = _d.cuMemAllocFromPoolAsync(node.buffer.nbytes, self.pool.handle, sh)
            call = "cuMemAllocFromPoolAsync"
            if not err:
                b = node.buffer.name
                addr[b] = int(dptr)
                dptrs[b] = dptr
                built.allocs[b] = int(dptr)
                alloc_of[node.name] = int(dptr)
            ckind = "mem_alloc"
        elif kind == "free":
            (err,) = _d.cuMemFreeAsync(dptrs.pop(node.buffer.name), sh)
            call, ckind = "cuMemFreeAsync", "mem_free"
        elif kind in ("h2d", "d2h"):
            if kind == "h2d":
                hname, dname = node.src.buffer.name, node.dst.buffer.name
            else:
                hname, dname = node.dst.buffer.name, node.src.buffer.name
            params, field, off = memcpy_params(node, haddr[hname], addr[dname])
            (err,) = _d.cuMemcpy3DAsync(params, sh)
            call, ckind = "cuMemcpy3DAsync", "memcpy"
        elif kind == "kernel":
            ka = kargs[node.name]
            ka.bind(addr)
            cfg = ka.config
            if ka.needs_ex:
                (err,) = _d.cuLaunchKernelEx(build_launch_config(cfg, sh), ka.kernel.function,
                                             ka.packed.address, 0)
                call = "cuLaunchKernelEx"
            else:
                (gx, gy, gz), (bx, by, bz) = cfg.grid, cfg.block
                (err,) = _d.cuLaunchKernel(ka.kernel.function, gx, gy, gz, bx, by, bz,
                                           cfg.shared_mem, sh, ka.packed.address, 0)
                call = "cuLaunchKernel"
            params = kernel_params(ka)
            built.kernels[node.name] = ka
            ckind = "kernel"
        elif kind == "memset":
            es = node.element_size
            fn = _memset[es]
            (err,) = fn(addr[node.dst.buffer.name] + node.dst.offset, node.unsigned_value,
                        node.dst.nbytes // es, sh)
            call, ckind = fn.__name__, "memset"
            params = memset_params(node, addr[node.dst.buffer.name])
        elif kind == "host":
            token = built.callbacks.add(node.fn, node.name)
            # the driver's entry point, not cuda-bindings' wrapper: that one enqueues a
            # one-shot record the first graph launch frees (see hostfunc)
            err = launch_host_func(_d, sh, hostfn, token)
            call, ckind = "cuLaunchHostFunc", "host"
        else:
            raise OrchestraError(f"node {node.name}: the capture executor cannot run node kind "
                                 f"{kind!r} ({type(node).__name__})")
        if err:
            raise error_from_result(call, err)
        status, deps = capture_status(s)
        if status != _ACTIVE:
            raise error_from_result(call, int(_d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
                                    context="the capture was invalidated")
        if len(deps) != 1:
            raise OrchestraError(
                f"capture of node {node.name}: expected the stream's dependency set to be the "
                f"one node just captured, found {len(deps)} nodes")
        rec = built.add(NodeRecord(node.name, ckind, deps[0], params))
        if kind in ("h2d", "d2h"):
            built.host_users[hname].append((rec, field, off))
        return rec

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def streams(self) -> tuple[Stream, ...]:
        """Every stream the executor created (the origin first)."""
        return tuple(self._pool.streams)

    def close(self) -> None:
        """Synchronize and release the pooled streams and events (idempotent). Execs already
        built keep working."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer()

    def __repr__(self) -> str:
        return (f"<CaptureExecutor on device {self.device.ordinal}: {self.captures} captures, "
                f"{len(self._pool.streams)} streams>")


__all__ = ["CaptureError", "CaptureExecutor", "CaptureSession", "MODES", "capture_mode",
           "capture_status", "is_capturing"]

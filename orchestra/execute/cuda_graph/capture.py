"""The capture executor: a plan enqueued inside one stream capture becomes a CUDA graph.

    with CaptureExecutor(mode="thread-local") as ex:
        exe = ex.build(graph, bindings={...})      # a GraphExec (see cuda_graph.exec)
        exe.launch(sync=True)

How a plan is captured (`capture_plan.capture_steps`, checked by `check_capture_steps` before
anything is enqueued):

1. checks, all before the capture (`ExecutorBase._checked`): graph and plan structure, the
   graph-memory policy, hazards (``verify``), every stream forked and joined, devices,
   kernels compiled and arguments packed; then bindings resolved, streams and sync-only
   events taken from the executor's pools (the default memory pool was configured at executor
   setup: no pool attribute is touched during a capture), tracer events created, and the
   plan lowered onto streams in capture mode (`lowering.stream.lower_plan`: the steps the
   eager executor runs, each node also recording its graph node's parameter struct);
2. ``cuStreamBeginCapture(origin, mode)`` on the executor's origin stream (not a plan stream)
   through a driver-level `CaptureSession`; ``mode`` is ``thread-local`` by default (another
   thread's CUDA calls cannot invalidate it), ``global`` or ``relaxed`` on request;
3. fork: one event recorded on the origin, every plan stream waits for it;
4. the steps in ``plan.issue_order()``, one driver call per node, made by the node's entry in
   the lowering table: ``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync`` become memory nodes,
   copies go through ``cuMemcpy3DAsync`` with the node's own ``CUDA_MEMCPY3D`` record (the very
   struct replays later rewrite), kernels ``cuLaunchKernel`` / ``cuLaunchKernelEx``, memsets
   ``cuMemsetD8/16/32Async``, host functions ``cuLaunchHostFunc`` (the driver's own entry
   point: cuda-bindings' wrapper would capture a one-shot record that the first launch frees),
   plan events ``cuEventRecord`` / ``cuStreamWaitEvent``; a node with bodies (a conditional
   node, a child graph) adds its node to the capturing graph and captures its bodies into the
   body graphs from a side stream (`lowering.bodies`). Before the first node, each node's
   entry makes what it needs on the capturing graph (``begin_graph``: conditional handles,
   which kernels before the conditional node take). After each node,
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

import time
from typing import Any, Callable

from cuda.bindings import driver as _d

from orchestra.driver.capture import (
    CaptureSession,
    UnjoinedStreamError,
    capture_mode,
    capture_status,
)
from orchestra.driver.check import error_from_result
from orchestra.errors import CudaError, OrchestraError
from orchestra.execute.bindings import release_keep
from orchestra.execute.cuda_graph.built import BuiltGraph
from orchestra.execute.cuda_graph.capture_plan import capture_steps, check_capture_steps
from orchestra.execute.cuda_graph.executor import GraphExecutorBase
from orchestra.execute.cuda_graph.spec import check_findings, check_graph_memory
from orchestra.execute.errors import ExecutorArgumentTypeError
from orchestra.execute.lowering import lowering_for
from orchestra.execute.lowering.bodies import begin_graph
from orchestra.execute.lowering.copy import copy_kernel_nodes
from orchestra.execute.lowering.stream import Addresses, StreamContext, lower_plan
from orchestra.execute.prepare import assign_event_slots, check_run
from orchestra.graph import Node, TaskGraph
from orchestra.schedule import verify

_ACTIVE = _d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


def _trace_meta(graph, resolved) -> dict:
    """A graph tracer's meta: the node count, and the copies lowered to copy kernels."""
    meta: dict = {"nodes": len(graph)}
    lowered = copy_kernel_nodes(resolved)
    if lowered:
        meta["lowered"] = lowered
    return meta


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


class CaptureExecutor(GraphExecutorBase):
    """Captures plans into CUDA graphs (see the module doc).

    Args:
        device: a `Device`, an ordinal or None (device 0).
        mode: ``"thread-local"`` (default), ``"global"`` or ``"relaxed"``.
        verify: run the hazard verifier before capturing (`HazardError`).
        kernel_resolver: a shared `KernelResolver`.
        auto_free: the opt-in to allocations the graph does not free (see
            `GraphExecutorBase.build`).
        driver: the `DriverAPI` every driver call goes through (default: the process's).
        copy_lowering: how host copies are captured (see `GraphExecutorBase.build`): a copy
            kernel is captured as a kernel node.

    ``build(graph, plan=None, bindings, *, policy, streams, trace, hook=None, ...)``:
    ``hook(stream, node)``, when given, is called right after each node is captured (a test
    seam: a test injects an illegal stream query there). Streams (one per plan `StreamSpec`, by priority),
    the origin stream and sync-only events are pooled and reused by every capture; one capture
    at a time per executor.

    Thread-safety: may be shared between threads: every capture holds the executor's lock (one
    capture at a time: the pooled streams and events are reused by every capture), so builds from
    several threads serialize. Captures use the ``thread-local`` mode by default, so other threads'
    CUDA calls cannot invalidate one. The `GraphExec` objects it returns are thread-safe.
    """

    executor_name = "capture"

    def __init__(self, device=None, *, mode="thread-local", verify: bool = True,
                 kernel_resolver=None, auto_free: bool = False, driver=None,
                 copy_lowering="auto"):
        super().__init__(device, verify=verify, kernel_resolver=kernel_resolver,
                         auto_free=auto_free, driver=driver, copy_lowering=copy_lowering)
        self.mode = capture_mode(mode)
        self._origin = self.api.stream(self.device)
        self._stream_pool.streams.append(self._origin)
        self.captures = 0

    @property
    def origin(self):
        """The stream every capture begins and ends on."""
        return self._origin

    # -- checks -------------------------------------------------------------------------------

    def _plan_checks(self, graph, plan, *, auto_free: bool, copies=None):
        """Structure, issue order and allocation order (`check_run` without hazards), the
        graph-memory policy, the hazard verifier (unless ``verify=False``; NEVER_FREED
        findings left out under ``auto_free``), every stream forked and joined. Returns
        ``(issue, unfreed)``."""
        issue = check_run(plan, graph, verify=False)
        unfreed = check_graph_memory(graph, auto_free=auto_free)
        if self.verify:
            check_findings(verify(plan, graph), auto_free=auto_free)
        check_capture_steps(capture_steps(plan, issue))
        return issue, unfreed

    # -- capturing ----------------------------------------------------------------------------

    def _build_graph(self, graph: TaskGraph, plan, bindings, *, trace: bool, policy: str,
                     streams: int, costs, auto_free: bool, copies=None,
                     hook: Callable | None = None, mode=None) -> BuiltGraph:
        with self._lock:
            self._check_open()
            return self._capture(graph, plan, bindings, trace, policy, streams, costs,
                                 auto_free, hook, capture_mode(mode) if mode else self.mode,
                                 copies if copies is not None else self.copy_policy())

    def _capture(self, graph, plan, bindings, trace, policy, streams, costs, auto_free, hook,
                 mode, copies) -> BuiltGraph:
        t0 = time.perf_counter_ns()
        if not isinstance(graph, TaskGraph):
            raise ExecutorArgumentTypeError(
                f"capture takes a TaskGraph, got {type(graph).__name__}")
        plan = self._plan(graph, plan, policy, streams, costs, need=True)
        (issue, unfreed), resolved = self._checked(graph, plan, auto_free=auto_free,
                                                   copies=copies)
        modules = self._lease_modules(resolved)
        try:
            table = self._bindings(graph, bindings)
        except BaseException:
            release_keep(modules)
            raise
        built = BuiltGraph(None, graph, plan, self.executor_name, table)
        built.leases = modules
        try:
            return self._record(built, graph, plan, issue, unfreed, resolved, trace, hook, mode,
                                t0, copies)
        except BaseException:
            release_keep(built.keeps)  # nothing captured ever ran
            raise

    def _record(self, built, graph, plan, issue, unfreed, resolved, trace, hook, mode,
                t0, copies=None) -> BuiltGraph:
        """Lower the plan and capture it into ``built`` (steps 2-5 of the module doc)."""
        table = built.bindings
        dev = self.device
        dev.make_current()
        pool = self._stream_pool
        sm = pool.take_streams(plan, self.stream_devices(plan))
        slots, nslots = assign_event_slots(issue)
        events = [pool.event(i).handle for i in range(nslots)]
        fork_join = (pool.event(nslots), pool.event(nslots + 1))
        addresses = Addresses(table, slot_users=False)
        addresses.fill(table)
        ctx = StreamContext(self.api, self.executor_name, addresses, resolved, self.pool.handle,
                            dev, built=built, bindings=table, copies=copies,
                            side_streams=pool.side)
        program = lower_plan(issue, graph, ctx, sm, events, slots)
        tracer = None
        if trace:
            from orchestra.trace import GraphTracer

            tracer = GraphTracer(dev, executor="capture")
            for _ in range(2 * len(graph)):  # create the events now, not during the capture
                tracer.pool.take()
            tracer.begin(sm, policy=plan.policy, meta=_trace_meta(graph, resolved))
            built.tracer = tracer
        ordered = [(name, sm[name]) for name in plan.stream_names]
        names = [n for n, _ in ordered]
        records = built.records
        api = self.api
        session = CaptureSession(self._origin, mode, events=fork_join, api=api)
        current: tuple[Node | None, Any] | None = None  # (node being captured, its stream)
        try:
            session.begin()
            begin_graph(graph.nodes, ctx, session.capturing_graph())
            session.fork(*(s for _, s in ordered), names=names)
            for step, where, s, site in zip(program.steps, program.nodes, program.streams,
                                            program.sites):
                if where is None:  # an event record or wait
                    current = (None, site[0])
                    try:
                        step()
                    except CudaError as exc:
                        raise exc.with_context(f"event {site[1]}") from exc
                    continue
                sname, node = where
                current = (node, sname)
                if tracer is not None:
                    tracer.before(sname, node)
                step()
                status, deps = capture_status(s, api)
                if status != _ACTIVE:
                    raise error_from_result(
                        "cuStreamGetCaptureInfo",
                        int(_d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
                        context="the capture was invalidated")
                if lowering_for(node).captures_one_node:
                    if len(deps) != 1:
                        raise OrchestraError(
                            f"capture of node {node.name}: expected the stream's dependency "
                            f"set to be the one node just captured, found {len(deps)} nodes")
                    records[node.name].gnode = deps[0]
                # else: a library call (NCCL) that captured any number of nodes (none for a
                # one-rank all-reduce in place); replays never rewrite them: no node recorded
                if tracer is not None:
                    tracer.after(sname, node)
                if hook is not None:
                    hook(s, node)
            current = None
            session.join(*(s for _, s in ordered), names=names)
            built.cugraph = session.end()
        except BaseException as exc:
            left = session.abort()
            for _, s in left:
                pool.drop(s)
            if tracer is not None:
                tracer.abort()
                tracer.close()
            self.captures += 1
            raise self._capture_error(exc, current, left) from exc
        self.captures += 1
        for buffer, address in ctx.allocations.values():
            built.allocs[buffer] = address
        built.unfreed = [ctx.allocations[a][1] for a, _ in unfreed]
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

    def __repr__(self) -> str:
        return (f"<CaptureExecutor on device {self.device.ordinal}: {self.captures} captures, "
                f"{len(self._stream_pool.streams)} streams>")


__all__ = ["CaptureError", "CaptureExecutor"]

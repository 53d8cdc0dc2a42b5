"""The eager executor: enqueue a plan's steps onto non-blocking streams, one driver call each.

    with EagerExecutor() as ex:
        result = ex.run(graph, bindings={"host_in": pinned_in, "host_out": pinned_out})

For each (graph, plan) the executor *prepares* once (cached by identity): checks (`prepare`),
kernel resolution and argument packing (`kernels`, `kernel_args`), streams and events from its
pools, and one small closure per step that makes exactly one driver call:

    Alloc       cuMemAllocFromPoolAsync   (device's default pool, release threshold UINT64_MAX)
    HostToDevice cuMemcpyHtoDAsync        (pinned host memory only, see `bindings`)
    Kernel      cuLaunchKernel            (cuLaunchKernelEx with launch attributes)
    DeviceToHost cuMemcpyDtoHAsync
    Free        cuMemFreeAsync
    Memset      cuMemsetD8/D16/D32Async
    HostFunc    cuLaunchHostFunc          (one C trampoline per executor, see `hostfunc`)
    RecordEvent cuEventRecord / WaitEvent cuStreamWaitEvent (sync-only events)

A run then resolves its bindings, fills the address tables the closures read, and calls the
closures in ``plan.issue_order()``. Nothing goes to the legacy default stream. Streams (one per
plan `StreamSpec`, with its priority) and events (``CU_EVENT_DISABLE_TIMING``) are pooled by the
executor and reused by every run and every plan; `close()` (or ``with``, or the finalizer)
synchronizes them and releases them.

If a driver call fails part-way, the executor synchronizes what was enqueued, frees every
allocation the run made, and re-raises the `CudaError` naming the node (``err.context``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any, Mapping

import attrs
from cuda.bindings import driver as _d

from orchestra.driver import Device, Event, MemoryPool, Stream
from orchestra.driver.check import error_from_result
from orchestra.driver.device import as_device, context_alive
from orchestra.errors import CallOrderError, CudaError, OrchestraError
from orchestra.execute.bindings import BindingSpec, PinnedCheck
from orchestra.execute.closable import Closable
from orchestra.execute.errors import ExecutorArgumentTypeError, HostFunctionError
from orchestra.execute.hostfunc import HostCallbacks
from orchestra.execute.kernel_args import resolve_kernel_node
from orchestra.execute.kernels import KernelResolver
from orchestra.execute.occupancy import capacity_for
from orchestra.execute.prepare import assign_event_slots, check_run
from orchestra.execute.resources import MEMSET_ASYNC, PlanCache, StreamPool
from orchestra.graph import KernelNode, TaskGraph
from orchestra.schedule import Plan, RecordEvent, RunNode

log = logging.getLogger(__name__)

_alloc = _d.cuMemAllocFromPoolAsync
_free = _d.cuMemFreeAsync
_htod = _d.cuMemcpyHtoDAsync
_dtoh = _d.cuMemcpyDtoHAsync
_launch = _d.cuLaunchKernel
_record = _d.cuEventRecord
_wait = _d.cuStreamWaitEvent
_hostfn = _d.cuLaunchHostFunc
_memset = MEMSET_ASYNC


@attrs.frozen
class RunResult:
    """What one run measured.

    Attributes:
        wall_ms: host clock (``perf_counter``) from the first enqueue to the end of the final
            synchronize; None for a run with ``sync=False`` until `EagerExecutor.synchronize`.
        enqueue_us: host time spent enqueueing every step (µs).
        nodes: graph nodes run. steps: driver calls made (nodes + event records + waits).
        events: event records; waits: stream waits; streams: streams used.
        policy: the plan's policy. prepare_ms: time spent preparing this (graph, plan) in this
            call (checks, kernel resolution, closures); 0.0 when it came from the cache.
        timeline: what the tracer's ``finish()`` returned (None without a tracer).
    """

    wall_ms: float | None
    enqueue_us: float
    nodes: int
    steps: int
    events: int
    waits: int
    streams: int
    policy: str
    prepare_ms: float = 0.0
    timeline: Any = None

    @property
    def host_us_per_node(self) -> float:
        """Host enqueue time per graph node (µs): the executor's overhead per node."""
        return self.enqueue_us / self.nodes if self.nodes else 0.0

    def as_dict(self) -> dict:
        d = attrs.asdict(self, filter=lambda a, v: a.name != "timeline")
        d["host_us_per_node"] = self.host_us_per_node
        return d


class _Prepared:
    """One (graph, plan), ready to run: closures, address tables, streams, bookkeeping."""

    def __init__(self, graph, plan):
        self.graph = graph  # strong references keep the cache key's ids unique
        self.plan = plan
        self.spec = BindingSpec(graph)
        self.steps: list = []
        self.labels: list[str] = []
        self.trace_nodes: list = []  # per step: (stream name, node) for RunNode steps, else None
        self.streams: dict[str, Stream] = {}
        self.ptrs: list[int] = []  # device address per buffer slot
        self.objs: list = []  # CUdeviceptr per allocation slot (None when not allocated)
        self.alloc_stream: list = []  # per slot: CUstream handle that allocated it (None: external)
        self.alloc_slots: list[int] = []
        self.external: dict[str, int] = {}  # external device buffer name -> slot
        self.hptrs: list[int] = []
        self.host_slots: dict[str, int] = {}
        self.tokens: list[int] = []
        self.kernel_args: dict[str, Any] = {}
        self.live_at_end: dict[int, str] = {}  # alloc slots no Free of the plan releases
        self.unfreed = False
        self.nodes = 0
        self.events = 0
        self.waits = 0
        self.prepare_ms = 0.0


@attrs.define
class _Pending:
    prepared: _Prepared
    keep: Any  # the resolved bindings: host arrays stay alive until the run is synchronized
    tracer: Any
    t0: int
    enqueue_us: float
    prepare_ms: float


def _shutdown(pool: StreamPool, callbacks: HostCallbacks, tracers: list) -> None:
    """Finalizer / close(): wait for pending work (host functions may still call the
    trampoline), then release the pooled streams, events and the ``trace=True`` tracer's
    timing events."""
    if context_alive(pool.device.ordinal):
        pool.synchronize()
    for t in tracers:
        t.close()
    tracers.clear()
    pool.release()
    del callbacks  # the trampoline may go only after the synchronize above


class EagerExecutor(Closable):
    """Runs task graphs by enqueueing their plans onto pooled non-blocking streams.

    Args:
        device: a `Device`, an ordinal or None (device 0). Every node must be on this device.
        verify: run the hazard verifier (``schedule.check``) before a plan's first run; a plan
            with hazards raises `HazardError` and nothing is enqueued.
        kernel_resolver: a shared `KernelResolver` (default: a new one for ``device``).
        cache_size: how many prepared (graph, plan) pairs to keep.

    One run at a time per executor (``run`` holds a lock); create one executor per host thread
    for concurrent submission.
    """

    def __init__(self, device: Device | int | None = None, *, verify: bool = True,
                 kernel_resolver: KernelResolver | None = None, cache_size: int = 16):
        self.device = as_device(device)
        self.verify = bool(verify)
        self.kernels = (kernel_resolver if kernel_resolver is not None
                        else KernelResolver(self.device))
        self.cache_size = max(1, int(cache_size))
        self.device.make_current()
        self.pool = MemoryPool.default(self.device)  # release threshold set once, at setup
        self._pinned = PinnedCheck()
        self._callbacks = HostCallbacks()
        self._hostfn_ptr = _d.CUhostFn(self._callbacks.address)
        self._pool = StreamPool(self.device, Stream, Event)
        self._tracers: list = []  # the EagerTracer trace=True uses (created on first use)
        self._prepared: collections.OrderedDict = collections.OrderedDict()
        self._plans = PlanCache()
        self._pending: list[_Pending] = []
        self._lock = threading.RLock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._pool, self._callbacks,
                                           self._tracers)
        self._finalizer.atexit = False

    # -- pools ------------------------------------------------------------------------------

    @property
    def streams(self) -> tuple[Stream, ...]:
        """Every stream the executor has created (pooled, reused by every plan)."""
        return tuple(self._pool.streams)

    @property
    def event_count(self) -> int:
        """Sync-only events the executor has created (pooled)."""
        return len(self._pool.events)

    @property
    def tracer(self):
        """The `orchestra.trace.EagerTracer` that ``run(..., trace=True)`` uses: created on
        first use, kept (its timing events are reused by every traced run), closed with the
        executor."""
        if not self._tracers:
            from orchestra.trace import EagerTracer

            self._tracers.append(EagerTracer(self.device, executor="eager"))
        return self._tracers[0]

    # -- planning and preparation -----------------------------------------------------------

    def plan_for(self, graph: TaskGraph, policy: str = "by-engine", streams: int = 3,
                 costs=None) -> Plan:
        """``schedule(graph, policy, streams, costs)``, cached for the same graph object
        (``concurrent``: with each kernel's resident capacity, `occupancy`)."""
        return self._plans.get(graph, policy, streams, costs, self.cache_size,
                               capacity_for(policy, self.kernels, self.device))

    def prepare(self, graph: TaskGraph, plan: Plan | None = None, *, policy: str = "by-engine",
                streams: int = 3, costs=None) -> Plan:
        """Check and prepare (graph, plan) now, so the first `run` enqueues at full speed.
        Returns the plan (scheduled here when None). Raises what `run` raises before enqueueing."""
        with self._lock:
            self._check_open()
            plan = plan if plan is not None else self.plan_for(graph, policy, streams, costs)
            self._get_prepared(graph, plan)
            return plan

    def _get_prepared(self, graph, plan) -> tuple[_Prepared, float]:
        key = (id(graph), len(graph), id(plan))
        prep = self._prepared.get(key)
        if prep is not None and prep.graph is graph and prep.plan is plan:
            self._prepared.move_to_end(key)
            return prep, 0.0
        t0 = time.perf_counter_ns()
        prep = self._build(graph, plan)
        prep.prepare_ms = (time.perf_counter_ns() - t0) / 1e6
        self._prepared[key] = prep
        while len(self._prepared) > self.cache_size:
            _, old = self._prepared.popitem(last=False)
            if not self._pending:
                for t in old.tokens:
                    self._callbacks.remove(t)
        return prep, prep.prepare_ms

    def _build(self, graph: TaskGraph, plan: Plan) -> _Prepared:
        if not isinstance(graph, TaskGraph):
            raise ExecutorArgumentTypeError(
                f"run() takes a TaskGraph, got {type(graph).__name__}")
        if not isinstance(plan, Plan):
            raise ExecutorArgumentTypeError(
                f"plan must be a schedule.Plan, got {type(plan).__name__}")
        issue = check_run(plan, graph, verify=self.verify)
        ordinal = self.device.ordinal
        for node in graph.nodes:
            if node.kind != "host" and node.device != ordinal:
                raise OrchestraError(
                    f"node {node.name} is on device {node.device}, but this EagerExecutor runs on "
                    f"device {ordinal}; use one executor per device")
        prep = _Prepared(graph, plan)
        # Kernels first: compile errors, argument and launch-limit errors surface before any
        # stream or event is created.
        for node in graph.nodes:
            if isinstance(node, KernelNode):
                kernel = self.kernels.resolve(node.kernel, node.name)
                prep.kernel_args[node.name] = resolve_kernel_node(node, kernel)
        prep.streams = self._pool.take_streams(plan)
        for name in prep.spec.host:
            prep.host_slots[name] = len(prep.hptrs)
            prep.hptrs.append(0)
        current: dict[str, int] = {}
        for name in prep.spec.external:
            current[name] = prep.external[name] = len(prep.ptrs)
            prep.ptrs.append(0)
            prep.objs.append(None)
            prep.alloc_stream.append(None)
        slots, nslots = assign_event_slots(issue)
        events = [self._pool.event(i).handle for i in range(nslots)]
        for i, (sname, step) in enumerate(issue):
            stream = prep.streams[sname]
            if isinstance(step, RunNode):
                node = graph.node(step.node)
                fn = self._node_step(prep, node, stream, current)
                prep.trace_nodes.append((sname, node))
                prep.labels.append(f"node {node.name} ({node.kind}) on stream {sname}")
                prep.nodes += 1
            elif i in slots:
                ev = events[slots[i]]
                if isinstance(step, RecordEvent):
                    fn = _record_step(ev, stream.handle)
                    prep.events += 1
                    what = "record"
                else:
                    fn = _wait_step(stream.handle, ev)
                    prep.waits += 1
                    what = "wait for"
                prep.trace_nodes.append(None)
                prep.labels.append(f"{what} event {step.event} on stream {sname}")
            else:
                continue  # a wait for an event nothing records orders nothing
            prep.steps.append(fn)
        prep.unfreed = bool(prep.live_at_end)
        return prep

    def _node_step(self, prep: _Prepared, node, stream: Stream, current: dict[str, int]):
        sh = stream.handle
        ptrs, objs = prep.ptrs, prep.objs
        kind = node.kind
        if kind == "alloc":
            slot = current[node.buffer.name] = len(ptrs)
            ptrs.append(0)
            objs.append(None)
            prep.alloc_stream.append(sh)
            prep.alloc_slots.append(slot)
            prep.live_at_end[slot] = node.name
            return _alloc_step(node.buffer.nbytes, self.pool.handle, sh, slot, ptrs, objs)
        if kind == "free":
            slot = current[node.buffer.name]
            prep.live_at_end.pop(slot, None)
            return _free_step(sh, slot, ptrs, objs)
        if kind == "h2d":
            return _h2d_step(sh, current[node.dst.buffer.name], node.dst.offset,
                             prep.host_slots[node.src.buffer.name], node.src.offset, node.nbytes,
                             ptrs, prep.hptrs)
        if kind == "d2h":
            return _d2h_step(sh, prep.host_slots[node.dst.buffer.name], node.dst.offset,
                             current[node.src.buffer.name], node.src.offset, node.nbytes,
                             ptrs, prep.hptrs)
        if kind == "memset":
            es = node.element_size
            return _memset_step(_memset[es], sh, current[node.dst.buffer.name], node.dst.offset,
                                node.unsigned_value, node.dst.nbytes // es, ptrs)
        if kind == "kernel":
            ka = prep.kernel_args[node.name]
            patches = tuple((p.field, current[p.buffer], p.offset) for p in ka.pointers)
            if ka.needs_ex:
                return _kernel_ex_step(ka, stream, patches, ptrs)
            return _kernel_step(ka, sh, patches, ptrs)
        if kind == "host":
            token = self._callbacks.add(node.fn, node.name)
            prep.tokens.append(token)
            return _hostfn_step(sh, self._hostfn_ptr, token)
        raise OrchestraError(f"node {node.name}: the eager executor cannot run node kind "
                             f"{kind!r} ({type(node).__name__})")

    # -- running ----------------------------------------------------------------------------

    def run(self, graph: TaskGraph, plan: Plan | None = None,
            bindings: Mapping[str, Any] | None = None, *, policy: str = "by-engine",
            streams: int = 3, sync: bool = True, tracer=None, costs=None,
            trace: bool = False) -> RunResult:
        """Run ``graph`` with ``plan`` (default: ``schedule(graph, policy, streams, costs)``).

        ``bindings``: host buffer name -> pinned numpy array (see `bindings`), external device
        buffer name -> DeviceBuffer. ``sync=False`` returns after enqueueing (``wall_ms`` None):
        keep the bound arrays untouched until `synchronize()`. ``tracer``: an object with the
        `orchestra.trace.EventTimer` methods (``begin``, ``before``, ``after``, ``finish``,
        ``abort``), called around every node. ``trace=True`` (without ``tracer``) uses the
        executor's own `tracer` (an `EagerTracer`); either way `RunResult.timeline` is the
        run's `Timeline` (with ``sync=False``: the result `synchronize()` returns).

        Raises before enqueueing anything: `GraphError`, `PlanMismatchError`, `HazardError`
        (unless ``verify=False``), kernel errors (`CompileError`, ``TypeError``/``ValueError``
        for arguments and launch limits), `BindingError`, `PageableMemoryError`. While
        enqueueing: `CudaError` naming the node (its work so far is synchronized and its
        allocations freed). After the run: `HostFunctionError` if a host function raised.
        """
        with self._lock:
            self._check_open()
            plan = plan if plan is not None else self.plan_for(graph, policy, streams, costs)
            prep, prepare_ms = self._get_prepared(graph, plan)
            resolved = prep.spec.resolve(bindings, self._pinned)
            if trace and tracer is None:
                tracer = self.tracer
                if any(p.tracer is tracer for p in self._pending):
                    raise CallOrderError(
                        "a run traced with trace=True is still pending (sync=False); call "
                        "synchronize() before the next traced run, or pass tracer=EagerTracer()")
            for name, slot in prep.host_slots.items():
                prep.hptrs[slot] = resolved.host[name].address
            for name, slot in prep.external.items():
                prep.ptrs[slot] = resolved.device[name].address
            self.device.make_current()
            if tracer is not None:
                tracer.begin(prep.streams, policy=plan.policy,
                             meta={"executor": "eager", "device": self.device.ordinal})
            t0 = time.perf_counter_ns()
            self._enqueue(prep, tracer)
            t1 = time.perf_counter_ns()
            self._pending.append(_Pending(prep, resolved, tracer, t0, (t1 - t0) / 1e3,
                                          prepare_ms))
            if not sync:
                return self._result(prep, None, (t1 - t0) / 1e3, prepare_ms, None)
            return self._sync_pending()

    def _enqueue(self, prep: _Prepared, tracer) -> None:
        steps = prep.steps
        i = -1
        try:
            if tracer is None:
                for i, step in enumerate(steps):  # noqa: B007 - i names the failing step
                    step()
            else:
                trace_nodes = prep.trace_nodes
                for i, step in enumerate(steps):
                    tn = trace_nodes[i]
                    if tn is None:
                        step()
                    else:
                        tracer.before(tn[0], tn[1])
                        step()
                        tracer.after(tn[0], tn[1])
        except BaseException as exc:
            self._abort(prep, tracer)
            if isinstance(exc, CudaError) and 0 <= i < len(prep.labels):
                raise exc.with_context(prep.labels[i]) from exc
            if 0 <= i < len(prep.labels) and isinstance(exc, Exception):
                exc.add_note(f"while enqueueing {prep.labels[i]}")
            raise

    def _abort(self, prep: _Prepared, tracer) -> None:
        """A step failed: wait for what was enqueued, free the run's live allocations."""
        for s in prep.streams.values():
            try:
                s.synchronize()
            except CudaError:
                pass
        self._free_live(prep)
        if tracer is not None:
            try:
                tracer.abort()
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
        self._callbacks.take_errors()

    def _free_live(self, prep: _Prepared) -> None:
        touched = set()
        for slot in prep.alloc_slots:
            obj = prep.objs[slot]
            if obj is None:
                continue
            sh = prep.alloc_stream[slot]
            (err,) = _free(obj, sh)
            prep.objs[slot] = None
            prep.ptrs[slot] = 0
            if not err:
                touched.add(sh)
        for s in prep.streams.values():
            if s.handle in touched:
                try:
                    s.synchronize()
                except CudaError:
                    pass

    def synchronize(self) -> RunResult | None:
        """Wait for every run started with ``sync=False``; return the last one's `RunResult`
        (None when nothing was pending). Raises `HostFunctionError` if a host function raised,
        `CudaError` if the work failed."""
        with self._lock:
            if not self._pending:
                return None
            return self._sync_pending()

    def _sync_pending(self) -> RunResult:
        pending, self._pending = self._pending, []
        streams = {}
        for p in pending:
            for s in p.prepared.streams.values():
                streams[id(s)] = s
        try:
            for s in streams.values():
                s.synchronize()
        except CudaError:
            for p in pending:
                self._free_live(p.prepared)
                if p.tracer is not None:
                    p.tracer.abort()
            self._callbacks.take_errors()
            raise
        t2 = time.perf_counter_ns()
        for p in pending:
            if p.prepared.unfreed:
                self._free_live(p.prepared)  # only with verify=False: an Alloc without a Free
        errors = self._callbacks.take_errors()
        timelines = []
        for p in pending:
            if p.tracer is not None:
                if errors:
                    p.tracer.abort()
                else:
                    timelines.append(p.tracer.finish())
        if errors:
            node, exc = errors[0]
            raise HostFunctionError(node, exc, errors[1:]) from exc
        last = pending[-1]
        return self._result(last.prepared, (t2 - last.t0) / 1e6, last.enqueue_us,
                            last.prepare_ms, timelines[-1] if last.tracer is not None else None)

    def _result(self, prep, wall_ms, enqueue_us, prepare_ms, timeline) -> RunResult:
        log.debug("eager run: %d nodes on %d streams, %d events, %d waits: %d driver calls "
                  "enqueued (one per step), in %.0f us; wall %s ms", prep.nodes,
                  len(prep.streams), prep.events, prep.waits, len(prep.steps), enqueue_us,
                  "-" if wall_ms is None else f"{wall_ms:.3f}")
        return RunResult(wall_ms=wall_ms, enqueue_us=enqueue_us, nodes=prep.nodes,
                         steps=len(prep.steps), events=prep.events, waits=prep.waits,
                         streams=len(prep.streams), policy=prep.plan.policy,
                         prepare_ms=prepare_ms, timeline=timeline)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending work, then release the pooled streams and events (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
            self._prepared.clear()
            self._plans.clear()
            self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            f"{len(self._pool.streams)} streams, {len(self._pool.events)} events, "
            f"{len(self._prepared)} prepared plans")
        return f"<EagerExecutor on device {self.device.ordinal}: {state}>"


# -- step closures: one driver call each ------------------------------------------------------


def _raise(call: str, err) -> None:
    raise error_from_result(call, err)


def _alloc_step(nbytes, pool, sh, slot, ptrs, objs):
    def step():
        err, dptr = _alloc(nbytes, pool, sh)
        if err:
            _raise("cuMemAllocFromPoolAsync", err)
        objs[slot] = dptr
        ptrs[slot] = int(dptr)
    return step


def _free_step(sh, slot, ptrs, objs):
    def step():
        (err,) = _free(objs[slot], sh)
        if err:
            _raise("cuMemFreeAsync", err)
        objs[slot] = None
        ptrs[slot] = 0
    return step


def _h2d_step(sh, dslot, doff, hslot, hoff, nbytes, ptrs, hptrs):
    def step():
        (err,) = _htod(ptrs[dslot] + doff, hptrs[hslot] + hoff, nbytes, sh)
        if err:
            _raise("cuMemcpyHtoDAsync", err)
    return step


def _d2h_step(sh, hslot, hoff, sslot, soff, nbytes, ptrs, hptrs):
    def step():
        (err,) = _dtoh(hptrs[hslot] + hoff, ptrs[sslot] + soff, nbytes, sh)
        if err:
            _raise("cuMemcpyDtoHAsync", err)
    return step


def _memset_step(fn, sh, slot, off, value, count, ptrs):
    name = fn.__name__

    def step():
        (err,) = fn(ptrs[slot] + off, value, count, sh)
        if err:
            _raise(name, err)
    return step


def _kernel_step(ka, sh, patches, ptrs):
    struct = ka.packed.struct
    address = ka.packed.address
    func = ka.kernel.function
    (gx, gy, gz), (bx, by, bz) = ka.config.grid, ka.config.block
    smem = ka.config.shared_mem
    name = ka.node.name

    def step():
        for field, slot, off in patches:
            setattr(struct, field, ptrs[slot] + off)
        (err,) = _launch(func, gx, gy, gz, bx, by, bz, smem, sh, address, 0)
        if err:
            raise error_from_result("cuLaunchKernel", err, context=f"kernel {name}")
    return step


def _kernel_ex_step(ka, stream, patches, ptrs):
    struct = ka.packed.struct
    kernel, packed, cfg, attributes = ka.kernel, ka.packed, ka.config, ka.attributes

    def step():
        for field, slot, off in patches:
            setattr(struct, field, ptrs[slot] + off)
        kernel.launch(stream, cfg.grid, cfg.block, packed, cfg.shared_mem, **attributes)
    return step


def _hostfn_step(sh, fnptr, token):
    def step():
        (err,) = _hostfn(sh, fnptr, token)
        if err:
            _raise("cuLaunchHostFunc", err)
    return step


def _record_step(ev, sh):
    def step():
        (err,) = _record(ev, sh)
        if err:
            _raise("cuEventRecord", err)
    return step


def _wait_step(sh, ev):
    def step():
        (err,) = _wait(sh, ev, 0)
        if err:
            _raise("cuStreamWaitEvent", err)
    return step

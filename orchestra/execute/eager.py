"""The eager executor: enqueue a plan's steps onto non-blocking streams, one driver call each.

    with EagerExecutor() as ex:
        result = ex.run(graph, bindings={"host_in": pinned_in, "host_out": pinned_out})

For each (graph, plan) the executor *prepares* once (cached by identity): the checks every
executor makes (`ExecutorBase._checked`: plan structure, issue order, hazards, allocation
order, devices, kernels resolved and arguments packed), streams and events from its pools, a
`BindingTable`, and the plan lowered onto streams (`lowering.stream.lower_plan`): one small
closure per step, made by the node's entry in the lowering table, that makes exactly one
driver call:

    Alloc       cuMemAllocFromPoolAsync   (device's default pool, release threshold UINT64_MAX)
    HostToDevice cuMemcpyHtoDAsync        (pinned host memory only, see `bindings`)
    Kernel      cuLaunchKernel            (cuLaunchKernelEx with launch attributes)
    DeviceToHost cuMemcpyDtoHAsync
    Free        cuMemFreeAsync
    Memset      cuMemsetD8/D16/D32Async
    HostFunc    cuLaunchHostFunc          (the driver's entry point; one C trampoline per
                                           executor, see `hostfunc`)
    RecordEvent cuEventRecord / WaitEvent cuStreamWaitEvent (sync-only events)

A run then binds its arrays through the binding table (checks; the identity and remembered
fast paths; the changed addresses written to the slots the closures read) and calls the
closures in ``plan.issue_order()``. Nothing goes to the legacy default stream. Streams (one per
plan `StreamSpec`, with its priority) and events (``CU_EVENT_DISABLE_TIMING``) are pooled by the
executor and reused by every run and every plan; `close()` (or ``with``, or the finalizer)
synchronizes them and releases them.

If a driver call fails part-way, the executor synchronizes what was enqueued, frees every
allocation the run made, and re-raises the `CudaError` naming the node (``err.context``).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Mapping

import attrs

from orchestra.driver import Device
from orchestra.driver.owner import CLOSE_EPOCH
from orchestra.errors import CallOrderError, CudaError
from orchestra.execute.base import ExecutorBase
from orchestra.execute.bindings import BindingTable, release_keep
from orchestra.execute.errors import ExecutorArgumentTypeError, HostFunctionError
from orchestra.execute.hostfunc import HostCallbacks
from orchestra.execute.kernels import KernelResolver
from orchestra.execute.lowering.copy import copy_kernel_nodes
from orchestra.execute.lowering.stream import Addresses, StreamContext, lower_plan
from orchestra.execute.lru import IdentityLRU
from orchestra.execute.occupancy import capacity_for
from orchestra.execute.prepare import assign_event_slots_by_device, check_run
from orchestra.execute.resources import PlanCache
from orchestra.execute.result import RunResult
from orchestra.graph import TaskGraph
from orchestra.schedule import Plan

log = logging.getLogger(__name__)
_debug = functools.partial(log.isEnabledFor, logging.DEBUG)  # cached by logging per level


class _Prepared:
    """One (graph, plan), ready to run: the lowered program, its address slots and binding
    table, the streams it enqueues on, the host-function tokens it registered."""

    __slots__ = ("graph", "plan", "bindings", "modules", "addresses", "program", "streams",
                 "tokens", "resolved", "unfreed", "prepare_ms", "lowered", "copies", "size",
                 "stream_list")

    def __init__(self, graph, plan, bindings: BindingTable, addresses: Addresses, program,
                 streams: dict, tokens: list, resolved: dict, modules: list, copies=None):
        self.graph = graph
        self.plan = plan
        self.copies = copies  # the CopyPolicy it was lowered with
        self.size = len(graph)  # a graph grown since is prepared again
        self.stream_list = tuple(streams.values())
        self.bindings = bindings
        self.modules = modules  # leases on the Modules of its kernels
        self.resolved = resolved  # packed kernel arguments: the steps launch with their memory
        self.addresses = addresses
        self.program = program
        self.streams = streams
        self.tokens = tokens
        self.unfreed = bool(addresses.live_at_end)  # verify=False: an Alloc without a Free
        self.prepare_ms = 0.0
        self.lowered = copy_kernel_nodes(resolved)  # copies run as copy kernels (traces)

    @property
    def steps(self) -> list:
        return self.program.steps

    @property
    def keeps(self) -> tuple:
        """What keeps the memory and code its runs use alive: ``(bindings, module leases)``."""
        return (self.bindings, self.modules)


@attrs.define
class _Pending:
    prepared: _Prepared
    tracer: Any
    t0: int
    enqueue_us: float
    prepare_ms: float


class EagerExecutor(ExecutorBase):
    """Runs task graphs by enqueueing their plans onto pooled non-blocking streams.

    Args:
        device: a `Device`, an ordinal or None (device 0). Every node must be on this device.
        verify: run the hazard verifier (``schedule.check``) before a plan's first run; a plan
            with hazards raises `HazardError` and nothing is enqueued.
        kernel_resolver: a shared `KernelResolver` (default: a new one for ``device``).
        cache_size: how many prepared (graph, plan) pairs to keep.
        driver: the `DriverAPI` every driver call goes through (default: the process's).
        devices: more devices to run on (ordinals or `Device` objects): plans over several
            GPUs, each stream on its `StreamSpec.device`, the events of a cross-device edge
            recorded on one device's stream and waited for on another's, allocations from each
            device's pool, kernels loaded per device (docs/multigpu.md).
        copy_lowering: ``"auto"`` (default), ``"kernel"``, ``"copy-engine"`` or a
            `CopyPolicy`: how host copies run unless a run or the node says otherwise (see
            `ExecutorBase`; eager runs use the ``eager`` crossover, copy engines by default).

    Lifetimes (docs/errors.md, "Lifetimes"): a run leases every bound external device
    buffer and the `PinnedBuffer` / `HostRegistration` / staging slot behind every bound host
    array, and a prepared plan the `Module` of each kernel it launches. A lease is released
    once no queued run can use it: a rebound value's at the next synchronize (at once when
    nothing is queued), a value whose owner was closed at the synchronize after the close (its
    memory goes then; binding it again is refused with `ClosedBindingError`), the rest when the
    prepared plan is evicted or the executor closes.

    Thread-safety: may be shared between threads, but it runs one thing at a time: `run`, `prepare`,
    `synchronize` and `close` hold the executor's lock, so submissions from several threads
    serialize (their work is enqueued on the executor's pooled streams one run after another). For
    concurrent submission create one executor per host thread.
    """

    executor_name = "eager"
    copy_mode = "eager"

    def __init__(self, device: Device | int | None = None, *, verify: bool = True,
                 kernel_resolver: KernelResolver | None = None, cache_size: int = 16,
                 driver=None, devices=None, copy_lowering="auto"):
        super().__init__(device, verify=verify, kernel_resolver=kernel_resolver, driver=driver,
                         devices=devices, copy_lowering=copy_lowering)
        self.cache_size = max(1, int(cache_size))
        self._callbacks = HostCallbacks()
        self._keep.append(self._callbacks)  # the trampoline goes only after the final sync
        self._prepared = IdentityLRU(self.cache_size, on_evict=self._evicted)
        self._plans = PlanCache(self.cache_size)
        self._pending: list[_Pending] = []
        self._last: _Prepared | None = None  # the last run's (graph, plan): no lookup
        self._copies = None  # the executor's own CopyPolicy, once asked for
        self._retired: list = []  # what kept memory alive that pending runs may still use
        self._close_epoch = CLOSE_EPOCH[0]  # leased closes seen by the last synchronize

    # -- pools ------------------------------------------------------------------------------

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
        return self._plans.get(graph, policy, streams, costs,
                               capacity_for(policy, self.kernels, self.device))

    def prepare(self, graph: TaskGraph, plan: Plan | None = None, *, policy: str = "by-engine",
                streams: int = 3, costs=None, copy_lowering=None) -> Plan:
        """Check and prepare (graph, plan) now, so the first `run` enqueues at full speed.
        Returns the plan (scheduled here when None). Raises what `run` raises before
        enqueueing. ``copy_lowering``: as for `run` (prepare with the one the runs use)."""
        with self._lock:
            self._check_open()
            plan = plan if plan is not None else self.plan_for(graph, policy, streams, costs)
            self._get_prepared(graph, plan, self.copy_policy(copy_lowering))
            return plan

    def _get_prepared(self, graph, plan, copies) -> tuple[_Prepared, float]:
        prep = self._prepared.get((graph, plan), (len(graph), copies))
        if prep is not None:
            return prep, 0.0
        t0 = time.perf_counter_ns()
        prep = self._build(graph, plan, copies)
        prep.prepare_ms = (time.perf_counter_ns() - t0) / 1e6
        self._prepared.put((graph, plan), (len(graph), copies), prep)
        return prep, prep.prepare_ms

    def _evicted(self, prep: _Prepared) -> None:
        if self._last is prep:
            self._last = None
        if not self._pending:  # queued work may still call the trampoline with its tokens
            for t in prep.tokens:
                self._callbacks.remove(t)
        self._retire(prep.keeps)

    def _retire(self, keep) -> None:
        """Release ``keep`` (what kept bound memory alive) once no queued run can use it."""
        if self._pending:
            self._retired.append(keep)
        else:
            release_keep(keep)

    def _plan_checks(self, graph, plan, copies=None):
        """Checks 1-4 of `prepare.check_run`: the issue order."""
        if not isinstance(plan, Plan):
            raise ExecutorArgumentTypeError(
                f"plan must be a schedule.Plan, got {type(plan).__name__}")
        return check_run(plan, graph, verify=self.verify)

    def _build(self, graph: TaskGraph, plan: Plan, copies) -> _Prepared:
        # Every check and kernel resolution first: compile errors, argument and launch-limit
        # errors surface before any stream or event is created.
        issue, resolved = self._checked(graph, plan, copies=copies)
        table = BindingTable(graph, self._pinned, where="the eager executor's run")
        addresses = Addresses(table, slot_users=True)
        modules = self._lease_modules(resolved)
        ctx = None
        try:
            pool = self._stream_pool
            sdev = self.stream_devices(plan)
            streams = pool.take_streams(plan, sdev)
            # an event belongs to the device of the stream that records it (cuEventRecord needs
            # both on one device); any device's stream may wait for it (cuStreamWaitEvent)
            slots, where = assign_event_slots_by_device(issue, lambda s: sdev[s].ordinal)
            by_ordinal = {d.ordinal: d for d in self.devices}
            events = [pool.event(k, by_ordinal[o]).handle for o, k in where]
            ctx = StreamContext(self.api, self.executor_name, addresses, resolved,
                                self.pool.handle, self.device, callbacks=self._callbacks,
                                pools={o: p.handle for o, p in self.pools.items()},
                                stream_devices=sdev, copies=copies, bindings=table)
            program = lower_plan(issue, graph, ctx, streams, events, slots)
        except BaseException:
            for t in (ctx.tokens if ctx is not None else ()):
                self._callbacks.remove(t)
            release_keep(modules)
            raise
        return _Prepared(graph, plan, table, addresses, program, streams, ctx.tokens, resolved,
                         modules, copies)

    # -- running ----------------------------------------------------------------------------

    def run(self, graph: TaskGraph, plan: Plan | None = None,
            bindings: Mapping[str, Any] | None = None, *, policy: str = "by-engine",
            streams: int = 3, sync: bool = True, tracer=None, costs=None,
            trace: bool = False, copy_lowering=None) -> RunResult:
        """Run ``graph`` with ``plan`` (default: ``schedule(graph, policy, streams, costs)``).

        ``bindings``: host buffer name -> pinned numpy array (see `bindings`), external device
        buffer name -> DeviceBuffer. ``sync=False`` returns after enqueueing (``wall_ms`` None):
        keep the bound arrays untouched until `synchronize()`. ``tracer``: an object with the
        `orchestra.trace.EventTimer` methods (``begin``, ``before``, ``after``, ``finish``,
        ``abort``), called around every node. ``trace=True`` (without ``tracer``) uses the
        executor's own `tracer` (an `EagerTracer`); either way `RunResult.timeline` is the
        run's `Timeline` (with ``sync=False``: the result `synchronize()` returns).
        ``copy_lowering``: ``"auto"`` / ``"kernel"`` / ``"copy-engine"`` / a `CopyPolicy` for
        this run's host copies (default: the executor's; a node's own ``lowering=`` wins);
        each choice is its own prepared program.

        Raises before enqueueing anything: `GraphError`, `PlanMismatchError`, `HazardError`
        (unless ``verify=False``), kernel errors (`CompileError`, ``TypeError``/``ValueError``
        for arguments and launch limits), `BindingError`, `PageableMemoryError`. While
        enqueueing: `CudaError` naming the node (its work so far is synchronized and its
        allocations freed). After the run: `HostFunctionError` if a host function raised.
        """
        with self._lock:
            if self._closed:
                self._check_open()
            if plan is None:
                plan = self.plan_for(graph, policy, streams, costs)
            copies = (self._copies if copy_lowering is None and self._copies is not None
                      else self._run_policy(copy_lowering))
            prep = self._last  # the (graph, plan) run last: no cache lookup
            if (prep is not None and prep.graph is graph and prep.plan is plan
                    and prep.copies is copies and prep.size == len(graph)):
                prepare_ms = 0.0
            else:
                prep, prepare_ms = self._get_prepared(graph, plan, copies)
                self._last = prep
            retired = prep.bindings.bind(bindings)
            if retired:
                self._retire(retired)
            if sync and tracer is None and not trace and not self._pending:
                return self._run_now(prep, prepare_ms)
            if trace and tracer is None:
                tracer = self.tracer
                if any(p.tracer is tracer for p in self._pending):
                    raise CallOrderError(
                        "a run traced with trace=True is still pending (sync=False); call "
                        "synchronize() before the next traced run, or pass tracer=EagerTracer()")
            self.device.make_current()
            if tracer is not None:
                meta = {"executor": "eager", "device": self.device.ordinal}
                if prep.lowered:
                    meta["lowered"] = prep.lowered
                tracer.begin(prep.streams, policy=plan.policy, meta=meta)
            t0 = time.perf_counter_ns()
            self._enqueue(prep, tracer)
            t1 = time.perf_counter_ns()
            self._pending.append(_Pending(prep, tracer, t0, (t1 - t0) / 1e3, prepare_ms))
            if not sync:
                return self._result(prep, None, (t1 - t0) / 1e3, prepare_ms, None)
            return self._sync_pending()

    def _run_policy(self, copy_lowering):
        policy = self.copy_policy(copy_lowering)
        if copy_lowering is None:
            self._copies = policy
        return policy

    def _run_now(self, prep: _Prepared, prepare_ms: float) -> RunResult:
        """The common run: untraced, waited for, nothing else pending. The same steps as the
        general path with its per-run objects left out (no pending record, no stream set: the
        prepared plan's own streams are synchronized)."""
        self.device.make_current()
        steps = prep.program.steps
        perf = time.perf_counter_ns
        t0 = perf()
        i = -1
        try:
            for i, step in enumerate(steps):  # noqa: B007 - i names the failing step
                step()
        except BaseException as exc:
            self._step_failed(prep, None, i, exc)
            raise
        t1 = perf()
        try:
            for s in prep.stream_list:
                s.synchronize()
        except CudaError:
            self._free_live(prep)
            self._callbacks.take_errors()
            raise
        finally:
            if self._retired:
                retired, self._retired = self._retired, []
                release_keep(retired)
        t2 = perf()
        if CLOSE_EPOCH[0] != self._close_epoch:  # a leased object was closed somewhere
            self._close_epoch = CLOSE_EPOCH[0]
            for p in self._prepared.values():  # nothing queued: closed memory can go now
                p.bindings.drop_closed()
        elif prep.bindings.held > BindingTable.HELD_MAX:
            prep.bindings.sweep()  # many owners bound in turn: the oldest go
        if prep.unfreed:
            self._free_live(prep)  # only with verify=False: an Alloc without a Free
        if self._callbacks.errors:
            errors = self._callbacks.take_errors()
            node, raised = errors[0]
            raise HostFunctionError(node, raised, errors[1:]) from raised
        program = prep.program
        if _debug():
            self._log_run(prep, (t1 - t0) / 1e3, (t2 - t0) / 1e6)
        return RunResult((t2 - t0) / 1e6, (t1 - t0) / 1e3, program.node_count,
                         len(steps), program.event_count, program.wait_count,
                         len(prep.stream_list), prep.plan.policy, prepare_ms, None,
                         len(prep.lowered))

    def _enqueue(self, prep: _Prepared, tracer) -> None:
        """Call the steps (around each node, the tracer's ``before`` / ``after``). A failing
        step: `_step_failed`."""
        program = prep.program
        steps = program.steps
        i = -1
        try:
            if tracer is None:
                for i, step in enumerate(steps):  # noqa: B007 - i names the failing step
                    step()
            else:
                nodes = program.nodes
                for i, step in enumerate(steps):
                    tn = nodes[i]
                    if tn is None:
                        step()
                    else:
                        tracer.before(tn[0], tn[1])
                        step()
                        tracer.after(tn[0], tn[1])
        except BaseException as exc:
            self._step_failed(prep, tracer, i, exc)
            raise

    def _step_failed(self, prep: _Prepared, tracer, i: int, exc: BaseException) -> None:
        """Step ``i`` raised ``exc``: synchronize what was enqueued, free the run's
        allocations, then raise a `CudaError` naming the step (the caller re-raises anything
        else, with a note naming the step)."""
        self._abort(prep, tracer)
        labels = prep.program.labels
        if isinstance(exc, CudaError) and 0 <= i < len(labels):
            raise exc.with_context(labels[i]) from exc
        if 0 <= i < len(labels) and isinstance(exc, Exception):
            exc.add_note(f"while enqueueing {labels[i]}")

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
        a = prep.addresses
        free = self.api.cuMemFreeAsync
        touched = set()
        for slot in a.alloc_slots:
            obj = a.objs[slot]
            if obj is None:
                continue
            sh = a.alloc_stream[slot]
            (err,) = free(obj, sh)
            a.objs[slot] = None
            a.ptrs[slot] = 0
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
        finally:
            retired, self._retired = self._retired, []
            release_keep(retired)
        t2 = time.perf_counter_ns()
        if CLOSE_EPOCH[0] != self._close_epoch:  # a leased object was closed somewhere
            self._close_epoch = CLOSE_EPOCH[0]
            for prep in self._prepared.values():  # nothing queued: closed memory can go now
                prep.bindings.drop_closed()
        elif pending[-1].prepared.bindings.held > BindingTable.HELD_MAX:
            pending[-1].prepared.bindings.sweep()  # many owners bound in turn: the oldest go
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

    @staticmethod
    def _log_run(prep, enqueue_us, wall_ms) -> None:
        program = prep.program
        log.debug("eager run: %d nodes on %d streams, %d events, %d waits: %d driver calls "
                  "enqueued (one per step), %d copy kernels, in %.0f us; wall %s ms",
                  program.node_count, len(prep.streams), program.event_count,
                  program.wait_count, len(program.steps), len(prep.lowered), enqueue_us,
                  "-" if wall_ms is None else f"{wall_ms:.3f}")

    def _result(self, prep, wall_ms, enqueue_us, prepare_ms, timeline) -> RunResult:
        program = prep.program
        if _debug():
            self._log_run(prep, enqueue_us, wall_ms)
        return RunResult(wall_ms, enqueue_us, program.node_count, len(program.steps),
                         program.event_count, program.wait_count, len(prep.streams),
                         prep.plan.policy, prepare_ms, timeline, len(prep.lowered))

    # -- lifetime ---------------------------------------------------------------------------

    def _on_close(self) -> None:
        # bound memory is released only after the final synchronize (the finalizer's)
        self._keep.extend(self._retired)
        self._keep.extend(p.keeps for p in self._prepared.values())
        self._retired.clear()
        self._pending.clear()
        self._last = None
        self._prepared.clear()
        self._plans.clear()

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            f"{len(self._stream_pool.streams)} streams, {len(self._stream_pool.events)} "
            f"events, {len(self._prepared)} prepared plans")
        return f"<EagerExecutor on device {self.device.ordinal}: {state}>"


__all__ = ["EagerExecutor", "RunResult"]

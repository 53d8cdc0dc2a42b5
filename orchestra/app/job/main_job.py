"""The main job: N batches of allocate -> H2D -> burn -> D2H -> free, three-way overlapped.

    report = MainJob(batches=32, batch_mib=64, policy="by-engine").run()
    print(report.efficiency, report.verified)

What `MainJob.run` does, in order:

1. float32 input from ``np.random.default_rng(seed)`` in ONE pinned input array, and ONE pinned
   output array; batch ``b`` is a disjoint range of both (the last batch may be shorter);
2. single-batch timings with timing events, each operation alone (`timing.BatchTimer`):
   ``t_h2d``, ``t_d2h``, then ``--compute-iters auto`` calibrates the kernel to the slower copy,
   then ``t_kernel``; then the sustained times of K back-to-back items (H2Ds, D2Hs, kernels,
   H2D/D2H pairs at once; `sustained`) for the bound;
3. the plan (``schedule``; critical-path gets a cost model from those timings), prepared once,
   with the policy and stream count ``"auto"`` resolves to (`policy.choose_policy`: round-robin
   lanes when most copies run as copy kernels, else by-engine on 3 streams, or 4 (two compute
   streams) for the CUDA graph executors when the burn kernel's grid is smaller than the
   blocks the GPU holds at once, ``Kernel.occupancy`` x SM count, and batches are at most
   16 MiB), decided before the timings
   so that the sustained times are measured at the plan's concurrency;
4. a routing check: one run with ``check_iters`` (3) iterations, verified against numpy. With
   many iterations every output converges to 2.0 whatever its input, so only a short run shows
   that each batch's output came from its own input;
5. ``warmup`` then ``repeat`` runs, each: poison the output with NaN, run, verify every element
   against the numpy reference (computed once). Wall time: `RunResult.wall_ms`, the host clock
   from the first enqueue to the end of the synchronize; the report gives the median;
6. with ``trace=True``, one more run after the timed ones, traced (``run(..., trace=True)``) and
   verified like the others, so tracing never changes the wall times: ``JobReport.timeline``.

``efficiency = bound / wall`` with the fill-aware pipeline bound from the sustained times, the
duplex rate where both directions overlap (`bound.pipeline_bound`; N counts a shorter last
batch by its fraction of a full one). The sustained times are measured at the plan's
concurrency (items spread over its streams: a lane plan runs that many batches at once),
with the copy mechanism the run uses (the copy kernel too when any copy runs as one) and
launched as the run is (captured into one CUDA graph for the graph executors). An
efficiency above 1.01 is a bug in the bound: ``JobReport.bound_warning`` says so.

With ``input=FILE.npy`` the data comes from a float32 ``.npy`` file (memory-mapped, any shape,
flattened) and goes through a pool of pinned staging slots (`graphs.build_staged_graph`); the
result is written to ``output`` (``np.lib.format.open_memmap``; default: a temporary file) and
verified chunk by chunk.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from orchestra.errors import JobConfigError, JobConfigTypeError, counted
from orchestra.app.job import data as jd
from orchestra.app.job.graphs import (
    DEVICE_BUDGET,
    ELEMENT,
    batch_bytes_from_mib,
    batch_sizes,
    build_job_graph,
    build_staged_graph,
    burn_grid,
    burn_kernel_ref,
    in_flight_for,
    job_costs,
)
from orchestra.app.job.inputs import open_input
from orchestra.app.job.bound import bound_warning
from orchestra.app.job.checks import MAX_ITERS, whole
from orchestra.app.job.policy import (
    AUTO, PolicyChoice, check_policy, check_streams, choose_policy, count_copies, fills_gpu,
)
from orchestra.app.job.sustained import items_for
from orchestra.app.job.timing import BatchTimer, SingleBatch, launch_for

log = logging.getLogger(__name__)

TIMING_NOTE = ("wall: host clock (perf_counter) from the first enqueue to the end of the final "
               "stream synchronize, median over the timed runs; single-batch times: timing "
               "events around each operation alone, median; sustained times (the bound's): K "
               "back-to-back items behind a gate kernel, GPU time / K, median")
CHECK_ITERS = 3


@attrs.frozen
class JobReport:
    """Everything `MainJob.run` measured. Times in ms, sizes in bytes.

    Immutable (frozen), but ``bound_terms`` and ``sustained`` are plain dicts (and ``timeline`` a
    `Timeline`): may be shared between threads as long as nobody modifies them.
    """

    device: str
    executor: str
    policy: str  # the policy the plan ran with ("auto" resolved)
    streams: int  # the streams the plan runs on (at most the resolved number)
    batches: int
    batch_bytes: int
    data_bytes: int
    compute_iters: int
    compute_iters_auto: bool
    t_h2d_ms: float
    t_kernel_ms: float
    t_d2h_ms: float
    wall_ms: float
    wall_ms_runs: tuple
    bound_ms: float
    efficiency: float
    host_us_per_node: float
    nodes: int
    events: int
    waits: int
    verified: bool
    check: str
    mismatches: int
    routing_check: bool | None
    repeat: int
    seed: int | None
    input: str | None = None
    output: str | None = None
    bound_limiter: str = ""  # the bound's largest term: upload, download, compute or link
    bound_terms: dict = attrs.field(factory=dict)  # term -> ms (bound.PipelineBound.terms)
    sustained: dict | None = None  # bound.Sustained.as_dict(): the times the bound is made of
    bound_warning: str | None = None  # set when efficiency > 1.01: the bound is wrong
    copy_lowering: str = "auto"  # the run's --copy-lowering
    copy_kernels: int = 0  # host copies of one run that ran as the copy kernel
    policy_requested: str = AUTO  # what was asked for: "auto" or a policy
    streams_requested: int | str = AUTO  # "auto" or a count
    policy_reason: str = ""  # why the policy and stream count (policy.PolicyChoice.reason)
    timing: str = TIMING_NOTE
    timeline: Any = attrs.field(default=None, eq=False, repr=False)  # trace=True: a Timeline

    @property
    def bytes_moved(self) -> int:
        """H2D plus D2H bytes of one run."""
        return 2 * self.data_bytes

    @property
    def gbps(self) -> float:
        """Bytes moved per second of wall time (GB/s)."""
        return self.bytes_moved / (self.wall_ms * 1e6) if self.wall_ms else 0.0

    def as_dict(self) -> dict:
        d = attrs.asdict(self, filter=lambda a, v: a.name != "timeline")
        d["wall_ms_runs"] = list(self.wall_ms_runs)
        d["bytes"] = self.bytes_moved
        d["gbps"] = self.gbps
        return d


def parse_iters(value) -> int | None:
    """``"auto"`` / None -> None (calibrate); else an int from 0 to `MAX_ITERS` (the burn
    kernel's ``int iters``): `JobConfigError` out of range, `JobConfigTypeError` for a
    string other than ``auto``, a bool or a fractional float."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str):  # "7", as a command line gives it
        try:
            value = int(value)
        except ValueError:
            raise JobConfigTypeError(f"compute iterations must be 'auto' or an int from 0 to "
                                     f"{MAX_ITERS}; got {value!r}") from None
    return whole("compute iterations", value, 0, MAX_ITERS)


class MainJob:
    """The main job (see the module doc). Arguments mirror ``orchestra run``'s options.

    ``policy``: a `orchestra.schedule.POLICIES` name or "auto" (default), ``streams``: an int
    >= 1 or "auto" (default): resolved by `orchestra.app.job.policy.choose_policy` from how the
    executor lowers the job's copies and whether the burn kernel fills the GPU
    (`JobConfigError` for anything else).
    ``compute_iters``: an int, or "auto" (default) to match the kernel to the slower copy.
    ``elements``: total float32 elements (default ``batches * batch elements``; a value that is
    not a multiple gives a shorter last batch and more batches). ``input``/``output``: stream a
    float32 ``.npy`` file through ``staging_slots`` pinned slots instead of generated data.
    ``trace``: one extra traced, verified run after the timed ones (`JobReport.timeline`).
    ``progress``: called as ``progress(stage, done, total)`` as the runs go (the CLI's bar).
    ``copy_lowering``: ``"auto"`` (default), ``"kernel"`` or ``"copy-engine"``, the executor's
    (`orchestra.execute.ExecutorBase`). ``device_budget``: device memory (bytes) the batches in
    flight may hold together before batch ``b`` waits for batch ``b - k``'s frees
    (`orchestra.app.job.graphs.in_flight_for`; default 8 GiB).

    Thread-safety: not thread-safe: `run` drives one executor, its staging and its device buffers
    from the calling thread; run one job at a time per object.
    """

    def __init__(self, batches: int = 32, batch_mib: float = 64, streams: int | str = AUTO,
                 policy: str = AUTO, compute_iters="auto", repeat: int = 5, seed: int = 0,
                 executor: str = "eager", *, device=None, elements: int | None = None,
                 input: str | os.PathLike | None = None, output: str | os.PathLike | None = None,
                 warmup: int = 1, block: int = 256, verify_plan: bool = True,
                 staging_slots: int = 4, timing_repeats: int = 7, check_iters: int = CHECK_ITERS,
                 graph_dot: str | os.PathLike | None = None, trace: bool = False,
                 progress: Callable[[str, int, int], None] | None = None,
                 copy_lowering: str = "auto", device_budget: int = DEVICE_BUDGET):
        # counts by name (a string or 2.5 batches once failed in int() or was truncated)
        self.batches = whole("batches", batches, 1)
        repeat, warmup = whole("repeat", repeat, 1), whole("warmup", warmup, 0)
        self.batch_bytes = batch_bytes_from_mib(batch_mib)
        self.streams = check_streams(streams)
        self.policy = check_policy(policy)
        # the resolved policy and streams, once run() knows the executor's copy lowering
        self.choice: PolicyChoice | None = None
        self.iters = parse_iters(compute_iters)
        self.repeat, self.warmup, self.seed = repeat, warmup, seed
        self.executor_name = executor
        self.device = device
        self.elements = elements
        self.input = None if input is None else Path(input)
        self.output = None if output is None else Path(output)
        self.block = whole("block", block, 1)  # the device's limit: checked by run()
        self.verify_plan = verify_plan
        self.staging_slots = whole("staging_slots", staging_slots, 1)
        self.timing_repeats = whole("timing_repeats", timing_repeats, 1)
        self.check_iters = whole("check_iters", check_iters, 0, MAX_ITERS)
        self.graph_dot = graph_dot  # capture / graph executors: the CUDA graph as DOT
        self.trace = bool(trace)
        self.progress = progress
        self.copy_lowering = copy_lowering
        if isinstance(device_budget, float) and math.isfinite(device_budget):
            device_budget = math.floor(device_budget)  # bytes from a fractional MiB count
        self.device_budget = whole("device_budget (bytes)", device_budget, 1)

    # -- shared pieces ----------------------------------------------------------------------

    def sizes(self, total_elements: int | None = None) -> list[int]:
        """Bytes per batch."""
        per = self.batch_bytes // ELEMENT
        total = total_elements or self.elements or self.batches * per
        return batch_sizes(total, per)

    def _choose(self, executor, sizes, in_flight: int | None, fills: bool | None = None):
        """Resolve ``policy`` / ``streams`` (`choose_policy`) from how ``executor`` lowers the
        job's copies over ``sizes``; ``in_flight``: the batches that may run together;
        ``fills``: whether the burn kernel fills the GPU (`_kernel_fills`; None: unknown)."""
        copies, kernels = count_copies(sizes, executor.copy_policy())
        c = self.choice = choose_policy(self.policy, self.streams, copies=copies,
                                        copy_kernels=kernels, batches=len(sizes),
                                        in_flight=in_flight,
                                        executor=f"{self.executor_name} executor",
                                        eager=self.executor_name == "eager",
                                        kernel_fills_gpu=fills, batch_bytes=max(sizes))
        log.debug("main job: %s", c.describe())
        return c

    def _burn_kernel(self, executor, sizes, dev) -> tuple:
        """``(kernel, grid, fills)``: the burn kernel ``executor`` resolves, its grid for the
        largest batch, its launch limits checked (before any timing or run), and whether it
        fills ``dev`` (`_kernel_fills`). Made before the policy: that decides auto's streams."""
        grid = burn_grid(max(sizes) // ELEMENT, self.block, dev.sm_count)
        kernel = executor.kernels.resolve(burn_kernel_ref())
        kernel.launch_config(grid, self.block)
        return kernel, grid, self._kernel_fills(kernel, grid, dev)

    def _kernel_fills(self, kernel, grid: int, dev) -> bool | None:
        """Whether ``grid`` blocks of `block` threads of ``kernel`` fill ``dev``: at least its
        resident blocks, ``kernel.occupancy(block, 0)`` x ``dev.sm_count``
        (`policy.fills_gpu`, the executors' test for the concurrent policy); None for a kernel
        without ``occupancy`` or a device without an SM count. The burn kernel uses no
        dynamic shared memory."""
        fills = fills_gpu(kernel, grid, self.block, getattr(dev, "sm_count", 0))
        log.debug("main job: kernel grid %d x %d %s", grid, self.block,
                  {None: "(resident blocks unknown)", True: "fills the GPU",
                   False: "is smaller than the GPU"}[fills])
        return fills

    def _resolved(self) -> PolicyChoice:
        """The `PolicyChoice` `_choose` made (run() makes it before any timing)."""
        if self.choice is None:
            raise JobConfigError("the policy is resolved when the job runs (MainJob.run)")
        return self.choice

    def _plan(self, executor, graph, single: SingleBatch):
        c = self._resolved()
        costs = None
        if c.policy == "critical-path":
            costs = job_costs(single.nbytes, single.t_h2d_ms, single.t_kernel_ms,
                              single.t_d2h_ms)
        return executor.prepare(graph, policy=c.policy, streams=c.streams, costs=costs), costs

    def _timings(self, kernel, stream, host_in, host_out, grid, batches: int) -> SingleBatch:
        """Single-batch and sustained times; the sustained items spread over the plan's
        streams (its concurrency), with the copy kernel timed too when the run has any, and
        launched as the run launches its work (one CUDA graph for the graph executors,
        `timing.launch_for`)."""
        self._step("single-batch timings", 0, self.warmup + self.repeat + int(self.trace))
        c = self._resolved()
        timer = BatchTimer(kernel, stream, host_in, host_out, grid=grid, block=self.block,
                           repeats=self.timing_repeats)
        try:
            return timer.measure(self.iters,
                                 items=items_for(batches, host_in.nbytes, streams=c.streams),
                                 streams=c.streams, copy_kernel=c.copy_kernels > 0,
                                 launch=launch_for(self.executor_name))
        finally:
            timer.close()

    def _report(self, dev, sizes, single, runs, checks, routing, mismatches,
                timeline=None) -> JobReport:
        walls = [r.wall_ms for r in runs]
        wall = statistics.median(walls)
        bound = single.bound(sizes)
        efficiency = bound.efficiency(wall)
        last = runs[-1]
        ok = all(c.ok for c in checks) and routing is not False
        bad = next((c for c in checks if not c.ok), checks[-1])
        c = self._resolved()
        return JobReport(
            device=dev.name, executor=self.executor_name, policy=c.policy,
            streams=last.streams, batches=len(sizes), batch_bytes=single.nbytes,
            data_bytes=sum(sizes), compute_iters=single.iters,
            compute_iters_auto=self.iters is None, t_h2d_ms=single.t_h2d_ms,
            t_kernel_ms=single.t_kernel_ms, t_d2h_ms=single.t_d2h_ms, wall_ms=wall,
            wall_ms_runs=tuple(walls), bound_ms=bound.bound_ms, efficiency=efficiency,
            host_us_per_node=statistics.median(r.host_us_per_node for r in runs),
            nodes=last.nodes, events=last.events, waits=last.waits, verified=ok,
            check=bad.describe(), mismatches=mismatches, routing_check=routing,
            repeat=self.repeat, seed=None if self.input else self.seed,
            input=None if self.input is None else str(self.input),
            output=None if self.output is None else str(self.output), timeline=timeline,
            bound_limiter=bound.limiter, bound_terms=bound.terms,
            sustained=None if single.sustained is None else single.sustained.as_dict(),
            bound_warning=bound_warning(efficiency, f"{self.executor_name} {c.policy} "
                                                    f"({counted(c.streams, 'stream')})"),
            copy_lowering=self.copy_lowering, copy_kernels=last.copy_kernels,
            policy_requested=c.requested_policy, streams_requested=c.requested_streams,
            policy_reason=c.reason)

    def _dump_dot(self, executor) -> None:
        if self.graph_dot and hasattr(executor, "dot"):
            executor.dot(self.graph_dot)

    def _timed_runs(self, executor, run_once, check):
        """``warmup`` + ``repeat`` runs of ``run_once(trace)`` (a `RunResult`), each verified by
        ``check()``; the DOT dump; with ``trace``, one more traced and verified run. Returns
        (the timed runs, every check, the most mismatches, the traced run's timeline)."""
        runs, checks, mismatches = [], [], 0
        total = self.warmup + self.repeat + int(self.trace)
        for r in range(self.warmup + self.repeat):
            self._step("warm-up run" if r < self.warmup else "timed run", r, total)
            res = run_once(False)
            log.debug("main job: run %d of %d: %d nodes, %d steps, wall %.3f ms", r + 1,
                      self.warmup + self.repeat, res.nodes, res.steps, res.wall_ms)
            chk = check()
            mismatches = max(mismatches, chk.mismatches)
            checks.append(chk)
            if r >= self.warmup:
                runs.append(res)
        self._dump_dot(executor)  # the timed runs' graph, not the traced one
        timeline = None
        if self.trace:  # after the timed runs: tracing never skews the wall times
            self._step("traced run", total - 1, total)
            timeline = run_once(True).timeline
            chk = check()
            mismatches = max(mismatches, chk.mismatches)
            checks.append(chk)
        return runs, checks, mismatches, timeline

    def _step(self, stage: str, done: int, total: int) -> None:
        log.debug("main job: %s (%d of %d)", stage, done + 1, total)
        if self.progress is not None:
            self.progress(stage, done, total)

    @staticmethod
    def _close(executor, stream, buffers) -> None:
        """The executor, then the timing stream and the pinned buffers made so far."""
        executor.close()
        if stream is not None:
            stream.close()
        for p in buffers:
            if p is not None:
                p.close()

    # -- run --------------------------------------------------------------------------------

    def run(self) -> JobReport:
        """Run the job on the GPU (`NoDeviceError` without one, before any work)."""
        from orchestra.driver.device import as_device

        dev = as_device(self.device)
        if self.input is not None:
            return self._run_file(dev, self.input)
        return self._run_generated(dev)

    def _run_generated(self, dev) -> JobReport:
        from orchestra.driver import PinnedBuffer, Stream
        from orchestra.execute import make_executor

        sizes = self.sizes()
        total = sum(sizes) // ELEMENT
        executor = make_executor(self.executor_name, dev, verify=self.verify_plan,
                                 copy_lowering=self.copy_lowering)
        pin_in = pin_out = stream = None
        try:
            kernel, grid, fills = self._burn_kernel(executor, sizes, dev)
            self._choose(executor, sizes, in_flight_for(sizes, self.device_budget), fills)
            pin_in = PinnedBuffer.empty(total, np.float32, dev)
            pin_out = PinnedBuffer.empty(total, np.float32, dev)
            x, y = pin_in.array, pin_out.array
            jd.fill_uniform(x, self.seed)
            stream = Stream(dev)
            n0 = sizes[0] // ELEMENT
            single = self._timings(kernel, stream, x[:n0], y[:n0], grid, len(sizes))
            bindings = {"host_in": x, "host_out": y}

            routing = None
            if self.check_iters and self.check_iters != single.iters:
                rg = build_job_graph(sizes, iters=self.check_iters, block=self.block,
                                     sm_count=dev.sm_count, device_budget=self.device_budget)
                plan, _ = self._plan(executor, rg.graph, single)
                jd.poison(y)
                executor.run(rg.graph, plan, bindings)
                routing = jd.check_against(x, y, self.check_iters).ok

            jg = build_job_graph(sizes, iters=single.iters, block=self.block,
                                 sm_count=dev.sm_count, device_budget=self.device_budget)
            plan, _ = self._plan(executor, jg.graph, single)
            reference = jd.Reference.build(x, single.iters)

            def run_once(trace):
                jd.poison(y)
                return executor.run(jg.graph, plan, bindings, trace=trace)

            runs, checks, mismatches, timeline = self._timed_runs(
                executor, run_once, lambda: reference.compare(y))
            del x, y, bindings  # drop the views (run_once's too) before the buffers close
            return self._report(dev, sizes, single, runs, checks, routing, mismatches, timeline)
        finally:
            self._close(executor, stream, (pin_in, pin_out))

    def _run_file(self, dev, path: Path) -> JobReport:
        from orchestra.driver import Stream
        from orchestra.execute import StagingPool, make_executor

        inp = open_input(path)  # the checks `orchestra plan --input` makes too
        src, fortran, flat_in = inp.array, inp.fortran, inp.flat
        tmp = None
        out_path = self.output
        if out_path is None:
            fd, tmp = tempfile.mkstemp(suffix=".npy", prefix="orchestra-run-")
            os.close(fd)
            out_path = Path(tmp)
        out_mm = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.float32,
                                           shape=src.shape, fortran_order=fortran)
        flat_out = (out_mm.T if fortran else out_mm).reshape(-1)
        n = flat_in.size
        sizes = self.sizes(n)
        per = self.batch_bytes // ELEMENT
        slots = max(1, min(self.staging_slots, len(sizes)))
        executor = make_executor(self.executor_name, dev, verify=self.verify_plan,
                                 copy_lowering=self.copy_lowering)
        stage_in = stage_out = stream = None
        try:
            kernel, grid, fills = self._burn_kernel(executor, sizes, dev)
            # a slot's next batch waits for the batch before it: at most ``slots`` at once
            self._choose(executor, sizes, slots, fills)
            stage_in = StagingPool(slots, max(sizes), dev, prefix="stage_in")
            stage_out = StagingPool(slots, max(sizes), dev, prefix="stage_out")
            ins = [stage_in.view(k) for k in range(slots)]
            outs = [stage_out.view(k) for k in range(slots)]

            def fill(b):
                lo, hi, k = b * per, min(n, (b + 1) * per), b % slots

                def f():
                    np.copyto(ins[k][:hi - lo], flat_in[lo:hi])
                return f

            def drain(b):
                lo, hi, k = b * per, min(n, (b + 1) * per), b % slots

                def f():
                    flat_out[lo:hi] = outs[k][:hi - lo]
                return f

            stream = Stream(dev)
            n0 = sizes[0] // ELEMENT
            np.copyto(ins[0][:n0], flat_in[:n0])
            single = self._timings(kernel, stream, ins[0][:n0], outs[0][:n0], grid, len(sizes))
            bindings = {**stage_in.bindings(), **stage_out.bindings()}

            def build(iters):
                return build_staged_graph(sizes, slots=slots, iters=iters, fill=fill,
                                          drain=drain, block=self.block, sm_count=dev.sm_count)

            def one_run(graph, plan, trace=False):
                jd.poison(flat_out)
                for o in outs:
                    jd.poison(o)
                return executor.run(graph, plan, bindings, trace=trace)

            routing = None
            if self.check_iters and self.check_iters != single.iters:
                rg = build(self.check_iters)
                plan, _ = self._plan(executor, rg.graph, single)
                one_run(rg.graph, plan)
                out_mm.flush()
                routing = jd.check_against(flat_in, flat_out, self.check_iters).ok

            jg = build(single.iters)
            plan, _ = self._plan(executor, jg.graph, single)

            def run_once(trace):
                res = one_run(jg.graph, plan, trace=trace)
                out_mm.flush()
                return res

            runs, checks, mismatches, timeline = self._timed_runs(
                executor, run_once, lambda: jd.check_against(flat_in, flat_out, single.iters))
            return self._report(dev, sizes, single, runs, checks, routing, mismatches, timeline)
        finally:
            self._close(executor, stream, (stage_in, stage_out))
            out_mm.flush()
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


__all__ = ["CHECK_ITERS", "JobReport", "MainJob", "TIMING_NOTE", "parse_iters"]

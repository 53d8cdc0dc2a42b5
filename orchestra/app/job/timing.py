"""Single-batch timings with timing events, sustained times for the bound, and the choice of
``--compute-iters``.

Each of H2D, kernel and D2H is timed alone (nothing else on the GPU): a timing event before and
after it on one stream, ``cuEventElapsedTime``, median of ``repeats`` after ``warmup`` runs.
Those single-batch times are reported and calibrate the kernel; the bound uses the sustained
times of `BatchTimer.sustained` (K back-to-back items behind a gate, `sustained`), because a
single item timed alone includes latency a full pipeline hides (`bound`).

``--compute-iters auto`` (the default) calibrates the kernel to the slower copy: the kernel's
time is affine in ``iters`` (a fixed part plus the per-iteration FMAs), so two probe launches
give the line, one more launch at the predicted count corrects it (`calibrate_iters`).

The sustained items are launched the way the run launches its work (``launch=``): enqueued
on streams for the eager executor, captured into one CUDA graph and launched as one for the
graph executors (a graph launches small kernels with less per-launch overhead than a stream,
so items timed on streams overstate what a graph of them takes: a graph of 16 lanes beat such
a bound), or both, the faster counting, where contenders of both kinds share one bound.
"""

from __future__ import annotations

import statistics
from typing import Callable

import attrs
import numpy as np

from orchestra.app.job.bound import LAUNCHES, PipelineBound, Sustained, pipeline_bound
from orchestra.errors import JobConfigError

PROBES = (64, 512)
MAX_ITERS = 1 << 20


def launch_for(executor: str) -> str:
    """How to launch the sustained items for a run by ``executor`` (``"eager"``, ``"capture"``
    or ``"graph"``, as `orchestra.execute.make_executor` names them): ``"graph"`` for the two
    CUDA-graph executors (the run is one graph launch), ``"stream"`` for the eager one."""
    return "graph" if executor in ("capture", "graph") else "stream"


def check_launch(launch) -> str:
    """``launch`` if it is one of `LAUNCHES`, else `JobConfigError` (a ``ValueError``)."""
    if launch not in LAUNCHES:
        raise JobConfigError(f"the sustained items are launched as one of "
                             f"{', '.join(LAUNCHES)}; got {launch!r}")
    return launch


@attrs.frozen
class SingleBatch:
    """Median single-batch times (ms) of ``nbytes`` bytes, the kernel's ``iters``, and the
    sustained times the bound is made of (None when not measured).

    Immutable: may be shared between threads freely.
    """

    nbytes: int
    iters: int
    t_h2d_ms: float
    t_kernel_ms: float
    t_d2h_ms: float
    repeats: int
    sustained: Sustained | None = None

    def bound(self, sizes) -> PipelineBound:
        """`pipeline_bound` over ``sizes`` (bytes per batch, or a batch count) from the
        sustained times; without them from the single-batch times, both directions at once
        assumed as fast as the slower alone (an upper estimate of what the link allows)."""
        s = self.sustained
        if s is None:
            s = Sustained(self.nbytes, 1, self.t_h2d_ms, self.t_kernel_ms, self.t_d2h_ms,
                          max(self.t_h2d_ms, self.t_d2h_ms))
        return pipeline_bound(s, sizes)


def calibrate_iters(kernel_ms: Callable[[int], float], target_ms: float, *,
                    probes: tuple[int, int] = PROBES, max_iters: int = MAX_ITERS
                    ) -> tuple[int, float]:
    """The iteration count whose kernel time is ``target_ms``, and that time.

    ``kernel_ms(iters)`` measures the kernel. Fits ``t = a + b * iters`` through two probes,
    predicts, measures there and corrects once more with the slope through that point.
    """
    if not target_ms > 0:
        raise JobConfigError(f"target time must be > 0 ms; got {target_ms!r}")
    i1, i2 = probes
    t1, t2 = kernel_ms(i1), kernel_ms(i2)
    slope = (t2 - t1) / (i2 - i1)
    if slope <= 0:  # noise at tiny sizes: fall back to proportional scaling
        slope = max(t2, 1e-6) / i2

    def clamp(v):
        return int(min(max(round(v), 1), max_iters))

    iters = clamp(i2 + (target_ms - t2) / slope)
    t = kernel_ms(iters)
    if abs(t - target_ms) > 0.02 * target_ms and iters != i2:
        slope2 = (t - t2) / (iters - i2)
        if slope2 > 0:
            better = clamp(iters + (target_ms - t) / slope2)
            if better != iters:
                iters, t = better, kernel_ms(better)
    return iters, t


def median_ms(op: Callable[[], None], stream, *, repeats: int = 7, warmup: int = 2,
              events=None) -> float:
    """Median time (ms) of ``op()`` (which enqueues on ``stream``) between two timing events."""
    from orchestra.driver import Event

    start, end = events or (Event(stream.device, timing=True), Event(stream.device, timing=True))
    samples = []
    try:
        for r in range(warmup + repeats):
            start.record(stream)
            op()
            end.record(stream)
            end.synchronize()
            if r >= warmup:
                samples.append(Event.elapsed_ms(start, end))
    finally:
        if events is None:
            start.close()
            end.close()
    return statistics.median(samples)


class BatchTimer:
    """Times one batch of ``nbytes`` on ``stream``: H2D from pinned ``host_in`` (a 1-D float32
    view of ``nbytes``), the kernel, D2H into pinned ``host_out``.

    ``kernel``: the `orchestra.kernel.Kernel` for burn; ``grid``/``block`` as in the job's graph.
    `close()` frees the device buffers and events.
    """

    def __init__(self, kernel, stream, host_in, host_out, *, grid: int, block: int,
                 repeats: int = 7, warmup: int = 2):
        from cuda.bindings import driver

        from orchestra.driver import DeviceBuffer, Event

        self._d = driver
        self.kernel, self.stream = kernel, stream
        self.host_in, self.host_out = host_in, host_out
        self.nbytes = host_in.nbytes
        self.n = self.nbytes // 4
        self.grid, self.block = grid, block
        self.repeats, self.warmup = repeats, warmup
        self.d_in = DeviceBuffer.allocate(self.nbytes, stream)
        self.d_out = DeviceBuffer.allocate(self.nbytes, stream)
        self.events = (Event(stream.device, timing=True), Event(stream.device, timing=True))

    def _time(self, op) -> float:
        return median_ms(op, self.stream, repeats=self.repeats, warmup=self.warmup,
                         events=self.events)

    def h2d_ms(self) -> float:
        return self._time(lambda: self.d_in.copy_from_host(self.host_in, self.stream))

    def d2h_ms(self) -> float:
        return self._time(lambda: self.d_out.copy_to_host(self.host_out, self.stream))

    def kernel_ms(self, iters: int) -> float:
        from orchestra.app.job.graphs import burn_scalars

        packed = self.kernel.pack([self.d_in.ptr, self.d_out.ptr, self.n, *burn_scalars(iters)])
        return self._time(lambda: self.kernel.launch(self.stream, self.grid, self.block, packed))

    def _copy_kernel(self, which="auto"):
        """The copy kernel (``cuda_src/copy.cu``) and its grid and block for ``nbytes``, or None
        where it cannot be loaded, for ``which=False``, and for ``"auto"`` where no executor
        would lower a copy of ``nbytes`` to it under ``"auto"`` (at or above every crossover
        of `orchestra.execute.copy_table.load_crossover`; large copies belong on the copy
        engines). ``which=True``: whatever the size (a run lowers its copies to it)."""
        from orchestra.errors import OrchestraError
        from orchestra.execute.copy_table import load_crossover
        from orchestra.execute.lowering.copy import copy_kernel_ref
        from orchestra.execute.lowering.copy_policy import COPY_BLOCK, MODES, copy_grid
        from orchestra.kernel import load_kernel

        if which is False:
            return None
        dev = self.stream.device
        try:
            cross = load_crossover(dev)
            if which == "auto" and self.nbytes >= max(
                    cross.threshold(m, d) for m in MODES for d in ("h2d", "d2h")):
                return None
            ref = copy_kernel_ref()  # the executors' copy kernel, as their lowering loads it
            k = load_kernel(ref.source, ref.name, params=ref.params, device=dev)
        except OrchestraError:
            return None
        return k, copy_grid(self.nbytes, dev.sm_count), COPY_BLOCK

    def sustained(self, items: int, iters: int, *, streams: int = 1,
                  copy_kernel: bool | str = "auto", launch: str = "stream") -> Sustained:
        """Sustained per-item times of ``items`` back-to-back items (`sustained.GatedTimer`):
        H2Ds, D2Hs, kernels at ``iters``, and H2D / D2H pairs at once.

        Each kind is timed on one stream and, when ``streams`` > 1, spread round-robin over
        that many (item i on stream i % streams; pairs: the H2Ds over ``streams`` streams, the
        D2Hs over as many others): the plan's concurrency, since small items overlap across
        streams (several copy engines, kernels smaller than the GPU, latency-bound copy
        kernels) as lane (round-robin) and concurrent plans let them. The faster of the two
        is the per-item rate (`Sustained.h2d_ms`, ...); the one-stream time alone is the
        time of one step of a batch's chain (`Sustained.h2d_chain_ms`, ...), which the
        bound's fill and drain terms use. Items on several streams write the same device or
        host buffer: harmless for timing, and the contents are not used.

        ``copy_kernel``: whether copies are also timed as the copy kernel, the faster
        mechanism counting (a bound is a lower bound only if no lowering the run uses beats
        it): ``"auto"`` (default) where ``"auto"`` lowering may pick it (below the largest
        crossover); True whatever the size (the run lowers its copies to it); False never
        (the run keeps every copy on the copy engines). The kernel's items each use their own
        host region (docs/execution.md, "Either copy mechanism"). ``Sustained.copies`` says
        which mechanism each copy time came from.

        ``launch`` (one of `LAUNCHES`): how the items are launched, as the run launches its
        work. ``"stream"`` (default; the eager executor): the K items enqueued on the streams
        behind the gate. ``"graph"`` (the capture and graph-build executors): the K items
        captured once into a CUDA graph on the same streams (item i on stream i % width: one
        chain per stream, `orchestra.driver.captured.CapturedGraph`), instantiated and
        uploaded, then the graph launched behind the gate (one untimed launch sizes the
        gate, one more warms up, the median of the timed ones counts), GPU time / K; the
        graph is destroyed before the next kind is timed, also when timing fails.
        ``"both"``: each kind both ways, the faster counting (a bound shared by eager and
        graph contenders). ``Sustained.launch`` records it; another value raises
        `JobConfigError`."""
        from orchestra.app.job.graphs import burn_scalars
        from orchestra.app.job.sustained import GatedTimer
        from orchestra.driver import Stream
        from orchestra.driver.captured import CapturedGraph

        check_launch(launch)
        K = max(1, int(items))
        S = max(1, min(int(streams), K))
        s = self.stream
        h_in, h_out, d_in, d_out = self.host_in, self.host_out, self.d_in, self.d_out
        packed = self.kernel.pack([d_in.ptr, d_out.ptr, self.n, *burn_scalars(iters)])
        kern, grid, block = self.kernel, self.grid, self.block
        gated = GatedTimer(s, repeats=max(3, self.repeats - 2), warmup=1)
        extra = [Stream(s.device) for _ in range(2 * S - 1)]
        lanes = [s, *extra[:S - 1]]  # S streams, the timer's first
        down = extra[S - 1:]         # S more, for the D2H side of pairs

        def h2ds(width):
            def run():
                for i in range(K):
                    d_in.copy_from_host(h_in, lanes[i % width])
            return run

        def d2hs(width):
            def run():
                for i in range(K):
                    d_out.copy_to_host(h_out, lanes[i % width])
            return run

        def kernels(width):
            def run():
                for i in range(K):
                    kern.launch(lanes[i % width], grid, block, packed)
            return run

        def pairs(width):
            def run():
                for i in range(K):
                    d_in.copy_from_host(h_in, lanes[i % width])
                    d_out.copy_to_host(h_out, down[i % width])
            return run

        def timed(make, width, others_of) -> float:
            """GPU ms of the K items ``make(width)`` enqueues, launched as ``launch`` says."""
            run, others = make(width), others_of(width)
            times = []
            if launch != "graph":
                times.append(gated.median_ms(run, others))
            if launch != "stream":
                # captured on the very streams, so the graph has one chain per stream
                with CapturedGraph(s, run, others) as graph:
                    times.append(gated.median_ms(graph.launch))
            return min(times)

        def both(make, others_of):
            """(per item on one stream, per item at the best of 1 and S streams)."""
            one = timed(make, 1, others_of) / K
            if S == 1:
                return one, one
            return one, min(one, timed(make, S, others_of) / K)

        ck = self._copy_kernel(copy_kernel)
        if launch != "stream":  # the launch checks now, not first inside a capture
            kern.launch_config(grid, block)
            if ck is not None:
                ck[0].launch_config(ck[1], ck[2])
        spans = []  # the copy kernels' own pinned host memory, one region per item
        kh2ds = kd2hs = kpairs = None  # the copy-kernel variants, where the kernel applies
        if ck is not None:
            from orchestra.driver import PinnedBuffer

            ckern, cgrid, cblock = ck
            nb = self.nbytes
            # Each item its own host region, as in a pipeline: the SMs reach host memory
            # through L2, so items re-reading or re-writing one region (the copy engines'
            # timing above does) would be served by L2 and beat the link.
            spans = [PinnedBuffer.empty(K * nb, np.uint8, s.device) for _ in range(2)]
            hin, hout = (int(b.array.ctypes.data) for b in spans)
            # dst, src, bytes, system fence: none, also for the D2Hs. The executors fence a
            # D2H copy kernel only in graphs with host functions (CopyPolicy.d2h_system_fence;
            # the job's generated graph has none), and the fence only slows a copy (1.43 ->
            # 3.25 us at 64 KiB on an H200): timed without it, the time is a lower bound for
            # both. The bytes themselves are never read.
            ups = [ckern.pack([d_in.ptr, hin + i * nb, nb, 0]) for i in range(K)]
            dns = [ckern.pack([hout + i * nb, d_out.ptr, nb, 0]) for i in range(K)]

            def kh2ds(width):
                def run():
                    for i in range(K):
                        ckern.launch(lanes[i % width], cgrid, cblock, ups[i])
                return run

            def kd2hs(width):
                def run():
                    for i in range(K):
                        ckern.launch(lanes[i % width], cgrid, cblock, dns[i])
                return run

            def kpairs(width):
                def run():
                    for i in range(K):
                        ckern.launch(lanes[i % width], cgrid, cblock, ups[i])
                        ckern.launch(down[i % width], cgrid, cblock, dns[i])
                return run

        def fastest(engine, kernel, others):
            """(chain time, rate time, which mechanism the rate came from): each the faster
            of the copy engines and the copy kernel."""
            one, rate = both(engine, others)
            if kernel is None:
                return one, rate, "copy engine"
            kone, krate = both(kernel, others)
            return (min(one, kone), *((krate, "copy kernel") if krate < rate
                                      else (rate, "copy engine")))

        try:
            c_h, t_h, by_h = fastest(h2ds, kh2ds, lambda w: lanes[1:w])
            c_d, t_d, by_d = fastest(d2hs, kd2hs, lambda w: lanes[1:w])
            c_k, t_k = both(kernels, lambda w: lanes[1:w])
            _, t_p, by_p = fastest(pairs, kpairs, lambda w: lanes[1:w] + down[:w])
        finally:
            gated.close()
            for e in extra:
                e.synchronize()
                e.close()
            s.synchronize()
            for b in spans:
                b.close()
        return Sustained(self.nbytes, K, t_h, t_k, t_d, t_p, S,
                         copies=f"H2D by {by_h}, D2H by {by_d}, pair by {by_p}",
                         h2d_chain_ms=c_h, kernel_chain_ms=c_k, d2h_chain_ms=c_d,
                         launch=launch)

    def measure(self, iters: int | None, *, items: int | None = None,
                streams: int = 1, copy_kernel: bool | str = "auto",
                launch: str = "stream") -> SingleBatch:
        """Time H2D and D2H alone, then the kernel at ``iters`` (None: calibrate to the slower
        copy alone); with ``items``, the sustained times of that many back-to-back items too,
        on one stream and on ``streams`` (`sustained`, with ``copy_kernel`` and ``launch``).
        A bad ``launch`` raises `JobConfigError` before anything is timed."""
        check_launch(launch)
        self.d_in.copy_from_host(self.host_in, self.stream, sync=True)
        t_h2d, t_d2h = self.h2d_ms(), self.d2h_ms()
        if iters is None:
            iters, _ = calibrate_iters(self.kernel_ms, max(t_h2d, t_d2h))
        t_k = self.kernel_ms(iters)
        sus = None
        if items:
            sus = self.sustained(items, iters, streams=streams, copy_kernel=copy_kernel,
                                 launch=launch)
        return SingleBatch(self.nbytes, int(iters), t_h2d, t_k, t_d2h, self.repeats, sus)

    def close(self) -> None:
        self.stream.synchronize()
        self.d_in.close()
        self.d_out.close()
        for e in self.events:
            e.close()
        self.stream.synchronize()

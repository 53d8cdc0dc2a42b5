"""Single-batch timings with timing events, and the choice of ``--compute-iters``.

Each of H2D, kernel and D2H is timed alone (nothing else on the GPU): a timing event before and
after it on one stream, ``cuEventElapsedTime``, median of ``repeats`` after ``warmup`` runs.
These are the numbers the bound ``t_h2d + N * max(t_h2d, t_kernel, t_d2h) + t_d2h`` uses.

``--compute-iters auto`` (the default) calibrates the kernel to the slower copy: the kernel's
time is affine in ``iters`` (a fixed part plus the per-iteration FMAs), so two probe launches
give the line, one more launch at the predicted count corrects it (`calibrate_iters`).
"""

from __future__ import annotations

import statistics
from typing import Callable

import attrs

from orchestra.errors import JobConfigError

PROBES = (64, 512)
MAX_ITERS = 1 << 20


@attrs.frozen
class SingleBatch:
    """Median single-batch times (ms) of ``nbytes`` bytes, and the kernel's ``iters``."""

    nbytes: int
    iters: int
    t_h2d_ms: float
    t_kernel_ms: float
    t_d2h_ms: float
    repeats: int
    t_duplex_ms: float | None = None  # per batch, H2Ds of nbytes while D2Hs of nbytes run

    @property
    def t_max_ms(self) -> float:
        return max(self.t_h2d_ms, self.t_kernel_ms, self.t_d2h_ms)

    def bound_ms(self, batches: float) -> float:
        """``t_h2d + N * max(t_h2d, t_kernel, t_d2h) + t_d2h`` (fill-aware ideal)."""
        return self.t_h2d_ms + batches * self.t_max_ms + self.t_d2h_ms

    def duplex_bound_ms(self, batches: float) -> float | None:
        """The same bound with each steady-state step costing at least ``t_duplex`` (and at least
        the plain bound's step, should a noisy ``t_duplex`` come in lower): in a full
        pipeline batch b's H2D runs while batch b-2's D2H does, and the link moves both
        directions at once more slowly than either alone (PCIe duplex contention). What the
        hardware allows; None when not measured."""
        if self.t_duplex_ms is None:
            return None
        step = max(self.t_duplex_ms, self.t_max_ms)  # never below the plain bound
        return self.t_h2d_ms + batches * step + self.t_d2h_ms


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

    def duplex_ms(self, pairs: int = 4) -> float:
        """The time per batch of ``pairs`` H2Ds (on the timer's stream) running while as many
        D2Hs run (on a second stream forked from it with an event and joined back): what one
        pipeline step costs the link once both directions are busy."""
        from orchestra.driver import Event, Stream

        with Stream(self.stream.device) as other, Event(self.stream.device) as fork, \
                Event(self.stream.device) as join:
            def both():
                fork.record(self.stream)
                other.wait(fork)
                for _ in range(pairs):
                    self.d_in.copy_from_host(self.host_in, self.stream)
                    self.d_out.copy_to_host(self.host_out, other)
                join.record(other)
                self.stream.wait(join)

            return self._time(both) / pairs

    def measure(self, iters: int | None) -> SingleBatch:
        """Time H2D and D2H alone and at once, then the kernel at ``iters`` (None: calibrate
        to the slower copy alone)."""
        self.d_in.copy_from_host(self.host_in, self.stream, sync=True)
        t_h2d, t_d2h = self.h2d_ms(), self.d2h_ms()
        t_duplex = self.duplex_ms()
        if iters is None:
            iters, _ = calibrate_iters(self.kernel_ms, max(t_h2d, t_d2h))
        t_k = self.kernel_ms(iters)
        return SingleBatch(self.nbytes, int(iters), t_h2d, t_k, t_d2h, self.repeats, t_duplex)

    def close(self) -> None:
        self.stream.synchronize()
        self.d_in.close()
        self.d_out.close()
        for e in self.events:
            e.close()
        self.stream.synchronize()

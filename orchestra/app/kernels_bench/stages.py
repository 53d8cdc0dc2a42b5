"""``orchestra bench stages``: the block-scope unified pipeline (cuda_src/pipeline_block.cu) at
1, 2, 3 and 4 stages against a device-to-device copy of the same bytes, in one run.

For each stage count: kernel time (median of ``repeats`` launches, each timed with its own pair
of timing events, after ``warmup`` untimed rounds), bandwidth (bytes read + bytes written over
the kernel time), percent of the copy's bandwidth (``cuMemcpyDtoDAsync`` of the same bytes,
also reads + writes) and occupancy (``cuOccupancyMaxActiveBlocksPerMultiprocessor``). Rounds are
interleaved - copy, 1, 2, 3, 4 stages, copy, ... - so every contender sees the same clocks and
the same memory state. The launch grid is persistent: SM count x occupancy blocks, each walking
its tiles grid-stride. The output is checked bit for bit after the runs of each stage count.

The CUDA Programming Guide asks for stage counts to be compared, not assumed: the table is that
comparison. Goal: the best stage count reaches >= 85% of the copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from orchestra.errors import BenchConfigError, UnsupportedDeviceError
from orchestra.app.kernels_bench import catalog as cat
from orchestra.app.kernels_bench.common import check_buffer, fill_pattern, median, pattern

GOAL_PERCENT = 85.0
A, B = 1.5, -0.5  # y = A * x + B: exact in float32 for the fill pattern


@attrs.frozen
class StageResult:
    stages: int
    ms: float
    gbps: float
    percent_of_copy: float
    blocks_per_sm: int
    grid: int
    block: int
    shared_mem: int
    verified: bool
    detail: str


@attrs.frozen
class StagesReport:
    device: str
    mib: int
    floats: int
    bytes_moved: int  # read + written per launch
    repeats: int
    copy_ms: float
    copy_gbps: float
    results: tuple

    @property
    def best(self) -> StageResult:
        return max(self.results, key=lambda r: r.gbps)

    @property
    def goal_met(self) -> bool:
        return self.best.percent_of_copy >= GOAL_PERCENT

    @property
    def verified(self) -> bool:
        return all(r.verified for r in self.results)

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d["results"] = [attrs.asdict(r) for r in self.results]
        d.update(best_stages=self.best.stages, best_percent_of_copy=self.best.percent_of_copy,
                 goal_percent=GOAL_PERCENT, goal_met=self.goal_met, verified=self.verified)
        return d


def run_stages(*, mib: int = 1024, block: int = 256, repeats: int = 20, warmup: int = 3,
               device=None, stage_counts=cat.STAGE_COUNTS,
               progress: Callable[[str, int, int], None] | None = None) -> StagesReport:
    """Measure (see the module doc). ``mib``: MiB read (and as many written) per launch.
    ``progress(stage, done, total)`` is called before each round (a progress bar)."""
    from cuda.bindings import driver

    from orchestra.driver import Device, DeviceBuffer, Event, Stream, cu

    if mib < 1 or repeats < 1 or warmup < 0:
        raise BenchConfigError("need mib >= 1, repeats >= 1, warmup >= 0")
    if block % 32 or not 32 <= block <= 1024:
        raise BenchConfigError(f"block must be a multiple of 32 in 32..1024, got {block}")
    dev = device if isinstance(device, Device) else Device.get(device or 0)
    dev.make_current()
    stream = Stream(dev)
    n = mib * (1 << 20) // 4
    nbytes = 4 * n
    x = DeviceBuffer.allocate(nbytes, stream)
    y = DeviceBuffer.allocate(nbytes, stream)
    try:
        fill_pattern(x, n, stream, dev)

        contenders: list[tuple[Any, Callable[[], Any]]] = []  # (label, enqueue function)
        copy = ("copy", lambda: cu(driver.cuMemcpyDtoDAsync, y.handle, x.handle, nbytes,
                                   stream.handle))
        contenders.append(copy)
        configs = {}
        for s in stage_counts:
            k = cat.load(f"pipeline_block<{s}>", dev)
            smem = cat.pipeline_block_smem(s, block)
            occ = k.occupancy(block, smem)
            if occ < 1:
                raise UnsupportedDeviceError(
                    f"pipeline_block<{s}> cannot run {block} threads with {smem}"
                    " bytes of shared memory on this device")
            grid = occ * dev.sm_count
            args = k.pack((x, y, n, A, B))
            configs[s] = (occ, grid, smem)
            contenders.append((s, functools.partial(k.launch, stream, grid, block, args, smem)))

        events = [(Event(dev, timing=True), Event(dev, timing=True)) for _ in contenders]
        times: dict = {label: [] for label, _ in contenders}
        for rnd in range(warmup + repeats):
            if progress is not None:
                progress("warm-up round" if rnd < warmup else "timed round", rnd,
                         warmup + repeats)
            for (label, enqueue), (start, end) in zip(contenders, events):
                start.record(stream)
                enqueue()
                end.record(stream)
            stream.synchronize()
            if rnd >= warmup:
                for (label, _), (start, end) in zip(contenders, events):
                    times[label].append(Event.elapsed_ms(start, end))

        copy_ms = median(times["copy"])
        copy_gbps = 2 * nbytes / (copy_ms * 1e-3) / 1e9
        results = []
        for s in stage_counts:
            # Check this stage count's output on its own: clear y, one more launch, compare.
            occ, grid, smem = configs[s]
            y.memset(0, stream)
            dict(contenders)[s]()
            stream.synchronize()
            ok, detail = check_buffer(y, n, lambda st, c: (np.float32(A) * pattern(st, c)
                                                          + np.float32(B)), stream, dev)
            ms = median(times[s])
            gbps = 2 * nbytes / (ms * 1e-3) / 1e9
            results.append(StageResult(s, ms, gbps, 100.0 * gbps / copy_gbps, occ, grid, block,
                                       smem, ok, detail))
        for pair in events:
            for e in pair:
                e.close()
    finally:
        x.free()
        y.free()
        stream.synchronize()
        stream.close()
    return StagesReport(dev.name, mib, n, 2 * nbytes, repeats, copy_ms, copy_gbps,
                        tuple(results))

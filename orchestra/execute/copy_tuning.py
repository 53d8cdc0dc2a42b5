"""Measure where host copies stop being worth a copy kernel on this device (needs a GPU).

    report = measure_copy_crossover()          # ``orchestra tune copies``; about 10-20 s
    report.crossover                            # the CopyCrossover, saved for this device

What it measures, per executor mode (``graph``: a CUDA graph built with `GraphBuildExecutor`
and launched; ``eager``: `EagerExecutor` runs) and per copy size (4 KiB - 4 MiB; ``quick``:
4 KiB, 64 KiB, 1 MiB): the main job's pipeline (`build_pipeline`: per batch H2D -> burn kernel
with 1 iteration -> D2H, scheduled by-engine on 3 streams; 256 batches up to 64 KiB, 64 up to
1 MiB, 16 at 4 MiB, so copies overlap in both directions as they do in real work), four ways:
every copy on the copy engines, the H2D copies as copy kernels, the D2H copies as copy
kernels, every copy as a copy kernel. The variants take turns, run by run, ``repeats`` runs each after two warm-ups; the
wall time per run (launch or enqueue until the synchronize returns, host and GPU together) is
the median. Every variant's output is checked once against numpy (the outputs poisoned with
NaN first).

The crossover of a direction is the smallest size from which the copy engines are no slower
(within `MARGIN`) at it and at every larger size measured, comparing the best variant with
that direction on the copy engines against the best with it as copy kernels
(`direction_times`); copies below it become copy kernels
under ``copy_lowering="auto"``. When the copy engines win even at the smallest size the
crossover is 0 (never a kernel); when the kernels win at every size it is twice the largest
size measured. `save` (default) stores the table in orchestra's cache for this device
(`copy_table.save_crossover`): every later executor on this device uses it.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import attrs
import numpy as np

from orchestra.execute.copy_table import load_crossover, save_crossover
from orchestra.execute.lowering.copy_policy import CopyCrossover, fmt_bytes

KIB, MIB = 1 << 10, 1 << 20
SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
QUICK_SIZES = (4 * KIB, 64 * KIB, 1 * MIB)
MARGIN = 0.03
"""A copy kernel must be at least 3% faster than the copy engines to be chosen (timing noise
must not move the crossover)."""
VARIANTS = ("copy-engine", "h2d-kernel", "d2h-kernel", "both-kernel")
BURN_PARAMS = ("const float* x", "float* y", "size_t n", "int iters", "float s", "float t")


def batches_for(size: int) -> int:
    """Batches per pipeline for copies of ``size`` bytes: 256 up to 64 KiB, 64 up to 1 MiB,
    else 16. Small copies need many batches for a run to last milliseconds: a run of 64
    x 4 KiB (a few hundred µs) is dominated by the launch and the first copies' latency,
    where the sustained rate a real pipeline lives on decides nothing."""
    if size <= 64 * KIB:
        return 256
    return 64 if size <= MIB else 16


@attrs.frozen
class CrossoverRow:
    """One (mode, size): the median wall ms of each variant (`VARIANTS`) and whether every
    variant's output was right.

    Immutable (frozen), but ``ms`` is a plain dict: may be shared between threads freely as long as
    nobody modifies it.
    """

    mode: str
    size: int
    batches: int
    ms: dict
    verified: bool

    def as_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class CrossoverReport:
    """What `measure_copy_crossover` found: ``crossover`` (the `CopyCrossover`), ``rows``,
    ``seconds`` (how long it took), ``saved`` (the cache entry's path, or None), ``device``.

    Immutable (frozen): may be shared between threads freely.
    """

    device: str
    crossover: CopyCrossover
    rows: tuple
    seconds: float
    saved: str | None
    verified: bool

    def as_dict(self) -> dict:
        return {"device": self.device, "crossover": self.crossover.as_dict(),
                "rows": [r.as_dict() for r in self.rows], "seconds": self.seconds,
                "saved": self.saved, "verified": self.verified}


def crossover_size(sizes, engine_ms: dict, kernel_ms: dict, margin: float = MARGIN) -> int:
    """The crossover (bytes) from per-size median times (see the module doc): the smallest
    size from which ``engine_ms[s] <= kernel_ms[s] * (1 + margin)`` holds for it and every
    larger size; 0 when that is the smallest size; ``2 * max(sizes)`` when the copy engines
    never win. Sizes missing a time are skipped."""
    both = [s for s in sorted(sizes) if s in engine_ms and s in kernel_ms]
    if not both:
        return 0
    cross = None
    for s in reversed(both):
        if engine_ms[s] <= kernel_ms[s] * (1 + margin):
            cross = s
        else:
            break
    if cross is None:
        return 2 * both[-1]
    return 0 if cross == both[0] else cross


def with_lowering(graph, h2d: str = "auto", d2h: str = "auto"):
    """A copy of ``graph`` whose H2D / D2H nodes say ``lowering=h2d`` / ``d2h``."""
    from orchestra.graph import TaskGraph

    out = TaskGraph()
    for node in graph.nodes:
        if node.kind == "h2d":
            node = attrs.evolve(node, lowering=h2d)
        elif node.kind == "d2h":
            node = attrs.evolve(node, lowering=d2h)
        out.add(node)
    return out


_LOWERINGS = {"copy-engine": ("copy-engine", "copy-engine"),
              "h2d-kernel": ("kernel", "copy-engine"),
              "d2h-kernel": ("copy-engine", "kernel"),
              "both-kernel": ("kernel", "kernel")}


def direction_times(ms_by_size: dict, direction: str) -> tuple[dict, dict]:
    """Per size, the best wall ms with ``direction``'s copies on the copy engines and the
    best with them as copy kernels, over the variants (the other direction either way):
    ``(engine_ms, kernel_ms)`` for `crossover_size`. Deciding each direction with the other
    left on the engines misses that a graph with no memcpy node at all launches for about
    nothing (every memcpy node costs 1.3-1.9 µs of host time at every launch)."""
    as_kernel = {"h2d": ("h2d-kernel", "both-kernel"), "d2h": ("d2h-kernel", "both-kernel")}
    kern = as_kernel[direction]
    engine, kernel = {}, {}
    for size, ms in ms_by_size.items():
        e = [t for v, t in ms.items() if v not in kern]
        k = [t for v, t in ms.items() if v in kern]
        if e and k:
            engine[size], kernel[size] = min(e), min(k)
    return engine, kernel


def _pipeline(size: int, batches: int):
    from orchestra.compiler.sources import kernel_source_dir
    from orchestra.graph import HostBuffer, KernelRef, build_pipeline

    burn = KernelRef(str(kernel_source_dir() / "burn.cu"), "burn", params=BURN_PARAMS)
    total = size * batches
    g, _ = build_pipeline(batches, size, burn, scalars=(1, 0.5, 1.0), in_flight=8,
                          host_in=HostBuffer("host_in", total),
                          host_out=HostBuffer("host_out", total))
    return g


def _interleaved_ms(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Median wall ms of each of ``fns`` (name -> callable that runs and waits), the
    variants taking turns run by run so that clock and thermal drift reach all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter_ns()
            fn()
            times[k].append((time.perf_counter_ns() - t0) / 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def measure_copy_crossover(device=None, *, sizes=None, quick: bool = False, repeats: int = 7,
                           modes=("graph", "eager"), save: bool = True,
                           progress: Callable[[str, int, int], None] | None = None
                           ) -> CrossoverReport:
    """Measure the copy-lowering crossover of ``device`` (a `Device`, ordinal or None: device
    0); see the module doc for what runs. ``sizes``: copy sizes in bytes (default `SIZES`,
    ``quick``: `QUICK_SIZES`); ``modes``: which crossovers to measure (the other keeps the
    table's current value); ``save``: store the result for the device. ``progress(what, done,
    total)`` is called per variant. Returns a `CrossoverReport`. Raises `NoDeviceError`
    without a GPU, `CudaError` / `CompileError` as the executors do."""
    from orchestra.driver import Device, PinnedBuffer
    from orchestra.execute.cuda_graph.build import GraphBuildExecutor
    from orchestra.execute.eager import EagerExecutor
    from orchestra.execute.kernels import KernelResolver

    t_start = time.perf_counter()
    dev = device if isinstance(device, Device) else Device.get(device or 0)
    dev.make_current()
    sizes = tuple(sorted(sizes or (QUICK_SIZES if quick else SIZES)))
    modes = tuple(modes)
    resolver = KernelResolver(dev)
    rows = []
    total = len(sizes) * len(modes) * len(VARIANTS)
    done = 0
    rng = np.random.default_rng(0)
    graph_ex = GraphBuildExecutor(dev, kernel_resolver=resolver)
    eager_ex = EagerExecutor(dev, kernel_resolver=resolver)
    try:
        for size in sizes:
            batches = batches_for(size)
            n = size * batches // 4
            pin_in = PinnedBuffer.empty(n, np.float32, dev)
            pin_out = PinnedBuffer.empty(n, np.float32, dev)
            x, y = pin_in.array, pin_out.array
            x[:] = rng.standard_normal(n).astype(np.float32)
            want = x * np.float32(0.5) + np.float32(1)
            base = _pipeline(size, batches)
            bind = {"host_in": x, "host_out": y}
            graphs = {v: with_lowering(base, *_LOWERINGS[v]) for v in VARIANTS}
            try:
                for mode in modes:
                    runs, execs = {}, []
                    try:
                        for v, g in graphs.items():
                            if mode == "graph":
                                exe = graph_ex.build(g, bindings=bind)
                                execs.append(exe)
                                runs[v] = functools.partial(exe.launch, sync=True)
                            else:
                                plan = eager_ex.prepare(g, policy="by-engine", streams=3)
                                runs[v] = functools.partial(eager_ex.run, g, plan, bind)
                        ms = _interleaved_ms(runs, repeats)
                        ok = True
                        for v in VARIANTS:  # each variant's output, poisoned first
                            y[:] = np.nan
                            runs[v]()
                            ok = ok and bool(np.array_equal(y, want))
                            done += 1
                            if progress is not None:
                                progress(f"{mode} {fmt_bytes(size)} {v}", done, total)
                    finally:
                        for exe in execs:
                            exe.close()
                    rows.append(CrossoverRow(mode, size, batches, ms, ok))
            finally:
                pin_in.close()
                pin_out.close()
    finally:
        graph_ex.close()
        eager_ex.close()
    old = load_crossover(dev)
    values = old.as_dict()
    for mode in modes:
        mine = {r.size: r.ms for r in rows if r.mode == mode}
        for direction in ("h2d", "d2h"):
            engine, kernel = direction_times(mine, direction)
            values[f"{mode}_{direction}"] = crossover_size(sizes, engine, kernel)
    verified = all(r.verified for r in rows)
    stamp = time.strftime("%Y-%m-%d")
    table = CopyCrossover(values["graph_h2d"], values["graph_d2h"], values["eager_h2d"],
                          values["eager_d2h"], f"measured {stamp} on {dev.name}",
                          {"rows": [r.as_dict() for r in rows]})
    saved = None
    if save and verified:  # a wrong output measures nothing worth keeping
        path = save_crossover(dev, table)
        saved = None if path is None else str(path)
    return CrossoverReport(dev.name, table, tuple(rows), time.perf_counter() - t_start, saved,
                           verified)


__all__ = ["CrossoverReport", "CrossoverRow", "MARGIN", "QUICK_SIZES", "SIZES", "VARIANTS",
           "batches_for", "crossover_size", "direction_times", "measure_copy_crossover", "with_lowering"]

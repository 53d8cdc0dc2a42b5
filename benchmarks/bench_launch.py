"""Host cost of compiling/loading and launching kernels (needs a GPU).

    python benchmarks/bench_launch.py [--launches 10000] [--repeats 5]

Prints one table:

* cache-hit compile + load: ``load_kernel`` with a warm on-disk cache and an empty in-process
  memo (source hash, cache read, ``cuLibraryLoadData``, kernel lookup), ms;
* host microseconds per launch of a tiny kernel on a non-blocking stream, timed with
  ``time.perf_counter_ns`` around batches of 500 launches (the stream is drained between
  batches, outside the timed region, so the launch queue never fills and back-pressure never
  shows up as host time):
    - bare ``cuLaunchKernel`` with prepacked arguments (the floor),
    - ``Kernel.launch`` with prepacked `PackedArgs` (goal: within 0.3 us of the bare call; the
      very stream, dimensions and arguments again: the remembered call),
    - ``Kernel.launch`` with the very tuple of plain values (int addresses, ints) every launch
      (packed once, then the remembered call),
    - ``Kernel.launch`` with a list of arguments packed on every launch.

The loops take turns batch by batch (``--launches / 500`` batches of each per repeat, the order
rotated every turn), so host drift and the neighbours' load hit them alike. Each row is the
median per-batch time; an overhead is the median of the per-turn differences to the bare batch
of the same turn (paired, so the drift cancels), with its interquartile range: on a shared
host a loop's time varies by +-1 us from one batch to the next, more than the overhead sought.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

try:
    import orchestra  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCH = 500


def _batch_us(fn, count: int, stream) -> float:
    """µs per launch of one batch of ``count`` calls of ``fn``; the stream drained after."""
    t0 = time.perf_counter_ns()
    for _ in range(count):
        fn()
    t = time.perf_counter_ns() - t0
    stream.synchronize()
    return t / count / 1000.0


def interleaved_batches(loops, launches: int, repeats: int, stream) -> dict:
    """Per-batch µs per launch of each of ``loops``, taking turns batch by batch (the order
    rotated each turn): ``{fn: [µs, ...]}``, one entry per turn, turn ``i`` of every loop
    measured back to back."""
    turns = repeats * max(1, launches // BATCH)
    per: dict = {fn: [] for fn in loops}
    for i in range(turns):
        k = i % len(loops)
        for fn in loops[k:] + loops[:k]:
            per[fn].append(_batch_us(fn, BATCH, stream))
    return per


def paired(per: dict, fn, base) -> tuple[float, float, float]:
    """Median and interquartile range (µs) of ``fn``'s per-turn time minus ``base``'s."""
    d = [a - b for a, b in zip(per[fn], per[base])]
    q = statistics.quantiles(d, n=4)
    return statistics.median(d), q[0], q[2]


def _iqr(o) -> str:
    return f"{o[0]:9.3f} us  (IQR {o[1]:.3f} to {o[2]:.3f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    from cuda.bindings import driver

    from orchestra.compiler import load_kernel
    from orchestra.kernel.module import clear_memo
    from orchestra.driver import Device, DeviceBuffer, Stream
    from orchestra.errors import NoDeviceError

    try:
        dev = Device.get(0)
    except NoDeviceError as exc:
        print(f"bench_launch: {exc}", file=sys.stderr)
        return 2
    dev.make_current()
    stream = Stream(dev)

    load_kernel("vector_add.cu", "vector_add", device=dev)  # warm the on-disk cache
    load_ms = []
    for _ in range(args.repeats):
        clear_memo()
        t0 = time.perf_counter_ns()
        kernel = load_kernel("vector_add.cu", "vector_add", device=dev)
        load_ms.append((time.perf_counter_ns() - t0) / 1e6)

    n = 1024
    a = DeviceBuffer.allocate(n * 4, stream)
    c = DeviceBuffer.allocate(n * 4, stream)
    a.memset(0, stream)
    values = [a, a, c, n]
    packed = kernel.pack(values)
    plain = (a.ptr, a.ptr, c.ptr, n)
    grid, block = 4, 256
    func, handle, address = kernel.function, stream.handle, packed.address
    launch = driver.cuLaunchKernel

    def bare():
        (err,) = launch(func, 4, 1, 1, 256, 1, 1, 0, handle, address, 0)
        if err:
            raise RuntimeError(f"cuLaunchKernel: {err!r}")

    def prepacked():
        kernel.launch(stream, grid, block, packed)

    def same_tuple():
        kernel.launch(stream, grid, block, plain)

    def repacked():
        kernel.launch(stream, grid, block, values)

    loops = (bare, prepacked, same_tuple, repacked)
    for fn in loops:  # warm up (config checks, caches)
        for _ in range(100):
            fn()
    stream.synchronize()

    per = interleaved_batches(loops, args.launches, args.repeats, stream)
    t_bare, t_pre, t_tuple, t_re = (statistics.median(per[fn]) for fn in loops)
    o_pre, o_tuple, o_re = (paired(per, fn, bare) for fn in (prepacked, same_tuple, repacked))

    rows = [
        ("cache-hit compile + load (load_kernel)", f"{statistics.median(load_ms):9.3f} ms"),
        ("bare cuLaunchKernel, prepacked args", f"{t_bare:9.3f} us/launch"),
        ("Kernel.launch, PackedArgs", f"{t_pre:9.3f} us/launch"),
        ("Kernel.launch, the same tuple of plain values", f"{t_tuple:9.3f} us/launch"),
        ("Kernel.launch, args packed each time", f"{t_re:9.3f} us/launch"),
        ("overhead over bare (PackedArgs), paired", _iqr(o_pre)
         + ("  [goal <= 0.3 us: PASS]" if o_pre[0] <= 0.3 else "  [goal <= 0.3 us: MISS]")),
        ("overhead over bare (the same tuple), paired", _iqr(o_tuple)),
        ("packing cost per launch (over bare), paired", _iqr(o_re)),
    ]
    print(f"device: {dev.name} ({dev.arch}); {args.launches} launches x {args.repeats} repeats"
          f" in batches of {BATCH}, taking turns; medians per batch; kernel vector_add, grid "
          f"{grid}, block {block}")
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value}")

    stream.synchronize()
    a.free()
    c.free()
    stream.synchronize()
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

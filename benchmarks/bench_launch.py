"""Host cost of compiling/loading and launching kernels (needs a GPU).

    python benchmarks/bench_launch.py [--launches 10000] [--repeats 5]

Prints one table:

* cache-hit compile + load: ``load_kernel`` with a warm on-disk cache and an empty in-process
  memo (source hash, cache read, ``cuLibraryLoadData``, kernel lookup), ms;
* host microseconds per launch, median over ``--repeats`` runs of ``--launches`` launches of a
  tiny kernel on a non-blocking stream, timed with ``time.perf_counter_ns`` around the launch
  loops only (the stream is drained between batches of 500, outside the timed region, so the
  launch queue never fills and back-pressure never shows up as host time):
    - bare ``cuLaunchKernel`` with prepacked arguments (the floor),
    - ``Kernel.launch`` with prepacked `PackedArgs` (goal: within 0.3 us of the bare call; the
      very stream, dimensions and arguments again: the remembered call),
    - ``Kernel.launch`` with the very tuple of plain values (int addresses, ints) every launch
      (packed once, then the remembered call),
    - ``Kernel.launch`` with a list of arguments packed on every launch.

The launch loops run in turns, ``--repeats`` rounds of each, so drift hits them alike.
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


def _median_us_per_launch(fn, launches: int, repeats: int, stream) -> float:
    per = []
    for _ in range(repeats):
        total = 0
        done = 0
        while done < launches:
            count = min(BATCH, launches - done)
            t0 = time.perf_counter_ns()
            for _ in range(count):
                fn()
            total += time.perf_counter_ns() - t0
            stream.synchronize()
            done += count
        per.append(total / launches / 1000.0)
    return statistics.median(per)


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

    per: dict = {fn: [] for fn in loops}
    for _ in range(args.repeats):  # in turns: the same drift for every loop
        for fn in loops:
            per[fn].append(_median_us_per_launch(fn, args.launches, 1, stream))
    t_bare, t_pre, t_tuple, t_re = (statistics.median(per[fn]) for fn in loops)

    rows = [
        ("cache-hit compile + load (load_kernel)", f"{statistics.median(load_ms):9.3f} ms"),
        ("bare cuLaunchKernel, prepacked args", f"{t_bare:9.3f} us/launch"),
        ("Kernel.launch, PackedArgs", f"{t_pre:9.3f} us/launch"),
        ("Kernel.launch, the same tuple of plain values", f"{t_tuple:9.3f} us/launch"),
        ("Kernel.launch, args packed each time", f"{t_re:9.3f} us/launch"),
        ("overhead over bare (PackedArgs)", f"{t_pre - t_bare:9.3f} us"
         + ("  [goal <= 0.3 us: PASS]" if t_pre - t_bare <= 0.3 else "  [goal <= 0.3 us: MISS]")),
        ("overhead over bare (the same tuple)", f"{t_tuple - t_bare:9.3f} us"),
        ("packing cost per launch", f"{t_re - t_pre:9.3f} us"),
    ]
    print(f"device: {dev.name} ({dev.arch}); {args.launches} launches x {args.repeats} repeats,"
          f" medians; kernel vector_add, grid {grid}, block {block}")
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

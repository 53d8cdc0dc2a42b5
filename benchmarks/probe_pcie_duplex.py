"""PCIe duplex probe (GPU): how fast H2D runs while D2H runs, for several kinds of pinned memory.

    python benchmarks/probe_pcie_duplex.py [--copies 8] [--mib 64]

Times, with timing events (median of 7 after a warm-up), ``--copies`` back-to-back copies of
``--mib`` MiB: H2D alone, D2H alone, both directions at once on two streams, and H2D split in 2
or 4 parts over two streams while D2H runs; for host memory from ``cuMemHostAlloc`` (portable),
``cuMemHostAlloc`` write-combined, and transparent-huge-page memory registered with
``cuMemHostRegister``; then H2D done by the SMs (a copy kernel reading mapped pinned memory),
alone and with D2H running. This is what the main job's "duplex bound" stands on
(docs/execution.md): the first three lines show whether any host memory kind moves both
directions at once faster.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

try:
    import orchestra  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuda.bindings import driver as d

from orchestra.compiler import load_kernel
from orchestra.driver import Device, DeviceBuffer, Event, Stream, cu

PULL = r'''extern "C" __global__ void pull(const float4* __restrict__ x, float4* __restrict__ y,
                                  size_t n4) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
       i += (size_t)blockDim.x * gridDim.x) y[i] = x[i];
}'''
HUGE = 2 << 20


def host_alloc(nbytes: int, flags: int):
    p = int(cu(d.cuMemHostAlloc, nbytes, flags))
    return p, lambda: cu(d.cuMemFreeHost, p)


def thp_register(nbytes: int):
    """Anonymous memory aligned to 2 MiB, advised MADV_HUGEPAGE, touched, then registered."""
    import mmap

    m = mmap.mmap(-1, nbytes + HUGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    addr = (base + HUGE - 1) & ~(HUGE - 1)
    libc = ctypes.CDLL(None)
    libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), 14)  # MADV_HUGEPAGE
    ctypes.memset(addr, 1, nbytes)
    cu(d.cuMemHostRegister, addr, nbytes, d.CU_MEMHOSTREGISTER_PORTABLE)

    def free():
        cu(d.cuMemHostUnregister, addr)
        m.close()

    return addr, free


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args(argv)
    nbytes, reps = args.mib << 20, args.copies
    dev = Device.get(0)
    dev.make_current()
    s = [Stream(dev) for _ in range(4)]
    dev_in = [DeviceBuffer.allocate(nbytes, s[0]) for _ in range(2)]
    dev_out = [DeviceBuffer.allocate(nbytes, s[0]) for _ in range(2)]
    s[0].synchronize()
    start, end, join = Event(dev, timing=True), Event(dev, timing=True), Event(dev)

    def timed(enqueue) -> float:
        """Median ms from a record on s0 (every stream waits on it) to all streams done."""
        out = []
        for _ in range(8):
            start.record(s[0])
            for x in s[1:]:
                x.wait(start)
            for x in enqueue():
                join.record(x)
                s[0].wait(join)
            end.record(s[0])
            end.synchronize()
            out.append(Event.elapsed_ms(start, end))
        return statistics.median(out[1:])

    def h2d(src, parts=1, streams=(0,)):
        k = nbytes // parts
        for r in range(reps):
            for p in range(parts):
                cu(d.cuMemcpyHtoDAsync, int(dev_in[r % 2].handle) + p * k, src + p * k, k,
                   s[streams[p % len(streams)]].handle)
        return [s[i] for i in streams]

    def d2h(dst):
        for r in range(reps):
            cu(d.cuMemcpyDtoHAsync, dst, int(dev_out[r % 2].handle), nbytes, s[2].handle)
        return [s[2]]

    kinds = {
        "cuMemHostAlloc": lambda: host_alloc(nbytes, d.CU_MEMHOSTALLOC_PORTABLE),
        "write-combined": lambda: host_alloc(
            nbytes, d.CU_MEMHOSTALLOC_PORTABLE | d.CU_MEMHOSTALLOC_WRITECOMBINED),
        "THP + register": lambda: thp_register(nbytes),
    }
    print(f"{dev.name}: {reps} x {args.mib} MiB per direction, ms (median of 7)")
    print(f"  {'host memory':16s} {'H2D':>8s} {'D2H':>8s} {'both':>8s} {'both, H2D in 2':>15s} "
          f"{'both, H2D in 4':>15s}")
    for name, make in kinds.items():
        (src, free_src), (dst, free_dst) = make(), make()
        try:
            row = (timed(lambda: h2d(src)), timed(lambda: d2h(dst)),
                   timed(lambda: h2d(src) + d2h(dst)),
                   timed(lambda: h2d(src, 2, (0, 1)) + d2h(dst)),
                   timed(lambda: h2d(src, 4, (0, 1)) + d2h(dst)))
        finally:
            free_src()
            free_dst()
        print(f"  {name:16s} " + " ".join(f"{v:8.3f}" if i < 3 else f"{v:15.3f}"
                                           for i, v in enumerate(row)))
    kernel = load_kernel(PULL, "pull")
    src, free_src = host_alloc(nbytes, d.CU_MEMHOSTALLOC_PORTABLE | d.CU_MEMHOSTALLOC_DEVICEMAP)
    dst, free_dst = host_alloc(nbytes, d.CU_MEMHOSTALLOC_PORTABLE)
    try:
        mapped = int(cu(d.cuMemHostGetDevicePointer, src, 0))
        args_ = kernel.pack([mapped, int(dev_in[0].handle), nbytes // 16])
        for grid in (dev.sm_count, 2 * dev.sm_count):
            def pull(g=grid):
                for _ in range(reps):
                    kernel.launch(s[0], g, 256, args_)
                return [s[0]]
            alone, both = timed(pull), timed(lambda: pull() + d2h(dst))
            print(f"  SM copy kernel, grid {grid}: H2D {alone:.3f} ms alone "
                  f"({reps * nbytes / alone / 1e6:.1f} GB/s), {both:.3f} ms with D2H running")
    finally:
        free_src()
        free_dst()
    for b in dev_in + dev_out:
        b.close()
    for x in s:
        x.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

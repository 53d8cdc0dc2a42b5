"""Small helpers shared by the benchmarks: medians, tables, pattern fill and chunked checks of
large device buffers (bounded host memory)."""

from __future__ import annotations

import statistics

import numpy as np

CHUNK_BYTES = 64 << 20  # host staging for fills and checks of large buffers


def median(values) -> float:
    return float(statistics.median(values))


def format_table(header, rows) -> str:
    """Left-aligned text columns; numbers already formatted by the caller."""
    table = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


def pattern(start: int, count: int) -> np.ndarray:
    """Floats ``(i % 1021) * 0.25 - 100`` for i in [start, start + count): cheap to make,
    not periodic in any power-of-two tile, and ``a * x + b`` stays exact for the small
    multiples of 1/8 the benchmarks use (so results compare bit for bit)."""
    i = np.arange(start, start + count, dtype=np.int64)
    return ((i % 1021).astype(np.float32) * np.float32(0.25) - np.float32(100)).astype(np.float32)


def fill_pattern(buf, n: int, stream, device) -> None:
    """Write `pattern(0, n)` into device buffer ``buf`` (n float32), through one pinned chunk."""
    from cuda.bindings import driver

    from orchestra.driver import PinnedBuffer, cu

    per = CHUNK_BYTES // 4
    with PinnedBuffer.empty((min(per, n),), np.float32, device) as pin:
        for start in range(0, n, per):
            count = min(per, n - start)
            pin.array[:count] = pattern(start, count)
            cu(driver.cuMemcpyHtoDAsync, driver.CUdeviceptr(buf.ptr + 4 * start), pin.ptr,
               4 * count, stream.handle)
            stream.synchronize()  # the pinned chunk is reused next round


def check_buffer(buf, n: int, expected_chunk, stream, device) -> tuple[bool, str]:
    """Compare device buffer ``buf`` (n float32) with ``expected_chunk(start, count)`` chunk by
    chunk, exactly. Returns ``(ok, detail)``."""
    from cuda.bindings import driver

    from orchestra.driver import PinnedBuffer, cu

    per = CHUNK_BYTES // 4
    with PinnedBuffer.empty((min(per, n),), np.float32, device) as pin:
        for start in range(0, n, per):
            count = min(per, n - start)
            cu(driver.cuMemcpyDtoHAsync, pin.ptr, driver.CUdeviceptr(buf.ptr + 4 * start),
               4 * count, stream.handle)
            stream.synchronize()
            got = pin.array[:count]
            want = expected_chunk(start, count)
            bad = np.flatnonzero(got != want)
            if bad.size:
                i = int(bad[0])
                return False, (f"{bad.size} wrong values in floats {start}..{start + count - 1};"
                               f" first at {start + i}: got {got[i]!r}, expected {want[i]!r}")
    return True, f"all {n} floats correct"

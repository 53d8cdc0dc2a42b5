"""numpy references of the library's kernels (float32 in, float32 out, same formulas).

The GPU may contract ``a * x + b`` into one fused multiply-add, so float results are compared
with `close` (relative 1e-5, absolute 1e-6) rather than bit for bit; sums use a float64
reference and a looser tolerance.
"""

from __future__ import annotations

import numpy as np


def close(got, want, *, rtol: float = 1e-5, atol: float = 1e-6) -> tuple[bool, str]:
    """``(ok, detail)``: ``ok`` when every element matches; ``detail`` names the first
    mismatch and the count."""
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        return False, f"shape {got.shape} != expected {want.shape}"
    bad = ~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=False)
    if not bad.any():
        return True, "ok"
    i = int(np.flatnonzero(bad)[0])
    return False, (f"{int(bad.sum())} of {got.size} elements differ; first at [{i}]:"
                   f" got {got.flat[i]!r}, expected {want.flat[i]!r}")


def pipeline_block(x: np.ndarray, a: float, b: float) -> np.ndarray:
    return (np.float32(a) * x + np.float32(b)).astype(np.float32)


def pipeline_thread(x: np.ndarray, c: float) -> np.ndarray:
    return (x * x - np.float32(c)).astype(np.float32)


def pipeline_primitives(x: np.ndarray, block: int) -> np.ndarray:
    """Each float averaged with its mirror image inside its tile of ``block * 4`` floats (the
    last tile may be short)."""
    tile = block * 4
    y = np.empty_like(x)
    for t0 in range(0, x.size, tile):
        seg = x[t0:t0 + tile]
        y[t0:t0 + seg.size] = np.float32(0.5) * (seg + seg[::-1])
    return y


def producer_consumer(x: np.ndarray) -> np.ndarray:
    return (np.float32(2) * x + np.float32(1)).astype(np.float32)


def warp_specialized(x: np.ndarray, a: float, b: float) -> np.ndarray:
    return (np.float32(a) * x * x + np.float32(b)).astype(np.float32)


def ragged_offsets(rng: np.random.Generator, nseg: int, max_len: int,
                   zero_fraction: float = 0.1) -> np.ndarray:
    """CSR offsets (``nseg + 1`` uint32) of ``nseg`` segments of random length 0..max_len
    (about ``zero_fraction`` of them empty)."""
    lengths = rng.integers(0, max_len + 1, size=nseg)
    lengths[rng.random(nseg) < zero_fraction] = 0
    offsets = np.zeros(nseg + 1, dtype=np.uint32)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def early_exit_segments(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Inclusive prefix sum inside each segment, accumulated in float32 in order (as the
    kernel does, one add per element)."""
    y = np.zeros_like(x)
    for s in range(offsets.size - 1):
        b, e = int(offsets[s]), int(offsets[s + 1])
        if e > b:
            y[b:e] = np.add.accumulate(x[b:e], dtype=np.float32)
    return y


def early_exit_warps(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of each segment (float64; compare with a loose tolerance)."""
    return np.array([x[int(offsets[s]):int(offsets[s + 1])].astype(np.float64).sum()
                     for s in range(offsets.size - 1)])


def pdl_pair(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """pdl_primary then pdl_secondary: z = 3 * x + w."""
    return (np.float32(3) * x + w).astype(np.float32)


def pdl_chain(x0: np.ndarray, steps: int) -> np.ndarray:
    """``steps`` applications of y = x + 1, in float32 one step at a time."""
    y = x0.astype(np.float32).copy()
    for _ in range(steps):
        y += np.float32(1)
    return y


def cluster_dsmem(x: np.ndarray, block: int, cluster: int, grid: int) -> np.ndarray:
    """y[b*B + t] = x[b*B + t] + 0.5 * x[nb*B + B-1-t], nb = the next block of b's cluster
    (ranks wrap around), x read as 0 past its end."""
    pad = np.zeros(grid * block, dtype=np.float32)
    pad[:x.size] = x
    tiles = pad.reshape(grid, block)
    b = np.arange(grid)
    nb = (b // cluster) * cluster + (b % cluster + 1) % cluster
    y = tiles + np.float32(0.5) * tiles[nb, ::-1]
    return y.reshape(-1)[:x.size].astype(np.float32)


def cp_async_scale(x: np.ndarray, scale: float) -> np.ndarray:
    return (np.float32(scale) * x).astype(np.float32)

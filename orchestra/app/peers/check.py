"""Output checks of ``orchestra bench peers`` against numpy (pure numpy, no CUDA).

Every contender runs the same ``burn`` kernel (cuda_src/burn.cu) with ``s = -1, t = 0``: each
of the ``iters`` steps is ``v = fmaf(v, -1, 0)``, exact in float32, so the output is exactly
``-x`` for an odd iteration count (the benchmark makes the count odd) and every element still
identifies its input: an output routed to the wrong batch, a skipped kernel (+x) or an element
never written (NaN, the poison) all fail. The kernel's time still grows with ``iters``.
numpy's ``x * -1 + 0`` rounds like the kernel (the product is exact; ``-0 + 0 = +0`` as in
``fmaf``), so the comparison is bit for bit.

Large outputs are checked chunk by chunk on a thread pool (`orchestra.app.job.data`); timed runs
between the first and the last may check a sample: every batch's first and last element plus
every `STRIDE`-th (`sample_indices`).
"""

from __future__ import annotations

import numpy as np

from orchestra.app.job import data as jd
from orchestra.errors import BenchConfigError

SCALE = -1.0
SHIFT = 0.0
STRIDE = 4099
SAMPLE_ABOVE = 1 << 22  # outputs with more elements may be checked on a sample


def odd_iters(iters: int) -> int:
    """The odd iteration count at or above ``iters`` (>= 1): the output is then ``-x``."""
    return max(1, int(iters) | 1)


def negate(x: np.ndarray) -> np.ndarray:
    """The expected output for ``x`` with an odd iteration count: ``x * -1 + 0`` in float32."""
    return np.add(np.multiply(x, np.float32(SCALE)), np.float32(SHIFT), dtype=np.float32)


def _first_bad(got: np.ndarray, want: np.ndarray, lo: int):
    g, w = got.view(np.uint32), want.view(np.uint32)
    bad = g != w
    count = int(np.count_nonzero(bad))
    if not count:
        return 0, None
    j = int(np.flatnonzero(bad)[0])
    return count, (lo + j, float(got[j]), float(want[j]))


def check_negated(x: np.ndarray, got: np.ndarray) -> tuple[bool, str]:
    """Is 1-D float32 ``got`` exactly ``negate(x)``? (ok, detail), chunked on threads."""
    if got.shape != x.shape:
        raise BenchConfigError(f"output has shape {got.shape}, input {x.shape}")

    def one(lo, hi):
        return _first_bad(got[lo:hi], negate(x[lo:hi]), lo)

    return _describe(jd.for_chunks(x.size, one), x.size)


def check_equal(got: np.ndarray, want: np.ndarray) -> tuple[bool, str]:
    """Bit-for-bit equality of two float32 arrays of one shape: (ok, detail)."""
    got, want = np.ravel(got), np.ravel(want)
    if got.shape != want.shape:
        raise BenchConfigError(f"output has {got.size} elements, the reference {want.size}")
    return _describe([_first_bad(got, want, 0)], got.size)


def _describe(parts, n: int) -> tuple[bool, str]:
    total, first = 0, None
    for count, f in parts:
        total += count
        if f is not None and first is None:
            first = f
    if not total:
        return True, f"all {n} elements match"
    assert first is not None  # a part that counted differences named its first
    i, g, w = first
    return False, f"{total} of {n} elements differ; first at {i}: got {g!r}, want {w!r}"


def sample_indices(n: int, batch_elements: int, stride: int = STRIDE) -> np.ndarray:
    """Indices of a sampled check: every batch's first and last element, every ``stride``-th
    element and the very last one (sorted, unique)."""
    if n < 1 or batch_elements < 1:
        raise BenchConfigError("need n >= 1 and batch_elements >= 1")
    starts = np.arange(0, n, batch_elements, dtype=np.int64)
    ends = np.minimum(starts + batch_elements, n) - 1
    idx = np.concatenate([starts, ends, np.arange(0, n, stride, dtype=np.int64), [n - 1]])
    return np.unique(idx)


def check_sample(x: np.ndarray, got: np.ndarray, idx: np.ndarray) -> tuple[bool, str]:
    """`check_negated` on the elements ``idx`` only."""
    ok, detail = _describe([_first_bad(got[idx], negate(x[idx]), 0)], idx.size)
    if ok:
        return True, f"all {idx.size} sampled elements match"
    return False, "sampled " + detail.replace("first at ", "first at sample ")


def poison(out: np.ndarray, idx: np.ndarray | None = None) -> None:
    """NaN into ``out`` (every element, chunked on threads) or into ``out[idx]``."""
    if idx is None:
        jd.poison(out)
    else:
        out[idx] = np.nan


__all__ = ["SAMPLE_ABOVE", "SCALE", "SHIFT", "STRIDE", "check_equal", "check_negated",
           "check_sample", "negate", "odd_iters", "poison", "sample_indices"]

"""The main job's data on the host: seeded input, NaN poisoning, the numpy reference, checks.

Everything works chunk by chunk (`CHUNK` elements) on a thread pool: numpy's random fills,
ufuncs and comparisons release the GIL, so gigabytes take about a second on a many-core host.
Results never depend on the number of threads: chunk ``i`` of the input always comes from child
generator ``i`` of ``np.random.default_rng(seed)``.

The kernel (``cuda_src/burn.cu``) computes, per element, ``iters`` times ``v = fmaf(v, s, t)``.
With ``s = 0.5`` and ``t = 1`` the product is exact, so numpy's float32 ``v * 0.5 + 1`` rounds
exactly like ``fmaf``: the reference is bit-exact. The map converges: after about 25-30 steps
every float32 in [0, 1) has become exactly 2.0 and stays there, so the reference loop stops as
soon as a chunk stops changing, and a chunk whose reference is one constant is stored as that
constant (the default iteration counts need no reference memory at all). Because such an output
no longer depends on the input, the job also runs a *routing check* with a few iterations (see
`orchestra.app.job.main_job`), whose output still identifies each input element.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import attrs
import numpy as np

from orchestra.errors import JobConfigError

CHUNK = 1 << 22  # elements per chunk (16 MiB of float32)
SCALE = 0.5
SHIFT = 1.0


def workers() -> int:
    return max(1, min(32, os.cpu_count() or 1))


def _chunks(n: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]


def for_chunks(n: int, fn: Callable[[int, int], object], chunk: int = CHUNK) -> list:
    """``[fn(lo, hi) for each chunk]`` computed on a thread pool, in chunk order."""
    ranges = _chunks(n, chunk)
    if len(ranges) <= 1:
        return [fn(lo, hi) for lo, hi in ranges]
    with ThreadPoolExecutor(max_workers=min(workers(), len(ranges))) as pool:
        return list(pool.map(lambda r: fn(*r), ranges))


def fill_uniform(out: np.ndarray, seed: int) -> None:
    """Fill 1-D float32 ``out`` with uniform [0, 1) values from ``default_rng(seed)`` (chunk i
    from its i-th spawned child: reproducible for any thread count)."""
    ranges = _chunks(out.size)
    children = np.random.default_rng(seed).spawn(len(ranges))

    def fill(i):
        lo, hi = ranges[i]
        children[i].random(dtype=np.float32, out=out[lo:hi])

    if len(ranges) <= 1:
        for i in range(len(ranges)):
            fill(i)
        return
    with ThreadPoolExecutor(max_workers=min(workers(), len(ranges))) as pool:
        list(pool.map(fill, range(len(ranges))))


def poison(out: np.ndarray) -> None:
    """Set every element of 1-D float ``out`` to NaN (so an element the GPU never wrote fails)."""
    def fill(lo, hi):
        out[lo:hi] = np.nan
    for_chunks(out.size, fill)


def burn_reference(x: np.ndarray, iters: int, s: float = SCALE, t: float = SHIFT) -> np.ndarray:
    """``iters`` steps of ``v = v * s + t`` on float32 ``x`` (one chunk), stopping early once a
    step changes nothing (then no later step would). Bit-exact with ``burn`` when ``v * s`` is
    exact (``s`` a power of two, no subnormals), as for the job's s = 0.5; other values round
    the product separately and may differ from ``fmaf`` in the last bit."""
    v = np.array(x, dtype=np.float32, copy=True)
    w = np.empty_like(v)
    s32, t32 = np.float32(s), np.float32(t)
    for _ in range(int(iters)):
        np.multiply(v, s32, out=w)
        np.add(w, t32, out=w)
        if np.array_equal(w, v):
            break
        v, w = w, v
    return v


@attrs.frozen
class Check:
    """Result of comparing an output with the reference: ``ok``, the number of ``mismatches``
    and the ``first`` one as ``(index, got, want)``."""

    ok: bool
    mismatches: int
    first: tuple | None = None

    def describe(self) -> str:
        if self.ok:
            return "all elements match"
        if self.first is None:
            return f"{self.mismatches} element(s) differ"
        i, got, want = self.first
        return (f"{self.mismatches} element(s) differ; first at index {i}: got {got!r}, "
                f"want {want!r}")


def _compare(got: np.ndarray, want, lo: int) -> tuple[int, tuple | None]:
    if isinstance(want, np.ndarray):
        bad = got != want
    else:
        bad = got != np.float32(want)  # NaN never equals: a poisoned element is a mismatch
    count = int(np.count_nonzero(bad))
    if not count:
        return 0, None
    j = int(np.flatnonzero(bad)[0])
    w = want[j] if isinstance(want, np.ndarray) else want
    return count, (lo + j, float(got[j]), float(w))


def _merge(parts) -> Check:
    total, first = 0, None
    for count, f in parts:
        total += count
        if f is not None and first is None:
            first = f
    return Check(total == 0, total, first)


class Reference:
    """The expected output of ``burn`` on ``x``, chunk by chunk: a constant where the chunk has
    converged to one value, else the chunk's array. Built once; `compare` checks an output."""

    def __init__(self, parts: list, n: int, iters: int):
        self.parts = parts
        self.n = n
        self.iters = iters

    @classmethod
    def build(cls, x: np.ndarray, iters: int, s: float = SCALE, t: float = SHIFT) -> "Reference":
        def part(lo, hi):
            v = burn_reference(x[lo:hi], iters, s, t)
            first = v[0]
            if v.size and np.all(v == first) and not np.isnan(first):
                return np.float32(first)
            return v
        return cls(for_chunks(x.size, part), x.size, iters)

    @property
    def nbytes(self) -> int:
        """Host memory the stored reference takes (bytes)."""
        return sum(p.nbytes for p in self.parts if isinstance(p, np.ndarray))

    def compare(self, out: np.ndarray) -> Check:
        if out.size != self.n:
            raise JobConfigError(f"the output has {out.size} elements, the reference {self.n}")
        ranges = _chunks(self.n)

        def one(i):
            lo, hi = ranges[i]
            return _compare(out[lo:hi], self.parts[i], lo)

        if len(ranges) <= 1:
            return _merge([one(i) for i in range(len(ranges))])
        with ThreadPoolExecutor(max_workers=min(workers(), len(ranges))) as pool:
            return _merge(list(pool.map(one, range(len(ranges)))))


def check_against(x: np.ndarray, out: np.ndarray, iters: int, s: float = SCALE,
                  t: float = SHIFT) -> Check:
    """Compare ``out`` with the reference of ``x`` computed on the fly (nothing stored); for
    memory-mapped files larger than memory."""
    if out.size != x.size:
        raise JobConfigError(f"the output has {out.size} elements, the input {x.size}")

    def one(lo, hi):
        return _compare(out[lo:hi], burn_reference(x[lo:hi], iters, s, t), lo)

    return _merge(for_chunks(x.size, one))

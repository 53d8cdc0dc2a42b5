"""Per-bucket counters and latency samples of a serving engine (plain Python).

Latencies are kept as the most recent ``SAMPLES`` values per bucket in a `Samples` ring: one
preallocated block of float64 (512 KiB), allocated by the bucket's first sample and never
grown, so percentiles describe recent traffic and memory stays flat however long the engine
serves (a ``deque`` of Python floats costs 32 bytes per sample and grows until it is full).
"""

from __future__ import annotations

import array

import numpy as np

from orchestra.serve.errors import ServeConfigValueError

SAMPLES = 1 << 16  # latency samples kept per bucket


class Samples:
    """The most recent ``capacity`` float samples (a power of two) in a fixed-size ring.

    `add` is one array store and one attribute store (no allocation once the ring exists; the
    ring itself is allocated by the first `add`, or at once with ``prealloc=True``).

    Thread-safety: `add` may run in several threads at once without a lock: a race can overwrite one
    sample with another, or make ``total`` miss an add (statistics, not bookkeeping); `values`
    copies a snapshot.
    """

    __slots__ = ("_ring", "_n", "_mask", "capacity")

    def __init__(self, capacity: int = SAMPLES, prealloc: bool = False):
        if capacity < 1 or capacity & (capacity - 1):
            raise ServeConfigValueError(f"capacity must be a power of two; got {capacity}")
        self.capacity = capacity
        self._mask = capacity - 1
        self._n = 0
        self._ring = array.array("d", bytes(8 * capacity)) if prealloc else None

    def add(self, value: float) -> None:
        ring = self._ring
        if ring is None:
            ring = self._ring = array.array("d", bytes(8 * self.capacity))
        n = self._n
        ring[n & self._mask] = value
        self._n = n + 1

    append = add  # the deque spelling

    def __len__(self) -> int:
        return min(self._n, self.capacity)

    @property
    def total(self) -> int:
        """Samples ever added (the ring keeps the last ``capacity``)."""
        return self._n

    def values(self) -> np.ndarray:
        """The kept samples (oldest first once the ring wrapped), as a new float64 array."""
        n, ring = self._n, self._ring
        if ring is None or n == 0:
            return np.empty(0, np.float64)
        a = np.frombuffer(ring, np.float64)
        if n <= self.capacity:
            return a[:n].copy()
        i = n & self._mask
        return np.concatenate((a[i:], a[:i]))

    def __iter__(self):
        return iter(self.values().tolist())


def percentiles(samples, qs=(50, 95, 99)) -> dict:
    """``{"p50": .., "p95": .., "p99": .., "count": n}`` of ``samples`` (None when empty)."""
    if isinstance(samples, Samples):
        a = samples.values()
    elif isinstance(samples, np.ndarray):
        a = samples.astype(np.float64, copy=False)
    else:
        a = np.fromiter(samples, dtype=np.float64)
    out = {f"p{q:g}": (float(np.percentile(a, q)) if a.size else None) for q in qs}
    out["count"] = int(a.size)
    return out


class BucketStats:
    """Counters of one bucket, read as a snapshot by `as_dict`.

    Thread-safety: not thread-safe by itself: the counters are changed under the engine's lock; the
    latency and GPU-time rings (`Samples`) take adds from any thread without it; `as_dict` reads a
    snapshot (counters read without the lock may be one event apart).
    """

    def __init__(self, rows: int):
        self.rows = rows
        self.requests = 0  # requests completed (results delivered or failed after launch)
        self.failed = 0  # requests failed after admission (CUDA error, build error)
        self.hits = 0  # requests admitted to a bucket that was already built
        self.misses = 0  # requests that waited for (or triggered) the bucket's build
        self.launches = 0  # launches (one request, or one dynamic batch)
        self.rows_served = 0  # request rows launched (padding excluded)
        self.queue_high = 0  # the most requests waiting for this bucket at once
        self.builds = 0
        self.build_ms = 0.0  # sum over the bucket's instances
        self.instantiate_ms = 0.0
        self.graph_bytes: int | None = None
        self.wall_ms: float | None = None  # the last build's wall time (all instances)
        self.latency_us = Samples(SAMPLES)
        self.gpu_ms = Samples(SAMPLES >> 4)  # sampled launches only (timing_every)

    def as_dict(self, queue_depth: int, instances: int, free: int) -> dict:
        padded = self.launches * self.rows
        gpu = self.gpu_ms.values()
        return {
            "rows": self.rows,
            "instances": instances,
            "free_instances": free,
            "requests": self.requests,
            "failed": self.failed,
            "hits": self.hits,
            "misses": self.misses,
            "launches": self.launches,
            "requests_per_launch": (self.requests / self.launches) if self.launches else None,
            "batch_fill": (self.rows_served / padded) if padded else None,
            "queue_depth": queue_depth,
            "queue_high": self.queue_high,
            "latency_us": percentiles(self.latency_us),
            "gpu_ms": {"mean": float(gpu.mean()) if gpu.size else None,
                       **percentiles(gpu, (50, 99))},
            "builds": self.builds,
            "build_ms": self.build_ms,
            "instantiate_ms": self.instantiate_ms,
            "graph_bytes": self.graph_bytes,
            "build_wall_ms": self.wall_ms,
        }


__all__ = ["BucketStats", "SAMPLES", "Samples", "percentiles"]

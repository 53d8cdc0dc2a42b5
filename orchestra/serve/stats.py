"""Per-bucket counters and latency samples of a serving engine (plain Python).

Latencies are kept as the most recent ``SAMPLES`` values per bucket (a ring), so percentiles
describe recent traffic and memory stays flat however long the engine serves.
"""

from __future__ import annotations

import collections

import numpy as np

SAMPLES = 1 << 16  # latency samples kept per bucket


def percentiles(samples, qs=(50, 95, 99)) -> dict:
    """``{"p50": .., "p95": .., "p99": .., "count": n}`` of ``samples`` (None when empty)."""
    a = np.fromiter(samples, dtype=np.float64)
    out = {f"p{q:g}": (float(np.percentile(a, q)) if a.size else None) for q in qs}
    out["count"] = int(a.size)
    return out


class BucketStats:
    """Counters of one bucket. Mutated under the engine's lock, except the sample rings
    (``deque.append`` is atomic in CPython), read as a snapshot by `as_dict`."""

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
        self.latency_us: collections.deque = collections.deque(maxlen=SAMPLES)
        self.gpu_ms: collections.deque = collections.deque(maxlen=SAMPLES)

    def as_dict(self, queue_depth: int, instances: int, free: int) -> dict:
        padded = self.launches * self.rows
        gpu = list(self.gpu_ms)
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
            "latency_us": percentiles(list(self.latency_us)),
            "gpu_ms": {"mean": (sum(gpu) / len(gpu)) if gpu else None,
                       **percentiles(gpu, (50, 99))},
            "builds": self.builds,
            "build_ms": self.build_ms,
            "instantiate_ms": self.instantiate_ms,
            "graph_bytes": self.graph_bytes,
            "build_wall_ms": self.wall_ms,
        }


__all__ = ["BucketStats", "SAMPLES", "percentiles"]

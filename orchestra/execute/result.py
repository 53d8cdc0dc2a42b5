"""`RunResult`: what one run of a task graph measured (every executor returns one)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class RunResult:
    """What one run measured.

    Attributes:
        wall_ms: host clock (``perf_counter``) from the first enqueue to the end of the final
            synchronize; None for a run with ``sync=False`` until `EagerExecutor.synchronize`.
        enqueue_us: host time spent enqueueing every step (µs).
        nodes: graph nodes run. steps: driver calls made (nodes + event records + waits).
        events: event records; waits: stream waits; streams: streams used.
        policy: the plan's policy. prepare_ms: time spent preparing this (graph, plan) in this
            call (checks, kernel resolution, closures); 0.0 when it came from the cache.
        timeline: what the tracer's ``finish()`` returned (None without a tracer).
    """

    wall_ms: float | None
    enqueue_us: float
    nodes: int
    steps: int
    events: int
    waits: int
    streams: int
    policy: str
    prepare_ms: float = 0.0
    timeline: Any = None

    @property
    def host_us_per_node(self) -> float:
        """Host enqueue time per graph node (µs): the executor's overhead per node."""
        return self.enqueue_us / self.nodes if self.nodes else 0.0

    def as_dict(self) -> dict:
        d = attrs.asdict(self, filter=lambda a, v: a.name != "timeline")
        d["host_us_per_node"] = self.host_us_per_node
        return d


__all__ = ["RunResult"]

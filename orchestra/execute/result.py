"""`RunResult`: what one run of a task graph measured (every executor returns one)."""

from __future__ import annotations

from typing import Any

_FIELDS = ("wall_ms", "enqueue_us", "nodes", "steps", "events", "waits", "streams", "policy",
           "prepare_ms", "timeline", "copy_kernels")


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
        copy_kernels: host copies that ran as the copy kernel (the rest used copy engines).

    A plain record (``__slots__``, built on every run: a frozen attrs class cost 2 µs per run
    against 0.3 µs); treat it as read-only. Equal when every field is.

    Thread-safety: a plain record (not frozen, for speed), filled by the run that makes it and never
    changed by orchestra afterwards: may be shared between threads as read-only data (do not assign
    to its fields).
    """

    __slots__ = _FIELDS

    def __init__(self, wall_ms: float | None, enqueue_us: float, nodes: int, steps: int,
                 events: int, waits: int, streams: int, policy: str, prepare_ms: float = 0.0,
                 timeline: Any = None, copy_kernels: int = 0):
        self.wall_ms = wall_ms
        self.enqueue_us = enqueue_us
        self.nodes = nodes
        self.steps = steps
        self.events = events
        self.waits = waits
        self.streams = streams
        self.policy = policy
        self.prepare_ms = prepare_ms
        self.timeline = timeline
        self.copy_kernels = copy_kernels

    @property
    def host_us_per_node(self) -> float:
        """Host enqueue time per graph node (µs): the executor's overhead per node."""
        return self.enqueue_us / self.nodes if self.nodes else 0.0

    def as_dict(self) -> dict:
        """Every field but ``timeline``, plus ``host_us_per_node``."""
        d = {f: getattr(self, f) for f in _FIELDS if f != "timeline"}
        d["host_us_per_node"] = self.host_us_per_node
        return d

    def __eq__(self, other) -> bool:
        if type(other) is not RunResult:
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable slots: not hashable

    def __repr__(self) -> str:
        return "RunResult(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS) + ")"


__all__ = ["RunResult"]

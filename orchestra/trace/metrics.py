"""Overlap metrics over a `Timeline`: busy time, concurrency, pair intersections, efficiency.

All interval arithmetic is on unions, so two nodes of one engine running at once (two compute
streams, say) count once. Times in ms.
"""

from __future__ import annotations

from itertools import combinations
from typing import Callable, Iterable

import attrs

from orchestra.errors import TraceValueError
from orchestra.trace.timeline import OVERLAP_ENGINES, engine_key

Interval = tuple[float, float]


# -- interval algebra ---------------------------------------------------------------------------

def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (touching intervals merge)."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> float:
    """Total time covered by already-disjoint intervals."""
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def concurrency(sets: Iterable[list[Interval]]) -> dict[int, float]:
    """k -> time during which exactly k of the given unions are busy (k >= 1)."""
    edges = []
    for ivs in sets:
        for s, e in ivs:
            edges.append((s, 1))
            edges.append((e, -1))
    edges.sort()  # at equal times ends (-1) come first: touching intervals do not overlap
    out: dict[int, float] = {}
    level, prev = 0, None
    for t, d in edges:
        if prev is not None and level > 0 and t > prev:
            out[level] = out.get(level, 0.0) + (t - prev)
        level += d
        prev = t
    return out


def busy_by(spans, key: Callable) -> dict:
    """key(span) -> busy ms (union of that group's spans)."""
    groups: dict = {}
    for s in spans:
        groups.setdefault(key(s), []).append((s.start_ms, s.end_ms))
    return {k: length(union(v)) for k, v in groups.items()}


def efficiency(bound_ms: float, makespan_ms: float) -> float:
    """``bound_ms / makespan_ms``; ValueError for a bound <= 0 or an empty run."""
    if not bound_ms > 0:
        raise TraceValueError(f"efficiency: bound_ms must be > 0; got {bound_ms!r}")
    if not makespan_ms > 0:
        raise TraceValueError("efficiency: the timeline has no duration (no spans, or all empty)")
    return bound_ms / makespan_ms


# -- metrics ------------------------------------------------------------------------------------

@attrs.frozen
class Metrics:
    """What a timeline says about overlap.

    Attributes:
        makespan_ms: first start to last end.
        busy_ms: engine -> busy ms, every engine that ran (in `ENGINES` order).
        stream_busy_ms: stream -> busy ms.
        engines: the engines the overlap numbers count (those of the requested set that ran).
        concurrency_ms: k -> ms during which exactly k of ``engines`` were busy.
        pairs_ms: (a, b) -> ms both were busy, for each pair of ``engines``.

    Immutable (frozen), but the per-engine tables are plain dicts: may be shared between threads
    freely as long as nobody modifies them.
    """

    makespan_ms: float
    busy_ms: dict
    stream_busy_ms: dict
    engines: tuple[str, ...]
    concurrency_ms: dict
    pairs_ms: dict

    def overlap_ms(self, at_least: int = 2) -> float:
        """ms during which at least ``at_least`` engines were busy at once."""
        return sum(v for k, v in self.concurrency_ms.items() if k >= at_least)

    def overlap_fraction(self, at_least: int = 2) -> float:
        """`overlap_ms` as a fraction of the makespan (0.0 for an empty run)."""
        return self.overlap_ms(at_least) / self.makespan_ms if self.makespan_ms > 0 else 0.0

    def busy_fraction(self, engine: str) -> float:
        return self.busy_ms.get(engine, 0.0) / self.makespan_ms if self.makespan_ms > 0 else 0.0


def compute_metrics(timeline, engines=OVERLAP_ENGINES) -> Metrics:
    """`Metrics` of ``timeline``; the overlap numbers count ``engines`` (None: every engine)."""
    spans = timeline.spans
    busy = busy_by(spans, lambda s: s.engine)
    busy = {k: busy[k] for k in sorted(busy, key=engine_key)}
    stream_busy = busy_by(spans, lambda s: s.stream)
    stream_busy = {k: stream_busy[k] for k in timeline.streams if k in stream_busy}
    chosen = tuple(e for e in (busy if engines is None else engines) if e in busy)
    unions = {e: union((s.start_ms, s.end_ms) for s in spans if s.engine == e) for e in chosen}
    pairs = {(a, b): length(intersect(unions[a], unions[b])) for a, b in combinations(chosen, 2)}
    return Metrics(timeline.makespan_ms, busy, stream_busy, chosen,
                   dict(sorted(concurrency(unions.values()).items())), pairs)


def pipeline_bound_ms(timeline, batches: Iterable[int] | None = None) -> float | None:
    """The design's ideal time of N equal batches, from the timeline's own node times:
    ``t_up + N * max(t_up, t_compute, t_down) + t_down``, each ``t`` the mean per batch of
    the summed durations of that batch's upload / compute / download nodes.

    None when no span carries a batch number.
    """
    per: dict[int, dict[str, float]] = {}
    for s in timeline.spans:
        if s.batch is None or s.engine not in OVERLAP_ENGINES:
            continue
        if batches is not None and s.batch not in batches:
            continue
        d = per.setdefault(s.batch, dict.fromkeys(OVERLAP_ENGINES, 0.0))
        d[s.engine] += s.duration_ms
    if not per:
        return None
    n = len(per)
    t = {e: sum(d[e] for d in per.values()) / n for e in OVERLAP_ENGINES}
    return t["upload"] + n * max(t.values()) + t["download"]


# -- text ---------------------------------------------------------------------------------------

def _pct(x: float, total: float) -> str:
    return f"{100.0 * x / total:5.1f}%" if total > 0 else "    -"


def summary(timeline, bound_ms: float | None = None, engines=OVERLAP_ENGINES) -> str:
    m = compute_metrics(timeline, engines)
    T = m.makespan_ms
    head = [f"timeline: {len(timeline.spans)} node(s) on {len(timeline.streams)} stream(s)"]
    if timeline.executor:
        head.append(f"executor {timeline.executor}")
    if timeline.policy:
        head.append(f"policy {timeline.policy}")
    head.append(f"device {timeline.device}")
    lines = [", ".join(head), f"makespan {T:.3f} ms (from {timeline.start_ms:.3f} to "
                              f"{timeline.end_ms:.3f} ms after the run's start)"]
    lines.append(f"{'engine':<12}{'nodes':>6}{'busy ms':>11}{'busy':>8}")
    for e, b in m.busy_ms.items():
        n = sum(1 for s in timeline.spans if s.engine == e)
        lines.append(f"{e:<12}{n:>6}{b:>11.3f}{_pct(b, T):>8}")
    lines.append(f"{'stream':<12}{'nodes':>6}{'busy ms':>11}{'busy':>8}{'first ms':>11}{'last ms':>11}")
    for st in timeline.streams:
        ss = [s for s in timeline.spans if s.stream == st]
        b = m.stream_busy_ms.get(st, 0.0)
        first = f"{min(s.start_ms for s in ss):>11.3f}" if ss else f"{'-':>11}"
        last = f"{max(s.end_ms for s in ss):>11.3f}" if ss else f"{'-':>11}"
        lines.append(f"{st:<12}{len(ss):>6}{b:>11.3f}{_pct(b, T):>8}{first}{last}")
    if len(m.engines) >= 2:
        parts = [f">={k} engines {m.overlap_ms(k):.3f} ms ({_pct(m.overlap_ms(k), T).strip()})"
                 for k in range(2, len(m.engines) + 1)]
        lines.append(f"overlap of {'/'.join(m.engines)}: " + ", ".join(parts))
        lines.append("pairs: " + ", ".join(f"{a}&{b} {v:.3f} ms" for (a, b), v in m.pairs_ms.items()))
    if bound_ms is not None:
        eff = efficiency(bound_ms, T) if T > 0 else 0.0
        lines.append(f"bound {bound_ms:.3f} ms, efficiency {100.0 * eff:.1f}% (bound / makespan)")
    return "\n".join(lines)

"""What ``orchestra bench peers`` prints: rows, ratios to orchestra's best, the text table, JSON
and the ratio chart (pure Python; matplotlib only for the chart, an optional extra).

A `Row` is one contender on one workload: wall ms (the median of the timed runs; for the
request workload the p50 of the requests, with the p99 beside it), efficiency against the
workload's bound (`orchestra.app.job.bound`; None where there is none), host µs per node (the
host time of the enqueue or launch call over the work's node count), whether every output
matched, and a note. `add_ratios` sets each row's wall over the fastest verified orchestra row
of its workload (1.00 = as fast as orchestra's best; above: slower).
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import attrs

from orchestra.errors import BenchConfigError, MissingExtraError

FAMILIES = ("orchestra", "cuda-python", "cupy", "torch")
MISSING_MATPLOTLIB = ("--plot needs matplotlib, which is not installed: pip install "
                      "orchestra[plot] (or pip install matplotlib)")


@attrs.define
class Row:
    """One contender on one workload (times in ms, host cost in µs per node).

    Thread-safety: plain mutable data (``attrs.define``), filled by one thread: share it only once
    it is complete, and do not change it while others read it.
    """

    workload: str
    contender: str
    family: str
    mode: str  # "eager" (enqueued per run) or "graph" (a CUDA graph launched per run)
    wall_ms: float
    runs: int = 0
    p99_ms: float | None = None
    efficiency: float | None = None
    host_us_per_node: float | None = None
    verified: bool = True
    note: str = ""
    ratio: float | None = None
    wall_ms_runs: list = attrs.field(factory=list)

    def __attrs_post_init__(self):
        if self.family not in FAMILIES:
            raise BenchConfigError(f"Row.family must be one of {FAMILIES}; got "
                                   f"{self.family!r}")

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def add_ratios(rows: Sequence[Row]) -> dict[str, float | None]:
    """Set ``row.ratio`` = wall / the fastest verified orchestra row's wall of the same
    workload (None when that workload has no verified orchestra row); returns workload ->
    that best wall."""
    best: dict[str, float | None] = {}
    for w in dict.fromkeys(r.workload for r in rows):
        ours = [r.wall_ms for r in rows if r.workload == w and r.family == "orchestra"
                and r.verified and r.wall_ms > 0]
        best[w] = min(ours) if ours else None
    for r in rows:
        b = best[r.workload]
        r.ratio = r.wall_ms / b if b else None
    return best


def _fmt(value, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


HEADER = ("workload", "contender", "mode", "wall ms", "p99 ms", "efficiency", "host us/node",
          "x orchestra best", "output", "note")


def table_rows(rows: Iterable[Row]) -> list[tuple]:
    return [(r.workload, r.contender, r.mode, f"{r.wall_ms:.3f}", _fmt(r.p99_ms, ".3f"),
             _fmt(r.efficiency, ".3f"), _fmt(r.host_us_per_node, ".2f"),
             _fmt(r.ratio, ".2f"), "ok" if r.verified else "WRONG", r.note) for r in rows]


def format_table(rows: Sequence[Row]) -> str:
    """Left-aligned columns (`HEADER`), a blank line between workloads."""
    body = table_rows(rows)
    table = [HEADER] + body
    widths = [max(len(str(t[i])) for t in table) for i in range(len(HEADER))]

    def line(t):
        return "  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip()

    out = [line(HEADER)]
    last = None
    for r, t in zip(rows, body):
        if last is not None and r.workload != last:
            out.append("")
        out.append(line(t))
        last = r.workload
    return "\n".join(out)


@attrs.define
class PeersReport:
    """Everything one ``orchestra bench peers`` run measured.

    Thread-safety: plain mutable data (``attrs.define``), filled by one thread: share it only once
    it is complete, and do not change it while others read it.
    """

    device: str
    versions: dict
    workloads: list  # per workload: its spec and what was measured for it (bound, iters)
    rows: list
    skipped: list  # notes: peers not installed, contenders that could not run
    repeat: int
    timing: str = ("wall: host clock around the call that enqueues (or launches) everything "
                   "and synchronizes, median of the timed runs after a warm-up; the request "
                   "workload: p50 / p99 of the single requests")

    @property
    def verified(self) -> bool:
        return all(r.verified for r in self.rows)

    @property
    def bound_bugs(self) -> list[str]:
        """One message per row whose efficiency exceeds the limit (a bug in the bound)."""
        from orchestra.app.job.bound import bound_warning

        out = []
        for r in self.rows:
            if r.efficiency is not None:
                msg = bound_warning(r.efficiency, f"{r.workload} {r.contender}")
                if msg:
                    out.append(msg)
        return out

    def as_dict(self) -> dict:
        return {"device": self.device, "versions": self.versions, "workloads": self.workloads,
                "rows": [r.as_dict() for r in self.rows], "skipped": list(self.skipped),
                "repeat": self.repeat, "timing": self.timing, "verified": self.verified,
                "bound_bugs": self.bound_bugs}

    def format(self) -> str:
        """The text report: a header, one line per workload's bound, the table, the notes."""
        v = ", ".join(f"{k} {val}" for k, val in self.versions.items())
        lines = [f"orchestra bench peers: {self.device} ({v})", self.timing, ""]
        for w in self.workloads:
            if w.get("bound_line"):
                lines.append(f"{w['label']}: {w['bound_line']}")
        if any(w.get("bound_line") for w in self.workloads):
            lines.append("")
        lines.append(format_table(self.rows))
        if self.skipped:
            lines.append("")
            lines += [f"skipped: {s}" for s in self.skipped]
        bugs = self.bound_bugs
        if bugs:
            lines += ["", "!" * 78, *bugs, "!" * 78]
        if not self.verified:
            bad = [f"{r.workload} {r.contender}" for r in self.rows if not r.verified]
            lines += ["", f"VERIFICATION FAILED: {', '.join(bad)}"]
        return "\n".join(lines)


def plot_ratios(rows: Sequence[Row], path, *, title: str | None = None) -> str:
    """A horizontal bar chart of every row's ratio to orchestra's best, grouped by workload,
    written to ``path`` (format from the suffix); returns the path. Rows without a ratio are
    left out. Raises `MissingExtraError` (an ``ImportError``) with the install hint when
    matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingExtraError(MISSING_MATPLOTLIB) from exc
    shown = [r for r in rows if r.ratio is not None]
    colors = {"orchestra": "#1f77b4", "cuda-python": "#7f7f7f", "cupy": "#2ca02c",
              "torch": "#d62728"}
    fig = Figure(figsize=(10, 0.8 + 0.28 * max(1, len(shown))), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{r.workload}: {r.contender}" for r in shown]
    ys = list(range(len(shown)))[::-1]
    ax.barh(ys, [r.ratio for r in shown], color=[colors[r.family] for r in shown])
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("wall / orchestra's best on the workload (lower is faster)")
    ax.set_title(title or "orchestra bench peers")
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path)
    return path


__all__ = ["FAMILIES", "HEADER", "MISSING_MATPLOTLIB", "PeersReport", "Row", "add_ratios",
           "format_table", "plot_ratios", "table_rows"]

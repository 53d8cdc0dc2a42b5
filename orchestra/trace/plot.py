"""A PNG Gantt chart of a `Timeline`: one row per stream, one bar per node, coloured by engine.

matplotlib is an optional extra (``pip install orchestra[plot]``); it is imported only when a
chart is drawn, and never through pyplot (no global backend or figure state).
"""

from __future__ import annotations

import os

from orchestra.errors import MissingExtraError, TraceTypeError, counted
from orchestra.trace.timeline import Timeline, engine_color

MISSING = ("plot_gantt needs matplotlib, which is not installed: pip install orchestra[plot] "
           "(or pip install matplotlib)")


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingExtraError(MISSING) from exc
    return Figure


def plot_gantt(timeline: Timeline, path, *, title: str | None = None,
               bound_ms: float | None = None, labels: bool | None = None,
               width_in: float = 12.0) -> str:
    """Draw ``timeline`` to ``path`` (format from the suffix, PNG normally); returns the path.

    ``labels``: write node names inside bars (default: when there are at most 60 spans).
    ``bound_ms``: also draw the ideal end time (start + bound) as a dashed line.
    Raises ImportError with the install hint when matplotlib is missing.
    """
    if not isinstance(timeline, Timeline):
        raise TraceTypeError(f"plot_gantt expects a Timeline; got {type(timeline).__name__}")
    Figure = _figure_class()
    path = os.fspath(path)
    streams = timeline.streams
    rows = max(len(streams), 1)
    fig = Figure(figsize=(width_in, 1.0 + 0.55 * rows), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    if labels is None:
        labels = len(timeline.spans) <= 60
    for i, name in enumerate(streams):
        y = rows - 1 - i  # first stream on top
        for s in timeline.spans_for(name):
            ax.broken_barh([(s.start_ms, max(s.duration_ms, 1e-6))], (y - 0.4, 0.8),
                           facecolors=engine_color(s.engine), edgecolors="black", linewidth=0.3)
            if labels and s.duration_ms >= 0.03 * timeline.makespan_ms:
                ax.text(s.start_ms + s.duration_ms / 2, y, s.name, ha="center", va="center",
                        fontsize=6, clip_on=True)
    ax.set_yticks(range(rows))
    ax.set_yticklabels(list(reversed(streams)) or [""])
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_xlabel("ms from the run's start")
    end = max(timeline.end_ms, timeline.start_ms + (bound_ms or 0.0))
    ax.set_xlim(0.0, end * 1.02 if end > 0 else 1.0)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    if bound_ms is not None:
        ax.axvline(timeline.start_ms + bound_ms, color="red", linestyle="--", linewidth=0.8)
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=engine_color(e), edgecolor="black", linewidth=0.3, label=e)
               for e in timeline.engines]
    if bound_ms is not None:
        from matplotlib.lines import Line2D
        handles.append(Line2D([0], [0], color="red", linestyle="--", linewidth=0.8,
                              label=f"bound {bound_ms:.3f} ms"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7,
                  frameon=False)
    if title is None:
        bits = [x for x in (timeline.executor, timeline.policy) if x]
        title = f"{' / '.join(bits) + ': ' if bits else ''}" \
                f"{counted(len(timeline.spans), 'node')}, makespan {timeline.makespan_ms:.3f} ms"
    ax.set_title(title, fontsize=9)
    fig.savefig(path, bbox_inches="tight")
    return path

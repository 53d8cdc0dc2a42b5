"""`orchestra run --trace FILE.json --plot FILE.png`: what the CLI does with the traced run.

The main job runs one extra, traced repeat after the timed ones (`MainJob(trace=True)`), so the
wall times never include tracing. This module writes that run's `Timeline` as a Chrome trace
(Perfetto) and, optionally, a PNG Gantt chart, reads the trace back to count its node events
and tracks, and formats the summary `orchestra run` prints.
"""

from __future__ import annotations

import importlib.util
import json
import os

from orchestra.trace.plot import MISSING


def check_outputs(trace_path, plot_path) -> str | None:
    """A one-line reason the outputs cannot be written (checked before any GPU work), or None."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        return f"--plot: {MISSING}"
    for opt, path in (("--trace", trace_path), ("--plot", plot_path)):
        if path:
            folder = os.path.dirname(os.path.abspath(os.fspath(path)))
            if not os.path.isdir(folder):
                return f"{opt} {path}: the folder {folder} does not exist"
    return None


def trace_counts(trace: dict) -> tuple[int, int]:
    """(node events, tracks) of a Chrome trace object: ``X`` events and ``thread_name`` tracks."""
    events = trace.get("traceEvents", [])
    nodes = sum(1 for e in events if e.get("ph") == "X")
    tracks = len({(e.get("pid"), e.get("tid")) for e in events
                  if e.get("ph") == "M" and e.get("name") == "thread_name"})
    return nodes, tracks


def write_outputs(timeline, *, trace_path=None, plot_path=None, bound_ms=None) -> dict:
    """Write the Chrome trace (read back: it must parse) and the Gantt chart; return what
    `format_trace` and ``--json`` report: counts, metrics, paths."""
    from orchestra.trace import pipeline_bound_ms, plot_gantt, to_chrome_trace, write_chrome_trace

    if trace_path:
        write_chrome_trace(timeline, trace_path)
        with open(trace_path, encoding="utf-8") as f:
            nodes, tracks = trace_counts(json.load(f))
    else:
        nodes, tracks = trace_counts(to_chrome_trace(timeline))
    if plot_path:
        plot_gantt(timeline, plot_path, bound_ms=bound_ms)
    m = timeline.metrics()
    own_bound = pipeline_bound_ms(timeline)
    T = m.makespan_ms
    return {
        "trace_file": None if trace_path is None else os.fspath(trace_path),
        "plot_file": None if plot_path is None else os.fspath(plot_path),
        "nodes": nodes, "tracks": tracks, "spans": len(timeline), "streams": list(timeline.streams),
        "makespan_ms": T, "busy_ms": dict(m.busy_ms),
        "overlap_ms": {f">={k}": m.overlap_ms(k) for k in range(2, len(m.engines) + 1)},
        "pairs_ms": {f"{a}&{b}": v for (a, b), v in m.pairs_ms.items()},
        "bound_ms": bound_ms, "efficiency": (bound_ms / T) if bound_ms and T > 0 else None,
        "timeline_bound_ms": own_bound,
        "timeline_efficiency": (own_bound / T) if own_bound and T > 0 else None,
    }


def format_trace(timeline, info: dict) -> str:
    """The text `orchestra run` prints after its report."""
    lines = ["traced run (one extra run after the timed ones, verified, not in the wall times):",
             timeline.summary(bound_ms=info["bound_ms"])]
    if info["bound_ms"] is not None:
        lines.append("  (bound from the single-batch timings above; efficiency = bound / "
                     "makespan of the traced run)")
    if info["timeline_bound_ms"] is not None and info["timeline_efficiency"] is not None:
        lines.append(f"bound from the traced node times {info['timeline_bound_ms']:.3f} ms, "
                     f"efficiency {100.0 * info['timeline_efficiency']:.1f}%")
    if info["trace_file"]:
        lines.append(f"Chrome trace {info['trace_file']}: {info['nodes']} node events, "
                     f"{info['tracks']} tracks (one per stream); open it in ui.perfetto.dev")
    else:
        lines.append(f"trace: {info['nodes']} node events, {info['tracks']} tracks")
    if info["plot_file"]:
        lines.append(f"Gantt chart {info['plot_file']}")
    return "\n".join(lines)


__all__ = ["check_outputs", "format_trace", "trace_counts", "write_outputs"]

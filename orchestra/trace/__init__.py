"""orchestra.trace: when each node ran, what overlapped, and pictures of it.

    timeline = executor.run(graph, plan, bindings, trace=True).timeline
    print(timeline.summary(bound_ms=pipeline_bound_ms(timeline)))
    write_chrome_trace(timeline, "run.json")    # open in ui.perfetto.dev
    plot_gantt(timeline, "run.png")              # needs orchestra[plot]

`Timeline` / `NodeSpan` / metrics / Chrome export / the Gantt chart are plain Python (no CUDA);
`EagerTracer` and `GraphTracer` record with the driver's timing events. See docs/trace.md.
"""

from orchestra.trace.chrome import to_chrome_trace, write_chrome_trace
from orchestra.trace.metrics import (
    Metrics, compute_metrics, concurrency, efficiency, intersect, pipeline_bound_ms, union,
)
from orchestra.trace.nvtx import node_range, nvtx_available, nvtx_range
from orchestra.trace.plot import plot_gantt
from orchestra.trace.recorder import (
    EagerTracer, EventPair, EventPool, EventTimer, GraphTracer, event_elapsed_ms,
    spans_from_event_pairs,
)
from orchestra.trace.timeline import (
    ENGINE_COLORS, ENGINES, OVERLAP_ENGINES, NodeSpan, Timeline, engine_color, node_bytes,
)

__all__ = [
    "ENGINES", "ENGINE_COLORS", "EagerTracer", "EventPair", "EventPool", "EventTimer",
    "GraphTracer", "Metrics", "NodeSpan", "OVERLAP_ENGINES", "Timeline", "compute_metrics",
    "concurrency", "efficiency", "engine_color", "event_elapsed_ms", "intersect", "node_bytes",
    "node_range", "nvtx_available", "nvtx_range", "pipeline_bound_ms", "plot_gantt",
    "spans_from_event_pairs", "to_chrome_trace", "union", "write_chrome_trace",
]

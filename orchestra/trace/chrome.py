"""Chrome trace event JSON (opens in Perfetto, ui.perfetto.dev, and chrome://tracing).

One process per device (``pid`` = device ordinal), one thread track per stream (``tid`` = the
stream's index in ``Timeline.streams``, named by ``thread_name`` metadata), one complete ("X")
event per node with ``ts``/``dur`` in µs and the node's kind, batch, engine, stream and bytes in
``args``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from orchestra.errors import TraceTypeError
from orchestra.trace.timeline import Timeline


def to_chrome_trace(timeline: Timeline) -> dict:
    """The timeline as a Chrome trace object (``json.dumps`` it, or use `write_chrome_trace`)."""
    if not isinstance(timeline, Timeline):
        raise TraceTypeError(f"to_chrome_trace expects a Timeline; got {type(timeline).__name__}")
    tids = {name: i for i, name in enumerate(timeline.streams)}
    pids = sorted({timeline.device} | {s.device for s in timeline.spans})
    used = {(s.device, s.stream) for s in timeline.spans}
    label = ", ".join(x for x in (timeline.executor, timeline.policy) if x)
    events: list[dict] = []
    for pid in pids:
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"device {pid}" + (f" ({label})" if label else "")}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for name, tid in tids.items():
            # every stream gets a track on the timeline's device; on other devices only if used
            if pid != timeline.device and (pid, name) not in used:
                continue
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
    for s in timeline.spans:
        args: dict[str, Any] = {"kind": s.kind, "engine": s.engine, "stream": s.stream,
                                "batch": s.batch}
        if s.nbytes is not None:
            args["bytes"] = s.nbytes
            if s.duration_ms > 0 and s.engine in ("upload", "download"):
                args["GB/s"] = round(s.nbytes / (s.duration_ms * 1e6), 3)
        events.append({"name": s.name, "cat": s.engine, "ph": "X", "pid": s.device,
                       "tid": tids[s.stream], "ts": s.start_ms * 1e3,
                       "dur": s.duration_ms * 1e3, "args": args})
    other = {"producer": "orchestra.trace", "executor": timeline.executor,
             "policy": timeline.policy, "device": timeline.device,
             "streams": list(timeline.streams), "makespan_ms": timeline.makespan_ms}
    for k, v in timeline.meta.items():
        other.setdefault(str(k), v)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(timeline: Timeline, path) -> str:
    """Write `to_chrome_trace` as JSON to ``path``; returns the path as a str."""
    path = os.fspath(path)
    data = to_chrome_trace(timeline)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, default=str)
        f.write("\n")
    return path

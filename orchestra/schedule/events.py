"""Event insertion: join streams only where an edge crosses streams and is not already implied.

Nodes are visited in one global order that respects the graph (so every stream's order does too).
Each stream carries a vector clock of what it already waits for. For a node, its cross-stream
predecessors are taken latest first; a predecessor the clock already covers needs nothing; any
other gets one wait on an event recorded right after it, and the clock joins that node's clock.
Those waits are exactly the cross-stream edges of the transitive reduction of
(graph edges + stream order): no fewer waits can order every edge without adding false
dependencies. An event recorded after a node is shared by all the waits on that node.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from orchestra.errors import GraphError
from orchestra.graph import TaskGraph
from orchestra.schedule.plan import Plan, RecordEvent, RunNode, StreamSpec, WaitEvent


def insert_events(graph: TaskGraph, node_stream: dict[str, str],
                  streams: Sequence[StreamSpec | str], order: Sequence[str] | None = None,
                  policy: str = "manual", meta: dict | None = None) -> Plan:
    """The plan that runs each node on ``node_stream[node]``, streams in ``order`` (default: the
    graph's topological order), with the fewest events that order every edge."""
    specs = tuple(s if isinstance(s, StreamSpec) else StreamSpec(s) for s in streams)
    sid = {s.name: i for i, s in enumerate(specs)}
    order = tuple(graph.topological_order() if order is None else order)
    names = [n.name for n in graph.nodes]
    if len(order) != len(names) or set(order) != set(names):  # names are unique
        raise GraphError("order must list every node of the graph exactly once")
    gpos = {n: i for i, n in enumerate(order)}
    preds = graph.predecessor_map()  # node -> {pred: reason}, unordered (cross is sorted below)
    for v in order:
        gv = gpos[v]
        for p in preds[v]:
            if gpos[p] > gv:
                p = next(q for q in graph.predecessors(v) if gpos[q] > gv)  # the first one
                raise GraphError(f"order puts {v} before {p}, but {v} depends on {p}")
    on = {}  # node -> stream index
    for n in order:
        if node_stream.get(n) not in sid:
            raise GraphError(f"node {n} is assigned to stream {node_stream.get(n)!r}, "
                             f"not one of {list(sid)}")
        on[n] = sid[node_stream[n]]

    S = len(specs)
    cur = [[0] * S for _ in specs]
    # cur[s] as a tuple, valid until a wait changes a counter other than s's own: the clock
    # every node run in between shares (its own counter there is stale; pos has it)
    shared: list[tuple[int, ...] | None] = [None] * S
    seen: dict[str, tuple[int, ...]] = {}
    pos: dict[str, int] = {}
    waits = defaultdict(list)  # node -> predecessors it waits for, in wait order
    sources: set[str] = set()
    for v in order:
        s = on[v]
        c = cur[s]
        ps = preds[v]
        if ps:
            cross = [p for p in ps if on[p] != s]
            if len(cross) > 1:
                cross.sort(key=gpos.__getitem__, reverse=True)
            for p in cross:
                sp = on[p]
                if c[sp] >= pos[p]:
                    continue  # already ordered through an earlier wait or stream order
                waits[v].append(p)
                sources.add(p)
                c[:] = map(max, c, seen[p])
                c[sp] = pos[p]  # the snapshot's own counter is stale
                shared[s] = None
        c[s] += 1
        pos[v] = c[s]
        snap = shared[s]
        if snap is None:
            snap = shared[s] = tuple(c)
        seen[v] = snap

    # events numbered by their source's place in the global order: stable and readable
    event = {p: f"e{i}" for i, p in enumerate(sorted(sources, key=gpos.__getitem__))}
    steps: dict[str, list[RunNode | RecordEvent | WaitEvent]] = {sp.name: [] for sp in specs}
    for v in order:
        out = steps[node_stream[v]]
        if v in waits:
            out.extend(WaitEvent(event[p]) for p in waits[v])
        out.append(RunNode(v))
        if v in event:
            out.append(RecordEvent(event[v]))
    return Plan(specs, steps, policy, order, meta or {})

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

from typing import Sequence, cast

from orchestra.errors import GraphError
from orchestra.graph import TaskGraph
from orchestra.graph.trusted import make_each
from orchestra.schedule.plan import Plan, RecordEvent, RunNode, StreamSpec, WaitEvent


def insert_events(graph: TaskGraph, node_stream: dict[str, str],
                  streams: Sequence[StreamSpec | str], order: Sequence[str] | None = None,
                  policy: str = "manual", meta: dict | None = None) -> Plan:
    """The plan that runs each node on ``node_stream[node]``, streams in ``order`` (default: the
    graph's topological order), with the fewest events that order every edge.

    Raises `GraphError` when ``order`` does not list every node once, puts a node before one
    it depends on, or ``node_stream`` names a stream not in ``streams``. Pure Python, no CUDA;
    not thread-safe while ``graph`` grows.
    """
    specs = tuple(s if isinstance(s, StreamSpec) else StreamSpec(s) for s in streams)
    sid = {s.name: i for i, s in enumerate(specs)}
    graph_order = graph.topological_order()
    order = graph_order if order is None else tuple(order)
    preds = graph.predecessor_map()  # node -> {pred: reason}, unordered (cross is sorted below)
    if order == graph_order:  # the graph's own order (what the policies pass): valid as it is
        gpos = graph.topological_positions()
    else:
        gpos = _checked_positions(graph, order, preds)
    at = gpos.__getitem__
    # node -> stream index, from the mapping in one pass; anything unusual goes the slow way
    fast = dict(zip(node_stream.keys(), map(sid.get, node_stream.values())))
    if len(fast) != len(gpos) or None in fast.values() or fast.keys() != gpos.keys():
        on = _checked_streams(order, node_stream, sid)
    else:
        on = cast("dict[str, int]", fast)  # no None in it: checked just above

    S = len(specs)
    cur = [[0] * S for _ in specs]
    # cur[s] as a tuple, valid until a wait changes a counter other than s's own: the clock
    # every node run in between shares (its own counter there is stale; pos has it)
    shared: list[tuple[int, ...] | None] = [None] * S
    seen: dict[str, tuple[int, ...]] = {}
    pos: dict[str, int] = {}
    waits: dict[str, list[str]] = {}  # node -> predecessors it waits for, in wait order
    sources: set[str] = set()
    for v in order:
        s = on[v]
        c = cur[s]
        ps = preds[v]
        if ps:
            cross = [p for p in ps if on[p] != s]
            if cross:
                if len(cross) > 1:
                    cross.sort(key=at, reverse=True)
                for p in cross:
                    sp = on[p]
                    if c[sp] >= pos[p]:
                        continue  # already ordered through an earlier wait or stream order
                    w = waits.get(v)
                    if w is None:
                        waits[v] = [p]
                    else:
                        w.append(p)
                    sources.add(p)
                    c[:] = map(max, c, seen[p])
                    c[sp] = pos[p]  # the snapshot's own counter is stale
                    shared[s] = None
        n = c[s] = c[s] + 1
        pos[v] = n
        snap = shared[s]
        if snap is None:
            snap = shared[s] = tuple(c)
        seen[v] = snap

    # events numbered by their source's place in the global order: stable and readable. The
    # steps are made in bulk (`make_each`): one RunNode per node, one RecordEvent and one
    # WaitEvent per event (steps are frozen values: the waits on one event share one).
    ordered = sorted(sources, key=at)
    names = [f"e{i}" for i in range(len(ordered))]
    record_of = dict(zip(ordered, make_each(RecordEvent, "event", names)))
    wait_of = dict(zip(ordered, make_each(WaitEvent, "event", names)))
    lists: list[list[RunNode | RecordEvent | WaitEvent]] = [[] for _ in specs]
    recorded: list[list[str]] = [[] for _ in specs]  # events per stream, in record order
    members: list[list[str]] = [[] for _ in specs]  # nodes per stream, in run order
    n_waits = 0
    for v, run in zip(order, make_each(RunNode, "node", order)):
        k = on[v]
        out = lists[k]
        w = waits.get(v)
        if w is not None:
            out.extend([wait_of[p] for p in w])
            n_waits += len(w)
        out.append(run)
        members[k].append(v)
        rec = record_of.get(v)
        if rec is not None:
            out.append(rec)
            recorded[k].append(rec.event)
    # what Plan() would derive by scanning every step, known here already
    stream_of: dict[str, str] = {}
    for spec, ms in zip(specs, members):
        stream_of.update(dict.fromkeys(ms, spec.name))
    events = tuple(e for evs in recorded for e in evs)  # every waited event is recorded
    return Plan._derived(specs, {sp.name: tuple(x) for sp, x in zip(specs, lists)}, policy,
                         order, dict(meta or {}), stream_of, events, (len(events), n_waits))


def _checked_positions(graph: TaskGraph, order: tuple, preds: dict) -> dict[str, int]:
    """``order``'s positions, after checking it lists every node once and never puts a node
    before one of its predecessors (`GraphError` naming the pair)."""
    gpos = {n: i for i, n in enumerate(order)}
    # every node exactly once: as many names as nodes, none twice, the graph's own names
    if len(order) != len(preds) or len(gpos) != len(order) or gpos.keys() != preds.keys():
        raise GraphError("order must list every node of the graph exactly once")
    at = gpos.__getitem__
    for v in order:
        ps = preds[v]
        if ps and max(map(at, ps)) > gpos[v]:
            gv = gpos[v]
            p = next(q for q in graph.predecessors(v) if gpos[q] > gv)  # the first one
            raise GraphError(f"order puts {v} before {p}, but {v} depends on {p}")
    return gpos


def _checked_streams(order: tuple, node_stream, sid: dict) -> dict[str, int]:
    """Node -> stream index for every node of ``order``; `GraphError` for a node without one
    of the plan's streams."""
    on = {n: sid.get(node_stream.get(n)) for n in order}
    if None in on.values():
        n = next(n for n in order if on[n] is None)
        raise GraphError(f"node {n} is assigned to stream {node_stream.get(n)!r}, "
                         f"not one of {list(sid)}")
    return cast("dict[str, int]", on)

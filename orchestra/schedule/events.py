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

from collections import deque
from itertools import compress, repeat
from operator import add, mod, setitem
from typing import Any, Sequence, cast

from orchestra.errors import GraphError
from orchestra.graph import TaskGraph
from orchestra.graph.trusted import make_each
from orchestra.schedule.plan import (
    Plan, PlanIndex, RecordEvent, RunNode, StreamSpec, WaitEvent,
)


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
    if order == graph_order:  # the graph's own order (what the policies pass): valid as it is
        gpos = graph.topological_positions()
    else:
        gpos = _checked_positions(graph, order, graph.predecessor_map())
    # node -> stream index, from the mapping in one pass; anything unusual goes the slow way
    fast: dict[str, Any] = dict(zip(node_stream.keys(), map(sid.get, node_stream.values())))
    if len(fast) != len(gpos) or None in fast.values() or fast.keys() != gpos.keys():
        fast = _checked_streams(order, node_stream, sid)
    on = list(map(cast("dict[str, int]", fast).__getitem__, graph.node_map()))
    if order == graph_order and graph._program_order_is_topological():
        issue = None  # node indices are the issue order
    else:
        issue = list(map(graph.index, order))
    return plan_by_index(graph, on, specs, issue, policy, meta)


def plan_by_index(graph: TaskGraph, on: list[int], specs: tuple[StreamSpec, ...],
                  issue: list[int] | None = None, policy: str = "manual",
                  meta: dict | None = None) -> Plan:
    """`insert_events` by node index (`TaskGraph.index`): node ``v`` runs on stream
    ``specs[on[v]]``, nodes issued in the order of ``issue`` (node indices; None: index order,
    which must then be a topological order). The caller checked what `insert_events` checks.

    Each stream's steps are written as codes while the clocks are kept (`PlanIndex`: ``1 +
    v`` runs node ``v``, ``1 + n + p`` records the event of node ``p``, ``1 + 2n + p`` waits
    for it), with a place (0) kept after each run for its record: a node becomes an event's
    source only when a later node waits for it. The step objects, the listing and the makespan
    are then made from the codes by lookups in C, not step by step in Python."""
    nodes, back = graph._by_index()
    n = len(nodes)
    if issue is None:
        rank = None
        seq: Sequence[int] = range(n)
    else:
        rank = [0] * n
        for i, v in enumerate(issue):
            rank[v] = i
        seq = issue
    S = len(specs)
    cur = [[0] * S for _ in specs]
    # cur[s] as a tuple, valid until a wait changes a counter other than s's own: the clock
    # every node run in between shares (its own counter there is stale; pos has it)
    shared: list[tuple[int, ...] | None] = [None] * S
    seen: list = [None] * n
    pos = [0] * n
    codes: list[list[int]] = [[] for _ in specs]
    slot = [0] * n  # where node v's record goes in codes[on[v]] (a 0 until then)
    source = bytearray(n)  # 1: an event is recorded after node v
    R, W = 1 + n, 1 + 2 * n  # records' and waits' codes (runs' from 1)
    n_waits = 0
    # each node with its stream and its predecessors' distances, in issue order
    walk = zip(seq, on, back) if rank is None else ((v, on[v], back[v]) for v in seq)
    for v, s, ps in walk:
        c = cur[s]
        cs = codes[s]
        if ps:
            # the predecessors on other streams, latest first (one or two: no list needed)
            if len(ps) == 1:
                p = v - ps[0]
                cross: Sequence[int] = (p,) if on[p] != s else ()
            elif len(ps) == 2 and rank is None:
                p, q = v - ps[0], v - ps[1]
                if on[p] == s:
                    cross = () if on[q] == s else (q,)
                elif on[q] == s:
                    cross = (p,)
                else:
                    cross = (p, q) if p > q else (q, p)
            else:
                cross = [v - d for d in ps if on[v - d] != s]
                if len(cross) > 1:
                    if rank is None:
                        cross.sort(reverse=True)
                    else:
                        cross.sort(key=rank.__getitem__, reverse=True)
            for p in cross:
                sp = on[p]
                if c[sp] >= pos[p]:
                    continue  # already ordered through an earlier wait or stream order
                cs.append(W + p)
                n_waits += 1
                if not source[p]:
                    source[p] = 1
                    codes[sp][slot[p]] = R + p
                c[:] = map(max, c, seen[p])
                c[sp] = pos[p]  # the snapshot's own counter is stale
                shared[s] = None
        cs.append(1 + v)
        slot[v] = len(cs)
        cs.append(0)
        k = c[s] = c[s] + 1
        pos[v] = k
        snap = shared[s]
        if snap is None:
            snap = shared[s] = tuple(c)
        seen[v] = snap

    # events numbered by their source's place in the issue order: stable and readable; the
    # steps made in bulk (`make_each`): one RunNode per node, one RecordEvent and one
    # WaitEvent per event (steps are frozen values: the waits on one event share one)
    sources = (list(compress(seq, source)) if rank is None else
               [v for v in seq if source[v]])
    events = list(map(mod, repeat("e%d"), range(len(sources))))
    names = [x.name for x in nodes]
    table: list = [None]
    table += make_each(RunNode, "node", names)
    table += repeat(None, 2 * n)
    at_record = list(map(add, repeat(R), sources))
    deque(map(setitem, repeat(table), at_record, make_each(RecordEvent, "event", events)), 0)
    deque(map(setitem, repeat(table), map(add, repeat(n), at_record),
              make_each(WaitEvent, "event", events)), 0)
    codes = [list(filter(None, cs)) for cs in codes]  # without the places no record took
    steps = {sp.name: tuple(map(table.__getitem__, cs)) for sp, cs in zip(specs, codes)}
    order = tuple(names) if issue is None else tuple([names[v] for v in issue])
    hint = PlanIndex(graph, codes, n, names, sources, events, on)
    return Plan._derived(specs, steps, policy, order, dict(meta or {}), (len(sources), n_waits),
                         hint)


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

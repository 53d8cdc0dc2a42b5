"""Stream assignment policies: round-robin, by-engine, critical-path, concurrent.

Each policy picks a stream per node and one global node order that respects the graph; event
insertion then adds the joins. Rules shared by all: a `Free` runs on the stream of the buffer's
last use (its latest predecessor), so freeing needs no event in the common case; nodes without a
``batch`` fall back to their connected component (several independent pieces) or to their index
within their level (one piece), as Taskflow's round-robin capturer does.
"""

from __future__ import annotations

import heapq
from typing import cast

import attrs

from orchestra.errors import GraphError, ScheduleArgumentTypeError, ScheduleError, int_text
from orchestra.graph import TaskGraph
from orchestra.graph.collector import paused
from orchestra.graph.fields import is_int
from orchestra.schedule.concurrent import concurrent
from orchestra.schedule.costs import Costs, check_costs_type, estimate_costs, resource_of
from orchestra.schedule.devices import graph_devices, place_by_device
from orchestra.schedule.events import insert_events, plan_by_index
from orchestra.schedule.plan import Plan, StreamSpec

POLICIES = ("round-robin", "by-engine", "critical-path", "concurrent")
#: Policies that use ``resident_blocks`` (executors fill it from kernel occupancy).
CAPACITY_POLICIES = ("concurrent",)


def schedule(graph: TaskGraph, policy: str = "by-engine", streams: int = 3,
             costs: Costs = None, *, resident_blocks=None) -> Plan:
    """A `Plan` for ``graph`` on ``streams`` streams.

    - ``round-robin``: batch b wholly on stream ``s{b % streams}``, nodes in program order: the
      classic multi-stream loop.
    - ``by-engine``: 1 stream: ``main``. 2: ``main`` (allocs, H2D, kernels) and ``download`` (D2H).
      3+: ``upload`` (allocs, H2D), ``compute`` (kernels; ``compute0``.. round-robin by batch when
      streams > 3), ``download`` (D2H). Host functions follow their latest predecessor.
    - ``critical-path``: a list scheduler over estimated costs (see `costs.CostModel`; ``costs``
      may be a dict node -> µs or a callable): the ready node that can start earliest (ties: the
      longest remaining path) goes on the stream where it starts earliest, with one upload copy
      engine, one download copy engine and the SMs as exclusive resources. Allocs are placed just
      before their first use. The estimated makespan is in ``plan.meta["makespan_us"]``.
    - ``concurrent``: by-engine's copy streams; kernels that do not fill the GPU (grid smaller
      than ``resident_blocks[node]``, the blocks the device holds at once for that launch) go
      on separate compute streams (``compute0``..) so independent ones run at once; kernels
      that fill it, or whose capacity is unknown, stay on one (`concurrent`). Needs
      ``streams`` >= 4 for two compute streams. The executors fill ``resident_blocks`` from
      ``Kernel.occupancy()`` and the SM count; other policies ignore it.

    ``streams`` is an upper bound: a stream no node would run on is left out of the plan (the
    others keep their names), so ``by-engine`` with 100 streams and 4 batches makes ``upload``,
    ``compute0``..``compute3`` and ``download``, and an executor creates those 6 streams only.
    A graph with no nodes keeps the policy's first stream.

    Devices (`devices`): a graph on one device gets the streams above on that device; a graph
    whose nodes run on several devices gets them per device (``d0.compute``, ``d1.compute``,
    ...; ``streams`` is then per device), and each edge between devices becomes an event
    recorded on one device's stream and waited on by the other's.
    """
    if not isinstance(graph, TaskGraph):
        raise ScheduleArgumentTypeError(f"schedule() needs a TaskGraph as its first argument; "
                                        f"got {type(graph).__name__}")
    if not is_int(streams):  # a numpy integer is one (np.int64(4) was refused)
        raise ScheduleArgumentTypeError(f"streams must be an int >= 1; got {streams!r}")
    streams = int(streams)
    if streams < 1:
        raise ScheduleError(f"streams must be an int >= 1; got {int_text(streams)}")
    if not isinstance(policy, str):  # a list or a dict would fail the policy lookups inside
        raise ScheduleArgumentTypeError(f"policy must be a string, one of {', '.join(POLICIES)};"
                                        f" got {type(policy).__name__} {policy!r:.80}")
    check_costs_type(costs)
    with paused():  # no cycles made: the collector's passes over the graph would find nothing
        return _schedule(graph, policy, streams, costs, resident_blocks)


def _schedule(graph, policy, streams, costs, resident_blocks) -> Plan:
    graph.validate()
    if policy in ("critical-path", "concurrent"):
        # Both take the lowest-numbered idle stream first, so with one stream more than there
        # are nodes one is always idle and the rest never used: the same plan as any larger
        # count, without lists of ``streams`` entries (``--streams 10**23`` ran out of memory).
        streams = min(streams, len(graph) + 3)
    if policy in _BY_INDEX:
        specs, on, seq = _BY_INDEX[policy](graph, streams)
        devs = graph_devices(graph)
        if len(devs) == 1:  # one device: the policy's streams there, node indices kept
            if devs != (0,):
                specs = tuple(attrs.evolve(sp, device=devs[0]) for sp in specs)
            return plan_by_index(graph, on, specs, seq, policy, {})
        assign = _as_assign(graph, specs, on)
        order = graph.topological_order()
        meta: dict = {}
    elif policy == "critical-path":
        specs, assign, order, meta = _critical_path(graph, streams, costs)
    elif policy == "concurrent":
        specs, assign, order, meta = concurrent(graph, streams, costs, resident_blocks)
    else:
        raise ScheduleError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    specs, assign = place_by_device(graph, specs, assign, order)  # streams per device
    return insert_events(graph, assign, _used(specs, assign), order, policy, meta)


def _used(specs, assign):
    """The streams some node runs on, in the policy's order (its first one when none is)."""
    used = set(assign.values())
    return tuple(s for s in specs if s.name in used) or specs[:1]


def _group_keys(graph: TaskGraph) -> dict[str, int]:
    """Per node: its batch, else its component (if several), else its index within its level."""
    key = {name: n.batch for name, n in graph.node_map().items()}
    if None not in key.values():  # the common case: no fallback to compute
        return cast("dict[str, int]", key)
    nodes = graph.nodes
    comp = graph.components()
    several = len(set(comp.values())) > 1
    in_level = {n: i for level in graph.levels() for i, n in enumerate(level)}
    return {n.name: n.batch if n.batch is not None else (comp[n.name] if several else in_level[n.name])
            for n in nodes}


def _group_key_list(graph: TaskGraph) -> list[int]:
    """`_group_keys` by node index, from the edges by index (no table by name)."""
    nodes, back = graph._by_index()
    keys = [n.batch for n in nodes]
    if None not in keys:
        return cast("list[int]", keys)
    n = len(nodes)
    # components: union-find over the edges, numbered by their first node
    parent = list(range(n))
    for v in range(n):
        for d in back[v]:
            a, b = v, v - d
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            while parent[b] != b:
                parent[b] = parent[parent[b]]
                b = parent[b]
            if a != b:
                parent[max(a, b)] = min(a, b)
    comp = [0] * n
    number: dict[int, int] = {}
    for v in range(n):
        r = v
        while parent[r] != r:
            r = parent[r]
        comp[v] = number.setdefault(r, len(number))
    if len(number) > 1:
        return [k if k is not None else c for k, c in zip(keys, comp)]
    # one piece: each node's place within its level (longest path from a source), the levels'
    # nodes in program order
    level = [0] * n
    for v in (range(n) if graph._program_order_is_topological()
              else map(graph.index, graph.topological_order())):
        ps = back[v]
        if ps:
            level[v] = (level[v - ps[0]] if len(ps) == 1
                        else max([level[v - d] for d in ps])) + 1
    count = [0] * (max(level, default=0) + 1)  # nodes seen so far per level
    in_level = [0] * n
    for v, lv in enumerate(level):
        in_level[v] = count[lv]
        count[lv] += 1
    return [k if k is not None else i for k, i in zip(keys, in_level)]


def _walk(graph: TaskGraph):
    """``(nodes, back, seq, latest)``: the graph by node index (`TaskGraph._by_index`), the
    node indices in topological order (None: index order is one) and ``latest(v)``, the
    predecessor of node ``v`` latest in that order (v must have one)."""
    nodes, back = graph._by_index()
    if graph._program_order_is_topological():
        return nodes, back, None, lambda v: v - min(back[v])
    pos = graph.topological_positions()
    index = graph.index
    seq = [index(n) for n in graph.topological_order()]
    rank = [0] * len(nodes)
    for i, v in enumerate(seq):
        rank[v] = i
    return nodes, back, seq, lambda v: max((v - d for d in back[v]), key=rank.__getitem__)


def _used_streams(on: list[int], spec_of) -> tuple[tuple, list[int]]:
    """The specs of the streams some node runs on (``spec_of(k)`` for stream number ``k``, in
    number order; stream 0 alone when no node runs), and ``on`` renumbered to index them.
    Only these are made: ``streams`` may be far more than the nodes (``streams=10**23`` must
    not build that many)."""
    used = sorted(set(on)) or [0]
    specs = tuple(spec_of(k) for k in used)
    if used[-1] != len(used) - 1:  # a gap: renumber
        where = {k: i for i, k in enumerate(used)}
        on = [where[k] for k in on]
    return specs, on


def _round_robin_index(graph, S):
    """Round-robin by node index: ``(specs, stream index per node, issue order)``."""
    nodes, back, seq, latest = _walk(graph)
    key = _group_key_list(graph)
    on = [0] * len(nodes)
    for v in (range(len(nodes)) if seq is None else seq):
        node = nodes[v]
        on[v] = on[latest(v)] if node.kind == "free" and back[v] else key[v] % S
    specs, on = _used_streams(on, lambda k: StreamSpec(f"s{k}"))
    return specs, on, seq


def _as_assign(graph, specs, on) -> dict[str, str]:
    """Node name -> stream name, from stream indices by node index."""
    return dict(zip(graph.node_map().keys(), [specs[k].name for k in on]))


# by-engine: what a node's class decides (engine and kind are class attributes)
_UP, _DOWN, _FOLLOW, _COMPUTE = range(4)


def _engine_rule(cls) -> int:
    engine, kind = cls.engine, cls.kind
    if engine == "upload" or (engine == "memory" and kind != "free"):
        return _UP  # allocs go where the uploads are
    if engine == "download":
        return _DOWN
    if kind == "free" or engine == "host":
        return _FOLLOW  # the latest predecessor's stream
    return _COMPUTE


def _by_engine_index(graph, S):
    """By-engine by node index: ``(specs, stream index per node, issue order)``. Stream
    numbers: upload 0, compute 1 .. S - 2, download S - 1 (S >= 3); only the specs of the
    streams some node runs on are made (`_used_streams`)."""
    if S == 1:
        up = down = 0
        nc, first = 1, 0
        spec_of = lambda k: StreamSpec("main")  # noqa: E731
    elif S == 2:
        up, down = 0, 1
        nc, first = 1, 0
        spec_of = lambda k: (StreamSpec("main") if k == 0  # noqa: E731
                             else StreamSpec("download", role="download"))
    else:
        nc, first = S - 2, 1
        up, down = 0, S - 1

        def spec_of(k):
            if k == up:
                return StreamSpec("upload", role="upload")
            if k == down:
                return StreamSpec("download", role="download")
            return StreamSpec("compute" if nc == 1 else f"compute{k - 1}", role="compute")
    nodes, back, seq, latest = _walk(graph)
    # one compute stream: every node's group key would pick it, so none is computed
    one = first if nc == 1 else None
    key = _group_key_list(graph) if one is None else []
    on = [0] * len(nodes)
    rules: dict[type, int] = {}
    for v in (range(len(nodes)) if seq is None else seq):
        cls = type(nodes[v])
        rule = rules.get(cls)
        if rule is None:
            rule = rules[cls] = _engine_rule(cls)
        if rule == _UP:
            on[v] = up
        elif rule == _DOWN:
            on[v] = down
        elif rule == _FOLLOW and back[v]:
            ps = back[v]
            on[v] = on[v - ps[0]] if len(ps) == 1 else on[latest(v)]
        else:
            on[v] = one if one is not None else first + key[v] % nc
    specs, on = _used_streams(on, spec_of)
    return specs, on, seq


_BY_INDEX = {"round-robin": _round_robin_index, "by-engine": _by_engine_index}


def _critical_path(graph, S, costs):
    # Earliest-start first, longest remaining path breaking ties. Pure priority order would
    # queue every upload (longest path) ahead of every kernel, and since a stream runs in
    # enqueue order (no backfilling) the kernels would start late. Ready nodes are grouped by
    # the resource they need (or the stream they are pinned to): each group's start threshold
    # only grows, so a pending heap (by data-ready time) and a ready heap (by priority) per group
    # keep a step O(groups x log n).
    cost = estimate_costs(graph, costs)
    names = [n.name for n in graph.nodes]
    idx = {n: i for i, n in enumerate(names)}
    node = {n.name: n for n in graph.nodes}
    preds = {n: graph.predecessors(n) for n in names}
    succs = {n: graph.successors(n) for n in names}
    bl: dict[str, float] = {}  # longest remaining path, this node included (µs)
    for n in reversed(graph.topological_order()):
        bl[n] = cost[n] + max((bl[s] for s in succs[n]), default=0.0)
    # Allocs with a use are placed lazily, just before their first scheduled use: allocating
    # every batch up front would be "earliest" but holds all memory at once.
    lazy = {n for n in names if node[n].kind == "alloc" and succs[n]
            and not any(node[p].kind == "alloc" for p in preds[n])}
    eff = {}
    for n in names:
        if n in lazy:
            continue
        e = set()
        for p in preds[n]:
            e.update(preds[p] if p in lazy else (p,))
        eff[n] = e
    users = {n: [] for n in names}
    for n, e in eff.items():
        for p in e:
            users[p].append(n)
    remaining = {n: len(e) for n, e in eff.items()}

    stream_free = [0.0] * S
    res_free = {"upload": 0.0, "download": 0.0, "compute": 0.0}
    finish: dict[str, float] = {}
    where: dict[str, int] = {}
    seq: list[str] = []
    groups: dict = {}  # group key -> (pending heap by data-ready time, available heap by priority)

    def push(v):
        dr = max((finish[p] for p in eff[v]), default=0.0)
        if node[v].kind == "free":  # pinned to the stream of the buffer's last use
            last = max(eff[v] | {p for p in preds[v] if p in finish},
                       key=lambda p: (finish[p], seq_pos[p]), default=None)
            g = ("stream", where[last] if last is not None else 0)
        else:
            g = ("res", resource_of(node[v]))
        heapq.heappush(groups.setdefault(g, ([], []))[0], (dr, -bl[v], idx[v], v))

    def threshold(g):
        if g[0] == "stream":
            return stream_free[g[1]]
        t = min(stream_free)
        return max(t, res_free[g[1]]) if g[1] else t

    seq_pos: dict[str, int] = {}
    for v in names:
        if v not in lazy and remaining[v] == 0:
            push(v)
    while len(seq) < len(names):
        best = None
        for g, (pending, avail) in groups.items():
            t = threshold(g)
            while pending and pending[0][0] <= t:
                dr, nbl, i, v = heapq.heappop(pending)
                heapq.heappush(avail, (nbl, i, v, dr))
            if avail:
                cand = (t, avail[0][0], avail[0][1], g)
            elif pending:
                cand = (pending[0][0], pending[0][1], pending[0][2], g)
            else:
                continue
            if best is None or cand < best:
                best = cand
        if best is None:
            raise GraphError("critical-path: no node is ready (the graph has a cycle?)")
        est, _, _, g = best
        pending, avail = groups[g]
        if avail and threshold(g) == est:
            _, _, v, dr = heapq.heappop(avail)
        else:
            dr, _, _, v = heapq.heappop(pending)
        if g[0] == "stream":
            s = g[1]
        else:
            fits = [i for i in range(S) if stream_free[i] <= est]
            pred_streams = [where[p] for p in sorted(eff[v], key=lambda p: -finish[p])]
            s = next((ps for ps in pred_streams if ps in fits), None)
            if s is None:  # best fit: the stream that went idle last, keeping others free
                s = max(fits, key=lambda i: (stream_free[i], -i))
        for a in sorted((p for p in preds[v] if p in lazy and p not in finish), key=idx.__getitem__):
            _place(a, s, stream_free[s], cost, finish, where, seq, seq_pos, stream_free)
        res = resource_of(node[v])
        start = max(stream_free[s], dr, res_free[res] if res else 0.0)
        _place(v, s, start, cost, finish, where, seq, seq_pos, stream_free)
        if res:
            res_free[res] = finish[v]
        for u in users[v]:
            remaining[u] -= 1
            if remaining[u] == 0:
                push(u)

    specs = []
    for i in range(S):
        engines = [node[n].engine for n in seq if where[n] == i]
        counts = {r: engines.count(r) for r in ("upload", "compute", "download")}
        role = max(counts, key=counts.get) if any(counts.values()) else "general"
        if sum(counts.values()) and counts[role] * 2 <= sum(counts.values()):
            role = "general"  # no engine dominates
        specs.append(StreamSpec(f"s{i}", role=role))
    assign = {n: specs[where[n]].name for n in names}
    return tuple(
        specs), assign, tuple(seq), {"makespan_us": round(max(finish.values(), default=0.0), 3)}


def _place(v, s, start, cost, finish, where, seq, seq_pos, stream_free):
    finish[v] = start + cost[v]
    where[v] = s
    seq_pos[v] = len(seq)
    seq.append(v)
    stream_free[s] = finish[v]

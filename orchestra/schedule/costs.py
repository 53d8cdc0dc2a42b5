"""Per-node time estimates (µs) and a simple simulation of a plan's makespan.

Copies cost bytes / bandwidth (1 GB/s = 1,000 bytes/µs). A kernel costs ``kernel_us`` when given,
else its bytes touched / ``kernel_gbps``: by default that equals its input's copy time, the
balanced case ``orchestra run`` aims for. A node with bodies (a conditional, a child graph) costs
its most expensive body run once (a loop's iteration count is known only on the GPU). Measured
times replace the model through ``costs=``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import attrs

from orchestra.errors import ScheduleArgumentTypeError, ScheduleError, int_text
from orchestra.graph import Mode, Node, TaskGraph
from orchestra.schedule.plan import Plan, RecordEvent, RunNode, WaitEvent

_WRITE = Mode.WRITE
RESOURCES = {"upload": "upload", "download": "download", "compute": "compute"}


@attrs.frozen
class CostModel:
    """Default cost model. Bandwidths in GB/s, times in µs.

    Immutable: may be shared between threads freely.
    """

    h2d_gbps: float = 50.0
    d2h_gbps: float = 50.0
    kernel_us: float | None = None
    kernel_gbps: float = 50.0
    memset_gbps: float = 1000.0
    alloc_us: float = 1.0
    free_us: float = 1.0
    host_us: float = 5.0
    other_us: float = 1.0

    def cost(self, node, accesses=None) -> float:
        """Estimated µs for ``node``; ``accesses``: its ``accesses()`` when the caller has them
        (e.g. from `TaskGraph.accesses`)."""
        if node.bodies:
            return max(sum(self.cost(n) for n in body.nodes) for body in node.bodies)
        kind = node.kind
        if kind == "h2d":
            return node.nbytes / (self.h2d_gbps * 1e3)
        if kind == "d2h":
            return node.nbytes / (self.d2h_gbps * 1e3)
        if kind == "kernel":
            if self.kernel_us is not None:
                return float(self.kernel_us)
            reads = sum(a.range.nbytes for a in (node.accesses() if accesses is None else accesses)
                        if a.mode.reads)
            return max(reads, 1) / (self.kernel_gbps * 1e3)
        if kind == "memset":
            return node.dst.nbytes / (self.memset_gbps * 1e3)
        return {"alloc": self.alloc_us, "free": self.free_us, "host": self.host_us}.get(kind, self.other_us)


Costs = CostModel | Mapping[str, float] | Callable | None


def check_costs_type(costs) -> None:
    """`ScheduleArgumentTypeError` unless ``costs`` is one of the kinds `estimate_costs` takes
    (a list or a number would otherwise be ignored, the default model used in its place)."""
    if costs is None or isinstance(costs, (CostModel, Mapping)) or callable(costs):
        return
    raise ScheduleArgumentTypeError(
        f"costs must be None, a CostModel, a dict node name -> µs or a callable node -> µs; "
        f"got {type(costs).__name__} {_text(costs)[:80]}")


def estimate_costs(graph: TaskGraph, costs: Costs = None) -> dict[str, float]:
    """µs per node name. ``costs``: None (default model), a `CostModel`, a dict name -> µs (others
    from the default model), or a callable node -> µs (None falls back to the model)."""
    return dict(zip(graph.node_map(), cost_list(graph, costs)))


def cost_list(graph: TaskGraph, costs: Costs = None) -> list[float]:
    """`estimate_costs` by node index (`TaskGraph.index`): the same values, without a table by
    name (on a long pipeline, making that table costs as much as the values)."""
    check_costs_type(costs)
    model = costs if isinstance(costs, CostModel) else CostModel()
    given = None  # node -> µs or None, from ``costs`` (decided once, not per node)
    if isinstance(costs, Mapping):
        given = lambda node: costs.get(node.name)  # noqa: E731
    elif callable(costs) and not isinstance(costs, CostModel):
        given = costs
    out: list[float] = []
    append = out.append
    cost = model.cost
    ours = type(model).cost is CostModel.cost  # a subclass's cost() may take the node alone
    # The default model's cost per node class, decided once per class (kind and bodies are
    # the class's): a constant, a copy's bandwidth, or `CostModel.cost` (kernels, kinds with
    # bodies, the rest). `CostModel.cost` per node (a method call and a dict built per call)
    # was most of this pass on a long pipeline.
    rules: dict[type, tuple] = {}
    fixed = {"alloc": model.alloc_us, "free": model.free_us, "host": model.host_us}
    bandwidth = {"h2d": model.h2d_gbps * 1e3, "d2h": model.d2h_gbps * 1e3}
    if model.kernel_us is None:
        bandwidth["kernel"] = model.kernel_gbps * 1e3  # bytes read over kernel_gbps
    value: float | None
    node: Any  # the copy kinds' ``nbytes`` is read without naming each class
    for node in graph._by_index()[0]:  # `TaskGraph.accesses` of a node: its _accesses
        cls = type(node)
        rule = rules.get(cls)
        if rule is None:
            rule = rules[cls] = _cost_rule(cls, ours and given is None, fixed, bandwidth)
        how = rule[0]
        if how == 0:
            value = rule[1]
        elif how == 1:
            value = node.nbytes / rule[1]
        elif how == 4:  # a kernel: the bytes it reads (CostModel.cost, inline)
            reads = 0
            for a in node._accesses:
                if a.mode is not _WRITE:
                    reads += a.range.nbytes
            value = (reads or 1) / rule[1]
        elif how == 2:
            value = float(cost(node, node._accesses) if node.kind == "kernel" else cost(node))
        else:
            value = given(node) if given is not None else None
            if value is None:
                value = cost(node, node._accesses) if ours and node.kind == "kernel" \
                    else cost(node)
            try:
                # True is 1 to float(): a flag, not a time (None makes float() refuse it)
                value = float(None if isinstance(value, bool) else value)  # type: ignore[arg-type]
            except (TypeError, ValueError, OverflowError):  # not a number; an int beyond a double
                raise ScheduleError(f"cost of node {node.name} must be a finite number >= 0 µs;"
                                    f" got {type(value).__name__} {_text(value)}") from None
        if not 0 <= value < math.inf:  # an infinite cost has no makespan (nor JSON text)
            raise ScheduleError(f"cost of node {node.name} must be a finite number >= 0 µs; got"
                                f" {value!r}")
        append(value)
    if sum(out) == math.inf:  # each finite, together beyond a double: no makespan (nor JSON)
        raise ScheduleError(f"the costs of the graph's {len(out)} nodes add up to more than a "
                            f"double holds (largest {max(out):.3g} µs); give costs in µs, "
                            "below about 1e300 in all")
    return out


def _cost_rule(cls, default: bool, fixed: dict, bandwidth: dict) -> tuple:
    """How `estimate_costs` costs a node of class ``cls``: ``(0, µs)`` a constant, ``(1,
    bytes per µs)`` a copy's size over a bandwidth, ``(4, bytes per µs)`` a kernel's bytes
    read over a bandwidth, ``(2,)`` the model's `CostModel.cost`, ``(3,)`` ``costs=`` first
    (``default``: the default model alone decides)."""
    if not default:
        return (3,)
    if cls.bodies is not Node.bodies:  # a kind with bodies: its bodies' cost
        return (2,)
    if cls.kind in fixed:
        return (0, float(fixed[cls.kind]))
    if cls.kind == "kernel" and "kernel" in bandwidth:
        return (4, bandwidth["kernel"])
    if cls.kind in bandwidth and cls.kind != "kernel":
        return (1, bandwidth[cls.kind])
    return (2,)


def resource_of(node) -> str | None:
    """The engine a node occupies exclusively: one upload copy engine, one download copy engine,
    the SMs (kernels serialize in this model); None for allocs, frees and host functions."""
    return RESOURCES.get(node.engine)


def estimate_makespan(plan: Plan, graph: TaskGraph, costs: Costs = None) -> float:
    """Simulated end time (µs) of ``plan``: each stream in order, waits joined, one node at a time
    per engine, the node that can start first going next."""
    index = plan._by_index(graph)
    if index is not None:
        end = _walk_by_index(index, graph, costs)
        if end is not None:
            return end
    cost = estimate_costs(graph, costs)
    names = plan.stream_names
    steps = [plan.steps[n] for n in names]
    by_name = graph.node_map()
    res_of: dict[type, str | None] = {}  # node class -> its resource (engine is the class's)
    uses: list[set] = []  # per stream: the resources its nodes occupy
    records: list[str] = []
    for ss in steps:
        used = set()
        for st in ss:
            tp = type(st)
            if tp is RunNode or (tp is not RecordEvent and isinstance(st, RunNode)):
                node = by_name.get(st.node)
                if node is None:
                    graph.node(st.node)  # raises GraphError naming it
                cls: Any = type(node)
                res = res_of.get(cls, 0)
                if res == 0:
                    res = res_of[cls] = RESOURCES.get(cls.engine)
                used.add(res)
            elif tp is RecordEvent or isinstance(st, RecordEvent):
                records.append(st.event)
        used.discard(None)
        uses.append(used)
    recorded = set(records)
    shared = sum(len(u) for u in uses) != len(set().union(*uses))
    if shared or len(recorded) != len(records):
        return _simulate(steps, cost, by_name, recorded)
    # No engine is used by two streams (by-engine's streams, say) and every event is recorded
    # once: a node then starts when its stream reaches it, its engine being free by then (only
    # its own stream used it), so the order in which the simulation picks streams changes no
    # time. Each stream is walked on its own, until a wait for an event not recorded yet.
    S = len(steps)
    t_stream = [0.0] * S
    head = [0] * S
    ev_time: dict[str, float] = {}
    waiting: dict[str, list[int]] = {}  # unrecorded event -> streams blocked on it
    todo = list(range(S - 1, -1, -1))
    while todo:
        k = todo.pop()
        ss, i, t = steps[k], head[k], t_stream[k]
        end = len(ss)
        while i < end:
            st = ss[i]
            tp = type(st)
            if tp is not RunNode and tp is not WaitEvent and tp is not RecordEvent:
                # a subclass of a step kind: the exact-type tests above are the fast path
                tp = RunNode if isinstance(st, RunNode) else \
                    WaitEvent if isinstance(st, WaitEvent) else RecordEvent
            if tp is RunNode:
                t += cost[st.node]
            elif tp is WaitEvent:
                e = st.event
                if e in recorded:
                    at = ev_time.get(e)
                    if at is None:
                        waiting.setdefault(e, []).append(k)
                        break
                    if at > t:
                        t = at
            else:
                ev_time[st.event] = t
                for j in waiting.pop(st.event, ()):
                    todo.append(j)
            i += 1
        head[k], t_stream[k] = i, t
    return max(t_stream, default=0.0)


def _walk_by_index(index, graph: TaskGraph, costs: Costs) -> float | None:
    """`estimate_makespan` of a plan made by `insert_events` for ``graph``, from its steps'
    codes (`PlanIndex`; every event recorded once). When no engine is used by two streams,
    each stream is walked on its own (as in `estimate_makespan`); else None (the simulation
    decides)."""
    codes, n = index.codes, index.n
    nodes, _ = graph._by_index()
    res_of: dict[type, str | None] = {}
    for cls in set(map(type, nodes)):
        res_of[cls] = RESOURCES.get(cls.engine)  # type: ignore[attr-defined]  # a Node class
    res = list(map(res_of.__getitem__, map(type, nodes)))
    uses = []
    for cs in codes:
        used = set(map(res.__getitem__, [c - 1 for c in cs if c <= n]))
        used.discard(None)
        uses.append(used)
    if sum(len(u) for u in uses) != len(set().union(*uses)):
        return None
    cost = [0.0]
    cost += cost_list(graph, costs)  # by code: a run's code is 1 + its node's index
    R, W = 1 + n, 1 + 2 * n
    S = len(codes)
    t_stream = [0.0] * S
    head = [0] * S
    ev_time: list[float | None] = [None] * n  # by the event's source node
    waiting: dict[int, list[int]] = {}  # event not recorded yet -> streams blocked on it
    todo = list(range(S - 1, -1, -1))
    while todo:
        k = todo.pop()
        cs, i, t = codes[k], head[k], t_stream[k]
        end = len(cs)
        while i < end:
            c = cs[i]
            if c < R:
                t += cost[c]
            elif c < W:  # a record
                ev_time[c - R] = t
                todo.extend(waiting.pop(c - R, ()))
            else:  # a wait
                at = ev_time[c - W]
                if at is None:
                    waiting.setdefault(c - W, []).append(k)
                    break
                if at > t:
                    t = at
            i += 1
        head[k], t_stream[k] = i, t
    return max(t_stream, default=0.0)


def _simulate(steps, cost, by_name, recorded) -> float:
    """`estimate_makespan`'s simulation: the stream whose next node can start first (ties: the
    first stream) runs it, one node at a time per engine."""
    busy = {r: 0.0 for r in RESOURCES.values()}
    # per step of each stream: (resource, cost) of a RunNode, None for an event step (exact
    # types first: the common case, and fast on long plans)
    runs = [[(RESOURCES.get(by_name[st.node].engine), cost[st.node])
             if type(st) is RunNode or (type(st) is not RecordEvent and isinstance(st, RunNode))
             else None for st in ss] for ss in steps]
    S = len(steps)
    t_stream = [0.0] * S
    head = [0] * S
    ev_time: dict[str, float] = {}
    # A stream's head changes only when its node runs or an event it waits for is recorded,
    # so only those streams ("dirty") are walked again; the others keep their head's
    # resource (ready[k]: the resource, "" for none, None when blocked or done), and their
    # start is recomputed from busy[] as they are compared. Streams are still walked and
    # compared in stream order, so events are recorded, and ties broken, as by walking every
    # stream every step (what this loop did before: a third of a long plan's estimate).
    dirty = [True] * S
    ready: list[str | None] = [None] * S
    waiting: dict[str, list[int]] = {}  # unrecorded event -> streams blocked on it
    while True:
        best, best_start = -1, 0.0
        for k in range(S):  # the stream whose next node can start first (ties: the first)
            if dirty[k]:
                dirty[k] = False
                ss, rk, i, t = steps[k], runs[k], head[k], t_stream[k]
                end = len(ss)
                while i < end and rk[i] is None:
                    st = ss[i]
                    if isinstance(st, WaitEvent) and st.event in recorded:
                        if st.event not in ev_time:
                            waiting.setdefault(st.event, []).append(k)
                            break
                        t = max(t, ev_time[st.event])
                    elif isinstance(st, RecordEvent):
                        ev_time[st.event] = t
                        for j in waiting.pop(st.event, ()):
                            dirty[j] = True  # walked later in this pass, or in the next
                    i += 1
                head[k], t_stream[k] = i, t
                run = rk[i] if i < end else None
                ready[k] = None if run is None else (run[0] or "")
            res = ready[k]
            if res is not None:
                t = t_stream[k]
                start = max(t, busy[res]) if res else t
                if best < 0 or start < best_start:
                    best, best_start = k, start
        if best < 0:
            if any(dirty):  # a record late in the pass woke an earlier stream: walk it
                continue
            return max(t_stream, default=0.0)
        chosen = runs[best][head[best]]
        assert chosen is not None  # the chosen stream's head is a RunNode
        res, c = chosen
        end_t = best_start + c
        if res:
            busy[res] = end_t
        t_stream[best] = end_t
        head[best] += 1
        dirty[best] = True


def _text(value) -> str:
    """A cost as messages show it (a huge int by its magnitude, never its digits)."""
    return int_text(value) if isinstance(value, int) and not isinstance(value, bool) \
        else repr(value)

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

from orchestra.errors import ScheduleError, int_text
from orchestra.graph import TaskGraph
from orchestra.schedule.plan import Plan, RecordEvent, RunNode, WaitEvent


RESOURCES = {"upload": "upload", "download": "download", "compute": "compute"}


@attrs.frozen
class CostModel:
    """Default cost model. Bandwidths in GB/s, times in µs."""

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


def estimate_costs(graph: TaskGraph, costs: Costs = None) -> dict[str, float]:
    """µs per node name. ``costs``: None (default model), a `CostModel`, a dict name -> µs (others
    from the default model), or a callable node -> µs (None falls back to the model)."""
    model = costs if isinstance(costs, CostModel) else CostModel()
    given = None  # node -> µs or None, from ``costs`` (decided once, not per node)
    if isinstance(costs, Mapping):
        given = lambda node: costs.get(node.name)  # noqa: E731
    elif callable(costs) and not isinstance(costs, CostModel):
        given = costs
    out = {}
    cost, accesses = model.cost, graph.accesses
    ours = type(model).cost is CostModel.cost  # a subclass's cost() may take the node alone
    # The default model's per-kind constants and bandwidths, looked up once: `CostModel.cost`
    # per node (a method call and a dict built per call) was most of this pass on a long
    # pipeline. Kinds with bodies, kernels and the rest still go through `cost`.
    fixed = {"alloc": model.alloc_us, "free": model.free_us, "host": model.host_us} \
        if ours and given is None else {}
    bandwidth = {"h2d": model.h2d_gbps * 1e3, "d2h": model.d2h_gbps * 1e3} if fixed else {}
    value: float | None
    node: Any  # the copy kinds' ``nbytes`` is read without naming each class
    for name, node in graph.node_map().items():
        kind = node.kind
        if fixed and not node.bodies:
            if kind in fixed:
                value = fixed[kind]
            elif kind in bandwidth:
                value = node.nbytes / bandwidth[kind]
            else:
                value = cost(node, accesses(name)) if kind == "kernel" else cost(node)
        else:
            value = given(node) if given is not None else None
            if value is None:
                value = cost(node, accesses(name)) if ours and kind == "kernel" else cost(node)
        try:
            value = float(value)
        except (TypeError, ValueError, OverflowError):  # not a number; an int beyond a double
            raise ScheduleError(f"cost of node {name} must be a finite number >= 0 µs; got"
                                f" {type(value).__name__} {_text(value)}") from None
        if not 0 <= value < math.inf:  # an infinite cost has no makespan (nor JSON text)
            raise ScheduleError(f"cost of node {name} must be a finite number >= 0 µs; got"
                                f" {value!r}")
        out[name] = value
    return out


def resource_of(node) -> str | None:
    """The engine a node occupies exclusively: one upload copy engine, one download copy engine,
    the SMs (kernels serialize in this model); None for allocs, frees and host functions."""
    return RESOURCES.get(node.engine)


def estimate_makespan(plan: Plan, graph: TaskGraph, costs: Costs = None) -> float:
    """Simulated end time (µs) of ``plan``: each stream in order, waits joined, one node at a time
    per engine, the node that can start first going next."""
    cost = estimate_costs(graph, costs)
    names = plan.stream_names
    recorded = {st.event for ss in plan.steps.values() for st in ss if isinstance(st, RecordEvent)}
    busy = {r: 0.0 for r in RESOURCES.values()}
    # node -> (resource, cost) of its RunNode steps, made once per node (not per step)
    run_of = {name: (RESOURCES.get(node.engine), cost[name])
              for name, node in graph.node_map().items()}
    steps = [plan.steps[n] for n in names]

    def run_step(st):  # a RunNode's (resource, cost); GraphError for a node the graph lacks
        got = run_of.get(st.node)
        if got is None:
            graph.node(st.node)  # raises
        return got

    # per step of each stream: (resource, cost) of a RunNode, None for an event step (exact
    # types first: the common case, and fast on long plans)
    runs = [[run_of.get(st.node) or run_step(st) if type(st) is RunNode
             else (run_step(st) if isinstance(st, RunNode) else None) for st in ss]
            for ss in steps]
    S = len(names)
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

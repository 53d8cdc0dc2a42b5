"""The fast hazard verifier against the old exhaustive one (tests/verify_oracle.py) on many random
small programs: graphs over a few buffers with overlapping ranges, scheduled by every policy,
then broken by dropping or moving steps. Same findings (kind, buffer, nodes, streams, message),
same order, for plans and for hand-picked graph edges. Likewise the chain clocks and transitive
reduction against bitsets, and the plan's issue order, text, makespan and JSON against the code
they replaced."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.verify_oracle as oracle
from orchestra.graph import (
    Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostFunc, HostToDevice, In, InOut, KernelNode,
    KernelRef, Memset, Out, TaskGraph,
)
from orchestra.graph.taskgraph import transitive_reduction
from orchestra.schedule import (
    POLICIES, GraphOrder, Plan, PlanOrder, estimate_makespan, json_text, schedule, verify,
    verify_graph_edges,
)

K = KernelRef("k.cu", "k")
SIZE = 24
DEVICE = tuple(Buffer(f"d{i}", SIZE) for i in range(3))
HOST = tuple(HostBuffer(f"h{i}", SIZE) for i in range(2))


def _noop():
    return None


@st.composite
def ranges(draw, buffers, size=None):
    buf = draw(st.sampled_from(buffers))
    if size is None:
        off = draw(st.integers(0, SIZE - 1))
        return buf.range(off, draw(st.integers(1, SIZE - off)))
    return buf.range(draw(st.integers(0, SIZE - size)), size)


@st.composite
def programs(draw):
    """A `TaskGraph` of 1-14 random nodes; some device buffers get Alloc/Free nodes (in any
    place, so lifetimes can be wrong too), the others stay external."""
    g = TaskGraph()
    managed = draw(st.sets(st.sampled_from([b.name for b in DEVICE]), max_size=3))
    names: list[str] = []
    for i in range(draw(st.integers(1, 14))):
        name = f"n{i}"
        after = tuple(draw(st.sets(st.sampled_from(names), max_size=1))) if names and draw(
            st.integers(0, 5)) == 0 else ()
        kind = draw(st.sampled_from(("kernel", "kernel", "kernel", "h2d", "d2h", "host",
                                     "memset", "alloc", "free")))
        if kind in ("alloc", "free"):
            pick = [b for b in DEVICE if b.name in managed]
            if not pick:
                kind = "kernel"
            else:
                buf = draw(st.sampled_from(pick))
                node = (Alloc if kind == "alloc" else Free)(name, buf, after=after)
        if kind == "kernel":
            args = tuple(draw(st.sampled_from((In, Out, InOut)))(draw(ranges(DEVICE)))
                         for _ in range(draw(st.integers(1, 3))))
            node = KernelNode(name, K, 1, 32, args, after=after)
        elif kind in ("h2d", "d2h"):
            n = draw(st.integers(1, SIZE))
            host, dev = draw(ranges(HOST, n)), draw(ranges(DEVICE, n))
            node = (HostToDevice(name, host, dev, after=after) if kind == "h2d"
                    else DeviceToHost(name, dev, host, after=after))
        elif kind == "host":
            both = DEVICE + HOST
            node = HostFunc(name, _noop, reads=draw(st.lists(ranges(both), max_size=2)),
                            writes=draw(st.lists(ranges(both), max_size=2)), after=after)
        elif kind == "memset":
            node = Memset(name, draw(ranges(DEVICE)), 0, after=after)
        g.add(node)
        names.append(name)
    return g


def _edit(plan: Plan, data) -> Plan:
    """``plan`` with a few random breakages: waits or records dropped, runs moved to another
    stream or place, a run repeated or dropped, an unknown run or wait added. With no edits,
    ``plan`` itself: a scheduled plan keeps the steps' codes `insert_events` made
    (`PlanIndex`), which the verifier, the listing and the makespan read instead of the
    steps, so both ways are compared with the oracles."""
    edits = data.draw(st.integers(0, 4), label="edits")
    if edits == 0:
        return plan
    d = plan.to_dict()
    streams = d["streams"]
    for _ in range(edits):
        s = data.draw(st.sampled_from(streams), label="stream")
        what = data.draw(st.sampled_from(("drop", "move", "repeat", "ghost", "wait", "swap")),
                         label="edit")
        steps = s["steps"]
        if what == "ghost":
            steps.insert(data.draw(st.integers(0, len(steps))), ["run", "ghost"])
            continue
        if what == "wait":
            ev = data.draw(st.sampled_from(["nope"] + [x[1] for t in streams for x in t["steps"]
                                                       if x[0] == "record"]), label="event")
            steps.insert(data.draw(st.integers(0, len(steps))), ["wait", ev])
            continue
        if not steps:
            continue
        i = data.draw(st.integers(0, len(steps) - 1), label="step")
        if what == "drop":
            del steps[i]
        elif what == "swap" and i + 1 < len(steps):
            steps[i], steps[i + 1] = steps[i + 1], steps[i]
        elif what in ("move", "repeat"):
            step = steps[i] if what == "repeat" else steps.pop(i)
            t = data.draw(st.sampled_from(streams), label="to")["steps"]
            t.insert(data.draw(st.integers(0, len(t))), list(step))
    return Plan.from_dict(d)


SETTINGS = settings(max_examples=600, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(g=programs(), policy=st.sampled_from(POLICIES), streams=st.integers(1, 5), data=st.data())
def test_plan_findings_match_the_exhaustive_verifier(g, policy, streams, data):
    plan = _edit(schedule(g, policy, streams), data)
    assert verify(plan, g) == oracle.verify(plan, g)


@SETTINGS
@given(g=programs(), data=st.data())
def test_graph_edge_findings_match_the_exhaustive_verifier(g, data):
    names = [n.name for n in g.nodes]
    edges = sorted(g.edges)
    choice = data.draw(st.sampled_from(("all", "reduced", "subset", "extra")), label="edges")
    if choice == "reduced":
        edges = sorted(g.reduced_edges())
    elif choice == "subset":
        edges = [e for e in edges if data.draw(st.booleans(), label="keep")]
    elif choice == "extra":  # may add a cycle (DEADLOCK) or a reverse order
        for _ in range(data.draw(st.integers(1, 4), label="extra edges")):
            a, b = data.draw(st.sampled_from(names)), data.draw(st.sampled_from(names))
            if a != b:
                edges.append((a, b))
    assert verify_graph_edges(g, edges) == oracle.verify_graph_edges(g, edges)


@SETTINGS
@given(g=programs(), policy=st.sampled_from(POLICIES), streams=st.integers(1, 5), data=st.data())
def test_plan_happens_before_matches_the_per_node_clocks(g, policy, streams, data):
    """Every pair of nodes: the shared-snapshot clocks answer as the per-node clocks did."""
    plan = _edit(schedule(g, policy, streams), data)
    new, old = PlanOrder(plan), oracle.PlanOrder(plan)
    assert new.findings == old.findings and new.runs == old.runs
    nodes = [n for n in plan.node_stream if old.has(n)]
    assert all(new.before(a, b) == old.before(a, b) for a in nodes for b in nodes)


@st.composite
def dags(draw):
    """Edges of a random DAG over nodes ``v0..``: each node's predecessors are drawn from the
    nodes before it, some nodes joining many (wide joins, then fan-outs from them)."""
    n = draw(st.integers(1, 60))
    edges = []
    for i in range(1, n):
        if draw(st.integers(0, 9)) == 0:
            preds = draw(st.sets(st.integers(0, i - 1), max_size=i))  # a wide join
        else:
            preds = draw(st.sets(st.integers(max(0, i - 8), i - 1), max_size=3))
        edges += [(f"v{p}", f"v{i}") for p in preds]
    return n, edges


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=dags(), flat_max=st.sampled_from((0, 2, 16)), max_depth=st.sampled_from((1, 3, 8)),
       scan=st.sampled_from((0, 1, 8)))
def test_graph_happens_before_matches_reachability(dag, flat_max, max_depth, scan):
    """Every pair of nodes: the chain clocks answer as ancestor bitsets do, and the transitive
    reduction built on them is the bitsets' one, whatever the limits on flat clocks, layer depth
    and the chain-adoption scan (small ones exercise layers and flattening)."""
    import orchestra.graph.reach as hb

    n, edges = dag
    g = TaskGraph()
    for i in range(n):
        g.add(HostFunc(f"v{i}", _noop))
    saved = hb._FLAT_MAX, hb._MAX_DEPTH, hb._ADOPT_SCAN
    hb._FLAT_MAX, hb._MAX_DEPTH, hb._ADOPT_SCAN = flat_max, max_depth, scan
    try:
        new = GraphOrder(g, edges)
        names = [f"v{i}" for i in range(n)]
        reduced = transitive_reduction(names, edges)
    finally:
        hb._FLAT_MAX, hb._MAX_DEPTH, hb._ADOPT_SCAN = saved
    old = oracle.GraphOrder(g, edges)
    assert [(a, b) for a in names for b in names if new.before(a, b)] == \
        [(a, b) for a in names for b in names if old.before(a, b)]
    assert reduced == oracle.transitive_reduction(names, edges)


def _issue(fn, plan):
    try:
        return fn(plan)
    except ValueError as exc:
        return ("ValueError", str(exc))


@SETTINGS
@given(g=programs(), policy=st.sampled_from(POLICIES), streams=st.integers(1, 5), data=st.data())
def test_issue_order_matches_the_head_scan(g, policy, streams, data):
    """`Plan.issue_order` (the executors' enqueue order) as the scan it replaced gives it, or
    the same error for waits in a cycle."""
    plan = _edit(schedule(g, policy, streams), data)
    assert _issue(Plan.issue_order, plan) == _issue(oracle.issue_order, plan)


@SETTINGS
@given(g=programs(), policy=st.sampled_from(POLICIES), streams=st.integers(1, 5), data=st.data())
def test_plan_text_and_makespan_match_the_old_writers(g, policy, streams, data):
    """`str(plan)` (what `orchestra plan` prints) and `estimate_makespan` as the code they
    replaced gives them, on scheduled and on broken plans."""
    plan = _edit(schedule(g, policy, streams), data)
    assert str(plan) == oracle.plan_text(plan)
    copy = Plan.from_dict(plan.to_dict())  # the same steps, without the codes
    assert str(copy) == str(plan) and verify(copy, g) == verify(plan, g)
    if set(plan.node_stream) <= {n.name for n in g.nodes}:  # the simulation needs every cost
        assert estimate_makespan(plan, g) == oracle.estimate_makespan(plan, g)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.one_of(st.text(), st.integers(), st.floats(), st.booleans(),
                                st.none()), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=500, deadline=None)
@given(value=_json_values, indent=st.integers(0, 3))
def test_json_text_is_json_dumps(value, indent):
    """The fast indented JSON writer gives ``json.dumps(..., indent, sort_keys=True)``'s text,
    or the same error (keys of mixed types cannot be sorted)."""
    def text(fn):
        try:
            return fn()
        except (TypeError, ValueError) as exc:
            return (type(exc), str(exc))
    assert text(lambda: json_text.dumps(value, indent)) == \
        text(lambda: json.dumps(value, indent=indent, sort_keys=True))


def test_json_text_of_a_plan_and_of_what_json_refuses():
    g = TaskGraph()
    for i in range(3):
        g.add(HostFunc(f"v{i}", _noop, after=(f"v{i - 1}",) if i else ()))
    d = {"plan": schedule(g, "round-robin", 2).to_dict(), "n": [1.5, float("nan"), -0.0]}
    assert json_text.dumps(d, 1) == json.dumps(d, indent=1, sort_keys=True)
    loop: list = []
    loop.append(loop)
    for bad, exc in ((loop, ValueError), ({"x": object()}, TypeError), ({(1, 2): 3}, TypeError)):
        with pytest.raises(exc) as got:
            json_text.dumps(bad)
        with pytest.raises(exc) as want:
            json.dumps(bad, indent=1, sort_keys=True)
        assert str(got.value) == str(want.value)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_topological_order_and_edge_tables(n, data):
    """Program order is the topological order when every edge goes forward, Kahn's otherwise
    (an ``after=`` naming a node added later); the edge count and predecessor table agree with
    the edge set."""
    from orchestra.errors import GraphError
    from orchestra.graph.taskgraph import kahn_order

    names = [f"v{i}" for i in range(n)]
    g = TaskGraph()
    for i, name in enumerate(names):
        after = data.draw(st.sets(st.sampled_from(names), max_size=2), label="after") - {name}
        g.add(HostFunc(name, _noop, after=tuple(sorted(after))))
    edges = sorted(g.edges)
    assert g.edge_count == len(edges)
    assert sorted((p, s) for s, ps in g.predecessor_map().items() for p in ps) == edges
    order = kahn_order(names, edges)
    if len(order) < n:
        with pytest.raises(GraphError, match="cycle"):
            g.topological_order()
    else:
        assert g.topological_order() == tuple(order)


@SETTINGS
@given(g=programs(), policy=st.sampled_from(POLICIES), streams=st.integers(1, 5), data=st.data())
def test_maximal_nodes_match_pairwise_checks(g, policy, streams, data):
    """``maximal`` (the last racing uses a FREE_RACE reports) is the set of nodes before none of
    the others, for plans and for graph edges."""
    plan = _edit(schedule(g, policy, streams), data)
    names = [n.name for n in g.nodes]
    for order in (PlanOrder(plan), GraphOrder(g, sorted(g.reduced_edges()))):
        have = [n for n in names if order.has(n)]
        some = data.draw(st.lists(st.sampled_from(have), unique=True), label="nodes") if have else []
        assert order.maximal(some) == {u for u in some
                                       if not any(order.before(u, v) for v in some)}

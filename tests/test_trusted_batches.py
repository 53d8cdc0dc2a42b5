"""`build_pipeline`'s trusted records (`orchestra.graph.trusted`) against checked ones, and the
plan `insert_events` derives its fields for against the plan `Plan()` derives them for."""

from __future__ import annotations

import attrs
import pytest

from orchestra.errors import GraphError, NodeFieldTypeError
from orchestra.graph import (
    Alloc, HostBuffer, HostFunc, InOut, KernelRef, Out, TaskGraph, add_batch, build_pipeline,
)
from orchestra.graph.trusted import make_each, maker
from orchestra.schedule import schedule
from orchestra.schedule.plan import Plan, RunNode

K = KernelRef("cuda_src/burn.cu", "burn", params=("const float* x", "float* y", "size_t n",
                                                   "int iters", "float s", "float t"))


def _fields(obj, depth=0):
    """Every attrs field of ``obj`` (eq=False ones too: the cached accesses, whole ranges and
    device), recursively, as plain data."""
    if attrs.has(type(obj)) and depth < 6:
        return (type(obj).__name__,
                tuple((f.name, _fields(getattr(obj, f.name), depth + 1))
                      for f in attrs.fields(type(obj))))
    if isinstance(obj, tuple):
        return tuple(_fields(x, depth) for x in obj)
    return (type(obj).__name__, obj)


def _checked(batches, sizes, host_in, host_out, in_flight, **kw):
    """What build_pipeline makes, batch by batch through the checked add_batch."""
    g, out, offset = TaskGraph(), [], 0
    for i, size in enumerate(sizes):
        after = ()
        if in_flight is not None and i >= in_flight:
            prev = out[i - in_flight]
            after = tuple(f.name for f in (prev.free_in, prev.free_out) if f is not None)
        out.append(add_batch(g, index=i, kernel=K, nbytes=size,
                             host_in=host_in.range(offset, size) if host_in else None,
                             host_out=host_out.range(offset, size) if host_out else None,
                             alloc_after=after, **kw))
        offset += size
    return g, out


@pytest.mark.parametrize("kw", [
    dict(scalars=(3, 1.0, 0.5), grid=(40, 1, 1), block=128),
    dict(scalars=(1, 1.0, 0.0)),  # grid from the size
    dict(in_place=True, block=(64,)),
    dict(arg_layout=lambda i, o, n, s: (InOut(i), Out(o), n, *s), scalars=(2,)),  # checked
    dict(device=1, element_size=2),
])
@pytest.mark.parametrize("shared_host", [True, False])
def test_trusted_batches_match_checked_ones(kw, shared_host):
    sizes = [4096, 4096, 2048, 4096, 1024, 4096, 4096, 512]
    total = sum(sizes)
    hin = HostBuffer("hin", total) if shared_host else None
    hout = HostBuffer("hout", total) if shared_host else None
    g1, b1 = build_pipeline(len(sizes), sizes, K, host_in=hin, host_out=hout, in_flight=3, **kw)
    g2, b2 = _checked(len(sizes), sizes, hin, hout, 3, **kw)
    assert [n.name for n in g1.nodes] == [n.name for n in g2.nodes]
    for x, y in zip(g1.nodes, g2.nodes):
        assert type(x) is type(y) and x == y and hash(x) == hash(y)
        assert _fields(x) == _fields(y), x.name
        assert g1.accesses(x.name) == g2.accesses(y.name)
    for x, y in zip(b1, b2):
        assert x == y and _fields(x) == _fields(y)
    assert g1.edges == g2.edges
    assert {e: g1.edge_reason(*e) for e in g1.edges} == {e: g2.edge_reason(*e) for e in g2.edges}
    assert schedule(g1, "by-engine", 4) == schedule(g2, "by-engine", 4)
    _same_graph(g1, g2)


def _same_graph(g1, g2):
    """Every table of two graphs the same, in the same order: edges by name (each node's
    predecessor dict in order), by index, explicit edges, buffers, the tracker's answers."""
    assert [(n, list(ps.items())) for n, ps in g1.predecessor_map().items()] == \
        [(n, list(ps.items())) for n, ps in g2.predecessor_map().items()]
    assert [g1.successors(n.name) for n in g1.nodes] == [g2.successors(n.name) for n in g2.nodes]
    assert g1._by_index()[1] == g2._by_index()[1]
    assert g1.explicit_edges == g2.explicit_edges
    assert g1.buffers == g2.buffers and g1.host_buffers == g2.host_buffers
    assert [g1.index(n.name) for n in g1.nodes] == list(range(len(g1)))
    assert g1.edge_count == g2.edge_count == len(g1.edges)


def test_a_pipeline_extended_after_it_is_built_infers_what_the_checked_one_does():
    # the nodes build_pipeline adds with known edges reach the dependency tracker before the
    # next add: later nodes depend on them exactly as on checked ones
    from orchestra.graph import Buffer, In, KernelNode
    sizes = [4096] * 9 + [1024]
    hin, hout = HostBuffer("hin", sum(sizes)), HostBuffer("hout", sum(sizes))
    g1, _ = build_pipeline(len(sizes), sizes, K, host_in=hin, host_out=hout, in_flight=4,
                           scalars=(1, 1.0, 0.0))
    g2, _ = _checked(len(sizes), sizes, hin, hout, 4, scalars=(1, 1.0, 0.0))
    w = Buffer("w", 64)
    for g in (g1, g2):
        g.add(KernelNode("late_read", KernelRef("k.cu", "k"), 1, 32, (In(w),)))
        g.add(HostFunc("drain", lambda: None, reads=[hout.range(8192, 20000)]))
        g.add(HostFunc("refill", lambda: None, writes=[hin]))
        g.add(Alloc("b3.in2", Buffer("b3.in2", 16), after=["b9.free_out"]))
    _same_graph(g1, g2)
    assert g1.predecessors("refill") == g2.predecessors("refill") != ()
    assert g1.predecessors("drain") == ("b2.d2h", "b3.d2h", "b4.d2h", "b5.d2h", "b6.d2h")


def test_a_host_buffer_named_like_a_batch_buffer_is_refused_as_before():
    # the later batches' names would clash with the host buffer's: the checked path says so
    sizes = [4096] * 5
    for name in ("b3.in", "b2.out"):
        hin = HostBuffer(name, sum(sizes))
        with pytest.raises(GraphError, match="already names"):
            build_pipeline(len(sizes), sizes, K, host_in=hin, scalars=(1, 1.0, 0.0))
    g, _ = build_pipeline(5, 4096, K, host_in=HostBuffer("b3.inx", 5 * 4096),
                          scalars=(1, 1.0, 0.0))
    assert len(g) == 35


def test_bad_later_batch_raises_what_add_batch_raises():
    # a size that is not a whole number of elements, past the first batch (the trusted path
    # hands it to the checked one)
    with pytest.raises(GraphError, match="not a whole number of 4-byte elements"):
        build_pipeline(3, [4096, 4096, 4098], K, scalars=(1, 1.0, 0.0))
    with pytest.raises(GraphError, match="positive"):
        build_pipeline(3, [4096, 0, 4096], K, scalars=(1, 1.0, 0.0))


def test_maker_refuses_a_field_list_that_is_not_the_class_fields():
    with pytest.raises(NodeFieldTypeError, match="not its fields"):
        maker(RunNode, "node", "extra")
    with pytest.raises(NodeFieldTypeError):
        make_each(Plan, "steps", [])
    made = make_each(RunNode, "node", ["a", "b"])
    assert made == [RunNode("a"), RunNode("b")] and hash(made[0]) == hash(RunNode("a"))


@pytest.mark.parametrize("policy,streams", [("by-engine", 3), ("by-engine", 5),
                                            ("round-robin", 2), ("critical-path", 3)])
def test_insert_events_derives_what_plan_derives(policy, streams):
    g, _ = build_pipeline(12, 4096, K, scalars=(1, 1.0, 0.0), in_flight=2)
    plan = schedule(g, policy, streams)
    again = Plan(plan.streams, plan.steps, plan.policy, plan.order, plan.meta)
    assert plan == again
    assert list(plan.node_stream.items()) == list(again.node_stream.items())
    assert plan.events == again.events
    assert (plan.event_count, plan.wait_count) == (again.event_count, again.wait_count)
    assert all(type(v) is tuple for v in plan.steps.values())
    assert list(plan.steps) == [s.name for s in plan.streams]


def test_a_scheduled_plan_copies_and_pickles_as_one_made_by_hand():
    # the steps' codes insert_events keeps (Plan._by_index) are left behind by a pickle or a
    # deep copy (a shallow copy shares them, as it shares the steps)
    import copy
    import pickle

    from orchestra.schedule import estimate_makespan

    g, _ = build_pipeline(9, 4096, K, scalars=(1, 1.0, 0.0), in_flight=3)
    plan = schedule(g, "by-engine", 3)
    assert plan._by_index(g) is not None and plan._by_index(TaskGraph()) is None
    for other in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan), copy.copy(plan)):
        assert other == plan
        assert (other._by_index(g) is plan._by_index(g)) if other._hint is not None else True
        assert other.node_stream == plan.node_stream and other.events == plan.events
        assert str(other) == str(plan)
        assert estimate_makespan(other, g) == estimate_makespan(plan, g)
    assert pickle.loads(pickle.dumps(plan))._hint is None and copy.deepcopy(plan)._hint is None

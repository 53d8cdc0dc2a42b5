"""CPU tests of orchestra.trace.recorder with fake events (no GPU): the elapsed-time conversion,
the eager tracer's hook protocol and event reuse, and the graph tracer's bookkeeping."""

import pytest

from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import KernelRef, build_pipeline
from orchestra.schedule import RunNode, schedule
from orchestra.trace import (
    EagerTracer, EventPair, EventPool, EventTimer, GraphTracer, Timeline, spans_from_event_pairs,
)

K = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)


class FakeEvent:
    """A timing event whose timestamp is the fake stream's clock when recorded."""

    created = 0

    def __init__(self, t=None):
        FakeEvent.created += 1
        self.t = t
        self.synced = 0
        self.closed = False

    def record(self, stream):
        self.t = stream.tick()
        return self

    def synchronize(self):
        self.synced += 1

    def close(self):
        self.closed = True


class FakeStream:
    def __init__(self, start, step=1.0):
        self.now, self.step = start, step

    def tick(self):
        t = self.now
        self.now += self.step
        return t


class FakePool(EventPool):
    def _create(self):
        return FakeEvent()


def elapsed(a, b):
    assert a.t is not None and b.t is not None, "event never recorded"
    return b.t - a.t


class Node:
    def __init__(self, name, kind="kernel", engine="compute", batch=None):
        self.name, self.kind, self.engine, self.batch, self.device = name, kind, engine, batch, 0


# -- spans_from_event_pairs ---------------------------------------------------------------------

def test_spans_from_event_pairs_single_origin():
    o = FakeEvent(100.0)
    pairs = [("s0", Node("a"), FakeEvent(101.0), FakeEvent(103.5)),
             EventPair("s1", Node("b", "h2d", "upload", 0), FakeEvent(102.0), FakeEvent(104.0))]
    tl = spans_from_event_pairs(o, pairs, {"streams": ("s0", "s1"), "policy": "p",
                                           "executor": "graph-build", "device": 1, "extra": 7},
                                elapsed=elapsed)
    assert isinstance(tl, Timeline)
    a, b = tl.span("a"), tl.span("b")
    assert (a.start_ms, a.end_ms, a.stream) == (1.0, 3.5, "s0")
    assert (b.start_ms, b.end_ms, b.kind, b.engine, b.batch) == (2.0, 4.0, "h2d", "upload", 0)
    assert (tl.streams, tl.policy, tl.executor, tl.device, tl.meta) == (
        ("s0", "s1"), "p", "graph-build", 1, {"extra": 7})


def test_default_elapsed_is_the_driver_event():
    with pytest.raises(TypeError, match="must be an Event"):  # Event.elapsed_ms checks its input
        spans_from_event_pairs(FakeEvent(0.0), [("s", Node("a"), FakeEvent(1.0), FakeEvent(2.0))])


def test_spans_from_event_pairs_zero_is_the_earliest_origin():
    # the reference origin (first) completed 2 ms after the earliest stream origin
    origins = [FakeEvent(5.0), FakeEvent(3.0), FakeEvent(4.0)]
    pairs = [("s1", Node("x"), FakeEvent(3.5), FakeEvent(6.0))]
    tl = spans_from_event_pairs(origins, pairs, {"streams": ("s0", "s1", "s2")}, elapsed=elapsed)
    assert (tl.span("x").start_ms, tl.span("x").end_ms) == (0.5, 3.0)


def test_spans_from_event_pairs_fake_elapsed_values():
    # elapsed() is called as (origin, event): feed it a table of fake values
    table = {"s": 0.25, "e": 1.75, "s2": 1.75, "e2": 1.7}  # e2 < s2: timer resolution, clamped
    tl = spans_from_event_pairs("O", [("m", Node("k"), "s", "e"), ("m", Node("k2"), "s2", "e2")],
                                elapsed=lambda a, b: 0.0 if b == "O" else table[b])
    assert (tl.span("k").start_ms, tl.span("k").end_ms) == (0.25, 1.75)
    assert tl.span("k2").duration_ms == 0.0
    with pytest.raises(ValueError, match="no origin"):
        spans_from_event_pairs([], [], elapsed=elapsed)


# -- EagerTracer --------------------------------------------------------------------------------

def make_tracer():
    return EagerTracer(device=0, pool=FakePool(0), elapsed=elapsed)


def test_eager_tracer_is_an_event_timer():
    assert isinstance(make_tracer(), EventTimer)
    assert isinstance(GraphTracer(pool=FakePool()), EventTimer)


def test_eager_tracer_records_spans():
    tr = make_tracer()
    up, comp = FakeStream(10.0), FakeStream(12.0)
    tr.begin({"up": up, "comp": comp}, policy="by-engine", meta={"run": 1})
    h, k = Node("h2d", "h2d", "upload", 0), Node("kernel", batch=0)
    tr.before("up", h)        # up: origin 10, start 11, end 12
    tr.after(up, h)           # a Stream object works as well as its name
    tr.before(comp, k)        # comp: origin 12, start 13, end 14
    tr.after("comp", k)
    tl = tr.finish()
    assert tl.streams == ("up", "comp") and tl.policy == "by-engine" and tl.executor == "eager"
    assert tl.meta == {"run": 1}
    assert (tl.span("h2d").start_ms, tl.span("h2d").end_ms) == (1.0, 2.0)
    assert (tl.span("kernel").start_ms, tl.span("kernel").end_ms) == (3.0, 4.0)
    assert tl.span("h2d").stream == "up" and tl.span("kernel").engine == "compute"
    assert not tr.active


def test_eager_tracer_reuses_events_across_runs():
    tr = make_tracer()
    for run in range(3):
        s0, s1 = FakeStream(0.0), FakeStream(0.0)
        tr.begin([("a", s0), ("b", s1)])
        for i in range(4):
            n = Node(f"n{i}")
            tr.before("a" if i % 2 else "b", n)
            tr.after("a" if i % 2 else "b", n)
        tl = tr.finish()
        assert len(tl) == 4
        assert tr.pool.size == 2 + 2 * 4  # origins + a pair per node, created once
        assert tr.pool.in_use == 0
    tr.close()
    assert tr.pool.size == 0


def test_eager_tracer_syncs_last_event_per_stream():
    tr = make_tracer()
    s0, s1 = FakeStream(0.0), FakeStream(0.0)
    tr.begin({"a": s0, "b": s1})
    n = Node("only")
    tr.before("a", n)
    tr.after("a", n)
    last_a = tr._last["a"]
    origin_b = tr._last["b"]
    tr.finish()
    assert last_a.synced == 1 and origin_b.synced == 1


def test_eager_tracer_misuse():
    tr = make_tracer()
    with pytest.raises(RuntimeError, match="call begin"):
        tr.before("a", Node("x"))
    with pytest.raises(RuntimeError, match="no run in progress"):
        tr.finish()
    s = FakeStream(0.0)
    tr.begin({"a": s})
    with pytest.raises(RuntimeError, match="already being traced"):
        tr.begin({"a": s})
    with pytest.raises(KeyError, match="unknown stream 'zz'"):
        tr.before("zz", Node("x"))
    with pytest.raises(KeyError, match="not one of the streams"):
        tr.before(FakeStream(0.0), Node("x"))
    with pytest.raises(RuntimeError, match="without a matching before"):
        tr.after("a", Node("x"))
    tr.before("a", Node("x"))
    with pytest.raises(RuntimeError, match="called twice"):
        tr.before("a", Node("x"))
    with pytest.raises(RuntimeError, match=r"before\(\) without after\(\).*'x'"):
        tr.finish()
    tr.abort()  # the run failed part-way: the tracer is usable again
    tr.begin({"a": s})
    assert len(tr.finish()) == 0
    with pytest.raises(TypeError, match="needs a Stream"):
        tr.begin(["a", "b"])
    with pytest.raises(ValueError, match="at least one stream"):
        tr.begin({})


def test_eager_tracer_on_a_scheduled_plan():
    """Walk a real plan the way an eager executor does; tracks follow the plan's streams."""
    g, _ = build_pipeline(3, 4096, K)
    plan = schedule(g, "by-engine", streams=3)
    streams = {name: FakeStream(0.0, step=0.5) for name in plan.stream_names}
    tr = make_tracer()
    tr.begin(streams, policy=plan.policy)
    for stream, step in plan.issue_order():
        if isinstance(step, RunNode):
            node = g.node(step.node)
            tr.before(stream, node)
            tr.after(stream, node)
    tl = tr.finish()
    assert tl.streams == plan.stream_names
    assert len(tl) == len(g.nodes)
    assert {s.name: s.stream for s in tl} == {n.name: plan.stream_of(n.name) for n in g.nodes}
    assert {s.engine for s in tl} == {"memory", "upload", "compute", "download"}
    assert tl.span("b1.h2d").nbytes == 4096 and tl.span("b1.h2d").batch == 1


# -- GraphTracer --------------------------------------------------------------------------------

def test_graph_tracer_build_path_and_replay():
    tr = GraphTracer(device=0, executor="graph-build", pool=FakePool(), elapsed=elapsed)
    tr.begin(("up", "comp"), policy="by-engine")
    a, k = Node("h2d", "h2d", "upload", 0), Node("kernel", batch=0)
    start_a, end_a = tr.pair("up", a)
    start_k, end_k = tr.pair("comp", k)
    assert len({id(e) for e in (start_a, end_a, start_k, end_k)}) == 4
    with pytest.raises(RuntimeError, match="no launch marked"):
        tr.finish()
    for launch in range(2):  # each launch re-records the same events
        launch_stream = FakeStream(100.0 * launch)
        tr.mark_launch(launch_stream)
        base = 100.0 * launch
        start_a.t, end_a.t, start_k.t, end_k.t = base + 1, base + 2, base + 2, base + 5
        tl = tr.finish()
        assert (tl.span("h2d").start_ms, tl.span("h2d").end_ms) == (1.0, 2.0)
        assert (tl.span("kernel").start_ms, tl.span("kernel").end_ms) == (2.0, 5.0)
        assert tl.executor == "graph-build" and tl.streams == ("up", "comp")
    assert tr.pool.size == 5  # 4 node events + 1 origin, never more


def test_graph_tracer_capture_path():
    recorded = []

    class Capturing(GraphTracer):
        def _record(self, ev, stream):  # stands in for cuEventRecordWithFlags(EXTERNAL)
            recorded.append(ev)
            ev.record(stream)

    s = FakeStream(0.0)
    tr = Capturing(pool=FakePool(), elapsed=elapsed, executor="capture")
    tr.begin({"main": s})
    n = Node("k")
    tr.before(s, n)
    tr.after("main", n)
    assert len(recorded) == 2 and len(tr.pairs) == 1
    tr.mark_launch(FakeStream(-1.0))
    tl = tr.finish()
    assert (tl.span("k").start_ms, tl.span("k").end_ms) == (1.0, 2.0)
    # names only (explicit build) cannot record while capturing
    tr2 = Capturing(pool=FakePool(), elapsed=elapsed)
    tr2.begin(("main",))
    with pytest.raises(TypeError, match="has no Stream"):
        tr2.before("main", n)

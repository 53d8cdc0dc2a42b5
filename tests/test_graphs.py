"""CPU tests of the CUDA Graph executors' pure parts (no GPU needed).

- the graph-build translation (`cuda_graph.spec.translate`): node kinds and edges equal the
  TaskGraph's own DAG for chain, diamond and batch pipelines;
- the C05 graph-memory policy: an Alloc without its Free is refused (unless auto_free);
- the capture plan: fork/join around the plan's steps never leaves a stream unjoined, and the
  check names the stream of a hand-made list that does (C02);
- `GraphCache`: keying by shapes/dtypes/topology, bucketing, hit/miss counts, LRU eviction
  that closes, one build per signature under concurrency.
"""

from __future__ import annotations

import threading

import pytest

from orchestra.driver.capture import UnjoinedStreamError
from orchestra.errors import GraphError, KernelArgumentValueError
from orchestra.execute.cuda_graph.capture_plan import CaptureStep, capture_steps, check_capture_steps
from orchestra.execute.cuda_graph.cache import BucketPolicy, GraphCache, Signature, pad_to
from orchestra.execute.cuda_graph.spec import (
    GraphMemoryError,
    check_graph_memory,
    translate,
    unfreed_allocations,
)
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import (
    Alloc,
    Buffer,
    DeviceToHost,
    Free,
    HostBuffer,
    HostFunc,
    HostToDevice,
    In,
    KernelNode,
    KernelRef,
    Memset,
    Out,
    TaskGraph,
    add_batch,
    build_pipeline,
)
from orchestra.schedule import PlanBuilder, RunNode, WaitEvent, schedule, verify_graph_edges

BURN = KernelRef("burn.cu", "burn", params=BURN_PARAMS)
N = 4096


# -- graphs ----------------------------------------------------------------------------------


def chain_graph() -> TaskGraph:
    g = TaskGraph()
    add_batch(g, index=0, kernel=BURN, nbytes=N, scalars=(3, 0.5, 1.0))
    return g


def diamond_graph() -> TaskGraph:
    """x -> (k1: y = f(x), k2: z = f(x)) -> k3: w = f(y) ... a diamond with a host function."""
    g = TaskGraph()
    x, y, z, w = (Buffer(n, N) for n in "xyzw")
    hin, hout = HostBuffer("hin", N), HostBuffer("hout", N)
    n = N // 4
    for b in (x, y, z, w):
        g.add(Alloc(f"alloc_{b.name}", b))
    g.add(HostToDevice("h2d", hin, x))
    g.add(KernelNode("k1", BURN, 4, 256, (In(x), Out(y), n, 1, 0.5, 1.0)))
    g.add(KernelNode("k2", BURN, 4, 256, (In(x), Out(z), n, 2, 0.5, 1.0)))
    g.add(Memset("poison_w", w, 0x7FC00000, element_size=4))
    g.add(KernelNode("k3", BURN, 4, 256, (In(y), Out(w), n, 1, 0.5, 1.0), after=("k2",)))
    g.add(DeviceToHost("d2h", w, hout))
    g.add(HostFunc("done", lambda: None, reads=(hout,)))
    for b in (x, y, z, w):
        g.add(Free(f"free_{b.name}", b))
    return g


def batch_graph(batches: int = 6, ragged: bool = True) -> TaskGraph:
    sizes = [N] * batches
    if ragged:
        sizes[-1] = N // 2
    g, _ = build_pipeline(batches, sizes, BURN, scalars=(2, 0.5, 1.0))
    return g


GRAPHS = {"chain": chain_graph, "diamond": diamond_graph, "batch": batch_graph}


def closure(nodes, edges) -> set:
    succ = {n: set() for n in nodes}
    for p, s in edges:
        succ[p].add(s)
    out = set()
    for n in nodes:
        stack, seen = list(succ[n]), set()
        while stack:
            m = stack.pop()
            if m not in seen:
                seen.add(m)
                stack.extend(succ[m])
        out |= {(n, m) for m in seen}
    return out


# -- cuda_graph.spec ------------------------------------------------------------------------

# orchestra node kind -> the CUDA graph node it becomes (cuGraphAdd*Node)
CUDA_KIND = {"alloc": "mem_alloc", "free": "mem_free", "h2d": "memcpy", "d2h": "memcpy",
             "kernel": "kernel", "memset": "memset", "host": "host"}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_translation_kinds_and_edges_equal_the_taskgraph(name):
    g = GRAPHS[name]()
    spec = translate(g)
    names = [n.name for n in g.nodes]
    assert sorted(spec.order) == sorted(names)
    # node kinds: one CUDA node per orchestra node, of the right kind
    for node in g.nodes:
        s = spec.node(node.name)
        assert s.kind == CUDA_KIND[node.kind]
        assert s.source_kind == node.kind
        assert s.direction == (node.kind if node.kind in ("h2d", "d2h") else None)
    # edges: exactly the transitive reduction, and the same order as the full DAG
    assert spec.edges == g.reduced_edges()
    assert closure(names, spec.edges) == closure(names, g.edges)
    # creation order: every dependency is created before its dependents
    pos = {n: i for i, n in enumerate(spec.order)}
    for s in spec.nodes:
        assert all(pos[d] < pos[s.name] for d in s.deps)
        assert list(s.deps) == sorted(s.deps, key=pos.__getitem__)
    # the edges alone order everything the program needs (no races, no lifetime errors)
    assert verify_graph_edges(g, spec.edges) == []
    # the unreduced translation has every edge
    assert translate(g, reduce=False).edges == g.edges


def test_translation_counts_for_a_batch_pipeline():
    spec = translate(batch_graph(5))
    counts = spec.counts()
    assert counts == {"mem_alloc": 10, "memcpy": 10, "kernel": 5, "mem_free": 10}
    # each batch is a chain alloc -> h2d -> kernel -> d2h -> free, batches independent
    assert ("b0.h2d", "b1.h2d") not in spec.edges
    assert ("b2.alloc_in", "b2.h2d") in spec.edges
    assert ("b2.h2d", "b2.kernel") in spec.edges
    assert ("b2.kernel", "b2.d2h") in spec.edges
    assert ("b2.d2h", "b2.free_out") in spec.edges
    assert ("b2.kernel", "b2.free_in") in spec.edges


@pytest.mark.parametrize("policy,streams", [("by-engine", 3), ("round-robin", 1),
                                             ("round-robin", 2), ("critical-path", 4)])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_plan_edges_add_each_streams_order(name, policy, streams):
    """edges="plan": the DAG's order plus each plan stream's order (what a capture records),
    transitively reduced; every dependency still created first."""
    g = GRAPHS[name]()
    plan = schedule(g, policy, streams)
    spec = translate(g, plan=plan, edges="plan")
    names = [n.name for n in g.nodes]
    chained = set()
    for sname in plan.stream_names:
        on = plan.nodes(sname)
        chained |= set(zip(on, on[1:]))
    want = closure(names, set(g.edges) | chained)
    assert closure(names, spec.edges) == want
    # reduced: dropping any edge loses some order
    for e in list(spec.edges)[:40]:
        assert closure(names, spec.edges - {e}) != want
    pos = {n: i for i, n in enumerate(spec.order)}
    assert all(pos[d] < pos[s.name] for s in spec.nodes for d in s.deps)
    assert verify_graph_edges(g, spec.edges) == []
    assert spec.kinds() == translate(g).kinds()


def test_plan_edges_make_one_chain_per_stream():
    g = batch_graph(4)
    single = translate(g, plan=schedule(g, "round-robin", 1), edges="plan")
    order = single.order
    # one stream: a straight line in the plan's order
    assert single.edges == set(zip(order, order[1:]))
    # the DAG itself keeps the batches independent
    assert ("b0.free_out", "b1.alloc_in") not in translate(g).edges


def test_plan_edges_refuse_bad_arguments():
    g = batch_graph(2)
    with pytest.raises(ValueError, match="edges must be one of"):
        translate(g, edges="streams")
    with pytest.raises(ValueError, match="needs the plan"):
        translate(g, edges="plan")
    with pytest.raises(ValueError, match="not a plan of this graph"):
        translate(g, plan=schedule(batch_graph(3), "by-engine", 3), edges="plan")
    with pytest.raises(TypeError, match="schedule.Plan"):
        translate(g, plan=object(), edges="plan")
    # a hand-made plan running a node before the node it depends on: a clear GraphError
    g2 = TaskGraph()
    g2.add(Memset("m0", Buffer("p", 64), 0))
    g2.add(Memset("m1", Buffer("q", 64), 0, after=("m0",)))
    backwards = PlanBuilder().stream("main").run("m1").run("m0").build()
    with pytest.raises(GraphError, match="contradicts the graph's edges.*m0, m1"):
        translate(g2, plan=backwards, edges="plan")


def test_diamond_translation_has_the_diamond():
    spec = translate(diamond_graph())
    assert set(spec.node("k3").deps) == {"k1", "k2", "poison_w"}
    assert spec.node("k1").deps == ("alloc_y", "h2d")  # the upload and its output's alloc
    assert spec.node("k2").deps == ("alloc_z", "h2d")
    assert spec.node("done").kind == "host"
    assert spec.node("poison_w").kind == "memset"


def test_topology_ignores_names_but_not_structure():
    a, b = translate(batch_graph(3)), translate(batch_graph(3))
    assert a.topology() == b.topology()
    assert translate(batch_graph(3)).topology() != translate(batch_graph(4)).topology()
    # the same kinds in the same order, one extra edge: a different topology
    g1 = TaskGraph()
    g2 = TaskGraph()
    for g, extra in ((g1, ()), (g2, ("m0",))):
        g.add(Memset("m0", Buffer("p", 64), 0))
        g.add(Memset("m1", Buffer("q", 64), 0, after=extra))
    assert [n.kind for n in translate(g1).nodes] == [n.kind for n in translate(g2).nodes]
    assert translate(g1).topology() != translate(g2).topology()


def test_translation_refuses_cycles_and_unknown_kinds():
    g = TaskGraph()
    g.add(Memset("a", Buffer("p", 64), 0, after=("b",)))
    g.add(Memset("b", Buffer("q", 64), 0, after=("a",)))
    with pytest.raises(GraphError, match="cycle"):
        translate(g)

    from orchestra.graph.nodes import Node

    class Peer(Node):
        kind = "peer"

        def accesses(self):
            return ()

    g2 = TaskGraph()
    g2.add(Peer("p0"))
    with pytest.raises(GraphError, match="no CUDA graph node"):
        translate(g2)


def test_translation_imports_no_cuda_call_path():
    import orchestra.execute.cuda_graph.capture_plan as cp
    import orchestra.execute.cuda_graph.cache as gc
    import orchestra.execute.cuda_graph.spec as gs

    for mod in (gs, cp, gc):
        assert "cuda.bindings" not in mod.__dict__.get("__builtins__", {})
        with open(mod.__file__) as f:
            src = f.read()
        assert "from cuda" not in src and "import cuda" not in src


# -- C05 -------------------------------------------------------------------------------------


def test_c05_alloc_without_free_is_refused_with_a_clear_error():
    g = TaskGraph()
    x = Buffer("x", N)
    g.add(Alloc("alloc_x", x))
    g.add(HostToDevice("h2d", HostBuffer("h", N), x))
    g.add(DeviceToHost("d2h", x, HostBuffer("o", N)))
    assert unfreed_allocations(g) == [("alloc_x", "x")]
    with pytest.raises(GraphMemoryError) as info:
        check_graph_memory(g)
    msg = str(info.value)
    assert "alloc_x" in msg and "buffer x" in msg and "Free" in msg and "auto_free" in msg
    assert info.value.unfreed == (("alloc_x", "x"),)
    assert isinstance(info.value, GraphError)
    # the opt-in: the exec frees on each relaunch
    assert check_graph_memory(g, auto_free=True) == [("alloc_x", "x")]
    # a complete graph passes
    assert check_graph_memory(chain_graph()) == []
    assert check_graph_memory(batch_graph()) == []


def test_c05_realloc_without_free_in_between_counts():
    g = TaskGraph()
    x = Buffer("x", N)
    g.add(Alloc("a1", x))
    g.add(Memset("m", x, 0))
    g.add(Alloc("a2", x))
    g.add(Free("f", x))
    assert unfreed_allocations(g) == [("a1", "x")]


def test_c05_graph_executors_check_before_building():
    # The executors call check_graph_memory before any CUDA call: the same function, so the
    # CPU check is the executors' check (see cuda_graph.build.prepare_build).
    from orchestra.execute.cuda_graph.build import prepare_build

    g = TaskGraph()
    x = Buffer("x", N)
    g.add(Alloc("alloc_x", x))
    g.add(Memset("m", x, 0))
    with pytest.raises(GraphMemoryError, match="alloc_x"):
        prepare_build(g, auto_free=False, verify=True)
    spec, unfreed = prepare_build(g, auto_free=True, verify=True)
    assert unfreed == [("alloc_x", "x")] and spec.counts()["mem_alloc"] == 1


# -- capture plan (C02) ----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["round-robin", "by-engine", "critical-path"])
@pytest.mark.parametrize("streams", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_capture_plan_forks_and_joins_every_stream(name, policy, streams):
    g = GRAPHS[name]()
    plan = schedule(g, policy, streams)
    steps = capture_steps(plan)
    check_capture_steps(steps)  # never raises for an orchestra capture
    forked = [s.stream for s in steps if s.op == "fork"]
    joined = [s.stream for s in steps if s.op == "join"]
    assert forked == joined == list(plan.stream_names)
    ops = [s.op for s in steps]
    assert ops[0] == "begin" and ops[-1] == "end"
    # forks come before any plan step, joins after all of them
    first_plan = ops.index("plan")
    last_plan = len(ops) - 1 - ops[::-1].index("plan")
    assert all(op == "fork" for op in ops[1:first_plan])
    assert all(op == "join" for op in ops[last_plan + 1:-1])
    assert sum(isinstance(s.step, RunNode) for s in steps) == len(g)


def test_unjoined_stream_is_named():
    plan = (PlanBuilder().stream("main").run("m0").record("e0")
            .stream("side").wait("e0").run("m1").build())
    steps = capture_steps(plan)
    without_side_join = [s for s in steps if not (s.op == "join" and s.stream == "side")]
    with pytest.raises(UnjoinedStreamError) as info:
        check_capture_steps(without_side_join)
    assert info.value.streams == ("side",)
    assert "side" in str(info.value) and "m1" in str(info.value)
    # work after the join is unjoined too
    late = steps[:-1] + [CaptureStep("plan", "side", RunNode("late")), steps[-1]]
    with pytest.raises(UnjoinedStreamError, match="late"):
        check_capture_steps(late)


def test_stream_working_without_fork_is_refused():
    steps = [CaptureStep("begin", "o"), CaptureStep("plan", "s", RunNode("n")),
             CaptureStep("join", "s"), CaptureStep("end", "o")]
    with pytest.raises(UnjoinedStreamError, match="never forked"):
        check_capture_steps(steps)


def test_waiting_for_a_captured_event_enters_the_capture():
    from orchestra.schedule import RecordEvent

    steps = [CaptureStep("begin", "o"), CaptureStep("fork", "a"),
             CaptureStep("plan", "a", RunNode("n0")), CaptureStep("plan", "a", RecordEvent("e")),
             CaptureStep("plan", "b", WaitEvent("e")), CaptureStep("plan", "b", RunNode("n1")),
             CaptureStep("join", "a"), CaptureStep("join", "b"), CaptureStep("end", "o")]
    check_capture_steps(steps)
    with pytest.raises(UnjoinedStreamError, match="b"):
        check_capture_steps(steps[:-2] + steps[-1:])


def test_a_forked_stream_without_work_needs_no_join():
    steps = [CaptureStep("begin", "o"), CaptureStep("fork", "a"), CaptureStep("end", "o")]
    check_capture_steps(steps)


# -- GraphCache ------------------------------------------------------------------------------


class Closable:
    def __init__(self, tag):
        self.tag = tag
        self.closed = False

    def close(self):
        self.closed = True


def test_signature_keys_on_shapes_dtypes_and_topology():
    c = GraphCache()
    a = c.signature({"x": (8, 1024, "float32")}, batches=8, policy="by-engine", streams=3,
                    kernel=("burn.cu", "burn"))
    b = c.signature({"x": ((8, 1024), "float32")}, streams=3, policy="by-engine", batches=8,
                    kernel=["burn.cu", "burn"])
    assert a == b and hash(a) == hash(b)
    assert a != c.signature({"x": (8, 1024, "float64")}, batches=8, policy="by-engine",
                            streams=3, kernel=("burn.cu", "burn"))
    assert a != c.signature({"x": (8, 1024, "float32")}, batches=8, policy="round-robin",
                            streams=3, kernel=("burn.cu", "burn"))
    assert a != c.signature({"x": (8, 2048, "float32")}, batches=8, policy="by-engine",
                            streams=3, kernel=("burn.cu", "burn"))
    assert a.shape("x") == (8, 1024) and a.get("streams") == 3 and a.get("nope", 7) == 7

    import numpy as np

    arr = np.zeros((8, 1024), np.float32)
    assert c.signature({"x": arr}, batches=8, policy="by-engine", streams=3,
                       kernel=("burn.cu", "burn")) == a
    with pytest.raises(TypeError):
        c.signature({"x": "nonsense"})
    unhashable = type("Unhashable", (), {"__hash__": None})()
    with pytest.raises(TypeError):
        c.signature({"x": arr}, bad=unhashable)
    # lists, sets and dicts are frozen into hashable values
    assert c.signature({}, k=[1, {2, 3}, {"a": [4]}]) == c.signature({}, k=(1, (2, 3), {"a": (4,)}))


def test_bucketing_pads_the_leading_dimension():
    assert [pad_to(n, "pow2") for n in (1, 2, 3, 4, 5, 8, 9, 1000)] == [1, 2, 4, 4, 8, 8, 16, 1024]
    assert [pad_to(n, [1, 8, 32]) for n in (1, 2, 8, 9, 32)] == [1, 8, 8, 32, 32]
    assert pad_to(13, None) == 13
    with pytest.raises(ValueError, match="largest bucket"):
        pad_to(33, [1, 8, 32])
    with pytest.raises(ValueError):
        BucketPolicy([0, 4])
    with pytest.raises(ValueError):
        BucketPolicy("pow2")(0)

    c = GraphCache(buckets="pow2")
    s3 = c.signature({"x": (3, 256, "float32"), "y": (3, 256, "float32")}, op="burn")
    s4 = c.signature({"x": (4, 256, "float32"), "y": (4, 256, "float32")}, op="burn")
    s5 = c.signature({"x": (5, 256, "float32"), "y": (5, 256, "float32")}, op="burn")
    assert s3 == s4 != s5
    assert s5.shape("x") == (8, 256)
    assert s3.requested[0][1] == (3, 256)  # the request's own shape is kept (not in the key)
    assert c.bucket(3) == 4 and GraphCache().bucket(3) == 3


def test_hits_misses_and_lru_eviction_close_values():
    c = GraphCache(max_entries=2)
    built = []

    def build(sig):
        v = Closable(sig.get("n"))
        built.append(v)
        return v

    s = [c.signature({}, n=i) for i in range(3)]
    v0 = c.get_or_build(s[0], build)
    assert c.get_or_build(s[0], build) is v0
    assert (c.hits, c.misses) == (1, 1)
    v1 = c.get_or_build(s[1], build)
    c.get_or_build(s[0], build)  # s0 most recent now
    v2 = c.get_or_build(s[2], build)  # evicts s1 (least recent)
    assert v1.closed and not v0.closed and not v2.closed
    assert s[1] not in c and s[0] in c and len(c) == 2
    assert c.stats == {"entries": 2, "hits": 2, "misses": 3, "evictions": 1}
    assert c.keys() == [s[0], s[2]]
    assert c.get(s[1]) is None and c.get(s[2]) is v2
    assert c.evict(s[0]) and v0.closed and not c.evict(s[0])
    c.clear()
    assert v2.closed and len(c) == 0 and len(built) == 3


def test_build_failure_is_not_cached():
    c = GraphCache()
    sig = c.signature({}, k=1)

    def bad(_):
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        c.get_or_build(sig, bad)
    assert sig not in c
    assert c.get_or_build(sig, lambda _: "ok") == "ok"
    assert c.misses == 2


def test_concurrent_requests_build_once():
    c = GraphCache()
    sig = c.signature({"x": (4, 4, "float32")})
    calls = []
    gate = threading.Event()

    def build(_):
        calls.append(1)
        gate.wait(5)
        return Closable("only")

    results = []
    threads = [threading.Thread(target=lambda: results.append(c.get_or_build(sig, build)))
               for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert c.misses == 1 and c.hits == 7


def test_signature_is_plain_data():
    s = Signature((("x", (4,), "float32"),), (("n", 1),))
    assert s == Signature((("x", (4,), "float32"),), (("n", 1),), requested=(("x", (3,), "f"),))


# -- the executors end to end on a fake driver (tests/fake_graph_cuda.py) --------------------
#
# The fake keeps what the executors rely on (parameters copied at SetParams, per-node updates
# naming instantiation-graph nodes, capture sequences with fork/join and invalidation,
# cuGraphExecUpdate only for identical topologies) and runs graphs on host memory, so outputs
# are checked against numpy. It checks the Python plumbing; the GPU tests check the driver.

import numpy as np  # noqa: E402

from orchestra.driver.capture import CaptureSession  # noqa: E402
from orchestra.execute.cuda_graph.capture import CaptureError, CaptureExecutor  # noqa: E402
from orchestra.execute.errors import (  # noqa: E402
    BindingError,
    HostFunctionError,
    PageableMemoryError,
)
from orchestra.execute.cuda_graph.build import GraphBuildExecutor  # noqa: E402
from tests import fake_graph_cuda as fg  # noqa: E402
from tests.graphs_for_tests import burn_pipeline, check_burn_outputs  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    return fg.install(monkeypatch)


def make_executor(kind, fake, **kw):
    cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
    return cls(fake.device, kernel_resolver=fg.resolver(fake), driver=fake, **kw)


def job(batches=4, ragged=True, iters=3, seed=0):
    """A batch pipeline, its bindings (random inputs, NaN outputs) and the batches."""
    sizes = [N] * batches
    if ragged:
        sizes[-1] = N // 4
    return burn_pipeline(BURN, batches, sizes, iters=iters, seed=seed)


KINDS = ("capture", "graph-build")


@pytest.mark.parametrize("policy,streams", [("by-engine", 3), ("round-robin", 2),
                                            ("critical-path", 4), ("by-engine", 1)])
@pytest.mark.parametrize("kind", KINDS)
def test_fake_graph_outputs_match_numpy(fake, kind, policy, streams):
    g, bs, bind = job(5)
    with make_executor(kind, fake) as ex:
        exe = ex.run(g, None, bind, policy=policy, streams=streams)
        check_burn_outputs(bs, bind, 3)
        assert exe.executor == kind and exe.launches == 1
        assert exe.node_count == len(g)
        assert fake.counts["cuGraphInstantiate"] == 1
        exe.close()
        exe.close()  # idempotent
    assert all(e.graph is None for e in fake.execs.values())
    assert not fake.live_graphs
    assert not fake.capture  # no stream left capturing


def test_fake_capture_and_build_make_the_same_graph_shape(fake):
    g, bs, bind = job(3)
    with make_executor("capture", fake) as cx, make_executor("graph-build", fake) as bx:
        a = cx.build(g, None, bind)
        b = bx.build(g, None, bind, edges="dag")
        ga, gb = fake.graphs[int(a.cugraph)], fake.graphs[int(b.cugraph)]
        assert Counter(n.kind for n in ga.nodes) == Counter(n.kind for n in gb.nodes)

        def edges(gr, exe):
            name = {int(r.gnode): n for n, r in exe._records.items()}
            return {(name[d], name[int(n.id)]) for n in gr.nodes for d in n.deps}

        # graph-build: exactly the reduced edges; capture: the same order (the plan's streams
        # add stream-order edges, so compare reachability on the graph's own nodes)
        assert edges(gb, b) == g.reduced_edges()
        names = [n.name for n in g.nodes]
        assert closure(names, edges(ga, a)) >= closure(names, g.edges)
        a.close()
        b.close()


@pytest.mark.parametrize("policy,streams", [("by-engine", 3), ("round-robin", 2)])
def test_fake_graph_build_with_plan_edges_has_the_captures_order(fake, policy, streams):
    """graph-build with edges="plan" orders exactly what a capture of the same plan orders,
    and still computes the right outputs."""
    g, bs, bind = job(4)
    plan = schedule(g, policy, streams)
    with make_executor("capture", fake) as cx, make_executor("graph-build", fake) as bx:
        a = cx.build(g, plan, bind)
        b = bx.build(g, plan, bind)  # edges="plan" is the default
        ga, gb = fake.graphs[int(a.cugraph)], fake.graphs[int(b.cugraph)]

        def edges(gr, exe):
            name = {int(r.gnode): n for n, r in exe._records.items()}
            return {(name[d], name[int(n.id)]) for n in gr.nodes for d in n.deps
                    if d in name and int(n.id) in name}

        names = [n.name for n in g.nodes]
        assert closure(names, edges(gb, b)) == closure(names, edges(ga, a))
        assert edges(gb, b) == translate(g, plan=plan, edges="plan").edges
        b.launch(sync=True)
        check_burn_outputs(bs, bind, 3)
        with pytest.raises(ValueError, match="edges must be one of"):
            bx.build(g, plan, bind, edges="stream")
        a.close()
        b.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_rebinding_remembers_checked_arrays(fake, kind, monkeypatch):
    """A pool of arrays bound in turn is checked once each; writability is checked every
    time; a removed pinned range or an update makes every array be checked again."""
    from orchestra.driver import host as H
    from orchestra.execute import bindings as bindings_mod

    g, bs, bind = job(2)
    sets = [bind, {k: v.copy() for k, v in bind.items()}]
    calls = []
    real = bindings_mod.check_host_array  # every check of a new array (the slow path)

    def counting(name, value, nbytes, writer, pinned):
        calls.append(name)
        return real(name, value, nbytes, writer, pinned)

    monkeypatch.setattr(bindings_mod, "check_host_array", counting)
    with make_executor(kind, fake) as ex:
        exe = ex.build(g, None, bind)
        for i in range(1, 8):
            exe.replay(sets[i % 2])
            check_burn_outputs(bs, sets[i % 2], 3)
        assert len(calls) == 2 * len(bind)  # each array checked once (the build its own set)
        out = bs[0].host_out.buffer.name
        exe.replay(sets[0])
        sets[1][out].flags.writeable = False
        with pytest.raises(BindingError, match="read-only"):
            exe.replay(sets[1])
        sets[1][out].flags.writeable = True
        exe.replay(sets[0])  # back on the first set (the refused replay moved one input)
        # a pinned range removed: everything is checked again
        before = len(calls)
        H.pinned_ranges().add(0x1000, 16)
        H.pinned_ranges().discard(0x1000)
        exe.replay(sets[1])
        exe.replay(sets[0])
        assert len(calls) == before + 2 * len(bind)
        # an update (a new build) forgets what was checked
        exe.update(g)
        before = len(calls)
        exe.replay(sets[1])
        assert len(calls) == before + len(bind)
        check_burn_outputs(bs, sets[1], 3)
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_update_keeps_the_plan_so_the_topology_matches(fake, kind):
    """update() without a plan rebuilds with the exec's own plan while it is valid for the new
    graph: a hand-given plan, or a critical-path schedule whose costs change with new sizes,
    still gives an in-place cuGraphExecUpdate, and the outputs are right."""
    g, bs, bind = job(4)
    with make_executor(kind, fake) as ex:
        exe = ex.build(g, schedule(g, "round-robin", 1), bind)
        r = exe.update(g)
        assert r.updated and not r.reinstantiated
        g2, bs2 = build_pipeline(4, [N * 4, N // 4, N, N * 2], BURN, scalars=(3, 0.5, 1.0))
        rng = np.random.default_rng(3)
        bind2 = {}
        for b in bs2:
            bind2[b.host_in.buffer.name] = rng.standard_normal(b.nbytes // 4).astype(np.float32)
            bind2[b.host_out.buffer.name] = np.full(b.nbytes // 4, np.nan, np.float32)
        exe2 = ex.build(g, None, bind, policy="critical-path", streams=4)
        r = exe2.update(g2, None, bind2)  # same nodes, new sizes: new costs
        assert r.updated and not r.reinstantiated
        exe2.launch(sync=True)
        check_burn_outputs(bs2, bind2, 3)
        # a plan that no longer fits the new graph is not reused: a fresh schedule is made
        g3 = TaskGraph()
        for node in g.nodes:
            g3.add(node)
        extra = Buffer("extra", 64)
        g3.add(Alloc("xa", extra))
        g3.add(Free("xf", extra))
        r = exe.update(g3)
        assert r.reinstantiated and exe.node_count == len(g) + 2
        exe.launch(sync=True)
        check_burn_outputs(bs, bind, 3)
        exe.close()
        exe2.close()


from collections import Counter  # noqa: E402


@pytest.mark.parametrize("kind", KINDS)
def test_fake_replay_with_fresh_arrays_updates_only_memcpy_nodes(fake, kind):
    g, bs, bind = job(3)
    with make_executor(kind, fake) as ex:
        exe = ex.build(g, None, bind)
        exe.launch(sync=True)
        check_burn_outputs(bs, bind, 3)
        rng = np.random.default_rng(1)
        for i in range(50):
            before = Counter(fake.counts)
            new = {}
            for b in bs:
                new[b.host_in.buffer.name] = rng.standard_normal(b.nbytes // 4).astype(np.float32)
                new[b.host_out.buffer.name] = np.full(b.nbytes // 4, np.nan, np.float32)
            exe.replay(new)
            check_burn_outputs(bs, new, 3)
            delta = fake.counts - before
            assert delta["cuGraphExecMemcpyNodeSetParams"] == 2 * len(bs)
            assert delta["cuGraphLaunch"] == 1
            assert delta["cuGraphInstantiate"] == 0 and delta["cuGraphExecKernelNodeSetParams"] == 0
        # the same array objects again: nothing to update
        before = Counter(fake.counts)
        exe.replay(new)
        assert (fake.counts - before) == Counter({"cuGraphLaunch": 1})
        # only the outputs change: only the D2H nodes are updated
        before = Counter(fake.counts)
        outs = {b.host_out.buffer.name: np.full(b.nbytes // 4, np.nan, np.float32) for b in bs}
        exe.replay(outs)
        check_burn_outputs(bs, {**new, **outs}, 3)
        assert (fake.counts - before)["cuGraphExecMemcpyNodeSetParams"] == len(bs)
        assert exe.bindings[bs[0].host_out.buffer.name] is outs[bs[0].host_out.buffer.name]
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_scalar_update_takes_effect(fake, kind):
    g, bs, bind = job(2)
    with make_executor(kind, fake) as ex:
        exe = ex.run(g, None, bind)
        check_burn_outputs(bs, bind, 3)
        for b in bs:
            bind[b.host_out.buffer.name][:] = np.nan
        exe.replay(scalars={b.kernel.name: {"iters": 7} for b in bs})
        check_burn_outputs(bs, bind, 7)
        assert exe.scalars(bs[0].kernel.name)["iters"] == 7
        # by index, and s / t: v = v * 0.25 + 2
        exe.replay(scalars={bs[0].kernel.name: {4: 0.25, "t": 2.0}})
        x, y = bind[bs[0].host_in.buffer.name], bind[bs[0].host_out.buffer.name]
        v = x.copy()
        for _ in range(7):
            v = v * np.float32(0.25) + np.float32(2)
        np.testing.assert_array_equal(y, v)
        assert fake.counts["cuGraphInstantiate"] == 1
        with pytest.raises(TypeError, match="pointer"):
            exe.replay(scalars={bs[0].kernel.name: {"x": 0}})
        with pytest.raises(ValueError, match="does not fit"):
            exe.replay(scalars={bs[0].kernel.name: {"iters": 2**40}})
        launches = fake.counts["cuGraphLaunch"]
        with pytest.raises(KernelArgumentValueError, match=r"parameter s \(float\): the int "
                                                           r"1\.000e\+400 .* does not fit in float32"):
            exe.replay(scalars={bs[0].kernel.name: {"s": 10 ** 400}})
        assert fake.counts["cuGraphLaunch"] == launches  # refused before the launch
        assert exe.scalars(bs[0].kernel.name)["s"] == 0.25  # the old value stays
        with pytest.raises(TypeError, match="float"):
            exe.replay(scalars={bs[0].kernel.name: {"iters": 1.5}})
        with pytest.raises(ValueError, match="not a kernel node"):
            exe.replay(scalars={"b0.h2d": {"iters": 1}})
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_replay_refuses_bad_bindings_before_launching(fake, kind):
    g, bs, bind = job(2)
    with make_executor(kind, fake) as ex:
        exe = ex.build(g, None, bind)
        name = bs[0].host_in.buffer.name
        launches = fake.counts["cuGraphLaunch"]
        with pytest.raises(BindingError, match="sizes must match"):
            exe.replay({name: np.zeros(7, np.float32)})
        with pytest.raises(BindingError, match="not a host buffer"):
            exe.replay({"nope": np.zeros(4, np.float32)})
        with pytest.raises(BindingError, match="allocated by the graph"):
            exe.replay({"b0.in": np.zeros(4, np.float32)})
        with pytest.raises(BindingError, match="contiguous"):
            exe.replay({name: np.zeros(2 * (N // 4), np.float32)[::2]})
        ro = np.zeros(N // 4, np.float32)
        ro.flags.writeable = False
        with pytest.raises(BindingError, match="read-only"):
            exe.replay({bs[0].host_out.buffer.name: ro})
        exe.replay({name: ro})  # a read-only input is fine
        fake.pinned = False  # the driver says: pageable
        with pytest.raises(PageableMemoryError, match="PinnedBuffer"):
            exe.replay({name: np.zeros(N // 4, np.float32)})
        assert fake.counts["cuGraphLaunch"] == launches + 1
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_exec_keeps_bound_arrays_alive(fake, kind):
    import gc
    import weakref

    g, bs, bind = job(1, ragged=False)
    with make_executor(kind, fake) as ex:
        exe = ex.build(g, None, bind)
        name = bs[0].host_in.buffer.name
        x = np.ones(N // 4, np.float32)
        ref = weakref.ref(x)
        exe.replay({name: x}, sync=False)
        del x
        gc.collect()
        assert ref() is not None  # bound: the exec reads it on every launch
        exe.replay({name: np.zeros(N // 4, np.float32)}, sync=False)
        gc.collect()
        assert ref() is not None  # unbound, but a launch may still read it until synchronize
        exe.synchronize()
        gc.collect()
        assert ref() is None
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_update_same_topology_uses_exec_update(fake, kind):
    g, bs, bind = job(3, iters=3)
    with make_executor(kind, fake) as ex:
        exe = ex.run(g, None, bind)
        g2, bs2, _ = job(3, iters=5)
        res = exe.update(g2)  # same structure, other scalars: cuGraphExecUpdate
        assert res.updated and not res.reinstantiated and res.reason is None
        assert fake.counts["cuGraphInstantiate"] == 1
        exe.launch(sync=True)
        check_burn_outputs(bs, bind, 5)
        # per-node updates after the update still name instantiation-graph nodes (the fake
        # refuses others): rebinding and scalars keep working
        exe.replay(scalars={bs2[0].kernel.name: {"iters": 1}})
        check_burn_outputs(bs[:1], bind, 1)
        new_in = {bs[1].host_in.buffer.name: np.arange(N // 4, dtype=np.float32)}
        exe.replay(new_in)
        check_burn_outputs(bs[1:2], {**bind, **new_in}, 5)
        exe.close()
    assert not fake.live_graphs


@pytest.mark.parametrize("kind", KINDS)
def test_fake_update_changed_topology_reports_and_reinstantiates(fake, kind, caplog):
    g, bs, bind = job(3)
    with make_executor(kind, fake) as ex:
        exe = ex.run(g, None, bind)
        g2, bs2, bind2 = job(4, seed=3)
        res = exe.update(g2, bindings=bind2)
        assert res.reinstantiated and not res.updated
        assert res.reason == "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED"
        assert "TOPOLOGY_CHANGED" in caplog.text
        assert exe.last_update is res
        assert fake.counts["cuGraphInstantiate"] == 2
        exe.launch(sync=True)
        check_burn_outputs(bs2, bind2, 3)
        exe.replay(scalars={bs2[3].kernel.name: {"iters": 2}})
        check_burn_outputs(bs2[3:], bind2, 2)
        # the same node count, one more edge: the offending node is named
        g3 = TaskGraph()
        g4 = TaskGraph()
        for gg, extra in ((g3, ()), (g4, ("m0",))):
            gg.add(Memset("m0", Buffer("p", 64), 0))
            gg.add(Memset("m1", Buffer("q", 64), 0, after=extra))
        ext = {"p": _FakeBuf(fake, 64), "q": _FakeBuf(fake, 64)}
        e3 = ex.build(g3, None, ext, policy="round-robin", streams=2)  # m0, m1 apart
        res = e3.update(g4)
        assert res.reinstantiated and res.node == "m1"
        e3.close()
        exe.close()
    assert not fake.live_graphs


class _FakeBuf:
    """An external device buffer in the fake's memory."""

    def __init__(self, fake, nbytes):
        self.ptr = fake._new_memory(nbytes, fake.mem)
        self.nbytes = nbytes
        self.device = 0


def test_fake_c01_capture_with_a_stream_query_fails_cleanly(fake, monkeypatch):
    g, bs, bind = job(2)
    ex = make_executor("capture", fake)

    def hook(stream, node):
        if node.name == "b0.h2d":
            stream.query()  # illegal during a capture: invalidates it

    with pytest.raises(CaptureError) as info:
        ex.build(g, None, bind, hook=hook)
    err = info.value
    assert err.call == "cuStreamQuery" and err.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert err.node == "b0.h2d" and err.stream == "upload"
    assert "b0.h2d" in str(err) and "cuStreamQuery" in str(err)
    assert "every stream left capture mode" in str(err)
    assert not fake.capture and err.still_capturing == ()
    assert fake.counts["cuStreamEndCapture"] == 1
    assert not fake.live_graphs  # nothing came back, nothing kept
    # the same executor captures the same graph fine afterwards
    exe = ex.run(g, None, bind)
    check_burn_outputs(bs, bind, 3)
    exe.close()
    ex.close()


def test_fake_c01_then_eager_runs(fake, monkeypatch):
    from orchestra.execute import EagerExecutor, KernelResolver
    from tests.fake_cuda import FakeCuda, FakeKernel

    eager_fake = FakeCuda(monkeypatch)
    g, bs, bind = job(2)
    ex = make_executor("capture", fake)
    with pytest.raises(CaptureError):
        ex.build(g, None, bind, hook=lambda s, n: s.query() if n.kind == "h2d" else None)
    with EagerExecutor(kernel_resolver=KernelResolver(eager_fake.device,
                                                      lambda ref, d: FakeKernel())) as eg:
        eg.run(g, None, bind)
    check_burn_outputs(bs, bind, 3)
    ex.close()


def test_fake_c02_hand_made_capture_names_the_unjoined_stream(fake):
    origin, side = fg.FakeStream(), fg.FakeStream()
    ev = (fg.FakeEvent(), fg.FakeEvent())
    buf = _FakeBuf(fake, 256)
    with pytest.raises(UnjoinedStreamError) as info:
        with CaptureSession(origin, events=ev) as cap:
            cap.fork(side, names=["side"])
            fake.cuMemsetD8Async(buf.ptr, 1, 256, side.handle)  # work on side, never joined
    assert info.value.streams == ("side",)
    assert not fake.capture  # both left capture mode
    assert not fake.live_graphs
    # joined, the same capture works
    with CaptureSession(origin, events=ev) as cap:
        cap.fork(side, names=["side"])
        fake.cuMemsetD8Async(buf.ptr, 1, 256, side.handle)
        cap.join(side)
    assert cap.graph is not None and not fake.capture


def test_fake_c03_many_captures_in_a_row(fake):
    g, bs, bind = job(2)
    with make_executor("capture", fake, mode="global") as ex:
        for _ in range(200):
            exe = ex.build(g, None, bind, upload=False)
            exe.close()
        assert ex.captures == 200
        assert len(ex.streams) == 4  # origin + 3 plan streams, reused
    assert not fake.capture and not fake.live_graphs


@pytest.mark.parametrize("kind", KINDS)
def test_fake_c05_policy(fake, kind):
    g = TaskGraph()
    x = Buffer("x", N)
    g.add(Alloc("alloc_x", x))
    g.add(HostToDevice("h2d", HostBuffer("h", N), x))
    g.add(DeviceToHost("d2h", x, HostBuffer("o", N)))
    bind = {"h": np.arange(N // 4, dtype=np.float32), "o": np.zeros(N // 4, np.float32)}
    with make_executor(kind, fake) as ex:
        with pytest.raises(GraphMemoryError, match="alloc_x"):
            ex.build(g, None, bind)
        assert fake.counts["cuGraphInstantiate"] == 0
        exe = ex.build(g, None, bind, auto_free=True)
        assert fake.execs[int(exe.handle)].flags == 1  # AUTO_FREE_ON_LAUNCH
        for i in range(100):
            exe.replay(sync=True)
        np.testing.assert_array_equal(bind["o"], bind["h"])
        exe.close()
        assert fake.counts["cuMemFree"] == 1  # the last launch's allocation, at close


@pytest.mark.parametrize("kind", KINDS)
def test_fake_host_nodes_run_and_errors_surface(fake, kind):
    g = TaskGraph()
    x = Buffer("x", N)
    hin, hout = HostBuffer("hin", N), HostBuffer("hout", N)
    calls = []
    g.add(HostFunc("pre", lambda: calls.append("pre"), writes=(hin,)))
    g.add(Alloc("a", x))
    g.add(HostToDevice("up", hin, x))
    g.add(DeviceToHost("down", x, hout))
    g.add(Free("f", x))
    g.add(HostFunc("post", lambda: calls.append("post"), reads=(hout,)))
    bind = {"hin": np.ones(N // 4, np.float32), "hout": np.zeros(N // 4, np.float32)}
    with make_executor(kind, fake) as ex:
        exe = ex.run(g, None, bind)
        assert calls == ["pre", "post"]
        exe.replay()
        assert calls == ["pre", "post"] * 2
        np.testing.assert_array_equal(bind["hout"], bind["hin"])
        exe.close()

        def boom():
            raise RuntimeError("boom")

        g2 = TaskGraph()
        g2.add(HostFunc("bad", boom))
        exe = ex.build(g2, None, {})
        with pytest.raises(HostFunctionError, match="bad.*boom"):
            exe.launch(sync=True)
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("topology", ["same", "changed"])
def test_fake_host_error_of_a_launch_before_update_is_reported(fake, kind, topology):
    """A host function that raised in a launch made before `update` is reported by the next
    synchronize: whether cuGraphExecUpdate swapped the callback table (same topology) or the
    exec was re-instantiated (changed topology: update itself completes, nothing leaks)."""
    def boom():
        raise RuntimeError("boom")

    g = TaskGraph()
    g.add(HostFunc("bad", boom))
    calls = []
    g2 = TaskGraph()
    g2.add(HostFunc("ok", lambda: calls.append(1)))
    if topology == "changed":
        g2.add(HostFunc("ok2", lambda: calls.append(2)))
    with make_executor(kind, fake) as ex:
        exe = ex.build(g, None, {})
        exe.launch()  # the fake runs the graph now: "bad" raised into the first table
        res = exe.update(g2)
        assert res.updated == (topology == "same")
        with pytest.raises(HostFunctionError, match="bad.*boom"):
            exe.synchronize()
        exe.launch(sync=True)  # reported once, the new functions run
        assert calls == ([1] if topology == "same" else [1, 2])
        exe.close()
    assert not fake.live_graphs


def test_launch_host_func_calls_the_driver_entry_point_not_the_bindings_wrapper(monkeypatch):
    """cuda-bindings' cuLaunchHostFunc (<= 13.3) enqueues its own one-shot record (freed after
    the first call): captured, the second graph launch would call freed memory. The capture
    executor calls the driver's entry point (cuGetProcAddress) instead, with the trampoline
    and the token themselves; here a C-callable stand-in for that entry point runs the host
    function twice, as two graph launches would."""
    import ctypes

    from orchestra.driver import entry_points
    from orchestra.execute import hostfunc

    seen = []

    @entry_points._LAUNCH_HOSTFN
    def entry(stream, fn, user):
        seen.append((stream, fn, user))
        hostfunc._HOSTFN(fn)(user)  # launch 1
        hostfunc._HOSTFN(fn)(user)  # launch 2: the same fn and userData again
        return 0

    class Driver:  # has cuGetProcAddress, like cuda.bindings.driver
        @staticmethod
        def cuGetProcAddress(symbol, version, flags):
            assert symbol == b"cuLaunchHostFunc"
            return 0, ctypes.cast(entry, ctypes.c_void_p).value, 0

        @staticmethod
        def cuLaunchHostFunc(*a):
            raise AssertionError("cuda-bindings' cuLaunchHostFunc must not be used")

    monkeypatch.setattr(entry_points, "_raw", None)
    cb = hostfunc.HostCallbacks()
    calls = []
    token = cb.add(lambda: calls.append(1), "h")
    assert entry_points.launch_host_func(Driver, 0x1234, cb.address, token) == 0
    assert calls == [1, 1] and cb.take_errors() == []
    assert seen == [(0x1234, cb.address, token)]
    assert entry_points.driver_launch_host_func_source() == "cuGetProcAddress"
    monkeypatch.setattr(entry_points, "_raw", None)


def test_fake_graph_build_sets_kernel_node_attributes(fake):
    g = TaskGraph()
    x, y = Buffer("x", N), Buffer("y", N)
    n = N // 4
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(Memset("mx", x, 0, element_size=4))
    g.add(KernelNode("k", BURN, (4, 1, 1), 256, (In(x), Out(y), n, 1, 0.5, 1.0),
                     attributes={"cluster": (2, 1, 1), "priority": -1}))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    with make_executor("graph-build", fake) as ex:
        exe = ex.build(g, None, {})
        ids = {a[1].name for a in fake.attributes}
        assert ids == {"CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION", "CU_LAUNCH_ATTRIBUTE_PRIORITY"}
        exe.launch(sync=True)
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_dot_and_repr(fake, kind, tmp_path):
    g, bs, bind = job(2)
    with make_executor(kind, fake) as ex:
        exe = ex.build(g, None, bind)
        path = exe.dot(tmp_path / "g.dot")
        with open(path) as f:
            text = f.read()
        assert text.startswith("digraph") and text.count("->") >= len(g.reduced_edges())
        assert kind in repr(exe)
        exe.close()
        assert "closed" in repr(exe)
        with pytest.raises(ValueError, match="closed"):
            exe.launch()
        with pytest.raises(ValueError, match="closed"):
            exe.replay()


@pytest.mark.parametrize("kind", KINDS)
def test_fake_finalizer_releases_a_forgotten_exec(fake, kind):
    import gc

    g, bs, bind = job(1)
    with make_executor(kind, fake) as ex:
        exe = ex.run(g, None, bind)
        h = int(exe.handle)
        del exe
        gc.collect()
        assert fake.execs[h].graph is None
    assert not fake.live_graphs


def test_fake_capture_failure_in_a_driver_call_names_the_node(fake):
    g, bs, bind = job(3)
    fake.fail["cuLaunchKernel"] = 2  # the second batch's kernel
    with make_executor("capture", fake) as ex:
        with pytest.raises(CaptureError) as info:
            ex.build(g, None, bind)
        assert info.value.call == "cuLaunchKernel" and info.value.node == "b1.kernel"
        assert not fake.capture and not fake.live_graphs


@pytest.mark.parametrize("kind", ["capture", "graph"])
def test_fake_graph_runner_has_the_eager_interface(fake, kind, tmp_path):
    from orchestra.execute.cuda_graph.runner import GraphRunner

    g, bs, bind = job(3)
    with GraphRunner(kind, fake.device, kernel_resolver=fg.resolver(fake)) as runner:
        plan = runner.prepare(g, policy="by-engine", streams=3)
        r1 = runner.run(g, plan, bind)
        check_burn_outputs(bs, bind, 3)
        assert r1.prepare_ms > 0 and r1.nodes == len(g) and r1.wall_ms is not None
        for b in bs:
            bind[b.host_out.buffer.name][:] = np.nan
        r2 = runner.run(g, plan, bind)
        check_burn_outputs(bs, bind, 3)
        assert r2.prepare_ms == 0.0 and r2.steps == 1
        assert fake.counts["cuGraphInstantiate"] == 1  # built once, replayed after
        assert runner.kernels is runner.executor.kernels
        path = runner.dot(tmp_path / "g.dot")
        assert (tmp_path / "g.dot").exists() and path.endswith("g.dot")
    assert runner.closed and not fake.live_graphs

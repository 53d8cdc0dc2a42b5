"""CPU tests of the hazard verifier: each hazard class in a deliberately broken plan."""

import pytest

from orchestra.errors import HazardError
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import (
    Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostFunc, HostToDevice, In,
    InOut, KernelNode, KernelRef, Out, TaskGraph, add_batch, build_pipeline,
)
from orchestra.schedule import Plan, PlanBuilder, check, schedule, verify, verify_graph_edges

K = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)
K_ANY = KernelRef("k.cu", "k")


def one_batch(index=3, nbytes=4096):
    g = TaskGraph()
    add_batch(g, index=index, kernel=K, nbytes=nbytes, scalars=(10, 1.0, 0.5))
    return g


def edit(plan, stream, remove=(), append=()):
    """A copy of ``plan`` with steps removed from / appended to one stream."""
    d = plan.to_dict()
    for s in d["streams"]:
        if s["name"] == stream:
            s["steps"] = [x for x in s["steps"] if tuple(x) not in set(remove)] + [list(a) for a in append]
    return Plan.from_dict(d)


def kinds(findings):
    return sorted(f.kind for f in findings)


# -- the three broken plans of the issue ----------------------------------------------------

def test_drop_one_event():
    g = one_batch()
    plan = schedule(g, "by-engine", 3)
    broken = edit(plan, "compute", remove=[("wait", "e0")])
    f = verify(broken, g)
    assert f[0].kind == "RAW" and f[0].buffer == "b3.in"
    assert f[0].nodes == ("b3.h2d", "b3.kernel") and f[0].streams == ("upload", "compute")
    assert f[0].message == (
        "RAW on buffer b3.in bytes [0, 4096): b3.h2d (stream upload) writes, b3.kernel (stream "
        "compute) reads, and no event orders b3.h2d before b3.kernel: record an event on upload "
        "after b3.h2d and wait for it on compute before b3.kernel")
    assert kinds(f) == ["FREE_RACE", "RAW", "USE_BEFORE_ALLOC", "USE_BEFORE_ALLOC"]


def test_move_a_free_to_another_stream():
    g = one_batch()
    plan = schedule(g, "by-engine", 3)
    broken = edit(edit(plan, "download", remove=[("run", "b3.free_out")]), "compute",
                  append=[("run", "b3.free_out")])
    (f,) = verify(broken, g)
    assert f.kind == "FREE_RACE" and f.buffer == "b3.out"
    assert f.nodes == ("b3.d2h", "b3.free_out") and f.streams == ("download", "compute")
    assert "record an event on download after b3.d2h and wait for it on compute before b3.free_out" in f.message
    assert "put the free on download" in f.message


def staging_graph():
    """Two batches share one pinned staging slot: fill -> upload, then refill for the next."""
    g, slot = TaskGraph(), HostBuffer("slot", 256)
    out = HostBuffer("result", 256)
    for b in range(2):
        d = Buffer(f"b{b}.d", 256)
        g.add(HostFunc(f"b{b}.fill", lambda: None, writes=[slot], batch=b))
        g.add(Alloc(f"b{b}.alloc", d, batch=b))
        g.add(HostToDevice(f"b{b}.h2d", slot, d, batch=b))
        g.add(KernelNode(f"b{b}.kernel", K_ANY, 1, 32, (InOut(d),), batch=b))
        g.add(DeviceToHost(f"b{b}.d2h", d, out, batch=b))
        g.add(HostFunc(f"b{b}.consume", lambda: None, reads=[out], batch=b))
        g.add(Free(f"b{b}.free", d, batch=b))
    return g


def test_reuse_a_host_buffer_early():
    g = staging_graph()
    assert ("b0.h2d", "b1.fill") in g.edges  # WAR on the slot
    ok = schedule(g, "by-engine", 3)
    assert verify(ok, g) == []
    # the host thread refills the slot right after the first fill: nothing waits for b0.h2d
    broken = (PlanBuilder()
              .stream("host").run("b0.fill").record("f0").run("b1.fill").record("f1")
              .stream("upload", role="upload").run("b0.alloc", "b1.alloc").wait("f0").run("b0.h2d")
              .wait("f1").run("b1.h2d").record("u1")
              .stream("compute", role="compute").wait("u1").run("b0.kernel", "b0.d2h", "b0.consume",
                                                               "b0.free", "b1.kernel", "b1.d2h",
                                                               "b1.consume", "b1.free")
              .build())
    f = verify(broken, g)
    assert [x.kind for x in f] == ["HOST_WAR"]
    assert f[0].buffer == "slot" and f[0].nodes == ("b0.h2d", "b1.fill")
    assert f[0].message.startswith("WAR on host buffer slot bytes [0, 256): b0.h2d (stream upload) "
                                   "reads, b1.fill (stream host) writes, and no event orders")


def test_host_result_read_before_the_copy_is_done():
    g = staging_graph()
    plan = schedule(g, "by-engine", 3)
    stream = plan.node_stream["b0.consume"]
    assert stream == "download"  # host functions follow their latest predecessor
    moved = edit(edit(plan, "download", remove=[("run", "b0.consume")]), "upload",
                 append=[("run", "b0.consume")])
    f = verify(moved, g)
    assert "HOST_RAW" in kinds(f) and any(x.nodes == ("b0.d2h", "b0.consume") for x in f)


# -- lifetimes ------------------------------------------------------------------------------

def lifetime_graph(free_twice=False, free=True):
    g, h, d = TaskGraph(), HostBuffer("h", 64), Buffer("d", 64)
    g.add(Alloc("alloc", d))
    g.add(HostToDevice("h2d", h, d))
    g.add(KernelNode("kernel", K_ANY, 1, 32, (InOut(d),)))
    if free:
        g.add(Free("free", d))
    if free_twice:
        g.add(Free("free_again", d))
    return g


def test_double_free():
    g = lifetime_graph(free_twice=True)
    f = verify(schedule(g, "round-robin", 1), g)
    assert kinds(f) == ["DOUBLE_FREE"] and f[0].nodes == ("free", "free_again")
    g = lifetime_graph()
    twice = PlanBuilder().stream("s0").run("alloc", "h2d", "kernel", "free").stream("s1").run("free").build()
    f = verify(twice, g)
    assert "DOUBLE_FREE" in kinds(f) and "run each node once" in f[0].message


def test_use_after_free():
    g = lifetime_graph()
    plan = PlanBuilder().stream("s0").run("alloc", "h2d", "free", "kernel").build()
    f = verify(plan, g)
    assert kinds(f) == ["USE_AFTER_FREE"]
    assert f[0].nodes == ("free", "kernel") and "kernel (stream s0) reads and writes it after free" in f[0].message


def test_use_before_alloc_and_never_freed():
    g = lifetime_graph(free=False)
    f = verify(PlanBuilder().stream("s0").run("h2d", "alloc", "kernel").build(), g)
    assert kinds(f) == ["NEVER_FREED", "USE_BEFORE_ALLOC"]
    uba = next(x for x in f if x.kind == "USE_BEFORE_ALLOC")
    assert uba.nodes == ("alloc", "h2d") and "runs h2d before alloc" in uba.message
    never = next(x for x in f if x.kind == "NEVER_FREED")
    assert never.message == "buffer d is allocated by alloc (stream s0) but never freed: add a Free after its last use"


def test_external_buffers_get_race_checks_only():
    g, w = TaskGraph(), Buffer("weights", 64)  # no Alloc/Free: bound by the caller
    g.add(KernelNode("update", K_ANY, 1, 32, (Out(w),)))
    g.add(KernelNode("use", K_ANY, 1, 32, (In(w),)))
    assert verify(schedule(g, "round-robin", 1), g) == []
    f = verify(PlanBuilder().stream("a").run("update").stream("b").run("use").build(), g)
    assert kinds(f) == ["RAW"]


# -- structure ------------------------------------------------------------------------------

def test_missing_unknown_and_duplicate_nodes():
    g = lifetime_graph()
    plan = PlanBuilder().stream("s0").run("alloc", "h2d", "h2d", "ghost", "free").build()
    f = verify(plan, g)
    assert {"MISSING", "DUPLICATE", "UNKNOWN_NODE"} <= set(kinds(f))
    assert any(x.kind == "MISSING" and x.nodes[0] == "kernel" for x in f)


def test_event_problems():
    g = lifetime_graph()
    unrecorded = PlanBuilder().stream("s0").run("alloc", "h2d").stream("s1").wait("nope").run("kernel", "free").build()
    f = verify(unrecorded, g)
    assert "WAIT_UNRECORDED" in kinds(f) and "RAW" in kinds(f)
    w = next(x for x in f if x.kind == "WAIT_UNRECORDED")
    assert w.nodes == ("kernel", None) and w.streams == ("s1",)  # the node the wait holds up
    assert w.message.startswith("stream s1 waits for event nope before kernel, which no stream records")
    # a wait with no node after it holds nothing up
    tail = PlanBuilder().stream("s0").run("alloc", "h2d", "kernel", "free").wait("nope").build()
    w = next(x for x in verify(tail, g) if x.kind == "WAIT_UNRECORDED")
    assert w.nodes == (None, None) and w.message.startswith("stream s0 waits for event nope, which")
    reused = (PlanBuilder().stream("s0").run("alloc").record("e").run("h2d").record("e")
              .stream("s1").wait("e").run("kernel", "free").build())
    assert "EVENT_REUSED" in kinds(verify(reused, g))
    dead = (PlanBuilder().stream("s0").run("alloc", "h2d").wait("y").record("x")
            .stream("s1").wait("x").record("y").run("kernel", "free").build())
    d = next(x for x in verify(dead, g) if x.kind == "DEADLOCK")
    # one held-up node per blocked stream: nothing runs after s0's wait, s1's holds up kernel
    assert d.streams == ("s0", "s1") and d.nodes == (None, "kernel")
    assert "stream s1 waits for x (holding up kernel) before it is recorded" in d.message
    assert "stream s0 waits for y before it is recorded" in d.message
    # three streams in a cycle: three held-up nodes
    g3 = TaskGraph()
    for n in ("a", "b", "c"):
        g3.add(HostFunc(n, lambda: None))
    ring = (PlanBuilder().stream("p").wait("ec").run("a").record("ea")
            .stream("q").wait("ea").run("b").record("eb")
            .stream("r").wait("eb").run("c").record("ec").build())
    d = next(x for x in verify(ring, g3) if x.kind == "DEADLOCK")
    assert d.streams == ("p", "q", "r") and d.nodes == ("a", "b", "c")
    # a stream blocked on its own later record: one stream, padded to two nodes
    own = PlanBuilder().stream("s").wait("e").run("a").record("e").run("b", "c").build()
    d = next(x for x in verify(own, g3) if x.kind == "DEADLOCK")
    assert d.streams == ("s",) and d.nodes == ("a", None)


def test_after_edges_are_checked():
    g = TaskGraph()
    g.add(HostFunc("log", lambda: None))
    g.add(HostFunc("then", lambda: None, after="log"))
    f = verify(PlanBuilder().stream("a").run("log").stream("b").run("then").build(), g)
    assert kinds(f) == ["ORDER"] and "then (stream b) must run after log (stream a)" in f[0].message


def test_hand_written_correct_plan_passes_and_check_raises():
    g = one_batch(0)
    good = (PlanBuilder()
            .stream("up", role="upload").run("b0.alloc_in", "b0.alloc_out", "b0.h2d").record("up0")
            .stream("comp", role="compute").wait("up0").run("b0.kernel").record("k0").run("b0.free_in")
            .stream("down", role="download").wait("k0").run("b0.d2h", "b0.free_out")
            .build())
    assert verify(good, g) == []
    check(good, g)
    bad = edit(good, "comp", remove=[("wait", "up0")])
    with pytest.raises(HazardError) as err:
        check(bad, g)
    assert "hazard(s); nothing was enqueued" in str(err.value) and len(err.value.findings) == 4


# -- graph edges only (CUDA graphs) ---------------------------------------------------------

def test_verify_graph_edges():
    g = one_batch(0)
    assert verify_graph_edges(g) == []
    assert verify_graph_edges(g, g.reduced_edges()) == []
    f = verify_graph_edges(g, g.edges - {("b0.h2d", "b0.kernel")})
    assert f[0].kind == "RAW" and f[0].streams == (None, None)
    assert "no path of graph edges orders b0.h2d before b0.kernel: add an edge" in f[0].message


# -- scale ----------------------------------------------------------------------------------

def test_4000_node_plans_verify_clean_and_one_missing_wait_is_found_exactly():
    # (how fast: benchmarks/bench_verify.py)
    g, _ = build_pipeline(572, 4096, K, scalars=(1, 1.0, 0.0))
    assert len(g) == 4004
    for policy in ("by-engine", "critical-path"):
        assert verify(schedule(g, policy, 4), g) == []
    assert verify_graph_edges(g) == []
    assert verify_graph_edges(g, g.reduced_edges()) == []
    # 2,000 kernels updating one workspace: the last one, on its own stream, waits for the
    # other 1,999. Without the wait it races with each of them, found through the frontier.
    w, ws, n = Buffer("weights", 64), Buffer("workspace", 64), 2000
    stack = TaskGraph()
    for i in range(n):
        stack.add(KernelNode(f"k{i}", K_ANY, 1, 32, (In(w), InOut(ws))))
    good = (PlanBuilder().stream("a").run(*(f"k{i}" for i in range(n - 1))).record("e")
            .stream("b").wait("e").run(f"k{n - 1}").build())
    assert verify(good, stack) == []
    f = verify(edit(good, "b", remove=[("wait", "e")]), stack)
    assert [x.nodes for x in f] == [(f"k{i}", f"k{n - 1}") for i in range(n - 1)]
    assert {x.kind for x in f} == {"RAW"} and {x.buffer for x in f} == {"workspace"}
    assert f[0].message == (
        "RAW on buffer workspace bytes [0, 64): k0 (stream a) reads and writes, k1999 (stream b) "
        "reads and writes, and no event orders k0 before k1999: record an event on a after k0 "
        "and wait for it on b before k1999")


def test_a_free_racing_thousands_of_uses_reports_the_last_one():
    # 3,000 kernels on one stream read-write a buffer that a Free on another stream releases
    # with no event: one FREE_RACE, for the last use (ordering it orders the rest); the same in
    # graph mode with the free's edge gone, where the uses are independent of each other
    d, n = Buffer("d", 64), 3000
    g = TaskGraph()
    g.add(Alloc("alloc", d))
    for i in range(n):
        g.add(KernelNode(f"k{i}", K_ANY, 1, 32, (In(d),)))
    g.add(Free("free", d))
    plan = (PlanBuilder().stream("a").run("alloc", *(f"k{i}" for i in range(n)))
            .stream("b").run("free").build())
    f = verify(plan, g)
    assert [(x.kind, x.nodes) for x in f] == [("USE_BEFORE_ALLOC", ("alloc", "free")),
                                              ("FREE_RACE", (f"k{n - 1}", "free"))]
    assert "(or put the free on a, the stream of the buffer's last use)" in f[1].message
    edges = g.edges - {(f"k{i}", "free") for i in range(n)}
    f = verify_graph_edges(g, edges)
    assert [x.kind for x in f] == ["FREE_RACE"] * n  # independent uses: each one is last
    assert [x.nodes for x in f[:2]] == [("k0", "free"), ("k1", "free")]

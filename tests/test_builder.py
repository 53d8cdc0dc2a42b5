"""`GraphBuilder` (CPU): generated names, graph allocations, equivalence with hand-written
graphs, its errors, runs on the fake drivers, and the docs and example that show it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.errors import (
    BufferLifetimeError,
    BuilderClosedError,
    ClosedError,
    GraphError,
    HostBufferUseError,
    NameCollisionError,
    NodeFieldTypeError,
    NodeFieldValueError,
    NotReadyError,
    OrchestraError,
)
from orchestra.graph import (
    Alloc,
    Buffer,
    DeviceToHost,
    Free,
    GraphBuilder,
    HostBuffer,
    HostFunc,
    HostToDevice,
    In,
    KernelNode,
    KernelRef,
    Lifetime,
    Memset,
    Out,
    TaskGraph,
    build_pipeline,
)
from orchestra.graph.names import label
from orchestra.schedule import POLICIES, schedule, verify, verify_graph_edges

ROOT = Path(__file__).resolve().parents[1]
BURN = KernelRef("burn.cu", "burn", params=BURN_PARAMS)  # burn(const float* x, float* y, n, ...)
N = 4096  # bytes per batch
ITERS = 3


def burn_ref(x, iters=ITERS):
    v = x.astype(np.float32).copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


def pipeline(batches=3, *, poison=True) -> GraphBuilder:
    """x -> device, burn, -> y per batch, over one host input and one host output sliced into
    batch ranges; a memset poisons each output first (a second writer of the buffer)."""
    g = GraphBuilder()
    x = g.host_input("x", batches * N)
    y = g.host_output("y", batches * N)
    for b in range(batches):
        with g.batch(b):
            dx = g.to_device(x.range(b * N, N))
            dy = g.device_buffer(N)
            if poison:
                g.memset(dy, 0x7FC00000, 4)
            g.kernel(BURN, 4, 256, (dx, Out(dy), N // 4, ITERS, 0.5, 1.0))
            g.to_host(dy, y.range(b * N, N))
    return g


def closure(graph: TaskGraph) -> dict[str, set[str]]:
    """node -> every node reachable from it along the graph's edges (computed here, not by the
    verifier, so the test does not trust the code under test)."""
    succs = {n.name: set() for n in graph.nodes}
    for p, s in graph.edges:
        succs[p].add(s)
    out: dict[str, set[str]] = {}
    for n in reversed(graph.topological_order()):
        r = set()
        for s in succs[n]:
            r |= {s} | out[s]
        out[n] = r
    return out


def uses(graph: TaskGraph, buffer: str) -> list[str]:
    return [n.name for n in graph.nodes if n.kind not in ("alloc", "free")
            and any(b.name == buffer for b in n.buffers())]


# -- generated names ---------------------------------------------------------------------------


def test_generated_names_read_kind_what_and_count():
    g = pipeline(2)
    graph = g.build()
    assert [n.name for n in graph.nodes] == [
        "alloc:d_x#0", "h2d:x#0", "alloc:buf#0", "memset:buf#0", "kernel:burn#0", "free:d_x#0",
        "d2h:y#0", "free:buf#0",
        "alloc:d_x#1", "h2d:x#1", "alloc:buf#1", "memset:buf#1", "kernel:burn#1", "free:d_x#1",
        "d2h:y#1", "free:buf#1"]
    assert [b.name for b in graph.buffers] == ["d_x#0", "buf#0", "d_x#1", "buf#1"]
    assert [b.name for b in graph.host_buffers] == ["x", "y"]
    assert [n.batch for n in graph.nodes] == [0] * 8 + [1] * 8


def test_names_are_stable_and_unique():
    a, b = pipeline(5).build(), pipeline(5).build()
    names = [n.name for n in a.nodes]
    assert names == [n.name for n in b.nodes]
    assert len(set(names)) == len(names)
    assert a.nodes == b.nodes and a.edges == b.edges  # the whole graph, not only the names
    assert schedule(a, "by-engine", 3).to_dict() == schedule(b, "by-engine", 3).to_dict()


def test_generated_names_never_collide_with_user_names():
    with GraphBuilder() as g:
        x = g.host_input("x", N)
        d = g.to_device(x, name="h2d:x")         # a user name that looks like a base: fine
        g.kernel(BURN, 4, 256, (d, d, N // 4, 1, 0.5, 1.0), name="kernel:burn")
        g.kernel(BURN, 4, 256, (d, d, N // 4, 1, 0.5, 1.0))
        g.to_device(x, d)
        dd = g.device_buffer(N, name="d_x")      # a user buffer name equal to a label
        g.to_device(x)                           # -> d_x#0, distinct from the user's d_x
        g.memset(dd, 0)
        with pytest.raises(NameCollisionError, match="'#'"):
            g.kernel(BURN, 4, 256, (d, d, N // 4, 1, 0.5, 1.0), name="kernel:burn#1")
        with pytest.raises(NameCollisionError, match="'#'"):
            g.device_buffer(N, name="buf#0")
        with pytest.raises(NameCollisionError, match="'#'"):
            g.host_input("in#1", N)
        with pytest.raises(NameCollisionError, match="'#'"):
            g.add(Memset("m#0", dd, 0))
    names = [n.name for n in g.graph.nodes]
    assert "h2d:x" in names and "kernel:burn" in names and "kernel:burn#0" in names
    assert "h2d:x#0" in names and "h2d:x#1" in names  # the later unnamed copies
    assert {b.name for b in g.graph.buffers} == {"d_x#0", "d_x", "d_x#1"}
    assert len(set(names)) == len(names)


def test_labels_fold_what_a_name_cannot_hold():
    assert label("d_x#12", "buf") == "d_x"
    assert label("<lambda>", "host") == "lambda"
    assert label("a b#c", "x") == "a_b_c"
    assert label("", "kernel") == "kernel" and label(None, "host") == "host"
    with GraphBuilder() as g:
        h = g.host_buffer("h", N)
        g.host_func(lambda: None, writes=h)
        g.host_func(print, reads=h)
    assert [n.name for n in g.graph.nodes] == ["host:lambda#0", "host:print#0"]


def test_generated_names_show_in_plan_text_and_json():
    graph = pipeline(2).build()
    plan = schedule(graph, "by-engine", 3)
    text = str(plan)
    for n in graph.nodes:
        assert re.search(rf"^    run    {re.escape(n.name)}$", text, re.M), n.name
    assert "wait   e0   (after alloc:buf#0 on upload)" in text
    runs = [name for st in json.loads(plan.to_json())["streams"] for op, name in st["steps"]
            if op == "run"]
    assert sorted(runs) == sorted(n.name for n in graph.nodes)  # names survive JSON


def test_refused_calls_leave_the_numbering_unchanged():
    with GraphBuilder() as g:
        x = g.host_input("x", N)
        with pytest.raises(NodeFieldValueError, match=r"KernelNode kernel:burn#0: grid"):
            g.kernel(BURN, 0, 256, ())
        with pytest.raises(NodeFieldValueError, match="HostToDevice h2d:x#0"):
            g.to_device(x, g.external_buffer("e", N // 2))
        with pytest.raises(NodeFieldTypeError):
            g.to_device(x, after=[3.5])  # bad after=: no buffer made, no number used
        d = g.to_device(x)
        g.kernel(BURN, 4, 256, (d, d, N // 4, 1, 0.5, 1.0))
    assert [n.name for n in g.graph.nodes] == ["alloc:d_x#0", "h2d:x#0", "kernel:burn#0",
                                               "free:d_x#0"]


# -- graph allocations -------------------------------------------------------------------------


def test_alloc_right_before_first_use_and_free_right_after_last():
    g = GraphBuilder()
    x = g.host_input("x", N)
    y = g.host_output("y", N)
    scratch = g.device_buffer(N)                        # made first, used later
    dx = g.to_device(x)
    g.kernel(BURN, 4, 256, (dx, Out(scratch), N // 4, 1, 0.5, 1.0))
    g.kernel(BURN, 4, 256, (In(scratch), Out(dx), N // 4, 1, 0.5, 1.0))
    g.host_func(lambda: None, reads=x)                  # touches neither
    g.kernel(BURN, 4, 256, (dx, Out(scratch), N // 4, 1, 0.5, 1.0))  # a later use moves both frees
    g.to_host(scratch, y)
    graph = g.build()
    names = [n.name for n in graph.nodes]
    assert names == ["alloc:d_x#0", "h2d:x#0", "alloc:buf#0", "kernel:burn#0", "kernel:burn#1",
                     "host:lambda#0", "kernel:burn#2", "free:d_x#0", "d2h:y#0", "free:buf#0"]
    assert g.lifetime(scratch) == Lifetime(scratch, "alloc:buf#0", "free:buf#0")
    reach = closure(graph)
    for buf in ("d_x#0", "buf#0"):
        alloc, free = f"alloc:{buf}", f"free:{buf}"
        assert isinstance(graph.node(alloc), Alloc) and isinstance(graph.node(free), Free)
        for u in uses(graph, buf):
            assert u in reach[alloc] and free in reach[u], (buf, u)
        assert graph.index(free) == max(graph.index(u) for u in uses(graph, buf)) + 1
    assert verify_graph_edges(graph) == []
    assert verify_graph_edges(graph, graph.reduced_edges()) == []


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_verifier_passes_for_every_policy_and_stream_count(policy, streams):
    graph = pipeline(4).build()
    plan = schedule(graph, policy, streams)
    assert verify(plan, graph) == []


def test_free_follows_every_use_of_many_interleaved_ranges():
    # Uses of disjoint ranges of one allocation, interleaved with other buffers' work: the Free
    # must still follow each (a Free after only the last writer would race the earlier readers).
    with GraphBuilder() as g:
        x = g.host_input("x", 4 * N)
        big = g.device_buffer(4 * N, name="big")
        for i in range(4):
            g.to_device(x.range(i * N, N), big.range(i * N, N))
        other = g.device_buffer(N)
        for i in range(4):
            g.kernel(BURN, 4, 256, (In(big.range(i * N, N)), Out(other), N // 4, 1, 0.5, 1.0))
        g.memset(other, 0)
    graph = g.graph
    reach = closure(graph)
    big_uses = uses(graph, "big")
    assert len(big_uses) == 8
    assert all("free:big#0" in reach[u] for u in big_uses)
    preds = set(graph.predecessors("free:big#0"))
    assert preds == {f"kernel:burn#{i}" for i in range(4)} | {f"h2d:x#{i}" for i in range(4)}
    for policy in POLICIES:
        for streams in (1, 2, 3, 4):
            assert verify(schedule(graph, policy, streams), graph) == [], (policy, streams)


def test_the_cuda_graph_memory_check_sees_every_pair():
    from orchestra.execute.cuda_graph.build import prepare_build
    from orchestra.execute.cuda_graph.spec import check_graph_memory, translate, unfreed_allocations

    graph = pipeline(3).build()
    assert unfreed_allocations(graph) == []
    assert check_graph_memory(graph) == []  # would raise GraphMemoryError for a missing Free
    counts = translate(graph).counts()
    assert counts["mem_alloc"] == counts["mem_free"] == 6
    spec, unfreed = prepare_build(graph, auto_free=False, verify=True)
    assert unfreed == [] and len(spec.nodes) == len(graph)


def test_unused_allocations_insert_nothing():
    with GraphBuilder() as g:
        x = g.host_input("x", N)
        unused = g.device_buffer(N)
        d = g.to_device(x)
        g.memset(d, 1)
    assert g.lifetime(unused).alloc == "alloc:buf#0"
    assert "alloc:buf#0" not in g.graph and [b.name for b in g.graph.buffers] == ["d_x#0"]


def test_after_a_buffer_means_after_its_free_and_bounds_memory():
    # two slots' worth of device memory: batch b's allocations wait for batch b-2's frees
    with GraphBuilder() as g:
        x = g.host_input("x", 4 * N)
        y = g.host_output("y", 4 * N)
        made = []
        for b in range(4):
            older = made[b - 2] if b >= 2 else ()
            din = g.device_buffer(N, after=older)
            dout = g.device_buffer(N, after=older)
            made.append((din, dout))
            g.to_device(x.range(b * N, N), din)
            g.kernel(BURN, 4, 256, (din, Out(dout), N // 4, 1, 0.5, 1.0))
            g.to_host(dout, y.range(b * N, N))
    graph = g.graph
    lives = [(g.lifetime(i), g.lifetime(o)) for i, o in made]
    assert graph.node(lives[2][0].alloc).after == (lives[0][0].free, lives[0][1].free)
    assert (lives[0][1].free, lives[2][1].alloc) in graph.explicit_edges
    for policy in POLICIES:
        assert verify(schedule(graph, policy, 3), graph) == []


def test_a_use_added_to_the_graph_after_close_is_caught_by_the_verifier():
    # After close the graph is a plain TaskGraph: a use added then follows the Free (inferred
    # edges put it after the Free's write), and the verifier refuses the plan before any run.
    g = pipeline(1)
    graph = g.build()
    late = graph.add(KernelNode("late", BURN, 4, 256, (In(Buffer("buf#0", N)),
                                                      Out(Buffer("d_x#0", N)), N // 4, 1, 0.5,
                                                      1.0)))
    assert ("free:buf#0", late.name) in graph.edges
    kinds = {f.kind for f in verify(schedule(graph, "by-engine", 3), graph)}
    assert "USE_AFTER_FREE" in kinds


# -- builder == hand-written -------------------------------------------------------------------


def saxpy_pair():
    nbytes = 4 * 1024
    saxpy = KernelRef("saxpy.cu", "saxpy", params=("float a", "const float* x", "const float* y",
                                                   "float* out", "size_t n"))
    with GraphBuilder() as g:
        x, y = g.host_input("x", nbytes), g.host_input("y", nbytes)
        out = g.host_output("out", nbytes)
        dx, dy = g.to_device(x), g.to_device(y)
        dout = g.device_buffer(nbytes)
        g.kernel(saxpy, 4, 256, (2.0, dx, dy, Out(dout), 1024))
        g.to_host(dout, out)
    xh, yh, oh = HostBuffer("x", nbytes), HostBuffer("y", nbytes), HostBuffer("out", nbytes)
    bx, by, bo = Buffer("d_x#0", nbytes), Buffer("d_y#0", nbytes), Buffer("buf#0", nbytes)
    hand = TaskGraph()
    for node in (Alloc("alloc:d_x#0", bx), HostToDevice("h2d:x#0", xh, bx),
                 Alloc("alloc:d_y#0", by), HostToDevice("h2d:y#0", yh, by),
                 Alloc("alloc:buf#0", bo),
                 KernelNode("kernel:saxpy#0", saxpy, 4, 256, (2.0, bx, by, Out(bo), 1024)),
                 Free("free:d_x#0", bx), Free("free:d_y#0", by),
                 DeviceToHost("d2h:out#0", bo, oh), Free("free:buf#0", bo)):
        hand.add(node)
    return g.graph, hand


def assert_same_graph(a: TaskGraph, b: TaskGraph, *, order=True):
    if order:
        assert a.nodes == b.nodes  # records equal field by field, in program order
    else:
        assert set(a.nodes) == set(b.nodes)
    for na in a.nodes:
        nb = b.node(na.name)
        assert na.kind == nb.kind and na.engine == nb.engine
        assert na.accesses() == nb.accesses()
    assert a.edges == b.edges and a.explicit_edges == b.explicit_edges
    assert {e: a.edge_reason(*e) for e in a.edges} == {e: b.edge_reason(*e) for e in b.edges}
    assert a.buffers == b.buffers and a.host_buffers == b.host_buffers


def test_builder_graph_equals_the_hand_written_one():
    built, hand = saxpy_pair()
    assert type(built) is TaskGraph
    assert_same_graph(built, hand)
    assert built.reduced_edges() == hand.reduced_edges()
    for policy in POLICIES:
        assert schedule(built, policy, 3).to_dict() == schedule(hand, policy, 3).to_dict()


def test_builder_with_every_name_given_reproduces_build_pipeline():
    # build_pipeline's graph (names, records, edges, in-flight after= edges) from builder calls;
    # only the program order differs (the builder allocates at first use, frees at last use).
    sizes = [N, N, N // 2, N]
    total = sum(sizes)
    ref, _ = build_pipeline(len(sizes), sizes, BURN, host_in=HostBuffer("host_in", total),
                            host_out=HostBuffer("host_out", total), in_flight=2,
                            scalars=(ITERS, 0.5, 1.0))
    with GraphBuilder() as g:
        hin, hout = g.host_input("host_in", total), g.host_output("host_out", total)
        off, made = 0, []
        for i, size in enumerate(sizes):
            with g.batch(i):
                p = f"b{i}."
                after = made[i - 2] if i >= 2 else ()
                inp = g.device_buffer(size, p + "in", alloc_name=p + "alloc_in",
                                      free_name=p + "free_in", after=after)
                out = g.device_buffer(size, p + "out", alloc_name=p + "alloc_out",
                                      free_name=p + "free_out", after=after)
                made.append((inp, out))
                g.to_device(hin.range(off, size), inp, name=p + "h2d")
                g.kernel(BURN, -(-size // 4 // 256), 256,
                         (In(inp), Out(out), size // 4, ITERS, 0.5, 1.0), name=p + "kernel")
                g.to_host(out, hout.range(off, size), name=p + "d2h")
                off += size
    assert_same_graph(g.graph, ref, order=False)
    for policy in POLICIES:
        assert verify(schedule(g.graph, policy, 3), g.graph) == []


def test_raw_records_pass_through_unchanged():
    e = Buffer("ext", N)
    node = Memset("poison", e, 0x7F, 1)
    with GraphBuilder() as g:
        assert g.add(node) is node
        h = g.host_output("h", N)
        g.add(DeviceToHost("down", e, h))
        g.add(Alloc("a", Buffer("mine", N)))   # a hand-managed lifetime is the user's
        g.add(Free("f", Buffer("mine", N)))
    assert g.graph.nodes[0] is node
    assert [n.name for n in g.graph.nodes] == ["poison", "down", "a", "f"]
    assert g.nodes == ()  # the builder forgets its list once the graph is written


# -- errors ------------------------------------------------------------------------------------


def _is(err, cls, *builtins):
    assert type(err) is cls and isinstance(err, OrchestraError)
    for b in builtins:
        assert isinstance(err, b)


def test_closed_builder_refuses_everything_and_graph_needs_close():
    g = GraphBuilder()
    x = g.host_input("x", N)
    d = g.to_device(x)
    with pytest.raises(NotReadyError, match="read .graph after the with block ends"):
        g.graph
    graph = g.build()
    assert g.build() is graph and g.graph is graph and g.closed
    for call in (lambda: g.kernel(BURN, 4, 256, (d, d, N // 4, 1, 0.5, 1.0)),
                 lambda: g.to_host(d, HostBuffer("h", N)), lambda: g.device_buffer(N),
                 lambda: g.memset(d, 0), lambda: g.host_input("z", N),
                 lambda: g.add(Memset("m", d, 0)), lambda: g.batch(1).__enter__()):
        with pytest.raises(BuilderClosedError, match="this GraphBuilder is closed .its graph is"
                                                     " built. and takes no more nodes") as info:
            call()
        _is(info.value, BuilderClosedError, ClosedError, ValueError)
    assert len(g.graph) == 3


def test_an_exception_in_the_block_discards_the_graph():
    with pytest.raises(RuntimeError, match="boom"):
        with GraphBuilder() as g:
            g.device_buffer(N)
            raise RuntimeError("boom")
    assert g.closed
    with pytest.raises(NotReadyError, match="closed without a graph"):
        g.graph
    with pytest.raises(BuilderClosedError, match="an exception ended it"):
        g.device_buffer(N)


def test_buffer_of_another_builder():
    with GraphBuilder() as first:
        x = first.host_input("x", N)
        d = first.to_device(x)
        shared = first.external_buffer("shared", N)
        first.memset(shared, 0)
    second = GraphBuilder()
    with pytest.raises(BuilderClosedError, match=r"Memset memset:d_x#0: buffer d_x#0 is allocated"
                                                 r" by another GraphBuilder \(closed\)"):
        second.memset(d, 0)
    third = GraphBuilder()
    mine = third.device_buffer(N)          # buf#0 of `third`, equal as a record to `fourth`'s
    fourth = GraphBuilder()
    with pytest.raises(BufferLifetimeError, match=r"allocated by another GraphBuilder "
                                                  r"\(still open\).*external_buffer\(\)") as info:
        fourth.memset(mine, 0)
    _is(info.value, BufferLifetimeError, GraphError, ValueError)
    theirs = fourth.device_buffer(N)
    assert theirs == mine and theirs is not mine
    fourth.memset(theirs, 0)               # its own equal record is fine
    second.memset(shared, 1)               # external buffers are bound per run: shareable
    assert [n.name for n in second.build().nodes] == ["memset:shared#0"]


def test_explicit_alloc_or_free_of_a_graph_allocation_is_refused():
    with GraphBuilder() as g:
        d = g.device_buffer(N)
        for rec in (Alloc("a", d), Free("f", d)):
            with pytest.raises(BufferLifetimeError, match=r"buffer buf#0 is allocated by the"
                               r" graph itself \(alloc:buf#0 before its first use, free:buf#0"
                               r" after its last\): drop this node") as info:
                g.add(rec)
            _is(info.value, BufferLifetimeError, GraphError, ValueError)
        g.memset(d, 0)


def test_name_collisions():
    with GraphBuilder() as g:
        x = g.host_buffer("x", N)  # no node reads it in the end: a host_input would be refused
        g.memset(g.external_buffer("e", N), 0, name="step")
        with pytest.raises(NameCollisionError, match="a node named 'step' is already in") as info:
            g.memset(Buffer("e", N), 0, name="step")
        _is(info.value, NameCollisionError, GraphError, ValueError)
        with pytest.raises(NameCollisionError, match="buffer name 'x' is already taken"):
            g.host_output("x", N)
        with pytest.raises(NameCollisionError, match="buffer name 'x' is already taken"):
            g.device_buffer(N, name="x")
        with pytest.raises(NameCollisionError, match=r"buffer name 'e' already names"):
            g.memset(Buffer("e", 2 * N), 0)      # another record under a taken name
        with pytest.raises(NameCollisionError, match=r"buffer name 'x' already names"):
            g.memset(Buffer("x", N), 0)          # a device buffer named like a host buffer
        with pytest.raises(NameCollisionError, match="already in the graph"):
            g.device_buffer(N, alloc_name="step")
        with pytest.raises(GraphError, match="lists itself in after="):
            g.to_device(x, name="me", after="me")
        with pytest.raises(NodeFieldTypeError, match=r"after\[0\] must be a node name, a node,"
                                                     r" or a buffer this builder allocates"):
            g.to_device(x, after=[x])
    assert [n.name for n in g.graph.nodes] == ["step"]


def test_plain_taskgraph_names_collisions_the_same_way():
    t = TaskGraph()
    t.add(Memset("m", Buffer("b", N), 0))
    with pytest.raises(NameCollisionError, match="a node named 'm' is already in the graph"):
        t.add(Memset("m", Buffer("b", N), 0))
    with pytest.raises(NameCollisionError, match="buffer name 'b' already names"):
        t.add(Memset("n", Buffer("b", 2 * N), 0))


def test_host_roles_and_lost_writes():
    g = GraphBuilder()
    x = g.host_input("x", N)
    y = g.host_output("y", 2 * N)
    d = g.to_device(x)
    with pytest.raises(HostBufferUseError, match=r"DeviceToHost d2h:x#0 writes x\[0:4096\], but x"
                                                 r" is a host input") as info:
        g.to_host(d, x)
    _is(info.value, HostBufferUseError, GraphError, ValueError)
    g.to_host(d, y.range(0, N))
    g.to_host(d, y.range(N, N))                  # another range: fine
    with pytest.raises(HostBufferUseError, match=r"d2h:y#2 writes host buffer y bytes \[2048,"
                                                 r" 4096\), which d2h:y#0 wrote and no node has"
                                                 r" read since"):
        g.to_host(d.range(0, N // 2), y.range(N // 2, N // 2))
    g.host_func(lambda: None, reads=y.range(0, 16))   # a reader in between clears that write
    g.to_host(d, y.range(0, N))
    h = g.host_buffer("slot", N)
    g.host_func(lambda: None, writes=h)
    g.host_func(lambda: None, reads=h, writes=h)      # reads first, then writes: fine
    with pytest.raises(HostBufferUseError, match="host:lambda#3 writes host buffer slot bytes \\[8, 16\\), which host:lambda#2"):
        g.host_func(lambda: None, writes=h.range(8, 8))
    g.build()


def test_unwritten_host_output_is_refused_at_close_and_the_builder_stays_open():
    g = GraphBuilder()
    g.host_output("result", N)
    g.host_output("other", N)
    with pytest.raises(HostBufferUseError, match=r"host output\(s\) result, other: no node writes"
                                                 r" them"):
        g.build()
    assert not g.closed
    d = g.device_buffer(N)
    g.memset(d, 0)
    g.to_host(d, HostBuffer("result", N))
    g.to_host(d, g._buffers["other"])
    assert len(g.build()) == 5


def test_unread_host_input_is_refused_at_close_and_the_builder_stays_open():
    g = GraphBuilder()
    x = g.host_input("x", N)
    y = g.host_input("y", N)
    z = g.host_input("z", N)
    out = g.host_output("out", N)
    d = g.to_device(x)                    # x is read
    with pytest.raises(HostBufferUseError):
        g.to_host(d, y)                   # refused (a write of an input): y is still unread
    g.to_host(d, out)
    with pytest.raises(HostBufferUseError) as info:
        g.build()
    assert str(info.value) == (
        "host input(s) y, z: declared with host_input() but no node reads them, so the array the"
        " caller binds would never reach the GPU (and a run would refuse the binding as"
        " unknown): read them (g.to_device(input), or a host_func with reads=), or remove the"
        " host_input() call")
    _is(info.value, HostBufferUseError, GraphError, ValueError)
    assert not g.closed and len(g.nodes) == 2  # unchanged, still open
    g.host_func(lambda: None, reads=y.range(0, 16))  # a host function reading part of y
    with pytest.raises(HostBufferUseError, match=r"^host input\(s\) z: declared with host_input\(\)"
                                                 r" but no node reads it, .*: read it "):
        g.build()
    g.to_device(HostBuffer("z", N))       # the same record made by hand is the same input
    graph = g.build()
    assert g.closed and {b.name for b in graph.host_buffers} == {"x", "y", "z", "out"}


def test_unread_host_input_in_a_with_block_fails_the_block():
    with pytest.raises(HostBufferUseError, match=r"host input\(s\) unused: declared"):
        with GraphBuilder() as g:
            g.host_input("unused", N)
            g.memset(g.device_buffer(N), 0)
    assert g.closed
    with pytest.raises(NotReadyError, match="closed without a graph"):
        g.graph


def test_overwrite_check_can_be_turned_off():
    with GraphBuilder(check_overwrites=False) as g:
        y = g.host_output("y", N)
        d = g.device_buffer(N)
        g.memset(d, 0)
        g.to_host(d, y)
        g.to_host(d, y)
    assert [n.kind for n in g.graph.nodes] == ["alloc", "memset", "d2h", "d2h", "free"]


def test_cycle_at_close_is_reported_and_the_builder_stays_open():
    g = GraphBuilder()
    d = g.device_buffer(N)
    g.memset(d, 0, name="first", after="second")
    g.memset(d, 1, name="second")
    with pytest.raises(GraphError, match="cycle: first -> second"):
        g.build()
    assert not g.closed
    g2 = GraphBuilder()
    g2.memset(g2.device_buffer(N), 0, after="nowhere")
    with pytest.raises(GraphError, match="after= names node.s. not in the graph: 'nowhere'"):
        g2.build()


def test_bad_fields_are_reported_under_the_generated_name():
    with GraphBuilder() as g:
        x = g.host_input("x", N)
        d = g.to_device(x)
        with pytest.raises(NodeFieldTypeError, match="KernelNode kernel:burn#0: argument 0 is host"
                                                     " buffer x"):
            g.kernel(BURN, 4, 256, (x,))
        with pytest.raises(NodeFieldTypeError, match="GraphBuilder.to_device: src must be a host"
                                                     " buffer"):
            g.to_device(d)
        with pytest.raises(NodeFieldTypeError, match="GraphBuilder.add takes a node record"):
            g.add("kernel")
        with pytest.raises(NodeFieldTypeError, match=r"GraphBuilder.batch: index must be an int"):
            g.batch("one").__enter__()
        g.memset(d, 0)


def test_batch_blocks_nest_and_restore():
    with GraphBuilder() as g:
        with g.batch(1):
            a = g.device_buffer(N)
            g.memset(a, 0)
            with g.batch(2):
                g.memset(a, 1)
            g.memset(a, 2, batch=7)
        g.memset(a, 3)
    assert [(n.name, n.batch) for n in g.graph.nodes] == [
        ("alloc:buf#0", 1), ("memset:buf#0", 1), ("memset:buf#1", 2), ("memset:buf#2", 7),
        ("memset:buf#3", None), ("free:buf#0", 1)]


# -- on the fake drivers: every executor unchanged ---------------------------------------------


def bound(batches):
    x = np.random.default_rng(7).random(batches * N // 4, dtype=np.float32)
    y = np.full(batches * N // 4, np.nan, np.float32)
    return {"x": x, "y": y}


def test_eager_run_on_the_fake_driver_traces_generated_names(monkeypatch):
    from orchestra.execute import EagerExecutor, KernelResolver
    from orchestra.trace import to_chrome_trace
    from tests.fake_cuda import FakeCuda, FakeKernel, patch_eager_tracer

    fake = FakeCuda(monkeypatch)
    patch_eager_tracer(monkeypatch)
    graph = pipeline(3, poison=False).build()
    arrays = bound(3)
    ex = EagerExecutor(kernel_resolver=KernelResolver(fake.device, lambda r, d: FakeKernel()))
    try:
        res = ex.run(graph, bindings=arrays, trace=True)
    finally:
        ex.close()
    np.testing.assert_array_equal(arrays["y"], burn_ref(arrays["x"]))
    assert fake.used == 0 and fake.counts["cuMemAllocFromPoolAsync"] == 6 \
        and fake.counts["cuMemFreeAsync"] == 6  # every graph allocation freed
    tl = res.timeline
    assert {s.name for s in tl.spans} == {n.name for n in graph.nodes}
    assert tl.span("kernel:burn#2").batch == 2 and tl.span("free:d_x#1").kind == "free"
    assert tl.span("h2d:x#0").nbytes == N
    trace = to_chrome_trace(tl)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert {e["name"] for e in events if e.get("ph") == "X"} == {n.name for n in graph.nodes}


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_cuda_graph_executors_on_the_fake_driver(monkeypatch, kind):
    from orchestra.execute.cuda_graph.build import GraphBuildExecutor
    from orchestra.execute.cuda_graph.capture import CaptureExecutor
    from tests import fake_graph_cuda as fg

    fake = fg.install(monkeypatch)
    cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
    graph = pipeline(3).build()
    arrays = bound(3)
    with cls(fake.device, kernel_resolver=fg.resolver(fake)) as ex:
        exe = ex.run(graph, None, arrays, policy="by-engine", streams=3)
        try:
            np.testing.assert_array_equal(arrays["y"], burn_ref(arrays["x"]))
            assert exe.node_count == len(graph)
            arrays["y"][:] = np.nan
            exe.replay()
            np.testing.assert_array_equal(arrays["y"], burn_ref(arrays["x"]))
        finally:
            exe.close()
    assert not fake.live_graphs


# -- the docs and the example ------------------------------------------------------------------


def doc_blocks(path: Path):
    """(language, code) of each fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


def test_building_md_examples_run_and_print_what_the_page_shows():
    blocks = doc_blocks(ROOT / "docs" / "building.md")
    ns: dict = {}
    ran = checked = 0
    for i, (lang, code) in enumerate(blocks):
        if lang != "python" or code.startswith(("# needs a GPU", "# signatures")):
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/building.md block {i}", "exec"), ns)
        ran += 1
        nxt = blocks[i + 1] if i + 1 < len(blocks) else ("", "")
        if nxt[0] == "text":
            assert out.getvalue() == nxt[1], f"block {i} printed something else"
            checked += 1
    assert ran == 3 and checked == 2
    # the GPU block at least compiles, and the signature block names real methods
    gpu = [c for lang, c in blocks if c.startswith("# needs a GPU")]
    assert len(gpu) == 1
    compile(gpu[0], "gpu block", "exec")
    sigs = next(c for lang, c in blocks if c.startswith("# signatures"))
    for method in re.findall(r"^g\.(\w+)\(", sigs, re.M):
        assert callable(getattr(GraphBuilder, method)), method


def test_the_example_builds_and_plans_without_a_gpu():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "build_graph.py"), "--plan",
                           "--batches", "3", "--n", "1024"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("plan (by-engine): 3 stream(s), 30 node(s)")
    for b in range(3):
        for name in (f"alloc:d_x#{b}", f"h2d:y#{b}", f"kernel:saxpy#{b}", f"d2h:out#{b}",
                     f"free:buf#{b}"):
            assert f"run    {name}\n" in text, name


def test_the_example_graph_verifies():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_graph", ROOT / "examples" / "build_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    graph = mod.build(1024, 5)
    assert len(graph) == 50 and len(graph.buffers) == 15
    for policy in POLICIES:
        for streams in (1, 2, 3, 4):
            assert verify(schedule(graph, policy, streams), graph) == []


def test_the_example_without_a_gpu_prints_one_line_and_exits_2():
    from orchestra.driver.check import device_available

    if device_available():
        pytest.skip("a GPU is present: the example runs instead")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "build_graph.py"), "--n",
                           "1024"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_graph: no CUDA device:")


def test_builders_in_threads_are_independent():
    from concurrent.futures import ThreadPoolExecutor

    serial = pipeline(30).build()
    with ThreadPoolExecutor(4) as pool:
        graphs = list(pool.map(lambda _: pipeline(30).build(), range(8)))
    for g in graphs:
        assert g.nodes == serial.nodes and g.edges == serial.edges


def test_lifetime_of_a_buffer_the_builder_does_not_allocate():
    with GraphBuilder() as g:
        e = g.external_buffer("e", N)
        g.memset(e, 0)
        for buf in (e, Buffer("buf#0", N), "buf#0"):
            with pytest.raises(BufferLifetimeError, match="is not a buffer this builder"
                                                          " allocates"):
                g.lifetime(buf)

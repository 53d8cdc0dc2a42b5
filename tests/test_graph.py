"""CPU tests of orchestra.graph: buffers, nodes, edge inference, cycles, the batch builder."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestra.errors import GraphError
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import (
    Access, Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostFunc, HostToDevice,
    In, InOut, KernelNode, KernelRef, Memset, Mode, Out, TaskGraph, add_batch, build_pipeline,
)

K = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)
K_ANY = KernelRef("extern \"C\" __global__ void k() {}", "k")


def kern(name, *args, **kw):
    return KernelNode(name, K_ANY, 1, 32, args, **kw)


# -- buffers and ranges ---------------------------------------------------------------------

def test_range_defaults_and_bounds():
    b = Buffer("x", 100)
    assert b.range() == b.whole and b.whole.nbytes == 100
    assert b.range(40).nbytes == 60 and b.range(40).end == 100
    with pytest.raises(GraphError, match="out of bounds of x"):
        b.range(90, 20)
    with pytest.raises(GraphError):
        b.range(-1, 4)
    with pytest.raises(GraphError, match="positive int"):
        Buffer("y", 0)


def test_overlap_is_per_buffer_and_byte_exact():
    a, b = Buffer("a", 64), Buffer("b", 64)
    assert a.range(0, 32).overlaps(a.range(31, 8))
    assert not a.range(0, 32).overlaps(a.range(32, 8))
    assert not a.range(0, 32).overlaps(b.range(0, 32))
    assert not Buffer("h", 64).whole.overlaps(HostBuffer("h", 64).whole)  # host vs device names


# -- nodes ----------------------------------------------------------------------------------

def test_copy_sizes_and_directions_are_checked():
    h, d = HostBuffer("h", 64), Buffer("d", 64)
    with pytest.raises(GraphError, match="sizes must match"):
        HostToDevice("up", h.range(0, 32), d)
    with pytest.raises(GraphError, match="src must be a host buffer"):
        HostToDevice("up", d, d)
    with pytest.raises(GraphError, match="dst must be a host buffer"):
        DeviceToHost("down", d, d)
    up = HostToDevice("up", h, d, batch=2)
    assert up.accesses() == (Access(h.whole, Mode.READ), Access(d.whole, Mode.WRITE))
    assert up.nbytes == 64 and up.batch == 2 and up.device == 0


def test_device_defaults_to_the_buffers_and_is_checked():
    d1 = Buffer("d1", 16, device=1)
    assert Alloc("a", d1).device == 1
    assert kern("k", In(d1)).device == 1
    with pytest.raises(GraphError, match="peer copy"):
        Alloc("a", d1, device=0)


def test_memset_validation():
    d = Buffer("d", 64)
    m = Memset("poison", d, 0x7FC00000, element_size=4)
    assert m.accesses() == (Access(d.whole, Mode.WRITE),)
    assert Memset("m", d, -1, element_size=2).unsigned_value == 0xFFFF
    with pytest.raises(GraphError, match="element_size"):
        Memset("m", d, 0, element_size=3)
    with pytest.raises(GraphError, match="whole number"):
        Memset("m", d.range(2, 8), 0, element_size=4)
    with pytest.raises(GraphError, match="fits"):
        Memset("m", d, 256, element_size=1)


def test_kernel_args_modes_and_const_params():
    x, y, z = Buffer("x", 64), Buffer("y", 64), Buffer("z", 64)
    # bare buffers: const T* -> READ, T* -> READ_WRITE; explicit wrappers win
    n = KernelNode("k", K, 1, 256, (x, y, 16, np.int32(3), np.float32(1.5), 0.5))
    assert [a.mode for a in n.accesses()] == [Mode.READ, Mode.READ_WRITE]
    n = KernelNode("k", K, 1, 256, (InOut(x), Out(y), 16, 3, 1.0, 0.5))
    assert [a.mode for a in n.accesses()] == [Mode.READ_WRITE, Mode.WRITE]
    n = KernelNode("k", K_ANY, 1, 256, (z, x.range(0, 8)))
    assert [a.mode for a in n.accesses()] == [Mode.READ_WRITE, Mode.READ_WRITE]
    assert n.grid == (1, 1, 1) and n.block == (256, 1, 1)
    with pytest.raises(GraphError, match="host buffer"):
        kern("k", HostBuffer("h", 8))
    with pytest.raises(GraphError, match="neither a scalar"):
        kern("k", "text")
    with pytest.raises(GraphError, match="grid"):
        KernelNode("k", K, 0, 256)


def test_const_parsing():
    from orchestra.graph.kernel_ref import pointee_is_const
    assert pointee_is_const("const float* __restrict__ x")
    assert pointee_is_const("float const *x")
    assert not pointee_is_const("float* const x")
    assert not pointee_is_const("float *x")
    assert pointee_is_const("size_t n") is None


def test_hostfunc_accesses():
    h, o = HostBuffer("h", 8), HostBuffer("o", 8)
    f = HostFunc("f", lambda: None, reads=[h], writes=[o.range(0, 4)])
    assert f.accesses() == (Access(h.whole, Mode.READ), Access(o.range(0, 4), Mode.WRITE))
    with pytest.raises(GraphError, match="callable"):
        HostFunc("f", None)


# -- edge inference -------------------------------------------------------------------------

def _edges(*nodes):
    g = TaskGraph()
    for n in nodes:
        g.add(n)
    return g, g.edges


def test_raw_war_waw():
    x = Buffer("x", 64)
    w1, r1, w2 = kern("w1", Out(x)), kern("r1", In(x)), kern("w2", Out(x))
    g, e = _edges(w1, r1, w2)
    assert ("w1", "r1") in e and g.edge_reason("w1", "r1") == "RAW x"
    assert ("r1", "w2") in e and g.edge_reason("r1", "w2") == "WAR x"
    assert ("w1", "w2") in e and g.edge_reason("w1", "w2") == "WAW x"


def test_reads_do_not_order_each_other():
    x = Buffer("x", 64)
    g, e = _edges(kern("w", Out(x)), kern("r1", In(x)), kern("r2", In(x)))
    assert e == {("w", "r1"), ("w", "r2")}


def test_disjoint_views_no_edge_overlapping_views_edge():
    x = Buffer("x", 64)
    g, e = _edges(kern("lo", Out(x.range(0, 32))), kern("hi", Out(x.range(32, 32))),
                  kern("mid", In(x.range(16, 32))))
    assert ("lo", "hi") not in e and ("hi", "lo") not in e
    assert {("lo", "mid"), ("hi", "mid")} <= e
    # a write that covers only part of a range keeps the older writer for the rest
    g, e = _edges(kern("all", Out(x)), kern("part", Out(x.range(0, 16))), kern("r", In(x.range(8, 16))))
    assert {("all", "part"), ("part", "r"), ("all", "r")} <= e


def test_host_buffers_are_tracked_too():
    h, d = HostBuffer("h", 64), Buffer("d", 64)
    fill = HostFunc("fill", lambda: None, writes=[h])
    g, e = _edges(Alloc("a", d), fill, HostToDevice("up", h, d),
                  HostFunc("refill", lambda: None, writes=[h]))
    assert ("fill", "up") in e and ("up", "refill") in e


def test_alloc_and_free_bracket_every_use():
    d = Buffer("d", 64)
    g, e = _edges(Alloc("a", d), kern("k1", Out(d.range(0, 32))), kern("k2", In(d.range(32, 32))),
                  Free("f", d))
    assert {("a", "k1"), ("a", "k2"), ("k1", "f"), ("k2", "f")} <= e


def test_self_access_no_self_edge():
    x = Buffer("x", 64)
    g, e = _edges(kern("k", In(x), Out(x)))
    assert e == set()


def test_duplicate_name_and_buffer_name_clash():
    g = TaskGraph()
    g.add(Alloc("a", Buffer("x", 8)))
    with pytest.raises(GraphError, match="already in the graph"):
        g.add(Alloc("a", Buffer("y", 8)))
    with pytest.raises(GraphError, match="already names"):
        g.add(Alloc("b", Buffer("x", 16)))


# -- after=, cycles, order ------------------------------------------------------------------

def test_after_edges_and_forward_references():
    g = TaskGraph()
    g.add(kern("a"))
    g.add(kern("b", after="a"))
    g.add(kern("c", after=("later",)))
    with pytest.raises(GraphError, match="'later'"):
        g.validate()
    g.add(kern("later"))
    assert ("a", "b") in g.edges and ("later", "c") in g.edges
    assert g.explicit_edges == {("a", "b"), ("later", "c")}
    assert g.topological_order() == ("a", "b", "later", "c")


def test_cycle_error_names_the_nodes():
    g = TaskGraph()
    g.add(kern("a", after="c"))
    g.add(kern("b", after="a"))
    g.add(kern("c", after="b"))
    g.add(kern("free_standing"))
    with pytest.raises(GraphError, match=r"cycle: a -> b -> c -> a"):
        g.validate()
    with pytest.raises(GraphError, match="cycle"):
        g.topological_order()


def test_cycle_through_inferred_edges():
    x = Buffer("x", 8)
    g = TaskGraph()
    g.add(kern("w", Out(x), after="r"))
    g.add(kern("r", In(x)))
    with pytest.raises(GraphError, match=r"cycle: (w -> r -> w|r -> w -> r)"):
        g.validate()


def test_topological_order_is_stable_and_levels():
    g = TaskGraph()
    for n in "abcd":
        g.add(kern(n))
    g.add(kern("e", after=("d", "a")))
    assert g.topological_order() == ("a", "b", "c", "d", "e")
    assert g.levels() == (("a", "b", "c", "d"), ("e",))
    assert g.predecessors("e") == ("a", "d") and g.successors("a") == ("e",)


def test_reduced_edges():
    x = Buffer("x", 8)
    g = TaskGraph()
    g.add(kern("w1", Out(x)))
    g.add(kern("w2", InOut(x)))
    g.add(kern("w3", InOut(x), after="w1"))
    assert ("w1", "w3") in g.edges
    assert g.reduced_edges() == {("w1", "w2"), ("w2", "w3")}


# -- batch builder --------------------------------------------------------------------------

def test_add_batch_names_and_chain():
    g = TaskGraph()
    b = add_batch(g, index=3, kernel=K, nbytes=4096, scalars=(10, 1.0, 0.5))
    assert [n.name for n in b.nodes] == ["b3.alloc_in", "b3.alloc_out", "b3.h2d", "b3.kernel",
                                         "b3.d2h", "b3.free_in", "b3.free_out"]
    assert b.input.name == "b3.in" and b.output.name == "b3.out" and b.host_in.buffer.name == "b3.host_in"
    assert b.kernel.args[2:] == (1024, 10, 1.0, 0.5) and b.kernel.grid == (4, 1, 1)
    assert all(n.batch == 3 for n in b.nodes)
    e = g.reduced_edges()
    assert {("b3.alloc_in", "b3.h2d"), ("b3.h2d", "b3.kernel"), ("b3.alloc_out", "b3.kernel"),
            ("b3.kernel", "b3.d2h"), ("b3.kernel", "b3.free_in"), ("b3.d2h", "b3.free_out")} == e


def test_add_batch_in_place_and_custom_layout():
    g = TaskGraph()
    b = add_batch(g, index=0, kernel=K_ANY, nbytes=64, in_place=True,
                  arg_layout=lambda i, o, n, s: (InOut(o), n))
    assert b.input is b.output and b.alloc_out is None and len(b.nodes) == 5
    with pytest.raises(GraphError, match="whole number"):
        add_batch(g, index=1, kernel=K, nbytes=63)


def test_build_pipeline_shared_host_buffers_have_no_cross_batch_edges():
    hin, hout = HostBuffer("input", 3 * 64 + 32), HostBuffer("output", 3 * 64 + 32)
    g, batches = build_pipeline(4, [64, 64, 64, 32], K, host_in=hin, host_out=hout,
                                scalars=(1, 1.0, 0.0))
    assert len(g) == 28 and len(batches) == 4
    assert batches[3].host_in == hin.range(192, 32)
    batch_of = {n.name: n.batch for n in g.nodes}
    assert all(batch_of[p] == batch_of[s] for p, s in g.edges)
    with pytest.raises(GraphError, match="at least"):
        build_pipeline(4, 64, K, host_in=HostBuffer("small", 64))


def test_graph_and_schedule_import_no_cuda():
    code = ("import sys, orchestra.graph, orchestra.schedule; "
            "bad = sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("policy,streams", [("by-engine", 3), ("round-robin", 3),
                                            ("critical-path", 3), ("by-engine", 1)])
def test_in_flight_orders_each_allocation_after_the_frees_of_batch_b_minus_w(policy, streams):
    from orchestra.app.job.graphs import BURN_PARAMS
    from orchestra.graph import KernelRef, build_pipeline
    from orchestra.schedule import schedule, verify
    from orchestra.schedule.happens_before import PlanOrder

    burn = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)
    graph, batches = build_pipeline(12, 4096, burn, scalars=(3, 0.5, 1.0), in_flight=4)
    plan = schedule(graph, policy=policy, streams=streams)
    assert verify(plan, graph) == []
    order = PlanOrder(plan)
    for b in range(4, 12):
        for alloc in (batches[b].alloc_in, batches[b].alloc_out):
            for free in (batches[b - 4].free_in, batches[b - 4].free_out):
                assert order.before(free.name, alloc.name)
    if policy == "by-engine" and streams == 3:
        # the bound is exact: batch b's allocations need not wait for batch b - 3
        assert not order.before(batches[1].free_out.name, batches[4].alloc_in.name)


def test_in_flight_must_be_positive():
    from orchestra.app.job.graphs import BURN_PARAMS
    from orchestra.graph import KernelRef, build_pipeline

    with pytest.raises(GraphError, match="in_flight"):
        build_pipeline(3, 4096, KernelRef("x.cu", "burn", params=BURN_PARAMS), in_flight=0)


# -- edge inference: the segment-map tracker against references ------------------------------

class _IntervalListTracker:
    """The tracker before segment maps (plain interval lists, scanned linearly): the oracle for
    the exact result, the order of the returned dict included."""

    def __init__(self):
        self._writers, self._readers = {}, {}

    @staticmethod
    def _carve(intervals, start, end):
        kept = []
        for s, e, node in intervals:
            if e <= start or s >= end:
                kept.append((s, e, node))
                continue
            if s < start:
                kept.append((s, start, node))
            if e > end:
                kept.append((end, e, node))
        return kept

    def access(self, node, accesses):
        deps = {}
        for acc in accesses:
            r = acc.range
            key, s, e = r.buffer.key, r.offset, r.end
            for ws, we, w in self._writers.get(key, []):
                if ws < e and s < we and w != node:
                    deps.setdefault(w, ("WAW " if acc.mode.writes else "RAW ") + r.buffer.name)
            if acc.mode.writes:
                for rs, re_, rd in self._readers.get(key, []):
                    if rs < e and s < re_ and rd != node:
                        deps.setdefault(rd, "WAR " + r.buffer.name)
        for acc in accesses:
            key = acc.range.buffer.key
            if acc.mode.writes:
                self._writers[key] = self._carve(self._writers.get(key, []), acc.range.offset, acc.range.end)
                self._readers[key] = self._carve(self._readers.get(key, []), acc.range.offset, acc.range.end)
        for acc in accesses:
            target = self._writers if acc.mode.writes else self._readers
            target.setdefault(acc.range.buffer.key, []).append((acc.range.offset, acc.range.end, node))
        return deps


def _brute_force_deps(program):
    """{node: {earlier node: reason}} by the definition, byte by byte: B waits for an earlier A
    when both touch a byte, one of them writes it, and no node between them writes that byte
    (that node already waits for A, and B for it). The reason comes from B's first access (in
    declaration order) that finds A: RAW/WAW when A was the last writer of one of its bytes,
    else WAR when it writes a byte A read (a READ access) since that byte's last write."""
    def touched(accs, key, x, writes):
        return any(a.range.buffer.key == key and a.range.offset <= x < a.range.end
                   and a.mode.writes == writes for a in accs)

    out = {}
    for bi, (b, baccs) in enumerate(program):
        deps = {}
        for acc in baccs:
            key, name = acc.range.buffer.key, acc.range.buffer.name
            xs = range(acc.range.offset, acc.range.end)

            def unshadowed(ai, x):
                return not any(touched(c, key, x, True) for _, c in program[ai + 1:bi])

            for ai, (a, aaccs) in enumerate(program[:bi]):
                if any(touched(aaccs, key, x, True) and unshadowed(ai, x) for x in xs):
                    deps.setdefault(a, ("WAW " if acc.mode.writes else "RAW ") + name)
            if acc.mode.writes:
                for ai, (a, aaccs) in enumerate(program[:bi]):
                    if any(touched(aaccs, key, x, False) and unshadowed(ai, x) for x in xs):
                        deps.setdefault(a, "WAR " + name)
        out[b] = deps
    return out


# one host and two device buffers; the host one shares a device buffer's name (keys differ)
_TRACKED = (Buffer("x", 24), Buffer("y", 16), HostBuffer("x", 24))


@st.composite
def _programs(draw):
    program = []
    for i in range(draw(st.integers(1, 12))):
        accs = []
        for _ in range(draw(st.integers(1, 3))):
            buf = draw(st.sampled_from(_TRACKED))
            off = draw(st.integers(0, buf.nbytes - 1))
            size = draw(st.integers(1, buf.nbytes - off))
            accs.append(Access(buf.range(off, size), draw(st.sampled_from(list(Mode)))))
        program.append((f"n{i}", tuple(accs)))
    return program


@settings(max_examples=400, deadline=None)
@given(program=_programs())
def test_tracker_edges_match_brute_force_and_the_interval_lists(program):
    from orchestra.graph import RangeTracker

    new, old = RangeTracker(), _IntervalListTracker()
    got = {}
    for node, accs in program:
        deps = new.access(node, accs)
        assert list(deps.items()) == list(old.access(node, accs).items())  # same order too
        got[node] = deps
    assert got == _brute_force_deps(program)


def test_tracker_edges_of_a_shared_host_buffer_pipeline_are_unchanged():
    from orchestra.graph import RangeTracker

    hin, hout = HostBuffer("input", 40 * 64), HostBuffer("output", 40 * 64)
    g, _ = build_pipeline(40, [64] * 39 + [32], K, host_in=hin, host_out=hout,
                          scalars=(1, 1.0, 0.0), in_flight=3)
    old, new = _IntervalListTracker(), RangeTracker()
    for node in g.nodes:
        accs = node.accesses()
        deps = old.access(node.name, accs)
        assert new.access(node.name, accs) == deps
        inferred = {p for p in g.predecessors(node.name) if (p, node.name) not in g.explicit_edges}
        assert inferred == set(deps)
        assert all(g.edge_reason(p, node.name) == r for p, r in deps.items())


def test_tracker_is_near_linear_on_disjoint_ranges_of_one_buffer():
    # the interval lists scanned every earlier range: ~2e8 steps here (tens of seconds)
    import time

    from orchestra.graph import RangeTracker

    n = 20_000
    h = HostBuffer("h", 64 * n)
    tr = RangeTracker()
    t0 = time.perf_counter()
    for i in range(n):
        r = h.range(64 * i, 64)
        assert tr.access(f"w{i}", (Access(r, Mode.WRITE),)) == {}
        assert tr.access(f"r{i}", (Access(r, Mode.READ),)) == {f"w{i}": "RAW h"}
    assert time.perf_counter() - t0 < 5.0
    everything = tr.access("all", (Access(h.whole, Mode.WRITE),))
    assert len(everything) == 2 * n and everything["r0"] == "WAR h" and everything["w0"] == "WAW h"

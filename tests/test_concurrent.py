"""CPU tests of the ``concurrent`` policy (orchestra.schedule.concurrent) and of the executors
filling its resident capacity from kernel occupancy (orchestra.execute.occupancy).

The policy must put independent kernels that do not fill the GPU on separate compute streams,
keep kernels that fill it together, stay hazard-free (the verifier passes) and join streams
only where the graph does (one wait per cross-stream edge of the reduced graph)."""

import pytest

from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import (
    Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostToDevice, In, KernelNode, KernelRef, Out,
    TaskGraph, build_pipeline,
)
from orchestra.schedule import schedule, verify
from orchestra.schedule.concurrent import capacity_of, fills_gpu, grid_blocks

K = KernelRef("k.cu", "k")
CAP = 100  # resident blocks of every kernel in these tests


def kern(name, grid, *args):
    return KernelNode(name, K, grid, 128, args)


def fan_out(width=4, grid=8):
    """src -> width independent kernels -> join, all device buffers (one piece, no batches)."""
    g = TaskGraph()
    x = Buffer("x", 64)
    ys = [Buffer(f"y{i}", 64) for i in range(width)]
    z = Buffer("z", 64)
    g.add(kern("src", grid, Out(x)))
    for i in range(width):
        g.add(kern(f"k{i}", grid, In(x), Out(ys[i])))
    g.add(kern("join", grid, *[In(y) for y in ys], Out(z)))
    return g


def caps(graph, value=CAP):
    return {n.name: value for n in graph.nodes if n.kind == "kernel"}


def compute_streams(plan):
    return [s.name for s in plan.streams if s.role == "compute"]


def test_independent_small_kernels_go_on_separate_compute_streams():
    g = fan_out(4, grid=8)
    plan = schedule(g, "concurrent", 6, resident_blocks=caps(g))
    assert compute_streams(plan) == ["compute0", "compute1", "compute2", "compute3"]
    lanes = [plan.stream_of(f"k{i}") for i in range(4)]
    assert sorted(lanes) == ["compute0", "compute1", "compute2", "compute3"]
    # the first one continues the source's stream: no event for it
    assert plan.stream_of("src") == plan.stream_of("k0") == "compute0"
    assert verify(plan, g) == []
    # events only where streams meet: k1..k3 wait for src, join waits for the three others
    assert plan.wait_count == 6 and plan.event_count == 4
    assert plan.meta["small_kernels"] == 6


def test_kernels_that_fill_the_gpu_stay_together():
    g = fan_out(4, grid=CAP)  # grid == capacity: every SM busy
    plan = schedule(g, "concurrent", 6, resident_blocks=caps(g))
    assert {plan.stream_of(n.name) for n in g.nodes} == {"compute0"}
    assert plan.wait_count == 0 and plan.event_count == 0
    assert plan.meta["small_kernels"] == 0
    assert verify(plan, g) == []


def test_without_capacity_every_kernel_counts_as_filling_the_gpu():
    g = fan_out(4, grid=1)
    plan = schedule(g, "concurrent", 6)
    assert {plan.stream_of(n.name) for n in g.nodes} == {"compute0"}
    # a capacity for some kernels only: the others stay with their predecessor
    part = {"k1": CAP, "k2": CAP}
    plan = schedule(g, "concurrent", 6, resident_blocks=part)
    assert plan.stream_of("k1") != plan.stream_of("k2")
    assert plan.stream_of("k0") == plan.stream_of("k3") == plan.stream_of("src")
    assert verify(plan, g) == []


def test_a_diamond_runs_its_two_sides_at_once():
    g = TaskGraph()
    x, a, b, z = (Buffer(n, 64) for n in ("x", "a", "b", "z"))
    g.add(kern("top", 4, Out(x)))
    g.add(kern("left", 4, In(x), Out(a)))
    g.add(kern("right", 4, In(x), Out(b)))
    g.add(kern("bottom", 4, In(a), In(b), Out(z)))
    plan = schedule(g, "concurrent", 4, resident_blocks=caps(g))
    assert plan.stream_of("left") != plan.stream_of("right")
    assert plan.stream_of("top") == plan.stream_of("left")
    assert plan.wait_count == 2 and verify(plan, g) == []


def test_mixed_large_and_small_kernels():
    # a large kernel, then a fan-out of small ones, then a large join
    g = TaskGraph()
    x = Buffer("x", 64)
    ys = [Buffer(f"y{i}", 64) for i in range(3)]
    g.add(kern("big0", 500, Out(x)))
    for i in range(3):
        g.add(kern(f"s{i}", 10, In(x), Out(ys[i])))
    g.add(kern("big1", 500, *[In(y) for y in ys], Out(Buffer("z", 64))))
    plan = schedule(g, "concurrent", 5, resident_blocks=caps(g))
    assert len({plan.stream_of(f"s{i}") for i in range(3)}) == 3
    assert plan.stream_of("big0") == "compute0"
    assert verify(plan, g) == []


def test_three_streams_have_one_compute_stream():
    g = fan_out(4, grid=8)
    plan = schedule(g, "concurrent", 3, resident_blocks=caps(g))
    assert compute_streams(plan) == ["compute"]
    assert plan.wait_count == 0 and verify(plan, g) == []
    assert schedule(g, "concurrent", 1, resident_blocks=caps(g)).stream_names == ("main",)


def test_copies_go_where_by_engine_puts_them_and_small_batches_overlap():
    g, _ = build_pipeline(6, 4096, KernelRef("k.cu", "burn", params=BURN_PARAMS), grid=4,
                          scalars=(10, 1.0, 0.5))
    plan = schedule(g, "concurrent", 5, resident_blocks=caps(g))
    for b in range(6):
        assert plan.stream_of(f"b{b}.h2d") == plan.stream_of(f"b{b}.alloc_in") == "upload"
        assert plan.stream_of(f"b{b}.d2h") == "download"
        assert plan.stream_of(f"b{b}.free_in") == plan.stream_of(f"b{b}.kernel")
    assert len({plan.stream_of(f"b{b}.kernel") for b in range(6)}) >= 2
    assert verify(plan, g) == []


def test_host_and_memory_nodes_around_small_kernels():
    g = TaskGraph()
    h = HostBuffer("h", 256)
    x = Buffer("x", 256)
    outs = [Buffer(f"o{i}", 64) for i in range(4)]
    g.add(Alloc("alloc", x))
    g.add(HostToDevice("up", h, x))
    for i, o in enumerate(outs):
        g.add(Alloc(f"alloc{i}", o))
        g.add(kern(f"k{i}", 2, In(x.range(64 * i, 64)), Out(o)))
        g.add(DeviceToHost(f"down{i}", o, h.range(64 * i, 64)))
        g.add(Free(f"free{i}", o))
    g.add(Free("free", x))
    plan = schedule(g, "concurrent", 6, resident_blocks=caps(g))
    assert len({plan.stream_of(f"k{i}") for i in range(4)}) == 4
    assert verify(plan, g) == []


def test_capacity_helpers():
    node = kern("k", (4, 2, 3))
    assert grid_blocks(node) == 24
    assert capacity_of(node, None) is None
    assert capacity_of(node, {"k": 30}) == 30 and not fills_gpu(node, {"k": 30})
    assert fills_gpu(node, {"k": 24}) and fills_gpu(node, {})
    assert capacity_of(node, lambda n: 7 * 2) == 14
    with pytest.raises(ValueError, match="must be >= 0"):
        capacity_of(node, {"k": -1})


def test_plan_json_round_trip_keeps_the_policy():
    from orchestra.schedule import Plan

    g = fan_out(3, grid=2)
    plan = schedule(g, "concurrent", 5, resident_blocks=caps(g))
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.policy == "concurrent"


# -- the executors fill the capacity from occupancy ------------------------------------------

class _OccupancyKernel:
    def __init__(self, base, per_sm):
        self._base, self.per_sm, self.calls = base, per_sm, []

    def __getattr__(self, name):
        return getattr(self._base, name)

    def occupancy(self, block, shared_mem=0):
        self.calls.append((block, shared_mem))
        return self.per_sm


def test_eager_executor_fills_resident_blocks_from_occupancy(monkeypatch):
    from orchestra.execute import EagerExecutor, KernelResolver
    from orchestra.execute.occupancy import resident_blocks
    from tests.fake_cuda import FakeCuda, FakeKernel

    fake = FakeCuda(monkeypatch)
    made = []

    def loader(ref, dev):
        made.append(_OccupancyKernel(FakeKernel(), per_sm=2))
        return made[-1]

    resolver = KernelResolver(fake.device, loader)
    sm = fake.device.sm_count
    g = fan_out(4, grid=2 * sm - 1)  # one block short of the 2 blocks/SM capacity
    assert resident_blocks(g, resolver, fake.device) == {n: 2 * sm for n in
                                                         ("src", "k0", "k1", "k2", "k3", "join")}
    assert made[0].calls[0] == ((128, 1, 1), 0)
    ex = EagerExecutor(kernel_resolver=resolver)
    try:
        plan = ex.plan_for(g, "concurrent", 6)
        assert len({plan.stream_of(f"k{i}") for i in range(4)}) == 4
        assert ex.plan_for(g, "concurrent", 6) is plan  # cached: occupancy asked once
        calls = len(made[0].calls)
        ex.plan_for(g, "concurrent", 6)
        assert len(made[0].calls) == calls
        # by-engine never asks
        ex.plan_for(g, "by-engine", 6)
        assert len(made[0].calls) == calls
        g2 = fan_out(4, grid=2 * sm)  # fills the GPU
        plan2 = ex.plan_for(g2, "concurrent", 6)
        assert {plan2.stream_of(f"k{i}") for i in range(4)} == {"compute0"}
    finally:
        ex.close()


def test_kernels_without_occupancy_count_as_filling(monkeypatch):
    from orchestra.execute import KernelResolver
    from orchestra.execute.occupancy import capacity_for, resident_blocks
    from tests.fake_cuda import FakeCuda, FakeKernel

    fake = FakeCuda(monkeypatch)
    resolver = KernelResolver(fake.device, lambda ref, d: FakeKernel())
    assert resident_blocks(fan_out(2), resolver, fake.device) == {}
    assert capacity_for("by-engine", resolver, fake.device) is None
    assert capacity_for("concurrent", resolver, fake.device)(fan_out(2)) == {}

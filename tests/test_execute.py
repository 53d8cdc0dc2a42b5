"""orchestra.execute without a GPU: binding validation, kernel argument resolution, plan checks,
event-handle reuse, host-function trampolines, and the eager executor end to end on a fake
driver (tests/fake_cuda.py) whose "device memory" is host memory, so outputs are checked
against numpy exactly as on the GPU."""

import ctypes
import gc

import numpy as np
import pytest

from orchestra.errors import CudaError, GraphError, HazardError
from orchestra.execute import (
    BindingError,
    BindingSpec,
    EagerExecutor,
    HostCallbacks,
    HostFunctionError,
    KernelResolver,
    PageableMemoryError,
    PinnedCheck,
    PlanMismatchError,
    assign_event_slots,
    check_run,
    make_executor,
    resolve_kernel_node,
)
from orchestra.execute.errors import ExecutorUnavailable
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
    build_pipeline,
)
from orchestra.schedule import POLICIES, PlanBuilder, RecordEvent, RunNode, WaitEvent, schedule
from tests.fake_cuda import FakeCuda, FakeKernel, patch_eager_tracer

K = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)
ITERS = 3


def burn_ref(x, iters=ITERS):
    v = x.astype(np.float32).copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


@pytest.fixture
def fake(monkeypatch):
    """The fake driver API, installed as the process's for the test; every array counts as
    pinned."""
    return FakeCuda(monkeypatch)


@pytest.fixture
def pinned(fake):
    """The address of every array the (fake) driver was asked "is it pinned?" about."""
    return fake.pinned_asked


def executor(fake, **kw):
    return EagerExecutor(kernel_resolver=KernelResolver(fake.device, lambda ref, d: FakeKernel()),
                         **kw)


def pipeline(sizes, *, block=256):
    """A job-like pipeline over one host_in / host_out buffer, and matching bound arrays."""
    total = sum(sizes)
    hin, hout = HostBuffer("host_in", total), HostBuffer("host_out", total)
    g, batches = build_pipeline(len(sizes), list(sizes), K, host_in=hin, host_out=hout,
                                block=block, scalars=(ITERS, 0.5, 1.0))
    x = np.random.default_rng(1).random(total // 4, dtype=np.float32)
    y = np.full(total // 4, np.nan, np.float32)
    return g, {"host_in": x, "host_out": y}


# -- bindings --------------------------------------------------------------------------------

def small_graph():
    g, _ = build_pipeline(2, 4096, K)
    return g


def test_bindings_missing_and_unknown_listed_together(pinned):
    spec = BindingSpec(small_graph())
    a = np.zeros(1024, np.float32)
    with pytest.raises(BindingError) as info:
        spec.resolve({"b0.host_in": a, "nope": a, "b0.in": a})
    msg = str(info.value)
    assert "unbound: b0.host_out (host buffer, 4096 bytes), b1.host_in" in msg
    assert "not buffers of the graph: 'nope'" in msg
    assert "allocated by the graph's own Alloc nodes" in msg and "'b0.in'" in msg
    assert isinstance(info.value, ValueError)


def test_bindings_wrong_size_names_both(pinned):
    spec = BindingSpec(small_graph())
    good = {n: np.zeros(1024, np.float32) for n in spec.host}
    good["b1.host_out"] = np.zeros(1000, np.float32)
    with pytest.raises(BindingError, match=r"b1.host_out: the array has 4000 bytes .* host buffer "
                                           r"b1.host_out has 4096 bytes"):
        spec.resolve(good)


def test_bindings_non_contiguous_and_readonly_and_type(pinned):
    spec = BindingSpec(small_graph())
    arrays = {n: np.zeros(1024, np.float32) for n in spec.host}
    arrays["b0.host_in"] = np.zeros(2048, np.float32)[::2]
    with pytest.raises(BindingError, match="not C-contiguous.*PinnedBuffer.empty"):
        spec.resolve(arrays)
    arrays["b0.host_in"] = np.zeros(1024, np.float32)
    ro = np.zeros(1024, np.float32)
    ro.flags.writeable = False
    arrays["b0.host_out"] = ro
    with pytest.raises(BindingError, match="read-only, but node b0.d2h writes it"):
        spec.resolve(arrays)
    arrays["b0.host_out"] = ro.copy()
    ro_in = np.zeros(1024, np.float32)
    ro_in.flags.writeable = False  # a read-only *source* is fine
    arrays["b0.host_in"] = ro_in
    spec.resolve(arrays)
    arrays["b0.host_in"] = [0.0] * 1024
    with pytest.raises(BindingError, match="expected a pinned numpy array"):
        spec.resolve(arrays)
    with pytest.raises(BindingError, match="must be a mapping"):
        spec.resolve([1, 2])


def test_bindings_pageable_is_a_type_error_that_says_how_to_pin(monkeypatch):
    FakeCuda(monkeypatch, pinned=False)
    spec = BindingSpec(small_graph())
    arrays = {n: np.zeros(1024, np.float32) for n in spec.host}
    with pytest.raises(PageableMemoryError) as info:
        spec.resolve(arrays)
    assert isinstance(info.value, TypeError)
    msg = str(info.value)
    assert "pageable memory" in msg
    assert "PinnedBuffer.empty(shape, dtype).array" in msg and "register_host(array)" in msg


def test_pinned_check_asks_the_driver_once_per_array(monkeypatch, pinned):
    check = PinnedCheck()
    a = np.zeros(4096, np.uint8)
    for _ in range(1000):
        assert check(a)
        assert check(a[:100])  # a view of it: same owner, different range: asked once more
    assert check.driver_queries == 2 and len(pinned) == 2
    b = np.zeros(4096, np.uint8)
    assert check(b) and check.driver_queries == 3


def test_pinned_check_forgets_a_freed_owner(monkeypatch):
    answers = iter([True, False])
    FakeCuda(monkeypatch, pinned=lambda a: next(answers))
    check = PinnedCheck()
    a = np.zeros(4096, np.uint8)
    assert check(a) and check(a) and check.driver_queries == 1  # remembered while a lives
    del a
    gc.collect()
    b = np.zeros(4096, np.uint8)  # may sit where a was
    # the answer died with its owner: b is asked about (and is not pinned)
    assert not check(b) and check.driver_queries == 2


def test_pinned_check_uses_the_registry_without_driver_queries(monkeypatch):
    from orchestra.driver import pinned_ranges

    FakeCuda(monkeypatch, pinned=lambda a: pytest.fail("driver asked"))
    a = np.zeros(8192, np.uint8)
    reg = pinned_ranges()
    reg.add(a.ctypes.data, a.nbytes)
    try:
        check = PinnedCheck()
        assert check(a) and check(a[100:200]) and check.driver_queries == 0
    finally:
        reg.discard(a.ctypes.data)
    assert not reg.covers(a.ctypes.data, a.ctypes.data + 1)


def test_pinned_ranges_registry():
    from orchestra.driver import PinnedRanges

    r = PinnedRanges()
    r.add(1000, 100)
    r.add(5000, 10)
    assert r.covers(1000, 1100) and r.covers(1050, 1060) and r.covers(5000, 5010)
    assert not r.covers(999, 1001) and not r.covers(1050, 1101) and not r.covers(2000, 2001)
    assert not r.covers(0, 1)
    assert r.version == 0  # adding never unpins: version unchanged
    r.discard(1000)
    assert not r.covers(1000, 1001) and len(r) == 1
    assert r.version == 1
    r.discard(1000)  # twice is fine
    assert r.version == 1


def test_external_device_buffers(pinned):
    g = TaskGraph()
    ext = Buffer("ext", 4096)
    g.add(Memset("m", ext, 0))
    spec = BindingSpec(g)
    assert list(spec.external) == ["ext"]
    with pytest.raises(BindingError, match=r"unbound: ext \(external device buffer, 4096 bytes\)"):
        spec.resolve({})

    class Dev:
        def __init__(self, ptr, nbytes):
            self.ptr, self.nbytes = ptr, nbytes
    with pytest.raises(BindingError, match="has 100 bytes but buffer ext needs 4096"):
        spec.resolve({"ext": Dev(1 << 20, 100)})
    with pytest.raises(BindingError, match="needs a DeviceBuffer"):
        spec.resolve({"ext": np.zeros(4096, np.uint8)})
    assert spec.resolve({"ext": Dev(1 << 20, 8192)}).address("ext") == 1 << 20


# -- kernel arguments ------------------------------------------------------------------------

def test_resolve_kernel_node_packs_scalars_and_records_pointer_fields():
    x, y = Buffer("x", 4096), Buffer("y", 8192)
    node = KernelNode("k", K, 4, 256, (In(x), Out(y.range(4096, 4096)), 1024, 7, 0.5, 1.0))
    ka = resolve_kernel_node(node, FakeKernel())
    assert [(p.index, p.buffer, p.offset) for p in ka.pointers] == [(0, "x", 0), (1, "y", 4096)]
    assert ka.packed.values()[2:] == (1024, 7, 0.5, 1.0)
    ka.bind({"x": 0x1000, "y": 0x20000})
    assert ka.packed.values()[:2] == (0x1000, 0x20000 + 4096)
    assert not ka.needs_ex and ka.config.grid == (4, 1, 1)


def test_resolve_kernel_node_refusals_name_the_node_and_parameter():
    x, y = Buffer("x", 4096), Buffer("y", 4096)
    fk = FakeKernel()
    bad_int = KernelNode("k1", K, 1, 256, (In(x), Out(y), 1024, 2**31, 0.5, 1.0))
    with pytest.raises(ValueError, match=r"kernel node k1: parameter iters \(int\): 2147483648 "
                                         r"does not fit in int32"):
        resolve_kernel_node(bad_int, fk)
    float_for_int = KernelNode("k2", K, 1, 256, (In(x), Out(y), 1024, 1.5, 0.5, 1.0))
    with pytest.raises(TypeError, match="kernel node k2: parameter iters.*float"):
        resolve_kernel_node(float_for_int, fk)
    missing = KernelNode("k3", K, 1, 256, (In(x), Out(y), 1024, 3, 0.5))
    with pytest.raises(TypeError, match="kernel node k3: kernel burn.*takes 6 arguments, got 5"):
        resolve_kernel_node(missing, fk)
    buf_for_scalar = KernelNode("k4", K, 1, 256, (In(x), Out(y), In(x), 3, 0.5, 1.0))
    with pytest.raises(TypeError, match="argument 2 is buffer x but parameter n is a scalar"):
        resolve_kernel_node(buf_for_scalar, fk)
    int_for_ptr = KernelNode("k5", K, 1, 256, (12345, Out(y), 1024, 3, 0.5, 1.0))
    with pytest.raises(TypeError, match="parameter x .* is a pointer; pass a graph buffer"):
        resolve_kernel_node(int_for_ptr, fk)
    # a block past CUDA's own 1024 threads is refused when the node is made; what depends on
    # the device (here its shared memory) is refused when the launch is resolved
    with pytest.raises(ValueError, match="KernelNode k6: block x = 2048 is above CUDA's limit"):
        KernelNode("k6", K, 1, 2048, (In(x), Out(y), 1024, 3, 0.5, 1.0))
    too_big = KernelNode("k6", K, 1, 256, (In(x), Out(y), 1024, 3, 0.5, 1.0),
                         shared_mem=227 * 1024 + 1)
    with pytest.raises(ValueError, match="kernel node k6: launch of burn: shared memory .* "
                                         "opt-in limit"):
        resolve_kernel_node(too_big, fk)
    attr = KernelNode("k7", K, 1, 256, (In(x), Out(y), 1024, 3, 0.5, 1.0),
                      attributes={"warp_speed": 9})
    with pytest.raises(ValueError, match="unknown launch attribute 'warp_speed'"):
        resolve_kernel_node(attr, fk)


def test_kernel_resolver_memoizes_and_notes_the_node():
    loads = []

    def loader(ref, dev):
        loads.append(ref)
        if ref.name == "missing":
            raise KeyError("no kernel named 'missing'")
        return FakeKernel()
    r = KernelResolver("dev", loader)
    assert r.resolve(K) is r.resolve(K) and len(loads) == 1 and len(r) == 1
    with pytest.raises(KeyError) as info:
        r.resolve(KernelRef("cuda_src/burn.cu", "missing"), node="b0.kernel")
    assert "kernel node b0.kernel" in "".join(info.value.__notes__)


# -- plan checks and event slots -------------------------------------------------------------

def test_check_run_structure_errors_even_without_verify():
    g = small_graph()
    plan = schedule(g, "round-robin", 1)
    steps = [st for st in plan.steps["s0"] if st.node != "b1.free_out"]
    broken = type(plan)(plan.streams, {"s0": steps})
    with pytest.raises(PlanMismatchError, match="never run: b1.free_out"):
        check_run(broken, g, verify=False)
    extra = type(plan)(plan.streams, {"s0": list(plan.steps["s0"]) + [RunNode("ghost")]})
    with pytest.raises(PlanMismatchError, match="not in the graph: ghost"):
        check_run(extra, g, verify=False)


def test_check_run_refuses_use_issued_before_alloc():
    g = TaskGraph()
    b, h = Buffer("b", 64), HostBuffer("h", 64)
    g.add(Alloc("a", b))
    g.add(HostToDevice("up", h, b))
    g.add(Free("f", b))
    plan = PlanBuilder().stream("s").run("up", "a", "f").build()
    with pytest.raises(HazardError):
        check_run(plan, g)
    with pytest.raises(PlanMismatchError, match="node up .* issued before its Alloc"):
        check_run(plan, g, verify=False)


def test_check_run_graph_errors_first():
    g = TaskGraph()
    b = Buffer("b", 64)
    g.add(Memset("m", b, 0, after=("later",)))
    with pytest.raises(GraphError, match="after= names node"):
        check_run(PlanBuilder().stream("s").run("m").build(), g)


def test_event_slots_reuse_handles_once_all_waits_are_issued():
    g, _ = build_pipeline(64, 4096, K)
    plan = schedule(g, "by-engine", 3)
    issue = plan.issue_order()
    slots, count = assign_event_slots(issue)
    assert plan.event_count == 128
    assert count == 8  # min_handles distinct handles, then reused oldest first
    assert assign_event_slots(issue, min_handles=1)[1] == 1
    # every wait uses the slot its event was last recorded into, and that slot was not
    # re-recorded in between (in issue order)
    last = {}
    for i, (_, st) in enumerate(issue):
        if isinstance(st, RecordEvent):
            last[slots[i]] = st.event
        elif isinstance(st, WaitEvent):
            assert last[slots[i]] == st.event


def test_event_slots_skip_waits_for_unrecorded_events():
    issue = [("a", WaitEvent("ghost")), ("a", RecordEvent("e")), ("b", WaitEvent("e"))]
    slots, count = assign_event_slots(issue)
    assert slots == {1: 0, 2: 0} and count == 1


# -- host callbacks --------------------------------------------------------------------------

def test_host_callbacks_trampoline_and_errors():
    cb = HostCallbacks()
    seen = []
    t1 = cb.add(lambda: seen.append(1), "n1")
    t2 = cb.add(lambda: 1 / 0, "n2")
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(cb.address)
    fn(t1)
    fn(t2)
    fn(12345)
    assert seen == [1]
    errs = cb.take_errors()
    assert [e[0] for e in errs] == ["n2", "?"] and isinstance(errs[0][1], ZeroDivisionError)
    assert cb.take_errors() == []
    cb.remove(t1)
    assert len(cb) == 1


# -- the eager executor on the fake driver ---------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_eager_outputs_match_numpy(fake, policy, streams):
    sizes = [4 * 1000, 4 * 777, 4 * 1000, 4 * 13]  # not multiples of the block, ragged last
    g, b = pipeline(sizes)
    with executor(fake) as ex:
        res = ex.run(g, bindings=b, policy=policy, streams=streams)
    np.testing.assert_array_equal(b["host_out"], burn_ref(b["host_in"]))
    assert fake.used == 0 and not fake.mem
    assert res.nodes == len(g) and res.wall_ms is not None and res.enqueue_us > 0
    assert res.steps == len(fake.driver_calls())  # one driver call per step
    assert res.policy == policy


def test_eager_enqueues_in_issue_order_with_one_call_per_step(fake):
    g, b = pipeline([4096] * 5)
    ex = executor(fake)
    plan = schedule(g, "by-engine", 3)
    ex.run(g, plan, b)
    kinds = {"alloc": "cuMemAllocFromPoolAsync", "free": "cuMemFreeAsync",
             "h2d": "cuMemcpyHtoDAsync", "d2h": "cuMemcpyDtoHAsync", "kernel": "cuLaunchKernel"}
    stream_of = {name: int(s.handle) for name, s in ex._prepared.values()[0].streams.items()}
    expected = []
    for sname, st in plan.issue_order():
        if isinstance(st, RunNode):
            expected.append((kinds[g.node(st.node).kind], stream_of[sname]))
        elif isinstance(st, RecordEvent):
            expected.append(("cuEventRecord", stream_of[sname]))
        else:
            expected.append(("cuStreamWaitEvent", stream_of[sname]))
    assert [(c[0], c[1]) for c in fake.driver_calls()] == expected
    assert len(set(stream_of.values())) == 3
    ex.close()


def test_eager_prepares_once_and_reuses_streams_and_events(fake):
    g, b = pipeline([4096] * 8)
    ex = executor(fake)
    plan = ex.prepare(g, policy="by-engine", streams=3)
    first = ex.run(g, plan, b)
    assert first.prepare_ms == 0.0  # prepared above
    prep = ex._prepared.values()[0]
    steps = list(prep.steps)
    n_streams, n_events = len(ex.streams), ex.event_count
    for _ in range(5):
        again = ex.run(g, plan, b)
        assert again.prepare_ms == 0.0
    assert ex._prepared.values()[0].steps == steps  # the same closures
    assert (len(ex.streams), ex.event_count) == (n_streams, n_events)
    assert ex.event_count <= 8 < plan.event_count
    # a second graph with another plan of the same shape reuses the pooled streams
    g2, b2 = pipeline([4096] * 3)
    ex.run(g2, bindings=b2, policy="round-robin", streams=3)
    assert len(ex.streams) == 3
    # plan=None is scheduled once per graph, not per run
    r1 = ex.run(g2, bindings=b2, policy="round-robin", streams=3)
    assert r1.prepare_ms == 0.0
    streams = ex.streams
    ex.close()
    assert streams and all(s.closed for s in streams) and ex.closed
    with pytest.raises(ValueError, match="closed"):
        ex.run(g, plan, b)


def test_eager_pool_usage_flat_over_many_runs(fake):
    g, b = pipeline([4096])
    ex = executor(fake)
    for _ in range(200):
        ex.run(g, bindings=b)
        assert fake.used == 0
    assert fake.counts["cuMemAllocFromPoolAsync"] == 400
    np.testing.assert_array_equal(b["host_out"], burn_ref(b["host_in"]))


def test_eager_error_mid_enqueue_frees_everything_and_names_the_node(fake):
    g, b = pipeline([4096] * 4)
    fake.fail["cuMemcpyHtoDAsync"] = 3  # the third batch's upload fails
    ex = executor(fake)
    with pytest.raises(CudaError) as info:
        ex.run(g, bindings=b, policy="by-engine", streams=3)
    err = info.value
    assert err.call == "cuMemcpyHtoDAsync" and err.name == "CUDA_ERROR_INVALID_VALUE"
    assert "node b2.h2d (h2d) on stream upload" in err.context
    assert fake.used == 0 and not fake.mem  # every allocation made so far was freed
    assert any(c[0] == "sync" for c in fake.log)
    # the executor still works afterwards
    del fake.fail["cuMemcpyHtoDAsync"]
    ex.run(g, bindings=b, policy="by-engine", streams=3)
    np.testing.assert_array_equal(b["host_out"], burn_ref(b["host_in"]))
    assert fake.used == 0


def test_eager_alloc_failure(fake):
    g, b = pipeline([4096] * 3)
    fake.fail["cuMemAllocFromPoolAsync"] = 4
    with pytest.raises(CudaError, match=r"cuMemAllocFromPoolAsync.*\[node b1.alloc_out"):
        executor(fake).run(g, bindings=b, policy="round-robin", streams=2)
    assert fake.used == 0


def test_eager_refuses_before_enqueueing_anything(fake):
    g, b = pipeline([4096] * 2)
    ex = executor(fake)
    fake.pinned = False
    with pytest.raises(PageableMemoryError):
        ex.run(g, bindings=b)
    with pytest.raises(BindingError):
        ex.run(g, bindings={"host_in": b["host_in"]})
    assert fake.driver_calls() == []


def test_eager_hazardous_hand_written_plan_is_refused(fake):
    g, b = pipeline([4096])
    # the kernel on another stream with no event after the upload: a RAW race
    plan = (PlanBuilder().stream("up").run("b0.alloc_in", "b0.alloc_out", "b0.h2d")
            .stream("k").run("b0.kernel").stream("up").run("b0.d2h", "b0.free_in", "b0.free_out")
            .build())
    with pytest.raises(HazardError, match="RAW"):
        executor(fake).run(g, plan, b)
    assert fake.driver_calls() == []
    # verify=False runs it (the fake runs in issue order, so it even gives the right answer)
    executor(fake, verify=False).run(g, plan, b)
    assert fake.used == 0


def test_eager_host_function_fills_a_host_buffer_before_the_upload(fake):
    """C07 on the fake: a host function writes a pinned host buffer, an H2D on the same stream
    copies it; the data copied is what the host function wrote."""
    n = 1024
    src = np.zeros(n, np.float32)
    out = np.full(n, np.nan, np.float32)
    h, ho, d = HostBuffer("h", 4 * n), HostBuffer("ho", 4 * n), Buffer("d", 4 * n)
    g = TaskGraph()
    g.add(HostFunc("fill", lambda: src.__setitem__(slice(None), np.arange(n)), writes=[h]))
    g.add(Alloc("a", d))
    g.add(HostToDevice("up", h, d))
    g.add(DeviceToHost("down", d, ho))
    g.add(Free("f", d))
    plan = schedule(g, "round-robin", 1)
    executor(fake).run(g, plan, {"h": src, "ho": out})
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32))
    names = [c[0] for c in fake.driver_calls()]
    assert names.index("cuLaunchHostFunc") < names.index("cuMemcpyHtoDAsync")


def test_eager_host_function_exception_names_the_node(fake):
    g = TaskGraph()
    h = HostBuffer("h", 64)
    g.add(HostFunc("ok", lambda: None, writes=[h]))
    g.add(HostFunc("boom", lambda: {}["x"], reads=[h]))
    ex = executor(fake)
    with pytest.raises(HostFunctionError, match="host function of node boom raised KeyError") as i:
        ex.run(g, bindings={"h": np.zeros(64, np.uint8)})
    assert i.value.node == "boom" and isinstance(i.value.__cause__, KeyError)
    # the next run is clean
    g2 = TaskGraph()
    g2.add(HostFunc("fine", lambda: None, writes=[h]))
    assert ex.run(g2, bindings={"h": np.zeros(64, np.uint8)}).nodes == 1


def test_eager_memset_and_external_buffer(fake):
    n = 256
    ext = Buffer("ext", 4 * n)
    hb = HostBuffer("out", 4 * n)
    g = TaskGraph()
    g.add(Memset("poison", ext, 0x7FC00000, element_size=4))
    g.add(Memset("half", ext.range(0, 2 * n), 0x3F80, element_size=2))
    g.add(DeviceToHost("down", ext, hb))
    backing = np.zeros(4 * n + 64, np.uint8)
    ptr = (backing.ctypes.data + 63) // 64 * 64
    fake.mem[ptr] = backing[ptr - backing.ctypes.data:][:4 * n]

    class Dev:
        nbytes = 4 * n

    dev = Dev()
    dev.ptr = ptr
    out = np.zeros(n, np.float32)
    executor(fake).run(g, bindings={"ext": dev, "out": out}, policy="round-robin", streams=1)
    assert np.isnan(out[n // 2:]).all()
    assert (out[:n // 2] == np.frombuffer(np.uint16([0x3F80, 0x3F80]).tobytes(), np.float32)[0]).all()
    assert [c[0] for c in fake.driver_calls()] == ["cuMemsetD32Async", "cuMemsetD16Async",
                                                   "cuMemcpyDtoHAsync"]


def test_eager_tracer_hooks(fake):
    g, b = pipeline([4096] * 2)
    calls = []

    class Tracer:
        def begin(self, streams, *, policy="", meta=None):
            calls.append(("begin", tuple(streams), policy))

        def before(self, stream, node):
            calls.append(("before", stream, node.name))

        def after(self, stream, node):
            calls.append(("after", stream, node.name))

        def finish(self):
            calls.append(("finish",))
            return "timeline"

        def abort(self):
            calls.append(("abort",))

    res = executor(fake).run(g, bindings=b, tracer=Tracer())
    assert res.timeline == "timeline"
    assert calls[0] == ("begin", ("upload", "compute", "download"), "by-engine")
    assert calls[-1] == ("finish",)
    befores = [c for c in calls if c[0] == "before"]
    assert len(befores) == len(g) and ("before", "compute", "b0.kernel") in befores
    # a failing run aborts the tracer
    calls.clear()
    fake.fail["cuLaunchKernel"] = fake.counts["cuLaunchKernel"] + 1
    with pytest.raises(CudaError):
        executor(fake).run(g, bindings=b, tracer=Tracer())
    assert calls[-1] == ("abort",)


def test_eager_trace_true_uses_the_executors_own_tracer(fake, monkeypatch):
    from orchestra.trace import Timeline

    made = patch_eager_tracer(monkeypatch)
    g, b = pipeline([4096] * 3)
    ex = executor(fake)
    untraced = ex.run(g, bindings=b)
    assert untraced.timeline is None and not ex._tracers  # no tracer until asked for
    res = ex.run(g, bindings=b, trace=True)
    tl = res.timeline
    assert isinstance(tl, Timeline) and len(tl) == len(g) == res.nodes
    assert tl.streams == ("upload", "compute", "download") and tl.executor == "eager"
    assert {s.name for s in tl.spans} == {n.name for n in g.nodes}
    assert all(s.end_ms > s.start_ms >= 0 for s in tl.spans)
    np.testing.assert_array_equal(b["host_out"], burn_ref(b["host_in"]))
    n_events = len(made)
    assert n_events == 2 * len(g) + 3
    tracer = ex.tracer
    assert len(ex.run(g, bindings=b, trace=True).timeline) == len(g)
    assert ex.tracer is tracer and len(made) == n_events  # kept and its events reused
    # an explicit tracer still wins, and the run's timeline is that tracer's
    class Mine:
        def begin(self, streams, *, policy="", meta=None):
            pass

        def before(self, stream, node):
            pass

        after = before

        def finish(self):
            return "mine"

        def abort(self):
            pass

    assert ex.run(g, bindings=b, tracer=Mine(), trace=True).timeline == "mine"
    # the executor's tracer serves one run at a time
    ex.run(g, bindings=b, trace=True, sync=False)
    with pytest.raises(RuntimeError, match="still pending"):
        ex.run(g, bindings=b, trace=True)
    assert len(ex.synchronize().timeline) == len(g)
    ex.close()
    assert all(e.closed for e in made)  # the tracer's timing events go with the executor


def test_eager_sync_false_then_synchronize(fake):
    g, b = pipeline([4096] * 2)
    ex = executor(fake)
    res = ex.run(g, bindings=b, sync=False)
    assert res.wall_ms is None and res.enqueue_us > 0
    done = ex.synchronize()
    assert done.wall_ms is not None and ex.synchronize() is None
    np.testing.assert_array_equal(b["host_out"], burn_ref(b["host_in"]))


def test_eager_refuses_nodes_on_another_device(fake):
    g = TaskGraph()
    g.add(Memset("m", Buffer("b", 64, device=1), 0))
    with pytest.raises(Exception, match="is on device 1, but this EagerExecutor runs on device 0"):
        executor(fake).run(g, bindings={"b": None})


def test_eager_graph_growth_invalidates_the_prepared_plan(fake):
    g, b = pipeline([4096])
    ex = executor(fake)
    ex.run(g, bindings=b)
    extra = HostBuffer("extra", 64)
    g.add(HostFunc("late", lambda: None, writes=[extra]))
    res = ex.run(g, bindings={**b, "extra": np.zeros(64, np.uint8)})
    assert res.nodes == 8 and res.prepare_ms > 0


def test_make_executor_names():
    from orchestra.execute import AVAILABLE_EXECUTORS, EXECUTORS

    assert AVAILABLE_EXECUTORS == EXECUTORS == ("eager", "capture", "graph")
    with pytest.raises(ExecutorUnavailable, match="unknown executor 'warp'"):
        make_executor("warp")

"""Copy kernels meet control flow, on the CPU: host copies lowered to the copy kernel inside
conditional bodies and child graphs (built, captured from a side stream, run eagerly), the eager
fast path running the host-driven equivalent of a conditional node on every run, replays that
re-point copy kernels at the top of a graph and refuse those inside a body, node enable /
disable of copy kernel nodes, and programmatic edges from a copy kernel into a PDL consumer.

The fake drivers (tests/fake_cuda.py, tests/fake_graph_cuda.py) run the copy kernel by name
(it moves the bytes between the fake device memory and the pinned host array) and run
conditional nodes the way the driver does, so outputs are checked against numpy references and
the node kinds against what the driver would report."""

from __future__ import annotations

import numpy as np
import pytest

from orchestra.execute import CopyPolicy, EagerExecutor
from orchestra.execute.cuda_graph.spec import translate
from orchestra.execute.errors import BindingError, ExecutorArgumentValueError
from orchestra.execute.lowering.copy import COPY_KERNEL_NAME, CopyKernelArgs
from orchestra.graph import (
    Alloc,
    Buffer,
    ChildGraph,
    Condition,
    DeviceToHost,
    Free,
    HostBuffer,
    HostToDevice,
    If,
    In,
    KernelNode,
    Memset,
    Out,
    TaskGraph,
    While,
)
from tests import fake_graph_cuda as fg
from tests.fake_cuda import FakeKernel, fake_kernel
from tests.graphs_for_tests import fake_drivers, fake_executor
from tests.test_control import ADD, BURN, KERNELS, SETTER, STEP, chain_reference

KINDS = ("eager", "capture", "graph-build")
N = 256  # floats per array: 1 KiB copies, below every default crossover


@pytest.fixture
def fakes(monkeypatch):
    """(eager fake, graph fake) on devices whose kernels address pinned host memory."""
    return fake_drivers(monkeypatch, kernel_host_access=True)


def executor(kind, fakes, **kw):
    """An executor on the fakes whose kernels are the copy kernel, burn and test_control's
    control kernels (set_cond, add_to, while_step)."""
    if kind == "eager":
        made = {name: FakeKernel(p, name, behave=b) for name, (p, b) in KERNELS.items()}
        return fake_executor(kind, fakes, eager_kernel=lambda r, d: made.get(r.name)
                             or fake_kernel(r, d), **kw)
    made = {name: fg.FakeGraphKernel(p, name, behave=b) for name, (p, b) in KERNELS.items()}
    return fake_executor(kind, fakes, eager_kernel=None, graph_kernels=made, **kw)


def copy_log(fakes, kind):
    return (fakes[0] if kind == "eager" else fakes[1]).copy_kernels


def top_graph(fake):
    return [g for g in fake.graphs.values() if g.instantiated][-1]


def staged_body(x, y, hin, hout, *, lowering="kernel"):
    """hin -> x (copy kernel), burn x -> y, y -> hout (copy kernel): a body that stages its own
    data through pinned host memory."""
    body = TaskGraph()
    body.add(HostToDevice("in_up", hin, x, lowering=lowering))
    body.add(KernelNode("in_burn", BURN, 1, 256, (In(x), Out(y), N, 3, 0.5, 1.0)))
    body.add(DeviceToHost("in_down", y, hout, lowering=lowering))
    return body


def child_copies_graph():
    """A child graph whose copies are copy kernels; the allocations outside it."""
    x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(ChildGraph("child", staged_body(x, y, HostBuffer("hin", 4 * N),
                                          HostBuffer("hout", 4 * N))))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    return g


def if_copies_graph():
    """choice -> src (top-level copy kernel); set(c, src, flag); IF c: the staged body (copy
    kernels inside), else: acc += 10; acc -> out."""
    src, fl, acc = Buffer("src", 4), Buffer("flag", 4), Buffer("acc", 4)
    x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
    c = Condition("c", flag=fl)
    otherwise = TaskGraph()
    otherwise.add(KernelNode("add10", ADD, 1, 1, (acc, 10)))
    g = TaskGraph()
    for b in (src, fl, acc, x, y):
        g.add(Alloc(f"a_{b.name}", b))
    g.add(HostToDevice("up", HostBuffer("choice", 4), src, lowering="kernel"))
    g.add(Memset("zero", acc, 0))
    g.add(KernelNode("set", SETTER, 1, 1, (c, In(src), Out(fl))))
    g.add(If("branch", c, staged_body(x, y, HostBuffer("hin", 4 * N),
                                      HostBuffer("hout", 4 * N)), otherwise))
    g.add(DeviceToHost("down", acc, HostBuffer("out", 4), lowering="kernel"))
    for b in (src, fl, acc, x, y):
        g.add(Free(f"f_{b.name}", b))
    return g


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return {"hin": rng.standard_normal(N).astype(np.float32),
            "hout": np.full(N, np.nan, np.float32)}


def run_once(ex, kind, g, bind):
    if kind == "eager":
        return ex.run(g, bindings=bind)
    exe = ex.run(g, None, bind)
    exe.close()
    return exe


# -- copy kernels inside bodies ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_copy_kernels_run_inside_a_child_graph_on_every_executor(fakes, kind):
    g = child_copies_graph()
    bind = inputs()
    with executor(kind, fakes) as ex:
        result = run_once(ex, kind, g, bind)
    np.testing.assert_array_equal(bind["hout"], chain_reference(bind["hin"], 3))
    # both body copies ran as the copy kernel, neither with the system fence (no host function)
    log = copy_log(fakes, kind)
    assert [(n, fence) for _, _, n, fence in log] == [(4 * N, 0), (4 * N, 0)]
    assert log[0][1] == bind["hin"].ctypes.data and log[1][0] == bind["hout"].ctypes.data
    assert result.copy_kernels == 2
    if kind != "eager":
        child = next(n for n in top_graph(fakes[1]).nodes if n.kind == "graph")
        assert [n.kind for n in child.params["graph"].nodes] == ["kernel"] * 3
        assert [n.params["kernel"].name for n in child.params["graph"].nodes] == [
            COPY_KERNEL_NAME, "burn", COPY_KERNEL_NAME]


@pytest.mark.parametrize("kind", KINDS)
def test_copy_kernels_inside_a_conditional_body_follow_the_branch(fakes, kind):
    g = if_copies_graph()
    with executor(kind, fakes) as ex:
        for choice in (1, 0, 1):
            bind = {**inputs(choice), "choice": np.array([choice], np.uint32),
                    "out": np.full(1, -1, np.int32)}
            before = len(copy_log(fakes, kind))
            run_once(ex, kind, g, bind)
            ran = copy_log(fakes, kind)[before:]
            if choice:  # the THEN body staged its data through its two copy kernels
                np.testing.assert_array_equal(bind["hout"], chain_reference(bind["hin"], 3))
                assert int(bind["out"][0]) == 0 and len(ran) == 4
            else:  # ELSE: the body's copy kernels did not run, hout is untouched
                assert np.isnan(bind["hout"]).all()
                assert int(bind["out"][0]) == 10 and len(ran) == 2
            assert {n for _, _, n, _ in ran} <= {4, 4 * N}
    if kind != "eager":
        top = top_graph(fakes[1])
        cond = next(n for n in top.nodes if n.kind == "conditional")
        then, otherwise = cond.params["bodies"]
        assert [n.kind for n in then.nodes] == ["kernel"] * 3
        assert [n.kind for n in otherwise.nodes] == ["kernel"]


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_the_records_of_body_copy_kernels_say_kernel(fakes, kind):
    with executor(kind, fakes) as ex:
        exe = ex.build(if_copies_graph(), bindings={
            **inputs(), "choice": np.array([1], np.uint32), "out": np.zeros(1, np.int32)})
        inner = exe._built.inner
        assert {n: (inner[n].kind, inner[n].container) for n in ("in_up", "in_down")} == {
            "in_up": ("kernel", "branch"), "in_down": ("kernel", "branch")}
        assert exe._built.records["up"].kind == "kernel"
        assert isinstance(exe._built.copies["in_up"], CopyKernelArgs)
        assert exe.copy_kernels == 4  # up, down and the body's two
        exe.close()


def test_a_captured_body_launches_its_copy_kernels_from_the_side_stream(fakes):
    """Under capture the body's copy kernels are launched on the side stream that captures
    into the child's embedded graph, never on a plan stream or the origin."""
    _, graph = fakes
    launched = []
    real = graph.cuLaunchKernel

    def spy(func, *args):
        launched.append((fg.FakeGraphKernel.registry[int(func)].name, int(args[7])))
        return real(func, *args)

    graph.cuLaunchKernel = spy
    with executor("capture", fakes) as ex:
        bind = inputs()
        exe = ex.build(child_copies_graph(), bindings=bind)
        side = {int(s.handle) for s in ex._stream_pool.sides}
        others = {int(s.handle) for s in ex.streams} - side
        assert [name for name, _ in launched] == [COPY_KERNEL_NAME, "burn", COPY_KERNEL_NAME]
        assert {h for _, h in launched} <= side and not {h for _, h in launched} & others
        exe.launch(sync=True)
        np.testing.assert_array_equal(bind["hout"], chain_reference(bind["hin"], 3))
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_auto_lowering_applies_inside_bodies_with_the_build_policy(fakes, kind):
    """No node asks: the build's policy decides for body copies as for the others (copy
    kernels for "kernel", memcpy nodes / cuMemcpy*Async for "copy-engine")."""
    for lowering, expect in (("kernel", 2), ("copy-engine", 0)):
        x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
        g = TaskGraph()
        g.add(Alloc("ax", x))
        g.add(Alloc("ay", y))
        g.add(ChildGraph("child", staged_body(x, y, HostBuffer("hin", 4 * N),
                                              HostBuffer("hout", 4 * N), lowering="auto")))
        g.add(Free("fx", x))
        g.add(Free("fy", y))
        bind = inputs()
        before = len(copy_log(fakes, kind))
        with executor(kind, fakes, copy_lowering=lowering) as ex:
            run_once(ex, kind, g, bind)
        np.testing.assert_array_equal(bind["hout"], chain_reference(bind["hin"], 3))
        assert len(copy_log(fakes, kind)) - before == expect
        if kind != "eager":
            child = next(n for n in top_graph(fakes[1]).nodes if n.kind == "graph")
            want = "kernel" if expect else "memcpy"
            assert [n.kind for n in child.params["graph"].nodes] == [want, "kernel", want]


# -- the eager fast path and conditional nodes ------------------------------------------------


def while_copies_graph(limit):
    """WHILE go (default 1): step (counter += 1, go = counter < limit), counter -> hlog (a copy
    kernel inside the body, every iteration); counter -> out after the loop."""
    counter, fl = Buffer("counter", 4), Buffer("flag", 4)
    go = Condition("go", default=1, flag=fl)
    body = TaskGraph()
    body.add(KernelNode("step", STEP, 1, 1, (go, counter, Out(fl), limit)))
    body.add(DeviceToHost("log", counter, HostBuffer("hlog", 4), lowering="kernel"))
    g = TaskGraph()
    g.add(Alloc("a_counter", counter))
    g.add(Alloc("a_flag", fl))
    g.add(Memset("zero", counter, 0))
    g.add(Memset("flag_on", fl, 1))
    g.add(While("loop", go, body))
    g.add(DeviceToHost("down", counter, HostBuffer("out", 4)))
    g.add(Free("f_counter", counter))
    g.add(Free("f_flag", fl))
    return g


def test_the_eager_fast_path_runs_the_host_driven_loop_on_every_run(fakes, monkeypatch):
    """Runs after the first take the fast path (the last prepared program, `_run_now`), which
    must still run the conditional node's host-driven loop: read the flag back, run the body,
    read again; a body copy kernel whose host array changed between runs writes the new one
    (the binding table re-points its packed host field)."""
    eager, _ = fakes
    fast = []
    real = EagerExecutor._run_now

    def spy(self, prep, prepare_ms):
        fast.append(prepare_ms)
        return real(self, prep, prepare_ms)

    monkeypatch.setattr(EagerExecutor, "_run_now", spy)
    g = while_copies_graph(5)
    logs = [np.full(1, -1, np.int32) for _ in range(3)]
    with executor("eager", fakes) as ex:
        for i, hlog in enumerate(logs):
            out = np.zeros(1, np.int32)
            reads0 = len(eager.calls("cuMemcpyDtoHAsync"))
            kernels0 = len(eager.copy_kernels)
            ex.run(g, bindings={"out": out, "hlog": hlog})
            assert int(out[0]) == 5 and int(hlog[0]) == 5
            # 5 body runs: a flag read after each (the first test is the default), + "down"
            assert len(eager.calls("cuMemcpyDtoHAsync")) - reads0 == 5 + 1
            assert [h for h, _, _, _ in eager.copy_kernels[kernels0:]] == \
                [hlog.ctypes.data] * 5
            assert all(int(x[0]) == -1 for x in logs[i + 1:])  # later arrays untouched
    assert len(fast) == 3 and fast[1:] == [0.0, 0.0]  # prepared once, then the shortcut


def test_eager_kernels_get_handle_zero_on_the_fast_path_too(fakes):
    """The eager executor has no graph, so kernels taking a condition get handle 0 (written
    once when the program is lowered; the fake refuses any set_conditional eagerly)."""
    eager, _ = fakes
    with executor("eager", fakes) as ex:
        for _ in range(3):
            out = np.zeros(1, np.int32)
            ex.run(while_copies_graph(3), bindings={"out": out,
                                                    "hlog": np.zeros(1, np.int32)})
            assert int(out[0]) == 3


# -- replays ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_replays_re_point_top_level_copy_kernels_and_refuse_body_ones(fakes, kind):
    _, graph = fakes
    bind = {**inputs(), "choice": np.array([1], np.uint32), "out": np.full(1, -1, np.int32)}
    with executor(kind, fakes) as ex:
        exe = ex.build(if_copies_graph(), bindings=bind)
        exe.launch(sync=True)
        np.testing.assert_array_equal(bind["hout"], chain_reference(bind["hin"], 3))
        before = graph.counts["cuGraphExecKernelNodeSetParams"]
        # the top-level upload is a copy kernel: re-pointed in place, one kernel SetParams
        out = np.full(1, -1, np.int32)
        exe.replay({"choice": np.array([0], np.uint32), "out": out})
        assert int(out[0]) == 10
        assert graph.counts["cuGraphExecKernelNodeSetParams"] - before == 2  # up, down
        assert not graph.counts["cuGraphExecMemcpyNodeSetParams"]
        # a host array of a copy kernel inside the IF body: refused by name, nothing applied
        calls = len(graph.log)
        with pytest.raises(BindingError, match="hin is used by node in_up inside the body of "
                                               "branch"):
            exe.replay({"hin": np.zeros(N, np.float32)})
        assert graph.log[calls:] == []
        exe.close()


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_a_body_copy_kernels_host_array_is_bound_by_a_whole_graph_update(fakes, kind):
    _, graph = fakes
    bind = inputs()
    with executor(kind, fakes) as ex:
        exe = ex.build(child_copies_graph(), bindings=bind)
        exe.launch(sync=True)
        np.testing.assert_array_equal(bind["hout"], chain_reference(bind["hin"], 3))
        fresh = inputs(7)
        with pytest.raises(BindingError, match="hout is used by node in_down inside the body "
                                               "of child"):
            exe.replay({"hout": fresh["hout"]})
        assert not graph.counts["cuGraphExecKernelNodeSetParams"]
        res = exe.update(child_copies_graph(), bindings=fresh)
        assert res.updated or res.reinstantiated
        exe.launch(sync=True)
        np.testing.assert_array_equal(fresh["hout"], chain_reference(fresh["hin"], 3))
        assert graph.copy_kernels[-2][1] == fresh["hin"].ctypes.data
        assert graph.copy_kernels[-1][0] == fresh["hout"].ctypes.data
        exe.close()


# -- node enable / disable --------------------------------------------------------------------


def optional_copy_graph(lowering):
    """up -> burn -> down (the copies lowered as asked); a child graph holding a copy."""
    x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
    body = TaskGraph()
    body.add(DeviceToHost("inner_copy", y, HostBuffer("hside", 4 * N), lowering=lowering))
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", 4 * N), x, lowering=lowering))
    g.add(KernelNode("burn", BURN, 1, 256, (In(x), Out(y), N, 1, 0.5, 1.0)))
    g.add(DeviceToHost("down", y, HostBuffer("hout", 4 * N), lowering=lowering))
    g.add(ChildGraph("child", body))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    return g


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
@pytest.mark.parametrize("lowering,node_kind", [("kernel", "kernel"),
                                                ("copy-engine", "memcpy")])
def test_a_copy_kernel_node_can_be_switched_off_and_on(fakes, kind, lowering, node_kind):
    _, graph = fakes
    x = np.arange(N, dtype=np.float32)
    out = np.full(N, np.nan, np.float32)
    with executor(kind, fakes) as ex:
        exe = ex.build(optional_copy_graph(lowering), bindings={
            "hin": x, "hout": out, "hside": np.zeros(N, np.float32)})
        assert exe._built.records["down"].kind == node_kind
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 1))
        out[:] = -1
        exe.disable("down")
        assert not exe.is_enabled("down")
        exe.launch(sync=True)
        assert (out == -1).all()  # the download was skipped
        copies = len(graph.copy_kernels)
        exe.enable("down")
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 1))
        assert len(graph.copy_kernels) - copies == (3 if lowering == "kernel" else 0)
        assert graph.counts["cuGraphInstantiate"] == 1
        assert graph.counts["cuGraphNodeSetEnabled"] == 2
        # a copy inside the child graph is refused by name before any call
        with pytest.raises(ExecutorArgumentValueError, match="node inner_copy is inside the "
                                                             "body of child"):
            exe.disable("up", "inner_copy")
        assert exe.is_enabled("up") and graph.counts["cuGraphNodeSetEnabled"] == 2
        exe.close()


# -- programmatic edges -----------------------------------------------------------------------


def pdl_after_copy():
    x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", 4 * N), x))
    g.add(KernelNode("burn", BURN, 1, 256, (In(x), Out(y), N, 1, 0.5, 1.0),
                     attributes={"pdl": True}))
    g.add(DeviceToHost("down", y, HostBuffer("hout", 4 * N)))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    return g


def test_a_copy_kernel_feeds_a_pdl_consumer_through_a_programmatic_edge():
    """A copy kernel is a kernel node: a PDL consumer after it gets a programmatic edge (as a
    capture of the two launches records); after a memcpy node it keeps a full edge."""
    g = pdl_after_copy()
    as_kernel = translate(g, copies=CopyPolicy("kernel"))
    as_memcpy = translate(g, copies=CopyPolicy("copy-engine"))
    assert as_kernel.node("up").kind == "kernel"
    assert as_kernel.node("burn").programmatic == ("up",)
    assert as_memcpy.node("up").kind == "memcpy"
    assert as_memcpy.node("burn").programmatic == ()
    assert as_kernel.topology() != as_memcpy.topology()


@pytest.mark.parametrize("lowering,expect", [("kernel", [COPY_KERNEL_NAME]),
                                             ("copy-engine", [])])
def test_graph_build_adds_the_programmatic_edge_from_the_copy_kernel(fakes, lowering, expect):
    _, graph = fakes
    x = np.arange(N, dtype=np.float32)
    out = np.zeros(N, np.float32)
    with executor("graph-build", fakes, copy_lowering=lowering) as ex:
        exe = ex.build(pdl_after_copy(), bindings={"hin": x, "hout": out})
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 1))
        nodes = {int(n.id): n for n in graph.graphs[int(exe.cugraph)].nodes}
        _, src, dst, data, _ = graph.cuGraphGetEdges(exe.cugraph, 64)
        prog = [nodes[int(a)].params["kernel"].name for a, b, e in zip(src, dst, data)
                if int(e.type) == fg.PROGRAMMATIC]
        assert prog == expect
        exe.close()

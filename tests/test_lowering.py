"""The executors' shared house, on the CPU: the lowering table (one entry per node kind, and
every executor lowers through it), the driver seam (one injectable `DriverAPI`), the binding
table (users, fast paths, what keeps bound memory alive) and `IdentityLRU`.

The executors run on the fake drivers of tests/fake_cuda.py (eager) and tests/fake_graph_cuda.py
(capture, graph-build), whose "device memory" is host memory, so outputs are checked against
numpy."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import re
import types
import weakref
from collections import Counter
from pathlib import Path
from typing import ClassVar

import attrs
import numpy as np
import pytest
from cuda.bindings import driver as _d

import orchestra
import orchestra.driver as od
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.driver import api as api_mod
from orchestra.driver import host as host_mod
from orchestra.driver import owner as owner_mod
from orchestra.driver.api import DriverAPI, default_api, use_api
from orchestra.driver.check import error_from_result
from orchestra.execute import (
    BindingTable,
    EagerExecutor,
    KernelResolver,
    NoLoweringError,
)
from orchestra.execute import bindings as bindings_mod
from orchestra.execute.cuda_graph.spec import translate
from orchestra.execute.lowering import LOWERINGS, Lowering, lowering_for, missing_lowerings, register
from orchestra.execute.lru import IdentityLRU
from orchestra.graph import (
    Access,
    Alloc,
    Buffer,
    BufferRange,
    DeviceToHost,
    Free,
    HostBuffer,
    HostToDevice,
    In,
    KernelNode,
    KernelRef,
    Memset,
    Mode,
    Node,
    Out,
    TaskGraph,
)
from orchestra.graph import nodes as nodes_mod
from orchestra.graph.buffers import as_range
from tests import fake_graph_cuda as fg
from tests.fake_pinned import Owned
from tests.fake_cuda import FakeCuda, FakeKernel
from tests.graphs_for_tests import burn_pipeline, burn_reference, check_burn_outputs, fake_executor

BURN = KernelRef("burn.cu", "burn", params=BURN_PARAMS)
N = 4096  # bytes per batch
KINDS = ("eager", "capture", "graph-build")


def concrete_node_classes() -> list[type]:
    """Every node class of `orchestra.graph.nodes` that a graph can hold: it names its own
    kind (the bases `Node` and the host-copy base do not)."""
    return [c for c in vars(nodes_mod).values()
            if isinstance(c, type) and issubclass(c, Node) and c is not Node
            and "kind" in c.__dict__]


def pipeline(batches=3, seed=0):
    return burn_pipeline(BURN, batches, N, seed=seed)


@pytest.fixture
def fakes(monkeypatch):
    """(eager fake, graph fake): the graph fake is the process's default driver API; every
    executor below is given its fake explicitly."""
    eager = FakeCuda()
    graph = fg.install(monkeypatch)
    return eager, graph


def executor(kind, fakes, **kw):
    return fake_executor(kind, fakes, eager_kernel=lambda r, d: FakeKernel(), **kw)


def run(ex, kind, g, bind, **kw):
    """One run of ``g``: the eager executor's ``run``, a graph executor's build + launch."""
    if kind == "eager":
        return ex.run(g, bindings=bind, **kw)
    exe = ex.run(g, None, bind, **kw)
    exe.close()
    return exe


# -- the table: one entry per node kind ------------------------------------------------------


def test_every_node_kind_has_a_lowering():
    classes = concrete_node_classes()
    assert {c.kind for c in classes} >= {"alloc", "free", "h2d", "d2h", "kernel", "memset",
                                         "host"}
    assert missing_lowerings(classes) == []
    for cls in classes:
        entry = LOWERINGS[cls]
        assert entry.node_type is cls and entry.kind == cls.kind
        assert entry.engine == cls.engine  # the scheduler's and the trace's engine
        assert entry.graph_node and entry.driver_node_type
        assert hasattr(_d.CUgraphNodeType, entry.driver_node_type)
        assert type(entry).stream is not Lowering.stream
        assert type(entry).graph is not Lowering.graph
    # what replays rewrite: the copies' CUDA_MEMCPY3D, the kernels' CUDA_KERNEL_NODE_PARAMS
    assert LOWERINGS[HostToDevice].replay_params == "CUDA_MEMCPY3D"
    assert LOWERINGS[DeviceToHost].replay_params == "CUDA_MEMCPY3D"
    assert LOWERINGS[KernelNode].replay_params == "CUDA_KERNEL_NODE_PARAMS"
    assert not LOWERINGS[nodes_mod.HostFunc].on_device  # host functions run on the host


@attrs.frozen
class Peer(Node):
    """A node kind with no lowering."""

    kind: ClassVar[str] = "peer"

    def accesses(self):
        return ()


def test_the_completeness_check_sees_a_kind_without_an_entry():
    assert missing_lowerings([Peer]) == [Peer]
    with pytest.raises(NoLoweringError, match="peer.*no entry in the lowering table"):
        lowering_for(Peer("p"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_kind_without_an_entry_is_refused_before_any_driver_call(fakes, kind):
    eager, graph = fakes
    g, bs, bind = pipeline(1)
    g.add(Peer("p"))
    with executor(kind, fakes) as ex:
        with pytest.raises(orchestra.GraphError, match="peer"):
            run(ex, kind, g, bind)
    assert eager.driver_calls() == []
    assert not {"cuGraphCreate", "cuStreamBeginCapture", "cuGraphInstantiate"} & set(graph.counts)


def test_the_translation_makes_no_driver_call():
    class Refusing:
        def __getattr__(self, name):
            raise AssertionError(f"translate called the driver: {name}")

    g, _, _ = pipeline(2)
    with use_api(Refusing()):
        spec = translate(g)
    assert [n.kind for n in spec.nodes].count("memcpy") == 4


# -- every executor lowers through the table --------------------------------------------------


class _Counting(Lowering):
    """Wraps an entry and counts the calls every executor makes of it."""

    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls
        self.node_type = inner.node_type
        self.graph_node = inner.graph_node
        self.driver_node_type = inner.driver_node_type
        self.on_device = inner.on_device

    def resolve(self, node, executor):
        self.calls["resolve", node.name] += 1
        return self.inner.resolve(node, executor)

    def stream(self, node, ctx, stream):
        self.calls["stream", ctx.executor_name, node.name] += 1
        return self.inner.stream(node, ctx, stream)

    def graph(self, node, ctx, deps):
        self.calls["graph", node.name] += 1
        return self.inner.graph(node, ctx, deps)


@pytest.mark.parametrize("kind", KINDS)
def test_every_executor_lowers_every_node_through_its_entry(fakes, kind, monkeypatch):
    calls: Counter = Counter()
    for cls, entry in list(LOWERINGS.items()):
        monkeypatch.setitem(LOWERINGS, cls, _Counting(entry, calls))
    g, bs, bind = pipeline(3)
    with executor(kind, fakes) as ex:
        run(ex, kind, g, bind)
    check_burn_outputs(bs, bind)
    names = [n.name for n in g.nodes]
    kernels = [n.name for n in g.nodes if isinstance(n, KernelNode)]
    assert {k[1] for k in calls if k[0] == "resolve"} == set(names)
    assert all(calls["resolve", n] == 1 for n in kernels)
    if kind == "graph-build":
        assert {k for k in calls if k[0] != "resolve"} == {("graph", n) for n in names}
    else:
        assert {k for k in calls if k[0] != "resolve"} == {("stream", kind, n) for n in names}
    assert all(v == 1 for k, v in calls.items() if k[0] != "resolve")


@attrs.frozen
class Fill(Node):
    """A node kind no executor knows: fill ``dst`` with the byte ``value``."""

    dst: BufferRange = attrs.field(converter=lambda r: as_range(r, "Fill dst"))
    value: int = 0
    kind: ClassVar[str] = "fill"

    def accesses(self):
        return (Access(self.dst, Mode.WRITE),)


class FillLowering(Lowering):
    """The whole of what a new kind needs: its stream step and its graph node."""

    node_type = Fill
    graph_node = "memset"
    driver_node_type = "CU_GRAPH_NODE_TYPE_MEMSET"

    def stream(self, node, ctx, stream):
        fn, sh, ptrs = ctx.api.cuMemsetD8Async, stream.handle, ctx.addresses.ptrs
        slot, off = ctx.addresses.device_slot(node.dst.buffer.name), node.dst.offset
        value, count = node.value, node.dst.nbytes

        def step():
            (err,) = fn(ptrs[slot] + off, value, count, sh)
            if err:
                raise error_from_result("cuMemsetD8Async", err)
        return step

    def graph(self, node, ctx, deps):
        p = _d.CUDA_MEMSET_NODE_PARAMS()
        p.dst = ctx.device_address(node.dst.buffer.name) + node.dst.offset
        p.value, p.elementSize, p.width, p.height, p.pitch = node.value, 1, node.dst.nbytes, 1, 0
        gnode = ctx.add("cuGraphAddMemsetNode", deps, p, ctx.context)
        return ctx.record(node, gnode, p)


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_node_kind_runs_on_every_executor_with_only_its_entry(fakes, kind, monkeypatch):
    """A kind defined here, registered here: no executor was changed for it."""
    monkeypatch.setitem(LOWERINGS, Fill, FillLowering())
    g = TaskGraph()
    x = Buffer("x", 256)
    g.add(Alloc("a", x))
    g.add(Fill("f", x.range(64, 128), 7))
    g.add(DeviceToHost("down", x.range(64, 128), HostBuffer("out", 128)))
    g.add(Free("free", x))
    out = np.zeros(128, np.uint8)
    with executor(kind, fakes) as ex:
        run(ex, kind, g, {"out": out})
    assert (out == 7).all()
    assert translate(g).node("f").kind == "memset"


@attrs.frozen
class Twice(Fill):
    kind: ClassVar[str] = "twice"


def test_register_is_the_decorator_entries_use(monkeypatch):
    node = Twice("t", Buffer("b", 8))
    with pytest.raises(NoLoweringError):
        lowering_for(node)
    monkeypatch.setitem(LOWERINGS, Fill, FillLowering())
    assert lowering_for(node) is LOWERINGS[Fill]  # no entry of its own: its base class's
    try:
        @register
        class TwiceLowering(FillLowering):
            node_type = Twice

        assert isinstance(lowering_for(node), TwiceLowering)
    finally:
        LOWERINGS.pop(Twice, None)


def test_no_executor_calls_the_bindings_module_directly():
    """Every driver call of the executors goes through their DriverAPI: no
    ``cuda.bindings.driver.cu*(...)`` call in orchestra.execute or in the capture session
    (cuda-bindings' types and enums are fine: they make no driver call)."""
    root = Path(orchestra.__file__).parent
    files = sorted((root / "execute").rglob("*.py")) + [root / "driver" / "capture.py"]
    call = re.compile(r"\b(?:_d|driver|drv|d)\.cu[A-Z]\w*\s*\(")
    offending = [f"{p.relative_to(root)}:{i}: {line.strip()}"
                 for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
                 if call.search(line)]
    assert offending == []


# -- the driver seam ------------------------------------------------------------------------


def test_driver_api_binds_each_function_once_and_names_what_is_missing():
    calls = []
    module = types.SimpleNamespace(cuFoo=lambda *a: calls.append(a) or (0,),
                                   __name__="stub")
    api = DriverAPI(module)
    assert api.cuFoo is module.cuFoo
    assert "cuFoo" in vars(api)  # bound: later reads are plain attribute reads
    api.cuFoo(1, 2)
    assert calls == [(1, 2)]
    with pytest.raises(AttributeError, match="no cuBar"):
        api.cuBar
    with pytest.raises(AttributeError):
        api.something_else
    assert "stub" in repr(api)


def test_use_api_swaps_the_default_for_a_block_only(monkeypatch):
    monkeypatch.setattr(api_mod, "_default", None)
    real = default_api()
    assert isinstance(real, DriverAPI) and default_api() is real
    fake = FakeCuda()
    with use_api(fake):
        assert default_api() is fake
    assert default_api() is real


def test_an_executor_uses_the_api_it_was_given_not_the_default(monkeypatch):
    class Refusing(FakeCuda):
        def __getattribute__(self, name):
            if name.startswith("cu"):
                raise AssertionError(f"the default API was called: {name}")
            return super().__getattribute__(name)

    Refusing().install(monkeypatch)
    mine = FakeCuda()
    g, bs, bind = pipeline(2)
    with EagerExecutor(mine.device, driver=mine,
                       kernel_resolver=KernelResolver(mine.device, lambda r, d: FakeKernel())) as ex:
        ex.run(g, bindings=bind)
    check_burn_outputs(bs, bind)
    assert mine.counts["cuLaunchKernel"] == 2


def test_the_eager_ex_launch_builds_its_config_once_per_node(fakes):
    """A kernel with launch attributes goes through cuLaunchKernelEx with a CUlaunchConfig
    made at prepare time (dims, stream, attributes), reused by every run."""
    eager, _ = fakes
    g = TaskGraph()
    x, y = Buffer("x", N), Buffer("y", N)
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", N), x))
    g.add(KernelNode("k", BURN, 4, 256, (In(x), Out(y), N // 4, 3, 0.5, 1.0),
                     attributes={"priority": -1}))
    g.add(DeviceToHost("down", y, HostBuffer("hout", N)))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    x_in = np.arange(N // 4, dtype=np.float32)
    y_out = np.zeros(N // 4, np.float32)
    with executor("eager", fakes) as ex:
        for _ in range(3):
            y_out[:] = np.nan
            ex.run(g, bindings={"hin": x_in, "hout": y_out})
            np.testing.assert_array_equal(y_out, burn_reference(x_in))
    configs = eager.launch_configs
    assert len(configs) == 3 and configs[0] is configs[1] is configs[2]
    assert configs[0].numAttrs == 1 and (configs[0].gridDimX, configs[0].blockDimX) == (4, 256)
    assert int(configs[0].attrs[0].value.priority) == -1


# -- the binding table ----------------------------------------------------------------------


class _FakeBuf:
    """An external device buffer in the graph fake's memory."""

    def __init__(self, fake, nbytes):
        self.ptr = fake._new_memory(nbytes, fake.mem)
        self.nbytes = nbytes
        self.device = 0


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_bindings_list_every_field_their_address_is_written_to(fakes, kind):
    """Host buffers and external device buffers alike: (record, struct, field, offset) per
    use, so a rebinding (or a re-pointed device buffer) rewrites exactly those fields."""
    _, graph = fakes
    n = N // 4
    g = TaskGraph()
    x, y = Buffer("x", N), Buffer("y", N)
    g.add(HostToDevice("up", HostBuffer("hin", N).range(0, N // 2), x.range(N // 2, N // 2)))
    g.add(Memset("zero", x.range(0, N // 2), 0))
    g.add(KernelNode("k", BURN, 4, 256, (In(x), Out(y), n, 3, 0.5, 1.0)))
    g.add(DeviceToHost("down", y, HostBuffer("hout", N)))
    xb, yb = _FakeBuf(graph, N), _FakeBuf(graph, N)
    hin = np.arange(n, dtype=np.float32)
    hout = np.zeros(n, np.float32)
    with executor(kind, fakes) as ex:
        exe = ex.run(g, None, {"x": xb, "y": yb, "hin": hin, "hout": hout})
        table = exe._table

        def uses(name):
            return sorted((u.record.name, u.field, u.offset) for u in table.get(name).users)

        assert uses("hin") == [("up", "srcHost", 0)]
        assert uses("hout") == [("down", "dstHost", 0)]
        assert uses("x") == [("k", "a0", 0), ("up", "dstDevice", N // 2), ("zero", "dst", 0)]
        assert uses("y") == [("down", "srcDevice", 0), ("k", "a1", 0)]
        for name, field in (("x", "dstDevice"), ("y", "srcDevice"), ("hin", "srcHost")):
            u = next(u for u in table.get(name).users if u.field == field)
            assert u.cell is not None  # written straight into the struct on a rebind
            assert int(getattr(u.params, field)) == table.get(name).address + u.offset
        kernel_user = next(u for u in table.get("x").users if u.record.name == "k")
        assert kernel_user.params is exe._kernels["k"].struct  # the packed argument struct
        assert kernel_user.record.kind == "kernel"
        # a cell over the packed pointer field too: the rebinding writes the struct's bytes
        struct = kernel_user.params
        assert ctypes.addressof(kernel_user.cell) == (ctypes.addressof(struct)
                                                      + type(struct).a0.offset)
        assert kernel_user.params.a0 == kernel_user.cell.value == xb.ptr
        assert table.get("x").value is xb and table.get("x").keep is xb  # no lease(): kept
        ref = burn_reference(np.concatenate([np.zeros(n // 2, np.float32), hin[:n // 2]]))
        np.testing.assert_array_equal(hout, ref)
        # the same external buffers again (what GraphRunner passes every run): no change
        launches = graph.counts["cuGraphLaunch"]
        exe.replay({"x": xb, "y": yb, "hin": hin, "hout": hout})
        assert graph.counts["cuGraphLaunch"] == launches + 1
        assert graph.counts["cuGraphExecMemcpyNodeSetParams"] == 0
        # another buffer for x: re-pointed in place, one SetParams per node it reaches, at
        # each use's byte offset (the kernel's pointer field in its packed struct too)
        x2 = _FakeBuf(graph, N)
        before = Counter(graph.counts)
        hout[:] = np.nan
        exe.replay({"x": x2})
        delta = graph.counts - before
        assert delta == Counter({"cuGraphExecKernelNodeSetParams": 1,
                                 "cuGraphExecMemcpyNodeSetParams": 1,
                                 "cuGraphExecMemsetNodeSetParams": 1, "cuGraphLaunch": 1})
        fe = graph.execs[int(exe.handle)]
        slot = {name: fe.slots[fe.index[int(r.gnode)]] for name, r in exe._records.items()}
        assert slot["up"]["dst"] == x2.ptr + N // 2 and slot["zero"]["dst"] == x2.ptr
        kernel_args = exe._kernels["k"].struct
        assert kernel_args.a0 == x2.ptr and kernel_args.a1 == yb.ptr
        np.testing.assert_array_equal(hout, ref)  # the same result, through the new buffer
        graph.mem[xb.ptr][:] = 0xDD  # the old buffer is no longer read
        hout[:] = np.nan
        exe.replay()
        np.testing.assert_array_equal(hout, ref)
        assert exe.device_bindings == {"x": x2, "y": yb} and exe.repoint_updates == 0
        exe.close()


def test_eager_runs_take_the_replay_fast_path(fakes, monkeypatch):
    """The very arrays bound before are not checked again; a pool of arrays bound in turn is
    checked once each; a pinned range removed makes everything be checked again."""
    calls = []
    real = bindings_mod.check_host_array
    monkeypatch.setattr(bindings_mod, "check_host_array",
                        lambda name, *a: (calls.append(name), real(name, *a))[1])
    g, bs, bind = pipeline(2)
    sets = [bind, {k: v.copy() for k, v in bind.items()}]
    with executor("eager", fakes) as ex:
        for i in range(6):
            ex.run(g, bindings=sets[i % 2])
            check_burn_outputs(bs, sets[i % 2])
        assert len(calls) == 2 * len(bind)
        host_mod.pinned_ranges().add(0x1000, 16)
        host_mod.pinned_ranges().discard(0x1000)
        ex.run(g, bindings=sets[0])
        assert len(calls) == 3 * len(bind)
        ro = sets[0][bs[0].host_out.buffer.name]
        ro.flags.writeable = False  # the same array, now read-only: refused, nothing enqueued
        launches = fakes[0].counts["cuLaunchKernel"]
        with pytest.raises(orchestra.execute.BindingError, match="read-only"):
            ex.run(g, bindings=sets[0])
        assert fakes[0].counts["cuLaunchKernel"] == launches


@pytest.fixture
def owned(monkeypatch):
    """Owned pinned arrays and device buffers whose leases and releases the tests count
    (`tests.fake_pinned`); at the end every one was released exactly once."""
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: True)
    o = Owned()
    yield o
    o.check_once()


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_an_exec_leases_bound_memory_until_no_launch_needs_it(fakes, kind, owned):
    """The exec leases the registration behind every bound array; a rebinding's old lease
    ends at the next synchronize (launches may read it until then), an update's old build's
    at the synchronize after it, everything at close; each release runs once."""
    g, bs, bind = pipeline(1)
    name = bs[0].host_in.buffer.name
    regs = owned.pin(bind)
    with executor(kind, fakes) as ex:
        exe = ex.build(g, None, bind)
        assert owned.leased() == sorted(r.name for r in regs.values())
        exe.launch()  # pending
        new = np.ones(N // 4, np.float32)
        (reg2,) = owned.pin({name: new}).values()
        exe.replay({name: new}, sync=False)
        assert regs[name].leases == 1 and reg2.leases == 1  # the old one: a launch may read it
        regs[name].close()  # no longer bound, but a launch may still read it
        assert owned.released[regs[name].name] == 0
        exe.synchronize()
        assert owned.released[regs[name].name] == 1 and reg2.leases == 1
        exe.update(g)  # a new build leases the same arrays; the old build's leases end at sync
        assert reg2.leases == 2
        exe.synchronize()
        assert reg2.leases == 1
        reg2.close()  # closed under the exec: kept until the exec closes
        assert owned.released[reg2.name] == 0
        exe.replay()
        check_burn_outputs(bs, {**bind, name: new})
        with pytest.raises(orchestra.execute.ClosedBindingError,
                           match=f"binding {name} .a {kind} GraphExec.: the HostRegistration"):
            exe.replay({name: new})  # bound again after the close: refused
        exe.close()
        assert owned.released[reg2.name] == 1 and owned.leased() == []


@pytest.mark.parametrize("kind", ["eager", "capture", "graph-build"])
def test_leases_kept_for_rebinding_are_bounded(fakes, kind, owned, monkeypatch):
    """A table keeps the leases of owners bound before (a staging pool bound in turn costs no
    new lease), but no more than HELD_MAX unused ones past a synchronize: many distinct
    owners bound in turn do not pile up."""
    monkeypatch.setattr(BindingTable, "HELD_MAX", 4)
    g, bs, bind = pipeline(1)
    name = bs[0].host_in.buffer.name
    owned.pin(bind)
    arrays = [np.ones(N // 4, np.float32) * i for i in range(12)]
    regs = [next(iter(owned.pin({name: a}).values())) for a in arrays]
    with executor(kind, fakes) as ex:
        exe = None if kind == "eager" else ex.build(g, None, bind)
        for a in arrays:
            if kind == "eager":
                ex.run(g, bindings={**bind, name: a})
            else:
                exe.replay({name: a})
            check_burn_outputs(bs, {**bind, name: a})
        leased = [r.leases for r in regs]
        assert leased[-1] == 1 and sum(leased) <= 4 + 2, leased  # bound + at most HELD_MAX
        if exe is not None:
            exe.close()
    assert sum(r.leases for r in regs) == 0


def test_an_eager_run_leases_bound_memory_until_queued_runs_are_done(fakes, owned):
    g, bs, bind = pipeline(1)
    other = {k: v.copy() for k, v in bind.items()}
    first, second = owned.pin(bind), owned.pin(other)
    with executor("eager", fakes) as ex:
        ex.run(g, bindings=bind, sync=False)
        assert owned.leased() == sorted(r.name for r in first.values())
        ex.run(g, bindings=other, sync=False)
        assert len(owned.leased()) == 2 * len(bind)  # the first set: its run is still queued
        ex.synchronize()
        # the first set is not bound now; its leases stay with the plan for a rebinding to
        # come, until their owners close them
        assert len(owned.leased()) == 2 * len(bind)
        ex.run(g, bindings=other, sync=False)  # the same arrays: nothing taken or released
        assert {r.leases for r in second.values()} == {1}
        ex.run(g, bindings=bind)
        assert {r.leases for r in first.values()} == {1}  # the same lease, bound again
        for r in second.values():  # unused now: released at the next synchronize
            r.close()
        assert all(owned.released[r.name] == 0 for r in second.values())
        ex.run(g, bindings=bind)
        assert all(owned.released[r.name] == 1 for r in second.values())
        other = {k: v.copy() for k, v in bind.items()}
        second = owned.pin(other)
        # an owner closed while bound: its memory goes at the next synchronize, binding the
        # closed array again is refused before anything is enqueued
        reg = first[bs[0].host_in.buffer.name]
        ex.run(g, bindings=bind, sync=False)
        reg.close()
        assert owned.released[reg.name] == 0  # a queued run reads it
        launches = fakes[0].counts["cuLaunchKernel"]
        with pytest.raises(orchestra.execute.ClosedBindingError,
                           match="the eager executor's run.: the HostRegistration bound to it "
                                 "is closed"):
            ex.run(g, bindings=bind)
        assert fakes[0].counts["cuLaunchKernel"] == launches
        ex.synchronize()
        assert owned.released[reg.name] == 1  # the queued run is done: the memory goes
        fakes[0].pinned = lambda a: a.ctypes.data != reg.array.ctypes.data  # unpinned now
        with pytest.raises(orchestra.execute.PageableMemoryError):
            ex.run(g, bindings=bind)
        ex.run(g, bindings=other)
        check_burn_outputs(bs, other)
    assert owned.leased() == []  # closed: after its last sync


# -- IdentityLRU --------------------------------------------------------------------------------


def test_identity_lru_keys_by_identity_and_evicts_least_recent():
    evicted = []
    lru = IdentityLRU(2, on_evict=evicted.append)
    a, b, c = [1], [1], [1]  # equal, not identical
    lru.put((a,), ("x",), "A")
    assert lru.get((b,), ("x",)) is None and lru.get((a,), ("y",)) is None
    assert lru.get((a,), ("x",)) == "A"
    lru.put((b,), ("x",), "B")
    lru.get((a,), ("x",))  # a is now the most recent
    lru.put((c,), ("x",), "C")
    assert evicted == ["B"] and len(lru) == 2 and lru.values() == ["A", "C"]
    value, made = lru.get_or_make((a,), ("x",), lambda: pytest.fail("cached"))
    assert (value, made) == ("A", False)
    value, made = lru.get_or_make((None,), (), lambda: "N")
    assert (value, made) == ("N", True) and lru.get((None,)) == "N"
    lru.clear()
    assert len(lru) == 0 and evicted == ["B", "C"]
    with pytest.raises(ValueError, match="at least one"):
        IdentityLRU(0)


def test_identity_lru_holds_its_keys_strongly_or_weakly():
    class Key:
        pass

    strong, weak = IdentityLRU(4), IdentityLRU(4, weak=True)
    k1, k2 = Key(), Key()
    r1, r2 = weakref.ref(k1), weakref.ref(k2)
    strong.put((k1,), (), 1)
    weak.put((k2,), (), 2)
    del k1, k2
    gc.collect()
    assert r1() is not None  # a strong cache keeps its key's id unique
    assert r2() is None  # a weak one does not keep the caller's object alive
    k3 = Key()  # may reuse k2's id: still a miss
    assert weak.get((k3,)) is None


def test_an_unbound_binding_has_no_fast_path(fakes):
    """None is what a fresh (or released) binding holds: binding None is checked and refused,
    never taken for "the object bound already"."""
    g = TaskGraph()
    g.add(Memset("m", Buffer("x", 64), 0))
    g.add(DeviceToHost("d", Buffer("x", 64), HostBuffer("h", 64)))
    table = BindingTable(g)
    with pytest.raises(orchestra.execute.BindingError, match="needs a DeviceBuffer"):
        table.bind({"x": None, "h": np.zeros(16, np.float32)})
    with pytest.raises(orchestra.execute.BindingError, match="expected a pinned numpy array"):
        table.bind({"x": _FakeBuf(fakes[1], 64), "h": None})
    table.bind({"x": _FakeBuf(fakes[1], 64), "h": np.zeros(16, np.float32)})
    table.release()
    with pytest.raises(orchestra.execute.BindingError, match="needs a DeviceBuffer"):
        table.bind({"x": None, "h": np.zeros(16, np.float32)})

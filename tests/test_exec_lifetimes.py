"""The executors' side of the lifetime rule, without a GPU (docs/errors.md, "Lifetimes").

A built exec and a queued eager run lease everything they refer to: external device buffers,
the `PinnedBuffer` / `HostRegistration` / `StagingPool` slot behind every bound host array, and
the `Module` of every kernel. Here the real driver-layer classes run on `FakeMemoryDriver`
(tests/test_lifetimes.py: every call logged, freed memory poisoned) and the executors on the
graph fake (tests/fake_graph_cuda.py), both sharing one "device memory" table, so a replay of
freed memory fails the fake's range check and a release shows in the log exactly once.

Also here: external device buffers re-pointed on replay (in place, or by an update for the
caller), `GraphRunner` with external buffers, `GraphExec.close()` dropping every reference
(weak references), two threads replaying one exec (each its own output), and no growth over
many replays.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import tracemalloc
import weakref
from collections import Counter

import numpy as np
import pytest

import orchestra.driver as od
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.driver import owner as owner_mod
from orchestra.driver.owner import ResourceClosedError
from orchestra.execute import BindingError, ClosedBindingError, EagerExecutor
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.execute.cuda_graph.capture import CaptureExecutor
from orchestra.execute.cuda_graph.runner import GraphRunner
from orchestra.execute.kernels import KernelResolver
from orchestra.graph import (
    Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostFunc, HostToDevice, In, KernelNode,
    KernelRef, Memset, Out, TaskGraph,
)
from tests import fake_graph_cuda as fg
from tests.test_lifetimes import fake_mem  # noqa: F401 - the fixture

N = 1024  # floats per buffer
NB = 4 * N
BURN = KernelRef("burn.cu", "burn", params=BURN_PARAMS)
KINDS = ("capture", "graph-build")
ALL = ("eager",) + KINDS


def ref(x, iters=3):
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


def io_graph(external=True):
    """hin -> H2D -> x -> burn -> y -> D2H -> hout; x and y external, or allocated."""
    g = TaskGraph()
    x, y = Buffer("x", NB), Buffer("y", NB)
    if not external:
        g.add(Alloc("ax", x))
        g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", NB), x))
    g.add(KernelNode("k", BURN, 4, 256, (In(x), Out(y), N, 3, 0.5, 1.0)))
    g.add(DeviceToHost("down", y, HostBuffer("hout", NB)))
    if not external:
        g.add(Free("fx", x))
        g.add(Free("fy", y))
    return g


class Env:
    """The graph fake and the memory fake sharing device memory, plus the executors."""

    def __init__(self, graph_fake, mem_fake):
        self.fake = graph_fake
        self.mem = mem_fake
        graph_fake.mem = mem_fake.mem  # DeviceBuffer memory is what the graph's nodes touch
        self.stream = od.Stream()
        self.eager_fake = None

    def executor(self, kind, resolver=None):
        if kind == "eager":
            from tests.fake_cuda import FakeCuda, FakeKernel

            self.eager_fake = fk = FakeCuda()
            fk.mem = self.mem.mem
            if resolver is None:  # (an empty resolver is falsy)
                resolver = KernelResolver(fk.device, lambda r, d: FakeKernel())
            return EagerExecutor(fk.device, driver=fk, kernel_resolver=resolver)
        cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
        return cls(self.fake.device, driver=self.fake,
                   kernel_resolver=resolver if resolver is not None else fg.resolver(self.fake))

    def device_buffer(self, nbytes=NB):
        return od.DeviceBuffer.allocate(nbytes, self.stream)

    def pinned(self):
        p = od.PinnedBuffer.empty(N, np.float32)
        p.array[:] = 0
        return p

    def frees(self, name):
        return [a[0] for a in self.mem.calls(name)]


@pytest.fixture
def env(monkeypatch, fake_mem):  # noqa: F811 - the imported fixture
    fake = fg.install(monkeypatch)
    e = Env(fake, fake_mem)
    yield e
    e.stream.close()


def run_once(kind, ex, g, bind, exe=None):
    """One run: eager ``run``; a graph exec's build (first) or ``launch``. Returns the exec."""
    if kind == "eager":
        ex.run(g, bindings=bind)
        return None
    if exe is None:
        exe = ex.build(g, None, bind)
    exe.launch(sync=True)
    return exe


# -- C19: an external device buffer closed by its owner under a built exec ---------------------


@pytest.mark.parametrize("kind", KINDS)
def test_c19_external_buffer_closed_under_an_exec_replays_right_until_close(env, kind):
    before = od.live_handles()
    g = io_graph()
    x, y = env.device_buffer(), env.device_buffer()
    ptrs = sorted((x.ptr, y.ptr))
    hin, hout = env.pinned(), env.pinned()
    bind = {"x": x, "y": y, "hin": hin.array, "hout": hout.array}
    rng = np.random.default_rng(0)
    with env.executor(kind) as ex:
        exe = ex.build(g, None, bind)
        x.close()
        y.free(env.stream)
        assert x.closed and y.closed and env.frees("cuMemFreeAsync") == []  # leased by the exec
        assert od.deferred_releases()["device_buffer"] == 2
        for _ in range(3):
            hin.array[:] = rng.standard_normal(N).astype(np.float32)
            hout.array[:] = np.nan
            exe.replay()  # no bindings: the graph reads the memory the leases keep
            np.testing.assert_array_equal(hout.array, ref(hin.array))
        # the closed buffer given again (GraphRunner passes every binding every run): refused,
        # naming the binding and the exec; nothing launched
        launches = env.fake.counts["cuGraphLaunch"]
        with pytest.raises(ClosedBindingError, match=rf"binding x \(a {kind} GraphExec\): the "
                                                     "DeviceBuffer bound to it is closed") as info:
            exe.replay({"x": x})
        assert info.value.binding == "x" and info.value.what == "DeviceBuffer"
        assert isinstance(info.value, BindingError) and isinstance(info.value, ValueError)
        assert env.fake.counts["cuGraphLaunch"] == launches
        exe.close()
        assert sorted(env.frees("cuMemFreeAsync")) == ptrs  # each once, at the exec's close
    hin.close()
    hout.close()
    gc.collect()
    assert od.live_handles() == before and od.deferred_releases()["device_buffer"] == 0


@pytest.mark.parametrize("kind", ALL)
def test_closed_device_buffer_at_bind_time_is_a_binding_error_before_any_work(env, kind):
    """Closed before the run or build: refused naming the binding and the executor, before
    any graph is created or anything enqueued, and nothing of the other bindings stays
    leased."""
    g = io_graph()
    x, y = env.device_buffer(), env.device_buffer()
    hin, hout = env.pinned(), env.pinned()
    bind = {"x": x, "y": y, "hin": hin.array, "hout": hout.array}
    x.close()
    assert len(env.frees("cuMemFreeAsync")) == 1  # nothing leased it: freed at once
    with env.executor(kind) as ex:
        where = "the eager executor's run" if kind == "eager" else f"the {kind} executor's build"
        with pytest.raises(ClosedBindingError, match=rf"binding x \({where}\): the "
                                                     "DeviceBuffer bound to it is closed"):
            if kind == "eager":
                ex.run(g, bindings=bind)
            else:
                ex.build(g, None, bind)
        assert env.fake.counts["cuGraphCreate"] + env.fake.counts["cuStreamBeginCapture"] == 0
        if env.eager_fake is not None:
            assert env.eager_fake.counts["cuMemcpyHtoDAsync"] == 0
        assert (y._own.leases, hin._own.leases, hout._own.leases) == (0, 0, 0)
    for o in (y, hin, hout):
        o.close()
    assert od.deferred_releases() == {k: 0 for k in od.deferred_releases()}


# -- pinned memory, host registrations and staging slots under a built exec / a queued run ------


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("what", ["pinned", "registration", "staging"])
def test_host_memory_closed_under_an_exec_or_a_queued_run(env, kind, what):
    """The memory behind a bound host array is closed by its owner while an exec is built on
    it (or a run is queued): the release waits; replays are right; binding it again is refused;
    the release runs once, when the exec closes (eager: at the synchronize)."""
    before = od.live_handles()
    g = io_graph(external=False)
    pool = None
    if what == "pinned":
        hin_owner, hout_owner = env.pinned(), env.pinned()
        hin, hout = hin_owner.array, hout_owner.array
        release = "cuMemFreeHost"
    elif what == "registration":
        hin, hout = np.zeros(N, np.float32), np.zeros(N, np.float32)
        hin_owner, hout_owner = od.register_host(hin), od.register_host(hout)
        release = "cuMemHostUnregister"
    else:
        from orchestra.execute.staging import StagingPool

        pool = StagingPool(2, NB)
        hin, hout = pool.view(0), pool.view(1)
        hin_owner = hout_owner = pool
        release = "cuMemFreeHost"
    hin[:] = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    expected = ref(hin.copy())
    bind = {"hin": hin, "hout": hout}
    with env.executor(kind) as ex:
        if kind == "eager":
            ex.run(g, bindings=bind, sync=False)  # the fake runs it at once; the GPU would not
            np.testing.assert_array_equal(hout, expected)
        else:
            exe = ex.build(g, None, bind)
        for o in {id(hin_owner): hin_owner, id(hout_owner): hout_owner}.values():
            o.close()
        assert env.frees(release) == []  # leased: kept
        if kind == "eager":
            with pytest.raises(ClosedBindingError, match="binding hin .the eager executor's "
                                                         "run.: the .* is closed"):
                ex.run(g, bindings=bind)  # new work on closed memory: refused
            ex.synchronize()
            assert len(env.frees(release)) == 2  # the queued run is done: released now
        else:
            hout[:] = np.nan
            exe.replay()
            np.testing.assert_array_equal(hout, expected)
            with pytest.raises(ClosedBindingError, match=f"binding hin .a {kind} GraphExec."):
                exe.replay({"hin": hin})
            assert env.frees(release) == []
            exe.close()
            assert len(env.frees(release)) == 2
    assert len(env.frees(release)) == 2  # exactly once each
    del hin, hout, bind, pool
    gc.collect()
    assert od.live_handles() == before


# -- modules ------------------------------------------------------------------------------------


class FakeModule(od.Resource):
    def __init__(self, released):
        dev = fg.FakeDevice()
        self._own = od.Owner(self, object(), lambda h: released.append(h), dev, "Module")


def module_resolver(fake, released, modules):
    def load(ref, device):
        k = fg.FakeGraphKernel()
        k.module = FakeModule(released)
        modules.append(k.module)
        return k

    return KernelResolver(fake.device, load)


@pytest.mark.parametrize("kind", KINDS)
def test_a_module_closed_under_an_exec_is_unloaded_when_the_exec_closes(env, kind, monkeypatch):
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: True)
    released, modules = [], []
    g = io_graph(external=False)
    hin, hout = env.pinned(), env.pinned()
    with env.executor(kind, module_resolver(env.fake, released, modules)) as ex:
        exe = ex.build(g, None, {"hin": hin.array, "hout": hout.array})
        (module,) = modules
        assert module._own.leases == 1
        module.close()
        assert released == []  # the exec launches its kernel
        hin.array[:] = 2.0
        exe.replay()
        np.testing.assert_array_equal(hout.array, ref(hin.array))
        # a new build resolves the kernel again (its module is closed) and leases the new one
        exe2 = ex.build(g, None, {"hin": hin.array, "hout": hout.array})
        assert len(modules) == 2 and modules[1]._own.leases == 1
        exe.close()
        assert len(released) == 1
        exe2.close()
        assert modules[1]._own.leases == 0
    hin.close()
    hout.close()


def test_eager_plans_lease_their_modules_and_a_closed_one_is_named(env, monkeypatch):
    from tests.fake_cuda import FakeKernel

    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: True)
    released, modules = [], []

    def load(r, d):
        k = FakeKernel()
        k.module = FakeModule(released)
        modules.append(k.module)
        return k

    g = io_graph(external=False)
    hin, hout = env.pinned(), env.pinned()
    with env.executor("eager") as ex0:
        fk = env.eager_fake
    with EagerExecutor(fk.device, driver=fk, kernel_resolver=KernelResolver(fk.device, load)) as ex:
        ex.run(g, bindings={"hin": hin.array, "hout": hout.array})
        modules[0].close()
        ex.run(g, bindings={"hin": hin.array, "hout": hout.array})  # the prepared plan's lease
        assert released == []
    assert len(released) == 1  # at the executor's close, after its final synchronize
    # a module closed between resolution and the lease: named, nothing enqueued
    closed = FakeModule(released)
    closed.close()

    def load_closed(r, d):
        k = FakeKernel()
        k.module = closed
        return k

    ex = EagerExecutor(fk.device, driver=fk, kernel_resolver=KernelResolver(fk.device, load_closed))
    monkeypatch.setattr("orchestra.execute.kernels._module_closed", lambda k: False)
    calls = len(fk.log)
    with pytest.raises(ResourceClosedError, match="kernel node k: kernel 'burn' belongs to a "
                                                  "Module that was closed"):
        ex.run(g, bindings={"hin": hin.array, "hout": hout.array})
    assert len(fk.log) == calls
    ex.close()
    hin.close()
    hout.close()
    del ex0


# -- re-pointing external device buffers on replay ---------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_replay_repoints_external_buffers_in_place_and_leases_them(env, kind):
    g = TaskGraph()
    x, y = Buffer("x", NB), Buffer("y", NB)
    g.add(Memset("zero", x.range(0, NB // 2), 0, element_size=4))
    g.add(HostToDevice("up", HostBuffer("hin", NB // 2), x.range(NB // 2, NB // 2)))
    g.add(KernelNode("k", BURN, 4, 256, (In(x), Out(y), N, 3, 0.5, 1.0)))
    g.add(DeviceToHost("down", y.range(NB // 4, NB // 2), HostBuffer("hout", NB // 2)))
    bufs = [env.device_buffer() for _ in range(4)]
    hin, hout = np.ones(N // 2, np.float32), np.zeros(N // 2, np.float32)
    expect = ref(np.concatenate([np.zeros(N // 2, np.float32), hin]))[N // 4:3 * N // 4]
    with env.executor(kind) as ex:
        exe = ex.build(g, None, {"x": bufs[0], "y": bufs[1], "hin": hin, "hout": hout})
        assert [b._own.leases for b in bufs] == [1, 1, 0, 0]
        before = Counter(env.fake.counts)
        exe.replay({"x": bufs[2], "y": bufs[3]})
        delta = env.fake.counts - before
        # x: memset, copy, kernel; y: kernel, copy; one SetParams per (binding, node)
        assert delta["cuGraphExecMemsetNodeSetParams"] == 1
        assert delta["cuGraphExecMemcpyNodeSetParams"] == 2
        assert delta["cuGraphExecKernelNodeSetParams"] == 2
        assert delta["cuGraphInstantiate"] == delta["cuGraphExecUpdate"] == 0
        fe = env.fake.execs[int(exe.handle)]
        slot = {n: fe.slots[fe.index[int(r.gnode)]] for n, r in exe._records.items()}
        assert slot["zero"]["dst"] == bufs[2].ptr
        assert slot["up"]["dst"] == bufs[2].ptr + NB // 2
        assert slot["down"]["src"] == bufs[3].ptr + NB // 4
        np.testing.assert_array_equal(hout, expect)
        # the old buffers are not bound any more; the exec keeps their leases for a rebinding
        # to come until their owner closes them, then ends them at the next synchronize
        assert [b._own.leases for b in bufs] == [1, 1, 1, 1]
        bufs[0].close()
        bufs[2].close()  # bound: kept until the exec closes
        exe.synchronize()
        assert [b._own.leases for b in bufs] == [0, 1, 1, 1]
        assert env.frees("cuMemFreeAsync") == [int(bufs[0]._own._handle)]
        # too small, wrong device: refused before anything changes, naming the calls
        small = od.DeviceBuffer.allocate(64, env.stream)
        with pytest.raises(BindingError, match="has 64 bytes but buffer x needs") as info:
            exe.replay({"x": small})
        small.close()
        assert "cuGraphExecKernelNodeSetParams" in "\n".join(info.value.__notes__)

        class Elsewhere:
            ptr, nbytes, device = bufs[1].ptr, NB, 1

        with pytest.raises(BindingError, match="on device 1 but buffer y is on device 0"):
            exe.replay({"y": Elsewhere()})
        with pytest.raises(BindingError, match="external device buffers: x, y"):
            exe.replay({"z": bufs[0]})
        assert exe.device_bindings == {"x": bufs[2], "y": bufs[3]}
        exe.close()
    assert [b._own.leases for b in bufs] == [0, 0, 0, 0]
    for b in bufs:
        b.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_device_to_device_copy_is_repointed_one_side_at_a_time(env, kind):
    """A `PeerCopy` within one device between two external buffers: re-pointing its source
    rewrites only the source field; captured, the record holds what the captured call used,
    so the destination stays right."""
    from orchestra.graph import PeerCopy

    g = TaskGraph()
    a, b = Buffer("a", NB), Buffer("b", NB)
    g.add(HostToDevice("up", HostBuffer("hin", NB), a))
    g.add(PeerCopy("copy", a, b))
    g.add(DeviceToHost("down", b, HostBuffer("hout", NB)))
    a1, a2, b1 = env.device_buffer(), env.device_buffer(), env.device_buffer()
    hin, hout = np.arange(N, dtype=np.float32), np.zeros(N, np.float32)
    with env.executor(kind) as ex:
        exe = ex.build(g, None, {"a": a1, "b": b1, "hin": hin, "hout": hout})
        exe.launch(sync=True)
        np.testing.assert_array_equal(hout, hin)
        hout[:] = 0
        exe.replay({"a": a2})
        fe = env.fake.execs[int(exe.handle)]
        copy = fe.slots[fe.index[int(exe._records["copy"].gnode)]]
        assert (copy["src"], copy["dst"]) == (a2.ptr, b1.ptr)
        np.testing.assert_array_equal(hout, hin)
        assert env.fake.mem[a2.ptr].view(np.float32).tolist() == hin.tolist()
        exe.close()
    for buf in (a1, a2, b1):
        buf.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_node_update_updates_the_exec_for_the_caller(env, kind, caplog):
    g = io_graph()
    x, y, x2 = env.device_buffer(), env.device_buffer(), env.device_buffer()
    hin, hout = np.full(N, 3.0, np.float32), np.zeros(N, np.float32)
    with env.executor(kind) as ex:
        exe = ex.build(g, None, {"x": x, "y": y, "hin": hin, "hout": hout})
        env.fake.fail["cuGraphExecKernelNodeSetParams"] = \
            env.fake.counts["cuGraphExecKernelNodeSetParams"] + 1
        with caplog.at_level(logging.WARNING, "orchestra.execute.cuda_graph.replay"):
            exe.replay({"x": x2})
        np.testing.assert_array_equal(hout, ref(hin))
        assert exe.repoint_updates == 1
        msg = exe.last_update.message
        assert "re-pointing external device buffer x: cuGraphExecKernelNodeSetParams refused" \
            " node k" in msg and "updated the exec with the new binding instead" in msg
        assert exe.last_update.updated  # cuGraphExecUpdate took the rebuilt graph
        assert msg in caplog.text
        assert exe.device_bindings["x"] is x2 and x2._own.leases == 1
        exe.synchronize()
        assert x._own.leases == 0  # the old build's lease ended at the synchronize
        graph_mem = env.fake.mem[x2.ptr]
        assert graph_mem.view(np.float32)[:4].tolist() == [3.0] * 4  # the rebuilt graph uses x2
        exe.close()
    for b in (x, y, x2):
        b.close()


@pytest.mark.parametrize("kind", ["capture", "graph"])
def test_graph_runner_with_external_buffers_rebound_every_tenth_run(env, kind):
    """The runner passes every binding every run: the same buffers cost nothing, a rebound one
    is re-pointed in place; 100 runs, each output checked, one build."""
    g = io_graph()
    xs = [env.device_buffer() for _ in range(3)]
    y = env.device_buffer()
    hin, hout = env.pinned(), env.pinned()
    rng = np.random.default_rng(5)
    with GraphRunner(kind, env.fake.device, kernel_resolver=fg.resolver(env.fake),
                     driver=env.fake) as runner:
        x = xs[0]
        for i in range(100):
            if i and i % 10 == 0:
                x = xs[(i // 10) % 3]
            hin.array[:] = rng.standard_normal(N).astype(np.float32)
            hout.array[:] = np.nan
            runner.run(g, None, {"x": x, "y": y, "hin": hin.array, "hout": hout.array})
            np.testing.assert_array_equal(hout.array, ref(hin.array))
        assert env.fake.counts["cuGraphInstantiate"] == 1
        assert env.fake.counts["cuGraphExecMemcpyNodeSetParams"] == 9  # the up node, 9 times
        assert env.fake.counts["cuGraphExecKernelNodeSetParams"] == 9
        assert [b._own.leases for b in xs] == [1, 1, 1]  # bound, or ready to be bound again
    assert [b._own.leases for b in xs + [y]] == [0, 0, 0, 0]
    for b in xs + [y, hin, hout]:
        b.close()


# -- close drops every reference ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_close_drops_every_reference_while_the_exec_object_lives(env, kind):
    ran = []
    g = io_graph()
    g.add(HostFunc("note", lambda: ran.append(1)))  # a host node: its callbacks table
    x, y = env.device_buffer(), env.device_buffer()
    hin, hout = np.ones(N, np.float32), np.zeros(N, np.float32)
    with env.executor(kind) as ex:
        exe = ex.build(g, None, {"x": x, "y": y, "hin": hin, "hout": hout})
        exe.launch(sync=True)
        assert ran == [1]
        refs = {"hin": weakref.ref(hin), "hout": weakref.ref(hout), "x": weakref.ref(x),
                "y": weakref.ref(y), "table": weakref.ref(exe._table),
                "built": weakref.ref(exe._built), "callbacks": weakref.ref(exe._callbacks),
                "packed": weakref.ref(exe._kernels["k"].struct),
                "record": weakref.ref(exe._records["up"])}
        x.close()  # closed under the exec: its memory goes with the exec
        del hin, hout, x, y
        gc.collect()
        assert all(r() is not None for r in refs.values())  # the exec holds them
        exe.close()
        gc.collect()
        alive = [n for n, r in refs.items() if r() is not None]
        assert alive == [], f"still referenced after close: {alive}"
        assert exe.closed and exe.bindings == {} and exe.device_bindings == {}
        assert repr(exe) == "<GraphExec closed>"
        with pytest.raises(ValueError, match="closed"):
            exe.replay()
    assert len(env.frees("cuMemFreeAsync")) == 2


# -- C13: two threads replaying one exec ----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_c13_two_threads_replaying_one_exec_each_get_their_own_output(env, kind, monkeypatch):
    """Each thread binds its own input and output arrays and replays (sync=True) 200 times;
    the exec's lock serializes rebinding, launch and wait, so every output is its caller's.
    A switch interval of 1 µs makes the threads interleave between any two bytecodes."""
    g = io_graph(external=False)
    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)
    old = sys.getswitchinterval()
    with env.executor(kind) as ex:
        exe = ex.build(g, None, {"hin": np.zeros(N, np.float32), "hout": np.zeros(N, np.float32)})
        bad: list = []

        def worker(seed):
            rng = np.random.default_rng(seed)
            xin, yout = np.empty(N, np.float32), np.empty(N, np.float32)
            for i in range(200):
                xin[:] = rng.standard_normal(N).astype(np.float32) + seed * 100
                yout[:] = np.nan
                exe.replay({"hin": xin, "hout": yout})
                if not np.array_equal(yout, ref(xin)):
                    bad.append((seed, i))

        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(old)
        assert bad == []
        assert exe.launches == 400
        exe.close()


# -- C20 on the fake: many replays, no growth ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_many_replays_with_rebinding_keep_nothing_extra(env, kind):
    from orchestra.graph import build_pipeline

    batches = 16
    g, bs = build_pipeline(batches, [NB] * batches, BURN, scalars=(1, 0.5, 1.0))
    sets = []
    for _ in range(2):
        b = {}
        for batch in bs:
            b[batch.host_in.buffer.name] = np.ones(N, np.float32)
            b[batch.host_out.buffer.name] = np.zeros(N, np.float32)
        sets.append(b)
    with env.executor(kind) as ex:
        exe = ex.build(g, None, sets[0])
        for i in range(20):
            exe.replay(sets[i % 2])
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.take_snapshot()
        for i in range(200):
            exe.replay(sets[i % 2], sync=i % 3 != 0)
            if i % 3 == 0:
                exe.synchronize()
        gc.collect()
        mine = [tracemalloc.Filter(False, "*fake_graph_cuda.py"),  # the fake's call log
                tracemalloc.Filter(False, tracemalloc.__file__)]
        diff = tracemalloc.take_snapshot().filter_traces(mine).compare_to(
            base.filter_traces(mine), "lineno")
        tracemalloc.stop()
        grown = sum(d.size_diff for d in diff if d.size_diff > 0)
        print("\n".join(map(str, diff[:5])))
        assert exe._state.retired == [] and len(exe._state.keep) == 1
        assert grown < 16 * 1024, grown  # nothing per replay (200 of them)
        exe.close()

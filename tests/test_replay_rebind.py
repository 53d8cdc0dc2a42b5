"""Replays that rebind host arrays and external device buffers on the CPU (the graph fake and
the memory fake sharing "device memory", as in tests/test_exec_lifetimes.py).

A value bound to a binding before (a pool of staging arrays bound in turn) takes the replay's
fast path: no checks but writability, no lease lookup, only its address written and one
SetParams per node it reaches. These tests hold that path to everything the full path promises:
outputs right across many rebindings (copy kernels and memcpy nodes), a replaced array's lease
kept while a launch may still read it, a read-only output refused every time, memory closed
meanwhile refused, a refused node update turned into an update of the whole exec, and no
driver call at all for bindings that did not change.
"""

from __future__ import annotations

import numpy as np
import pytest

import orchestra.driver as od
from orchestra.execute import BindingError, ClosedBindingError
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.execute.cuda_graph.capture import CaptureExecutor
from tests import fake_graph_cuda as fg
from tests.test_exec_lifetimes import N, env, io_graph, ref  # noqa: F401 - env: the fixture
from tests.test_lifetimes import fake_mem  # noqa: F401 - the fixture env needs

KINDS = ("capture", "graph-build")
LOWERINGS = ("kernel", "copy-engine")
SETPARAMS = ("cuGraphExecKernelNodeSetParams", "cuGraphExecMemcpyNodeSetParams")


def executor(env, kind, lowering):
    """An executor of ``kind`` on the graph fake; ``lowering`` "kernel": the host copies are
    copy-kernel nodes (what graphs get on an H200 below the crossover)."""
    env.fake.device.kernel_host_access = lowering == "kernel"
    cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
    return cls(env.fake.device, driver=env.fake, kernel_resolver=fg.resolver(env.fake),
               copy_lowering=lowering)


def setparams(env) -> int:
    return sum(env.fake.counts[name] for name in SETPARAMS)


class Pinned:
    """A `PinnedBuffer` and the one array view of it that is bound (``PinnedBuffer.array``
    makes a new view each time; a pool binds the same views in turn)."""

    def __init__(self, env):
        self.buf = env.pinned()
        self.ptr = self.buf.ptr
        self.array = self.buf.array

    def close(self):
        self.buf.close()


def count_full_rebinds(exe) -> list:
    """The bindings ``exe``'s replays take the full path for (checks and leases), recorded."""
    full = []
    real = exe._rebind

    def counted(p, value, version):
        full.append(p.binding.name)
        return real(p, value, version)

    exe._rebind = counted
    return full


def pinned_sets(env, count):
    """``count`` (in, out) `Pinned` pairs, each input with its own values."""
    rng = np.random.default_rng(7)
    sets = []
    for _ in range(count):
        pin, pout = Pinned(env), Pinned(env)
        pin.array[:] = rng.standard_normal(N).astype(np.float32)
        sets.append((pin, pout))
    return sets


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_round_robin_rebinding_keeps_every_output_right(env, kind, lowering):
    """Three pinned input/output pairs bound in turn, 30 replays, half of them queued
    back to back: each output is its own input's result, bit for bit; each replay makes one
    SetParams per node whose array changed (two), an unchanged binding none."""
    g = io_graph(external=False)
    sets = pinned_sets(env, 3)
    want = [ref(pin.array) for pin, _ in sets]
    with executor(env, kind, lowering) as ex:
        exe = ex.build(g, None, {"hin": sets[0][0].array, "hout": sets[0][1].array})
        assert exe.copy_kernels == (2 if lowering == "kernel" else 0)
        full = count_full_rebinds(exe)
        for i in range(30):
            j = i % 3
            pin, pout = sets[j]
            pout.array[:] = np.nan
            before = setparams(env)
            exe.replay({"hin": pin.array, "hout": pout.array}, sync=i % 2 == 0)
            assert setparams(env) - before == (0 if i == 0 else 2)
            exe.synchronize()
            np.testing.assert_array_equal(pout.array.view(np.uint32), want[j].view(np.uint32))
            # the very arrays again: an identity test each, no driver call but the launch
            before = setparams(env)
            exe.replay({"hin": pin.array, "hout": pout.array})
            assert setparams(env) == before
        assert len(full) == 4  # the first binding of sets 1 and 2; later ones: the fast path
        exe.close()
    for pair in sets:
        for p in pair:
            p.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_replaced_arrays_memory_stays_until_no_launch_can_read_it(env, kind):
    """Rebinding away from an array while a launch is queued keeps its memory's lease until
    the next synchronize; with nothing queued the use ends at once. Closing the memory
    meanwhile defers the free to the end of the lease, and binding it again is refused."""
    g = io_graph(external=False)
    (a_in, a_out), (b_in, b_out) = pinned_sets(env, 2)
    with executor(env, kind, "kernel") as ex:
        exe = ex.build(g, None, {"hin": a_in.array, "hout": a_out.array})
        exe.replay({"hin": b_in.array, "hout": b_out.array}, sync=True)
        exe.replay({"hin": a_in.array, "hout": a_out.array}, sync=True)  # both remembered
        # nothing queued: the replaced arrays' use ends at once
        exe.replay({"hin": b_in.array, "hout": b_out.array}, sync=True)
        held = exe._table.host["hin"].known[id(a_in.array)][4]
        assert held.count == 0
        exe.replay({"hin": a_in.array, "hout": a_out.array}, sync=False)  # queued: reads a
        assert held.count == 1
        exe.replay({"hin": b_in.array, "hout": b_out.array}, sync=False)
        assert exe.pending
        a_ptrs = sorted([a_in.ptr, a_out.ptr])
        assert held.count == 1  # the launch queued on a may still read it: retired
        a_in.close()  # the queued launch's predecessor read it; the exec still holds a lease
        a_out.close()
        assert env.frees("cuMemFreeHost") == []
        launches = exe.launches
        with pytest.raises(ClosedBindingError, match="binding hin"):  # remembered, but closed
            exe.replay({"hin": a_in.array})
        assert exe.launches == launches
        exe.synchronize()
        assert held.count == 0
        # nothing queued and nothing binds them: the closed memory goes now, once each
        assert sorted(env.frees("cuMemFreeHost")) == a_ptrs
        np.testing.assert_array_equal(b_out.array, ref(b_in.array))
        exe.close()
    for p in (b_in, b_out):
        p.close()
    assert len(env.frees("cuMemFreeHost")) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_remembered_output_made_read_only_is_refused_before_the_launch(env, kind):
    g = io_graph(external=False)
    (a_in, a_out), (b_in, b_out) = pinned_sets(env, 2)
    with executor(env, kind, "kernel") as ex:
        exe = ex.build(g, None, {"hin": a_in.array, "hout": a_out.array})
        exe.replay({"hin": b_in.array, "hout": b_out.array})
        exe.replay({"hin": a_in.array, "hout": a_out.array})  # b's arrays are remembered now
        launches = exe.launches
        b_out.array.flags.writeable = False
        with pytest.raises(BindingError, match="binding hout: the array is read-only, but "
                                               "node down writes it"):
            exe.replay({"hout": b_out.array})
        assert exe.launches == launches
        b_out.array.flags.writeable = True
        b_out.array[:] = np.nan
        exe.replay({"hin": b_in.array, "hout": b_out.array})
        np.testing.assert_array_equal(b_out.array, ref(b_in.array))
        exe.close()
    for pair in ((a_in, a_out), (b_in, b_out)):
        for p in pair:
            p.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_update_of_a_remembered_value_updates_the_whole_exec(env, kind):
    g = io_graph()  # x, y external: the burn kernel and the copies reach them
    x, y, x2 = env.device_buffer(), env.device_buffer(), env.device_buffer()
    (a_in, a_out), = pinned_sets(env, 1)
    with executor(env, kind, "kernel") as ex:
        exe = ex.build(g, None, {"x": x, "y": y, "hin": a_in.array, "hout": a_out.array})
        exe.replay({"x": x2})
        exe.replay({"x": x})  # x2 remembered
        assert exe.repoint_updates == 0
        full = count_full_rebinds(exe)
        env.fake.fail["cuGraphExecKernelNodeSetParams"] = \
            env.fake.counts["cuGraphExecKernelNodeSetParams"] + 1
        a_out.array[:] = np.nan
        exe.replay({"x": x2})
        assert full == [] and exe.repoint_updates == 1  # refused on the fast path
        assert "cuGraphExecKernelNodeSetParams refused" in exe.last_update.message
        assert exe.device_bindings["x"] is x2
        np.testing.assert_array_equal(a_out.array, ref(a_in.array))
        a_out.array[:] = np.nan
        exe.replay({"x": x})  # and back, per node again
        np.testing.assert_array_equal(a_out.array, ref(a_in.array))
        assert exe.repoint_updates == 1
        exe.close()
    for b in (x, y, x2, a_in, a_out):
        b.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_remembered_device_buffer_closed_meanwhile_is_refused(env, kind):
    g = io_graph()
    x, y, x2 = env.device_buffer(), env.device_buffer(), env.device_buffer()
    (a_in, a_out), = pinned_sets(env, 1)
    with executor(env, kind, "kernel") as ex:
        exe = ex.build(g, None, {"x": x, "y": y, "hin": a_in.array, "hout": a_out.array})
        exe.replay({"x": x2})
        exe.replay({"x": x})
        x2.close()
        launches = exe.launches
        with pytest.raises(ClosedBindingError, match="binding x"):
            exe.replay({"x": x2})
        assert exe.launches == launches and exe.device_bindings["x"] is x
        a_out.array[:] = np.nan
        exe.replay()
        np.testing.assert_array_equal(a_out.array, ref(a_in.array))
        exe.close()
    for b in (x, y, a_in, a_out):
        b.close()


def test_a_rebinding_through_a_body_is_still_refused_by_name(env):
    """A host buffer used inside a conditional body takes the full path (and its refusal)
    even after it was bound before."""
    from orchestra.execute.cuda_graph.replay import Rebind

    class Inner:
        inside = "loop"
        record = type("R", (), {"name": "body.up"})()

    b = type("B", (), {"kind": "host", "writer": None, "users": [Inner()]})()
    p = Rebind(b, (), (), (), ())
    assert p.fast == 0 and p.inner is not None and p.one is None

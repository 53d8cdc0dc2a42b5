"""Running across devices and NCCL nodes on the CPU fakes: the eager executor over fake devices
0 and 1 (streams, events, pools, kernels and peer copies per device), peer-access refusals,
and the collectives' translation (eager, capture and graph-build calls recorded by the fakes,
results checked against numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestra.driver import owner as owner_mod
from orchestra.driver.peer import PeerAccessError
from orchestra.execute import EagerExecutor
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.execute.cuda_graph.capture import CaptureExecutor
from orchestra.execute.errors import ExecutorDeviceError
from orchestra.execute.kernels import KernelResolver
from orchestra.graph import (AllGather, AllReduce, Alloc, Broadcast, Buffer, DeviceToHost, Free,
                             HostBuffer, HostToDevice, KernelNode, PeerCopy, ReduceScatter, Recv,
                             Send, TaskGraph)
from orchestra.nccl import Communicator, NcclUsageError, run_per_device
from orchestra.schedule import schedule
from tests import fake_graph_cuda as fg
from tests.fake_multigpu import MultiCuda, loader
from tests.fake_nccl import FakeNccl, NcclGraphDriver, install_graph, nccl
from tests.test_multigpu_plan import N, REF, two_device_graph


@pytest.fixture(autouse=True)
def _contexts_alive(monkeypatch):
    # fake devices have no primary context: let owners (communicators) release
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: True)


def host(n=N, value=None, seed=0):
    a = np.random.default_rng(seed).standard_normal(n).astype(np.float32) if value is None \
        else np.full(n, value, np.float32)
    return a


def eager(fake, **kw):
    return EagerExecutor(0, devices=(0, 1), driver=fake,
                         kernel_resolver=KernelResolver(fake.gpus[0], loader), **kw)


@pytest.mark.parametrize("policy", ["by-engine", "round-robin", "critical-path", "concurrent"])
def test_an_eager_run_across_two_devices_matches_numpy(policy):
    fake = MultiCuda()
    g = two_device_graph()
    x = host()
    out = np.zeros(N, np.float32)
    with eager(fake) as ex:
        plan = schedule(g, policy, 3)
        ex.run(g, plan, {"hin": x, "hout": out})
        assert out == pytest.approx((x * 2.0) * 1.0 + 3.0)
        # every stream on its plan device, every record on its own device (the fake refuses
        # others), the peer copy with both contexts, peer access enabled for the pair
        assert {fake.stream_device[int(s.handle)] for s in ex.streams} == {0, 1}
        assert not [c for c in fake.log if c[0].startswith("bad")]
        peer = fake.calls("cuMemcpyPeerAsync")
        assert len(peer) == 1 and peer[0][2][1] == "ctx1" and peer[0][2][3] == "ctx0"
        assert fake.enabled == [(0, 1)]
        waits = fake.calls("cuStreamWaitEvent")
        assert any(fake.event_device[w[2]] != fake.stream_device[w[1]] for w in waits), \
            "no cross-device wait"
        # a second run reuses everything
        ex.run(g, plan, {"hin": x, "hout": out})
        assert len(fake.calls("cuMemcpyPeerAsync")) == 2


def test_a_peer_copy_within_one_device_is_a_device_to_device_copy():
    fake = MultiCuda(count=1)
    g = TaskGraph()
    a = Buffer("a", 4 * N)
    hin, hout = HostBuffer("hin", 2 * N), HostBuffer("hout", 2 * N)
    g.add(Alloc("alloc", a))
    g.add(HostToDevice("up", hin, a.range(0, 2 * N)))
    g.add(PeerCopy("copy", a.range(0, 2 * N), a.range(2 * N, 2 * N)))
    g.add(DeviceToHost("down", a.range(2 * N, 2 * N), hout))
    g.add(Free("free", a))
    x = host(N // 2)
    out = np.zeros(N // 2, np.float32)
    with EagerExecutor(0, driver=fake) as ex:
        ex.run(g, bindings={"hin": x, "hout": out})
    assert np.array_equal(out, x)
    assert len(fake.calls("cuMemcpyDtoDAsync")) == 1 and not fake.calls("cuMemcpyPeerAsync")
    assert fake.enabled == []


@pytest.mark.parametrize("count,peer,message", [
    (2, set(), r"device 0 cannot access device 1's memory \(cuDeviceCanAccessPeer\(0, 1\) = 0\)"),
    (2, {(0, 1)}, r"device 1 cannot access device 0's memory"),
    (1, True, r"between devices 0 and 1: device 1 does not exist \(this machine has 1 device"),
])
def test_a_peer_copy_the_pair_cannot_make_is_refused_naming_the_pair(count, peer, message):
    fake = MultiCuda(count=2, peer=peer)
    g = two_device_graph()
    fake.gpus = fake.gpus[:count] if count == 1 else fake.gpus
    devices = (0, 1) if count == 2 else ()
    if count == 1:  # a one-GPU machine: device 1's nodes make the executor refuse first
        g = TaskGraph()
        a, b = Buffer("a", 64), Buffer("b", 64, device=1)
        g.add(PeerCopy("p", a, b))
    with EagerExecutor(0, devices=devices, driver=fake,
                       kernel_resolver=KernelResolver(fake.gpus[0], loader)) as ex:
        with pytest.raises(PeerAccessError, match=message) as info:
            ex.run(g, bindings=_bindings(g))
        assert info.value.pair == (0, 1)
    assert not fake.driver_calls()  # refused before anything was enqueued


def _bindings(g):
    out = {}
    for b in g.host_buffers:
        out[b.name] = np.zeros(b.nbytes // 4, np.float32)
    for b in g.buffers:
        if not any(isinstance(n, Alloc) and n.buffer == b for n in g.nodes):
            out[b.name] = FakeDeviceBuffer(b.nbytes)
    return out


class FakeDeviceBuffer:
    def __init__(self, nbytes):
        self.array = np.zeros(nbytes, np.uint8)
        self.ptr = self.array.ctypes.data
        self.nbytes = nbytes


def test_a_node_on_a_device_the_executor_does_not_run_on_is_refused():
    fake = MultiCuda()
    g = two_device_graph()
    with EagerExecutor(0, driver=fake, kernel_resolver=KernelResolver(fake.gpus[0], loader)) \
            as ex:
        with pytest.raises(ExecutorDeviceError, match="is on device 1, but this EagerExecutor "
                           r"runs on device 0; use one executor per device \(or pass devices"):
            ex.run(g, bindings=_bindings(g))
    with CaptureExecutor(0, driver=fake) as cx:
        with pytest.raises(ExecutorDeviceError, match="builds for device 0"):
            cx.build(g, bindings=_bindings(g))


def test_a_plan_stream_on_a_missing_device_is_refused():
    fake = MultiCuda()
    g = two_device_graph()
    plan = schedule(g, "by-engine", 3)
    with EagerExecutor(0, devices=(1,), driver=fake,
                       kernel_resolver=KernelResolver(fake.gpus[0], loader)) as ex:
        ex.run(g, plan, _bindings(g))  # devices (0, 1): fine
    fake3 = MultiCuda(count=3)
    with EagerExecutor(0, devices=(2,), driver=fake3,
                       kernel_resolver=KernelResolver(fake3.gpus[0], loader)) as ex:
        with pytest.raises(ExecutorDeviceError, match="is on device 1"):
            ex.run(g, plan, _bindings(g))


# -- NCCL nodes -------------------------------------------------------------------------------


def comm_graph(comm, n=N, kind="all_reduce"):
    """H2D -> collective -> D2H on the communicator's device."""
    d = comm.device
    g = TaskGraph()
    nr = comm.nranks
    send_n, recv_n = {"all_reduce": (n, n), "all_gather": (n, n * nr),
                      "reduce_scatter": (n * nr, n), "broadcast": (n, n)}[kind]
    hin, hout = HostBuffer("hin", 4 * send_n), HostBuffer("hout", 4 * recv_n)
    s, r = Buffer("s", 4 * send_n, device=d), Buffer("r", 4 * recv_n, device=d)
    g.add(Alloc("alloc_s", s))
    g.add(Alloc("alloc_r", r))
    g.add(HostToDevice("up", hin, s))
    node = {"all_reduce": lambda: AllReduce("coll", s, r, comm=comm),
            "all_gather": lambda: AllGather("coll", s, r, comm=comm),
            "reduce_scatter": lambda: ReduceScatter("coll", s, r, comm=comm),
            "broadcast": lambda: Broadcast("coll", s, r, comm=comm, root=0)}[kind]()
    g.add(node)
    g.add(DeviceToHost("down", r, hout))
    g.add(Free("free_s", s))
    g.add(Free("free_r", r))
    return g, send_n, recv_n


def test_a_one_rank_all_reduce_is_the_identity_eagerly():
    fake = MultiCuda(count=1)
    fn = FakeNccl()
    with nccl(fn):
        uid = fn.get_unique_id()
        comm = Communicator.init_rank(uid, 0, 1, 0, driver=fake)
        g, _, _ = comm_graph(comm)
        x, out = host(), np.zeros(N, np.float32)
        with EagerExecutor(0, driver=fake) as ex:
            ex.run(g, bindings={"hin": x, "hout": out})
            streams = {int(s.handle) for s in ex.streams}
        assert np.array_equal(out, x)
        calls = [c for c in fn.calls if c[0] == "all_reduce"]
        assert len(calls) == 1 and calls[0][1] == 0 and not calls[0][3]
        assert calls[0][2] in streams  # on a plan stream
        comm.close()
    assert fn.destroyed and fn.destroyed[0].destroyed


def test_the_communicator_outlives_its_close_while_an_executor_holds_a_lease():
    fake = MultiCuda(count=1)
    fn = FakeNccl()
    with nccl(fn):
        comm = Communicator.init_rank(fn.get_unique_id(), 0, 1, 0, driver=fake)
        g, _, _ = comm_graph(comm)
        ex = EagerExecutor(0, driver=fake)
        ex.run(g, bindings={"hin": host(), "hout": np.zeros(N, np.float32)})
        comm.close()
        assert comm.closed and not fn.destroyed  # the prepared plan's lease keeps it
        ex.close()
        del ex
        import gc

        gc.collect()
        assert fn.destroyed
        with pytest.raises(ValueError, match="closed"):
            EagerExecutor(0, driver=fake).run(g, bindings={"hin": host(),
                                                           "hout": np.zeros(N, np.float32)})


@pytest.mark.parametrize("executor", ["capture", "graph-build"])
def test_collectives_become_graph_nodes_and_replay(monkeypatch, executor):
    drv = install_graph(monkeypatch)
    fn = FakeNccl(driver=drv)
    with nccl(fn):
        comm = Communicator.init_rank(fn.get_unique_id(), 0, 1, 0, driver=drv)
        g, _, _ = comm_graph(comm)
        x, out = host(), np.zeros(N, np.float32)
        cls = CaptureExecutor if executor == "capture" else GraphBuildExecutor
        with cls(driver=drv, kernel_resolver=fg.resolver(drv)) as gx:
            exe = gx.build(g, bindings={"hin": x, "hout": out})
            calls = [c for c in fn.calls if c[0] == "all_reduce"]
            assert len(calls) == 1 and calls[0][3]  # captured, not run
            assert not out.any()
            if executor == "graph-build":
                assert [c for c in drv.log if c[0] == "cuGraphAddChildGraphNode"]
            exe.launch(sync=True)
            assert np.array_equal(out, x)
            y = host(seed=3)
            exe.replay({"hin": y})
            assert np.array_equal(out, y)
            assert len([c for c in fn.calls if c[0] == "all_reduce"]) == 1  # never re-issued
            exe.close()
        comm.close()


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "broadcast"])
def test_two_ranks_on_two_threads_match_numpy(kind):
    fake = MultiCuda()
    fn = FakeNccl()
    inputs = {}

    def rank(comm):
        g, send_n, recv_n = comm_graph(comm, kind=kind)
        x = host(send_n, seed=comm.rank)
        inputs[comm.rank] = x
        out = np.zeros(recv_n, np.float32)
        with EagerExecutor(comm.device, driver=fake,
                           kernel_resolver=KernelResolver(fake.gpus[comm.device], loader)) as ex:
            ex.run(g, bindings={"hin": x, "hout": out})
        return out

    with nccl(fn):
        outs = run_per_device(rank, [0, 1], driver=fake, timeout=30)
    a, b = inputs[0], inputs[1]
    want = {"all_reduce": [a + b, a + b], "all_gather": [np.concatenate([a, b])] * 2,
            "reduce_scatter": [(a + b)[:N], (a + b)[N:]], "broadcast": [a, a]}[kind]
    for got, w in zip(outs, want):
        np.testing.assert_allclose(got, w, rtol=1e-6)
    assert len(fn.destroyed) == 2  # run_per_device closed what it made


def test_send_and_recv_between_two_ranks():
    fake = MultiCuda()
    fn = FakeNccl()

    def rank(comm):
        d = comm.device
        g = TaskGraph()
        h = HostBuffer("h", 4 * N)
        buf = Buffer("buf", 4 * N, device=d)
        g.add(Alloc("alloc", buf))
        arr = host(seed=7) if comm.rank == 0 else np.zeros(N, np.float32)
        if comm.rank == 0:
            g.add(HostToDevice("up", h, buf))
            g.add(Send("send", buf, comm=comm, peer=1))
        else:
            g.add(Recv("recv", buf, comm=comm, peer=0))
            g.add(DeviceToHost("down", buf, h))
        g.add(Free("free", buf))
        with EagerExecutor(d, driver=fake) as ex:
            ex.run(g, bindings={"h": arr})
        return arr

    with nccl(fn):
        sent, got = run_per_device(rank, [0, 1], driver=fake, timeout=30)
    assert np.array_equal(got, sent)


def test_two_ranks_of_one_communicator_in_one_graph_are_refused():
    fake = MultiCuda()
    fn = FakeNccl()
    with nccl(fn):
        c0, c1 = Communicator.init_all([0, 1], driver=fake)
        g = TaskGraph()
        a, b = Buffer("a", 64, device=0), Buffer("b", 64, device=1)
        g.add(AllReduce("r0", a, a, comm=c0))
        g.add(AllReduce("r1", b, b, comm=c1))
        with eager(fake) as ex:
            with pytest.raises(NcclUsageError, match="two ranks of one communicator in one "
                               "graph; run each rank's graph on its own thread"):
                ex.run(g, bindings=_bindings(g))
        assert not fn.calls[1:]
        c0.close()
        c1.close()


def test_a_closed_communicator_is_refused_before_anything_is_enqueued():
    fake = MultiCuda(count=1)
    fn = FakeNccl()
    with nccl(fn):
        comm = Communicator.init_rank(fn.get_unique_id(), 0, 1, 0, driver=fake)
        g, _, _ = comm_graph(comm)
        comm.close()
        with EagerExecutor(0, driver=fake) as ex:
            with pytest.raises(ValueError, match="NcclComm is closed"):
                ex.run(g, bindings={"hin": host(), "hout": np.zeros(N, np.float32)})
        assert not fake.driver_calls()


def test_communicators_count_as_live_handles():
    from orchestra.driver import live_handles

    fake = MultiCuda()
    fn = FakeNccl()
    before = live_handles().get("nccl_comm", 0)
    with nccl(fn):
        comms = Communicator.init_all(driver=fake)
        assert [c.rank for c in comms] == [0, 1] and [c.device for c in comms] == [0, 1]
        assert live_handles()["nccl_comm"] == before + 2
        for c in comms:
            c.close()
    assert live_handles().get("nccl_comm", 0) == before
    with pytest.raises(NcclUsageError, match="repeat a device"):
        Communicator.init_all([0, 0], driver=fake, api=fn)
    with pytest.raises(NcclUsageError, match="rank 2 of 2"):
        Communicator.init_rank(bytes(128), 2, 2, 0, driver=fake, api=fn)


# -- the benchmark's pure parts ----------------------------------------------------------------


def test_bench_sizes_and_goals():
    from orchestra.app.multigpu.bench import MultiGpuReport, Row
    from orchestra.app.multigpu.cli import goal_met, parse_sizes
    from orchestra.errors import BenchConfigError

    mib = 1 << 20
    assert parse_sizes("1-8") == (mib, 2 * mib, 4 * mib, 8 * mib)
    assert parse_sizes("3,64") == (3 * mib, 64 * mib)
    with pytest.raises(BenchConfigError, match="LO-HI or a comma list"):
        parse_sizes("a-b")
    rep = MultiGpuReport(devices=[0], ranks=1)
    assert goal_met(rep) is None  # one GPU: the goals are about two
    rep = MultiGpuReport(devices=[0, 1], ranks=2, rows=[
        Row("peer copy both ways", "orchestra PeerCopy", mib, 1.0, 98.0),
        Row("peer copy both ways", "cuda-python cuMemcpyPeerAsync", mib, 1.0, 100.0),
        Row("all-reduce", "orchestra eager", 64 * mib, 1.0, 97.5),
        Row("all-reduce", "NCCL direct (nccl4py)", 64 * mib, 1.0, 100.0),
        Row("data-parallel step", "orchestra eager", mib, 0.3, 1.0),
        Row("data-parallel step", "orchestra graph (captured)", mib, 0.1, 1.0)])
    assert goal_met(rep) is True
    rep.rows[2].gbps = 90.0
    assert goal_met(rep) is False
    assert rep.ratio("all-reduce", "orchestra eager", "NCCL direct (nccl4py)", 64 * mib) == 0.9


def test_the_step_graph_is_hazard_free_and_its_reference_is_the_all_reduce():
    from orchestra.app.multigpu.step import reference, step_graph
    from orchestra.schedule import verify

    class C:
        rank, nranks, device = 1, 2, 1

    g = step_graph(C(), 1024)
    plan = schedule(g, "by-engine", 3)
    assert verify(plan, g) == [] and plan.devices == (1,)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert np.array_equal(reference(x), 0.5 * ((2 * x + 1).sum(0)))

"""GPU checks of the multi-GPU nodes, each run in its own interpreter by
tests/test_multigpu_gpu.py (``python tests/multigpu_checks.py NAME``): NCCL or a driver fault
cannot take the test process down, and a hang ends at the test's timeout. Each check prints
``OK NAME`` when every value matched numpy, raises otherwise."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import numpy as np  # noqa: E402

from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream, live_handles  # noqa: E402
from orchestra.execute import CaptureExecutor, EagerExecutor, GraphBuildExecutor  # noqa: E402
from orchestra.graph import (AllGather, AllReduce, Alloc, Broadcast, Buffer,  # noqa: E402
                             DeviceToHost, Free, HostBuffer, HostToDevice, PeerCopy,
                             ReduceScatter, Recv, Send, TaskGraph)

N = 1 << 16  # float32 per rank
EXECUTORS = (EagerExecutor, CaptureExecutor, GraphBuildExecutor)


def pinned(n, fill=None, seed=0, device=0):
    buf = PinnedBuffer.empty((n,), np.float32, device=device)
    buf.array[:] = (np.random.default_rng(seed).standard_normal(n).astype(np.float32)
                    if fill is None else fill)
    return buf


def run_graph(cls, g, bindings, device=0, **kw):
    """Run ``g`` once with executor class ``cls`` on ``device`` (graphs: build, launch, close)."""
    if cls is EagerExecutor:
        with EagerExecutor(device, **kw) as ex:
            ex.run(g, bindings=bindings)
        return
    with cls(device) as gx:
        exe = gx.build(g, bindings=bindings)
        try:
            exe.launch(sync=True)
        finally:
            exe.close()


def collective_graph(comm, kind, n=N, peer=None):
    """H2D -> one collective -> D2H on the rank's device (send / recv sizes per kind)."""
    d, nr = comm.device, comm.nranks
    sn, rn = {"all_reduce": (n, n), "all_gather": (n, n * nr), "reduce_scatter": (n * nr, n),
              "broadcast": (n, n), "send": (n, n), "recv": (n, n)}[kind]
    g = TaskGraph()
    hin, hout = HostBuffer("hin", 4 * sn), HostBuffer("hout", 4 * rn)
    s, r = Buffer("s", 4 * sn, device=d), Buffer("r", 4 * rn, device=d)
    for b in (s, r):
        g.add(Alloc(f"alloc_{b.name}", b))
    g.add(HostToDevice("up", hin, s))
    make = {"all_reduce": lambda: AllReduce("c", s, r, comm=comm),
            "all_gather": lambda: AllGather("c", s, r, comm=comm),
            "reduce_scatter": lambda: ReduceScatter("c", s, r, comm=comm),
            "broadcast": lambda: Broadcast("c", s, r, comm=comm, root=0),
            "send": lambda: Send("c", s, comm=comm, peer=peer),
            "recv": lambda: Recv("c", r, comm=comm, peer=peer)}
    g.add(make[kind]())
    g.add(DeviceToHost("down", r, hout))
    for b in (s, r):
        g.add(Free(f"free_{b.name}", b))
    return g, sn, rn


# -- one GPU ---------------------------------------------------------------------------------


def one_rank_collectives():
    """A one-rank communicator: every collective of one rank is the identity (checked), run
    eagerly, captured and built; a replay of the captured graph with a new input too."""
    from orchestra.nccl import Communicator, unique_id

    before = live_handles()
    with Communicator.init_rank(unique_id(), 0, 1, 0) as comm:
        assert (comm.rank, comm.nranks, comm.device) == (0, 1, 0)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            g, sn, rn = collective_graph(comm, kind)
            for cls in EXECUTORS:
                hin, hout = pinned(sn, seed=len(kind)), pinned(rn, fill=0.0)
                run_graph(cls, g, {"hin": hin.array, "hout": hout.array})
                assert np.array_equal(hout.array, hin.array), (kind, cls.__name__)
        g, sn, rn = collective_graph(comm, "all_reduce")
        hin, hout = pinned(sn), pinned(rn, fill=0.0)
        with CaptureExecutor(0) as cx:
            exe = cx.build(g, bindings={"hin": hin.array, "hout": hout.array})
            exe.launch(sync=True)
            assert np.array_equal(hout.array, hin.array)
            other = pinned(sn, seed=9)
            exe.replay({"hin": other.array})
            assert np.array_equal(hout.array, other.array)
            exe.close()
    import gc

    gc.collect()  # the executors' prepared plans held leases on the communicator
    assert live_handles().get("nccl_comm", 0) == before.get("nccl_comm", 0)


def peer_copy_one_device():
    """A PeerCopy within one device is a device-to-device copy (eager, captured, built)."""
    g = TaskGraph()
    a = Buffer("a", 8 * N)
    hin, hout = HostBuffer("hin", 4 * N), HostBuffer("hout", 4 * N)
    g.add(Alloc("alloc", a))
    g.add(HostToDevice("up", hin, a.range(0, 4 * N)))
    g.add(PeerCopy("copy", a.range(0, 4 * N), a.range(4 * N, 4 * N)))
    g.add(DeviceToHost("down", a.range(4 * N, 4 * N), hout))
    g.add(Free("free", a))
    for cls in EXECUTORS:
        hin_b, hout_b = pinned(N, seed=3), pinned(N, fill=0.0)
        run_graph(cls, g, {"hin": hin_b.array, "hout": hout_b.array})
        assert np.array_equal(hout_b.array, hin_b.array), cls.__name__


def peer_copy_refused_one_gpu():
    """On a one-GPU machine a PeerCopy to device 1 is refused naming the pair and the device
    count, before anything is enqueued (nothing leaks)."""
    from orchestra.driver.device import device_count
    from orchestra.driver.peer import PeerAccessError

    assert device_count() == 1, "this check is for one-GPU machines"
    g = TaskGraph()
    src, dst = Buffer("src", 4 * N), Buffer("dst", 4 * N, device=1)
    g.add(PeerCopy("p", src, dst))
    s = Stream(0)
    a = DeviceBuffer.allocate(4 * N, s)
    s.synchronize()
    before = live_handles()
    with EagerExecutor(0) as ex:
        try:
            ex.run(g, bindings={"src": a, "dst": a})
        except PeerAccessError as exc:
            msg = str(exc)
            assert "between devices 0 and 1: device 1 does not exist (this machine has 1 " \
                   "device(s))" in msg, msg
            assert exc.pair == (0, 1)
        else:
            raise AssertionError("the peer copy to a missing device was not refused")
    after = live_handles()
    assert after.get("device_buffer") == before.get("device_buffer"), (before, after)
    a.close()
    s.close()


# -- two GPUs --------------------------------------------------------------------------------


def peer_copies_two():
    """Peer copies 0 -> 1 (push on device 0, pull on device 1) and back, eagerly over both
    devices; then a graph per device (captured and built) copying into the other GPU's
    external buffer."""
    from orchestra.driver.peer import enabled_pairs

    g = TaskGraph()
    hin, hout = HostBuffer("hin", 4 * N), HostBuffer("hout", 4 * N)
    a, b, c = Buffer("a", 4 * N, device=0), Buffer("b", 4 * N, device=1), Buffer("c", 4 * N)
    for x in (a, b, c):
        g.add(Alloc(f"alloc_{x.name}", x))
    g.add(HostToDevice("up", hin, a))
    g.add(PeerCopy("push", a, b))             # on device 0
    g.add(PeerCopy("pull", b, c, device=0))   # device 0 reads device 1's memory
    g.add(DeviceToHost("down", c, hout))
    for x in (a, b, c):
        g.add(Free(f"free_{x.name}", x))
    hin_b, hout_b = pinned(N, seed=5), pinned(N, fill=0.0)
    with EagerExecutor(0, devices=(1,)) as ex:
        ex.run(g, bindings={"hin": hin_b.array, "hout": hout_b.array})
    assert np.array_equal(hout_b.array, hin_b.array)
    assert (0, 1) in enabled_pairs()
    s1 = Stream(1)
    remote = DeviceBuffer.allocate(4 * N, s1)
    s1.synchronize()
    g2 = TaskGraph()
    x, back = Buffer("x", 4 * N), Buffer("back", 4 * N)
    r = Buffer("remote", 4 * N, device=1)
    g2.add(Alloc("alloc_x", x))
    g2.add(Alloc("alloc_back", back))
    g2.add(HostToDevice("up", hin, x))
    g2.add(PeerCopy("to1", x, r))
    g2.add(PeerCopy("from1", r, back, device=0))
    g2.add(DeviceToHost("down", back, hout))
    g2.add(Free("free_x", x))
    g2.add(Free("free_back", back))
    for cls in (CaptureExecutor, GraphBuildExecutor):
        hout_b.array[:] = 0
        run_graph(cls, g2, {"hin": hin_b.array, "hout": hout_b.array, "remote": remote})
        assert np.array_equal(hout_b.array, hin_b.array), cls.__name__
    remote.close()
    s1.close()


def collectives_two():
    """Every collective and send / recv over two GPUs (one thread each) against numpy, eager
    and captured."""
    from orchestra.nccl import run_per_device

    kinds = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv")

    def rank(comm):
        out = {}
        for kind in kinds:
            for cls in (EagerExecutor, CaptureExecutor):
                if kind == "sendrecv":
                    k = "send" if comm.rank == 0 else "recv"
                    g, sn, rn = collective_graph(comm, k, peer=1 - comm.rank)
                else:
                    g, sn, rn = collective_graph(comm, kind)
                hin = pinned(sn, seed=10 + comm.rank, device=comm.device)
                hout = pinned(rn, fill=0.0, device=comm.device)
                run_graph(cls, g, {"hin": hin.array, "hout": hout.array}, device=comm.device)
                out[(kind, cls.__name__)] = (hin.array.copy(), hout.array.copy())
        return out

    r0, r1 = run_per_device(rank, [0, 1], timeout=120)
    for kind in kinds:
        for cls in ("EagerExecutor", "CaptureExecutor"):
            (x0, y0), (x1, y1) = r0[(kind, cls)], r1[(kind, cls)]
            want = {"all_reduce": (x0 + x1, x0 + x1),
                    "all_gather": (np.concatenate([x0, x1]),) * 2,
                    "reduce_scatter": ((x0 + x1)[:N], (x0 + x1)[N:]),
                    "broadcast": (x0, x0)}.get(kind)
            if kind == "sendrecv":
                np.testing.assert_array_equal(y1, x0, err_msg=f"{kind} {cls}")
                continue
            np.testing.assert_allclose(y0, want[0], rtol=1e-6, err_msg=f"{kind} {cls} rank 0")
            np.testing.assert_allclose(y1, want[1], rtol=1e-6, err_msg=f"{kind} {cls} rank 1")


CHECKS = {f.__name__: f for f in (one_rank_collectives, peer_copy_one_device,
                                  peer_copy_refused_one_gpu, peer_copies_two, collectives_two)}

if __name__ == "__main__":
    name = sys.argv[1]
    CHECKS[name]()
    print(f"OK {name}")

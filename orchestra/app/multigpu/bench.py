"""`orchestra bench multigpu`: orchestra's multi-GPU nodes against the library calls they make.

Three parts, each contender timed in the same run, interleaved repeat by repeat (median):

- **peer copy** (two GPUs or more): ``--peer-mib`` MiB from device 0 to device 1 (one way)
  and both ways at once, as `PeerCopy` nodes run by an `EagerExecutor` over both devices,
  against ``cuMemcpyPeerAsync`` called by hand on one stream per direction (cuda-python).
  GB/s counts the bytes that crossed (both directions for both ways).
- **all-reduce**: out-of-place float32 sums of 1 MiB .. 1 GiB over every GPU (one rank per
  GPU, one thread each), as `AllReduce` nodes run by an `EagerExecutor`, and as a captured
  CUDA graph replayed, against ``ncclAllReduce`` called through nccl4py on the same buffers
  and stream. Bus bandwidth = bytes / time x 2 (n - 1) / n (NCCL's nccl-tests convention);
  with one GPU that factor is 0, so the algorithm bandwidth (bytes / time) is shown as well.
- **step**: the data-parallel step (H2D, kernel, all-reduce, kernel, D2H; `step.step_graph`)
  at ``--step-mib`` MiB shards, eager against the captured graph replayed, output checked
  against numpy.

With fewer than two GPUs the peer-copy part is skipped (said in ``skipped``); the all-reduce
and the step run with one rank. ``NCCL_NVLS_ENABLE=0`` is set unless already set.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Callable

import attrs
import numpy as np

MIB = 1 << 20
DEFAULT_SIZES = tuple(MIB << k for k in range(11))  # 1 MiB .. 1 GiB


@attrs.define
class Row:
    """One contender on one part of the benchmark (times in ms, bandwidths in GB/s).

    Thread-safety: plain mutable data (``attrs.define``), filled by one thread: share it only once
    it is complete, and do not change it while others read it.
    """

    part: str
    contender: str
    size_bytes: int
    ms: float
    gbps: float  # GB/s (1e9 bytes): copy bandwidth, or all-reduce bus bandwidth
    algbw: float | None = None
    verified: bool = True
    note: str = ""


@attrs.define
class MultiGpuReport:
    """What `run_multigpu` measured: the devices, ranks, result rows and skipped parts.

    Thread-safety: plain mutable data (``attrs.define``), filled by one thread: share it only once
    it is complete, and do not change it while others read it.
    """

    devices: list
    ranks: int
    rows: list = attrs.field(factory=list)
    skipped: list = attrs.field(factory=list)
    nccl_version: int | None = None

    def as_dict(self) -> dict:
        return {"devices": self.devices, "ranks": self.ranks, "nccl_version": self.nccl_version,
                "rows": [attrs.asdict(r) for r in self.rows], "skipped": self.skipped}

    @property
    def verified(self) -> bool:
        return all(r.verified for r in self.rows)

    def ratio(self, part: str, contender: str, base: str, size: int | None = None) -> float | None:
        """``contender``'s GB/s over ``base``'s for ``part`` (at ``size``)."""
        def pick(c):
            return [r for r in self.rows if r.part == part and r.contender == c
                    and (size is None or r.size_bytes == size)]
        a, b = pick(contender), pick(base)
        if not a or not b or not b[0].gbps:
            return None
        return a[0].gbps / b[0].gbps


def _median_ms(samples) -> float:
    return statistics.median(samples) * 1e3


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- peer copies -----------------------------------------------------------------------------


def bench_peer(nbytes: int, repeats: int, reps: int, progress=None) -> list[Row]:
    from cuda.bindings import driver as d

    from orchestra.driver import DeviceBuffer, Stream
    from orchestra.driver.check import cu
    from orchestra.driver.device import Device
    from orchestra.driver.peer import enable_peer_access
    from orchestra.execute import EagerExecutor
    from orchestra.app.multigpu.step import peer_copy_graph

    enable_peer_access(0, 1)
    d0, d1 = Device.get(0), Device.get(1)
    s0, s1 = Stream(d0), Stream(d1)
    bufs = {}
    for a, b in ((0, 1), (1, 0)):
        sa, sb = (s0, s1) if a == 0 else (s1, s0)
        bufs[(a, b)] = (DeviceBuffer.allocate(nbytes, sa), DeviceBuffer.allocate(nbytes, sb))
    s0.synchronize()
    s1.synchronize()
    rows = []
    try:
        with EagerExecutor(0, devices=(1,)) as ex:
            for label, pairs in (("one way 0->1", [(0, 1)]), ("both ways", [(0, 1), (1, 0)])):
                g = peer_copy_graph(nbytes, pairs, reps)
                bind = {}
                for a, b in pairs:
                    bind[f"src{a}_{b}"], bind[f"dst{a}_{b}"] = bufs[(a, b)]
                ex.run(g, bindings=bind)  # warm-up: prepare, peer access
                streams = {0: s0, 1: s1}

                def raw():
                    for _ in range(reps):
                        for a, b in pairs:
                            src, dst = bufs[(a, b)]
                            cu(d.cuMemcpyPeerAsync, dst.ptr, Device.get(b).context, src.ptr,
                               Device.get(a).context, nbytes, streams[a].handle)
                    for a, _ in pairs:
                        streams[a].synchronize()

                raw()
                t_orch, t_raw = [], []
                for _ in range(repeats):
                    t_orch.append(_time(lambda: ex.run(g, bindings=bind)))
                    t_raw.append(_time(raw))
                moved = nbytes * reps * len(pairs)
                for name, ts in (("orchestra PeerCopy", t_orch),
                                 ("cuda-python cuMemcpyPeerAsync", t_raw)):
                    ms = _median_ms(ts)
                    rows.append(Row(f"peer copy {label}", name, nbytes, ms, moved / ms / 1e6))
                if progress:
                    progress(f"peer copy {label}")
    finally:
        for pair in bufs.values():
            for buf in pair:
                buf.close()
        s0.close()
        s1.close()
    return rows


# -- all-reduce ------------------------------------------------------------------------------


def _busbw(nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    alg = nbytes / seconds / 1e9
    return alg * 2 * (n - 1) / n, alg


def bench_all_reduce(comms, sizes, repeats: int, iters: int, progress=None) -> list[Row]:
    """Per size: orchestra eager, orchestra graph, NCCL direct; each rank on its thread."""
    from orchestra.nccl import run_per_device

    n = len(comms)
    barrier = threading.Barrier(n)

    def rank(comm):
        from orchestra.driver import DeviceBuffer, Stream
        from orchestra.execute import CaptureExecutor, EagerExecutor
        from orchestra.graph import AllReduce, Buffer, TaskGraph

        api = comm.api
        f32, total = api.dtype("float32"), api.op("sum")
        stream = Stream(comm.device)
        out = {}
        with EagerExecutor(comm.device) as ex, CaptureExecutor(comm.device) as cx:
            for nbytes in sizes:
                send = DeviceBuffer.allocate(nbytes, stream)
                recv = DeviceBuffer.allocate(nbytes, stream)
                stream.synchronize()
                g = TaskGraph()
                sb, rb = Buffer("send", nbytes, device=comm.device), Buffer("recv", nbytes,
                                                                              device=comm.device)
                for i in range(iters):
                    g.add(AllReduce(f"ar{i}", sb, rb, comm=comm))  # in order: WAW on recv
                bind = {"send": send, "recv": recv}
                plan = ex.prepare(g, policy="by-engine", streams=1)
                barrier.wait()
                ex.run(g, plan, bind)  # NCCL connects before the capture, not inside it
                exe = cx.build(g, bindings=bind, streams=1)
                count = nbytes // 4

                def direct():
                    for _ in range(iters):
                        api.all_reduce(send.ptr, recv.ptr, count, f32, total, comm.handle,
                                       int(stream.handle))
                    stream.synchronize()

                contenders = (("orchestra eager", lambda: ex.run(g, plan, bind)),
                              ("orchestra graph", lambda: exe.launch(sync=True)),
                              ("NCCL direct (nccl4py)", direct))
                for _, fn in contenders:  # warm-up (NCCL connects lazily)
                    barrier.wait()
                    fn()
                samples: dict = {name: [] for name, _ in contenders}
                for _ in range(repeats):
                    for name, fn in contenders:
                        barrier.wait()
                        samples[name].append(_time(fn))
                out[nbytes] = samples
                exe.close()
                send.close()
                recv.close()
        stream.close()
        return out

    per_rank = run_per_device(rank, comms=comms)
    rows = []
    for nbytes in sizes:
        for name in per_rank[0][nbytes]:
            # a collective ends when its slowest rank does: the max over ranks per repeat
            ts = [max(r[nbytes][name][i] for r in per_rank) for i in range(repeats)]
            sec = statistics.median(ts) / iters
            bus, alg = _busbw(nbytes, sec, n)
            rows.append(Row("all-reduce", name, nbytes, sec * 1e3, bus, alg))
        if progress:
            progress(f"all-reduce {nbytes // MIB} MiB")
    return rows


# -- the step --------------------------------------------------------------------------------


def bench_step(comms, shard_bytes: int, repeats: int, iters: int, progress=None) -> list[Row]:
    from orchestra.nccl import run_per_device
    from orchestra.app.multigpu.step import reference, step_graph

    n = max(4, shard_bytes // 16 * 4)
    nranks = len(comms)
    barrier = threading.Barrier(nranks)
    rng = np.random.default_rng(0)
    global_in = rng.standard_normal((nranks, n)).astype(np.float32)
    want = reference(global_in)

    def rank(comm):
        from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream
        from orchestra.execute import CaptureExecutor, EagerExecutor

        g = step_graph(comm, n)
        hin = PinnedBuffer.empty((n,), np.float32, device=comm.device)
        hout = PinnedBuffer.empty((n,), np.float32, device=comm.device)
        hin.array[:] = global_in[comm.rank]
        s = Stream(comm.device)
        y = DeviceBuffer.allocate(4 * n, s)
        s.synchronize()
        bind = {"shard_in": hin.array, "shard_out": hout.array, "y": y}
        samples: dict = {"eager": [], "graph": []}
        ok = True
        with EagerExecutor(comm.device) as ex, CaptureExecutor(comm.device) as cx:
            plan = ex.prepare(g)
            barrier.wait()
            ex.run(g, plan, bind)  # NCCL connects before the capture, not inside it
            exe = cx.build(g, bindings=bind)

            def eager():
                for _ in range(iters):
                    ex.run(g, plan, bind)

            def graph():
                for _ in range(iters):
                    exe.launch(sync=True)

            for fn in (eager, graph):
                barrier.wait()
                fn()
                ok = ok and bool(np.allclose(hout.array, want, rtol=1e-5, atol=1e-5 * nranks))
                hout.array[:] = 0
            for _ in range(repeats):
                for name, fn in (("eager", eager), ("graph", graph)):
                    barrier.wait()
                    samples[name].append(_time(fn))
            ok = ok and bool(np.allclose(hout.array, want, rtol=1e-5, atol=1e-5 * nranks))
            exe.close()
        y.close()
        s.close()
        return samples, ok

    per_rank = run_per_device(rank, comms=comms)
    ok = all(r[1] for r in per_rank)
    rows = []
    for name, label in (("eager", "orchestra eager"), ("graph", "orchestra graph (captured)")):
        ts = [max(r[0][name][i] for r in per_rank) for i in range(repeats)]
        ms = statistics.median(ts) * 1e3 / iters
        rows.append(Row("data-parallel step", label, 4 * n, ms, 4 * n / ms / 1e6, None, ok,
                        "" if ok else "output differs from numpy"))
    if progress:
        progress("step")
    return rows


def run_multigpu(*, peer_mib: int = 256, sizes=DEFAULT_SIZES, step_mib: float = 1.0,
                 repeats: int = 5, iters: int = 10, devices=None, progress=None
                 ) -> MultiGpuReport:
    """Every part that the machine allows (module doc)."""
    from orchestra.driver.device import device_count
    from orchestra.errors import BenchConfigError
    from orchestra.nccl import Communicator, default_nccl, nvls_off

    nvls_off()
    if repeats < 1 or iters < 1 or peer_mib < 1 or step_mib <= 0 or not sizes:
        raise BenchConfigError("repeats, iters, --peer-mib and --step-mib must be positive, "
                               "and at least one all-reduce size given")
    if any(s % 4 for s in sizes):
        raise BenchConfigError("all-reduce sizes must be whole float32 counts (multiples of 4)")
    devs = list(range(device_count())) if devices is None else list(devices)
    rep = MultiGpuReport(devices=devs, ranks=len(devs))
    if len(devs) >= 2 and 0 in devs and 1 in devs:
        rep.rows += bench_peer(peer_mib * MIB, repeats, iters, progress)
    else:
        rep.skipped.append(f"peer copy: needs two GPUs ({len(devs)} visible)")
    api = default_nccl()
    try:
        rep.nccl_version = api.version()
    except Exception as exc:  # noqa: BLE001 - reported, the peer part still counts
        rep.skipped.append(f"all-reduce and step: NCCL unavailable ({exc})")
        return rep
    if len(devs) < 2:
        rep.skipped.append("all-reduce over several GPUs: one GPU, so one rank (bus bandwidth "
                           "is 0 by definition; the algorithm bandwidth is shown)")
    comms = Communicator.init_all(devs)
    try:
        rep.rows += bench_all_reduce(comms, sizes, repeats, iters, progress)
        rep.rows += bench_step(comms, int(step_mib * MIB), repeats, iters, progress)
    finally:
        for c in comms:
            c.close()
    return rep


__all__ = ["DEFAULT_SIZES", "MultiGpuReport", "Row", "bench_all_reduce", "bench_peer",
           "bench_step", "run_multigpu"]

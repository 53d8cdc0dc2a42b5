"""Host cost of `GraphExec.replay` in orchestra's own Python, without a GPU (the fake driver).

    python benchmarks/bench_replay_fake.py [--replays 20000] [--repeat 7] [--batches 1]
                                           [--copy-lowering kernel|copy-engine]

Builds the one-request graph (H2D -> burn -> D2H per batch, 64 KiB each) with the CPU test
fake (`tests/fake_graph_cuda.py`), capture and graph-build, then replaces the exec's bound
driver functions (``cuGraphLaunch``, ``cuGraphExec*NodeSetParams``) with calls that return
success at once, so what is timed is orchestra's work per replay and the Python call of each
driver function, nothing the driver does. The copies are lowered as on an H200 by default
(``--copy-lowering kernel``: 64 KiB copies in graphs are copy-kernel nodes, so a host rebinding
rewrites a kernel node's packed pointer and calls ``cuGraphExecKernelNodeSetParams``);
``copy-engine`` makes them memcpy nodes. Rows (host µs per replay):

- launch only: ``replay(sync=False)``;
- same bindings: ``replay(bind)`` with the bound arrays (the identity fast path);
- 2 rebound I/O nodes, back to back: two array sets alternated, launches pending (every H2D
  and D2H rebound; the remembered fast path after the first round; the replaced arrays are
  retired until the next synchronize);
- 2 rebound I/O nodes, drained: the same with ``synchronize()`` before each replay, outside
  the timed region (what ``benchmarks/bench_graphs.py`` times on the GPU: nothing pending,
  so the replaced arrays' leases end at once);
- 1 external device buffer re-pointed (two buffers alternated: the kernel node's pointer
  field and the copy node's device field rewritten, one SetParams per node);

and the bare equivalent: the same null driver calls made from a plain loop with prebuilt
parameter structs (one launch; two SetParams + one launch). "over bare" is orchestra's part.
The host arrays sit in orchestra's pinned ranges with an owner (as `register_host` makes them),
so a rebinding leases and releases them as it would real pinned memory. The calling thread's
current-context marker is set as `Device.make_current` leaves it on a real device (the fake
device sets none). Back-to-back rows: this thread's CPU time per call over ``--replays``
calls; drained rows: each call timed alone (``perf_counter_ns``, the median); every row is
the fastest of ``--repeat`` rounds (robust to a busy machine). The GPU version of the same
question (real driver calls) is ``benchmarks/bench_graphs.py --workloads 1x0.0625``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from orchestra.graph import (  # noqa: E402
    Buffer, DeviceToHost, HostBuffer, HostToDevice, In, KernelNode, KernelRef, Out, TaskGraph,
)
from orchestra.app.job.graphs import BURN_PARAMS  # noqa: E402
from tests import fake_graph_cuda as fg  # noqa: E402

_OK = (0,)


def _null2(a, b):
    return _OK


def _null3(a, b, c):
    return _OK


def _null4(a, b, c, d):
    return _OK


NULLED = {"cuGraphLaunch": _null2, "cuGraphExecMemcpyNodeSetParams": _null4,
          "cuGraphExecKernelNodeSetParams": _null3, "cuGraphExecMemsetNodeSetParams": _null4}


class _Pinned:
    """A numpy array in orchestra's pinned ranges with an `Owner` (what `register_host`
    makes), so bindings lease it as they lease real pinned memory; nothing is released."""

    def __init__(self, array):
        import contextlib
        import types

        from orchestra.driver import host as host_mod
        from orchestra.driver.owner import Owner

        dev = types.SimpleNamespace(ordinal=0, pushed=contextlib.nullcontext)
        self.array = array
        self._own = Owner(self, array.ctypes.data, lambda h: None, dev, "HostRegistration")
        host_mod.pinned_ranges().add(array.ctypes.data, array.nbytes, self._own)


def graph(batches: int, n: int, external: bool):
    g = TaskGraph()
    for i in range(batches):
        x, y = Buffer(f"b{i}.x", 4 * n), Buffer(f"b{i}.y", 4 * n)
        hin, hout = HostBuffer(f"b{i}.in", 4 * n), HostBuffer(f"b{i}.out", 4 * n)
        if not external:
            from orchestra.graph import Alloc, Free
            g.add(Alloc(f"b{i}.ax", x))
            g.add(Alloc(f"b{i}.ay", y))
        g.add(HostToDevice(f"b{i}.up", hin, x))
        g.add(KernelNode(f"b{i}.k", KernelRef("burn.cu", "burn", params=BURN_PARAMS), 1, 256,
                         (In(x), Out(y), n, 1, 0.5, 1.0)))
        g.add(DeviceToHost(f"b{i}.down", y, hout))
        if not external:
            g.add(Free(f"b{i}.fx", x))
            g.add(Free(f"b{i}.fy", y))
    return g


class FakeDeviceBuffer:
    def __init__(self, fake, nbytes):
        self.nbytes = nbytes
        self.device = 0
        self.ptr = fake._new_memory(nbytes, fake.mem)


def timed(fn, replays: int, repeat: int) -> float:
    """µs of this thread's CPU time per call (``time.thread_time_ns``: time other processes
    take the core for does not count), the fastest of ``repeat`` rounds of ``replays``."""
    rounds = []
    for _ in range(repeat):
        t0 = time.thread_time_ns()
        for _ in range(replays):
            fn()
        rounds.append((time.thread_time_ns() - t0) / 1e3 / replays)
    return min(rounds)


def timed_each(fn, before, replays: int, repeat: int) -> float:
    """µs per call of ``fn`` timed alone, ``before()`` run untimed ahead of each call: the
    median of ``replays`` calls, the fastest of ``repeat`` rounds."""
    clock = time.perf_counter_ns
    rounds = []
    for _ in range(repeat):
        per = []
        for _ in range(replays):
            before()
            t0 = clock()
            fn()
            per.append(clock() - t0)
        per.sort()
        rounds.append(per[len(per) // 2] / 1e3)
    return min(rounds)


def _nothing():
    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replays", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--copy-lowering", choices=("kernel", "copy-engine"), default="kernel",
                    help="how the 64 KiB copies are lowered (default kernel: what graphs get "
                         "on an H200)")
    args = ap.parse_args(argv)
    from orchestra.execute.cuda_graph.build import GraphBuildExecutor
    from orchestra.execute.cuda_graph.capture import CaptureExecutor
    from orchestra.driver import api as api_mod
    from orchestra.driver import device as device_mod

    n = 16384  # 64 KiB of float32
    fake = fg.FakeGraphDriver()
    fake.device.kernel_host_access = args.copy_lowering == "kernel"
    fg.FakeStream.installed = fake
    old = api_mod._default
    api_mod._default = fake
    rows = []
    try:
        for kind, cls in (("capture", CaptureExecutor), ("graph-build", GraphBuildExecutor)):
            g = graph(args.batches, n, external=True)
            sets = []
            pins: list = []
            for _ in range(2):
                b = {}
                for i in range(args.batches):
                    b[f"b{i}.in"] = np.zeros(n, np.float32)
                    b[f"b{i}.out"] = np.zeros(n, np.float32)
                    pins.extend((_Pinned(b[f"b{i}.in"]), _Pinned(b[f"b{i}.out"])))
                    b[f"b{i}.x"] = FakeDeviceBuffer(fake, 4 * n)
                    b[f"b{i}.y"] = FakeDeviceBuffer(fake, 4 * n)
                sets.append(b)
            host_sets = [{k: v for k, v in s.items() if k.endswith((".in", ".out"))}
                         for s in sets]
            dev_sets = [{k: v for k, v in s.items() if k.endswith(".x")} for s in sets]
            ex = cls(fake.device, kernel_resolver=fg.resolver(fake), driver=fake,
                     copy_lowering=args.copy_lowering)
            # the driver calls a replay makes return at once (bound by the exec when built)
            saved = {name: getattr(fake, name) for name in NULLED}
            for name, fn in NULLED.items():
                setattr(fake, name, fn)
            try:
                exe = ex.build(g, None, sets[0])
            finally:
                for name, fn in saved.items():
                    setattr(fake, name, fn)
            # what Device.make_current leaves on a real device: this thread's context marker
            device_mod._tls.ctx = exe._ctx_key
            state = [0]

            def rebind_host():
                state[0] ^= 1
                exe.replay(host_sets[state[0]], sync=False)

            def repoint():
                state[0] ^= 1
                exe.replay(dev_sets[state[0]], sync=False)

            cases = [("launch only", lambda: exe.replay(sync=False), None),
                     ("same bindings", lambda: exe.replay(host_sets[0], sync=False), None),
                     (f"{2 * args.batches} rebound I/O nodes, back to back", rebind_host, None),
                     (f"{2 * args.batches} rebound I/O nodes, drained", rebind_host,
                      exe.synchronize)]
            try:
                repoint()
                repoint()
                cases.append((f"{args.batches} external buffer re-pointed", repoint, None))
            except Exception as exc:  # noqa: BLE001 - older code refused it
                print(f"  ({kind}: re-pointing an external buffer refused: "
                      f"{type(exc).__name__})")
            exe.replay(host_sets[0], sync=False)
            for what, fn, before in cases:
                if before is None:
                    us = timed(fn, args.replays, args.repeat)
                else:
                    us = timed_each(fn, before, args.replays, args.repeat)
                exe.synchronize()  # the retired arrays of back-to-back rows end here
                rows.append((kind, what, us))
            exe.close()
            ex.close()
        # the bare loop: the same null calls with prebuilt structs
        from cuda.bindings import driver as d

        if args.copy_lowering == "kernel":  # kernel nodes: a packed pointer field each
            import ctypes

            class _Args(ctypes.Structure):
                _fields_ = [("a0", ctypes.c_uint64), ("a1", ctypes.c_uint64),
                            ("a2", ctypes.c_uint64), ("a3", ctypes.c_uint32)]

            p1, p2 = d.CUDA_KERNEL_NODE_PARAMS(), d.CUDA_KERNEL_NODE_PARAMS()
            s1, s2 = _Args(), _Args()
            e, s, n1, n2 = 1, 2, 3, 4

            def bare_rebind():
                s1.a1 = 0x1000
                _null3(e, n1, p1)
                s2.a0 = 0x2000
                _null3(e, n2, p2)
                _null2(e, s)
        else:
            p1, p2 = d.CUDA_MEMCPY3D(), d.CUDA_MEMCPY3D()
            e, s, n1, n2, ctx = 1, 2, 3, 4, 5

            def bare_rebind():
                p1.srcHost = 0x1000
                _null4(e, n1, p1, ctx)
                p2.dstHost = 0x2000
                _null4(e, n2, p2, ctx)
                _null2(e, s)

        def bare_launch():
            _null2(e, s)

        bare = {"launch only": timed(bare_launch, args.replays, args.repeat),
                "rebound": timed(bare_rebind, args.replays, args.repeat),
                "rebound, drained": timed_each(bare_rebind, _nothing, args.replays,
                                               args.repeat)}
    finally:
        api_mod._default = old
    print(f"host us per replay on the fake driver (null driver calls), fastest of "
          f"{args.repeat} x {args.replays}; {args.batches} batch(es) of 64 KiB, copies as "
          f"{'copy kernels' if args.copy_lowering == 'kernel' else 'memcpy nodes'}")
    print(f"  {'executor':12} {'replay':40} {'host us':>8} {'over bare':>10}")
    for kind, what, us in rows:
        ref = bare["launch only"] if what in ("launch only", "same bindings") else (
            bare["rebound, drained"] if "drained" in what else
            bare["rebound"] if "rebound" in what else None)
        over = f"{us - ref:10.2f}" if ref is not None and args.batches == 1 else f"{'-':>10}"
        print(f"  {kind:12} {what:40} {us:8.2f} {over}")
    print(f"  {'bare':12} {'launch only':40} {bare['launch only']:8.2f}")
    print(f"  {'bare':12} {'2 rebound + launch':40} {bare['rebound']:8.2f}")
    print(f"  {'bare':12} {'2 rebound + launch, timed alone':40} "
          f"{bare['rebound, drained']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

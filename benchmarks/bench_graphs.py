"""CUDA Graph executors against eager and against a bare cuda-python graph, in one run (GPU).

    python benchmarks/bench_graphs.py [--workloads 1024x0.0625,32x64] [--repeat 7]
                                      [--iters 1,4] [--replays 2000] [--json]

For each workload (batches x MiB of float32, one pinned input and one pinned output array
sliced into batches, the main job's graph: alloc -> H2D -> burn -> D2H -> free per batch,
by-engine plan on 3 streams):

1. wall time, median of ``--repeat`` runs after a warm-up, of
   - orchestra eager (``EagerExecutor.run``: enqueue every node, synchronize),
   - orchestra capture and orchestra graph-build (``GraphExec.replay(sync=True)``, no updates),
   - a bare captured graph: the same work captured by hand with raw cuda-python calls (upload /
     compute / download streams joined by events, exactly the by-engine plan), instantiated
     and launched with ``cuGraphLaunch`` (no orchestra on any path);
   host clock from the first call to the end of the synchronize; for the graphs also the GPU
   time of the launch (timing events recorded on the launch stream around ``cuGraphLaunch``)
   and GPU µs per node (that time / graph nodes), compared with the bare graph;
2. host µs per replay, median over ``--replays`` replays (enqueue only; the stream is drained
   outside the timed region every 50 launches, as bench_launch does):
   - no updates (``replay(sync=False)``: launch only),
   - one node updated (a new scalar for one kernel node),
   - all inputs and outputs rebound (two array sets alternated: every H2D and D2H node is
     updated, 2 x batches nodes),
   against the goal ``5 µs + 1 µs per updated node``; the bare ``cuGraphLaunch`` is the floor.

Every run's output is poisoned with NaN before and compared with numpy after (outside timing).
Goals printed at the end: replay host cost <= 5 µs + 1 µs per updated node; per-node GPU cost
within 10% of the bare graph; at the launch-bound workload (1,024 x 64 KiB) the graph executors
at least 3x faster than eager (wall).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

try:
    import orchestra  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

DRAIN = 50


def parse_workloads(text: str) -> list[tuple[int, float]]:
    out = []
    for item in text.split(","):
        n, mib = item.lower().split("x")
        out.append((int(n), float(mib)))
    return out


def ref(x, iters):
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


class Workload:
    def __init__(self, dev, batches: int, mib: float, iters: int, block: int = 256):
        from orchestra.driver import PinnedBuffer
        from orchestra.execute import KernelResolver
        from orchestra.job import batch_bytes_from_mib, build_job_graph, burn_grid, burn_kernel_ref

        self.dev, self.batches, self.mib, self.iters, self.block = dev, batches, mib, iters, block
        self.batch_bytes = batch_bytes_from_mib(mib)
        self.n = self.batch_bytes // 4
        self.total = self.n * batches
        self.sizes = [self.batch_bytes] * batches
        self.pins = [PinnedBuffer.empty(self.total, np.float32, dev) for _ in range(4)]
        self.x, self.y, self.x2, self.y2 = (p.array for p in self.pins)
        rng = np.random.default_rng(0)
        rng.random(out=self.x, dtype=np.float32)
        rng.random(out=self.x2, dtype=np.float32)
        self.grid = burn_grid(self.n, block, dev.sm_count)
        self.resolver = KernelResolver(dev)
        self.kernel = self.resolver.resolve(burn_kernel_ref())
        self.jg = build_job_graph(self.sizes, iters=iters, block=block, sm_count=dev.sm_count)
        self.graph = self.jg.graph
        self.bindings = {"host_in": self.x, "host_out": self.y}
        self.alt = {"host_in": self.x2, "host_out": self.y2}
        self.want = ref(self.x, iters)

    @property
    def name(self) -> str:
        kib = self.batch_bytes / 1024
        size = f"{kib:g} KiB" if kib < 1024 else f"{kib / 1024:g} MiB"
        return f"{self.batches} x {size}"

    def poison(self):
        self.y[:] = np.nan

    def verify(self) -> bool:
        return self.y.tobytes() == self.want.tobytes()

    def close(self):
        for p in self.pins:
            p.close()


class BareGraph:
    """The same work captured with raw cuda-python: no orchestra on any path."""

    def __init__(self, w: Workload):
        from cuda.bindings import driver as d

        from orchestra.driver import MemoryPool

        self.d, self.w = d, w
        w.dev.make_current()
        pool = MemoryPool.default(w.dev).handle  # configured before the capture
        ok = self._ok
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.origin = ok(d.cuStreamCreateWithPriority(flags, 0))
        up, comp, down = (ok(d.cuStreamCreateWithPriority(flags, 0)) for _ in range(3))
        ev_flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        events = [ok(d.cuEventCreate(ev_flags)) for _ in range(2 * w.batches + 2)]
        self.t0, self.t1 = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
        nb, n = w.batch_bytes, w.n
        xaddr, yaddr = w.x.ctypes.data, w.y.ctypes.data
        func = w.kernel.function
        keep = []
        ok(d.cuStreamBeginCapture(self.origin,
                                  d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        fork, join = events[-2], events[-1]
        ok(d.cuEventRecord(fork, self.origin))
        for s in (up, comp, down):
            ok(d.cuStreamWaitEvent(s, fork, 0))
        for b in range(w.batches):
            off = b * nb
            din = ok(d.cuMemAllocFromPoolAsync(nb, pool, up))
            dout = ok(d.cuMemAllocFromPoolAsync(nb, pool, up))
            ok(d.cuMemcpyHtoDAsync(din, xaddr + off, nb, up))
            ev_up, ev_k = events[2 * b], events[2 * b + 1]
            ok(d.cuEventRecord(ev_up, up))
            ok(d.cuStreamWaitEvent(comp, ev_up, 0))
            vals = (ctypes.c_uint64(int(din)), ctypes.c_uint64(int(dout)), ctypes.c_uint64(n),
                    ctypes.c_int32(w.iters), ctypes.c_float(0.5), ctypes.c_float(1.0))
            params = (ctypes.c_void_p * 6)(*[ctypes.addressof(v) for v in vals])
            keep.append((vals, params))
            ok(d.cuLaunchKernel(func, w.grid, 1, 1, w.block, 1, 1, 0, comp,
                                ctypes.addressof(params), 0))
            ok(d.cuEventRecord(ev_k, comp))
            ok(d.cuMemFreeAsync(din, comp))
            ok(d.cuStreamWaitEvent(down, ev_k, 0))
            ok(d.cuMemcpyDtoHAsync(yaddr + off, dout, nb, down))
            ok(d.cuMemFreeAsync(dout, down))
        for s in (up, comp, down):
            ok(d.cuEventRecord(join, s))
            ok(d.cuStreamWaitEvent(self.origin, join, 0))
        self.graph = ok(d.cuStreamEndCapture(self.origin))
        self.exec = ok(d.cuGraphInstantiate(self.graph, 0))
        ok(d.cuGraphUpload(self.exec, self.origin))
        self.streams, self.events = (up, comp, down), events
        self.nodes = 7 * w.batches

    @staticmethod
    def _ok(res):
        if int(res[0]):
            raise RuntimeError(f"driver call failed: {res[0]!r}")
        return res[1] if len(res) == 2 else None

    def launch(self):
        (err,) = self.d.cuGraphLaunch(self.exec, self.origin)
        if err:
            raise RuntimeError(f"cuGraphLaunch: {err!r}")

    def sync(self):
        self._ok(self.d.cuStreamSynchronize(self.origin))

    def gpu_ms(self) -> float:
        d = self.d
        self._ok(d.cuEventRecord(self.t0, self.origin))
        self.launch()
        self._ok(d.cuEventRecord(self.t1, self.origin))
        self._ok(d.cuEventSynchronize(self.t1))
        return float(self._ok(d.cuEventElapsedTime(self.t0, self.t1)))

    def close(self):
        d = self.d
        self.sync()
        d.cuGraphExecDestroy(self.exec)
        d.cuGraphDestroy(self.graph)
        for e in self.events + [self.t0, self.t1]:
            d.cuEventDestroy(e)
        for s in self.streams + (self.origin,):
            d.cuStreamDestroy(s)


def exec_gpu_ms(exe, t0, t1) -> float:
    """GPU time of one launch: timing events on the exec's stream around cuGraphLaunch."""
    from cuda.bindings import driver as d

    s = exe.stream.handle
    d.cuEventRecord(t0.handle, s)
    exe.launch()
    d.cuEventRecord(t1.handle, s)
    t1.synchronize()
    return float(d.cuEventElapsedTime(t0.handle, t1.handle)[1])


def host_us(fn, count: int, sync) -> float:
    """Median over chunks of DRAIN calls of host µs per call (drained outside the timing)."""
    per = []
    done = 0
    while done < count:
        k = min(DRAIN, count - done)
        t0 = time.perf_counter_ns()
        for _ in range(k):
            fn()
        per.append((time.perf_counter_ns() - t0) / k / 1e3)
        sync()
        done += k
    return statistics.median(per)


def bench(w: Workload, repeat: int, replays: int) -> dict:
    from orchestra.driver import Event
    from orchestra.execute import EagerExecutor
    from orchestra.execute.capture import CaptureExecutor
    from orchestra.execute.graph_build import GraphBuildExecutor

    out = {"workload": w.name, "batches": w.batches, "batch_bytes": w.batch_bytes,
           "iters": w.iters, "nodes": len(w.graph), "rows": [], "host": []}
    failures = []
    t0, t1 = Event(w.dev, timing=True), Event(w.dev, timing=True)

    # eager
    eager = EagerExecutor(w.dev, kernel_resolver=w.resolver)
    plan = eager.prepare(w.graph, policy="by-engine", streams=3)
    walls = []
    for r in range(repeat + 1):
        w.poison()
        t = time.perf_counter_ns()
        res = eager.run(w.graph, plan, w.bindings)
        dt = (time.perf_counter_ns() - t) / 1e6
        if not w.verify():
            failures.append("eager")
        if r:
            walls.append(dt)
    out["rows"].append({"executor": "eager", "wall_ms": statistics.median(walls),
                        "host_us_per_node": res.host_us_per_node})
    eager.close()

    # bare graph (raw cuda-python)
    bare = BareGraph(w)
    walls, gpus = [], []
    for r in range(repeat + 1):
        w.poison()
        t = time.perf_counter_ns()
        bare.launch()
        bare.sync()
        dt = (time.perf_counter_ns() - t) / 1e6
        if not w.verify():
            failures.append("bare graph")
        if r:
            walls.append(dt)
            gpus.append(bare.gpu_ms())
    bare_gpu = statistics.median(gpus)
    out["rows"].append({"executor": "bare cuda-python graph", "wall_ms": statistics.median(walls),
                        "gpu_ms": bare_gpu, "gpu_us_per_node": bare_gpu * 1e3 / bare.nodes})
    # many launches of a large workload would queue minutes of GPU work: fewer there
    count = replays if w.batch_bytes <= (1 << 20) else max(20, replays // 40)
    bare_launch_us = host_us(bare.launch, count, bare.sync)
    out["host"].append({"executor": "bare cuda-python graph", "what": "cuGraphLaunch only",
                        "updated_nodes": 0, "host_us": bare_launch_us})
    bare.close()

    # orchestra graphs
    for name, cls in (("capture", CaptureExecutor), ("graph-build", GraphBuildExecutor)):
        ex = cls(w.dev, kernel_resolver=w.resolver)
        t = time.perf_counter_ns()
        exe = ex.build(w.graph, plan, w.bindings)
        build_ms = (time.perf_counter_ns() - t) / 1e6
        walls, gpus = [], []
        for r in range(repeat + 1):
            w.poison()
            t = time.perf_counter_ns()
            exe.replay(sync=True)
            dt = (time.perf_counter_ns() - t) / 1e6
            if not w.verify():
                failures.append(name)
            if r:
                walls.append(dt)
                gpus.append(exec_gpu_ms(exe, t0, t1))
        gpu = statistics.median(gpus)
        out["rows"].append({"executor": f"orchestra {name}", "wall_ms": statistics.median(walls),
                            "gpu_ms": gpu, "gpu_us_per_node": gpu * 1e3 / exe.node_count,
                            "build_ms": build_ms, "instantiate_ms": exe.instantiate_ms})
        exe.synchronize()

        # host cost per replay
        no_upd = host_us(lambda: exe.replay(sync=False), count, exe.synchronize)
        kname = w.jg.batches[0].kernel.name
        flip = [w.iters, w.iters + 1]
        state = {"i": 0}

        def one_node():
            state["i"] ^= 1
            exe.replay(scalars={kname: {"iters": flip[state["i"]]}}, sync=False)

        one = host_us(one_node, count, exe.synchronize)
        exe.replay(scalars={kname: {"iters": w.iters}}, sync=True)
        sets = [w.alt, w.bindings]

        def rebind():
            state["i"] ^= 1
            exe.replay(sets[state["i"]], sync=False)

        all_io = host_us(rebind, count if w.batches <= 64 else max(50, count // 20),
                         exe.synchronize)
        exe.replay(w.bindings, sync=True)
        nio = 2 * w.batches
        for what, nodes, us in (("launch only", 0, no_upd), ("1 kernel node (scalar)", 1, one),
                                ("all inputs + outputs rebound", nio, all_io)):
            out["host"].append({"executor": f"orchestra {name}", "what": what,
                                "updated_nodes": nodes, "host_us": us,
                                "goal_us": 5 + nodes, "ok": us <= 5 + nodes})
        w.poison()
        exe.replay(sync=True)
        if not w.verify():
            failures.append(f"{name} after replays")
        exe.close()
        ex.close()
    t0.close()
    t1.close()

    eager_wall = out["rows"][0]["wall_ms"]
    for row in out["rows"]:
        row["speedup_vs_eager"] = eager_wall / row["wall_ms"]
        if "gpu_us_per_node" in row:
            row["gpu_vs_bare"] = row["gpu_us_per_node"] / (bare_gpu * 1e3 / (7 * w.batches))
    out["failures"] = failures
    return out


def print_table(header, rows):
    table = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        print("  " + "  ".join(c.rjust(wd) for c, wd in zip(r, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="1024x0.0625,32x64",
                    help="batches x MiB, comma separated (default 1024x0.0625,32x64)")
    ap.add_argument("--iters", default="1,4",
                    help="burn iterations per workload, comma separated (default 1,4)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--replays", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from orchestra.driver import Device
    from orchestra.driver.check import device_available

    if not device_available():
        print("bench_graphs: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    dev = Device.get(0)
    workloads = parse_workloads(args.workloads)
    iters = [int(i) for i in args.iters.split(",")]
    iters += [iters[-1]] * (len(workloads) - len(iters))
    results = []
    for (batches, mib), it in zip(workloads, iters):
        w = Workload(dev, batches, mib, it)
        try:
            results.append(bench(w, args.repeat, args.replays))
        finally:
            w.close()
    if args.json:
        print(json.dumps(results, indent=1))
        return 0 if not any(r["failures"] for r in results) else 1

    print(f"device: {dev.name} ({dev.arch}); wall: host clock, median of {args.repeat} runs "
          "after a warm-up; GPU: timing events around cuGraphLaunch on the launch stream")
    goals = []
    for r in results:
        print(f"\n{r['workload']} (burn iters {r['iters']}, {r['nodes']} graph nodes):")
        print_table(("executor", "wall ms", "x eager", "GPU ms", "GPU us/node", "vs bare"),
                    [(row["executor"], f"{row['wall_ms']:.3f}", f"{row['speedup_vs_eager']:.2f}",
                      f"{row['gpu_ms']:.3f}" if "gpu_ms" in row else "-",
                      f"{row['gpu_us_per_node']:.3f}" if "gpu_us_per_node" in row else "-",
                      f"{row['gpu_vs_bare']:.3f}" if "gpu_vs_bare" in row else "-")
                     for row in r["rows"]])
        print("  host cost per replay (enqueue only, median):")
        print_table(("executor", "update", "nodes", "host us", "goal us", ""),
                    [(h["executor"], h["what"], h["updated_nodes"], f"{h['host_us']:.2f}",
                      f"{h['goal_us']}" if "goal_us" in h else "-",
                      ("PASS" if h["ok"] else "MISS") if "ok" in h else "")
                     for h in r["host"]])
        for row in r["rows"]:
            if row["executor"].startswith("orchestra"):
                goals.append((f"{r['workload']}: {row['executor']} GPU/node within 10% of bare",
                              row["gpu_vs_bare"] <= 1.10))
                if r["batches"] >= 1024:
                    goals.append((f"{r['workload']}: {row['executor']} >= 3x faster than eager",
                                  row["speedup_vs_eager"] >= 3.0))
        for h in r["host"]:
            if "ok" in h:
                goals.append((f"{r['workload']}: {h['executor']} replay ({h['what']}) <= "
                              f"{h['goal_us']} us", h["ok"]))
        if r["failures"]:
            print(f"  VERIFICATION FAILED: {', '.join(r['failures'])}")
    print("\ngoals:")
    for text, ok in goals:
        print(f"  [{'PASS' if ok else 'MISS'}] {text}")
    return 0 if not any(r["failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Independent small kernels at once: a fan-out under the concurrent policy against the
one-compute-stream plan (needs a GPU).

    python benchmarks/bench_fanout.py [--width 16] [--grid 8] [--iters 20001] [--repeat 7]
                                      [--json]

The graph: ``--width`` independent ``burn`` kernels (cuda_src/burn.cu, s = -1, t = 0, so the
output is exactly -x for an odd iteration count), each ``--grid`` blocks of 256 threads on its
own slice of one external input buffer, writing its own slice of one external output buffer,
then one D2H of the whole output (the join). Each kernel is far smaller than the GPU (the
table prints its grid against the resident capacity from ``Kernel.occupancy()`` x SMs), so on
one compute stream they run one after the other while separate streams let them share the SMs.

Rows: the eager and capture executors and the graph-build executor (the plan's stream order as
edges, its default), each with ``by-engine`` on 3 streams (one compute stream) and with
``concurrent`` on width + 2 streams. Wall: host clock around run + synchronize (graph
executors: ``replay(sync=True)``), median of ``--repeat`` after one warm-up; every run's output
is poisoned with NaN first and compared with -x bit for bit after. "speed-up" is the
one-compute-stream row's wall over the concurrent row's, per executor. Expected on an H200:
about 40 ms in all; the concurrent rows several times faster than one stream.
"""

from __future__ import annotations

import argparse
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

BLOCK = 256


def build_graph(width: int, n: int, grid: int, iters: int):
    from orchestra.app.job import burn_kernel_ref
    from orchestra.graph import Buffer, DeviceToHost, HostBuffer, In, KernelNode, Out, TaskGraph

    nb = 4 * n
    x, y = Buffer("x", width * nb), Buffer("y", width * nb)
    host = HostBuffer("host_out", width * nb)
    g = TaskGraph()
    ref = burn_kernel_ref()
    for i in range(width):
        g.add(KernelNode(f"k{i}", ref, grid, BLOCK,
                         (In(x.range(i * nb, nb)), Out(y.range(i * nb, nb)), n, iters, -1.0,
                          0.0)))
    g.add(DeviceToHost("down", y, host))
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=16, help="independent kernels (16)")
    ap.add_argument("--grid", type=int, default=8, help="blocks per kernel (8)")
    ap.add_argument("--iters", type=int, default=20001,
                    help="burn iterations per element (odd: the output is -x); 20001")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per row (7)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    iters = args.iters | 1

    from orchestra.driver import Device, DeviceBuffer, PinnedBuffer, Stream
    from orchestra.errors import NoDeviceError
    from orchestra.execute import CaptureExecutor, EagerExecutor, GraphBuildExecutor
    from orchestra.execute import KernelResolver
    from orchestra.app.job import burn_kernel_ref

    try:
        dev = Device.get(0)
    except NoDeviceError as exc:
        print(f"bench_fanout: {exc}", file=sys.stderr)
        return 2
    resolver = KernelResolver(dev)
    kernel = resolver.resolve(burn_kernel_ref())
    capacity = kernel.occupancy(BLOCK) * dev.sm_count
    n = args.grid * BLOCK * 4  # one float4 per thread
    g = build_graph(args.width, n, args.grid, iters)
    total = args.width * n
    x = (np.arange(total, dtype=np.float32) % 1021) * np.float32(0.25)
    want = (x * np.float32(-1) + np.float32(0)).view(np.uint32)
    rows, failures = [], []
    with Stream(dev) as s:
        xin = DeviceBuffer.allocate(4 * total, s)
        yout = DeviceBuffer.allocate(4 * total, s)
        pin = PinnedBuffer.empty(total, np.float32, dev)
        pin.array[:] = x
        xin.copy_from_host(pin, s, sync=True)
        out = PinnedBuffer.empty(total, np.float32, dev)
        bindings = {"x": xin, "y": yout, "host_out": out.array}
        try:
            for kind in ("eager", "capture", "graph-build"):
                for policy, streams in (("by-engine", 3), ("concurrent", args.width + 2)):
                    rows.append(_row(kind, policy, streams, g, bindings, out, want, resolver,
                                     dev, args.repeat, failures,
                                     (EagerExecutor, CaptureExecutor, GraphBuildExecutor)))
        finally:
            s.synchronize()
            xin.close()
            yout.close()
            s.synchronize()
            pin.close()
            out.close()
    for r in rows:
        if r["policy"] == "concurrent":
            base = next(b for b in rows if b["executor"] == r["executor"]
                        and b["policy"] == "by-engine")
            r["speedup"] = base["wall_ms"] / r["wall_ms"]
    if args.json:
        print(json.dumps({"device": dev.name, "width": args.width, "grid": args.grid,
                          "capacity_blocks": capacity, "iters": iters, "rows": rows,
                          "failures": failures}, indent=1))
    else:
        print(f"bench_fanout: {dev.name}; {args.width} independent burn kernels of "
              f"{args.grid} blocks x {BLOCK} threads ({iters} iters); resident capacity "
              f"{capacity} blocks; wall: host clock, median of {args.repeat}")
        head = ("executor", "policy", "streams", "compute streams", "wall ms", "speed-up",
                "output")
        table = [head] + [(r["executor"], r["policy"], r["streams"], r["compute_streams"],
                           f"{r['wall_ms']:.3f}",
                           f"{r['speedup']:.2f}x" if "speedup" in r else "-",
                           "ok" if r["verified"] else "WRONG") for r in rows]
        widths = [max(len(str(t[i])) for t in table) for i in range(len(head))]
        for t in table:
            print("  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip())
        if failures:
            print(f"VERIFICATION FAILED: {', '.join(failures)}")
    return 1 if failures else 0


def _row(kind, policy, streams, g, bindings, out, want, resolver, dev, repeat, failures,
         classes):
    eager_cls, capture_cls, build_cls = classes
    walls, ok = [], True
    if kind == "eager":
        ex = eager_cls(dev, kernel_resolver=resolver)
        plan = ex.prepare(g, policy=policy, streams=streams)
        run, closer = (lambda: ex.run(g, plan, bindings)), ex.close
    else:
        ex = (capture_cls if kind == "capture" else build_cls)(dev, kernel_resolver=resolver)
        exe = ex.build(g, None, bindings, policy=policy, streams=streams)
        plan = exe.plan

        def run():
            exe.replay(sync=True)

        def closer():
            exe.close()
            ex.close()
    try:
        for r in range(repeat + 1):
            out.array[:] = np.nan
            t0 = time.perf_counter_ns()
            run()
            dt = (time.perf_counter_ns() - t0) / 1e6
            good = np.array_equal(out.array.view(np.uint32), want)
            ok &= good
            if r:
                walls.append(dt)
    finally:
        closer()
    if not ok:
        failures.append(f"{kind} {policy}")
    compute = sum(1 for sp in plan.streams if sp.role == "compute")
    return {"executor": kind, "policy": policy, "streams": len(plan.streams),
            "compute_streams": compute, "wall_ms": statistics.median(walls),
            "wall_ms_runs": walls, "verified": bool(ok), "waits": plan.wait_count}


if __name__ == "__main__":
    sys.exit(main())

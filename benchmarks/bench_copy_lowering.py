"""Host copies as copy kernels against the copy engines and a bare captured graph (needs a GPU).

    python benchmarks/bench_copy_lowering.py [--workloads 4096x4KiB@1,1024x64KiB@1,...]
                                             [--repeat 15] [--json FILE]

For each pipeline workload (``BATCHESxSIZE[@ITERS]`` as ``orchestra bench peers`` takes them:
the main job's graph, alloc -> H2D -> burn -> D2H -> free per batch; the kernel calibrated to
the copies unless ``@ITERS``), in one process on one GPU; every orchestra row runs the policy
and streams ``--policy auto`` picks for its copy lowering (round-robin lanes when most copies
are copy kernels, else by-engine on 3 streams, 4 for the graph rows when the burn kernel is
smaller than the GPU; the "plan" column):

- **bare**: the same work captured by hand with raw cuda-python (memcpy nodes, by-engine on 3
  streams; the contender ``orchestra bench peers`` calls "cuda-python bare captured graph");
- **graph auto**: orchestra's graph-build exec with ``copy_lowering="auto"`` (copies below the
  device's crossover as copy kernels: the default) and the ``auto`` policy;
- **graph auto by-engine**: the same with by-engine on 3 streams (the default before lanes);
- **graph copy-engine**: the same exec with every copy a memcpy node;
- **capture auto**: orchestra's capture exec, auto;
- **eager copy-engine** / **eager kernel**: ``EagerExecutor.run`` with each lowering (host
  enqueue µs per copy too: what a copy kernel launch costs the host against
  ``cuMemcpy*Async``).

Per contender: **host µs** (until the launch call returns, the GPU drained first; eager: the
enqueue time), **GPU ms** (timing events around one launch on its stream; eager: the wall
time), **wall ms** (launch to synchronize), medians of ``--repeat``; each output checked
against numpy once (poisoned first). The goal lines at the end (issue's goals): 1024 x 64 KiB
graph auto host <= 100 µs and GPU <= 0.85x bare; 4096 x 4 KiB graph auto wall >= 2.5x faster
than bare; from 16 MiB per copy, graph auto wall within 2% of bare. Expected on an H200: the
default workloads take about a minute (the 64 MiB ones dominate); with lanes, graph auto about
10x faster than bare at 4096 x 4 KiB and about 3x at 1024 x 64 KiB (by-engine: 2.35x, 1.56x).
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

DEFAULT = "4096x4KiB@1,1024x64KiB@1,256x1MiB@1,64x16MiB,32x64MiB"


def _events(d):
    from orchestra.app.peers.cuda_python import _ok

    return _ok(d.cuEventCreate(0)), _ok(d.cuEventCreate(0))


def measure_graph(launch, sync, stream, repeat: int) -> dict:
    """host µs, GPU ms, wall ms (medians) of ``launch()`` on CUstream ``stream``."""
    from cuda.bindings import driver as d

    from orchestra.app.peers.cuda_python import _ok

    launch()
    sync()
    host, wall, gpu = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        launch()
        t1 = time.perf_counter_ns()
        sync()
        t2 = time.perf_counter_ns()
        host.append((t1 - t0) / 1e3)
        wall.append((t2 - t0) / 1e6)
    e0, e1 = _events(d)
    try:
        for _ in range(repeat):
            _ok(d.cuEventRecord(e0, stream))
            launch()
            _ok(d.cuEventRecord(e1, stream))
            sync()
            gpu.append(float(_ok(d.cuEventElapsedTime(e0, e1))))
    finally:
        d.cuEventDestroy(e0)
        d.cuEventDestroy(e1)
    return {"host_us": statistics.median(host), "gpu_ms": statistics.median(gpu),
            "wall_ms": statistics.median(wall)}


def _plan(op) -> str:
    """``round-robin x16``: the policy and the streams the contender's plan runs on."""
    return f"{op.plan.policy} x{len(op.plan.streams)}"


def run_workload(w, dev, resolver, repeat: int, log) -> list[dict]:
    from orchestra.app.peers.cuda_python import BareGraph
    from orchestra.app.peers.harness import PipelineData
    from orchestra.app.peers.orchestra_side import OrchestraPipeline

    data = PipelineData(dev, w, resolver)
    rows = []

    def check(name):
        ok, detail = data.check(True)
        if not ok:
            log(f"  {name}: WRONG output: {detail}")
        return ok, detail

    try:
        bare = BareGraph(data)
        try:
            data.poison(True)
            bare()
            ok, detail = check("bare")
            m = measure_graph(bare.launch, bare.sync, bare.origin, repeat)
            rows.append({"contender": "bare", "plan": "by-engine x3", "copy_kernels": 0,
                         "ok": ok, **m})
        finally:
            bare.close()
        log(f"  bare: {rows[-1]}")
        for kind, lowering, policy in (("graph-build", "auto", "auto"),
                                       ("graph-build", "auto", "by-engine"),
                                       ("graph-build", "copy-engine", "auto"),
                                       ("capture", "auto", "auto")):
            streams = "auto" if policy == "auto" else 3
            op = OrchestraPipeline(data, kind, policy, streams, copy_lowering=lowering)
            try:
                exe = op.exe
                data.poison(True)
                exe.launch(sync=True)
                ok, detail = check(kind)
                m = measure_graph(exe.launch, exe.synchronize, exe.stream.handle, repeat)
                name = f"{'graph' if kind == 'graph-build' else 'capture'} {lowering}"
                if policy != "auto":
                    name += f" {policy}"
                rows.append({"contender": name, "plan": _plan(op), "reason": op.choice.reason,
                             "copy_kernels": exe.copy_kernels, "ok": ok, **m})
            finally:
                op.close()
            log(f"  {rows[-1]['contender']}: {rows[-1]}")
        for lowering in ("copy-engine", "kernel"):
            op = OrchestraPipeline(data, "eager", copy_lowering=lowering)
            try:
                ex, g, plan, b = op.ex, op.graph, op.plan, op.bindings
                data.poison(True)
                res = ex.run(g, plan, b)
                ok, detail = check("eager")
                enq, wall = [], []
                for _ in range(repeat):
                    r = ex.run(g, plan, b)
                    enq.append(r.enqueue_us)
                    wall.append(r.wall_ms)
                copies = 2 * w.batches
                rows.append({"contender": f"eager {lowering}", "plan": _plan(op),
                             "reason": op.choice.reason, "copy_kernels": res.copy_kernels,
                             "ok": ok, "host_us": statistics.median(enq),
                             "gpu_ms": None, "wall_ms": statistics.median(wall),
                             "copies": copies})
            finally:
                op.close()
            log(f"  {rows[-1]['contender']}: {rows[-1]}")
    finally:
        data.close()
    return rows


def goals(results: dict) -> list[str]:
    """The goal lines (see the module doc) for the workloads measured."""
    out = []

    def row(wname, contender):
        for r in results.get(wname, []):
            if r["contender"] == contender:
                return r
        return None

    for wname, rows in results.items():
        bare, auto = row(wname, "bare"), row(wname, "graph auto")
        if bare is None or auto is None:
            continue
        speed = bare["wall_ms"] / auto["wall_ms"]
        gpu = auto["gpu_ms"] / bare["gpu_ms"]
        line = (f"{wname}: graph auto ({auto.get('plan', '?')}) host {auto['host_us']:.0f} µs "
                f"(bare {bare['host_us']:.0f}), GPU {gpu:.2f}x bare, wall {speed:.2f}x faster "
                "than bare")
        by = row(wname, "graph auto by-engine")
        if by is not None and by.get("plan") != auto.get("plan"):
            line += (f" (by-engine x3: {bare['wall_ms'] / by['wall_ms']:.2f}x, so the auto "
                     f"policy {by['wall_ms'] / auto['wall_ms']:.2f}x faster)")
        batches, size = wname.split("@")[0].split("x")
        if wname.startswith("1024x64KiB"):
            ok = auto["host_us"] <= 100 and gpu <= 0.85
            line += f"; goal host <= 100 µs and GPU <= 0.85x: {'met' if ok else 'NOT met'}"
        elif wname.startswith("4096x4KiB"):
            line += f"; goal >= 2.5x: {'met' if speed >= 2.5 else 'NOT met'}"
        elif size.endswith("MiB") and float(size[:-3]) >= 16:
            ok = abs(auto["wall_ms"] / bare["wall_ms"] - 1) <= 0.02
            line += f"; goal within 2% of bare: {'met' if ok else 'NOT met'}"
        eng, ker = row(wname, "eager copy-engine"), row(wname, "eager kernel")
        if eng and ker:
            line += (f"; eager enqueue µs copy-engine {eng['host_us']:.0f} vs kernel "
                     f"{ker['host_us']:.0f}, wall {eng['wall_ms']:.2f} vs {ker['wall_ms']:.2f} ms")
        out.append(line)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=DEFAULT, help=f"default {DEFAULT}")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    from orchestra.app.peers.workloads import parse_workloads
    from orchestra.driver import Device
    from orchestra.execute import KernelResolver
    from orchestra.execute.copy_table import load_crossover

    from orchestra.errors import NoDeviceError

    try:
        dev = Device.get(0)
    except NoDeviceError as exc:
        print(f"bench_copy_lowering: {exc}", file=sys.stderr)
        return 2
    dev.make_current()
    resolver = KernelResolver(dev)
    table = load_crossover(dev)
    print(f"bench_copy_lowering: {dev.name}, crossover {table.source} (graph: kernels below "
          f"{table.graph_h2d} B H2D / {table.graph_d2h} B D2H; eager: {table.eager_h2d} / "
          f"{table.eager_d2h} B)", flush=True)
    results: dict = {}
    bad = False
    for w in parse_workloads(args.workloads):
        print(f"{w.name}:", flush=True)
        rows = run_workload(w, dev, resolver, args.repeat, lambda m: print(m, flush=True))
        results[w.name] = rows
        bad = bad or not all(r["ok"] for r in rows)
    print()
    head = ("workload", "contender", "plan", "copy kernels", "host µs", "GPU ms", "wall ms",
            "wall vs bare", "output")
    table_rows = []
    for wname, rows in results.items():
        bare = next(r for r in rows if r["contender"] == "bare")
        for r in rows:
            table_rows.append((wname, r["contender"], r["plan"], r["copy_kernels"],
                               f"{r['host_us']:.1f}",
                               "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.3f}",
                               f"{r['wall_ms']:.3f}", f"{bare['wall_ms'] / r['wall_ms']:.2f}x",
                               "ok" if r["ok"] else "WRONG"))
    from orchestra.app.kernels_bench.common import format_table

    print(format_table(head, table_rows))
    print()
    for line in goals(results):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev.name, "crossover": table.as_dict(),
                                               "results": results}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

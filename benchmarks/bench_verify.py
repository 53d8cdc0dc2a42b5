"""How the scheduler and the hazard verifier scale with the number of nodes (pure Python, no GPU).

    python benchmarks/bench_verify.py                  # 1k, 4k, 16k, 64k, 100k nodes
    python benchmarks/bench_verify.py --nodes 1000,4000 --budget 30

Three graph shapes, each at about N nodes:

- ``stack``: N kernels that each read one shared weights buffer and read-write one workspace
  (external buffers: no Alloc/Free), a chain through the workspace;
- ``fan``: N/2 kernels reading all of one buffer, one kernel writing all of it, N/2 kernels
  writing disjoint slices of it (the writer waits for every reader, every slice for the writer);
- ``pipeline``: `build_pipeline` batches (alloc, H2D, kernel, D2H, free; 7 nodes each) slicing
  one host input and one host output buffer, at most 6 batches holding device memory at once,
  like `orchestra run`.

Columns, in seconds: ``build`` (the `TaskGraph`), ``plan`` (``schedule(graph, "by-engine", 4)``),
``verify`` (``verify(plan, graph)``), ``check_run`` (the executors' pre-run checks, verifier
included), ``build-dag`` and ``build-plan`` (the graph-build executor's pre-CUDA checks,
``prepare_build`` with ``edges="dag"`` / ``"plan"``: translation plus `verify_graph_edges`).
``x4`` is plan + verify at this size over plan + verify at a quarter of it (the growth per 4x
nodes; linear is 4, quadratic 16). A column whose previous size took longer than ``--budget``
seconds is skipped (``-``). Every plan must verify clean: a finding stops the benchmark.

Times are the best of ``--repeat`` runs of wall time; the machine's other load shows in them.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from orchestra.graph import (
    Buffer, HostBuffer, In, InOut, KernelNode, KernelRef, Out, TaskGraph, build_pipeline,
)
from orchestra.schedule import schedule, verify

# cuda_src/burn.cu's parameters (the main job's kernel): the graph reads them, nothing compiles
K = KernelRef("cuda_src/burn.cu", "burn", params=("const float* x", "float* y", "size_t n",
                                                   "int iters", "float s", "float t"))
K_ANY = KernelRef("k.cu", "k")
SLICE = 256  # bytes per slice of the fan pattern's buffer
STREAMS = 4  # by-engine: upload, compute0, compute1, download


def stack(n: int) -> TaskGraph:
    g = TaskGraph()
    w, ws = Buffer("weights", 1 << 20), Buffer("workspace", 1 << 16)
    for i in range(n):
        g.add(KernelNode(f"k{i}", K_ANY, 1, 32, (In(w), InOut(ws))))
    return g


def fan(n: int) -> TaskGraph:
    half = max(1, n // 2)
    g = TaskGraph()
    x = Buffer("x", half * SLICE)
    for i in range(half):
        g.add(KernelNode(f"read{i}", K_ANY, 1, 32, (In(x),)))
    g.add(KernelNode("write", K_ANY, 1, 32, (Out(x),)))
    for i in range(half):
        g.add(KernelNode(f"slice{i}", K_ANY, 1, 32, (Out(x.range(i * SLICE, SLICE)),)))
    return g


def pipeline(n: int) -> TaskGraph:
    batches = max(1, n // 7)
    nbytes = 4096
    host_in, host_out = HostBuffer("host_in", batches * nbytes), HostBuffer("host_out", batches * nbytes)
    g, _ = build_pipeline(batches, nbytes, K, scalars=(1, 1.0, 0.0), host_in=host_in,
                          host_out=host_out, in_flight=6)
    return g


PATTERNS = {"stack": stack, "fan": fan, "pipeline": pipeline}
COLUMNS = ("build", "plan", "verify", "check_run", "build-dag", "build-plan")


def _timed(fn, repeat):
    best, out = None, None
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return best, out


def measure(pattern: str, n: int, repeat: int, skip: set) -> dict:
    from orchestra.execute.cuda_graph.build import prepare_build
    from orchestra.execute.prepare import check_run

    row = {}
    row["build"], graph = _timed(lambda: PATTERNS[pattern](n), 1)
    row["nodes"] = len(graph)
    row["plan"], plan = _timed(lambda: schedule(graph, "by-engine", STREAMS), repeat)
    if "verify" not in skip:
        row["verify"], findings = _timed(lambda: verify(plan, graph), repeat)
        if findings:
            sys.exit(f"{pattern} at {n} nodes: the plan has findings: {findings[0]}")
    if "check_run" not in skip:
        row["check_run"], _ = _timed(lambda: check_run(plan, graph), repeat)
    for col, edges in (("build-dag", "dag"), ("build-plan", "plan")):
        if col not in skip:
            row[col], _ = _timed(lambda: prepare_build(graph, plan=plan, edges=edges), repeat)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="1000,4000,16000,64000,100000",
                    help="comma-separated node counts (default 1000,4000,16000,64000,100000)")
    ap.add_argument("--patterns", default=",".join(PATTERNS),
                    help=f"comma-separated, of {', '.join(PATTERNS)} (default all)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per measurement, the best shown (default 3: a 2-core machine's "
                    "noise at the small sizes otherwise moves the x4 column by 2x)")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="skip a column at larger sizes once it took longer than this (s)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.nodes.split(",")]
    head = f"{'pattern':<9} {'nodes':>7} " + " ".join(f"{c:>10}" for c in COLUMNS) + f" {'x4':>6}"
    print(head)
    print("-" * len(head))
    for pattern in args.patterns.split(","):
        skip: set = set()
        seen: dict[int, float] = {}
        for n in sizes:
            row = measure(pattern, n, args.repeat, skip)
            pv = row["plan"] + row["verify"] if "verify" in row else None
            if pv is not None:
                seen[n] = pv
            growth = "-"
            if pv is not None and n // 4 in seen and seen[n // 4] > 0:
                growth = f"{pv / seen[n // 4]:.1f}"
            cells = " ".join(f"{row[c]:>10.3f}" if c in row else f"{'-':>10}" for c in COLUMNS)
            print(f"{pattern:<9} {row['nodes']:>7} {cells} {growth:>6}", flush=True)
            skip |= {c for c in COLUMNS if c in row and row[c] > args.budget}
    return 0


if __name__ == "__main__":
    sys.exit(main())

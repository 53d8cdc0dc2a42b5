"""The main job's pipeline: orchestra against hand-written loops, measured in one run (needs a GPU).

    python benchmarks/bench_pipeline.py [--repeat 7] [--workloads 32x64,256x4] [--json]

For each workload (batches x MiB of float32): one pinned input and one pinned output array,
single-batch H2D / kernel / D2H times with timing events (the kernel's iteration count calibrated
so it takes as long as the slower copy), the sustained per-item times of K back-to-back items
and the fill-aware pipeline bound made of them (docs/execution.md, "The bound"), and then,
interleaved round by round so drift hits every contender alike, each implementation of the same
work (same data, same ``burn`` kernel, same grid):

- orchestra eager, by-engine, 3 streams (and round-robin, 3 streams);
- cuda-python by hand, by-engine: upload / compute / download streams joined by events, every
  ``cuMemAllocFromPoolAsync`` / ``cuMemcpy*Async`` / ``cuLaunchKernel`` / ``cuEventRecord`` /
  ``cuStreamWaitEvent`` / ``cuMemFreeAsync`` written out, arguments packed per launch the way
  the cuda-python samples do;
- cuda-python by hand, the classic loop: batch ``b`` wholly on stream ``b % 3``;
- CuPy (if importable): the classic loop on three non-blocking CuPy streams, CuPy's memory pool,
  ``cupy.RawKernel`` compiled from the same ``burn.cu``;
- PyTorch (if importable): the classic loop on three ``torch.cuda.Stream``s, the caching
  allocator and ``copy_(non_blocking=True)``; the kernel is burn's cubin launched on torch's
  stream (``cuLaunchKernel``), since elementwise torch ops would need ``iters`` launches.

Wall time of every contender: host clock around the call that enqueues everything and
synchronizes, median of ``--repeat`` runs after one warm-up; every run's output is poisoned with
NaN before and compared with the numpy reference after (outside the timing).

The bound takes the duplex rate (an H2D and a D2H at once) where both directions overlap, so
it is what the link allows; an efficiency above 1.01 is a bug in the bound and is printed as
"BOUND BUG". Goal: orchestra by-engine >= 0.98 of the bound and never below the best
hand-written loop of the same run.
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
from bench_common import parse_workloads

GOAL = 0.98


class Workload:
    """Data, kernel, timings and reference of one (batches, MiB) workload."""

    def __init__(self, dev, batches: int, mib: float, seed: int = 0, block: int = 256):
        from orchestra.driver import PinnedBuffer, Stream
        from orchestra.execute import KernelResolver
        from orchestra.app.job import batch_bytes_from_mib, burn_grid, burn_kernel_ref
        from orchestra.app.job import data as jd
        from orchestra.app.job.sustained import items_for
        from orchestra.app.job.timing import BatchTimer

        self.dev, self.batches, self.mib, self.block = dev, batches, mib, block
        self.batch_bytes = batch_bytes_from_mib(mib)
        self.n = self.batch_bytes // 4
        self.total = self.n * batches
        self.sizes = [self.batch_bytes] * batches
        self.pin_in = PinnedBuffer.empty(self.total, np.float32, dev)
        self.pin_out = PinnedBuffer.empty(self.total, np.float32, dev)
        self.x, self.y = self.pin_in.array, self.pin_out.array
        jd.fill_uniform(self.x, seed)
        self.grid = burn_grid(self.n, block, dev.sm_count)
        self.resolver = KernelResolver(dev)
        self.kernel = self.resolver.resolve(burn_kernel_ref())
        with Stream(dev) as s:
            timer = BatchTimer(self.kernel, s, self.x[:self.n], self.y[:self.n], grid=self.grid,
                               block=block)
            try:
                self.single = timer.measure(None, items=items_for(batches, self.batch_bytes),
                                            streams=3)
            finally:
                timer.close()
        self.iters = self.single.iters
        self.bound = self.single.bound(self.sizes)
        self.bound_ms = self.bound.bound_ms
        self.reference = jd.Reference.build(self.x, self.iters)

    @property
    def name(self) -> str:
        return f"{self.batches} x {self.mib:g} MiB"

    def poison(self):
        from orchestra.app.job import data as jd
        jd.poison(self.y)

    def verify(self) -> bool:
        return self.reference.compare(self.y).ok

    def close(self):
        self.pin_in.close()
        self.pin_out.close()


# -- contenders ------------------------------------------------------------------------------


class Orchestra:
    def __init__(self, w: Workload, policy: str):
        from orchestra.execute import EagerExecutor
        from orchestra.app.job import build_job_graph

        self.name = f"orchestra eager, {policy}, 3 streams"
        self.ex = EagerExecutor(w.dev, kernel_resolver=w.resolver)
        jg = build_job_graph(w.sizes, iters=w.iters, block=w.block, sm_count=w.dev.sm_count)
        self.graph = jg.graph
        self.plan = self.ex.prepare(self.graph, policy=policy, streams=3)
        self.bindings = {"host_in": w.x, "host_out": w.y}
        self.last = None

    def __call__(self):
        self.last = self.ex.run(self.graph, self.plan, self.bindings)

    def note(self) -> str:
        return f"{self.last.host_us_per_node:.2f} us/node" if self.last else ""

    def close(self):
        self.ex.close()


# The hand-written cuda-python loops and the CuPy / PyTorch loops live in orchestra.app.peers
# (`orchestra bench peers` runs them too); this script runs them on the job's own kernel
# scalars (burn s = 0.5, t = 1, the workload's default).


# -- driver ---------------------------------------------------------------------------------


def contenders(w: Workload, skip: set[str]):
    from orchestra.app.peers import frameworks as fw
    from orchestra.app.peers import optional
    from orchestra.app.peers.cuda_python import ByHand

    out = [Orchestra(w, "by-engine"), Orchestra(w, "round-robin"), ByHand(w, "by-engine"),
           ByHand(w, "classic")]
    skipped = []
    for key, cls in (("cupy", fw.CuPyLoop), ("torch", fw.TorchLoop)):
        if key in skip:
            continue
        mod = optional.probe(key)
        if isinstance(mod, optional.Skip):
            skipped.append(f"{key}: {mod.note}")
            continue
        try:
            out.append(cls(w, mod))
        except Exception as exc:  # noqa: BLE001 - a broken optional contender is reported
            skipped.append(f"{key}: {type(exc).__name__}: {exc}")
    return out, skipped


def bench_workload(w: Workload, repeat: int, skip: set[str]) -> tuple[list[dict], list[str]]:
    impls, skipped = contenders(w, skip)
    walls = {c.name: [] for c in impls}
    ok = {c.name: True for c in impls}
    try:
        for rnd in range(repeat + 1):  # round 0: warm-up
            for c in impls:
                w.poison()
                t0 = time.perf_counter()
                c()
                wall = (time.perf_counter() - t0) * 1e3
                ok[c.name] &= w.verify()
                if rnd:
                    walls[c.name].append(wall)
        from orchestra.app.job import bound_warning

        rows = []
        for c in impls:
            wall = statistics.median(walls[c.name])
            eff = w.bound_ms / wall
            rows.append({"workload": w.name, "implementation": c.name, "wall_ms": wall,
                         "bound_ms": w.bound_ms, "efficiency": eff,
                         "bound_warning": bound_warning(eff, f"{w.name} {c.name}"),
                         "verified": ok[c.name], "note": c.note(),
                         "wall_ms_runs": walls[c.name]})
        return rows, skipped
    finally:
        for c in impls:
            c.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="32x64,256x4",
                    help="comma-separated BATCHESxMIB (default 32x64,256x4)")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per contender (7)")
    ap.add_argument("--skip", default="", help="comma-separated: cupy,torch")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from orchestra.driver import Device
    from orchestra.errors import NoDeviceError

    try:
        dev = Device.get(args.device)
    except NoDeviceError as exc:
        print(f"bench_pipeline: {exc}", file=sys.stderr)
        return 2
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    all_rows, notes, singles = [], [], []
    for batches, mib in parse_workloads(args.workloads):
        w = Workload(dev, batches, mib)
        try:
            s = w.single
            singles.append({"workload": w.name, "iters": s.iters, "t_h2d_ms": s.t_h2d_ms,
                            "t_kernel_ms": s.t_kernel_ms, "t_d2h_ms": s.t_d2h_ms,
                            "bound": w.bound.as_dict(), "bound_ms": w.bound_ms})
            rows, skipped = bench_workload(w, args.repeat, skip)
            all_rows += rows
            notes += [f"{w.name}: {x}" for x in skipped]
        finally:
            w.close()

    goals = []
    for name in dict.fromkeys(r["workload"] for r in all_rows):
        rows = {r["implementation"]: r for r in all_rows if r["workload"] == name}
        ours = rows["orchestra eager, by-engine, 3 streams"]["efficiency"]
        by_hand = max(r["efficiency"] for k, r in rows.items() if k.startswith("cuda-python"))
        goals.append({"workload": name, "orchestra": ours, "best_by_hand": by_hand,
                      "goal_met": ours >= GOAL and ours >= by_hand})
    ok = all(r["verified"] for r in all_rows)
    if args.json:
        print(json.dumps({"device": dev.name, "single_batch": singles, "rows": all_rows,
                          "goals": goals, "skipped": notes, "verified": ok}, indent=1))
    else:
        print(f"bench_pipeline: {dev.name}; wall = host clock around enqueue + synchronize, "
              f"median of {args.repeat}; bound = the fill-aware pipeline bound from sustained "
              "per-item times")
        for s in singles:
            b = s["bound"]
            su = b["sustained"]
            terms = ", ".join(f"{k} {v:.2f}" for k, v in b["terms_ms"].items())
            print(f"  {s['workload']}: burn {s['iters']} iters; single batch H2D "
                  f"{s['t_h2d_ms']:.3f} ms, kernel {s['t_kernel_ms']:.3f} ms, D2H "
                  f"{s['t_d2h_ms']:.3f} ms; sustained ({su['items']} items) H2D "
                  f"{su['h2d_ms']:.3f}, kernel {su['kernel_ms']:.3f}, D2H {su['d2h_ms']:.3f}, "
                  f"pair {su['pair_ms']:.3f} ms; bound {s['bound_ms']:.2f} ms "
                  f"({b['limiter']}-bound; {terms})")
        header = ("workload", "implementation", "wall ms", "bound ms", "efficiency",
                  "output", "note")
        table = [header] + [(r["workload"], r["implementation"], f"{r['wall_ms']:.2f}",
                             f"{r['bound_ms']:.2f}", f"{r['efficiency']:.3f}",
                             "ok" if r["verified"] else "WRONG", r["note"]) for r in all_rows]
        widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
        for row in table:
            print("  ".join(str(c).ljust(wd) for c, wd in zip(row, widths)).rstrip())
        for g in goals:
            print(f"goal {g['workload']}: orchestra by-engine {g['orchestra']:.3f} (>= {GOAL} of "
                  "the bound and "
                  f">= best by hand {g['best_by_hand']:.3f}): "
                  f"{'met' if g['goal_met'] else 'NOT met'}")
        for n in notes:
            print(f"skipped {n}")
        for r in all_rows:
            if r["bound_warning"]:
                print(f"!!! {r['bound_warning']}")
    for r in all_rows:
        if r["bound_warning"]:
            print(f"bench_pipeline: {r['bound_warning']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

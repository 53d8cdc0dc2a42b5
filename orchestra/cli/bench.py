"""`orchestra bench stages|pdl`: the kernel library's two benchmarks (need a GPU).

``stages``: the block-scope unified pipeline at 1-4 stages vs a device-to-device copy of the
same bytes (`orchestra.app.kernels_bench.stages`). ``pdl``: a chain of small dependent kernels with
and without programmatic dependent launch (`orchestra.app.kernels_bench.pdlchain`). Both print a
table (or ``--json``) and check their output against numpy; exit 1 when the output is wrong, or
with ``--check-goal`` when the benchmark's goal (printed under the table) is missed.
``--check-goal`` belongs to ``stages``, ``pdl`` and ``multigpu`` (`orchestra.app.multigpu.cli`);
``serve`` prints its goals without judging them and, like ``peers``, exits 1 only for a
wrong output.
"""

from __future__ import annotations

import argparse
import json

from orchestra.cli import progress
from orchestra.cli.exit_codes import CHECK_FAILED, OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: the kernel library (stages, pdl), serving "
                                     "(serve), orchestra against its peers (peers), several "
                                     "GPUs (multigpu)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    s = bsub.add_parser("stages", help="block-scope pipeline at 1-4 stages vs a D2D copy")
    s.add_argument("--mib", type=int, default=1024,
                   help="MiB read per launch (as many written); default 1024")
    s.add_argument("--block", type=int, default=256, help="threads per block (default 256)")
    s.add_argument("--repeats", type=int, default=20, help="timed launches per contender")
    s.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    _common(s, "the best stage count stays under 85%% of the copy's bandwidth")
    s.set_defaults(func=run_stages_cmd)

    d = bsub.add_parser("pdl", help="chain of small dependent kernels with and without PDL")
    d.add_argument("--kernels", type=int, default=1000, help="kernels in the chain (1000)")
    d.add_argument("--n", type=int, default=256, help="floats per kernel (256)")
    d.add_argument("--block", type=int, default=256, help="threads per block (256)")
    d.add_argument("--repeats", type=int, default=5, help="timed chains per mode (5)")
    d.add_argument("--gate-ms", type=float, default=None,
                   help="how long the stream is held while the host enqueues the chain"
                        " (default: 3x the measured enqueue time, at least 5 ms)")
    d.add_argument("--no-graphs", action="store_true",
                   help="time stream chains only (default: CUDA graph replays too)")
    _common(d, "a stream chain with PDL takes more than 0.7 us per kernel")
    d.set_defaults(func=run_pdl_cmd)

    from orchestra.serve.cli import register as register_serve  # options live with the engine

    register_serve(bsub)

    from orchestra.cli import peers_cmd

    peers_cmd.register(bsub)

    from orchestra.app.multigpu.cli import register as register_multigpu

    register_multigpu(bsub)


def _common(p: argparse.ArgumentParser, goal: str) -> None:
    p.add_argument("--device", type=int, default=0, help="device ordinal (0)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--check-goal", action="store_true", help=f"exit 1 when {goal}")
    p.set_defaults(no_device_hint=" (orchestra bench runs kernels: it needs an NVIDIA GPU)")


def run_stages_cmd(args: argparse.Namespace) -> int:
    from orchestra.app.kernels_bench.common import format_table
    from orchestra.app.kernels_bench.stages import GOAL_PERCENT, run_stages

    with progress.task("bench stages") as update:
        rep = run_stages(mib=args.mib, block=args.block, repeats=args.repeats,
                         warmup=args.warmup, device=args.device,
                         progress=progress.reporter(update, "bench stages"))
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print(f"orchestra bench stages: {rep.device}, {rep.mib} MiB in + {rep.mib} MiB out per"
              f" launch, block {args.block}, median of {rep.repeats}")
        rows = [("D2D copy", f"{rep.copy_ms:.3f}", f"{rep.copy_gbps:.0f}", "100.0", "", "", "",
                 "")]
        for r in rep.results:
            rows.append((f"{r.stages} stage" + ("s" if r.stages > 1 else ""), f"{r.ms:.3f}",
                         f"{r.gbps:.0f}", f"{r.percent_of_copy:.1f}", r.blocks_per_sm, r.grid,
                         r.shared_mem, "ok" if r.verified else "WRONG"))
        print(format_table(("", "ms", "GB/s", "% of copy", "blocks/SM", "grid", "smem/block",
                            "output"), rows))
        best = rep.best
        print(f"best: {best.stages} stage(s) at {best.percent_of_copy:.1f}% of the copy"
              f" (goal >= {GOAL_PERCENT:.0f}%: {'met' if rep.goal_met else 'NOT met'});"
              " GB/s counts bytes read + written")
        for r in rep.results:
            if not r.verified:
                print(f"  {r.stages} stages: {r.detail}")
    if not rep.verified:
        return CHECK_FAILED
    return CHECK_FAILED if args.check_goal and not rep.goal_met else OK


def run_pdl_cmd(args: argparse.Namespace) -> int:
    from orchestra.app.kernels_bench.common import format_table
    from orchestra.app.kernels_bench.pdlchain import BUILD_GOAL_US, GOAL_US, run_pdl_chain

    with progress.task("bench pdl") as update:
        rep = run_pdl_chain(kernels=args.kernels, n=args.n, block=args.block,
                            repeats=args.repeats, gate_ms=args.gate_ms, graphs=not args.no_graphs,
                            device=args.device, progress=progress.reporter(update, "bench pdl"))
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    else:
        print(f"orchestra bench pdl: {rep.device}, chain of {rep.kernels} dependent kernels"
              f" (y = x + 1, {rep.n} floats, grid {rep.grid} x block {rep.block}),"
              f" median of {rep.repeats}")
        rows = [(r.mode, r.kernel, "yes" if r.pdl else "no", f"{r.us_per_kernel:.3f}",
                 f"{r.chain_ms:.3f}", f"{r.host_enqueue_ms:.2f}",
                 f"{r.gate_ms:.1f}" if r.mode == "stream" else "-",
                 ("yes" if r.host_bound else "no") if r.mode == "stream" else "-",
                 "-" if r.programmatic_edges is None else r.programmatic_edges,
                 "ok" if r.verified else "WRONG")
                for r in rep.results]
        print(format_table(("mode", "link kernel", "PDL", "GPU us/kernel", "chain ms",
                            "host ms", "gate ms", "host-bound", "prog. edges", "output"), rows))
        off = rep.best(False, "stream")
        for mode in ("stream", "graph", "graph-build"):
            on = rep.best(True, mode)
            if on is None:
                continue
            base = rep.best(False, mode) or off
            saved = f"saves {base.us_per_kernel - on.us_per_kernel:.3f} us per kernel; " \
                if base is not None else ""
            if mode == "stream":
                goal = f"goal <= {GOAL_US} us: {'met' if rep.goal_met else 'NOT met'}"
            elif mode == "graph-build":
                goal = (f"goal <= {BUILD_GOAL_US} us (programmatic edges): "
                        f"{'met' if rep.build_goal_met else 'NOT met'}")
            else:
                goal = f"goal <= {GOAL_US} us (judged on stream)"
            print(f"{mode}: best with PDL {on.us_per_kernel:.3f} us/kernel ({on.kernel}); {saved}"
                  f"{goal}")
            if on.detail and "edges" in on.detail:
                print(f"  {mode} edges: {on.detail.split('edges ', 1)[1]}")
        for r in rep.results:
            if not r.verified:
                print(f"  {r.mode} {r.kernel} pdl={r.pdl}: {r.detail}")
            if r.host_bound:
                print(f"  {r.mode} {r.kernel} pdl={r.pdl}: the host was still enqueueing when"
                      " the gate opened: the GPU time includes host gaps; raise --gate-ms")
    if not rep.verified:
        return CHECK_FAILED
    return CHECK_FAILED if args.check_goal and not rep.goal_met else OK

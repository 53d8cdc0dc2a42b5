"""`orchestra run`: the main job on the GPU (see `orchestra.app.job.main_job`).

Generates float32 batches (or streams ``--input FILE.npy``), measures single-batch H2D, kernel
and D2H times with timing events, runs the pipeline ``--repeat`` times with NaN-poisoned outputs,
verifies every element against numpy and prints: batches, bytes moved, wall ms (median), the
fill-aware pipeline bound from sustained per-item times (docs/execution.md, "The bound"),
efficiency = bound / wall, host µs per node and PASS/FAIL (``--json``: one JSON object); an
efficiency above 1.01 prints a BOUND BUG banner. Exit 0 on PASS, 1 on a mismatch, 3 without a
GPU (the message points to `orchestra plan`); options are checked as `orchestra plan` checks
them (`orchestra.cli.job_options`), and against the device, before any work.
``--trace FILE.json`` / ``--plot FILE.png``: one
extra traced run after the timed ones, written as a Chrome trace / Gantt chart and summarized
(`orchestra.cli.trace_out`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from orchestra.cli import progress
from orchestra.cli.exit_codes import CHECK_FAILED, OK, UsageError
from orchestra.errors import counted
from orchestra.cli.job_options import (
    DEFAULT_STAGING_SLOTS, add_graph_options, check_device, check_options, device_budget,
    fmt_bytes,
    nonnegative_int, positive_int, same_file,
)

log = logging.getLogger(__name__)

EXECUTORS = ("eager", "capture", "graph")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the main job on the GPU: batched H2D -> kernel -> D2H, "
                                   "timed against the overlap bound and verified")
    add_graph_options(p)
    p.add_argument("--output", metavar="FILE.npy",
                   help="with --input: where to write the result (default: a temporary file)")
    p.add_argument("--repeat", type=positive_int, default=5,
                   help="timed runs; the wall time is their median (default 5)")
    p.add_argument("--warmup", type=nonnegative_int, default=1,
                   help="untimed, verified runs first (1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated input (0)")
    p.add_argument("--executor", choices=EXECUTORS, default="eager",
                   help="eager (default: enqueue every node), capture (stream capture into a "
                        "CUDA graph) or graph (a CUDA graph built node by node); the graph "
                        "executors build once and replay every run")
    p.add_argument("--graph-dot", metavar="FILE",
                   help="with --executor capture|graph: write the CUDA graph as DOT "
                        "(cuGraphDebugDotPrint)")
    p.add_argument("--trace", metavar="FILE.json",
                   help="after the timed runs, run once more with tracing and write a Chrome "
                        "trace (open in ui.perfetto.dev); prints busy time per engine, overlap "
                        "and efficiency")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the traced run as a Gantt chart (needs matplotlib)")
    p.add_argument("--device", type=nonnegative_int, default=0, help="device ordinal (0)")
    p.add_argument("--no-verify-plan", action="store_true",
                   help="skip the hazard verifier before the first run")
    p.set_defaults(func=run, no_device_hint="; `orchestra plan` shows the same plan without a GPU")


def run(args: argparse.Namespace) -> int:
    from orchestra.execute import AVAILABLE_EXECUTORS

    if args.executor not in AVAILABLE_EXECUTORS:
        raise UsageError(f"--executor {args.executor} is not available yet; use "
                         f"--executor {' | '.join(AVAILABLE_EXECUTORS)}")
    if args.graph_dot and args.executor == "eager":
        raise UsageError("--graph-dot needs --executor capture or graph (the eager executor "
                         "builds no CUDA graph)")
    if args.output and not args.input:
        raise UsageError("--output needs --input (the generated data is verified in memory)")
    if args.output:
        if same_file(args.input, args.output):
            # the output is opened for writing (truncated) while the input is still read
            raise UsageError(f"--output {args.output} is the --input file: writing the result "
                             "would overwrite the input before it is read; pass another "
                             "--output")
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            raise UsageError(f"--output {args.output}: the folder {folder} does not exist")
    if args.input and args.seed != 0:
        log.warning("--seed does not apply with --input: the file is the input")
    input_elements = None
    if args.input:
        from orchestra.app.job.inputs import open_input

        input_elements = open_input(args.input).size  # the checks `orchestra plan` makes too
    needs = check_options(args, "run", input_elements)
    from orchestra.cli.trace_out import check_outputs

    problem = check_outputs(args.trace, args.plot)
    if problem:
        raise UsageError(problem)
    from orchestra.driver import Device
    from orchestra.app.job import MainJob

    dev = Device.get(args.device)  # NoDeviceError here: exit 3 before any work
    check_device(args, needs, dev)
    with progress.task("run") as update:
        job = MainJob(batches=needs["batches"], batch_mib=args.batch_mib, streams=args.streams,
                      policy=args.policy, compute_iters=args.compute_iters, repeat=args.repeat,
                      seed=args.seed, executor=args.executor, device=dev, input=args.input,
                      output=args.output, warmup=args.warmup, block=args.block,
                      verify_plan=not args.no_verify_plan,
                      staging_slots=args.staging_slots or DEFAULT_STAGING_SLOTS,
                      graph_dot=args.graph_dot, trace=bool(args.trace or args.plot),
                      progress=progress.reporter(update, "run"),
                      copy_lowering=args.copy_lowering, device_budget=device_budget(args))
        report = job.run()
    log.debug("run: %s", {k: v for k, v in report.as_dict().items() if k in (
        "nodes", "events", "waits", "wall_ms", "verified")})
    trace_info = None
    if report.timeline is not None:
        from orchestra.cli.trace_out import write_outputs

        trace_info = write_outputs(report.timeline, trace_path=args.trace, plot_path=args.plot,
                                   bound_ms=report.bound_ms)
    if args.json:
        d = report.as_dict()
        if trace_info is not None:
            d["trace"] = trace_info
        print(json.dumps(d, indent=1, sort_keys=True))
        if report.bound_warning:
            log.error("%s", report.bound_warning)  # stderr, even with -q
    else:
        print_report(report)
        if trace_info is not None:
            from orchestra.cli.trace_out import format_trace

            print()
            print(format_trace(report.timeline, trace_info))
    return CHECK_FAILED if not report.verified else OK


def format_table(header, rows) -> str:
    table = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table)


def print_report(r) -> None:
    from orchestra.app.job.bound import LAUNCH_NOTES

    src = f"{r.input} -> {r.output or 'a temporary file'}" if r.input else f"seed {r.seed}"
    print(f"orchestra run: {r.device}, executor {r.executor}, policy {r.policy}, "
          f"{counted(r.streams, 'stream')}, {src}")
    if r.policy_reason:
        print(f"policy choice: {r.policy_reason}")
    how = "auto" if r.compute_iters_auto else "given"
    print(f"single batch ({fmt_bytes(r.batch_bytes)}): H2D {r.t_h2d_ms:.3f} ms, kernel "
          f"{r.t_kernel_ms:.3f} ms (burn, {r.compute_iters} iters, {how}), D2H {r.t_d2h_ms:.3f} ms")
    if r.routing_check is not None:
        print(f"routing check (3 iters, output still depends on input): "
              f"{'PASS' if r.routing_check else 'FAIL'}")
    print()
    print(format_table(
        ("batches", "bytes moved", "wall ms", "bound ms", "efficiency", "host us/node", "result"),
        [(r.batches, fmt_bytes(r.bytes_moved), f"{r.wall_ms:.3f}", f"{r.bound_ms:.3f}",
          f"{r.efficiency:.3f}", f"{r.host_us_per_node:.2f}", "PASS" if r.verified else "FAIL")]))
    print()
    runs = ", ".join(f"{w:.2f}" for w in r.wall_ms_runs)
    print(f"wall ms: median of {counted(r.repeat, 'run')} ({runs}); host clock from the first enqueue to "
          "the end of the synchronize")
    if r.sustained:
        su = r.sustained
        spread = (f", the faster of 1 and {su['streams']} streams (the plan's concurrency)"
                  if su.get("streams", 1) > 1 else "")
        launched = LAUNCH_NOTES.get(su.get("launch", "stream"), "")
        print(f"sustained per batch ({su['items']} back-to-back{spread}, {launched}, GPU time "
              f"behind a gate): H2D {su['h2d_ms']:.4f} ms, kernel {su['kernel_ms']:.4f} ms, D2H "
              f"{su['d2h_ms']:.4f} ms, H2D + D2H at once {su['pair_ms']:.4f} ms per pair"
              + (f" ({su['copies']})" if su.get("copies") else ""))
        chain = [su.get(f"{k}_chain_ms") for k in ("h2d", "kernel", "d2h")]
        if None not in chain:
            print(f"one batch's chain step by step (the same items on one stream; the bound's "
                  f"fill and drain): H2D {chain[0]:.4f} ms, kernel {chain[1]:.4f} ms, D2H "
                  f"{chain[2]:.4f} ms")
    if r.bound_terms:
        terms = ", ".join(f"{k} {v:.3f}" for k, v in r.bound_terms.items())
        print(f"bound = the largest of ({terms}) ms: {r.bound_limiter}-bound; efficiency = "
              "bound / wall (docs/execution.md, \"The bound\")")
    if r.copy_kernels:
        print(f"copies: {r.copy_kernels} per run ran as copy kernels (--copy-lowering "
              f"{r.copy_lowering}); each sustained copy time is the faster of the copy "
              "engines and the copy kernel")
    if r.bound_warning:
        banner = "!" * 78
        print(f"{banner}\n{r.bound_warning}\n{banner}")
        log.error("%s", r.bound_warning)  # stderr too, even with -q
    if not r.verified:
        print(f"verification: {r.check}")

"""`orchestra bench peers`: orchestra against hand-written cuda-python, CuPy and PyTorch on the
same GPU, in one process, with the same kernel source (`orchestra.app.peers`).

Registered under `orchestra bench` by `orchestra.cli.bench`. Prints the table (or ``--json``),
optionally draws the ratios (``--plot FILE.png``, needs matplotlib); exit 0 when every output
matched, 1 when one did not or when an efficiency exceeded 1.01 (a bug in the bound, printed
loudly), 2 for bad options, 3 without a GPU (`orchestra.cli.exit_codes`). A progress bar on a
terminal (`orchestra.cli.progress`); ``-v`` logs each step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from orchestra.app.peers.workloads import BUILTIN, DEFAULT
from orchestra.cli import progress
from orchestra.cli.exit_codes import CHECK_FAILED, OK, UsageError


def _epilog() -> str:
    lines = ["workloads (expected wall on an H200, setup and output checks included):"]
    for w in BUILTIN:
        lines.append(f"  {w.key}  {w.name:<11} ~{w.expected_s:.0f} s  {_what(w)}")
    total = sum(w.expected_s for w in BUILTIN)
    lines.append(f"  the default (all five): ~{total:.0f} s; a custom pipeline is "
                 "BATCHESxSIZE[@ITERS], e.g. 64x1MiB or 512x256KiB@1")
    lines.append("contenders: orchestra eager / capture / graph-build; cuda-python classic "
                 "loop, by-engine with events, bare captured graph; CuPy (RawKernel, "
                 "non-blocking streams, stream capture); PyTorch (streams, pinned tensors, "
                 "torch.cuda.graph). A peer that is not installed is skipped with a note.")
    return "\n".join(lines)


def _what(w) -> str:
    if w.kind == "pipeline":
        kernel = "calibrated kernel" if w.iters is None else f"kernel of {w.iters} iteration"
        return f"pipeline, {w.batches} batches, {kernel}"
    if w.kind == "request":
        return f"one request, p50 / p99 of {w.requests}"
    return f"{w.kernels} dependent tiny kernels, with and without PDL"


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "peers", help="orchestra vs cuda-python, CuPy and PyTorch on the same GPU and kernels",
        description="Every contender on every workload, interleaved round by round, every "
                    "output checked against numpy; wall ms (median of --repeat after a "
                    "warm-up), efficiency against the fill-aware bound from sustained times, "
                    "host us per node, and each row's ratio to orchestra's best.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=DEFAULT, metavar="LIST",
                   help=f"comma-separated keys or names (default {DEFAULT}; 'all' = the five)")
    p.add_argument("--repeat", type=int, default=5,
                   help="timed runs per contender after one warm-up (default 5, at least 5 "
                        "for a median worth quoting)")
    p.add_argument("--skip", default="", metavar="PEERS",
                   help="comma-separated peers to leave out: cupy,torch")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw each row's ratio to orchestra's best (needs matplotlib)")
    p.add_argument("--workload-timeout", type=float, default=240.0, metavar="S",
                   help="seconds before a workload counts as hung: every stack dumped, exit "
                        "1 (default 240; 0 = none)")
    p.add_argument("--device", type=int, default=0, help="device ordinal (0)")
    p.set_defaults(func=run, no_device_hint=" (orchestra bench peers runs kernels: it needs an "
                                            "NVIDIA GPU)")


def check_plot_path(path) -> str | None:
    """Why ``--plot path`` cannot be written (before any GPU work), or None."""
    if not path:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        from orchestra.app.peers.report import MISSING_MATPLOTLIB

        return MISSING_MATPLOTLIB
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder):
        return f"--plot {path}: the folder {folder} does not exist"
    return None


def parse_skip(text: str) -> set[str]:
    from orchestra.app.peers.optional import PEERS

    out = {t.strip().lower() for t in text.split(",") if t.strip()}
    unknown = out - set(PEERS)
    if unknown:
        raise UsageError(f"--skip {','.join(sorted(unknown))}: unknown peer; choose from "
                         f"{', '.join(PEERS)}")
    return out


def run(args: argparse.Namespace) -> int:
    from orchestra.app.peers.workloads import parse_workloads
    from orchestra.errors import BenchConfigError

    try:
        workloads = parse_workloads(args.workloads)
    except BenchConfigError as exc:
        raise UsageError(str(exc)) from None
    skip = parse_skip(args.skip)
    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat}: need at least 1 timed run")
    problem = check_plot_path(args.plot)
    if problem:
        raise UsageError(problem)
    from orchestra.app.peers.harness import run_peers
    from orchestra.driver import Device

    dev = Device.get(args.device)  # NoDeviceError here: exit 3 before any work
    with progress.task("bench peers") as update:
        report = run_peers(workloads, repeat=args.repeat, device=dev, skip=skip,
                           progress=progress.reporter(update, "bench peers"),
                           workload_timeout_s=args.workload_timeout or None)
    if args.plot:
        from orchestra.app.peers.report import plot_ratios

        plot_ratios(report.rows, args.plot, title=f"orchestra bench peers: {report.device}")
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(report.format())
        if args.plot:
            print(f"ratio chart: {args.plot}")
    for bug in report.bound_bugs:
        print(f"orchestra bench peers: {bug}", file=sys.stderr)
    return OK if report.verified and not report.bound_bugs else CHECK_FAILED

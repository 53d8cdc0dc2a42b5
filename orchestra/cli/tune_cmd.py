"""`orchestra tune copies`: measure this device's copy-lowering crossover and keep it (needs a
GPU).

Runs `orchestra.execute.copy_tuning.measure_copy_crossover`: the main job's pipeline at copy
sizes 4 KiB - 4 MiB (``--quick``: 4 KiB, 64 KiB, 1 MiB), as a CUDA graph and eagerly, with every
copy on the copy engines, the H2D copies as copy kernels, the D2H copies as copy kernels, and
every copy as a copy kernel;
prints the median wall ms of each and the crossover per mode and direction, and stores the table
in orchestra's cache for this device (``--no-save``: print only), where every executor's
``copy_lowering="auto"`` finds it. Exit 1 when an output was wrong (nothing is saved then).
"""

from __future__ import annotations

import argparse
import json

from orchestra.cli import progress
from orchestra.cli.exit_codes import CHECK_FAILED, OK
from orchestra.cli.job_options import nonnegative_int, positive_int
from orchestra.errors import counted


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="measure device-specific choices and keep them (copies)")
    tsub = p.add_subparsers(dest="tune_command", metavar="WHAT", required=True)
    c = tsub.add_parser("copies", help="where host copies stop being worth a copy kernel "
                                       "(about 10-20 s; --quick about 5 s)",
                        description="Measure, per executor mode and direction, the copy size "
                                    "below which a copy kernel beats the copy engines, and "
                                    "keep it for this device (copy_lowering='auto').")
    c.add_argument("--quick", action="store_true", help="3 sizes instead of 6")
    c.add_argument("--repeats", type=positive_int, default=7,
                   help="timed runs per variant (7)")
    c.add_argument("--mode", choices=("both", "graph", "eager"), default="both",
                   help="which crossover to measure (default both)")
    c.add_argument("--no-save", action="store_true", help="print the result, keep nothing")
    c.add_argument("--device", type=nonnegative_int, default=0, help="device ordinal (0)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=run_copies, no_device_hint=" (orchestra tune runs copies on the GPU)")


def run_copies(args: argparse.Namespace) -> int:
    from orchestra.execute.copy_tuning import VARIANTS, measure_copy_crossover
    from orchestra.execute.lowering.copy_policy import fmt_bytes

    modes = ("graph", "eager") if args.mode == "both" else (args.mode,)
    with progress.task("tune copies") as update:
        rep = measure_copy_crossover(args.device, quick=args.quick, repeats=args.repeats,
                                     modes=modes, save=not args.no_save,
                                     progress=progress.reporter(update, "tune copies"))
    if args.json:
        print(json.dumps(rep.as_dict(), indent=1, sort_keys=True))
        return OK if rep.verified else CHECK_FAILED
    from orchestra.cli.run_cmd import format_table

    print(f"orchestra tune copies: {rep.device}, the pipeline (H2D -> kernel -> D2H per batch, "
          f"by-engine, 3 streams), median wall ms of {counted(args.repeats, 'run')}")
    rows = []
    for r in rep.rows:
        eng = r.ms["copy-engine"]
        rows.append((r.mode, fmt_bytes(r.size), r.batches,
                     *(f"{r.ms[v]:.3f}" for v in VARIANTS),
                     f"{r.ms['h2d-kernel'] / eng:.2f}", f"{r.ms['d2h-kernel'] / eng:.2f}",
                     f"{r.ms['both-kernel'] / eng:.2f}", "ok" if r.verified else "WRONG"))
    print(format_table(("mode", "copy", "batches", "copy engines", "H2D kernel", "D2H kernel",
                        "both kernels", "H2D ratio", "D2H ratio", "both ratio", "output"), rows))
    c = rep.crossover
    for mode in modes:
        print(f"{mode}: copy kernels below {fmt_bytes(c.threshold(mode, 'h2d'))} (H2D), "
              f"{fmt_bytes(c.threshold(mode, 'd2h'))} (D2H)")
    if rep.saved:
        print(f"saved for this device: {rep.saved} ({rep.seconds:.1f} s)")
    elif not rep.verified:
        print("an output was WRONG: nothing saved")
    else:
        print(f"not saved ({'--no-save' if args.no_save else 'the cache is off'}; "
              f"{rep.seconds:.1f} s)")
    return OK if rep.verified else CHECK_FAILED

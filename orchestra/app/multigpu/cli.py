"""``orchestra bench multigpu``: the options and the printed table (`bench.run_multigpu`)."""

from __future__ import annotations

import argparse
import json

from orchestra.cli.exit_codes import CHECK_FAILED, OK

GOALS = ("peer copy >= 97% of cuMemcpyPeerAsync both ways; all-reduce bus bandwidth >= 97% "
         "of NCCL direct at >= 64 MiB; the captured step >= 1.5x faster than eager at 1 MiB")


def register(bsub) -> None:
    p = bsub.add_parser("multigpu", help="peer copies, NCCL all-reduce and the data-parallel "
                                         "step vs cuda-python and NCCL driven directly")
    p.add_argument("--peer-mib", type=int, default=256, help="MiB per peer copy (256)")
    p.add_argument("--sizes-mib", default="1-1024",
                   help="all-reduce sizes: LO-HI (powers of two between) or a comma list of "
                        "MiB (default 1-1024)")
    p.add_argument("--step-mib", type=float, default=1.0, help="MiB per shard of the step (1)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per contender (5)")
    p.add_argument("--iters", type=int, default=10, help="operations per timed repeat (10)")
    p.add_argument("--devices", default=None,
                   help="comma list of device ordinals (default: every visible GPU)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--check-goal", action="store_true",
                   help="exit 1 unless: " + GOALS.replace("%", "%%"))
    p.set_defaults(func=run_multigpu_cmd,
                   no_device_hint=" (orchestra bench runs kernels: it needs an NVIDIA GPU)")


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"1-1024"`` -> 1, 2, 4 .. 1024 MiB; ``"1,64,256"`` -> those (bytes)."""
    from orchestra.errors import BenchConfigError

    mib = 1 << 20
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            out, v = [], lo
            while v <= hi:
                out.append(v)
                v *= 2
        else:
            out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchConfigError(f"--sizes-mib {text!r}: write LO-HI or a comma list") from None
    if not out or min(out) < 1:
        raise BenchConfigError(f"--sizes-mib {text!r}: sizes are whole MiB >= 1")
    return tuple(v * mib for v in out)


def goal_met(rep) -> bool | None:
    """None when the goals cannot be judged here (fewer than two GPUs)."""
    if rep.ranks < 2:
        return None
    checks = [rep.ratio("peer copy both ways", "orchestra PeerCopy",
                        "cuda-python cuMemcpyPeerAsync")]
    for r in rep.rows:
        if r.part == "all-reduce" and r.contender == "orchestra eager" and \
                r.size_bytes >= 64 << 20:
            checks.append(rep.ratio("all-reduce", "orchestra eager", "NCCL direct (nccl4py)",
                                    r.size_bytes))
    step = {r.contender: r.ms for r in rep.rows if r.part == "data-parallel step"}
    ok = all(c is not None and c >= 0.97 for c in checks)
    if step:
        ok = ok and step["orchestra eager"] >= 1.5 * step["orchestra graph (captured)"]
    return ok


def run_multigpu_cmd(args: argparse.Namespace) -> int:
    from orchestra.app.kernels_bench.common import format_table
    from orchestra.app.multigpu.bench import run_multigpu
    from orchestra.cli import progress

    devices = None if args.devices is None else [int(x) for x in args.devices.split(",")]
    with progress.task("bench multigpu") as update:
        rep = run_multigpu(peer_mib=args.peer_mib, sizes=parse_sizes(args.sizes_mib),
                           step_mib=args.step_mib, repeats=args.repeats, iters=args.iters,
                           devices=devices, progress=progress.reporter(update, "bench multigpu"))
    met = goal_met(rep)
    if args.json:
        d = rep.as_dict()
        d["goal_met"] = met
        print(json.dumps(d, indent=2))
    else:
        nccl = f", NCCL {rep.nccl_version}" if rep.nccl_version else ""
        print(f"orchestra bench multigpu: {rep.ranks} GPU(s) {rep.devices}{nccl}; median of "
              f"{args.repeats}, {args.iters} operations per repeat")
        rows = []
        for r in rep.rows:
            size = f"{r.size_bytes / (1 << 20):g} MiB"
            alg = "" if r.algbw is None else f"{r.algbw:.1f}"
            rows.append((r.part, r.contender, size, f"{r.ms:.4f}", f"{r.gbps:.1f}", alg,
                         "ok" if r.verified else "WRONG"))
        print(format_table(("part", "contender", "size", "ms", "GB/s (bus for all-reduce)",
                            "algbw GB/s", "output"), rows))
        for s in rep.skipped:
            print(f"skipped: {s}")
        print(f"goals ({GOALS}): " + ("not judged (needs two GPUs)" if met is None
                                      else "met" if met else "NOT met"))
    if not rep.verified:
        return CHECK_FAILED
    return CHECK_FAILED if args.check_goal and met is False else OK

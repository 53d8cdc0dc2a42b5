"""`orchestra compile FILE.cu --arch sm_90 [-o OUT.cubin] [--ptx]`: NVRTC to a cubin (or PTX).

Runs on a machine without a GPU when `--arch` is given. Uses the on-disk cubin cache.
"""

from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile a CUDA C++ file (or link a .ptx file) to a cubin")
    p.add_argument("file", type=Path, help="a .cu source file, or a .ptx file to link with nvJitLink")
    p.add_argument("--arch", help="target, e.g. sm_90 (default: the current GPU; required without one)")
    p.add_argument("-o", "--output", type=Path, help="where to write the cubin/PTX (default: FILE.cubin)")
    p.add_argument("--ptx", action="store_true", help="emit PTX for compute_XX instead of a cubin")
    p.add_argument("--name-expression", action="append", default=[], metavar="EXPR",
                   help="instantiate a template kernel, e.g. 'pipeline_block<2>' (repeatable)")
    p.add_argument("-O", "--option", action="append", default=[], metavar="OPT",
                   help="extra NVRTC option, e.g. -O=-lineinfo (repeatable)")
    p.set_defaults(func=run)


def run(args) -> int:
    from orchestra.compiler import compile as nvrtc_compile, link_ptx

    if not args.file.is_file():
        print(f"orchestra compile: no such file: {args.file}", file=sys.stderr)
        return 2
    if args.file.suffix == ".ptx":
        if args.ptx:
            print("orchestra compile: --ptx makes no sense for a .ptx input", file=sys.stderr)
            return 2
        if not args.arch:
            from orchestra.driver import Device
            args.arch = Device.get().arch
        data, what, extra = link_ptx(args.file, arch=args.arch), "cubin", ""
    else:
        result = nvrtc_compile(args.file, arch=args.arch, options=tuple(args.option),
                               name_expressions=tuple(args.name_expression), ptx=args.ptx)
        data = result.cubin
        what = "PTX" if args.ptx else "cubin"
        extra = " (cache hit)" if result.cache_hit else ""
        for expr, lowered in result.lowered_names.items():
            print(f"{expr} -> {lowered}")
        if result.log.strip():
            print(result.log.rstrip(), file=sys.stderr)
    out = args.output or args.file.with_suffix(".ptx" if args.ptx else ".cubin")
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes, {what} for {args.arch or 'the current GPU'}){extra}")
    return 0

"""`orchestra compile FILE.cu --arch sm_90 [-o OUT.cubin] [--ptx]`: NVRTC to a cubin (or PTX);
`orchestra compile FILE.ptx --arch sm_90 [-o OUT.cubin]`: nvJitLink to a cubin.

Runs on a machine without a GPU when `--arch` is given. Uses the on-disk cubin cache.
"""

from __future__ import annotations

import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile a CUDA C++ file (or link a .ptx file) to a cubin")
    p.add_argument("file", type=Path,
                   help="a .cu source file, or a .ptx file to link with nvJitLink; a bare name "
                        "such as burn.cu is also looked up among the kernels orchestra ships")
    p.add_argument("--arch", help="target, e.g. sm_90 (default: the current GPU; required without one)")
    p.add_argument("-o", "--output", type=Path, help="where to write the cubin/PTX (default: FILE.cubin)")
    p.add_argument("--ptx", action="store_true", help="emit PTX for compute_XX instead of a cubin")
    p.add_argument("--name-expression", action="append", default=[], metavar="EXPR",
                   help="instantiate a template kernel, e.g. 'pipeline_block<2>' (repeatable; "
                        ".cu input only)")
    p.add_argument("-O", "--option", action="append", default=[], metavar="OPT",
                   help="extra NVRTC option, e.g. -O=-lineinfo (repeatable; .cu input only)")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    """Refuse the command line (exit 2; printed by `orchestra.cli.main`, as JSON under --json)."""
    from orchestra.cli.exit_codes import UsageError

    raise UsageError(message)


def _find_input(path: Path) -> Path:
    """``path`` as given, else a kernel shipped with orchestra of that name (``burn.cu``,
    ``cp_async.ptx``), else ``path`` unchanged (reported missing by the caller)."""
    if path.exists() or path.is_absolute():
        return path
    from orchestra.compiler.sources import kernel_source_dir, ptx_source_dir, resolve_path

    return resolve_path(path, (kernel_source_dir(), ptx_source_dir())) or path


def _current_arch() -> str | None:
    """The current GPU's architecture, or None without a GPU or driver."""
    from orchestra.driver import Device
    from orchestra.errors import NoDeviceError

    try:
        return Device.get().arch
    except NoDeviceError:
        return None


def run(args) -> int:
    from orchestra.compiler import compile as nvrtc_compile, link_ptx
    from orchestra.compiler.target import normalize_arch, virtual_arch

    out = args.output or args.file.with_suffix(".ptx" if args.ptx else ".cubin")  # as given
    args.file = _find_input(args.file)
    if args.file.is_dir():
        return _fail(f"{args.file} is a directory: give a .cu or .ptx file")
    if not args.file.is_file():
        return _fail(f"no such file: {args.file}")
    ptx_input = args.file.suffix == ".ptx"
    if ptx_input:
        if args.ptx:
            return _fail("--ptx makes no sense for a .ptx input (it is PTX already)")
        nvrtc_only = [flag for flag, given in (("--name-expression", args.name_expression),
                                               ("-O/--option", args.option)) if given]
        if nvrtc_only:
            verb, it = ("apply", "them") if len(nvrtc_only) > 1 else ("applies", "it")
            return _fail(f"{' and '.join(nvrtc_only)} {verb} to NVRTC (.cu input) only; a .ptx "
                         f"input is linked with nvJitLink as it is: drop {it}")
    arch: str | None
    if args.arch:
        try:
            arch = normalize_arch(args.arch)
        except ValueError:
            return _fail(f"--arch {args.arch}: unknown GPU architecture; pass a name like "
                         "--arch sm_90 or a compute capability like --arch 9.0")
    else:
        arch = _current_arch()
        if arch is None:
            return _fail(f"no CUDA device to take the target architecture from: pass --arch, "
                         f"e.g. --arch sm_90 (compute capability 9.0) to "
                         f"{'link' if ptx_input else 'compile'} {args.file} without a GPU")
    if ptx_input:
        data, what, extra = link_ptx(args.file, arch=arch), f"cubin for {arch}", ""
    else:
        result = nvrtc_compile(args.file, arch=arch, options=tuple(args.option),
                               name_expressions=tuple(args.name_expression), ptx=args.ptx)
        data = result.cubin
        what = f"PTX for {virtual_arch(arch)}" if args.ptx else f"cubin for {arch}"
        extra = " (cache hit)" if result.cache_hit else ""
        for expr, lowered in result.lowered_names.items():
            print(f"{expr} -> {lowered}")
        if result.log.strip():
            print(result.log.rstrip(), file=sys.stderr)
    out.write_bytes(data)
    print(f"wrote {out} ({len(data)} bytes, {what}){extra}")
    return 0

"""`orchestra compile FILE.cu --arch sm_90 [-o OUT.cubin] [--ptx]`: NVRTC to a cubin (or PTX);
`orchestra compile FILE.ptx --arch sm_90 [-o OUT.cubin]`: nvJitLink to a cubin.

Writes the image and lists the kernels in it: a name expression with the lowered (mangled) name
it became, an ``extern "C"`` kernel by its name. An image with no kernel is a warning on stderr
(exit 0), or an error with ``--strict`` (exit 1, nothing written). ``--json`` prints one JSON
object instead (``arch``, ``outputs``, ``kernels``, ``cache_hit``, ``warnings``), and errors as
``{"error": {"type": ..., "message": ...}}``.

Runs on a machine without a GPU when `--arch` is given. Uses the on-disk compile cache.
``--arch compute_90`` makes PTX (as ``--arch sm_90 --ptx``; a ``.ptx`` input, linked into a
cubin, needs a real ``sm_90``). An architecture the NVRTC in use does not offer
(``nvrtcGetSupportedArchs``) is refused before anything is compiled, with the list of those it
does (exit 2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from orchestra.errors import NoDeviceError

_NO_KERNELS_HINT = ("a template kernel is only compiled for the instantiations named with"
                    " --name-expression 'name<args>'; a file of device functions or headers"
                    " alone has none")


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile a CUDA C++ file (or link a .ptx file) to a cubin",
                       description="Compile a CUDA C++ file with NVRTC (or link a .ptx file with "
                                   "nvJitLink) to a cubin, and list the kernels it holds.")
    p.add_argument("file", type=Path,
                   help="a .cu source file, or a .ptx file to link with nvJitLink; a bare name "
                        "such as burn.cu is also looked up among the kernels orchestra ships")
    p.add_argument("--arch", help="target, e.g. sm_90 (default: the current GPU; required without "
                                  "one); compute_90 makes PTX for compute_90 (as --ptx); one "
                                  "the NVRTC in use does not offer is refused with the list of "
                                  "those it does")
    p.add_argument("-o", "--output", type=Path, help="where to write the cubin/PTX (default: FILE.cubin)")
    p.add_argument("--ptx", action="store_true", help="emit PTX for compute_XX instead of a cubin")
    p.add_argument("--name-expression", action="append", default=[], metavar="EXPR",
                   help="instantiate a template kernel, e.g. 'pipeline_block<2>' (repeatable; "
                        ".cu input only)")
    p.add_argument("-O", "--option", action="append", default=[], metavar="OPT",
                   help="extra NVRTC option, e.g. -O=-lineinfo or -O=-Iinclude (repeatable; .cu "
                        "input only)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1, nothing written) when the image holds no kernel")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _error(args, kind: str, message: str, code: int) -> int:
    """The one place this command reports an error: ``{"error": {"type", "message"}}`` on
    stdout under --json, else one ``orchestra compile: ...`` line on stderr. Returns ``code``."""
    if getattr(args, "json", False):
        print(json.dumps({"error": {"type": kind, "message": message}}))
    else:
        print(f"orchestra compile: {message}", file=sys.stderr)
    return code


def _fail(args, message: str) -> int:
    return _error(args, "UsageError", message, 2)


def _current_arch() -> str | None:
    """The current GPU's architecture, or None without a GPU or driver."""
    from orchestra.driver import Device

    try:
        return Device.get().arch
    except NoDeviceError:
        return None


def _listing(image: bytes, is_ptx: bool, lowered_names: dict) -> tuple[list[dict], list[dict]]:
    """(kernels, variables) of an image. A kernel: ``{"name", "lowered_name",
    "name_expression"}`` where ``name`` is the expression that named it, else its symbol; a
    variable: a name expression that resolved to a ``__device__``/``__constant__`` variable."""
    from orchestra.compiler.elf import kernel_names
    from orchestra.compiler.ptx import ptx_entry_names

    symbols = ptx_entry_names(image) if is_ptx else kernel_names(image)
    by_lowered: dict[str, str] = {}
    for expr, low in lowered_names.items():
        by_lowered.setdefault(low, expr)
    kernels = [{"name": by_lowered.get(s, s), "lowered_name": s,
                "name_expression": by_lowered.get(s)} for s in symbols]
    variables = [{"name": expr, "lowered_name": low} for expr, low in lowered_names.items()
                 if low not in symbols]
    return kernels, variables


def _build(args, arch: str, ptx_input: bool) -> dict:
    """Compile or link; the output record (before writing)."""
    from orchestra.compiler import compile as nvrtc_compile
    from orchestra.compiler.ptx import link_ptx_cached
    from orchestra.compiler.target import virtual_arch

    if ptx_input:
        data, hit = link_ptx_cached(args.file, arch=arch)
        log, lowered, emit_ptx = "", {}, False
    else:
        result = nvrtc_compile(args.file, arch=arch, options=tuple(args.option),
                               name_expressions=tuple(args.name_expression), ptx=args.ptx)
        data, hit, log, lowered, emit_ptx = (result.cubin, result.cache_hit, result.log,
                                             result.lowered_names, args.ptx)
    kernels, variables = _listing(data, emit_ptx, lowered)
    out = args.output or args.file.with_suffix(".ptx" if emit_ptx else ".cubin")
    return {"input": str(args.file), "output": str(out), "format": "ptx" if emit_ptx else "cubin",
            "target": virtual_arch(arch) if emit_ptx else arch, "bytes": len(data),
            "cache_hit": hit, "kernels": kernels, "variables": variables, "log": log,
            "_data": data}


def _text_report(rec: dict) -> list[str]:
    what = f"{'PTX' if rec['format'] == 'ptx' else 'cubin'} for {rec['target']}"
    lines = [f"wrote {rec['output']} ({rec['bytes']} bytes, {what})"
             + (" (cache hit)" if rec["cache_hit"] else "")]
    for k in rec["kernels"]:
        lines.append(f"  kernel {k['name']} -> {k['lowered_name']}" if k["name_expression"]
                     else f"  kernel {k['name']}")
    for v in rec["variables"]:
        lines.append(f"  variable {v['name']} -> {v['lowered_name']}")
    return lines


def run(args) -> int:
    from orchestra.compiler.sources import SourceEncodingError

    try:
        return _run(args)
    except SourceEncodingError as exc:  # a bad input file: a usage error, like a missing one
        return _fail(args, str(exc))
    # anything else reaches orchestra.cli.main: one line or one JSON error, and its exit code
    # (a CompileError is 4, with the compiler's log)


def _find_input(path: Path) -> Path:
    """``path`` as given, else a kernel shipped with orchestra of that name (``burn.cu``,
    ``cp_async.ptx``), else ``path`` unchanged (reported missing by the caller)."""
    if path.exists() or path.is_absolute():
        return path
    from orchestra.compiler.sources import kernel_source_dir, ptx_source_dir, resolve_path

    return resolve_path(path, (kernel_source_dir(), ptx_source_dir())) or path


def _arch_option(args) -> tuple[str | None, bool, str | None]:
    """``--arch`` read: ``(arch "sm_XY" or None, virtual, error message or None)``. A virtual
    ``compute_XY`` asks for PTX (as ``--arch sm_XY --ptx``)."""
    from orchestra.compiler.target import split_arch
    from orchestra.errors import CompilerArgumentValueError

    if args.arch is None:
        return None, False, None
    if not args.arch.strip():  # --arch "" (an unset variable in a script): not "no --arch"
        return None, False, (f"--arch {args.arch!r} is empty: pass a target such as --arch "
                             "sm_90, or leave --arch out to compile for the current GPU")
    try:
        arch, virtual = split_arch(args.arch)
    except CompilerArgumentValueError as exc:
        if str(exc).startswith("unknown GPU architecture"):
            return None, False, (f"--arch {args.arch}: unknown GPU architecture; pass a name like "
                                 "--arch sm_90 or a compute capability like --arch 9.0")
        return None, False, f"--arch {args.arch}: {exc}"
    return arch, virtual, None


def _unsupported(args, arch: str, ptx_input: bool) -> str | None:
    """Why the compiler in use cannot target ``arch`` (its list of those it can), or None."""
    from orchestra.compiler.nvrtc import check_arch_supported
    from orchestra.compiler.ptx import check_link_arch
    from orchestra.errors import UnsupportedArchError

    try:
        if ptx_input:
            check_link_arch(arch)
        else:
            check_arch_supported(arch)
    except UnsupportedArchError as exc:
        where = f"--arch {args.arch}" if args.arch else f"the current GPU ({arch})"
        why = str(exc)
        if args.arch and args.arch.strip().lower().startswith("compute_"):
            # PTX for a virtual architecture: the same numbers, named as the user named them
            why = why.replace("sm_", "compute_")
        return f"{where}: {why}"
    return None


def _run(args) -> int:
    given = args.file
    arch, virtual, bad_arch = _arch_option(args)
    if bad_arch:
        return _fail(args, bad_arch)
    if virtual and given.suffix == ".ptx":
        return _fail(args, f"--arch {args.arch} is a virtual architecture: nvJitLink links a "
                           f".ptx file into a cubin for a real one: pass --arch {arch}")
    if virtual:
        args.ptx = True  # compute_XY is PTX for compute_XY, as NVRTC makes it
    from orchestra.compiler.nvrtc import ARCH_OPTIONS

    for o in args.option:
        if o.startswith(ARCH_OPTIONS):
            return _fail(args, f"-O {o} sets the target architecture: pass --arch instead (with "
                               "--ptx, or --arch compute_XY, for PTX)")
    args.file = _find_input(given)
    if args.file != given and args.output is None:  # a shipped kernel: write here, not beside it
        args.output = Path(given.name).with_suffix(".ptx" if args.ptx else ".cubin")
    if args.file.is_dir():
        return _fail(args, f"{args.file} is a directory: give a .cu or .ptx file")
    if not args.file.is_file():
        if args.file.exists():  # a FIFO or a device: NVRTC reads files
            return _fail(args, f"{args.file} is not a regular file (a pipe, a socket or a "
                               "device): give a .cu or .ptx file")
        return _fail(args, f"no such file: {args.file}")
    ptx_input = args.file.suffix == ".ptx"
    out = args.output or args.file.with_suffix(".ptx" if args.ptx and not ptx_input else ".cubin")
    if args.output is not None and not ptx_input:
        # the suffix names what the file holds: a cubin named .ptx (or PTX named .cubin) is
        # read back as the wrong kind by `orchestra compile` and by the loaders
        if args.ptx and out.suffix.lower() == ".cubin":
            how = f"--arch {args.arch}" if virtual else "--ptx"
            other = f"pass --arch {arch} for a cubin" if virtual else "drop --ptx"
            return _fail(args, f"-o {out}: {how} makes PTX, not a cubin; name the output .ptx, "
                               f"or {other}")
        if not args.ptx and out.suffix.lower() == ".ptx":
            return _fail(args, f"-o {out}: this makes a cubin, not PTX; name the output "
                               ".cubin, or pass --ptx for PTX")
    from orchestra.cli.job_options import same_file

    if same_file(os.fspath(args.file), os.fspath(out)):
        return _fail(args, f"-o {out} is the input file {args.file}: writing the "
                           f"{'PTX' if args.ptx else 'cubin'} would overwrite the source; "
                           "pass another -o")
    if os.path.isdir(out):  # -o build/ or -o "" (the current folder)
        name = args.file.stem + (".ptx" if args.ptx and not ptx_input else ".cubin")
        return _fail(args, f"-o {os.fspath(args.output)!r} is a directory: pass a file name, "
                           f"e.g. -o {os.path.join(os.fspath(out), name)}")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):  # before compiling: was "[Errno 2] No such file" after it
        return _fail(args, f"-o {out}: the folder {folder} does not exist; create it or pass "
                           "another -o")
    if ptx_input:
        if args.ptx:
            return _fail(args, "--ptx makes no sense for a .ptx input (it is PTX already)")
        nvrtc_only = [flag for flag, given in (("--name-expression", args.name_expression),
                                               ("-O/--option", args.option)) if given]
        if nvrtc_only:
            verb, it = ("apply", "them") if len(nvrtc_only) > 1 else ("applies", "it")
            return _fail(args, f"{' and '.join(nvrtc_only)} {verb} to NVRTC (.cu input) only; a "
                               f".ptx input is linked with nvJitLink as it is: drop {it}")
    if arch is None:
        arch = _current_arch()
        if arch is None:
            return _fail(args, f"no CUDA device to take the target architecture from: pass "
                               f"--arch, e.g. --arch sm_90 (compute capability 9.0) to "
                               f"{'link' if ptx_input else 'compile'} {args.file} without a GPU")
    unsupported = _unsupported(args, arch, ptx_input)
    if unsupported:
        return _fail(args, unsupported)
    rec = _build(args, arch, ptx_input)
    data = rec.pop("_data")
    warnings = []
    if not rec["kernels"]:
        msg = f"{rec['output']} holds no kernel: {_NO_KERNELS_HINT}"
        if args.strict:
            return _error(args, "NoKernelsError", f"{msg} (--strict: not written)", 1)
        warnings.append(msg)
    try:
        Path(rec["output"]).write_bytes(data)
    except OSError as exc:  # a full disk, no permission, /dev/full: named, with the file
        return _fail(args, f"-o {rec['output']}: cannot be written ({exc.strerror or exc})")
    if rec["log"].strip() and not args.json:
        print(rec["log"].rstrip(), file=sys.stderr)
    for w in warnings:
        print(f"orchestra compile: warning: {w}", file=sys.stderr)
    if args.json:
        kernels = [dict(k, output=rec["output"]) for k in rec["kernels"]]
        print(json.dumps({"arch": arch, "cache_hit": rec["cache_hit"], "outputs": [rec],
                          "kernels": kernels, "warnings": warnings}, indent=2))
    else:
        print("\n".join(_text_report(rec)))
    return 0

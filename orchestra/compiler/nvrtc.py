"""CUDA C++ -> cubin (or PTX) with NVRTC, through the on-disk cache.

`compile` is the entry point; `prepare_compile` computes everything up to the cache key
without compiling (`load_kernel` memoizes on that key). NVRTC itself is called only from
`_run_nvrtc`, so a cache hit provably never touches it.

Default options: ``-std=c++17`` (unless the caller passes a ``-std``), and
``--gpu-architecture=sm_XY`` (a cubin with SASS for exactly that SM) or, with ``ptx=True``,
``--gpu-architecture=compute_XY`` (PTX). Then the caller's options, then one ``-I`` per include
directory: the source file's directory, the caller's ``include_dirs``, ``cuda_src/``, and the
CCCL and cudart header directories found with ``cuda.pathfinder``.

The cache key covers every header the program reaches through any of those directories or a
``-I`` in the caller's options (`orchestra.compiler.headers`); the cache itself (location, size
cap, eviction) is `orchestra.compiler.cache`.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import attrs

from orchestra.compiler import cache
from orchestra.compiler.elf import ElfError, defined_names, is_elf, kernel_names
from orchestra.compiler.includes import (
    describe_versions,
    include_dirs_for,
    missing_headers,
    system_include_dirs,
)
from orchestra.compiler.headers import header_digest, search_path
from orchestra.compiler.sources import Source, read_source
from orchestra.compiler.target import default_arch, normalize_arch, split_arch, virtual_arch
from orchestra.compiler.target import virtual_arch_message
from orchestra.errors import (
    CompileError,
    CompilerArgumentTypeError,
    CompilerArgumentValueError,
    UnsupportedArchError,
)

_ERROR_LINE_RE = re.compile(r"^(.*?)\((\d+)\): (?:catastrophic )?error\b.*$", re.MULTILINE)
_NAME_MAP_PRAGMA_RE = re.compile(r"^\s*#pragma nv_mangled_name (.+?)\s*$", re.MULTILINE)
# NVRTC options that set the target: refused in options= (arch= says it, and enters the key).
ARCH_OPTIONS = ("-arch", "--gpu-architecture", "-gpu-architecture", "--arch")


class NameExpressionError(CompileError):
    """One or more name expressions did not resolve to a symbol of the image.

    Attributes (besides `CompileError`'s): ``missing``: the expressions that failed, in the
    order given; ``resolved``: dict expression -> lowered name for the ones that did resolve.
    """

    def __init__(self, summary, log="", options=(), include_dirs=(), call="", missing=(),
                 resolved=None):
        self.missing = tuple(missing)
        self.resolved = dict(resolved or {})
        super().__init__(summary, log, options, include_dirs, call)

    def __reduce__(self):
        return (type(self), (self.summary, self.log, self.options, self.include_dirs, self.call,
                             self.missing, self.resolved))


@attrs.frozen(eq=False)
class CompileResult:
    """The output of one compile.

    Attributes:
        cubin: the image bytes: an ELF cubin, or PTX text (bytes, no trailing NUL) when
            ``ptx`` is True.
        log: NVRTC's log (warnings; empty when clean), str.
        lowered_names: dict name expression -> lowered (mangled) name, for the
            ``name_expressions`` passed.
        arch: the target, ``"sm_90"`` (also for PTX, whose virtual target is ``compute_90``).
        options: every option NVRTC got, tuple of str (``-I`` directories included).
        nvrtc_version: NVRTC's (major, minor).
        cache_hit: True when the image came from the on-disk cache (NVRTC was not called).
        ptx: True when ``cubin`` holds PTX.
        name: the program name (the source path, or ``inline.cu``).
        key: the cache key (sha256 hex).
        include_dirs: the include directories searched.

    Immutable (frozen), but ``lowered_names`` is a plain dict: may be shared between threads freely
    as long as nobody modifies that dict.
    """

    cubin: bytes
    log: str
    lowered_names: dict
    arch: str
    options: tuple
    nvrtc_version: tuple
    cache_hit: bool
    ptx: bool = False
    name: str = ""
    key: str = ""
    include_dirs: tuple = ()

    @property
    def image(self) -> bytes:
        """Alias of ``cubin`` (which holds PTX when ``ptx`` is True)."""
        return self.cubin

    def kernel_names(self) -> list[str]:
        """Lowered names of the kernels in the cubin (ELF symbol table); [] for PTX."""
        return [] if self.ptx else kernel_names(self.cubin)

    def write(self, path) -> Path:
        """Write the image to ``path`` (a ``.cubin``/``.ptx`` file); returns the path."""
        p = Path(path)
        p.write_bytes(self.cubin)
        return p


def default_output_path(source_path, ptx: bool = False) -> Path:
    """``foo.cu`` -> ``foo.cubin`` (or ``foo.ptx``) next to it: what ``orchestra compile``
    writes without ``-o``."""
    return Path(source_path).with_suffix(".ptx" if ptx else ".cubin")


def compile_to_file(source_or_path, out=None, *, arch=None, ptx=False, options=(),
                    include_dirs=()) -> tuple[CompileResult, Path]:
    """`compile` and write the image: to ``out``, or next to the source as ``.cubin``/``.ptx``
    (`default_output_path`; inline text needs ``out``). What ``orchestra compile FILE.cu
    --arch sm_90 [-o OUT] [--ptx]`` does. Returns ``(result, path written)``."""
    res = compile(source_or_path, arch=arch, options=options, include_dirs=include_dirs,
                  ptx=ptx)
    if out is None:
        src = read_source(source_or_path)
        if src.path is None:
            raise CompilerArgumentValueError("inline source text has no file name: pass out=")
        out = default_output_path(src.path, ptx)
    return res, res.write(out)


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor) (``nvrtcVersion``); cached for the process."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err):
        raise CompileError(f"nvrtcVersion: {_result_name(err)}", call="nvrtcVersion")
    return (int(major), int(minor))


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """The compute capabilities (x10, ascending: ``(75, 80, ..., 121)``) the NVRTC in use can
    compile for (``nvrtcGetSupportedArchs``); cached for the process. Each also takes the
    ``a`` / ``f`` variants from 9.0 / 10.0 on (`orchestra.compiler.target.SUFFIX_MIN_CC`)."""
    from cuda.bindings import nvrtc

    err, archs = nvrtc.nvrtcGetSupportedArchs()
    if int(err):
        raise CompileError(f"nvrtcGetSupportedArchs: {_result_name(err)}",
                           call="nvrtcGetSupportedArchs")
    return tuple(sorted(int(a) for a in archs))


def check_arch_supported(arch: str, *, detail: str = "", compiler: str = "") -> str:
    """``arch`` (a real ``"sm_XY"`` name, suffix allowed) when the NVRTC in use compiles for
    it; else `UnsupportedArchError` listing the architectures it does (``supported_archs``).
    ``detail`` says where the architecture came from (``"the device's architecture"``)."""
    digits = arch[3:].rstrip("af")
    archs = supported_archs()
    if int(digits) in archs:
        return arch
    major, minor = nvrtc_version()
    raise UnsupportedArchError(arch, tuple(f"sm_{a}" for a in archs),
                               compiler or f"NVRTC {major}.{minor}", detail)


def _result_name(result) -> str:
    try:
        return result.name
    except AttributeError:
        return f"nvrtcResult({int(result)})"


def _iterable(items, what: str):
    """``iter(items)``, or `CompilerArgumentTypeError` naming the argument (``options=5``)."""
    try:
        return iter(items)
    except TypeError:
        example = {"options": '("-DN=4",)', "include_dirs": '("include",)',
                   "name_expressions": '("pipeline_block<2>",)'}.get(what, '("...",)')
        raise CompilerArgumentTypeError(
            f"{what} must be a string or a sequence of strings (e.g. {what}={example}), "
            f"got {type(items).__name__}") from None


def _as_str_tuple(items, what: str) -> tuple[str, ...]:
    if isinstance(items, (str, bytes)):
        items = (items,)
    out = []
    for x in _iterable(items, what):
        if isinstance(x, bytes):
            try:
                x = x.decode("utf-8")
            except UnicodeDecodeError:
                raise CompilerArgumentValueError(
                    f"{what}: {x!r} is not UTF-8; pass str") from None
        if not isinstance(x, str):
            raise CompilerArgumentTypeError(f"{what} must be strings, got {type(x).__name__}")
        out.append(x)
    return tuple(out)


def build_options(arch: str, ptx: bool, user_options=(), include_dirs=()) -> tuple[str, ...]:
    """The full NVRTC option list (see the module doc).

    Raises ``ValueError`` when ``user_options`` carries its own architecture flag (pass
    ``arch=`` instead, so the cache key and the result's ``arch`` stay truthful).
    """
    user = _as_str_tuple(user_options, "options")
    for o in user:
        if o.startswith(ARCH_OPTIONS):
            raise CompilerArgumentValueError(
                f"option {o!r} sets the target architecture: pass arch=\"sm_XY\" (and ptx=True"
                " for PTX) instead")
    opts = []
    if not any(o.startswith(("-std", "--std")) for o in user):
        opts.append("-std=c++17")
    target = virtual_arch(arch) if ptx else normalize_arch(arch)
    opts.append(f"--gpu-architecture={target}")
    opts.extend(user)
    opts.extend(f"-I{d}" for d in include_dirs)
    return tuple(opts)


@attrs.frozen(eq=False)
class CompileJob:
    """A compile with every input resolved and its cache key computed; `run` performs it.

    Made by `prepare_compile`. ``source`` is a `Source`; ``options`` the full option list.

    Immutable (frozen): may be shared between threads freely. `run` may be called from several
    threads (or processes) at once: each call compiles its own NVRTC program, and the on-disk cache
    writes an entry whole (temporary file, then ``os.replace``), so concurrent runs of one job at
    most compile it twice.
    """

    source: Source
    arch: str
    ptx: bool
    options: tuple
    include_dirs: tuple
    name_expressions: tuple
    key: str

    def run(self) -> CompileResult:
        """Return the cached result, or compile with NVRTC and cache it (see `compile`)."""
        entry = cache.load("nvrtc", self.key)
        if entry is not None and (self.ptx or is_elf(entry.image)):
            return self._result(entry.image, entry.log, entry.names, True)
        image, log, lowered = _compile_checked(self)
        cache.store("nvrtc", self.key, image, log, lowered)
        return self._result(image, log, lowered, False)

    def _result(self, image, log, lowered, hit) -> CompileResult:
        return CompileResult(
            cubin=image, log=log, lowered_names=dict(lowered), arch=self.arch,
            options=self.options, nvrtc_version=nvrtc_version(), cache_hit=hit, ptx=self.ptx,
            name=self.source.name, key=self.key, include_dirs=self.include_dirs)


def prepare_compile(source_or_path, *, arch=None, options=(), name_expressions=(),
                    include_dirs=(), ptx=False) -> CompileJob:
    """Resolve the inputs of a compile (see `compile`) and compute its cache key, without
    compiling.

    The key covers the source text and name, every NVRTC option, the target, the name
    expressions, the NVRTC version and every header the source reaches through any include path
    (`orchestra.compiler.headers.header_key`: project headers by path and content, CCCL and
    cudart by version). Costs one ``stat`` per reachable header when nothing changed.
    """
    src = read_source(source_or_path)
    if arch is None:
        arch = check_arch_supported(default_arch(), detail="the current device's architecture")
    else:
        given = arch
        arch, virtual = split_arch(given)
        if virtual and not ptx:  # compute_XY names PTX: never a cubin for sm_XY in its place
            raise CompilerArgumentValueError(virtual_arch_message(given, arch))
        check_arch_supported(arch)
    if isinstance(include_dirs, (str, bytes, os.PathLike)):
        include_dirs = (include_dirs,)
    paths = []
    for d in _iterable(include_dirs, "include_dirs"):
        try:
            paths.append(os.fspath(d))
        except TypeError:
            raise CompilerArgumentTypeError(
                f"include_dirs must be paths (str or os.PathLike), got {type(d).__name__}"
            ) from None
    user_dirs = tuple(str(Path(d).resolve()) for d in _as_str_tuple(paths, "include_dirs"))
    dirs = include_dirs_for(src.directory, user_dirs)
    opts = build_options(arch, bool(ptx), options, dirs)
    names = tuple(dict.fromkeys(_as_str_tuple(name_expressions, "name_expressions")))
    for n in names:
        if not n.strip():
            raise CompilerArgumentValueError("an empty name expression was given")
    headers = header_digest(src.text, src.name, opts, system_include_dirs())
    key = cache.make_key("nvrtc", src.text, src.name, headers, opts, arch, bool(ptx), names,
                         nvrtc_version())
    searched, _pre, _src_inc = search_path(opts)  # -I from options= too, in NVRTC's order
    return CompileJob(src, arch, bool(ptx), opts, searched, names, key)


def compile(source_or_path, *, arch=None, options=(), name_expressions=(), include_dirs=(),
            ptx=False) -> CompileResult:  # noqa: A001 - the package's public name
    """Compile CUDA C++ with NVRTC to a cubin for one SM (or to PTX), cached on disk.

    Args:
        source_or_path: a path (str or Path) of an existing ``.cu`` file (a relative name is
            also looked up in ``cuda_src/``), or the CUDA C++ text itself.
        arch: ``"sm_90"`` etc.; default: the current device's (``Device.get().arch``). Without
            a GPU it must be given (``ValueError`` says so). The virtual ``"compute_90"`` is
            taken with ``ptx=True`` only (PTX for compute_90); for a cubin it is refused,
            never silently built as sm_90. An architecture the NVRTC in use does not offer
            (``nvrtcGetSupportedArchs``: ``sm_35`` with NVRTC 13) is `UnsupportedArchError`,
            listing the ones it does, before NVRTC runs.
        options: extra NVRTC options (str), e.g. ``("-DN=4", "-lineinfo")``; ``-I`` /
            ``--include-path`` directories given here are searched before ``include_dirs``,
            and the headers found through them enter the cache key like any other.
        name_expressions: C++ expressions naming ``__global__`` functions or ``__device__``
            variables, e.g. ``"my_kernel<float, 4>"``; their lowered names come back in
            ``lowered_names`` (``nvrtcAddNameExpression`` / ``nvrtcGetLoweredName``).
        include_dirs: extra ``-I`` directories (project headers: their contents enter the key).
            Editing, adding or removing any header the source can reach recompiles.
        ptx: give PTX for ``compute_XY`` instead of a cubin.

    Returns a `CompileResult`; ``cache_hit`` tells whether NVRTC ran.

    Raises:
        CompileError: NVRTC refused the program; the message holds the full log (``file(line):
            error ...``), the options and the include directories tried; for a missing header
            (``cannot open source file``) it names the header and reports the NVRTC and header
            (CCCL, cudart) versions found, flagging headers of another CUDA version.
        NameExpressionError: a name expression did not resolve (names it; ``.resolved`` holds
            the others).
        UnsupportedArchError: ``arch`` is not one NVRTC offers (a ``ValueError``).
        FileNotFoundError, ValueError, TypeError: bad arguments.
    """
    return prepare_compile(source_or_path, arch=arch, options=options,
                           name_expressions=name_expressions, include_dirs=include_dirs,
                           ptx=ptx).run()


@attrs.frozen
class _NvrtcOutput:
    ok: bool
    call: str
    status: str
    image: bytes
    log: str
    lowered: dict


def _run_nvrtc(text: str, name: str, options: tuple, name_expressions: tuple,
               ptx: bool) -> _NvrtcOutput:
    """The one place NVRTC runs: nvrtcCreateProgram, nvrtcAddNameExpression,
    nvrtcCompileProgram, nvrtcGetProgramLog, nvrtcGetCUBIN/nvrtcGetPTX, nvrtcGetLoweredName,
    nvrtcDestroyProgram. Never raises for a program NVRTC refuses (``ok`` is False)."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(text.encode("utf-8"), name.encode("utf-8"), 0,
                                         None, None)
    if int(err):
        return _NvrtcOutput(False, "nvrtcCreateProgram", _result_name(err), b"", "", {})
    try:
        for expr in name_expressions:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode("utf-8"))
            if int(err):
                return _NvrtcOutput(False, "nvrtcAddNameExpression", _result_name(err), b"",
                                    f"name expression {expr!r} was refused", {})
        opts = [o.encode("utf-8") for o in options]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = ""
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        if not int(err) and size > 1:
            buf = bytearray(size)
            (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
            if not int(err):
                log = bytes(buf).rstrip(b"\0").decode("utf-8", errors="replace").strip()
        if int(cerr):
            return _NvrtcOutput(False, "nvrtcCompileProgram", _result_name(cerr), b"", log, {})
        get_size, get = ((nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx
                         else (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN))
        err, size = get_size(prog)
        if int(err):
            return _NvrtcOutput(False, get_size.__name__, _result_name(err), b"", log, {})
        buf = bytearray(size)
        (err,) = get(prog, buf)
        if int(err):
            return _NvrtcOutput(False, get.__name__, _result_name(err), b"", log, {})
        image = bytes(buf)
        if ptx:
            image = image.rstrip(b"\0")
        lowered = {}
        for expr in name_expressions:
            err, low = nvrtc.nvrtcGetLoweredName(prog, expr.encode("utf-8"))
            lowered[expr] = (low.decode("utf-8") if (not int(err) and low) else "")
        return _NvrtcOutput(True, "", "", image, log, lowered)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _first_error(log: str) -> str:
    m = _ERROR_LINE_RE.search(log)
    return m.group(0).strip() if m else ""


def _failed_name_expressions(log: str, names: tuple) -> list[str] | None:
    """The given expressions NVRTC's ``__nv_name_map`` errors point at, or None when the
    log holds other errors too (or an expression cannot be matched)."""
    error_lines = _ERROR_LINE_RE.findall(log)
    if not error_lines or any(f != "__nv_name_map" for f, _line in error_lines):
        return None
    squash = {re.sub(r"\s+", "", n): n for n in names}
    bad = []
    for text in _NAME_MAP_PRAGMA_RE.findall(log):
        n = squash.get(re.sub(r"\s+", "", text))
        if n is None:
            return None
        if n not in bad:
            bad.append(n)
    return [n for n in names if n in bad] or None


def _symbol_present(image: bytes, ptx: bool, lowered: str, names_cache: list) -> bool:
    if ptx:
        text = image.decode("utf-8", errors="replace")
        return re.search(r"(?<![\w$])" + re.escape(lowered) + r"(?![\w$])", text) is not None
    if not names_cache:
        try:
            names_cache.append(defined_names(image))
        except ElfError:
            names_cache.append(None)
    return names_cache[0] is None or lowered in names_cache[0]


def _compile_checked(job: CompileJob) -> tuple[bytes, str, dict]:
    """Run NVRTC for ``job`` and turn every failure into the right `CompileError`."""
    src = job.source
    out = _run_nvrtc(src.text, src.name, job.options, job.name_expressions, job.ptx)
    what = f"{src.name} for {job.arch}" + (" (PTX)" if job.ptx else "")
    if not out.ok:
        versions, warnings = describe_versions(nvrtc_version(), job.include_dirs)
        if out.call == "nvrtcCompileProgram" and out.status == "NVRTC_ERROR_COMPILATION":
            bad = _failed_name_expressions(out.log, job.name_expressions) \
                if job.name_expressions else None
            if bad:
                good = tuple(n for n in job.name_expressions if n not in bad)
                resolved = {}
                if good:
                    retry = _run_nvrtc(src.text, src.name, job.options, good, job.ptx)
                    if retry.ok:
                        resolved = {k: v for k, v in retry.lowered.items() if v}
                raise _name_error(job, bad, resolved, out.log)
            missing = missing_headers(out.log)
            if missing:
                lines = [f"NVRTC could not compile {what}: missing header"
                         f"{'s' if len(missing) > 1 else ''} "
                         + ", ".join(f'"{h}"' for h in missing)
                         + f" (cannot open source file); none of the {len(job.include_dirs)}"
                         " include directories below holds it",
                         f"versions: {versions}"]
                lines += [f"warning: {w}" for w in warnings]
                raise CompileError("\n".join(lines), out.log, job.options, job.include_dirs,
                                   "nvrtcCompileProgram")
            first = _first_error(out.log)
            lines = [f"NVRTC could not compile {what}" + (f": {first}" if first else ""),
                     f"versions: {versions}"]
            lines += [f"warning: {w}" for w in warnings]
            raise CompileError("\n".join(lines), out.log, job.options, job.include_dirs,
                               "nvrtcCompileProgram")
        raise CompileError(f"{out.call}: {out.status} while compiling {what} ({versions})",
                           out.log, job.options, job.include_dirs, out.call)
    # Every expression must give a non-empty lowered name that the image really defines.
    cache_list: list = []
    missing = [n for n in job.name_expressions
               if not out.lowered.get(n) or not _symbol_present(out.image, job.ptx,
                                                               out.lowered[n], cache_list)]
    if missing:
        resolved = {n: v for n, v in out.lowered.items() if n not in missing}
        raise _name_error(job, missing, resolved, out.log)
    return out.image, out.log, out.lowered


def _name_error(job: CompileJob, missing, resolved, log) -> NameExpressionError:
    miss = ", ".join(repr(m) for m in missing)
    ok = ", ".join(f"{k!r} -> {v}" for k, v in resolved.items()) or "none"
    summary = (f"name expression{'s' if len(missing) > 1 else ''} {miss} in {job.source.name}"
               f" did not resolve to a __global__ function or __device__ variable of the image"
               f" (check the spelling and the template arguments); resolved: {ok}")
    return NameExpressionError(summary, log, job.options, (), "nvrtcGetLoweredName",
                               missing, resolved)

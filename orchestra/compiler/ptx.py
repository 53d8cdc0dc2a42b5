"""PTX: its ISA version, whether a driver can JIT it, and linking it to a cubin with nvJitLink.

PTX written by a newer NVRTC (say 13.5, ``.version 9.5``) cannot be JIT-compiled by an
older driver (say CUDA 13.0): the driver answers ``CUDA_ERROR_UNSUPPORTED_PTX_VERSION``, which
names neither version. `check_ptx_loadable` compares the two first and raises `PtxVersionError`
naming both; `Module.load` calls it before handing PTX to the driver. `link_ptx` avoids the
problem altogether: nvJitLink (a wheel, same version as NVRTC) turns the PTX into a cubin for an
exact SM on the CPU, and cubins load on any driver of the same CUDA major version.
"""

from __future__ import annotations

import functools
import re

from orchestra.compiler import cache
from orchestra.compiler.elf import is_elf
from orchestra.compiler.sources import read_source
from orchestra.compiler.target import split_arch
from orchestra.errors import (
    CompileError, CompilerArgumentTypeError, CompilerArgumentValueError, OrchestraError,
)

_VERSION_RE = re.compile(rb"^[ \t]*\.version[ \t]+(\d+)\.(\d+)", re.MULTILINE)


class PtxVersionError(OrchestraError):
    """The driver is older than the PTX ISA version of a PTX image.

    Attributes: ``ptx_version`` (major, minor) of the ``.version`` directive,
    ``required_cuda`` (major, minor) the first CUDA release that reads it, ``driver_version``
    (``cuDriverGetVersion``, e.g. 13000).
    """

    def __init__(self, ptx_version, required_cuda, driver_version: int):
        self.ptx_version = tuple(ptx_version)
        self.required_cuda = tuple(required_cuda)
        self.driver_version = int(driver_version)
        dmaj, dmin = cuda_version_tuple(self.driver_version)
        super().__init__(
            f"PTX ISA {self.ptx_version[0]}.{self.ptx_version[1]} needs a CUDA"
            f" {self.required_cuda[0]}.{self.required_cuda[1]} driver or newer to JIT-compile,"
            f" but the driver supports CUDA {dmaj}.{dmin} (cuDriverGetVersion ="
            f" {self.driver_version}); the PTX came from a newer NVRTC/toolkit than the driver."
            " Compile to a cubin instead (compile(..., ptx=False)) or link the PTX on the host"
            " with link_ptx(ptx, arch=...), or update the driver")

    def __reduce__(self):
        return (type(self), (self.ptx_version, self.required_cuda, self.driver_version))


def cuda_version_tuple(version: int) -> tuple[int, int]:
    """``13050`` (1000 * major + 10 * minor) -> ``(13, 5)``."""
    return (version // 1000, (version % 1000) // 10)


def is_ptx(image) -> bool:
    """True when ``image`` (bytes or str) is PTX text: not ELF, and has a ``.version``
    directive."""
    if isinstance(image, str):
        image = image.encode("utf-8", errors="replace")
    return not is_elf(image) and _VERSION_RE.search(bytes(image[:65536])) is not None


def ptx_isa_version(ptx) -> tuple[int, int]:
    """The ``.version X.Y`` of a PTX text (bytes or str) as ``(X, Y)``.

    Raises ``ValueError`` when there is no ``.version`` directive.
    """
    if isinstance(ptx, str):
        ptx = ptx.encode("utf-8", errors="replace")
    m = _VERSION_RE.search(bytes(ptx))
    if m is None:
        raise CompilerArgumentValueError("not PTX: no .version directive found")
    return (int(m.group(1)), int(m.group(2)))


# The PTX ISA release history (PTX ISA manual, "Release Notes"): ISA -> first CUDA release.
_PTX_TO_CUDA = {
    (7, 0): (11, 0), (7, 1): (11, 1), (7, 2): (11, 2), (7, 3): (11, 3), (7, 4): (11, 4),
    (7, 5): (11, 5), (7, 6): (11, 6), (7, 7): (11, 7), (7, 8): (11, 8),
    (8, 0): (12, 0), (8, 1): (12, 1), (8, 2): (12, 2), (8, 3): (12, 3), (8, 4): (12, 4),
    (8, 5): (12, 5), (8, 6): (12, 7), (8, 7): (12, 8), (8, 8): (12, 9),
}


def _ptx_version_pair(ptx_version) -> tuple[int, int]:
    """``ptx_version`` as (major, minor) ints >= 0, else a `CompilerArgumentError` saying
    what to pass (``(9, 5)``, not ``"9.5"`` or ``(9,)``)."""
    if isinstance(ptx_version, (str, bytes)) or not isinstance(ptx_version, (tuple, list)):
        raise CompilerArgumentTypeError(
            f"ptx_version must be a (major, minor) tuple of ints such as (9, 5) (the PTX "
            f".version directive), got {ptx_version!r}")
    if len(ptx_version) != 2 or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ptx_version):
        raise CompilerArgumentValueError(
            f"ptx_version must be (major, minor) with two ints >= 0, such as (9, 5); got "
            f"{tuple(ptx_version)!r}")
    return int(ptx_version[0]), int(ptx_version[1])


def required_cuda_for_ptx(ptx_version) -> tuple[int, int]:
    """The first CUDA version (major, minor) whose driver JIT reads PTX ISA ``ptx_version``.

    Uses ``cuda.bindings.utils.get_minimal_required_cuda_ver_from_ptx_ver`` when it knows the
    version, else the release table (ISA 9.x is CUDA 13.x: 9.0 -> 13.0, 9.5 -> 13.5; ISA 7.x and
    8.0-8.5 follow the same +4 rule, 8.6/8.7/8.8 are 12.7/12.8/12.9).

    Raises `CompilerArgumentTypeError` / `CompilerArgumentValueError` when ``ptx_version`` is
    not a (major, minor) pair of ints >= 0.
    """
    major, minor = _ptx_version_pair(ptx_version)
    try:
        from cuda.bindings.utils import get_minimal_required_cuda_ver_from_ptx_ver

        return cuda_version_tuple(get_minimal_required_cuda_ver_from_ptx_ver(f"{major}.{minor}"))
    except Exception:  # noqa: BLE001 - older cuda-bindings or an ISA newer than its table
        pass
    if (major, minor) in _PTX_TO_CUDA:
        return _PTX_TO_CUDA[(major, minor)]
    if major >= 9:
        return (major + 4, minor)
    if major == 8:
        return (12, minor + 1) if minor > 5 else (12, minor)
    if major == 7:
        return (11, minor)
    return (10, 0) if major == 6 else (major + 3, 0)


def check_ptx_loadable(ptx_version, driver_version: int) -> None:
    """Raise `PtxVersionError` when a driver reporting ``driver_version`` (cuDriverGetVersion,
    e.g. 13000) is older than the CUDA release PTX ISA ``ptx_version`` (major, minor) needs.

    Pure function (no driver call): `Module.load` passes the real driver version. Raises
    `CompilerArgumentTypeError` / `CompilerArgumentValueError` for a ``ptx_version`` that is not
    (major, minor) or a ``driver_version`` that is not an int >= 0.
    """
    need = required_cuda_for_ptx(ptx_version)
    if not isinstance(driver_version, int) or isinstance(driver_version, bool):
        raise CompilerArgumentTypeError(
            f"driver_version must be an int as cuDriverGetVersion reports it (13000 for CUDA "
            f"13.0), got {driver_version!r}")
    if driver_version < 0:
        raise CompilerArgumentValueError(f"driver_version must be >= 0, got {driver_version}")
    have = cuda_version_tuple(int(driver_version))
    if have < need:
        raise PtxVersionError(ptx_version, need, driver_version)


@functools.lru_cache(maxsize=None)
def nvjitlink_version() -> tuple[int, int]:
    """nvJitLink's (major, minor) (``nvJitLinkVersion``); cached for the process."""
    from cuda.bindings import nvjitlink

    major, minor = (int(x) for x in nvjitlink.version())
    return major, minor


def _run_nvjitlink(ptx: bytes, name: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    """Link one PTX image: nvJitLinkCreate(options), AddData(PTX), Complete, GetLinkedCubin.

    Returns ``(cubin, info log)``. Raises `CompileError` carrying the error log and the call
    that failed. The one place nvJitLink is called (tests patch it to prove cache hits).
    """
    from cuda.bindings import nvjitlink

    call = "nvJitLinkCreate"
    handle = None
    try:
        handle = nvjitlink.create(len(options), list(options))
        call = "nvJitLinkAddData"
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, ptx, len(ptx), name)
        call = "nvJitLinkComplete"
        nvjitlink.complete(handle)
        call = "nvJitLinkGetLinkedCubin"
        size = nvjitlink.get_linked_cubin_size(handle)
        buf = bytearray(size)
        nvjitlink.get_linked_cubin(handle, buf)
        info = _jitlink_log(nvjitlink, handle, error=False)
        return bytes(buf), info
    except nvjitlink.nvJitLinkError as exc:
        log = _jitlink_log(nvjitlink, handle, error=True) if handle is not None else ""
        raise CompileError(f"{call}: {exc} while linking {name} with nvJitLink"
                           f" {'.'.join(map(str, nvjitlink_version()))}",
                           log=log, options=options, call=call) from None
    finally:
        if handle is not None:
            try:
                nvjitlink.destroy(handle)
            except Exception:  # noqa: BLE001 - freeing the handle must not mask the result
                pass


def _jitlink_log(nvjitlink, handle, error: bool) -> str:
    try:
        if error:
            n = nvjitlink.get_error_log_size(handle)
            buf = bytearray(n)
            if n:
                nvjitlink.get_error_log(handle, buf)
        else:
            n = nvjitlink.get_info_log_size(handle)
            buf = bytearray(n)
            if n:
                nvjitlink.get_info_log(handle, buf)
    except Exception:  # noqa: BLE001 - a log is best effort
        return ""
    return bytes(buf).rstrip(b"\0").decode("utf-8", errors="replace")


def link_ptx(ptx_source_or_path, *, arch, options=()) -> bytes:
    """PTX (text, bytes, or a path such as ``ptx/foo.ptx``) -> cubin bytes for ``arch``.

    Runs nvJitLink on the host (no GPU needed) with ``-arch=sm_XY`` plus ``options``; the
    result is cached like NVRTC output (namespace ``"nvjitlink"``, key over the PTX text, arch,
    options and the nvJitLink version), so a cache hit calls nvJitLink not at all.

    Raises `CompileError` (with nvJitLink's error log) when the PTX does not assemble or link,
    ``ValueError`` for an unknown ``arch``, a virtual ``compute_XY`` (a cubin is for a real
    ``sm_XY``) or text that is not PTX, `UnsupportedArchError` (a ``ValueError``) for an
    architecture the toolkit cannot target (listing those it can).
    """
    return link_ptx_cached(ptx_source_or_path, arch=arch, options=options)[0]


def link_ptx_cached(ptx_source_or_path, *, arch, options=()) -> tuple[bytes, bool]:
    """`link_ptx` that also tells whether the cubin came from the cache: ``(cubin, hit)``."""
    if isinstance(ptx_source_or_path, (bytes, bytearray)):
        text = bytes(ptx_source_or_path).rstrip(b"\0")
        name = "inline.ptx"
    else:
        src = read_source(ptx_source_or_path, inline_name="inline.ptx")
        text, name = src.text.encode("utf-8"), src.name
    if not is_ptx(text):
        raise CompilerArgumentValueError(f"{name} is not PTX text (no .version directive)")
    given = arch
    arch, virtual = split_arch(given)
    if virtual:
        raise CompilerArgumentValueError(
            f"{given!r} is a virtual architecture: nvJitLink links PTX into a cubin for a real"
            f" one; pass arch=\"{arch}\"")
    check_link_arch(arch)
    if isinstance(options, str):
        options = (options,)
    opts = (f"-arch={arch}",) + tuple(str(o) for o in options)
    key = cache.make_key("nvjitlink", text, arch, opts, nvjitlink_version())
    entry = cache.load("nvjitlink", key)
    if entry is not None and is_elf(entry.image):
        return entry.image, True
    cubin, info = _run_nvjitlink(text, name, opts)
    cache.store("nvjitlink", key, cubin, info, {})
    return cubin, False


def check_link_arch(arch: str) -> None:
    """`UnsupportedArchError` for an architecture the nvJitLink in use cannot target. nvJitLink
    has no query of its own; it ships with NVRTC, whose ``nvrtcGetSupportedArchs`` answers for
    both when their versions match (otherwise nvJitLink's own refusal stands)."""
    from orchestra.compiler.nvrtc import check_arch_supported, nvrtc_version

    version = nvjitlink_version()
    if version == nvrtc_version():
        check_arch_supported(arch, compiler=f"nvJitLink {version[0]}.{version[1]}")


_ENTRY_RE = re.compile(r"^\s*(?:\.(?:visible|weak|extern)\s+)*\.entry\s+([A-Za-z_$%][\w$]*)",
                       re.MULTILINE)


def ptx_entry_names(ptx) -> list[str]:
    """Names of the kernels (``.entry`` directives) a PTX text defines, in order."""
    text = ptx.decode("utf-8", errors="replace") if isinstance(ptx, (bytes, bytearray)) else ptx
    return _ENTRY_RE.findall(text)

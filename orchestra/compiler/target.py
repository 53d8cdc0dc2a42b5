"""The GPU architecture a compile or link targets.

``arch`` is spelled as NVRTC/ptxas spell it: ``"sm_90"`` (a real architecture: a cubin with
SASS for exactly that SM), ``"sm_90a"`` (architecture-specific features, compute capability 9.0
and up), ``"sm_100f"`` (family-specific features, 10.0 and up), or a compute capability given as
``"90"``, ``90``, ``"9.0"`` or ``(9, 0)``. PTX is generated for the matching virtual
architecture ``compute_90``.

``"compute_90"`` names that virtual architecture itself: NVRTC makes PTX for it, never a cubin.
`split_arch` reads it as ``("sm_90", True)``; `normalize_arch`, for the callers that need a real
architecture (a cubin, nvJitLink), refuses it and says to ask for PTX or pass ``sm_90``.
Which architectures the NVRTC in use can target is its own answer (``nvrtcGetSupportedArchs``):
`orchestra.compiler.nvrtc.check_arch_supported` checks against it.
"""

from __future__ import annotations

import operator
import re

from orchestra.errors import CompilerArgumentValueError

_ARCH_RE = re.compile(r"^(sm_|compute_)?(\d)(\d{1,2})([af]?)$")
# The lowest compute capability (x10) each feature suffix exists for: "a" (architecture-
# specific) from sm_90a, "f" (family-specific) from sm_100f (CUDA C++ Programming Guide,
# "Feature Availability"; NVRTC refuses sm_80a and sm_90f).
SUFFIX_MIN_CC = {"a": 90, "f": 100}


def _capability(pair) -> tuple[int, int] | None:
    """``(major, minor)`` as two small ints, or None when they are not."""
    try:
        major, minor = (operator.index(x) for x in pair)
    except TypeError:
        return None
    if any(isinstance(x, bool) for x in pair) or not (0 < major < 100 and 0 <= minor < 10):
        return None
    return major, minor


def split_arch(arch) -> tuple[str, bool]:
    """``arch`` as ``("sm_XY", virtual)``: the real name (keeping an ``a``/``f`` suffix), and
    whether it was given as the virtual ``compute_XY`` (PTX only).

    Raises `CompilerArgumentValueError` (a ``ValueError``) for anything that is not an
    architecture name or compute capability, and for a suffix the architecture does not have
    (``sm_80a``: ``a`` exists from 9.0, ``f`` from 10.0).
    """
    if isinstance(arch, tuple) and len(arch) == 2:
        cc = _capability(arch)
        if cc is not None:
            arch = f"{cc[0]}{cc[1]}"
    elif isinstance(arch, int) and not isinstance(arch, bool):
        arch = str(arch)
    if isinstance(arch, str):
        s = arch.strip().lower().replace(".", "")
        m = _ARCH_RE.match(s)
        if m:
            prefix, major, minor, suffix = m.groups()
            name = f"sm_{major}{minor}{suffix}"
            if suffix and int(major + minor) < SUFFIX_MIN_CC[suffix]:
                kind = "architecture" if suffix == "a" else "family"
                lowest = SUFFIX_MIN_CC[suffix]
                raise CompilerArgumentValueError(
                    f"GPU architecture {arch!r}: the {kind}-specific variant '{suffix}' exists"
                    f" from compute capability {lowest // 10}.{lowest % 10} on (sm_{lowest}"
                    f"{suffix}); use sm_{major}{minor}")
            return name, prefix == "compute_"
    raise CompilerArgumentValueError(
        f"unknown GPU architecture {arch!r}: pass a name like arch=\"sm_90\" (compute capability"
        " 9.0), or a compute capability such as (9, 0)")


def normalize_arch(arch) -> str:
    """``arch`` as a real architecture, ``"sm_XY"`` (keeping an ``a``/``f`` suffix).

    Raises `CompilerArgumentValueError` (a ``ValueError``) for anything that is not an
    architecture name or compute capability, and for a virtual ``compute_XY``, which names PTX
    rather than a cubin (the message says to ask for PTX, or to pass ``sm_XY``).
    """
    name, virtual = split_arch(arch)
    if virtual:
        raise CompilerArgumentValueError(virtual_arch_message(arch, name))
    return name


def virtual_arch_message(given, name: str, *, ptx_hint: str = "ptx=True",
                         arch_hint: str = "arch=") -> str:
    """Why a virtual ``compute_XY`` cannot make a cubin, and what to pass instead."""
    return (f"{given!r} is a virtual architecture: NVRTC makes PTX for it, not a cubin; for"
            f" {virtual_arch(name)} PTX pass {ptx_hint}, for a cubin pass {arch_hint}\"{name}\"")


def virtual_arch(arch) -> str:
    """The virtual architecture for PTX: ``"sm_90"`` (or ``"compute_90"``) -> ``"compute_90"``."""
    return "compute_" + split_arch(arch)[0][3:]


def default_arch(device=None) -> str:
    """The architecture of ``device`` (default: device 0), from ``Device.arch``.

    Without a GPU or driver raises ``ValueError`` telling the caller to pass ``arch=`` (for
    example ``arch="sm_90"``) instead of letting a `NoDeviceError` traceback escape.
    """
    from orchestra.errors import NoDeviceError

    try:
        from orchestra.driver.device import as_device

        dev = as_device(device)
        return dev.arch
    except NoDeviceError as exc:
        raise CompilerArgumentValueError(
            "no CUDA device to take the target architecture from: pass it explicitly, e.g."
            f' arch="sm_90" (compute capability 9.0); {exc}') from None

"""The GPU architecture a compile or link targets.

``arch`` is spelled as NVRTC/ptxas spell it: ``"sm_90"`` (a real architecture: a cubin with
SASS for exactly that SM), ``"sm_90a"`` (architecture-specific features), or a compute
capability given as ``"90"``, ``90``, ``"9.0"`` or ``(9, 0)``. PTX is generated for the
matching virtual architecture ``compute_90``.
"""

from __future__ import annotations

import re

from orchestra.errors import CompilerArgumentValueError

_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d)(\d{1,2})([af]?)$")


def normalize_arch(arch) -> str:
    """``arch`` as ``"sm_XY"`` (keeping an ``a``/``f`` suffix).

    Raises ``ValueError`` for anything that is not an architecture name or compute capability.
    """
    if isinstance(arch, tuple) and len(arch) == 2:
        return "sm_%d%d" % (int(arch[0]), int(arch[1]))
    if isinstance(arch, int) and not isinstance(arch, bool):
        arch = str(arch)
    if isinstance(arch, str):
        s = arch.strip().lower().replace(".", "")
        m = _ARCH_RE.match(s)
        if m:
            return f"sm_{m.group(1)}{m.group(2)}{m.group(3)}"
    raise CompilerArgumentValueError(
        f"unknown GPU architecture {arch!r}: pass a name like arch=\"sm_90\" (compute capability"
        " 9.0), or a compute capability such as (9, 0)")


def virtual_arch(arch: str) -> str:
    """The virtual architecture for PTX: ``"sm_90"`` -> ``"compute_90"``."""
    return "compute_" + normalize_arch(arch)[3:]


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

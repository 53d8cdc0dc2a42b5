"""Include directories for NVRTC, the project headers a program pulls in, and header versions.

System headers come from NVIDIA's wheels, found with ``cuda.pathfinder``:
``find_nvidia_header_directory("cccl")`` (libcu++ ``<cuda/pipeline>``, ``<cuda/barrier>``, CUB,
Thrust) and ``find_nvidia_header_directory("cudart")`` (``cooperative_groups.h``,
``cuda_pipeline_primitives.h``, ``cuda_runtime.h``). Which headers a program reaches, for the
cache key, is `orchestra.compiler.headers`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from orchestra.compiler.sources import kernel_source_dir

_MISSING_RE = re.compile(r'cannot open source file "([^"]+)"')


@functools.lru_cache(maxsize=None)
def system_include_dirs() -> tuple[str, ...]:
    """The CCCL and cudart header directories (``cuda.pathfinder``), those that exist.

    Cached for the process. Empty when the header wheels are not installed (a compile that
    needs them then fails with a missing-header `CompileError` that lists what was tried).
    """
    from cuda.pathfinder import find_nvidia_header_directory

    found = []
    for lib in ("cccl", "cudart"):
        try:
            d = find_nvidia_header_directory(lib)
        except Exception:  # noqa: BLE001 - an unsupported name or a probe failure: not found
            d = None
        if d and Path(d).is_dir() and d not in found:
            found.append(str(Path(d)))
    return tuple(found)


def include_dirs_for(source_dir, user_dirs=()) -> tuple[str, ...]:
    """Every ``-I`` directory for one compile, in search order, without duplicates:
    the including file's directory, the caller's ``user_dirs``, ``cuda_src/``, then
    `system_include_dirs()`."""
    dirs: list[str] = []
    candidates = ([source_dir] if source_dir is not None else []) + list(user_dirs)
    ksd = kernel_source_dir()
    if ksd.is_dir():
        candidates.append(ksd)
    for d in candidates:
        s = str(Path(d).resolve())
        if s not in dirs:
            dirs.append(s)
    for s in system_include_dirs():
        if s not in dirs:
            dirs.append(s)
    return tuple(dirs)


def missing_headers(log: str) -> list[str]:
    """Header names NVRTC could not open (``cannot open source file "x"``), in log order."""
    return list(dict.fromkeys(_MISSING_RE.findall(log)))


def _read_define(path: Path, macro: str) -> int | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = re.search(r"^[ \t]*#[ \t]*define[ \t]+" + macro + r"[ \t]+\(?(\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else None


_CCCL_VERSION_FILES = (
    "cuda/std/__cccl/version.h",
    "cuda/std/detail/libcxx/include/__cccl/version.h",
    "cuda/version",
    "cuda/std/version",
)


def cccl_version(directory) -> tuple[int, int, int] | None:
    """``CCCL_VERSION`` of the CCCL headers in ``directory`` as (major, minor, patch), or None."""
    d = Path(directory)
    for rel in _CCCL_VERSION_FILES:
        v = _read_define(d / rel, "CCCL_VERSION")
        if v is not None:
            return (v // 1000000, (v // 1000) % 1000, v % 1000)
    return None


def cudart_version(directory) -> tuple[int, int] | None:
    """``CUDART_VERSION`` of ``cuda_runtime_api.h`` in ``directory`` as (major, minor), or None."""
    v = _read_define(Path(directory) / "cuda_runtime_api.h", "CUDART_VERSION")
    if v is None:
        return None
    return (v // 1000, (v % 1000) // 10)


def header_versions(dirs) -> list[tuple[str, str, tuple[int, ...]]]:
    """For each directory holding CCCL or cudart headers: ``(dir, "CCCL"|"cudart", version)``."""
    out: list[tuple[str, str, tuple[int, ...]]] = []
    for d in dirs:
        v = cccl_version(d)
        if v is not None:
            out.append((str(d), "CCCL", v))
        v2 = cudart_version(d)
        if v2 is not None:
            out.append((str(d), "cudart", v2))
    return out


def describe_versions(nvrtc_version, dirs) -> tuple[str, list[str]]:
    """A one-line summary ``NVRTC 13.5; CCCL 3.5.0 in DIR; cudart 13.5 in DIR`` and a list of
    warnings for directories whose headers belong to another CUDA major version than NVRTC
    (CCCL 3.x ships with CUDA 13, CCCL 2.x with CUDA 12)."""
    parts = ["NVRTC %d.%d" % tuple(nvrtc_version)]
    warnings = []
    major = nvrtc_version[0]
    for d, kind, v in header_versions(dirs):
        ver = ".".join(str(x) for x in v)
        parts.append(f"{kind} {ver} in {d}")
        cuda_major = v[0] + 10 if kind == "CCCL" else v[0]
        if kind == "CCCL" and v[0] < 2:
            cuda_major = 11
        if cuda_major != major:
            warnings.append(
                f"{d} holds {kind} {ver} headers from CUDA {cuda_major}, but NVRTC is"
                f" {nvrtc_version[0]}.{nvrtc_version[1]}: headers of another CUDA version; remove"
                " that directory from include_dirs or install matching headers"
                " (pip install nvidia-cuda-cccl / nvidia-cuda-runtime for the same CUDA major)")
    return "; ".join(parts), warnings

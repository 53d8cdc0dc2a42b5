"""Where kernel sources live and how a `source_or_path` argument is read.

`kernel_source_dir()` holds the CUDA C++ kernels, `ptx_source_dir()` the hand-written PTX. In the
repository they are ``cuda_src/`` and ``ptx/`` at the top level; a built package (a wheel,
``pip install .``) carries copies as ``orchestra/_kernels/cuda_src/`` and
``orchestra/_kernels/ptx/`` (setup.py's build step). Both functions look in the installed
package first and in the checkout next to it second, so a normal and an editable install find
them through the same calls, from any working directory. `read_source` turns the argument every
compiler entry point takes (a path to an existing file, or the program text itself) into a
`Source`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable

import attrs

from orchestra.errors import (
    CompilerArgumentTypeError,
    KernelSourceNotFoundError,
    OrchestraError,
)

log = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../orchestra
_PACKAGED = _PACKAGE_DIR / "_kernels"                   # a built package's copies
_CHECKOUT = _PACKAGE_DIR.parent                         # the repository, in an editable install

#: File suffixes that mark a str argument as a file name rather than program text.
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inl", ".ptx")


def _kernel_dir(name: str, env: str) -> Path:
    """``$env`` if set, else the package's ``_kernels/<name>``, else the checkout's ``<name>``.

    The last is returned even when missing, so that "not found" messages name where the
    kernels were looked for."""
    override = os.environ.get(env)
    if override:
        return Path(override).resolve()
    packaged = _PACKAGED / name
    if packaged.is_dir():
        return packaged
    return _CHECKOUT / name


def kernel_source_dir() -> Path:
    """The directory of the CUDA C++ kernels (``cuda_src/``), absolute.

    Overridable with ``$ORCHESTRA_KERNEL_DIR``; otherwise the installed package's copy, or the
    checkout's ``cuda_src/`` in an editable install. Callers that need it check ``.is_dir()``.
    """
    return _kernel_dir("cuda_src", "ORCHESTRA_KERNEL_DIR")


def ptx_source_dir() -> Path:
    """The directory of the hand-written PTX kernels (``ptx/``), absolute.

    Overridable with ``$ORCHESTRA_PTX_DIR``; otherwise found as `kernel_source_dir` is.
    """
    return _kernel_dir("ptx", "ORCHESTRA_PTX_DIR")


class SourceEncodingError(OrchestraError, ValueError):
    """A kernel source file is not UTF-8 text; the message names the file and the first bad
    byte. ``path``: the file."""

    def __init__(self, path, byte: int, offset: int):
        self.path, self.byte, self.offset = str(path), byte, offset
        super().__init__(
            f"{path} is not UTF-8 text (byte 0x{byte:02x} at offset {offset}): a kernel source"
            " must be UTF-8 CUDA C++ or PTX; is it a binary file (a .cubin?) or saved in"
            " another encoding?")

    def __reduce__(self):
        return (type(self), (self.path, self.byte, self.offset))


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceEncodingError(path, data[exc.start], exc.start) from None


@attrs.frozen
class Source:
    """A program's text and where it came from.

    Attributes:
        text: the program text (str).
        path: the file it was read from (absolute `Path`), or None for text given inline.
        name: the program name NVRTC puts in its log (``file(line): error ...``): the path for
            a file, ``"<inline>.cu"`` style names for inline text.
    """

    text: str
    path: Path | None
    name: str

    @property
    def directory(self) -> Path | None:
        """The directory holding the file (searched for its ``#include "..."``), or None."""
        return self.path.parent if self.path is not None else None


def _looks_like_path(s: str) -> bool:
    if "\n" in s or "{" in s or ";" in s:
        return False
    return s.endswith(SOURCE_SUFFIXES) or os.sep in s or os.path.isfile(s)


def resolve_path(name: str | os.PathLike[str], search: Iterable[str | os.PathLike[str]] = ()
                 ) -> Path | None:
    """Find file ``name``: as given (relative to the working directory), then in each of
    ``search`` (directories). Returns an absolute `Path` or None."""
    p = Path(name)
    if p.is_file():
        return p.resolve()
    if not p.is_absolute():
        for d in search:
            q = Path(d) / p
            if q.is_file():
                return q.resolve()
    return None


def read_source(source_or_path: str | bytes | os.PathLike[str], *, inline_name: str = "inline.cu",
                search: Iterable[str | os.PathLike[str]] | None = None) -> Source:
    """Read a program given as a path or as text.

    ``source_or_path``: a `Path` (must exist), a str naming an existing file (a relative name
    is also looked up in ``search``, by default `kernel_source_dir()` and `ptx_source_dir()`),
    or the program text itself. bytes are taken as program text (UTF-8).

    Raises ``FileNotFoundError`` for a `Path`, or for a str that looks like a file name (ends in
    ``.cu``/``.ptx``/..., holds no newline) but exists nowhere; `SourceEncodingError` (a
    ``ValueError``) for a file that is not UTF-8; ``TypeError`` for other types.
    """
    search = (kernel_source_dir(), ptx_source_dir()) if search is None else tuple(search)
    if isinstance(source_or_path, bytes):
        return Source(source_or_path.decode("utf-8"), None, inline_name)
    if isinstance(source_or_path, os.PathLike) or (
        isinstance(source_or_path, str) and _looks_like_path(source_or_path)
    ):
        path = resolve_path(source_or_path, search)
        if path is None:
            dirs = ", ".join(str(d) for d in search)
            raise KernelSourceNotFoundError(
                f"kernel source {os.fspath(source_or_path)!r} not found (looked in the working"
                f" directory and {dirs}); pass an existing path or the program text itself")
        text = _read_text(path)
        log.debug("kernel source %s (%d bytes)", path, len(text))
        return Source(text, path, str(path))
    if isinstance(source_or_path, str):
        return Source(source_or_path, None, inline_name)
    raise CompilerArgumentTypeError(
        "expected a path (str or Path) to a kernel source file or the program text (str),"
        f" got {type(source_or_path).__name__}")

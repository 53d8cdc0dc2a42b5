"""Where kernel sources live and how a `source_or_path` argument is read.

`kernel_source_dir()` is the repository's ``cuda_src/`` (CUDA C++ kernels), `ptx_source_dir()`
its ``ptx/`` (hand-written PTX); both are found relative to this package, which works for the
editable install the project uses. `read_source` turns the argument every compiler entry point
takes (a path to an existing file, or the program text itself) into a `Source`.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from orchestra.errors import (
    CompilerArgumentTypeError,
    KernelSourceNotFoundError,
    OrchestraError,
)

_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _PACKAGE_DIR.parent.parent

#: File suffixes that mark a str argument as a file name rather than program text.
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inl", ".ptx")


def kernel_source_dir() -> Path:
    """The repository's ``cuda_src/`` directory (CUDA C++ kernels), absolute.

    Overridable with ``$ORCHESTRA_KERNEL_DIR``. The directory may be missing in a non-editable
    install; callers that need it check ``.is_dir()``.
    """
    env = os.environ.get("ORCHESTRA_KERNEL_DIR")
    return Path(env).resolve() if env else _REPO_ROOT / "cuda_src"


def ptx_source_dir() -> Path:
    """The repository's ``ptx/`` directory (hand-written PTX kernels), absolute.

    Overridable with ``$ORCHESTRA_PTX_DIR``.
    """
    env = os.environ.get("ORCHESTRA_PTX_DIR")
    return Path(env).resolve() if env else _REPO_ROOT / "ptx"


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


def resolve_path(name: str | os.PathLike, search=()) -> Path | None:
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


def read_source(source_or_path, *, inline_name: str = "inline.cu", search=None) -> Source:
    """Read a program given as a path or as text.

    ``source_or_path``: a `Path` (must exist), a str naming an existing file (a relative name
    is also looked up in ``search``, by default `kernel_source_dir()` and `ptx_source_dir()`),
    or the program text itself. bytes are taken as program text (UTF-8).

    Raises ``FileNotFoundError`` for a `Path`, or for a str that looks like a file name (ends in
    ``.cu``/``.ptx``/..., holds no newline) but exists nowhere; `SourceEncodingError` (a
    ``ValueError``) for a file that is not UTF-8; ``TypeError`` for other types.
    """
    if search is None:
        search = (kernel_source_dir(), ptx_source_dir())
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
        return Source(_read_text(path), path, str(path))
    if isinstance(source_or_path, str):
        return Source(source_or_path, None, inline_name)
    raise CompilerArgumentTypeError(
        "expected a path (str or Path) to a kernel source file or the program text (str),"
        f" got {type(source_or_path).__name__}")

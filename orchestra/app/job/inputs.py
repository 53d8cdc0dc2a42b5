"""The ``--input FILE.npy`` array of the main job: opened and checked in one place, so
`orchestra run` (`MainJob`) and `orchestra plan` accept and refuse the same files.

    inp = open_input("x.npy")      # JobInputError naming the file for anything but float32 data
    inp.flat                       # 1-D view in the file's own order (C or Fortran)

`check_input_file` is the part that looks at the file itself (there, a regular file, not
empty) before numpy opens it: ``np.load`` blocks forever on a FIFO and gives a bare
``EOFError`` for an empty file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs
import numpy as np

from orchestra.errors import JobInputError


@attrs.frozen
class InputArray:
    """A checked ``.npy`` input: ``array`` (memory-mapped, as stored) and ``fortran``
    (stored in Fortran order: `flat` and a result written with the same order follow it).

    Immutable (frozen) record; ``array`` is a read-only memory map of the file: may be shared
    between threads for reading.
    """

    path: Path
    array: np.ndarray = attrs.field(eq=False, repr=False)
    fortran: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def size(self) -> int:
        """Elements (float32) in the file."""
        return int(self.array.size)

    @property
    def flat(self) -> np.ndarray:
        """The elements in storage order, as a 1-D view of the memory map (no copy)."""
        return (self.array.T if self.fortran else self.array).reshape(-1)


def check_input_file(path: str | os.PathLike) -> None:
    """Refuse ``path`` unless it is an existing, readable, non-empty regular file.

    Looks only at ``os.stat`` (nothing is opened, so a FIFO cannot block). Raises
    `JobInputError` (a ``ValueError``) naming the file and what to pass instead: missing, not
    readable, a directory, not a regular file (a FIFO, a socket, ``/dev/null`` or another
    device: the array is memory-mapped from a file), or 0 bytes long. Thread-safe.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise JobInputError(f"{path}: no such file") from None
    except OSError as exc:  # a path through a file, a name too long, no permission on a folder
        raise JobInputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise JobInputError(f"{path} is a directory: pass a .npy file (np.save)")
    if not stat.S_ISREG(st.st_mode):
        raise JobInputError(f"{path} is not a regular file (a pipe, a socket or a device): "
                            "the array is memory-mapped from a file; save it with np.save first")
    if st.st_size == 0:
        raise JobInputError(f"{path} is empty (0 bytes): not a .npy file; save the array "
                            "with np.save")


def open_input(path: str | os.PathLike) -> InputArray:
    """Memory-map ``path`` and check it is a non-empty float32 (little-endian) ``.npy`` array.

    The one check of an input file: `MainJob` (``input=``), `orchestra run --input` and
    `orchestra plan --input` all call it. Raises `JobInputError` (a ``ValueError``) naming the
    file otherwise: what `check_input_file` refuses, another dtype or byte order, an empty
    array, an ``.npz`` archive, not a ``.npy`` file (garbage, a truncated header), a file that
    cannot be read (no permission). Nothing stays open on an error. Thread-safe.
    """
    path = Path(path)
    check_input_file(path)
    try:
        src = np.load(path, mmap_mode="r")
    except (ValueError, EOFError) as exc:  # not a .npy file: pickle data, garbage, truncated
        raise JobInputError(f"{path}: not a .npy array numpy can load ({exc})") from None
    except OSError as exc:  # the permission to read it, an I/O error
        raise JobInputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(src, np.ndarray):  # np.load opens an .npz archive as a dict of arrays
        close = getattr(src, "close", None)
        if close is not None:
            close()
        raise JobInputError(f"{path}: not a .npy array ({type(src).__name__}); --input takes one "
                            "array saved with np.save")
    if src.dtype != np.dtype("<f4"):
        raise JobInputError(f"{path}: the array is {src.dtype}; orchestra run --input "
                            "streams float32 (little-endian) arrays: convert it with "
                            "np.save(path, a.astype(np.float32))")
    if src.size == 0:
        raise JobInputError(f"{path}: the array is empty")
    fortran = bool(src.flags.f_contiguous and not src.flags.c_contiguous)
    return InputArray(path, src, fortran)

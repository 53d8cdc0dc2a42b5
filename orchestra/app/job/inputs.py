"""The ``--input FILE.npy`` array of the main job: opened and checked in one place, so
`orchestra run` (`MainJob`) and `orchestra plan` accept and refuse the same files.

    inp = open_input("x.npy")      # ValueError naming the file for anything but float32 data
    inp.flat                       # 1-D view in the file's own order (C or Fortran)
"""

from __future__ import annotations

import os
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


def open_input(path: str | os.PathLike) -> InputArray:
    """Memory-map ``path`` and check it is a non-empty float32 (little-endian) ``.npy`` array.

    Raises ValueError naming the file otherwise (another dtype or byte order, an empty array,
    an ``.npz`` archive, not a ``.npy`` file); OSError when it cannot be read.
    """
    path = Path(path)
    try:
        src = np.load(path, mmap_mode="r")
    except ValueError as exc:  # not a .npy file (pickle data, garbage, object arrays)
        raise JobInputError(f"{path}: not a .npy array numpy can load ({exc})") from None
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

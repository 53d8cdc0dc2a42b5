"""Host copies of request-sized arrays that keep the GIL.

numpy releases the GIL around any copy of more than 500 elements. For a request of 64 KiB the
copy itself takes a few µs, but under load (8 threads submitting, the completion thread, the
timer) every release hands the GIL to a waiting thread, and the copying thread must then wait
for it back: a hand-off, and often a sleep and a wake-up, per copy. Measured on the H200
machine's CPUs with the leanest batching hand-off Python allows (8 threads, one request each
in flight, a GIL-free stand-in for the GPU): 64 KiB requests copied in and out by numpy ran at
15-22 thousand requests/s, 1 KiB requests at 33-47 thousand: the cost is the hand-offs, not
the bytes. So the engine's per-request copies (one request's rows in and out; a batch's rows
stay one numpy call each way, which measured faster: one release per batch, during which the
other threads do their own work) up to `HOLD_LIMIT` bytes are one ``memmove`` called
through ctypes' ``PYFUNCTYPE`` (a foreign call that keeps the GIL, unlike
``CFUNCTYPE``/``ctypes.memmove``); larger copies stay with numpy, which lets other threads run
meanwhile.

The memmove runs only for what it copies exactly: numpy arrays (subclasses included), both
C-contiguous, of equal shape and dtype (no object fields), into a writable array. Anything
else (a strided or reversed view, a Fortran-order array, other shapes or dtypes: a custom
`Backend`'s staging, say) is numpy's copy, with numpy's result or numpy's error: never a copy
of the wrong bytes or past the end of an array.

Thread-safety: both functions may be called from any thread; a copy is atomic with respect to
other Python threads only in that no Python code runs during it (the GIL is held).
"""

from __future__ import annotations

import ctypes

import numpy as np

#: Copies of at most this many bytes keep the GIL (about 60 µs of memcpy on a slow host: a
#: bound on how long other threads, an event loop among them, wait for it).
HOLD_LIMIT = 256 << 10

_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t)(ctypes._memmove_addr)  # type: ignore[attr-defined]


def address(a) -> int:
    """The address of ``a``'s first byte (``__array_interface__``'s data pointer)."""
    return a.__array_interface__["data"][0]


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)``: one ``memmove`` with the GIL held when both are C-contiguous
    numpy arrays of the same shape and dtype, ``dst`` writable, of at most `HOLD_LIMIT` bytes
    (the engine's staging rows and checked requests); otherwise ``np.copyto`` itself (its
    casts, its broadcasting, its errors)."""
    n = src.nbytes
    if (n <= HOLD_LIMIT and isinstance(dst, np.ndarray)
            and isinstance(src, np.ndarray) and dst.shape == src.shape
            and dst.dtype == src.dtype and not src.dtype.hasobject):
        fd = dst.flags
        if fd.c_contiguous and fd.writeable and src.flags.c_contiguous:
            _memmove(address(dst), address(src), n)
            return
    np.copyto(dst, src)


def copied(src: np.ndarray) -> np.ndarray:
    """A new C-contiguous copy of ``src`` (``src.copy()``): one ``memmove`` with the GIL held
    when ``src`` is a C-contiguous ndarray (not a subclass: ``src.copy()`` keeps those) of at
    most `HOLD_LIMIT` bytes, otherwise ``src.copy()``."""
    if (src.nbytes <= HOLD_LIMIT and type(src) is np.ndarray
            and src.flags.c_contiguous and not src.dtype.hasobject):
        out = np.empty(src.shape, src.dtype)
        _memmove(address(out), address(src), src.nbytes)
        return out
    return src.copy()


__all__ = ["HOLD_LIMIT", "address", "copied", "copy_into"]

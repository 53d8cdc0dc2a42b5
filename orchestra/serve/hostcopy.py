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
other threads do their own work) of more than `NUMPY_HOLDS` elements and at most `HOLD_LIMIT`
bytes are one ``memmove`` called through ctypes' ``PYFUNCTYPE`` (a foreign call that keeps the
GIL, unlike ``CFUNCTYPE``/``ctypes.memmove``); larger copies stay with numpy, which lets other
threads run meanwhile, and so do smaller ones: numpy keeps the GIL for those itself, and its
copy costs less than the ctypes call.

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

#: numpy keeps the GIL for copies of at most this many elements (its
#: ``NPY_BEGIN_THREADS_THRESHOLDED``): no hand-off to avoid, and its copy is the cheaper one.
NUMPY_HOLDS = 500

_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t)(ctypes._memmove_addr)  # type: ignore[attr-defined]
_pointer_at = ctypes.c_void_p.from_address


class _Probe(np.ndarray):
    pass


def _data_offset() -> int | None:
    """Where an ndarray object keeps its data pointer (numpy's ``PyArrayObject.data``, right
    after the object header), found by comparing with ``__array_interface__`` on a few arrays;
    None when no offset matches all of them (then `address` asks ``__array_interface__``).
    Reading it is a few hundred ns; ``__array_interface__`` builds a dict (over 1 µs)."""
    base = np.arange(64, dtype=np.uint8)
    probes: list[np.ndarray] = [base, base[5:], base[9:40].reshape(1, 31),
                                np.zeros((3, 4), np.float64),
                                base[32:].view(_Probe)]  # a subclass: the same object layout
    step = ctypes.sizeof(ctypes.c_void_p)
    # the header is 2 words (4 in a free-threaded or trace-refs build); at most 8 words in,
    # the reads stay inside the array object (about 12 words of numpy's own fields)
    for off in range(step, 8 * step + 1, step):
        if all((_pointer_at(id(p) + off).value or 0) == p.__array_interface__["data"][0]
               for p in probes):
            return off
    return None


_DATA_OFFSET = _data_offset()


def address(a) -> int:
    """The address of ``a``'s first byte (``__array_interface__``'s data pointer; for a numpy
    array read from the array object itself, which is cheaper)."""
    if _DATA_OFFSET is not None and isinstance(a, np.ndarray):
        return _pointer_at(id(a) + _DATA_OFFSET).value or 0
    return a.__array_interface__["data"][0]


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)``: one ``memmove`` with the GIL held when both are C-contiguous
    numpy arrays of the same shape and dtype, ``dst`` writable, of more than `NUMPY_HOLDS`
    elements and at most `HOLD_LIMIT` bytes (the engine's staging rows and checked requests);
    otherwise ``np.copyto`` itself (its casts, its broadcasting, its errors)."""
    n = src.nbytes
    if (n <= HOLD_LIMIT and src.size > NUMPY_HOLDS and isinstance(dst, np.ndarray)
            and isinstance(src, np.ndarray) and dst.shape == src.shape
            and dst.dtype == src.dtype and not src.dtype.hasobject):
        fd = dst.flags
        if fd.c_contiguous and fd.writeable and src.flags.c_contiguous:
            _memmove(address(dst), address(src), n)
            return
    np.copyto(dst, src)


def copied(src: np.ndarray) -> np.ndarray:
    """A new C-contiguous copy of ``src`` (``src.copy()``): one ``memmove`` with the GIL held
    when ``src`` is a C-contiguous ndarray (not a subclass: ``src.copy()`` keeps those) of more
    than `NUMPY_HOLDS` elements and at most `HOLD_LIMIT` bytes, otherwise ``src.copy()``."""
    if (src.nbytes <= HOLD_LIMIT and src.size > NUMPY_HOLDS and type(src) is np.ndarray
            and src.flags.c_contiguous and not src.dtype.hasobject):
        out = np.empty(src.shape, src.dtype)
        _memmove(address(out), address(src), src.nbytes)
        return out
    return src.copy()


__all__ = ["HOLD_LIMIT", "NUMPY_HOLDS", "address", "copied", "copy_into"]

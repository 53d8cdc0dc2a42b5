"""Host copies of request-sized arrays that keep the GIL.

numpy releases the GIL around any copy of more than a few hundred elements. For a request of
64 KiB the copy itself takes a few µs, but under load (8 threads submitting, the completion
thread, the timer) every release hands the GIL to a waiting thread, and the copying thread
must then wait for it back: a hand-off, and often a sleep and a wake-up, per copy. Measured on
the H200 machine's CPUs with the leanest batching hand-off Python allows (8 threads, one
request each in flight, a GIL-free stand-in for the GPU): 64 KiB requests copied in and out by
numpy ran at 15-22 thousand requests/s, 1 KiB requests at 33-47 thousand: the cost is the
hand-offs, not the bytes. So the engine's per-request copies (one request's rows in and out;
a batch's rows stay one numpy call each way, which measured faster: one release per batch,
during which the other threads do their own work) up to `HOLD_LIMIT` bytes are one
``memmove`` called through ctypes' ``PYFUNCTYPE`` (a foreign call that keeps the GIL, unlike
``CFUNCTYPE``/``ctypes.memmove``); larger copies stay with numpy, which lets other threads run
meanwhile.

Both functions need C-contiguous arrays (the engine checks every request for it, and its
staging rows are C-contiguous prefixes); `copy_into` needs equal shapes and dtypes.

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


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first byte (``__array_interface__``'s data pointer)."""
    return a.__array_interface__["data"][0]


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for C-contiguous arrays of the same shape and dtype (the
    caller's contract: the engine's staging rows and checked requests): up to `HOLD_LIMIT`
    bytes one ``memmove`` with the GIL held, above it ``np.copyto`` (GIL released)."""
    n = src.nbytes
    if n > HOLD_LIMIT:
        np.copyto(dst, src)
    elif n:
        _memmove(address(dst), address(src), n)


def copied(src: np.ndarray) -> np.ndarray:
    """A new C-contiguous copy of ``src`` (``src.copy()``), up to `HOLD_LIMIT` bytes with the
    GIL held."""
    if src.nbytes > HOLD_LIMIT:
        return src.copy()
    out = np.empty(src.shape, src.dtype)
    if src.nbytes:
        _memmove(address(out), address(src), src.nbytes)
    return out


__all__ = ["HOLD_LIMIT", "address", "copied", "copy_into"]

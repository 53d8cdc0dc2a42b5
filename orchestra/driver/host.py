"""Page-locked (pinned) host memory: the only host memory orchestra copies to or from.

Asynchronous copies need page-locked memory: from pageable memory the driver stages through a
bounce buffer and the copy no longer overlaps with other work. Two ways to get it:

- `PinnedBuffer` allocates it (``cuMemHostAlloc`` with ``CU_MEMHOSTALLOC_PORTABLE``, freed with
  ``cuMemFreeHost``), and exposes numpy views of it;
- `register_host` page-locks an existing numpy array in place (``cuMemHostRegister`` with
  ``CU_MEMHOSTREGISTER_PORTABLE``, undone with ``cuMemHostUnregister``).

Portable memory counts as pinned in every context, so one buffer serves every device.
"""

from __future__ import annotations

import bisect
import math
import operator
import threading

import numpy as np
from cuda.bindings import driver

from orchestra.driver.check import cu, device_available
from orchestra.driver.device import Device, as_device
from orchestra.driver.owner import Owner, Resource
from orchestra.errors import (
    CudaError,
    DriverArgumentTypeError,
    DriverArgumentValueError,
    PageableMemoryError,
)


class PinnedRanges:
    """The address ranges ``[lo, hi)`` of page-locked memory that orchestra itself allocated
    (`PinnedBuffer`) or registered (`HostRegistration`), kept while they are pinned.

    Executors check bindings against it before asking the driver: a hit costs a bisect under a
    lock instead of two ``cuPointerGetAttribute`` calls, so a loop of many runs does no driver
    query on its hot path. Ranges never overlap (the driver refuses overlapping registrations).

    ``version`` counts removals: an answer "covered" stays true while it is unchanged (adding
    a range never unpins anything), which lets callers remember checked arrays.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}
        self.version = 0

    def add(self, lo: int, nbytes: int) -> None:
        with self._lock:
            if lo not in self._ends:
                bisect.insort(self._starts, lo)
            self._ends[lo] = lo + nbytes

    def discard(self, lo: int) -> None:
        with self._lock:
            if self._ends.pop(lo, None) is not None:
                del self._starts[bisect.bisect_left(self._starts, lo)]
                self.version += 1

    def covers(self, lo: int, hi: int) -> bool:
        """True when ``[lo, hi)`` lies inside one known pinned range."""
        with self._lock:
            i = bisect.bisect_right(self._starts, lo) - 1
            return i >= 0 and hi <= self._ends[self._starts[i]]

    def __len__(self) -> int:
        return len(self._starts)


_pinned = PinnedRanges()


def pinned_ranges() -> PinnedRanges:
    """The process-wide `PinnedRanges` registry (filled by `PinnedBuffer` and `register_host`)."""
    return _pinned


def _free_pinned(ptr: int) -> None:
    _pinned.discard(ptr)
    cu(driver.cuMemFreeHost, ptr)


def _unregister(ptr: int) -> None:
    _pinned.discard(ptr)
    cu(driver.cuMemHostUnregister, ptr)


class PinnedBuffer(Resource):
    """``nbytes`` (int, > 0) bytes of page-locked host memory on behalf of ``device``
    (None: device 0; portable, so usable with every device).

    ``.ptr`` (int address), ``.nbytes``, ``.array`` (a numpy view with the shape and dtype given
    to `empty`, else 1-D ``uint8``), `view`. Every view's ``.base`` is this object, so the
    memory stays allocated while a view lives and the garbage collector cannot free it under
    one; `close()` (``cuMemFreeHost``, idempotent) frees it at once, so drop the views first.
    ``cuMemHostAlloc`` failing raises `CudaError` (``CUDA_ERROR_OUT_OF_MEMORY``).
    """

    def __init__(self, nbytes: int, device: Device | int | None = None):
        nbytes = operator.index(nbytes)
        if nbytes < 1:
            raise DriverArgumentValueError(
                f"PinnedBuffer needs a positive size in bytes, got {nbytes}")
        self.device = as_device(device)
        self.nbytes = nbytes
        self._shape: tuple[int, ...] = (nbytes,)
        self._dtype = np.dtype(np.uint8)
        self.device.make_current()
        ptr = int(cu(driver.cuMemHostAlloc, nbytes, driver.CU_MEMHOSTALLOC_PORTABLE))
        self._own = Owner(self, ptr, _free_pinned, self.device, "PinnedBuffer")
        _pinned.add(ptr, nbytes)

    @classmethod
    def empty(cls, shape, dtype=np.float32, device: Device | int | None = None) -> "PinnedBuffer":
        """A pinned buffer sized for an array of ``shape`` and ``dtype`` (uninitialized);
        ``.array`` then has that shape and dtype."""
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise DriverArgumentTypeError("PinnedBuffer cannot hold Python objects (dtype=object)")
        shape = (operator.index(shape),) if np.ndim(shape) == 0 else tuple(map(operator.index, shape))
        buf = cls(math.prod(shape) * dtype.itemsize, device)
        buf._shape, buf._dtype = shape, dtype
        return buf

    @property
    def ptr(self) -> int:
        """The host address (int); ``ValueError`` once closed."""
        return self._own.handle

    @property
    def __array_interface__(self) -> dict:
        # numpy keeps the object that exports this as the view's .base: the owner stays alive.
        return {"version": 3, "shape": (self.nbytes,), "typestr": "|u1",
                "data": (self.ptr, False)}

    @property
    def array(self) -> np.ndarray:
        """A writable numpy view of the whole buffer (shape/dtype from `empty`, else uint8)."""
        return self.view(self._dtype, self._shape)

    def view(self, dtype=np.uint8, shape=None) -> np.ndarray:
        """A numpy view of the first bytes of the buffer as ``dtype`` with ``shape``
        (default: as many whole elements as fit, 1-D). ``ValueError`` if it does not fit."""
        dtype = np.dtype(dtype)
        if shape is None:
            shape = (self.nbytes // dtype.itemsize,)
        shape = (operator.index(shape),) if np.ndim(shape) == 0 else tuple(shape)
        need = math.prod(shape) * dtype.itemsize
        if need > self.nbytes:
            raise DriverArgumentValueError(
                f"a {shape} {dtype} view needs {need} bytes; the PinnedBuffer has {self.nbytes}")
        return np.asarray(self)[:need].view(dtype).reshape(shape)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self._own.handle:x}"
        return f"<PinnedBuffer {self.nbytes} bytes at {state}>"


class HostRegistration(Resource):
    """A numpy array page-locked in place (``cuMemHostRegister``, PORTABLE); `close()` or the
    end of a ``with`` block unregisters it (``cuMemHostUnregister``).

    ``.array`` (the registered array, kept alive by this object), ``.ptr`` (int), ``.nbytes``.
    Registration works on whole pages: two arrays sharing a page cannot both be registered
    (`CudaError` ``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``).
    """

    def __init__(self, array: np.ndarray, device: Device | int | None = None):
        if not isinstance(array, np.ndarray):
            raise DriverArgumentTypeError(
                f"register_host expects a numpy array, got {type(array).__name__}")
        _check_layout(array, "register_host")
        if not array.flags.writeable:
            raise DriverArgumentValueError(
                "register_host refuses a read-only array: registration is for "
                "buffers the GPU writes too; pass a writable copy (array.copy())")
        if array.nbytes == 0:
            raise DriverArgumentValueError("register_host: the array is empty (0 bytes)")
        self.device = as_device(device)
        self.array = array
        self.nbytes = array.nbytes
        self.device.make_current()
        ptr = array.ctypes.data
        cu(driver.cuMemHostRegister, ptr, self.nbytes, driver.CU_MEMHOSTREGISTER_PORTABLE)
        self._own = Owner(self, ptr, _unregister, self.device, "HostRegistration")
        _pinned.add(ptr, self.nbytes)

    @property
    def ptr(self) -> int:
        """The host address (int); ``ValueError`` once unregistered."""
        return self._own.handle

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{self._own.handle:x}"
        return f"<HostRegistration {self.nbytes} bytes at {state}>"


def register_host(array: np.ndarray, device: Device | int | None = None) -> HostRegistration:
    """Page-lock ``array`` in place; see `HostRegistration`. Use it as a context manager.

    Raises ``ValueError`` for a non-contiguous, read-only or empty array, ``TypeError`` for
    a non-array or dtype=object, `CudaError` when the driver refuses.
    """
    return HostRegistration(array, device)


def is_pinned(array) -> bool:
    """True when all of ``array``'s memory is page-locked (``cuMemHostAlloc`` or registered).

    Asks ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`` for the first and last byte
    (``CU_MEMORYTYPE_HOST`` means page-locked; ``CUDA_ERROR_INVALID_VALUE`` means pageable).
    ``cuMemHostGetFlags`` is not used: it fails for registered memory. Never raises for a
    numpy array: without a driver, or for an empty array, the answer is False.
    """
    if isinstance(array, (PinnedBuffer, HostRegistration)):
        return not array.closed
    if not isinstance(array, np.ndarray):
        raise DriverArgumentTypeError(
            f"is_pinned expects a numpy array, got {type(array).__name__}")
    if array.nbytes == 0:
        return False
    if _pinned.covers(*_byte_bounds(array)):  # orchestra's own pinned memory: no driver query
        return True
    if not device_available():
        return False
    with Device.get(0).pushed():  # pointer queries need a current (UVA) context
        return _pinned_here(array)


def _pinned_here(array: np.ndarray) -> bool:
    low, high = _byte_bounds(array)
    return _host_locked(low) and _host_locked(high - 1)


def _host_locked(address: int) -> bool:
    try:
        kind = cu(driver.cuPointerGetAttribute,
                  driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    except CudaError as err:
        if err.name == "CUDA_ERROR_INVALID_VALUE":  # memory the driver does not know: pageable
            return False
        raise
    return int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    """``[low, high)`` addresses spanned by ``array`` (any strides)."""
    low = high = array.ctypes.data
    for n, stride in zip(array.shape, array.strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + array.itemsize


def _check_layout(array: np.ndarray, what: str) -> None:
    if array.dtype.hasobject:
        raise DriverArgumentTypeError(
            f"{what}: arrays of Python objects (dtype=object) cannot be copied")
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise DriverArgumentValueError(
            f"{what}: the array is not contiguous (strides {array.strides}); call "
            "np.ascontiguousarray(array) first, or copy it into a PinnedBuffer's .array")


def host_span(obj, nbytes: int, what: str, *, writable: bool) -> int:
    """Address of the pinned host memory ``obj`` for a copy of exactly ``nbytes`` bytes.

    ``obj``: a `PinnedBuffer`, `HostRegistration` or numpy array. Refuses, before anything is
    enqueued: a size other than ``nbytes`` (``ValueError`` naming both sizes), a
    non-contiguous array (``ValueError``), dtype=object, a read-only destination, and pageable
    memory (``TypeError`` saying to use `PinnedBuffer` or `register_host`). Call with the
    target device's context current.
    """
    if isinstance(obj, PinnedBuffer):
        _checked_size(obj.nbytes, nbytes, what)
        return obj.ptr
    if isinstance(obj, HostRegistration):
        obj.ptr  # noqa: B018 - ValueError once unregistered
        array, known_pinned = obj.array, True
    elif isinstance(obj, np.ndarray):
        array, known_pinned = obj, False
    else:
        raise DriverArgumentTypeError(
            f"{what} expects a PinnedBuffer, HostRegistration or numpy array, "
            f"got {type(obj).__name__}")
    _check_layout(array, what)
    if writable and not array.flags.writeable:
        raise DriverArgumentValueError(f"{what}: the destination array is read-only")
    _checked_size(array.nbytes, nbytes, what)
    if not known_pinned and not _pinned.covers(*_byte_bounds(array)) and not _pinned_here(array):
        raise PageableMemoryError(
            f"{what}: the numpy array is in pageable memory, which cannot be copied "
            "asynchronously; allocate it with PinnedBuffer.empty(shape, dtype).array or "
            "page-lock it with register_host(array)")
    return array.ctypes.data


def _checked_size(size: int, nbytes: int, what: str) -> None:
    if size != nbytes:
        raise DriverArgumentValueError(
            f"{what}: the host side has {size} bytes, the device buffer {nbytes}")

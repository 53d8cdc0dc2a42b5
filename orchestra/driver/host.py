"""Page-locked (pinned) host memory: the only host memory orchestra copies to or from.

Asynchronous copies need page-locked memory: from pageable memory the driver stages through a
bounce buffer and the copy no longer overlaps with other work. Two ways to get it:

- `PinnedBuffer` allocates it (``cuMemHostAlloc`` with ``CU_MEMHOSTALLOC_PORTABLE``, freed with
  ``cuMemFreeHost``), and exposes numpy views of it;
- `register_host` page-locks an existing numpy array in place (``cuMemHostRegister`` with
  ``CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP``, undone with
  ``cuMemHostUnregister``).

Both are mapped into the device's address space: with unified addressing a kernel reads and
writes them at their host address (``cuMemHostAlloc`` memory always; registered memory where
``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`` is set), which is what
orchestra's copy kernels use (`Device.kernel_host_access`).

Portable memory counts as pinned in every context, so one buffer serves every device.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import threading

import numpy as np
from cuda.bindings import driver

from orchestra.driver.check import cu, device_available
from orchestra.driver.device import Device, as_device
from orchestra.driver.owner import Lease, Owner, Resource, ResourceClosedError
from orchestra.errors import (
    CudaError,
    DriverArgumentTypeError,
    DriverArgumentValueError,
    PageableMemoryError,
)


class PinnedRanges:
    """The address ranges ``[lo, hi)`` of page-locked memory that orchestra itself allocated
    (`PinnedBuffer`) or registered (`HostRegistration`), each with the `Owner` behind it, kept
    until the memory is really unpinned (``cuMemFreeHost`` / ``cuMemHostUnregister``): while
    the owner is closed but leased, the range stays and reads as closed.

    Executors check bindings against it before asking the driver: a hit costs a bisect under a
    lock instead of two ``cuPointerGetAttribute`` calls, so a loop of many runs does no driver
    query on its hot path. Ranges never overlap (the driver refuses overlapping registrations).

    ``version`` counts removals and closes: an answer "covered" stays true while it is
    unchanged (adding a range never unpins anything), which lets callers remember checked
    arrays.

    Thread-safety: may be shared between threads: every query and change holds the re-entrant lock.
    It is re-entrant because a finalizer (a forgotten buffer's release, which removes its range) may
    run on the thread that holds it; every change is one step that leaves the lists consistent.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._starts: list[int] = []
        self._ends: dict[int, tuple[int, Owner | None]] = {}  # lo -> (hi, owner)
        self.version = 0

    def add(self, lo: int, nbytes: int, owner: Owner | None = None) -> None:
        """Record ``[lo, lo + nbytes)`` as pinned by ``owner`` (its `lease` backs `lease`)."""
        with self._lock:
            if lo not in self._ends:
                bisect.insort(self._starts, lo)
            self._ends[lo] = (lo + nbytes, owner)

    def discard(self, lo: int, owner: Owner | None = None) -> None:
        """Forget the range starting at ``lo`` (its memory was unpinned); with ``owner``, only
        if the range is still that owner's (not new memory pinned at the same address)."""
        with self._lock:
            end = self._ends.get(lo)
            if end is not None and (owner is None or end[1] is owner):
                del self._ends[lo]
                del self._starts[bisect.bisect_left(self._starts, lo)]
                self.version += 1

    def closing(self, lo: int) -> None:
        """The range's owner was closed: earlier "covered" answers no longer hold."""
        with self._lock:
            self.version += 1

    def _find(self, lo: int, hi: int):
        """(hi_of_range, owner) of the range holding all of ``[lo, hi)``, else None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, lo) - 1
            if i < 0:
                return None
            end = self._ends.get(self._starts[i])
        return end if end is not None and hi <= end[0] else None

    def covers(self, lo: int, hi: int) -> bool:
        """True when ``[lo, hi)`` lies inside one known pinned range whose owner is open."""
        hit = self._find(lo, hi)
        return hit is not None and (hit[1] is None or not hit[1].closed)

    def closed_owner(self, lo: int, hi: int) -> str | None:
        """The kind (``"PinnedBuffer"``, ``"HostRegistration"``) of the closed owner whose
        memory, kept pinned only for earlier work, holds ``[lo, hi)``; None otherwise."""
        hit = self._find(lo, hi)
        if hit is not None and hit[1] is not None and hit[1].closed:
            return hit[1]._what
        return None

    def owner(self, lo: int, hi: int) -> Owner | None:
        """The `Owner` of the orchestra memory that holds all of ``[lo, hi)`` (open or closed),
        or None (memory pinned outside orchestra, or not pinned). Its ``lease()`` is what
        `lease` takes; callers that bind the same memory again keep it to skip the lookup."""
        hit = self._find(lo, hi)
        return None if hit is None else hit[1]

    def lease(self, lo: int, hi: int) -> Lease | None:
        """A `Lease` on the owner of the orchestra memory that holds all of ``[lo, hi)``, so
        an executor that binds a plain numpy view of it keeps the memory pinned and allocated
        until the lease is released; None when no orchestra range holds it (memory pinned
        outside orchestra, e.g. by torch, or not pinned: ask `is_pinned`).

        Raises `ResourceClosedError` when the owner is closed (its memory is kept only for
        work that leased it before): close-then-bind is refused, never a read of memory about
        to be freed.
        """
        hit = self._find(lo, hi)
        if hit is None or hit[1] is None:
            return None
        owner = hit[1]
        try:
            return owner.lease()
        except ResourceClosedError:
            raise ResourceClosedError(
                f"the host memory [{lo:#x}, {hi:#x}) belongs to a {owner._what} that is "
                "closed: it cannot be bound to new work; bind memory of an open PinnedBuffer "
                "or HostRegistration", owner._what) from None

    def __len__(self) -> int:
        return len(self._starts)


_pinned = PinnedRanges()


def pinned_ranges() -> PinnedRanges:
    """The process-wide `PinnedRanges` registry (filled by `PinnedBuffer` and `register_host`)."""
    return _pinned


class _Unpin:
    """The release of orchestra's pinned memory at ``ptr``: ``cuMemFreeHost`` (``array`` None)
    or ``cuMemHostUnregister`` of ``array``, which it keeps alive until then (the memory must
    not go back to Python's allocator while it is registered or leased). The range is removed
    afterwards, and only if it is still this owner's: until the driver call returns the memory
    is pinned, and a lease asked for meanwhile is refused as closed, not answered "unknown"."""

    __slots__ = ("array", "owner")

    def __init__(self, array=None):
        self.array = array
        self.owner = None  # set once the Owner exists

    def __call__(self, ptr: int) -> None:
        try:
            if self.array is None:
                cu(driver.cuMemFreeHost, ptr)
            else:
                cu(driver.cuMemHostUnregister, ptr)
        finally:
            _pinned.discard(ptr, self.owner)
            self.array = self.owner = None


def _owned_pinned(obj, ptr: int, nbytes: int, release: _Unpin, device, what: str) -> Owner:
    own = Owner(obj, ptr, release, device, what, on_close=functools.partial(_pinned.closing, ptr))
    release.owner = own
    _pinned.add(ptr, nbytes, own)
    return own


class PinnedBuffer(Resource):
    """``nbytes`` (int, > 0) bytes of page-locked host memory on behalf of ``device``
    (None: device 0; portable, so usable with every device).

    ``.ptr`` (int address), ``.nbytes``, ``.array`` (a numpy view with the shape and dtype given
    to `empty`, else 1-D ``uint8``), `view`. Every view's ``.base`` is this object, so the
    memory stays allocated while a view lives and the garbage collector cannot free it under
    one; `close()` (``cuMemFreeHost``, idempotent) frees it at once, so drop the views first.
    ``cuMemHostAlloc`` failing raises `CudaError` (``CUDA_ERROR_OUT_OF_MEMORY``).

    Thread-safety: the object may be shared between threads: `close` and `lease` go through the
    `Owner`, whose bookkeeping is atomic, so they may race each other and the finalizer from any
    thread: the handle is released exactly once, after the last lease. The memory is plain host
    memory: threads (and the copies the GPU runs) that write it at once race, so order them
    yourself; `close` frees it at once even while another thread uses a view (take a `lease` for
    work in flight).
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
        self._own = _owned_pinned(self, ptr, nbytes, _Unpin(), self.device, "PinnedBuffer")

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
        """The host address (int); `ResourceClosedError` (a ``ValueError``) once closed."""
        return self._own.handle

    def lease(self) -> Lease:
        """A `Lease` whose ``.handle`` (the int address) stays allocated and pinned until it
        is released, even if the buffer is closed meanwhile. `ResourceClosedError` if closed
        already. Release it only after the work that uses the memory has completed."""
        return self._own.lease()

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

    Lifetime: `lease` (or ``pinned_ranges().lease(lo, hi)`` for the array's address range)
    keeps the array registered, and alive, for work that refers to it. `close()` while a lease
    is out returns at once and the registration reads as closed (``.ptr`` raises
    `ResourceClosedError`, no new lease, `is_pinned` is False for the array), but
    ``cuMemHostUnregister`` runs when the last lease ends (docs/errors.md, "Lifetimes").

    Thread-safety: the object may be shared between threads: `close` and `lease` go through the
    `Owner`, whose bookkeeping is atomic, so they may race each other and the finalizer from any
    thread: the handle is released exactly once, after the last lease. The array's contents are the
    caller's to guard, as for any numpy array.
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
        # DEVICEMAP: mapped into the device address space, so copy kernels can address it
        # (with unified addressing at the host pointer itself, docs/graphs.md)
        cu(driver.cuMemHostRegister, ptr, self.nbytes,
           driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP)
        self._own = _owned_pinned(self, ptr, self.nbytes, _Unpin(array), self.device,
                                  "HostRegistration")

    @property
    def ptr(self) -> int:
        """The host address (int); `ResourceClosedError` (a ``ValueError``) once closed."""
        return self._own.handle

    def lease(self) -> Lease:
        """A `Lease` whose ``.handle`` (the int address) stays registered until it is
        released, even if the registration is closed meanwhile. `ResourceClosedError` if
        closed already. Release it only after the work that uses the memory has completed."""
        return self._own.lease()

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
    ``cuMemHostGetFlags`` is not used: it fails for registered memory. Memory of a closed
    `PinnedBuffer` / `HostRegistration` that a lease keeps pinned for earlier work reads False:
    new work must not use it. Never raises for a numpy array: without a driver, or for an
    empty array, the answer is False.
    """
    if isinstance(array, (PinnedBuffer, HostRegistration)):
        return not array.closed
    if not isinstance(array, np.ndarray):
        raise DriverArgumentTypeError(
            f"is_pinned expects a numpy array, got {type(array).__name__}")
    if array.nbytes == 0:
        return False
    bounds = _byte_bounds(array)
    if _pinned.covers(*bounds):  # orchestra's own pinned memory: no driver query
        return True
    if _pinned.closed_owner(*bounds) is not None:  # pinned only until earlier work ends
        return False
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
    closed = None if known_pinned else _pinned.closed_owner(*_byte_bounds(array))
    if closed is not None:
        raise ResourceClosedError(
            f"{what}: the numpy array is memory of a {closed} that is closed (kept only for "
            "work that used it before); use an open PinnedBuffer or HostRegistration", closed)
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

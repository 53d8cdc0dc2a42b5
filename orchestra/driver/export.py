"""Orchestra device memory out: DLPack and the CUDA Array Interface for `DeviceBuffer`, through a
typed `BufferView`, with the protocols' stream semantics and leases that keep the memory alive.

`DeviceBuffer.view(dtype, shape)` gives a `BufferView`: a shape and dtype over the buffer's first
bytes, and the stream its contents are ready on (the allocating stream unless given). Both export:

* ``__dlpack__(stream=...)`` / ``__dlpack_device__()`` (DLPack, through `orchestra.driver.dlpack`):
  when the consumer passes its stream, orchestra records an event on the view's stream and makes
  the consumer's stream wait on it (``cuEventRecord`` + ``cuStreamWaitEvent``; ``stream=None``
  means the legacy default stream, as the protocol says, ``-1`` no ordering). So
  ``torch.from_dlpack(buf.view(np.float32, (n,)))`` and ``cupy.from_dlpack(...)`` see the memory
  without a copy, after orchestra's work on it.
* ``__cuda_array_interface__`` (version 3, with ``stream``: the view's stream), so
  ``cupy.asarray(view)`` and numba see it; the consumer synchronizes on that stream (CuPy does so
  by default).

Lifetime: every export holds a `Lease` on the buffer (`DeviceBuffer.lease`): a DLPack capsule
until its consumer calls the deleter (torch and CuPy do when their tensor is collected), a
`BufferView` for as long as it lives (a CUDA Array Interface consumer keeps the view). Closing the
buffer meanwhile returns at once and the free waits for the last lease. When a consumer lets go of
a closed buffer's memory, its own work on it may still be queued on its stream, which orchestra
does not know: the export then synchronizes the context (``cuCtxSynchronize``) before it ends the
lease that frees the memory. `DeviceBuffer`'s own ``__cuda_array_interface__`` takes one lease that
lasts until the buffer object is collected: after a CUDA Array Interface export, ``close()`` frees
only when nothing (the consumer included) refers to the buffer any more; export a `BufferView`
where that matters.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref

import numpy as np
from cuda.bindings import driver

from orchestra.driver import dlpack as _dl
from orchestra.driver.check import cu
from orchestra.driver.device import context_alive
from orchestra.driver.event import Event
from orchestra.driver.stream import DEFAULT_HANDLES, LEGACY_STREAM, check_stream
from orchestra.errors import DriverArgumentValueError, ExportError, InteropTypeError

_KDLCUDA = int(_dl.DLDeviceType.kDLCUDA)


class ExportLease:
    """A lease on a `DeviceBuffer` for one export; `end` (idempotent, thread-safe) releases it,
    after a ``cuCtxSynchronize`` when the buffer is closed or collected (its consumer's work on
    the memory may still be queued, and this may be the lease whose end frees it)."""

    __slots__ = ("_lease", "_ref", "_device", "_lock")

    def __init__(self, buffer):
        self._lease = buffer.lease()  # ResourceClosedError once closed
        self._ref = weakref.ref(buffer)
        self._device = buffer.device
        self._lock = threading.Lock()

    @property
    def handle(self):
        return self._lease.handle

    @property
    def ended(self) -> bool:
        return self._lease is None

    def end(self) -> None:
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is None:
            return
        buffer = self._ref()
        try:
            if (buffer is None or buffer.closed) and context_alive(self._device.ordinal):
                with self._device.pushed():
                    cu(driver.cuCtxSynchronize)
        finally:
            lease.release()

    def __del__(self):
        try:
            self.end()
        except Exception:  # noqa: BLE001 - nothing can be raised from a finalizer
            pass


def normalize_dtype(dtype):
    """A numpy dtype, or the name of a type numpy lacks (``"bfloat16"``, the float8 names)."""
    if isinstance(dtype, str) and (dtype == "bfloat16" or dtype in _dl._FLOAT8.values()):
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InteropTypeError(f"{dtype!r} is not a dtype") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
        raise InteropTypeError(f"a device view cannot have dtype {dt}: use a numeric dtype")
    return dt


def itemsize_of(dtype) -> int:
    return 2 if dtype == "bfloat16" else 1 if isinstance(dtype, str) else dtype.itemsize


class BufferView:
    """A typed view of a `DeviceBuffer`'s first bytes, for export to other libraries.

    Make it with `DeviceBuffer.view`. Attributes: ``buffer``, ``dtype`` (numpy dtype, or
    ``"bfloat16"`` / a float8 name), ``shape`` (tuple), ``itemsize``, ``nbytes``, ``strides``
    (bytes, C order), ``readonly``, ``stream`` (the orchestra `Stream` its contents are ready
    on), ``device``, ``ptr``. Holds a lease on the buffer while it lives (`release` ends it
    early; the view is unusable afterwards). Exports ``__dlpack__`` / ``__dlpack_device__`` and
    ``__cuda_array_interface__`` (see the module doc).

    Thread-safety: may be shared between threads: its fields are set once, `release` ends the lease
    under a lock (once, whoever calls it), and each export records its own ordering event.
    """

    def __init__(self, buffer, dtype=np.uint8, shape=None, *, stream=None, readonly=False):
        self.dtype = normalize_dtype(dtype)
        self.itemsize = itemsize_of(self.dtype)
        if shape is None:
            shape = (buffer.nbytes // self.itemsize,)
        elif np.ndim(shape) == 0:
            shape = (operator.index(shape),)
        else:
            shape = tuple(operator.index(n) for n in shape)
        if any(n < 0 for n in shape):
            raise DriverArgumentValueError(f"a view's shape cannot be negative: {shape}")
        self.shape = shape
        self.nbytes = math.prod(shape) * self.itemsize
        if self.nbytes > buffer.nbytes:
            raise DriverArgumentValueError(
                f"a {shape} {self.dtype} view needs {self.nbytes} bytes; the DeviceBuffer has "
                f"{buffer.nbytes}")
        self.stream = buffer.stream if stream is None else check_stream(stream, "view")
        self.readonly = bool(readonly)
        self.buffer = buffer
        self.device = buffer.device
        self._export = ExportLease(buffer)
        self.ptr = int(self._export.handle)
        step, strides = self.itemsize, []
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        self.strides = tuple(reversed(strides))

    def release(self) -> None:
        """End this view's lease now (after the consumers' work on it completed)."""
        self._export.end()

    @property
    def released(self) -> bool:
        return self._export.ended

    def _live_ptr(self) -> int:
        if self._export.ended:
            raise ExportError("this BufferView was released: make a new view to export")
        return self.ptr

    # -- DLPack --------------------------------------------------------------------------------

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dl.DLDeviceType.kDLCUDA, self.device.ordinal)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule over the view (no copy). ``stream``: the consumer's stream (an
        int: the handle, 1 legacy default, 2 per-thread default; None means 1; -1 no
        ordering); orchestra records an event on the view's stream and makes that stream wait
        on it. ``max_version`` >= (1, 0) gives a versioned capsule (read-only flag set for a
        read-only view), else a legacy one. `ExportError` (a ``BufferError``) for another
        ``dl_device``, ``copy=True``, stream 0 or a dtype DLPack cannot describe."""
        ptr = self._live_ptr()
        if dl_device is not None and tuple(int(x) for x in dl_device) != \
                (_KDLCUDA, self.device.ordinal):
            raise ExportError(
                f"this view lives on CUDA device {self.device.ordinal}; it cannot be exported "
                f"to DLPack device {tuple(dl_device)} without a copy, which orchestra does not "
                "make")
        if copy:
            raise ExportError("orchestra exports device memory without copying: copy=True is "
                              "not supported (copy on the consumer's side)")
        self._order_for(stream)
        versioned = max_version is not None and int(max_version[0]) >= 1
        export = ExportLease(self.buffer)
        try:
            return _dl.make_capsule(
                ptr, self.shape, tuple(s // self.itemsize for s in self.strides), self.dtype,
                (_KDLCUDA, self.device.ordinal), readonly=self.readonly, versioned=versioned,
                on_release=export.end, what="BufferView.__dlpack__")
        except InteropTypeError as exc:
            export.end()
            raise ExportError(str(exc)) from exc
        except BaseException:
            export.end()
            raise

    def _order_for(self, stream) -> None:
        """The DLPack producer's duty: work on the consumer's ``stream`` after the view's."""
        if stream is None:
            value = LEGACY_STREAM  # DLPack: None means the legacy default stream on CUDA
        else:
            try:
                value = operator.index(stream)
            except TypeError:
                raise ExportError(f"DLPack stream must be an int, got {stream!r}") from None
            if value == -1:
                return
            if value == 0:
                raise ExportError(
                    "DLPack stream 0 is ambiguous (the protocol disallows it): pass 1 for the "
                    "legacy default stream, 2 for the per-thread default stream, or a handle")
            if value < -1:
                raise ExportError(f"DLPack stream {value} is not a stream")
        mine = check_stream(self.stream, "BufferView.__dlpack__")
        if value == int(mine.handle):
            return
        self.device.make_current()
        ev = Event(self.device)
        try:
            ev.record(mine)
            cu(driver.cuStreamWaitEvent, driver.CUstream(value), ev.handle, 0)
        finally:
            ev.close()

    # -- the CUDA Array Interface --------------------------------------------------------------

    @property
    def __cuda_array_interface__(self) -> dict:
        """Version 3: shape, typestr, data (pointer, read-only), strides None (C order), and
        ``stream``: the view's stream, which the consumer synchronizes with (or waits on).
        `ExportError` for a dtype the interface has no typestr for (bfloat16, float8) or a
        closed stream."""
        ptr = self._live_ptr()
        if isinstance(self.dtype, str):
            raise ExportError(
                f"the CUDA Array Interface has no typestr for {self.dtype}: export this view "
                "through DLPack (torch.from_dlpack / cupy.from_dlpack)")
        if self.stream.closed:
            raise ExportError("the stream this view's contents are ready on is closed: make a "
                              "view with stream= an open stream")
        return cai_dict(ptr, self.shape, self.dtype, self.readonly, int(self.stream.handle))

    def __repr__(self) -> str:
        state = "released" if self.released else f"0x{self.ptr:x}"
        return (f"<BufferView {self.dtype}{list(self.shape)} at {state} on device "
                f"{self.device.ordinal}>")


def cai_dict(ptr: int, shape, dtype, readonly: bool, stream: int) -> dict:
    """A version-3 ``__cuda_array_interface__`` dict (C-contiguous)."""
    if stream in DEFAULT_HANDLES[:1]:
        stream = LEGACY_STREAM  # 0 is not allowed in the interface; our streams are never 0
    return {"version": 3, "shape": tuple(shape), "typestr": dtype.str,
            "data": (ptr, bool(readonly)), "strides": None, "stream": stream}

"""Stream-ordered device memory: the default memory pool and `DeviceBuffer`.

Allocation and free are stream operations (``cuMemAllocFromPoolAsync`` / ``cuMemFreeAsync``):
they take effect in stream order, cost no device-wide synchronization, and during stream
capture they become graph allocation / free nodes. The pool keeps freed memory for reuse up to
its release threshold; orchestra sets that threshold high so a synchronize does not hand the
memory back to the OS and the next batch pays for ``cudaMalloc``-like work again.
"""

from __future__ import annotations

import operator
import threading

import numpy as np

from cuda.bindings import driver

from orchestra.driver.check import cu
from orchestra.driver.device import Device, as_device
from orchestra.driver.host import host_span
from orchestra.driver.owner import Lease, Owner, Resource
from orchestra.driver.stream import Stream, check_stream
from orchestra.errors import DriverArgumentValueError

UINT64_MAX = (1 << 64) - 1
_P = driver.CUmemPool_attribute
_pool_lock = threading.Lock()


class MemoryPool:
    """A device's memory pool (``CUmemoryPool``), the source of stream-ordered allocations.

    Get the default one with `MemoryPool.default`. Sizes are in bytes. Configure pools at
    setup, never while a stream capture is in progress: the capture records allocations with
    the pool's properties at that moment, and the executors call `MemoryPool.default()` before
    they begin capturing.

    Thread-safety: `default` makes one pool object per device under a lock and may be called from
    any thread; the queries are single driver calls. Setting attributes (`release_threshold`,
    `internal_dependencies`) or `trim` from one thread while others allocate is allowed by the
    driver but changes their behaviour mid-run: configure pools at setup, in one thread.
    """

    _defaults: dict[int, "MemoryPool"] = {}

    def __init__(self, handle, device: Device):
        self.handle = handle
        self.device = device

    @classmethod
    def default(cls, device: Device | int | None = None,
                release_threshold: int | None = None) -> "MemoryPool":
        """The default pool of ``device`` (None: device 0), from ``cuDeviceGetDefaultMemPool``.

        On first use the release threshold is set to ``release_threshold`` or, when None,
        ``UINT64_MAX`` (keep everything); a later call changes it only when given a value.
        Also on first use, `internal_dependencies` is turned off: the pool may then no longer
        make one stream wait for another's free on its own (hidden waits would serialize
        streams a plan keeps apart); memory moves between streams only through the plan's
        explicit events (``CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES``, on by default)
        or once a free has completed (opportunistic reuse).
        Raises `CudaError` ``CUDA_ERROR_NOT_SUPPORTED`` where memory pools are unsupported.
        """
        dev = as_device(device)
        pool = cls._defaults.get(dev.ordinal)
        if pool is None:
            with _pool_lock:
                pool = cls._defaults.get(dev.ordinal)
                if pool is None:
                    dev.make_current()
                    pool = cls(cu(driver.cuDeviceGetDefaultMemPool, dev.handle), dev)
                    pool.release_threshold = (UINT64_MAX if release_threshold is None
                                              else release_threshold)
                    pool.internal_dependencies = False
                    cls._defaults[dev.ordinal] = pool
                    return pool
        if release_threshold is not None:
            pool.release_threshold = release_threshold
        return pool

    def _get(self, attr) -> int:
        return int(cu(driver.cuMemPoolGetAttribute, self.handle, attr))

    def _set64(self, attr, value: int) -> None:
        value = operator.index(value)
        if not 0 <= value <= UINT64_MAX:
            raise DriverArgumentValueError(f"{attr.name} must be in 0 .. 2**64 - 1, got {value}")
        cu(driver.cuMemPoolSetAttribute, self.handle, attr, driver.cuuint64_t(value))

    @property
    def release_threshold(self) -> int:
        """Bytes of reserved memory the pool keeps when it could return memory to the OS
        (at a synchronize); ``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD``. Settable."""
        return self._get(_P.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)

    @release_threshold.setter
    def release_threshold(self, nbytes: int) -> None:
        self._set64(_P.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, nbytes)

    @property
    def internal_dependencies(self) -> bool:
        """Whether the driver may insert waits on other streams' frees to reuse memory
        (``CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES``). Settable."""
        return bool(self._get(_P.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES))

    @internal_dependencies.setter
    def internal_dependencies(self, allow: bool) -> None:
        cu(driver.cuMemPoolSetAttribute, self.handle,
           _P.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, int(bool(allow)))

    @property
    def reserved_bytes(self) -> int:
        """Bytes of device memory the pool holds now (``CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT``)."""
        return self._get(_P.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)

    @property
    def used_bytes(self) -> int:
        """Bytes handed out and not yet freed (``CU_MEMPOOL_ATTR_USED_MEM_CURRENT``)."""
        return self._get(_P.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)

    @property
    def reserved_high(self) -> int:
        """Peak of `reserved_bytes` since creation or `reset_peaks` (bytes)."""
        return self._get(_P.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)

    @property
    def used_high(self) -> int:
        """Peak of `used_bytes` since creation or `reset_peaks` (bytes)."""
        return self._get(_P.CU_MEMPOOL_ATTR_USED_MEM_HIGH)

    def reset_peaks(self) -> None:
        """Reset `reserved_high` and `used_high` to the current values (the driver accepts only
        0 for these attributes, meaning "reset")."""
        self._set64(_P.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)
        self._set64(_P.CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)

    def trim(self, keep_bytes: int = 0) -> None:
        """Return unused reserved memory to the OS until at most ``keep_bytes`` stay reserved
        (``cuMemPoolTrimTo``). Memory of unfreed allocations, or of frees the host has not yet
        seen complete (synchronize first), cannot be returned."""
        cu(driver.cuMemPoolTrimTo, self.handle, operator.index(keep_bytes))

    def __repr__(self) -> str:
        return f"<MemoryPool of device {self.device.ordinal}>"


class _Free:
    """A stream-ordered allocation's release (runs inside the owner's ``device.pushed()``, so
    the context is current): ``cuMemFreeAsync`` on ``stream`` (the one `DeviceBuffer.free`
    named, else the allocating stream)."""

    __slots__ = ("alloc_stream", "stream")

    def __init__(self, stream: Stream):
        self.alloc_stream = stream
        self.stream = stream

    def __call__(self, dptr) -> None:
        for stream in (self.stream, self.alloc_stream):
            if not stream.closed:
                cu(driver.cuMemFreeAsync, dptr, stream.handle)
                return
        # The user closed the stream(s) first. Free in stream order on a private stream after
        # the whole context is idle, and wait, so the pool sees the memory back at once (a
        # plain cuMemFree of a pool allocation is returned to the pool lazily).
        cu(driver.cuCtxSynchronize)
        with Stream(self.alloc_stream.device) as private:
            cu(driver.cuMemFreeAsync, dptr, private.handle)
            private.synchronize()


class DeviceBuffer(Resource):
    """``nbytes`` bytes of device memory allocated in stream order (use `allocate`).

    ``.ptr`` (int device address), ``.handle`` (``CUdeviceptr``), ``.nbytes``, ``.device``
    (where the memory lives: the pool's device), ``.stream`` (the allocating stream).
    The memory may be used by work on ``stream`` right away; work on another stream must
    first wait for an event recorded on ``stream`` after the allocation.

    Lifetime: `lease` keeps the memory allocated for a built exec or queued work that refers
    to it. `close()` / `free()` while a lease is out return at once and the buffer reads as
    closed (``.ptr`` raises `ResourceClosedError`, no new lease), but ``cuMemFreeAsync`` runs
    when the last lease ends (docs/errors.md, "Lifetimes"); ``live_handles()`` counts the
    buffer, and the pool's ``used_bytes`` its memory, until then.

    Thread-safety: the object may be shared between threads: `close` and `lease` go through the
    `Owner`, whose bookkeeping is atomic, so they may race each other and the finalizer from any
    thread: the handle is released exactly once, after the last lease. The memory itself is ordered
    only by streams: work from different threads (or streams) that touches it must be ordered by
    events, as for any device memory.
    """

    def __init__(self, nbytes: int, stream: Stream, pool: MemoryPool | None = None):
        nbytes = operator.index(nbytes)
        if nbytes < 1:
            raise DriverArgumentValueError(
                f"DeviceBuffer needs a positive size in bytes, got {nbytes}")
        stream = check_stream(stream, "DeviceBuffer.allocate")
        pool = MemoryPool.default(stream.device) if pool is None else pool
        self.nbytes = nbytes
        self.stream = stream
        self.pool = pool
        self.device = pool.device
        stream.device.make_current()
        dptr = cu(driver.cuMemAllocFromPoolAsync, nbytes, pool.handle, stream.handle)
        self._freer = _Free(stream)
        self._own = Owner(self, dptr, self._freer, self.device, "DeviceBuffer")

    @classmethod
    def allocate(cls, nbytes: int, stream: Stream, pool: MemoryPool | None = None) -> "DeviceBuffer":
        """Allocate ``nbytes`` (> 0) bytes from ``pool`` (default: the default pool of
        ``stream``'s device) in ``stream``'s order (``cuMemAllocFromPoolAsync``).

        Raises ``ValueError`` for a size < 1, ``TypeError`` when ``stream`` is not a `Stream`
        (never the legacy default stream), `CudaError` ``CUDA_ERROR_OUT_OF_MEMORY`` when the
        pool cannot grow. The contents are uninitialized.
        """
        return cls(nbytes, stream, pool)

    @property
    def handle(self) -> driver.CUdeviceptr:
        """The ``CUdeviceptr``; `ResourceClosedError` (a ``ValueError``) once closed."""
        return self._own.handle

    @property
    def ptr(self) -> int:
        """The device address as an int; `ResourceClosedError` (a ``ValueError``) once
        closed."""
        return int(self._own.handle)

    def lease(self) -> Lease:
        """A `Lease` whose ``.handle`` (``CUdeviceptr``) stays allocated until it is released,
        even if the buffer is closed meanwhile. `ResourceClosedError` if closed already.
        Release it only after the work that uses the memory has completed."""
        return self._own.lease()

    def free(self, stream: Stream | None = None) -> None:
        """Free in ``stream``'s order (``cuMemFreeAsync``); default: the allocating stream.

        Work on other streams that uses the buffer must be ordered before ``stream`` (by an
        event) first. Freeing twice does nothing (the first call's stream counts). While a
        lease is out, the free waits for the last lease's end and is then enqueued on
        ``stream``, or on the allocating stream if ``stream`` was closed by then. If both
        streams are closed when the free runs, it synchronizes the context and frees on a
        private stream. ``TypeError`` if ``stream`` is not a `Stream` (checked first).
        """
        if stream is not None:
            stream = check_stream(stream, "DeviceBuffer.free")
            if not self._own.closed:
                self._freer.stream = stream  # before the close: the release reads it
        self._own.close()

    def close(self) -> None:
        """Same as ``free()`` on the allocating stream; idempotent. See the class doc for a
        close while leased."""
        self._own.close()

    def copy_from_host(self, src, stream: Stream, *, sync: bool = False) -> None:
        """Enqueue a copy of all of ``src`` into this buffer (``cuMemcpyHtoDAsync``).

        ``src``: a `PinnedBuffer`, a `HostRegistration`, or a contiguous numpy array in pinned
        memory, of exactly ``nbytes`` bytes (any dtype). Pageable memory raises ``TypeError``
        (use `PinnedBuffer` or `register_host`); a size mismatch or a non-contiguous array
        raises ``ValueError``. The host memory must stay alive and unchanged until the copy has
        run: ``sync=True`` waits for ``stream`` before returning.
        """
        stream = check_stream(stream, "DeviceBuffer.copy_from_host")
        stream.device.make_current()
        host = host_span(src, self.nbytes, "DeviceBuffer.copy_from_host", writable=False)
        cu(driver.cuMemcpyHtoDAsync, self.handle, host, self.nbytes, stream.handle)
        if sync:
            stream.synchronize()

    def copy_to_host(self, out, stream: Stream, *, sync: bool = False) -> None:
        """Enqueue a copy of this buffer into ``out`` (``cuMemcpyDtoHAsync``).

        ``out``: as for `copy_from_host`, and writable. The data is in ``out`` only once
        ``stream`` has passed the copy: pass ``sync=True`` or synchronize the stream (or an
        event recorded after it) before reading.
        """
        stream = check_stream(stream, "DeviceBuffer.copy_to_host")
        stream.device.make_current()
        host = host_span(out, self.nbytes, "DeviceBuffer.copy_to_host", writable=True)
        cu(driver.cuMemcpyDtoHAsync, host, self.handle, self.nbytes, stream.handle)
        if sync:
            stream.synchronize()

    def memset(self, value: int, stream: Stream) -> None:
        """Enqueue setting every byte to ``value`` (an int 0..255) (``cuMemsetD8Async``)."""
        value = operator.index(value)
        if not 0 <= value <= 255:
            raise DriverArgumentValueError(
                f"memset writes single bytes: value must be 0..255, got {value}")
        stream = check_stream(stream, "DeviceBuffer.memset")
        cu(driver.cuMemsetD8Async, self.handle, value, self.nbytes, stream.handle)

    # -- interop: DLPack and the CUDA Array Interface out (orchestra.driver.export) -------------

    def view(self, dtype=np.uint8, shape=None, *, stream: Stream | None = None,
             readonly: bool = False):
        """A typed `BufferView` of the first bytes: ``dtype`` (numpy dtype, or ``"bfloat16"``)
        and ``shape`` (default: as many whole elements as fit, 1-D), whose contents are ready
        on ``stream`` (default: the allocating stream), for export to torch / CuPy / numba
        (``torch.from_dlpack(buf.view(np.float32, (n,)))``, ``cupy.asarray(view)``).

        The view holds a lease on the buffer while it lives, and each DLPack capsule one until
        its consumer lets go (docs/interop.md). ``DriverArgumentValueError`` when the view does
        not fit, `ResourceClosedError` for a closed buffer, `InteropTypeError` for a dtype
        that is not numeric."""
        from orchestra.driver.export import BufferView

        return BufferView(self, dtype, shape, stream=stream, readonly=readonly)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """DLPack export of the whole buffer as 1-D ``uint8`` (see `BufferView.__dlpack__`)."""
        view = self.view()
        try:  # the capsule holds its own lease
            return view.__dlpack__(stream=stream, max_version=max_version,
                                   dl_device=dl_device, copy=copy)
        finally:
            view.release()

    def __dlpack_device__(self) -> tuple[int, int]:
        from orchestra.driver.dlpack import DLDeviceType

        return (DLDeviceType.kDLCUDA, self.device.ordinal)

    @property
    def __cuda_array_interface__(self) -> dict:
        """Version 3, 1-D ``uint8``, ``stream`` the allocating stream. The first read takes a
        lease that lasts until this object is collected: a consumer holds the buffer object,
        so ``close()`` cannot free the memory under it (the free waits until nothing refers to
        the buffer). Export `view` objects for a typed array or an explicit lifetime."""
        from orchestra.driver.export import ExportLease, cai_dict

        export = self.__dict__.get("_cai_export")
        if export is None or export.ended:
            export = self.__dict__["_cai_export"] = ExportLease(self)
        return cai_dict(int(export.handle), (self.nbytes,), np.dtype(np.uint8), False,
                        int(check_stream(self.stream, "__cuda_array_interface__").handle))

    def __repr__(self) -> str:
        state = "freed" if self.closed else f"0x{int(self._own.handle):x}"
        return f"<DeviceBuffer {self.nbytes} bytes at {state} on device {self.device.ordinal}>"

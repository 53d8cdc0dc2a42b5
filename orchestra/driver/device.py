"""CUDA devices and their primary contexts.

`Device.get(ordinal)` returns one cached `Device` per ordinal. Its primary context is retained
once (``cuDevicePrimaryCtxRetain``) the first time it is needed and released at interpreter exit
(``cuDevicePrimaryCtxRelease`` from an ``atexit`` hook). `context_alive(ordinal)` turns False at
that moment, so resource finalizers that run later skip their release instead of touching a dead
context.

A context is *current* per host thread. `Device.make_current()` binds it to the calling thread
with ``cuCtxSetCurrent``, skipping the call when a thread-local cache says it is already bound, so
that serving code can call it on every submission from many threads at almost no cost.
Orchestra calls that need a context (creating streams, events, buffers) make their device
current on the calling thread this way; finalizers instead push and pop it (`Device.pushed`).
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import os
import threading

import attrs
from cuda.bindings import driver

from orchestra.driver.check import cu, ensure_initialized
from orchestra.errors import DriverArgumentTypeError, DriverArgumentValueError

_A = driver.CUdevice_attribute

_lock = threading.RLock()
_devices: dict[int, "Device"] = {}
_alive: dict[int, bool] = {}  # ordinal -> primary context retained and not yet released
_tls = threading.local()  # .ctx: int value of the context this thread last made current
_atexit_registered = False


def _after_fork_in_child() -> None:
    """In a child forked after ``cuInit`` (see `orchestra.driver.check`): forget the parent's
    devices and contexts, so `Device.get` goes through `ensure_initialized` (which raises
    `CudaForkError`), finalizers skip their releases (`context_alive` is False) and the exit hook
    releases nothing: the child must not call the driver with the parent's handles."""
    global _lock, _tls
    from orchestra.driver.check import forked_after_init

    _lock = threading.RLock()  # another thread may have held it at the fork
    if forked_after_init():
        _devices.clear()
        _alive.clear()
        _tls = threading.local()


if hasattr(os, "register_at_fork"):  # registered after check.py's hook, so it runs after it
    os.register_at_fork(after_in_child=_after_fork_in_child)


def context_alive(ordinal: int) -> bool:
    """True while device ``ordinal``'s primary context is retained by orchestra.

    False before the first retain and after the exit hook released it; finalizers check this
    so they never call the driver on a dead context.
    """
    return _alive.get(ordinal, False)


def device_count() -> int:
    """Number of visible CUDA devices (``cuDeviceGetCount``).

    Raises `NoDeviceError` when no driver or no device is present.
    """
    ensure_initialized()
    return cu(driver.cuDeviceGetCount)


def devices() -> list["Device"]:
    """Every visible device, in ordinal order (see `device_count`)."""
    return [Device.get(i) for i in range(device_count())]


@attrs.frozen
class DeviceLimits:
    """The limits launch checks and allocators need (all from ``cuDeviceGetAttribute``,
    except the stream priorities, from ``cuCtxGetStreamPriorityRange``).

    Sizes are in bytes; dimensions are ``(x, y, z)`` tuples of ints. Stream priorities follow
    CUDA's convention: lower numbers are higher priority, so the valid range is
    ``greatest_stream_priority <= p <= least_stream_priority`` (for example -5 .. 0).

    Immutable: may be shared between threads freely.
    """

    max_threads_per_block: int
    max_block_dim: tuple[int, int, int]
    max_grid_dim: tuple[int, int, int]
    max_shared_memory_per_block: int  # the default limit (48 KiB) without opt-in
    max_shared_memory_per_block_optin: int  # reachable with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    max_registers_per_block: int
    cooperative_launch: bool
    cluster_launch: bool
    memory_pools_supported: bool
    least_stream_priority: int  # lowest priority (numerically largest, usually 0)
    greatest_stream_priority: int  # highest priority (numerically smallest, e.g. -5)

    @property
    def stream_priority_range(self) -> tuple[int, int]:
        """``(greatest, least)``: the closed interval of valid stream priorities."""
        return (self.greatest_stream_priority, self.least_stream_priority)


class Device:
    """One CUDA device and its retained primary context.

    Do not construct directly: `Device.get(ordinal)` caches one instance per ordinal, so
    identity comparison works and the primary context is retained once.

    Attributes (read-only): ``ordinal`` (int), ``handle`` (``CUdevice``), ``name`` (str),
    ``compute_capability`` (``(major, minor)``), ``arch`` (``"sm_90"``), ``sm_count``,
    ``async_engine_count`` (copy engines), ``total_memory`` (bytes, ``cuDeviceTotalMem``),
    ``warp_size``, ``limits`` (`DeviceLimits`), ``context`` (``CUcontext``, retained on first use),
    ``kernel_host_access`` (kernels can address pinned host memory: copy kernels).

    Thread-safety: one instance per ordinal, shared by every thread: `get` makes it and `context`
    retains the primary context once, both under a module lock; the attributes are read-only and
    `limits` is queried once and assigned whole. The current context is per host thread:
    `make_current` binds it on the calling thread only (a thread-local cache skips the call when it
    is current already), so code that calls the driver directly on a new thread calls it first;
    orchestra's own objects do that themselves.
    """

    def __init__(self, ordinal: int, handle):
        self.ordinal = ordinal
        self.handle = handle
        self._ctx = None  # CUcontext, retained lazily
        self._ctx_int = 0
        self._limits: DeviceLimits | None = None
        raw_name = cu(driver.cuDeviceGetName, 256, handle)
        self.name = raw_name.split(b"\0", 1)[0].decode(errors="replace")
        self.compute_capability = (
            self.attribute(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            self.attribute(_A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
        self.sm_count = self.attribute(_A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.async_engine_count = self.attribute(_A.CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)
        self.warp_size = self.attribute(_A.CU_DEVICE_ATTRIBUTE_WARP_SIZE)
        self.total_memory = int(cu(driver.cuDeviceTotalMem, handle))

    @classmethod
    def get(cls, ordinal: int = 0) -> "Device":
        """The cached `Device` for ``ordinal`` (``cuDeviceGet``).

        Raises `NoDeviceError` with no driver or device, ``ValueError`` for an ordinal outside
        ``0 .. device_count() - 1``.
        """
        dev = _devices.get(ordinal)
        if dev is not None:
            return dev
        ensure_initialized()
        ordinal = operator.index(ordinal)
        count = cu(driver.cuDeviceGetCount)
        if not 0 <= ordinal < count:
            raise DriverArgumentValueError(
                f"device ordinal {ordinal} is out of range: {count} device(s) visible")
        with _lock:
            dev = _devices.get(ordinal)
            if dev is None:
                dev = _devices[ordinal] = cls(ordinal, cu(driver.cuDeviceGet, ordinal))
        return dev

    @property
    def arch(self) -> str:
        """The NVRTC / ptxas target name, e.g. ``"sm_90"`` for compute capability 9.0."""
        return "sm_%d%d" % self.compute_capability

    def attribute(self, attr) -> int:
        """One ``CUdevice_attribute`` value (``cuDeviceGetAttribute``); needs no context."""
        return int(cu(driver.cuDeviceGetAttribute, attr, self.handle))

    @property
    def kernel_host_access(self) -> bool:
        """Whether kernels on this device can read and write pinned host memory through its
        host pointer: unified addressing (``CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING``: memory
        from ``cuMemHostAlloc`` is mapped at the same address, driver API "Unified
        Addressing") and ``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``
        (registered memory too, ``cuMemHostRegister``). What copy kernels need."""
        v = self.__dict__.get("_kernel_host_access")
        if v is None:
            v = bool(self.attribute(_A.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)) and bool(
                self.attribute(_A.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM))
            self.__dict__["_kernel_host_access"] = v
        return v

    @property
    def context(self):
        """The primary context (``CUcontext``), retained once on first use.

        Released by an ``atexit`` hook; `context_alive` tells whether it still is.
        """
        if self._ctx is None:
            global _atexit_registered
            with _lock:
                if self._ctx is None:
                    ctx = cu(driver.cuDevicePrimaryCtxRetain, self.handle)
                    self._ctx_int = int(ctx)
                    self._ctx = ctx
                    _alive[self.ordinal] = True
                    if not _atexit_registered:
                        atexit.register(_release_primary_contexts)
                        _atexit_registered = True
        return self._ctx

    def make_current(self, force: bool = False) -> "Device":
        """Bind this device's primary context to the calling host thread (``cuCtxSetCurrent``).

        A thread-local cache skips the driver call when this thread already has it current.
        Pass ``force=True`` after code outside orchestra changed the thread's context.
        Returns ``self``.
        """
        ctx = self.context
        if force or getattr(_tls, "ctx", None) != self._ctx_int:
            cu(driver.cuCtxSetCurrent, ctx)
            _tls.ctx = self._ctx_int
        return self

    @contextlib.contextmanager
    def pushed(self):
        """Make this context current for a ``with`` block, then restore the thread's previous one
        (``cuCtxPushCurrent`` / ``cuCtxPopCurrent``); no driver call when it is already current.

        Finalizers use it: they run on whatever thread the garbage collector picked and must not
        change that thread's current context.
        """
        if getattr(_tls, "ctx", None) == self._ctx_int and self._ctx is not None:
            yield self
            return
        cu(driver.cuCtxPushCurrent, self.context)
        try:
            yield self
        finally:
            cu(driver.cuCtxPopCurrent)

    def synchronize(self) -> None:
        """Wait for all work in this device's primary context (``cuCtxSynchronize``).

        Raises `CudaError` if any earlier work failed (for example a sticky launch error).
        """
        self.make_current()
        cu(driver.cuCtxSynchronize)

    @property
    def limits(self) -> DeviceLimits:
        """The device's `DeviceLimits` (queried once; makes the context current once)."""
        if self._limits is None:
            a = self.attribute
            self.make_current()
            least, greatest = cu(driver.cuCtxGetStreamPriorityRange)
            self._limits = DeviceLimits(
                max_threads_per_block=a(_A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
                max_block_dim=(a(_A.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X),
                               a(_A.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y),
                               a(_A.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)),
                max_grid_dim=(a(_A.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X),
                              a(_A.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y),
                              a(_A.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)),
                max_shared_memory_per_block=a(_A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
                max_shared_memory_per_block_optin=a(
                    _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
                max_registers_per_block=a(_A.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK),
                cooperative_launch=bool(a(_A.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)),
                cluster_launch=bool(a(_A.CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH)),
                memory_pools_supported=bool(a(_A.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)),
                least_stream_priority=int(least),
                greatest_stream_priority=int(greatest),
            )
        return self._limits

    def __repr__(self) -> str:
        return f"<Device {self.ordinal}: {self.name} ({self.arch})>"


def as_device(device) -> Device:
    """Resolve ``None`` (device 0), an ordinal or a `Device` to a `Device`."""
    if device is None:
        return Device.get(0)
    if isinstance(device, Device):
        return device
    try:
        ordinal = operator.index(device)
    except TypeError:
        raise DriverArgumentTypeError(
            f"expected a Device, an int ordinal or None, got {type(device).__name__}") from None
    return Device.get(ordinal)


def _release_primary_contexts() -> None:
    """``atexit``: mark every context dead first (finalizers then skip), then release them."""
    retained = [d for d in _devices.values() if d._ctx is not None]
    for dev in retained:
        _alive[dev.ordinal] = False
    for dev in retained:
        try:
            cu(driver.cuDevicePrimaryCtxRelease, dev.handle)
        except Exception:  # noqa: BLE001 - at exit the driver may already be tearing down
            pass

"""Peer access between GPUs: checked once per pair, enabled once per pair, cached.

A `PeerCopy` between two devices (and any kernel that reads another GPU's memory) is fastest
with peer access: the copy goes device to device over NVLink / PCIe instead of being staged
through host memory. `enable_peer_access(a, b)` makes it so for the pair, both ways:

1. both ordinals exist (``cuDeviceGetCount``), else `PeerAccessError` naming the pair and the
   device count;
2. ``cuDeviceCanAccessPeer`` both ways, else `PeerAccessError` naming the pair (no peer copy
   between them: stage through host memory with a D2H then an H2D copy);
3. ``cuCtxEnablePeerAccess`` from each primary context to the other
   (``CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`` counts as done: someone else enabled it);
4. each device's default memory pool grants the other device read-write access
   (``cuMemPoolSetAccess``): stream-ordered allocations (``cuMemAllocFromPoolAsync``, the
   executors' `Alloc`) are not covered by context peer access.

The result is cached per unordered pair for the process, so every later call costs a set
lookup. Calls are made by the executors before anything is enqueued (a peer copy's
``resolve``), never inside a stream capture. Thread-safe (one lock).
"""

from __future__ import annotations

import threading

from cuda.bindings import driver

from orchestra.driver.check import cu, error_from_result
from orchestra.errors import UnsupportedDeviceError

_lock = threading.Lock()
_enabled: set[tuple[int, int]] = set()
_R = driver.CUresult


class PeerAccessError(UnsupportedDeviceError):
    """Two devices cannot reach each other's memory (or one does not exist); ``.pair`` is
    ``(a, b)``. The message names the pair and what to do instead."""

    def __init__(self, message: str, pair=(None, None)):
        super().__init__(message)
        self.pair = tuple(pair)

    def __reduce__(self):
        return (type(self), (str(self), self.pair))


def device_count() -> int:
    """Visible devices (``cuDeviceGetCount``)."""
    from orchestra.driver.device import device_count as count

    return count()


def can_access_peer(a: int, b: int) -> bool:
    """Whether device ``a`` can access device ``b``'s memory directly
    (``cuDeviceCanAccessPeer``); True for ``a == b``."""
    if a == b:
        return True
    from orchestra.driver.device import Device

    return bool(cu(driver.cuDeviceCanAccessPeer, Device.get(a).handle, Device.get(b).handle))


def check_pair(a: int, b: int, count: int, can_access, what: str = "a peer copy") -> None:
    """Raise `PeerAccessError` unless devices ``a`` and ``b`` both exist (``count`` devices)
    and ``can_access(x, y)`` both ways (pure: the fakes' driver uses it too)."""
    missing = [d for d in (a, b) if not 0 <= d < count]
    if missing:
        raise PeerAccessError(
            f"{what} between devices {a} and {b}: device {missing[0]} does not exist (this "
            f"machine has {count} device(s)); put both buffers on devices below {count}",
            (a, b))
    for x, y in ((a, b), (b, a)):
        if not can_access(x, y):
            raise PeerAccessError(
                f"{what} between devices {a} and {b}: device {x} cannot access device {y}'s "
                f"memory (cuDeviceCanAccessPeer({x}, {y}) = 0), so there is no peer path "
                "between them; stage the data through pinned host memory (a DeviceToHost "
                "then a HostToDevice copy) instead", (a, b))


def enable_peer_access(a: int, b: int) -> None:
    """Peer access between devices ``a`` and ``b``, both ways (see the module doc); a no-op
    for ``a == b`` and for a pair enabled before. Raises `PeerAccessError` (a pair that
    cannot), `CudaError` (a driver call that fails)."""
    if a == b:
        return
    key = (min(a, b), max(a, b))
    if key in _enabled:
        return
    with _lock:
        if key in _enabled:
            return
        check_pair(a, b, device_count(), can_access_peer)
        from orchestra.driver.device import Device
        from orchestra.driver.memory import MemoryPool

        for x, y in ((a, b), (b, a)):
            dx, dy = Device.get(x), Device.get(y)
            with dx.pushed():
                (err,) = driver.cuCtxEnablePeerAccess(dy.context, 0)
            if err not in (_R.CUDA_SUCCESS, _R.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                raise error_from_result("cuCtxEnablePeerAccess", err,
                                        context=f"device {x} -> device {y}")
            desc = driver.CUmemAccessDesc()
            desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = x
            desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            pool = MemoryPool.default(dy)  # y's allocations become readable and writable by x
            cu(driver.cuMemPoolSetAccess, pool.handle, [desc], 1)
        _enabled.add(key)


def enabled_pairs() -> frozenset[tuple[int, int]]:
    """The pairs `enable_peer_access` has enabled in this process (``(low, high)``)."""
    return frozenset(_enabled)


__all__ = ["PeerAccessError", "can_access_peer", "check_pair", "device_count",
           "enable_peer_access", "enabled_pairs"]

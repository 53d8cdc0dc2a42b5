"""A stand-in driver API with several GPUs (fake devices 0 and 1), for CPU tests of plans and
eager runs across devices.

`MultiCuda` is the eager fake (`tests.fake_cuda.FakeCuda`: host memory, calls run at once in
issue order) with devices: every stream, event, memory pool and allocation belongs to one
device, and the calls check what the driver requires across devices:

- ``cuEventRecord`` only with an event and a stream of one device (``CUDA_ERROR_INVALID_HANDLE``
  otherwise); ``cuStreamWaitEvent`` takes an event of any device;
- ``cuMemAllocFromPoolAsync`` only from the stream's own device's pool;
- ``cuLaunchKernel`` only of a kernel loaded on the stream's device, with that device current;
- ``cuMemcpyPeerAsync`` with the contexts of the devices the two pointers belong to;
- ``enable_peer_access`` answers from ``peer`` (True: every pair can; or a set of pairs that
  can) with the real pair checks (`orchestra.driver.peer.check_pair`).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

from cuda.bindings import driver

from orchestra.driver.peer import check_pair
from tests import fake_cuda
from tests.fake_cuda import OK, FakeCuda, FakeKernel

BAD = driver.CUresult.CUDA_ERROR_INVALID_HANDLE


class FakeGPU(fake_cuda.FakeDevice):
    def __init__(self, ordinal: int, fake: "MultiCuda"):
        self.ordinal = ordinal
        self.handle = ordinal
        self.context = f"ctx{ordinal}"
        self.name = f"Fake GPU {ordinal}"
        self.fake = fake

    def make_current(self, force=False):
        self.fake.current = self.ordinal
        return self

    @contextlib.contextmanager
    def pushed(self):
        previous, self.fake.current = self.fake.current, self.ordinal
        try:
            yield self
        finally:
            self.fake.current = previous

    def __repr__(self):
        return f"<FakeGPU {self.ordinal}>"


class DevicePool:
    def __init__(self, ordinal):
        self.ordinal = ordinal
        self.handle = f"pool{ordinal}"


class MultiCuda(FakeCuda):
    """The eager fake with ``count`` devices (see the module doc)."""

    def __init__(self, monkeypatch=None, *, count: int = 2, peer=True, pinned=True):
        super().__init__(monkeypatch, pinned=pinned)
        self.gpus = [FakeGPU(i, self) for i in range(count)]
        self.device = self.gpus[0]
        self._tls = threading.local()  # the current device is per host thread, as in CUDA
        self.peer = peer
        self.enabled: list[tuple[int, int]] = []
        self.stream_device: dict[int, int] = {}
        self.event_device: dict[int, int] = {}
        self.mem_device: dict[int, int] = {}
        self.made_streams: list = []

    @property
    def current(self):
        return getattr(self._tls, "current", None)

    @current.setter
    def current(self, ordinal):
        self._tls.current = ordinal

    # -- the driver layer's objects ----------------------------------------------------------

    def as_device(self, device=None):
        if device is None:
            return self.gpus[0]
        if isinstance(device, FakeGPU):
            return device
        return self.gpus[int(device)]

    def device_count(self):
        return len(self.gpus)

    def context_of(self, ordinal):
        return self.gpus[ordinal].context

    def default_pool(self, device=None):
        return DevicePool(self.as_device(device).ordinal)

    def stream(self, device=None, priority=0):
        s = super().stream(device, priority)
        self.stream_device[int(s.handle)] = self.as_device(device).ordinal
        self.made_streams.append(s)
        return s

    def event(self, device=None):
        e = super().event(device)
        self.event_device[int(e.handle)] = self.as_device(device).ordinal
        return e

    def can_access(self, a, b):
        return self.peer is True or (a, b) in self.peer

    def enable_peer_access(self, a, b):
        check_pair(a, b, len(self.gpus), self.can_access)
        self.enabled.append((a, b))

    # -- device checks ------------------------------------------------------------------------

    def _device_of_ptr(self, ptr, nbytes=1):
        for base, arr in self.mem.items():
            if base <= ptr and ptr + nbytes <= base + arr.nbytes:
                return self.mem_device[base]
        raise AssertionError(f"[{ptr:#x}, +{nbytes}) is not inside a live allocation")

    def cuMemAllocFromPoolAsync(self, nbytes, pool, stream):
        dev = self.stream_device[int(stream)]
        if pool != f"pool{dev}":  # the handle DevicePool gives
            self.log.append(("bad pool", int(stream), (pool, dev)))
            return (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None)
        err, dptr = super().cuMemAllocFromPoolAsync(nbytes, pool, stream)
        if not err:
            self.mem_device[int(dptr)] = dev
        return err, dptr

    def cuEventRecord(self, event, stream):
        if self.event_device[int(event)] != self.stream_device[int(stream)]:
            self.log.append(("bad record", int(stream), int(event)))
            return (BAD,)
        return super().cuEventRecord(event, stream)

    def _launch_check(self, func, stream):
        dev = self.stream_device[int(stream)]
        assert getattr(func, "device_ordinal", dev) == dev, \
            f"kernel of device {func.device_ordinal} launched on a stream of device {dev}"
        assert self.current == dev, f"device {self.current} current, stream on device {dev}"

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self._launch_check(func, stream)
        return super().cuLaunchKernel(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra)

    def cuMemcpyPeerAsync(self, dst, dst_ctx, src, src_ctx, nbytes, stream):
        err = self._call("cuMemcpyPeerAsync", stream, (int(dst), dst_ctx, int(src), src_ctx,
                                                       nbytes))
        if err:
            return (err,)
        assert dst_ctx == self.context_of(self._device_of_ptr(int(dst), nbytes))
        assert src_ctx == self.context_of(self._device_of_ptr(int(src), nbytes))
        ctypes.memmove(int(dst), int(src), nbytes)
        return (OK,)

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        err = self._call("cuMemcpyDtoDAsync", stream, (int(dst), int(src), nbytes))
        if err:
            return (err,)
        assert self._device_of_ptr(int(dst), nbytes) == self._device_of_ptr(int(src), nbytes)
        ctypes.memmove(int(dst), int(src), nbytes)
        return (OK,)

    def streams_of(self, ordinal):
        return [s for s in self.made_streams if self.stream_device[int(s.handle)] == ordinal]


def loader(ref, device):
    """A kernel resolver's loader: a fake burn kernel tagged with the device it loaded on."""
    k = FakeKernel()
    k.device_ordinal = device.ordinal
    return k

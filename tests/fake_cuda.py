"""A stand-in driver API for the eager executor, for CPU tests.

`FakeCuda` is a `DriverAPI` look-alike (the one object executors reach the driver through):
the driver calls the eager executor makes, plus the driver layer's objects (device, streams,
events, the memory pool, pinned checks). Installing it swaps the process's default driver API
for the test (one monkeypatch); an executor can also be given it with ``driver=``.

"Device memory" is real host memory (numpy arrays), so copies are ``ctypes.memmove`` and the
fake ``burn`` kernel reads its packed arguments exactly as the driver would (the ``void**`` array
of `PackedArgs`). Every operation runs at once, in issue order: a correct plan's issue order is a
valid sequential order, so outputs must match numpy. Every call is logged with its stream.
"""

from __future__ import annotations

import ctypes
from collections import Counter

import numpy as np
from cuda.bindings import driver

from orchestra.compiler.args import ArgLayout
from orchestra.compiler.launch import LaunchConfig, check_launch
from orchestra.compiler.params import normalize_params
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.driver import api as api_mod
from orchestra.driver.device import DeviceLimits
from orchestra.execute.lowering.copy import COPY_KERNEL_NAME, COPY_PARAMS

OK = driver.CUresult.CUDA_SUCCESS
LIMITS = DeviceLimits(
    max_threads_per_block=1024, max_block_dim=(1024, 1024, 64),
    max_grid_dim=(2**31 - 1, 65535, 65535), max_shared_memory_per_block=48 * 1024,
    max_shared_memory_per_block_optin=227 * 1024, max_registers_per_block=65536,
    cooperative_launch=True, cluster_launch=True, memory_pools_supported=True,
    least_stream_priority=0, greatest_stream_priority=-5)
_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeDevice:
    ordinal = 0
    name = "Fake GPU"
    sm_count = 4
    arch = "sm_90"
    limits = LIMITS
    # copy kernels need kernels that address pinned host memory; off unless a test turns it on
    # (then "auto" lowers small copies to the copy kernel, which the fakes run by name)
    kernel_host_access = False
    total_memory = 80 << 30  # bytes, as cuDeviceTotalMem reports (orchestra run checks it)

    def make_current(self, force=False):
        return self


class FakeHandle(int):
    """An int that is also a stand-in CUstream/CUevent handle."""


class FakeStream:
    count = 0

    def __init__(self, device=None, priority=0, fake=None):
        FakeStream.count += 1
        self.device = device
        self.priority = priority
        self.handle = FakeHandle(1000 + FakeStream.count)
        self.closed = False
        self.syncs = 0
        self.fake = fake

    def synchronize(self):
        self.syncs += 1
        if self.fake is not None:
            self.fake.log.append(("sync", int(self.handle), None))

    def close(self):
        self.closed = True


class FakeEvent:
    count = 0

    def __init__(self, device=None, timing=False):
        FakeEvent.count += 1
        self.handle = FakeHandle(5000 + FakeEvent.count)
        self.closed = False

    def close(self):
        self.closed = True


class FakePool:
    handle = "pool"


class FakePinned:
    """`DriverAPI.pinned_buffer`'s stand-in: host memory with ``.array``, ``.ptr``."""

    def __init__(self, nbytes):
        self.array = np.zeros(nbytes, np.uint8)
        self.ptr = self.array.ctypes.data
        self.closed = False

    def close(self):
        self.closed = True


class FakeKernel:
    """A compiler `Kernel` look-alike for burn (or, named ``orchestra_copy`` with
    `COPY_PARAMS`, the copy kernel): real `ArgLayout` packing, limits checked against `LIMITS`;
    launching runs the math in numpy on the fake device memory (or moves the bytes).

    ``behave(fake, args)``: another kernel's effect instead of burn, given the fake driver
    (``fake.u32(ptr)`` / ``fake.i32(ptr)`` / ``fake.f32(ptr, n)``: numpy views of device
    memory, ``fake.set_conditional(handle, value)``) and the packed struct; ``waits``: whether
    its PTX executes griddepcontrol.wait (what programmatic edges are checked against)."""

    def __init__(self, params=BURN_PARAMS, name="burn", behave=None, waits=True):
        self.name = name
        self.params = normalize_params(params)
        self.layout = ArgLayout(self.params, name)
        self.function = self
        self.launches = 0
        self.behave = behave
        self.waits = waits

    def pack(self, args):
        return self.layout.pack(args)

    def launch_config(self, grid, block, shared_mem=0, **attributes):
        cfg = LaunchConfig.make(grid, block, shared_mem, **attributes)
        check_launch(cfg, LIMITS, kernel_name=self.name)
        return cfg


class FakeAPI:
    """What both fakes share of the `DriverAPI` surface: the driver layer's objects. Driver
    calls a fake does not implement raise ``AttributeError`` naming them."""

    stream_type = FakeStream
    event_type = FakeEvent

    def __init__(self, device=None, pinned=True):
        self.device = device if device is not None else FakeDevice()
        self.pinned = pinned  # is_pinned's answer: a bool, or a function of the array
        self.pinned_asked: list[int] = []  # the address of every array is_pinned was asked

    def install(self, monkeypatch):
        """Make this fake the process's default driver API for the test (and return it)."""
        monkeypatch.setattr(api_mod, "_default", self)
        return self

    def as_device(self, device=None):
        return self.device

    def context_alive(self, ordinal):
        return True

    def stream(self, device=None, priority=0):
        return self.stream_type(device, priority, fake=self)

    def event(self, device=None):
        return self.event_type(device)

    def default_pool(self, device=None):
        return FakePool()

    def pinned_buffer(self, nbytes, device=None):
        return FakePinned(nbytes)

    def check_stream(self, stream, what="this call"):
        return stream

    def is_pinned(self, array):
        self.pinned_asked.append(array.ctypes.data)
        return self.pinned(array) if callable(self.pinned) else bool(self.pinned)


class FakeCuda(FakeAPI):
    """The eager executor's driver calls on host memory. ``FakeCuda(monkeypatch)`` installs
    it as the default driver API for the test."""

    def __init__(self, monkeypatch=None, *, pinned=True):
        super().__init__(FakeDevice(), pinned)
        self.log: list = []
        self.mem: dict[int, np.ndarray] = {}
        self.used = 0
        self.used_high = 0
        self.counts: Counter = Counter()
        self.fail: dict[str, int] = {}  # call name -> fail on this (1-based) call
        self.launch_configs: list = []  # every CUlaunchConfig cuLaunchKernelEx was given
        self.copy_kernels: list = []  # (dst, src, n, system_fence) of every copy kernel run
        if monkeypatch is not None:
            self.install(monkeypatch)

    # -- bookkeeping -----------------------------------------------------------------------

    def _call(self, name, stream, detail=None):
        self.counts[name] += 1
        self.log.append((name, int(stream), detail))
        if self.fail.get(name) == self.counts[name]:
            return driver.CUresult.CUDA_ERROR_INVALID_VALUE
        return OK

    def calls(self, name=None):
        return [c for c in self.log if name is None or c[0] == name]

    def driver_calls(self):
        return [c for c in self.log if c[0] != "sync"]

    def _check_range(self, ptr, nbytes, what):
        for base, arr in self.mem.items():
            if base <= ptr and ptr + nbytes <= base + arr.nbytes:
                return
        raise AssertionError(f"{what}: [{ptr:#x}, +{nbytes}) is not inside a live allocation")

    def _floats(self, ptr, n):
        self._check_range(ptr, 4 * n, "kernel access")
        return np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr))

    # what FakeKernel.behave functions read and write device memory with
    def f32(self, ptr, n=1):
        return self._floats(int(ptr), n)

    def u32(self, ptr, n=1):
        self._check_range(int(ptr), 4 * n, "kernel access")
        return np.ctypeslib.as_array((ctypes.c_uint32 * n).from_address(int(ptr)))

    def i32(self, ptr, n=1):
        return self.u32(ptr, n).view(np.int32)

    def set_conditional(self, handle, value):
        raise AssertionError(f"an eager kernel set conditional handle {handle}: there is no "
                             "graph (the eager executor passes handle 0)")

    # -- the driver calls ------------------------------------------------------------------

    def cuMemAllocFromPoolAsync(self, nbytes, pool, stream):
        err = self._call("cuMemAllocFromPoolAsync", stream, nbytes)
        if err:
            return (err, None)
        arr = np.empty(nbytes + 64, np.uint8)
        ptr = (arr.ctypes.data + 63) // 64 * 64  # aligned like device allocations
        self.mem[ptr] = arr[ptr - arr.ctypes.data:][:nbytes]
        self.used += nbytes
        self.used_high = max(self.used_high, self.used)
        return (OK, driver.CUdeviceptr(ptr))

    def cuMemFreeAsync(self, dptr, stream):
        ptr = int(dptr)
        err = self._call("cuMemFreeAsync", stream, ptr)
        if err:
            return (err,)
        arr = self.mem.pop(ptr)
        self.used -= arr.nbytes
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        err = self._call("cuMemcpyHtoDAsync", stream, (int(dst), int(src), nbytes))
        if err:
            return (err,)
        self._check_range(int(dst), nbytes, "H2D destination")
        ctypes.memmove(int(dst), int(src), nbytes)
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
        err = self._call("cuMemcpyDtoHAsync", stream, (int(dst), int(src), nbytes))
        if err:
            return (err,)
        self._check_range(int(src), nbytes, "D2H source")
        ctypes.memmove(int(dst), int(src), nbytes)
        return (OK,)

    def _memset(self, name, dtype, dst, value, count, stream):
        err = self._call(name, stream, (int(dst), value, count))
        if err:
            return (err,)
        size = np.dtype(dtype).itemsize
        self._check_range(int(dst), count * size, "memset")
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * (count * size)).from_address(int(dst)))
        arr.view(dtype)[:] = value
        return (OK,)

    def cuMemsetD8Async(self, dst, value, count, stream):
        return self._memset("cuMemsetD8Async", np.uint8, dst, value, count, stream)

    def cuMemsetD16Async(self, dst, value, count, stream):
        return self._memset("cuMemsetD16Async", np.uint16, dst, value, count, stream)

    def cuMemsetD32Async(self, dst, value, count, stream):
        return self._memset("cuMemsetD32Async", np.uint32, dst, value, count, stream)

    def _copy(self, func, params):
        """The copy kernel: ``n`` bytes from ``src`` to ``dst``, one side device memory (a live
        allocation), the other pinned host memory addressed directly."""
        func.launches += 1
        base = ctypes.c_void_p.from_address(params).value
        s = func.layout.struct_type.from_address(base)
        dst, src, n, fence = (getattr(s, f) for f in func.layout.field_names)
        self.copy_kernels.append((int(dst), int(src), int(n), int(fence)))
        on_device = [p for p in (dst, src) if self._inside(p, n)]
        assert len(on_device) == 1, "a copy kernel moves bytes between host and device memory"
        ctypes.memmove(dst, src, n)
        return (OK,)

    def _inside(self, ptr, nbytes):
        return any(base <= ptr and ptr + nbytes <= base + arr.nbytes
                   for base, arr in self.mem.items())

    def _burn(self, func, params):
        if func.name == COPY_KERNEL_NAME:
            return self._copy(func, params)
        func.launches += 1
        base = ctypes.c_void_p.from_address(params).value  # kernelParams[0] = &field 0
        s = func.layout.struct_type.from_address(base)
        if func.behave is not None:
            func.behave(self, s)
            return (OK,)
        x, y, n, iters, sc, sh = (getattr(s, f) for f in func.layout.field_names)
        v = self._floats(x, n).copy()
        for _ in range(iters):
            v = v * np.float32(sc) + np.float32(sh)
        self._floats(y, n)[:] = v
        return (OK,)

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        err = self._call("cuLaunchKernel", stream, func.name)
        if err:
            return (err,)
        return self._burn(func, params)

    def cuLaunchKernelEx(self, config, func, params, extra):
        err = self._call("cuLaunchKernelEx", config.hStream, func.name)
        if err:
            return (err,)
        self.launch_configs.append(config)
        return self._burn(func, params)

    def cuEventRecord(self, event, stream):
        return (self._call("cuEventRecord", stream, int(event)),)

    def cuStreamWaitEvent(self, stream, event, flags):
        return (self._call("cuStreamWaitEvent", stream, int(event)),)

    def launch_host_func(self, stream, fn_address, token):
        """`DriverAPI.launch_host_func`: the driver's cuLaunchHostFunc entry point."""
        err = self._call("cuLaunchHostFunc", stream, token)
        if err:
            return int(err)
        _HOSTFN(int(fn_address))(token)  # through the real C trampoline
        return 0


def fake_kernel(ref, device=None) -> FakeKernel:
    """A `KernelResolver` loader for the eager fake: the copy kernel for its `KernelRef`,
    burn for every other."""
    if ref.name == COPY_KERNEL_NAME:
        return FakeKernel(COPY_PARAMS, COPY_KERNEL_NAME)
    return FakeKernel()


class FakeTimingEvent:
    """A timing event for `orchestra.trace.EagerTracer` on the fake: recording stamps the next
    tick of one shared clock (1 ms apart), so spans come out in issue order."""

    def __init__(self, clock):
        self.clock, self.t, self.closed = clock, None, False

    def record(self, stream):
        self.clock[0] += 1.0
        self.t = self.clock[0]
        return self

    def synchronize(self):
        pass

    def close(self):
        self.closed = True


def patch_eager_tracer(monkeypatch) -> list:
    """Make ``EagerExecutor.tracer`` (``run(..., trace=True)``) an `EagerTracer` whose events
    are `FakeTimingEvent`; returns the list every created event is appended to."""
    import orchestra.trace as ot
    from orchestra.trace import EagerTracer, EventPool

    made: list = []
    clock = [0.0]

    class Pool(EventPool):
        def _create(self):
            made.append(FakeTimingEvent(clock))
            return made[-1]

    def factory(device=None, *, executor="eager"):
        return EagerTracer(device, executor=executor, pool=Pool(device),
                           elapsed=lambda a, b: b.t - a.t)

    monkeypatch.setattr(ot, "EagerTracer", factory)
    return made

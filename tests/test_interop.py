"""Interop without a GPU: DLPack and the CUDA Array Interface in (`device_view`, `host_view`),
out (`DeviceBuffer` / `BufferView` exports), external streams (`Stream.from_handle`,
`DefaultStream`, ``__cuda_stream__``, `order_after` / `order_before`) and protocol arguments to
`Kernel.launch`, on a fake driver that records every call.

The DLPack ABI reader is checked against numpy's own capsules (a real foreign producer, kDLCPU);
device tensors are stood in by small classes that export capsules made by orchestra's producer
side, or a ``__cuda_array_interface__`` dict. Every refusal is checked with its class, its
builtin base and what its message tells the user to do.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import types

import numpy as np
import pytest
from cuda.bindings import driver

import orchestra.driver as od
from orchestra.compiler.params import normalize_params
from orchestra.driver import check as check_mod
from orchestra.driver import dlpack
from orchestra.driver import event as event_mod
from orchestra.driver import export as export_mod
from orchestra.driver import interop as interop_mod
from orchestra.driver import memory as memory_mod
from orchestra.driver import owner as owner_mod
from orchestra.driver import stream as stream_mod
from orchestra.driver.interop import ExternalArray, device_view, host_view
from orchestra.driver.stream import DefaultStream, Stream
from orchestra.errors import (
    ArgumentNeedsStreamError,
    DriverArgumentValueError,
    ExportError,
    InteropError,
    InteropTypeError,
    InteropValueError,
    KernelArgumentTypeError,
)

OK = driver.CUresult.CUDA_SUCCESS
INVALID_VALUE = driver.CUresult.CUDA_ERROR_INVALID_VALUE
A = driver.CUpointer_attribute
DEVICE_MEM = int(driver.CUmemorytype.CU_MEMORYTYPE_DEVICE)
HOST_MEM = int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)


# -- the fake driver --------------------------------------------------------------------------


class FakeDriver:
    """Streams, events, stream-ordered device memory and pointer queries. "Device memory" is
    host memory; ``pointers`` maps allocation ranges to (memory type, device ordinal), as
    ``cuPointerGetAttribute`` reports them. ``log`` holds (call, args) in order."""

    def __init__(self):
        self.log: list = []
        self.mem: dict[int, np.ndarray] = {}
        self.pointers: dict[int, tuple[int, int, int]] = {}  # lo -> (hi, memtype, ordinal)
        self.stream_device: dict[int, int] = {}
        self.n = 0

    def calls(self, name):
        return [args for n, args in self.log if n == name]

    def names(self):
        return [n for n, _ in self.log]

    def _next(self):
        self.n += 1
        return self.n

    # streams and events
    def cuStreamCreateWithPriority(self, flags, priority):
        h = 7000 + self._next()
        self.stream_device[h] = 0
        self.log.append(("cuStreamCreateWithPriority", (h,)))
        return (OK, driver.CUstream(h))

    def cuStreamDestroy(self, s):
        self.log.append(("cuStreamDestroy", (int(s),)))
        return (OK,)

    def cuStreamGetDevice(self, s):
        self.log.append(("cuStreamGetDevice", (int(s),)))
        return (OK, driver.CUdevice(self.stream_device.get(int(s), 0)))

    def cuStreamGetPriority(self, s):
        return (OK, -1)

    def cuStreamSynchronize(self, s):
        self.log.append(("cuStreamSynchronize", (int(s),)))
        return (OK,)

    def cuStreamWaitEvent(self, s, ev, flags):
        self.log.append(("cuStreamWaitEvent", (int(s), int(ev))))
        return (OK,)

    def cuEventCreate(self, flags):
        h = 5000 + self._next()
        self.log.append(("cuEventCreate", (h,)))
        return (OK, driver.CUevent(h))

    def cuEventRecord(self, ev, s):
        self.log.append(("cuEventRecord", (int(ev), int(s))))
        return (OK,)

    def cuEventDestroy(self, ev):
        self.log.append(("cuEventDestroy", (int(ev),)))
        return (OK,)

    def cuCtxSynchronize(self):
        self.log.append(("cuCtxSynchronize", ()))
        return (OK,)

    # memory
    def cuMemAllocFromPoolAsync(self, nbytes, pool, stream):
        arr = np.zeros(nbytes + 64, np.uint8)
        ptr = (arr.ctypes.data + 63) // 64 * 64
        self.mem[ptr] = arr[ptr - arr.ctypes.data:][:nbytes]
        self.pointers[ptr] = (ptr + nbytes, DEVICE_MEM, 0)
        self.log.append(("cuMemAllocFromPoolAsync", (nbytes, int(stream))))
        return (OK, driver.CUdeviceptr(ptr))

    def cuMemFreeAsync(self, dptr, stream):
        ptr = int(dptr)
        self.mem.pop(ptr)[:] = 0xDD
        del self.pointers[ptr]
        self.log.append(("cuMemFreeAsync", (ptr, int(stream))))
        return (OK,)

    def cuPointerGetAttribute(self, attr, ptr):
        self.log.append(("cuPointerGetAttribute", (attr, ptr)))
        for lo, (hi, memtype, ordinal) in self.pointers.items():
            if lo <= ptr < hi:
                if attr == A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
                    return (OK, memtype)
                if attr == A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
                    return (OK, ordinal)
        return (INVALID_VALUE, None)

    def device_memory(self, nbytes, ordinal=0, memtype=DEVICE_MEM):
        """A fake allocation the pointer queries know (not owned by a DeviceBuffer)."""
        arr = np.zeros(nbytes, np.uint8)
        self.mem[arr.ctypes.data] = arr
        self.pointers[arr.ctypes.data] = (arr.ctypes.data + nbytes, memtype, ordinal)
        return arr.ctypes.data


class FakeDev:
    def __init__(self, ordinal=0):
        self.ordinal = ordinal
        self.name = f"Fake GPU {ordinal}"
        self.limits = types.SimpleNamespace(stream_priority_range=(-5, 0))

    def make_current(self, force=False):
        return self

    def pushed(self):
        return contextlib.nullcontext(self)


@pytest.fixture
def fake(monkeypatch):
    f = FakeDriver()
    devs = {0: FakeDev(0), 1: FakeDev(1)}
    pool = types.SimpleNamespace(handle="pool", device=devs[0])
    real_cu = check_mod.cu

    def fake_cu(fn, *args):
        return real_cu(getattr(f, fn.__name__), *args)

    def as_dev(d=None):
        if d is None:
            return devs[0]
        return d if isinstance(d, FakeDev) else devs[int(getattr(d, "ordinal", d))]

    for mod in (memory_mod, stream_mod, event_mod, interop_mod, export_mod):
        monkeypatch.setattr(mod, "cu", fake_cu)
        if hasattr(mod, "as_device"):
            monkeypatch.setattr(mod, "as_device", as_dev)
    monkeypatch.setattr(check_mod, "cu", fake_cu)
    monkeypatch.setattr(stream_mod, "ensure_initialized", lambda: None)
    monkeypatch.setattr(stream_mod.Device, "get", classmethod(lambda cls, o=0: devs[o]))
    monkeypatch.setattr(memory_mod.MemoryPool, "default",
                        classmethod(lambda cls, d=None, r=None: pool))
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: True)
    monkeypatch.setattr(export_mod, "context_alive", lambda ordinal: True)
    f.devs = devs
    yield f
    gc.collect()  # what the test left in cycles (exception tracebacks) goes on the fake driver


# -- stand-ins for other libraries' objects -----------------------------------------------------


class CudaTensor:
    """A kDLCUDA tensor (a torch / CuPy stand-in): ``__dlpack__`` exports a real capsule made
    by orchestra's producer side, and records the stream and version it was asked for."""

    def __init__(self, ptr, shape, dtype=np.float32, strides=None, device=(2, 0),
                 readonly=False, capsule_device=None):
        self.address, self.shape, self.dtype = ptr, tuple(shape), dtype  # no .ptr: see Kernel
        itemsize = dlpack.dl_from_dtype(dtype, "test")[1] // 8
        self.strides = strides or tuple(
            int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.itemsize = itemsize
        self.device, self.readonly = device, readonly
        self.capsule_device = capsule_device or device
        self.calls: list = []
        self.released = 0

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        versioned = max_version is not None and max_version[0] >= 1
        return dlpack.make_capsule(self.address, self.shape, self.strides, self.dtype,
                                   self.capsule_device, readonly=self.readonly,
                                   versioned=versioned, on_release=self._released)

    def _released(self):
        self.released += 1


class OldCudaTensor(CudaTensor):
    """A producer from before DLPack 1.0: ``__dlpack__`` takes only ``stream``."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream, "max_version": "absent"})
        return dlpack.make_capsule(self.address, self.shape, self.strides, self.dtype, self.device,
                                   versioned=False, on_release=self._released)


class CAIArray:
    """A ``__cuda_array_interface__`` producer (a numba / CuPy stand-in)."""

    def __init__(self, ptr, shape, typestr="<f4", *, strides=None, readonly=False, version=3,
                 stream=None, **extra):
        self.cai = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, readonly),
                    "version": version, "strides": strides, **extra}
        if isinstance(version, int) and version >= 3:
            self.cai["stream"] = stream

    @property
    def __cuda_array_interface__(self):
        return self.cai


class TorchLikeStream:
    """An object with ``__cuda_stream__`` (a method, as torch, CuPy and cuda.core have it)."""

    def __init__(self, handle, version=0):
        self.handle_value, self.version = handle, version

    def __cuda_stream__(self):
        return (self.version, self.handle_value)


class PropertyStream:
    """Older cuda.core spelled ``__cuda_stream__`` as a property."""

    def __init__(self, handle):
        self.h = handle

    @property
    def __cuda_stream__(self):
        return (0, self.h)


def _error(exc_info, cls, *builtins):
    err = exc_info.value
    assert type(err) is cls, type(err)
    assert isinstance(err, InteropError if issubclass(cls, InteropError) else Exception)
    for b in builtins:
        assert isinstance(err, b)
    return str(err)


# -- the DLPack ABI against numpy's real capsules --------------------------------------------


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_consume_reads_numpy_capsules_field_by_field(max_version):
    a = np.arange(24, dtype=np.int16).reshape(2, 3, 4)[:, 1:, ::2]  # offset and strides
    cap = a.__dlpack__() if max_version is None else a.__dlpack__(max_version=max_version)
    info = dlpack.consume(cap)
    assert info.ptr == a.ctypes.data
    assert info.device == (1, 0)
    assert info.shape == (2, 2, 2)
    assert info.strides == tuple(s // 2 for s in a.strides) == (12, 4, 2)
    assert info.dtype == np.int16 and info.itemsize == 2
    assert info.version == (None if max_version is None else (1, info.version[1]))
    assert not info.readonly
    # the capsule was renamed: a second consumer cannot take it again
    with pytest.raises(InteropTypeError, match="not an unconsumed DLPack capsule"):
        dlpack.consume(cap)
    info.holder.release()
    info.holder.release()  # once only
    assert info.holder.released


def test_consume_reads_the_read_only_flag_and_every_numpy_dtype():
    r = np.arange(4.0)
    r.flags.writeable = False
    info = dlpack.consume(r.__dlpack__(max_version=(1, 0)))
    assert info.readonly
    info.holder.release()
    for dt in ("bool", "int8", "uint8", "int32", "uint64", "float16", "float32", "float64",
               "complex64", "complex128"):
        a = np.zeros(3, dt)
        info = dlpack.consume(a.__dlpack__(max_version=(1, 0)))
        assert info.dtype == np.dtype(dt), dt
        assert info.itemsize == np.dtype(dt).itemsize
        info.holder.release()


def test_consumed_numpy_memory_stays_alive_until_the_holder_releases():
    a = np.arange(1000, dtype=np.float64)
    info = dlpack.consume(a.__dlpack__(max_version=(1, 0)))
    ptr = info.ptr
    del a
    gc.collect()
    view = (ctypes.c_double * 1000).from_address(ptr)
    assert view[999] == 999.0  # numpy's deleter has not run: the array is alive
    holder = info.holder
    del info, view
    holder.release()


def test_dtype_table_refuses_vectors_sub_byte_and_opaque_types():
    with pytest.raises(InteropTypeError, match="vector dtype .*lanes=4"):
        dlpack.dtype_from_dl(dlpack.kDLFloat, 32, 4, "x")
    with pytest.raises(InteropTypeError, match="4-bit dtype.*whole-byte"):
        dlpack.dtype_from_dl(dlpack.kDLInt, 4, 1, "x")
    with pytest.raises(InteropTypeError, match="unsupported dtype"):
        dlpack.dtype_from_dl(dlpack.kDLOpaqueHandle, 64, 1, "x")
    with pytest.raises(InteropTypeError, match="unsupported dtype"):
        dlpack.dtype_from_dl(dlpack.kDLFloat, 24, 1, "x")
    assert dlpack.dtype_from_dl(dlpack.kDLBfloat, 16, 1, "x") == ("bfloat16", 2)
    assert dlpack.dtype_from_dl(10, 8, 1, "x") == ("float8_e4m3fn", 1)
    assert dlpack.dl_from_dtype("bfloat16", "x") == (dlpack.kDLBfloat, 16)
    assert dlpack.dl_from_dtype(np.dtype(np.uint16), "x") == (dlpack.kDLUInt, 16)
    with pytest.raises(InteropTypeError, match="cannot be described in DLPack"):
        dlpack.dl_from_dtype(np.dtype("U4"), "x")


def test_our_capsules_are_read_by_numpy_and_their_release_runs_once():
    data = np.arange(6, dtype=np.int32)
    ended = []
    cap = dlpack.make_capsule(data.ctypes.data, (2, 3), (3, 1), np.dtype(np.int32), (1, 0),
                              on_release=lambda: ended.append(1))

    class Carrier:
        def __dlpack__(self, **kw):
            return cap

        def __dlpack_device__(self):
            return (1, 0)

    before = dlpack.exports_alive()
    x = np.from_dlpack(Carrier())
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]] and ended == []
    data[4] = 40
    assert x[1, 1] == 40  # the same memory: no copy
    del x, cap
    gc.collect()
    assert ended == [1] and dlpack.exports_alive() == before - 1
    # a capsule never consumed ends its export when it is collected
    cap = dlpack.make_capsule(data.ctypes.data, (6,), (1,), np.dtype(np.int32), (1, 0),
                              versioned=False, on_release=lambda: ended.append(2))
    del cap
    gc.collect()
    assert ended == [1, 2] and dlpack.exports_alive() == before - 1


def test_read_only_export_sets_the_versioned_flag_numpy_honours():
    data = np.arange(3, dtype=np.float32)
    cap = dlpack.make_capsule(data.ctypes.data, (3,), (1,), np.dtype(np.float32), (1, 0),
                              readonly=True)

    class Carrier:
        def __dlpack__(self, **kw):
            return cap

        def __dlpack_device__(self):
            return (1, 0)

    x = np.from_dlpack(Carrier())
    assert not x.flags.writeable


# -- device_view: DLPack ----------------------------------------------------------------------


def test_dlpack_view_passes_our_stream_and_reads_the_tensor(fake):
    s = Stream()
    ptr = fake.device_memory(4096)
    t = CudaTensor(ptr, (16, 8), np.float32)
    view = device_view(t, stream=s, nbytes=512, dtype=np.float32, writable=True)
    assert t.calls == [{"stream": int(s.handle), "max_version": (1, 0)}]
    assert view.protocol == "dlpack"
    assert (view.ptr, view.nbytes, view.device) == (ptr, 512, 0)
    assert view.shape == (16, 8) and view.strides == (32, 4)
    assert view.dtype == np.float32 and view.itemsize == 4 and not view.readonly
    assert view.ordering == ("dlpack: the producer ordered its work before stream "
                             f"{int(s.handle):#x}")
    assert "cuEventRecord" not in fake.names()  # the producer orders, orchestra does not
    assert t.released == 0
    view.release()
    assert t.released == 1 and view.released
    view.release()
    assert t.released == 1


def test_dlpack_view_without_a_stream_asks_for_no_ordering(fake):
    t = CudaTensor(fake.device_memory(64), (16,))
    with device_view(t) as view:
        assert t.calls[0]["stream"] == -1
        assert view.ordering.startswith("none: no stream given")
    assert t.released == 1


def test_dlpack_view_on_a_default_stream_passes_its_dlpack_number(fake):
    t = CudaTensor(fake.device_memory(64), (16,))
    device_view(t, stream=DefaultStream(0)).release()
    device_view(t, stream=Stream.from_handle(2)).release()
    assert [c["stream"] for c in t.calls] == [1, 2]


def test_dlpack_producer_without_max_version_gets_the_legacy_call(fake):
    t = OldCudaTensor(fake.device_memory(64), (16,))
    s = Stream()
    view = device_view(t, stream=s)
    assert t.calls == [{"stream": int(s.handle), "max_version": "absent"}]
    assert view.nbytes == 64 and not view.readonly
    del view
    gc.collect()
    assert t.released == 1  # collected records release too


def test_dlpack_view_is_released_when_a_check_refuses(fake):
    t = CudaTensor(fake.device_memory(64), (16,))
    with pytest.raises(InteropValueError, match="too small"):
        device_view(t, nbytes=65)
    assert t.released == 1


def test_dlpack_refusals_name_what_to_change(fake):
    ptr = fake.device_memory(4096)
    s = Stream()
    # another device
    with pytest.raises(InteropValueError) as info:
        device_view(CudaTensor(ptr, (16,), device=(2, 1)), stream=s)
    msg = _error(info, InteropValueError, ValueError)
    assert "is on device 1, but orchestra uses it on device 0" in msg
    assert "t.to('cuda:0')" in msg
    # strided
    with pytest.raises(InteropValueError) as info:
        device_view(CudaTensor(ptr, (4, 4), strides=(1, 4)), stream=s)
    msg = _error(info, InteropValueError, ValueError)
    assert "is strided (shape (4, 4), strides (4, 16) bytes" in msg
    assert "t.contiguous()" in msg and "cupy.ascontiguousarray(a)" in msg
    # ... which layout="dense" accepts (a transposed tensor's bytes are all there)
    dense = device_view(CudaTensor(ptr, (4, 4), strides=(1, 4)), stream=s, layout="dense")
    assert dense.nbytes == 64
    with pytest.raises(InteropValueError, match="is strided"):  # gaps are never dense
        device_view(CudaTensor(ptr, (4, 4), strides=(8, 1)), layout="dense")
    # too small
    with pytest.raises(InteropValueError) as info:
        device_view(CudaTensor(ptr, (16,)), nbytes=100)
    msg = _error(info, InteropValueError, ValueError)
    assert "is too small: it has 64 bytes (shape (16,), float32), but at least 100 bytes" in msg
    # read-only for a writer
    with pytest.raises(InteropValueError) as info:
        device_view(CudaTensor(ptr, (16,), readonly=True), writable=True)
    msg = _error(info, InteropValueError, ValueError)
    assert "is read-only (the DLPack read-only flag), but orchestra writes it" in msg
    assert device_view(CudaTensor(ptr, (16,), readonly=True)).readonly  # a reader may
    # dtype
    with pytest.raises(InteropTypeError) as info:
        device_view(CudaTensor(ptr, (16,), np.int32), dtype=np.float32)
    msg = _error(info, InteropTypeError, TypeError)
    assert "has dtype int32, but float32 is needed" in msg
    # unsupported dtype: a vector type
    with pytest.raises(InteropTypeError, match="vector dtype"):
        class Vec(CudaTensor):
            def __dlpack__(self, **kw):
                cap = super().__dlpack__(**kw)
                mt = dlpack.DLManagedTensorVersioned.from_address(
                    dlpack._get_pointer(cap, dlpack._VERSIONED))
                mt.dl_tensor.dtype.lanes = 4
                return cap
        device_view(Vec(ptr, (4,)))
    # host memory
    with pytest.raises(InteropValueError) as info:
        device_view(CudaTensor(ptr, (16,), device=(1, 0)))
    msg = _error(info, InteropValueError, ValueError)
    assert "is in host memory (DLPack device kDLCPU)" in msg
    assert "t.cuda()" in msg and "host_view" in msg
    with pytest.raises(InteropValueError, match=r"on a kDLROCM device"):
        device_view(CudaTensor(ptr, (16,), device=(10, 0)))
    # the capsule disagreeing with __dlpack_device__
    t = CudaTensor(ptr, (16,), device=(2, 0), capsule_device=(1, 0))
    with pytest.raises(InteropValueError, match="capsule says DLPack device kDLCPU"):
        device_view(t)
    assert t.released == 1
    # not a protocol object at all
    with pytest.raises(InteropTypeError) as info:
        device_view(object())
    msg = _error(info, InteropTypeError, TypeError)
    assert "is not device memory orchestra can read" in msg and "__dlpack__" in msg


def test_bfloat16_and_managed_memory_from_dlpack(fake):
    ptr = fake.device_memory(64)
    v = device_view(CudaTensor(ptr, (32,), "bfloat16"), dtype="bfloat16")
    assert v.dtype == "bfloat16" and v.itemsize == 2 and v.nbytes == 64
    with pytest.raises(InteropTypeError, match="has dtype bfloat16, but float16 is needed"):
        device_view(CudaTensor(ptr, (32,), "bfloat16"), dtype=np.float16)
    managed = device_view(CudaTensor(ptr, (16,), device=(13, 0)), device=1)
    assert managed.device == 1  # managed memory is usable on the device asked for


def test_a_producer_that_refuses_is_an_interop_error(fake):
    class Refuses(CudaTensor):
        def __dlpack__(self, **kw):
            raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

    with pytest.raises(InteropValueError) as info:
        device_view(Refuses(fake.device_memory(64), (16,)), stream=Stream())
    msg = _error(info, InteropValueError, ValueError)
    assert "refused to export: RuntimeError: Can't export tensors that require gradient" in msg


# -- device_view: the CUDA Array Interface ----------------------------------------------------


def test_cai_v3_with_a_stream_records_there_and_waits_on_ours(fake):
    s = Stream()
    ptr = fake.device_memory(1024)
    producer = 0x9000
    a = CAIArray(ptr, (8, 32), "<f4", stream=producer)
    fake.log.clear()
    view = device_view(a, stream=s, dtype="float32", writable=True, nbytes=1024)
    assert view.protocol == "cuda_array_interface" and view.keepalive == (a,)
    assert (view.ptr, view.nbytes, view.shape, view.strides) == (ptr, 1024, (8, 32), (128, 4))
    (ev,) = fake.calls("cuEventCreate")
    assert fake.calls("cuEventRecord") == [(ev[0], producer)]
    assert fake.calls("cuStreamWaitEvent") == [(int(s.handle), ev[0])]
    assert fake.calls("cuEventDestroy") == [ev]
    # the checks came first: both pointer queries, then the ordering
    names = fake.names()
    assert names.index("cuEventRecord") > max(i for i, n in enumerate(names)
                                              if n == "cuPointerGetAttribute")
    assert view.ordering == f"event: stream {int(s.handle):#x} waits for stream {producer:#x}"


@pytest.mark.parametrize("value,name", [(1, "the legacy default stream"),
                                        (2, "the per-thread default stream")])
def test_cai_default_stream_numbers_are_recorded_on_for_ordering(fake, value, name):
    s = Stream()
    view = device_view(CAIArray(fake.device_memory(64), (16,), stream=value), stream=s)
    (ev,) = fake.calls("cuEventCreate")
    assert fake.calls("cuEventRecord") == [(ev[0], value)]
    assert view.ordering.endswith(f"waits for {name}")


def test_cai_same_stream_no_stream_v2_and_no_consumer_order_nothing(fake):
    s = Stream()
    ptr = fake.device_memory(64)
    fake.log.clear()
    same = device_view(CAIArray(ptr, (16,), stream=int(s.handle)), stream=s)
    v2 = device_view(CAIArray(ptr, (16,), version=2), stream=s)
    none = device_view(CAIArray(ptr, (16,), stream=None), stream=s)
    unordered = device_view(CAIArray(ptr, (16,), stream=0x9000))
    assert "cuEventRecord" not in fake.names()
    assert same.ordering.startswith("none: the producer's stream")
    assert v2.ordering == ("none: the CUDA Array Interface gave no stream (version 2): by the "
                           "protocol the producer has synchronized")
    assert "version 3" in none.ordering
    assert unordered.ordering.startswith("none: no stream given")


def test_cai_refusals_name_what_to_change(fake):
    ptr = fake.device_memory(4096)
    s = Stream()
    with pytest.raises(InteropValueError) as info:
        device_view(CAIArray(ptr, (16,), stream=0), stream=s)
    msg = _error(info, InteropValueError, ValueError)
    assert "stream is 0, which the CUDA Array Interface disallows" in msg
    assert "1 for the legacy default stream" in msg
    assert "cuEventRecord" not in fake.names()
    with pytest.raises(InteropValueError, match="is strided .*strides \\(64, 4\\) bytes"):
        device_view(CAIArray(ptr, (4, 4), strides=(64, 4)), stream=s)
    with pytest.raises(InteropValueError, match="is too small: it has 64 bytes"):
        device_view(CAIArray(ptr, (16,)), nbytes=4096)
    with pytest.raises(InteropValueError, match=r"read-only \(the interface's data\[1\]\)"):
        device_view(CAIArray(ptr, (16,), readonly=True), writable=True)
    with pytest.raises(InteropTypeError, match="has dtype float64, but int64 is needed"):
        device_view(CAIArray(ptr, (16,), "<f8"), dtype=np.int64)
    with pytest.raises(InteropTypeError, match="structured dtype"):
        device_view(CAIArray(ptr, (16,), "|V8", descr=[("a", "<f4"), ("b", "<f4")]))
    with pytest.raises(InteropTypeError, match="unsupported dtype '|O'"):
        device_view(CAIArray(ptr, (16,), "|O"))
    with pytest.raises(InteropTypeError, match="byte order"):
        device_view(CAIArray(ptr, (16,), ">f4"))
    with pytest.raises(InteropValueError, match="masked arrays"):
        device_view(CAIArray(ptr, (16,), mask=CAIArray(ptr, (16,), "|b1")))
    with pytest.raises(InteropValueError, match="version None is not a known version"):
        device_view(CAIArray(ptr, (16,), version=None))
    # the pointer's device, asked of the driver
    other = fake.device_memory(64, ordinal=1)
    with pytest.raises(InteropValueError, match="is on device 1, but orchestra uses it on "
                                                "device 0"):
        device_view(CAIArray(other, (16,)), stream=s)
    pinned = fake.device_memory(64, memtype=HOST_MEM)
    with pytest.raises(InteropValueError, match="page-locked host memory.*host_view"):
        device_view(CAIArray(pinned, (16,)))
    with pytest.raises(InteropValueError, match="is not CUDA memory the driver knows"):
        device_view(CAIArray(0x1234, (16,)))
    # a descr that only restates typestr is fine
    assert device_view(CAIArray(ptr, (16,), "<f4", descr=[("", "<f4")])).nbytes == 64


def test_cai_producer_failure_and_empty_arrays(fake):
    class Broken:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")

    with pytest.raises(InteropValueError, match="reading __cuda_array_interface__ failed: "
                                                "RuntimeError: Can't get"):
        device_view(Broken())
    empty = device_view(CAIArray(0, (0, 4)))  # a null pointer is fine for 0 bytes
    assert empty.nbytes == 0 and empty.device == 0


def test_releasing_a_cai_record_never_calls_the_objects_own_release(fake):
    class Pooled(CAIArray):
        def release(self):
            raise AssertionError("the producer's own release() was called")

    a = Pooled(fake.device_memory(64), (16,))
    view = device_view(a)
    view.release()
    assert view.released and view.obj is None


def test_a_size_one_dimension_with_any_stride_is_still_contiguous(fake):
    ptr = fake.device_memory(64)
    v = device_view(CAIArray(ptr, (1, 16), strides=(12345, 4)))
    assert v.nbytes == 64


# -- device_view: orchestra's own buffers ------------------------------------------------------


def test_device_buffer_and_views_take_a_lease(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(256, s)
    rec = device_view(buf, stream=s, dtype=np.float32, nbytes=256, writable=True)
    assert rec.protocol == "orchestra" and rec.dtype is None  # untyped bytes match any dtype
    assert rec.ptr == buf.ptr and buf._own.leases == 1
    typed = device_view(buf.view(np.float32, (8, 8)))
    assert typed.dtype == np.float32 and typed.shape == (8, 8) and typed.nbytes == 256
    with pytest.raises(InteropTypeError, match="has dtype float32, but int32 is needed"):
        device_view(buf.view(np.float32), dtype=np.int32)
    buf.close()
    assert fake.calls("cuMemFreeAsync") == []  # leased
    rec.release()
    typed.release()
    gc.collect()
    assert len(fake.calls("cuMemFreeAsync")) == 1
    with pytest.raises(InteropValueError, match="was released"):  # refused, not read
        device_view(rec)
    with pytest.raises(InteropValueError, match="was released"):
        device_view(ExternalArray(ptr=1, nbytes=1, device=0, shape=(1,), strides=(1,),
                                  dtype=None, itemsize=1, readonly=False, obj=None,
                                  keepalive=None, protocol="orchestra", ordering=""))


def test_a_wrapped_record_does_not_release_the_inner_one(fake):
    t = CudaTensor(fake.device_memory(64), (16,))
    inner = device_view(t)
    outer = device_view(inner, dtype=np.float32)
    outer.release()
    assert t.released == 0 and not inner.released
    inner.release()
    assert t.released == 1


# -- host_view ----------------------------------------------------------------------------------


class HostTensor:
    """A CPU tensor that speaks DLPack (a pinned torch CPU tensor stand-in)."""

    def __init__(self, array, device=(1, 0)):
        self.array, self.device = array, device

    def __dlpack__(self, **kw):
        kw.pop("stream", None)
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.device


def test_host_view_shares_memory_with_every_host_protocol():
    base = np.arange(8, dtype=np.float32)
    assert host_view(base) is base
    through_dlpack = host_view(HostTensor(base))
    assert np.shares_memory(through_dlpack, base) and through_dlpack.dtype == np.float32
    through_dlpack[0] = 42
    assert base[0] == 42

    class AI:
        @property
        def __array_interface__(self):
            return base.__array_interface__

    assert np.shares_memory(host_view(AI()), base)
    raw = bytearray(16)
    v = host_view(raw)
    v[3] = 7
    assert raw[3] == 7
    ro = host_view(bytes(4))
    assert not ro.flags.writeable


def test_host_view_through_dlpack_keeps_the_tensor_until_the_array_dies():
    base = np.arange(8, dtype=np.float32)
    released, streams = [], []

    class PinnedTensor:  # a pinned torch CPU tensor stand-in: DLPack kDLCUDAHost
        def __init__(self, dtype=np.float32, readonly=True):
            self.dtype, self.readonly = dtype, readonly

        def __dlpack_device__(self):
            return (3, 0)

        def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            streams.append(stream)
            return dlpack.make_capsule(base.ctypes.data, (2, 4), (4, 1), self.dtype, (3, 0),
                                       readonly=self.readonly,
                                       versioned=max_version is not None,
                                       on_release=lambda: released.append(1))

    a = host_view(PinnedTensor())
    assert streams == [None]  # host memory: no stream
    assert a.shape == (2, 4) and a.dtype == np.float32 and a.ctypes.data == base.ctypes.data
    assert not a.flags.writeable  # the read-only flag reaches numpy
    assert a[1, 2] == 6.0
    assert released == []
    del a
    gc.collect()
    assert released == [1]
    w = host_view(PinnedTensor(readonly=False))
    w[0, 0] = 99.0
    assert base[0] == 99.0
    del w
    with pytest.raises(InteropTypeError, match="numpy has no bfloat16 dtype"):
        host_view(PinnedTensor("bfloat16"))
    gc.collect()
    assert released == [1, 1, 1]  # the refused one was released too


def test_host_view_refuses_device_memory_and_strangers():
    with pytest.raises(InteropValueError) as info:
        host_view(HostTensor(np.zeros(2), device=(2, 0)))
    msg = _error(info, InteropValueError, ValueError)
    assert "is device memory (DLPack kDLCUDA)" in msg and "device_view" in msg
    with pytest.raises(InteropValueError, match="is device memory \\(CUDA Array Interface\\)"):
        host_view(CAIArray(0x1000, (4,)))
    with pytest.raises(InteropTypeError) as info:
        host_view(3.5)
    assert "is not host memory orchestra can read" in _error(info, InteropTypeError, TypeError)


def test_host_view_result_passes_the_binding_checks():
    from orchestra.execute import bindings

    base = np.arange(64, dtype=np.float32)
    a = host_view(HostTensor(base))
    asked = []
    checker = bindings.PinnedCheck(lambda arr: asked.append(arr) or True)  # pinned, as torch's
    assert bindings.check_host_array("x", a, 256, "writer", checker) is a
    assert len(asked) == 1 and asked[0] is a


# -- streams ------------------------------------------------------------------------------------


def test_cuda_stream_round_trip(fake):
    before = od.live_handles()
    s = Stream()
    assert s.__cuda_stream__() == (0, int(s.handle))
    assert Stream.from_handle(s) is s
    theirs = TorchLikeStream(int(s.handle))
    wrapped = Stream.from_handle(theirs, device=0)
    assert isinstance(wrapped, Stream) and wrapped.external and wrapped.source is theirs
    assert int(wrapped.handle) == int(s.handle) and wrapped.__cuda_stream__() == (0, int(s.handle))
    assert wrapped.priority == -1  # asked of the driver
    assert "external Stream" in repr(wrapped)
    # the driver says which device a non-default stream is on
    fake.stream_device[0xABC0] = 1
    other = Stream.from_handle(PropertyStream(0xABC0))
    assert other.device.ordinal == 1 and fake.calls("cuStreamGetDevice") == [(0xABC0,)]
    assert Stream.from_handle(driver.CUstream(0xABC0), device=1).device.ordinal == 1
    # wrappers are never destroyed by orchestra and count as no handle
    wrapped.close()
    other.close()
    assert wrapped.closed and fake.calls("cuStreamDestroy") == []
    with pytest.raises(ValueError, match="external Stream wrapper is closed"):
        wrapped.handle
    s.close()
    assert fake.calls("cuStreamDestroy") == [(int(driver.CUstream(fake.calls(
        "cuStreamCreateWithPriority")[0][0])),)]
    assert od.live_handles() == before


def test_from_handle_refusals(fake):
    with pytest.raises(InteropValueError, match="version 1; orchestra reads version 0"):
        Stream.from_handle(TorchLikeStream(0x9000, version=1))
    with pytest.raises(InteropValueError, match="cannot be negative"):
        Stream.from_handle(-5)
    with pytest.raises(InteropTypeError) as info:
        Stream.from_handle(3.0)
    assert "__cuda_stream__" in _error(info, InteropTypeError, TypeError)

    class Bad:
        def __cuda_stream__(self):
            return "stream"

    with pytest.raises(InteropValueError, match=r"returns \(0, stream_handle_int\)"):
        Stream.from_handle(Bad())


@pytest.mark.parametrize("handle", [0, 1, 2, TorchLikeStream(0), driver.CUstream(0)])
def test_default_streams_order_but_never_take_work(fake, handle):
    d = Stream.from_handle(handle)
    assert isinstance(d, DefaultStream) and not isinstance(d, Stream)
    value = 2 if handle == 2 else 1
    assert d.value == value and d.__cuda_stream__() == (0, value)
    with pytest.raises(DriverArgumentValueError) as info:
        d.handle
    msg = str(info.value)
    assert "wrapped for ordering only" in msg and "order_after" in msg
    assert "torch.cuda.Stream()" in msg
    with pytest.raises(DriverArgumentValueError, match="ordering only"):
        od.DeviceBuffer.allocate(16, d)
    with pytest.raises(DriverArgumentValueError, match="ordering only"):
        stream_mod.check_stream(d, "GraphExec.launch")
    # ordering is allowed
    ev = od.Event()
    ev.record(d)
    d.wait(ev)
    d.synchronize()
    assert fake.calls("cuEventRecord")[-1] == (int(ev.handle), value)
    assert fake.calls("cuStreamWaitEvent")[-1] == (value, int(ev.handle))
    assert fake.calls("cuStreamSynchronize")[-1] == (value,)
    ev.close()


def test_order_after_and_order_before(fake):
    ours = Stream()
    theirs = TorchLikeStream(0x9100)
    fake.log.clear()
    od.order_after(ours, theirs)
    (ev,) = fake.calls("cuEventCreate")
    assert fake.calls("cuEventRecord") == [(ev[0], 0x9100)]
    assert fake.calls("cuStreamWaitEvent") == [(int(ours.handle), ev[0])]
    assert fake.calls("cuEventDestroy") == [ev]
    fake.log.clear()
    od.order_before(ours, theirs)
    (ev,) = fake.calls("cuEventCreate")
    assert fake.calls("cuEventRecord") == [(ev[0], int(ours.handle))]
    assert fake.calls("cuStreamWaitEvent") == [(0x9100, ev[0])]
    fake.log.clear()
    od.order_after(ours, 0)  # torch.cuda.current_stream() by default: the legacy stream
    assert fake.calls("cuEventRecord")[0][1] == 1
    od.order_before(ours, TorchLikeStream(0))
    assert fake.calls("cuStreamWaitEvent")[-1][0] == 1
    fake.log.clear()
    od.order_after(ours, ours)  # nothing to order
    od.order_after(ours, TorchLikeStream(int(ours.handle)))
    od.order_after(0, DefaultStream(1))
    assert not {"cuEventCreate", "cuEventRecord", "cuStreamWaitEvent"} & set(fake.names())


def test_order_helpers_put_a_raw_default_stream_on_the_other_streams_device(fake):
    fake.stream_device[0x9200] = 1
    producer, waiter = od.ordering.resolve_pair(0, TorchLikeStream(0x9200))
    assert isinstance(producer, DefaultStream) and producer.device.ordinal == 1
    assert waiter.device.ordinal == 1


# -- exports: DeviceBuffer / BufferView -------------------------------------------------------


def _consume(obj, **kw):
    return dlpack.consume(obj.__dlpack__(**kw))


def test_dlpack_export_orders_the_consumer_stream_after_ours(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(1024, s)
    view = buf.view(np.float32, (16, 16))
    assert view.__dlpack_device__() == (2, 0) and buf.__dlpack_device__() == (2, 0)
    fake.log.clear()
    info = _consume(view, stream=0x9300, max_version=(1, 0))
    (ev,) = fake.calls("cuEventCreate")
    assert fake.calls("cuEventRecord") == [(ev[0], int(s.handle))]
    assert fake.calls("cuStreamWaitEvent") == [(0x9300, ev[0])]
    assert fake.calls("cuEventDestroy") == [ev]
    assert info.ptr == buf.ptr and info.device == (2, 0) and info.version == (1, 0)
    assert info.shape == (16, 16) and info.strides == (16, 1) and info.dtype == np.float32
    assert not info.readonly
    fake.log.clear()
    for stream, waited in ((None, 1), (1, 1), (2, 2), (-1, None), (int(s.handle), None)):
        i = _consume(view, stream=stream)
        assert i.version is None  # no max_version: a legacy capsule
        waits = fake.calls("cuStreamWaitEvent")
        assert (waits[-1][0] if waits else None) == waited or waited is None and not waits
        fake.log.clear()
        i.holder.release()
    info.holder.release()


def test_dlpack_export_refusals_are_buffer_errors(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(64, s)
    alive = dlpack.exports_alive()
    for kw, text in (({"stream": 0}, "stream 0 is ambiguous"),
                     ({"dl_device": (1, 0)}, r"cannot be exported to DLPack device \(1, 0\)"),
                     ({"dl_device": (2, 1)}, "cannot be exported"),
                     ({"copy": True}, "copy=True is not supported"),
                     ({"stream": 1.5}, "must be an int")):
        with pytest.raises(ExportError, match=text) as info:
            buf.__dlpack__(**kw)
        assert isinstance(info.value, BufferError) and isinstance(info.value, InteropError)
    assert dlpack.exports_alive() == alive  # a refusal exports nothing
    assert buf._own.leases == 0
    ro = buf.view(np.float32, readonly=True)
    info = _consume(ro, max_version=(1, 0))
    assert info.readonly
    info.holder.release()


def test_view_shapes_and_sizes(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(100, s)
    assert buf.view().shape == (100,) and buf.view().dtype == np.uint8
    assert buf.view(np.float32).shape == (25,)
    assert buf.view(np.float64).shape == (12,)  # whole elements only
    assert buf.view(np.int16, 3).shape == (3,)
    with pytest.raises(DriverArgumentValueError, match="needs 104 bytes; the DeviceBuffer has 100"):
        buf.view(np.float32, (26,))
    with pytest.raises(InteropTypeError, match="cannot have dtype"):
        buf.view(np.dtype([("a", "f4"), ("b", "f4")]))
    bf = buf.view("bfloat16", (50,))
    info = _consume(bf, max_version=(1, 0))
    assert info.dtype == "bfloat16" and info.itemsize == 2
    info.holder.release()
    with pytest.raises(ExportError, match="no typestr for bfloat16"):
        bf.__cuda_array_interface__
    other = Stream()
    assert buf.view(stream=other).stream is other
    with pytest.raises(DriverArgumentValueError, match="ordering only"):
        buf.view(stream=DefaultStream(1))


def test_a_closed_buffer_stays_allocated_while_a_capsule_is_out(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(256, s)
    ptr = buf.ptr
    cap = buf.view(np.float32).__dlpack__(stream=-1, max_version=(1, 0))
    gc.collect()  # the view is gone; the capsule keeps its own lease
    assert buf._own.leases == 1
    info = dlpack.consume(cap)
    del cap
    buf.close()
    assert buf.closed and fake.calls("cuMemFreeAsync") == []
    fake.log.clear()
    info.holder.release()  # the consumer let go: sync the context (its work), then free
    assert fake.names() == ["cuCtxSynchronize", "cuMemFreeAsync"]
    assert fake.calls("cuMemFreeAsync") == [(ptr, int(s.handle))]


def test_an_unconsumed_capsule_ends_its_lease_without_a_sync_while_the_buffer_is_open(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(64, s)
    cap = buf.__dlpack__(stream=-1)
    assert buf._own.leases == 1
    fake.log.clear()
    del cap
    gc.collect()
    assert buf._own.leases == 0 and "cuCtxSynchronize" not in fake.names()
    buf.close()
    assert len(fake.calls("cuMemFreeAsync")) == 1


def test_cuda_array_interface_export(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(64, s)
    view = buf.view(np.int32, (4, 4))
    cai = view.__cuda_array_interface__
    assert cai == {"version": 3, "shape": (4, 4), "typestr": "<i4", "data": (buf.ptr, False),
                   "strides": None, "stream": int(s.handle)}
    # and orchestra reads its own export back through the protocol, ordered: same stream
    back = device_view(CAIArray(*cai["data"][:1], cai["shape"], cai["typestr"],
                                stream=cai["stream"]), stream=s, dtype=np.int32)
    assert back.ptr == buf.ptr and back.ordering.startswith("none: the producer's stream")
    assert buf.__cuda_array_interface__["typestr"] == "|u1"
    assert buf.__cuda_array_interface__["shape"] == (64,)
    view.release()
    with pytest.raises(ExportError, match="was released"):
        view.__cuda_array_interface__
    with pytest.raises(ExportError, match="was released"):
        view.__dlpack__()


def test_cuda_array_interface_keeps_a_closed_buffer_until_the_consumer_lets_go(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(64, s)
    ptr = buf.ptr
    consumer_holds = [buf]  # a CUDA Array Interface consumer keeps the exporting object
    buf.__cuda_array_interface__
    buf.__cuda_array_interface__  # one lease, however often it is read
    assert buf._own.leases == 1
    buf.close()
    assert fake.calls("cuMemFreeAsync") == []
    fake.log.clear()
    del buf
    consumer_holds.clear()
    gc.collect()
    assert fake.names() == ["cuCtxSynchronize", "cuMemFreeAsync"]
    assert fake.calls("cuMemFreeAsync") == [(ptr, int(s.handle))]


def test_a_buffer_view_keeps_its_lease_while_it_lives(fake):
    s = Stream()
    buf = od.DeviceBuffer.allocate(64, s)
    view = buf.view(np.float32)
    buf.close()
    assert fake.calls("cuMemFreeAsync") == []
    with pytest.raises(ValueError, match="closed"):
        buf.view()
    del view
    gc.collect()
    assert len(fake.calls("cuMemFreeAsync")) == 1


def test_round_trip_through_dlpack_orders_on_the_consumer_stream(fake):
    producer_stream, consumer_stream = Stream(), Stream()
    buf = od.DeviceBuffer.allocate(64, producer_stream)

    class Foreign:  # another library re-exporting orchestra's memory
        def __dlpack__(self, **kw):
            return buf.view(np.float32).__dlpack__(**kw)

        def __dlpack_device__(self):
            return buf.__dlpack_device__()

    fake.log.clear()
    rec = device_view(Foreign(), stream=consumer_stream, dtype=np.float32, writable=True)
    assert rec.ptr == buf.ptr and rec.shape == (16,) and rec.protocol == "dlpack"
    assert fake.calls("cuEventRecord")[0][1] == int(producer_stream.handle)
    assert fake.calls("cuStreamWaitEvent")[0][0] == int(consumer_stream.handle)
    rec.release()
    gc.collect()
    assert buf._own.leases == 0


# -- Kernel.launch with protocol arguments ----------------------------------------------------


@pytest.fixture
def kernel(fake, monkeypatch):
    """A `Kernel` for ``copy(const float* x, float* y, int n)`` whose launches are recorded
    with the argument values the driver would read."""
    from orchestra.kernel import module as mod

    params = normalize_params(("const float* x", "float* y", "int n"))
    monkeypatch.setattr(mod.Kernel, "_verify_params", lambda self: None)
    k = mod.Kernel(types.SimpleNamespace(device=fake.devs[0], _image=b""), "copy", "copy",
                   "kernel", "function", params)
    k._plain[(1, 32, 0)] = (1, 1, 1, 32, 1, 1, 0)
    launches = []

    def launch(*a):
        ptrs = (ctypes.c_void_p * 3).from_address(a[9])
        values = (ctypes.c_uint64.from_address(ptrs[0]).value,
                  ctypes.c_uint64.from_address(ptrs[1]).value,
                  ctypes.c_int32.from_address(ptrs[2]).value)
        launches.append((int(a[8]), values))
        fake.log.append(("cuLaunchKernel", (int(a[8]),)))
        return (OK,)

    monkeypatch.setattr(mod, "_launch", launch)
    k.launches = launches
    return k


def test_launch_takes_protocol_arguments_ordered_on_the_launch_stream(fake, kernel):
    s = Stream()
    x = CudaTensor(fake.device_memory(128), (32,), np.float32)
    y_ptr = fake.device_memory(128)
    y = CAIArray(y_ptr, (32,), "<f4", stream=0x9400)
    fake.log.clear()
    kernel.launch(s, 1, 32, [x, y, 32])
    assert kernel.launches == [(int(s.handle), (x.address, y_ptr, 32))]
    assert x.calls == [{"stream": int(s.handle), "max_version": (1, 0)}]
    names = fake.names()
    # the CUDA Array Interface producer's stream was waited for before the launch
    assert names.index("cuStreamWaitEvent") < names.index("cuLaunchKernel")
    assert fake.calls("cuEventRecord")[0][1] == 0x9400
    assert x.released == 1  # orchestra lets go when launch returns (the caller keeps x)
    # mappings too, and the fast path is untouched for ints and buffers
    kernel.launch(s, 1, 32, {"x": x, "y": y_ptr, "n": 4})
    assert kernel.launches[-1][1] == (x.address, y_ptr, 4)


def test_launch_on_another_librarys_stream(fake, kernel):
    theirs = TorchLikeStream(0x9500)
    x = CudaTensor(fake.device_memory(128), (32,))
    kernel.launch(theirs, 1, 32, [x, fake.device_memory(128), 32])
    assert kernel.launches[-1][0] == 0x9500
    assert x.calls[-1]["stream"] == 0x9500
    kernel.launch(theirs, 1, 32, [1, 2, 3])  # plain ints on a __cuda_stream__ stream
    assert kernel.launches[-1] == (0x9500, (1, 2, 3))


@pytest.mark.parametrize("make", [lambda: TorchLikeStream(0), lambda: TorchLikeStream(2),
                                  lambda: DefaultStream(1)])
def test_launch_on_a_default_stream_is_refused_before_any_ordering(fake, kernel, make):
    stream = make()
    x = CudaTensor(fake.device_memory(128), (32,))
    with pytest.raises(DriverArgumentValueError) as info:
        kernel.launch(stream, 1, 32, [x, 0x2000, 32])
    msg = str(info.value)
    assert "default stream" in msg and "order_after" in msg
    assert x.calls == [] and kernel.launches == []
    with pytest.raises(DriverArgumentValueError, match="default stream"):
        kernel.launch(stream, 1, 32, [1, 2, 3])


def test_launch_reads_cuda_stream_before_handle(fake, kernel):
    class CoreLikeStream:  # cuda.core streams have both; the default one must still be refused
        handle = driver.CUstream(1)

        def __cuda_stream__(self):
            return (0, 1)

    with pytest.raises(DriverArgumentValueError, match="legacy default stream"):
        kernel.launch(CoreLikeStream(), 1, 32, [1, 2, 3])
    for raw in (driver.CUstream(1), driver.CUstream(2)):
        with pytest.raises(DriverArgumentValueError, match="default stream"):
            kernel.launch(raw, 1, 32, [1, 2, 3])
    with pytest.raises(DriverArgumentValueError, match="legacy default stream"):
        kernel.launch(driver.CUstream(0), 1, 32, [1, 2, 3])
    assert kernel.launches == []
    kernel.launch(driver.CUstream(0x9600), 1, 32, [1, 2, 3])
    assert kernel.launches == [(0x9600, (1, 2, 3))]


def test_launch_checks_the_pointee_dtype_and_const(fake, kernel):
    s = Stream()
    ptr = fake.device_memory(128)
    with pytest.raises(InteropTypeError) as info:
        kernel.launch(s, 1, 32, [CudaTensor(ptr, (32,), np.int32), ptr, 32])
    msg = str(info.value)
    assert "kernel copy: parameter x (const float*) has dtype int32, but float32 is needed" in msg
    with pytest.raises(InteropValueError, match="parameter y .*read-only.*declare the kernel "
                                                "parameter const"):
        kernel.launch(s, 1, 32, [ptr, CudaTensor(ptr, (32,), readonly=True), 32])
    # read-only is fine for const T*
    kernel.launch(s, 1, 32, [CudaTensor(ptr, (32,), readonly=True), ptr, 32])
    with pytest.raises(InteropValueError, match="parameter x .*is strided"):
        kernel.launch(s, 1, 32, [CudaTensor(ptr, (4, 4), strides=(1, 4)), ptr, 32])
    assert len(kernel.launches) == 1
    # a view taken before the failing argument was released (nothing leaks)
    good = CudaTensor(ptr, (32,))
    with pytest.raises(InteropValueError):
        kernel.launch(s, 1, 32, [good, CudaTensor(ptr, (32,), readonly=True), 32])
    assert good.released == 1


def test_pack_refuses_protocol_objects_without_a_stream(kernel):
    x = CudaTensor(0x1000, (32,))
    with pytest.raises(ArgumentNeedsStreamError) as info:
        kernel.pack([x, 0x2000, 32])
    err = info.value
    assert isinstance(err, KernelArgumentTypeError) and isinstance(err, TypeError)
    assert "parameter x (const float*)" in str(err) and "Kernel.launch(stream" in str(err)
    assert "device_view(obj" in str(err)
    assert x.calls == []
    packed = kernel.pack([ExternalArray(ptr=0x1000, nbytes=128, device=0, shape=(32,),
                                        strides=(4,), dtype=np.dtype(np.float32), itemsize=4,
                                        readonly=False, obj=None, keepalive=None,
                                        protocol="dlpack", ordering=""), 0x2000, 32])
    assert packed.values() == (0x1000, 0x2000, 32)


def test_pointee_dtypes():
    from orchestra.kernel.module import pointee_dtype

    assert pointee_dtype("const float*") == np.float32
    assert pointee_dtype("double*") == np.float64
    assert pointee_dtype("unsigned int*") == np.uint32
    assert pointee_dtype("bool*") == np.bool_
    for any_dtype in ("void*", "const void*", "char*", "unsigned char*", "uint8_t*", "float**",
                      "__half*", "float4*"):
        assert pointee_dtype(any_dtype) is None, any_dtype


def test_scalars_never_evaluate_a_protocol_property():
    from orchestra.compiler.args import ArgLayout

    class Touchy:
        @property
        def __cuda_array_interface__(self):
            raise AssertionError("evaluated")

    layout = ArgLayout(normalize_params(("int n",)))
    with pytest.raises(KernelArgumentTypeError, match="got a buffer"):
        layout.pack([Touchy()])

"""Device and host memory of other libraries in: DLPack and the CUDA Array Interface, checked and
ordered before orchestra uses it.

`device_view(obj, stream=...)` takes anything with ``__dlpack__`` / ``__dlpack_device__`` (torch
CUDA tensors, CuPy arrays, cuda.core buffers and views, JAX arrays) or
``__cuda_array_interface__`` v2 / v3 (CuPy, numba, torch), and orchestra's own `DeviceBuffer` /
`BufferView`, and returns an `ExternalArray`: address, size, device, shape, strides, dtype,
read-only flag, the object that keeps the memory alive, and what was done to order it. It checks,
before orchestra enqueues anything, the device, the layout (C-contiguous by default; a strided
view is refused with a message that says how to make it contiguous), the dtype, the size and, for
memory orchestra writes, that it is writable.

Ordering against the producer's stream (the rule of each protocol):

* **DLPack**: orchestra passes its stream to ``__dlpack__(stream=...)``; the producer makes the
  data safe to use on that stream (torch and CuPy record an event on their current stream and
  make ours wait on it). This is the path taken whenever an object has both protocols: for
  torch, whose ``__cuda_array_interface__`` is version 2 without a stream, it is the only path
  that orders at all.
* **CUDA Array Interface v3 with a ``stream``**: orchestra records an event on that stream and
  makes its own stream wait on it (``cuEventRecord`` + ``cuStreamWaitEvent``). Stream 1 and 2
  mean the legacy and the per-thread default streams: recording there only orders, orchestra
  still never enqueues work on them.
* **CUDA Array Interface v2, or ``stream: None``**: the protocol says the producer has finished
  its work on the data (it synchronized); nothing is waited for. Make sure it did.

`ExternalArray.keepalive` keeps the producer's memory alive (the consumed DLPack capsule, whose
deleter runs on `ExternalArray.release` or when the record is collected; the object itself for
the CUDA Array Interface; a `Lease` on an orchestra buffer). Whoever enqueues work on the memory
holds the record until that work has completed.

`host_view(obj)` turns host memory of other libraries (pinned torch CPU tensors, anything with
``__dlpack__`` on the host, ``__array_interface__`` or the buffer protocol) into a numpy view that
shares the memory, for the host-binding checks (which also check it is pinned).

Why not cuda.core's ``StridedMemoryView.from_any_interface``? It was considered first: it
implements both consumer sides. Measured with cuda-core 1.2.2: it refuses CUDA Array Interface v2
(``BufferError: only CUDA Array Interface v3 or above is supported``), which the protocol allows
and torch exports; its CUDA Array Interface path asks the driver for the pointer's device through
its own bindings, outside orchestra's checked calls, so it cannot run on the CPU test fakes and
its failures are not orchestra errors; it creates and destroys events outside orchestra's handle
accounting; its errors (``BufferError``, ``RuntimeError``, ``AssertionError``) say nothing about
what to change; and ``import cuda.core.utils`` costs 0.2-0.7 s. What is left to write is small:
the DLPack ABI (four C structs, `orchestra.driver.dlpack`, also needed for orchestra's own exports)
and a dict reader; both are tested on the CPU with numpy's own capsules and stand-in objects.
"""

from __future__ import annotations

import math
import operator

import numpy as np
from cuda.bindings import driver

from orchestra.driver import dlpack as _dl
from orchestra.driver.check import cu
from orchestra.driver.device import as_device
from orchestra.driver.event import Event
from orchestra.driver.export import BufferView
from orchestra.driver.memory import DeviceBuffer
from orchestra.driver.stream import DefaultStream, as_stream
from orchestra.errors import CudaError, InteropTypeError, InteropValueError

__all__ = ["ExternalArray", "device_view", "host_view", "has_device_protocol",
           "has_host_protocol"]

_HOST_TYPES = (_dl.DLDeviceType.kDLCPU, _dl.DLDeviceType.kDLCUDAHost,
               _dl.DLDeviceType.kDLROCMHost)
_NUMERIC_KINDS = "biufc"


class ExternalArray:
    """Device memory of another library (or orchestra's), checked and ordered by `device_view`.

    Attributes:
        ptr: the device address of the first element (int).
        nbytes: ``prod(shape) * itemsize``.
        device: the device ordinal.
        shape: tuple of ints (elements).
        strides: tuple of ints, in **bytes** (as numpy and the CUDA Array Interface count them;
            DLPack's element strides are converted).
        dtype: a numpy dtype; a name (``"bfloat16"``, ``"float8_e4m3fn"``...) for types numpy
            lacks; None for untyped orchestra memory (a `DeviceBuffer`: bytes).
        itemsize: bytes per element.
        readonly: True when the producer marked the memory read-only.
        obj: the object that was passed in.
        keepalive: what keeps the memory alive: a consumed DLPack capsule's holder, a 1-tuple
            holding the object (CUDA Array Interface), or a `Lease` (orchestra buffers).
        protocol: ``"dlpack"``, ``"cuda_array_interface"`` or ``"orchestra"``.
        ordering: what was done to order the producer's work before the consumer stream, in
            words (``"dlpack: producer ordered before stream 0x..."``, ``"event: ..."``,
            ``"none: ..."``).

    It has ``.ptr`` and ``.nbytes``, so it binds wherever a `DeviceBuffer` does. Hold it until
    the work that uses the memory has completed; then `release` it (or drop it).

    Thread-safety: may be shared between threads: its fields are set once, and `release` may be
    called from several threads (what it lets go of, a DLPack holder under its own lock or a
    `Lease`, releases once).
    """

    __slots__ = ("ptr", "nbytes", "device", "shape", "strides", "dtype", "itemsize",
                 "readonly", "obj", "keepalive", "protocol", "ordering", "__weakref__")

    def __init__(self, *, ptr, nbytes, device, shape, strides, dtype, itemsize, readonly, obj,
                 keepalive, protocol, ordering):
        self.ptr, self.nbytes, self.device = ptr, nbytes, device
        self.shape, self.strides, self.dtype, self.itemsize = shape, strides, dtype, itemsize
        self.readonly, self.obj, self.keepalive = readonly, obj, keepalive
        self.protocol, self.ordering = protocol, ordering

    @property
    def released(self) -> bool:
        return self.keepalive is None

    def release(self) -> None:
        """Let go of the producer's memory now (a DLPack capsule's deleter runs, a lease ends).
        Only once the work that uses it has completed. Idempotent."""
        keep, self.keepalive = self.keepalive, None
        self.obj = None
        release = getattr(keep, "release", None)
        if release is not None:
            release()

    def __enter__(self) -> "ExternalArray":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        dtype = "bytes" if self.dtype is None else str(self.dtype)
        return (f"<ExternalArray {self.protocol} {dtype}{list(self.shape)} at 0x{self.ptr:x} "
                f"on device {self.device}, {self.nbytes} bytes"
                f"{', read-only' if self.readonly else ''}; {self.ordering}>")


def _has(obj, name: str) -> bool:
    return hasattr(type(obj), name) or name in getattr(obj, "__dict__", ())


def has_device_protocol(obj) -> bool:
    """True when ``obj`` speaks DLPack (``__dlpack__`` and ``__dlpack_device__``) or the CUDA
    Array Interface: something `device_view` may read (it still checks where the memory is).
    Looks the attributes up on the type: a property is not evaluated."""
    return (_has(obj, "__dlpack__") and _has(obj, "__dlpack_device__")) \
        or _has(obj, "__cuda_array_interface__")


def has_host_protocol(obj) -> bool:
    """True when `host_view` could read ``obj`` (DLPack, ``__array_interface__``, buffer
    protocol)."""
    if isinstance(obj, np.ndarray):
        return True
    if _has(obj, "__dlpack__") or _has(obj, "__array_interface__"):
        return True
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def _describe(obj) -> str:
    t = type(obj)
    mod = t.__module__ or ""
    return t.__name__ if mod in ("builtins", "") else f"{mod.split('.')[0]}.{t.__name__}"


def _ordinal(device) -> int | None:
    if device is None:
        return None
    ordinal = getattr(device, "ordinal", None)
    if ordinal is not None:
        return int(ordinal)
    try:
        return operator.index(device)
    except TypeError:
        raise InteropTypeError(
            f"device must be a Device, an ordinal or None, got {_describe(device)}") from None


def _normalize_dtype(dtype, what: str):
    if dtype is None or isinstance(dtype, str) and (dtype == "bfloat16" or
                                                   dtype in _dl._FLOAT8.values()):
        return dtype
    try:
        return np.dtype(dtype)
    except TypeError:
        raise InteropTypeError(f"{what}: {dtype!r} is not a dtype") from None


def _same_dtype(a, b) -> bool:
    if type(a) is type(b):  # two numpy dtypes (the common case: a cheap comparison) or names
        return a == b
    return (a if isinstance(a, str) else a.name) == (b if isinstance(b, str) else b.name)


def _c_strides(shape, itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


def _is_c_contiguous(shape, strides, itemsize: int) -> bool:
    if strides is None or any(n == 0 for n in shape):
        return True
    step = itemsize
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != step:  # a size-1 dimension's stride is never used
            return False
        step *= n
    return True


def _is_dense(shape, strides, itemsize: int) -> bool:
    """Every byte of the extent is an element exactly once, in any dimension order."""
    if _is_c_contiguous(shape, strides, itemsize):
        return True
    dims = sorted((st, n) for n, st in zip(shape, strides) if n != 1)
    step = itemsize
    for st, n in dims:
        if st != step:
            return False
        step *= n
    return True


def _strided_message(what: str, rec: ExternalArray, strides_unit: str, given) -> str:
    return (f"{what} is strided (shape {rec.shape}, strides {given} {strides_unit}, "
            f"{rec.dtype}): orchestra needs contiguous memory; make a contiguous copy first "
            "(torch: t.contiguous(); CuPy: cupy.ascontiguousarray(a))"
            + ("" if rec.protocol == "orchestra" else
               ", or pass layout=\"dense\" where any dense dimension order will do"))


def device_view(obj, *, stream=None, device=None, nbytes: int | None = None, dtype=None,
                writable: bool = False, layout: str = "C", what: str | None = None
                ) -> ExternalArray:
    """Read ``obj``'s device memory through DLPack or the CUDA Array Interface, check it, and
    order its producer's work before ``stream``.

    Args:
        obj: anything with ``__dlpack__`` / ``__dlpack_device__`` (preferred when both are
            present) or ``__cuda_array_interface__`` (v2 or v3), a `DeviceBuffer`, a
            `BufferView` or an `ExternalArray` (checked again, not ordered again).
        stream: the stream orchestra will use the memory on: an orchestra `Stream`, a
            `DefaultStream`, or anything `Stream.from_handle` wraps (torch / CuPy / cuda.core
            streams). None: nothing is ordered (the DLPack producer is passed ``stream=-1``, a
            CUDA Array Interface stream is not waited for): the caller has ordered or
            synchronized the producer.
        device: the device (or ordinal) the memory must be on; default: ``stream``'s device,
            else device 0.
        nbytes: the least size in bytes the caller needs (None: any).
        dtype: the dtype the caller needs (numpy dtype, name, or None for any); untyped
            orchestra buffers match every dtype.
        writable: True when orchestra writes the memory: read-only memory is refused.
        layout: ``"C"`` (C-contiguous; the default) or ``"dense"`` (contiguous in any dimension
            order, e.g. a transposed tensor: the bytes are all there, their order is the
            caller's business).
        what: how error messages name the object (default: its type).

    Returns an `ExternalArray`; hold it until the work using the memory has completed.

    Raises, before orchestra enqueues anything (the DLPack producer may already have enqueued
    its wait on ``stream``, which is harmless):
    `InteropTypeError` when ``obj`` speaks neither protocol, for an unsupported dtype (vector,
    sub-byte, structured, object, non-native byte order) or one other than ``dtype``;
    `InteropValueError` for memory on another device or on the host (the message says to copy
    it or to use `host_view`), a strided layout (says ``.contiguous()`` /
    ``cupy.ascontiguousarray``), fewer than ``nbytes`` bytes, read-only memory when
    ``writable``, a malformed ``__cuda_array_interface__`` (stream 0, a mask, an unknown
    version), a producer that refused to export; `DriverArgumentValueError` when ``stream``
    cannot take ordering; `CudaError` from the driver.

    Driver calls: ``cuPointerGetAttribute`` (CUDA Array Interface: memory type and device of
    the pointer), ``cuEventCreate`` / ``cuEventRecord`` / ``cuStreamWaitEvent`` /
    ``cuEventDestroy`` (CUDA Array Interface with a stream). Thread-safe.
    """
    what = what or f"the {_describe(obj)}"
    if layout not in ("C", "dense"):
        raise InteropValueError(f"layout must be \"C\" or \"dense\", got {layout!r}")
    need_dtype = _normalize_dtype(dtype, what)
    consumer = None if stream is None else as_stream(stream, device)
    want = _ordinal(device)
    if want is None:
        want = consumer.device.ordinal if consumer is not None else 0
    if isinstance(obj, ExternalArray):
        if obj.released:
            raise InteropValueError(f"{what}: this ExternalArray was released")
        rec = ExternalArray(ptr=obj.ptr, nbytes=obj.nbytes, device=obj.device, shape=obj.shape,
                            strides=obj.strides, dtype=obj.dtype, itemsize=obj.itemsize,
                            readonly=obj.readonly, obj=obj, keepalive=(obj,),
                            protocol=obj.protocol, ordering=obj.ordering)
    elif isinstance(obj, (DeviceBuffer, BufferView)):
        rec = _from_orchestra(obj)
    elif _has(obj, "__dlpack__") and _has(obj, "__dlpack_device__"):
        rec = _from_dlpack(obj, consumer, what)
    elif _has(obj, "__cuda_array_interface__"):
        rec = _from_cai(obj, consumer, want, what, need_dtype, nbytes, writable, layout)
        return rec  # checked (and ordered) inside: the checks come before the ordering
    else:
        raise InteropTypeError(
            f"{what} is not device memory orchestra can read: pass an object with __dlpack__ "
            "(torch, CuPy, JAX, cuda.core) or __cuda_array_interface__ (CuPy, numba), a "
            "DeviceBuffer, or an int address")
    try:
        _check(rec, want, need_dtype, nbytes, writable, layout, what,
               strides_given=rec.strides, unit="bytes")
    except BaseException:
        rec.release()  # the capsule's deleter, a lease; nothing for a wrapped record
        raise
    return rec


def _from_orchestra(obj) -> ExternalArray:
    lease = (obj.buffer if isinstance(obj, BufferView) else obj).lease()
    ptr = int(lease.handle)
    if isinstance(obj, BufferView):
        shape, dtype, itemsize = obj.shape, obj.dtype, obj.itemsize
        readonly, nbytes = obj.readonly, obj.nbytes
    else:
        shape, dtype, itemsize, readonly, nbytes = (obj.nbytes,), None, 1, False, obj.nbytes
    return ExternalArray(ptr=ptr, nbytes=nbytes, device=obj.device.ordinal, shape=shape,
                         strides=_c_strides(shape, itemsize), dtype=dtype, itemsize=itemsize,
                         readonly=readonly, obj=obj, keepalive=lease, protocol="orchestra",
                         ordering="none: orchestra memory, ordered by the caller's streams")


def dlpack_stream_arg(consumer) -> int:
    """The ``stream=`` value DLPack expects for ``consumer``: the handle as an int, 1 for the
    legacy default stream, 2 for the per-thread one, -1 for no ordering (None)."""
    if consumer is None:
        return -1
    if isinstance(consumer, DefaultStream):
        return consumer.value
    return int(consumer.handle)


def _from_dlpack(obj, consumer, what: str) -> ExternalArray:
    try:
        dev_type, dev_id = obj.__dlpack_device__()
        dev_type, dev_id = int(dev_type), int(dev_id)
    except Exception as exc:  # noqa: BLE001 - whatever the producer raises is its refusal
        raise InteropValueError(f"{what}: __dlpack_device__() failed: {exc}") from exc
    if dev_type in _HOST_TYPES:
        raise InteropValueError(
            f"{what} is in host memory (DLPack device {_device_name(dev_type)}), where device "
            "memory is needed: copy it to the GPU first (torch: t.cuda(); CuPy: "
            "cupy.asarray(a)), or bind it as a host buffer (orchestra.driver.host_view)")
    if dev_type not in (_dl.DLDeviceType.kDLCUDA, _dl.DLDeviceType.kDLCUDAManaged):
        raise InteropValueError(
            f"{what} is on a {_device_name(dev_type)} device; orchestra reads CUDA device "
            "memory (kDLCUDA) and managed memory (kDLCUDAManaged)")
    stream_arg = dlpack_stream_arg(consumer)
    try:
        try:
            capsule = obj.__dlpack__(stream=stream_arg,
                                     max_version=(_dl.DLPACK_MAJOR, _dl.DLPACK_MINOR))
        except TypeError:  # a producer from before DLPack 1.0 takes no max_version
            capsule = obj.__dlpack__(stream=stream_arg)
    except Exception as exc:  # noqa: BLE001 - the producer's refusal, whatever its class
        raise InteropValueError(
            f"{what}: its __dlpack__(stream={stream_arg}) refused to export: "
            f"{type(exc).__name__}: {exc}") from exc
    info = _dl.consume(capsule, what)
    if info.device[0] != dev_type:
        info.holder.release()
        raise InteropValueError(
            f"{what}: its capsule says DLPack device {_device_name(info.device[0])}, its "
            f"__dlpack_device__() says {_device_name(dev_type)}: the producer is inconsistent")
    strides = info.strides
    shape = info.shape
    strides_b = (_c_strides(shape, info.itemsize) if strides is None
                 else tuple(s * info.itemsize for s in strides))
    managed = dev_type == _dl.DLDeviceType.kDLCUDAManaged
    if consumer is None:
        ordering = "none: no stream given, the producer was asked for no ordering (stream=-1)"
    else:
        ordering = f"dlpack: the producer ordered its work before stream {stream_arg:#x}"
    rec = ExternalArray(
        ptr=info.ptr, nbytes=math.prod(shape) * info.itemsize,
        device=None if managed else info.device[1], shape=shape, strides=strides_b,
        dtype=info.dtype, itemsize=info.itemsize, readonly=info.readonly, obj=obj,
        keepalive=info.holder, protocol="dlpack", ordering=ordering)
    return rec


def _device_name(dev_type: int) -> str:
    try:
        return _dl.DLDeviceType(dev_type).name
    except ValueError:
        return f"DLPack type {dev_type}"


def _check(rec: ExternalArray, want: int, dtype, nbytes, writable: bool, layout: str, what: str,
           *, strides_given, unit: str) -> None:
    if rec.device is not None and rec.device != want:
        raise InteropValueError(
            f"{what} is on device {rec.device}, but orchestra uses it on device {want}: move it "
            f"there first (torch: t.to('cuda:{want}'); CuPy: copy under "
            f"cupy.cuda.Device({want})), or use device {rec.device}'s streams")
    if rec.device is None:
        rec.device = want  # managed memory: usable on the device asked for
    if dtype is not None and rec.dtype is not None and not _same_dtype(rec.dtype, dtype):
        raise InteropTypeError(
            f"{what} has dtype {rec.dtype}, but {dtype} is needed: convert it first (torch: "
            f"t.to(torch.{dtype}); CuPy / numpy: a.astype('{dtype}'))")
    ok = (_is_c_contiguous if layout == "C" else _is_dense)(rec.shape, rec.strides,
                                                           rec.itemsize)
    if not ok:
        raise InteropValueError(_strided_message(what, rec, unit, strides_given))
    if nbytes is not None and rec.nbytes < nbytes:
        raise InteropValueError(
            f"{what} is too small: it has {rec.nbytes} bytes (shape {rec.shape}, {rec.dtype}), "
            f"but at least {nbytes} bytes are needed")
    if writable and rec.readonly:
        how = {"dlpack": "the DLPack read-only flag",
               "cuda_array_interface": "the interface's data[1]"}.get(rec.protocol, "read-only")
        raise InteropValueError(
            f"{what} is read-only ({how}), but orchestra writes it: pass writable memory (e.g. "
            "a copy), or declare the kernel parameter const if the kernel only reads it")


# -- the CUDA Array Interface ------------------------------------------------------------------


def _cai_dtype(cai: dict, what: str):
    typestr = cai.get("typestr")
    if not isinstance(typestr, str):
        raise InteropValueError(f"{what}: __cuda_array_interface__ has no typestr string")
    try:
        dt = np.dtype(typestr)
    except TypeError:
        raise InteropTypeError(f"{what}: typestr {typestr!r} is not a dtype") from None
    descr = cai.get("descr")
    if descr is not None:
        fields = [tuple(f) for f in descr]
        if len(fields) != 1 or fields[0][0] != "" or np.dtype(fields[0][1]) != dt:
            raise InteropTypeError(
                f"{what}: a structured dtype (descr {descr!r}) is not supported; pass an array "
                "of a numeric dtype")
    if dt.kind not in _NUMERIC_KINDS:
        raise InteropTypeError(
            f"{what}: unsupported dtype {typestr!r}; orchestra reads bool, int, uint, float and "
            "complex arrays")
    if not dt.isnative:
        raise InteropTypeError(
            f"{what}: dtype {typestr!r} is not in the machine's byte order; convert it first")
    return dt


def cuda_array_interface(obj, what: str) -> dict:
    """``obj.__cuda_array_interface__``, read once; producer failures become
    `InteropValueError`."""
    try:
        cai = obj.__cuda_array_interface__
    except Exception as exc:  # noqa: BLE001 - e.g. torch refuses tensors that require grad
        raise InteropValueError(
            f"{what}: reading __cuda_array_interface__ failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(cai, dict):
        raise InteropValueError(
            f"{what}: __cuda_array_interface__ is {_describe(cai)}, not a dict")
    return cai


def _from_cai(obj, consumer, want: int, what: str, need_dtype, nbytes, writable,
              layout) -> ExternalArray:
    cai = cuda_array_interface(obj, what)
    version = cai.get("version")
    if type(version) is not int or version < 0:
        raise InteropValueError(
            f"{what}: __cuda_array_interface__ version {version!r} is not a known version "
            "(orchestra reads 0 to 3)")
    try:
        shape = tuple(operator.index(n) for n in cai["shape"])
        ptr, readonly = cai["data"]
        ptr = operator.index(ptr)
    except (KeyError, TypeError, ValueError):
        raise InteropValueError(
            f"{what}: __cuda_array_interface__ needs 'shape' (ints) and 'data' "
            "((address, read_only)); got " + repr({k: cai.get(k) for k in ('shape', 'data')})
        ) from None
    if cai.get("mask") is not None:
        raise InteropValueError(f"{what}: masked arrays (a 'mask' in the interface) are not "
                                "supported; pass the data without a mask")
    if any(n < 0 for n in shape):
        raise InteropValueError(f"{what}: negative extent in shape {shape}")
    dt = _cai_dtype(cai, what)
    strides = cai.get("strides")
    if strides is not None:
        try:
            strides = tuple(operator.index(s) for s in strides)
        except TypeError:
            raise InteropValueError(f"{what}: strides {strides!r} are not ints") from None
        if len(strides) != len(shape):
            raise InteropValueError(f"{what}: {len(strides)} strides for {len(shape)} "
                                    "dimensions")
    total = math.prod(shape) * dt.itemsize
    stream_value = cai.get("stream") if version >= 3 else None
    if stream_value is not None:
        if type(stream_value) is not int:
            raise InteropValueError(f"{what}: the interface's stream {stream_value!r} is not "
                                    "an int")
        if stream_value == 0:
            raise InteropValueError(
                f"{what}: the interface's stream is 0, which the CUDA Array Interface "
                "disallows (ambiguous): the producer must give 1 for the legacy default "
                "stream, 2 for the per-thread default stream, or None when it synchronized")
    if total and not ptr:
        raise InteropValueError(f"{what}: a null data pointer for {total} bytes")
    device = _pointer_device(ptr, want, what) if total else want
    rec = ExternalArray(
        ptr=ptr, nbytes=total, device=device, shape=shape,
        strides=_c_strides(shape, dt.itemsize) if strides is None else strides, dtype=dt,
        itemsize=dt.itemsize, readonly=bool(readonly), obj=obj, keepalive=(obj,),
        protocol="cuda_array_interface", ordering="")  # a tuple: the object's own .release()
                                                       # (if it has one) is never called
    _check(rec, want, need_dtype, nbytes, writable, layout, what,
           strides_given=rec.strides, unit="bytes")
    if stream_value is None:
        rec.ordering = ("none: the CUDA Array Interface gave no stream "
                        f"(version {version}): by the protocol the producer has synchronized")
    elif consumer is None:
        rec.ordering = (f"none: no stream given; the producer's stream {stream_value:#x} was "
                        "not waited for")
    else:
        rec.ordering = _order_raw(stream_value, consumer)
    return rec


def _pointer_device(ptr: int, want: int, what: str) -> int:
    """The device ordinal of device memory at ``ptr`` (``cuPointerGetAttribute``)."""
    dev = as_device(want)
    dev.make_current()  # pointer queries need a current (UVA) context
    A = driver.CUpointer_attribute
    try:
        kind = int(cu(driver.cuPointerGetAttribute, A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr))
    except CudaError as err:
        if err.name == "CUDA_ERROR_INVALID_VALUE":
            raise InteropValueError(
                f"{what}: address {ptr:#x} is not CUDA memory the driver knows (pageable host "
                "memory, or freed)") from None
        raise
    if kind == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST):
        raise InteropValueError(
            f"{what}: address {ptr:#x} is page-locked host memory, where device memory is "
            "needed: copy it to the GPU first, or bind it as a host buffer "
            "(orchestra.driver.host_view)")
    return int(cu(driver.cuPointerGetAttribute, A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr))


def _order_raw(value: int, consumer) -> str:
    """Make ``consumer`` wait for the work on the producer's stream ``value`` (a CUDA Array
    Interface stream: 1 / 2 are the default streams); returns what was done, in words."""
    mine = consumer.value if isinstance(consumer, DefaultStream) else int(consumer.handle)
    if value == mine:
        return f"none: the producer's stream {value:#x} is the consumer's stream"
    dev = consumer.device
    dev.make_current()
    ev = Event(dev)
    try:
        cu(driver.cuEventRecord, ev.handle, driver.CUstream(value))
        consumer.wait(ev)
    finally:
        ev.close()
    name = {1: "the legacy default stream", 2: "the per-thread default stream"}.get(
        value, f"stream {value:#x}")
    return f"event: stream {mine:#x} waits for {name}"


# -- host memory -------------------------------------------------------------------------------


def host_view(obj, *, what: str | None = None) -> np.ndarray:
    """A numpy array sharing ``obj``'s host memory, for host bindings and copies.

    ``obj``: a numpy array (returned as is), a `PinnedBuffer` / `HostRegistration` (their
    ``.array``), an object with ``__dlpack__`` on the host (pinned torch CPU tensors: DLPack
    kDLCPU / kDLCUDAHost; the array's ``.base`` keeps the consumed tensor, whose deleter runs
    when the array is collected), ``__array_interface__``, or the buffer protocol.

    Nothing is copied, and pinning is not checked here: the host-binding checks and
    `DeviceBuffer.copy_*` refuse pageable memory (``PageableMemoryError``; pin a torch tensor
    with ``t.pin_memory()``). Raises `InteropValueError` for device memory (use `device_view`)
    or a producer that refused, `InteropTypeError` for an object that speaks no host protocol.
    """
    from orchestra.driver.host import HostRegistration, PinnedBuffer

    what = what or f"the {_describe(obj)}"
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, PinnedBuffer):
        return obj.array
    if isinstance(obj, HostRegistration):
        obj.ptr  # noqa: B018 - ResourceClosedError once unregistered
        return obj.array
    if _has(obj, "__dlpack__") and _has(obj, "__dlpack_device__"):
        try:
            dev_type = int(obj.__dlpack_device__()[0])
        except Exception as exc:  # noqa: BLE001
            raise InteropValueError(f"{what}: __dlpack_device__() failed: {exc}") from exc
        if dev_type not in _HOST_TYPES + (_dl.DLDeviceType.kDLCUDAManaged,):
            raise InteropValueError(
                f"{what} is device memory (DLPack {_device_name(dev_type)}), where host memory "
                "is needed: bind it as an external device buffer (device_view), or copy it to "
                "the host first")
        return _host_from_dlpack(obj, what)
    if _has(obj, "__cuda_array_interface__"):
        raise InteropValueError(
            f"{what} is device memory (CUDA Array Interface), where host memory is needed: "
            "bind it as an external device buffer (device_view), or copy it to the host first")
    if _has(obj, "__array_interface__"):
        return _asarray(obj, what, "__array_interface__")
    try:
        view = memoryview(obj)
    except TypeError:
        raise InteropTypeError(
            f"{what} is not host memory orchestra can read: pass a numpy array, a PinnedBuffer, "
            "a pinned torch CPU tensor, or an object with __dlpack__, __array_interface__ or "
            "the buffer protocol") from None
    return _asarray(view, what, "buffer")


def _asarray(obj, what: str, protocol: str) -> np.ndarray:
    # numpy reads the producer's description; a malformed one (a missing typestr, a bad
    # shape) raises numpy's ValueError / TypeError / KeyError, which becomes ours so that
    # callers see one error family naming the object
    try:
        return np.asarray(obj)
    except Exception as exc:  # noqa: BLE001 - whatever the producer's description raised
        raise InteropValueError(f"{what}: numpy cannot read its {protocol} description: "
                                f"{type(exc).__name__}: {exc}") from exc


class _HostTensor:
    """The ``.base`` of a `host_view` array read through DLPack: describes the memory to numpy
    (``__array_interface__``) and keeps the consumed tensor (its `DLPackHolder`) alive."""

    __slots__ = ("__array_interface__", "holder", "obj")

    def __init__(self, interface: dict, holder, obj):
        self.__array_interface__ = interface
        self.holder, self.obj = holder, obj


def _host_from_dlpack(obj, what: str) -> np.ndarray:
    try:
        try:
            capsule = obj.__dlpack__(stream=None,
                                     max_version=(_dl.DLPACK_MAJOR, _dl.DLPACK_MINOR))
        except TypeError:  # a producer from before DLPack 1.0
            capsule = obj.__dlpack__(stream=None)
    except Exception as exc:  # noqa: BLE001 - the producer's refusal, whatever its class
        raise InteropValueError(
            f"{what}: its __dlpack__() refused to export: {type(exc).__name__}: {exc}") from exc
    info = _dl.consume(capsule, what)
    try:
        if info.device[0] not in _HOST_TYPES + (_dl.DLDeviceType.kDLCUDAManaged,):
            raise InteropValueError(
                f"{what}: its capsule is on DLPack device {_device_name(info.device[0])}, not "
                "in host memory")
        if isinstance(info.dtype, str):
            raise InteropTypeError(
                f"{what}: numpy has no {info.dtype} dtype; view the tensor as an integer dtype "
                "of the same size first (torch: t.view(torch.int16))")
        shape = info.shape
        strides = None if info.strides is None else tuple(
            st * info.itemsize for st in info.strides)
        if math.prod(shape) == 0:
            info.holder.release()
            return np.empty(shape, info.dtype)
        interface = {"version": 3, "shape": shape, "typestr": info.dtype.str,
                     "data": (info.ptr, info.readonly), "strides": strides}
        return np.asarray(_HostTensor(interface, info.holder, obj))
    except BaseException:
        info.holder.release()
        raise


__all__ += ["dlpack_stream_arg", "cuda_array_interface"]

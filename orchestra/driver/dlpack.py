"""The DLPack ABI in ctypes: read a producer's capsule, make capsules for orchestra's exports.

DLPack (dmlc/dlpack, ``dlpack.h``; the Python protocol is the Array API standard's
``__dlpack__`` / ``__dlpack_device__``) hands a tensor over as a ``PyCapsule`` holding a
``DLManagedTensorVersioned`` (name ``"dltensor_versioned"``, DLPack >= 1.0) or a legacy
``DLManagedTensor`` (``"dltensor"``). The consumer renames the capsule to ``"used_..."`` and from
then on owns the tensor: it must call the tensor's ``deleter`` exactly once when it is done. A
capsule that is never consumed is cleaned up by the producer's capsule destructor.

No CUDA here (plain ctypes over the C structs), so everything is testable on a CPU with numpy's
own ``__dlpack__`` (kDLCPU) and with the capsules `make_capsule` produces for any device.

* `consume(capsule) -> DLTensorInfo`: the tensor's fields and a `DLPackHolder` that calls the
  deleter once (``release()``, or when the holder is garbage-collected).
* `make_capsule(...)`: a new capsule over memory orchestra exports; ``on_release`` runs once when
  the consumer calls the deleter, or when an unconsumed capsule is collected.

Thread-safety: consuming and releasing take the GIL (ctypes calls into ``pythonapi`` keep it);
deleters of foreign producers are called with the GIL released (a producer that needs it, like
numpy or CuPy, takes it itself). Our own deleter is a ctypes callback, which takes the GIL on
whatever thread the consumer calls it from.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
from typing import Any

from orchestra.errors import InteropTypeError, InteropValueError


class DLDeviceType(enum.IntEnum):
    """``DLDeviceType`` values (``dlpack.h``) orchestra meets."""

    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3  # page-locked host memory
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14


DLPACK_MAJOR = 1  # the ABI version this module reads and writes
DLPACK_MINOR = 0
READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
IS_COPIED = 1 << 1  # DLPACK_FLAG_BITMASK_IS_COPIED

# DLDataTypeCode
kDLInt, kDLUInt, kDLFloat, kDLOpaqueHandle, kDLBfloat, kDLComplex, kDLBool = range(7)
_FLOAT8 = {7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
           11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu"}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # elements; NULL = C-contiguous (< 1.2)
        ("byte_offset", ctypes.c_uint64),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*deleter)(DLManagedTensor*)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


# Capsule names. PyCapsule keeps the name *pointer*, so these bytes objects must live as long as
# any capsule named with them: module constants do.
_VERSIONED = b"dltensor_versioned"
_USED_VERSIONED = b"used_dltensor_versioned"
_LEGACY = b"dltensor"
_USED_LEGACY = b"used_dltensor"

_api = ctypes.pythonapi
# Calls on a live capsule (the caller holds a reference).
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api))
_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api))
# The same calls on a capsule being deallocated: taken as a bare address, so that no reference
# is created to an object whose reference count already reached zero.
_is_valid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api))
_get_pointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api))
_err_clear = ctypes.PYFUNCTYPE(None)(("PyErr_Clear", _api))


def dtype_from_dl(code: int, bits: int, lanes: int, what: str):
    """``(dtype, itemsize)`` for a DLPack ``DLDataType``: a numpy dtype where numpy has one, else
    a name (``"bfloat16"``, ``"float8_e4m3fn"``...). `InteropTypeError` for vector types
    (lanes != 1), sub-byte types, opaque handles and codes orchestra does not know."""
    import numpy as np

    if lanes != 1:
        raise InteropTypeError(
            f"{what}: a vector dtype (DLPack lanes={lanes}) is not supported; pass an array of "
            "scalars (e.g. view float4 data as float32 with 4x the length)")
    if bits % 8 or bits == 0:
        raise InteropTypeError(
            f"{what}: a {bits}-bit dtype (DLPack code {code}) is not supported: orchestra "
            "handles whole-byte element types only")
    size = bits // 8
    if code in (kDLInt, kDLUInt) and size in (1, 2, 4, 8):
        return np.dtype(f"{'i' if code == kDLInt else 'u'}{size}"), size
    if code == kDLFloat and size in (2, 4, 8):
        return np.dtype(f"f{size}"), size
    if code == kDLComplex and size in (8, 16):
        return np.dtype(f"c{size}"), size
    if code == kDLBool and size == 1:
        return np.dtype(np.bool_), 1
    if code == kDLBfloat and size == 2:
        return "bfloat16", 2
    if code in _FLOAT8 and size == 1:
        return _FLOAT8[code], 1
    raise InteropTypeError(
        f"{what}: unsupported dtype (DLPack code {code}, {bits} bits); orchestra reads ints, "
        "uints, floats (16/32/64), complex, bool, bfloat16 and the float8 types")


def dl_from_dtype(dtype, what: str) -> tuple[int, int]:
    """``(code, bits)`` of the DLPack ``DLDataType`` for ``dtype`` (numpy dtype or one of the
    names `dtype_from_dl` returns); `InteropTypeError` for what DLPack cannot describe."""
    import numpy as np

    if isinstance(dtype, str):
        if dtype == "bfloat16":
            return kDLBfloat, 16
        for code, name in _FLOAT8.items():
            if name == dtype:
                return code, 8
    if not isinstance(dtype, np.dtype):
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise InteropTypeError(f"{what}: {dtype!r} is not a dtype") from None
    kind = dtype.kind
    codes = {"i": kDLInt, "u": kDLUInt, "f": kDLFloat, "c": kDLComplex, "b": kDLBool}
    if kind in codes and dtype.fields is None and dtype.subdtype is None:
        return codes[kind], dtype.itemsize * 8
    if dtype.name in ("bfloat16",) or dtype.name in _FLOAT8.values():  # ml_dtypes' types
        return dl_from_dtype(dtype.name, what)
    raise InteropTypeError(f"{what}: dtype {dtype} cannot be described in DLPack; export a "
                           "view as a numeric dtype (e.g. uint8 bytes)")


class DLPackHolder:
    """Owns a consumed DLPack tensor: keeps the capsule and calls the producer's deleter once,
    on `release()` or when this holder is garbage-collected. Thread-safe."""

    __slots__ = ("_capsule", "_managed", "_deleter", "_lock", "__weakref__")

    def __init__(self, capsule, managed: int, deleter):
        self._capsule = capsule
        self._managed: int | None = managed
        self._deleter = deleter
        self._lock = threading.Lock()

    @property
    def released(self) -> bool:
        return self._managed is None

    def release(self) -> None:
        """Call the deleter (once): the producer may free or reuse the memory from now on."""
        with self._lock:
            managed, deleter = self._managed, self._deleter
            self._managed = self._deleter = None
            self._capsule = None
        if managed is not None and deleter:
            deleter(managed)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - nothing can be raised from a finalizer
            pass


class DLTensorInfo:
    """A consumed DLPack tensor: ``ptr`` (``data + byte_offset``), ``device`` ((type, id)),
    ``shape``, ``strides`` (elements, or None for C-contiguous), ``dtype`` / ``itemsize`` (see
    `dtype_from_dl`), ``readonly`` (the versioned READ_ONLY flag), ``version`` ((1, minor) or
    None for a legacy capsule), ``holder`` (`DLPackHolder`)."""

    __slots__ = ("ptr", "device", "shape", "strides", "dtype", "itemsize", "readonly",
                 "version", "holder")

    def __init__(self, *, ptr: int, device: tuple[int, int], shape: tuple[int, ...],
                 strides: tuple[int, ...] | None, dtype: Any, itemsize: int, readonly: bool,
                 version: tuple[int, int] | None, holder: DLPackHolder):
        self.ptr, self.device, self.shape, self.strides = ptr, device, shape, strides
        self.dtype, self.itemsize, self.readonly = dtype, itemsize, readonly
        self.version, self.holder = version, holder


def consume(capsule, what: str = "the object") -> DLTensorInfo:
    """Take ownership of a ``__dlpack__`` capsule (rename it ``used_...``) and read it.

    Raises `InteropTypeError` for something that is not an unconsumed DLPack capsule, an
    unsupported dtype; `InteropValueError` for a DLPack major version other than 1. On every
    error after the rename the deleter has been called already (nothing leaks).
    """
    mt: Any  # DLManagedTensorVersioned or DLManagedTensor: both have .dl_tensor
    if _is_valid(capsule, _VERSIONED):
        managed = _get_pointer(capsule, _VERSIONED)
        _set_name(capsule, _USED_VERSIONED)
        mt = DLManagedTensorVersioned.from_address(managed)
        holder = DLPackHolder(capsule, managed, mt.deleter)
        if mt.version.major != DLPACK_MAJOR:
            holder.release()  # dlpack.h: on a major mismatch only the deleter may be touched
            raise InteropValueError(
                f"{what}: DLPack version {mt.version.major}.{mt.version.minor} is not supported "
                f"(orchestra reads {DLPACK_MAJOR}.x)")
        version = (int(mt.version.major), int(mt.version.minor))
        readonly = bool(mt.flags & READ_ONLY)
    elif _is_valid(capsule, _LEGACY):
        managed = _get_pointer(capsule, _LEGACY)
        _set_name(capsule, _USED_LEGACY)
        mt = DLManagedTensor.from_address(managed)
        holder = DLPackHolder(capsule, managed, mt.deleter)
        version, readonly = None, False
    else:
        _err_clear()  # PyCapsule_IsValid sets no error, but a non-capsule may have
        raise InteropTypeError(
            f"{what}: __dlpack__() returned {type(capsule).__name__}, not an unconsumed DLPack "
            "capsule ('dltensor_versioned' or 'dltensor')")
    t = mt.dl_tensor
    try:
        ndim = int(t.ndim)
        if ndim < 0:
            raise InteropValueError(f"{what}: DLPack tensor with ndim {ndim}")
        shape = tuple(int(t.shape[i]) for i in range(ndim)) if ndim else ()
        strides = tuple(int(t.strides[i]) for i in range(ndim)) if ndim and t.strides else None
        dtype, itemsize = dtype_from_dl(t.dtype.code, t.dtype.bits, t.dtype.lanes, what)
    except BaseException:
        holder.release()
        raise
    return DLTensorInfo(ptr=(t.data or 0) + int(t.byte_offset),
                        device=(int(t.device.device_type), int(t.device.device_id)),
                        shape=shape, strides=strides, dtype=dtype, itemsize=itemsize,
                        readonly=readonly, version=version, holder=holder)


# -- the producer side -----------------------------------------------------------------------


class _Export:
    """The memory behind one exported tensor: the C struct, its shape/strides arrays, and the
    callback that ends the export. Kept in `_exports` until the deleter runs."""

    __slots__ = ("managed", "shape", "strides", "on_release", "key")

    def __init__(self, managed, shape, strides, on_release, key):
        self.managed, self.shape, self.strides = managed, shape, strides
        self.on_release, self.key = on_release, key


_exports: dict[int, _Export] = {}  # manager_ctx key -> export, while the consumer holds it
_keys = itertools.count(1)


def _end_export(key: int) -> None:
    export = _exports.pop(key, None)
    if export is not None and export.on_release is not None:
        export.on_release()


@_DELETER
def _deleter(managed):
    # Called by the consumer (any thread; the ctypes callback takes the GIL). manager_ctx holds
    # the key of our export; both struct layouts put it at a known place.
    try:
        key = _key_of(managed)
        _end_export(key)
    except Exception:  # noqa: BLE001 - an exception cannot cross into the consumer's C code
        pass


def _key_of(managed: int) -> int:
    """The key in ``manager_ctx`` of our export at address ``managed`` (-1 if it is not ours).

    The versioned struct keeps manager_ctx after its version, the legacy one after its DLTensor;
    both offsets lie inside either struct, and the address check tells which one it is."""
    for offset in (DLManagedTensorVersioned.manager_ctx.offset,
                   DLManagedTensor.manager_ctx.offset):
        key = ctypes.c_void_p.from_address(managed + offset).value
        export = _exports.get(key) if key is not None else None
        if key is not None and export is not None and \
                ctypes.addressof(export.managed) == managed:
            return key
    return -1


_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_DESTRUCTOR
def _capsule_destructor(capsule_address):
    # A capsule that was never consumed still has its original name: end the export. A consumed
    # one (renamed "used_...") belongs to its consumer, who calls the deleter.
    try:
        for name in (_VERSIONED, _LEGACY):
            if _is_valid_raw(capsule_address, name):
                managed = _get_pointer_raw(capsule_address, name)
                _end_export(_key_of(managed))
                return
        _err_clear()
    except Exception:  # noqa: BLE001 - nothing can be raised from a destructor
        pass


def make_capsule(ptr: int, shape, strides_elements, dtype, device: tuple[int, int], *,
                 readonly: bool = False, versioned: bool = True, on_release=None,
                 what: str = "export"):
    """A new DLPack capsule over ``ptr`` with ``shape`` and ``strides_elements`` (always given:
    DLPack >= 1.2 requires strides), ``dtype`` (numpy dtype or a `dtype_from_dl` name), on
    ``device`` ((`DLDeviceType`, id)). ``versioned`` picks ``DLManagedTensorVersioned`` (with the
    READ_ONLY flag when ``readonly``) over the legacy ``DLManagedTensor``. ``on_release`` (no
    arguments) runs once: when the consumer calls the deleter, or when the capsule is collected
    without having been consumed. `InteropTypeError` for a dtype DLPack cannot describe."""
    code, bits = dl_from_dtype(dtype, what)
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides_elements)
    tensor = DLTensor(data=ptr or None, device=DLDevice(int(device[0]), int(device[1])),
                      ndim=ndim, dtype=DLDataType(code, bits, 1),
                      shape=ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64)),
                      strides=ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64)),
                      byte_offset=0)
    key = next(_keys)
    managed: Any
    if versioned:
        managed = DLManagedTensorVersioned(
            version=DLPackVersion(DLPACK_MAJOR, DLPACK_MINOR), manager_ctx=key,
            deleter=_deleter, flags=READ_ONLY if readonly else 0, dl_tensor=tensor)
        name = _VERSIONED
    else:
        managed = DLManagedTensor(dl_tensor=tensor, manager_ctx=key, deleter=_deleter)
        name = _LEGACY
    _exports[key] = _Export(managed, shape_arr, strides_arr, on_release, key)
    try:
        return _new(ctypes.addressof(managed), name,
                    ctypes.cast(_capsule_destructor, ctypes.c_void_p))
    except BaseException:
        _exports.pop(key, None)
        raise


def exports_alive() -> int:
    """How many exported tensors their consumers still hold (tests read it)."""
    return len(_exports)

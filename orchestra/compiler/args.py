"""Kernel argument packing: a ctypes struct built once per signature, rewritten in place.

For a kernel's declared parameters (`Param`), `ArgLayout` makes a ``ctypes.Structure`` with one
field per parameter (ctypes gives each field its natural alignment, as the kernel's parameter
buffer has it) and a ``ctypes.c_void_p`` array whose element ``i`` holds the address of field
``i``: exactly the ``void** kernelParams`` that ``cuLaunchKernel``/``cuLaunchKernelEx`` take.
cuda-bindings accepts that argument as a plain int address and uses it as ``void**`` without
any conversion, so a prepacked `PackedArgs` costs nothing per launch.

`PackedArgs.set(i_or_name, value)` validates one value and rewrites only that field (graph
replay updates, changing a scalar between launches). The driver copies parameter values when
the launch call returns, so rewriting a field after ``launch`` returned never changes a launch
already enqueued.

Validation, before anything is enqueued, always naming the parameter:

* wrong number of arguments -> `KernelArgumentTypeError` showing the expected signature;
* an int that does not fit the declared width -> `KernelArgumentValueError` naming the range
  (``parameter n (int): 4294967296 does not fit in int32: pass an int from -2147483648 to
  2147483647``); an address or handle outside 64 bits likewise;
* a Python float (or numpy float) where an integer is declared -> `KernelArgumentTypeError`;
* ``bool`` is accepted only for ``bool`` parameters;
* a numpy scalar of another dtype than declared -> `KernelArgumentTypeError` (no silent casts);
* a buffer (anything with ``.ptr``, a numpy array) where a scalar belongs ->
  `KernelArgumentTypeError`;
* a pointer takes an int address, an object with ``.ptr`` (DeviceBuffer), a ``CUdeviceptr``
  or ``None`` (NULL) -- never a float or a numpy array (host memory) -> `KernelArgumentTypeError`;
  a DLPack / CUDA Array Interface object (a torch tensor, a CuPy array) needs a stream to be
  ordered on: `Kernel.launch` takes it, packing alone raises `ArgumentNeedsStreamError`.
* a conditional handle (``cudaGraphConditionalHandle``) takes a ``CUgraphConditionalHandle``
  (what ``cuGraphConditionalHandleCreate`` returns), its int value (64-bit unsigned) or
  ``None`` (0) -> `KernelArgumentTypeError` for anything else. Graph nodes pass a
  `orchestra.graph.Condition` instead; the executor packs its handle.

Floats: a Python float is packed as IEEE double for a ``double`` parameter (never narrowed) and
rounded to float32 for a ``float`` parameter (`KernelArgumentValueError` if finite but out of
float32 range, naming the range). NaN and +-inf pass as they are (numpy scalars of the declared
dtype too). An int given to a floating-point parameter must be exactly representable: one
beyond the type's range (``10**400``, where ``float()`` itself overflows) or between two of its
values is a `KernelArgumentValueError`, never a Python ``OverflowError``. Messages show a huge
int by its magnitude and bit length (``1.000e+400 (a 1329-bit int)``), never its digits. The two classes are
also ``TypeError`` / ``ValueError`` (orchestra.errors).
"""

from __future__ import annotations

import ctypes
import math
import operator
from collections.abc import Mapping

from orchestra.compiler.params import Param
from orchestra.errors import (
    ArgumentNeedsStreamError,
    KernelArgumentTypeError,
    KernelArgumentValueError,
    ParameterIndexError,
    UnknownParameterError,
    int_text,
)

_CTYPES = {
    "bool": ctypes.c_bool,
    "int8": ctypes.c_int8, "uint8": ctypes.c_uint8,
    "int16": ctypes.c_int16, "uint16": ctypes.c_uint16,
    "int32": ctypes.c_int32, "uint32": ctypes.c_uint32,
    "int64": ctypes.c_int64, "uint64": ctypes.c_uint64,
    "float32": ctypes.c_float, "float64": ctypes.c_double,
    "ptr": ctypes.c_uint64,
}
_INT_RANGE = {
    "int8": (-(1 << 7), (1 << 7) - 1), "uint8": (0, (1 << 8) - 1),
    "int16": (-(1 << 15), (1 << 15) - 1), "uint16": (0, (1 << 16) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1), "uint32": (0, (1 << 32) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1), "uint64": (0, (1 << 64) - 1),
}
# float32 overflow threshold under round-to-nearest: FLT_MAX + half an ulp.
_F32_OVERFLOW = (2.0 - 2.0 ** -24) * 2.0 ** 127
# The largest finite value of each floating-point parameter type, as messages show it.
_FLOAT_MAX = {"float32": "3.4028235e+38", "float64": "1.7976931348623157e+308"}
_U64 = (1 << 64) - 1
# Ints at or beyond DBL_MAX + half an ulp (2**1024 - 2**970) overflow float(): they round to
# 2**1024. Those below convert (to DBL_MAX at most).
_INT_TO_FLOAT = (1 << 1024) - (1 << 970)


def value_text(v) -> str:
    """``repr(v)``, bounded for ints (`int_text`): for messages about a value a user gave."""
    if isinstance(v, int) and not isinstance(v, bool) and not -10 ** 40 < v < 10 ** 40:
        return int_text(v) if type(v) is int else f"{type(v).__name__}({int_text(v)})"
    return repr(v)


def _np():
    import numpy

    return numpy


def _describe(v) -> str:
    t = type(v)
    mod = t.__module__
    name = t.__name__ if mod in ("builtins", None) else f"{mod.split('.')[0]}.{t.__name__}"
    if isinstance(v, (int, float, bool)):
        return f"{name} {value_text(v) if t is not bool else repr(v)}"
    return name


def speaks_device_protocol(v) -> bool:
    """True when ``v``'s type has ``__dlpack__`` or ``__cuda_array_interface__`` (looked up on
    the type, so a property such as torch's is not evaluated)."""
    t = type(v)
    return hasattr(t, "__dlpack__") or hasattr(t, "__cuda_array_interface__")


def _is_buffer(v) -> bool:
    if hasattr(v, "ptr"):
        return True
    np = _np()
    return isinstance(v, np.ndarray) or speaks_device_protocol(v)


def make_converter(p: Param):
    """The validating converter of one parameter: ``value -> value for the ctypes field``.

    Raises ``TypeError``/``ValueError`` as listed in the module doc.
    """
    label = f"parameter {p.name} ({p.ctype})"
    dtype = p.dtype

    if p.kind == "handle":
        def conv_handle(v):
            if v is None:
                return 0
            if type(v) is int or type(v).__name__ == "CUgraphConditionalHandle" or (
                    isinstance(v, _np().integer) and not isinstance(v, _np().bool_)):
                v = int(v)
                if 0 <= v < (1 << 64):
                    return v
                raise KernelArgumentValueError(
                    f"{label}: handle {int_text(v)} is not a 64-bit unsigned value (0 to {_U64})")
            raise KernelArgumentTypeError(
                f"{label} needs a conditional handle: a CUgraphConditionalHandle (from "
                f"cuGraphConditionalHandleCreate), its int value or None; in a graph node pass "
                f"an orchestra.graph.Condition; got {_describe(v)}")
        return conv_handle

    if p.kind == "pointer":
        def conv_ptr(v):
            if type(v) is int:
                if 0 <= v < (1 << 64):
                    return v
                raise KernelArgumentValueError(
                    f"{label}: address {int_text(v)} is not a 64-bit unsigned value (0 to"
                    f" {_U64})")
            if v is None:
                return 0
            if isinstance(v, (bool, float)):
                raise KernelArgumentTypeError(
                    f"{label} needs device memory: pass a DeviceBuffer (anything"
                    f" with .ptr), a CUdeviceptr, an int address or None; got"
                    f" {_describe(v)}")
            ptr = getattr(v, "ptr", None)
            if ptr is not None:
                try:
                    return conv_ptr(int(ptr))
                except (TypeError, ValueError):  # int("0x10") is a ValueError
                    raise KernelArgumentTypeError(
                        f"{label}: {_describe(v)}.ptr is not an address") from None
            if type(v).__name__ == "CUdeviceptr":
                return int(v)
            np = _np()
            if isinstance(v, np.ndarray):
                raise KernelArgumentTypeError(
                    f"{label} needs device memory: got a numpy array (host"
                    " memory); copy it into a DeviceBuffer and pass that")
            if isinstance(v, np.integer):
                return conv_ptr(int(v))
            if speaks_device_protocol(v):
                raise ArgumentNeedsStreamError(
                    f"{label}: a {_describe(v)} (DLPack / CUDA Array Interface) is ordered on "
                    "the stream that uses it, which packing alone does not know: pass it to "
                    "Kernel.launch(stream, ...), or pass orchestra.driver.device_view(obj, "
                    "stream=s), whose .ptr packs here")
            raise KernelArgumentTypeError(
                f"{label} needs device memory: pass a DeviceBuffer (anything with"
                f" .ptr), a CUdeviceptr, an int address or None; got {_describe(v)}")
        return conv_ptr

    def not_scalar(v) -> KernelArgumentTypeError:
        return KernelArgumentTypeError(
            f"{label}: got a buffer ({_describe(v)}) where a scalar belongs")

    def wrong_numpy(v) -> KernelArgumentTypeError:
        kind = "float" if "float" in dtype else "int"
        return KernelArgumentTypeError(
            f"{label}: numpy {v.dtype} scalar does not match the declared {dtype};"
            f" pass numpy.{dtype}(...) or a Python {kind}")

    if dtype == "bool":
        def conv_bool(v):
            if type(v) is bool:
                return v
            np = _np()
            if isinstance(v, np.bool_):
                return bool(v)
            if _is_buffer(v):
                raise not_scalar(v)
            raise KernelArgumentTypeError(
                f"{label}: expected a bool (True/False), got {_describe(v)}")
        return conv_bool

    if dtype in _INT_RANGE:
        lo, hi = _INT_RANGE[dtype]

        def conv_int(v):
            if type(v) is not int:
                if type(v) is bool:
                    raise KernelArgumentTypeError(
                        f"{label}: got a bool where an integer is declared;"
                        " pass an int (bool is accepted only for bool parameters)")
                if isinstance(v, float):
                    raise KernelArgumentTypeError(
                        f"{label}: got a float ({v!r}) where an integer is declared;"
                        " pass an int")
                np = _np()
                if isinstance(v, np.generic):
                    if v.dtype != np.dtype(dtype):
                        raise wrong_numpy(v)
                    v = int(v)
                elif _is_buffer(v):
                    raise not_scalar(v)
                else:
                    try:
                        v = operator.index(v)
                    except TypeError:
                        raise KernelArgumentTypeError(
                            f"{label}: expected an int, got {_describe(v)}") from None
            if lo <= v <= hi:
                return v
            raise KernelArgumentValueError(
                f"{label}: {int_text(v)} does not fit in {dtype}: pass an int from {lo} to {hi}")
        return conv_int

    single = dtype == "float32"
    fmax = _FLOAT_MAX[dtype]

    def out_of_range(v) -> KernelArgumentValueError:
        what = f"the int {int_text(v)}" if isinstance(v, int) else repr(v)
        return KernelArgumentValueError(
            f"{label}: {what} does not fit in {dtype}: pass a value from -{fmax} to {fmax}"
            f" (nan and +-inf pass as they are)")

    def conv_float(v):
        t = type(v)
        if t is float or (t is int):
            f = float(v) if t is float or -_INT_TO_FLOAT < v < _INT_TO_FLOAT else None
        elif t is bool:
            raise KernelArgumentTypeError(
                f"{label}: got a bool where a floating-point value is declared")
        else:
            np = _np()
            if isinstance(v, np.generic):
                if v.dtype != np.dtype(dtype):
                    raise wrong_numpy(v)
                return float(v)
            if _is_buffer(v):
                raise not_scalar(v)
            if isinstance(v, (float, int)):  # subclasses
                f = float(v) if isinstance(v, float) or -_INT_TO_FLOAT < v < _INT_TO_FLOAT \
                    else None
            else:
                raise KernelArgumentTypeError(f"{label}: expected a float, got {_describe(v)}")
        if f is None:  # an int beyond every double: float() would raise OverflowError
            raise out_of_range(v)
        if single and abs(f) >= _F32_OVERFLOW and not math.isinf(f):
            raise out_of_range(v)
        if isinstance(v, int) and t is not float and int(_np().array(f, dtype)) != v:
            # An int the declared type cannot hold exactly would be silently rounded.
            raise KernelArgumentValueError(
                f"{label}: the int {int_text(v)} is not exactly representable in {dtype};"
                " pass a float if rounding is intended")
        return f
    return conv_float


class ArgLayout:
    """The packing of one kernel signature: struct type, field offsets, converters.

    Attributes: ``params`` (tuple of `Param`), ``struct_type`` (ctypes Structure class),
    ``offsets`` (byte offset of each field), ``size`` (struct size in bytes).

    Thread-safety: read-only once made (every attribute is set in ``__init__``; `pack` makes a new
    `PackedArgs` each call): may be shared between threads freely.
    """

    def __init__(self, params, kernel_name: str = "kernel"):
        self.params = tuple(params)
        self.kernel_name = kernel_name
        fields = [(f"a{i}", _CTYPES[p.dtype]) for i, p in enumerate(self.params)]
        self.struct_type: type[ctypes.Structure] = type(
            f"{kernel_name}_args", (ctypes.Structure,), {"_fields_": fields})
        self.field_names = tuple(f for f, _ in fields)
        self.offsets = tuple(getattr(self.struct_type, f).offset for f in self.field_names)
        self.size = ctypes.sizeof(self.struct_type)
        self.pointer_array_type = ctypes.c_void_p * len(self.params)
        self.converters = tuple(make_converter(p) for p in self.params)
        self.index = {p.name: i for i, p in enumerate(self.params)}

    @property
    def signature(self) -> str:
        """``name(float a, const float* x, ...)``."""
        return f"{self.kernel_name}({', '.join(str(p) for p in self.params)})"

    def _arity_error(self, got: int) -> KernelArgumentTypeError:
        n = len(self.params)
        return KernelArgumentTypeError(
            f"kernel {self.signature} takes {n} argument{'s' if n != 1 else ''},"
            f" got {got}")

    def resolve(self, key) -> int:
        """A parameter index from an index or a name; `UnknownParameterError` (a ``KeyError``)
        for an unknown name, `ParameterIndexError` (an ``IndexError``) for an index out of
        range, `KernelArgumentTypeError` for a key that is neither."""
        if isinstance(key, str):
            try:
                return self.index[key]
            except KeyError:
                raise UnknownParameterError(
                    f"kernel {self.signature} has no parameter {key!r}") from None
        try:
            i = operator.index(key)
        except TypeError:
            raise KernelArgumentTypeError(
                f"a parameter of {self.signature} is named by its name (str) or index (int),"
                f" got {type(key).__name__} {key!r}") from None
        n = len(self.params)
        if not -n <= i < n:
            raise ParameterIndexError(f"parameter index {i} out of range for {self.signature}")
        return i % n

    def pack(self, args) -> "PackedArgs":
        """Validate ``args`` (a sequence in declaration order, or a mapping name -> value) and
        pack them into a new `PackedArgs`."""
        t = type(args)
        if (t is not list and t is not tuple) or len(args) != len(self.params):
            args = self.ordered(args)
        values = [conv(v) for conv, v in zip(self.converters, args)]
        s = self.struct_type(*values)
        return PackedArgs(self, s)

    def ordered(self, args) -> list | tuple:
        """``args`` (a sequence, a mapping name -> value, an iterable) in declaration order;
        `KernelArgumentTypeError` for unknown or missing names and the wrong count."""
        if isinstance(args, Mapping):
            unknown = [k for k in args if k not in self.index]
            if unknown:
                raise KernelArgumentTypeError(
                    f"kernel {self.signature} has no parameter(s) {unknown}")
            missing = [p.name for p in self.params if p.name not in args]
            if missing:
                raise KernelArgumentTypeError(
                    f"kernel {self.signature}: missing argument(s) {missing}")
            args = [args[p.name] for p in self.params]
        elif not isinstance(args, (list, tuple)):
            try:
                args = list(args)
            except TypeError:
                raise KernelArgumentTypeError(
                    f"kernel arguments must be a sequence or a mapping, got"
                    f" {type(args).__name__}") from None
        if len(args) != len(self.params):
            raise self._arity_error(len(args))
        return args


class PackedArgs:
    """Packed kernel arguments: the ctypes struct and the ``void*`` array pointing into it.

    Attributes:
        layout: the `ArgLayout`.
        struct: the ctypes Structure instance holding the values.
        pointers: the ``c_void_p`` array (``kernelParams``).
        address: the int address of ``pointers`` (what ``cuLaunchKernel`` receives); 0 for a
            kernel without parameters.

    Thread-safety: not thread-safe to rewrite: `set` writes the struct in place, so a thread that
    rewrites a field while another launches with it or reads it races. Confine one to a thread, or
    give each thread its own (`copy`). The driver copies the parameter values when
    ``cuLaunchKernel`` is called, so a rewrite after `launch` returns does not change that launch.
    """

    __slots__ = ("layout", "struct", "pointers", "address")

    def __init__(self, layout: ArgLayout, struct):
        self.layout = layout
        self.struct = struct
        base = ctypes.addressof(struct)
        self.pointers = layout.pointer_array_type(*[base + o for o in layout.offsets])
        self.address = ctypes.addressof(self.pointers) if layout.params else 0

    def set(self, key, value) -> None:
        """Validate ``value`` for parameter ``key`` (index or name) and rewrite only that field.

        Raises like `ArgLayout.pack`; the old value stays when validation fails.
        """
        i = self.layout.resolve(key)
        setattr(self.struct, self.layout.field_names[i], self.layout.converters[i](value))

    def get(self, key):
        """The packed value of parameter ``key`` (pointers as int addresses)."""
        i = self.layout.resolve(key)
        return getattr(self.struct, self.layout.field_names[i])

    def values(self) -> tuple:
        """Every packed value, in declaration order."""
        return tuple(getattr(self.struct, f) for f in self.layout.field_names)

    def __bytes__(self) -> bytes:
        """The struct's bytes (the parameter buffer, padding included)."""
        return ctypes.string_at(ctypes.addressof(self.struct), self.layout.size)

    def copy(self) -> "PackedArgs":
        """An independent copy (its own struct and pointer array)."""
        s = self.layout.struct_type.from_buffer_copy(self.struct)
        return PackedArgs(self.layout, s)

    def __repr__(self) -> str:
        vals = ", ".join(f"{p.name}={v!r}" for p, v in zip(self.layout.params, self.values()))
        return f"<PackedArgs {self.layout.kernel_name}({vals})>"

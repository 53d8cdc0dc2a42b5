"""What an engine takes and returns: named tensors with a fixed row shape and dtype, any number
of rows (axis 0), and the checks a request passes before anything is enqueued (plain Python).

    inputs={"x": ((1024,), "float32")}    # requests send x of shape (rows, 1024), float32
    inputs={"x": ((), "float32")}         # 1-D: x of shape (rows,)

A dtype is any numpy dtype with a size and no Python objects (structured ones included); a
subarray dtype (``('f4', (3,))``) is refused: its shape belongs in the row shape.

A request's arrays must be of exactly the declared dtype (no silent casts, byte order
included), C-contiguous, of shape ``(rows, *row_shape)`` with ``rows >= 1`` and the same
``rows`` for every input, and not masked (``numpy.ma``: the engine reads memory, which holds no
mask). They are numpy arrays or host tensors of other libraries (CPU torch tensors, anything
with ``__dlpack__`` on the host, ``__array_interface__`` or the buffer protocol): those are
read through a numpy view of their memory (`orchestra.driver.interop.host_view`, nothing
copied), which the request holds until its future is done. Device tensors (CUDA torch
tensors, CuPy arrays) are refused: an engine's graphs start from host memory. The checks raise
`InputTypeError` / `BadRequest` naming the input and the fix.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import Any, Mapping

import attrs
import numpy as np

from orchestra.serve.errors import ServeConfigTypeError, ServeConfigValueError
from orchestra.serve.errors import BadRequest, InputTypeError


def _row_shape(value) -> tuple[int, ...]:
    """A row shape: an int or a sequence of ints (numpy's too; not bools, floats or strings),
    else `ServeConfigTypeError` (operator.index raised a builtin TypeError)."""
    dims = (value,) if isinstance(value, (int, np.integer)) else value
    shape = None
    if not isinstance(dims, (str, bytes)):
        try:
            dims = tuple(dims)  # once: a generator is read a single time
            shape = tuple(operator.index(d) for d in dims)
        except TypeError:
            pass
    if shape is None or any(isinstance(d, (bool, np.bool_)) for d in dims):
        raise ServeConfigTypeError(f"a row shape must be a tuple of ints (or one int), e.g. "
                                   f"(1024,) or () for 1-D arrays; got {value!r}")
    return shape


def _dtype(value) -> np.dtype:
    """``np.dtype(value)``, or `ServeConfigTypeError` for what numpy cannot read as a dtype
    (it raised a builtin TypeError)."""
    try:
        return np.dtype(value)
    except (TypeError, ValueError) as exc:
        raise ServeConfigTypeError(f"{value!r} is not a numpy dtype ({exc}); give one such as "
                                   "'float32' or np.float32") from None


@attrs.frozen
class TensorSpec:
    """One named tensor: ``row_shape`` (the shape of one row: everything after axis 0) and
    ``dtype``. ``row_nbytes``: bytes per row.

    Immutable: may be shared between threads freely.
    """

    name: str
    row_shape: tuple[int, ...] = attrs.field(converter=_row_shape)
    dtype: np.dtype = attrs.field(converter=_dtype)

    def __attrs_post_init__(self):
        if any(d < 1 for d in self.row_shape):
            raise ServeConfigValueError(f"tensor {self.name}: row shape {self.row_shape} has a "
                                        f"dimension < 1")
        if self.dtype.hasobject:
            raise ServeConfigTypeError(f"tensor {self.name}: dtype object cannot be served")
        if self.dtype.subdtype is not None:
            # numpy never makes an array of a subarray dtype (np.zeros(2, ('f4', (3,))) is
            # float32 of shape (2, 3)): no request could ever match the spec
            base, sub = self.dtype.subdtype
            raise ServeConfigTypeError(
                f"tensor {self.name}: dtype {self.dtype} is a subarray dtype, which numpy "
                f"arrays never have; put its shape in the row shape: "
                f"({(*self.row_shape, *sub)}, {base.str!r})")
        if self.dtype.itemsize == 0:
            raise ServeConfigTypeError(
                f"tensor {self.name}: dtype {self.dtype.str!r} has no size; give its length "
                f"(e.g. 'S16' or 'U8')")

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize

    def shape(self, rows: int) -> tuple[int, ...]:
        return (rows, *self.row_shape)

    def describe(self) -> str:
        dims = ", ".join(["rows", *map(str, self.row_shape)])
        return f"({dims}) {_dtype_name(self.dtype)}"


def _dtype_name(dtype: np.dtype) -> str:
    """``dtype`` as a user would write it: numpy's name (float32, datetime64[ns]), the string
    of a sized string or void ('|S16'), the fields of a structured dtype, and the byte order
    when it is not the machine's (numpy names '>f4' float32 too)."""
    if dtype.fields is not None:
        return f"structured {dtype.descr}"
    if dtype.kind in "SUV":
        return repr(dtype.str)
    if not dtype.isnative:
        return f"{dtype.name} ({dtype.str!r}, byte-swapped)"
    return dtype.name


def _astype(spec: TensorSpec, what: str) -> str:
    """What to pass to ``.astype`` for ``spec``'s dtype: ``np.float32``, or its string when
    numpy's name does not say it all (byte order, units, sizes), or for a structured dtype
    the engine's own (its fields, offsets and padding)."""
    dtype = spec.dtype
    if dtype.fields is not None:
        return f"engine.{'outputs' if what == 'out' else 'inputs'}[{spec.name!r}].dtype"
    if dtype.isnative and np.dtype(getattr(np, dtype.name, "O")) == dtype:
        return f"np.{dtype.name}"
    return repr(dtype.str)


def tensor_specs(spec, what: str) -> dict[str, TensorSpec]:
    """``{name: TensorSpec}`` from ``{name: (row_shape, dtype)}`` or ``{name: TensorSpec}``."""
    if not isinstance(spec, Mapping) or not spec:
        raise ServeConfigTypeError(f"{what} must be a non-empty mapping of name -> (row_shape, "
                                   f"dtype); got {spec!r}")
    out = {}
    for name, v in spec.items():
        if isinstance(v, TensorSpec):
            out[name] = v if v.name == name else attrs.evolve(v, name=name)
            continue
        try:
            row, dtype = v
        except (TypeError, ValueError):
            raise ServeConfigTypeError(f"{what}[{name!r}] must be (row_shape, dtype), e.g. "
                                       f"((1024,), 'float32'); got {v!r}") from None
        try:
            out[name] = TensorSpec(name, row, dtype)
        except ServeConfigTypeError as exc:
            if str(exc).startswith(f"tensor {name}:"):
                raise
            raise ServeConfigTypeError(f"{what}[{name!r}]: {exc}") from None
    return out


def check_inputs(specs: dict[str, TensorSpec], inputs) -> tuple[dict[str, np.ndarray], int]:
    """The request's arrays by name and its row count, or `BadRequest` / `InputTypeError`.

    ``inputs``: ``{name: array}``, or one array when the engine has one input.
    """
    if isinstance(inputs, np.ndarray) or (not isinstance(inputs, Mapping)
                                          and _is_tensor(inputs)):
        if len(specs) != 1:
            raise BadRequest(f"this engine takes {len(specs)} inputs ({', '.join(specs)}); pass "
                             "a dict of name -> array")
        ((name, spec),) = specs.items()
        a = _check_array(spec, inputs, "input")
        return {name: a}, a.shape[0]
    if not isinstance(inputs, Mapping):
        raise InputTypeError(f"inputs must be a numpy array (or a host tensor) or a dict of "
                             f"name -> array; got {type(inputs).__name__}")
    if inputs.keys() != specs.keys():
        missing = [n for n in specs if n not in inputs]
        unknown = [str(n) for n in inputs if n not in specs]
        parts = []
        if missing:
            parts.append("missing " + ", ".join(missing))
        if unknown:
            parts.append("unknown " + ", ".join(unknown))
        raise BadRequest(f"inputs: {'; '.join(parts)} (this engine takes "
                         f"{', '.join(f'{n} {s.describe()}' for n, s in specs.items())})")
    arrays = {}
    rows = -1
    for name, spec in specs.items():
        a = _check_array(spec, inputs[name], "input")
        if rows < 0:
            rows = a.shape[0]
        elif a.shape[0] != rows:
            raise BadRequest(f"inputs have different row counts ({rows} and {a.shape[0]} for "
                             f"{name}); every input of one request has the same rows")
        arrays[name] = a
    return arrays, rows


def check_out(specs: dict[str, TensorSpec], out, rows: int) -> dict[str, np.ndarray]:
    """``out=`` arrays (``{name: array}`` or one array for a one-output engine): the dtype and
    ``(rows, *row_shape)`` of the output, C-contiguous and writable."""
    if isinstance(out, np.ndarray) or (not isinstance(out, Mapping) and _is_tensor(out)):
        if len(specs) != 1:
            raise BadRequest(f"this engine has {len(specs)} outputs ({', '.join(specs)}); pass "
                             "out= as a dict of name -> array")
        out = {next(iter(specs)): out}
    if not isinstance(out, Mapping):
        raise InputTypeError(f"out must be a numpy array or a dict of name -> array; got "
                             f"{type(out).__name__}")
    unknown = [str(n) for n in out if n not in specs]
    if unknown:
        raise BadRequest(f"out: unknown output(s) {', '.join(unknown)} (outputs: "
                         f"{', '.join(specs)})")
    checked = {}
    for name, a in out.items():
        spec = specs[name]
        a = _check_array(spec, a, "out")
        if a.shape[0] != rows:
            raise BadRequest(f"out {name}: {a.shape[0]} rows, the request has {rows}")
        if not a.flags.writeable:
            raise BadRequest(f"out {name} is read-only; pass a writable array")
        checked[name] = a
    return checked


def _is_tensor(obj) -> bool:
    """Whether ``obj`` is an array of another library, on the host or a device (what
    `orchestra.driver.interop`'s host and device protocol tests accept: DLPack,
    ``__array_interface__``, the buffer protocol, the CUDA Array Interface)."""
    from orchestra.driver.interop import has_device_protocol, has_host_protocol

    return has_host_protocol(obj) or has_device_protocol(obj)


def _as_array(spec: TensorSpec, a: Any, what: str) -> Any:
    """``a`` itself when it is a numpy array or not a tensor (the checks below name it), else a
    numpy view of a host tensor's memory; a device tensor, or a host tensor its producer does
    not export, is an `InputTypeError`."""
    if isinstance(a, np.ndarray) or not _is_tensor(a):
        return a
    from orchestra.driver.interop import host_view  # the driver layer only for tensors
    from orchestra.errors import OrchestraError

    try:  # a device tensor is host_view's InteropValueError ("is device memory ...")
        return host_view(a, what=f"{what} {spec.name}")
    except OrchestraError as exc:
        raise InputTypeError(f"{exc}; an engine takes host arrays: pass a CPU tensor (e.g. "
                             "t.cpu()) or a numpy array") from exc


def _check_array(spec: TensorSpec, a: Any, what: str) -> np.ndarray:
    name = spec.name
    a = _as_array(spec, a, what)
    if not isinstance(a, np.ndarray):
        raise InputTypeError(f"{what} {name}: expected a numpy array or a host tensor "
                             f"{spec.describe()}, got {type(a).__name__}; convert it with "
                             f"np.asarray(..., dtype={_astype(spec, what)})")
    # never imported: no array is a masked one; being imported by another thread (stats()'s
    # np.percentile imports it lazily): the module may not have the class yet, and then no
    # array is one either
    masked = getattr(sys.modules.get("numpy.ma"), "MaskedArray", None)
    if masked is not None and isinstance(a, masked):
        # the engine reads the array's memory, which holds no mask: the masked entries' data
        # would be served as if they were values
        raise InputTypeError(f"{what} {name} is a masked array, whose mask the engine would "
                             f"drop; pass a plain array: .filled(value) (masked entries set "
                             f"to value) or .data (the values under the mask as they are)")
    if a.dtype != spec.dtype:
        got, want = _dtype_name(a.dtype), _dtype_name(spec.dtype)
        if got == want:  # a structure's alignment: the same fields at other offsets
            got, want = f"{got}, itemsize {a.dtype.itemsize}", \
                f"{want}, itemsize {spec.dtype.itemsize}"
        raise InputTypeError(f"{what} {name}: dtype {got}, the engine takes {want}; convert "
                             f"it with .astype({_astype(spec, what)})")
    if a.ndim != 1 + len(spec.row_shape) or a.shape[1:] != spec.row_shape:
        raise BadRequest(f"{what} {name}: shape {a.shape}, expected {spec.describe()}")
    if a.shape[0] < 1:
        raise BadRequest(f"{what} {name}: 0 rows; a request needs at least one row")
    if not a.flags.c_contiguous:
        raise InputTypeError(f"{what} {name} is not C-contiguous (strides {a.strides}); pass "
                             "np.ascontiguousarray(...)")
    return a


__all__ = ["TensorSpec", "check_inputs", "check_out", "tensor_specs"]

"""Buffers, byte ranges of them, and the access modes nodes declare.

A `Buffer` is device memory that an `Alloc` node creates and a `Free` node releases (or, with
neither in the graph, memory bound by the caller at run time). A `HostBuffer` is a host slot
bound at run time to a pinned numpy array: the source of an H2D copy or the destination of a
D2H copy. A `Condition` is the value a conditional node tests: a CUDA graph's conditional
handle, which kernels set on the GPU. All three are plain, hashable values identified by name
(one namespace per graph); sizes are in bytes.
"""

from __future__ import annotations

import enum
from typing import cast

import attrs

from orchestra.errors import NodeFieldTypeError, NodeFieldValueError
from orchestra.graph.fields import MAX_BYTES, MAX_DEVICE, check_int, check_name, got


def _record(inst) -> str:
    name, kind = getattr(inst, "name", None), type(inst).__name__
    return f"{kind} {name}" if isinstance(name, str) and name else kind


def _positive_int(inst, attribute, value):
    check_int(lambda: _record(inst), attribute.name, value, minimum=1,
              what="a positive int (bytes)", maximum=MAX_BYTES,
              limit="below 2**64 (CUDA sizes are 64-bit)")


def _name(inst, attribute, value):
    check_name(type(inst).__name__, attribute.name, value)


class Mode(enum.Enum):
    """How a node touches a byte range.

    Immutable (an enum): may be shared between threads freely.
    """

    READ = "read"
    WRITE = "write"
    READ_WRITE = "read_write"

    @property
    def reads(self) -> bool:
        return self is not Mode.WRITE

    @property
    def writes(self) -> bool:
        return self is not Mode.READ


class _RangeMixin:
    """`.range()` and `.whole` for both buffer kinds."""

    nbytes: int  # each buffer kind's own field
    _whole: "BufferRange | None"  # each buffer kind's cache of `whole`

    def range(self, offset: int = 0, nbytes: int | None = None) -> "BufferRange":
        """The bytes ``[offset, offset + nbytes)`` of this buffer (default: to the end)."""
        if nbytes is None and type(offset) is int:  # else BufferRange names the bad offset
            nbytes = self.nbytes - offset
        return BufferRange(cast("Buffer | HostBuffer", self), offset, cast(int, nbytes))

    @property
    def whole(self) -> "BufferRange":
        """Every byte of this buffer (one range object per buffer, made on first use)."""
        w = self._whole
        if w is None:
            w = BufferRange._valid(cast("Buffer | HostBuffer", self), 0, self.nbytes)
            object.__setattr__(self, "_whole", w)
        return w


@attrs.frozen
class Buffer(_RangeMixin):
    """Device memory of ``nbytes`` bytes on ``device`` (a logical buffer).

    Immutable (frozen): may be shared between threads freely. `whole` is cached on first use by an
    idempotent write, so threads that ask at once at most make equal ranges.
    """

    name: str = attrs.field(validator=_name)
    nbytes: int = attrs.field(validator=_positive_int)
    device: int = attrs.field(default=0)
    _whole: "BufferRange | None" = attrs.field(init=False, default=None, eq=False, repr=False)

    @device.validator
    def _device(self, attribute, value):
        check_int(lambda: _record(self), "device", value, minimum=0,
                  what="a device ordinal (an int >= 0)", maximum=MAX_DEVICE,
                  limit="below 2**31 (a C int)")

    is_host = False

    @property
    def key(self) -> tuple[str, str]:
        return ("device", self.name)


@attrs.frozen
class HostBuffer(_RangeMixin):
    """A host slot of ``nbytes`` bytes, bound at run time to a pinned numpy array.

    Immutable (frozen): may be shared between threads freely. `whole` is cached on first use by an
    idempotent write, so threads that ask at once at most make equal ranges.
    """

    name: str = attrs.field(validator=_name)
    nbytes: int = attrs.field(validator=_positive_int)
    _whole: "BufferRange | None" = attrs.field(init=False, default=None, eq=False, repr=False)

    is_host = True
    device = None

    @property
    def key(self) -> tuple[str, str]:
        return ("host", self.name)


@attrs.frozen
class BufferRange:
    """Bytes ``[offset, offset + nbytes)`` of ``buffer``; checked to be in bounds.

    Immutable: may be shared between threads freely.
    """

    buffer: Buffer | HostBuffer
    offset: int
    nbytes: int

    def __attrs_post_init__(self):
        if not isinstance(self.buffer, (Buffer, HostBuffer, Condition)):
            raise NodeFieldTypeError(f"BufferRange: buffer must be a Buffer or HostBuffer, got"
                                     f" {got(self.buffer)}")
        offset, nbytes = self.offset, self.nbytes
        if not (type(offset) is int and type(nbytes) is int and offset >= 0 and nbytes >= 0):
            record = f"range of {self.buffer.name}"
            check_int(record, "offset", offset, minimum=0)
            check_int(record, "nbytes", nbytes, minimum=0)
        if self.nbytes == 0:
            raise NodeFieldValueError(f"range of {self.buffer.name}: an empty range (0 bytes)"
                                      " touches nothing")
        if self.offset + self.nbytes > self.buffer.nbytes:
            raise NodeFieldValueError(
                f"range [{self.offset}, {self.offset + self.nbytes}) is out of bounds of "
                f"{self.buffer.name} ({self.buffer.nbytes} bytes)")

    @classmethod
    def _valid(cls, buffer, offset: int, nbytes: int) -> "BufferRange":
        """A range known to be valid (e.g. a whole buffer), built without the checks: graphs
        of many batches build a few per node."""
        r = object.__new__(cls)
        put = object.__setattr__.__get__(r)
        put("buffer", buffer)
        put("offset", offset)
        put("nbytes", nbytes)
        return r

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def overlaps(self, other: "BufferRange") -> bool:
        return (self.buffer.key == other.buffer.key
                and self.offset < other.end and other.offset < self.end)

    def __str__(self) -> str:
        return f"{self.buffer.name}[{self.offset}:{self.end}]"


def _flag(value):
    """Converter for `Condition.flag`: a device buffer -> its first 4 bytes; else unchanged."""
    if isinstance(value, Buffer):
        return BufferRange(value, 0, 4) if value.nbytes >= 4 else value
    return value


@attrs.frozen
class Condition(_RangeMixin):
    """The value a conditional node (`If`, `While`, `Switch`) tests: a CUDA graph's
    *conditional handle* (``cuGraphConditionalHandleCreate``), as plain data.

    A kernel sets it on the GPU: declare the kernel's parameter ``cudaGraphConditionalHandle``
    (64-bit), pass the `Condition` as that argument of its `KernelNode` (a write of the
    condition, so the setter is ordered before the conditional node that tests it), and call
    ``cudaGraphSetConditional(handle, value)`` in the kernel (CUDA Programming Guide,
    "Conditional Graph Nodes"; with NVRTC declare it ``extern "C" __device__
    __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle, unsigned
    int);``). Each condition is tested by exactly one conditional node; the kernels that set
    it live in that node's graph (before it) or in its bodies.

    Attributes:
        name: unique among the graph's buffers and conditions.
        default: the value at the start of every launch of the graph (the handle is created
            with ``CU_GRAPH_COND_ASSIGN_DEFAULT``), an unsigned 32-bit int; None (default):
            no default, the value is undefined until a kernel sets it, so a kernel before the
            conditional node must. A condition with a default is not also set before the node
            (one or the other, so every executor sees the same value there).
        flag: optional: device memory (a `Buffer`, whose first 4 bytes are used, or a 4-byte
            `BufferRange`) where the kernels that set the condition also store the value as an
            ``unsigned int``. The eager executor, which has no CUDA graph and so no handle
            (its kernels get handle 0: guard ``cudaGraphSetConditional`` with ``if (h)``),
            reads the flag back to take the branch on the host; the graph executors ignore it.
        device: the device whose graph holds the handle (default 0).

    Wrong types and values raise `NodeFieldTypeError` / `NodeFieldValueError` naming the field.

    Immutable (frozen): may be shared between threads freely. `whole` is cached on first use by an
    idempotent write, so threads that ask at once at most make equal ranges.
    """

    name: str = attrs.field(validator=_name)
    default: int | None = None
    flag: BufferRange | None = attrs.field(default=None, converter=_flag)
    device: int = 0
    _whole: "BufferRange | None" = attrs.field(init=False, default=None, eq=False, repr=False)

    nbytes = 8  # the handle is 64-bit: the byte range accesses of it name
    is_host = False

    def __attrs_post_init__(self):
        record = f"Condition {self.name}"
        check_int(record, "device", self.device, minimum=0,
                  what="a device ordinal (an int >= 0)")
        if self.default is not None:
            check_int(record, "default", self.default, minimum=0,
                      what="None or an unsigned 32-bit int")
            if self.default >= 1 << 32:
                raise NodeFieldValueError(f"{record}: default must fit an unsigned 32-bit int;"
                                          f" got {self.default!r}")
        flag = self.flag
        if flag is not None:
            if not isinstance(flag, BufferRange) or flag.buffer.is_host \
                    or not isinstance(flag.buffer, Buffer):
                raise NodeFieldTypeError(f"{record}: flag must be a device Buffer or a 4-byte "
                                         f"BufferRange of one, or None; got {got(flag)}")
            if flag.nbytes != 4 or flag.offset % 4:
                raise NodeFieldValueError(f"{record}: flag must be 4 bytes at a 4-byte aligned "
                                          f"offset (an unsigned int); got {flag}")
            if flag.buffer.device != self.device:
                raise NodeFieldValueError(f"{record}: flag {flag} is on device "
                                          f"{flag.buffer.device}, the condition on {self.device}")

    @property
    def key(self) -> tuple[str, str]:
        return ("condition", self.name)

    @property
    def flags(self) -> int:
        """``cuGraphConditionalHandleCreate``'s flags: ``CU_GRAPH_COND_ASSIGN_DEFAULT`` (1)
        with a default, else 0."""
        return 0 if self.default is None else 1


def as_range(x, what: str = "argument") -> BufferRange:
    """A `BufferRange` from a buffer (whole) or a range; anything else is a
    `NodeFieldTypeError` (a `GraphError` and a ``TypeError``)."""
    if isinstance(x, BufferRange):
        return x
    if isinstance(x, (Buffer, HostBuffer)):
        return x.whole
    raise NodeFieldTypeError(f"{what} must be a Buffer, HostBuffer or BufferRange, got {got(x)}")


def to_range(x):
    """Converter: a buffer -> its whole range, a range as is, anything else unchanged (the
    record's own check names it)."""
    if isinstance(x, (Buffer, HostBuffer)):
        return x.whole
    return x


@attrs.frozen
class Access:
    """One declared access: ``mode`` on the bytes of ``range``.

    Immutable: may be shared between threads freely.
    """

    range: BufferRange
    mode: Mode

    @property
    def buffer(self):
        return self.range.buffer

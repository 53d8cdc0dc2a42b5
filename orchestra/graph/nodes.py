"""Node records: plain data naming the buffers they read and write.

Every node has ``name``, ``batch`` (int or None), ``device`` (defaults to the device of the device
buffers it touches, else 0), ``after`` (names of nodes it must follow besides the inferred ones),
and ``accesses()`` -> tuple of `Access`. ``engine`` says which hardware queue it occupies
("upload", "download", "compute", "host", "memory"); schedulers place nodes by it, so new kinds
(peer copies, NCCL collectives) only need their own ``accesses()`` and ``engine``.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, ClassVar

import attrs

from orchestra.errors import GraphError
from orchestra.graph.buffers import Access, Buffer, BufferRange, HostBuffer, Mode, as_range
from orchestra.graph.kernel_ref import KernelRef


def _after(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    for v in value:
        if not isinstance(v, str):
            raise GraphError(f"after= takes node names (str); got {v!r}")
    return value


@attrs.frozen
class Node:
    """Base of every node record. Subclasses define ``accesses()`` and ``engine``."""

    name: str
    batch: int | None = attrs.field(default=None, kw_only=True)
    device: int | None = attrs.field(default=None, kw_only=True)
    after: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=_after)
    # accesses() as computed once at construction (fields are frozen): TaskGraph.add reuses it
    _accesses: tuple | None = attrs.field(init=False, default=None, eq=False, repr=False)

    engine: ClassVar[str] = "compute"
    kind: ClassVar[str] = "node"

    def __attrs_post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"a node's name must be a non-empty str; got {self.name!r}")
        if self.batch is not None and (isinstance(self.batch, bool) or not isinstance(self.batch, int)):
            raise GraphError(f"node {self.name}: batch must be an int or None; got {self.batch!r}")
        accesses = self.accesses()
        object.__setattr__(self, "_accesses", accesses)
        devices = {a.buffer.device for a in accesses if not a.buffer.is_host}
        if self.device is None:
            object.__setattr__(self, "device", min(devices) if devices else 0)
        if self.checks_device and devices - {self.device}:
            raise GraphError(
                f"node {self.name} runs on device {self.device} but touches buffers on device(s) "
                f"{sorted(devices - {self.device})}: use a peer copy to move data between devices")

    checks_device: ClassVar[bool] = True

    def accesses(self) -> tuple[Access, ...]:
        raise NotImplementedError

    def buffers(self) -> tuple:
        """The distinct buffers this node touches, in declaration order."""
        seen = {}
        for a in self.accesses():
            seen.setdefault(a.buffer.key, a.buffer)
        return tuple(seen.values())


def _device_buffer(node, value, what):
    if not isinstance(value, Buffer):
        raise GraphError(f"{type(node).__name__} {node.name}: {what} must be a device Buffer "
                         f"(not a range or host buffer); got {value!r}")


@attrs.frozen
class Alloc(Node):
    """Allocate ``buffer`` stream-ordered (``cuMemAllocAsync``); a write of all its bytes."""

    buffer: Buffer
    engine: ClassVar[str] = "memory"
    kind: ClassVar[str] = "alloc"

    def __attrs_post_init__(self):
        _device_buffer(self, self.buffer, "buffer")
        super().__attrs_post_init__()

    def accesses(self):
        return (Access(self.buffer.whole, Mode.WRITE),)


@attrs.frozen
class Free(Node):
    """Free ``buffer`` stream-ordered (``cuMemFreeAsync``); a write of all its bytes, so it
    follows every use."""

    buffer: Buffer
    engine: ClassVar[str] = "memory"
    kind: ClassVar[str] = "free"

    def __attrs_post_init__(self):
        _device_buffer(self, self.buffer, "buffer")
        super().__attrs_post_init__()

    def accesses(self):
        return (Access(self.buffer.whole, Mode.WRITE),)


def _copy_check(node, want_src_host: bool):
    src, dst = node.src, node.dst
    names = ("host", "device") if want_src_host else ("device", "host")
    if src.buffer.is_host != want_src_host:
        raise GraphError(f"{type(node).__name__} {node.name}: src must be a {names[0]} buffer; "
                         f"got {src.buffer.name} ({'host' if src.buffer.is_host else 'device'})")
    if dst.buffer.is_host == want_src_host:
        raise GraphError(f"{type(node).__name__} {node.name}: dst must be a {names[1]} buffer; "
                         f"got {dst.buffer.name}")
    if src.nbytes != dst.nbytes:
        raise GraphError(f"{type(node).__name__} {node.name}: src {src} has {src.nbytes} bytes but "
                         f"dst {dst} has {dst.nbytes}; sizes must match")


def _rng(what):
    return lambda x: as_range(x, what)


@attrs.frozen
class _HostCopy(Node):
    """A copy between pinned host memory and a device buffer: reads ``src``, writes ``dst``.
    Subclasses declare ``src`` and ``dst`` (with their own converters) and ``src_is_host``."""

    src_is_host: ClassVar[bool]

    def __attrs_post_init__(self):
        _copy_check(self, self.src_is_host)
        super().__attrs_post_init__()

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    def accesses(self):
        return (Access(self.src, Mode.READ), Access(self.dst, Mode.WRITE))


@attrs.frozen
class HostToDevice(_HostCopy):
    """Copy ``src`` (host, pinned) to ``dst`` (device); ``cuMemcpyHtoDAsync``."""

    src: BufferRange = attrs.field(converter=_rng("HostToDevice src"))
    dst: BufferRange = attrs.field(converter=_rng("HostToDevice dst"))
    engine: ClassVar[str] = "upload"
    kind: ClassVar[str] = "h2d"
    src_is_host: ClassVar[bool] = True


@attrs.frozen
class DeviceToHost(_HostCopy):
    """Copy ``src`` (device) to ``dst`` (host, pinned); ``cuMemcpyDtoHAsync``."""

    src: BufferRange = attrs.field(converter=_rng("DeviceToHost src"))
    dst: BufferRange = attrs.field(converter=_rng("DeviceToHost dst"))
    engine: ClassVar[str] = "download"
    kind: ClassVar[str] = "d2h"
    src_is_host: ClassVar[bool] = False


@attrs.frozen
class Memset(Node):
    """Fill ``dst`` (device) with ``value`` repeated as ``element_size``-byte elements
    (``cuMemsetD8/D16/D32Async``). To poison float32 with NaN: value=0x7FC00000, element_size=4."""

    dst: BufferRange = attrs.field(converter=_rng("Memset dst"))
    value: int
    element_size: int = attrs.field(default=1)
    kind: ClassVar[str] = "memset"

    def __attrs_post_init__(self):
        if self.dst.buffer.is_host:
            raise GraphError(f"Memset {self.name}: dst must be a device buffer; got {self.dst.buffer.name}")
        es = self.element_size
        if es not in (1, 2, 4):
            raise GraphError(f"Memset {self.name}: element_size must be 1, 2 or 4; got {es!r}")
        if self.dst.offset % es or self.dst.nbytes % es:
            raise GraphError(f"Memset {self.name}: {self.dst} is not a whole number of "
                             f"{es}-byte elements")
        bits = 8 * es
        if isinstance(self.value, bool) or not isinstance(self.value, int) \
                or not -(1 << (bits - 1)) <= self.value < (1 << bits):
            raise GraphError(f"Memset {self.name}: value must be an int that fits {es} byte(s); "
                             f"got {self.value!r}")
        super().__attrs_post_init__()

    @property
    def unsigned_value(self) -> int:
        """``value`` as the unsigned int the driver call takes."""
        return self.value & ((1 << (8 * self.element_size)) - 1)

    def accesses(self):
        return (Access(self.dst, Mode.WRITE),)


# -- kernel arguments -----------------------------------------------------------------------


@attrs.frozen
class In:
    """A kernel argument the kernel only reads."""

    target: BufferRange = attrs.field(converter=_rng("In(...)"))
    mode: ClassVar[Mode] = Mode.READ


@attrs.frozen
class Out:
    """A kernel argument the kernel only writes."""

    target: BufferRange = attrs.field(converter=_rng("Out(...)"))
    mode: ClassVar[Mode] = Mode.WRITE


@attrs.frozen
class InOut:
    """A kernel argument the kernel reads and writes."""

    target: BufferRange = attrs.field(converter=_rng("InOut(...)"))
    mode: ClassVar[Mode] = Mode.READ_WRITE


def _is_scalar(x) -> bool:
    # numpy scalars register with the numbers ABCs; the duck test covers other array scalars.
    return isinstance(x, numbers.Number) or (hasattr(x, "dtype") and hasattr(x, "item")
                                             and getattr(x, "shape", None) == ())


def _dim3(value, what):
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    value = tuple(value)
    if not 1 <= len(value) <= 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                       for v in value):
        raise GraphError(f"{what} must be a positive int or 1-3 positive ints; got {value!r}")
    return value + (1,) * (3 - len(value))


def _attributes(value):
    if isinstance(value, dict):
        value = value.items()
    return tuple(sorted((str(k), v) for k, v in value))


@attrs.frozen
class KernelNode(Node):
    """Launch ``kernel`` with ``grid`` x ``block`` threads and ``args``.

    Arguments are scalars (int, float, numpy scalar; passed as is, packed by the compiler from
    the kernel's parameter types) or device buffers: ``In(b)``, ``Out(b)``, ``InOut(b)``, or a
    bare `Buffer`/`BufferRange`, which is a read for a declared ``const T*`` parameter and a
    read-write otherwise. ``shared_mem`` is dynamic shared memory in bytes; ``attributes`` are
    launch attributes (name -> value), kept sorted.
    """

    kernel: KernelRef
    grid: tuple[int, int, int] = attrs.field(converter=lambda v: _dim3(v, "grid"))
    block: tuple[int, int, int] = attrs.field(converter=lambda v: _dim3(v, "block"))
    args: tuple = attrs.field(default=(), converter=tuple)
    shared_mem: int = 0
    attributes: tuple = attrs.field(default=(), converter=_attributes)
    kind: ClassVar[str] = "kernel"

    def __attrs_post_init__(self):
        if not isinstance(self.kernel, KernelRef):
            raise GraphError(f"KernelNode {self.name}: kernel must be a KernelRef; got {self.kernel!r}")
        if isinstance(self.shared_mem, bool) or not isinstance(self.shared_mem, int) or self.shared_mem < 0:
            raise GraphError(f"KernelNode {self.name}: shared_mem must be an int >= 0 (bytes)")
        for i, a in enumerate(self.args):
            if isinstance(a, (In, Out, InOut, Buffer, BufferRange)):
                target = a.target if isinstance(a, (In, Out, InOut)) else as_range(a)
                if target.buffer.is_host:
                    raise GraphError(f"KernelNode {self.name}: argument {i} is host buffer "
                                     f"{target.buffer.name}; kernels take device buffers")
            elif isinstance(a, HostBuffer):
                raise GraphError(f"KernelNode {self.name}: argument {i} is host buffer {a.name}; "
                                 f"kernels take device buffers")
            elif not _is_scalar(a):
                raise GraphError(f"KernelNode {self.name}: argument {i} ({a!r}) is neither a scalar "
                                 f"nor a buffer (In/Out/InOut/Buffer/BufferRange)")
        super().__attrs_post_init__()

    def accesses(self):
        out = []
        for i, a in enumerate(self.args):
            if isinstance(a, (In, Out, InOut)):
                out.append(Access(a.target, a.mode))
            elif isinstance(a, (Buffer, BufferRange)):
                out.append(Access(as_range(a), self.kernel.default_mode(i)))
        return tuple(out)


@attrs.frozen
class HostFunc(Node):
    """Run ``fn()`` on a host thread in stream order (``cuLaunchHostFunc``).

    ``reads``/``writes`` name the host (and, for managed memory, device) buffers it touches.
    ``fn`` must not call CUDA: the driver forbids it inside a host function.
    """

    fn: Callable[[], Any]
    reads: tuple = attrs.field(default=(), converter=lambda xs: tuple(as_range(x, "HostFunc reads") for x in xs))
    writes: tuple = attrs.field(default=(), converter=lambda xs: tuple(as_range(x, "HostFunc writes") for x in xs))
    engine: ClassVar[str] = "host"
    kind: ClassVar[str] = "host"
    checks_device: ClassVar[bool] = False

    def __attrs_post_init__(self):
        if not callable(self.fn):
            raise GraphError(f"HostFunc {self.name}: fn must be callable; got {self.fn!r}")
        super().__attrs_post_init__()

    def accesses(self):
        return (tuple(Access(r, Mode.READ) for r in self.reads)
                + tuple(Access(r, Mode.WRITE) for r in self.writes))

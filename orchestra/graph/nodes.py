"""Node records: plain data naming the buffers they read and write.

Every node has ``name``, ``batch`` (int or None), ``device`` (defaults to the device of the device
buffers it touches, else 0), ``after`` (names of nodes it must follow besides the inferred ones),
and ``accesses()`` -> tuple of `Access`. ``engine`` says which hardware queue it occupies
("upload", "download", "compute", "host", "memory"); schedulers place nodes by it, so new kinds
(peer copies, NCCL collectives) only need their own ``accesses()`` and ``engine``. A node that
holds task graphs it runs as a unit (``bodies``, see `orchestra.graph.bodies`) accesses what
they touch, as a whole; ``tests`` is the `Condition` a conditional node tests.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import attrs

from orchestra.errors import NodeFieldTypeError, NodeFieldValueError, int_text
from orchestra.graph.buffers import (
    Access,
    Buffer,
    BufferRange,
    Condition,
    HostBuffer,
    Mode,
    as_range,
    to_range,
)
from orchestra.graph.bodies import body_accesses
from orchestra.graph.fields import (
    MAX_DEVICE, as_int, check_int, check_name, check_str_tuple, got, str_tuple,
)
from orchestra.graph.kernel_ref import KernelRef

_RANGE = "a Buffer, HostBuffer or BufferRange"


@attrs.frozen
class Node:
    """Base of every node record. Subclasses define ``accesses()`` and ``engine``.

    Immutable (frozen): may be shared between threads freely; the accesses are computed once, at
    construction. Kinds with bodies (`ChildGraph`, the conditional nodes) hold mutable `TaskGraph`
    objects: see theirs.
    """

    name: str
    batch: int | None = attrs.field(default=None, kw_only=True)
    device: int | None = attrs.field(default=None, kw_only=True)
    after: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=str_tuple)
    # accesses() as computed once at construction (fields are frozen): TaskGraph.add reuses it
    _accesses: tuple | None = attrs.field(init=False, default=None, eq=False, repr=False)

    engine: ClassVar[str] = "compute"
    kind: ClassVar[str] = "node"
    #: the `Condition` a conditional node tests (its own property there); None for other kinds
    tests: ClassVar[Condition | None] = None

    @property
    def bodies(self) -> tuple:
        """The task graphs this node holds and runs as a unit (a conditional node's branches or
        loop body, a child graph); empty for most kinds (`orchestra.graph.bodies`)."""
        return ()

    @property
    def _record(self) -> str:
        """How messages name this node: ``KernelNode k``."""
        return f"{type(self).__name__} {self.name}"

    def _record_of(self) -> str:  # the same, as a callable the checks call only to fail
        return self._record

    def __attrs_post_init__(self):
        # Wrong types and values raise NodeFieldTypeError / NodeFieldValueError (GraphErrors)
        # naming the node and the field, before anything reads the fields.
        record = self._record_of
        check_name(type(self).__name__, "name", self.name)
        check_int(record, "batch", self.batch, optional=True)
        check_int(record, "device", self.device, minimum=0, optional=True,
                  what="a device ordinal (an int >= 0) or None", maximum=MAX_DEVICE,
                  limit="below 2**31 (a C int)")
        check_str_tuple(record, "after", self.after, item="a node name (str)",
                        expected="a node name (str) or a list/tuple of node names")
        self._check()
        accesses = self.accesses()
        object.__setattr__(self, "_accesses", accesses)
        devices = {a.buffer.device for a in accesses if not a.buffer.is_host}
        if self.device is None:
            object.__setattr__(self, "device", min(devices) if devices else 0)
        if self.checks_device and devices - {self.device}:
            raise NodeFieldValueError(
                f"node {self.name} runs on device {self.device} but touches buffers on device(s) "
                f"{sorted(devices - {self.device})}: use a peer copy to move data between devices")

    #: every device buffer it touches is on ``device`` (a peer copy touches two devices)
    checks_device: ClassVar[bool] = True
    #: it runs on a stream of ``device`` (False: a host function, which any stream may run)
    device_bound: ClassVar[bool] = True

    def _check(self) -> None:
        """The kind's own field checks (called before ``accesses()`` is first used)."""

    def _check_range(self, field: str, *, device: bool | None = None) -> None:
        """Field ``field`` holds a `BufferRange` (the converter made one of a buffer); with
        ``device`` True / False it must be of a device / host buffer."""
        value = getattr(self, field)
        if not isinstance(value, BufferRange):
            raise NodeFieldTypeError(f"{self._record}: {field} must be {_RANGE}, got {got(value)}")
        if device is not None and value.buffer.is_host == device:
            want, have = ("device", "host") if device else ("host", "device")
            raise NodeFieldTypeError(f"{self._record}: {field} must be a {want} buffer; got"
                                     f" {value.buffer.name} ({have})")

    def accesses(self) -> tuple[Access, ...]:
        raise NotImplementedError  # abstract: every node kind defines its accesses

    def buffers(self) -> tuple:
        """The distinct buffers this node touches, in declaration order."""
        seen: dict[Any, Buffer | HostBuffer] = {}
        for a in self.accesses():
            seen.setdefault(a.buffer.key, a.buffer)
        return tuple(seen.values())


def _device_buffer(node, value, what):
    if not isinstance(value, Buffer):
        raise NodeFieldTypeError(f"{node._record}: {what} must be a device Buffer (not a range or"
                                 f" host buffer), got {got(value)}")


@attrs.frozen
class Alloc(Node):
    """Allocate ``buffer`` stream-ordered (``cuMemAllocAsync``); a write of all its bytes.

    Immutable: may be shared between threads freely.
    """

    buffer: Buffer
    engine: ClassVar[str] = "memory"
    kind: ClassVar[str] = "alloc"

    def _check(self):
        _device_buffer(self, self.buffer, "buffer")

    def accesses(self):
        return (Access(self.buffer.whole, Mode.WRITE),)


@attrs.frozen
class Free(Node):
    """Free ``buffer`` stream-ordered (``cuMemFreeAsync``); a write of all its bytes, so it
    follows every use.

    Immutable: may be shared between threads freely.
    """

    buffer: Buffer
    engine: ClassVar[str] = "memory"
    kind: ClassVar[str] = "free"

    def _check(self):
        _device_buffer(self, self.buffer, "buffer")

    def accesses(self):
        return (Access(self.buffer.whole, Mode.WRITE),)


def _copy_check(node, want_src_host: bool):
    node._check_range("src", device=not want_src_host)
    node._check_range("dst", device=want_src_host)
    src, dst = node.src, node.dst
    if src.nbytes != dst.nbytes:
        raise NodeFieldValueError(f"{node._record}: src {src} has {src.nbytes} bytes but dst"
                                  f" {dst} has {dst.nbytes}; sizes must match")


COPY_LOWERINGS = ("auto", "kernel", "copy-engine")
"""How a host copy may be lowered: ``"auto"`` (the executor chooses by size, see
docs/graphs.md), ``"kernel"`` (a copy kernel: the SMs load or store the pinned host memory
through its unified address; a kernel node in a CUDA graph) or ``"copy-engine"``
(``cuMemcpy*Async``, a memcpy node in a CUDA graph)."""


def check_copy_lowering(record: str, field: str, value) -> None:
    """`NodeFieldTypeError` / `NodeFieldValueError` unless ``value`` is one of
    `COPY_LOWERINGS`."""
    if not isinstance(value, str):
        raise NodeFieldTypeError(f"{record}: {field} must be one of "
                                 f"{', '.join(map(repr, COPY_LOWERINGS))}; got {got(value)}")
    if value not in COPY_LOWERINGS:
        raise NodeFieldValueError(f"{record}: {field} must be one of "
                                  f"{', '.join(map(repr, COPY_LOWERINGS))}; got {value!r}")


@attrs.frozen
class _HostCopy(Node):
    """A copy between pinned host memory and a device buffer: reads ``src``, writes ``dst``.
    Subclasses declare ``src`` and ``dst`` (with their own converters) and ``src_is_host``.

    ``lowering`` (keyword, default ``"auto"``): how the executors run the copy, one of
    `COPY_LOWERINGS`; a node's own choice wins over the executor's and the build's."""

    src_is_host: ClassVar[bool]
    lowering: str = attrs.field(default="auto", kw_only=True)
    if TYPE_CHECKING:  # fields of each subclass (with its own converter), not of this class
        src: BufferRange
        dst: BufferRange

    def _check(self):
        _copy_check(self, self.src_is_host)
        check_copy_lowering(self._record, "lowering", self.lowering)

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    def accesses(self):
        return (Access(self.src, Mode.READ), Access(self.dst, Mode.WRITE))


@attrs.frozen
class HostToDevice(_HostCopy):
    """Copy ``src`` (host, pinned) to ``dst`` (device): ``cuMemcpyHtoDAsync``, or a copy kernel
    (``lowering=``, see `_HostCopy`).

    Immutable: may be shared between threads freely.
    """

    src: BufferRange = attrs.field(converter=to_range)
    dst: BufferRange = attrs.field(converter=to_range)
    engine: ClassVar[str] = "upload"
    kind: ClassVar[str] = "h2d"
    src_is_host: ClassVar[bool] = True


@attrs.frozen
class DeviceToHost(_HostCopy):
    """Copy ``src`` (device) to ``dst`` (host, pinned): ``cuMemcpyDtoHAsync``, or a copy kernel
    (``lowering=``, see `_HostCopy`).

    Immutable: may be shared between threads freely.
    """

    src: BufferRange = attrs.field(converter=to_range)
    dst: BufferRange = attrs.field(converter=to_range)
    engine: ClassVar[str] = "download"
    kind: ClassVar[str] = "d2h"
    src_is_host: ClassVar[bool] = False


@attrs.frozen
class PeerCopy(Node):
    """Copy ``src`` (a device range) to ``dst`` (a device range on another GPU, or on the same
    one): ``cuMemcpyPeerAsync``, a memcpy node in built graphs.

    ``device`` is the GPU whose stream runs the copy: ``src``'s device by default (a push),
    or ``dst``'s (a pull); any other is refused. The executors enable peer access for the pair
    once (``cuCtxEnablePeerAccess`` and the memory pools' access) and refuse a pair whose
    devices cannot reach each other, naming it. Both ranges on one device make a plain
    device-to-device copy (``cuMemcpyDtoDAsync``), so code written for several GPUs runs on
    one. Sizes must match.

    Immutable: may be shared between threads freely.
    """

    src: BufferRange = attrs.field(converter=to_range)
    dst: BufferRange = attrs.field(converter=to_range)
    engine: ClassVar[str] = "peer"
    kind: ClassVar[str] = "peer_copy"
    checks_device: ClassVar[bool] = False

    def _check(self):
        self._check_range("src", device=True)
        self._check_range("dst", device=True)
        src, dst = self.src, self.dst
        if src.nbytes != dst.nbytes:
            raise NodeFieldValueError(f"{self._record}: src {src} has {src.nbytes} bytes but dst"
                                      f" {dst} has {dst.nbytes}; sizes must match")
        if src.overlaps(dst):
            raise NodeFieldValueError(f"{self._record}: src {src} and dst {dst} overlap; a copy"
                                      " needs disjoint ranges")
        ends = (src.buffer.device, dst.buffer.device)
        if self.device is None:
            object.__setattr__(self, "device", ends[0])
        elif self.device not in ends:
            raise NodeFieldValueError(
                f"{self._record}: device {self.device} is neither the source's device "
                f"({ends[0]}) nor the destination's ({ends[1]}); a peer copy runs on a stream "
                "of one of its two devices")

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    @property
    def peer(self) -> int:
        """The other device of the copy (``device`` itself for a copy within one device)."""
        a, b = self.src.buffer.device, self.dst.buffer.device
        other = b if self.device == a else a
        return int(other) if other is not None else int(self.device or 0)

    def accesses(self):
        return (Access(self.src, Mode.READ), Access(self.dst, Mode.WRITE))


@attrs.frozen
class Memset(Node):
    """Fill ``dst`` (device) with ``value`` repeated as ``element_size``-byte elements
    (``cuMemsetD8/D16/D32Async``). To poison float32 with NaN: value=0x7FC00000, element_size=4.

    Immutable: may be shared between threads freely.
    """

    dst: BufferRange = attrs.field(converter=to_range)
    value: int
    element_size: int = attrs.field(default=1)
    kind: ClassVar[str] = "memset"

    def _check(self):
        self._check_range("dst", device=True)
        es = self.element_size
        check_int(self._record_of, "element_size", es, what="1, 2 or 4 (bytes)")
        if es not in (1, 2, 4):
            raise NodeFieldValueError(f"{self._record}: element_size must be 1, 2 or 4; got {es!r}")
        if self.dst.offset % es or self.dst.nbytes % es:
            raise NodeFieldValueError(f"{self._record}: {self.dst} is not a whole number of "
                                      f"{es}-byte elements")
        bits = 8 * es
        expected = f"an int that fits {es} byte(s)"
        check_int(self._record_of, "value", self.value, what=expected)
        if not -(1 << (bits - 1)) <= self.value < (1 << bits):
            raise NodeFieldValueError(f"{self._record}: value must be {expected}; got"
                                      f" {self.value!r}")

    @property
    def unsigned_value(self) -> int:
        """``value`` as the unsigned int the driver call takes."""
        return self.value & ((1 << (8 * self.element_size)) - 1)

    def accesses(self):
        return (Access(self.dst, Mode.WRITE),)


# -- kernel arguments -----------------------------------------------------------------------


@attrs.frozen
class In:
    """A kernel argument the kernel only reads.

    Immutable: may be shared between threads freely.
    """

    target: BufferRange = attrs.field(converter=lambda x: as_range(x, "In(...)"))
    mode: ClassVar[Mode] = Mode.READ


@attrs.frozen
class Out:
    """A kernel argument the kernel only writes.

    Immutable: may be shared between threads freely.
    """

    target: BufferRange = attrs.field(converter=lambda x: as_range(x, "Out(...)"))
    mode: ClassVar[Mode] = Mode.WRITE


@attrs.frozen
class InOut:
    """A kernel argument the kernel reads and writes.

    Immutable: may be shared between threads freely.
    """

    target: BufferRange = attrs.field(converter=lambda x: as_range(x, "InOut(...)"))
    mode: ClassVar[Mode] = Mode.READ_WRITE


def _is_scalar(x) -> bool:
    # numpy scalars register with the numbers ABCs; the duck test covers other array scalars.
    return isinstance(x, numbers.Number) or (hasattr(x, "dtype") and hasattr(x, "item")
                                             and getattr(x, "shape", None) == ())


#: CUDA's launch limits on every GPU CUDA 13 supports (CUDA C++ Programming Guide,
#: "Compute Capabilities", technical specifications table: maximum x-dimension of a grid
#: 2**31-1, y and z 65535; maximum x/y-dimension of a block 1024, z 64; 1024 threads per
#: block). `KernelNode` refuses a launch outside them when it is made; what depends on the
#: device (shared memory, a kernel's own thread limit) is checked at launch (`check_launch`).
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_THREADS_PER_BLOCK = 1024
#: Dynamic shared memory is an unsigned int to ``cuLaunchKernel``; the device's own (much
#: lower) opt-in limit is checked at the launch.
MAX_SHARED_MEM = 2**32 - 1


def _is_whole(v) -> bool:
    """An int, numpy integer or other `numbers.Integral`, not a bool (numpy's bool is no
    Integral); a plain int without the ABC check (the common case, per node)."""
    if type(v) is int:
        return True
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _dim3(value):
    """Converter: an int or a list/tuple of 1-3 ints (numpy integers too) -> ``(x, y, z)`` of
    Python ints; anything else unchanged (`KernelNode` names the field)."""
    if type(value) is int:  # the common case first: a node is made per batch
        return (value, 1, 1)
    if _is_whole(value):
        value = (value,)
    if isinstance(value, (list, tuple)) and 1 <= len(value) <= 3 \
            and all(_is_whole(v) for v in value):
        return tuple(int(v) for v in value) + (1,) * (3 - len(value))
    return value


def _check_dim3(node, field: str) -> None:
    value = getattr(node, field)
    expected = "an int or a tuple of 1-3 ints"
    if not (isinstance(value, tuple) and len(value) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise NodeFieldTypeError(f"{node._record}: {field} must be {expected}, got {got(value)}")
    if any(v < 1 for v in value):
        raise NodeFieldValueError(f"{node._record}: {field} must be positive ({expected} >= 1),"
                                  f" got {_dims_text(value)}")
    limits = MAX_GRID_DIM if field == "grid" else MAX_BLOCK_DIM
    x, y, z = value
    if x <= limits[0] and y <= limits[1] and z <= limits[2] and (
            field == "grid" or x * y * z <= MAX_THREADS_PER_BLOCK):
        return  # within every limit: the usual case, no loop
    for axis, v, lim in zip("xyz", value, limits):
        if v > lim:
            fix = (("use fewer blocks (a grid-stride loop in the kernel) or split the launch"
                    if axis == "x" else "put the blocks in grid x (up to 2**31-1) instead")
                   if field == "grid" else
                   "use fewer threads per block and more blocks")
            whole = "" if value[1:] == (1, 1) else f", in {field} {_dims_text(value)}"
            raise NodeFieldValueError(
                f"{node._record}: {field} {axis} = {int_text(v)} is above CUDA's limit of "
                f"{lim} ({field}Dim.{axis} on every GPU){whole}: {fix}")
    if field == "block" and value[0] * value[1] * value[2] > MAX_THREADS_PER_BLOCK:
        raise NodeFieldValueError(
            f"{node._record}: block {value!r} has {value[0] * value[1] * value[2]} threads, "
            f"above CUDA's limit of {MAX_THREADS_PER_BLOCK} threads per block: use fewer "
            "threads per block and more blocks")


def _dims_text(value: tuple) -> str:
    """``(x, y, z)`` as written, a huge int as its magnitude (`int_text`)."""
    return "(" + ", ".join(int_text(v) for v in value) + ")"


def _args(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _attributes(value):
    """Converter: a mapping or pairs -> sorted ``((name, value), ...)``; else unchanged."""
    if isinstance(value, dict):
        value = value.items()
    try:
        return tuple(sorted((str(k), v) for k, v in value))
    except (TypeError, ValueError):
        return value  # not pairs: KernelNode names the field


@attrs.frozen
class KernelNode(Node):
    """Launch ``kernel`` with ``grid`` x ``block`` threads and ``args``.

    Arguments are scalars (int, float, numpy scalar; passed as is, packed by the compiler from
    the kernel's parameter types), device buffers: ``In(b)``, ``Out(b)``, ``InOut(b)``, or a
    bare `Buffer`/`BufferRange`, which is a read for a declared ``const T*`` parameter and a
    read-write otherwise, or a `Condition` for a ``cudaGraphConditionalHandle`` parameter (the
    kernel sets the condition: a write of it; the executor passes the handle). ``shared_mem``
    is dynamic shared memory in bytes; ``attributes`` are launch attributes (name -> value),
    kept sorted.

    ``grid`` and ``block``: an int or 1-3 ints (numpy integers too), padded with 1 to
    ``(x, y, z)``. A dimension below 1 or past CUDA's limits on every GPU (`MAX_GRID_DIM`,
    `MAX_BLOCK_DIM`, `MAX_THREADS_PER_BLOCK`) is a `NodeFieldValueError` (a ``ValueError``)
    when the node is made, a wrong type a `NodeFieldTypeError`; what depends on the device
    (its shared memory, a kernel's register-limited threads) is checked at the launch
    (``cuLaunchKernel``'s limits, `orchestra.compiler.launch.check_launch`).

    Immutable (frozen; its arguments are scalars and frozen buffer records): may be shared between
    threads freely.
    """

    kernel: KernelRef
    grid: tuple[int, int, int] = attrs.field(converter=_dim3)
    block: tuple[int, int, int] = attrs.field(converter=_dim3)
    args: tuple = attrs.field(default=(), converter=_args)
    shared_mem: int = attrs.field(default=0, converter=as_int)
    attributes: tuple = attrs.field(default=(), converter=_attributes)
    kind: ClassVar[str] = "kernel"

    def _check(self):
        if not isinstance(self.kernel, KernelRef):
            raise NodeFieldTypeError(f"{self._record}: kernel must be a KernelRef, got"
                                     f" {got(self.kernel)}")
        _check_dim3(self, "grid")
        _check_dim3(self, "block")
        check_int(self._record_of, "shared_mem", self.shared_mem, minimum=0,
                  what="an int >= 0 (bytes)", maximum=MAX_SHARED_MEM,
                  limit="below 2**32 (cuLaunchKernel's unsigned int sharedMemBytes); a "
                        "GPU's own limit is far lower (227 KiB on an H100 or H200)")
        r = self._record_of
        if not isinstance(self.attributes, tuple):
            raise NodeFieldTypeError(f"{r()}: attributes must be a mapping of launch attribute"
                                     f" name -> value, got {got(self.attributes)}")
        if not isinstance(self.args, tuple):
            raise NodeFieldTypeError(f"{r()}: args must be a tuple or list of kernel arguments, got"
                                     f" {got(self.args)}")
        for i, a in enumerate(self.args):
            if isinstance(a, Condition):
                continue  # a conditional handle argument
            if isinstance(a, (In, Out, InOut, Buffer, BufferRange)):
                target = a.target if isinstance(a, (In, Out, InOut)) else as_range(a)
                if target.buffer.is_host:
                    raise NodeFieldTypeError(f"{r()}: argument {i} is host buffer "
                                             f"{target.buffer.name}; kernels take device buffers")
            elif isinstance(a, HostBuffer):
                raise NodeFieldTypeError(f"{r()}: argument {i} is host buffer {a.name}; "
                                         f"kernels take device buffers")
            elif not _is_scalar(a):
                raise NodeFieldTypeError(f"{r()}: argument {i} ({a!r}) is neither a scalar nor a"
                                         f" buffer (In/Out/InOut/Buffer/BufferRange) or a"
                                         f" Condition")

    def accesses(self):
        out = []
        for i, a in enumerate(self.args):
            if isinstance(a, (In, Out, InOut)):
                out.append(Access(a.target, a.mode))
            elif isinstance(a, (Buffer, BufferRange)):
                out.append(Access(as_range(a), self.kernel.default_mode(i)))
            elif isinstance(a, Condition):
                out.append(Access(a.whole, Mode.WRITE))  # the kernel sets the condition
        return tuple(out)


def _ranges(xs):
    """Converter: a list/tuple of buffers or ranges -> tuple of ranges (bad items unchanged:
    `HostFunc` names them); a single buffer or range -> a 1-tuple."""
    if isinstance(xs, (Buffer, HostBuffer, BufferRange)):
        xs = (xs,)
    return tuple(to_range(x) for x in xs) if isinstance(xs, (list, tuple)) else xs


@attrs.frozen
class HostFunc(Node):
    """Run ``fn()`` on a host thread in stream order (``cuLaunchHostFunc``).

    ``reads``/``writes`` name the host (and, for managed memory, device) buffers it touches.
    ``fn`` must not call CUDA: the driver forbids it inside a host function.

    Immutable (frozen): the record may be shared between threads freely. ``fn`` itself is the
    caller's: it runs on a thread the driver or the executor chooses, never the submitting one, so
    whatever it touches must be safe to touch from another thread.
    """

    fn: Callable[[], Any]
    reads: tuple = attrs.field(default=(), converter=_ranges)
    writes: tuple = attrs.field(default=(), converter=_ranges)
    engine: ClassVar[str] = "host"
    kind: ClassVar[str] = "host"
    checks_device: ClassVar[bool] = False
    device_bound: ClassVar[bool] = False

    def _check(self):
        if not callable(self.fn):
            raise NodeFieldTypeError(f"{self._record}: fn must be callable (a function taking no"
                                     f" arguments), got {got(self.fn)}")
        for field in ("reads", "writes"):
            value = getattr(self, field)
            if not isinstance(value, tuple):
                raise NodeFieldTypeError(f"{self._record}: {field} must be a list/tuple of"
                                         f" buffers or ranges, got {got(value)}")
            for i, r in enumerate(value):
                if not isinstance(r, BufferRange):
                    raise NodeFieldTypeError(f"{self._record}: {field}[{i}] must be {_RANGE},"
                                             f" got {got(r)}")

    def accesses(self):
        return (tuple(Access(r, Mode.READ) for r in self.reads)
                + tuple(Access(r, Mode.WRITE) for r in self.writes))


def _check_body(node, field: str, value) -> None:
    """``value`` (field ``field``) is a `TaskGraph` (checked by duck type: this module is
    below `orchestra.graph.taskgraph`)."""
    if not (hasattr(value, "nodes") and hasattr(value, "topological_order")):
        raise NodeFieldTypeError(f"{node._record}: {field} must be a TaskGraph, got {got(value)}")


@attrs.frozen
class ChildGraph(Node):
    """Run ``graph`` (a `TaskGraph`) as one node of this graph: a CUDA child graph node
    (``cuGraphAddChildGraphNode``), built node by node into the embedded graph (graph-build) or
    captured into it (capture); the eager executor runs its nodes in place, on the node's
    stream. It accesses, as a whole, what ``graph`` touches (`orchestra.graph.bodies`), so
    happens-before runs through it.

    The driver refuses graph memory nodes (`Alloc`, `Free`) and conditional nodes inside a
    child graph: checked before any CUDA call (`BodyRestrictionError`). A child graph node
    cannot be disabled (``cuGraphNodeSetEnabled``); its nodes are not replayed one by one (see
    `orchestra.execute.lowering.bodies`). Node names are unique across the graph and the child.

    Thread-safety: the record is frozen, but its bodies are `TaskGraph` objects held by reference:
    share the node between threads only once its bodies are complete (no further `add` to them, see
    `TaskGraph`). `TaskGraph.add` recomputes the node's cached accesses when it is added (an
    idempotent write).
    """

    graph: Any
    kind: ClassVar[str] = "child"

    def _check(self):
        _check_body(self, "graph", self.graph)

    @property
    def bodies(self) -> tuple:
        return (self.graph,)

    def accesses(self):
        return body_accesses(self.bodies)


def _cases(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


@attrs.frozen
class Conditional(Node):
    """Base of the conditional nodes `If`, `While` and `Switch`: body task graphs run or not,
    or in a loop, on the GPU's say-so: a CUDA conditional node (``CU_GRAPH_NODE_TYPE_CONDITIONAL``)
    testing ``condition``, a `Condition` a kernel sets with ``cudaGraphSetConditional`` (before
    the node, or inside a loop body for the next test; CUDA Programming Guide, "Conditional Graph
    Nodes").

    The node accesses, as a whole, what its bodies touch (`orchestra.graph.bodies`), plus a read
    of the condition (and of its flag), so the kernel that sets the condition is ordered before
    it and happens-before runs through it. Bodies hold only what the driver allows there:
    kernels, copies, memsets, child graphs and other conditional nodes (checked before any CUDA
    call, `BodyRestrictionError`). Node names are unique across the graph and its bodies. The
    graph executors build a conditional node; the eager executor takes the branch on the host
    by reading the condition's ``flag`` back (a condition without one is refused there, naming
    the graph executors). Nodes inside bodies are not replayed one by one
    (`orchestra.execute.lowering.bodies`).

    Thread-safety: the record is frozen, but its bodies are `TaskGraph` objects held by reference:
    share the node between threads only once its bodies are complete (no further `add` to them, see
    `TaskGraph`). `TaskGraph.add` recomputes the node's cached accesses when it is added (an
    idempotent write).
    """

    condition: Condition
    kind: ClassVar[str] = "conditional"
    cond_type: ClassVar[str] = ""  # "if" / "while" / "switch": each subclass's own

    def _check(self):
        if type(self) is Conditional:
            raise NodeFieldTypeError(f"{self._record}: Conditional is the base of If, While and "
                                     "Switch; make one of those")
        if not isinstance(self.condition, Condition):
            raise NodeFieldTypeError(f"{self._record}: condition must be a Condition, got "
                                     f"{got(self.condition)}")

    @property
    def tests(self) -> Condition:  # type: ignore[override]
        return self.condition

    def accesses(self):
        cond = self.condition
        out = body_accesses(self.bodies) + (Access(cond.whole, Mode.READ),)
        if cond.flag is not None:
            out += (Access(cond.flag, Mode.READ),)
        return out


@attrs.frozen
class If(Conditional):
    """Run ``then`` (a `TaskGraph`) once when the condition is non-zero, else ``otherwise``
    (optional): an IF conditional node (size 2 with an ``otherwise``: IF / ELSE).

    Thread-safety: the record is frozen, but its bodies are `TaskGraph` objects held by reference:
    share the node between threads only once its bodies are complete (no further `add` to them, see
    `TaskGraph`). `TaskGraph.add` recomputes the node's cached accesses when it is added (an
    idempotent write).
    """

    then: Any
    otherwise: Any = None
    cond_type: ClassVar[str] = "if"

    def _check(self):
        super()._check()
        _check_body(self, "then", self.then)
        if self.otherwise is not None:
            _check_body(self, "otherwise", self.otherwise)

    @property
    def bodies(self) -> tuple:
        return (self.then,) if self.otherwise is None else (self.then, self.otherwise)


@attrs.frozen
class While(Conditional):
    """Run ``body`` (a `TaskGraph`) while the condition is non-zero: tested when the node is
    reached and after every run of the body, which sets it for the next test (a WHILE
    conditional node). Give the condition a default (1 runs the body at least once) or set it
    before the node.

    Thread-safety: the record is frozen, but its bodies are `TaskGraph` objects held by reference:
    share the node between threads only once its bodies are complete (no further `add` to them, see
    `TaskGraph`). `TaskGraph.add` recomputes the node's cached accesses when it is added (an
    idempotent write).
    """

    body: Any
    cond_type: ClassVar[str] = "while"

    def _check(self):
        super()._check()
        _check_body(self, "body", self.body)

    @property
    def bodies(self) -> tuple:
        return (self.body,)


@attrs.frozen
class Switch(Conditional):
    """Run ``cases[v]`` (a list of `TaskGraph`) once, where ``v`` is the condition's value;
    nothing when ``v >= len(cases)`` (a SWITCH conditional node).

    Thread-safety: the record is frozen, but its bodies are `TaskGraph` objects held by reference:
    share the node between threads only once its bodies are complete (no further `add` to them, see
    `TaskGraph`). `TaskGraph.add` recomputes the node's cached accesses when it is added (an
    idempotent write).
    """

    cases: tuple = attrs.field(converter=_cases)
    cond_type: ClassVar[str] = "switch"

    def _check(self):
        super()._check()
        if not isinstance(self.cases, tuple) or not self.cases:
            raise NodeFieldTypeError(f"{self._record}: cases must be a non-empty list of "
                                     f"TaskGraphs, got {got(self.cases)}")
        for i, case in enumerate(self.cases):
            _check_body(self, f"cases[{i}]", case)

    @property
    def bodies(self) -> tuple:
        return self.cases

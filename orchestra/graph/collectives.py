"""NCCL collectives and point-to-point transfers as node records (pure Python, no NCCL).

Each node is one rank's part of a collective: the graph of rank ``r`` holds rank ``r``'s
``AllReduce`` (and its buffers, on rank ``r``'s device); every rank of the communicator must
run the same collectives in the same order (NCCL's rule). The executors run the node on its
stream with the NCCL call of its kind (``ncclAllReduce``, ``ncclAllGather``,
``ncclReduceScatter``, ``ncclBroadcast``, ``ncclSend`` / ``ncclRecv``), eagerly or inside a
stream capture, so a collective is a node of a captured CUDA graph like any other.

``comm`` is the rank's communicator: any object with int attributes ``rank``, ``nranks`` and
``device`` (the ordinal of its GPU), normally an `orchestra.nccl.Communicator`. The node's
``device`` is the communicator's; every buffer it touches must be on it. Element counts come
from the byte sizes and ``dtype`` (a NCCL element type by numpy name: ``"float32"``,
``"int64"``, ``"bfloat16"``...).

Sizes (bytes, ``n`` = ``comm.nranks``):

    AllReduce       send and recv the same size; in place when send is recv
    AllGather       recv = n x send; in place when send is recv's chunk ``rank``
    ReduceScatter   send = n x recv; in place when recv is send's chunk ``rank``
    Broadcast       send and recv the same size; ``root``'s send is read, every recv written
    Send / Recv     one range each, to / from rank ``peer``
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from orchestra.errors import NodeFieldTypeError, NodeFieldValueError
from orchestra.graph.buffers import Access, BufferRange, Mode, to_range
from orchestra.graph.fields import check_int, got
from orchestra.graph.nodes import Node

#: NCCL element types by numpy-style name -> bytes per element
DTYPES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
          "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2}
#: reduction operators (``ncclSum`` ...)
OPS = ("sum", "prod", "max", "min", "avg")


def dtype_name(value) -> Any:
    """Converter: a numpy dtype, a numpy scalar type or a name -> its name (``"float32"``);
    anything else unchanged (the node names the field)."""
    if isinstance(value, str):
        return value
    name = getattr(value, "name", None)  # np.dtype
    if isinstance(name, str):
        return name
    name = getattr(value, "__name__", None)  # np.float32
    return name if isinstance(name, str) else value


@attrs.frozen
class Collective(Node):
    """Base of the NCCL node kinds: ``comm`` and ``dtype``; subclasses add their ranges.

    Immutable (frozen): may be shared between threads freely. ``comm`` is held by reference, not
    copied: running the node follows `Communicator`'s rules (NCCL operations on one communicator
    are issued by one thread at a time).
    """

    comm: Any = attrs.field(kw_only=True)
    dtype: str = attrs.field(default="float32", kw_only=True, converter=dtype_name)
    engine: ClassVar[str] = "compute"  # NCCL runs kernels on the SMs
    kind: ClassVar[str] = "collective"
    call: ClassVar[str] = ""  # the NCCL function
    #: the range fields, in the order the NCCL call takes them
    range_fields: ClassVar[tuple[str, ...]] = ()

    def _check(self):
        comm = self.comm
        for attr in ("rank", "nranks", "device"):
            value = getattr(comm, attr, None)
            if isinstance(value, bool) or not isinstance(value, int):
                raise NodeFieldTypeError(
                    f"{self._record}: comm must be a communicator (an object with int rank, "
                    f"nranks and device, e.g. orchestra.nccl.Communicator), got {got(comm)}")
        if not 0 <= comm.rank < comm.nranks:
            raise NodeFieldValueError(f"{self._record}: comm has rank {comm.rank} of "
                                      f"{comm.nranks}; a rank is in [0, nranks)")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise NodeFieldValueError(f"{self._record}: dtype must be one of "
                                      f"{', '.join(DTYPES)}; got {self.dtype!r}")
        size = DTYPES[self.dtype]
        for field in self.range_fields:
            self._check_range(field, device=True)
            r = getattr(self, field)
            if r.buffer.device != comm.device:
                raise NodeFieldValueError(
                    f"{self._record}: {field} {r} is on device {r.buffer.device} but the "
                    f"communicator (rank {comm.rank}) is on device {comm.device}; a collective "
                    "reads and writes its own rank's device")
            if r.nbytes % size:
                raise NodeFieldValueError(f"{self._record}: {field} {r} has {r.nbytes} bytes, "
                                          f"not a whole number of {self.dtype} ({size} bytes)")
        if self.device is not None and self.device != comm.device:
            raise NodeFieldValueError(f"{self._record}: device {self.device} is not the "
                                      f"communicator's device {comm.device}")
        object.__setattr__(self, "device", comm.device)
        self._check_kind()

    def _check_kind(self) -> None:
        """The kind's own size and rank checks."""

    def _peer_rank(self, field: str) -> None:
        value = getattr(self, field)
        check_int(self._record_of, field, value, minimum=0, what="a rank (an int >= 0)")
        if value >= self.comm.nranks:
            raise NodeFieldValueError(f"{self._record}: {field} {value} is not a rank of the "
                                      f"communicator ({self.comm.nranks} ranks)")

    def _op(self) -> None:
        op = getattr(self, "op")
        if op not in OPS:
            raise NodeFieldValueError(f"{self._record}: op must be one of {', '.join(OPS)}; "
                                      f"got {op!r}")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    if TYPE_CHECKING:  # each kind's own property
        @property
        def count(self) -> int:
            """The element count the NCCL call takes (``sendcount`` / ``recvcount``)."""

    def _check_peer_is_another_rank(self, advice: str) -> None:
        """``peer`` is a rank of the communicator other than this one; ``advice`` ends the
        message (what to do instead)."""
        peer = getattr(self, "peer")
        self._peer_rank("peer")
        if peer == self.comm.rank:
            raise NodeFieldValueError(f"{self._record}: peer {peer} is this rank; {advice}")


@attrs.frozen
class _SendRecvCollective(Collective):
    """Base of the kinds with a ``send`` and a ``recv`` range (in that order in the call)."""

    send: BufferRange = attrs.field(converter=to_range)
    recv: BufferRange = attrs.field(converter=to_range)
    range_fields: ClassVar[tuple[str, ...]] = ("send", "recv")

    def _check_same_size_in_place_or_disjoint(self, what: str) -> None:
        """send and recv of one size, either one range (in place) or disjoint (the
        all-reduce and broadcast rule); ``what`` names the kind in the message."""
        if self.send.nbytes != self.recv.nbytes:
            raise NodeFieldValueError(f"{self._record}: send has {self.send.nbytes} bytes, "
                                      f"recv {self.recv.nbytes}; {what} keeps the size")
        if self.send != self.recv and self.send.overlaps(self.recv):
            raise NodeFieldValueError(f"{self._record}: send {self.send} and recv {self.recv} "
                                      "overlap; use one range for both (in place) or disjoint")

    def _check_overlap(self, inner: str, outer: BufferRange, offset: int) -> None:
        """send and recv may overlap only in NCCL's in-place layout: ``inner`` (the
        smaller one) is ``outer``'s chunk at ``offset`` bytes."""
        send, recv = self.send, self.recv
        if not send.overlaps(recv) or send == recv:
            return
        small = send if inner == "send" else recv
        if small.buffer.key == outer.buffer.key and small.offset == outer.offset + offset:
            return
        raise NodeFieldValueError(
            f"{self._record}: send {send} and recv {recv} overlap; in place, {inner} must be "
            f"chunk {self.comm.rank} of the other (bytes [{outer.offset + offset}, "
            f"{outer.offset + offset + small.nbytes}) of {outer.buffer.name})")

    def _chunk_accesses(self, outer: BufferRange):
        """Accesses of a gather / scatter: in place (the smaller range is a chunk of
        ``outer``, the only overlap `_check_overlap` lets through) ``outer`` is one
        read-write; otherwise send is read and recv written."""
        if self.send.overlaps(self.recv):
            return (Access(outer, Mode.READ_WRITE),)
        return (Access(self.send, Mode.READ), Access(self.recv, Mode.WRITE))


@attrs.frozen
class AllReduce(_SendRecvCollective):
    """``recv = op(send of every rank)`` (``ncclAllReduce``); in place when send is recv.

    Immutable (frozen): may be shared between threads freely. ``comm`` is held by reference, not
    copied: running the node follows `Communicator`'s rules (NCCL operations on one communicator
    are issued by one thread at a time).
    """

    op: str = attrs.field(default="sum", kw_only=True)
    kind: ClassVar[str] = "all_reduce"
    call: ClassVar[str] = "ncclAllReduce"

    def _check_kind(self):
        self._op()
        self._check_same_size_in_place_or_disjoint("an all-reduce")

    @property
    def count(self) -> int:
        return self.recv.nbytes // self.itemsize

    def accesses(self):
        if self.send == self.recv:
            return (Access(self.recv, Mode.READ_WRITE),)
        return (Access(self.send, Mode.READ), Access(self.recv, Mode.WRITE))


@attrs.frozen
class AllGather(_SendRecvCollective):
    """Every rank's send, concatenated in rank order, into every rank's recv
    (``ncclAllGather``; ``count`` = send elements).

    Immutable (frozen): may be shared between threads freely. ``comm`` is held by reference, not
    copied: running the node follows `Communicator`'s rules (NCCL operations on one communicator
    are issued by one thread at a time).
    """

    kind: ClassVar[str] = "all_gather"
    call: ClassVar[str] = "ncclAllGather"

    def _check_kind(self):
        n = self.comm.nranks
        if self.recv.nbytes != n * self.send.nbytes:
            raise NodeFieldValueError(f"{self._record}: recv has {self.recv.nbytes} bytes; an "
                                      f"all-gather of {self.send.nbytes} bytes over {n} ranks "
                                      f"needs {n * self.send.nbytes}")
        self._check_overlap("send", self.recv, self.comm.rank * self.send.nbytes)

    @property
    def count(self) -> int:
        return self.send.nbytes // self.itemsize

    def accesses(self):
        return self._chunk_accesses(outer=self.recv)  # in place: own chunk read, all written


@attrs.frozen
class ReduceScatter(_SendRecvCollective):
    """Chunk ``rank`` of ``op(send of every rank)`` into recv (``ncclReduceScatter``;
    ``count`` = recv elements).

    Immutable (frozen): may be shared between threads freely. ``comm`` is held by reference, not
    copied: running the node follows `Communicator`'s rules (NCCL operations on one communicator
    are issued by one thread at a time).
    """

    op: str = attrs.field(default="sum", kw_only=True)
    kind: ClassVar[str] = "reduce_scatter"
    call: ClassVar[str] = "ncclReduceScatter"

    def _check_kind(self):
        self._op()
        n = self.comm.nranks
        if self.send.nbytes != n * self.recv.nbytes:
            raise NodeFieldValueError(f"{self._record}: send has {self.send.nbytes} bytes; a "
                                      f"reduce-scatter into {self.recv.nbytes} bytes over {n} "
                                      f"ranks needs {n * self.recv.nbytes}")
        self._check_overlap("recv", self.send, self.comm.rank * self.recv.nbytes)

    @property
    def count(self) -> int:
        return self.recv.nbytes // self.itemsize

    def accesses(self):
        return self._chunk_accesses(outer=self.send)


@attrs.frozen
class Broadcast(_SendRecvCollective):
    """Rank ``root``'s send into every rank's recv (``ncclBroadcast``); send is read on the
    root only (other ranks may pass recv as send).

    Immutable (frozen): may be shared between threads freely. ``comm`` is held by reference, not
    copied: running the node follows `Communicator`'s rules (NCCL operations on one communicator
    are issued by one thread at a time).
    """

    root: int = attrs.field(default=0, kw_only=True)
    kind: ClassVar[str] = "broadcast"
    call: ClassVar[str] = "ncclBroadcast"

    def _check_kind(self):
        self._peer_rank("root")
        self._check_same_size_in_place_or_disjoint("a broadcast")

    @property
    def count(self) -> int:
        return self.recv.nbytes // self.itemsize

    def accesses(self):
        if self.send == self.recv:
            mode = Mode.READ_WRITE if self.comm.rank == self.root else Mode.WRITE
            return (Access(self.recv, mode),)
        if self.comm.rank == self.root:
            return (Access(self.send, Mode.READ), Access(self.recv, Mode.WRITE))
        return (Access(self.recv, Mode.WRITE),)


@attrs.frozen
class Send(Collective):
    """Send ``src`` to rank ``peer`` (``ncclSend``); ``peer`` runs the matching `Recv`.

    Immutable (frozen): may be shared between threads freely. ``comm`` is held by reference, not
    copied: running the node follows `Communicator`'s rules (NCCL operations on one communicator
    are issued by one thread at a time).
    """

    src: BufferRange = attrs.field(converter=to_range)
    peer: int = attrs.field(kw_only=True)
    kind: ClassVar[str] = "send"
    call: ClassVar[str] = "ncclSend"
    range_fields: ClassVar[tuple[str, ...]] = ("src",)

    def _check_kind(self):
        self._check_peer_is_another_rank(
            "send to another rank (a copy within a rank is a PeerCopy)")

    @property
    def count(self) -> int:
        return self.src.nbytes // self.itemsize

    def accesses(self):
        return (Access(self.src, Mode.READ),)


@attrs.frozen
class Recv(Collective):
    """Receive into ``dst`` from rank ``peer`` (``ncclRecv``).

    Immutable (frozen): may be shared between threads freely. ``comm`` is held by reference, not
    copied: running the node follows `Communicator`'s rules (NCCL operations on one communicator
    are issued by one thread at a time).
    """

    dst: BufferRange = attrs.field(converter=to_range)
    peer: int = attrs.field(kw_only=True)
    kind: ClassVar[str] = "recv"
    call: ClassVar[str] = "ncclRecv"
    range_fields: ClassVar[tuple[str, ...]] = ("dst",)

    def _check_kind(self):
        self._check_peer_is_another_rank("receive from another rank")

    @property
    def count(self) -> int:
        return self.dst.nbytes // self.itemsize

    def accesses(self):
        return (Access(self.dst, Mode.WRITE),)


COLLECTIVES = (AllReduce, AllGather, ReduceScatter, Broadcast, Send, Recv)

__all__ = ["AllGather", "AllReduce", "Broadcast", "COLLECTIVES", "Collective", "DTYPES", "OPS",
           "ReduceScatter", "Recv", "Send", "dtype_name"]

"""`GraphBuilder`: build a `TaskGraph` with calls that read like the work they describe.

    with GraphBuilder() as g:
        x = g.host_input("x", nbytes)
        y = g.host_output("y", nbytes)
        dx = g.to_device(x)                      # a device buffer the graph allocates and frees
        dy = g.device_buffer(nbytes)             # likewise
        g.kernel(scale, grid, 256, (In(dx), Out(dy), n, 2.0))
        g.to_host(dy, y)
    graph = g.graph                              # a plain TaskGraph

Node names are optional (generated, see `orchestra.graph.names`). Device buffers made by
`device_buffer` and `to_device` are *graph allocations*: the builder inserts their `Alloc`
right before the first node that uses them and their `Free` right after the last one, so the
schedulers, the hazard verifier and every executor see ordinary `Alloc` / `Free` nodes. (They
are not CUDA managed, i.e. unified, memory: they are stream-ordered allocations, or memory
nodes of a CUDA graph.)

The builder keeps the nodes in call order and writes the `TaskGraph` when it closes, because
only then is each buffer's last use known: the graph is exactly the one the same nodes added to
a `TaskGraph` by hand in that order give, with each `Alloc` just before its buffer's first use
and each `Free` just after its last (its edges are inferred as always: the `Free` writes every
byte, so it follows every use). Everything a `TaskGraph` would refuse is refused at the call
that causes it, and nothing is changed by a refused call; only what the whole graph shows (an
``after=`` naming no node, a cycle) waits for the close.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from bisect import bisect_right
from typing import Any, Callable, TypeVar

import attrs

from orchestra.errors import (
    BufferLifetimeError,
    BuilderClosedError,
    GraphError,
    HostBufferUseError,
    NameCollisionError,
    NodeFieldTypeError,
    NotReadyError,
)
from orchestra.graph.buffers import Buffer, BufferRange, HostBuffer, as_range
from orchestra.graph.fields import check_int, got
from orchestra.graph.kernel_ref import KernelRef
from orchestra.graph.names import NameCounter, check_user_name, label
from orchestra.graph.nodes import (
    Alloc,
    DeviceToHost,
    Free,
    HostFunc,
    HostToDevice,
    KernelNode,
    Memset,
    Node,
)
from orchestra.graph.taskgraph import TaskGraph

_OPEN, _CLOSED, _FAILED = "open", "closed", "failed"
N = TypeVar("N", bound=Node)

# Every builder alive, to recognise a graph allocation of another builder passed to this one
# (a plain `Buffer` record cannot say who made it). Builders of different threads share it.
_BUILDERS: "weakref.WeakSet[GraphBuilder]" = weakref.WeakSet()
_BUILDERS_LOCK = threading.Lock()


@attrs.frozen
class Lifetime:
    """The nodes that bound a graph-allocated buffer's life: ``alloc`` (inserted right before
    its first use) and ``free`` (right after its last use), by name. Both exist in the graph
    once the buffer is used; ``after=`` may name them before the builder closes.

    Immutable: may be shared between threads freely.
    """

    buffer: Buffer
    alloc: str
    free: str
    batch: int | None = None
    after: tuple[str, ...] = ()


@attrs.define
class _Owned:
    """A graph allocation being built: its lifetime and the call-order index of its first and
    last use (None until used)."""

    life: Lifetime
    name_base: str | None = None  # the counter its generated name came from
    node_bases: tuple = (None, None)  # likewise for its Alloc and Free names
    first: int | None = None
    last: int | None = None


class _Unread:
    """Host bytes written and not read since, as sorted disjoint ``[start, end)`` runs with
    the node that wrote each (so a second write over them can name the first)."""

    __slots__ = ("starts", "ends", "nodes")

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.nodes: list[str] = []

    def overlapping(self, start: int, end: int) -> range:
        """Indices of the runs that share a byte with ``[start, end)``."""
        i = bisect_right(self.starts, start) - 1
        if i < 0 or self.ends[i] <= start:
            i += 1
        j = i
        while j < len(self.starts) and self.starts[j] < end:
            j += 1
        return range(i, j)

    def remove(self, start: int, end: int) -> None:
        r = self.overlapping(start, end)
        if r:
            del self.starts[r.start:r.stop], self.ends[r.start:r.stop], self.nodes[r.start:r.stop]

    def add(self, start: int, end: int, node: str) -> None:
        r = self.overlapping(start, end)  # only runs of this same node can still overlap
        if r:
            start = min(start, self.starts[r.start])
            end = max(end, self.ends[r.stop - 1])
            self.remove(start, end)
        i = bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, end)
        self.nodes.insert(i, node)


class GraphBuilder:
    """Builds one `TaskGraph`; a context manager (the graph is written when the block ends) or
    plain calls ending in `build()`.

    Args:
        check_overwrites: refuse a node that writes host bytes an earlier node wrote with no
            node reading them in between (`HostBufferUseError`): the first write would be lost,
            which is almost always a mistake (two `to_host` calls into one output). Costs a
            bisection per host access.

    Every method that adds a node takes ``name`` (default: generated), ``after`` (node names,
    node records, or a graph-allocated buffer meaning its `Free`; one or a list) and ``batch``
    (default: the enclosing `batch()` block's). Node field checks are the records' own
    (`NodeFieldError`, naming the node). Errors: `NameCollisionError` (a taken name, or a user
    name with ``#``), `BufferLifetimeError`, `HostBufferUseError`, `BuilderClosedError` after
    close; the graph's own checks (`validate()`: unknown ``after=`` names, cycles) run at close.

    Thread-safety: a builder is used by one thread at a time; builders in different threads
    are independent. The graph it returns is a plain `TaskGraph`.
    """

    def __init__(self, *, check_overwrites: bool = True):
        self._state = _OPEN
        self._graph: TaskGraph | None = None
        self._ops: list[tuple[Node, tuple[_Owned, ...]]] = []  # node, graph allocations it uses
        self._node_names: set[str] = set()
        self._nodes = NameCounter()
        self._buffer_names = NameCounter()
        self._buffers: dict[str, Buffer | HostBuffer] = {}
        self._owned: dict[str, _Owned] = {}
        self._made: dict[int, Buffer | HostBuffer] = {}  # id -> object, for identity checks
        self._roles: dict[str, str] = {}  # host buffer name -> "input" / "output" / "buffer"
        self._written: set[str] = set()  # host outputs some node writes
        self._read: set[str] = set()  # host inputs some node reads
        self._unread: dict[str, _Unread] = {}
        self._check_overwrites = bool(check_overwrites)
        self._batch: int | None = None
        with _BUILDERS_LOCK:
            _BUILDERS.add(self)

    # -- life of the builder ----------------------------------------------------------------

    def __enter__(self) -> "GraphBuilder":
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.build()
            except BaseException:
                self._fail()
                raise
        elif self._state == _OPEN:
            self._fail()  # the graph is never written

    def _fail(self) -> None:
        self._state = _FAILED
        self._ops = []

    def build(self) -> TaskGraph:
        """Write the graph and close the builder; later calls return the same graph.

        Raises `HostBufferUseError` for a host input no node reads or a host output no node
        writes, and what `TaskGraph.validate` raises (an ``after=`` naming no node, a cycle); after such an
        error the builder is unchanged and still open (the with block's end closes it).
        """
        if self._graph is not None:
            return self._graph
        self._check_open()
        unread = [n for n, role in self._roles.items() if role == "input" and n not in self._read]
        if unread:
            these, it = ("them", "them") if len(unread) > 1 else ("it", "it")
            raise HostBufferUseError(
                f"host input(s) {', '.join(unread)}: declared with host_input() but no node"
                f" reads {these}, so the array the caller binds would never reach the GPU (and"
                f" a run would refuse the binding as unknown): read {it} (g.to_device(input),"
                f" or a host_func with reads=), or remove the host_input() call")
        unwritten = [n for n, role in self._roles.items()
                     if role == "output" and n not in self._written]
        if unwritten:
            raise HostBufferUseError(
                f"host output(s) {', '.join(unwritten)}: no node writes them, so the caller"
                f" would read back whatever the array held: copy a result into each"
                f" (g.to_host(device_buffer, output)), or declare it with host_buffer() if that"
                f" is intended")
        graph = TaskGraph()
        for i, (node, mine) in enumerate(self._ops):
            for o in mine:
                if o.first == i:
                    life = o.life
                    graph.add(Alloc(life.alloc, life.buffer, batch=life.batch, after=life.after))
            graph.add(node)
            for o in mine:
                if o.last == i:
                    graph.add(Free(o.life.free, o.life.buffer, batch=o.life.batch))
        graph.validate()
        self._graph = graph
        self._state = _CLOSED
        self._ops = []
        return graph

    @property
    def closed(self) -> bool:
        """True once the builder closed (its graph written, or a failure ended it)."""
        return self._state != _OPEN

    @property
    def graph(self) -> TaskGraph:
        """The `TaskGraph`, once the builder closed (`NotReadyError` before)."""
        if self._graph is not None:
            return self._graph
        if self._state == _FAILED:
            raise NotReadyError("this GraphBuilder closed without a graph: an exception ended"
                                " its with block or its build(); fix it and build again")
        raise NotReadyError("the graph is written when the builder closes: read .graph after"
                            " the with block ends, or call build()")

    def _check_open(self) -> None:
        if self._state != _OPEN:
            what = "its graph is built" if self._state == _CLOSED else "an exception ended it"
            raise BuilderClosedError(
                f"this GraphBuilder is closed ({what}) and takes no more nodes or buffers:"
                f" start a new GraphBuilder for another graph")

    @contextlib.contextmanager
    def batch(self, index: int | None):
        """Nodes and buffers made inside ``with g.batch(i):`` get ``batch=i`` unless given one
        (traces and plans group by it); blocks nest."""
        self._check_open()
        check_int("GraphBuilder.batch", "index", index, optional=True)
        before, self._batch = self._batch, index
        try:
            yield self
        finally:
            self._batch = before

    def __repr__(self):
        return (f"<GraphBuilder {self._state}: {len(self._ops)} node(s) so far, "
                f"{len(self._owned)} graph allocation(s)>")

    # -- buffers ----------------------------------------------------------------------------

    def host_input(self, name: str, nbytes: int) -> HostBuffer:
        """A host buffer the caller fills and the graph only reads (bound at run time to a
        pinned array of ``nbytes`` bytes under ``name``). A node writing it is refused, and so
        is closing the builder with no node reading it (`HostBufferUseError`)."""
        return self._host(name, nbytes, "input")

    def host_output(self, name: str, nbytes: int) -> HostBuffer:
        """A host buffer the graph writes and the caller reads after the run; closing the
        builder with no node writing it is refused."""
        return self._host(name, nbytes, "output")

    def host_buffer(self, name: str, nbytes: int) -> HostBuffer:
        """A host buffer the graph may read and write (a staging slot)."""
        return self._host(name, nbytes, "buffer")

    def _host(self, name, nbytes, role) -> HostBuffer:
        self._check_open()
        check_user_name("host buffer", name)
        buf = HostBuffer(name, nbytes)  # field checks
        self._check_new_buffer_name(name)
        self._buffers[name] = buf
        self._made[id(buf)] = buf
        self._roles[name] = role
        return buf

    def external_buffer(self, name: str, nbytes: int, *, device: int = 0) -> Buffer:
        """A device buffer the caller binds at every run (a `DeviceBuffer` of at least
        ``nbytes`` bytes under ``name``); the graph never allocates or frees it."""
        self._check_open()
        check_user_name("buffer", name)
        buf = Buffer(name, nbytes, device)
        self._check_new_buffer_name(name)
        self._buffers[name] = buf
        self._made[id(buf)] = buf
        return buf

    def device_buffer(self, nbytes: int, name: str | None = None, *, device: int = 0,
                      after=(), batch: int | None = None, alloc_name: str | None = None,
                      free_name: str | None = None) -> Buffer:
        """``nbytes`` bytes of device memory the graph allocates right before the first node
        that uses it and frees right after the last one (``cuMemAllocAsync`` /
        ``cuMemFreeAsync``, or memory nodes of a CUDA graph). ``name`` defaults to
        ``buf#<n>``; ``alloc_name`` / ``free_name`` to ``alloc:<name>#<n>`` / ``free:...``
        (`lifetime()` tells them). ``after``: what its `Alloc` must follow, e.g. another graph
        allocation (meaning its `Free`), so the memory pool can hand that memory on through an
        explicit event and device memory stays bounded. Never used, it costs nothing: no node
        is inserted."""
        self._check_open()
        owned = self._new_owned(nbytes, name, device, after, batch, base="buf",
                                alloc_name=alloc_name, free_name=free_name)
        self._commit_owned(owned)
        return owned.life.buffer

    def lifetime(self, buffer: Buffer) -> Lifetime:
        """The `Alloc` / `Free` names of a buffer this builder allocates."""
        o = self._owned.get(buffer.name) if isinstance(buffer, Buffer) else None
        if o is None or o.life.buffer != buffer:
            raise BufferLifetimeError(f"{got(buffer)} is not a buffer this builder allocates"
                                      " (make one with device_buffer() or to_device())")
        return o.life

    def _check_new_buffer_name(self, name: str) -> None:
        known = self._buffers.get(name)
        if known is not None:
            raise NameCollisionError(f"buffer name {name!r} is already taken by {known!r}:"
                                     " give different buffers different names")

    def _new_owned(self, nbytes, name, device, after, batch, *, base: str,
                   alloc_name: str | None = None, free_name: str | None = None) -> _Owned:
        """A graph allocation, checked but not yet registered (`_commit_owned` does that)."""
        name_base = None
        if name is None:
            name_base = base
            name = self._buffer_names.peek(base)
        else:
            check_user_name("buffer", name)
        buf = Buffer(name, nbytes, device)
        self._check_new_buffer_name(name)
        lab = label(name, "buf")
        names: list[tuple[str, str | None]] = []
        for kind, given in (("alloc", alloc_name), ("free", free_name)):
            if given is None:
                names.append((self._nodes.peek(f"{kind}:{lab}"), f"{kind}:{lab}"))
                continue
            check_user_name("node", given)
            if not isinstance(given, str) or not given:
                raise NodeFieldTypeError(f"GraphBuilder.device_buffer: {kind}_name must be a"
                                         f" non-empty str or None, got {got(given)}")
            if given in self._node_names:
                raise NameCollisionError(f"a node named {given!r} is already in the graph:"
                                         f" node names must be unique; pick another")
            names.append((given, None))
        if names[0][0] == names[1][0]:
            raise NameCollisionError(f"alloc_name and free_name are both {names[0][0]!r}:"
                                     f" node names must be unique")
        life = Lifetime(buf, names[0][0], names[1][0], self._batch if batch is None else batch,
                        self._after(after, "device_buffer"))
        return _Owned(life, name_base, (names[0][1], names[1][1]))

    def _commit_owned(self, owned: _Owned) -> None:
        buf = owned.life.buffer
        if owned.name_base is not None:
            self._buffer_names.take(owned.name_base)
        for base in owned.node_bases:
            if base is not None:
                self._nodes.take(base)
        self._node_names.update((owned.life.alloc, owned.life.free))
        self._buffers[buf.name] = buf
        self._made[id(buf)] = buf
        self._owned[buf.name] = owned

    # -- nodes ------------------------------------------------------------------------------

    def to_device(self, src, dst=None, *, name: str | None = None, device: int = 0, after=(),
                  batch: int | None = None):
        """Copy host ``src`` (a `HostBuffer` or a range of one) to the device
        (``cuMemcpyHtoDAsync``). ``dst``: a device buffer or range of the same size; default a
        new graph allocation of ``src``'s size on ``device``, named ``d_<host buffer>#<n>``.
        Returns ``dst`` (the new buffer)."""
        self._check_open()
        src_range = as_range(src, "GraphBuilder.to_device: src")
        if not src_range.buffer.is_host:
            raise NodeFieldTypeError(f"GraphBuilder.to_device: src must be a host buffer or a"
                                     f" range of one, got device buffer {src_range.buffer.name}")
        owned = None
        if dst is None:
            owned = self._new_owned(src_range.nbytes, None, device, (), batch,
                                    base="d_" + label(src_range.buffer.name, "host"))
            dst = owned.life.buffer
        node_name = self._node_name(name, "h2d", src_range.buffer.name)
        node = HostToDevice(node_name, src, dst, **self._node_kw(after, batch, "to_device"))
        self._push(node, generated=name is None, new=owned)
        return dst

    def to_host(self, src, dst, *, name: str | None = None, after=(),
                batch: int | None = None) -> DeviceToHost:
        """Copy device ``src`` (buffer or range) to host ``dst`` (a `HostBuffer` or range of
        the same size; ``cuMemcpyDtoHAsync``). Returns the node."""
        self._check_open()
        dst_buf = dst.buffer if isinstance(dst, BufferRange) else dst
        node_name = self._node_name(name, "d2h", getattr(dst_buf, "name", "host"))
        node = DeviceToHost(node_name, src, dst, **self._node_kw(after, batch, "to_host"))
        return self._push(node, generated=name is None)

    def kernel(self, kernel: KernelRef, grid, block, args=(), *, name: str | None = None,
               shared_mem: int = 0, attributes=(), after=(), batch: int | None = None,
               device: int | None = None) -> KernelNode:
        """Launch ``kernel`` (a `KernelRef`) on ``grid`` x ``block`` with ``args`` (scalars, and
        device buffers bare or as ``In`` / ``Out`` / ``InOut``: see `KernelNode`). Returns the
        node, named ``kernel:<kernel name>#<n>`` by default."""
        self._check_open()
        node_name = self._node_name(name, "kernel", getattr(kernel, "name", "kernel"))
        node = KernelNode(node_name, kernel, grid, block, args, shared_mem, attributes,
                          device=device, **self._node_kw(after, batch, "kernel"))
        return self._push(node, generated=name is None)

    def memset(self, dst, value: int, element_size: int = 1, *, name: str | None = None,
               after=(), batch: int | None = None) -> Memset:
        """Fill device ``dst`` with ``value`` as ``element_size``-byte elements (see `Memset`).
        Returns the node."""
        self._check_open()
        dst_buf = dst.buffer if isinstance(dst, BufferRange) else dst
        node_name = self._node_name(name, "memset", getattr(dst_buf, "name", "memset"))
        node = Memset(node_name, dst, value, element_size,
                      **self._node_kw(after, batch, "memset"))
        return self._push(node, generated=name is None)

    def host_func(self, fn: Callable[[], Any], *, reads=(), writes=(), name: str | None = None,
                  after=(), batch: int | None = None) -> HostFunc:
        """Run ``fn()`` on a host thread in stream order (see `HostFunc`; it must not call
        CUDA). Returns the node, named ``host:<function name>#<n>`` by default."""
        self._check_open()
        node_name = self._node_name(name, "host", getattr(fn, "__name__", "fn"))
        node = HostFunc(node_name, fn, reads, writes, **self._node_kw(after, batch, "host_func"))
        return self._push(node, generated=name is None)

    def add(self, node: N) -> N:
        """Add a node record made by hand (any kind), under its own name. `Alloc` / `Free` of
        a buffer this builder allocates are refused: it inserts those itself."""
        self._check_open()
        if not isinstance(node, Node):
            raise NodeFieldTypeError(f"GraphBuilder.add takes a node record (KernelNode,"
                                     f" HostToDevice, ...), got {got(node)}")
        if isinstance(node, (Alloc, Free)) and node.buffer.name in self._owned:
            life = self._owned[node.buffer.name].life
            raise BufferLifetimeError(
                f"{type(node).__name__} {node.name}: buffer {node.buffer.name} is allocated by"
                f" the graph itself ({life.alloc} before its first use, {life.free} after its"
                f" last): drop this node, or make the buffer with external_buffer() and give it"
                f" both an Alloc and a Free")
        return self._push(node, generated=False)

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes added so far, in call order (without the inserted `Alloc` / `Free`)."""
        return tuple(node for node, _ in self._ops)

    # -- helpers ----------------------------------------------------------------------------

    def _node_name(self, name, kind: str, what: str) -> str:
        if name is None:
            return self._nodes.peek(f"{kind}:{label(what, kind)}")
        check_user_name("node", name)
        return name

    def _node_kw(self, after, batch, method: str) -> dict:
        return {"after": self._after(after, method),
                "batch": self._batch if batch is None else batch}

    def _after(self, after, method: str) -> tuple[str, ...]:
        """``after=`` items -> node names: a str as is, a node its name, a graph allocation
        its `Free`."""
        items = after if isinstance(after, (list, tuple)) else (after,)
        out = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, Node):
                out.append(item.name)
            elif isinstance(item, Buffer) and item.name in self._owned \
                    and self._owned[item.name].life.buffer == item:
                out.append(self._owned[item.name].life.free)
            else:
                raise NodeFieldTypeError(
                    f"GraphBuilder.{method}: after[{i}] must be a node name, a node, or a buffer"
                    f" this builder allocates (meaning its Free), got {got(item)}")
        return tuple(out)

    def _foreign_owner(self, buf) -> "GraphBuilder | None":
        with _BUILDERS_LOCK:
            others = list(_BUILDERS)
        for other in others:
            if other is not self and buf.name in other._owned and other._made.get(id(buf)) is buf:
                return other
        return None

    def _check_buffer(self, buf, node: Node) -> bool:
        """Is ``buf`` usable by ``node`` here? True when it is not known yet (the caller
        registers it on success)."""
        known = self._buffers.get(buf.name)
        if known is buf:
            return False
        if known is None or known == buf:
            if not buf.is_host and self._made.get(id(buf)) is not buf:
                other = self._foreign_owner(buf)
                if other is not None:
                    cls, state = ((BuilderClosedError, "closed") if other.closed
                                  else (BufferLifetimeError, "still open"))
                    raise cls(
                        f"{type(node).__name__} {node.name}: buffer {buf.name} is allocated by"
                        f" another GraphBuilder ({state}); its memory exists only inside that"
                        f" builder's graph: make a buffer with this builder (device_buffer(),"
                        f" to_device()), or an external_buffer() both graphs bind")
            if known is None:
                check_user_name("buffer", buf.name)
                return True
            return False
        raise NameCollisionError(
            f"{type(node).__name__} {node.name}: buffer name {buf.name!r} already names"
            f" {known!r}, not {buf!r}; give different buffers different names")

    def _push(self, node: N, *, generated: bool, new: _Owned | None = None) -> N:
        """Check ``node`` against the builder (every check before any change), then add it."""
        name = node.name
        if name in self._node_names:
            raise NameCollisionError(
                f"a node named {name!r} is already in the graph: node names must be unique;"
                f" pick another, or leave the name out to get a generated one")
        if not generated:
            check_user_name("node", name)
        if name in node.after:
            raise GraphError(f"node {name!r} lists itself in after=")
        new_name = new.life.buffer.name if new is not None else None
        accesses = node.accesses()
        buffers: dict = {}  # key -> buffer, in declaration order (Node.buffers(), once)
        host = []
        for a in accesses:
            buf = a.range.buffer
            buffers.setdefault(buf.key, buf)
            if buf.is_host:
                host.append(a)
        fresh = [buf for buf in buffers.values()
                 if buf.name != new_name and self._check_buffer(buf, node)]
        if host:
            self._check_host(node, host)
        # -- accepted: commit
        if new is not None:
            self._commit_owned(new)
        if generated:
            self._nodes.take(name.rsplit("#", 1)[0])
        self._node_names.add(name)
        for buf in fresh:
            self._buffers[buf.name] = buf
        index = len(self._ops)
        owned = self._owned
        mine = tuple(owned[b.name] for b in buffers.values()
                     if not b.is_host and b.name in owned)
        for o in mine:
            if o.first is None:
                o.first = index
            o.last = index
        self._ops.append((node, mine))
        if host:
            self._record_host(node, host)
        return node

    def _check_host(self, node: Node, host) -> None:
        for acc in host:
            buf = acc.buffer
            if acc.mode.writes and self._roles.get(buf.name) == "input":
                raise HostBufferUseError(
                    f"{type(node).__name__} {node.name} writes {acc.range}, but {buf.name} is a"
                    f" host input (the caller fills it; the graph only reads it): write to a"
                    f" host_output() instead, or declare it with host_buffer() if the graph"
                    f" reads and writes it")
        if not self._check_overwrites:
            return
        reads = [a.range for a in host if a.mode.reads]
        for acc in host:
            if not acc.mode.writes:
                continue
            r = acc.range
            runs = self._unread.get(r.buffer.name)
            if runs is None:
                continue
            for i in runs.overlapping(r.offset, r.end):
                s, e, writer = runs.starts[i], runs.ends[i], runs.nodes[i]
                if writer == node.name:
                    continue
                if any(q.buffer.name == r.buffer.name and q.offset < e and s < q.end
                       for q in reads):
                    continue  # this node reads those bytes first
                lo, hi = max(s, r.offset), min(e, r.end)
                raise HostBufferUseError(
                    f"{type(node).__name__} {node.name} writes host buffer {r.buffer.name}"
                    f" bytes [{lo}, {hi}), which {writer} wrote and no node has read since:"
                    f" {writer}'s data would be lost. Write to another host buffer or range, or"
                    f" add the node that reads them in between (e.g. a host_func with reads=);"
                    f" GraphBuilder(check_overwrites=False) allows it")

    def _record_host(self, node: Node, host) -> None:
        for acc in host:
            role = self._roles.get(acc.buffer.name)
            if acc.mode.writes and role == "output":
                self._written.add(acc.buffer.name)
            elif acc.mode.reads and role == "input":
                self._read.add(acc.buffer.name)
        if not self._check_overwrites:
            return
        for acc in host:
            if acc.mode.reads:
                runs = self._unread.get(acc.buffer.name)
                if runs is not None:
                    runs.remove(acc.range.offset, acc.range.end)
        for acc in host:
            if acc.mode.writes:
                r = acc.range
                self._unread.setdefault(r.buffer.name, _Unread()).add(r.offset, r.end, node.name)


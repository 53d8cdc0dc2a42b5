"""The batch: allocate -> H2D -> kernel -> D2H -> free, as graph nodes.

Names for batch ``i``: buffers ``b{i}.in`` and ``b{i}.out`` (device), ``b{i}.host_in`` and
``b{i}.host_out`` (host slots, unless the caller passes ranges of its own host buffers); nodes
``b{i}.alloc_in``, ``b{i}.alloc_out``, ``b{i}.h2d``, ``b{i}.kernel``, ``b{i}.d2h``,
``b{i}.free_in``, ``b{i}.free_out``. Separate input and output buffers let a run poison the outputs
and verify every element; ``in_place=True`` uses one buffer ``b{i}.buf`` instead.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from functools import partial
from itertools import accumulate, chain, repeat
from typing import Any, Callable, Sequence, cast

import attrs

from orchestra.errors import GraphError, NodeFieldTypeError
from orchestra.graph.fields import check_int, got, is_int
from orchestra.graph.buffers import Access, Buffer, BufferRange, HostBuffer, Mode, as_range
from orchestra.graph.kernel_ref import KernelRef
from orchestra.graph.nodes import Alloc, DeviceToHost, Free, HostToDevice, In, KernelNode, Node, Out
from orchestra.graph.taskgraph import TaskGraph
from orchestra.graph.trusted import make_columns, maker, set_column

def elementwise_args(inp: Buffer, out: Buffer, n: int, scalars: tuple) -> tuple:
    """Kernel arguments ``(In(inp), Out(out), n, *scalars)``: the elementwise convention
    ``kernel(const T* in, T* out, size_t n, ...scalars)``, the default `add_batch` layout."""
    return (In(inp), Out(out), n, *scalars)


ArgLayout = Callable[[Buffer, Buffer, int, tuple], tuple]


@attrs.frozen
class Batch:
    """The buffers and nodes of one batch (``alloc_out``/``free_out`` are None when in place).

    Immutable (frozen; its nodes and buffers are frozen too): may be shared between threads freely.
    """

    index: int
    input: Buffer
    output: Buffer
    host_in: BufferRange
    host_out: BufferRange
    alloc_in: Alloc
    alloc_out: Alloc | None
    h2d: HostToDevice
    kernel: KernelNode
    d2h: DeviceToHost
    free_in: Free
    free_out: Free | None

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The batch's nodes in program order."""
        return tuple(n for n in (self.alloc_in, self.alloc_out, self.h2d, self.kernel, self.d2h,
                                 self.free_in, self.free_out) if n is not None)

    @property
    def nbytes(self) -> int:
        return self.input.nbytes


def add_batch(graph: TaskGraph, *, index: int, kernel: KernelRef, nbytes: int, grid=None,
              block=256, scalars: tuple = (), host_in=None, host_out=None, element_size: int = 4,
              in_place: bool = False, arg_layout: ArgLayout = elementwise_args, device: int = 0,
              alloc_after: Sequence[str] = ()) -> Batch:
    """Add one batch of ``nbytes`` bytes (``nbytes // element_size`` elements) to ``graph``.

    ``host_in``/``host_out``: a `HostBuffer` or `BufferRange` of ``nbytes`` bytes, or None for a
    fresh host slot per batch. ``grid`` defaults to enough blocks of ``block`` threads to cover
    every element once. ``arg_layout(in, out, n, scalars)`` gives the kernel's arguments (default
    `elementwise_args`: input, output, element count, then ``scalars``).
    ``alloc_after``: names of nodes (typically an earlier batch's frees) the allocations must
    follow, so the memory pool can reuse that memory through an explicit event.

    Raises `GraphError` (`NodeFieldTypeError` / `NodeFieldValueError` naming the record and the
    field) for a bad value, `NameCollisionError` for a name the graph has; the nodes added
    before the failing one stay in ``graph``. Not thread-safe (it adds to ``graph``).
    """
    if nbytes % element_size:
        raise GraphError(f"batch {index}: {nbytes} bytes is not a whole number of "
                         f"{element_size}-byte elements")
    n = nbytes // element_size
    p = f"b{index}."
    inp = Buffer(p + ("buf" if in_place else "in"), nbytes, device)
    out = inp if in_place else Buffer(p + "out", nbytes, device)
    hin = as_range(host_in if host_in is not None else HostBuffer(p + "host_in", nbytes), "host_in")
    hout = as_range(host_out if host_out is not None else HostBuffer(p + "host_out", nbytes), "host_out")
    if grid is None:
        bx = block if isinstance(block, int) else block[0] if isinstance(block, tuple) and \
            block else None
        # a block that is no positive int leaves grid 1: KernelNode names the bad block
        grid = max(1, -(-n // bx)) if type(bx) is int and bx >= 1 else 1
    kw: dict[str, Any] = dict(batch=index, device=device)
    after = tuple(alloc_after)
    alloc_in = graph.add(Alloc(p + ("alloc" if in_place else "alloc_in"), inp, after=after, **kw))
    alloc_out = None if in_place else graph.add(Alloc(p + "alloc_out", out, after=after, **kw))
    h2d = graph.add(HostToDevice(p + "h2d", hin, inp, **kw))
    knode = graph.add(KernelNode(p + "kernel", kernel, grid, block,
                                 arg_layout(inp, out, n, tuple(scalars)), **kw))
    d2h = graph.add(DeviceToHost(p + "d2h", out, hout, **kw))
    free_in = graph.add(Free(p + ("free" if in_place else "free_in"), inp, **kw))
    free_out = None if in_place else graph.add(Free(p + "free_out", out, **kw))
    return Batch(index, inp, out, hin, hout, alloc_in, alloc_out, h2d, knode, d2h, free_in, free_out)


def _wholes(buffers: list, sizes: Sequence[int], m: int) -> list:
    """The whole range of each of ``buffers`` (made, and kept as their ``whole``)."""
    wholes = make_columns(BufferRange, _RANGE, (buffers, repeat(0), sizes), m)
    set_column(type(buffers[0]), "_whole", buffers, wholes)
    return wholes


def _bulk_reasons(pattern, allocs, ins, outs, hins, houts, afters) -> list[tuple[str, ...]]:
    """`_edge_reasons` of every node of `_Batches.bulk`'s batches, in program order."""
    out: list[tuple[str, ...]] = []
    for names in zip(ins, outs, hins, houts, afters):
        out += _edge_reasons(pattern, names[:4], allocs, names[4])
    return out


# a batch's nodes, in program order, as `_Batches.bulk` makes them
_BULK_NODES = ("alloc_in", "alloc_out", "h2d", "kernel", "d2h", "free_in", "free_out")
# the names the batches give their buffers (a host buffer named so: the checked path)
_GENERATED = re.compile(r"b[0-9]+\.(in|out|buf|host_in|host_out)")
_BUFFER = ("name", "nbytes", "device", "_whole")
_HOST = ("name", "nbytes", "_whole")
_RANGE = ("buffer", "offset", "nbytes")
_ACCESS = ("range", "mode")
_KERNEL = ("kernel", "grid", "block", "args", "shared_mem", "attributes")
_BATCH = tuple(f.name for f in attrs.fields(Batch))

# Records of the batches after the first (`_Batches`), made without their checks (`trusted`).
_make_buffer = maker(Buffer, "name", "nbytes", "device", "_whole")
_make_host = maker(HostBuffer, "name", "nbytes", "_whole")
_make_range = maker(BufferRange, "buffer", "offset", "nbytes")
_make_access = maker(Access, "range", "mode")
_make_in = maker(In, "target")
_make_out = maker(Out, "target")
_NODE = ("name", "batch", "device", "after", "_accesses")
_make_alloc = maker(Alloc, *_NODE, "buffer")
_make_free = maker(Free, *_NODE, "buffer")
_make_h2d = maker(HostToDevice, *_NODE, "lowering", "src", "dst")
_make_d2h = maker(DeviceToHost, *_NODE, "lowering", "src", "dst")
_make_kernel = maker(KernelNode, *_NODE, "kernel", "grid", "block", "args", "shared_mem",
                     "attributes")
_make_batch = maker(Batch, *(f.name for f in attrs.fields(Batch)))
_READ, _WRITE = Mode.READ, Mode.WRITE


def _whole(make, *fields):
    """A new buffer (``make(*fields, None)``) with its whole range made at once."""
    buf = make(*fields, None)
    object.__setattr__(buf, "_whole", _make_range(buf, 0, buf.nbytes))
    return buf


def _host_range(value, nbytes):
    """``as_range(value)`` when ``value`` is a host buffer or range of ``nbytes`` bytes (what
    `add_batch` accepts without an error), else None (the checked path decides)."""
    t = type(value)
    if t is BufferRange:
        return value if type(value.buffer) is HostBuffer and value.nbytes == nbytes else None
    if t is HostBuffer:
        return value.whole if value.nbytes == nbytes else None
    return None


ROLES = ("in", "out", "host_in", "host_out")  # a batch's buffers, as `_learn_edges` names them


def _edge_reasons(pattern, names, allocs, afters) -> list[tuple[str, ...]]:
    """Per node of a batch: its edges' reasons (`TaskGraph.edge_reason`), from the first
    batch's ``pattern`` (`_Batches._learn_edges`), the batch's buffer names by role, and the
    number of ``after=`` edges of each of its allocations ``allocs`` (places in the batch)."""
    after = ("after",) * afters
    return [tuple([kind + names[role] for _, kind, role in items]) + (after if j in allocs
                                                                      else ())
            for j, items in enumerate(pattern)]


class _Batches:
    """Adds batches of one shape (`add_batch`'s keywords other than the per-batch ``index``,
    ``nbytes``, ``host_in``, ``host_out``, ``alloc_after``) to a graph.

    The first batch goes through `add_batch`, every record checked; it proves the shape (the
    kernel, grid, block, scalars, device and argument layout are the same for every batch).
    A later batch whose own values pass the cheap checks here (an int index, a positive int
    size that is a whole number of elements, host ranges of that size, ``alloc_after`` a tuple
    of names) is made with trusted records: the same objects `add_batch` would make, without
    running each field check again. Any other batch goes through `add_batch`, which raises the
    error it always raised. The default argument layout is trusted too; any other
    `ArgLayout` is called per batch and its kernel node is checked.

    Edges: the first batch, added to an empty graph, also shows which edges the dependency
    tracker infers inside a batch (`_learn_edges`). A later batch touches fresh device buffers
    (and fresh host slots, or host ranges past every byte of its host buffers touched
    before), so the tracker would infer exactly that pattern again, renamed, plus its
    ``alloc_after`` edges: such a batch is added with those edges (`TaskGraph._add_known`)
    instead of asking the tracker node by node. Anything else (another node added in
    between, a host range over bytes touched before, a name already taken) goes through
    `TaskGraph.add`.
    """

    def __init__(self, kernel: KernelRef, kwargs: dict):
        # kept as given: the first add_batch call refuses an unknown keyword as it always did
        self._kw = {"kernel": kernel, **kwargs}
        self._shape: tuple | None = None  # what the first batch proved (see _learn)
        self._edges: tuple | None = None  # the first batch's edges (see _learn_edges)
        self._added = 0  # nodes this builder added to the graph
        self._ends: dict[str, int] = {}  # host buffer name -> end of the bytes touched so far
        self._back: dict[tuple, tuple] = {}  # after= distances -> per node, its edges' distances

    def add(self, graph: TaskGraph, index, nbytes, host_in=None, host_out=None,
            alloc_after=()) -> Batch:
        shape = self._shape
        if shape is not None and type(index) is int and type(nbytes) is int and nbytes > 0 \
                and not nbytes % shape[0] and type(alloc_after) is tuple \
                and all(type(a) is str for a in alloc_after):
            hin = (_whole(_make_host, f"b{index}.host_in", nbytes)._whole if host_in is None
                   else _host_range(host_in, nbytes))
            hout = (_whole(_make_host, f"b{index}.host_out", nbytes)._whole if host_out is None
                    else _host_range(host_out, nbytes))
            if hin is not None and hout is not None:
                batch = self._trusted(graph, shape, index, nbytes, hin, hout, alloc_after,
                                      host_in is None, host_out is None)
                self._touched(batch)
                return batch
        before = len(graph)
        batch = add_batch(graph, index=index, nbytes=nbytes, host_in=host_in, host_out=host_out,
                          alloc_after=alloc_after, **self._kw)
        if self._shape is None:
            self._shape = self._learn(batch)
            if before == 0 and self._shape is not None:
                self._edges = self._learn_edges(graph, batch, host_in is None,
                                                host_out is None)
        self._added = len(graph) if self._added == before else -1
        self._touched(batch)
        return batch

    def _touched(self, batch: Batch) -> None:
        ends = self._ends
        for r in (batch.host_in, batch.host_out):
            name = r.buffer.name
            ends[name] = max(ends.get(name, 0), r.offset + r.nbytes)

    def _learn(self, batch: Batch) -> tuple | None:
        """``(element_size, device, kernel, grid, block, bx, scalars, default layout,
        in place)`` from
        the first (checked) batch, or None when a value is not of the plain types the trusted
        path computes with (then every batch is checked)."""
        get = self._kw.get  # add_batch's defaults for what was not given
        es, device, block, grid = get("element_size", 4), get("device", 0), get("block", 256), \
            get("grid")
        scalars = get("scalars", ())
        bx = block if isinstance(block, int) else block[0]
        if type(es) is not int or es < 1 or type(device) is not int or type(bx) is not int \
                or type(scalars) not in (tuple, list):
            return None
        k = batch.kernel
        return (es, device, k.kernel, None if grid is None else k.grid, k.block, bx,
                tuple(scalars), get("arg_layout", elementwise_args) is elementwise_args,
                bool(get("in_place", False)))

    @staticmethod
    def _learn_edges(graph: TaskGraph, batch: Batch, fresh_in: bool, fresh_out: bool):
        """The edges the tracker inferred for ``batch``, the first nodes of ``graph``: per
        node of the batch (program order), its ``(predecessor's place in the batch, "RAW " /
        "WAR " / "WAW ", buffer role)`` in the order of its predecessor dict, where the role
        names the batch's buffer of the edge's reason (an index into `ROLES`); then
        ``fresh_in``, ``fresh_out`` (its host ranges were fresh host slots), whether one host
        buffer serves both directions, the host buffers, and the places of the allocations
        (which ``alloc_after`` applies to). None when an edge is not of that form (then later
        batches ask the tracker)."""
        nodes = batch.nodes
        place = {n.name: j for j, n in enumerate(nodes)}
        roles = {}
        for role, buf in (("host_out", batch.host_out.buffer), ("host_in", batch.host_in.buffer),
                          ("out", batch.output), ("in", batch.input)):
            roles[buf.name] = role
        preds = graph.predecessor_map()
        pattern = []
        for node in nodes:
            items = []
            for pred, reason in preds[node.name].items():
                kind, _, bname = reason.partition(" ")
                if pred not in place or kind not in ("RAW", "WAR", "WAW") or bname not in roles:
                    return None
                items.append((place[pred], kind + " ", ROLES.index(roles[bname])))
            pattern.append(tuple(items))
        # the nodes alloc_after applies to: the allocations, first in the batch and without
        # inferred edges (their buffer is new), so after= edges follow no inferred ones
        allocs = tuple(j for j, n in enumerate(nodes) if n.kind == "alloc")
        if any(pattern[j] for j in allocs):
            return None
        hin, hout = batch.host_in, batch.host_out
        # one host buffer for both directions: the edges hold for batches whose two ranges of
        # it are the same bytes, as the first batch's were (else they are not learned)
        joint = hin.buffer.name == hout.buffer.name
        if joint and (hin.offset, hin.nbytes) != (hout.offset, hout.nbytes):
            return None
        return tuple(pattern), fresh_in, fresh_out, joint, hin.buffer, hout.buffer, allocs

    def _known_edges(self, graph, hin, hout, fresh_in, fresh_out, after):
        """Per node of a later batch with host ranges ``hin`` and ``hout`` (``fresh_*``: a
        new host slot) and ``alloc_after`` names ``after``: its predecessors' distances (see
        `TaskGraph._add_known`), from the first batch's edges (`_learn_edges`) and the
        ``after`` nodes' places; None when those edges may not hold for this batch."""
        learned = self._edges
        if learned is None or self._added != len(graph):
            return None
        pattern, f_in, f_out, joint, b_in, b_out, allocs = learned
        if fresh_in != f_in or fresh_out != f_out:
            return None
        ends = self._ends
        # a shared host buffer: the same object as the first batch's, touched here only past
        # every byte touched before (a fresh host slot is new, like the device buffers)
        if not fresh_in and (hin.buffer is not b_in or hin.offset < ends.get(b_in.name, 0)):
            return None
        if not fresh_out and (hout.buffer is not b_out or hout.offset < ends.get(b_out.name, 0)):
            return None
        if joint and (hin.offset, hin.nbytes) != (hout.offset, hout.nbytes):
            return None
        # the batch's names are new (`_add_known` takes that as given): its index is new, and
        # no shared host buffer bears a name the batches make (the checked path says so)
        if any(not fresh and _GENERATED.fullmatch(b.name) for fresh, b in
               ((fresh_in, hin.buffer), (fresh_out, hout.buffer))):
            return None
        start = len(graph)
        try:  # distances to the after= nodes from the batch's first node
            dist = tuple([start - graph.index(a) for a in after])
        except GraphError:
            return None  # an after= naming no node yet: add() keeps it waiting
        if len(set(after)) != len(after):
            return None
        return self._back_of(dist)

    def bulk(self, graph: TaskGraph, done: list, sizes: Sequence, offsets: Sequence[int],
             host_in, host_out, in_flight) -> list | None:
        """The batches after ``done`` (those added so far, the first one checked), of sizes
        ``sizes`` at host offsets ``offsets`` (`build_pipeline`'s consecutive slices of
        ``host_in`` / ``host_out``, or fresh host slots where those are None), made all at
        once: each field of each record kind set for every batch in one loop
        (`trusted.make_columns`), and added to ``graph`` with the first batch's edges
        (`TaskGraph._add_known`). The same records and edges as adding them one by one.
        None, having added nothing, when the batches are not all plain: then the caller adds
        them one by one (`add`)."""
        shape, learned = self._shape, self._edges
        if shape is None or learned is None or self._added != len(graph) or not sizes:
            return None
        es, device, kernel, grid, block, bx, scalars, default_layout, in_place = shape
        pattern, f_in, f_out, joint, b_in, b_out, allocs = learned
        if not default_layout or in_place or (host_in is None) != f_in \
                or (host_out is None) != f_out \
                or (host_in is not None and host_in is not b_in) \
                or (host_out is not None and host_out is not b_out) \
                or len(pattern) != len(_BULK_NODES):
            return None
        # a name the batches make, taken by a host buffer: the checked path says so
        if any(hb is not None and _GENERATED.fullmatch(hb.name) for hb in (host_in, host_out)):
            return None
        if any(type(x) is not int or x <= 0 or x % es for x in sizes) \
                or any(type(x) is not int for x in offsets):
            return None
        first = len(done)
        m = len(sizes)
        idx = range(first, first + m)
        pre = [f"b{i}." for i in idx]
        rep_dev = repeat(device)
        inp = make_columns(Buffer, _BUFFER, ([p + "in" for p in pre], sizes, rep_dev,
                                             repeat(None)), m)
        out = make_columns(Buffer, _BUFFER, ([p + "out" for p in pre], sizes, rep_dev,
                                             repeat(None)), m)
        w_in = _wholes(inp, sizes, m)
        w_out = _wholes(out, sizes, m)
        if host_in is None:
            hb_in = make_columns(HostBuffer, _HOST, ([p + "host_in" for p in pre], sizes,
                                                     repeat(None)), m)
            hin = _wholes(hb_in, sizes, m)
        else:
            hin = make_columns(BufferRange, _RANGE, (repeat(host_in), offsets, sizes), m)
        if host_out is None:
            hb_out = make_columns(HostBuffer, _HOST, ([p + "host_out" for p in pre], sizes,
                                                      repeat(None)), m)
            hout = _wholes(hb_out, sizes, m)
        else:
            hout = make_columns(BufferRange, _RANGE, (repeat(host_out), offsets, sizes), m)
        win = make_columns(Access, _ACCESS, (w_in, repeat(_WRITE)), m)
        rin = make_columns(Access, _ACCESS, (w_in, repeat(_READ)), m)
        wout = make_columns(Access, _ACCESS, (w_out, repeat(_WRITE)), m)
        rout = make_columns(Access, _ACCESS, (w_out, repeat(_READ)), m)
        rhin = make_columns(Access, _ACCESS, (hin, repeat(_READ)), m)
        whout = make_columns(Access, _ACCESS, (hout, repeat(_WRITE)), m)
        ns = [x // es for x in sizes]
        grids = (repeat(grid) if grid is not None else
                 [(max(1, -(-x // bx)), 1, 1) for x in ns])
        args = [(a, b, x, *scalars) for a, b, x in
                zip(make_columns(In, ("target",), (w_in,), m),
                    make_columns(Out, ("target",), (w_out,), m), ns)]
        # alloc_after: batch i follows batch i - in_flight's frees
        fin = [b.free_in.name for b in done] + [p + "free_in" for p in pre]
        fout = [b.free_out.name for b in done] + [p + "free_out" for p in pre]
        f = in_flight
        afters = [(fin[i - f], fout[i - f]) if f is not None and i >= f else () for i in idx]
        batch = list(idx)
        empty = repeat(())
        alloc_in = make_columns(Alloc, _NODE + ("buffer",), (
            [p + "alloc_in" for p in pre], batch, rep_dev, afters, [(a,) for a in win], inp), m)
        alloc_out = make_columns(Alloc, _NODE + ("buffer",), (
            [p + "alloc_out" for p in pre], batch, rep_dev, afters, [(a,) for a in wout], out),
            m)
        h2d = make_columns(HostToDevice, _NODE + ("lowering", "src", "dst"), (
            [p + "h2d" for p in pre], batch, rep_dev, empty, list(zip(rhin, win)),
            repeat("auto"), hin, w_in), m)
        knode = make_columns(KernelNode, _NODE + _KERNEL, (
            [p + "kernel" for p in pre], batch, rep_dev, empty, list(zip(rin, wout)),
            repeat(kernel), grids, repeat(block), args, repeat(0), empty), m)
        d2h = make_columns(DeviceToHost, _NODE + ("lowering", "src", "dst"), (
            [p + "d2h" for p in pre], batch, rep_dev, empty, list(zip(rout, whout)),
            repeat("auto"), w_out, hout), m)
        free_in = make_columns(Free, _NODE + ("buffer",), (
            fin[first:], batch, rep_dev, empty, [(a,) for a in win], inp), m)
        free_out = make_columns(Free, _NODE + ("buffer",), (
            fout[first:], batch, rep_dev, empty, [(a,) for a in wout], out), m)
        # program order: batch by batch, each in _BULK_NODES order
        nodes = list(chain.from_iterable(zip(alloc_in, alloc_out, h2d, knode, d2h, free_in,
                                             free_out)))
        n_nodes = len(pattern)
        # edges: the first batch's pattern; the allocations after the frees in_flight
        # batches before (as many places before as in_flight batches of nodes, less the
        # free's place in its batch)
        fpos = (_BULK_NODES.index("free_in"), _BULK_NODES.index("free_out"))
        plain = self._back_of(())
        late = self._back_of(tuple(f * n_nodes - j for j in fpos)) if f is not None else plain
        back = list(chain.from_iterable(
            late if f is not None and i >= f else plain for i in idx))
        new = list(chain.from_iterable(zip(inp, out, *([hb_in] if host_in is None else []),
                                           *([hb_out] if host_out is None else []))))
        reasons = partial(_bulk_reasons, pattern, allocs,
                          [x.name for x in inp], [x.name for x in out],
                          [r.buffer.name for r in hin], [r.buffer.name for r in hout],
                          [len(a) for a in afters])
        if not graph._add_known(nodes, back, reasons, new):
            return None
        self._added = len(graph)
        ends = self._ends
        for r in (hin[-1], hout[-1]):  # where later batches may start (`_known_edges`)
            ends[r.buffer.name] = max(ends.get(r.buffer.name, 0), r.offset + r.nbytes)
        return make_columns(Batch, _BATCH, (batch, inp, out, hin, hout, alloc_in, alloc_out,
                                            h2d, knode, d2h, free_in, free_out), m)

    def _back_of(self, dist: tuple) -> tuple:
        """Per node of a batch: its predecessors' distances (`TaskGraph._add_known`), the
        allocations' after= edges ``dist`` places before the batch's first node."""
        back = self._back.get(dist)
        if back is None:
            assert self._edges is not None  # learned from the first batch
            pattern, allocs = self._edges[0], self._edges[-1]
            back = tuple(tuple([j - p for p, _, _ in items])
                         + (tuple([d + j for d in dist]) if j in allocs else ())
                         for j, items in enumerate(pattern))
            self._back[dist] = back
        return back

    def _trusted(self, graph, shape, index, nbytes, hin, hout, after, fresh_in=False,
                 fresh_out=False) -> Batch:
        es, device, kernel, grid, block, bx, scalars, default_layout, in_place = shape
        n = nbytes // es
        p = f"b{index}."
        inp = _whole(_make_buffer, p + ("buf" if in_place else "in"), nbytes, device)
        out = inp if in_place else _whole(_make_buffer, p + "out", nbytes, device)
        win, rin = _make_access(inp._whole, _WRITE), _make_access(inp._whole, _READ)
        wout, rout = (win, rin) if in_place else (_make_access(out._whole, _WRITE),
                                                  _make_access(out._whole, _READ))
        if grid is None:
            grid = (max(1, -(-n // bx)), 1, 1)
        alloc_in = _make_alloc(p + ("alloc" if in_place else "alloc_in"), index, device,
                               after, (win,), inp)
        alloc_out = None if in_place else _make_alloc(p + "alloc_out", index, device, after,
                                                      (wout,), out)
        h2d = _make_h2d(p + "h2d", index, device, (), (_make_access(hin, _READ), win),
                        "auto", hin, inp._whole)
        if default_layout:  # elementwise_args: (In(inp), Out(out), n, *scalars)
            args = (_make_in(inp._whole), _make_out(out._whole), n, *scalars)
            knode = _make_kernel(p + "kernel", index, device, (), (rin, wout), kernel, grid,
                                 block, args, 0, ())
        else:
            knode = KernelNode(p + "kernel", kernel, grid, block,
                               self._kw["arg_layout"](inp, out, n, scalars), batch=index,
                               device=device)
        d2h = _make_d2h(p + "d2h", index, device, (), (rout, _make_access(hout, _WRITE)),
                        "auto", out._whole, hout)
        free_in = _make_free(p + ("free" if in_place else "free_in"), index, device, (),
                             (win,), inp)
        free_out = None if in_place else _make_free(p + "free_out", index, device, (),
                                                    (wout,), out)
        nodes = ((alloc_in, h2d, knode, d2h, free_in) if in_place else
                 (alloc_in, alloc_out, h2d, knode, d2h, free_in, free_out))
        back = self._known_edges(graph, hin, hout, fresh_in, fresh_out, after)
        added = False
        if back is not None:
            new = [inp] if in_place else [inp, out]
            if fresh_in:
                new.append(hin.buffer)
            if fresh_out:
                new.append(hout.buffer)
            learned = self._edges
            assert learned is not None  # learned from the first batch
            reasons = partial(_edge_reasons, learned[0],
                              (inp.name, out.name, hin.buffer.name, hout.buffer.name),
                              learned[-1], len(after))
            added = graph._add_known(nodes, back, reasons, new)
        if not added:
            before = len(graph)
            for x in nodes:
                graph.add(x)
            if self._added != before:
                self._added = -1
        if self._added >= 0:
            self._added = len(graph)
        return _make_batch(index, inp, out, hin, hout, alloc_in, alloc_out, h2d, knode, d2h,
                           free_in, free_out)


#: `add_batch`'s keywords that `build_pipeline` passes through (it sets the others itself).
_PIPELINE_KEYWORDS = frozenset({"grid", "block", "scalars", "element_size", "in_place",
                                "arg_layout", "device"})


def build_pipeline(batches: int, batch_bytes: int | Sequence[int], kernel: KernelRef, *,
                   host_in: HostBuffer | None = None, host_out: HostBuffer | None = None,
                   in_flight: int | None = None, **kwargs) -> tuple[TaskGraph, list[Batch]]:
    """A graph of ``batches`` independent batches, in the classic loop's program order.

    ``batch_bytes``: one size for all, or one per batch (a last, shorter batch). ``host_in`` /
    ``host_out``: one host buffer to slice into consecutive batch ranges (e.g. a whole input array
    pinned once), or None for a slot per batch. Other keywords go to `add_batch`.

    ``in_flight``: at most this many batches hold device memory at once: batch ``b``'s
    allocations follow batch ``b - in_flight``'s frees (explicit ``after=`` edges, so a plan
    joins those streams with an event and the pool reuses that memory). Device memory then stays
    at ``in_flight`` batches however long the pipeline, without the pool's hidden internal
    dependencies (`orchestra.driver.MemoryPool` turns those off). None: no bound.
    """
    check_int("build_pipeline", "batches", batches, minimum=0, maximum=sys.maxsize,
              what="an int from 0 to 2**63 - 1 (the number of batches)")
    unknown = sorted(set(kwargs) - _PIPELINE_KEYWORDS)
    if unknown:  # before the first batch is made (add_batch would name one, half way)
        raise NodeFieldTypeError(f"build_pipeline: unknown keyword(s) {', '.join(unknown)}; "
                                 f"it passes these to add_batch: "
                                 f"{', '.join(sorted(_PIPELINE_KEYWORDS))}")
    if is_int(batch_bytes):
        sizes = [int(cast(int, batch_bytes))] * batches
    elif isinstance(batch_bytes, (str, bytes)) or not isinstance(batch_bytes, Iterable):
        raise NodeFieldTypeError(f"build_pipeline: batch_bytes must be an int (bytes per "
                                 f"batch) or a list of one int per batch, got {got(batch_bytes)}")
    else:
        sizes = list(batch_bytes)
    if len(sizes) != batches:
        raise GraphError(f"batch_bytes has {len(sizes)} sizes for {batches} batches")
    check_int("build_pipeline", "in_flight", in_flight, minimum=1, optional=True,
              what="None or an int >= 1 (batches holding device memory at once)")
    total = sum(sizes)
    for hb, what in ((host_in, "host_in"), (host_out, "host_out")):
        if hb is not None and (not isinstance(hb, HostBuffer) or hb.nbytes < total):
            raise GraphError(f"{what} must be a HostBuffer of at least {total} bytes; got {hb!r}")
    if in_flight is not None and in_flight < 1:
        raise GraphError(f"in_flight must be at least 1 batch; got {in_flight}")
    graph = TaskGraph()
    out: list[Batch] = []
    batches_of = _Batches(kernel, kwargs)
    make = batches_of.add
    offsets = list(accumulate(sizes, initial=0))
    for i, size in enumerate(sizes):
        if i == 1:  # the first batch proved the shape: the rest at once, if they are plain
            rest = batches_of.bulk(graph, out, sizes[1:], offsets[1:-1], host_in, host_out,
                                   in_flight)
            if rest is not None:
                out += rest
                break
        offset = offsets[i]
        hin = _slice(host_in, offset, size) if host_in is not None else None
        hout = _slice(host_out, offset, size) if host_out is not None else None
        after: tuple[str, ...] = ()
        if in_flight is not None and i >= in_flight:
            prev = out[i - in_flight]
            after = tuple(f.name for f in (prev.free_in, prev.free_out) if f is not None)
        out.append(make(graph, i, size, hin, hout, after))
    return graph, out


def _slice(host: HostBuffer, offset, size) -> BufferRange:
    """``host.range(offset, size)``, without its checks when the values are plain ints in
    bounds (else the checked range, which raises what it always raised)."""
    if type(offset) is int and type(size) is int and offset >= 0 and size > 0 \
            and offset + size <= host.nbytes:
        return _make_range(host, offset, size)
    return host.range(offset, size)

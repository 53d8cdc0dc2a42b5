"""The batch: allocate -> H2D -> kernel -> D2H -> free, as graph nodes.

Names for batch ``i``: buffers ``b{i}.in`` and ``b{i}.out`` (device), ``b{i}.host_in`` and
``b{i}.host_out`` (host slots, unless the caller passes ranges of its own host buffers); nodes
``b{i}.alloc_in``, ``b{i}.alloc_out``, ``b{i}.h2d``, ``b{i}.kernel``, ``b{i}.d2h``,
``b{i}.free_in``, ``b{i}.free_out``. Separate input and output buffers let a run poison the outputs
and verify every element; ``in_place=True`` uses one buffer ``b{i}.buf`` instead.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

from orchestra.errors import GraphError
from orchestra.graph.buffers import Access, Buffer, BufferRange, HostBuffer, Mode, as_range
from orchestra.graph.kernel_ref import KernelRef
from orchestra.graph.nodes import Alloc, DeviceToHost, Free, HostToDevice, In, KernelNode, Node, Out
from orchestra.graph.taskgraph import TaskGraph
from orchestra.graph.trusted import maker

def elementwise_args(inp: Buffer, out: Buffer, n: int, scalars: tuple) -> tuple:
    """Kernel arguments ``(In(inp), Out(out), n, *scalars)``: the elementwise convention
    ``kernel(const T* in, T* out, size_t n, ...scalars)``, the default `add_batch` layout."""
    return (In(inp), Out(out), n, *scalars)


ArgLayout = Callable[[Buffer, Buffer, int, tuple], tuple]


@attrs.frozen
class Batch:
    """The buffers and nodes of one batch (``alloc_out``/``free_out`` are None when in place)."""

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
        bx = block if isinstance(block, int) else block[0]
        grid = max(1, -(-n // bx))
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
    """

    def __init__(self, kernel: KernelRef, kwargs: dict):
        # kept as given: the first add_batch call refuses an unknown keyword as it always did
        self._kw = {"kernel": kernel, **kwargs}
        self._shape: tuple | None = None  # what the first batch proved (see _learn)

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
                return self._trusted(graph, shape, index, nbytes, hin, hout, alloc_after)
        batch = add_batch(graph, index=index, nbytes=nbytes, host_in=host_in, host_out=host_out,
                          alloc_after=alloc_after, **self._kw)
        if self._shape is None:
            self._shape = self._learn(batch)
        return batch

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

    def _trusted(self, graph, shape, index, nbytes, hin, hout, after) -> Batch:
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
        add = graph.add
        alloc_in = add(_make_alloc(p + ("alloc" if in_place else "alloc_in"), index, device,
                                   after, (win,), inp))
        alloc_out = None if in_place else add(_make_alloc(p + "alloc_out", index, device, after,
                                                          (wout,), out))
        h2d = add(_make_h2d(p + "h2d", index, device, (), (_make_access(hin, _READ), win),
                            "auto", hin, inp._whole))
        if default_layout:  # elementwise_args: (In(inp), Out(out), n, *scalars)
            args = (_make_in(inp._whole), _make_out(out._whole), n, *scalars)
            knode = add(_make_kernel(p + "kernel", index, device, (), (rin, wout), kernel, grid,
                                     block, args, 0, ()))
        else:
            knode = add(KernelNode(p + "kernel", kernel, grid, block,
                                   self._kw["arg_layout"](inp, out, n, scalars), batch=index,
                                   device=device))
        d2h = add(_make_d2h(p + "d2h", index, device, (), (rout, _make_access(hout, _WRITE)),
                            "auto", out._whole, hout))
        free_in = add(_make_free(p + ("free" if in_place else "free_in"), index, device, (),
                                 (win,), inp))
        free_out = None if in_place else add(_make_free(p + "free_out", index, device, (),
                                                        (wout,), out))
        return _make_batch(index, inp, out, hin, hout, alloc_in, alloc_out, h2d, knode, d2h,
                           free_in, free_out)


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
    sizes = [batch_bytes] * batches if isinstance(batch_bytes, int) else list(batch_bytes)
    if len(sizes) != batches:
        raise GraphError(f"batch_bytes has {len(sizes)} sizes for {batches} batches")
    total = sum(sizes)
    for hb, what in ((host_in, "host_in"), (host_out, "host_out")):
        if hb is not None and (not isinstance(hb, HostBuffer) or hb.nbytes < total):
            raise GraphError(f"{what} must be a HostBuffer of at least {total} bytes; got {hb!r}")
    if in_flight is not None and in_flight < 1:
        raise GraphError(f"in_flight must be at least 1 batch; got {in_flight}")
    graph = TaskGraph()
    out: list[Batch] = []
    make = _Batches(kernel, kwargs).add
    offset = 0
    for i, size in enumerate(sizes):
        hin = _slice(host_in, offset, size) if host_in is not None else None
        hout = _slice(host_out, offset, size) if host_out is not None else None
        after: tuple[str, ...] = ()
        if in_flight is not None and i >= in_flight:
            prev = out[i - in_flight]
            after = tuple(f.name for f in (prev.free_in, prev.free_out) if f is not None)
        out.append(make(graph, i, size, hin, hout, after))
        offset += size
    return graph, out


def _slice(host: HostBuffer, offset, size) -> BufferRange:
    """``host.range(offset, size)``, without its checks when the values are plain ints in
    bounds (else the checked range, which raises what it always raised)."""
    if type(offset) is int and type(size) is int and offset >= 0 and size > 0 \
            and offset + size <= host.nbytes:
        return _make_range(host, offset, size)
    return host.range(offset, size)

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
from orchestra.graph.buffers import Buffer, BufferRange, HostBuffer, as_range
from orchestra.graph.kernel_ref import KernelRef
from orchestra.graph.nodes import Alloc, DeviceToHost, Free, HostToDevice, In, KernelNode, Node, Out
from orchestra.graph.taskgraph import TaskGraph

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
    offset = 0
    for i, size in enumerate(sizes):
        hin = host_in.range(offset, size) if host_in is not None else None
        hout = host_out.range(offset, size) if host_out is not None else None
        after: tuple[str, ...] = ()
        if in_flight is not None and i >= in_flight:
            prev = out[i - in_flight]
            after = tuple(f.name for f in (prev.free_in, prev.free_out) if f is not None)
        out.append(add_batch(graph, index=i, kernel=kernel, nbytes=size, host_in=hin,
                             host_out=hout, alloc_after=after, **kwargs))
        offset += size
    return graph, out

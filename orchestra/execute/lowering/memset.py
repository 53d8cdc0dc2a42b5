"""Lowering of `Memset`: fill a device range with a 1-, 2- or 4-byte value.

    stream      cuMemsetD8Async / cuMemsetD16Async / cuMemsetD32Async (by element size)
    graph       cuGraphAddMemsetNode (CUDA_MEMSET_NODE_PARAMS: dst, value (unsigned),
                elementSize, width = elements, height 1, pitch 0)
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.check import error_from_result
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import Memset

#: element size -> the driver call
MEMSET_CALLS = {1: "cuMemsetD8Async", 2: "cuMemsetD16Async", 4: "cuMemsetD32Async"}


def memset_params(node, dev_addr: int):
    """``CUDA_MEMSET_NODE_PARAMS`` for a `Memset` node (``dev_addr``: the buffer's base)."""
    p = _d.CUDA_MEMSET_NODE_PARAMS()
    es = node.element_size
    p.dst = dev_addr + node.dst.offset
    p.value = node.unsigned_value
    p.elementSize = es
    p.width = node.dst.nbytes // es
    p.height = 1
    p.pitch = 0
    return p


@register
class MemsetLowering(Lowering):
    """The lowering of `Memset` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = Memset
    graph_node = "memset"
    driver_node_type = "CU_GRAPH_NODE_TYPE_MEMSET"

    def stream(self, node, ctx, stream):
        es = node.element_size
        call = MEMSET_CALLS[es]
        fn = getattr(ctx.api, call)
        a = ctx.addresses
        slot, off = a.device_slot(node.dst.buffer.name), node.dst.offset
        value, count, sh, ptrs = node.unsigned_value, node.dst.nbytes // es, stream.handle, a.ptrs

        def step():
            (err,) = fn(ptrs[slot] + off, value, count, sh)
            if err:
                raise error_from_result(call, err)
        if not ctx.capture:
            return step
        params = memset_params(node, 0)
        rec = ctx.record(node, params)
        ctx.use(node.dst.buffer.name, rec, params, "dst", off)

        def captured_step():  # the recorded params follow the address the capture used
            params.dst = ptrs[slot] + off
            step()
        return captured_step

    def graph(self, node, ctx, deps):
        params = memset_params(node, ctx.device_address(node.dst.buffer.name))
        gnode = ctx.add("cuGraphAddMemsetNode", deps, params, ctx.context)
        rec = ctx.record(node, gnode, params)
        ctx.use(node.dst.buffer.name, rec, params, "dst", node.dst.offset)
        return rec


__all__ = ["MEMSET_CALLS", "MemsetLowering", "memset_params"]

"""Lowering of `Alloc` and `Free`: stream-ordered allocation from the device's memory pool.

    stream      cuMemAllocFromPoolAsync / cuMemFreeAsync (the default pool: release
                threshold UINT64_MAX, internal dependencies off); captured, they become
                memory nodes
    graph       cuGraphAddMemAllocNode (CUDA_MEM_ALLOC_NODE_PARAMS: pinned device memory on
                the device; the driver writes the address into ``dptr``) /
                cuGraphAddMemFreeNode
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.check import cu, error_from_result
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import Alloc, Free


def alloc_params(nbytes: int, ordinal: int):
    """``CUDA_MEM_ALLOC_NODE_PARAMS`` for ``nbytes`` of device memory on device ``ordinal``."""
    p = _d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = _d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.handleTypes = _d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    p.poolProps.location.type = _d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = ordinal
    p.bytesize = nbytes
    return p


@register
class AllocLowering(Lowering):
    """The lowering of `Alloc` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = Alloc
    graph_node = "mem_alloc"
    driver_node_type = "CU_GRAPH_NODE_TYPE_MEM_ALLOC"

    def stream(self, node, ctx, stream):
        a = ctx.addresses
        sh = stream.handle
        slot = a.allocate(node, sh)
        alloc = ctx.api.cuMemAllocFromPoolAsync
        nbytes, ptrs, objs = node.buffer.nbytes, a.ptrs, a.objs
        pool = ctx.pool_for(node.buffer.device)

        def step():
            err, dptr = alloc(nbytes, pool, sh)
            if err:
                raise error_from_result("cuMemAllocFromPoolAsync", err)
            objs[slot] = dptr
            ptrs[slot] = int(dptr)
        if not ctx.capture:
            return step
        allocations, name, buffer = ctx.allocations, node.name, node.buffer.name

        def captured_step():  # the capture also notes each address it allocates
            step()
            allocations[name] = (buffer, ptrs[slot])
        return captured_step

    def graph(self, node, ctx, deps):
        params = alloc_params(node.buffer.nbytes, ctx.device.ordinal)
        gnode = ctx.add("cuGraphAddMemAllocNode", deps, params)
        dptr = params.dptr
        if int(dptr) == 0:  # the binding did not write back: ask the node (address only)
            dptr = cu(ctx.api.cuGraphMemAllocNodeGetParams, gnode).dptr
        ctx.allocated(node, dptr)
        return ctx.record(node, gnode, params)


@register
class FreeLowering(Lowering):
    """The lowering of `Free` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = Free
    graph_node = "mem_free"
    driver_node_type = "CU_GRAPH_NODE_TYPE_MEM_FREE"

    def stream(self, node, ctx, stream):
        a = ctx.addresses
        slot = a.free(node)
        free, sh, ptrs, objs = ctx.api.cuMemFreeAsync, stream.handle, a.ptrs, a.objs

        def step():
            (err,) = free(objs[slot], sh)
            if err:
                raise error_from_result("cuMemFreeAsync", err)
            objs[slot] = None
            ptrs[slot] = 0
        return step

    def graph(self, node, ctx, deps):
        gnode = ctx.add("cuGraphAddMemFreeNode", deps, ctx.freed(node))
        return ctx.record(node, gnode, None)


__all__ = ["AllocLowering", "FreeLowering", "alloc_params"]

"""Lowering of `HostToDevice` and `DeviceToHost`: copies between pinned host memory and a
device buffer.

    stream      eager: cuMemcpyHtoDAsync / cuMemcpyDtoHAsync; captured: cuMemcpy3DAsync with
                the node's own CUDA_MEMCPY3D (the very struct replays rewrite)
    graph       cuGraphAddMemcpyNode (CUDA_MEMCPY3D)
    replay      CUDA_MEMCPY3D: srcHost / dstHost for a rebound host array (srcDevice /
                dstDevice for an external device buffer), cuGraphExecMemcpyNodeSetParams

The record is a 1-D copy: Height = Depth = 1, WidthInBytes = bytes, pitches and heights 0
(unspecified: legal for any size); the host side CU_MEMORYTYPE_HOST, the device side
CU_MEMORYTYPE_DEVICE; buffer offsets folded into the addresses.
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.check import error_from_result
from orchestra.errors import OrchestraError
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import DeviceToHost, HostToDevice

_MT = _d.CUmemorytype


def memcpy_params(node, host_addr: int, dev_addr: int):
    """A 1-D ``CUDA_MEMCPY3D`` for an H2D / D2H node, and the host field replays rewrite:
    ``(params, "srcHost" | "dstHost", host offset)``. ``host_addr`` / ``dev_addr`` are the base
    addresses of the node's host and device buffers (offsets are added here)."""
    p = _d.CUDA_MEMCPY3D()
    if node.kind == "h2d":
        p.srcMemoryType = _MT.CU_MEMORYTYPE_HOST
        p.srcHost = host_addr + node.src.offset
        p.dstMemoryType = _MT.CU_MEMORYTYPE_DEVICE
        p.dstDevice = dev_addr + node.dst.offset
        field, off = "srcHost", node.src.offset
    elif node.kind == "d2h":
        p.srcMemoryType = _MT.CU_MEMORYTYPE_DEVICE
        p.srcDevice = dev_addr + node.src.offset
        p.dstMemoryType = _MT.CU_MEMORYTYPE_HOST
        p.dstHost = host_addr + node.dst.offset
        field, off = "dstHost", node.dst.offset
    else:
        raise OrchestraError(f"node {node.name}: not a host copy ({node.kind})")
    p.WidthInBytes = node.nbytes
    p.Height = 1
    p.Depth = 1
    # pitches and heights stay 0, "not specified" (cuMemcpy3D: "If specified, srcPitch must be
    # >= WidthInBytes + srcXInBytes", heights "may be 0 if Depth==1"); a pitch would also be
    # refused above CU_DEVICE_ATTRIBUTE_MAX_PITCH, so copies of any size stay legal
    return p, field, off


class _HostCopyLowering(Lowering):
    graph_node = "memcpy"
    driver_node_type = "CU_GRAPH_NODE_TYPE_MEMCPY"
    replay_params = "CUDA_MEMCPY3D"
    to_device: bool
    call: str  # the eager driver call

    def _sides(self, node):
        """(host range, device range, host field, device field) of the record."""
        if self.to_device:
            return node.src, node.dst, "srcHost", "dstDevice"
        return node.dst, node.src, "dstHost", "srcDevice"

    def stream(self, node, ctx, stream):
        host, dev, hfield, dfield = self._sides(node)
        a = ctx.addresses
        hslot, dslot = a.host_slot(host.buffer.name), a.device_slot(dev.buffer.name)
        hoff, doff, nbytes, sh = host.offset, dev.offset, node.nbytes, stream.handle
        ptrs, hptrs = a.ptrs, a.hptrs
        if ctx.capture:
            params = memcpy_params(node, 0, 0)[0]
            rec = ctx.record(node, params)
            ctx.use(host.buffer.name, rec, params, hfield, hoff)
            ctx.use(dev.buffer.name, rec, params, dfield, doff)
            copy3d = ctx.api.cuMemcpy3DAsync

            def step():
                setattr(params, hfield, hptrs[hslot] + hoff)
                setattr(params, dfield, ptrs[dslot] + doff)
                (err,) = copy3d(params, sh)
                if err:
                    raise error_from_result("cuMemcpy3DAsync", err)
            return step
        call = self.call
        fn = getattr(ctx.api, call)
        if self.to_device:
            def step():
                (err,) = fn(ptrs[dslot] + doff, hptrs[hslot] + hoff, nbytes, sh)
                if err:
                    raise error_from_result(call, err)
        else:
            def step():
                (err,) = fn(hptrs[hslot] + hoff, ptrs[dslot] + doff, nbytes, sh)
                if err:
                    raise error_from_result(call, err)
        return step

    def graph(self, node, ctx, deps):
        host, dev, hfield, dfield = self._sides(node)
        params, _, _ = memcpy_params(node, ctx.host_address(host.buffer.name),
                                     ctx.device_address(dev.buffer.name))
        gnode = ctx.add("cuGraphAddMemcpyNode", deps, params, ctx.context)
        rec = ctx.record(node, gnode, params)
        ctx.use(host.buffer.name, rec, params, hfield, host.offset)
        ctx.use(dev.buffer.name, rec, params, dfield, dev.offset)
        return rec


@register
class HostToDeviceLowering(_HostCopyLowering):
    node_type = HostToDevice
    to_device = True
    call = "cuMemcpyHtoDAsync"


@register
class DeviceToHostLowering(_HostCopyLowering):
    node_type = DeviceToHost
    to_device = False
    call = "cuMemcpyDtoHAsync"


__all__ = ["DeviceToHostLowering", "HostToDeviceLowering", "memcpy_params"]

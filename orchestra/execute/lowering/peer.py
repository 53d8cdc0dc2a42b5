"""Lowering of `PeerCopy`: device memory to device memory, on two GPUs or within one.

    resolve     peer access for the pair, once per process (``DriverAPI.enable_peer_access``:
                ``cuDeviceCanAccessPeer`` both ways, ``cuCtxEnablePeerAccess``, the pools'
                ``cuMemPoolSetAccess``); a pair that cannot reach each other, or a device that
                does not exist, is a `PeerAccessError` naming the pair, before any enqueue
    stream      two devices: cuMemcpyPeerAsync (with both primary contexts), eagerly and
                captured (the capture records a memcpy node); one device:
                cuMemcpyDtoDAsync (a plain device-to-device copy)
    graph       cuGraphAddMemcpyNode (CUDA_MEMCPY3D, device to device: with unified
                addressing the two pointers name their devices)
    replay      CUDA_MEMCPY3D srcDevice / dstDevice: an external device buffer re-pointed on
                replay (cuGraphExecMemcpyNodeSetParams); captured, the record is filled with
                the addresses the captured call used, so a rewrite of one side keeps the other

The copy runs on a stream of ``node.device`` (the source's device by default: a push).
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.check import error_from_result
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import PeerCopy

_MT = _d.CUmemorytype


def peer_params(node, src_addr: int, dst_addr: int):
    """A 1-D device-to-device ``CUDA_MEMCPY3D`` for a `PeerCopy` (``src_addr`` / ``dst_addr``:
    the buffers' base addresses; the offsets are added here)."""
    p = _d.CUDA_MEMCPY3D()
    p.srcMemoryType = _MT.CU_MEMORYTYPE_DEVICE
    p.srcDevice = src_addr + node.src.offset
    p.dstMemoryType = _MT.CU_MEMORYTYPE_DEVICE
    p.dstDevice = dst_addr + node.dst.offset
    p.WidthInBytes = node.nbytes
    p.Height = 1
    p.Depth = 1
    return p


@register
class PeerCopyLowering(Lowering):
    """The lowering of `PeerCopy` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = PeerCopy
    graph_node = "memcpy"
    driver_node_type = "CU_GRAPH_NODE_TYPE_MEMCPY"
    replay_params = "CUDA_MEMCPY3D"

    def resolve(self, node, executor):
        """``(source context, destination context)`` for a copy between two devices, after
        peer access for the pair is enabled; None within one device."""
        a, b = node.src.buffer.device, node.dst.buffer.device
        if a == b:
            return None
        executor.api.enable_peer_access(a, b)
        return (executor.api.context_of(a), executor.api.context_of(b))

    def stream(self, node, ctx, stream):
        a = ctx.addresses
        sslot, dslot = a.device_slot(node.src.buffer.name), a.device_slot(node.dst.buffer.name)
        soff, doff, nbytes, sh, ptrs = node.src.offset, node.dst.offset, node.nbytes, \
            stream.handle, a.ptrs
        params = None
        if ctx.capture:
            params = peer_params(node, 0, 0)
            rec = ctx.record(node, params)
            ctx.use(node.src.buffer.name, rec, params, "srcDevice", soff)
            ctx.use(node.dst.buffer.name, rec, params, "dstDevice", doff)
        contexts = ctx.resolved.get(node.name)
        if params is not None:  # captured once: the record gets the addresses the call used
            step = self._stream_step(contexts, ctx, ptrs, sslot, dslot, soff, doff, nbytes, sh)

            def captured():
                params.srcDevice = ptrs[sslot] + soff
                params.dstDevice = ptrs[dslot] + doff
                step()
            return captured
        return self._stream_step(contexts, ctx, ptrs, sslot, dslot, soff, doff, nbytes, sh)

    @staticmethod
    def _stream_step(contexts, ctx, ptrs, sslot, dslot, soff, doff, nbytes, sh):
        if contexts is None:
            dtod = ctx.api.cuMemcpyDtoDAsync

            def step():
                (err,) = dtod(ptrs[dslot] + doff, ptrs[sslot] + soff, nbytes, sh)
                if err:
                    raise error_from_result("cuMemcpyDtoDAsync", err)
            return step
        sctx, dctx = contexts
        peer = ctx.api.cuMemcpyPeerAsync

        def step():
            (err,) = peer(ptrs[dslot] + doff, dctx, ptrs[sslot] + soff, sctx, nbytes, sh)
            if err:
                raise error_from_result("cuMemcpyPeerAsync", err)
        return step

    def graph(self, node, ctx, deps):
        params = peer_params(node, ctx.device_address(node.src.buffer.name),
                             ctx.device_address(node.dst.buffer.name))
        gnode = ctx.add("cuGraphAddMemcpyNode", deps, params, ctx.context)
        rec = ctx.record(node, gnode, params)
        ctx.use(node.src.buffer.name, rec, params, "srcDevice", node.src.offset)
        ctx.use(node.dst.buffer.name, rec, params, "dstDevice", node.dst.offset)
        return rec


__all__ = ["PeerCopyLowering", "peer_params"]

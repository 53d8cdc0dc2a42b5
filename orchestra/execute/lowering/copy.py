"""Lowering of `HostToDevice` and `DeviceToHost`: copies between pinned host memory and a
device buffer, on a copy engine or as a copy kernel (`copy_policy.CopyPolicy.choose`).

On a copy engine:

    stream      eager: cuMemcpyHtoDAsync / cuMemcpyDtoHAsync; captured: cuMemcpy3DAsync with
                the node's own CUDA_MEMCPY3D (the very struct replays rewrite)
    graph       cuGraphAddMemcpyNode (CUDA_MEMCPY3D)
    replay      CUDA_MEMCPY3D: srcHost / dstHost for a rebound host array (srcDevice /
                dstDevice for an external device buffer), cuGraphExecMemcpyNodeSetParams

The record is a 1-D copy: Height = Depth = 1, WidthInBytes = bytes, pitches and heights 0
(unspecified: legal for any size); the host side CU_MEMORYTYPE_HOST, the device side
CU_MEMORYTYPE_DEVICE; buffer offsets folded into the addresses.

As a copy kernel (``cuda_src/copy.cu``'s ``orchestra_copy(dst, src, n, system_fence)``,
compiled once per device through the compiler's cache and the executor's `KernelResolver`):

    resolve     the kernel resolved, its arguments packed (n; system_fence = 1 for a D2H in a
                graph with host functions, `CopyPolicy.d2h_system_fence`), the
                launch checked: block `COPY_BLOCK`, grid `copy_grid(n, SMs)`
    stream      cuLaunchKernel; the host address (the bound array's: with unified addressing
                a kernel addresses pinned memory at its host pointer, `Device.kernel_host_access`)
                and the device address are written into the packed struct right before
    graph       cuGraphAddKernelNode (CUDA_KERNEL_NODE_PARAMS)
    replay      the packed struct's host-pointer field (a `BindingUser` with the field) plus
                cuGraphExecKernelNodeSetParams

The node's record kind is then ``"kernel"``: `GraphSpec` kinds, ``cuGraphNodeGetType``, the
plan printout and the trace all say so.
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.check import error_from_result
from orchestra.errors import OrchestraError
from orchestra.execute.kernel_args import KernelArgs, PointerArg
from orchestra.execute.lowering.copy_policy import COPY_BLOCK, CopyPolicy, copy_grid
from orchestra.execute.lowering.kernel import kernel_params
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import DeviceToHost, HostToDevice, KernelRef

_MT = _d.CUmemorytype

COPY_KERNEL_NAME = "orchestra_copy"
COPY_PARAMS = ("unsigned char* dst", "const unsigned char* src", "unsigned long long n",
               "unsigned int system_fence")
_DEFAULT_POLICY = CopyPolicy(kernel_host_access=False)  # no policy given: copy engines


def copy_kernel_ref() -> KernelRef:
    """The `KernelRef` of the copy kernel (``cuda_src/copy.cu``, ``orchestra_copy``)."""
    from orchestra.compiler.sources import kernel_source_dir

    return KernelRef(str(kernel_source_dir() / "copy.cu"), COPY_KERNEL_NAME, params=COPY_PARAMS)


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


class CopyKernelArgs(KernelArgs):
    """A host copy lowered to the copy kernel: `KernelArgs` (its ``pointers`` hold the device
    side) plus ``host`` (the `PointerArg` of the pinned host side: parameter, field, host
    buffer, offset).

    Thread-safety: not thread-safe: as `KernelArgs` (addresses written in place, under the owner's
    lock).
    """

    __slots__ = ("host",)

    def __init__(self, node, kernel, config, packed, device: PointerArg, host: PointerArg):
        super().__init__(node, kernel, config, packed, (device,), {})
        self.host = host

    @property
    def device(self) -> PointerArg:
        return self.pointers[0]


def resolve_copy_kernel(node, kernel, sm_count: int, system_fence: bool = True) -> CopyKernelArgs:
    """Pack the copy kernel's arguments for host copy ``node`` (addresses 0 until a step or a
    graph build writes them) and check its launch: `CopyKernelArgs`. ``system_fence``: a D2H
    copy ends with ``__threadfence_system()`` (`CopyPolicy.d2h_system_fence`)."""
    layout = kernel.layout
    names = layout.field_names
    to_device = node.kind == "h2d"
    host, dev = (node.src, node.dst) if to_device else (node.dst, node.src)
    # parameter 0 is dst, 1 is src
    h_index, d_index = (1, 0) if to_device else (0, 1)
    packed = kernel.pack([0, 0, node.nbytes, int(not to_device and system_fence)])
    config = kernel.launch_config(copy_grid(node.nbytes, sm_count), COPY_BLOCK)
    return CopyKernelArgs(node, kernel, config, packed,
                          PointerArg(d_index, names[d_index], dev.buffer.name, dev.offset),
                          PointerArg(h_index, names[h_index], host.buffer.name, host.offset))


def copy_kernel_nodes(resolved) -> dict[str, str]:
    """Node name -> ``"copy-kernel"`` for every host copy of ``resolved`` (what the executors'
    ``_resolve`` returned) lowered to the copy kernel: what traces and printouts mark."""
    return {name: "copy-kernel" for name, r in resolved.items() if isinstance(r, CopyKernelArgs)}


class _HostCopyLowering(Lowering):
    graph_node = "memcpy"
    driver_node_type = "CU_GRAPH_NODE_TYPE_MEMCPY"
    replay_params = "CUDA_MEMCPY3D"  # CUDA_KERNEL_NODE_PARAMS when lowered to a copy kernel
    to_device: bool
    call: str  # the eager driver call

    def _sides(self, node):
        """(host range, device range, host field, device field) of the record."""
        if self.to_device:
            return node.src, node.dst, "srcHost", "dstDevice"
        return node.dst, node.src, "dstHost", "srcDevice"

    # -- the choice -----------------------------------------------------------------------

    def resolve_with(self, node, executor, copies=None):
        """None (a copy engine), or the `CopyKernelArgs` when ``copies`` (the build's
        `CopyPolicy`) lowers ``node`` to the copy kernel: compiled (cached), loaded and packed
        now, before any CUDA call. Raises `CopyLoweringError` for a copy kernel the device
        cannot run, `CompileError` when the kernel does not build."""
        policy = copies if copies is not None else _DEFAULT_POLICY
        if policy.choose(node) != "kernel":
            return None
        resolver = executor.kernel_resolver(node.device)  # the node's device's kernels
        kernel = resolver.resolve(copy_kernel_ref(), node.name)
        return resolve_copy_kernel(node, kernel, resolver.device.sm_count,
                                   policy.d2h_system_fence)

    def graph_node_of(self, node, copies=None):
        policy = copies if copies is not None else _DEFAULT_POLICY
        return "kernel" if policy.choose(node) == "kernel" else "memcpy"

    # -- streams --------------------------------------------------------------------------

    def stream(self, node, ctx, stream):
        ka = ctx.resolved.get(node.name)
        if ka is not None:
            return self._kernel_step(node, ka, ctx, stream)
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

    def _kernel_step(self, node, ka: CopyKernelArgs, ctx, stream):
        """One ``cuLaunchKernel`` of the copy kernel; the two addresses are written into the
        packed struct from the address slots right before (the driver copies the arguments
        when the call returns)."""
        a = ctx.addresses
        h, d = ka.host, ka.device
        hslot, dslot = a.host_slot(h.buffer), a.device_slot(d.buffer)
        hfield, dfield, hoff, doff = h.field, d.field, h.offset, d.offset
        ptrs, hptrs, sh = a.ptrs, a.hptrs, stream.handle
        struct, address, func = ka.packed.struct, ka.packed.address, ka.kernel.function
        if ctx.capture:
            params = kernel_params(ka)
            rec = ctx.record(node, params)
            ctx.built.copies[node.name] = ka  # kernelParams points into its packed struct
            ctx.use(h.buffer, rec, struct, hfield, hoff)
            ctx.use(d.buffer, rec, struct, dfield, doff)
        launch = ctx.api.cuLaunchKernel
        cfg = ka.config
        (gx, gy, gz), (bx, by, bz) = cfg.grid, cfg.block
        name = node.name
        # eager: a bound side is written by the binding table when it changes (bound_field)
        host_bound = ctx.bound_field(h.buffer, struct, hfield, hoff)
        dev_bound = ctx.bound_field(d.buffer, struct, dfield, doff)
        if host_bound and dev_bound:
            def step():
                (err,) = launch(func, gx, gy, gz, bx, by, bz, 0, sh, address, 0)
                if err:
                    raise error_from_result("cuLaunchKernel", err, context=f"copy kernel {name}")
        elif host_bound:
            def step():
                setattr(struct, dfield, ptrs[dslot] + doff)
                (err,) = launch(func, gx, gy, gz, bx, by, bz, 0, sh, address, 0)
                if err:
                    raise error_from_result("cuLaunchKernel", err, context=f"copy kernel {name}")
        else:
            def step():
                setattr(struct, hfield, hptrs[hslot] + hoff)
                setattr(struct, dfield, ptrs[dslot] + doff)
                (err,) = launch(func, gx, gy, gz, bx, by, bz, 0, sh, address, 0)
                if err:
                    raise error_from_result("cuLaunchKernel", err, context=f"copy kernel {name}")
        return step

    # -- explicit graphs ------------------------------------------------------------------

    def graph(self, node, ctx, deps):
        ka = ctx.resolved.get(node.name)
        if ka is not None:
            h, d = ka.host, ka.device
            struct = ka.packed.struct
            setattr(struct, h.field, ctx.host_address(h.buffer) + h.offset)
            setattr(struct, d.field, ctx.device_address(d.buffer) + d.offset)
            params = kernel_params(ka)
            gnode = ctx.add("cuGraphAddKernelNode", deps, params)
            ctx.built.copies[node.name] = ka
            rec = ctx.record(node, gnode, params, kind="kernel")
            ctx.use(h.buffer, rec, struct, h.field, h.offset)
            ctx.use(d.buffer, rec, struct, d.field, d.offset)
            return rec
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
    """The lowering of `HostToDevice` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = HostToDevice
    to_device = True
    call = "cuMemcpyHtoDAsync"


@register
class DeviceToHostLowering(_HostCopyLowering):
    """The lowering of `DeviceToHost` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = DeviceToHost
    to_device = False
    call = "cuMemcpyDtoHAsync"


__all__ = [
    "COPY_KERNEL_NAME", "COPY_PARAMS", "CopyKernelArgs", "DeviceToHostLowering",
    "HostToDeviceLowering", "copy_kernel_nodes", "copy_kernel_ref", "memcpy_params",
    "resolve_copy_kernel",
]

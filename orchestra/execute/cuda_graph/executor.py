"""What both graph executors share: node parameter records, and the executor base class.

The parameter builders fill cuda-bindings structs from orchestra's node records and resolved
addresses; the exec keeps each struct for the node's life and changes single fields in replays.

    CUDA_MEMCPY3D             1-D copy: Height = Depth = 1, WidthInBytes = bytes, pitches and
                              heights 0 (unspecified: legal for any size);
                              host side CU_MEMORYTYPE_HOST (srcHost / dstHost), device side
                              CU_MEMORYTYPE_DEVICE (srcDevice / dstDevice); offsets folded into
                              the addresses
    CUDA_KERNEL_NODE_PARAMS   func (the CUfunction), grid, block, sharedMemBytes, kernelParams
                              (the address of the packed ``void*`` array, `PackedArgs.address`),
                              extra 0; ``kern``/``ctx`` left NULL (ignored when func is set)
    CUDA_MEMSET_NODE_PARAMS   dst, value (unsigned), elementSize 1/2/4, width = elements,
                              height 1, pitch 0
    CUDA_HOST_NODE_PARAMS     fn = the executor's C trampoline, userData = the callable's token
    CUDA_MEM_ALLOC_NODE_PARAMS bytesize; poolProps: pinned device memory on the device
                              (CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, id);
                              the driver writes the allocation's address into ``dptr``
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping

from cuda.bindings import driver as _d

from orchestra.compiler.launch import launch_attribute_values
from orchestra.driver import MemoryPool, Stream
from orchestra.driver.device import as_device
from orchestra.errors import OrchestraError
from orchestra.execute.bindings import BindingSpec, PinnedCheck
from orchestra.execute.closable import Closable
from orchestra.execute.cuda_graph.exec import BuiltGraph, GraphExec, AUTO_FREE_ON_LAUNCH
from orchestra.execute.errors import ExecutorArgumentTypeError
from orchestra.execute.kernel_args import resolve_kernel_node
from orchestra.execute.kernels import KernelResolver
from orchestra.graph import KernelNode, TaskGraph
from orchestra.schedule import Plan, schedule

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


def kernel_params(ka):
    """``CUDA_KERNEL_NODE_PARAMS`` for a resolved kernel node (`KernelArgs`): its
    ``kernelParams`` points into ``ka.packed``, so a rewritten packed field plus one
    ``cuGraphExecKernelNodeSetParams`` replays a new scalar."""
    p = _d.CUDA_KERNEL_NODE_PARAMS()
    cfg = ka.config
    p.func = ka.kernel.function
    p.gridDimX, p.gridDimY, p.gridDimZ = cfg.grid
    p.blockDimX, p.blockDimY, p.blockDimZ = cfg.block
    p.sharedMemBytes = cfg.shared_mem
    p.kernelParams = ka.packed.address
    p.extra = 0
    return p


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


def host_params(fn_address: int, token: int):
    """``CUDA_HOST_NODE_PARAMS``: the trampoline ``fn_address`` called with ``token``."""
    p = _d.CUDA_HOST_NODE_PARAMS()
    p.fn = _d.CUhostFn(fn_address)
    p.userData = token
    return p


def alloc_params(nbytes: int, ordinal: int):
    """``CUDA_MEM_ALLOC_NODE_PARAMS`` for ``nbytes`` of device memory on device ``ordinal``."""
    p = _d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = _d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.handleTypes = _d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    p.poolProps.location.type = _d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = ordinal
    p.bytesize = nbytes
    return p


def kernel_node_attributes(cfg) -> list:
    """``[(CUkernelNodeAttrID, CUkernelNodeAttrValue)]`` for ``cfg``'s launch attributes, for
    ``cuGraphKernelNodeSetAttribute`` (which takes ``CUkernelNodeAttrValue``, a subclass of the
    ``CUlaunchAttributeValue`` that `launch_attribute_values` builds). ``pdl`` is left out:
    in an explicitly built graph the dependency is a full edge (programmatic edges are future
    work), which is always correct."""
    return launch_attribute_values(cfg, id_type=_d.CUkernelNodeAttrID,
                                   value_type=_d.CUkernelNodeAttrValue, pdl=False)


class GraphExecutorBase(Closable):
    """Shared setup of the graph executors: device, default memory pool configured now (at
    setup, never during a capture), kernel resolver, pinned-memory checks.

    Subclasses implement ``_build_graph(taskgraph, plan, bindings, *, trace, policy, streams,
    costs, auto_free, **kw) -> BuiltGraph``.
    """

    _build_graph: Callable[..., BuiltGraph]  # each subclass's own (see above)

    executor_name = "graph"

    def __init__(self, device=None, *, verify: bool = True,
                 kernel_resolver: KernelResolver | None = None, auto_free: bool = False):
        self.device = as_device(device)
        self.verify = bool(verify)
        self.auto_free = bool(auto_free)
        self.kernels = (kernel_resolver if kernel_resolver is not None
                        else KernelResolver(self.device))  # an empty resolver is falsy
        self.device.make_current()
        self.pool = MemoryPool.default(self.device)  # release threshold set once, at setup
        self._pinned = PinnedCheck()
        self._closed = False

    # -- shared steps -------------------------------------------------------------------------

    def _check_devices(self, graph: TaskGraph) -> None:
        ordinal = self.device.ordinal
        for node in graph.nodes:
            if node.kind != "host" and node.device != ordinal:
                raise OrchestraError(
                    f"node {node.name} is on device {node.device}, but this "
                    f"{type(self).__name__} builds for device {ordinal}; use one executor per "
                    "device")

    def _resolve_kernels(self, graph: TaskGraph) -> dict:
        """Kernel node name -> `KernelArgs` (fresh packed arguments: never shared between
        execs, so one exec's scalar replays cannot change another's)."""
        out = {}
        for node in graph.nodes:
            if isinstance(node, KernelNode):
                kernel = self.kernels.resolve(node.kernel, node.name)
                out[node.name] = resolve_kernel_node(node, kernel)
        return out

    def _new_built(self, cugraph, graph: TaskGraph, plan, bindings) -> tuple[BuiltGraph, Any]:
        """Resolve ``bindings`` (all checks) and start a `BuiltGraph` that holds them."""
        spec = BindingSpec(graph)
        resolved = spec.resolve(bindings, self._pinned)
        built = BuiltGraph(cugraph, graph, plan, self.executor_name)
        for name, buf in spec.host.items():
            built.host_users[name] = []
            built.host_nbytes[name] = buf.nbytes
            hb = resolved.host[name]
            built.bound[name] = bindings[name]
            built.arrays[name] = hb.array
        built.host_written = dict(spec.written)
        for name, db in resolved.device.items():
            built.external[name] = db.obj
        return built, resolved

    def _plan(self, graph, plan, policy, streams, costs, need: bool) -> Plan | None:
        if plan is not None:
            if not isinstance(plan, Plan):
                raise ExecutorArgumentTypeError(
                    f"plan must be a schedule.Plan, got {type(plan).__name__}")
            return plan
        if not need:
            return None
        from orchestra.execute.occupancy import capacity_for

        capacity = capacity_for(policy, self.kernels, self.device)
        return schedule(graph, policy, streams, costs,
                        resident_blocks=capacity(graph) if capacity is not None else None)

    # -- public -------------------------------------------------------------------------------

    def build(self, graph: TaskGraph, plan: Plan | None = None,
              bindings: Mapping[str, Any] | None = None, *, policy: str = "by-engine",
              streams: int = 3, costs=None, trace: bool = False, upload: bool = True,
              auto_free: bool | None = None, stream: Stream | None = None, **kw) -> GraphExec:
        """Build ``graph``'s CUDA graph and instantiate it: a `GraphExec`, not launched.

        ``bindings`` (host buffer name -> pinned array, external device buffer name ->
        DeviceBuffer) are checked like the eager executor's and baked into the graph (replays
        rebind host arrays). ``trace``: every launch returns a `Timeline`. ``auto_free``
        (default: the executor's): allow Allocs without Frees and instantiate with
        ``CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH``. ``stream``: the exec's default
        launch stream (default: a new non-blocking one it owns).
        """
        if not isinstance(graph, TaskGraph):
            raise ExecutorArgumentTypeError(
                f"build() takes a TaskGraph, got {type(graph).__name__}")
        self._check_open()
        auto_free = self.auto_free if auto_free is None else bool(auto_free)
        options = dict(trace=bool(trace), policy=policy, streams=streams, costs=costs,
                       auto_free=auto_free, **kw)
        built = self._build_graph(graph, plan, bindings, **options)
        rebuild = functools.partial(self._rebuild, options)
        flags = AUTO_FREE_ON_LAUNCH if auto_free else 0
        return GraphExec(built, self.device, flags=flags, upload=upload, rebuild=rebuild,
                         stream=stream)

    def _rebuild(self, options, graph, plan, bindings) -> BuiltGraph:
        self._check_open()
        return self._build_graph(graph, plan, bindings, **options)

    def run(self, graph: TaskGraph, plan: Plan | None = None,
            bindings: Mapping[str, Any] | None = None, **kw) -> GraphExec:
        """`build`, launch once and wait: the exec (``exec.timeline`` when traced,
        ``exec.wall_ms`` the launch-to-done host time). Keep it to `replay`; close it when
        done."""
        exe = self.build(graph, plan, bindings, **kw)
        try:
            t0 = time.perf_counter_ns()
            exe.launch(sync=True)
            exe.wall_ms = (time.perf_counter_ns() - t0) / 1e6
        except BaseException:
            exe.close()
            raise
        return exe

    def close(self) -> None:
        """Release what the executor pools (idempotent). Execs it built stay usable (they own
        their graphs); `GraphExec.update` needs the executor open."""
        self._closed = True


__all__ = ["GraphExecutorBase", "alloc_params", "host_params", "kernel_node_attributes",
           "kernel_params", "memcpy_params", "memset_params"]

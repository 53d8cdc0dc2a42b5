"""Lowering of `KernelNode`: a kernel launch with its packed arguments.

    resolve     compile (cached), load and look the kernel up (`KernelResolver`), check and
                pack the arguments and the launch configuration (`resolve_kernel_node`), all
                before any CUDA call; a node with the ``pdl`` attribute must execute
                griddepcontrol.wait (`PdlWithoutWaitError` otherwise): PDL, and a
                programmatic edge, are applied only where the consumer waits
    stream      cuLaunchKernel; cuLaunchKernelEx with a CUlaunchConfig built once per node
                and stream when launch attributes are set (cooperative, cluster, pdl,
                priority); buffer arguments are written into the packed struct from the
                address slots right before the call, conditional handles from the context's
                handles (created when the capture began; none eagerly: 0)
    graph       cuGraphAddKernelNode (CUDA_KERNEL_NODE_PARAMS) + cuGraphKernelNodeSetAttribute
                per launch attribute; conditional handle arguments from the context
    replay      CUDA_KERNEL_NODE_PARAMS, whose kernelParams points into the packed struct: a
                rewritten scalar field (or an external buffer's pointer field) plus one
                cuGraphExecKernelNodeSetParams

The record: ``func`` (the ``CUfunction``), grid, block, ``sharedMemBytes``, ``kernelParams``
(the address of the packed ``void*`` array, `PackedArgs.address`), ``extra`` 0; ``kern`` /
``ctx`` left NULL (ignored when ``func`` is set).
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.compiler.griddep import PdlWithoutWaitError
from orchestra.compiler.launch import build_launch_config, launch_attribute_values
from orchestra.driver.check import cu, error_from_result
from orchestra.execute.kernel_args import resolve_kernel_node
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import KernelNode


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


def kernel_node_attributes(cfg) -> list:
    """``[(CUkernelNodeAttrID, CUkernelNodeAttrValue)]`` for ``cfg``'s launch attributes, for
    ``cuGraphKernelNodeSetAttribute`` (which takes ``CUkernelNodeAttrValue``, a subclass of the
    ``CUlaunchAttributeValue`` that `launch_attribute_values` builds). ``pdl`` is left out:
    in an explicitly built graph it is carried by the node's programmatic edges (edge data of
    type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC from its kernel dependencies, added by the
    graph-build executor), not by a node attribute."""
    return launch_attribute_values(cfg, id_type=_d.CUkernelNodeAttrID,
                                   value_type=_d.CUkernelNodeAttrValue, pdl=False)


@register
class KernelLowering(Lowering):
    """The lowering of `KernelNode` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = KernelNode
    graph_node = "kernel"
    driver_node_type = "CU_GRAPH_NODE_TYPE_KERNEL"
    replay_params = "CUDA_KERNEL_NODE_PARAMS"

    def resolve(self, node, executor):
        """`KernelArgs`: fresh packed arguments per resolution, never shared between execs
        or prepared plans (one exec's scalar replays cannot change another's)."""
        resolver = executor.kernel_resolver(node.device)
        kernel = resolver.resolve(node.kernel, node.name)
        ka = resolve_kernel_node(node, kernel)
        if ka.config.pdl and not resolver.waits_on_grid_dependency(node.kernel, node.name):
            exc = PdlWithoutWaitError(node.kernel.name)
            exc.add_note(f"kernel node {node.name} has the pdl attribute (programmatic "
                         "dependent launch; in a built graph, programmatic edges)")
            raise exc
        return ka

    def stream(self, node, ctx, stream):
        # the step launches with ka.packed's memory: its owner keeps ctx.resolved (eager: the
        # prepared plan; capture: the built graph's kernels)
        ka = ctx.resolved[node.name]
        a = ctx.addresses
        struct, address, func = ka.packed.struct, ka.packed.address, ka.kernel.function
        # a pointer into a bound (external) buffer is written by the binding table when the
        # binding changes; only pointers into the run's own allocations are written per run
        patches = tuple((p.field, a.device_slot(p.buffer), p.offset) for p in ka.pointers
                        if not ctx.bound_field(p.buffer, struct, p.field, p.offset))
        # conditional handles exist only once the graph that holds them does (capture: at its
        # start), so a capture reads them when the step runs; eagerly there is no graph, the
        # handles are 0 on every run, written once here
        handles = ctx.handles
        if ctx.capture:
            hpatches = tuple((h.field, h.condition) for h in ka.handles)
        else:
            ka.bind_handles({})
            hpatches = ()
        ptrs, sh = a.ptrs, stream.handle
        name = node.name
        if ctx.capture:
            params = kernel_params(ka)
            rec = ctx.record(node, params)
            ctx.built.kernels[node.name] = ka
            for p in ka.pointers:
                ctx.use(p.buffer, rec, struct, p.field, p.offset)
        if ka.needs_ex:
            config = build_launch_config(ka.config, sh)
            launch_ex = ctx.api.cuLaunchKernelEx

            def step():
                for field, slot, off in patches:
                    setattr(struct, field, ptrs[slot] + off)
                for field, cond in hpatches:
                    setattr(struct, field, handles.get(cond, 0))
                (err,) = launch_ex(config, func, address, 0)
                if err:
                    raise error_from_result("cuLaunchKernelEx", err, context=f"kernel {name}")
            return step
        launch = ctx.api.cuLaunchKernel
        cfg = ka.config
        (gx, gy, gz), (bx, by, bz), smem = cfg.grid, cfg.block, cfg.shared_mem
        if not patches and not hpatches:  # every pointer bound (or none): the launch alone
            def step():
                (err,) = launch(func, gx, gy, gz, bx, by, bz, smem, sh, address, 0)
                if err:
                    raise error_from_result("cuLaunchKernel", err, context=f"kernel {name}")
            return step

        def step():
            for field, slot, off in patches:
                setattr(struct, field, ptrs[slot] + off)
            for field, cond in hpatches:
                setattr(struct, field, handles.get(cond, 0))
            (err,) = launch(func, gx, gy, gz, bx, by, bz, smem, sh, address, 0)
            if err:
                raise error_from_result("cuLaunchKernel", err, context=f"kernel {name}")
        return step

    def graph(self, node, ctx, deps):
        ka = ctx.resolved[node.name]
        struct = ka.packed.struct
        for p in ka.pointers:
            setattr(struct, p.field, ctx.device_address(p.buffer) + p.offset)
        ka.bind_handles(ctx.handles)
        params = kernel_params(ka)
        gnode = ctx.add("cuGraphAddKernelNode", deps, params)
        for attr_id, value in kernel_node_attributes(ka.config):
            cu(ctx.api.cuGraphKernelNodeSetAttribute, gnode, attr_id, value)
        ctx.built.kernels[node.name] = ka
        rec = ctx.record(node, gnode, params)
        for p in ka.pointers:
            ctx.use(p.buffer, rec, struct, p.field, p.offset)
        return rec


__all__ = ["KernelLowering", "kernel_node_attributes", "kernel_params"]

"""Lowering of `If`, `While` and `Switch` (`Conditional`): body task graphs run on a condition
a kernel sets on the GPU.

    resolve       the driver's rules for a conditional body (`restrictions.CONDITIONAL_BODY`:
                  kernels, copies, memsets, child graphs, conditional nodes only), before any
                  CUDA call
    begin_graph   cuGraphConditionalHandleCreate on the graph that will hold the node (its
                  default, CU_GRAPH_COND_ASSIGN_DEFAULT with one), so the kernels before the
                  node, which take the handle as an argument, have it
    graph         cuGraphAddNode (CUgraphNodeParams: CU_GRAPH_NODE_TYPE_CONDITIONAL, the handle,
                  the type, one body per branch, the context); the driver makes the bodies
                  (phGraph_out), each built node by node (`bodies.build_body`)
    stream        captured: the same node added to the capturing graph at the stream's position
                  (`orchestra.driver.capture.add_captured_node`), each body captured into its
                  body graph from a side stream (`bodies.capture_body`); eager: the host-driven
                  equivalent (below)

The eager executor has no graph, hence no handle (its kernels get handle 0): it takes the branch
on the host. At the node it reads the condition's ``flag`` back (a 4-byte copy to pinned memory
on the node's stream, then a wait for that stream), where the kernels that set the condition
also store the value, and runs the chosen body's steps on the node's stream; a WHILE reads it
again after every run of its body. A condition with a default starts at its default (no node
before sets it: `orchestra.graph.bodies`). Each test costs the host a stream synchronization:
this is the loop a WHILE node saves. A condition without a flag is refused eagerly
(`EagerConditionError`), naming the graph executors.

Replays do not rewrite nodes inside bodies (`orchestra.execute.lowering.bodies`); the
conditional node's own parameters (type, number of bodies, handle) are fixed under exec update.
"""

from __future__ import annotations

import ctypes

from cuda.bindings import driver as _d

from orchestra.driver.capture import add_captured_node
from orchestra.driver.check import cu, error_from_result
from orchestra.errors import OrchestraError
from orchestra.execute.lowering.bodies import build_body, capture_body, lower_body, side_stream
from orchestra.execute.lowering.restrictions import CONDITIONAL_BODY, check_body
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph.nodes import Conditional

_T = _d.CUgraphConditionalNodeType
TYPES = {"if": _T.CU_GRAPH_COND_TYPE_IF, "while": _T.CU_GRAPH_COND_TYPE_WHILE,
         "switch": _T.CU_GRAPH_COND_TYPE_SWITCH}


class EagerConditionError(OrchestraError, ValueError):
    """The eager executor cannot take a conditional node's branch: its condition has no flag to
    read back. Raised before anything is enqueued."""


def conditional_params(node, handle: int, context):
    """``CUgraphNodeParams`` of a conditional node: its type, ``handle``, one body per branch,
    ``context`` (the ``CUcontext`` of the handle and of every body node)."""
    p = _d.CUgraphNodeParams()
    p.type = _d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    c = p.conditional
    c.handle = handle
    c.type = TYPES[node.cond_type]
    c.size = len(node.bodies)
    c.ctx = context
    return p


def body_graphs(params) -> list:
    """The body ``CUgraph`` s the driver made for a conditional node just added (the driver
    owns them: they live as long as the node)."""
    return list(params.conditional.phGraph_out)[:int(params.conditional.size)]


@register
class ConditionalLowering(Lowering):
    """The lowering of `If`, `While` and `Switch` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = Conditional
    graph_node = "conditional"
    driver_node_type = "CU_GRAPH_NODE_TYPE_CONDITIONAL"

    def resolve(self, node, executor):
        check_body(node, CONDITIONAL_BODY)
        return None

    def begin_graph(self, node, ctx, cugraph):
        cond = node.condition
        handle = cu(ctx.api.cuGraphConditionalHandleCreate, cugraph, ctx.device.context,
                    cond.default or 0, cond.flags)
        if int(handle) == 0:  # eager kernels get 0 for "no graph": a real handle never is
            raise OrchestraError(f"conditional {node.name}: cuGraphConditionalHandleCreate "
                                 "returned handle 0, which kernels read as no handle")
        ctx.handles[cond.name] = int(handle)

    def graph(self, node, ctx, deps):
        params = conditional_params(node, ctx.handles[node.condition.name], ctx.context)
        gnode = ctx.add_node(params, deps)
        rec = ctx.record(node, gnode, params)
        for cugraph, body in zip(body_graphs(params), node.bodies):
            build_body(ctx, body, cugraph, node.name)
        return rec

    def stream(self, node, ctx, stream):
        if ctx.capture:
            return self._captured(node, ctx, stream)
        return self._eager(node, ctx, stream)

    def _captured(self, node, ctx, stream):
        side = side_stream(ctx)
        programs = [lower_body(ctx, body, side, node.name) for body in node.bodies]
        rec = ctx.record(node, None)
        api, handles, cond, context = ctx.api, ctx.handles, node.condition.name, ctx.device.context

        def step():
            params = conditional_params(node, handles[cond], context)

            def add(graph, deps, edge_data):
                return cu(api.cuGraphAddNode, graph, deps or None, edge_data, len(deps), params)

            add_captured_node(stream, add, api)
            rec.params = params
            for cugraph, body, steps in zip(body_graphs(params), node.bodies, programs):
                capture_body(ctx, body, steps, side, cugraph)
        return step

    def _eager(self, node, ctx, stream):
        cond = node.condition
        if cond.flag is None:
            raise EagerConditionError(
                f"conditional {node.name}: the eager executor takes the branch on the host by "
                f"reading the condition's flag back, and condition {cond.name} has none; run "
                "this graph with the capture or graph-build executor (CaptureExecutor, "
                f"GraphBuildExecutor), or give Condition({cond.name!r}, flag=buffer) and have "
                "the kernel that sets it also store the value there")
        programs = [lower_body(ctx, body, stream, node.name) for body in node.bodies]
        a = ctx.addresses
        slot, off = a.device_slot(cond.flag.buffer.name), cond.flag.offset
        word = ctx.api.pinned_buffer(4, ctx.device)  # the closure keeps it
        cell = ctypes.c_uint32.from_address(int(word.ptr))
        copy, ptrs, sh, host = ctx.api.cuMemcpyDtoHAsync, a.ptrs, stream.handle, int(word.ptr)

        def read() -> int:
            (err,) = copy(host, ptrs[slot] + off, 4, sh)
            if err:
                raise error_from_result("cuMemcpyDtoHAsync", err,
                                        context=f"reading the flag of condition {cond.name}")
            stream.synchronize()
            return cell.value

        default, kind = cond.default, node.cond_type

        def first() -> int:
            return default if default is not None else read()

        def run(steps) -> None:
            for s in steps:
                s()

        if kind == "while":
            body = programs[0]

            def step():
                _ = word  # kept alive with the step
                value = first()
                while value:
                    run(body)
                    value = read()
        else:  # if / switch: the branch of the value (if: non-zero -> then; zero -> otherwise)
            def step():
                _ = word
                value = first()
                if kind == "if":
                    chosen = 0 if value else 1
                else:
                    chosen = value
                if chosen < len(programs):
                    run(programs[chosen])
        return step


__all__ = ["ConditionalLowering", "EagerConditionError", "TYPES", "body_graphs",
           "conditional_params"]

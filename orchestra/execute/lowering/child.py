"""Lowering of `ChildGraph`: a task graph run as one CUDA child graph node.

    resolve     the driver's rules for a child graph (`restrictions.CHILD_GRAPH`: no graph
                memory, no conditional nodes), before any CUDA call
    stream      eager: the child's nodes in place, on the node's stream (`bodies.lower_body`);
                captured: a child graph node added to the capturing graph at the stream's
                position (`orchestra.driver.capture.add_captured_node`), its embedded graph
                filled by capturing the child's nodes from a side stream
                (`bodies.capture_body`)
    graph       cuGraphAddChildGraphNode (cloning an empty graph), then the child's nodes
                added to the embedded graph (cuGraphChildGraphNodeGetGraph: no clone, the
                node owns it) through their entries (`bodies.build_body`)

Nothing is replayed per node (see `orchestra.execute.lowering.bodies`); the driver refuses to
disable a child graph node.
"""

from __future__ import annotations

from orchestra.driver.capture import add_captured_node
from orchestra.driver.check import cu
from orchestra.execute.lowering.bodies import build_body, capture_body, lower_body, side_stream
from orchestra.execute.lowering.restrictions import CHILD_GRAPH, check_body
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph.nodes import ChildGraph


def add_child_node(api, graph, deps: list):
    """A child graph node in ``graph`` after ``deps``, and its embedded graph (empty):
    ``(CUgraphNode, CUgraph)``. The node clones an empty graph made and destroyed here."""
    empty = cu(api.cuGraphCreate, 0)
    try:
        gnode = cu(api.cuGraphAddChildGraphNode, graph, deps or None, len(deps), empty)
    finally:
        api.cuGraphDestroy(empty)
    return gnode, cu(api.cuGraphChildGraphNodeGetGraph, gnode)


@register
class ChildGraphLowering(Lowering):
    """The lowering of `ChildGraph` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = ChildGraph
    graph_node = "graph"
    driver_node_type = "CU_GRAPH_NODE_TYPE_GRAPH"

    def resolve(self, node, executor):
        check_body(node, CHILD_GRAPH)
        return None

    def stream(self, node, ctx, stream):
        if not ctx.capture:
            steps = lower_body(ctx, node.graph, stream, node.name)

            def step():
                for s in steps:
                    s()
            return step
        side = side_stream(ctx)
        steps = lower_body(ctx, node.graph, side, node.name)
        ctx.record(node, None)
        api = ctx.api

        def step():
            embedded = []

            def add(graph, deps, edge_data):
                gnode, inner = add_child_node(api, graph, deps)
                embedded.append(inner)
                return gnode

            add_captured_node(stream, add, api)
            capture_body(ctx, node.graph, steps, side, embedded[0])
        return step

    def graph(self, node, ctx, deps):
        gnode, embedded = add_child_node(ctx.api, ctx.graph, deps)
        build_body(ctx, node.graph, embedded, node.name)
        return ctx.record(node, gnode, None)


__all__ = ["ChildGraphLowering", "add_child_node"]

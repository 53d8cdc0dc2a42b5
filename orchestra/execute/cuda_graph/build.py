"""The graph-build executor: a CUDA graph built node by node from the `TaskGraph`, no streams.

    with GraphBuildExecutor() as ex:
        exe = ex.build(graph, bindings={...})      # a GraphExec (see cuda_graph.exec)
        exe.launch(sync=True)

`prepare_build` runs the checks (pure Python, before any CUDA call): the graph is valid
(no cycle), the graph-memory policy (`spec.check_graph_memory`), and, unless
``verify=False``, the hazard verifier over the very edges the CUDA graph gets
(`schedule.verify_graph_edges` on the reduced edges). Then `spec.translate` gives the
nodes in creation order with their dependencies (``edges="plan"``, the default: the task
graph's own plus each plan stream's order, the shape a capture records, which the driver runs
faster than the widest DAG; ``edges="dag"``: the task graph's own alone), and each becomes one
driver call, made by the node's entry in the lowering table (`Lowering.graph`):

    mem_alloc  cuGraphAddMemAllocNode   (the driver returns the address in params.dptr)
    memcpy     cuGraphAddMemcpyNode     (CUDA_MEMCPY3D, 1-D, host side pinned)
    kernel     cuGraphAddKernelNode     (+ cuGraphKernelNodeSetAttribute per launch attribute;
                                         a node with the pdl attribute: its kernel
                                         dependencies added after it with programmatic edge
                                         data, cuGraphAddDependencies; also a host copy
                                         lowered to the copy kernel)
    memset     cuGraphAddMemsetNode
    host       cuGraphAddHostNode       (the executor's C trampoline, one token per function)
    mem_free   cuGraphAddMemFreeNode

A node with bodies adds its own node and builds its bodies into the body graphs node by node
the same way (`lowering.bodies.build_body`); before the first node, each node's entry makes what
it needs on the graph (``begin_graph``: conditional handles).

With ``trace=True`` every node sits between two event-record nodes
(``cuGraphAddEventRecordNode``, `GraphTracer.pair`), and successors depend on the second one.
"""

from __future__ import annotations

import time

from cuda.bindings import driver as _d

from orchestra.driver import cu
from orchestra.errors import CudaError
from orchestra.execute.bindings import release_keep
from orchestra.execute.cuda_graph.built import BuiltGraph
from orchestra.execute.cuda_graph.executor import GraphExecutorBase
from orchestra.execute.cuda_graph.spec import (
    GraphSpec,
    check_edge_source,
    check_findings,
    check_graph_memory,
    translate,
)
from orchestra.execute.lowering import lowering_for
from orchestra.execute.lowering.bodies import begin_graph
from orchestra.execute.lowering.copy import copy_kernel_nodes
from orchestra.execute.lowering.graph import GraphContext
from orchestra.graph import TaskGraph
from orchestra.schedule import verify_graph_edges


def prepare_build(graph: TaskGraph, *, auto_free: bool = False, verify: bool = True,
                  plan=None, edges: str = "dag", copies=None,
                  waits=None) -> tuple[GraphSpec, list]:
    """The pre-CUDA checks of a graph build, in order: ``graph.validate()`` (`GraphError`),
    the graph-memory policy (`GraphMemoryError` unless ``auto_free``), the translation
    (`spec.translate` with ``edges`` and ``plan``), the hazard verifier on the edges the
    CUDA graph gets, its programmatic edges ordering only consumers that ``waits(name)``
    (`HazardError`; allocations left unfreed on purpose are not findings with ``auto_free``).
    ``copies``: the `CopyPolicy` (which host copies become kernel nodes).
    Returns ``(spec, unfreed allocations)``."""
    graph.validate()
    unfreed = check_graph_memory(graph, auto_free=auto_free)
    spec = translate(graph, plan=plan, edges=edges, copies=copies)
    if verify:
        check_findings(verify_graph_edges(graph, spec.edges, programmatic=spec.programmatic_edges,
                                          waits=waits), auto_free=auto_free)
    return spec, unfreed


def programmatic_edge():
    """The ``CUgraphEdgeData`` of a programmatic edge: the consumer may launch once the
    producer triggers (or its blocks exit) and waits for its completion in
    ``griddepcontrol.wait`` (type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, from port
    CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, to port 0)."""
    e = _d.CUgraphEdgeData()
    e.type = _d.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    e.from_port = _d.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    e.to_port = 0
    return e


class GraphBuildExecutor(GraphExecutorBase):
    """Builds CUDA graphs explicitly from task graphs (``cuGraphAdd*Node``); see the module
    doc. ``device``, ``verify``, ``kernel_resolver``, ``auto_free``, ``driver``: as for the
    capture executor. ``build`` / ``run`` (from `GraphExecutorBase`) give `GraphExec` objects.

    Thread-safety: `build` takes no executor-wide lock: each build creates its own ``CUgraph``,
    records and binding table, and the pieces it shares (the `KernelResolver`, the copy-policy memo,
    the `PinnedCheck`) are safe to share. Concurrent builds are not exercised by the tests, though:
    orchestra's own users serialize them (`CudaBackend` holds a lock), and so should other callers.
    The `GraphExec` objects it returns are thread-safe.
    """

    executor_name = "graph-build"

    def _plan_checks(self, graph, plan, *, auto_free: bool, edges: str, copies=None):
        """`prepare_build`: ``(spec, unfreed)``; a programmatic edge's consumer waits when its
        kernel executes griddepcontrol.wait (`KernelResolver.waits_on_grid_dependency`)."""
        def waits(name: str) -> bool:
            node = graph.node(name)
            return self.kernels.waits_on_grid_dependency(node.kernel, name)

        return prepare_build(graph, auto_free=auto_free, verify=self.verify, plan=plan,
                             edges=edges, copies=copies, waits=waits)

    def _build_graph(self, graph: TaskGraph, plan, bindings, *, trace: bool, policy: str,
                     streams: int, costs, auto_free: bool, edges: str = "plan",
                     copies=None) -> BuiltGraph:
        """``edges``: ``"plan"`` (the default: the task graph's dependencies plus each plan
        stream's order, the shape a capture of ``plan``, or of the ``policy`` / ``streams``
        schedule, records) or ``"dag"`` (the task graph's dependencies alone: the widest
        graph). See `spec.translate`; measured on an H200 at 1,024 batches of 64 KiB,
        the DAG alone ran 1.12x to 1.58x the GPU time of the bare captured graph, the plan's
        shape 1.00x to 1.10x (benchmarks/bench_graphs.py)."""
        t0 = time.perf_counter_ns()
        check_edge_source(edges)  # before scheduling: the error names the argument
        plan = self._plan(graph, plan, policy, streams, costs, need=trace or edges == "plan")
        copies = copies if copies is not None else self.copy_policy()
        (spec, unfreed), resolved = self._checked(graph, plan, auto_free=auto_free, edges=edges,
                                                  copies=copies)
        modules = self._lease_modules(resolved)
        try:
            table = self._bindings(graph, bindings)
        except BaseException:
            release_keep(modules)
            raise
        dev = self.device
        dev.make_current()
        api = self.api
        try:
            g = cu(api.cuGraphCreate, 0)
        except BaseException:
            release_keep((table, modules))
            raise
        tracer = None
        try:
            built = BuiltGraph(g, graph, plan, self.executor_name, table)
            built.leases = modules
            if trace:
                from orchestra.trace import GraphTracer

                tracer = GraphTracer(dev, executor="graph-build")
                meta: dict = {"nodes": len(graph)}
                lowered = copy_kernel_nodes(resolved)
                if lowered:
                    meta["lowered"] = lowered
                tracer.begin(plan.stream_names, policy=plan.policy, meta=meta)
                built.tracer = tracer
            ctx = GraphContext(api, g, dev, resolved, built, table, copies)
            begin_graph(graph.nodes, ctx, g)  # e.g. conditional handles, before their setters
            tail: dict[str, object] = {}  # node -> the CUgraphNode its successors depend on
            edge = programmatic_edge()
            for sn in spec.nodes:
                node = graph.node(sn.name)
                # programmatic edges come after the node (edge data); traced builds put event
                # nodes between kernels, so their edges are all full ones
                prog = [tail[d] for d in sn.programmatic] if tracer is None else []
                deps = [tail[d] for d in sn.deps if tracer is not None
                        or d not in sn.programmatic]
                try:
                    if tracer is not None:
                        start, end = tracer.pair(plan.stream_of(sn.name), node)
                        deps = [cu(api.cuGraphAddEventRecordNode, g, deps or None, len(deps),
                                   start.handle)]
                    rec = lowering_for(node).graph(node, ctx, deps)
                    if prog:
                        cu(api.cuGraphAddDependencies, g, prog, [rec.gnode] * len(prog),
                           [edge] * len(prog), len(prog))
                    if tracer is not None:
                        tail[sn.name] = cu(api.cuGraphAddEventRecordNode, g, [rec.gnode], 1,
                                           end.handle)
                    else:
                        tail[sn.name] = rec.gnode
                except CudaError as exc:
                    raise exc.with_context(f"graph-build: adding node {sn.name} ({sn.kind})") \
                        from exc
            built.unfreed = [ctx.alloc_of[a] for a, _ in unfreed]
            built.meta["spec"] = spec
        except BaseException:
            api.cuGraphDestroy(g)
            if tracer is not None:
                tracer.close()
            release_keep((table, modules))  # nothing of the graph ever ran
            raise
        built.build_ms = (time.perf_counter_ns() - t0) / 1e6
        return built


__all__ = ["GraphBuildExecutor", "prepare_build"]

"""The graph-build executor: a CUDA graph built node by node from the `TaskGraph`, no streams.

    with GraphBuildExecutor() as ex:
        exe = ex.build(graph, bindings={...})      # a GraphExec (see graph_exec)
        exe.launch(sync=True)

`prepare_build` runs the checks (pure Python, before any CUDA call): the graph is valid
(no cycle), the graph-memory policy (`graph_spec.check_graph_memory`), and, unless
``verify=False``, the hazard verifier over the very edges the CUDA graph gets
(`schedule.verify_graph_edges` on the reduced edges). Then `graph_spec.translate` gives the
nodes in creation order with their dependencies (``edges="plan"``, the default: the task
graph's own plus each plan stream's order, the shape a capture records, which the driver runs
faster than the widest DAG; ``edges="dag"``: the task graph's own alone), and each becomes one
driver call:

    mem_alloc  cuGraphAddMemAllocNode   (the driver returns the address in params.dptr)
    memcpy     cuGraphAddMemcpyNode     (CUDA_MEMCPY3D, 1-D, host side pinned)
    kernel     cuGraphAddKernelNode     (+ cuGraphKernelNodeSetAttribute per launch attribute)
    memset     cuGraphAddMemsetNode
    host       cuGraphAddHostNode       (the executor's C trampoline, one token per function)
    mem_free   cuGraphAddMemFreeNode

With ``trace=True`` every node sits between two event-record nodes
(``cuGraphAddEventRecordNode``, `GraphTracer.pair`), and successors depend on the second one.
"""

from __future__ import annotations

import time

from cuda.bindings import driver as _d

from orchestra.driver import cu
from orchestra.errors import CudaError
from orchestra.execute.cuda_graph.exec import BuiltGraph, NodeRecord
from orchestra.execute.cuda_graph.executor import (
    GraphExecutorBase,
    alloc_params,
    host_params,
    kernel_node_attributes,
    kernel_params,
    memcpy_params,
    memset_params,
)
from orchestra.execute.cuda_graph.spec import (
    GraphSpec,
    check_edge_source,
    check_findings,
    check_graph_memory,
    translate,
)
from orchestra.execute.hostfunc import HostCallbacks
from orchestra.graph import TaskGraph
from orchestra.schedule import verify_graph_edges


def prepare_build(graph: TaskGraph, *, auto_free: bool = False, verify: bool = True,
                  plan=None, edges: str = "dag") -> tuple[GraphSpec, list]:
    """The pre-CUDA checks of a graph build, in order: ``graph.validate()`` (`GraphError`),
    the graph-memory policy (`GraphMemoryError` unless ``auto_free``), the translation
    (`graph_spec.translate` with ``edges`` and ``plan``), the hazard verifier on the edges the
    CUDA graph gets (`HazardError`; allocations left unfreed on purpose are not findings with
    ``auto_free``). Returns ``(spec, unfreed allocations)``."""
    graph.validate()
    unfreed = check_graph_memory(graph, auto_free=auto_free)
    spec = translate(graph, plan=plan, edges=edges)
    if verify:
        check_findings(verify_graph_edges(graph, spec.edges), auto_free=auto_free)
    return spec, unfreed


class GraphBuildExecutor(GraphExecutorBase):
    """Builds CUDA graphs explicitly from task graphs (``cuGraphAdd*Node``); see the module
    doc. ``device``, ``verify``, ``kernel_resolver``, ``auto_free``: as for the capture
    executor. ``build`` / ``run`` (from `GraphExecutorBase`) give `GraphExec` objects."""

    executor_name = "graph-build"

    def _build_graph(self, graph: TaskGraph, plan, bindings, *, trace: bool, policy: str,
                     streams: int, costs, auto_free: bool, edges: str = "plan") -> BuiltGraph:
        """``edges``: ``"plan"`` (the default: the task graph's dependencies plus each plan
        stream's order, the shape a capture of ``plan``, or of the ``policy`` / ``streams``
        schedule, records) or ``"dag"`` (the task graph's dependencies alone: the widest
        graph). See `graph_spec.translate`; measured on an H200 at 1,024 batches of 64 KiB,
        the DAG alone ran 1.12x to 1.58x the GPU time of the bare captured graph, the plan's
        shape 1.00x to 1.10x (benchmarks/bench_graphs.py)."""
        t0 = time.perf_counter_ns()
        check_edge_source(edges)  # before scheduling: the error names the argument
        plan = self._plan(graph, plan, policy, streams, costs, need=trace or edges == "plan")
        spec, unfreed = prepare_build(graph, auto_free=auto_free, verify=self.verify,
                                      plan=plan, edges=edges)
        self._check_devices(graph)
        kargs = self._resolve_kernels(graph)
        dev = self.device
        dev.make_current()
        ctx = dev.context
        g = cu(_d.cuGraphCreate, 0)
        tracer = None
        try:
            built, resolved = self._new_built(g, graph, plan, bindings)
            if trace:
                from orchestra.trace import GraphTracer

                tracer = GraphTracer(dev, executor="graph-build")
                tracer.begin(plan.stream_names, policy=plan.policy,
                             meta={"nodes": len(graph)})
                built.tracer = tracer
            if any(n.kind == "host" for n in graph.nodes):
                built.callbacks = HostCallbacks()
            addr = {name: b.address for name, b in resolved.device.items()}
            haddr = {name: b.address for name, b in resolved.host.items()}
            tail: dict[str, object] = {}  # node -> the CUgraphNode its successors depend on
            dptrs: dict[str, object] = {}  # buffer -> CUdeviceptr of its live allocation
            alloc_of: dict[str, int] = {}  # alloc node -> address
            for sn in spec.nodes:
                node = graph.node(sn.name)
                deps = [tail[d] for d in sn.deps]
                try:
                    if tracer is not None:
                        start, end = tracer.pair(plan.stream_of(sn.name), node)
                        deps = [cu(_d.cuGraphAddEventRecordNode, g, deps or None, len(deps),
                                   start.handle)]
                    rec = self._add(g, ctx, built, node, sn.kind, deps, addr, haddr, dptrs,
                                    kargs, alloc_of)
                    if tracer is not None:
                        tail[sn.name] = cu(_d.cuGraphAddEventRecordNode, g, [rec.gnode], 1,
                                           end.handle)
                    else:
                        tail[sn.name] = rec.gnode
                except CudaError as exc:
                    raise exc.with_context(f"graph-build: adding node {sn.name} ({sn.kind})") \
                        from exc
            built.unfreed = [alloc_of[a] for a, _ in unfreed]
            built.meta["spec"] = spec
        except BaseException:
            _d.cuGraphDestroy(g)
            if tracer is not None:
                tracer.close()
            raise
        built.build_ms = (time.perf_counter_ns() - t0) / 1e6
        return built

    def _add(self, g, ctx, built, node, kind, deps, addr, haddr, dptrs, kargs, alloc_of):
        n = len(deps)
        dl = deps or None
        if kind == "mem_alloc":
            params = alloc_params(node.buffer.nbytes, self.device.ordinal)
            gnode = cu(_d.cuGraphAddMemAllocNode, g, dl, n, params)
            dptr = params.dptr
            if int(dptr) == 0:  # the binding did not write back: ask the node (address only)
                dptr = cu(_d.cuGraphMemAllocNodeGetParams, gnode).dptr
            b = node.buffer.name
            addr[b] = int(dptr)
            dptrs[b] = dptr
            built.allocs[b] = int(dptr)
            alloc_of[node.name] = int(dptr)
            return built.add(NodeRecord(node.name, kind, gnode, params))
        if kind == "mem_free":
            b = node.buffer.name
            gnode = cu(_d.cuGraphAddMemFreeNode, g, dl, n, dptrs.pop(b))
            return built.add(NodeRecord(node.name, kind, gnode, None))
        if kind == "memcpy":
            if node.kind == "h2d":
                hname, dname = node.src.buffer.name, node.dst.buffer.name
            else:
                hname, dname = node.dst.buffer.name, node.src.buffer.name
            params, field, off = memcpy_params(node, haddr[hname], addr[dname])
            gnode = cu(_d.cuGraphAddMemcpyNode, g, dl, n, params, ctx)
            rec = built.add(NodeRecord(node.name, kind, gnode, params))
            built.host_users[hname].append((rec, field, off))
            return rec
        if kind == "kernel":
            ka = kargs[node.name]
            ka.bind(addr)
            params = kernel_params(ka)
            gnode = cu(_d.cuGraphAddKernelNode, g, dl, n, params)
            for attr_id, value in kernel_node_attributes(ka.config):
                cu(_d.cuGraphKernelNodeSetAttribute, gnode, attr_id, value)
            built.kernels[node.name] = ka
            return built.add(NodeRecord(node.name, kind, gnode, params))
        if kind == "memset":
            params = memset_params(node, addr[node.dst.buffer.name])
            gnode = cu(_d.cuGraphAddMemsetNode, g, dl, n, params, ctx)
            return built.add(NodeRecord(node.name, kind, gnode, params))
        if kind == "host":
            cb = built.callbacks
            token = cb.add(node.fn, node.name)
            params = host_params(cb.address, token)
            gnode = cu(_d.cuGraphAddHostNode, g, dl, n, params)
            return built.add(NodeRecord(node.name, kind, gnode, params))
        raise AssertionError(f"unhandled CUDA node kind {kind}")


__all__ = ["GraphBuildExecutor", "prepare_build"]

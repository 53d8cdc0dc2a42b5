"""The pure translation of a `TaskGraph` into a CUDA graph's shape (no CUDA calls).

`translate(graph)` gives the `GraphSpec` the graph-build executor builds node by node: one
`SpecNode` per orchestra node, in the graph's topological order (so every dependency is created
before its dependents), each with the CUDA node kind it becomes and the names of the nodes it
depends on. The dependencies are the graph's transitively reduced edges (`reduced_edges`): the
same order as the full edge set (a CUDA graph orders through paths), with the fewest edges.

    orchestra kind   CUDA graph node                     driver call
    alloc            mem_alloc                           cuGraphAddMemAllocNode
    h2d / d2h        memcpy (CUDA_MEMCPY3D, 1-D)         cuGraphAddMemcpyNode
                     or kernel (the copy kernel)         cuGraphAddKernelNode
    kernel           kernel                              cuGraphAddKernelNode
    memset           memset                              cuGraphAddMemsetNode
    host             host                                cuGraphAddHostNode
    free             mem_free                            cuGraphAddMemFreeNode

Each node's CUDA graph node kind comes from its entry in the lowering table
(`orchestra.execute.lowering`, ``Lowering.graph_node_of``: a host copy's kind depends on the
build's `CopyPolicy`); the translation itself makes no driver call.

Programmatic edges: a kernel node with the ``pdl`` launch attribute (a consumer that executes
``griddepcontrol.wait``, which the kernel lowering checks) gets programmatic edges from its
kernel dependencies (``SpecNode.programmatic``): the graph-build executor adds them with
``CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`` edge data, so the consumer may launch while its
producer runs and waits for it in its ``griddepcontrol.wait``. Every other dependency, and
every dependency of a node without the attribute, is a full edge.

The graph-memory policy lives here too, because it is a property of the task graph:
every `Alloc` of a graph that becomes a CUDA graph must have its `Free` in the same graph, so a
replayed graph never leaks its allocations; `check_graph_memory` refuses a graph that breaks
this, unless the caller opted in to ``auto_free`` (the exec is then instantiated with
``CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH``, which frees the unfreed allocations of the
previous launch when the graph is launched again). `check_findings` raises the hazard
verifier's findings for both graph executors, leaving out NEVER_FREED under that opt-in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs

from orchestra.errors import GraphError, HazardError, NotFoundError
from orchestra.execute.errors import (
    ExecutorArgumentTypeError,
    ExecutorArgumentValueError,
    PlanMismatchError,
)
from orchestra.execute.lowering import lowering_for
from orchestra.graph import Alloc, Free, TaskGraph
from orchestra.graph.taskgraph import kahn_order, transitive_reduction
from orchestra.schedule import Plan


class GraphMemoryError(GraphError):
    """A task graph that is to become a CUDA graph allocates memory it never frees.

    ``unfreed`` lists ``(alloc node, buffer)`` pairs. Nothing was built or enqueued.
    """

    def __init__(self, unfreed):
        self.unfreed = tuple(unfreed)
        listed = ", ".join(f"{a} (buffer {b})" for a, b in self.unfreed)
        super().__init__(
            f"a CUDA graph must free what it allocates: {listed} "
            f"{'has' if len(self.unfreed) == 1 else 'have'} no Free node in the graph, so every "
            "replay would allocate again and the memory would only come back outside the graph. "
            "Add a Free node after the buffer's last use, or pass auto_free=True to instantiate "
            "with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH (each launch then frees what "
            "the previous launch left allocated)")

    def __reduce__(self):
        return (type(self), (self.unfreed,))


@attrs.frozen
class SpecNode:
    """One CUDA graph node to create: ``name`` (the orchestra node), ``kind`` (CUDA node kind,
    see `cuda_kind`), ``source_kind`` (the orchestra kind), ``deps`` (names of the nodes it
    depends on, in creation order), ``direction`` ("h2d" / "d2h" for host copies, memcpy
    nodes and copy kernels alike, else None), ``programmatic`` (the deps whose edges are
    programmatic; see the module doc).

    Immutable: may be shared between threads freely.
    """

    name: str
    kind: str
    source_kind: str
    deps: tuple[str, ...]
    direction: str | None = None
    programmatic: tuple[str, ...] = ()


@attrs.frozen
class GraphSpec:
    """The CUDA graph to build: `nodes` in creation order (every node after its deps).

    Immutable: may be shared between threads freely.
    """

    nodes: tuple[SpecNode, ...]

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.nodes)

    @property
    def edges(self) -> frozenset[tuple[str, str]]:
        """Every ``(dependency, node)`` edge."""
        return frozenset((d, n.name) for n in self.nodes for d in n.deps)

    @property
    def programmatic_edges(self) -> frozenset[tuple[str, str]]:
        """The ``(producer, consumer)`` edges that are programmatic."""
        return frozenset((d, n.name) for n in self.nodes for d in n.programmatic)

    def kinds(self) -> dict[str, str]:
        """node name -> CUDA node kind."""
        return {n.name: n.kind for n in self.nodes}

    def counts(self) -> Counter:
        """How many nodes of each CUDA kind."""
        return Counter(n.kind for n in self.nodes)

    def node(self, name: str) -> SpecNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise NotFoundError(f"no node named {name!r} in the graph spec")

    def topology(self) -> tuple:
        """A hashable description of the shape: ``((kind, (dep index, ...)), ...)`` in creation
        order. Two specs with equal topology give topologically identical CUDA graphs (what
        ``cuGraphExecUpdate`` needs); node names do not enter it."""
        index = {n.name: i for i, n in enumerate(self.nodes)}
        return tuple((n.kind, tuple(sorted(index[d] for d in n.deps)),
                      tuple(sorted(index[d] for d in n.programmatic))) for n in self.nodes)


def cuda_kind(node, copies=None) -> str:
    """The CUDA graph node kind an orchestra node becomes (its lowering's ``graph_node_of``
    under ``copies``, the `CopyPolicy`: a host copy lowered to the copy kernel is a
    ``kernel``); `GraphError` for a kind no CUDA graph node exists for."""
    try:
        kind = lowering_for(node).graph_node_of(node, copies)
    except GraphError:
        raise GraphError(f"node {node.name}: node kind {node.kind!r} ({type(node).__name__}) "
                         "has no CUDA graph node translation (no entry in the lowering "
                         "table)") from None
    if kind is None:
        raise GraphError(f"node {node.name}: node kind {node.kind!r} ({type(node).__name__}) "
                         "has no CUDA graph node translation; run it with the eager executor")
    return kind


EDGE_SOURCES = ("dag", "plan")


def stream_order_edges(plan) -> set[tuple[str, str]]:
    """``(a, b)`` for every two nodes run one after the other on one stream of ``plan``: the
    ordering a capture of the plan records besides the task graph's own edges."""
    out: set[tuple[str, str]] = set()
    for name in plan.stream_names:
        nodes = plan.nodes(name)
        out.update(zip(nodes, nodes[1:]))
    return out


def check_edge_source(edges: str) -> None:
    """``ValueError`` unless ``edges`` is one of `EDGE_SOURCES`."""
    if edges not in EDGE_SOURCES:
        raise ExecutorArgumentValueError(
            f"edges must be one of {', '.join(EDGE_SOURCES)}; got {edges!r}")


def _plan_order(names, edges) -> list[str]:
    """A topological order of ``names`` under the DAG-plus-stream-order ``edges``; `GraphError`
    when a plan's stream order contradicts the graph's edges."""
    order = kahn_order(names, edges)
    if len(order) != len(names):
        done = set(order)
        stuck = [n for n in names if n not in done]
        shown = ", ".join(stuck[:6]) + (f" and {len(stuck) - 6} more" if len(stuck) > 6 else "")
        raise GraphError("the plan's stream order contradicts the graph's edges: a cycle runs "
                         f"through these nodes or they wait behind one ({shown}); schedule "
                         "the graph again")
    return order


def translate(graph: TaskGraph, *, reduce: bool = True, plan=None,
              edges: str = "dag", copies=None) -> GraphSpec:
    """The CUDA graph shape of ``graph``: nodes in topological order (ties: program order),
    dependencies from ``graph.reduced_edges()`` (or every edge with ``reduce=False``).

    ``edges="plan"`` (needs ``plan``, a `schedule.Plan` of this graph) adds the plan's stream
    order: each node also depends on the node before it on its plan stream, the ordering a
    stream capture of that plan records, so the CUDA graph has the capture's few long chains
    instead of the task graph's widest DAG (the driver runs wide DAGs on more internal streams
    and launches them at more host cost). The union is transitively reduced.

    ``copies`` (a `CopyPolicy`; None: every copy a memcpy node) decides which host copies
    become ``kernel`` nodes (the copy kernel); their `SpecNode` keeps ``source_kind`` and
    ``direction`` ("h2d" / "d2h").

    A kernel node with the ``pdl`` attribute gets programmatic edges from its kernel
    dependencies (``SpecNode.programmatic``; the module doc), copy kernels among them: a
    capture turns the pdl launch after a copy kernel into the same edge.

    Raises `GraphError` for a cycle, an unknown ``after=`` name, a node kind without a CUDA
    graph node, or a plan whose stream order contradicts the edges; ``ValueError`` for an
    unknown ``edges`` or ``edges="plan"`` without a plan or with another graph's plan;
    ``TypeError`` for a plan that is not a `schedule.Plan`.
    """
    check_edge_source(edges)
    order: Sequence[str] = graph.topological_order()  # validates
    if edges == "plan":
        if plan is None:
            raise ExecutorArgumentValueError(
                'edges="plan" needs the plan whose stream order to add')
        if not isinstance(plan, Plan):
            raise ExecutorArgumentTypeError(
                f"plan must be a schedule.Plan, got {type(plan).__name__}")
        names = [n.name for n in graph.nodes]
        planned = set(plan.node_stream)
        if planned != set(names):
            missing = sorted(set(names) - planned)[:4] or sorted(planned - set(names))[:4]
            raise PlanMismatchError(
                f"the plan is not a plan of this graph (node mismatch: {missing})")
        union = set(graph.edges) | stream_order_edges(plan)
        order = _plan_order(names, union)
        deps = transitive_reduction(order, union) if reduce else frozenset(union)
    else:
        deps = graph.reduced_edges() if reduce else graph.edges
    preds: dict[str, list[str]] = {n: [] for n in order}
    for p, s in deps:
        preds[s].append(p)
    pos = {n: i for i, n in enumerate(order)}
    out = []
    kinds: dict[str, str] = {}
    for name in order:
        node = graph.node(name)
        kind = kinds[name] = cuda_kind(node, copies)
        direction = node.kind if node.kind in ("h2d", "d2h") else None
        node_deps = tuple(sorted(preds[name], key=pos.__getitem__))
        programmatic: tuple[str, ...] = ()
        if kind == "kernel" and dict(getattr(node, "attributes", ())).get("pdl"):
            programmatic = tuple(d for d in node_deps if kinds[d] == "kernel")
        out.append(SpecNode(name, kind, node.kind, node_deps, direction, programmatic))
    return GraphSpec(tuple(out))


def unfreed_allocations(graph: TaskGraph) -> list[tuple[str, str]]:
    """``(alloc node, buffer)`` for every `Alloc` whose buffer no later `Free` of the graph
    releases (program order), in program order."""
    live: dict[str, str] = {}
    out: list[tuple[str, str]] = []
    for node in graph.nodes:
        if isinstance(node, Alloc):
            b = node.buffer.name
            if b in live:
                out.append((live[b], b))  # allocated again without a free in between
            live[b] = node.name
        elif isinstance(node, Free):
            live.pop(node.buffer.name, None)
    out.extend((a, b) for b, a in live.items())
    return sorted(out, key=lambda ab: graph.index(ab[0]))


def check_graph_memory(graph: TaskGraph, *, auto_free: bool = False) -> list[tuple[str, str]]:
    """The graph-memory policy: raise `GraphMemoryError` when an `Alloc` has no `Free` in ``graph``,
    unless ``auto_free`` (then return the unfreed allocations, which the exec frees on each
    relaunch and at close)."""
    unfreed = unfreed_allocations(graph)
    if unfreed and not auto_free:
        raise GraphMemoryError(unfreed)
    return unfreed


def check_findings(findings, *, auto_free: bool = False) -> None:
    """Raise `HazardError` for the verifier's ``findings`` on a graph that is to become a CUDA
    graph; with ``auto_free`` (the opt-in) NEVER_FREED findings are left out: those
    allocations are left unfreed on purpose."""
    if auto_free:
        findings = [f for f in findings if f.kind != "NEVER_FREED"]
    if findings:
        raise HazardError(findings)


__all__ = ["EDGE_SOURCES", "GraphMemoryError", "GraphSpec",
           "SpecNode", "check_edge_source", "check_findings", "check_graph_memory", "cuda_kind",
           "stream_order_edges", "translate", "unfreed_allocations"]

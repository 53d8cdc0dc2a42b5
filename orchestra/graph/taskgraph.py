"""`TaskGraph`: nodes in program order, with edges inferred from what they touch.

Adding a node asks the byte-range tracker which earlier nodes it conflicts with (read-after-write,
write-after-read, write-after-write on overlapping bytes of one buffer) and adds those edges, plus
``after=`` edges. ``after=`` may name a node added later (the edge appears when it is added), so a
cycle is possible; `validate()` reports it by name. A node with bodies (task graphs it runs as a
unit, `orchestra.graph.bodies`) is one node here, accessing what its bodies touch; `validate()`
also checks the bodies and the conditions.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import TypeVar

from orchestra.errors import GraphError, NameCollisionError
from orchestra.graph.bodies import check_bodies
from orchestra.graph.buffers import Buffer, Condition, HostBuffer
from orchestra.graph.nodes import Node
from orchestra.graph.ranges import RangeTracker
from orchestra.graph.reach import ChainClocks

N = TypeVar("N", bound=Node)


class TaskGraph:
    """A DAG of node records. Nodes keep insertion (program) order; every query is deterministic."""

    def __init__(self):
        self._nodes: dict[str, Node] = {}
        self._index: dict[str, int] = {}
        self._buffers: dict[str, Buffer | HostBuffer] = {}
        self._preds: dict[str, dict[str, str]] = {}  # node -> {pred: reason}
        self._succs: dict[str, dict[str, str]] = {}
        self._explicit: set[tuple[str, str]] = set()
        self._waiting: dict[str, list[str]] = defaultdict(list)  # unknown after-name -> nodes
        self._tracker = RangeTracker()
        self._topo: tuple[str, ...] | None = None
        self._topo_pos: dict[str, int] | None = None  # node -> place in _topo (with _topo)
        self._control = False  # a node with bodies or touching a condition: check_bodies
        self._container: str | None = None  # the node whose body this graph is
        self._backward = False  # an edge to an earlier node (an after= naming a later one)

    # -- building ---------------------------------------------------------------------------

    def add(self, node: N) -> N:
        """Add ``node`` after every node added so far (program order); returns it."""
        if not isinstance(node, Node):
            raise GraphError(f"TaskGraph.add takes a node record (Alloc, HostToDevice, ...); got {node!r}")
        name = node.name
        nodes = self._nodes
        if name in nodes:
            raise NameCollisionError(f"a node named {name!r} is already in the graph "
                                     f"({type(nodes[name]).__name__}); node names must be unique")
        after = node.after
        if after and name in after:
            raise GraphError(f"node {name!r} lists itself in after=")
        bodies = node.bodies
        if bodies and any(b is self for b in bodies):
            raise GraphError(f"node {name!r}: a body of it is the graph it is added to; a body "
                             "must be a separate TaskGraph")
        accesses = node._accesses
        if accesses is None or bodies:
            # a subclass that skipped Node's __attrs_post_init__, or a node with bodies (which
            # may have grown since the node was made: they are complete once it is added)
            accesses = node.accesses()
            object.__setattr__(node, "_accesses", accesses)
        buffers = self._buffers
        for acc in accesses:
            buf = acc.range.buffer
            known = buffers.get(buf.name)
            if known is None:
                buffers[buf.name] = buf
                if isinstance(buf, Condition):
                    self._control = True
            elif known is not buf:
                self._register(buf, name)  # equal, or a clash to report
        if bodies or node.tests is not None:
            self._control = True
            for body in bodies:
                body._container = name  # checked with the whole tree, from the top
        nodes[name] = node
        index = self._index
        index[name] = len(index)
        # inferred edges come first: none is there yet (the tracker's dict is a fresh one)
        preds = self._preds[name] = self._tracker.access(name, accesses)
        succs = self._succs
        succs[name] = {}
        for pred, reason in preds.items():
            succs[pred][name] = reason
        if after:
            explicit = self._explicit
            for pred in after:
                if pred in nodes:  # _edge(pred, name, "after", explicit=True), inline
                    preds.setdefault(pred, "after")
                    succs[pred].setdefault(name, "after")
                    explicit.add((pred, name))
                else:
                    self._waiting[pred].append(name)
        if self._waiting:
            for succ in self._waiting.pop(name, ()):
                self._edge(name, succ, "after", explicit=True)
                self._backward = True
        self._topo = self._topo_pos = None
        return node

    def _register(self, buf, node_name):
        known = self._buffers.get(buf.name)
        if known is None:
            self._buffers[buf.name] = buf
        elif known != buf:
            raise NameCollisionError(f"node {node_name!r}: buffer name {buf.name!r} already names {known!r}, "
                             f"not {buf!r}; give different buffers different names")

    def _edge(self, pred, succ, reason, explicit=False):
        self._preds[succ].setdefault(pred, reason)
        self._succs[pred].setdefault(succ, reason)
        if explicit:
            self._explicit.add((pred, succ))

    # -- queries ----------------------------------------------------------------------------

    def __len__(self):
        return len(self._nodes)

    def __contains__(self, name):
        return name in self._nodes

    def __iter__(self):
        return iter(self._nodes.values())

    @property
    def nodes(self) -> tuple[Node, ...]:
        """Every node, in insertion order."""
        return tuple(self._nodes.values())

    def node_map(self) -> dict[str, Node]:
        """Every node name -> its node, in insertion order: the graph's own table, for
        algorithms that visit every node (do not modify it)."""
        return self._nodes

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None

    def accesses(self, name: str) -> tuple:
        """Node ``name``'s ``accesses()``, computed once when it was added (nodes are
        immutable): what the scheduler and the verifier read instead of building them again."""
        try:
            accesses = self._nodes[name]._accesses
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None
        assert accesses is not None  # add() filled it
        return accesses

    def index(self, name: str) -> int:
        """Insertion (program-order) position of node ``name``."""
        try:
            return self._index[name]
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        """Device buffers, in order of first use."""
        return tuple(b for b in self._buffers.values() if isinstance(b, Buffer))

    @property
    def host_buffers(self) -> tuple[HostBuffer, ...]:
        """Host buffers, in order of first use."""
        return tuple(b for b in self._buffers.values() if isinstance(b, HostBuffer))

    @property
    def conditions(self) -> tuple[Condition, ...]:
        """Conditions (conditional handles) the nodes set or test, in order of first use."""
        return tuple(b for b in self._buffers.values() if isinstance(b, Condition))

    def buffer(self, name: str):
        try:
            return self._buffers[name]
        except KeyError:
            raise GraphError(f"no buffer named {name!r} is used by the graph") from None

    @property
    def edges(self) -> frozenset[tuple[str, str]]:
        """Every (pred, succ) edge: inferred from accesses and explicit ``after=``."""
        return frozenset((p, s) for s, ps in self._preds.items() for p in ps)

    @property
    def edge_count(self) -> int:
        """``len(self.edges)``, without building the set."""
        return sum(len(ps) for ps in self._preds.values())

    @property
    def explicit_edges(self) -> frozenset[tuple[str, str]]:
        """The edges that come from ``after=``."""
        return frozenset(self._explicit)

    def edge_reason(self, pred: str, succ: str) -> str:
        """Why the edge exists, e.g. ``"RAW b0.in"`` or ``"after"``."""
        return self._preds[succ][pred]

    def predecessor_map(self) -> dict[str, dict[str, str]]:
        """Every node -> ``{predecessor: edge reason}``, in no particular order: the graph's own
        table, for algorithms that visit every edge (do not modify it)."""
        return self._preds

    def predecessors(self, name: str) -> tuple[str, ...]:
        """The nodes ``name`` depends on, in program order."""
        return self._ordered(self._preds, name)

    def successors(self, name: str) -> tuple[str, ...]:
        """The nodes that depend on ``name``, in program order."""
        return self._ordered(self._succs, name)

    def _ordered(self, adjacency, name):
        try:
            ns = adjacency[name]
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None
        if len(ns) < 2:
            return tuple(ns)
        return tuple(sorted(ns, key=self._index.__getitem__))

    # -- structure --------------------------------------------------------------------------

    def validate(self, *, bodies: bool = True) -> None:
        """Raise `GraphError` for an ``after=`` naming no node, or for a cycle (naming its nodes);
        with bodies or conditions (and ``bodies``, the default), also what
        `orchestra.graph.bodies.check_bodies` checks, unless this graph is the body of a node
        (then the graph holding it checks the whole tree: a body alone cannot tell whether a
        condition it sets is tested outside it)."""
        if self._waiting:
            missing = ", ".join(f"{w!r} (after= of {', '.join(repr(n) for n in ns)})"
                                for w, ns in sorted(self._waiting.items()))
            raise GraphError(f"after= names node(s) not in the graph: {missing}")
        self._kahn()
        if bodies and self._control and self._container is None:
            check_bodies(self)

    def _kahn(self) -> tuple[str, ...]:
        if self._topo is not None:
            return self._topo
        if not self._backward:  # every edge goes forward: program order is Kahn's order
            self._topo = tuple(self._nodes)
            return self._topo
        names = list(self._nodes)
        order = kahn_order(names, ((n, s) for n in names for s in self._succs[n]))
        if len(order) != len(names):
            cycle = self._find_cycle(set(names) - set(order))
            why = ", ".join(f"{p} -> {q}: " + ("after=" if self._preds[q][p] == "after"
                                                else self._preds[q][p])
                            for p, q in zip(cycle, cycle[1:]))
            raise GraphError(f"cycle: {' -> '.join(cycle)} ({why}); no order can run these "
                             "nodes: remove an after= or add the nodes in the order they must run "
                             "(buffer dependencies follow insertion order)")
        self._topo = tuple(order)
        return self._topo

    def _find_cycle(self, stuck: set[str]) -> list[str]:
        # Every stuck node has a stuck predecessor: walk predecessors until a node repeats.
        start = min(stuck, key=self._index.__getitem__)
        path, seen = [start], {start: 0}
        while True:
            pred = min((p for p in self._preds[path[-1]] if p in stuck), key=self._index.__getitem__)
            if pred in seen:
                cycle = path[seen[pred]:] + [pred]
                return cycle[::-1]  # walked backwards; print in edge direction
            seen[pred] = len(path)
            path.append(pred)

    def topological_order(self) -> tuple[str, ...]:
        """Node names in dependency order; among ready nodes, the earliest added goes first."""
        self.validate()
        return self._kahn()

    def topological_positions(self) -> dict[str, int]:
        """Node -> its place in `topological_order()` (which this validates), for sorting by
        it. The graph's own table, made once per structure (the insertion index when program
        order is that order): do not modify it. Not thread-safe while nodes are added."""
        order = self.topological_order()
        if not self._backward:
            return self._index
        pos = self._topo_pos
        if pos is None:
            pos = self._topo_pos = {n: i for i, n in enumerate(order)}
        return pos

    def levels(self) -> tuple[tuple[str, ...], ...]:
        """Nodes grouped by longest-path depth from a source (level 0 has no predecessors)."""
        level: dict[str, int] = {}
        for n in self.topological_order():
            level[n] = max((level[p] + 1 for p in self._preds[n]), default=0)
        out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
        for n in self._nodes:
            out[level[n]].append(n)
        return tuple(tuple(x) for x in out)

    def components(self) -> dict[str, int]:
        """Weakly connected component of each node, numbered by their first node's insertion."""
        comp: dict[str, int] = {}
        c = -1
        for start in self._nodes:
            if start in comp:
                continue
            c += 1
            stack = [start]
            comp[start] = c
            while stack:
                n = stack.pop()
                for m in (*self._preds[n], *self._succs[n]):
                    if m not in comp:
                        comp[m] = c
                        stack.append(m)
        return comp

    def reduced_edges(self) -> frozenset[tuple[str, str]]:
        """The transitive reduction: edges not implied by a longer path."""
        order = self.topological_order()
        return transitive_reduction(order, ((n, s) for n in order for s in self._succs[n]))

    def __repr__(self):
        return (f"<TaskGraph {len(self._nodes)} nodes, {sum(len(p) for p in self._preds.values())} "
                f"edges, {len(self.buffers)} buffers, {len(self.host_buffers)} host buffers>")


def transitive_reduction(order, edges) -> frozenset[tuple[str, str]]:
    """The edges of ``edges`` (pairs of names) that no longer path implies; ``order`` is a
    topological order of every name in them. An edge ``(u, v)`` is implied when ``u`` reaches
    another predecessor of ``v``; reachability comes from chain clocks (`reach.ChainClocks`), so
    long pipelines stay about linear in time and memory (the reachability bitsets this replaced
    grew with the square of the node count)."""
    preds: dict[str, dict[str, None]] = {n: {} for n in order}
    succs: dict[str, list[str]] = {n: [] for n in order}
    for p, s in edges:
        if p not in preds[s]:
            preds[s][p] = None
            succs[p].append(s)
    plists = {n: list(ps) for n, ps in preds.items()}
    implied = ChainClocks(order, plists, succs, reduce=True).implied
    assert implied is not None  # reduce=True fills it
    out: list[tuple[str, str]] = []
    for v in order:
        drop = implied.get(v)
        out.extend((p, v) for p in plists[v] if not drop or p not in drop)
    return frozenset(out)


def kahn_order(names, edges) -> list[str]:
    """Kahn's topological order of ``names`` (a list) under ``edges`` (pairs of names); among
    ready nodes the earliest in ``names`` goes first. Shorter than ``names`` when a cycle
    leaves nodes unordered (the caller says which)."""
    index = {n: i for i, n in enumerate(names)}
    indeg = dict.fromkeys(names, 0)
    succs: dict[str, list[str]] = {n: [] for n in names}
    for p, s in edges:
        succs[p].append(s)
        indeg[s] += 1
    heap = [index[n] for n in names if indeg[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        n = names[heapq.heappop(heap)]
        order.append(n)
        for s in succs[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, index[s])
    return order

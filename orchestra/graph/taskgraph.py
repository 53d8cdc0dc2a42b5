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
import threading
from collections import defaultdict
from typing import Callable, Sequence, TypeVar

from orchestra.errors import GraphError, NameCollisionError
from orchestra.graph.bodies import check_bodies
from orchestra.graph.buffers import Buffer, Condition, HostBuffer
from orchestra.graph.nodes import Node
from orchestra.graph.ranges import RangeTracker
from orchestra.graph.reach import ChainClocks

N = TypeVar("N", bound=Node)

#: Held while the tables by name of nodes a builder added (`TaskGraph._add_known`) are made on
#: first use: threads that query one graph at once (schedule / verify from many threads) must
#: not see them half made. One lock for every graph (it is taken once per graph and batch of
#: nodes, never on the queries' fast paths) keeps a graph picklable.
_LAZY_LOCK = threading.RLock()


class TaskGraph:
    """A DAG of node records. Nodes keep insertion (program) order; every query is deterministic.

    Besides the tables by name, the graph keeps its edges by node index (insertion place):
    ``_back[v]`` holds ``v - p`` for each predecessor ``p`` of node ``v``, in the order of its
    predecessor dict, which the scheduler reads instead of the dicts. Nodes a builder adds with
    edges it knows already (`_add_known`) get only those; their dicts (``_preds``, ``_succs``,
    ``_explicit``) are made when something first asks for them (`_edges_by_name`), and the
    dependency tracker is fed their accesses before the next `add` (a 350,000-node pipeline
    that is only scheduled and printed never makes either).

    Thread-safety: building is not thread-safe: `add` (and the builders that add) must not run while
    any other thread uses the graph, so build it in one thread. A graph no longer added to may be
    read by several threads at once: the tables made on first query (names, edge dicts of nodes a
    builder added) are made under a module lock, and the cached orders are written whole (at worst
    computed twice). The dicts some queries return (`topological_positions`, `node_map`) are the
    graph's own: do not modify them.
    """

    def __init__(self):
        self._nodes: dict[str, Node] = {}
        self._index: dict[str, int] = {}
        self._list: list[Node] = []  # node index -> node
        self._back: list[tuple[int, ...]] = []  # node index -> its predecessors' distances
        self._buffers: dict[str, Buffer | HostBuffer] = {}
        self._preds: dict[str, dict[str, str]] = {}  # node -> {pred: reason}
        self._succs: dict[str, dict[str, str]] = {}
        self._explicit: set[tuple[str, str]] = set()
        # What `_add_known` added and the tables by name do not hold yet: ``_named`` nodes
        # (in index order) are in ``_nodes`` / ``_index``, their new buffers in
        # ``_new_buffers`` until then (`_sync_names`); the blocks whose edge dicts are not
        # made, (first index, reasons) with reasons() -> per node of the block, its edges'
        # reasons in ``_back`` order (`_edges_by_name`); the first node index the tracker has
        # not seen (-1: none).
        self._named = 0
        self._new_buffers: list = []
        self._lazy: list[tuple[int, Callable[[], Sequence[tuple[str, ...]]]]] = []
        self._untracked = -1
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
        if self._named != len(self._list) or self._lazy or self._untracked >= 0:
            self._catch_up()
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
        i = index[name] = len(index)
        self._list.append(node)
        self._named += 1
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
        self._back.append(tuple([i - index[p] for p in preds]) if preds else ())
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
        preds = self._preds[succ]
        if pred not in preds:
            preds[pred] = reason
            i = self._index[succ]
            self._back[i] += (i - self._index[pred],)
        self._succs[pred].setdefault(succ, reason)
        if explicit:
            self._explicit.add((pred, succ))

    def _add_known(self, nodes: Sequence[Node], back: Sequence[tuple[int, ...]],
                   reasons: Callable[[], Sequence[tuple[str, ...]]],
                   buffers: Sequence) -> bool:
        """Add ``nodes`` (records of plain kinds: no bodies, no condition, ``_accesses``
        filled) in program order, with the edges the caller knows `add` would give them:
        ``back[i]`` holds, for each predecessor of ``nodes[i]`` in the order of the dict `add`
        would make (inferred edges, then ``after=``; every one an earlier node), how many
        places before it that predecessor is; ``reasons()`` returns those edges' reasons, per
        node (called when something first asks for the edges by name). ``buffers``: the
        buffers the nodes touch that the graph does not know yet, in order of first use (every
        other one they touch is in the graph already, the same object). The caller
        guarantees the names of ``nodes`` and ``buffers`` are new (a clash is an internal
        error when the tables by name are made). For builders of many records of one shape
        (`build_pipeline`), which learn the edges from a first batch that went through `add`.

        The tables by name, the edge dicts and the dependency tracker get the nodes when
        something first asks (the next `add`, a query by name): a graph only scheduled and
        printed never pays for them. Returns False, having added nothing, while an
        ``after=`` waits for a node that is not in the graph (then the caller adds the nodes
        through `add`). Not thread-safe."""
        if self._waiting:
            return False
        start = len(self._list)
        self._list += nodes
        self._back += back
        self._new_buffers += buffers
        self._lazy.append((start, reasons))
        if self._untracked < 0:
            self._untracked = start
        self._topo = self._topo_pos = None
        return True

    def _sync_names(self) -> None:
        """Put the nodes `_add_known` added, and their new buffers, in the tables by name.
        Thread-safe (`_LAZY_LOCK`): ``_named`` moves only once the tables hold the nodes."""
        if self._named == len(self._list):
            return
        with _LAZY_LOCK:
            self._sync_names_locked()

    def _sync_names_locked(self) -> None:
        lst = self._list
        k = self._named
        if k == len(lst):
            return
        added = lst[k:]
        names = [n.name for n in added]
        nodes, index = self._nodes, self._index
        nodes.update(zip(names, added))
        index.update(zip(names, range(k, len(lst))))
        bufs = self._new_buffers
        self._new_buffers = []
        known = self._buffers
        had = len(known)
        known.update(zip([b.name for b in bufs], bufs))
        self._named = len(lst)
        if len(nodes) != len(lst) or len(known) != had + len(bufs):
            raise GraphError("internal error: a builder added nodes or buffers whose names "
                             "the graph had (TaskGraph._add_known)")

    def _edges_by_name(self) -> None:
        """Make the edge dicts of the nodes `_add_known` added (predecessors, successors,
        explicit edges), in node order. Thread-safe (`_LAZY_LOCK`): ``_lazy`` empties only
        once the dicts are made, so a thread that finds it empty reads complete dicts."""
        with _LAZY_LOCK:
            if self._lazy:
                self._edges_by_name_locked()

    def _edges_by_name_locked(self) -> None:
        self._sync_names()
        lazy = self._lazy
        lst, back, preds, succs = self._list, self._back, self._preds, self._succs
        explicit = self._explicit
        for k, (start, reasons) in enumerate(lazy):
            stop = lazy[k + 1][0] if k + 1 < len(lazy) else len(lst)
            for v, why in zip(range(start, stop), reasons()):
                name = lst[v].name
                ps = preds[name] = dict(zip([lst[v - d].name for d in back[v]], why))
                succs[name] = {}
                for pred, reason in ps.items():
                    succs[pred][name] = reason
                for pred in lst[v].after:
                    explicit.add((pred, name))
        self._lazy = []

    def _catch_up(self) -> None:
        """Before an `add`: the tables by name and the edge dicts of the nodes `_add_known`
        added, and their accesses fed to the tracker (its answers are their inferred edges,
        known already)."""
        self._sync_names()
        if self._lazy:
            self._edges_by_name()
        if self._untracked >= 0:
            access = self._tracker.access
            for node in self._list[self._untracked:]:
                access(node.name, node._accesses)
            self._untracked = -1

    def _may_have_bodies(self) -> bool:
        """False when no node holds bodies or touches a condition (then passes that look
        into bodies, `check_bodies` and the verifier's, have nothing to do)."""
        return self._control

    def _program_order_is_topological(self) -> bool:
        """Whether every edge goes from an earlier node to a later one (no ``after=`` named a
        node added later): then node indices are a topological order."""
        return not self._backward

    def _by_index(self) -> tuple[list[Node], list[tuple[int, ...]]]:
        """``(nodes, back)``: node index -> node, and node index ``v`` -> ``v - p`` for each
        predecessor ``p`` (in `predecessor_map` order). The graph's own tables, for the
        scheduler's passes over every node (do not modify them)."""
        return self._list, self._back

    # -- queries ----------------------------------------------------------------------------

    def __len__(self):
        return len(self._list)

    def __contains__(self, name):
        if self._named != len(self._list):
            self._sync_names()
        return name in self._nodes

    def __iter__(self):
        return iter(self._list)

    @property
    def nodes(self) -> tuple[Node, ...]:
        """Every node, in insertion order."""
        return tuple(self._list)

    def node_map(self) -> dict[str, Node]:
        """Every node name -> its node, in insertion order: the graph's own table, for
        algorithms that visit every node (do not modify it)."""
        if self._named != len(self._list):
            self._sync_names()
        return self._nodes

    def node(self, name: str) -> Node:
        if self._named != len(self._list):
            self._sync_names()
        try:
            return self._nodes[name]
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None

    def accesses(self, name: str) -> tuple:
        """Node ``name``'s ``accesses()``, computed once when it was added (nodes are
        immutable): what the scheduler and the verifier read instead of building them again."""
        if self._named != len(self._list):
            self._sync_names()
        try:
            accesses = self._nodes[name]._accesses
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None
        assert accesses is not None  # add() filled it
        return accesses

    def index(self, name: str) -> int:
        """Insertion (program-order) position of node ``name``."""
        if self._named != len(self._list):
            self._sync_names()
        try:
            return self._index[name]
        except KeyError:
            raise GraphError(f"no node named {name!r} in the graph") from None

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        """Device buffers, in order of first use."""
        self._sync_names()
        return tuple(b for b in self._buffers.values() if isinstance(b, Buffer))

    @property
    def host_buffers(self) -> tuple[HostBuffer, ...]:
        """Host buffers, in order of first use."""
        self._sync_names()
        return tuple(b for b in self._buffers.values() if isinstance(b, HostBuffer))

    @property
    def conditions(self) -> tuple[Condition, ...]:
        """Conditions (conditional handles) the nodes set or test, in order of first use."""
        self._sync_names()
        return tuple(b for b in self._buffers.values() if isinstance(b, Condition))

    def buffer(self, name: str):
        self._sync_names()
        try:
            return self._buffers[name]
        except KeyError:
            raise GraphError(f"no buffer named {name!r} is used by the graph") from None

    @property
    def edges(self) -> frozenset[tuple[str, str]]:
        """Every (pred, succ) edge: inferred from accesses and explicit ``after=``."""
        if self._lazy:
            self._edges_by_name()
        return frozenset((p, s) for s, ps in self._preds.items() for p in ps)

    @property
    def edge_count(self) -> int:
        """``len(self.edges)``, without building the set."""
        return sum(map(len, self._back))

    @property
    def explicit_edges(self) -> frozenset[tuple[str, str]]:
        """The edges that come from ``after=``."""
        if self._lazy:
            self._edges_by_name()
        return frozenset(self._explicit)

    def edge_reason(self, pred: str, succ: str) -> str:
        """Why the edge exists, e.g. ``"RAW b0.in"`` or ``"after"``."""
        if self._lazy:
            self._edges_by_name()
        return self._preds[succ][pred]

    def predecessor_map(self) -> dict[str, dict[str, str]]:
        """Every node -> ``{predecessor: edge reason}``, in no particular order: the graph's own
        table, for algorithms that visit every edge (do not modify it)."""
        if self._lazy:
            self._edges_by_name()
        return self._preds

    def predecessors(self, name: str) -> tuple[str, ...]:
        """The nodes ``name`` depends on, in program order."""
        return self._ordered(self._preds, name)

    def successors(self, name: str) -> tuple[str, ...]:
        """The nodes that depend on ``name``, in program order."""
        return self._ordered(self._succs, name)

    def _ordered(self, adjacency, name):
        if self._lazy:
            self._edges_by_name()
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
            self._topo = tuple([n.name for n in self._list])
            return self._topo
        if self._lazy:
            self._edges_by_name()
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
            if self._named != len(self._list):
                self._sync_names()
            return self._index
        pos = self._topo_pos
        if pos is None:
            pos = self._topo_pos = {n: i for i, n in enumerate(order)}
        return pos

    def levels(self) -> tuple[tuple[str, ...], ...]:
        """Nodes grouped by longest-path depth from a source (level 0 has no predecessors)."""
        level: dict[str, int] = {}
        if self._lazy:
            self._edges_by_name()
        for n in self.topological_order():
            level[n] = max((level[p] + 1 for p in self._preds[n]), default=0)
        out: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
        for n in self._nodes:
            out[level[n]].append(n)
        return tuple(tuple(x) for x in out)

    def components(self) -> dict[str, int]:
        """Weakly connected component of each node, numbered by their first node's insertion."""
        comp: dict[str, int] = {}
        if self._lazy:
            self._edges_by_name()
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
        if self._lazy:
            self._edges_by_name()
        return transitive_reduction(order, ((n, s) for n in order for s in self._succs[n]))

    def __repr__(self):
        return (f"<TaskGraph {len(self._list)} nodes, {self.edge_count} "
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

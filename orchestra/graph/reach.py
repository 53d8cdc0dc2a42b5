"""Reachability in a DAG without comparing all pairs: vector clocks over a chain cover.

Visiting the nodes in a topological order, each node continues the chain of a predecessor that
is still its chain's last node (else of another chain whose last node reaches it, else it starts
a chain), so the nodes of a chain are totally ordered by the edges. Which predecessor's chain it
continues decides how many chains there are (the clocks' size); the choice here finds one chain
per stream on the shapes schedules give (`_place`). A node's clock maps each
other chain to the highest position on it that reaches the node (positions on one chain reach
exactly the later ones): the join of its predecessors' clocks and positions. Then ``a`` reaches
``b`` exactly when ``clock(b)[chain(a)] >= position(a)`` (or both lie on one chain, ``a`` first),
an O(1) query. A node that adds nothing to a predecessor's clock shares that clock object; a
large clock is extended by a small layer on top (`_Layer`) instead of being copied, so the
fan-out of one wide join costs O(1) per successor.

Building costs O((nodes + edges) x the chains a node's ancestors lie on): small for pipelines of
batches, plans' stream shapes and chains of kernels, where a few chains cover everything; only
graphs whose ancestors spread over many chains (wide joins followed by more joins) pay more. The
ancestor bitsets this replaced cost O(nodes^2 / 64) memory whatever the shape.
"""

from __future__ import annotations

from collections import deque
from typing import Union

_EMPTY: dict[int, int] = {}  # the clock of a node without ancestors (shared; never mutated)
_FLAT_MAX = 16  # a clock of up to this many chains is a plain dict, copied when extended
_MAX_DEPTH = 8  # layers above a plain dict before a clock is flattened (bounds a lookup)
_ADOPT_SCAN = 8  # base clock entries looked at for a chain whose last node reaches a new node
_STALLED = 16  # chains remembered whose last node has no successor left to continue them


class _Layer:
    """A clock: the entries of ``own`` (each higher than ``parent``'s) over ``parent`` (a dict
    or another layer); ``size`` is the number of chains it has an entry for. Immutable once
    built."""

    __slots__ = ("own", "parent", "depth", "size")

    def __init__(self, own, parent, depth, size):
        self.own, self.parent, self.depth, self.size = own, parent, depth, size

    def get(self, chain: int, default: int = -1) -> int:
        k = self
        while type(k) is _Layer:
            v = k.own.get(chain)
            if v is not None:
                return v
            k = k.parent
        return k.get(chain, default)

    def flat(self) -> dict[int, int]:
        layers: list[dict[int, int]] = []
        k: Clock = self
        while isinstance(k, _Layer):
            layers.append(k.own)
            k = k.parent
        out = dict(k)
        for own in reversed(layers):
            out.update(own)
        return out


Clock = Union[dict[int, int], _Layer]  # a node's clock: chain -> highest position reaching it


def _size(clock) -> int:
    return len(clock) if type(clock) is dict else clock.size


def _layers(clock):
    """``clock`` and every clock object below it."""
    while type(clock) is _Layer:
        yield clock
        clock = clock.parent
    yield clock


def _items_above(clock, known_ids):
    """The entries of ``clock`` that are not in a clock object whose id is in ``known_ids``
    (clock objects are shared, so what lies below a shared one is known already)."""
    while id(clock) not in known_ids:
        if type(clock) is _Layer:
            yield from clock.own.items()
            clock = clock.parent
        else:
            yield from clock.items()
            return


class ChainClocks:
    """Which nodes of a DAG reach which. ``order``: node names in a topological order of the
    edges; ``preds``: node -> its predecessors (every one earlier in ``order``); ``succs``:
    node -> its successors (only their number is used: a chain is best continued by a node's
    last successor). ``reduce=True`` also finds each node's implied predecessors (``implied``).
    Nodes not in ``order`` (e.g. on a cycle) can be added later with
    `add_isolated`: they reach nothing and nothing reaches them. Not thread-safe while built;
    queries afterwards are."""

    def __init__(self, order, preds, succs, *, reduce: bool = False):
        self.chain: dict[str, int] = {}  # node -> its chain
        self.idx: dict[str, int] = {}  # node -> its position on that chain (0-based)
        self.clock: dict[str, Clock] = {}  # node -> {chain: highest position reaching it}
        self._tails: list[str] = []  # chain -> its last node so far
        self._left = {n: len(s) for n, s in succs.items()}  # successors not placed yet
        self._stalled: deque[int] = deque(maxlen=_STALLED)  # chains whose tail has none left
        self._placed: dict[str, int] = {}  # node -> how many nodes were placed before it
        # with ``reduce``: node -> its predecessors that another of its predecessors is reached
        # from (their edge is implied by a longer path: the transitive reduction drops it)
        self.implied: dict[str, set[str]] | None = {} if reduce else None
        for v in order:
            self._place(v, preds[v])

    def add_isolated(self, node: str) -> None:
        """Add ``node`` on a chain of its own, ordered with nothing."""
        self._place(node, ())

    def __contains__(self, node) -> bool:
        return node in self.chain

    def reaches(self, a: str, b: str) -> bool:
        """True when a path of edges leads from ``a`` to ``b`` (False for ``a == b``)."""
        if a == b:
            return False
        ca = self.chain[a]
        if ca == self.chain[b]:
            return self.idx[a] < self.idx[b]
        return self.clock[b].get(ca, -1) >= self.idx[a]

    def maximal(self, nodes) -> set[str]:
        """The nodes of ``nodes`` that reach none of the others. Per chain of one of them: the
        highest position of one on it, and the highest position on it another one's clock
        holds; each node costs the smaller of its clock and the number of those chains."""
        chain, idx, clock = self.chain, self.idx, self.clock
        chains = {chain[u] for u in nodes}
        own = dict.fromkeys(chains, -1)  # highest position of one of the nodes on the chain
        known = dict.fromkeys(chains, -1)  # highest position on it reaching another of them
        for v in nodes:
            cv = chain[v]
            if idx[v] > own[cv]:
                own[cv] = idx[v]
            k = clock[v]
            if type(k) is dict and len(k) <= len(chains):
                items = [(c, i) for c, i in k.items() if c in known]
            else:
                items = [(c, k.get(c, -1)) for c in chains]
            for c, i in items:
                if c != cv and i > known[c]:
                    known[c] = i
        return {u for u in nodes
                if not (own[chain[u]] > idx[u] or known[chain[u]] >= idx[u])}

    def _place(self, v, ps):
        """Give ``v`` (every predecessor placed) a chain, a position and a clock."""
        chain, idx, clock, tails, left = self.chain, self.idx, self.clock, self._tails, self._left
        self._placed[v] = len(self._placed)
        if not ps:
            chain[v], idx[v], clock[v] = len(tails), 0, _EMPTY
            tails.append(v)
            return
        if len(ps) == 1:  # the common case: the next node of a predecessor's chain
            p = ps[0]
            c = chain[p]
            if tails[c] == p:
                chain[v], idx[v], clock[v] = c, idx[p] + 1, clock[p]
                tails[c] = v
                left[p] -= 1
                return
        # continue the chain of a predecessor that is still its chain's tail: first one with
        # no other successor left (else its chain would end here), then the one placed first
        # (a newer tail is likelier to be continued by another successor; on plans' shapes this
        # keeps chains along streams: a few chains, so small clocks)
        cont, best = None, None
        placed = self._placed
        for p in ps:
            if tails[chain[p]] == p:
                key = (left[p] == 1, -placed[p])
                if best is None or key > best:
                    cont, best = p, key
        if cont is not None:
            base_p = cont
        elif len(ps) == 1:
            base_p = ps[0]
        else:
            base_p = max(ps, key=lambda p: _size(clock[p]))
        base = clock[base_p]
        upd: dict[int, int] = {}  # chain -> highest position reaching v, where above base's
        if len(ps) > 1:
            # strict ancestors of the predecessors first: the earlier nodes of their own chains,
            # then the other predecessors' clocks (what lies below a clock object base shares
            # is in base already)
            for p in ps:
                cp, ip = chain[p], idx[p] - 1
                if ip >= 0 and upd.get(cp, -1) < ip:
                    upd[cp] = ip
            known = None
            for p in ps:
                k = clock[p]
                if p != base_p and k is not base and k is not _EMPTY:
                    if known is None:
                        known = {id(x) for x in _layers(base)}
                    for c, i in _items_above(k, known):
                        if upd.get(c, -1) < i:
                            upd[c] = i
            if self.implied is not None:
                get = base.get
                implied = {u for u in ps if max(upd.get(chain[u], -1), get(chain[u], -1)) >= idx[u]}
                if implied:
                    self.implied[v] = implied
        for p in ps:  # then the predecessors themselves
            cp, ip = chain[p], idx[p]
            if upd.get(cp, -1) < ip:
                upd[cp] = ip
        c = chain[cont] if cont is not None else self._adopt(upd, base)
        upd.pop(c, None)  # positions on v's own chain are compared directly
        get = base.get
        own, added = {}, 0
        for k, i in upd.items():
            had = get(k, -1)
            if had < i:
                own[k] = i
                added += had < 0
        if not own:
            new = base
        else:
            size = _size(base) + added
            if size <= _FLAT_MAX:
                new = {**(base if type(base) is dict else base.flat()), **own}
            else:
                depth = base.depth + 1 if type(base) is _Layer else 1
                new = _Layer(own, base, depth, size)
                if depth > _MAX_DEPTH:
                    new = new.flat()
        if c == len(tails):
            tails.append(v)
            idx[v] = 0
        else:
            idx[v] = idx[tails[c]] + 1
            tails[c] = v
        chain[v] = c
        clock[v] = new
        for p in ps:
            left[p] -= 1
            if left[p] == 0 and tails[chain[p]] == p:
                self._stalled.append(chain[p])

    def _adopt(self, upd, base) -> int:
        """A chain whose tail reaches the node being placed (the highest position on it that
        reaches the node is the tail's), else a new chain's number. Looks at the predecessors'
        chains, chains whose tail has no successor left, and a few entries of the base clock."""
        idx, tails = self.idx, self._tails
        for c, i in upd.items():
            if idx[tails[c]] == i:
                return c
        for c in reversed(self._stalled):
            t = idx[tails[c]]
            if upd.get(c, -1) == t or base.get(c, -1) == t:
                self._stalled.remove(c)
                return c
        scan = base.own if type(base) is _Layer else base
        for n, (c, i) in enumerate(scan.items()):
            if n == _ADOPT_SCAN:
                break
            if idx[tails[c]] == i:
                return c
        return len(tails)

"""Data races: every two accesses to overlapping bytes of one buffer, at least one a write, must be
ordered the way program (insertion) order has them (RAW, WAR, WAW; HOST_* on host buffers).

Comparing every overlapping pair is quadratic (a chain of N kernels updating one workspace has
N^2/2 pairs), so the sweep keeps, per buffer, the frontier the graph's dependency tracker keeps
(`orchestra.graph.ranges`): the last writer(s) of every byte and the readers since. A node is
checked against the frontier entries it overlaps and conflicts with. A write then carves the
entries ordered before it out of its bytes: each such entry reaches every later access of those
bytes through the write, which is in the frontier there itself (or carved by a later write it is
ordered before, and so on). An entry not ordered before the write stays. So when every frontier
entry a node conflicts with is ordered before it, so is every earlier conflicting access; when one
is not, that node is compared with every earlier access of the buffer (the findings are exact,
and that costs only where there are findings). A correct plan costs O(accesses x log) plus the
graph's own inferred edges.

The findings are those of comparing every pair in (offset, end, program order) sweep order: one
per (buffer, earlier node, later node), described by the first overlapping pair of their accesses
in that order, sorted by (later node, earlier node) in program order, then by buffer (order of
first access).
"""

from __future__ import annotations

from orchestra.graph import Mode
from orchestra.graph.ranges import SegmentMap
from orchestra.schedule.finding import Finding

_READ = Mode.READ
VERB = {Mode.READ: "reads", Mode.WRITE: "writes", Mode.READ_WRITE: "reads and writes"}


def _mark_unordered(found, idx, verdict: dict, before, node, unordered: set) -> None:
    """Adds to ``unordered`` the frontier entries of ``found`` whose node is not ordered
    before ``node`` (``before(a, node)``, each node asked once: ``verdict`` keeps answers)."""
    for k in found:
        a = idx[k]
        ok = verdict.get(a)
        if ok is None:
            ok = verdict[a] = before(a, node)
        if not ok:
            unordered.add(k)


class _Buffer:
    """The sweep state of one buffer: the frontier of its accesses so far.

    The buffer's accesses are ``accs[k]``, by node ``idx[k]`` (a node index), in program
    order (`accesses_by_buffer`); a frontier entry is such a place ``k`` (so entries sort in
    program order, and an entry's bytes and node are looked up there). ``lifetime[v]``: node
    ``v`` is an Alloc or Free (checked by `verify`'s lifetime walk, not here).

    Most buffers are only ever accessed whole (a pipeline's device buffers, a kernel chain's
    workspace): until an access covers part of the buffer, the frontier is two plain lists of
    entries (``whole``), what segment maps with the one segment ``[0, nbytes)`` would hold, as
    the dependency tracker keeps them (`orchestra.graph.ranges`); the first partial access
    turns them into segment maps."""

    __slots__ = ("buffer", "rank", "idx", "accs", "lifetime", "writers", "readers", "pairs",
                 "whole")

    def __init__(self, buffer, rank, idx, accs, lifetime):
        self.buffer, self.rank = buffer, rank
        self.idx, self.accs, self.lifetime = idx, accs, lifetime
        self.writers: list | SegmentMap = []
        self.readers: list | SegmentMap = []
        self.whole = True
        self.pairs: list[tuple[int, int]] = []  # (earlier, later) not ordered, in discovery order

    def visit(self, i, j, before):
        """Check the accesses at places ``i`` to ``j - 1`` (all of one node) against the
        frontier, then record them; ``before`` is the order by node index."""
        node, accs = self.idx[i], self.accs
        xs = [(r.offset, r.offset + r.nbytes, a.mode, k)
              for k, a in zip(range(i, j), accs[i:j]) for r in (a.range,)]
        if self.whole:
            nbytes = self.buffer.nbytes
            if all(s == 0 and e == nbytes for s, e, _, _ in xs):
                self._visit_whole(node, i, xs, before)
                return
            self._split()
        writers, readers = self.writers, self.readers
        assert isinstance(writers, SegmentMap) and isinstance(readers, SegmentMap)
        verdict: dict[int, bool] = {}
        unordered: set[int] = set()  # frontier entries not ordered before node
        idx = self.idx
        for s, e, mode, _ in xs:
            found = writers.overlapping(s, e) if writers.pts else ()
            if mode is not _READ and readers.pts:
                more = readers.overlapping(s, e)
                found = found + more if found else more
            _mark_unordered(found, idx, verdict, before, node, unordered)
        if unordered:
            self._exhaustive(node, i, xs, before, verdict)
        for s, e, mode, _ in xs:  # every write carves first, then every access is added
            if mode is not _READ:
                for m in (writers, readers):
                    if not m.pts:
                        continue
                    if not unordered:
                        m.carve(s, e)
                        continue
                    kept = [k for k in m.overlapping(s, e) if k in unordered]
                    m.carve(s, e)
                    for k in kept:
                        r = accs[k].range
                        m.add(max(s, r.offset), min(e, r.offset + r.nbytes), k)
        for s, e, mode, k in xs:
            (readers if mode is _READ else writers).add(s, e, k)

    def visit_whole(self, i, mode, before):
        """`visit` of the one access at place ``i``, of the whole buffer in ``mode``, while
        every access so far was whole (what most accesses are), without the access list."""
        writers, readers = self.writers, self.readers
        assert isinstance(writers, list) and isinstance(readers, list)
        writes = mode is not _READ
        found = (writers + readers if readers else writers) if writes else writers
        if found:
            node, idx = self.idx[i], self.idx
            unordered = None
            if len(found) == 1:  # the usual frontier: one writer
                a = idx[found[0]]
                if not before(a, node):
                    unordered, verdict = {found[0]}, {a: False}
            else:
                verdict, unordered = {}, set()
                _mark_unordered(found, idx, verdict, before, node, unordered)
            if unordered:
                self._exhaustive(node, i, [(0, self.buffer.nbytes, mode, i)], before, verdict)
                if writes:
                    writers[:] = [k for k in writers if k in unordered]
                    readers[:] = [k for k in readers if k in unordered]
                (writers if writes else readers).append(i)
                return
        if writes:
            writers.clear()
            readers.clear()
            writers.append(i)
        else:
            readers.append(i)

    def visit_one(self, i, before):
        """`visit` of the one access at place ``i`` (a part of the buffer, or the buffer once
        its frontier is segment maps), without building the access list."""
        if self.whole:
            self._split()
        writers, readers = self.writers, self.readers
        assert isinstance(writers, SegmentMap) and isinstance(readers, SegmentMap)
        acc = self.accs[i]
        r, mode = acc.range, acc.mode
        s, e = r.offset, r.offset + r.nbytes
        writes = mode is not _READ
        found = writers.overlapping(s, e) if writers.pts else ()
        if writes and readers.pts:
            more = readers.overlapping(s, e)
            found = found + more if found else more
        if found:
            node, idx = self.idx[i], self.idx
            verdict: dict[int, bool] = {}
            for k in found:
                a = idx[k]
                ok = verdict.get(a)
                if ok is None:
                    ok = verdict[a] = before(a, node)
                if not ok:  # an entry not ordered before: the general visit reports it
                    self.visit(i, i + 1, before)
                    return
        if writes:
            if readers.pts:
                readers.carve(s, e)
            writers.assign(s, e, i)
        else:
            readers.add(s, e, i)

    def _visit_whole(self, node, i, xs, before):
        """`visit` for accesses of the whole buffer while every access so far was whole: the
        frontier lists hold every entry of its one segment, so what overlaps is all of them
        and a write's carve keeps only the entries not ordered before it."""
        writers, readers = self.writers, self.readers
        assert isinstance(writers, list) and isinstance(readers, list)
        idx = self.idx
        verdict: dict[int, bool] = {}
        unordered: set[int] = set()
        for _, _, mode, _ in xs:
            found = writers + readers if mode is not _READ and readers else writers
            _mark_unordered(found, idx, verdict, before, node, unordered)
        if unordered:
            self._exhaustive(node, i, xs, before, verdict)
        if any(mode is not _READ for _, _, mode, _ in xs):
            if unordered:
                writers[:] = [k for k in writers if k in unordered]
                readers[:] = [k for k in readers if k in unordered]
            else:
                writers.clear()
                readers.clear()
        for _, _, mode, k in xs:
            (readers if mode is _READ else writers).append(k)

    def _split(self):
        """The first partial access: the frontier lists become segment maps."""
        nbytes = self.buffer.nbytes
        maps = []
        for entries in (self.writers, self.readers):
            m = SegmentMap()
            if entries:
                m.pts = [0, nbytes]
                m.segs = [list(entries)]
            maps.append(m)
        self.writers, self.readers = maps
        self.whole = False

    def _exhaustive(self, node, i, xs, before, verdict):
        """Every earlier node with an access conflicting with one of ``xs`` and not ordered
        before ``node`` (its accesses start at place ``i``)."""
        found = {}
        idx, accs, lifetime = self.idx, self.accs, self.lifetime
        for s, e, mode, _ in xs:
            writes = mode is not _READ
            for k in range(i):
                a = idx[k]
                if lifetime[a]:
                    continue
                acc = accs[k]
                r = acc.range
                if r.offset < e and s < r.offset + r.nbytes \
                        and (writes or acc.mode is not _READ) and a not in found:
                    ok = verdict.get(a)
                    if ok is None:
                        ok = verdict[a] = before(a, node)
                    if not ok:
                        found[a] = None
        self.pairs.extend((a, node) for a in found)


_LIFETIME_KINDS = ("alloc", "free")


def accesses_by_buffer(order, graph):
    """One pass over the nodes ``order`` knows: ``(per_buffer, race_rank, before, known)``.
    ``per_buffer``: buffer name -> ``[buffer, node index, access, whole, ...]``,
    the nodes touching it (`TaskGraph.index`) and their `Access` records in program order
    (buffers in order of first access; `by_node` splits one); ``race_rank``: buffer name -> its
    place in the order of first access by a node that is not an Alloc or Free (the order race
    findings tie-break by); ``before(i, j)`` and ``known[i]``: ``order.before`` and
    ``order.has`` by node index (``order.by_index``)."""
    flat: dict[str, list] = {}  # buffer name -> [buffer, node, access, node, access, ...]
    race_rank: dict[str, int] = {}
    before, known = order.by_index(graph)
    for i, node in enumerate(graph.nodes):
        if not known[i]:
            continue
        racy = node.kind not in _LIFETIME_KINDS
        for acc in node._accesses:  # TaskGraph.accesses(name), without the lookup
            r = acc.range
            buf = r.buffer
            key = buf.name  # one namespace per graph: TaskGraph refuses two buffers of a name
            entry = flat.get(key)
            if entry is None:
                entry = flat[key] = [buf]
            if racy and key not in race_rank:
                race_rank[key] = len(race_rank)
            # the access's mode when it covers the whole buffer (the sweep's usual case,
            # known without reading the access again), else None
            entry += (i, acc, acc.mode if r.offset == 0 and r.nbytes == buf.nbytes else None)
    return flat, race_rank, before, known


def by_node(entry):
    """``(buffer, node indices, accesses, whole)`` of one `accesses_by_buffer` entry:
    ``whole[k]`` is access ``k``'s mode when it covers the whole buffer, else None."""
    return entry[0], entry[1::3], entry[2::3], entry[3::3]


def races(order, graph, collected=None) -> list[Finding]:
    """The data-race findings of ``order`` (a `PlanOrder` or `GraphOrder`) for ``graph``;
    ``collected``: `accesses_by_buffer`'s result, when the caller has it already. The sweep
    works by node index (`TaskGraph.index`); findings name the nodes."""
    per_buffer, race_rank, before, _ = collected or accesses_by_buffer(order, graph)
    out = []
    nodes = graph.nodes
    lifetime = [n.kind in _LIFETIME_KINDS for n in nodes]  # checked by verify's lifetime walk
    for key, rank in race_rank.items():  # buffers are independent: one sweep state at a time
        buf, idx, accs, whole = by_node(per_buffer[key])
        state = _Buffer(buf, rank, idx, accs, lifetime)
        i, m = 0, len(idx)
        while i < m:  # one node's accesses of the buffer are next to each other
            v = idx[i]
            j = i + 1
            while j < m and idx[j] == v:
                j += 1
            if lifetime[v]:
                pass
            elif j == i + 1:  # one access (the usual case)
                mode = whole[i]
                if mode is not None and state.whole:
                    state.visit_whole(i, mode, before)
                else:
                    state.visit_one(i, before)
            else:
                state.visit(i, j, before)
            i = j
        for a, b in state.pairs:
            out.append(((b, a, rank), _finding(order, graph, buf, nodes[a].name,
                                               nodes[b].name)))
    out.sort(key=lambda x: x[0])
    return [f for _, f in out]


def _accesses_of(graph, name, buf):
    """(sweep key, start, end, mode) of node ``name``'s accesses to ``buf``; the sweep key is
    (start, end, program index, declaration order), the order the pairwise sweep visits."""
    i = graph.index(name)
    return [((r.offset, r.end, i, k), r.offset, r.end, acc.mode)
            for k, acc in enumerate(graph.accesses(name))
            for r in (acc.range,) if r.buffer.key == buf.key]


def _finding(order, graph, buf, a, b) -> Finding:
    """The finding for unordered nodes ``a`` (earlier) and ``b`` on ``buf``: described by their
    first conflicting pair of accesses in sweep order."""
    best = None
    for ka, s1, e1, ma in _accesses_of(graph, a, buf):
        for kb, s2, e2, mb in _accesses_of(graph, b, buf):
            if s1 < e2 and s2 < e1 and (ma.writes or mb.writes):
                pair = (ka, kb) if ka < kb else (kb, ka)
                if best is None or pair < best[0]:
                    best = (pair, max(s1, s2), min(e1, e2), ma, mb)
    assert best is not None  # a and b were found conflicting on buf
    _, lo, hi, ma, mb = best
    # a stale read is the likelier bug, so write -> read-write counts as RAW
    kind = "RAW" if ma.writes and mb.reads else ("WAW" if ma.writes else "WAR")
    label = "host buffer" if buf.is_host else "buffer"
    return Finding(
        ("HOST_" if buf.is_host else "") + kind, buf.name, (a, b),
        (order.stream_of.get(a), order.stream_of.get(b)),
        f"{kind} on {label} {buf.name} bytes [{lo}, {hi}): {order.where(a)} {VERB[ma]}, "
        f"{order.where(b)} {VERB[mb]}, {order.fix(a, b)}")

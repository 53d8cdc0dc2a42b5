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


class _Buffer:
    """The sweep state of one buffer: frontier maps and the log of every access so far.

    Most buffers are only ever accessed whole (a pipeline's device buffers, a kernel chain's
    workspace): until an access covers part of the buffer, the frontier is two plain lists of
    entries in ``seq`` order (``whole``), what segment maps with the one segment ``[0,
    nbytes)`` would hold, as the dependency tracker keeps them (`orchestra.graph.ranges`); the
    first partial access turns them into segment maps."""

    __slots__ = ("buffer", "rank", "writers", "readers", "log", "pairs", "whole")

    def __init__(self, buffer, rank):
        self.buffer, self.rank = buffer, rank
        self.writers: list | SegmentMap = []
        self.readers: list | SegmentMap = []
        self.whole = True
        self.log: list[tuple[int, int, Mode, int]] = []  # (start, end, mode, node); seq = index
        self.pairs: list[tuple[int, int]] = []  # (earlier, later) not ordered, in discovery order

    def visit(self, node, xs, before):
        """Check node ``node``'s accesses ``xs`` [(start, end, mode)] against the frontier, then
        record them. Nodes are node indices, ``before`` the order by index."""
        if self.whole:
            nbytes = self.buffer.nbytes
            if all(s == 0 and e == nbytes for s, e, _ in xs):
                self._visit_whole(node, xs, before)
                return
            self._split()
        writers, readers = self.writers, self.readers
        assert isinstance(writers, SegmentMap) and isinstance(readers, SegmentMap)
        verdict: dict[int, bool] = {}
        unordered: set[int] = set()  # frontier entries (seq) not ordered before node
        for s, e, mode in xs:
            found = writers.overlapping(s, e) if writers.pts else ()
            if mode is not _READ and readers.pts:
                more = readers.overlapping(s, e)
                found = found + more if found else more
            for seq, a in found:
                ok = verdict.get(a)
                if ok is None:
                    ok = verdict[a] = before(a, node)
                if not ok:
                    unordered.add(seq)
        if unordered:
            self._exhaustive(node, xs, before, verdict)
        log = self.log
        for s, e, mode in xs:  # every write carves first, then every access is added
            if mode is not _READ:
                for m in (writers, readers):
                    if not m.pts:
                        continue
                    kept = [en for en in m.overlapping(s, e) if en[0] in unordered] if unordered else ()
                    m.carve(s, e)
                    for en in kept:
                        ks, ke = log[en[0]][:2]
                        m.add(max(s, ks), min(e, ke), en)
        for s, e, mode in xs:
            entry = (len(log), node)
            log.append((s, e, mode, node))
            (readers if mode is _READ else writers).add(s, e, entry)

    def _visit_whole(self, node, xs, before):
        """`visit` for accesses of the whole buffer while every access so far was whole: the
        frontier lists hold every entry of its one segment, so what overlaps is all of them
        and a write's carve keeps only the entries not ordered before it."""
        writers, readers = self.writers, self.readers
        assert isinstance(writers, list) and isinstance(readers, list)
        verdict: dict[int, bool] = {}
        unordered: set[int] = set()
        for _, _, mode in xs:
            found = writers + readers if mode is not _READ and readers else writers
            for seq, a in found:
                ok = verdict.get(a)
                if ok is None:
                    ok = verdict[a] = before(a, node)
                if not ok:
                    unordered.add(seq)
        if unordered:
            self._exhaustive(node, xs, before, verdict)
        if any(mode is not _READ for _, _, mode in xs):
            if unordered:
                writers[:] = [en for en in writers if en[0] in unordered]
                readers[:] = [en for en in readers if en[0] in unordered]
            else:
                writers.clear()
                readers.clear()
        log = self.log
        for s, e, mode in xs:
            entry = (len(log), node)
            log.append((s, e, mode, node))
            (readers if mode is _READ else writers).append(entry)

    def visit_one(self, node, s, e, mode, before):
        """`visit` of one access ``[s, e)`` (without building the access list)."""
        if self.whole:
            self._split()
        writers, readers = self.writers, self.readers
        assert isinstance(writers, SegmentMap) and isinstance(readers, SegmentMap)
        writes = mode is not _READ
        found = writers.overlapping(s, e) if writers.pts else ()
        if writes and readers.pts:
            more = readers.overlapping(s, e)
            found = found + more if found else more
        unordered = None
        if found:
            verdict: dict[int, bool] = {}
            for seq, a in found:
                ok = verdict.get(a)
                if ok is None:
                    ok = verdict[a] = before(a, node)
                if not ok:
                    if unordered is None:
                        unordered = set()
                    unordered.add(seq)
            if unordered:  # the general visit: exact findings, entries kept
                self._visit_unordered(node, s, e, mode, before, verdict, unordered)
                return
        log = self.log
        entry = (len(log), node)
        log.append((s, e, mode, node))
        if writes:
            if readers.pts:
                readers.carve(s, e)
            writers.assign(s, e, entry)
        else:
            readers.add(s, e, entry)

    def _visit_unordered(self, node, s, e, mode, before, verdict, unordered):
        """The rest of `visit_one` when a frontier entry is not ordered before ``node``."""
        self._exhaustive(node, [(s, e, mode)], before, verdict)
        writers, readers = self.writers, self.readers
        log = self.log
        if mode is not _READ:
            for m in (writers, readers):
                if not m.pts:
                    continue
                kept = [en for en in m.overlapping(s, e) if en[0] in unordered]
                m.carve(s, e)
                for en in kept:
                    ks, ke = log[en[0]][:2]
                    m.add(max(s, ks), min(e, ke), en)
        entry = (len(log), node)
        log.append((s, e, mode, node))
        (readers if mode is _READ else writers).add(s, e, entry)

    def visit_one_whole(self, node, mode, before):
        """`visit` of one access, of the whole buffer, while every access so far was whole
        (what most accesses are), without building the access list."""
        writers, readers = self.writers, self.readers
        assert isinstance(writers, list) and isinstance(readers, list)
        writes = mode is not _READ
        found = (writers + readers if readers else writers) if writes else writers
        unordered = None
        if found:
            verdict: dict[int, bool] = {}
            for seq, a in found:
                ok = verdict.get(a)
                if ok is None:
                    ok = verdict[a] = before(a, node)
                if not ok:
                    if unordered is None:
                        unordered = set()
                    unordered.add(seq)
            if unordered:
                self._exhaustive(node, [(0, self.buffer.nbytes, mode)], before, verdict)
        if writes:
            if unordered:
                writers[:] = [en for en in writers if en[0] in unordered]
                readers[:] = [en for en in readers if en[0] in unordered]
            else:
                writers.clear()
                readers.clear()
        log = self.log
        entry = (len(log), node)
        log.append((0, self.buffer.nbytes, mode, node))
        (writers if writes else readers).append(entry)

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

    def _exhaustive(self, node, xs, before, verdict):
        """Every earlier node with an access conflicting with one of ``xs`` and not ordered
        before ``node``."""
        found = {}
        for s, e, mode in xs:
            writes = mode is not _READ
            for ys, ye, ymode, a in self.log:
                if ys < e and s < ye and (writes or ymode is not _READ) and a not in found:
                    ok = verdict.get(a)
                    if ok is None:
                        ok = verdict[a] = before(a, node)
                    if not ok:
                        found[a] = None
        self.pairs.extend((a, node) for a in found)


_LIFETIME_KINDS = ("alloc", "free")


def accesses_by_buffer(order, graph):
    """One pass over the nodes ``order`` knows: ``(per_buffer, race_rank, before, known)``.
    ``per_buffer``: buffer name -> ``[buffer, node index, access, node index, access, ...]``,
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
            buf = acc.range.buffer
            key = buf.name  # one namespace per graph: TaskGraph refuses two buffers of a name
            entry = flat.get(key)
            if entry is None:
                entry = flat[key] = [buf]
            if racy and key not in race_rank:
                race_rank[key] = len(race_rank)
            entry += (i, acc)
    return flat, race_rank, before, known


def by_node(entry):
    """``(buffer, node indices, accesses)`` of one `accesses_by_buffer` entry."""
    return entry[0], entry[1::2], entry[2::2]


def races(order, graph, collected=None) -> list[Finding]:
    """The data-race findings of ``order`` (a `PlanOrder` or `GraphOrder`) for ``graph``;
    ``collected``: `accesses_by_buffer`'s result, when the caller has it already. The sweep
    works by node index (`TaskGraph.index`); findings name the nodes."""
    per_buffer, race_rank, before, _ = collected or accesses_by_buffer(order, graph)
    out = []
    nodes = graph.nodes
    for key, rank in race_rank.items():  # buffers are independent: one sweep state at a time
        buf, idx, accs = by_node(per_buffer[key])
        state = _Buffer(buf, rank)
        nbytes = buf.nbytes
        i, m = 0, len(idx)
        while i < m:  # one node's accesses of the buffer are next to each other
            v = idx[i]
            j = i + 1
            while j < m and idx[j] == v:
                j += 1
            if nodes[v].kind in _LIFETIME_KINDS:
                pass  # lifetimes are checked separately
            elif j == i + 1:  # one access (the usual case)
                r = accs[i].range
                if state.whole and r.offset == 0 and r.nbytes == nbytes:
                    state.visit_one_whole(v, accs[i].mode, before)
                else:
                    state.visit_one(v, r.offset, r.offset + r.nbytes, accs[i].mode, before)
            else:
                state.visit(v, [(r.offset, r.offset + r.nbytes, a.mode)
                                for a in accs[i:j] for r in (a.range,)], before)
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

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
    """The sweep state of one buffer: frontier maps and the log of every access so far."""

    __slots__ = ("buffer", "rank", "writers", "readers", "log", "pairs")

    def __init__(self, buffer, rank):
        self.buffer, self.rank = buffer, rank
        self.writers, self.readers = SegmentMap(), SegmentMap()
        self.log: list[tuple[int, int, Mode, str]] = []  # (start, end, mode, node); seq = index
        self.pairs: list[tuple[str, str]] = []  # (earlier, later) not ordered, in discovery order

    def visit(self, node, xs, before):
        """Check node ``node``'s accesses ``xs`` [(start, end, mode)] against the frontier, then
        record them."""
        writers, readers = self.writers, self.readers
        verdict: dict[str, bool] = {}
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
    """One pass over the nodes ``order`` knows: ``(per_buffer, race_rank)``. ``per_buffer``:
    buffer key -> ``[buffer, node, access, node, access, ...]``, the nodes touching it and
    their `Access` records in program order (buffers in order of first access; one list of the
    graph's own objects per buffer, so a big graph adds few objects for the garbage collector
    to scan; `by_node` splits one);
    ``race_rank``: buffer key -> its place in the order of first access by a node that is not
    an Alloc or Free (the order race findings tie-break by)."""
    flat: dict[tuple, list] = {}  # buffer key -> [buffer, node, access, node, access, ...]
    race_rank: dict[tuple, int] = {}
    has, accesses = order.has, graph.accesses
    for node in graph.nodes:
        name = node.name
        if not has(name):
            continue
        racy = node.kind not in _LIFETIME_KINDS
        for acc in accesses(name):
            buf = acc.range.buffer
            key = (buf.is_host, buf.name)  # Buffer.key, without the property call
            entry = flat.get(key)
            if entry is None:
                entry = flat[key] = [buf]
            if racy and key not in race_rank:
                race_rank[key] = len(race_rank)
            entry += (node, acc)
    return flat, race_rank


def by_node(entry):
    """``(buffer, nodes, accesses)`` of one `accesses_by_buffer` entry."""
    return entry[0], entry[1::2], entry[2::2]


def races(order, graph, collected=None) -> list[Finding]:
    """The data-race findings of ``order`` (a `PlanOrder` or `GraphOrder`) for ``graph``;
    ``collected``: `accesses_by_buffer`'s result, when the caller has it already."""
    per_buffer, race_rank = collected or accesses_by_buffer(order, graph)
    before = order.before
    out = []
    index = graph.index
    for key, rank in race_rank.items():  # buffers are independent: one sweep state at a time
        buf, nodes, accs = by_node(per_buffer[key])
        state = _Buffer(buf, rank)
        cur = ""  # the node whose accesses of this buffer are being gathered
        xs: list[tuple[int, int, Mode]] = []
        for node, acc in zip(nodes, accs):
            if node.kind in _LIFETIME_KINDS:
                continue  # lifetimes are checked separately
            if node.name != cur:
                if xs:
                    state.visit(cur, xs, before)
                cur, xs = node.name, []
            r = acc.range
            xs.append((r.offset, r.offset + r.nbytes, acc.mode))
        if xs:
            state.visit(cur, xs, before)
        for a, b in state.pairs:
            out.append(((index(b), index(a), rank), _finding(order, graph, buf, a, b)))
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

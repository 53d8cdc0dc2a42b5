"""Byte-range dependency tracker: which earlier nodes must a new access wait for.

Per buffer it keeps the last writer of every byte and the readers since that write. A read waits
for the overlapping writers; a write waits for the overlapping writers and readers, then carves
its bytes out of both (later accesses reach the older nodes through it, so their edges would be
redundant) and becomes the writer there. Disjoint views of one buffer therefore never depend on
each other.

Both maps are segment maps (`SegmentMap`): sorted breakpoints, each segment between two of them
holding the entries that cover it, so an access visits only the segments it overlaps (bisect),
not every range the buffer has seen. A pipeline slicing one host buffer into N batch ranges thus
costs O(N log N), not O(N^2). (The cost of an access is the number of segments it spans: a read
of a whole buffer that earlier reads cut into N pieces is O(N), where a plain list appended it in
O(1); a write over them finds those N readers either way.) Each entry carries the sequence number
of the access that made it; dependencies are reported in that order, the order of the plain
interval lists this replaced (`tests/test_graph.py` checks both against a brute force).

Most buffers of a pipeline are only ever touched whole (an Alloc, an upload, a kernel, a
Free): until an access covers part of a buffer, the tracker keeps its writers and readers as two
plain lists (what a segment map with the one segment ``[0, nbytes)`` would hold) and switches to
segment maps at the first partial access. Ranges that follow the last breakpoint (a pipeline
walking through a host buffer) are appended without a search.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from orchestra.graph.buffers import Access, Mode

_READ = Mode.READ


class SegmentMap:
    """Byte ranges -> entries ``(seq, node)``; ranges may overlap (several entries per byte).
    The dependency tracker here and the hazard verifier (`orchestra.schedule.races`) use it.

    ``pts`` are sorted breakpoints; ``segs[i]`` lists the entries covering ``[pts[i], pts[i+1])``
    (``len(segs) == len(pts) - 1`` once there is a breakpoint). Bytes outside every segment, or
    in a segment with an empty list, have no entry.
    """

    __slots__ = ("pts", "segs")

    def __init__(self):
        self.pts: list[int] = []
        self.segs: list[list[tuple[int, str]]] = []

    def _split(self, x: int, lo: int = 0) -> int:
        """Make ``x`` a breakpoint (the entries of the segment it cut now cover both halves);
        return its index in ``pts``. ``lo``: no breakpoint before that index is >= ``x``."""
        pts = self.pts
        i = bisect_left(pts, x, lo)
        n = len(pts)
        if i < n and pts[i] == x:
            return i
        pts.insert(i, x)
        if n == 0:
            return i
        if i == 0:  # before every breakpoint: a new empty segment [x, old first)
            self.segs.insert(0, [])
        elif i == n:  # after every breakpoint: a new empty segment [old last, x)
            self.segs.append([])
        else:  # inside segment i-1: both halves keep its entries
            self.segs.insert(i, self.segs[i - 1][:])
        return i

    def overlapping(self, start: int, end: int) -> list[tuple[int, str]]:
        """The distinct entries covering any byte of ``[start, end)``, in ``seq`` order."""
        pts, segs = self.pts, self.segs
        if not pts or start >= pts[-1] or end <= pts[0]:
            return []  # past either end: nothing is there
        # from the segment holding byte ``start`` (each later one ends after it too)
        j = bisect_right(pts, start) - 1
        if j < 0:
            j = 0
        n = len(segs)
        found = []
        while j < n and pts[j] < end:
            if segs[j]:
                found.extend(segs[j])
            j += 1
        if len(found) > 1:
            found = sorted(set(found))
        return found

    def carve(self, start: int, end: int) -> None:
        """Remove every entry from the bytes ``[start, end)``."""
        pts = self.pts
        if not pts or end <= pts[0] or start >= pts[-1]:
            return  # nothing is there
        i = self._split(start)
        j = self._split(end, i + 1)
        if j > i + 1:
            del pts[i + 1:j]
            self.segs[i:j] = [[]]
        else:
            self.segs[i] = []

    def assign(self, start: int, end: int, entry: tuple[int, str]) -> None:
        """`carve` then `add` of ``[start, end)``: ``entry`` becomes the only entry of those
        bytes (a write's frontier), in one pass."""
        pts = self.pts
        if not pts or end <= pts[0] or start >= pts[-1]:
            self.add(start, end, entry)  # nothing there to carve
            return
        i = self._split(start)
        j = self._split(end, i + 1)
        if j > i + 1:
            del pts[i + 1:j]
            self.segs[i:j] = [[entry]]
        else:
            self.segs[i] = [entry]

    def add(self, start: int, end: int, entry: tuple[int, str]) -> None:
        """Add ``entry`` to every byte of ``[start, end)``."""
        pts = self.pts
        if not pts:  # the first entry (most buffers of a long pipeline have few)
            self.pts = [start, end]
            self.segs = [[entry]]
            return
        if start >= pts[-1]:  # after every breakpoint (a walk through a buffer): append
            segs = self.segs
            if start > pts[-1]:
                pts.append(start)
                segs.append([])
            pts.append(end)
            segs.append([entry])
            return
        i = self._split(start)
        j = self._split(end, i + 1)
        segs = self.segs
        for k in range(i, j):
            segs[k].append(entry)


class RangeTracker:
    """Infers RAW, WAR and WAW dependencies from accesses given in program order.

    Thread-safety: not thread-safe (`access` updates per-buffer tables in place): use one per
    thread; a `TaskGraph` owns its own and uses it only while nodes are added.
    """

    def __init__(self):
        # buffer key -> [writers, readers, split]: with ``split`` False every access so far
        # covered the whole buffer and both are lists of entries (seq, node) in seq order;
        # with ``split`` True they are `SegmentMap`s (last writer(s) of each byte, readers
        # since that write)
        self._maps: dict[tuple, list] = {}
        self._seq = 0

    def access(self, node: str, accesses: tuple[Access, ...]) -> dict[str, str]:
        """Record ``node``'s accesses; return {earlier node: reason} it must wait for.

        The reason reads like ``"RAW b0.in"``. All dependencies are found before any update, so
        a node that reads and writes one buffer never depends on itself.
        """
        deps: dict[str, str] = {}
        maps = self._maps
        todo = []
        for acc in accesses:
            r = acc.range
            buf = r.buffer
            key = (buf.is_host, buf.name)  # Buffer.key, without the property call
            s = r.offset
            e = s + r.nbytes
            writes = acc.mode is not _READ
            st = maps.get(key)
            if st is None:  # a buffer's first access: nothing to wait for
                st = maps[key] = ([[], [], False] if s == 0 and e == buf.nbytes
                                  else [SegmentMap(), SegmentMap(), True])
            elif not st[2] and s == 0 and e == buf.nbytes:  # whole, as every access before
                found = st[0]
                if found:
                    reason = ("WAW " if writes else "RAW ") + buf.name
                    for _, w in found:
                        if w != node and w not in deps:
                            deps[w] = reason
                if writes:
                    found = st[1]
                    if found:
                        reason = "WAR " + buf.name
                        for _, rd in found:
                            if rd != node and rd not in deps:
                                deps[rd] = reason
            else:
                if not st[2]:  # the first partial access: the lists become segment maps
                    _split_state(st, buf.nbytes)
                wm, rm = st[0], st[1]
                if wm.pts:
                    found = wm.overlapping(s, e)
                    if found:
                        reason = ("WAW " if writes else "RAW ") + buf.name
                        for _, w in found:
                            if w != node and w not in deps:
                                deps[w] = reason
                if writes and rm.pts:
                    found = rm.overlapping(s, e)
                    if found:
                        reason = "WAR " + buf.name
                        for _, rd in found:
                            if rd != node and rd not in deps:
                                deps[rd] = reason
            todo.append((st, s, e, writes))
        # every write carves first, then every access is added: a node's accesses never hide
        # each other (a buffer that became split above is split for all of them)
        for st, s, e, writes in todo:
            if writes:
                if st[2]:
                    st[0].carve(s, e)
                    st[1].carve(s, e)
                else:
                    st[0] = []
                    st[1] = []
        seq = self._seq
        for st, s, e, writes in todo:
            seq += 1
            if st[2]:
                st[0 if writes else 1].add(s, e, (seq, node))
            else:
                st[0 if writes else 1].append((seq, node))
        self._seq = seq
        return deps


def _split_state(st: list, nbytes: int) -> None:
    """Turn a whole-buffer state ``[writers, readers, False]`` into the segment maps holding
    the same entries over ``[0, nbytes)``."""
    for k in (0, 1):
        m = SegmentMap()
        if st[k]:
            m.pts = [0, nbytes]
            m.segs = [list(st[k])]
        st[k] = m
    st[2] = True

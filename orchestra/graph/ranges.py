"""Byte-range dependency tracker: which earlier nodes must a new access wait for.

Per buffer it keeps the last writer of every byte and the readers since that write, as lists of
``(start, end, node)`` intervals. A read waits for the overlapping writers; a write waits for the
overlapping writers and readers, then carves its bytes out of both lists (later accesses reach the
older nodes through it, so their edges would be redundant) and becomes the writer there.
Disjoint views of one buffer therefore never depend on each other.
"""

from __future__ import annotations

from collections import defaultdict

from orchestra.graph.buffers import Access


def _carve(intervals, start, end):
    """``intervals`` with the bytes ``[start, end)`` removed."""
    kept = []
    for s, e, node in intervals:
        if e <= start or s >= end:
            kept.append((s, e, node))
            continue
        if s < start:
            kept.append((s, start, node))
        if e > end:
            kept.append((end, e, node))
    return kept


class RangeTracker:
    """Infers RAW, WAR and WAW dependencies from accesses given in program order."""

    def __init__(self):
        self._writers = defaultdict(list)  # buffer key -> [(start, end, node)]
        self._readers = defaultdict(list)

    def access(self, node: str, accesses: tuple[Access, ...]) -> dict[str, str]:
        """Record ``node``'s accesses; return {earlier node: reason} it must wait for.

        The reason reads like ``"RAW b0.in"``. All dependencies are found before any update, so
        a node that reads and writes one buffer never depends on itself.
        """
        deps: dict[str, str] = {}
        for acc in accesses:
            r = acc.range
            key, s, e = r.buffer.key, r.offset, r.end
            for ws, we, w in self._writers[key]:
                if ws < e and s < we and w != node:
                    deps.setdefault(w, ("WAW " if acc.mode.writes else "RAW ") + r.buffer.name)
            if acc.mode.writes:
                for rs, re_, rd in self._readers[key]:
                    if rs < e and s < re_ and rd != node:
                        deps.setdefault(rd, "WAR " + r.buffer.name)
        for acc in accesses:
            r = acc.range
            key = r.buffer.key
            if acc.mode.writes:
                self._writers[key] = _carve(self._writers[key], r.offset, r.end)
                self._readers[key] = _carve(self._readers[key], r.offset, r.end)
        for acc in accesses:
            r = acc.range
            key = r.buffer.key
            if acc.mode.writes:
                self._writers[key].append((r.offset, r.end, node))
            else:
                self._readers[key].append((r.offset, r.end, node))
        return deps

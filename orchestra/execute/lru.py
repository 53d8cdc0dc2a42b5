"""`IdentityLRU`: values cached by the identity of the objects they were made from.

The executors cache work per object, not per value: a prepared plan per (graph object, plan
object), a schedule per (graph, costs) object, a checked host array per array object. A task
graph is mutable and not hashable by content, and a check of an array is only valid for that
very array, so the key is the objects' identities plus a few plain values (a node count, a
policy name), and a hit requires ``is`` on every object, never ``==``.

An id is unique only while its object lives. A *strong* cache holds its key objects, so their
ids cannot be reused while the entry exists; a *weak* cache holds weak references (an entry
whose object was collected is a miss, and is dropped when next looked at), for caches that
must not keep their keys alive (a checked host array belongs to the caller).
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable

from orchestra.execute.errors import ExecutorArgumentValueError


class IdentityLRU:
    """At most ``size`` values keyed by ``(objects, extra)``, least recently used dropped first.

    ``objects``: a tuple of objects compared by identity (None entries allowed); ``extra``: a
    hashable tuple compared by equality. ``weak=True`` keeps weak references to the objects
    (each must support them) instead of the objects. ``on_evict(value)`` is called for every
    value dropped to make room (not for `clear`, nor for a value `put` replaces).

    Thread-safety: may be shared between threads: one lock covers the entries; ``on_evict`` runs
    outside it, and so does `get_or_make`'s ``make`` (two threads that miss on one key at once
    both make a value; the later one is kept).
    """

    def __init__(self, size: int, *, weak: bool = False,
                 on_evict: Callable[[Any], None] | None = None):
        if size < 1:
            raise ExecutorArgumentValueError(
                f"an IdentityLRU holds at least one entry; got size={size}")
        self.size = int(size)
        self.weak = bool(weak)
        self._on_evict = on_evict
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def _key(self, objects: tuple, extra: tuple) -> tuple:
        return (tuple(map(id, objects)), extra)

    def _held(self, objects: tuple) -> tuple:
        if self.weak:
            return tuple(None if o is None else weakref.ref(o) for o in objects)
        return objects

    def _matches(self, held: tuple, objects: tuple) -> bool:
        if self.weak:
            for h, o in zip(held, objects):
                if (h() if h is not None else None) is not o:
                    return False
            return True
        for h, o in zip(held, objects):
            if h is not o:
                return False
        return True

    def get(self, objects: tuple, extra: tuple = (), default=None):
        """The value for these very ``objects`` (and equal ``extra``), made most recent; else
        ``default``."""
        key = self._key(objects, extra)
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return default
            if not self._matches(hit[0], objects):
                del self._entries[key]  # a collected object's id, reused
                return default
            self._entries.move_to_end(key)
            return hit[1]

    def put(self, objects: tuple, extra: tuple, value) -> None:
        """Store ``value`` as the most recent entry; drops the least recent beyond ``size``."""
        key = self._key(objects, extra)
        evicted = []
        with self._lock:
            self._entries[key] = (self._held(objects), value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                evicted.append(self._entries.popitem(last=False)[1][1])
        if self._on_evict is not None:
            for v in evicted:
                self._on_evict(v)

    def get_or_make(self, objects: tuple, extra: tuple, make: Callable[[], Any]) -> tuple:
        """``(value, made)``: the cached value, or ``make()`` stored and ``made=True``. ``make``
        runs outside the lock; if it raises, nothing is stored."""
        value = self.get(objects, extra, _MISSING)
        if value is not _MISSING:
            return value, False
        value = make()
        self.put(objects, extra, value)
        return value, True

    def values(self) -> list:
        """The values, least recently used first."""
        with self._lock:
            return [v for _, v in self._entries.values()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return f"<IdentityLRU {len(self)}/{self.size}{' weak' if self.weak else ''}>"


_MISSING = object()

__all__ = ["IdentityLRU"]

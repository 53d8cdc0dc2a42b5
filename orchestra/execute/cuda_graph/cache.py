"""`GraphCache`: executable graphs kept per input shape signature, as serving systems keep them.

A graph's topology and its baked-in sizes depend on the shapes and dtypes of its inputs and on
everything that shapes the task graph (batch count, scheduling policy, stream count, the kernels
and their launch shapes). A serving loop looks the exec up by that `Signature`, replays it with
the request's arrays, and builds (captures or constructs) a new one only on a miss:

    cache = GraphCache(max_entries=16, buckets="pow2")
    sig = cache.signature({"x": (batch, 1024, "float32")}, policy="by-engine", streams=3,
                          kernel=("burn.cu", "burn"))
    with cache.lease(sig, lambda s: build_exec_for(s)) as exe:
        exe.replay({"x": padded_x, "y": padded_y})

Bucketing (optional) pads the leading dimension of every input shape (the batch dimension by
serving convention) up to the next bucket, so requests of batch 3, 4 and 5..8 share the execs
captured for 4 and 8: ``buckets="pow2"`` (powers of two), a list of sizes (``[1, 8, 32, 128]``,
anything larger than the last bucket is refused), or None (exact shapes). `bucket` tells the
caller the size to pad to. Everything here is plain Python (no CUDA).

Thread-safe: lookups and counts are under one lock; a build runs outside it, and concurrent
requests for a signature that is being built wait for that build instead of building again.
Least-recently-used entries beyond ``max_entries`` are evicted and closed (``close()`` is called
on the value when it has one).

Lifetimes (docs/errors.md, "Lifetimes"): an entry evicted while leased (`lease`) is dropped
from the cache at once but closed only when its last lease ends, exactly once, by the thread
that ends it: another thread's eviction (capacity, `evict`, `put` replacing it, `clear`) never
closes an exec that a thread is launching. `get_or_build` and `get` return the value without a
lease: a later eviction may close it under the caller, so a caller that shares the cache with
other threads uses `lease`.
"""

from __future__ import annotations

import bisect
import collections
import logging
import operator
import threading
from typing import Any, Callable, Hashable, Mapping, Sequence

import attrs

from orchestra.errors import NotFoundError
from orchestra.execute.errors import (
    BucketOverflowError,
    ExecutorArgumentTypeError,
    ExecutorArgumentValueError,
)

log = logging.getLogger(__name__)


def _dtype_name(dtype) -> str:
    try:
        import numpy as np

        return np.dtype(dtype).name
    except Exception:  # noqa: BLE001 - any other dtype-like is kept as its text
        return str(dtype)


class BucketPolicy:
    """Rounds a size up to a bucket. ``kind``: ``"pow2"`` or ``"list"``; ``sizes`` for lists.

    Thread-safety: its fields are set once, in ``__init__``: may be shared between threads freely.
    """

    def __init__(self, spec):
        if spec == "pow2":
            self.kind, self.sizes = "pow2", ()
        elif isinstance(spec, BucketPolicy):
            self.kind, self.sizes = spec.kind, spec.sizes
        else:
            try:
                sizes = sorted({operator.index(s) for s in spec})
            except TypeError:
                raise ExecutorArgumentTypeError(
                    f"buckets must be 'pow2', a sequence of sizes or None; got "
                    f"{spec!r}") from None
            if not sizes or sizes[0] < 1:
                raise ExecutorArgumentValueError(
                    f"bucket sizes must be positive ints; got {spec!r}")
            self.kind, self.sizes = "list", tuple(sizes)

    def __call__(self, n: int) -> int:
        n = operator.index(n)
        if n < 1:
            raise ExecutorArgumentValueError(f"a bucketed size must be >= 1; got {n}")
        if self.kind == "pow2":
            return 1 << (n - 1).bit_length()
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise BucketOverflowError(
                f"size {n} is larger than the largest bucket ({self.sizes[-1]}); "
                f"buckets: {list(self.sizes)}")
        return self.sizes[i]

    def __repr__(self) -> str:
        if self.kind == "pow2":
            return "BucketPolicy('pow2')"
        return f"BucketPolicy({list(self.sizes)})"


@attrs.frozen
class Signature:
    """What an exec is keyed by: ``shapes`` ((name, shape, dtype), sorted by name) and
    ``topology`` ((key, value), sorted by key): batch count, policy, streams, kernel identity,
    launch shapes... anything that changes the task graph. ``requested``: the shapes before
    bucketing (not part of equality or the hash).

    Immutable: may be shared between threads freely.
    """

    shapes: tuple
    topology: tuple = ()
    requested: tuple = attrs.field(default=(), eq=False, hash=False, repr=False)

    def shape(self, name: str) -> tuple:
        for n, shape, _ in self.shapes:
            if n == name:
                return shape
        raise NotFoundError(f"no input named {name!r} in the signature")

    def get(self, key: str, default=None):
        for k, v in self.topology:
            if k == key:
                return v
        return default


def _freeze(value):
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, set | frozenset):
        return tuple(sorted(_freeze(v) for v in value))
    hash(value)  # TypeError for anything unhashable
    return value


def _shape_entry(name: str, spec) -> tuple[tuple[int, ...], str]:
    """(shape, dtype) from an array (``.shape``/``.dtype``), a ``(shape, dtype)`` pair or a
    ``(d0, d1, ..., dtype)`` tuple."""
    if hasattr(spec, "shape") and hasattr(spec, "dtype"):
        return tuple(int(d) for d in spec.shape), _dtype_name(spec.dtype)
    if isinstance(spec, (tuple, list)) and spec:
        if len(spec) == 2 and isinstance(spec[0], (tuple, list)):
            return tuple(operator.index(d) for d in spec[0]), _dtype_name(spec[1])
        *dims, dtype = spec
        if not isinstance(dtype, int):
            return tuple(operator.index(d) for d in dims), _dtype_name(dtype)
    raise ExecutorArgumentTypeError(
        f"input {name}: give an array, (shape, dtype) or (d0, ..., dtype); got "
        f"{spec!r}")


class _Entry:
    """One cached value and its lifetime: ``leases`` out, ``evicted`` (out of the cache),
    ``closed`` (its close was claimed: it happens once). Changed only under the cache's lock."""

    __slots__ = ("value", "leases", "evicted", "closed")

    def __init__(self, value, leases: int = 0):
        self.value = value
        self.leases = leases
        self.evicted = False
        self.closed = False


class CacheLease:
    """A lease on one `GraphCache` entry's value: while it is held, no eviction closes it.

    ``value``: the cached value (an exec). `release()` ends the lease (idempotent,
    thread-safe); if the entry was evicted meanwhile and this was its last lease, the value is
    closed now, on this thread. A context manager: ``with cache.lease(sig, build) as exe:``
    gives the value and releases at the end of the block. A lease garbage-collected unreleased
    is ended by the cache's next call (a finalizer must not take the cache's lock).

    Thread-safety: may be shared between threads; `release` may be called from several at once: one
    ``list.pop`` claims it, so the lease ends exactly once.
    """

    __slots__ = ("value", "_claim", "_entry", "__weakref__")

    def __init__(self, cache: "GraphCache", entry: _Entry):
        self.value = entry.value
        self._entry = entry
        self._claim = [cache]  # popped once: the one caller that ends the lease

    @property
    def released(self) -> bool:
        return not self._claim

    def release(self) -> None:
        """End the lease (see the class doc); a no-op if it already ended."""
        try:
            cache = self._claim.pop()
        except IndexError:
            return
        cache._unlease(self._entry)

    def __enter__(self):
        return self.value

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            cache = self._claim.pop()
        except (IndexError, AttributeError):
            return
        cache._orphans.append(self._entry)  # list.append: safe at any bytecode, any thread

    def __repr__(self) -> str:
        return f"<CacheLease of {self.value!r}{' (released)' if not self._claim else ''}>"


class GraphCache:
    """LRU cache of built graph execs by `Signature`, with hit and miss counts.

    Args:
        max_entries: keep at most this many (None: unbounded); the least recently used entry
            is evicted and its value closed (when its last lease ends, if leased).
        buckets: None, ``"pow2"`` or a list of sizes: how `signature` pads the leading dimension
            of every input shape (see the module doc).

    Values are closed by calling their ``close()`` (if they have one) exactly once, after
    eviction and after the last `lease` on them ended.

    Thread-safety: may be shared between threads: one lock covers the entries, the counts and the
    builds in flight; a value is built outside the lock, once per signature (other threads asking
    for it wait for that build), and closed outside it. Use `lease` where other threads may evict a
    value you still use.
    """

    def __init__(self, max_entries: int | None = None, buckets=None):
        if max_entries is not None:
            max_entries = operator.index(max_entries)
            if max_entries < 1:
                raise ExecutorArgumentValueError(
                    f"max_entries must be >= 1 or None; got {max_entries}")
        self.max_entries = max_entries
        self.buckets = None if buckets is None else BucketPolicy(buckets)
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._building: dict[Signature, threading.Event] = {}
        self._lock = threading.Lock()
        self._orphans: list[_Entry] = []  # entries of leases garbage-collected unreleased
        self._deferred = 0  # evicted entries waiting for their last lease
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # -- keys -------------------------------------------------------------------------------

    def bucket(self, n: int) -> int:
        """The size ``n`` is padded to (``n`` itself without bucketing)."""
        return operator.index(n) if self.buckets is None else self.buckets(n)

    def signature(self, inputs: Mapping[str, Any] | None = None, **topology) -> Signature:
        """The `Signature` of ``inputs`` (name -> array, ``(shape, dtype)`` or
        ``(d0, ..., dtype)``), the leading dimension bucketed, plus ``topology`` keywords
        (values made hashable: lists become tuples, dicts sorted item tuples)."""
        shapes, requested = [], []
        for name, spec in sorted((inputs or {}).items()):
            shape, dtype = _shape_entry(name, spec)
            requested.append((name, shape, dtype))
            if shape and self.buckets is not None:
                shape = (self.buckets(shape[0]),) + shape[1:]
            shapes.append((name, shape, dtype))
        topo = tuple(sorted((str(k), _freeze(v)) for k, v in topology.items()))
        return Signature(tuple(shapes), topo, tuple(requested))

    # -- lookups ----------------------------------------------------------------------------

    def get(self, signature: Signature, default=None):
        """The cached value (counted as a hit, made most recent) or ``default`` (not counted).
        Not leased: a later eviction may close it (see `lease`)."""
        self._end_orphans()
        with self._lock:
            entry = self._entries.get(signature)
            if entry is not None:
                self._entries.move_to_end(signature)
                self.hits += 1
                return entry.value
        return default

    def get_or_build(self, signature: Signature, build_fn: Callable[[Signature], Any]):
        """The value for ``signature``, built with ``build_fn(signature)`` on a miss.

        A hit moves the entry to most recent. A miss builds outside the lock; other threads
        asking for the same signature meanwhile wait for that build (and count as hits). If
        ``build_fn`` raises, nothing is cached and the error propagates (waiters retry).

        The value is not leased: an eviction by a later call (this thread's or another's) may
        close it while the caller still uses it. Where other threads share the cache, use
        `lease`, which keeps it open until released.
        """
        return self._lookup(signature, build_fn, lease=False)

    def lease(self, signature: Hashable,
              build_fn: Callable[[Any], Any] | None = None) -> CacheLease:
        """A `CacheLease` on the value for ``signature`` (a `Signature`, or any hashable key, as
        `GraphRunner` uses; built with ``build_fn`` on a miss, as `get_or_build` does): the value stays open until the lease is released, even if it
        is evicted meanwhile (then it is closed at the last lease's end).

        ``with cache.lease(sig, build_fn) as exe: exe.replay(...)``. Without ``build_fn`` a
        miss raises ``KeyError`` naming the signature. Counts hits and misses like
        `get_or_build`.
        """
        return self._lookup(signature, build_fn, lease=True)

    def _lookup(self, signature, build_fn, *, lease: bool):
        self._end_orphans()
        while True:
            with self._lock:
                entry = self._entries.get(signature)
                if entry is not None:
                    self._entries.move_to_end(signature)
                    self.hits += 1
                    log.debug("graph cache hit: %s", signature)
                    if not lease:
                        return entry.value
                    entry.leases += 1
                    return CacheLease(self, entry)
                pending = self._building.get(signature)
                if pending is None:
                    if build_fn is None:
                        raise NotFoundError(f"no cached value for {signature!r} and no build_fn "
                                            "to build one")
                    pending = self._building[signature] = threading.Event()
                    self.misses += 1
                    log.debug("graph cache miss: %s (building)", signature)
                    break
            pending.wait()
        try:
            value = build_fn(signature)
        except BaseException:
            with self._lock:
                del self._building[signature]
            pending.set()
            raise
        entry = _Entry(value, leases=1 if lease else 0)
        with self._lock:
            old = self._entries.pop(signature, None)  # a put() meanwhile: replaced
            to_close = self._evict_locked(old) if old is not None and old.value is not value \
                else []
            self._entries[signature] = entry
            del self._building[signature]
            to_close += self._trim_locked()
        pending.set()
        _close_all(to_close)
        return CacheLease(self, entry) if lease else value

    def put(self, signature: Signature, value) -> None:
        """Insert (or replace, closing the old value once unleased) an entry; evicts like
        `get_or_build`."""
        self._end_orphans()
        with self._lock:
            old = self._entries.pop(signature, None)
            to_close = []
            if old is not None:
                if old.value is value:
                    self._entries[signature] = old
                    return
                to_close = self._evict_locked(old)
            self._entries[signature] = _Entry(value)
            to_close += self._trim_locked()
        _close_all(to_close)

    def evict(self, signature: Signature) -> bool:
        """Remove one entry and close it (now, or at its last lease's end); True if it was
        there."""
        self._end_orphans()
        with self._lock:
            entry = self._entries.pop(signature, None)
            if entry is None:
                return False
            to_close = self._evict_locked(entry)
        _close_all(to_close)
        return True

    def clear(self) -> None:
        """Drop every entry and close each (now, or at its last lease's end; counts kept)."""
        self._end_orphans()
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            to_close = [v for e in entries for v in self._evict_locked(e)]
        _close_all(to_close)

    close = clear

    # -- lifetimes (under the lock: mark; outside it: close) --------------------------------

    def _trim_locked(self) -> list:
        to_close: list = []
        if self.max_entries is not None:
            while len(self._entries) > self.max_entries:
                to_close += self._evict_locked(self._entries.popitem(last=False)[1],
                                               capacity=True)
        return to_close

    def _evict_locked(self, entry: _Entry, capacity: bool = False) -> list:
        """Mark ``entry`` evicted (``capacity``: counted in ``evictions``); [its value] when it
        is to be closed now, else [] (closed at its last lease's end)."""
        entry.evicted = True
        if capacity:
            self.evictions += 1
        if entry.closed:
            return []
        if entry.leases:
            self._deferred += 1
            return []
        entry.closed = True
        return [entry.value]

    def _unlease(self, entry: _Entry) -> None:
        with self._lock:
            entry.leases -= 1
            if entry.leases or not entry.evicted or entry.closed:
                return
            entry.closed = True
            self._deferred -= 1
        _close(entry.value)

    def _end_orphans(self) -> None:
        while self._orphans:
            try:
                entry = self._orphans.pop()
            except IndexError:
                return
            self._unlease(entry)

    @property
    def deferred(self) -> int:
        """Evicted values still open because a lease is out (each closed at its last lease's
        end)."""
        with self._lock:
            return self._deferred

    def __contains__(self, signature) -> bool:
        with self._lock:
            return signature in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[Signature]:
        """Signatures, least recently used first."""
        with self._lock:
            return list(self._entries)

    @property
    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses,
                    "evictions": self.evictions}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.clear()

    def __repr__(self) -> str:
        return (f"<GraphCache {len(self)} entries, {self.hits} hits, {self.misses} misses, "
                f"buckets={self.buckets!r}>")


def _close(value) -> None:
    close = getattr(value, "close", None)
    if callable(close):
        close()


def _close_all(values) -> None:
    """Close each value; every one is tried, the first error is raised after."""
    error = None
    for v in values:
        try:
            _close(v)
        except BaseException as exc:  # noqa: BLE001 - the others must still be closed
            error = error or exc
    if error is not None:
        raise error


def pad_to(n: int, buckets: Sequence[int] | str | None) -> int:
    """Convenience: the bucket ``n`` pads to under ``buckets`` (None: ``n``)."""
    return operator.index(n) if buckets is None else BucketPolicy(buckets)(n)


__all__ = ["BucketPolicy", "CacheLease", "GraphCache", "Signature", "pad_to"]

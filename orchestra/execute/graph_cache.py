"""`GraphCache`: executable graphs kept per input shape signature, as serving systems keep them.

A graph's topology and its baked-in sizes depend on the shapes and dtypes of its inputs and on
everything that shapes the task graph (batch count, scheduling policy, stream count, the kernels
and their launch shapes). A serving loop looks the exec up by that `Signature`, replays it with
the request's arrays, and builds (captures or constructs) a new one only on a miss:

    cache = GraphCache(max_entries=16, buckets="pow2")
    sig = cache.signature({"x": (batch, 1024, "float32")}, policy="by-engine", streams=3,
                          kernel=("burn.cu", "burn"))
    exe = cache.get_or_build(sig, lambda s: build_exec_for(s))
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
"""

from __future__ import annotations

import bisect
import collections
import operator
import threading
from typing import Any, Callable, Mapping, Sequence

import attrs

from orchestra.errors import NotFoundError
from orchestra.execute.errors import (
    BucketOverflowError,
    ExecutorArgumentTypeError,
    ExecutorArgumentValueError,
)


def _dtype_name(dtype) -> str:
    try:
        import numpy as np

        return np.dtype(dtype).name
    except Exception:  # noqa: BLE001 - any other dtype-like is kept as its text
        return str(dtype)


class BucketPolicy:
    """Rounds a size up to a bucket. ``kind``: ``"pow2"`` or ``"list"``; ``sizes`` for lists."""

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
    bucketing (not part of equality or the hash)."""

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


class GraphCache:
    """LRU cache of built graph execs by `Signature`, with hit and miss counts.

    Args:
        max_entries: keep at most this many (None: unbounded); the least recently used entry
            is evicted and its value closed.
        buckets: None, ``"pow2"`` or a list of sizes: how `signature` pads the leading dimension
            of every input shape (see the module doc).
    """

    def __init__(self, max_entries: int | None = None, buckets=None):
        if max_entries is not None:
            max_entries = operator.index(max_entries)
            if max_entries < 1:
                raise ExecutorArgumentValueError(
                    f"max_entries must be >= 1 or None; got {max_entries}")
        self.max_entries = max_entries
        self.buckets = None if buckets is None else BucketPolicy(buckets)
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._building: dict[Signature, threading.Event] = {}
        self._lock = threading.Lock()
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
        """The cached value (counted as a hit, made most recent) or ``default`` (not counted)."""
        with self._lock:
            if signature in self._entries:
                self._entries.move_to_end(signature)
                self.hits += 1
                return self._entries[signature]
        return default

    def get_or_build(self, signature: Signature, build_fn: Callable[[Signature], Any]):
        """The value for ``signature``, built with ``build_fn(signature)`` on a miss.

        A hit moves the entry to most recent. A miss builds outside the lock; other threads
        asking for the same signature meanwhile wait for that build (and count as hits). If
        ``build_fn`` raises, nothing is cached and the error propagates (waiters retry).
        """
        while True:
            with self._lock:
                if signature in self._entries:
                    self._entries.move_to_end(signature)
                    self.hits += 1
                    return self._entries[signature]
                pending = self._building.get(signature)
                if pending is None:
                    pending = self._building[signature] = threading.Event()
                    self.misses += 1
                    break
            pending.wait()
        try:
            value = build_fn(signature)
        except BaseException:
            with self._lock:
                del self._building[signature]
            pending.set()
            raise
        evicted = []
        with self._lock:
            self._entries[signature] = value
            self._entries.move_to_end(signature)
            del self._building[signature]
            if self.max_entries is not None:
                while len(self._entries) > self.max_entries:
                    evicted.append(self._entries.popitem(last=False)[1])
                    self.evictions += 1
        pending.set()
        for old in evicted:
            _close(old)
        return value

    def put(self, signature: Signature, value) -> None:
        """Insert (or replace, closing the old value) an entry; evicts like `get_or_build`."""
        evicted = []
        with self._lock:
            old = self._entries.pop(signature, None)
            if old is not None and old is not value:
                evicted.append(old)
            self._entries[signature] = value
            if self.max_entries is not None:
                while len(self._entries) > self.max_entries:
                    evicted.append(self._entries.popitem(last=False)[1])
                    self.evictions += 1
        for v in evicted:
            _close(v)

    def evict(self, signature: Signature) -> bool:
        """Remove and close one entry; True if it was there."""
        with self._lock:
            value = self._entries.pop(signature, None)
        if value is None:
            return False
        _close(value)
        return True

    def clear(self) -> None:
        """Close and drop every entry (counts are kept)."""
        with self._lock:
            values = list(self._entries.values())
            self._entries.clear()
        for v in values:
            _close(v)

    close = clear

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


def pad_to(n: int, buckets: Sequence[int] | str | None) -> int:
    """Convenience: the bucket ``n`` pads to under ``buckets`` (None: ``n``)."""
    return operator.index(n) if buckets is None else BucketPolicy(buckets)(n)


__all__ = ["BucketPolicy", "GraphCache", "Signature", "pad_to"]

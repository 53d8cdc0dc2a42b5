"""Shape buckets: the row counts an engine builds executable graphs for (plain Python).

A request of ``r`` rows runs on the smallest bucket of at least ``r`` rows: its inputs are
padded to the bucket's rows, its outputs sliced back. Three ways to give the buckets:

- ``"vllm"`` (the default): 1, 2, 4, then every multiple of 8 up to ``max_rows`` (the capture
  sizes vLLM uses for decode batches; few rows waste little padding, many rows waste at most 7);
- ``"pow2"``: powers of two up to ``max_rows`` (fewer graphs, up to 2x padding);
- a sequence of row counts (``[1, 16, 64]``).

``max_rows`` is always a bucket: a request above the largest bucket is refused with
`RequestTooLarge` unless the engine may split it.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from typing import Sequence

from orchestra.serve.errors import ServeConfigTypeError, ServeConfigValueError
DEFAULT_MAX_ROWS = 256
# buckets one engine may have: each is built (K instances of a graph) by its first request,
# and the engine keeps a record per bucket; vLLM captures 67 sizes
MAX_BUCKETS = 4096


def vllm_buckets(max_rows: int = DEFAULT_MAX_ROWS) -> tuple[int, ...]:
    """``(1, 2, 4, 8, 16, 24, ..., max_rows)``: 1, 2, 4, then steps of 8, and ``max_rows``.

    Raises `ServeConfigValueError` when that makes more than `MAX_BUCKETS` buckets
    (``max_rows`` above about 8 x 4096 rows): use ``"pow2"`` or a list for such sizes."""
    m = positive_count("max_rows", max_rows)
    if m // 8 + 4 > MAX_BUCKETS:  # counted before building: 10**20 rows would never end
        raise ServeConfigValueError(
            f"buckets='vllm' with max_rows={m} makes {m // 8 + 3} buckets, more than "
            f"{MAX_BUCKETS} (one per 8 rows); use buckets='pow2' or a list of row counts "
            f"for such sizes, or max_rows <= {8 * (MAX_BUCKETS - 4)}")
    sizes = {s for s in (1, 2, 4) if s <= m} | set(range(8, m + 1, 8)) | {m}
    return tuple(sorted(sizes))


def pow2_buckets(max_rows: int = DEFAULT_MAX_ROWS) -> tuple[int, ...]:
    """``(1, 2, 4, ..., max_rows)``: powers of two below ``max_rows``, and ``max_rows``."""
    m = positive_count("max_rows", max_rows)
    sizes = {1 << k for k in range(m.bit_length()) if 1 << k <= m} | {m}
    return tuple(sorted(sizes))


def bucket_sizes(spec="vllm", max_rows: int | None = None) -> tuple[int, ...]:
    """The sorted, distinct bucket row counts of ``spec`` (see the module doc).

    ``max_rows`` default: 256 for ``"vllm"`` and ``"pow2"``; with a sequence it is added to it
    when given. Raises `ServeConfigValueError` / `ServeConfigTypeError` (a ``ValueError`` /
    ``TypeError``) for sizes, ``max_rows`` included, that are not positive ints.
    """
    if isinstance(spec, str):
        if spec == "vllm":
            return vllm_buckets(DEFAULT_MAX_ROWS if max_rows is None else max_rows)
        if spec == "pow2":
            return pow2_buckets(DEFAULT_MAX_ROWS if max_rows is None else max_rows)
        raise ServeConfigValueError(f"buckets must be 'vllm', 'pow2' or a sequence of row counts; "
                                    f"got {spec!r}")
    if isinstance(spec, int):
        spec = [spec]
    try:
        # at most one more than the limit is read: range(10**20) or a generator never ends
        given = list(itertools.islice(iter(spec), MAX_BUCKETS + 1))
        sizes = {operator.index(s) for s in given}
    except TypeError:
        raise ServeConfigTypeError(f"buckets must be 'vllm', 'pow2' or a sequence of row counts "
                                   f"(ints); got {spec!r}") from None
    if max_rows is not None:
        sizes.add(positive_count("max_rows", max_rows))  # "8" or 2.5: not a builtin TypeError
    if not sizes or min(sizes) < 1:
        raise ServeConfigValueError(f"bucket row counts must be positive ints; got {spec!r}")
    if len(given) > MAX_BUCKETS:
        raise ServeConfigValueError(f"more than {MAX_BUCKETS} buckets given; "
                                    "give fewer row counts (a request runs on the smallest "
                                    "that fits)")
    return tuple(sorted(sizes))


class Buckets:
    """A sorted set of bucket row counts and the lookup ``pick(rows) -> bucket rows``.

    Immutable; safe to share between threads.
    """

    __slots__ = ("sizes", "largest")

    def __init__(self, sizes: Sequence[int]):
        self.sizes = tuple(sorted(set(sizes)))
        if not self.sizes:
            raise ServeConfigValueError("at least one bucket is needed")
        self.largest = self.sizes[-1]

    def pick(self, rows: int) -> int | None:
        """The smallest bucket of at least ``rows`` rows, or None when ``rows`` is above the
        largest."""
        i = bisect.bisect_left(self.sizes, rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"Buckets({list(self.sizes)})"


def positive_count(name: str, value, least: int = 1) -> int:
    """``value`` as an int >= ``least`` (1 by default; numpy ints too), else
    `ServeConfigTypeError` for a bool, a float or a string (2.5 was taken, "8" failed in a
    comparison) and `ServeConfigValueError` below ``least``; ``name`` names the argument in
    the message."""
    if isinstance(value, bool):
        raise ServeConfigTypeError(f"{name} must be an int >= {least}; got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ServeConfigTypeError(f"{name} must be an int >= {least}; got {value!r}") from None
    if n < least:
        raise ServeConfigValueError(f"{name} must be >= {least}; got {n}")
    return n


__all__ = ["Buckets", "DEFAULT_MAX_ROWS", "MAX_BUCKETS", "bucket_sizes", "pow2_buckets", "vllm_buckets"]

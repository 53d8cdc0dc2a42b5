"""The workloads of ``orchestra bench peers`` and their parsing (pure Python).

Built in (letters or names in ``--workloads``):

| key | name | what | expected wall on an H200 |
|---|---|---|---|
| a | 32x64MiB | pipeline, 32 batches of 64 MiB, kernel calibrated to the copies | ~35 s |
| b | 256x4MiB | pipeline, 256 batches of 4 MiB, kernel calibrated to the copies | ~25 s |
| c | 1024x64KiB | pipeline, 1024 batches of 64 KiB, kernel of 1 iteration: launch-bound | ~25 s |
| d | request | one 64 KiB request (H2D -> kernel -> D2H, waited for), p50 / p99 of 2,000 | ~15 s |
| e | chain | 1,000 dependent tiny kernels, with and without PDL | ~10 s |

A custom pipeline is ``BATCHESxSIZE[@ITERS]`` with SIZE in KiB or MiB (``64x1MiB``,
``512x256KiB@1``); ITERS is the kernel's iteration count (default: calibrated to the copies,
``auto``). The expected times include setup (pinned memory, compiles, peers' imports) and the
output checks; `expected_seconds` estimates a custom one.
"""

from __future__ import annotations

import re

import attrs

from orchestra.errors import BenchConfigError

KIB = 1 << 10
MIB = 1 << 20


@attrs.frozen
class Workload:
    """One workload. ``kind``: "pipeline" (``batches`` x ``batch_bytes``, kernel ``iters``:
    an int or None = calibrated to the copies), "request" (``requests`` single requests of
    ``batch_bytes``) or "chain" (``kernels`` dependent kernels of ``batch_bytes``).

    Immutable: may be shared between threads freely.
    """

    key: str
    name: str
    kind: str
    batch_bytes: int
    batches: int = 1
    iters: int | None = None
    requests: int = 0
    kernels: int = 0
    expected_s: float = 0.0

    @property
    def label(self) -> str:
        """What the table's workload column shows (a built-in's key first)."""
        key = f"({self.key}) " if self.key != self.name else ""
        if self.kind == "pipeline":
            return f"{key}{self.batches} x {format_size(self.batch_bytes)}"
        if self.kind == "request":
            return f"{key}1 x {format_size(self.batch_bytes)} request"
        return f"{key}chain of {self.kernels} kernels"

    @property
    def nodes(self) -> int:
        """Task-graph nodes of orchestra's version of the workload (alloc x2, H2D, kernel,
        D2H, free x2 per batch; a request with external buffers: H2D, kernel, D2H; a chain:
        one kernel node per link)."""
        if self.kind == "pipeline":
            return 7 * self.batches
        if self.kind == "request":
            return 3
        return self.kernels

    def as_dict(self) -> dict:
        return attrs.asdict(self)


BUILTIN = (
    Workload("a", "32x64MiB", "pipeline", 64 * MIB, 32, None, expected_s=35.0),
    Workload("b", "256x4MiB", "pipeline", 4 * MIB, 256, None, expected_s=25.0),
    Workload("c", "1024x64KiB", "pipeline", 64 * KIB, 1024, 1, expected_s=25.0),
    Workload("d", "request", "request", 64 * KIB, 1, 1, requests=2000, expected_s=15.0),
    Workload("e", "chain", "chain", 256 * 4, 1, None, kernels=1000, expected_s=10.0),
)
DEFAULT = "a,b,c,d,e"

_CUSTOM = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)(kib|mib|k|m)(?:@(\d+|auto))?$")


def format_size(nbytes: int) -> str:
    """``65536`` -> ``"64 KiB"``, ``67108864`` -> ``"64 MiB"``."""
    if nbytes >= MIB and nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    if nbytes >= KIB and nbytes % KIB == 0:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def expected_seconds(w: Workload) -> float:
    """Expected wall seconds of one workload on an H200 (the built-ins' measured estimates;
    a custom pipeline: ~10 s of setup plus its bytes at ~1.5 GB/s of run-and-check time,
    plus 15 µs per batch per contender run)."""
    if w.expected_s:
        return w.expected_s
    total = w.batches * w.batch_bytes
    return 10.0 + 2 * total / 1.5e9 + w.batches * 15e-6 * 60


def parse_workloads(text: str) -> list[Workload]:
    """``"a,c,request"`` -> the workloads, in the given order, each once. Items: a built-in's
    key or name (case-insensitive), ``all``, or a custom ``BATCHESxSIZE[@ITERS]``. Raises
    `BenchConfigError` (a ``ValueError``) naming the item."""
    out: list[Workload] = []
    seen = set()
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise BenchConfigError("--workloads is empty; give keys like a,b,c,d,e (or all)")
    for item in items:
        for w in _parse_item(item):
            if w.name not in seen:
                seen.add(w.name)
                out.append(w)
    return out


def _parse_item(item: str) -> list[Workload]:
    low = item.lower()
    if low == "all":
        return list(BUILTIN)
    for w in BUILTIN:
        if low in (w.key, w.name.lower()):
            return [w]
    m = _CUSTOM.match(low)
    if m is None:
        valid = ", ".join(f"{w.key}/{w.name}" for w in BUILTIN)
        raise BenchConfigError(f"unknown workload {item!r}; use one of {valid}, all, or "
                            "BATCHESxSIZE[@ITERS] with SIZE in KiB or MiB (e.g. 64x1MiB, "
                            "512x256KiB@1)")
    batches, size, unit, iters = m.groups()
    nbytes = int(float(size) * (MIB if unit.startswith("m") else KIB))
    nbytes = nbytes // 16 * 16
    if int(batches) < 1 or nbytes < 16:
        raise BenchConfigError(f"workload {item!r}: need at least 1 batch of at least 16 bytes")
    it = None if iters in (None, "auto") else int(iters)
    if it is not None and it < 1:
        raise BenchConfigError(f"workload {item!r}: ITERS must be >= 1 or auto")
    name = f"{int(batches)}x{format_size(nbytes).replace(' ', '')}" + (
        f"@{it}" if it is not None else "")
    return [Workload(name, name, "pipeline", nbytes, int(batches), it)]


__all__ = ["BUILTIN", "DEFAULT", "Workload", "expected_seconds",
           "format_size", "parse_workloads"]

"""What the benchmark scripts share (imported from their own folder)."""

from __future__ import annotations


def parse_workloads(text: str) -> list[tuple[int, float]]:
    """``"32x64,256x4"`` -> ``[(32, 64.0), (256, 4.0)]``: batches x MiB per batch."""
    out = []
    for item in text.split(","):
        n, mib = item.lower().split("x")
        out.append((int(n), float(mib)))
    return out

"""The crossover arithmetic of benchmarks/probe_graph_launch.py (no GPU): from which copy size
memcpy nodes are no dearer than the best copy kernel, per direction and metric."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_graph_launch.py"
spec = importlib.util.spec_from_file_location("probe_graph_launch", PATH)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)

K, M = 1 << 10, 1 << 20


def test_crossover_is_where_memcpy_wins_from_then_on():
    sizes = [4 * K, 64 * K, M, 16 * M]
    mem = {4 * K: 2.0, 64 * K: 3.0, M: 20.0, 16 * M: 300.0}
    ker = {4 * K: 0.5, 64 * K: 1.0, M: 25.0, 16 * M: 400.0}
    assert probe.crossover(sizes, mem, ker) == M
    # memcpy wins at a small size, loses in between: the crossover is above that
    mem2 = {**mem, 4 * K: 0.1}
    assert probe.crossover(sizes, mem2, ker) == M
    assert probe.crossover(sizes, {s: 1.0 for s in sizes}, {s: 0.5 for s in sizes}) is None
    assert probe.crossover(sizes, {s: 0.5 for s in sizes}, {s: 1.0 for s in sizes}) == 4 * K
    # a size missing on one side is skipped
    assert probe.crossover(sizes, {M: 1.0, 16 * M: 1.0}, ker) == M


def _row(kind, direction, size, gpu, host=0.0, **kw):
    return {"kind": kind, "direction": direction, "size": size, "gpu_us_per_node": gpu,
            "host_us_per_node": host, "cost_us_per_node": max(gpu, host), **kw}


def test_crossovers_take_the_best_addressing_and_grid_and_skip_wrong_rows():
    rows = [
        _row("memcpy", "h2d", 4 * K, 2.0, host=1.6, addressing="host"),
        _row("memcpy", "h2d", 4 * K, 1.9, host=1.5, addressing="unified"),
        _row("copy-kernel", "h2d", 4 * K, 0.8, grid=4),
        _row("copy-kernel", "h2d", 4 * K, 0.6, grid=16),
        _row("memcpy", "h2d", 16 * M, 300.0, host=1.6, addressing="host"),
        _row("copy-kernel", "h2d", 16 * M, 330.0, grid=132),
        _row("copy-kernel", "h2d", 16 * M, 100.0, grid=264, ok=False),  # a wrong copy
        _row("memcpy", "d2h", 4 * K, 0.5, host=1.6, addressing="host"),
        _row("copy-kernel", "d2h", 4 * K, 0.7, grid=4),
        _row("empty-kernel chain", None, 0, 1.0),
    ]
    c = probe.crossovers(rows)
    assert c["h2d"]["by_gpu"] == 16 * M and c["h2d"]["by_cost"] == 16 * M
    assert c["h2d"]["best_grid"] == {str(4 * K): 16, str(16 * M): 132}
    # D2H: memcpy is faster on the GPU at 4 KiB but its host cost (1.6 us) is dearer
    assert c["d2h"]["by_gpu"] == 4 * K and c["d2h"]["by_cost"] is None
    assert "above 4 KiB" in probe.describe_crossover(None, [4 * K])
    assert "or below" in probe.describe_crossover(4 * K, [4 * K, M])


@pytest.mark.parametrize("size,k", [(4 * K, 64), (M, 64), (4 * M, 16), (64 * M, 4)])
def test_copies_per_graph_keep_the_probe_short(size, k):
    assert probe.copies_for(size) == k

"""docs/quickstart.md runs as written: its Python blocks, in order, are one program. Without a
GPU every block compiles and the first two (a task graph by hand, its plan) run for real; on a
GPU the whole page runs in a child process and checks its own results (each block asserts
against numpy)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_every_block_compiles():
    found = blocks()
    assert len(found) == 8  # sections 1-6, interop (7), serving (8)
    for i, block in enumerate(found, 1):
        compile(block, f"docs/quickstart.md block {i}", "exec")


def test_the_graph_and_plan_blocks_run_without_a_gpu(capsys):
    ns: dict = {}
    for block in blocks()[:2]:
        exec(compile(block, "docs/quickstart.md", "exec"), ns)
    graph, plan = ns["graph"], ns["plan"]
    assert len(graph) == 10 and len(plan.streams) == 3
    edges = graph.edges
    for edge in [("alloc_dx", "upload_x"), ("upload_x", "saxpy"), ("upload_y", "saxpy"),
                 ("alloc_dout", "saxpy"), ("saxpy", "download"), ("download", "free_dout"),
                 ("saxpy", "free_dx")]:
        assert edge in edges, edge
    assert plan.stream_of("saxpy") != plan.stream_of("upload_x")  # by engine
    assert plan.wait_count >= 2  # the kernel waits for both uploads' stream
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "[('alloc_dout', 'saxpy'), ('alloc_dx', 'upload_x'), ('alloc_dy', 'upload_y')]")


@pytest.mark.gpu
def test_the_whole_quickstart_runs_on_the_gpu():
    proc = subprocess.run([sys.executable, "-c", "\n".join(blocks())], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for executor in ("capture", "graph-build"):  # each ran, verified, and said how many nodes
        assert any(line.startswith(f"{executor}: ") and line.endswith(" CUDA graph nodes")
                   for line in lines), proc.stdout
    assert "cache: 2 hits, 2 misses" in proc.stdout, proc.stdout

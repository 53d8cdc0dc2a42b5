"""`GraphBuilder` graphs on a real GPU (skipped without one): the graph allocations it inserts
are allocated and freed by every executor (pool and graph memory back where they were), outputs
bit-exact against numpy, and the builder example runs as written."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestra.app.job import burn_kernel_ref
from orchestra.driver import PinnedBuffer
from orchestra.execute import CaptureExecutor, EagerExecutor, GraphBuildExecutor, graph_memory
from orchestra.graph import GraphBuilder, Out

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
ITERS = 5


def burn_ref(x, iters=ITERS):
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


def builder_graph(n: int, batches: int, dev):
    """Per batch: x slice up (graph-allocated), NaN poison of a graph-allocated output, burn,
    down into the y slice. No names, no Alloc / Free written."""
    nbytes = 4 * n
    grid = max(1, min(-(-n // 256), 4 * dev.sm_count))
    with GraphBuilder() as g:
        x = g.host_input("x", batches * nbytes)
        y = g.host_output("y", batches * nbytes)
        for b in range(batches):
            with g.batch(b):
                dx = g.to_device(x.range(b * nbytes, nbytes))
                dy = g.device_buffer(nbytes)
                g.memset(dy, 0x7FC00000, 4)  # NaN: an output the kernel misses shows
                g.kernel(burn_kernel_ref(), grid, 256, (dx, Out(dy), n, ITERS, 0.5, 1.0))
                g.to_host(dy, y.range(b * nbytes, nbytes))
    return g.graph


@pytest.fixture
def arrays(dev):
    n, batches = 100_003, 4  # not a multiple of the block
    pin_x = PinnedBuffer.empty(n * batches, np.float32, dev)
    pin_y = PinnedBuffer.empty(n * batches, np.float32, dev)
    pin_x.array[:] = (np.random.default_rng(3).standard_normal(n * batches) * 50).astype(np.float32)
    yield n, batches, pin_x.array, pin_y.array
    pin_x.close()
    pin_y.close()


def test_builder_graph_on_every_executor(dev, pool, arrays):
    n, batches, x, y = arrays
    graph = builder_graph(n, batches, dev)
    assert sum(node.kind == "alloc" for node in graph.nodes) == 2 * batches
    expect = burn_ref(x).tobytes()
    bindings = {"x": x, "y": y}
    used = pool.used_bytes
    with EagerExecutor(dev) as ex:
        for policy, streams in (("by-engine", 3), ("round-robin", 2), ("critical-path", 4)):
            y[:] = np.nan
            ex.run(graph, None, bindings, policy=policy, streams=streams)
            assert y.tobytes() == expect, (policy, streams)
            assert pool.used_bytes == used  # every graph allocation freed
    for cls in (CaptureExecutor, GraphBuildExecutor):
        with cls(dev) as gx:
            y[:] = np.nan
            exe = gx.run(graph, None, bindings)
            try:
                assert y.tobytes() == expect, cls.__name__
                before = graph_memory(dev).used
                for _ in range(20):
                    y[:] = np.nan
                    exe.replay()
                    assert y.tobytes() == expect, cls.__name__
                assert graph_memory(dev).used == before  # freed inside the graph each launch
            finally:
                exe.close()
        assert pool.used_bytes == used


def test_the_builder_example_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "build_graph.py"), "--n",
                           "300007", "--batches", "3"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("eager run, CUDA graph launch and replay match numpy")


def test_building_md_runs_on_the_gpu():
    import re

    text = (ROOT / "docs" / "building.md").read_text(encoding="utf-8")
    blocks = [code for lang, code in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
              if lang == "python" and not code.startswith("# signatures")]
    assert any(code.startswith("# needs a GPU") for code in blocks)
    proc = subprocess.run([sys.executable, "-c", "\n".join(blocks)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the GPU block asserts its output
    assert "run    kernel:saxpy#0" in proc.stdout

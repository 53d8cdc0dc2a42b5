"""Copy kernels on a real GPU (skipped without one). Whatever launches a copy kernel runs in a
child process, so a wrong address (a sticky CUDA error) cannot spoil the other tests:

- the device's kernels address pinned memory at its host pointer (`Device.kernel_host_access`,
  ``cuMemHostGetDevicePointer`` == the host pointer for a `PinnedBuffer` and a registered array);
- ``copy_lowering="auto"`` builds kernel nodes for small copies and memcpy nodes for large ones
  (``cuGraphNodeGetType``), and the outputs are right;
- ``orchestra tune copies --quick`` measures, verifies and prints a crossover (not saved).

The copy kernel itself (sizes, offsets, alignments, guard bytes) and the executors with and
without the lowering (bit-identical outputs, replays with rebound arrays) are the
``copy_kernel`` and ``copy_lowering`` checks of tests/kernel_checks.py, which
tests/test_kernels_gpu.py runs one process each and tests/run_sanitizers.sh runs under
compute-sanitizer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_kernels_address_pinned_memory_at_its_host_pointer(dev):
    from cuda.bindings import driver as d

    from orchestra.driver import PinnedBuffer, register_host

    assert dev.kernel_host_access  # unified addressing and host pointers for registered memory
    pin = PinnedBuffer(1 << 16, dev)
    raw = np.zeros((1 << 16) + 8192, np.uint8)
    arr = raw[(-raw.ctypes.data) % 4096:][:1 << 16]
    try:
        with register_host(arr, dev) as reg:
            for ptr in (pin.ptr, reg.ptr):
                err, mapped = d.cuMemHostGetDevicePointer(ptr, 0)
                assert int(err) == 0 and int(mapped) == ptr
    finally:
        pin.close()


_AUTO = r"""
import numpy as np
from cuda.bindings import driver as d
from orchestra.app.job.graphs import burn_kernel_ref
from orchestra.driver import Device, PinnedBuffer
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.graph import build_pipeline, HostBuffer

dev = Device.get(0)
sizes = [4096, 64 << 10, 1 << 20]  # kernels, kernels, memcpy nodes by the default crossover
total = sum(sizes)
g, _ = build_pipeline(3, sizes, burn_kernel_ref(), scalars=(1, 0.5, 1.0),
                      host_in=HostBuffer("x", total), host_out=HostBuffer("y", total))
x = PinnedBuffer.empty(total // 4, np.float32, dev)
y = PinnedBuffer.empty(total // 4, np.float32, dev)
x.array[:] = np.random.default_rng(0).standard_normal(total // 4).astype(np.float32)
y.array[:] = np.nan
with GraphBuildExecutor(dev) as ex:
    exe = ex.build(g, bindings={"x": x.array, "y": y.array})
    kinds = {}
    for name, gnode in exe.nodes.items():
        err, t = d.cuGraphNodeGetType(gnode)
        assert int(err) == 0
        kinds[name] = t.name
    exe.launch(sync=True)
    copies = exe.copy_kernels
    exe.close()
want = x.array * np.float32(0.5) + np.float32(1)
assert np.array_equal(y.array, want), "wrong output"
K, M = "CU_GRAPH_NODE_TYPE_KERNEL", "CU_GRAPH_NODE_TYPE_MEMCPY"
assert kinds["b0.h2d"] == kinds["b0.d2h"] == kinds["b1.h2d"] == kinds["b1.d2h"] == K, kinds
assert kinds["b2.h2d"] == kinds["b2.d2h"] == M, kinds
assert copies == 4, copies
print("OK", copies)
"""


def test_auto_lowering_builds_kernel_nodes_for_small_copies_in_a_child():
    proc = _child(_AUTO)
    assert proc.returncode == 0 and "OK 4" in proc.stdout, proc.stdout + proc.stderr


def test_tune_copies_quick_in_a_child():
    proc = subprocess.run([sys.executable, "-m", "orchestra.cli.main", "tune", "copies",
                           "--quick", "--no-save", "--mode", "graph", "--repeats", "3",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["verified"] and rep["saved"] is None
    assert [r["size"] for r in rep["rows"]] == [4096, 65536, 1 << 20]
    assert all(set(r["ms"]) == {"copy-engine", "h2d-kernel", "d2h-kernel",
                                   "both-kernel"} for r in rep["rows"])
    c = rep["crossover"]
    assert c["graph_h2d"] >= 0 and c["graph_d2h"] >= 0
    print("tune copies --quick (graph):", {k: c[k] for k in ("graph_h2d", "graph_d2h")},
          f"{rep['seconds']:.1f} s")

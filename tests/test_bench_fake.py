"""The CPU benchmarks of orchestra's own host cost (fake driver, stubbed driver calls) run
and print every row with a number: they reach into the exec and the kernel, so a refactor that
breaks them shows here (their numbers are for the benchmark, not for tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("lowering", ["kernel", "copy-engine"])
def test_bench_replay_fake_prints_every_row(lowering):
    proc = subprocess.run([sys.executable, "benchmarks/bench_replay_fake.py", "--replays", "50",
                           "--repeat", "1", "--copy-lowering", lowering], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for kind in ("capture", "graph-build"):
        for what in ("launch only", "same bindings", "2 rebound I/O nodes, back to back",
                     "2 rebound I/O nodes, drained", "1 external buffer re-pointed"):
            assert re.search(rf"{kind}\s+{re.escape(what)}\s+\d+\.\d\d", out), (kind, what, out)
    assert re.search(r"bare\s+2 rebound \+ launch, timed alone\s+\d+\.\d\d", out), out
    assert ("copy kernels" if lowering == "kernel" else "memcpy nodes") in out.splitlines()[0]


def test_bench_launch_host_prints_every_row():
    proc = subprocess.run([sys.executable, "benchmarks/bench_launch_host.py", "--launches", "50",
                           "--repeats", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for label in ("bare cuLaunchKernel call, prepacked", "Kernel.launch, PackedArgs",
                  "Kernel.launch, the same tuple of ints", "one DLPack argument"):
        assert re.search(rf"{re.escape(label)}\s+\d+\s+-?\d+", proc.stdout), (label, proc.stdout)

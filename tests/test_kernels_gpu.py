"""GPU tests of the kernel library: every check of tests/kernel_checks.py (each kernel against
numpy on random data with ragged sizes, all four stage counts, the PDL pair and chain, case C12,
the cluster kernels, the PTX kernel), each in its own subprocess with a timeout so that a kernel
that hangs fails its test instead of hanging the suite. Plus short runs of both benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_checks

pytestmark = pytest.mark.gpu

RUNNER = Path(__file__).with_name("kernel_checks.py")
TIMEOUT_S = int(os.environ.get("ORCHESTRA_KERNEL_CHECK_TIMEOUT", "300"))


def _run(argv: list[str], timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # the child was killed: its kernel hung
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"{' '.join(argv[1:])} did not finish within {timeout} s (a hung kernel?)"
                    f"\n{out or ''}")


@pytest.mark.parametrize("name", list(kernel_checks.CHECKS))
def test_kernel_against_numpy(name):
    proc = _run([sys.executable, str(RUNNER), name])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"PASS {name}" in proc.stdout or f"SKIP {name}" in proc.stdout


def test_bench_stages_small_run():
    proc = _run([sys.executable, "-m", "orchestra.cli.main", "bench", "stages", "--mib", "64",
                 "--repeats", "3", "--warmup", "1", "--json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["verified"] and [r["stages"] for r in rep["results"]] == [1, 2, 3, 4]
    assert all(r["blocks_per_sm"] >= 1 and r["gbps"] > 0 for r in rep["results"])


def test_bench_pdl_short_chain():
    proc = _run([sys.executable, "-m", "orchestra.cli.main", "bench", "pdl", "--kernels", "200",
                 "--repeats", "2", "--json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["verified"]
    assert {r["pdl"] for r in rep["results"]} == {False, True}

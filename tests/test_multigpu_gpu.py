"""Multi-GPU checks on real GPUs. Each body runs in a child interpreter
(tests/multigpu_checks.py, or the example and the launcher as programs) with
``NCCL_NVLS_ENABLE=0``, so an NCCL fault or hang cannot take the test process down.

One GPU: a one-rank communicator (every collective of one rank is the identity, eager,
captured and built), a peer copy within one device, the refusal of a peer copy to a device that
does not exist, the data-parallel example with one rank in both process models.
Two GPUs (skipped with a reason on fewer): peer copies both ways, every collective against
numpy, the captured step over two threads and over two processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
CHECKS = str(Path(__file__).with_name("multigpu_checks.py"))
EXAMPLE = str(ROOT / "examples" / "data_parallel_step.py")
HAVE_NCCL4PY = importlib.util.find_spec("nccl") is not None
NEEDS_NCCL = pytest.mark.skipif(not HAVE_NCCL4PY, reason="nccl4py not installed (pip install "
                                "'orchestra[nccl]')")


def _devices() -> int:
    from orchestra.driver.device import device_count

    return device_count()


def two_gpus():
    if _devices() < 2:
        pytest.skip(f"needs two GPUs ({_devices()} visible)")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["NCCL_NVLS_ENABLE"] = "0"
    return env


def _run(args, timeout=120):
    r = subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def check(name, timeout=120):
    out = _run([CHECKS, name], timeout)
    assert f"OK {name}" in out, out


@NEEDS_NCCL
def test_a_one_rank_communicator_runs_every_collective_as_the_identity():
    check("one_rank_collectives")


def test_a_peer_copy_within_one_device_is_a_device_to_device_copy():
    check("peer_copy_one_device")


def test_a_peer_copy_to_a_missing_device_is_refused_naming_the_pair():
    if _devices() != 1:
        pytest.skip("for one-GPU machines (device 1 exists here)")
    check("peer_copy_refused_one_gpu")


@NEEDS_NCCL
def test_the_data_parallel_example_with_one_rank_in_one_process():
    out = _run([EXAMPLE, "--ranks", "1", "--steps", "5", "--eager", "2"])
    assert "rank 0 (device 0)" in out and out.rstrip().endswith(": ok"), out


@NEEDS_NCCL
def test_the_data_parallel_example_with_one_rank_under_the_launcher():
    out = _run(["-m", "orchestra.launch", "--nproc", "1", EXAMPLE, "--steps", "5", "--eager",
                "2"])
    assert "[rank 0] rank 0 (device 0)" in out and ": ok" in out, out


# -- two GPUs ---------------------------------------------------------------------------------


def test_peer_copies_between_two_gpus():
    two_gpus()
    check("peer_copies_two")


@NEEDS_NCCL
def test_every_collective_over_two_gpus_matches_numpy():
    two_gpus()
    check("collectives_two", timeout=300)


@NEEDS_NCCL
def test_the_captured_step_over_two_gpus_in_one_process():
    two_gpus()
    out = _run([EXAMPLE, "--ranks", "2", "--steps", "10", "--eager", "3"], timeout=300)
    assert out.count(": ok") == 2, out


@NEEDS_NCCL
@pytest.mark.parametrize("store", ["tcp", "file"])
def test_the_captured_step_over_two_gpus_one_process_each(store):
    two_gpus()
    out = _run(["-m", "orchestra.launch", "--nproc", "2", "--store", store, EXAMPLE,
                "--steps", "10", "--eager", "3"], timeout=300)
    assert "[rank 0] rank 0 (device 0)" in out and "[rank 1] rank 1 (device 1)" in out, out
    assert out.count(": ok") == 2, out

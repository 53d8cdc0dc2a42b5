"""The command lines of benchmarks/probe_serve_ceiling.py (CPU) and
benchmarks/probe_pipeline_overlap.py (GPU): bad arguments are refused while parsing (exit 2,
one line naming the argument), a tiny ceiling run prints its rows, and the pipeline probe
without a GPU exits with one line."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from orchestra.driver.check import device_available

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("probe_serve_ceiling",
                                              BENCH / "probe_serve_ceiling.py")
ceiling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling)


@pytest.mark.parametrize("argv, says", [
    (["--batches", "3,2"], "each batch size must divide --threads (8); 3 does not"),
    (["--batches", "0"], "argument --batches: expected requests per batch >= 1"),
    (["--batches", "-2"], "argument --batches: expected requests per batch >= 1"),
    (["--batches", "8,x"], "argument --batches: expected requests per batch: comma-separated"),
    (["--batches", ""], "argument --batches"),
    (["--kib", "0"], "argument --kib: expected request sizes in KiB >= 1"),
    (["--kib", "-1"], "argument --kib"),
    (["--kib", "1.5"], "argument --kib"),
    (["--seconds", "nan"], "argument --seconds: expected a finite number of seconds > 0"),
    (["--seconds", "inf"], "argument --seconds"),
    (["--seconds", "0"], "argument --seconds"),
    (["--gpu-us", "1000000"], "--gpu-us from 0 to 999,999"),
    (["--gpu-us", "-1"], "--gpu-us from 0 to 999,999"),
    (["--threads", "0"], "--threads, --repeats >= 1"),
    (["--repeats", "0"], "--threads, --repeats >= 1"),
])
def test_ceiling_probe_refuses_bad_arguments_while_parsing(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        ceiling.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_ceiling_probe_runs_and_prints_a_row_per_size_batch_and_copy(capsys):
    assert ceiling.main(["--threads", "4", "--batches", "4,1", "--kib", "2,1", "--gpu-us",
                         "0", "--seconds", "0.05", "--repeats", "1"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (kib, b, how) for kib in ("2", "1") for b in ("4", "1")
        for how in ("numpy", "memmove+GIL")]
    assert all(float(r[3].replace(",", "")) > 0 for r in rows)


def test_ceiling_run_counts_requests_of_every_thread():
    rate, cpu_us = ceiling.run(threads=4, batch=2, gpu_us=0, seconds=0.05, kib=1, held=True)
    assert rate > 0 and cpu_us > 0


def _pipeline(*argv):
    return subprocess.run([sys.executable, str(BENCH / "probe_pipeline_overlap.py"), *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--iters", "3000000000"],
                                  ["--items", "1"], ["--mib", "0"], ["--mib", "-1"],
                                  ["--mib", "nan"], ["--mib", "inf"], ["--mib", "1e-9"],
                                  ["--iters", "x"]])
def test_pipeline_probe_refuses_bad_arguments_before_the_gpu(argv):
    r = _pipeline(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "probe_pipeline_overlap.py: error: " in r.stderr.splitlines()[-1]


def test_pipeline_probe_help():
    r = _pipeline("--help")
    assert r.returncode == 0 and "--iters" in r.stdout and "--mib" in r.stdout


@pytest.mark.skipif(device_available(), reason="a GPU is here: the probe would run")
def test_pipeline_probe_without_a_gpu_exits_with_one_line():
    r = _pipeline("--items", "2", "--mib", "0.0625")
    assert r.returncode == 1 and not r.stdout
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("probe_pipeline_overlap: ") and "Traceback" not in r.stderr

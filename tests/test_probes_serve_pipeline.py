"""The command lines of benchmarks/probe_serve_ceiling.py (CPU) and
benchmarks/probe_pipeline_overlap.py (GPU): bad arguments are refused while parsing (exit 2,
one line naming the argument), a tiny ceiling run prints its rows, the windowed ceiling run
hands every request its own output (a corrupted one fails the run), and the pipeline probe
without a GPU exits with one line."""

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestra.driver.check import device_available

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("probe_serve_ceiling",
                                              BENCH / "probe_serve_ceiling.py")
assert spec is not None and spec.loader is not None
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
    (["--window", "0"], "argument --window: expected requests in flight per thread >= 1"),
    (["--window", "4,-1"], "argument --window: expected requests in flight per thread >= 1"),
    (["--window", "x"], "argument --window: expected requests in flight per thread: "
                        "comma-separated"),
    (["--window", ""], "argument --window"),
    (["--delay-us", "-1"], "argument --delay-us: expected µs from 0 to 1,000,000"),
    (["--delay-us", "nan"], "argument --delay-us: expected µs from 0 to 1,000,000"),
    (["--delay-us", "inf"], "argument --delay-us"),
    (["--delay-us", "2e6"], "argument --delay-us"),
    (["--delay-us", "x"], "argument --delay-us"),
    # window 1 rows still need batches that divide the threads, beside windowed ones
    (["--window", "1,32", "--batches", "32,3"],
     "each batch size must divide --threads (8); 3 does not"),
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


def _rows(out):
    return [ln.split() for ln in out.splitlines()[2:]]


def test_ceiling_probe_windowed_table_has_a_window_column(capsys):
    # batches 4,2 with 2 threads: window 1 runs 2 (no batch holds more than one request per
    # thread) once; window 4 takes up to 4 and 2, which need not divide the threads
    assert ceiling.main(["--threads", "2", "--window", "1,4", "--batches", "4,2", "--kib", "1",
                         "--gpu-us", "0", "--seconds", "0.05", "--repeats", "2",
                         "--delay-us", "50"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["KiB", "window", "batch", "copies", "req/s", "cpu",
                                           "us/req"]
    rows = _rows(out)
    assert [tuple(r[:4]) for r in rows] == [
        ("1", "1", "2", "numpy"), ("1", "1", "2", "memmove+GIL"),
        ("1", "4", "4", "numpy"), ("1", "4", "2", "numpy")]
    assert all(float(r[4].replace(",", "")) > 0 and float(r[5]) > 0 for r in rows)


def _recording(sizes, rows_seen, threads):
    """A tamper hook that changes nothing: it records each batch's size and checks each row
    is one thread's input times 2 (numpy reference)."""
    refs = {(2.0 * (i + 1)): i for i in range(threads)}

    def look(block):
        sizes.append(block.shape[0])
        for row in block:
            assert row.dtype == np.float32 and row.shape == (256,)
            np.testing.assert_array_equal(row, np.full(256, row[0], np.float32))
            assert float(row[0]) in refs
            rows_seen.add(refs[float(row[0])])
    return look


def test_windowed_run_hands_every_request_its_own_output_in_batches_up_to_b():
    sizes, seen = [], set()
    r = ceiling.run_windowed(threads=2, window=4, batch=4, gpu_us=0, seconds=0.2, kib=1,
                             delay_us=200.0, tamper=_recording(sizes, seen, 2))
    assert r.requests > 0 and r.wrong == 0 and r.first_wrong == ""
    assert r.rate > 0 and r.cpu_us > 0
    # every request that was batched was compared by its thread: none lost in the drain, and
    # the ones counted were measured before the end
    assert r.checked == sum(sizes) and r.requests <= r.checked <= r.requests + 2 * 4 + 2
    assert max(sizes) <= 4 and min(sizes) >= 1 and seen == {0, 1}


def test_windowed_batches_wait_their_delay_for_requests_that_never_come():
    # 1 thread x 2 in flight never fills a batch of 4: each batch holds at most 2 and goes
    # 2 ms after its first request was queued (queued after the previous batch's outputs), so
    # at most 2 requests per 2 ms
    sizes, seen = [], set()
    r = ceiling.run_windowed(threads=1, window=2, batch=4, gpu_us=0, seconds=0.2, kib=1,
                             delay_us=2000.0, tamper=_recording(sizes, seen, 1))
    assert r.wrong == 0 and r.requests > 0
    assert max(sizes) <= 2 and r.rate <= 2 * (0.2 / 0.002 + 1) / 0.2 * 1.05


def _corrupt_last_byte(nth):
    calls = [0]

    def corrupt(block):
        calls[0] += 1
        if calls[0] == nth:  # the very last byte: a check of the first element would miss it
            block.view(np.uint8)[-1, -1] ^= 0x01
    return corrupt


def test_windowed_run_detects_a_corrupted_output():
    r = ceiling.run_windowed(threads=2, window=4, batch=4, gpu_us=0, seconds=0.2, kib=1,
                             delay_us=200.0, tamper=_corrupt_last_byte(3))
    assert r.wrong == 1, r
    assert "byte 1,023 of 1,024" in r.first_wrong and "at index 255" in r.first_wrong


def test_ceiling_probe_fails_with_one_line_on_a_wrong_output(capsys, monkeypatch):
    monkeypatch.setattr(ceiling, "run_windowed",
                        functools.partial(ceiling.run_windowed, tamper=_corrupt_last_byte(5)))
    assert ceiling.main(["--threads", "2", "--window", "4", "--batches", "4", "--kib", "1",
                         "--gpu-us", "0", "--seconds", "0.2", "--repeats", "1"]) == 1
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err
    assert lines[0].startswith("probe_serve_ceiling: wrong output (window 4, batch 4, 1 KiB): "
                               "1 of ")
    assert "byte 1,023 of 1,024" in lines[0]
    assert len(_rows(cap.out)) == 0  # no row for the failed run


def test_windowed_run_whose_batcher_fails_stops_every_thread():
    def fail(block):
        raise ValueError("boom")
    with pytest.raises(ceiling.ProbeFailed, match="the batcher thread failed: ValueError"):
        ceiling.run_windowed(threads=3, window=4, batch=2, gpu_us=0, seconds=0.1, kib=1,
                             delay_us=0.0, tamper=fail)


def test_ceiling_probe_fails_with_one_line_when_the_batcher_fails(capsys, monkeypatch):
    def fail(block):
        raise ValueError("boom")
    monkeypatch.setattr(ceiling, "run_windowed",
                        functools.partial(ceiling.run_windowed, tamper=fail))
    assert ceiling.main(["--threads", "3", "--window", "4", "--batches", "2", "--kib", "1",
                         "--gpu-us", "0", "--seconds", "5", "--repeats", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["probe_serve_ceiling: window 4, batch 2, 1 KiB: the batcher thread failed: "
                   "ValueError('boom')"]


def test_ceiling_probe_runs_a_batch_above_the_threads_as_the_threads(capsys):
    # one request in flight per thread: no batch can hold more than one request of each
    assert ceiling.main(["--threads", "2", "--batches", "4,2", "--kib", "1", "--gpu-us", "0",
                         "--seconds", "0.05", "--repeats", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [tuple(r[:3]) for r in rows] == [("1", "2", "numpy"), ("1", "2", "memmove+GIL")]


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

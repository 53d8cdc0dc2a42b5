"""`orchestra bench serve --processes K` on the CPU: the threads split over worker processes,
each with its own engine, windows started together and the figures merged; the arithmetic of
the merge on made-up figures; the CLI's refusals; a start that fails joins every thread."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from orchestra.errors import BenchConfigError
from orchestra.serve.bench import (
    BenchOptions,
    _engine_variants,
    EngineConfig,
    Workload,
    closed_loop,
    cpu_backend_factory,
    run,
)
from orchestra.serve import bench_processes
from orchestra.serve.bench_processes import merge, split_threads


def test_threads_spread_over_the_processes_as_evenly_as_they_go():
    assert split_threads(8, 1) == [8]
    assert split_threads(8, 2) == [4, 4]
    assert split_threads(8, 3) == [3, 3, 2]
    assert split_threads(5, 5) == [1, 1, 1, 1, 1]
    with pytest.raises(BenchConfigError, match="--processes 3 needs at least as many --threads"):
        split_threads(2, 3)


BASE = "engine, dynamic batching, 2 inst/bucket"


def _answer(requests, window, lat, fill=1.0):
    return {"requests": requests, "wrong": 0, "errors": 0, "note": "",
            "batch_fill": fill, "window": window,
            "latency": np.asarray(lat, dtype=np.float64).tobytes(), "extra": {"warmup_ms": 3.0}}


def test_the_merge_sums_requests_over_the_span_of_every_window():
    # two processes whose windows overlap for 1.5 of their 2 s: the span is 2.5 s, so the
    # total is 3,000 requests / 2.5 s, below the 1,000 + 2,000 req/s the windows saw alone
    a = _answer(2000, (10.0, 12.0), [100.0] * 10, fill=1.0)
    b = _answer(4000, (10.5, 12.5), [300.0] * 30, fill=0.5)
    r = merge([a, b], [4, 4], BASE)
    assert r.name == "engine, dynamic batching, 2 inst/bucket, 2 processes x 4 threads"
    assert r.requests == 6000 and r.seconds == pytest.approx(2.5)
    assert r.rps == pytest.approx(2400.0)
    assert r.extra["per_process_req_per_s"] == pytest.approx([1000.0, 2000.0])
    assert r.extra["start_spread_ms"] == pytest.approx(500.0)
    assert len(r.latency_us) == 40 and r.pct()["p50"] == pytest.approx(300.0)
    assert r.batch_fill == pytest.approx((2000 * 1.0 + 4000 * 0.5) / 6000)
    assert r.errors == 0 and r.extra["warmup_ms"] == 3.0


def test_a_worker_that_failed_fails_the_row_naming_the_worker_how_it_ended_and_why():
    a = _answer(100, (1.0, 2.0), [5.0])
    r = merge([a, {"error": "CudaError: out of memory", "exit": "exit code 1"}], [2, 1], BASE)
    assert r.requests == 100 and r.errors == 1  # the survivors' figures, the sums unchanged
    assert r.failed == "worker 1 of 2 (exit code 1): CudaError: out of memory"
    assert r.failed in r.note and r.as_dict()["failed"] == r.failed
    assert r.name == BASE + ", 2 processes x 2/1 threads"
    # every worker failed: the row keeps its real name, and the one that failed first (not
    # those its failure stopped) is the row's failure
    empty = merge([{"error": "another worker failed before the start; see its error",
                    "secondary": True, "exit": "exit code 1"},
                   {"error": "ended without handing back a result",
                    "exit": "killed by signal SIGKILL"}], [1, 1], "cuda-python (stream per thread)")
    assert empty.requests == 0 and empty.rps == 0.0 and empty.errors == 2
    assert empty.name == "cuda-python (stream per thread), 2 processes x 1 threads"
    assert empty.failed == ("worker 1 of 2 (killed by signal SIGKILL): ended without handing "
                            "back a result")
    assert len(empty.extra["worker_errors"]) == 2
    assert merge([a, a], [1, 1], BASE).failed is None


def test_how_a_worker_ended_in_words():
    from types import SimpleNamespace as P

    assert bench_processes.ended(P(exitcode=None)) == "still running"
    assert bench_processes.ended(P(exitcode=3)) == "exit code 3"
    assert bench_processes.ended(P(exitcode=-9)) == "killed by signal SIGKILL"
    assert bench_processes.ended(P(exitcode=-15)) == "killed by signal SIGTERM"


def test_the_row_is_named_from_the_configuration_instances_per_process():
    # without batching every thread holds an instance: 3 threads over 2 processes are 2 and
    # 1, and so are their instances per bucket (worker 0's alone said 2)
    o = BenchOptions(mode="closed", threads=3, processes=2, batching="off", dispatch="caller",
                     engine=EngineConfig(instances=1))
    (variant,) = _engine_variants(o)
    name = bench_processes.contender_name(o, ("engine", variant), [2, 1])
    assert name == "engine, caller thread launches, 2/1 inst/bucket"
    o.engine.instances = 4
    assert bench_processes.contender_name(o, ("engine", variant), [2, 1]) == \
        "engine, caller thread launches, 4 inst/bucket"
    assert bench_processes.contender_name(o, ("peer", "torch"), [2, 1]) == \
        "PyTorch CUDA graph (per thread)"


def test_two_worker_processes_serve_together_every_output_checked():
    o = BenchOptions(mode="closed", mix="16K", threads=3, window=4, duration=0.5,
                     batching="on", dispatch="caller", processes=2,
                     engine=EngineConfig(backend_factory=cpu_backend_factory))
    results, notes, _ = run(o)
    (r,) = results
    assert r.name == "engine, dynamic batching, 2 inst/bucket, 2 processes x 2/1 threads"
    assert r.errors == 0 and r.wrong == 0 and r.requests > 0, r.note
    assert len(r.latency_us) == r.requests
    assert r.extra["processes"] == 2 and r.extra["threads_per_process"] == [2, 1]
    # the span covers every window: the total cannot exceed what the processes saw alone
    assert r.seconds >= 0.5
    assert r.rps <= sum(r.extra["per_process_req_per_s"]) * (1 + 1e-9)
    assert all(v > 0 for v in r.extra["per_process_req_per_s"])
    assert any("2 processes (2/1 threads)" in n for n in notes)


def test_plot_without_matplotlib_names_the_option_and_the_extra(monkeypatch, tmp_path, capsys):
    import importlib.util

    from orchestra.cli.main import main as cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli(["bench", "serve", "--cpu", "--plot", str(tmp_path / "cdf.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "orchestra[plot]" in err
    assert "plot_gantt" not in err


def test_cli_refuses_processes_where_they_do_not_apply(capsys):
    from orchestra.cli.main import main as cli

    assert cli(["bench", "serve", "--cpu", "--mode", "asyncio", "--processes", "2"]) == 2
    assert "--processes applies to the closed loop" in capsys.readouterr().err
    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--processes", "2",
                "--process"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--processes", "4",
                "--threads", "2"]) == 2
    assert "--processes 4 needs at least as many --threads (got 2)" in capsys.readouterr().err
    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--processes", "0"]) == 2
    assert "--processes must be >= 1" in capsys.readouterr().err


def test_cli_json_carries_the_merged_row(capsys):
    from orchestra.cli.main import main as cli

    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--duration", "0.3",
                "--threads", "2", "--processes", "2", "--mix", "16K", "--batching", "off",
                "--dispatch", "caller", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    (r,) = rep["results"]
    assert rep["verified"] is True and r["wrong"] == 0 and r["errors"] == 0
    assert r["processes"] == 2 and r["requests"] > 0
    assert r["name"].endswith("2 processes x 1 threads")


def test_a_start_that_fails_joins_the_warmed_threads_and_raises():
    # the barrier shared with the other processes broke: no window is measured and no thread
    # is left waiting
    w = Workload("4K", pool=2)
    before = threading.active_count()

    def sync():
        raise threading.BrokenBarrierError

    with pytest.raises(threading.BrokenBarrierError):
        closed_loop("echo", "closed", w, lambda: (lambda x: x), 3, 0.1, sync=sync)
    assert threading.active_count() == before


def _options(**kw):
    kw = {"mode": "closed", "mix": "16K", "threads": 2, "duration": 0.3, "batching": "on",
          "dispatch": "caller", "processes": 2,
          "engine": EngineConfig(backend_factory=cpu_backend_factory), **kw}
    return BenchOptions(**kw)


def test_a_worker_that_dies_before_the_start_is_seen_at_once(monkeypatch):
    # worker 1 dies while worker 0 waits at the barrier: reading the pipes in order waited
    # for worker 0 until the barrier's 180 s ran out
    from tests import fake_bench_workers

    monkeypatch.setattr(bench_processes, "_worker", fake_bench_workers.dies_before_the_start)
    t0 = time.monotonic()
    (r,), _, _ = run(_options())
    assert time.monotonic() - t0 < 30
    assert r.requests == 0 and r.errors == 2
    assert r.name == "engine, dynamic batching, 2 inst/bucket, 2 processes x 1 threads"
    assert r.failed == "worker 1 of 2 (exit code 3): ended without handing back a result"
    assert r.extra["worker_errors"][0] == ("worker 0 of 2 (exit code 1): another worker failed "
                                           "before the start; see its error")


def test_a_worker_killed_in_its_window_fails_the_run(monkeypatch, capsys):
    # worker 1 is killed once the windows started; worker 0's figures alone were reported
    # as the row's, verified, exit status 0, with a goal line
    from orchestra.cli.main import main as cli
    from tests import fake_bench_workers

    monkeypatch.setattr(bench_processes, "_worker", fake_bench_workers.killed_in_its_window)
    argv = ["bench", "serve", "--cpu", "--mode", "closed", "--duration", "0.3", "--threads",
            "2", "--processes", "2", "--mix", "16K", "--batching", "on", "--dispatch",
            "caller"]
    assert cli([*argv, "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    (r,) = rep["results"]
    assert rep["verified"] is False
    assert r["failed"] == ("worker 1 of 2 (killed by signal SIGKILL): ended without handing "
                           "back a result")
    assert rep["goals"] == [f"closed: {r['name']}: failed, not judged ({r['failed']})"]
    assert cli(argv) == 1
    text = capsys.readouterr().out
    assert "goal >=" not in text and "failed, not judged" in text


ROOT = Path(__file__).resolve().parent.parent
CHILD = str(Path(__file__).with_name("bench_serve_child.py"))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie not reaped yet is gone as far as the test is concerned
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _signal_the_parent(tmp_path, sig):
    """Start the CLI with two workers that run on (`fake_bench_workers.runs_on`), send
    ``sig`` to the parent alone once both have started; (exit status, seconds from the
    signal to the exit, stderr, the workers' pids)."""
    env = dict(os.environ, ORCHESTRA_TEST_PIDS=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # SIGINT as a terminal delivers it: a shell's background job ignores it, and a child
    # would inherit that
    proc = subprocess.Popen(
        [sys.executable, CHILD, "runs_on", "bench", "serve", "--cpu", "--mode", "closed",
         "--processes", "2", "--threads", "2", "--duration", "60", "--batching", "on",
         "--dispatch", "caller"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / str(k)).exists() for k in range(2)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        pids = [int((tmp_path / str(k)).read_text()) for k in range(2)]
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, time.monotonic() - t0, err, pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _gone(pids):
    deadline = time.monotonic() + 2
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    live = [p for p in pids if _alive(p)]
    for p in live:  # leave nothing behind for the next test, then fail
        os.kill(p, signal.SIGKILL)
    return not live


def test_ctrl_c_to_the_parent_stops_every_worker_at_once(tmp_path):
    # it took a join(10) per worker, the barrier unbroken, and no word
    code, seconds, err, pids = _signal_the_parent(tmp_path, signal.SIGINT)
    assert _gone(pids)
    assert code == 130, err
    assert seconds < 5, seconds
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines() == [
        "orchestra bench serve: interrupted; every worker process was stopped, no results"]


def test_sigterm_to_the_parent_stops_every_worker(tmp_path):
    # SIGTERM ended the parent alone; its workers ran their windows out
    code, seconds, err, pids = _signal_the_parent(tmp_path, signal.SIGTERM)
    assert _gone(pids)
    assert code == 143, err
    assert seconds < 5, seconds
    assert err.strip().splitlines() == [
        "orchestra bench serve: stopped by SIGTERM; every worker process was stopped, no "
        "results"]


def test_the_sigterm_handler_is_put_back_and_set_only_in_the_main_thread():
    before = signal.getsignal(signal.SIGTERM)
    with bench_processes._sigterm_raises():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    seen = []

    def elsewhere():
        with bench_processes._sigterm_raises():
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert seen == [before]


def test_processes_beyond_the_cap_are_refused_at_once(capsys):
    # --processes 10**14 --threads 10**14 hung in the option check (split_threads built a
    # list of 10**14 counts) before anything ran
    from orchestra.cli.main import main as cli
    from orchestra.serve.bench_processes import MAX_PROCESSES

    from orchestra.serve.cli import MAX_THREADS

    n = str(10**14)
    t0 = time.monotonic()
    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--processes", n,
                "--threads", n]) == 2
    assert time.monotonic() - t0 < 10
    # --threads has a limit of its own now, checked first
    assert f"--threads must be at most {MAX_THREADS:,}" in capsys.readouterr().err
    t0 = time.monotonic()
    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--processes", n,
                "--threads", str(MAX_THREADS)]) == 2
    assert time.monotonic() - t0 < 10
    assert f"--processes must be at most {MAX_PROCESSES}" in capsys.readouterr().err
    with pytest.raises(BenchConfigError, match="at most"):
        split_threads(MAX_PROCESSES + 1, MAX_PROCESSES + 1)
    assert len(split_threads(MAX_PROCESSES, MAX_PROCESSES)) == MAX_PROCESSES

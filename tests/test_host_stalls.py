"""`HostStallProbe` sees the machine stop its process, and `lag_cause` puts a loop's wait
down to the machine only when a stall of that process covers it: real stops (SIGSTOP) of a
real measuring process, and samples of known windows against known stalls."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from orchestra.serve.host_stalls import HostStallProbe
from orchestra.serve.loop_lag import MACHINE_STALL, PROBE_WAIT, lag_cause, lag_causes, overlap_ms

linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="the probe reads /proc and is Linux only")

BUSY = "loop busy running callbacks"
GIL = "loop thread waiting for the GIL"
CPU = "loop thread waiting for a CPU (runnable, all CPUs busy)"


@linux
def test_a_stop_of_the_measuring_process_is_seen_as_a_stall_where_it_happened():
    probe = HostStallProbe().start()
    proc = probe._proc
    assert proc is not None, "the measuring process did not start"
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGSTOP)
    a = time.perf_counter()
    time.sleep(0.04)
    b = time.perf_counter()
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(0.05)
    seen = probe.stop()
    assert seen is not None and seen["chunks"] > 1000 and seen["seconds"] > 0.1
    assert 1 < seen["chunk_us"] < 1000
    # the stall spans the stop: it began before the SIGSTOP landed, ended after SIGCONT
    spans = [(s, e) for s, e in seen["stalls"] if s <= a + 0.005 and e >= b - 0.001]
    assert spans, (a, b, seen["stalls"][:20])
    s, e = spans[0]
    assert 0.035 <= e - s <= 1.0, (s, e)
    assert proc.poll() is not None  # the process has ended
    assert probe.stop() is None  # a second stop: nothing more


@linux
def test_a_probe_whose_process_died_returns_none_and_leaves_nothing_running():
    probe = HostStallProbe().start()
    proc = probe._proc
    assert proc is not None
    proc.kill()
    proc.wait()
    assert probe.stop() is None
    assert probe.stop() is None


def test_a_wait_is_the_machines_only_when_a_stall_covers_what_would_break_the_bound():
    # the window 0-1 s, the callback waited its last 3 ms (0.997-1.0), off its CPU, no
    # run-queue wait: a wait for the GIL unless the machine stalled through it
    waiting = (0.0, 1.0, 3.0, 1.0, 0.0)
    assert lag_cause(waiting, [], host_stalls=[(0.9975, 0.9995)]) == MACHINE_STALL  # 2 ms of 3
    assert lag_cause(waiting, [], host_stalls=[(0.998, 0.9988)]) == GIL  # 0.8 ms: 2.2 left
    assert lag_cause(waiting, [], host_stalls=[(0.5, 0.9)]) == GIL  # before the wait
    assert lag_cause(waiting, []) == GIL
    # two stalls add up; a stall of a sample within the bound changes nothing
    assert lag_cause(waiting, [], host_stalls=[(0.997, 0.998), (0.9985, 0.9995)]) == MACHINE_STALL
    assert lag_cause((0.0, 1.0, 0.9, 1.0, 0.0), [], host_stalls=[(0.0, 1.0)]) is None
    # the loop ran (busy), waited for a CPU, or collected: those stay what they were
    whole = [(0.0, 1.0)]
    assert lag_cause((0.0, 1.0, 3.0, 900.0, 0.0), [], host_stalls=whole) == BUSY
    assert lag_cause((0.0, 1.0, 3.0, 1.0, 2.5), [], host_stalls=whole) == CPU
    gc_pause = [(0.997, 0.9995, 0)]
    assert lag_cause(waiting, gc_pause, host_stalls=whole) == "garbage collector (generation 0)"
    # without the run-queue wait known, the machine's stall still explains a wait
    assert lag_cause((0.0, 1.0, 3.0, 1.0), [], host_stalls=whole) == MACHINE_STALL
    assert lag_cause((0.0, 1.0, 3.0, 1.0), []) == "loop thread waiting for the GIL or a CPU"
    # a busy loop and a probe thread that waited for a CPU: the probe's, when its wait is
    # what breaks the bound; the loop's when the lag stays over it without that wait
    assert lag_cause((0.0, 1.0, 3.0, 900.0, 0.0, 2.5), []) == PROBE_WAIT
    assert lag_cause((0.0, 1.0, 3.0, 900.0, 0.0, 1.0), []) == BUSY
    assert lag_cause((0.0, 1.0, 3.0, 900.0, 0.0, None), []) == BUSY
    assert lag_cause((0.0, 1.0, 3.0, 1.0, 0.0, 2.5), []) == GIL  # the loop waited: its own
    causes = lag_causes([waiting, (1.0, 2.0, 5.0, 1.0, 0.0), (2.0, 3.0, 0.5, 0.0, 0.0)], [],
                        host_stalls=[(0.9975, 0.9995)])
    assert causes == {MACHINE_STALL: {"count": 1, "max_ms": 3.0},
                      GIL: {"count": 1, "max_ms": 5.0}}


def _fake_probe_process(tmp_path, monkeypatch, script: str) -> None:
    """The measuring process replaced by a shell script (its interpreter: ``sys.executable``)."""
    exe = tmp_path / "fake-python"
    exe.write_text("#!/bin/sh\n" + script + "\n")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(exe))


@linux
@pytest.mark.parametrize("answer", [
    "'[1, 2]'", "'{\"x\": 1}'", "'\"stalls\"'",
    "'{\"stalls\": [1, 2], \"preempted\": 0, \"chunks\": 1, \"seconds\": 1.0, "
    "\"chunk_us\": 1.0, \"steal_ms\": null}'",
    "'{\"stalls\": [[1.0, 2.0]], \"chunks\": 1}'",
    "'{\"stalls\": [], \"preempted\": 0, \"chunks\": 1, \"seconds\": 1.0, \"chunk_us\": 1.0}'",
])
def test_a_measuring_process_that_answers_garbage_is_a_probe_that_did_not_run(
        answer, tmp_path, monkeypatch):
    _fake_probe_process(tmp_path, monkeypatch, f"echo ready; read x; echo {answer}")
    probe = HostStallProbe().start()
    assert probe._proc is not None
    assert probe.stop() is None


def _children() -> list[int]:
    """This process's child processes still there (zombies included)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                pids.append(int(d))
    return pids


@linux
def test_a_measuring_process_that_never_says_ready_does_not_hang_start(tmp_path, monkeypatch):
    _fake_probe_process(tmp_path, monkeypatch, "exec sleep 30")
    before = set(_children())
    probe = HostStallProbe()
    t = time.perf_counter()
    probe.start(timeout=0.5)
    assert time.perf_counter() - t < 3.0
    assert probe._proc is None and probe.stop() is None
    assert set(_children()) <= before  # killed and reaped


def interrupted_after(seconds: float, call) -> None:
    """Run ``call`` with a Ctrl-C (KeyboardInterrupt from SIGALRM) ``seconds`` into it; it
    must raise that interrupt."""
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@linux
def test_an_interrupt_while_start_waits_leaves_no_process_behind(tmp_path, monkeypatch):
    _fake_probe_process(tmp_path, monkeypatch, "exec sleep 30")
    before = set(_children())
    probe = HostStallProbe()
    interrupted_after(0.2, lambda: probe.start(timeout=5.0))
    assert probe._proc is None
    assert set(_children()) <= before


@linux
def test_an_interrupt_while_stop_waits_leaves_no_process_behind():
    probe = HostStallProbe().start()
    proc = probe._proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)  # stopped: it cannot end by itself when stdin closes
    interrupted_after(0.2, lambda: probe.stop(timeout=5.0))
    assert proc.poll() is not None, "the stopped measuring process was left behind"
    assert proc.pid not in _children()


@linux
def test_a_threshold_of_any_real_number_type_measures():
    np = pytest.importorskip("numpy")
    probe = HostStallProbe(np.float64(0.5))
    assert probe.threshold_ms == 0.5 and type(probe.threshold_ms) is float
    probe.start()
    time.sleep(0.02)
    seen = probe.stop()
    assert seen is not None and seen["chunks"] > 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "0.25", True, None])
def test_a_threshold_that_is_not_a_positive_number_is_refused(bad):
    from orchestra.serve.errors import ServeConfigError

    with pytest.raises(ServeConfigError, match="threshold_ms"):
        HostStallProbe(bad)


def test_stalls_that_overlap_count_once():
    # two probes (two CPUs) saw the same 1.5 ms stall of a 3 ms wait: 1.5 ms left, over 1 ms
    waiting = (0.0, 1.0, 3.0, 1.0, 0.0)
    twice = [(0.997, 0.9985), (0.997, 0.9985)]
    assert overlap_ms(twice, 0.997, 1.0) == pytest.approx(1.5)
    assert lag_cause(waiting, [], host_stalls=twice) == GIL
    # nested and chained spans: their union (0.997-0.9995: 2.5 ms), in any order
    spans = [(0.998, 0.999), (0.9985, 0.9995), (0.997, 0.9982)]
    assert overlap_ms(spans, 0.997, 1.0) == pytest.approx(2.5)
    assert lag_cause(waiting, [], host_stalls=spans) == MACHINE_STALL


def test_lag_causes_takes_its_stalls_and_pauses_from_any_iterable():
    waiting = (0.0, 1.0, 3.0, 1.0, 0.0)
    causes = lag_causes([waiting, waiting], iter([]), host_stalls=iter([(0.0, 1.0)]))
    assert causes == {MACHINE_STALL: {"count": 2, "max_ms": 3.0}}


@pytest.mark.parametrize("case", ["darwin", "exits", "garbage", "hangs"])
def test_a_probe_that_could_not_measure_says_why(case, tmp_path, monkeypatch):
    if case == "darwin":
        monkeypatch.setattr(sys, "platform", "darwin")
    elif not sys.platform.startswith("linux"):
        pytest.skip("the measuring process runs on Linux")
    else:
        _fake_probe_process(tmp_path, monkeypatch, {
            "exits": "exit 3", "garbage": "echo ready; read x; echo '[1]'",
            "hangs": "echo ready; exec sleep 30"}[case])
    probe = HostStallProbe().start(timeout=1.0)
    assert probe.stop(timeout=0.5) is None
    assert probe.why == {
        "darwin": "Linux only, this is darwin",
        "exits": "the measuring process ended (exit status 3) before it measured",
        "garbage": "the measuring process's result could not be read",
        "hangs": "the measuring process did not answer within 0.5 s"}[case]
    assert probe.stop() is None and probe.why  # a second stop keeps the reason


def test_the_bench_says_why_the_machines_stalls_could_not_be_measured():
    from orchestra.serve.bench import Result, format_lag

    r = Result("asyncio", "engine, 1 tasks")
    r.extra.update({"loop_lag_p50_ms": 0.1, "loop_lag_p99_ms": 0.2, "loop_lag_max_ms": 0.3,
                    "loop_lag_samples": 10, "loop_lag_probe_gap_ms": 1.0,
                    "loop_lag_over_1ms": 0, "loop_lag_causes": {}, "gc_collections": {},
                    "host_stalls": None,
                    "host_stalls_why": "the measuring process did not answer within 5 s"})
    text = "\n".join(format_lag(r))
    assert ("the machine: its stalls could not be measured here (the measuring process did "
            "not answer within 5 s)") in text
    assert "Linux only" not in text


@pytest.mark.parametrize("count, seconds, want", [
    (0, 0.0261, "a separate process doing only fixed CPU work did not stall over 0.25 ms in "
                "0.0261 s (2 gaps spent waiting for a CPU left out)"),
    (3, 12.345, "a separate process doing only fixed CPU work stalled 3 times over 0.25 ms in "
                "12.3 s (max 1.500 ms, 1 above 1 ms; 2 gaps spent waiting for a CPU left "
                "out)"),
])
def test_the_bench_line_on_the_machines_stalls_reads_for_a_short_load(count, seconds, want):
    from orchestra.serve.bench import Result, format_lag

    r = Result("asyncio", "engine, 1 tasks")
    r.extra.update({"loop_lag_p50_ms": 0.1, "loop_lag_p99_ms": 0.2, "loop_lag_max_ms": 0.3,
                    "loop_lag_samples": 10, "loop_lag_probe_gap_ms": 1.0,
                    "loop_lag_over_1ms": 0, "loop_lag_causes": {}, "gc_collections": {},
                    "host_stalls": {"count": count, "preempted": 2, "threshold_ms": 0.25,
                                    "max_ms": 1.5 if count else 0.0, "over_1ms": min(count, 1),
                                    "seconds": seconds, "steal_ms": None}})
    assert want in "\n".join(format_lag(r))


@linux
def test_a_load_that_fails_to_start_its_loop_probe_leaves_no_measuring_process(monkeypatch):
    import asyncio

    from orchestra.serve import bench, errors

    def boom(self):
        raise errors.ServeError("the loop probe did not start")

    from orchestra.serve import loop_lag

    monkeypatch.setattr(loop_lag.LoopLagProbe, "start", boom)
    monkeypatch.setattr(loop_lag.TimerLagProbe, "start", boom)
    w = bench.Workload("16K")
    before = set(_children())
    cfg = bench.EngineConfig(backend_factory=lambda w: __import__(
        "orchestra.serve", fromlist=["NumpyBackend"]).NumpyBackend(
        lambda d: d["x"] * 0 + d["x"], device_thread=True))
    with bench.make_engine(w, cfg, instances=2) as e:
        with pytest.raises(errors.ServeError, match="loop probe"):
            asyncio.run(bench._asyncio_load("t", w, e, 4, 8))
    assert set(_children()) <= before, "the measuring process was left running"

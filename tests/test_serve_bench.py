"""`orchestra bench serve`'s harness on the CPU: every mode runs through a numpy backend (the
same engine code, no GPU), outputs verified, bad requests of the soak refused one by one; the
option parsing and the CLI's refusals."""

from __future__ import annotations

import json
import sys

import pytest

from orchestra.serve import NumpyBackend
from orchestra.serve.bench import (
    S,
    T,
    BenchOptions,
    EngineConfig,
    Workload,
    allocator_note,
    main,
    parse_mix,
    parse_size,
    run,
)
from orchestra.serve.demo import demo_reference


def cpu_config(**kw) -> EngineConfig:
    return EngineConfig(backend_factory=lambda w: NumpyBackend(
        lambda d: demo_reference(d["x"], w.iters, S, T)), **kw)


def test_sizes_and_mixes():
    assert parse_size("64K") == 65536 and parse_size("1M") == 1 << 20
    assert parse_size("4KiB") == 4096 and parse_size("512") == 512
    assert parse_mix("4K:1,64K:8") == [(4096, 1.0), (65536, 8.0)]
    assert parse_mix("64K") == [(65536, 1.0)]
    with pytest.raises(ValueError, match="give bytes"):
        parse_size("lots")
    with pytest.raises(ValueError, match="weights"):
        parse_mix("4K:0")
    with pytest.raises(ValueError, match="whole number of 4096-byte rows"):
        Workload("6K")
    w = Workload("4K:1,16K:3", iters=2)
    assert w.sizes == [1, 4] and w.max_rows == 4
    x, y = w.requests[1][0]
    assert x.shape == (4, 1024) and y.tobytes() == demo_reference(x, 2).tobytes()
    pick = w.picker(0)
    counts = {1: 0, 4: 0}
    for _ in range(4000):
        counts[pick()[0].shape[0]] += 1
    assert 0.2 < counts[1] / 4000 < 0.3  # weights 1:3


@pytest.mark.parametrize("mode", ["latency", "closed", "open", "asyncio", "soak"])
def test_every_mode_on_the_cpu_backend(mode, capsys):
    # the soak stops at its requests or its duration, whichever first: a duration it never
    # reaches (0.2 s was reached first on a loaded machine: 14 bad requests of 15)
    o = BenchOptions(mode=mode, mix="4K:1,16K:2", duration=120 if mode == "soak" else 0.2,
                     threads=3, tasks=20,
                     requests={"latency": 100, "soak": 1500, "asyncio": 200}.get(mode),
                     rate=1000, engine=cpu_config())
    assert main(o, as_json=True) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["verified"] is True
    res = rep["results"]
    assert res and all(r["wrong"] == 0 for r in res)
    assert all(r["requests"] > 0 and r["p50_us"] > 0 for r in res)
    if mode == "closed":
        names = [r["name"] for r in res]
        assert any("batching" in n for n in names) and any("dispatcher" in n for n in names)
        batched = next(r for r in res if "batching" in r["name"])
        assert 0 < batched["batch_fill"] <= 1
    if mode == "asyncio":
        assert all("loop_lag_max_ms" in r for r in res)
    if mode == "soak":
        (r,) = res
        assert r["stopped_by"] == "requests"
        assert r["bad_requests"] == 15 and r["bad_refused_ok"] == 15 and r["errors"] == 0
        assert r["engine_bad_requests"] == 15
        assert r["first"]["rss_bytes"] > 0 and r["last"]["rss_bytes"] > 0


def test_text_tables_and_goal_lines(capsys):
    o = BenchOptions(mode="all", mix="16K", duration=0.2, threads=2, requests=50,
                     batching="on", engine=cpu_config())
    assert main(o) == 0
    text = capsys.readouterr().out
    assert "latency:" in text and "closed:" in text
    assert "engine(x) [blocking]" in text and "dynamic batching" in text
    assert "closed loop:" in text and "goal >= 50,000" in text


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    o = BenchOptions(mode="latency", mix="4K", requests=50, engine=cpu_config())
    path = tmp_path / "cdf.png"
    assert main(o, as_json=True, plot=str(path)) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_count_every_request():
    o = BenchOptions(mode="latency", mix="4K", requests=123, engine=cpu_config())
    results, notes, w = run(o)
    assert [r.requests for r in results] == [123, 123]
    assert all(len(r.latency_us) == 123 for r in results)


def test_cli_refusals(capsys):
    from orchestra.cli.main import main as cli

    assert cli(["bench", "serve", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    for bad in ("-1", "nan", "inf"):
        assert cli(["bench", "serve", "--cpu", "--mode", "asyncio", "--gc-young-ms", bad]) == 2
        assert (f"--gc-young-ms must be a finite number >= 0, got {float(bad)}"
                in capsys.readouterr().err)
    assert cli(["bench", "serve", "--cpu", "--mode", "asyncio", "--completions-per-turn",
                "0"]) == 2
    assert "--completions-per-turn must be >= 1" in capsys.readouterr().err
    assert cli(["bench", "serve", "--cpu", "--mode", "asyncio", "--arrivals-per-turn",
                "0"]) == 2
    assert "--arrivals-per-turn must be >= 1" in capsys.readouterr().err
    for mode in ("closed", "all"):
        assert cli(["bench", "serve", "--cpu", "--mode", mode, "--arrivals-per-turn",
                    "2"]) == 2
        assert "--arrivals-per-turn applies to the asyncio load" in capsys.readouterr().err
        assert cli(["bench", "serve", "--cpu", "--mode", mode, "--completions-per-turn", "2",
                    "--loop", "uvloop"]) == 2
        assert ("--completions-per-turn, --loop apply to the asyncio load (--mode asyncio), "
                f"not --mode {mode}") in capsys.readouterr().err
    assert cli(["bench", "serve", "--cpu", "--mode", "open", "--rate", "1e-300"]) == 2
    assert "--rate must be at least 1 request/s, got 1e-300" in capsys.readouterr().err
    assert cli(["bench", "serve", "--cpu", "--batching", "on", "--max-delay-us", "1e12"]) == 2
    assert "--max-delay-us must be at most 1,000,000" in capsys.readouterr().err
    code = cli(["bench", "serve", "--mix", "6K", "--no-peers", "--mode", "latency"])
    err = capsys.readouterr().err
    # a size that is no whole number of rows (usage, 2); without a GPU, no device (3) first
    usage = (code, "4096-byte rows" in err) == (2, True)
    no_gpu = (code, "no CUDA device" in err) == (3, True)
    assert usage or no_gpu, (code, err)


def test_lag_causes_put_each_late_wake_up_down_to_gc_callbacks_or_waiting():
    from orchestra.serve.loop_lag import lag_causes

    # (start s, end s, lag ms, loop-thread CPU ms) per 0.5 ms probe sleep
    samples = [
        (0.0, 0.0006, 0.1, 0.05),  # on time
        (1.0, 1.0035, 3.0, 0.2),  # a 2.5 ms collection inside: the GC
        (2.0, 2.0025, 2.0, 2.3),  # the loop thread ran the whole time: callbacks
        (3.0, 3.0045, 4.0, 0.3),  # neither: it waited for the GIL or a CPU
    ]
    pauses = [(1.0005, 1.003, 2), (2.0001, 2.0002, 0)]
    causes = lag_causes(samples, pauses)
    assert causes == {
        "garbage collector (generation 2)": {"count": 1, "max_ms": 3.0},
        "loop busy running callbacks": {"count": 1, "max_ms": 2.0},
        "loop thread waiting for the GIL or a CPU": {"count": 1, "max_ms": 4.0},
    }


def test_the_allocator_note_names_the_settings_the_environment_gave():
    assert "as it is" in allocator_note({})
    note = allocator_note({"MALLOC_TRIM_THRESHOLD_": "4294967295", "PATH": "/bin",
                           "MALLOC_TOP_PAD_": ""})
    assert note.endswith("environment: MALLOC_TRIM_THRESHOLD_=4294967295")


def test_asyncio_mode_reports_the_lag_distribution_and_its_causes(capsys):
    o = BenchOptions(mode="asyncio", mix="16K", tasks=40, requests=400, batching="on",
                     engine=cpu_config())
    assert main(o) == 0
    text = capsys.readouterr().out
    assert "event-loop lag p50" in text and "garbage collections during the run" in text
    assert "gc.freeze() after the engine's warm-up" in text
    assert "glibc's allocator" in text
    results, _, _ = run(o)
    (r,) = results
    assert r.requests == 400 and r.wrong == 0
    x = r.extra
    assert x["loop_lag_p50_ms"] <= x["loop_lag_p99_ms"] <= x["loop_lag_max_ms"]
    assert sum(c["count"] for c in x["loop_lag_causes"].values()) == x["loop_lag_over_1ms"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the machine's stalls: Linux")
def test_asyncio_mode_measures_the_machines_stalls_beside_the_load_unless_told_not_to(
        capsys, monkeypatch):
    """The asyncio load runs a separate measuring process for the machine's own stalls and
    says what it saw; --no-host-probe leaves it out (no process, no line, no figures); on a
    machine of fewer than 4 CPUs it is left out and the output says why."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    o = BenchOptions(mode="asyncio", mix="16K", tasks=40, requests=400, batching="off",
                     dispatch="caller", engine=cpu_config())
    assert main(o) == 0
    text = capsys.readouterr().out
    assert ("the machine: a separate process doing only fixed CPU work stalled" in text
            or "the machine: a separate process doing only fixed CPU work did not stall" in text)
    results, _, _ = run(o)
    (r,) = results
    assert r.requests == 400 and r.wrong == 0
    h = r.extra["host_stalls"]
    assert h["seconds"] >= r.seconds * 0.5 and h["count"] >= h["over_1ms"] >= 0
    assert h["threshold_ms"] == 0.25 and h["preempted"] >= 0
    # the loop's own maximum (without the samples the machine or the probe explain)
    assert 0 <= r.extra["loop_lag_max_ms_own"] <= r.extra["loop_lag_max_ms"]
    o.host_probe = False
    assert main(o) == 0
    assert "the machine:" not in capsys.readouterr().out
    results, _, _ = run(o)
    assert "host_stalls" not in results[0].extra
    o.host_probe = True
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert main(o) == 0
    assert ("the machine: its stalls could not be measured here (left out: this machine has 2 "
            "CPUs and the probe keeps one busy; it runs from 4)") in capsys.readouterr().out
    results, _, _ = run(o)
    assert results[0].extra["host_stalls"] is None
    assert results[0].extra["loop_lag_max_ms_own"] <= results[0].extra["loop_lag_max_ms"]


@pytest.mark.parametrize("young_ms", [2.0, 0.0])
def test_asyncio_mode_collects_the_young_generation_from_the_loop(young_ms, capsys):
    """--gc-young-ms: the automatic collector is off during the load and the loop collects
    generation 0 on a timer (the pauses are in the probe's lag and the collection counts);
    afterwards the collector is on again and a full collection finds no cycles the
    requests left behind. 0: the automatic collector, as it was."""
    import gc

    o = BenchOptions(mode="asyncio", mix="16K", tasks=40, requests=800, batching="off",
                     dispatch="caller", engine=cpu_config(), gc_young_ms=young_ms)
    assert main(o) == 0
    text = capsys.readouterr().out
    assert gc.isenabled()
    assert ("gc.collect(0) every 2 ms from the loop" in text) == bool(young_ms)
    results, _, _ = run(o)
    (r,) = results
    assert r.requests == 800 and r.wrong == 0 and r.errors == 0
    # the loop thread's CPU per request, and the benchmark's own share of it, both measured
    assert 0 < r.extra["bench_own_us_per_request"] < r.extra["loop_cpu_us_per_request"]
    assert "of which the benchmark's own (pick the input, compare the output)" in text
    if young_ms:
        assert r.extra["gc_left_for_full_collection"] == 0
        # at least one timed collection per 10 ms of load (a loaded machine stretches it)
        assert r.extra["gc_collections"]["0"]["count"] >= r.seconds / 0.01
        assert "1" not in r.extra["gc_collections"] and "2" not in r.extra["gc_collections"]
    else:
        assert "gc_left_for_full_collection" not in r.extra


def test_asyncio_mode_runs_on_uvloop_when_asked(monkeypatch):
    """--loop uvloop: the same load, every output checked, on uvloop's event loop; its lag
    probe sleeps 1 ms (libuv's timers count whole ms)."""
    uvloop = pytest.importorskip("uvloop")
    seen = []
    o = BenchOptions(mode="asyncio", mix="16K", tasks=40, requests=800, batching="off",
                     dispatch="caller", engine=cpu_config(), loop="uvloop")
    import orchestra.serve.bench as bench

    real = bench._asyncio_load

    async def spy(*a, **kw):
        import asyncio

        seen.append(type(asyncio.get_running_loop()).__module__)
        return await real(*a, **kw)

    monkeypatch.setattr(bench, "_asyncio_load", spy)
    results, notes, _ = run(o)
    (r,) = results
    assert seen and seen[0].startswith("uvloop")
    assert r.requests == 800 and r.wrong == 0 and r.errors == 0
    assert r.extra["loop_lag_probe_gap_ms"] == 1.0 and r.extra["loop_lag_samples"] > 0
    assert any(f"uvloop {uvloop.__version__}" in n for n in notes)


def test_loop_option_refusals(capsys, monkeypatch):
    from orchestra.cli.main import main as cli

    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--loop", "uvloop"]) == 2
    assert "--loop applies to the asyncio load" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "uvloop", None)  # not installed
    assert cli(["bench", "serve", "--cpu", "--mode", "asyncio", "--loop", "uvloop"]) == 2
    assert "--loop uvloop needs uvloop: pip install 'orchestra[uvloop]'" in (
        capsys.readouterr().err)


def test_soak_stops_at_the_requests_or_the_duration_whichever_first(capsys):
    o = BenchOptions(mode="soak", mix="16K", threads=2, requests=600, duration=30,
                     engine=cpu_config())
    assert main(o) == 0
    text = capsys.readouterr().out
    assert "(reached 600 requests)" in text and "RSS" in text and "live handles" in text
    o = BenchOptions(mode="soak", mix="16K", threads=2, requests=10**9, duration=0.3,
                     engine=cpu_config())
    (r,), _, _ = run(o)
    assert r.extra["stopped_by"] == "duration" and 0.3 <= r.seconds < 5
    assert r.errors == 0 and r.wrong == 0 and r.extra["bad_refused_ok"] > 0


def test_cli_cpu_runs_the_engine_without_a_gpu(capsys):
    from orchestra.cli.main import main as cli

    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--duration", "0.2",
                "--threads", "2", "--mix", "16K", "--batching", "on", "--window", "4",
                "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["device"].startswith("CPU") and rep["verified"] is True
    (r,) = rep["results"]
    assert "dynamic batching" in r["name"] and r["requests"] > 0 and r["wrong"] == 0


@pytest.mark.parametrize("process", [False, True])
def test_completions_per_turn_reaches_the_engine(process):
    """--completions-per-turn is the option of the engine the bench opens, in this process and
    in an engine process."""
    from orchestra.cli.main import build_parser
    from orchestra.serve.bench import Workload, open_engine
    from orchestra.serve.cli import options

    args = build_parser().parse_args(["bench", "serve", "--cpu", "--mode", "asyncio",
                                      "--completions-per-turn", "3"])
    o = options(args)
    assert o.engine.completions_per_turn == 3
    with open_engine(Workload("4K", pool=2), o.engine, process=process) as e:
        assert e.completions_per_turn == 3
    # without the option each engine keeps its own default: 16 in process, 4 for an engine
    # process (whose loop copies every output out of its slot)
    o = options(build_parser().parse_args(["bench", "serve", "--cpu", "--mode", "asyncio"]))
    assert o.engine.completions_per_turn is None
    with open_engine(Workload("4K", pool=2), o.engine, process=process) as e:
        assert e.completions_per_turn == (4 if process else 16)


def test_loop_option_is_refused_with_mode_all(capsys):
    # --mode all is latency + closed: no asyncio load runs, so --loop uvloop was taken and
    # silently ignored (the refusal's own message said "--mode asyncio or all")
    from orchestra.cli.main import main as cli

    assert cli(["bench", "serve", "--cpu", "--mode", "all", "--loop", "uvloop"]) == 2
    err = capsys.readouterr().err
    assert "--loop applies to the asyncio load (--mode asyncio), not --mode all" in err


def test_the_asyncio_loads_switches_are_refused_outside_it(capsys):
    """--no-gc-freeze and --no-host-probe change only the asyncio load: elsewhere they are
    refused, as its other options are, and taken with --mode asyncio."""
    from orchestra.cli.main import build_parser
    from orchestra.cli.main import main as cli
    from orchestra.serve.cli import options

    for flag in ("--no-gc-freeze", "--no-host-probe"):
        for mode in ("closed", "all"):
            assert cli(["bench", "serve", "--cpu", "--mode", mode, flag]) == 2
            assert (f"{flag} applies to the asyncio load (--mode asyncio), not --mode "
                    f"{mode}") in capsys.readouterr().err
    o = options(build_parser().parse_args(["bench", "serve", "--cpu", "--mode", "asyncio",
                                           "--no-gc-freeze", "--no-host-probe"]))
    assert o.gc_freeze is False and o.host_probe is False
    o = options(build_parser().parse_args(["bench", "serve", "--cpu", "--mode", "asyncio"]))
    assert o.gc_freeze is True and o.host_probe is True and o.lag_probe == "auto"


@pytest.mark.parametrize("kind", ["timerfd", "thread"])
def test_lag_probe_is_the_asyncio_loads_and_is_used_there(capsys, kind):
    """--lag-probe picks how the asyncio load's lag is measured; elsewhere it is refused; the
    row says which probe measured it."""
    from orchestra.cli.main import main as cli
    from orchestra.serve.bench import BenchOptions, EngineConfig, cpu_backend_factory, run

    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--lag-probe", kind]) == 2
    assert ("--lag-probe applies to the asyncio load (--mode asyncio), not --mode "
            "closed") in capsys.readouterr().err
    if kind == "timerfd" and not sys.platform.startswith("linux"):
        pytest.skip("timer file descriptors are Linux's")
    o = BenchOptions(mode="asyncio", tasks=20, requests=400, batching="off",
                     dispatch="caller", peers=False, host_probe=False, lag_probe=kind,
                     engine=EngineConfig(backend_factory=cpu_backend_factory, instances=2))
    results, _, _ = run(o)
    (r,) = results
    assert r.requests == 400 and r.wrong == 0
    assert r.extra["loop_lag_probe"] == kind and r.extra["loop_lag_samples"] > 0
    lag = r.extra["loop_lag_max_ms"]
    assert 0 <= r.extra["loop_lag_p50_ms"] <= lag
    # the goal's verdict says it too (the thread probe reads higher: runs differ by probe)
    from orchestra.serve.bench import goal_lines

    (goal,) = [g for g in goal_lines(results) if "event-loop lag" in g]
    by = {"timerfd": "by the timer-fd probe", "thread": "by the thread probe"}[kind]
    assert f"event-loop lag max {lag:.3f} ms {by} (goal <= 1 ms)" in goal
    r.extra["loop_lag_max_ms_own"] = lag / 2  # what the machine's stalls (and probe) explain
    (goal,) = [g for g in goal_lines(results) if "event-loop lag" in g]
    assert ("probe thread's own delay" in goal) == (kind == "thread"), goal


def test_gc_young_ms_is_refused_outside_the_asyncio_load(capsys):
    """--gc-young-ms (the asyncio load's young collections) was taken by every mode and did
    nothing outside it; given explicitly, any value (0 and the default 5 too) is refused
    there, as the other options of the asyncio load are, --mode all (latency + closed)
    included. Without it the asyncio load still collects every 5 ms; 0 still turns that off."""
    from orchestra.cli.main import build_parser
    from orchestra.cli.main import main as cli
    from orchestra.serve.cli import options

    for mode in ("latency", "closed", "open", "soak", "all"):
        for value in ("0", "5", "2.5"):
            assert cli(["bench", "serve", "--cpu", "--mode", mode, "--gc-young-ms",
                        value]) == 2
            assert (f"--gc-young-ms applies to the asyncio load (--mode asyncio), not --mode "
                    f"{mode}") in capsys.readouterr().err
    assert cli(["bench", "serve", "--cpu", "--mode", "closed", "--gc-young-ms", "1",
                "--arrivals-per-turn", "2"]) == 2
    assert ("--arrivals-per-turn, --gc-young-ms apply to the asyncio load (--mode asyncio), "
            "not --mode closed") in capsys.readouterr().err

    def parsed(*extra):
        return options(build_parser().parse_args(["bench", "serve", "--cpu", *extra]))

    assert parsed("--mode", "asyncio").gc_young_ms == 5.0  # the default, as it was
    assert parsed("--mode", "asyncio", "--gc-young-ms", "0").gc_young_ms == 0.0
    assert parsed("--mode", "asyncio", "--gc-young-ms", "2").gc_young_ms == 2.0
    assert parsed("--mode", "closed").gc_young_ms == 5.0  # unused there, and not given


def test_counts_have_upper_limits_checked_before_anything_is_made(capsys, monkeypatch):
    """--threads, --instances, --tasks and --window had no upper bound: a huge count started
    threads, tasks or instances until MemoryError. Each is refused above its limit (exit 2,
    before any device is opened: no --cpu here), its limit accepted; --threads x --window
    requests' outputs must fit in the machine's memory (closed loop only: the one that
    uses --window)."""
    from orchestra.cli import job_options
    from orchestra.cli.main import build_parser
    from orchestra.cli.main import main as cli
    from orchestra.serve.cli import (
        MAX_INSTANCES,
        MAX_REQUESTS,
        MAX_TASKS,
        MAX_THREADS,
        MAX_WINDOW,
        options,
    )

    limits = {"threads": MAX_THREADS, "instances": MAX_INSTANCES, "tasks": MAX_TASKS,
              "window": MAX_WINDOW, "requests": MAX_REQUESTS}
    assert limits == {"threads": 4096, "instances": 1024, "tasks": 1_000_000, "window": 65536,
                      "requests": 100_000_000}
    for name, limit in limits.items():
        mode = "asyncio" if name == "tasks" else "closed"
        for value in (limit + 1, 10**14, 10**50):
            assert cli(["bench", "serve", "--mode", mode, f"--{name}", str(value)]) == 2
            err = capsys.readouterr().err
            assert f"--{name} must be at most {limit:,} (" in err, err
            assert f"pass a smaller --{name}" in err
        assert "got 1.000e+50 (a 167-bit int)" in err  # no 51-digit number in the message
        o = options(build_parser().parse_args(["bench", "serve", "--cpu", "--mode", mode,
                                               "--mix", "4K", "--threads", "1",
                                               f"--{name}", str(limit)]))
        assert (o.engine.instances if name == "instances" else getattr(o, name)) == limit

    def check(*extra):
        return options(build_parser().parse_args(["bench", "serve", "--cpu", "--mix", "64K",
                                                  *extra]))

    # requests in flight hold their outputs: 8 x 4096 x 64 KiB = 2 GiB on a 1 GiB machine
    monkeypatch.setattr(job_options, "host_memory_bytes", lambda: 2**30)
    for mode in ("closed", "all"):
        assert cli(["bench", "serve", "--cpu", "--mode", mode, "--mix", "64K", "--threads",
                    "8", "--window", "4096"]) == 2
        assert ("--threads 8 x --window 4096 requests in flight of up to 64.0 KiB each may "
                "hold 2.00 GiB of outputs but this machine has 1.00 GiB; pass a smaller "
                "--window or fewer --threads") in capsys.readouterr().err
    assert check("--mode", "closed", "--threads", "8", "--window", "2048").window == 2048
    assert check("--mode", "soak", "--threads", "8", "--window", "4096").window == 4096
    monkeypatch.setattr(job_options, "host_memory_bytes", lambda: None)  # not known: no check
    assert check("--mode", "closed", "--threads", "8", "--window", "4096").window == 4096

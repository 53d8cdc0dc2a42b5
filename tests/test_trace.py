"""CPU tests of orchestra.trace: timeline data, overlap metrics, Chrome trace, Gantt PNG, NVTX.

The metrics are checked on a hand-made timeline whose numbers were worked out by hand:

    upload    [0,4] [6,8]          busy 6
    compute   [2,7] (+ [4,6] on a second compute stream: same union)   busy 5
    download  [3,5] [7,10]         busy 5
    memory    [0,0.5]              (not counted in the overlap)

    time   0-2 2-3 3-4 4-5 5-6 6-7 7-8 8-10
    busy    1   2   3   2   1   2   2   1     -> exactly 1: 5, exactly 2: 4, exactly 3: 1 ms
    upload&compute [2,4]+[6,7] = 3, upload&download [3,4]+[7,8] = 2, compute&download [3,5] = 2
"""

import importlib
import json
import sys

import pytest

from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import (
    Alloc, Buffer, DeviceToHost, HostBuffer, HostFunc, HostToDevice, In, KernelNode,
    KernelRef, Memset, Out,
)
from orchestra.trace import (
    NodeSpan, Timeline, compute_metrics, concurrency, efficiency, intersect, pipeline_bound_ms,
    plot_gantt, to_chrome_trace, union, write_chrome_trace,
)
from orchestra.trace import nvtx as trace_nvtx
from orchestra.trace import plot as trace_plot

STREAMS = ("upload", "compute0", "compute1", "download")


def hand_timeline():
    S = NodeSpan
    spans = [
        S("alloc", "alloc", 0, "upload", "memory", 0.0, 0.5, nbytes=1024),
        S("up0", "h2d", 0, "upload", "upload", 0.0, 4.0, nbytes=4_000_000),
        S("up1", "h2d", 1, "upload", "upload", 6.0, 8.0, nbytes=2_000_000),
        S("k0", "kernel", 0, "compute0", "compute", 2.0, 7.0),
        S("k1", "kernel", 1, "compute1", "compute", 4.0, 6.0),
        S("down0", "d2h", 0, "download", "download", 3.0, 5.0, nbytes=2_000_000),
        S("down1", "d2h", 1, "download", "download", 7.0, 10.0, nbytes=3_000_000),
    ]
    return Timeline(spans, STREAMS, policy="by-engine", executor="eager", device=0,
                    meta={"batches": 2})


# -- interval algebra ---------------------------------------------------------------------------

def test_union_intersect_concurrency():
    assert union([(3, 5), (0, 1), (1, 2), (4, 6), (7, 7)]) == [(0, 2), (3, 6)]
    assert intersect([(0, 4), (6, 8)], [(2, 7)]) == [(2, 4), (6, 7)]
    assert intersect([(0, 1)], [(1, 2)]) == []
    assert concurrency([[(0, 2)], [(1, 3)], [(2, 4)]]) == {1: 2.0, 2: 2.0}
    assert concurrency([]) == {}


# -- metrics on the hand-made timeline ----------------------------------------------------------

def test_busy_per_engine():
    tl = hand_timeline()
    assert tl.busy_ms() == pytest.approx({"memory": 0.5, "upload": 6.0, "compute": 5.0,
                                          "download": 5.0})
    m = tl.metrics()
    assert list(m.busy_ms) == ["upload", "compute", "download", "memory"]  # ENGINES order
    assert m.stream_busy_ms == pytest.approx({"upload": 6.0, "compute0": 5.0, "compute1": 2.0,
                                              "download": 5.0})
    assert m.busy_fraction("upload") == pytest.approx(0.6)


def test_makespan_and_efficiency():
    tl = hand_timeline()
    assert (tl.start_ms, tl.end_ms, tl.makespan_ms) == (0.0, 10.0, 10.0)
    assert tl.efficiency(8.0) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="bound_ms must be > 0"):
        tl.efficiency(0)
    with pytest.raises(ValueError, match="no duration"):
        efficiency(1.0, 0.0)


def test_overlap_two_and_three_engines():
    m = compute_metrics(hand_timeline())
    assert m.engines == ("upload", "compute", "download")
    assert m.concurrency_ms == pytest.approx({1: 5.0, 2: 4.0, 3: 1.0})
    assert m.overlap_ms(2) == pytest.approx(5.0)
    assert m.overlap_ms(3) == pytest.approx(1.0)
    assert m.overlap_fraction(2) == pytest.approx(0.5)
    assert m.overlap_fraction(3) == pytest.approx(0.1)
    assert hand_timeline().overlap_ms(3) == pytest.approx(1.0)


def test_pair_intersections():
    pairs = hand_timeline().pair_overlap_ms()
    assert pairs == pytest.approx({("upload", "compute"): 3.0, ("upload", "download"): 2.0,
                                   ("compute", "download"): 2.0})
    # inclusion-exclusion: each instant with k engines busy is in k*(k-1)/2 pairs
    m = hand_timeline().metrics()
    assert sum(pairs.values()) == pytest.approx(sum(k * (k - 1) / 2 * v
                                                    for k, v in m.concurrency_ms.items()))


def test_overlap_over_chosen_engines():
    tl = hand_timeline()
    m = tl.metrics(engines=("upload", "memory"))
    assert m.pairs_ms == pytest.approx({("upload", "memory"): 0.5})
    everything = tl.metrics(engines=None)
    assert everything.engines == ("upload", "compute", "download", "memory")
    # engines that did not run are left out rather than counted as idle
    assert tl.metrics(engines=("upload", "host")).engines == ("upload",)


def test_touching_intervals_do_not_overlap():
    S = NodeSpan
    tl = Timeline([S("a", "h2d", 0, "s", "upload", 0, 1), S("b", "kernel", 0, "s", "compute", 1, 2)])
    assert tl.overlap_ms(2) == 0.0
    assert tl.pair_overlap_ms() == {("upload", "compute"): 0.0}


def test_pipeline_bound():
    S = NodeSpan
    spans = []
    for b in range(4):  # h2d 1 ms, kernel 2 ms, d2h 1 ms per batch
        t = 2.0 * b
        spans += [S(f"u{b}", "h2d", b, "up", "upload", t, t + 1),
                  S(f"k{b}", "kernel", b, "c", "compute", t + 1, t + 3),
                  S(f"d{b}", "d2h", b, "down", "download", t + 3, t + 4)]
    tl = Timeline(spans)
    assert pipeline_bound_ms(tl) == pytest.approx(1 + 4 * 2 + 1)
    assert tl.makespan_ms == pytest.approx(10.0)
    assert tl.efficiency(pipeline_bound_ms(tl)) == pytest.approx(1.0)
    assert pipeline_bound_ms(Timeline([S("x", "host", None, "s", "host", 0, 1)])) is None


def test_summary_text():
    text = hand_timeline().summary(bound_ms=8.0)
    assert "7 node(s) on 4 stream(s)" in text and "policy by-engine" in text
    assert "makespan 10.000 ms" in text
    assert ">=2 engines 5.000 ms (50.0%)" in text and ">=3 engines 1.000 ms (10.0%)" in text
    assert "upload&compute 3.000 ms" in text
    assert "efficiency 80.0%" in text
    for s in STREAMS:
        assert s in text
    assert "timeline: 0 node(s)" in str(Timeline([]))


# -- timeline data ------------------------------------------------------------------------------

def test_spans_sorted_and_queries():
    tl = hand_timeline()
    starts = [s.start_ms for s in tl.spans]
    assert starts == sorted(starts)
    assert [s.name for s in tl.spans_for("upload")] == ["alloc", "up0", "up1"]
    assert [s.name for s in tl.spans_for(engine="upload")] == ["up0", "up1"]
    assert [s.name for s in tl.spans_for("upload", engine="memory")] == ["alloc"]
    assert [s.name for s in tl.spans_for(batch=1)] == ["k1", "up1", "down1"]
    assert tl.span("k0").duration_ms == 5.0
    assert tl.engines == ("upload", "compute", "download", "memory")
    with pytest.raises(KeyError, match="no stream 'nope'"):
        tl.spans_for("nope")
    with pytest.raises(KeyError):
        tl.span("nope")


def test_timeline_validation():
    with pytest.raises(ValueError, match="before start_ms"):
        NodeSpan("x", "kernel", 0, "s", "compute", 2.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        NodeSpan("x", "kernel", 0, "s", "compute", float("nan"), 1.0)
    span = NodeSpan("x", "kernel", 0, "s", "compute", 0, 1)
    with pytest.raises(ValueError, match="not one of the timeline's streams"):
        Timeline([span], ("a", "b"))
    with pytest.raises(ValueError, match="distinct"):
        Timeline([], ("a", "a"))
    with pytest.raises(TypeError):
        Timeline([("x", 0, 1)])
    # streams without spans keep their track; streams default to order of first use
    assert Timeline([span], ("a", "s")).streams == ("a", "s")
    assert Timeline([span]).streams == ("s",)


def test_timeline_json_round_trip():
    tl = hand_timeline()
    back = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert back == tl
    with pytest.raises(ValueError, match="not an orchestra timeline"):
        Timeline.from_dict({"spans": []})


def test_span_from_graph_nodes():
    K = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)
    x, y, h = Buffer("x", 256, device=1), Buffer("y", 256, device=1), HostBuffer("h", 256)
    cases = [
        (Alloc("a", x, batch=2), "alloc", "memory", 256),
        (HostToDevice("up", h, x, batch=2), "h2d", "upload", 256),
        (KernelNode("k", K, 1, 32, (In(x), Out(y), 64, 1, 1.0, 0.5), batch=2), "kernel", "compute", None),
        (DeviceToHost("down", y, h, batch=2), "d2h", "download", 256),
        (Memset("m", x.range(0, 64), 0), "memset", "compute", 64),
        (HostFunc("hf", lambda: None), "host", "host", None),
    ]
    for node, kind, engine, nbytes in cases:
        s = NodeSpan.from_node(node, "s0", 1.0, 2.0)
        assert (s.name, s.kind, s.engine, s.nbytes, s.stream) == (node.name, kind, engine, nbytes, "s0")
        assert s.device == node.device
    assert NodeSpan.from_node(cases[0][0], "s0", 0, 1).batch == 2


# -- Chrome trace -------------------------------------------------------------------------------

def test_chrome_trace_json(tmp_path):
    tl = hand_timeline()
    path = write_chrome_trace(tl, tmp_path / "run.json")
    data = json.loads(open(path).read())
    assert data["displayTimeUnit"] == "ms"
    events = data["traceEvents"]
    assert isinstance(events, list)
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(tl.spans)
    assert sorted(e["name"] for e in xs) == sorted(s.name for s in tl.spans)
    threads = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert [t["args"]["name"] for t in threads] == list(STREAMS)
    assert len({(t["pid"], t["tid"]) for t in threads}) == len(STREAMS)
    tid = {t["args"]["name"]: t["tid"] for t in threads}
    for e in xs:
        s = tl.span(e["name"])
        assert e["pid"] == 0 and e["tid"] == tid[s.stream]
        assert e["ts"] == pytest.approx(s.start_ms * 1000) and e["dur"] == pytest.approx(s.duration_ms * 1000)
        assert e["args"]["kind"] == s.kind and e["args"]["engine"] == s.engine
        assert e["args"]["batch"] == s.batch and e["cat"] == s.engine
        assert e["args"].get("bytes") == s.nbytes
    assert tl.span("up0").nbytes / (4.0 * 1e6) == xs[[e["name"] for e in xs].index("up0")]["args"]["GB/s"]
    procs = [e for e in events if e["name"] == "process_name"]
    assert len(procs) == 1 and "eager" in procs[0]["args"]["name"]
    assert data["otherData"]["policy"] == "by-engine" and data["otherData"]["batches"] == 2


def test_chrome_trace_one_track_per_stream_even_if_idle():
    span = NodeSpan("x", "kernel", 0, "b", "compute", 0, 1)
    data = to_chrome_trace(Timeline([span], ("a", "b", "c")))
    names = [e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["a", "b", "c"]
    assert [e["tid"] for e in data["traceEvents"] if e["ph"] == "X"] == [1]
    with pytest.raises(TypeError):
        to_chrome_trace([span])


# -- Gantt PNG ----------------------------------------------------------------------------------

def test_plot_gantt_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install orchestra[plot])")
    tl = hand_timeline()
    path = plot_gantt(tl, tmp_path / "run.png", bound_ms=8.0)
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "run.png").stat().st_size > 1000
    plot_gantt(Timeline([]), tmp_path / "empty.png")  # an empty run still draws


def test_plot_gantt_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install orchestra\[plot\]"):
        trace_plot.plot_gantt(hand_timeline(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# -- NVTX ---------------------------------------------------------------------------------------

def test_nvtx_range_is_a_noop_without_nvtx(monkeypatch):
    monkeypatch.setattr(trace_nvtx, "_nvtx", None)
    assert not trace_nvtx.nvtx_available()
    ran = []
    with trace_nvtx.nvtx_range("node", "#1f77b4"):
        ran.append(1)
    assert ran == [1]
    with pytest.raises(ZeroDivisionError):  # exceptions pass through
        with trace_nvtx.nvtx_range("node"):
            1 / 0


def test_nvtx_module_imports_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    try:
        mod = importlib.reload(trace_nvtx)
        assert not mod.nvtx_available()
        with mod.nvtx_range("x", "green"):
            pass
    finally:
        monkeypatch.undo()
        importlib.reload(trace_nvtx)


def test_nvtx_range_with_the_package(monkeypatch):
    pytest.importorskip("nvtx", reason="nvtx not installed (pip install orchestra[nvtx])")
    calls = []

    class Fake:
        @staticmethod
        def push_range(message, color, domain):
            calls.append(("push", message, color, domain))

        @staticmethod
        def pop_range(domain):
            calls.append(("pop", domain))

    monkeypatch.setattr(trace_nvtx, "_nvtx", Fake)
    node = HostToDevice("b0.h2d", HostBuffer("h", 8), Buffer("x", 8))
    with trace_nvtx.node_range(node):
        pass
    assert calls == [("push", "b0.h2d", 0x1F77B4, "orchestra"), ("pop", "orchestra")]
    monkeypatch.undo()
    with trace_nvtx.nvtx_range("real", "#2ca02c"):  # the real package, no profiler attached
        pass


def test_timeline_analysis_imports_no_cuda(tmp_path):
    """Loading a saved timeline and exporting it works where cuda-bindings cannot load."""
    import subprocess

    path = tmp_path / "tl.json"
    path.write_text(json.dumps(hand_timeline().to_dict()))
    code = ("import sys, json, orchestra.trace as t; "
            f"tl = t.Timeline.from_dict(json.load(open({str(path)!r}))); "
            "t.to_chrome_trace(tl); tl.summary(); t.pipeline_bound_ms(tl); "
            "bad = sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr

"""GPU tests of the traced run (skipped without a device): the main job's timeline shows the three
engines overlapping, its Chrome trace has one X event per node and one track per stream, a traced
eager run leaks no handle, and ``orchestra run --trace`` writes a file that parses."""

import gc
import importlib.util
import json
import subprocess
import sys

import pytest

from orchestra.driver import MemoryPool, leaked, live_handles
from orchestra.trace import OVERLAP_ENGINES, intersect, to_chrome_trace, union

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(dev):
    """8 batches x 8 MiB, by-engine, kernel calibrated to the slower copy, one traced run."""
    from orchestra.app.job import MainJob

    return MainJob(batches=8, batch_mib=8, policy="by-engine", streams=3, repeat=2, warmup=1,
                   device=dev, trace=True).run()


def stream_busy(tl, stream):
    """Busy intervals of the stream's copy/compute nodes (alloc/free are not engine work)."""
    return union((s.start_ms, s.end_ms) for s in tl.spans_for(stream)
                 if s.engine in OVERLAP_ENGINES)


def test_main_job_timeline_shows_the_three_engines_overlapping(report):
    assert report.verified  # the traced run is verified like the timed ones
    assert len(report.wall_ms_runs) == 2  # and is not one of them
    tl = report.timeline
    assert tl is not None and len(tl) == report.nodes
    assert tl.streams == ("upload", "compute", "download") and tl.policy == "by-engine"
    assert {s.batch for s in tl.spans} == set(range(8))
    for s in tl.spans:
        assert 0.0 <= s.start_ms <= s.end_ms
    # upload / compute / download streams: busy intervals intersect pairwise
    up, comp, down = (stream_busy(tl, n) for n in tl.streams)
    for a, b, what in ((up, comp, "upload&compute"), (up, down, "upload&download"),
                       (comp, down, "compute&download")):
        both = sum(e - s for s, e in intersect(a, b))
        assert both > 0.0, f"{what}: the streams never ran at once\n{tl.summary()}"
    m = tl.metrics()
    assert all(v > 0.0 for v in m.pairs_ms.values()), tl.summary()
    # each engine's nodes stay on their own stream and keep their order there
    for name in tl.streams:
        spans = [s for s in tl.spans_for(name) if s.engine in OVERLAP_ENGINES]
        assert {s.engine for s in spans} == {name}
        assert all(x.end_ms <= y.start_ms + 1e-3 for x, y in zip(spans, spans[1:]))


def test_main_job_trace_json_has_one_event_per_node_and_one_track_per_stream(report):
    tl = report.timeline
    data = json.loads(json.dumps(to_chrome_trace(tl)))
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    tracks = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(xs) == len(tl) == report.nodes == 8 * 7
    assert sorted(e["name"] for e in xs) == sorted(s.name for s in tl.spans)
    assert sorted(tracks.values()) == sorted(tl.streams) and len(tracks) == 3
    for e in xs:
        assert tracks[e["tid"]] == e["args"]["stream"] and e["dur"] >= 0


def test_traced_eager_runs_leak_nothing(dev):
    from orchestra.app.job import MainJob

    pool = MemoryPool.default(dev)
    MainJob(batches=2, batch_mib=1, compute_iters=3, repeat=1, device=dev).run()  # warm: module
    gc.collect()
    dev.synchronize()
    used0, live0 = pool.used_bytes, live_handles()
    r = MainJob(batches=4, batch_mib=1, compute_iters=3, repeat=1, device=dev, trace=True).run()
    assert r.verified and len(r.timeline) == r.nodes
    gc.collect()
    dev.synchronize()
    assert pool.used_bytes == used0
    assert leaked(live0) == {}  # executor streams and events, tracer events, pinned memory


def test_orchestra_run_trace_writes_a_file_that_parses(tmp_path):
    trace = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "orchestra.cli.main", "run", "--trace", str(trace),
           "--batches", "4", "--batch-mib", "4", "--repeat", "2"]
    png = tmp_path / "run.png"
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", str(png)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(trace.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    tracks = [e for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert len(xs) == 4 * 7 and len(tracks) == 3
    assert f"Chrome trace {trace}: 28 node events, 3 tracks (one per stream)" in proc.stdout
    assert "overlap of upload/compute/download" in proc.stdout
    if "--plot" in cmd:
        assert png.read_bytes()[:4] == b"\x89PNG"

"""CPU tests of `orchestra bench peers` (orchestra.app.peers): workload parsing, the table,
ratios and JSON, skip notes when peers are absent, the output checks against numpy, and the
harness's rounds, checks and failure handling with fake contenders (no GPU)."""

import json
import sys
import types

import numpy as np
import pytest

from orchestra.app.job.bound import Sustained, pipeline_bound
from orchestra.app.peers import check as ck
from orchestra.app.peers import harness, optional
from orchestra.app.peers.report import PeersReport, Row, add_ratios, format_table, plot_ratios
from orchestra.app.peers.workloads import (
    BUILTIN, DEFAULT, Workload, expected_seconds, format_size, parse_workloads,
)
from orchestra.errors import BenchConfigError, MissingExtraError

# -- workloads --------------------------------------------------------------------------------


def test_the_default_is_the_five_builtins_in_order():
    ws = parse_workloads(DEFAULT)
    assert [w.key for w in ws] == ["a", "b", "c", "d", "e"]
    a, b, c, d, e = ws
    assert (a.batches, a.batch_bytes, a.iters) == (32, 64 << 20, None)
    assert (b.batches, b.batch_bytes) == (256, 4 << 20)
    assert (c.batches, c.batch_bytes, c.iters) == (1024, 64 << 10, 1)
    assert d.kind == "request" and d.requests == 2000 and d.batch_bytes == 64 << 10
    assert e.kind == "chain" and e.kernels == 1000
    assert sum(expected_seconds(w) for w in ws) < 240  # the whole run in under 4 minutes


def test_keys_names_all_custom_and_duplicates():
    ws = parse_workloads(" C, request ,a,A,32x64MiB ")
    assert [w.key for w in ws] == ["c", "d", "a"]
    assert parse_workloads("all") == list(BUILTIN)
    (w,) = parse_workloads("64x1MiB")
    assert (w.kind, w.batches, w.batch_bytes, w.iters, w.name) == (
        "pipeline", 64, 1 << 20, None, "64x1MiB")
    (w,) = parse_workloads("512x256KiB@3")
    assert (w.batches, w.batch_bytes, w.iters) == (512, 256 << 10, 3)
    assert w.label == "512 x 256 KiB" and w.nodes == 7 * 512
    assert parse_workloads("8x1.5m@auto")[0].batch_bytes == 3 << 19
    assert 10 < expected_seconds(parse_workloads("64x1MiB")[0]) < 60


@pytest.mark.parametrize("bad", ["", "z", "0x1MiB", "4x1GiB", "4x1MiB@0", "4x8", "x4MiB"])
def test_bad_workloads_say_what_is_valid(bad):
    with pytest.raises(BenchConfigError) as err:
        parse_workloads(bad)
    assert isinstance(err.value, ValueError)
    assert "a" in str(err.value) or "at least" in str(err.value)


def test_labels_and_node_counts():
    a, _, c, d, e = BUILTIN
    assert a.label == "(a) 32 x 64 MiB" and a.nodes == 224
    assert c.label == "(c) 1024 x 64 KiB"
    assert d.label == "(d) 1 x 64 KiB request" and d.nodes == 3
    assert e.label == "(e) chain of 1000 kernels" and e.nodes == 1000
    assert format_size(100) == "100 B" and format_size(3 << 10) == "3 KiB"


# -- report -----------------------------------------------------------------------------------


def _rows():
    return [Row("(a) w", "orchestra eager", "orchestra", "eager", 12.0, runs=5, efficiency=0.9,
                host_us_per_node=1.5),
            Row("(a) w", "orchestra capture replay", "orchestra", "graph", 10.0, runs=5,
                efficiency=1.08),
            Row("(a) w", "CuPy loop", "cupy", "eager", 15.0, runs=5, efficiency=0.72),
            Row("(a) w", "orchestra graph-build replay", "orchestra", "graph", 5.0,
                verified=False, note="3 of 9 elements differ"),
            Row("(d) r", "cuda-python bare", "cuda-python", "eager", 0.02, p99_ms=0.03),
            Row("(d) r", "PyTorch eager", "torch", "eager", 0.03, p99_ms=0.05)]


def test_ratios_are_to_the_fastest_verified_orchestra_row():
    rows = _rows()
    best = add_ratios(rows)
    assert best == {"(a) w": 10.0, "(d) r": None}  # the wrong 5 ms row does not count
    assert [r.ratio for r in rows[:4]] == [1.2, 1.0, 1.5, 0.5]
    assert rows[4].ratio is None and rows[5].ratio is None


def test_table_json_and_loud_bound_bug():
    rows = _rows()
    add_ratios(rows)
    rep = PeersReport("Fake GPU", {"python": "3.12"}, [
        {"label": "(a) w", "bound_line": "bound 9.000 ms (link-bound)"}], rows,
        ["PyTorch is not installed (pip install torch); its rows are left out"], 5)
    text = rep.format()
    lines = text.splitlines()
    assert lines[0] == "orchestra bench peers: Fake GPU (python 3.12)"
    assert "(a) w: bound 9.000 ms (link-bound)" in lines
    header = next(x for x in lines if x.startswith("workload"))
    for col in ("wall ms", "p99 ms", "efficiency", "host us/node", "x orchestra best", "output"):
        assert col in header
    eager = next(x for x in lines if "orchestra eager" in x)
    assert "12.000" in eager and "0.900" in eager and "1.50" in eager and "1.20" in eager
    assert any("WRONG" in x and "3 of 9 elements differ" in x for x in lines)
    assert "skipped: PyTorch is not installed" in text
    assert "!" * 78 in text and "BOUND BUG: (a) w orchestra capture replay efficiency 1.080" in text
    assert "VERIFICATION FAILED: (a) w orchestra graph-build replay" in text
    assert not rep.verified and len(rep.bound_bugs) == 1
    d = json.loads(json.dumps(rep.as_dict()))
    assert d["verified"] is False and d["bound_bugs"] == rep.bound_bugs
    assert d["rows"][0]["contender"] == "orchestra eager" and d["rows"][0]["ratio"] == 1.2
    assert d["skipped"] == rep.skipped and d["repeat"] == 5
    # a blank line between workloads; dashes where there is nothing
    assert "" in format_table(rows).splitlines()
    bare = next(x for x in lines if "cuda-python bare" in x)
    assert " - " in bare


def test_rows_refuse_an_unknown_family():
    with pytest.raises(BenchConfigError, match="family"):
        Row("w", "x", "numba", "eager", 1.0)


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingExtraError, match=r"pip install orchestra\[plot\]"):
        plot_ratios(_rows(), "x.png")


def test_plot_draws_the_ratios(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _rows()
    add_ratios(rows)
    path = plot_ratios(rows, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000 and path.endswith("r.png")


# -- optional peers ----------------------------------------------------------------------------


def _importer(modules):
    def imp(name):
        got = modules[name]
        if isinstance(got, BaseException):
            raise got
        return got
    return imp


def test_a_missing_peer_is_a_skip_note():
    missing = ImportError("No module named 'cupy'", name="cupy")
    broken = ImportError("libcudart.so.12: cannot open shared object file", name="cupy_backends")
    cpu_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    s = optional.probe("cupy", _importer({"cupy": missing}))
    assert isinstance(s, optional.Skip) and "CuPy is not installed" in s.note
    assert "pip install cupy" in s.note and "left out" in s.note
    s = optional.probe("cupy", _importer({"cupy": broken}))
    assert "CuPy does not import: libcudart" in s.note
    s = optional.probe("torch", _importer({"torch": cpu_torch}))
    assert "PyTorch cannot use the GPU" in s.note and "is_available() is False" in s.note
    s = optional.probe("torch", _importer({"torch": RuntimeError("boom")}))
    assert "PyTorch does not import: RuntimeError: boom" in s.note
    gpu_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True),
                                      __version__="9.9")
    assert optional.probe("torch", _importer({"torch": gpu_torch})) is gpu_torch
    with pytest.raises(BenchConfigError):
        optional.probe("numba")


def test_probe_peers_collects_notes_and_skips():
    gpu_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))

    def prober(name):
        if name == "cupy":
            return optional.Skip("cupy", "CuPy is not installed")
        return gpu_torch

    peers, notes = harness.probe_peers((), prober)
    assert peers == {"torch": gpu_torch} and notes == ["CuPy is not installed"]
    peers, notes = harness.probe_peers({"torch"}, prober)
    assert peers == {} and notes == ["CuPy is not installed", "PyTorch: left out (--skip)"]


def test_contender_lists_leave_absent_peers_out():
    w = types.SimpleNamespace()
    names = [n for n, _ in harness.pipeline_contenders(w, {})]
    assert names == ["orchestra eager", "orchestra capture", "orchestra graph-build",
                     "cuda-python classic loop", "cuda-python by-engine",
                     "cuda-python bare graph"]
    both = {"cupy": object(), "torch": object()}
    names = [n for n, _ in harness.pipeline_contenders(w, both)]
    assert names[-4:] == ["CuPy loop", "CuPy graph", "PyTorch loop", "PyTorch graph"]
    req = [n for n, _ in harness.request_contenders(w, {"torch": object()})]
    assert "PyTorch graph" in req and not any(n.startswith("CuPy") for n in req)
    chain = [n for n, _ in harness.chain_contenders(w, {"cupy": object(), "torch": object()})]
    assert chain[-2:] == ["CuPy stream", "CuPy graph"]  # no PyTorch chain: no way to run it
    assert sum("pdl=True" in n for n in chain) == 4  # eager, capture, bare stream and graph


# -- output checks -----------------------------------------------------------------------------


def test_negate_is_exact_and_matches_fmaf_on_zero():
    x = np.array([0.0, 1.5, 0.25, 3e-39, 0.999], np.float32)
    got = ck.negate(x)
    assert got.dtype == np.float32
    assert np.array_equal(got, -x)
    assert np.signbit(got[0]) == np.False_  # fmaf(+0, -1, 0) = -0 + 0 = +0
    assert ck.negate(ck.negate(x)).tobytes() == x.tobytes()
    assert [ck.odd_iters(i) for i in (0, 1, 2, 7, 1200)] == [1, 1, 3, 7, 1201]


def test_check_negated_catches_what_it_must():
    x = np.random.default_rng(0).random(10_000, dtype=np.float32)
    y = ck.negate(x)
    assert ck.check_negated(x, y) == (True, "all 10000 elements match")
    skipped_kernel = x.copy()
    ok, detail = ck.check_negated(x, skipped_kernel)
    assert not ok and "10000 of 10000 elements differ" in detail
    never_written = y.copy()
    never_written[1234] = np.nan
    ok, detail = ck.check_negated(x, never_written)
    assert not ok and "first at 1234" in detail
    swapped = np.concatenate([y[5000:], y[:5000]])  # batches routed to the wrong place
    assert not ck.check_negated(x, swapped)[0]
    with pytest.raises(BenchConfigError):
        ck.check_negated(x, y[:10])


def test_samples_cover_every_batch():
    idx = ck.sample_indices(10_000, 1000, stride=4099)
    for b in range(10):
        assert b * 1000 in idx and b * 1000 + 999 in idx
    assert 4099 in idx and 8198 in idx and idx[-1] == 9999 and np.all(np.diff(idx) > 0)
    x = np.random.default_rng(1).random(10_000, dtype=np.float32)
    y = ck.negate(x)
    assert ck.check_sample(x, y, idx)[0]
    y[999] = 0.5  # the last element of the first batch
    ok, detail = ck.check_sample(x, y, idx)
    assert not ok and detail.startswith("sampled 1 of")
    y2 = ck.negate(x)
    ck.poison(y2, idx)
    assert np.isnan(y2[idx]).all() and not np.isnan(np.delete(y2, idx)).any()
    assert ck.check_equal(ck.negate(x), ck.negate(x))[0]
    with pytest.raises(BenchConfigError):
        ck.sample_indices(0, 1)


# -- the harness with fake contenders -----------------------------------------------------------


class FakePipe:
    """The parts of `harness.PipelineData` the rounds use, on host arrays."""

    def __init__(self, batches=4, n=1024, sample=False):
        self.spec = Workload("t", "t", "pipeline", 4 * n, batches)
        self.n, self.batches = n, batches
        self.x = np.random.default_rng(3).random(n * batches, dtype=np.float32)
        self.y = np.zeros_like(self.x)
        self.sample = ck.sample_indices(self.x.size, n, stride=97) if sample else None
        self.bound = pipeline_bound(Sustained(4 * n, 4, 1.0, 1.0, 1.0, 1.0), batches)
        self.polls = []

    poison = harness.PipelineData.poison
    check = harness.PipelineData.check


class Good:
    family, mode, host_us = "orchestra", "eager", None

    def __init__(self, w, name="good", family="orchestra", writes=None):
        self.w, self.name, self.family = w, name, family
        self.writes = writes or (lambda w: ck.negate(w.x))
        self.calls, self.closed = 0, False

    def __call__(self):
        self.calls += 1
        self.w.y[:] = self.writes(self.w)
        self.host_us = 2.0 * self.w.spec.nodes

    def note(self):
        return "a note"

    def close(self):
        self.closed = True


def test_pipeline_rounds_check_every_run_and_drop_failures():
    w = FakePipe()
    made = {}

    def make(name, **kw):
        def f():
            made[name] = Good(w, name, **kw)
            return made[name]
        return (name, f)

    class Flaky(Good):
        def __call__(self):
            super().__call__()
            if self.calls == 3:
                raise RuntimeError("lost the context")

    def flaky():
        made["flaky"] = Flaky(w, "flaky", family="cupy")
        return made["flaky"]

    def broken():
        raise OSError("libcupy.so: not found")

    factories = [make("ours"), make("peer", family="torch"),
                 make("skips kernel", family="cuda-python", writes=lambda w: w.x),
                 ("flaky", flaky), ("broken", broken)]
    skipped, logs = [], []
    rows = harness.run_pipeline(w, {}, 3, skipped, logs.append, factories)
    assert [r.contender for r in rows] == ["ours", "peer", "skips kernel"]
    ours, peer, bad = rows
    assert made["ours"].calls == 4 and ours.runs == 3 and len(ours.wall_ms_runs) == 3
    assert ours.verified and ours.note == "a note" and ours.host_us_per_node == 2.0
    assert ours.efficiency == pytest.approx(w.bound.bound_ms / ours.wall_ms)
    assert peer.family == "torch" and peer.verified
    assert not bad.verified and "elements differ" in bad.note
    assert any("broken: could not be built (OSError: libcupy.so: not found)" in s
               for s in skipped)
    assert any("flaky: failed in round 2 (RuntimeError: lost the context)" in s
               for s in skipped)
    assert all(c.closed for c in made.values())


def test_pipeline_sampled_rounds_still_catch_an_unwritten_output():
    w = FakePipe(sample=True)
    state = {"n": 0}

    def lazy(w):  # writes everything in round 0, then leaves the output alone
        state["n"] += 1
        return ck.negate(w.x) if state["n"] == 1 else w.y

    rows = harness.run_pipeline(w, {}, 2, [], lambda m: None,
                                [("lazy", lambda: Good(w, "lazy", writes=lazy))])
    assert not rows[0].verified and "sampled" in rows[0].note


class FakeRequest:
    def __init__(self, requests=250):
        self.spec = Workload("d", "request", "request", 4096, 1, 1, requests=requests)
        self.x = np.random.default_rng(4).random(1024, dtype=np.float32)
        self.y = np.zeros_like(self.x)
        self.want = ck.negate(self.x)
        self.bound = pipeline_bound(Sustained(4096, 1, 0.001, 0.001, 0.001, 0.001), 1)


def test_requests_are_each_poisoned_timed_and_checked():
    r = FakeRequest()
    calls = {"good": 0, "bad": 0}

    class Req:
        family, mode, host_us = "cuda-python", "eager", None

        def __init__(self, name, ok_every=1):
            self.name, self.ok_every = name, ok_every
            self.closed = False

        def __call__(self):
            calls[self.name] += 1
            if calls[self.name] % self.ok_every:
                return  # leaves the poison in the output
            r.y[:] = r.want

        def note(self):
            return ""

        def close(self):
            self.closed = True

    rows = harness.run_requests(r, {}, [], lambda m: None,
                                [("good", lambda: Req("good")), ("bad", lambda: Req("bad", 10))])
    good, bad = rows
    assert calls["good"] == harness.REQUEST_WARMUP + 250 and good.runs == 250
    assert good.verified and good.p99_ms >= good.wall_ms > 0
    assert good.efficiency == pytest.approx(r.bound.bound_ms / good.wall_ms)
    assert not bad.verified and bad.note.startswith("270 wrong outputs")


class FakeChain:
    def __init__(self):
        self.spec = Workload("e", "chain", "chain", 1024, kernels=10)
        self.kernels = 10
        self.x0 = np.arange(256, dtype=np.float32)
        self.want = self.x0 + np.float32(10)
        self.buf = None

    def reset(self):
        self.buf = self.x0.copy()

    def result(self):
        return self.buf


def test_chain_runs_reset_and_check_with_own_or_shared_buffers():
    c = FakeChain()

    class Shared:
        family, mode, name, host_us = "orchestra", "eager", "shared", None

        def __call__(self):
            assert np.array_equal(c.buf, c.x0)  # reset before every run
            c.buf = c.buf + np.float32(c.kernels)
            self.host_us = 5.0 * c.kernels

        def note(self):
            return ""

        def close(self):
            pass

    class Own(Shared):
        name, family = "own", "cupy"

        def reset(self):
            self.mine = c.x0.copy()

        def result(self):
            return self.mine + np.float32(9)  # one link short

        def __call__(self):
            self.host_us = None

    rows = harness.run_chain(c, {}, 4, [], lambda m: None,
                             [("shared", Shared), ("own", Own)])
    shared, own = rows
    assert shared.verified and shared.runs == 4 and shared.host_us_per_node == 5.0
    assert shared.efficiency is None
    assert not own.verified and own.host_us_per_node is None


# -- the command line ----------------------------------------------------------------------------


def test_cli_refuses_bad_options_before_any_gpu_work(capsys):
    from orchestra.cli.main import main

    assert main(["bench", "peers", "--workloads", "a,zz"]) == 2
    assert "unknown workload 'zz'" in capsys.readouterr().err
    assert main(["bench", "peers", "--skip", "numba"]) == 2
    assert "--skip numba: unknown peer; choose from cupy, torch" in capsys.readouterr().err
    assert main(["bench", "peers", "--repeat", "0"]) == 2
    assert "--repeat 0" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_is_a_usage_error(monkeypatch, capsys):
    import importlib.util

    from orchestra.cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "peers", "--plot", "r.png"]) == 2
    assert "pip install orchestra[plot]" in capsys.readouterr().err


def test_cli_help_gives_the_expected_time_per_workload(capsys):
    from orchestra.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "peers", "--help"])
    out = capsys.readouterr().out
    for w in BUILTIN:
        assert f"{w.key}  {w.name}" in out and f"~{w.expected_s:.0f} s" in out
    assert "the default (all five): ~110 s" in out


# -- orchestra's pipeline contenders pick what `--policy auto` would ---------------------------


def test_graph_rows_run_two_compute_streams_where_the_kernel_is_smaller_than_the_gpu():
    """(b) 256 x 4 MiB: copies on the copy engines; with a burn kernel smaller than the GPU
    (`PipelineData.kernel_fills_gpu` False) the capture and graph-build rows get by-engine on
    4 streams (two compute streams), eager keeps 3, and the bound is measured over 4."""
    from orchestra.app.job.policy import OVERLAP_NOTE
    from orchestra.app.peers.orchestra_side import pipeline_policy
    from orchestra.errors import JobConfigTypeError
    from orchestra.execute import DEFAULT_CROSSOVER, CopyPolicy
    from tests.fake_cuda import FakeDevice

    graph, eager = (CopyPolicy("auto", m, DEFAULT_CROSSOVER, True) for m in ("graph", "eager"))
    b = types.SimpleNamespace(batches=256, batch_bytes=4 << 20, kernel_fills_gpu=False)
    for kind in ("capture", "graph-build"):
        c = pipeline_policy(b, graph, executor=f"{kind} executor")
        assert (c.policy, c.streams) == ("by-engine", 4) and OVERLAP_NOTE in c.reason
    c = pipeline_policy(b, eager, executor="eager executor")
    assert (c.policy, c.streams) == ("by-engine", 3)
    assert pipeline_policy(b, graph, "by-engine", 3, "graph-build executor").streams == 3
    full = types.SimpleNamespace(batches=256, batch_bytes=4 << 20, kernel_fills_gpu=True)
    unknown = types.SimpleNamespace(batches=256, batch_bytes=4 << 20)
    for w in (full, unknown):
        assert pipeline_policy(w, graph, executor="graph-build executor").streams == 3
    dev = FakeDevice()
    assert harness.bound_streams(dev, b) == 4  # the graph rows' 4 streams
    assert harness.bound_streams(dev, full) == harness.bound_streams(dev, unknown) == 3
    with pytest.raises(JobConfigTypeError, match="kernel_fills_gpu"):
        pipeline_policy(types.SimpleNamespace(batches=4, batch_bytes=4 << 20,
                                              kernel_fills_gpu=1), graph)


@pytest.fixture
def graph_fake(monkeypatch):
    from tests import fake_graph_cuda as fg

    return fg.install(monkeypatch)


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
@pytest.mark.parametrize("fills,streams", [(False, 4), (True, 3), (None, 3)])
def test_orchestra_graph_pipeline_rows_on_the_graph_fake(graph_fake, kind, fills, streams):
    """`OrchestraPipeline` replayed on the graph fake: the row name and plan say the streams
    auto picked, batch kernels alternate over compute0 / compute1 on 4, and every output is
    the negated input (the burn kernel's s = -1, t = 0 with an odd iteration count)."""
    from orchestra.app.job.graphs import burn_grid
    from orchestra.app.peers.orchestra_side import OrchestraPipeline
    from tests import fake_graph_cuda as fg

    batches, n = 6, 2048
    w = types.SimpleNamespace(
        dev=graph_fake.device, resolver=fg.resolver(graph_fake), batches=batches,
        batch_bytes=4 * n, grid=burn_grid(n, harness.BLOCK, graph_fake.device.sm_count),
        block=harness.BLOCK, iters=3, burn_st=harness.BURN_ST, kernel_fills_gpu=fills,
        x=np.random.default_rng(2).random(batches * n, dtype=np.float32),
        y=np.full(batches * n, np.nan, np.float32))
    op = OrchestraPipeline(w, kind)
    try:
        assert op.name == f"orchestra {kind} replay (by-engine, {streams} streams)"
        assert (op.choice.policy, op.choice.streams) == ("by-engine", streams)
        names = sorted(s.name for s in op.plan.streams)
        compute = ["compute0", "compute1"] if streams == 4 else ["compute"]
        assert names == sorted(["upload", "download", *compute])
        assert [op.plan.node_stream[f"b{b}.kernel"] for b in range(batches)] == \
            [compute[b % len(compute)] for b in range(batches)]
        op()
        assert op.host_us is not None
        ok, detail = ck.check_negated(w.x, w.y)
        assert ok, detail
        assert np.array_equal(w.y, ck.negate(w.x))
    finally:
        op.close()

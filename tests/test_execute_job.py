"""The main job without a GPU: sizes and grids, seeded data, the numpy reference and its checks,
iteration calibration, and `MainJob` end to end (generated data and an --input file through the
staging slots) on the fake driver of tests/fake_cuda.py."""

import os
from pathlib import Path

import numpy as np
import pytest

import orchestra.driver as od
import orchestra.execute as oe
from orchestra.execute import EagerExecutor, KernelResolver
from orchestra.execute import staging as staging_mod
from orchestra.app.job import (
    MainJob,
    Sustained,
    batch_bytes_from_mib,
    batch_sizes,
    burn_grid,
    calibrate_iters,
    parse_iters,
)
from orchestra.app.job import data as jd
from orchestra.app.job import main_job as mj
from orchestra.app.job.timing import SingleBatch
from orchestra.errors import JobInputError
from orchestra.schedule import POLICIES
from tests.fake_cuda import FakeCuda, FakeKernel, patch_eager_tracer


def test_sizes_and_grid():
    assert batch_bytes_from_mib(64) == 64 << 20
    assert batch_bytes_from_mib(0.001) == 1048  # whole float32 elements
    assert batch_bytes_from_mib(1e-9) == 4
    with pytest.raises(ValueError):
        batch_bytes_from_mib(0)
    assert batch_sizes(10, 4) == [16, 16, 8]
    assert batch_sizes(8, 4) == [16, 16]
    assert burn_grid(16 << 20, 256, 132) == 528
    assert burn_grid(1000, 256) == 1
    assert burn_grid(1 << 20, 256) == 1024
    assert parse_iters("auto") is None and parse_iters(None) is None and parse_iters("7") == 7
    # without sustained times the bound comes from the single-batch times, pairs as fast as
    # the slower copy: h + k + d + (N - 1) * max for a balanced pipeline
    sb = SingleBatch(4096, 9, 1.0, 2.0, 1.5, 7)
    assert sb.bound(10).bound_ms == pytest.approx(1 + 10 * 2 + 1.5)
    # with them, the sustained times count (pairs slower than either copy: link-bound)
    sb = SingleBatch(4096, 9, 1.5, 1.5, 1.5, 7, Sustained(4096, 8, 1.0, 1.0, 1.0, 1.1))
    assert sb.bound(32).bound_ms == pytest.approx(4 + 30 * 1.1)
    assert sb.bound(32).limiter == "link"


def test_calibrate_iters_hits_the_target():
    calls = []

    def kernel_ms(iters):  # a fixed cost plus a per-iteration cost, slightly nonlinear
        calls.append(iters)
        return 0.02 + 0.0005 * iters * (1 + 1e-5 * iters)
    iters, t = calibrate_iters(kernel_ms, 1.2)
    assert abs(t - 1.2) / 1.2 < 0.02
    assert len(calls) <= 4
    assert calibrate_iters(lambda i: 0.01, 1.0, max_iters=5000)[0] <= 5000  # flat: clamped
    with pytest.raises(ValueError):
        calibrate_iters(kernel_ms, 0)


def test_fill_uniform_is_seeded_and_chunk_stable(monkeypatch):
    monkeypatch.setattr(jd, "CHUNK", 1000)
    a = np.empty(4500, np.float32)
    jd.fill_uniform(a, 7)
    b = np.empty(4500, np.float32)
    jd.fill_uniform(b, 7)
    assert np.array_equal(a, b) and ((0 <= a) & (a < 1)).all()
    monkeypatch.setattr(jd, "workers", lambda: 1)
    c = np.empty(4500, np.float32)
    jd.fill_uniform(c, 7)
    assert np.array_equal(a, c)
    jd.fill_uniform(c, 8)
    assert not np.array_equal(a, c)


def test_reference_converges_to_a_constant_and_checks(monkeypatch):
    monkeypatch.setattr(jd, "CHUNK", 1 << 12)
    x = np.empty(3 * (1 << 12) + 5, np.float32)
    jd.fill_uniform(x, 0)
    ref = jd.Reference.build(x, 2000)
    assert all(not isinstance(p, np.ndarray) and p == 2.0 for p in ref.parts)
    assert ref.nbytes == 0  # nothing stored for a converged reference
    out = np.full_like(x, 2.0)
    assert ref.compare(out).ok
    out[5000] = np.nan
    chk = ref.compare(out)
    assert not chk.ok and chk.mismatches == 1 and chk.first[0] == 5000
    assert "first at index 5000" in chk.describe()
    # few iterations: the output still depends on the input, so a swap is caught
    short = jd.Reference.build(x, 3)
    assert short.nbytes == x.nbytes
    good = jd.burn_reference(x, 3)
    assert short.compare(good).ok and jd.check_against(x, good, 3).ok
    swapped = good.copy()
    swapped[:100], swapped[100:200] = good[100:200], good[:100]
    assert not jd.check_against(x, swapped, 3).ok
    assert not short.compare(swapped).ok
    # and the converged output cannot tell: that is why the job runs a routing check
    assert jd.Reference.build(x, 2000).compare(np.full_like(x, 2.0)).ok


def test_burn_reference_stops_early_and_matches_the_full_loop():
    x = np.random.default_rng(3).random(1000, dtype=np.float32)
    full = x.copy()
    for _ in range(100):
        full = full * np.float32(0.5) + np.float32(1)
    assert np.array_equal(jd.burn_reference(x, 100), full)
    assert np.array_equal(jd.burn_reference(x, 0), x)


def test_poison():
    a = np.zeros(10, np.float32)
    jd.poison(a)
    assert np.isnan(a).all()


# -- MainJob on the fake driver --------------------------------------------------------------

class FakePinned:
    """`PinnedBuffer` look-alike over a numpy array."""

    def __init__(self, nbytes, device=None):
        self._mem = np.zeros(nbytes, np.uint8)
        self.nbytes = nbytes
        self.closed = False
        self._shape, self._dtype = (nbytes,), np.dtype(np.uint8)

    @classmethod
    def empty(cls, shape, dtype=np.float32, device=None):
        dtype = np.dtype(dtype)
        shape = (shape,) if np.ndim(shape) == 0 else tuple(shape)
        b = cls(int(np.prod(shape)) * dtype.itemsize)
        b._shape, b._dtype = shape, dtype
        return b

    @property
    def array(self):
        return self.view(self._dtype, self._shape)

    def view(self, dtype=np.uint8, shape=None):
        dtype = np.dtype(dtype)
        if shape is None:
            shape = (self.nbytes // dtype.itemsize,)
        shape = (shape,) if np.ndim(shape) == 0 else tuple(shape)
        return self._mem[:int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    def close(self):
        self.closed = True


class FakeStreamObj:
    def __init__(self, device=None, priority=0):
        self.closed = False

    def close(self):
        self.closed = True


def patch_main_job(monkeypatch, fake, make_executor, fake_timings) -> None:
    """The main job on ``fake`` (a `FakeCuda`): fake pinned buffers and streams, executors from
    ``make_executor``, device timings from ``fake_timings`` (a `MainJob._timings`)."""
    monkeypatch.setattr(od, "PinnedBuffer", FakePinned)
    monkeypatch.setattr(staging_mod, "PinnedBuffer", FakePinned)
    monkeypatch.setattr(od, "Stream", FakeStreamObj)
    monkeypatch.setattr(oe, "make_executor", make_executor)
    monkeypatch.setattr("orchestra.driver.device.as_device", lambda d=None: fake.device)
    monkeypatch.setattr(mj.MainJob, "_timings", fake_timings)


@pytest.fixture
def fake_job(monkeypatch):
    fake = FakeCuda(monkeypatch)
    made = []

    def make_executor(name="eager", device=None, *, verify=True, copy_lowering="auto"):
        ex = EagerExecutor(kernel_resolver=KernelResolver(fake.device,
                                                          lambda r, d: FakeKernel()),
                           verify=verify, copy_lowering=copy_lowering)
        made.append(ex)
        return ex

    timings = []

    def fake_timings(self, kernel, stream, host_in, host_out, grid, batches):
        assert host_in.dtype == np.float32 and host_in.size == host_out.size
        timings.append((host_in.size, grid, batches))
        return SingleBatch(host_in.nbytes, self.iters if self.iters is not None else 40,
                           1.0, 1.0, 1.0, 7,
                           Sustained(host_in.nbytes, min(batches, 16), 1.0, 1.0, 1.0, 1.25))

    patch_main_job(monkeypatch, fake, make_executor, fake_timings)
    fake.made, fake.timings = made, timings
    return fake


@pytest.mark.parametrize("policy", POLICIES)
def test_main_job_generated_data_on_the_fake(fake_job, policy):
    job = MainJob(batches=5, batch_mib=0.01, streams=3, policy=policy, compute_iters=6,
                  repeat=3, seed=1, elements=5 * 2621 - 100)  # ragged last batch
    r = job.run()
    assert r.verified and r.routing_check is True and r.mismatches == 0
    assert r.batches == 5 and r.data_bytes == 4 * (5 * 2621 - 100)
    assert r.compute_iters == 6 and not r.compute_iters_auto
    assert len(r.wall_ms_runs) == 3 and r.wall_ms > 0
    n_eff = r.data_bytes / r.batch_bytes
    f = (r.data_bytes - 4 * r.batch_bytes) / r.batch_bytes  # the ragged last batch
    # link-bound: fill and drain at the smallest batch, the rest of both directions at once
    assert r.bound_limiter == "link" and r.sustained["pair_ms"] == 1.25
    assert r.bound_ms == pytest.approx(4 * f + 1.25 * (n_eff - 2 * f))
    assert r.bound_terms["upload"] == pytest.approx(n_eff + 2 * f)
    assert r.efficiency == pytest.approx(r.bound_ms / r.wall_ms)
    assert fake_job.timings[-1][2] == 5  # K comes from the job's batch count
    assert fake_job.used == 0
    assert all(ex.closed for ex in fake_job.made)
    d = r.as_dict()
    for key in ("batches", "wall_ms", "bound_ms", "efficiency", "verified", "t_h2d_ms",
                "t_kernel_ms", "t_d2h_ms", "policy", "streams", "compute_iters", "bytes",
                "bound_limiter", "bound_terms", "sustained", "bound_warning"):
        assert key in d
    assert d["bytes"] == 2 * r.data_bytes


def test_main_job_detects_a_wrong_kernel(fake_job, monkeypatch):
    # the kernel writes nothing: the D2H copies whatever the output allocation held
    monkeypatch.setattr(fake_job, "cuLaunchKernel",
                        lambda func, *a: (fake_job._call("cuLaunchKernel", a[7]),))
    r = MainJob(batches=2, batch_mib=0.01, compute_iters=5, repeat=1).run()
    assert not r.verified and r.routing_check is False
    assert r.mismatches == 2 * 2621 and "element(s) differ; first at index" in r.check


def test_main_job_streams_an_input_file_through_staging_slots(fake_job, tmp_path):
    src = np.random.default_rng(5).random((37, 1000), dtype=np.float32)
    inp, outp = tmp_path / "in.npy", tmp_path / "out.npy"
    np.save(inp, src)
    job = MainJob(batch_mib=0.02, compute_iters=4, repeat=2, input=inp, output=outp,
                  staging_slots=2, policy="by-engine")
    r = job.run()
    assert r.verified and r.routing_check is True
    assert r.batches == -(-37000 // 5242)  # 0.02 MiB = 5242 floats per batch
    result = np.load(outp)
    assert result.shape == src.shape
    np.testing.assert_array_equal(result, jd.burn_reference(src.reshape(-1), 4).reshape(src.shape))
    assert fake_job.used == 0 and r.input == str(inp) and r.output == str(outp)


def test_main_job_input_file_fortran_order_and_dtype(fake_job, tmp_path):
    src = np.asfortranarray(np.random.default_rng(6).random((50, 30), dtype=np.float32))
    inp, outp = tmp_path / "f.npy", tmp_path / "g.npy"
    np.save(inp, src)
    assert MainJob(batch_mib=0.001, compute_iters=2, repeat=1, input=inp, output=outp).run().verified
    np.testing.assert_array_equal(np.load(outp), jd.burn_reference(src, 2))
    np.save(inp, src.astype(np.float64))
    with pytest.raises(ValueError, match="float64; orchestra run --input streams float32"):
        MainJob(input=inp).run()


def test_main_job_auto_iters_uses_the_calibrated_value(fake_job):
    r = MainJob(batches=2, batch_mib=0.01, repeat=1).run()  # fake timing "calibrates" to 40
    assert r.compute_iters == 40 and r.compute_iters_auto and r.verified


# -- the traced run (MainJob(trace=True), orchestra run --trace/--plot) ------------------------

def test_main_job_trace_is_one_extra_verified_run_after_the_timed_ones(fake_job, monkeypatch):
    made = patch_eager_tracer(monkeypatch)
    r = MainJob(batches=4, batch_mib=0.01, compute_iters=5, repeat=2, warmup=1,
                trace=True).run()
    assert r.verified and len(r.wall_ms_runs) == 2  # the traced run is not a timed one
    tl = r.timeline
    assert len(tl) == r.nodes == 4 * 7 and tl.streams == ("upload", "compute", "download")
    assert {s.batch for s in tl.spans} == {0, 1, 2, 3}
    assert made and all(e.closed for e in made)  # the tracer closed with the executor
    assert "timeline" not in r.as_dict()
    untraced = MainJob(batches=2, batch_mib=0.01, compute_iters=5, repeat=1).run()
    assert untraced.timeline is None


def test_main_job_trace_with_an_input_file(fake_job, monkeypatch, tmp_path):
    patch_eager_tracer(monkeypatch)
    src = np.random.default_rng(7).random(9000, dtype=np.float32)
    inp = tmp_path / "in.npy"
    np.save(inp, src)
    r = MainJob(batch_mib=0.01, compute_iters=3, repeat=1, input=inp, staging_slots=2,
                trace=True).run()
    assert r.verified and len(r.timeline) == r.nodes
    assert {s.kind for s in r.timeline.spans} >= {"host", "h2d", "kernel", "d2h"}


def test_cli_run_trace_and_plot_on_the_fake(fake_job, monkeypatch, tmp_path, capsys):
    import json

    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install orchestra[plot])")

    from orchestra.cli.main import main

    patch_eager_tracer(monkeypatch)
    monkeypatch.setattr(od.Device, "get", classmethod(lambda cls, ordinal=0: fake_job.device))
    trace, png = tmp_path / "run.json", tmp_path / "run.png"
    assert main(["run", "--batches", "4", "--batch-mib", "0.01", "--compute-iters", "3",
                 "--repeat", "2", "--trace", str(trace), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    data = json.loads(trace.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    tracks = [e for e in data["traceEvents"] if e.get("name") == "thread_name"]
    assert len(xs) == 4 * 7 and len(tracks) == 3  # one per node, one per stream
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "traced run (one extra run after the timed ones" in out
    assert f"Chrome trace {trace}: 28 node events, 3 tracks (one per stream)" in out
    assert "upload" in out and "overlap of upload/compute/download" in out
    assert "efficiency" in out and f"Gantt chart {png}" in out
    # --json carries the same numbers
    assert main(["run", "--batches", "4", "--batch-mib", "0.01", "--compute-iters", "3",
                 "--repeat", "1", "--trace", str(trace), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["trace"]["nodes"] == 28 and d["trace"]["tracks"] == 3
    assert d["trace"]["trace_file"] == str(trace) and d["trace"]["plot_file"] is None
    assert set(d["trace"]["busy_ms"]) >= {"upload", "compute", "download"}


def test_main_job_block_over_the_limit_is_refused_before_any_timing_or_run(fake_job):
    with pytest.raises(ValueError, match=r"launch of burn: block \(2048, 1, 1\) has 2048 threads, "
                                         r"above the device's max threads per block \(1024\)"):
        MainJob(batches=2, batch_mib=0.01, compute_iters=3, repeat=1, block=2048).run()
    assert fake_job.timings == [] and fake_job.driver_calls() == []
    assert all(ex.closed for ex in fake_job.made)


# -- --input files: one check for run and plan (orchestra.app.job.inputs) --------------------------

BAD_INPUTS = {
    "float64": (lambda: np.ones(1000), "the array is float64; orchestra run --input streams "
                "float32 (little-endian) arrays: convert it with np.save(path, a.astype(np.float32))"),
    "int64": (lambda: np.arange(1000, dtype=np.int64), "the array is int64; orchestra run --input"),
    "big-endian": (lambda: np.ones(1000, ">f4"), "the array is >f4; orchestra run --input"),
    "empty": (lambda: np.zeros((0, 3), np.float32), "the array is empty"),
    "npz": (None, "not a .npy array (NpzFile); --input takes one array saved with np.save"),
    "garbage": (None, "not a .npy array numpy can load"),
}


@pytest.mark.parametrize("bad", BAD_INPUTS)
def test_run_and_plan_refuse_the_same_input_files_with_the_same_message(
        fake_job, monkeypatch, tmp_path, capsys, bad):
    from orchestra.cli.main import main

    make, want = BAD_INPUTS[bad]
    path = tmp_path / ("x.npz" if bad == "npz" else "x.npy")
    if bad == "npz":
        np.savez(path, a=np.ones(10, np.float32))
    elif bad == "garbage":
        path.write_bytes(b"not numpy at all")
    else:
        np.save(path, make())
    with pytest.raises(ValueError) as info:
        MainJob(input=path, compute_iters=3, repeat=1).run()
    msg = str(info.value)
    assert msg.startswith(f"{path}: {want}")
    assert fake_job.made == [] and fake_job.used == 0  # refused before any executor or memory
    monkeypatch.setattr(od.Device, "get", classmethod(lambda cls, ordinal=0: fake_job.device))
    assert main(["run", "--input", str(path), "--compute-iters", "3", "--repeat", "1"]) == 2
    assert capsys.readouterr().err == f"orchestra run: {msg}\n"
    assert main(["plan", "--input", str(path)]) == 2  # planned as float32 before
    assert capsys.readouterr() == ("", f"orchestra plan: {msg}\n")


def test_open_input_keeps_the_storage_order(tmp_path):
    from orchestra.app.job import open_input

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    for arr, fortran in ((a, False), (np.asfortranarray(a), True), (a[0], False)):
        np.save(tmp_path / "a.npy", arr)
        inp = open_input(str(tmp_path / "a.npy"))
        assert inp.fortran is fortran and inp.shape == arr.shape and inp.size == arr.size
        assert isinstance(inp.array, np.memmap)  # memory-mapped, not read
        np.testing.assert_array_equal(inp.flat, arr.T.reshape(-1) if fortran else arr.reshape(-1))
    np.save(tmp_path / "s.npy", np.float32(2.5))  # a 0-d array is one element
    assert open_input(tmp_path / "s.npy").flat.tolist() == [2.5]
    with pytest.raises(JobInputError, match=": no such file$"):
        open_input(tmp_path / "missing.npy")


def _fifo_unblocked_after(path, seconds):
    """A FIFO at ``path``, and a thread that opens it for writing after ``seconds`` (so a
    reader that blocked on it gets EOF instead of hanging the test run)."""
    import threading

    os.mkfifo(path)

    def unblock():
        if not done.wait(seconds):
            with open(path, "wb"):
                pass

    done = threading.Event()
    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    return done, t


NOT_A_FILE = {
    "empty": " is empty (0 bytes): not a .npy file; save the array with np.save",  # EOFError
    "folder": " is a directory: pass a .npy file (np.save)",  # IsADirectoryError
    "fifo": " is not a regular file (a pipe, a socket or a device): the array is "
            "memory-mapped from a file; save it with np.save first",  # np.load blocked
    "devnull": " is not a regular file (a pipe, a socket or a device)",  # a raw mmap error
    "missing": ": no such file",  # FileNotFoundError
    "under a file": ": cannot be read (Not a directory)",  # NotADirectoryError
}


@pytest.mark.parametrize("bad", NOT_A_FILE)
def test_main_job_refuses_paths_that_are_no_npy_file_as_the_cli_does(
        fake_job, monkeypatch, tmp_path, capsys, bad):
    from orchestra.cli.main import main

    done = None
    path = tmp_path / "x.npy"
    if bad == "empty":
        path.write_bytes(b"")
    elif bad == "folder":
        path.mkdir()
    elif bad == "fifo":
        done, thread = _fifo_unblocked_after(path, 5.0)
    elif bad == "devnull":
        path = Path(os.devnull)
    elif bad == "under a file":
        np.save(tmp_path / "f.npy", np.ones(3, np.float32))
        path = tmp_path / "f.npy" / "x.npy"
    try:
        with pytest.raises(JobInputError) as info:
            MainJob(input=path, compute_iters=3, repeat=1).run()
    finally:
        if done is not None:
            done.set()
            thread.join()
    msg = str(info.value)
    assert msg.startswith(f"{path}{NOT_A_FILE[bad]}")
    assert isinstance(info.value, ValueError)
    assert fake_job.made == [] and fake_job.used == 0  # refused before any executor or memory
    if bad == "fifo":
        return  # the CLI's own test covers it
    monkeypatch.setattr(od.Device, "get", classmethod(lambda cls, ordinal=0: fake_job.device))
    assert main(["run", "--input", str(path), "--compute-iters", "3", "--repeat", "1"]) == 2
    assert capsys.readouterr().err == f"orchestra run: {msg}\n"  # one check, one message
    assert main(["plan", "--input", str(path)]) == 2
    assert capsys.readouterr() == ("", f"orchestra plan: {msg}\n")


def test_a_truncated_npy_header_is_named_not_an_eof_error(fake_job, tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.ones(8, np.float32))
    path.write_bytes(path.read_bytes()[:9])  # the magic string and half the header length
    with pytest.raises(JobInputError, match="not a .npy array numpy can load"):
        MainJob(input=path, compute_iters=3, repeat=1).run()


def test_main_job_reports_the_streams_the_plan_runs_on(fake_job):
    # by-engine with 5 streams: upload, compute0..compute2, download; 2 batches leave compute2
    # without a node, so the plan (and the executor) has 4 streams
    r = MainJob(batches=2, batch_mib=0.01, streams=5, compute_iters=3, repeat=1).run()
    assert r.verified and r.streams == 4 and r.as_dict()["streams"] == 4
    assert MainJob(batches=3, batch_mib=0.01, streams=5, compute_iters=3, repeat=1).run().streams == 5


def test_print_report_bound_lines(fake_job, capsys):
    """The sustained times and the bound's terms show; an efficiency above 1.01 prints the
    loud BOUND BUG banner on stdout and the message on stderr."""
    import attrs

    from orchestra.app.job import bound_warning
    from orchestra.cli.run_cmd import print_report

    r = MainJob(batches=4, batch_mib=0.01, compute_iters=3, repeat=1).run()
    # the fake GPU takes no time, so its runs "beat" the 1 ms items: the report says so
    assert r.bound_warning.startswith("BOUND BUG: eager by-engine (3 streams) efficiency")
    r = attrs.evolve(r, wall_ms=2 * r.bound_ms, efficiency=0.5, bound_warning=None)
    print_report(r)
    out = capsys.readouterr()
    line = [x for x in out.out.splitlines() if x.startswith("sustained per batch")]
    assert len(line) == 1 and "1.2500 ms per pair" in line[0] and "4 back-to-back" in line[0]
    assert "launched on streams" in line[0]  # an eager run's items
    print_report(attrs.evolve(r, sustained={**r.sustained, "launch": "graph"}))
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sustained per")]
    assert "launched as one CUDA graph" in line[0]
    assert any(x.startswith("bound = the largest of (upload") for x in out.out.splitlines())
    assert "BOUND BUG" not in out.out + out.err
    fast = attrs.evolve(r, wall_ms=r.bound_ms / 1.05, efficiency=1.05,
                        bound_warning=bound_warning(1.05, "eager by-engine"))
    print_report(fast)
    out = capsys.readouterr()
    assert "!" * 78 in out.out and "BOUND BUG: eager by-engine efficiency 1.050" in out.out
    assert "BOUND BUG" in out.err
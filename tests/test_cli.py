"""`orchestra plan` and `orchestra run` without a GPU: the plan listing and its counts for each
policy, JSON output, the staged (--input) graph, and run's one-line exit 3 without a device;
`orchestra compile`'s inputs, options and messages (NVRTC and nvJitLink run on the CPU)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from orchestra.cli.main import main
from orchestra.driver.check import device_available
from orchestra.app.job import batch_sizes, build_job_graph, build_staged_graph
from orchestra.schedule import POLICIES, schedule

no_gpu = pytest.mark.skipif(device_available(), reason="checks the behaviour without a GPU")


def expected_counts(batches, per_elems, policy, streams):
    jg = build_job_graph(batch_sizes(batches * per_elems, per_elems), iters=1)
    plan = schedule(jg.graph, policy, streams)
    return jg, plan


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("streams", [1, 3, 4])
def test_plan_json_counts(capsys, policy, streams):
    assert main(["plan", "--batches", "6", "--batch-mib", "1", "--policy", policy,
                 "--streams", str(streams), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    jg, plan = expected_counts(6, (1 << 20) // 4, policy, streams)
    assert out["nodes"] == len(jg.graph) == 42
    assert out["edges"] == len(jg.graph.edges)
    assert out["events"] == plan.event_count and out["waits"] == plan.wait_count
    # the streams the plan uses (critical-path runs these 6 batches on 3 of 4)
    assert out["streams"] == len(plan.streams) <= streams and out["policy"] == policy
    assert out["streams_requested"] == streams
    assert out["batches"] == 6 and out["batch_bytes"] == 1 << 20 and out["data_bytes"] == 6 << 20
    assert out["plan"] == json.loads(plan.to_json())
    assert out["estimated_makespan_ms"] > 0
    assert "default cost model" in out["cost_model"]


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_text(capsys, policy):
    assert main(["plan", "--batches", "4", "--batch-mib", "2", "--policy", policy]) == 0
    text = capsys.readouterr().out
    jg, plan = expected_counts(4, (2 << 20) // 4, policy, 3)
    lines = text.splitlines()
    assert lines[0].startswith("orchestra plan: 4 batches x 2.00 MiB (8.00 MiB), policy " + policy)
    assert str(plan) in text  # the per-stream listing
    assert (f"counts: {len(jg.graph)} nodes, {len(jg.graph.edges)} edges, {plan.event_count} "
            f"events, {plan.wait_count} waits, 3 streams") in text
    assert "estimated makespan:" in text
    if policy == "critical-path":
        assert "default cost model: no GPU is used here" in text
    if policy == "by-engine":
        assert "stream upload (role upload" in text and "stream download" in text


def test_plan_summary_and_fractional_batch_mib(capsys):
    assert main(["plan", "--batches", "3", "--batch-mib", "0.001", "--summary"]) == 0
    text = capsys.readouterr().out
    assert "stream " not in text and "counts: 21 nodes" in text
    assert "3 batches x 1.02 KiB (3.07 KiB)" in text  # 0.001 MiB -> 1048 bytes (262 floats)


def test_plan_counts_only_the_streams_the_plan_uses(capsys):
    assert main(["plan", "--batches", "4", "--batch-mib", "0.01", "--streams", "100",
                 "--summary"]) == 0
    text = capsys.readouterr().out
    assert "policy by-engine, 6 streams (of 100 requested: no node would run on the others)" in text
    assert "8 waits, 6 streams" in text  # upload, compute0..compute3, download
    assert main(["plan", "--batches", "4", "--batch-mib", "0.01", "--streams", "6"]) == 0
    text = capsys.readouterr().out
    assert "policy by-engine, 6 streams, compute iters" in text and "requested" not in text


def test_plan_printout_says_1_batch_not_1_batches(tmp_path, capsys):
    # was "1 batches x 64.0 MiB", "1 batches, 1 staging slots", "1 lanes (16, capped at the
    # 1 batches)"
    assert main(["plan", "--batches", "1", "--policy", "round-robin", "--copy-lowering",
                 "kernel", "--summary"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("orchestra plan: 1 batch x 64.0 MiB (64.0 MiB), policy round-robin, "
                           "1 stream, compute iters auto\n")
    assert "streams auto: 1 lane (16, capped at the 1 batch))" in text
    assert "counts: 7 nodes, 8 edges, 0 events, 0 waits, 1 stream\n" in text
    np.save(tmp_path / "x.npy", np.ones(10, np.float32))
    assert main(["plan", "--input", str(tmp_path / "x.npy"), "--summary"]) == 0
    assert f"{tmp_path / 'x.npy'} (10 float32, 1 batch, 1 staging slot), policy" in \
        capsys.readouterr().out


def test_counted_takes_the_number_of_its_noun():
    from orchestra.errors import counted

    assert [counted(n, "batch") for n in (0, 1, 2)] == ["0 batches", "1 batch", "2 batches"]
    assert counted(1, "stream") == "1 stream" and counted(16, "stream") == "16 streams"
    assert counted(3, "entry", "entries") == "3 entries" and counted(1, "entry") == "1 entry"


def test_plan_with_input_file_shows_the_staged_graph(tmp_path, capsys):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((10, 1000), np.float32))  # 10,000 floats = 40,000 bytes
    assert main(["plan", "--input", str(path), "--batch-mib", str(16000 / 2**20),
                 "--staging-slots", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sizes = batch_sizes(10_000, 4000)
    assert sizes == [16000, 16000, 8000]
    jg = build_staged_graph(sizes, slots=2, iters=1)
    assert out["batches"] == 3 and out["nodes"] == len(jg.graph) == 27
    assert out["data_bytes"] == 40_000


def test_staged_graph_waits_before_reusing_a_slot():
    sizes = [4096] * 5
    jg = build_staged_graph(sizes, slots=2, iters=3)
    g = jg.graph
    # refill of slot 0 for batch 2 waits for the upload of batch 0 that read it
    assert ("b0.h2d", "b2.fill") in g.edges
    # the download into output slot 0 for batch 2 waits for batch 0's drain
    assert ("b0.drain", "b2.d2h") in g.edges
    for policy in POLICIES:
        for streams in (1, 2, 3, 4):
            from orchestra.schedule import verify
            assert verify(schedule(g, policy, streams), g) == []


def test_run_graph_dot_needs_a_graph_executor(capsys):
    assert main(["run", "--executor", "eager", "--graph-dot", "g.dot"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("orchestra run: --graph-dot needs --executor capture or graph (the "
                           "eager executor builds no CUDA graph)")


def test_run_output_needs_input(capsys):
    assert main(["run", "--output", "y.npy"]) == 2
    assert "--output needs --input" in capsys.readouterr().err


def test_run_staging_slots_needs_input(capsys):
    assert main(["run", "--staging-slots", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "orchestra run: --staging-slots needs --input (the generated data is made in pinned "
        "memory and needs no staging slots)")


def test_bad_options_are_usage_errors(capsys):
    assert main(["run", "--batches", "0"]) == 2
    assert "orchestra run: error: argument --batches: expected an int >= 1, got 0" in (
        capsys.readouterr().err)
    assert main(["plan", "--compute-iters", "lots"]) == 2
    assert "expected 'auto' or an int" in capsys.readouterr().err


@no_gpu
def test_run_without_gpu_exits_3_with_one_line_pointing_to_plan():
    proc = subprocess.run([sys.executable, "-m", "orchestra.cli.main", "run", "--batches", "2",
                           "--batch-mib", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("orchestra run: no CUDA device")
    assert lines[0].endswith("; `orchestra plan` shows the same plan without a GPU")


def test_help_lists_run_and_plan():
    proc = subprocess.run([sys.executable, "-m", "orchestra.cli.main", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "run " in proc.stdout and "plan " in proc.stdout


def test_run_plot_without_matplotlib_is_one_line_before_any_work(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["run", "--trace", "t.json", "--plot", "t.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert err == ("orchestra run: --plot: plot_gantt needs matplotlib, which is not installed: "
                   "pip install orchestra[plot] (or pip install matplotlib)")


def test_run_trace_into_a_missing_folder_is_refused_before_any_work(capsys, tmp_path):
    missing = tmp_path / "nope" / "t.json"
    assert main(["run", "--trace", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"orchestra run: --trace {missing}: the folder {missing.parent} does not exist")


def test_trace_outputs_on_a_hand_made_timeline(tmp_path):
    from orchestra.cli.trace_out import format_trace, write_outputs
    from orchestra.trace import NodeSpan, Timeline

    spans = []
    for b in range(3):  # a perfect by-engine pipeline: 1 ms per stage
        spans += [NodeSpan(f"b{b}.h2d", "h2d", b, "upload", "upload", b, b + 1, nbytes=1 << 20),
                  NodeSpan(f"b{b}.kernel", "kernel", b, "compute", "compute", b + 1, b + 2),
                  NodeSpan(f"b{b}.d2h", "d2h", b, "download", "download", b + 2, b + 3,
                           nbytes=1 << 20)]
    tl = Timeline(spans, ("upload", "compute", "download", "spare"), "by-engine", "eager")
    info = write_outputs(tl, trace_path=tmp_path / "t.json", bound_ms=5.0)
    assert (info["nodes"], info["tracks"]) == (9, 4)  # a track for the idle stream too
    assert info["makespan_ms"] == 5.0 and info["efficiency"] == 1.0
    assert info["overlap_ms"][">=3"] == 1.0 and info["pairs_ms"]["upload&compute"] == 2.0
    assert info["timeline_bound_ms"] == 5.0
    text = format_trace(tl, info)
    assert f"Chrome trace {tmp_path / 't.json'}: 9 node events, 4 tracks" in text
    assert "bound 5.000 ms, efficiency 100.0%" in text
    json.loads((tmp_path / "t.json").read_text())


# -- orchestra compile (NVRTC / nvJitLink run on the CPU; no GPU needed) -------------------------

SAXPY_CU = ('extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {\n'
            '    int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
            '    if (i < n) y[i] = a * x[i] + y[i];\n}\n')


@pytest.fixture
def ptx_file(tmp_path):
    from orchestra.compiler import ptx_source_dir

    path = tmp_path / "cp_async.ptx"
    path.write_bytes((ptx_source_dir() / "cp_async.ptx").read_bytes())
    return path


@pytest.fixture
def no_device_arch(monkeypatch):
    """`orchestra compile` as on a machine without a GPU, whatever this machine has."""
    import orchestra.cli.compile_cmd as cc

    monkeypatch.setattr(cc, "_current_arch", lambda: None)


@pytest.mark.parametrize("suffix", [".ptx", ".cu"])
def test_compile_without_arch_or_gpu_says_to_pass_arch(suffix, tmp_path, ptx_file, capsys,
                                                       no_device_arch):
    src = ptx_file if suffix == ".ptx" else tmp_path / "saxpy.cu"
    if suffix == ".cu":
        src.write_text(SAXPY_CU)
    assert main(["compile", str(src)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    verb = "link" if suffix == ".ptx" else "compile"
    assert err == ("orchestra compile: no CUDA device to take the target architecture from: pass "
                   f"--arch, e.g. --arch sm_90 (compute capability 9.0) to {verb} {src} without "
                   "a GPU")
    assert not src.with_suffix(".cubin").exists()


@pytest.mark.parametrize("flags, message", [
    (["--name-expression", "k<2>"], "--name-expression applies to NVRTC (.cu input) only; a "
     ".ptx input is linked with nvJitLink as it is: drop it"),
    (["-O=-lineinfo"], "-O/--option applies to NVRTC (.cu input) only; a .ptx input is linked "
     "with nvJitLink as it is: drop it"),
    (["--name-expression", "k<2>", "-O=-lineinfo"], "--name-expression and -O/--option apply to "
     "NVRTC (.cu input) only; a .ptx input is linked with nvJitLink as it is: drop them"),
    (["--ptx"], "--ptx makes no sense for a .ptx input (it is PTX already)"),
])
def test_compile_refuses_nvrtc_options_for_a_ptx_input(flags, message, ptx_file, capsys):
    assert main(["compile", str(ptx_file), "--arch", "sm_90", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"orchestra compile: {message}"
    assert not ptx_file.with_suffix(".cubin").exists()


def test_compile_links_a_ptx_input(ptx_file, capsys):
    assert main(["compile", str(ptx_file), "--arch", "sm_90"]) == 0
    out = ptx_file.with_suffix(".cubin")
    assert out.read_bytes()[:4] == b"\x7fELF"
    assert capsys.readouterr().out.strip().splitlines() == [
        f"wrote {out} ({out.stat().st_size} bytes, cubin for sm_90)", "  kernel cp_async_scale"]


def test_compile_ptx_output_names_the_virtual_architecture(tmp_path, capsys):
    src = tmp_path / "saxpy.cu"
    src.write_text(SAXPY_CU)
    assert main(["compile", str(src), "--arch", "90", "--ptx"]) == 0
    out = src.with_suffix(".ptx")
    assert b".target sm_90" in out.read_bytes()  # PTX's own spelling of compute_90
    line, kernel = capsys.readouterr().out.strip().splitlines()
    assert line.startswith(f"wrote {out} (") and line.endswith(" bytes, PTX for compute_90)")
    assert kernel == "  kernel saxpy"
    assert main(["compile", str(src), "--arch", "sm_90"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[0].endswith(" bytes, cubin for sm_90)")


def test_compile_a_directory_or_a_missing_file_or_a_bad_arch(tmp_path, capsys):
    assert main(["compile", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"orchestra compile: {tmp_path} is a directory: give a .cu or .ptx file")
    assert main(["compile", str(tmp_path / "nope.cu")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"orchestra compile: no such file: {tmp_path / 'nope.cu'}")
    src = tmp_path / "saxpy.cu"
    src.write_text(SAXPY_CU)
    assert main(["compile", str(src), "--arch", "bogus"]) == 2
    assert capsys.readouterr().err.strip() == (
        "orchestra compile: --arch bogus: unknown GPU architecture; pass a name like --arch "
        "sm_90 or a compute capability like --arch 9.0")


# -- the example and the benchmarks without a GPU: one line, exit 2 -----------------------------

@no_gpu
@pytest.mark.parametrize("script", ["examples/three_way_overlap.py",
                                    "benchmarks/bench_pipeline.py", "benchmarks/bench_graphs.py",
                                    "benchmarks/bench_launch.py", "benchmarks/bench_fanout.py",
                                    "benchmarks/probe_graph_launch.py",
                                    "benchmarks/bench_copy_lowering.py"])
def test_scripts_without_gpu_print_one_line_and_exit_2(script):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / script
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{path.stem}: no CUDA device: orchestra needs an NVIDIA GPU")

"""What every `orchestra` command shares (orchestra.cli.main, exit_codes, logs, progress):
--version, python -m orchestra, a quiet exit on a closed pipe (141) and on Ctrl-C (130), a
subcommand's own usage on its errors, --json errors, the documented exit codes, -v / -q
anywhere on the line, plan making run's option checks, warnings for options that do not apply,
debug logs, and progress bars only on a terminal. No GPU needed: run's device side is the fake
driver of tests/fake_cuda.py."""

import json
import os
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import orchestra
import orchestra.driver as od
from orchestra.cli import exit_codes, progress
from orchestra.cli import job_options as jo
from orchestra.cli.main import build_parser, main, version_text
from orchestra.errors import (
    CompileError, CudaError, GraphError, HazardError, NoDeviceError, OrchestraError,
)
from tests.test_execute_job import fake_job  # noqa: F401 - the fake driver's MainJob fixture

ROOT = Path(__file__).resolve().parents[1]


def orchestra_cli(*argv, **kw):
    """``python -m orchestra ARGV`` in a child process, from a directory outside the checkout."""
    kw.setdefault("cwd", os.path.dirname(ROOT))
    return subprocess.run([sys.executable, "-m", "orchestra", *argv], capture_output=True,
                          text=True, timeout=120, **kw)


# -- --version, python -m orchestra, --help -------------------------------------------------------

def test_version_from_python_m_orchestra():
    proc = orchestra_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == version_text()
    assert proc.stdout.startswith(f"orchestra {orchestra.__version__} (Python ")
    assert orchestra.__version__ == metadata.version("orchestra")  # one version, pyproject's


def test_help_documents_the_exit_codes_and_cites_no_internal_ids():
    proc = orchestra_cli("--help")
    assert proc.returncode == 0
    for code in ("0 ", "1 ", "2 ", "3 ", "4 ", "5 ", "70", "130", "141"):
        assert f"\n  {code}" in proc.stdout, code
    assert "run " in proc.stdout and "plan " in proc.stdout
    import re

    texts = [build_parser().format_help()]
    stack = [build_parser()]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for child in action.choices.values():
                    texts.append(child.format_help())
                    stack.append(child)
    assert len(texts) >= 8  # orchestra, devices, compile, plan, run, bench, stages, pdl
    for text in texts:
        assert not re.search(r"\bC\d\d\b|issue \d|design map", text), text


# -- closed pipe, Ctrl-C ------------------------------------------------------------------------

def test_closed_pipe_exits_141_without_a_word():
    # the JSON of 3,000 batches is megabytes: far more than a pipe holds
    proc = subprocess.Popen([sys.executable, "-m", "orchestra", "plan", "--batches", "3000",
                             "--batch-mib", "0.01", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == exit_codes.PIPE_CLOSED == 141
    assert first == b"{\n"
    assert err == ""


def test_ctrl_c_exits_130_without_a_traceback():
    # SIGINT as a terminal delivers it: a shell's background job (and so a test run started
    # with `&`) ignores it, and a child would inherit that
    proc = subprocess.Popen([sys.executable, "-m", "orchestra", "-v", "plan", "--batches",
                             "100000", "--batch-mib", "0.01", "--summary"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:  # wait until the command is at work: its first debug line
        seen.append(line)
        if "[cli.job_options] plan: 100000 batches" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == exit_codes.INTERRUPTED == 130, "".join(seen) + rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest
    assert proc.stdout.read() == ""


def _command_raising(monkeypatch, exc):
    """Make the parsed command raise ``exc`` (to test how `main` reports it)."""
    import orchestra.cli.main as cli_main

    real = cli_main.parse_args

    def parse(parser, argv):
        args = real(parser, argv)

        def func(args):
            raise exc
        args.func = func
        return args

    monkeypatch.setattr(cli_main, "parse_args", parse)


def test_keyboard_interrupt_in_a_command_is_130_in_process(monkeypatch, capsys):
    _command_raising(monkeypatch, KeyboardInterrupt())
    assert main(["plan"]) == 130
    assert capsys.readouterr() == ("", "")
    assert main(["plan", "--json"]) == 130
    assert capsys.readouterr() == ("", "")


# -- usage errors: the subcommand's usage, text or JSON -------------------------------------------

@pytest.mark.parametrize("argv, prog", [
    (["plan", "--bogus"], "orchestra plan"),
    (["run", "--block", "x"], "orchestra run"),
    (["bench", "stages", "--bogus"], "orchestra bench stages"),
    (["compile"], "orchestra compile"),
    (["--bogus-top"], "orchestra"),
])
def test_a_usage_error_shows_the_subcommands_usage(argv, prog, capsys):
    assert main(argv) == exit_codes.USAGE == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"usage: {prog} ")
    assert lines[-1].startswith(f"{prog}: error: ")


def test_usage_error_under_json_is_a_json_object(capsys):
    assert main(["plan", "--bogus", "--json"]) == 2
    out, err = capsys.readouterr()
    assert err == ""
    e = json.loads(out)["error"]
    assert e["type"] == "UsageError" and e["exit_code"] == 2
    assert e["message"] == "unrecognized arguments: --bogus"
    assert e["usage"].startswith("usage: orchestra plan ")


def test_every_command_takes_json_v_and_q():
    stack = [build_parser()]
    leaves = []
    while stack:
        p = stack.pop()
        subs = [a for a in p._actions if isinstance(getattr(a, "choices", None), dict)]
        if not subs:
            leaves.append(p)
        for a in subs:
            stack.extend(dict.fromkeys(a.choices.values()))
    assert {p.prog for p in leaves} == {
        "orchestra devices", "orchestra compile", "orchestra cache info", "orchestra cache clear",
        "orchestra plan", "orchestra run", "orchestra bench stages", "orchestra bench pdl",
        "orchestra bench serve", "orchestra bench peers", "orchestra bench multigpu",
        "orchestra tune copies"}
    for p in leaves:
        for opt in ("--json", "-v", "--verbose", "-q", "--quiet"):
            assert opt in p._option_string_actions, (p.prog, opt)


# -- the exit codes -------------------------------------------------------------------------------

@pytest.mark.parametrize("exc, code", [
    (NoDeviceError("cuInit: CUDA_ERROR_NO_DEVICE"), 3),
    (CompileError("NVRTC refused it", log="x.cu(1): error"), 4),
    (CudaError("cuMemAllocAsync", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"), 5),
    (HazardError(["b0.h2d and b0.kernel race on b0.in"]), 1),
    (exit_codes.UsageError("--output needs --input"), 2),
    (ValueError("bad"), 2), (TypeError("bad"), 2), (FileNotFoundError("x.npy"), 2),
    (GraphError("a cycle"), 5), (OrchestraError("other"), 5),
    (RuntimeError("a bug"), 70), (ZeroDivisionError(), 70),
])
def test_exit_code_of_each_failure(exc, code):
    assert exit_codes.exit_code(exc) == code


@pytest.mark.parametrize("exc, code, fields", [
    (NoDeviceError("cuInit: CUDA_ERROR_NO_DEVICE"), 3, {}),
    (CompileError("NVRTC refused k.cu", log="k.cu(3): error: x", options=("-arch=sm_90",)), 4,
     {"log": "k.cu(3): error: x", "options": ["-arch=sm_90"]}),
    (CudaError("cuLaunchKernel", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal address"), 5,
     {"call": "cuLaunchKernel", "result": "CUDA_ERROR_ILLEGAL_ADDRESS", "result_code": 700,
      "sticky": True}),
    (HazardError(["x races y"]), 1, {"findings": ["x races y"]}),
])
def test_errors_under_json(monkeypatch, capsys, exc, code, fields):
    _command_raising(monkeypatch, exc)
    assert main(["plan", "--json"]) == code
    out, err = capsys.readouterr()
    e = json.loads(out)["error"]
    assert e["type"] == type(exc).__name__ and e["message"] == str(exc)
    assert e["exit_code"] == code
    for k, v in fields.items():
        assert e[k] == v, k
    assert err == ""
    # the same error as text: one line on stderr (the first line of a multi-line message)
    assert main(["plan"]) == code
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"orchestra plan: {str(exc).splitlines()[0]}")


def test_internal_error_prints_the_traceback_and_exits_70(monkeypatch, capsys):
    _command_raising(monkeypatch, RuntimeError("boom"))
    assert main(["plan"]) == 70
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err
    assert err.rstrip().splitlines()[-1] == (
        "orchestra plan: internal error (RuntimeError: boom); please report it with the "
        "traceback")


def test_no_device_under_json_carries_the_hint(monkeypatch, capsys):
    def no_device(cls, ordinal=0):
        raise NoDeviceError("cuInit: CUDA_ERROR_NO_DEVICE")

    monkeypatch.setattr(od.Device, "get", classmethod(no_device))
    assert main(["run", "--batches", "2", "--batch-mib", "0.01", "--json"]) == 3
    out, err = capsys.readouterr()
    e = json.loads(out)["error"]
    assert e["type"] == "NoDeviceError" and e["exit_code"] == 3
    assert e["message"].endswith("; `orchestra plan` shows the same plan without a GPU")
    assert err == ""


def test_compile_error_exits_4(tmp_path, capsys):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    assert main(["compile", str(src), "--arch", "sm_90", "--json"]) == 4
    e = json.loads(capsys.readouterr().out)["error"]
    assert e["type"] == "CompileError" and "undefined_name" in e["log"]
    assert not src.with_suffix(".cubin").exists()


def test_a_failed_verification_exits_1(fake_job, monkeypatch, capsys):  # noqa: F811
    # the kernel writes nothing: the output keeps its NaN poison and fails the check
    monkeypatch.setattr(fake_job, "cuLaunchKernel",
                        lambda func, *a: (fake_job._call("cuLaunchKernel", a[7]),))
    monkeypatch.setattr(od.Device, "get", classmethod(lambda cls, ordinal=0: fake_job.device))
    assert main(["run", "--batches", "2", "--batch-mib", "0.01", "--compute-iters", "3",
                 "--repeat", "1", "--json"]) == exit_codes.CHECK_FAILED == 1
    assert json.loads(capsys.readouterr().out)["verified"] is False


# -- -v / -q anywhere, debug logs, warnings -------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["-v", "plan", "--batches", "2", "--batch-mib", "0.01", "--summary"],
    ["plan", "-v", "--batches", "2", "--batch-mib", "0.01", "--summary"],
    ["plan", "--batches", "2", "--batch-mib", "0.01", "--summary", "--verbose"],
])
def test_verbose_anywhere_on_the_line_logs_plan_sizes(argv, capsys):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "orchestra plan: debug: [cli.plan_cmd] plan: task graph of 14 nodes, 16 edges" in err
    assert "orchestra plan: debug: [cli.plan_cmd] plan: 3 streams, 4 events, 4 waits" in err
    assert "counts: 14 nodes" in out and "debug" not in out


def test_without_verbose_no_debug_lines(capsys):
    assert main(["plan", "--batches", "2", "--batch-mib", "0.01", "--summary"]) == 0
    assert capsys.readouterr().err == ""


@pytest.fixture
def small_npy(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros(3000, np.float32))
    return path


@pytest.mark.parametrize("where", ["before", "after"])
def test_warning_for_an_option_that_does_not_apply_and_quiet(small_npy, capsys, where):
    argv = ["plan", "--input", str(small_npy), "--batches", "7", "--summary"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err == ("orchestra plan: warning: --batches does not apply with --input: the file's "
                   "size and --batch-mib set the number of batches\n")
    quiet = ["-q", *argv] if where == "before" else [*argv, "-q"]
    assert main(quiet) == 0
    out, err = capsys.readouterr()
    assert err == "" and "counts:" in out


def test_summary_with_json_warns(capsys):
    assert main(["plan", "--batches", "2", "--batch-mib", "0.01", "--summary", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["nodes"] == 14
    assert err == ("orchestra plan: warning: --summary does not apply with --json (the JSON "
                   "object holds the counts and the plan)\n")


def test_run_logs_driver_calls_per_run(fake_job, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr(od.Device, "get", classmethod(lambda cls, ordinal=0: fake_job.device))
    assert main(["run", "-v", "--batches", "2", "--batch-mib", "0.01", "--compute-iters", "3",
                 "--repeat", "2", "--warmup", "0", "--json"]) == 0
    err = capsys.readouterr().err
    runs = [line for line in err.splitlines() if "[execute.eager] eager run: " in line]
    # --compute-iters 3 is the routing check's count: no extra run, the 2 timed ones only
    assert len(runs) == 2, err
    calls = [int(line.split(" driver calls enqueued")[0].rsplit(" ", 1)[1]) for line in runs]
    # what the fake driver saw: every enqueue of both runs (no synchronize in its count)
    assert sum(calls) == len(fake_job.driver_calls())
    assert calls[0] == calls[1] > 14  # 2 batches x 7 nodes, plus the event records and waits
    assert "eager run: 14 nodes on 3 streams, 4 events, 4 waits" in runs[0]
    jobs = [line for line in err.splitlines() if "[app.job.main_job] main job: run " in line]
    assert [j.split("main job: ")[1].split(", wall")[0] for j in jobs] == [
        f"run 1 of 2: 14 nodes, {calls[0]} steps", f"run 2 of 2: 14 nodes, {calls[1]} steps"]


def test_compile_logs_cache_misses_and_hits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ORCHESTRA_NO_CACHE", raising=False)
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n')
    assert main(["compile", str(src), "--arch", "sm_90", "-v"]) == 0
    assert "[compiler.cache] cache miss nvrtc-" in capsys.readouterr().err
    assert main(["compile", "-v", str(src), "--arch", "sm_90"]) == 0
    assert "[compiler.cache] cache hit nvrtc-" in capsys.readouterr().err


# -- plan makes run's option checks ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["plan", "run"])
def test_plan_and_run_refuse_a_block_over_1024_threads(command, capsys):
    assert main([command, "--block", "2048", "--batches", "2", "--batch-mib", "0.01"]) == 2
    assert capsys.readouterr().err == (
        f"orchestra {command}: --block 2048: a block has at most 1024 threads on every CUDA "
        "GPU; pass --block 1024 or fewer (256 is the default)\n")


def test_run_refuses_more_pinned_memory_than_the_host_has(monkeypatch, capsys):
    monkeypatch.setattr(jo, "host_memory_bytes", lambda: 64 << 30)
    monkeypatch.setattr(od.Device, "get", classmethod(lambda cls, ordinal=0: pytest.fail(
        "run looked for a GPU before refusing the job")))
    # a 97.7 GiB batch (100,000 MiB): 32 of them in and out is 6.1 TiB of pinned memory
    assert main(["run", "--batch-mib", "100000"]) == 2
    assert capsys.readouterr().err == (
        "orchestra run: the job needs 6.10 TiB of pinned host memory (the whole input "
        "and output) but this machine has 64.0 GiB; pass a smaller --batch-mib or fewer "
        "--batches\n")


@pytest.mark.parametrize("json_out", [False, True])
def test_plan_prints_a_plan_run_would_refuse_and_warns(json_out, monkeypatch, capsys):
    # plan allocates nothing: it prints the plan, and says on stderr that run would refuse it
    monkeypatch.setattr(jo, "host_memory_bytes", lambda: 64 << 30)
    assert main(["plan", "--batch-mib", "100000", "--batches", "3"]
                + (["--json"] if json_out else [])) == 0
    cap = capsys.readouterr()
    assert cap.err == (
        "orchestra plan: warning: `orchestra run` would refuse this job on this machine: the "
        "job needs 585.9 GiB of pinned host memory (the whole input and output) but this "
        "machine has 64.0 GiB; pass a smaller --batch-mib or fewer --batches\n")
    if json_out:
        d = json.loads(cap.out)
        assert d["batches"] == 3 and d["nodes"] == 21 and d["pinned_bytes"] == 6 * 100000 << 20
    else:
        assert cap.out.startswith("orchestra plan: 3 batches x 97.7 GiB (293.0 GiB), policy "
                                  "by-engine")
        assert "memory: 585.9 GiB pinned host" in cap.out
    # within the machine's memory: no warning
    assert main(["plan", "--batch-mib", "1000", "--batches", "3", "--summary"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ["plan", "run"])
def test_staging_slots_without_input_is_refused_by_both(command, capsys):
    assert main([command, "--staging-slots", "2"]) == 2
    assert capsys.readouterr().err == (
        f"orchestra {command}: --staging-slots needs --input (the generated data is made in "
        "pinned memory and needs no staging slots)\n")


class _Device:
    name = "Small GPU"
    total_memory = 8 << 30

    class limits:
        max_threads_per_block = 512


def test_run_checks_the_device_block_limit_and_memory(monkeypatch, capsys):
    monkeypatch.setattr(jo, "host_memory_bytes", lambda: 1 << 50)
    monkeypatch.setattr(od.Device, "get", classmethod(lambda cls, ordinal=0: _Device()))
    assert main(["run", "--block", "1024", "--batches", "2", "--batch-mib", "0.01"]) == 2
    assert capsys.readouterr().err == (
        "orchestra run: --block 1024: Small GPU runs at most 512 threads per block\n")
    assert main(["run", "--batches", "1", "--batch-mib", "5000"]) == 2
    assert capsys.readouterr().err == (
        "orchestra run: one batch needs 9.77 GiB of device memory (its input and output) but "
        "Small GPU has 8.00 GiB; pass a smaller --batch-mib\n")
    # plan, without a GPU, shows what run checks against the device
    assert main(["plan", "--batches", "1", "--batch-mib", "5000", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device_batch_bytes"] == 2 * 5000 * 2**20 and d["pinned_bytes"] == 2 * 5000 * 2**20


def test_memory_needs_match_the_graph():
    from orchestra.app.job import batch_sizes, build_job_graph

    args = build_parser().parse_args(["plan", "--batches", "9", "--batch-mib", "0.01"])
    needs = jo.memory_needs(args)
    jg = build_job_graph(batch_sizes(9 * 2621, 2621), iters=1)
    device = [n for n in jg.graph.nodes if type(n).__name__ == "Alloc"]
    assert len(device) == 2 * 9
    assert {n.buffer.nbytes for n in device} == {needs["batch_bytes"]}
    assert needs["device_batch_bytes"] == 2 * needs["batch_bytes"]
    # 9 small batches fit the default budget: every batch in flight, no bounding edges
    assert needs["in_flight"] is None
    assert needs["device_peak_bytes"] == 9 * 2 * needs["batch_bytes"]
    assert not any(a.after for a in device)
    assert needs["pinned_bytes"] == sum(b.nbytes for b in jg.host_buffers)


# -- progress bars: a terminal only ---------------------------------------------------------------

class _Tty:
    def __init__(self, tty):
        self.tty = tty

    def isatty(self):
        return self.tty

    def write(self, s):
        return len(s)

    def flush(self):
        pass


def test_progress_only_on_a_terminal_without_json_or_quiet(monkeypatch):
    import importlib.util

    has_rich = importlib.util.find_spec("rich") is not None
    monkeypatch.setattr(sys, "stderr", _Tty(True))
    assert progress.wanted() is has_rich
    assert progress.wanted(json=True) is False and progress.wanted(quiet=True) is False
    monkeypatch.setattr(sys, "stderr", _Tty(False))
    assert progress.wanted() is False


def test_progress_disabled_is_a_no_op(capsys):
    progress.configure(False)
    with progress.task("work", total=3) as update:
        update(1, description="step")
    assert capsys.readouterr() == ("", "")


def test_progress_bar_draws_on_stderr_when_enabled(monkeypatch):
    pytest.importorskip("rich", reason="progress bars need rich (pip install orchestra[progress])")
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    buf = Terminal()
    monkeypatch.setattr(sys, "stderr", buf)
    progress.configure(True)
    try:
        with progress.task("work", total=4) as update:
            update(2, description="halfway there")
    finally:
        progress.configure(False)
    drawn = buf.getvalue()
    assert "halfway there" in drawn and "2/4" in drawn


def test_piped_run_of_plan_carries_no_bar():
    proc = orchestra_cli("plan", "--batches", "2", "--batch-mib", "0.01", "--summary")
    assert proc.returncode == 0 and proc.stderr == ""
    assert "\x1b[" not in proc.stdout


@pytest.mark.parametrize("budget_batches, expect", [(9, None), (8, 8), (7.5, 7), (1, 6)])
def test_device_budget_bounds_the_batches_in_flight(budget_batches, expect):
    """--device-budget-mib: all batches fit -> no bound; else batch b allocates after batch
    b - k freed, k = budget // batch (at least 6), as memory_needs reports it."""
    from orchestra.app.job import batch_sizes, build_job_graph
    from orchestra.app.job.graphs import in_flight_for

    per = 2 * 2621 * 4  # one batch's input and output, bytes
    mib = budget_batches * per / 2**20
    args = build_parser().parse_args(["plan", "--batches", "9", "--batch-mib", "0.01",
                                      "--device-budget-mib", repr(mib)])
    needs = jo.memory_needs(args)
    assert needs["in_flight"] == expect
    sizes = batch_sizes(9 * 2621, 2621)
    assert in_flight_for(sizes, jo.device_budget(args)) == expect
    jg = build_job_graph(sizes, iters=1, device_budget=jo.device_budget(args))
    allocs = {n.name: n for n in jg.graph.nodes if type(n).__name__ == "Alloc"}
    waits = {name: tuple(a.after) for name, a in allocs.items() if a.after}
    if expect is None:
        assert waits == {} and needs["device_peak_bytes"] == 9 * per
    else:
        assert needs["device_peak_bytes"] == expect * per
        assert set(waits) == {f"b{b}.{k}" for b in range(expect, 9)
                              for k in ("alloc_in", "alloc_out")}
        assert all(set(w) == {f"b{int(n[1:].split('.')[0]) - expect}.free_in",
                              f"b{int(n[1:].split('.')[0]) - expect}.free_out"}
                   for n, w in waits.items())

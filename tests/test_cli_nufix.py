"""Problems a new user met on a machine without a GPU: --json before the subcommand, an output
that would overwrite the input, the device-memory figure with a small input, a cache folder that
is a file, a full stdout, options checked only after the device check, and the Python API's
raw exceptions. No GPU needed."""

import json

import pytest

from orchestra.cli.main import main, version_info, version_text


# -- 1. --json anywhere on the line ---------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--json", "plan"], ["plan", "--json"], ["--json", "cache", "info"],
    ["cache", "--json", "info"], ["cache", "info", "--json"],
])
def test_json_before_or_after_the_subcommand(argv, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path / "cache"))
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, dict) and out  # one JSON object, not the text report
    assert ("batches" in out) if "plan" in argv else ("entries" in out)


def test_json_before_the_subcommand_makes_errors_json(capsys):
    assert main(["--json", "plan", "--batch-mib", "0"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["exit_code"] == 2


@pytest.mark.parametrize("argv", [["--version", "--json"], ["--json", "--version"]])
def test_version_as_json(argv, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's version action exits 0
        main(argv)
    assert exc.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out == version_info()
    assert version_text().startswith(f"orchestra {out['orchestra']} (Python {out['python']}")


def test_version_as_text(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == version_text()


# -- 2. run --output onto its --input; --output's folder ------------------------------------------

@pytest.fixture
def no_gpu_check(monkeypatch):
    """Device.get fails the test: the refusal must come before the device check."""
    import orchestra.driver as od

    def refuse(*a, **k):
        raise AssertionError("reached the device check")
    monkeypatch.setattr(od.Device, "get", staticmethod(refuse))


@pytest.mark.parametrize("how", ["same", "dotdot", "symlink", "hardlink"])
def test_run_refuses_an_output_that_is_its_input(tmp_path, capsys, no_gpu_check, how):
    import os

    import numpy as np

    src = tmp_path / "A.npy"
    data = np.arange(10, dtype=np.float32)
    np.save(src, data)
    out = {"same": src, "dotdot": tmp_path / "sub" / ".." / "A.npy",
           "symlink": tmp_path / "L.npy", "hardlink": tmp_path / "H.npy"}[how]
    (tmp_path / "sub").mkdir()
    if how == "symlink":
        os.symlink(src, out)
    if how == "hardlink":
        os.link(src, out)
    assert main(["run", "--input", str(src), "--output", str(out)]) == 2
    assert "is the --input file" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(src), data)  # untouched


def test_run_refuses_an_output_in_a_missing_folder(tmp_path, capsys, no_gpu_check):
    import numpy as np

    np.save(tmp_path / "A.npy", np.zeros(4, np.float32))
    out = tmp_path / "nope" / "B.npy"
    assert main(["run", "--input", str(tmp_path / "A.npy"), "--output", str(out)]) == 2
    assert f"the folder {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


# -- 4. the device-memory figure with an input smaller than a batch -------------------------------

def test_memory_needs_with_a_small_input_counts_the_real_batch():
    from orchestra.cli import job_options as jo
    from orchestra.cli.main import build_parser, parse_args

    args = parse_args(build_parser(), ["run", "--input", "x.npy", "--batch-mib", "100000"])
    needs = jo.memory_needs(args, input_elements=10)  # 40 bytes: one batch of 40 bytes
    assert needs["batches"] == 1
    assert needs["pinned_bytes"] == 2 * 40
    assert needs["device_batch_bytes"] == 2 * 40
    assert needs["device_peak_bytes"] == 2 * 40
    args = parse_args(build_parser(), ["run", "--input", "x.npy", "--batch-mib", "1"])
    needs = jo.memory_needs(args, input_elements=3 << 20)  # 12 MiB: 12 batches of 1 MiB
    assert needs["batches"] == 12
    assert needs["device_batch_bytes"] == 2 << 20


# -- 3. compile -o onto its source ----------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--ptx"]])
@pytest.mark.parametrize("how", ["same", "dotdot", "symlink"])
def test_compile_refuses_an_output_that_is_its_source(tmp_path, monkeypatch, capsys, extra, how):
    import os

    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "k.cu"
    text = "extern \"C\" __global__ void k(float *x) { x[0] = 1.0f; }\n"
    src.write_text(text)
    (tmp_path / "sub").mkdir()
    out = {"same": src, "dotdot": tmp_path / "sub" / ".." / "k.cu",
           "symlink": tmp_path / "l.cu"}[how]
    if how == "symlink":
        os.symlink(src, out)
    assert main(["compile", str(src), "--arch", "sm_90", "-o", str(out), *extra]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert src.read_text() == text


def test_compile_to_another_file_still_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "k.cu"
    src.write_text("extern \"C\" __global__ void k(float *x) { x[0] = 1.0f; }\n")
    assert main(["compile", str(src), "--arch", "sm_90", "-o", str(tmp_path / "k.cubin")]) == 0
    assert (tmp_path / "k.cubin").read_bytes()[:4] == b"\x7fELF"


# -- 5. a cache location that is a file -----------------------------------------------------------

_KERNEL = "extern \"C\" __global__ void k(float *x) { x[0] = 1.0f; }\n"


def compiles_without_the_cache(tmp_path, capsys, why: str) -> None:
    """`orchestra compile` of a small kernel succeeds with a warning that says ``why`` the
    cache is unusable and that it compiles without it; the cubin is written."""
    src = tmp_path / "k.cu"
    src.write_text(_KERNEL)
    assert main(["compile", str(src), "--arch", "sm_90", "-o", str(tmp_path / "k.cubin")]) == 0
    err = capsys.readouterr().err
    assert why in err
    assert "compiling without the cache" in err
    assert (tmp_path / "k.cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("below", [False, True])
def test_compile_with_the_cache_dir_a_file_warns_and_compiles(tmp_path, monkeypatch, capsys,
                                                              below):
    blocker = tmp_path / "cachefile"
    blocker.write_text("not a folder")
    where = blocker / "sub" if below else blocker
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(where))
    compiles_without_the_cache(tmp_path, capsys,
                               f"ORCHESTRA_CACHE_DIR={where} is not a directory")
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("action", ["info", "clear"])
def test_cache_info_and_clear_say_the_dir_is_a_file(tmp_path, monkeypatch, capsys, action):
    blocker = tmp_path / "cachefile"
    blocker.write_text("x")
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(blocker))
    assert main(["cache", action]) == 2
    err = capsys.readouterr().err
    assert f"ORCHESTRA_CACHE_DIR={blocker} is not a directory" in err
    assert main(["cache", action, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "CacheDirError"


def test_cache_api_raises_cache_dir_error(tmp_path, monkeypatch):
    from orchestra.compiler import cache

    blocker = tmp_path / "f"
    blocker.write_text("x")
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(blocker))
    for call in (cache.cache_info, cache.cache_clear, cache.cache_dir):
        with pytest.raises(cache.CacheDirError, match="is not a directory"):
            call()
    assert issubclass(cache.CacheDirError, ValueError)
    assert cache.load("nvrtc", "0" * 64) is None  # a miss, not an error
    assert cache.store("nvrtc", "0" * 64, b"img", "", {}) is None


# -- 6. a stdout that cannot be written -----------------------------------------------------------

@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["plan"], ["plan", "--json"], ["--json", "devices"],
                                  ["devices", "--json"], ["cache", "info"]])
def test_a_full_stdout_is_one_line_and_exit_74(argv, tmp_path):
    import subprocess
    import sys

    from orchestra.cli.exit_codes import OUTPUT_ERROR

    env = dict(__import__("os").environ, ORCHESTRA_CACHE_DIR=str(tmp_path / "c"))
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "orchestra", *argv], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    assert proc.returncode == OUTPUT_ERROR == 74, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "could not write the output to stdout: No space left on device" in lines[0]


def test_an_input_oserror_is_still_a_usage_error(tmp_path, capsys):
    assert main(["run", "--input", str(tmp_path / "missing.npy")]) == 2
    assert "missing.npy" in capsys.readouterr().err


def test_exit_74_is_documented():
    from pathlib import Path

    from orchestra.cli import exit_codes

    assert "\n  74 " in exit_codes.EPILOG
    assert "| 74 |" in (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()


# -- 7. options checked before the device check (exit 2 without a GPU, not 3) ---------------------

@pytest.fixture
def no_device(monkeypatch):
    """Device.get raises NoDeviceError (exit 3) as on a machine without a GPU, whatever this
    machine has: an option error must come first."""
    import orchestra.driver as od
    from orchestra.errors import NoDeviceError

    def none(*a, **k):
        raise NoDeviceError("no CUDA device (test)")
    monkeypatch.setattr(od.Device, "get", staticmethod(none))


@pytest.mark.parametrize("option, says", [
    (["--duration", "-1"], "--duration must be a finite number > 0"),
    (["--duration", "nan"], "--duration must be a finite number > 0"),
    (["--mix", "garbage"], "request size 'garbage'"),
    (["--mix", "64K:-1"], "weights must be > 0"),
    (["--mix", "0K"], "must be positive"),
    (["--mix", "64K:nan"], "weights must be finite"),
    (["--mix", "64K:x"], "--mix '64K:x'"),
    (["--mix", "3K"], "not a whole number of 4096-byte rows"),
    (["--row-kib", "0"], "--row-kib must be a finite number > 0"),
    (["--row-kib", "0.001"], "at least one float32"),
    (["--rate", "-5"], "--rate must be a finite number > 0"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-delay-us", "-1"], "--max-delay-us must be"),
    (["--device", "-1"], "--device must be >= 0"),
    (["--plot", "/nonexistent/x.png"], "--plot"),
])
def test_bench_serve_refuses_bad_options_before_the_device(option, says, no_device, capsys):
    assert main(["bench", "serve", *option]) == 2
    assert says in capsys.readouterr().err


def test_bench_serve_good_options_reach_the_device_check(no_device, capsys):
    assert main(["bench", "serve", "--mix", "4K:1,64K:8", "--duration", "0.5"]) == 3


@pytest.mark.parametrize("argv", [
    ["tune", "copies", "--repeats", "0"], ["tune", "copies", "--device", "-1"],
    ["run", "--warmup", "-1"], ["run", "--device", "-1"],
])
def test_counts_and_ordinals_are_refused_while_parsing(argv, no_device, capsys):
    assert main(argv) == 2
    assert "expected an int >=" in capsys.readouterr().err


def test_run_warmup_zero_is_allowed(no_device, capsys):
    assert main(["run", "--warmup", "0"]) == 3  # reaches the device check


# -- 8. the Python API's raw exceptions -----------------------------------------------------------

@pytest.mark.parametrize("kw, exc_type, says", [
    (dict(options=5), TypeError, "options must be a string or a sequence of strings"),
    (dict(include_dirs=5), TypeError, "include_dirs must be a string or a sequence"),
    (dict(include_dirs=[5]), TypeError, "include_dirs must be paths"),
    (dict(name_expressions=5), TypeError, "name_expressions must be a string or a sequence"),
    (dict(options=[b"\xff"]), ValueError, "is not UTF-8"),
])
def test_compile_refuses_bad_argument_types_by_name(kw, exc_type, says):
    import orchestra.compiler as oc
    from orchestra.errors import CompilerArgumentError

    with pytest.raises(CompilerArgumentError, match=says) as info:
        oc.compile('extern "C" __global__ void k() {}', arch="sm_90", **kw)
    assert isinstance(info.value, exc_type)


def test_plan_from_json_nested_too_deep_is_a_plan_format_error():
    from orchestra.errors import PlanFormatError
    from orchestra.schedule import Plan

    with pytest.raises(PlanFormatError, match="nested too deeply"):
        Plan.from_json("[" * 100000 + "]" * 100000)


@pytest.mark.parametrize("version, exc_type", [
    ("9.5", TypeError), ((9,), ValueError), ((9, 5, 1), ValueError), ((9, "5"), ValueError),
    ((9, -1), ValueError), (None, TypeError), (95, TypeError),
])
def test_required_cuda_for_ptx_refuses_a_bad_version(version, exc_type):
    from orchestra.compiler.ptx import required_cuda_for_ptx
    from orchestra.errors import CompilerArgumentError

    with pytest.raises(CompilerArgumentError, match=r"\(9, 5\)") as info:
        required_cuda_for_ptx(version)
    assert isinstance(info.value, exc_type)


def test_ptx_version_checks_still_answer():
    from orchestra.compiler.ptx import PtxVersionError, check_ptx_loadable, required_cuda_for_ptx

    assert required_cuda_for_ptx((9, 5)) == (13, 5)
    assert required_cuda_for_ptx([9, 0]) == (13, 0)
    check_ptx_loadable((9, 0), 13000)
    with pytest.raises(PtxVersionError):
        check_ptx_loadable((9, 5), 13000)


@pytest.mark.parametrize("driver, exc_type", [(None, TypeError), ("13000", TypeError),
                                              (-1, ValueError)])
def test_check_ptx_loadable_refuses_a_bad_driver_version(driver, exc_type):
    from orchestra.compiler.ptx import check_ptx_loadable
    from orchestra.errors import CompilerArgumentError

    with pytest.raises(CompilerArgumentError, match="driver_version") as info:
        check_ptx_loadable((9, 5), driver)
    assert isinstance(info.value, exc_type)


# -- 9. the docs ----------------------------------------------------------------------------------

def _doc(name):
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "docs" / name).read_text(encoding="utf-8")


def test_quickstart_serving_example_runs_without_a_gpu():
    text = _doc("quickstart.md")
    section = text[text.index("## 8. The serving engine"):text.index("## Where next")]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "NumpyBackend" in code
    exec(compile(code, "quickstart.md section 8", "exec"), {})  # its asserts check the values


def test_quickstart_no_longer_promises_what_exists():
    text = _doc("quickstart.md")
    assert "Coming with" not in text
    assert "docs/interop.md" in text and "docs/serving.md" in text


def test_bench_help_lists_every_benchmark():
    from orchestra.cli.main import build_parser

    help_text = " ".join(build_parser().format_help().split())
    line = help_text[help_text.index("bench benchmarks:"):help_text.index("tune measure")]
    for name in ("stages", "pdl", "serve", "peers", "multigpu"):
        assert name in line, name


def test_check_goal_is_documented_only_where_it_is_taken():
    from orchestra.cli import exit_codes
    from orchestra.cli.main import build_parser

    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if isinstance(getattr(a, "choices", None), dict))
    takers = {name for name, p in bench.choices.items() if "--check-goal" in p._option_string_actions}
    assert takers == {"stages", "pdl", "multigpu"}
    epilog = " ".join(exit_codes.EPILOG.split())
    assert "bench stages|pdl|multigpu --check-goal" in epilog
    assert "only `bench stages`, `bench pdl` and `bench multigpu` take `--check-goal`" in _doc("cli.md")


def test_errors_doc_says_the_root_is_raised_too():
    text = _doc("errors.md")
    assert "the root of the family; never raised itself" not in text
    assert "also raised itself" in text


def test_schedule_and_verify_refuse_wrong_argument_types_by_name():
    from orchestra.errors import ScheduleArgumentTypeError
    from orchestra.graph import Alloc, Buffer, Free, TaskGraph
    from orchestra.schedule import schedule, verify

    g = TaskGraph()
    b = Buffer("b", 16)
    g.add(Alloc("a", b))
    g.add(Free("f", b))
    plan = schedule(g)
    assert verify(plan, g) == []
    with pytest.raises(ScheduleArgumentTypeError, match="needs a TaskGraph.*got str"):
        schedule("graph", "by-engine", streams=3)
    with pytest.raises(ScheduleArgumentTypeError, match="a Plan and a TaskGraph, in that order; "
                                                       "got TaskGraph and Plan"):
        verify(g, plan)
    with pytest.raises(TypeError):  # still a TypeError for existing except clauses
        verify(None, g)

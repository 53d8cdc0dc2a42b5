"""What a new user's odd option values did to `orchestra plan` / `orchestra run` (no GPU): each
is refused with a message that says what to change, or planned as asked; none runs out of
memory or answers with an internal error."""

import pytest

import orchestra.cli.job_options as jo
from orchestra.cli.main import build_parser, main


@pytest.fixture
def small_host(monkeypatch):
    """A machine of 16 GiB of physical memory, whatever this one has."""
    monkeypatch.setattr(jo, "host_memory_bytes", lambda: 16 << 30)


def test_a_huge_batch_count_is_refused_by_the_host_memory_check(small_host, capsys):
    # was "cannot fit 'int' into an index-sized integer" (a list of 10**20 sizes was made
    # before any check)
    # run refuses it by its pinned memory; plan, which pins nothing, warns of that, then
    # refuses it by the host memory its task graph would take to build
    assert main(["run", "--batches", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra run: the job needs ") and "pinned host memory" in err
    assert err.endswith("but this machine has 16.0 GiB; pass a smaller --batch-mib or fewer "
                        "--batches\n")
    assert main(["plan", "--batches", "99999999999999999999"]) == 2
    warning, refusal = capsys.readouterr().err.splitlines()
    assert warning.startswith("orchestra plan: warning: `orchestra run` would refuse this job")
    assert "pinned host memory" in warning
    assert refusal.startswith("orchestra plan: 99999999999999999999 batches: their task graph")


def test_a_graph_beyond_host_memory_is_refused_before_it_is_built(small_host, capsys):
    # 4-byte batches: 2 billion of them need only 16 GB of pinned memory, but their graph would
    # take terabytes to build (the process was killed)
    assert main(["plan", "--batches", "2000000000", "--batch-mib", "1e-9"]) == 2
    assert capsys.readouterr().err == (
        "orchestra plan: 2000000000 batches: their task graph and plan need about 29.8 TiB of "
        "host memory to build (about 16 KiB a batch) but this machine has 16.0 GiB; pass "
        "fewer --batches or a larger --batch-mib with the same data\n")
    # the limit: 16 GiB / 16 KiB = 1 Mi batches
    args = build_parser().parse_args(["plan", "--batches", str(1 << 20), "--batch-mib",
                                      "1e-9"])
    assert jo.check_options(args, "plan")["batches"] == 1 << 20
    args = build_parser().parse_args(["plan", "--batches", str((1 << 20) + 1), "--batch-mib",
                                      "1e-9"])
    with pytest.raises(jo.UsageError, match="fewer --batches"):
        jo.check_options(args, "plan")


@pytest.mark.parametrize("batches, budget_batches", [(9, 9), (9, 8), (9, 7.5), (9, 1),
                                                     (40, 100), (40, 39), (1, 0.5)])
def test_memory_needs_in_flight_is_in_flight_for_of_the_sizes(batches, budget_batches):
    from orchestra.app.job.graphs import device_peak_bytes, in_flight_for

    per = 2 * 2621 * 4
    args = build_parser().parse_args(["plan", "--batches", str(batches), "--batch-mib", "0.01",
                                      "--device-budget-mib", repr(budget_batches * per / 2**20)])
    needs = jo.memory_needs(args)
    sizes = [2621 * 4] * batches
    assert needs["in_flight"] == in_flight_for(sizes, jo.device_budget(args))
    assert needs["device_peak_bytes"] == device_peak_bytes(sizes, jo.device_budget(args))


def test_plan_with_a_huge_stream_count_prints_the_streams_it_uses(capsys):
    assert main(["plan", "--summary", "--batches", "4", "--batch-mib", "0.01",
                 "--policy", "round-robin", "--streams", "99999999999999999999999"]) == 0
    out = capsys.readouterr().out
    assert "policy round-robin, 4 streams (of 99999999999999999999999 requested" in out


def test_plan_compute_iters_beyond_the_kernels_int_is_a_usage_error(capsys):
    # burn.cu's iters is an int: 2**31 was planned, and `run` would have failed at the launch
    assert main(["plan", "--compute-iters", str(2**31)]) == 2
    assert capsys.readouterr().err.endswith(
        "argument --compute-iters: expected 'auto' or an int from 0 to 2147483647 (the "
        "kernel's int parameter), got 2147483648\n")


def test_the_lane_reason_names_the_streams_given():
    from orchestra.app.job.policy import choose_policy

    c = choose_policy("auto", 3, copies=8, copy_kernels=8, batches=4)
    assert (c.policy, c.streams) == ("round-robin", 3)
    assert "batch b runs in lane b % 3; --streams 3 given" in c.reason  # was b % 4


# -- the Python API: MainJob and choose_policy refuse what they cannot run, by name ---------------

from orchestra.errors import JobConfigError, JobConfigTypeError  # noqa: E402

BAD_JOB = [
    ({"batches": "abc"}, JobConfigTypeError, "batches must be an int >= 1; got 'abc'"),
    ({"batches": 2.5}, JobConfigTypeError, "batches must be an int >= 1; got 2.5"),
    ({"batches": float("nan")}, JobConfigTypeError, "batches must be an int >= 1; got nan"),
    ({"batches": 0}, JobConfigError, "batches must be an int >= 1; got 0"),
    ({"repeat": 0}, JobConfigError, "repeat must be an int >= 1; got 0"),
    ({"warmup": -1}, JobConfigError, "warmup must be an int >= 0; got -1"),
    ({"compute_iters": 2**40}, JobConfigError,
     "compute iterations must be an int from 0 to 2147483647; got 1099511627776"),
    ({"compute_iters": "abc"}, JobConfigTypeError,
     "compute iterations must be 'auto' or an int from 0 to 2147483647; got 'abc'"),
    ({"compute_iters": 1.5}, JobConfigTypeError,
     "compute iterations must be an int from 0 to 2147483647; got 1.5"),
    ({"device_budget": float("nan")}, JobConfigTypeError,
     "device_budget (bytes) must be an int >= 1; got nan"),
    ({"device_budget": float("inf")}, JobConfigTypeError,
     "device_budget (bytes) must be an int >= 1; got inf"),
    ({"device_budget": "abc"}, JobConfigTypeError,
     "device_budget (bytes) must be an int >= 1; got 'abc'"),
    ({"device_budget": True}, JobConfigTypeError,
     "device_budget (bytes) must be an int >= 1; got True"),
    ({"device_budget": None}, JobConfigTypeError,
     "device_budget (bytes) must be an int >= 1; got None"),
    ({"device_budget": 0.5}, JobConfigError, "device_budget (bytes) must be an int >= 1; got 0"),
    ({"block": 0}, JobConfigError, "block must be an int >= 1; got 0"),
    ({"block": "x"}, JobConfigTypeError, "block must be an int >= 1; got 'x'"),
    ({"staging_slots": 0}, JobConfigError, "staging_slots must be an int >= 1; got 0"),
    ({"timing_repeats": 0}, JobConfigError, "timing_repeats must be an int >= 1; got 0"),
    ({"check_iters": -1}, JobConfigError,
     "check_iters must be an int from 0 to 2147483647; got -1"),
]


@pytest.mark.parametrize("kw, cls, message", BAD_JOB)
def test_main_job_refuses_bad_counts_by_name(kw, cls, message):
    from orchestra.app.job.main_job import MainJob

    with pytest.raises(cls) as info:
        MainJob(**kw)
    assert type(info.value) is cls and str(info.value) == message
    assert isinstance(info.value, TypeError if cls is JobConfigTypeError else ValueError)


def test_main_job_keeps_whole_counts():
    from orchestra.app.job.main_job import MainJob

    job = MainJob(batches=32.0, compute_iters="7", device_budget=1.5 * 2**20, block=128)
    assert (job.batches, job.iters, job.device_budget, job.block) == (32, 7, 3 << 19, 128)
    assert type(job.batches) is int


@pytest.mark.parametrize("kw, cls, message", [
    ({"batches": 2.5}, JobConfigTypeError, "batches must be an int >= 1; got 2.5"),
    ({"batches": float("inf")}, JobConfigTypeError, "batches must be an int >= 1; got inf"),
    ({"copies": "4"}, JobConfigTypeError, "copies must be an int >= 0; got '4'"),
    ({"copies": float("nan")}, JobConfigTypeError, "copies must be an int >= 0; got nan"),
    ({"copy_kernels": 9}, JobConfigError, "copy_kernels must be an int from 0 to 8; got 9"),
    ({"in_flight": 0}, JobConfigError,
     "in_flight (None: every batch) must be an int >= 1; got 0"),
    ({"in_flight": float("nan")}, JobConfigTypeError,
     "in_flight (None: every batch) must be an int >= 1; got nan"),
    ({"in_flight": "x"}, JobConfigTypeError,
     "in_flight (None: every batch) must be an int >= 1; got 'x'"),
    ({"lanes": 2.5}, JobConfigTypeError, "lanes must be an int >= 1; got 2.5"),
])
def test_choose_policy_refuses_bad_counts_by_name(kw, cls, message):
    from orchestra.app.job.policy import choose_policy

    args = {"copies": 8, "copy_kernels": 8, "batches": 4, **kw}
    with pytest.raises(cls) as info:
        choose_policy(**args)
    assert type(info.value) is cls and str(info.value) == message


def test_compile_refuses_an_output_in_a_missing_folder_before_compiling(tmp_path, monkeypatch,
                                                                         capsys):
    # was "orchestra compile: [Errno 2] No such file or directory: '.../x.cubin'" after NVRTC
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path / "cache"))
    import orchestra.cli.compile_cmd as cc

    monkeypatch.setattr(cc, "_build", lambda *a: pytest.fail("compiled before the check"))
    src = tmp_path / "k.cu"
    src.write_text("extern \"C\" __global__ void k(float *x) { x[0] = 1.0f; }\n")
    out = tmp_path / "missing" / "x.cubin"
    assert main(["compile", str(src), "--arch", "sm_90", "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"orchestra compile: -o {out}: the folder {out.parent} does not exist; create it or "
        "pass another -o\n")


# -- orchestra bench serve: upper limits, before the device (each once hung or failed late) ------

@pytest.fixture
def no_device(monkeypatch):
    import orchestra.driver as od
    from orchestra.errors import NoDeviceError

    def none(*a, **k):
        raise NoDeviceError("no CUDA device (test)")
    monkeypatch.setattr(od.Device, "get", staticmethod(none))


@pytest.mark.parametrize("option, message", [
    # was "timestamp out of range for platform time_t" from a wait
    (["--duration", "1e30"],
     "--duration is beyond the longest wait Python can make (9.22e+09 s), got 1e+30"),
    (["--max-delay-us", "1e30"],
     "--max-delay-us must be at most 1,000,000 (1 s): a batch that does not fill waits that "
     "long; got 1e+30"),
    # the kernel's int iters: ran forever on --cpu
    (["--iters", str(2**31)],
     "--iters must be at most 2147483647 (the kernel's int parameter), got 2147483648"),
    # the engine built a per-row table of 10**8 entries (hung)
    (["--max-batch", "100000000"],
     "--max-batch 100000000: a batch of that many 4096-byte rows needs 381.5 GiB per buffer "
     "but this machine has 16.0 GiB; pass a smaller --max-batch"),
])
@pytest.mark.parametrize("cpu", [[], ["--cpu"]])
def test_bench_serve_refuses_values_beyond_what_can_run(option, message, cpu, no_device,
                                                        small_host, capsys):
    assert main(["bench", "serve", *cpu, *option]) == 2
    assert capsys.readouterr().err == f"orchestra bench serve: {message}\n"


def test_bench_serve_values_at_the_limits_reach_the_device(no_device, small_host, capsys):
    assert main(["bench", "serve", "--iters", str(2**31 - 1), "--max-batch", str(4 << 20),
                 "--duration", "1e9"]) == 3


# -- orchestra.serve: Batching and the engine's counts ----------------------------------------------

from orchestra.serve.errors import ServeConfigTypeError, ServeConfigValueError  # noqa: E402


@pytest.mark.parametrize("kw, cls, message", [
    ({"max_batch": 2.5}, ServeConfigTypeError, "max_batch (rows) must be an int >= 1; got 2.5"),
    ({"max_batch": "8"}, ServeConfigTypeError, "max_batch (rows) must be an int >= 1; got '8'"),
    ({"max_batch": True}, ServeConfigTypeError,
     "max_batch (rows) must be an int >= 1; got True"),
    ({"max_batch": 0}, ServeConfigValueError, "max_batch (rows) must be >= 1; got 0"),
    # inf was accepted and the engine failed in int(inf * 1000)
    ({"max_delay_us": float("inf")}, ServeConfigValueError,
     "max_delay_us must be at most 9.22e+15 (the longest wait Python can make); got inf"),
])
def test_batching_refuses_what_the_engine_cannot_use(kw, cls, message):
    from orchestra.serve.engine import Batching

    with pytest.raises(cls) as info:
        Batching(**kw)
    assert type(info.value) is cls and str(info.value) == message


@pytest.mark.parametrize("value, cls, message", [
    (1.5, ServeConfigTypeError, "completions_per_turn must be an int >= 1; got 1.5"),
    (True, ServeConfigTypeError, "completions_per_turn must be an int >= 1; got True"),
    ("x", ServeConfigTypeError, "completions_per_turn must be an int >= 1; got 'x'"),
    (None, ServeConfigTypeError, "completions_per_turn must be an int >= 1; got None"),
    (float("nan"), ServeConfigTypeError, "completions_per_turn must be an int >= 1; got nan"),
    (0, ServeConfigValueError, "completions_per_turn must be >= 1; got 0"),
])
def test_engine_completions_per_turn_must_be_a_count(value, cls, message):
    from orchestra.serve import Engine
    from orchestra.serve.backend import NumpyBackend

    with pytest.raises(cls) as info:
        Engine(backend=NumpyBackend(lambda d: {"y": d["x"]}), inputs={"x": ((4,), "float32")},
               outputs={"y": ((4,), "float32")}, max_rows=8, completions_per_turn=value)
    assert type(info.value) is cls and str(info.value) == message

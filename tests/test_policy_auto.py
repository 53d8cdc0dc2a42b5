"""``--policy auto`` / ``--streams auto`` on the CPU: the resolution rules (copy kernels ->
round-robin lanes, else by-engine on 3 streams; caps; explicit options win; bad values), the
copy counts per size and lowering, what `orchestra plan` schedules and prints per size,
executor and lowering, the main job on the fake driver running a lane plan, the peers'
contenders' choice and the bound's stream count."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from orchestra.app.job.policy import (
    DEFAULT_STREAMS,
    LANES,
    PolicyChoice,
    choose_policy,
    count_copies,
)
from orchestra.cli.main import main
from orchestra.errors import JobConfigError, JobConfigTypeError
from orchestra.execute import DEFAULT_CROSSOVER, CopyCrossover, CopyPolicy
from orchestra.schedule import Plan

KIB, MIB = 1 << 10, 1 << 20


def graph_policy(lowering="auto", access=True, table=DEFAULT_CROSSOVER):
    return CopyPolicy(lowering, "graph", table, access)


def eager_policy(lowering="auto", access=True):
    return CopyPolicy(lowering, "eager", DEFAULT_CROSSOVER, access)


# -- the rules ------------------------------------------------------------------------------------


def test_copy_kernels_make_lanes_capped_at_the_batches():
    c = choose_policy(copies=2048, copy_kernels=2048, batches=1024, executor="graph executor")
    assert (c.policy, c.streams) == ("round-robin", LANES) == ("round-robin", 16)
    assert c.lanes and c.auto and c.requested_policy == c.requested_streams == "auto"
    assert "2048 of 2048 host copies run as copy kernels (graph executor)" in c.reason
    assert "lane b % 16" in c.reason and "capped" not in c.reason
    few = choose_policy(copies=8, copy_kernels=8, batches=4)
    assert (few.policy, few.streams) == ("round-robin", 4)
    assert "4 lanes (16, capped at the 4 batches)" in few.reason
    bounded = choose_policy(copies=2000, copy_kernels=2000, batches=1000, in_flight=6)
    assert bounded.streams == 6 and "capped at the 6 batches in flight" in bounded.reason


def test_copy_engine_copies_keep_by_engine_on_three_streams():
    c = choose_policy(copies=64, copy_kernels=0, batches=32)
    assert (c.policy, c.streams) == ("by-engine", DEFAULT_STREAMS) == ("by-engine", 3)
    assert not c.lanes and "by-engine feeds one copy engine per direction" in c.reason


@pytest.mark.parametrize("kernels,policy", [(0, "by-engine"), (9, "by-engine"),
                                            (10, "round-robin"), (20, "round-robin")])
def test_lanes_when_at_least_half_the_copies_are_copy_kernels(kernels, policy):
    # a measured table may lower one direction only: H2D kernels, D2H on the engines
    assert choose_policy(copies=20, copy_kernels=kernels, batches=10).policy == policy


def test_explicit_options_win():
    c = choose_policy("by-engine", "auto", copies=2048, copy_kernels=2048, batches=1024)
    assert (c.policy, c.streams) == ("by-engine", 3) and not c.lanes
    assert c.reason == "--policy by-engine given; streams auto: 3"
    c = choose_policy("round-robin", "auto", copies=2048, copy_kernels=2048, batches=1024)
    assert (c.policy, c.streams) == ("round-robin", 16) and c.lanes
    c = choose_policy("round-robin", "auto", copies=64, copy_kernels=0, batches=32)
    assert (c.policy, c.streams) == ("round-robin", 3) and not c.lanes
    c = choose_policy("auto", 6, copies=2048, copy_kernels=2048, batches=1024)
    assert (c.policy, c.streams) == ("round-robin", 6) and c.reason.endswith("--streams 6 given")
    c = choose_policy("concurrent", 5, copies=2048, copy_kernels=2048, batches=1024)
    assert (c.policy, c.streams, c.auto) == ("concurrent", 5, False)
    assert c.as_dict() == {"policy": "concurrent", "streams": 5, "requested_policy":
                           "concurrent", "requested_streams": 5, "reason": c.reason,
                           "copies": 2048, "copy_kernels": 2048, "lanes": False,
                           "kernel_fills_gpu": None}


# -- a kernel smaller than the GPU: two compute streams for the CUDA graph executors --------------


def big_job(**kw):
    """256 x 4 MiB, copies on the copy engines: what ``orchestra run --batches 256 --batch-mib 4``
    counts (512 host copies, none a copy kernel)."""
    return choose_policy(**{**dict(copies=512, copy_kernels=0, batches=256,
                                   executor="graph executor"), **kw})


def test_a_kernel_smaller_than_the_gpu_gets_two_compute_streams_in_a_cuda_graph():
    from orchestra.app.job.policy import OVERLAP_NOTE, OVERLAP_STREAMS

    c = big_job(kernel_fills_gpu=False)
    assert (c.policy, c.streams) == ("by-engine", OVERLAP_STREAMS) == ("by-engine", 4)
    assert c.auto and not c.lanes and c.kernel_fills_gpu is False
    assert c.reason == ("auto: 0 of 512 host copies run as copy kernels (graph executor); "
                        "by-engine feeds one copy engine per direction; streams auto: 4 "
                        f"(upload, 2 compute, download): {OVERLAP_NOTE}")
    assert "23.3 ms on 4" in c.reason and "fewer blocks than the GPU holds" in c.reason
    assert c.as_dict()["kernel_fills_gpu"] is False and c.as_dict()["streams"] == 4
    # the capture executor too; and in_flight bounded to 2 still has two kernels to overlap
    assert big_job(executor="capture executor", kernel_fills_gpu=False).streams == 4
    assert big_job(in_flight=2, kernel_fills_gpu=False).streams == 4


@pytest.mark.parametrize("kw,why,tail", [
    (dict(kernel_fills_gpu=True), "fills the GPU: one compute stream",
     " (the kernel fills the GPU: one compute stream)"),
    (dict(kernel_fills_gpu=None), "unknown (orchestra plan): 3, and the reason says why",
     " (the kernel's size against the GPU is unknown here; one smaller than the GPU gets 4: "
     "two compute streams)"),
    (dict(eager=True, executor="eager executor", kernel_fills_gpu=False),
     "eager: noise-level, lost at 1500 iters", ""),
    (dict(batches=1, copies=2, kernel_fills_gpu=False), "one batch: nothing to overlap", ""),
    (dict(in_flight=1, kernel_fills_gpu=False), "one batch in flight", ""),
])
def test_by_engine_keeps_three_streams_otherwise(kw, why, tail):
    c = big_job(**kw)
    assert (c.policy, c.streams) == ("by-engine", 3), why
    assert c.reason.endswith("by-engine feeds one copy engine per direction; streams auto: 3"
                             + tail)
    # where a kernel's size could not change the count (eager, one batch in flight), the
    # reason says nothing about compute streams, whatever the kernel
    if not tail:
        assert c.reason == big_job(**{**kw, "kernel_fills_gpu": None}).reason


def test_explicit_options_win_over_a_small_kernel():
    small = dict(kernel_fills_gpu=False)
    c = big_job(policy="by-engine", **small)  # --policy by-engine --streams auto: 3, as always
    assert (c.policy, c.streams) == ("by-engine", 3)
    assert c.reason == "--policy by-engine given; streams auto: 3"
    c = big_job(streams=3, **small)  # --streams 3: by-engine on 3
    assert (c.policy, c.streams) == ("by-engine", 3) and c.reason.endswith("--streams 3 given")
    c = big_job(streams=6, **small)
    assert (c.policy, c.streams) == ("by-engine", 6)
    c = big_job(policy="concurrent", **small)
    assert (c.policy, c.streams) == ("concurrent", 3)
    # copy kernels: lanes whatever the kernel's size
    c = choose_policy(copies=2048, copy_kernels=2048, batches=1024, kernel_fills_gpu=False)
    assert (c.policy, c.streams) == ("round-robin", 16)


@pytest.mark.parametrize("bad", [0, 1, "no", 0.0])
def test_kernel_fills_gpu_must_be_a_bool_or_none(bad):
    from orchestra.errors import JobConfigTypeError

    with pytest.raises(JobConfigTypeError, match="kernel_fills_gpu must be True, False or None"):
        big_job(kernel_fills_gpu=bad)


def test_four_by_engine_streams_put_the_batch_kernels_on_two_compute_streams():
    """What the 4 streams are: upload, compute0 / compute1 (batch kernels alternating),
    download; copies stay on one stream per direction."""
    from orchestra.app.job.graphs import build_job_graph
    from orchestra.schedule import schedule

    jg = build_job_graph([4 * MIB] * 6, iters=1, block=256, sm_count=132)
    plan = schedule(jg.graph, "by-engine", big_job(kernel_fills_gpu=False).streams)
    assert sorted(s.name for s in plan.streams) == ["compute0", "compute1", "download", "upload"]
    assert [plan.node_stream[f"b{b}.kernel"] for b in range(6)] == ["compute0", "compute1"] * 3
    assert {plan.node_stream[f"b{b}.h2d"] for b in range(6)} == {"upload"}
    assert {plan.node_stream[f"b{b}.d2h"] for b in range(6)} == {"download"}


class OccupancyKernel:
    """A kernel with ``occupancy`` (blocks per SM) that records what it was asked."""

    def __init__(self, per_sm):
        self.per_sm, self.asked = per_sm, []

    def occupancy(self, block, shared_mem=0):
        self.asked.append((block, shared_mem))
        return self.per_sm


def test_fills_gpu_compares_the_grid_with_the_resident_blocks():
    from orchestra.app.job.graphs import burn_grid
    from orchestra.app.job.policy import fills_gpu

    k = OccupancyKernel(8)  # 8 blocks of 256 threads per SM: 2048 threads, an H200's limit
    grid = burn_grid((4 * MIB) // 4, 256, 132)
    assert grid == 528  # capped at 4 blocks per SM
    assert fills_gpu(k, grid, 256, 132) is False  # 528 < 8 * 132 = 1056
    assert k.asked == [(256, 0)]
    assert fills_gpu(k, 1056, 256, 132) is True and fills_gpu(k, 1057, 256, 132) is True
    assert fills_gpu(k, 1055, 256, 132) is False
    assert fills_gpu(k, 100, 512, 132, shared_mem=4096) is False and k.asked[-1] == (512, 4096)
    assert fills_gpu(OccupancyKernel(4), 528, 256, 132) is True  # 4 per SM: exactly full
    assert fills_gpu(object(), 528, 256, 132) is None  # no occupancy: unknown
    assert fills_gpu(k, 528, 256, 0) is None and fills_gpu(k, 528, 256, None) is None


@pytest.mark.parametrize("kw", [dict(policy="fastest"), dict(streams=0), dict(streams=True),
                                dict(streams="many"), dict(streams=2.0),
                                dict(copy_kernels=3, copies=2), dict(batches=0)])
def test_bad_values_are_refused(kw):
    args = {**dict(copies=2, copy_kernels=2, batches=1), **kw}
    with pytest.raises(JobConfigError) as e:
        choose_policy(**args)
    assert isinstance(e.value, ValueError)


def test_copy_counts_per_size_and_lowering():
    sizes = [64 * KIB] * 5 + [4 * KIB]  # ragged last batch
    assert count_copies(sizes, graph_policy()) == (12, 12)
    assert count_copies(sizes, eager_policy()) == (12, 0)  # eager keeps the copy engines
    assert count_copies(sizes, eager_policy("kernel")) == (12, 12)
    assert count_copies(sizes, graph_policy("copy-engine")) == (12, 0)
    assert count_copies([MIB] * 4, graph_policy()) == (8, 0)  # above the 256 KiB crossover
    assert count_copies([MIB] * 4, graph_policy("kernel")) == (8, 8)
    assert count_copies([4 * KIB] * 4, graph_policy(access=False)) == (8, 0)
    one_way = CopyCrossover(graph_h2d=256 * KIB, graph_d2h=0, eager_h2d=0, eager_d2h=0)
    assert count_copies([64 * KIB] * 3 + [512 * KIB], graph_policy(table=one_way)) == (8, 3)


# -- orchestra plan -------------------------------------------------------------------------------


def plan_json(capsys, *argv, batches=40):
    assert main(["plan", "--batches", str(batches), *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mib,executor,lowering,policy,streams", [
    (0.00390625, "graph", "auto", "round-robin", 16),   # 4 KiB
    (0.0625, "graph", "auto", "round-robin", 16),       # 64 KiB
    (0.0625, "capture", "auto", "round-robin", 16),
    (0.0625, "eager", "auto", "by-engine", 3),          # eager's crossover: copy engines
    (0.0625, "eager", "kernel", "by-engine", 3),        # eager: lanes cost host time
    (0.0625, "graph", "copy-engine", "by-engine", 3),
    (1, "graph", "auto", "by-engine", 3),               # 1 MiB: above the crossover
    (1, "graph", "kernel", "round-robin", 16),
    (16, "capture", "auto", "by-engine", 3),
])
def test_plan_resolves_auto_per_size_executor_and_lowering(capsys, mib, executor, lowering,
                                                           policy, streams):
    out = plan_json(capsys, "--batch-mib", str(mib), "--executor", executor,
                    "--copy-lowering", lowering)
    assert (out["policy"], out["streams"]) == (policy, streams)
    assert out["policy_requested"] == out["streams_requested"] == "auto"
    choice = out["policy_choice"]
    assert choice["copies"] == 80 == out["copy_lowering"]["copies"]
    assert choice["copy_kernels"] == out["copy_lowering"]["copy_kernels"]
    assert choice["lanes"] is (policy == "round-robin")
    plan = Plan.from_dict(out["plan"])
    assert plan.policy == policy and len(plan.streams) == streams
    if policy == "round-robin":  # each batch's chain in lane b % 16
        for b in (0, 5, 16, 39):
            for step in ("h2d", "d2h"):
                assert plan.node_stream[f"b{b}.{step}"] == f"s{b % 16}"
        assert out["events"] == 0  # lanes never wait on each other


def test_plan_printout_shows_the_choice_and_why(capsys):
    assert main(["plan", "--batches", "1024", "--batch-mib", "0.0625", "--executor", "graph",
                 "--summary"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("orchestra plan: 1024 batches x 64.0 KiB (64.0 MiB), policy "
                               "round-robin, 16 streams, compute iters")
    assert lines[1] == (
        "policy choice: round-robin on 16 streams (auto: 2048 of 2048 host copies run as "
        "copy kernels (graph executor), which are latency-bound and overlap on the SMs: batch "
        "b runs in lane b % 16; streams auto: 16 lanes)")
    assert "7168 nodes" in lines[2] and "0 events, 0 waits, 16 streams" in lines[2]
    assert main(["plan", "--batches", "4", "--batch-mib", "64", "--summary"]) == 0
    text = capsys.readouterr().out
    assert "policy choice: by-engine on 3 streams (auto: 0 of 8 host copies run as copy " \
           "kernels (eager executor); by-engine feeds one copy engine per direction; streams " \
           "auto: 3)" in text



@pytest.mark.parametrize("executor", ["graph", "capture"])
def test_plan_says_why_a_cuda_graph_job_shows_3_streams_where_run_may_use_4(capsys, executor):
    """Without a GPU `orchestra plan` cannot tell whether the kernel fills it: its 3 streams
    may be 4 in `orchestra run`, and its reason says so (text and --json)."""
    assert main(["plan", "--batches", "8", "--batch-mib", "4", "--executor", executor,
                 "--summary"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("policy choice:")][0]
    assert line.startswith("policy choice: by-engine on 3 streams (")
    assert line.endswith("streams auto: 3 (the kernel's size against the GPU is unknown "
                         "here; one smaller than the GPU gets 4: two compute streams))")
    out = plan_json(capsys, "--batch-mib", "4", "--executor", executor)
    assert out["streams"] == 3 and out["policy_choice"]["kernel_fills_gpu"] is None
    assert "one smaller than the GPU gets 4" in out["policy_choice"]["reason"]
    # eager keeps 3 whatever the kernel: nothing to say about it
    out = plan_json(capsys, "--batch-mib", "4", "--executor", "eager")
    assert out["streams"] == 3 and "GPU" not in out["policy_choice"]["reason"]

def test_plan_explicit_policy_and_streams_win(capsys):
    out = plan_json(capsys, "--batch-mib", "0.0625", "--executor", "graph", "--policy",
                    "by-engine")
    assert (out["policy"], out["streams"]) == ("by-engine", 3)
    assert out["policy_choice"]["reason"] == "--policy by-engine given; streams auto: 3"
    out = plan_json(capsys, "--batch-mib", "0.0625", "--executor", "graph", "--streams", "6")
    assert (out["policy"], out["streams"], out["streams_requested"]) == ("round-robin", 6, 6)
    out = plan_json(capsys, "--batch-mib", "64", "--policy", "round-robin", "--streams", "auto")
    assert (out["policy"], out["streams"]) == ("round-robin", 3)
    # --streams auto caps the lanes at the batches
    out = plan_json(capsys, "--batch-mib", "0.0625", "--executor", "graph", batches=5)
    assert (out["policy"], out["streams"]) == ("round-robin", 5)


@pytest.mark.parametrize("bad", ["0", "-2", "lots"])
def test_plan_refuses_a_bad_stream_count(capsys, bad):
    assert main(["plan", "--batches", "4", "--streams", bad]) == 2
    assert "expected 'auto' or an int >= 1" in capsys.readouterr().err


def test_plan_with_an_input_file_caps_the_lanes_at_the_staging_slots(tmp_path, capsys):
    path = tmp_path / "in.npy"
    np.save(path, np.arange(64 * 1024, dtype=np.float32))  # 256 KiB: 16 batches of 16 KiB
    assert main(["plan", "--input", str(path), "--batch-mib", "0.015625", "--executor",
                 "graph", "--staging-slots", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batches"] == 16
    assert (out["policy"], out["streams"]) == ("round-robin", 5)
    assert "capped at the 5 batches in flight" in out["policy_choice"]["reason"]


# -- the main job on the fake driver ---------------------------------------------------------------


def test_main_job_times_the_sustained_items_over_the_lanes(monkeypatch):
    """`MainJob._timings` hands the plan's concurrency to the sustained measurement: the lane
    count as streams, K grown to 16 items per lane, the copy kernel timed too, and the items
    launched as the run is (streams for eager, one CUDA graph for the graph executors)."""
    from orchestra.app.job import main_job as mj

    calls = []

    class Timer:
        def __init__(self, kernel, stream, host_in, host_out, **kw):
            self.nbytes = host_in.nbytes

        def measure(self, iters, **kw):
            calls.append(kw)
            return "single"

        def close(self):
            pass

    monkeypatch.setattr(mj, "BatchTimer", Timer)
    job = mj.MainJob(batches=1024, batch_mib=0.0625, compute_iters=1)
    x = np.zeros(16384, np.float32)
    job.choice = choose_policy(copies=2048, copy_kernels=2048, batches=1024)
    assert job._timings(None, None, x, x, 16, 1024) == "single"
    assert calls[-1] == {"items": 256, "streams": 16, "copy_kernel": True, "launch": "stream"}
    job.choice = choose_policy(copies=2048, copy_kernels=0, batches=1024)
    job._timings(None, None, x, x, 16, 1024)
    assert calls[-1] == {"items": 48, "streams": 3, "copy_kernel": False, "launch": "stream"}
    # a run that is a CUDA graph times its sustained items as a CUDA graph
    for executor in ("graph", "capture"):
        job = mj.MainJob(batches=1024, batch_mib=0.0625, compute_iters=1, executor=executor)
        job.choice = choose_policy(copies=2048, copy_kernels=2048, batches=1024)
        job._timings(None, None, x, x, 16, 1024)
        assert calls[-1] == {"items": 256, "streams": 16, "copy_kernel": True,
                             "launch": "graph"}


@pytest.fixture
def lane_job(monkeypatch):
    """The main job on the eager fake (tests/test_execute_job.py's fixture), with kernels
    that address host memory (so copies can be copy kernels) and the copy kernel loadable."""
    from orchestra.app.job import Sustained
    from orchestra.app.job.timing import SingleBatch
    from orchestra.execute import EagerExecutor, KernelResolver
    from tests.fake_cuda import FakeCuda, fake_kernel
    from tests.test_execute_job import patch_main_job

    fake = FakeCuda(monkeypatch)
    fake.device.kernel_host_access = True
    seen = {}

    def make_executor(name="eager", device=None, *, verify=True, copy_lowering="auto"):
        return EagerExecutor(kernel_resolver=KernelResolver(fake.device, fake_kernel),
                             verify=verify, copy_lowering=copy_lowering)

    def fake_timings(self, kernel, stream, host_in, host_out, grid, batches):
        seen["choice"] = self.choice  # resolved before the timings
        return SingleBatch(host_in.nbytes, self.iters, 1.0, 1.0, 1.0, 7,
                           Sustained(host_in.nbytes, 16, 1.0, 1.0, 1.0, 1.25))

    patch_main_job(monkeypatch, fake, make_executor, fake_timings)
    fake.seen = seen
    return fake


def test_main_job_runs_copy_kernels_in_lanes_and_verifies(lane_job):
    from orchestra.app.job import MainJob
    from orchestra.app.job.policy import EAGER_LANES_NOTE

    # eager: auto keeps by-engine even with copy kernels (the host enqueues each of them)
    r = MainJob(batches=20, batch_mib=0.01, compute_iters=5, repeat=1,
                copy_lowering="kernel").run()
    assert r.verified and r.routing_check is True
    assert (r.policy, r.streams) == ("by-engine", 3)
    assert (r.policy_requested, r.streams_requested) == ("auto", "auto")
    assert "40 of 40 host copies run as copy kernels (eager executor)" in r.policy_reason
    assert EAGER_LANES_NOTE in r.policy_reason and r.copy_kernels == 40
    # lanes asked for: round-robin with --streams auto runs 16 lanes
    events = lane_job.counts["cuEventRecord"]
    r = MainJob(batches=20, batch_mib=0.01, compute_iters=5, repeat=1, policy="round-robin",
                copy_lowering="kernel").run()
    assert r.verified and (r.policy, r.streams) == ("round-robin", 16)
    assert r.copy_kernels == 40 and lane_job.seen["choice"].streams == 16
    assert lane_job.counts["cuEventRecord"] == events  # lanes never wait on each other
    # the default lowering keeps eager copies on the copy engines: by-engine, 3 streams
    r = MainJob(batches=20, batch_mib=0.01, compute_iters=5, repeat=1).run()
    assert r.verified and (r.policy, r.streams, r.copy_kernels) == ("by-engine", 3, 0)
    d = r.as_dict()
    assert d["policy_requested"] == "auto" and "by-engine feeds" in d["policy_reason"]
    # explicit options are kept
    r = MainJob(batches=20, batch_mib=0.01, compute_iters=5, repeat=1, policy="round-robin",
                streams=2, copy_lowering="kernel").run()
    assert r.verified and (r.policy, r.streams) == ("round-robin", 2)
    assert r.policy_reason == "--policy round-robin given; --streams 2 given"


@pytest.fixture
def graph_job(monkeypatch):
    """The main job with the graph runners on the graph fake (tests/fake_graph_cuda.py): the
    job graph captured or built and replayed on host memory, outputs real; the burn kernel a
    `FakeGraphKernel` whose ``occupancy`` answers ``graph_job.per_sm`` blocks per SM (None:
    a kernel without ``occupancy``). Device timings faked as in `lane_job`."""
    from orchestra.app.job import Sustained
    from orchestra.app.job.timing import SingleBatch
    from orchestra.execute.cuda_graph.runner import GraphRunner
    from orchestra.execute import EagerExecutor, KernelResolver
    from tests import fake_graph_cuda as fg
    from tests.fake_cuda import FakeCuda, FakeKernel
    from tests.test_execute_job import patch_main_job

    fake = fg.install(monkeypatch)
    eager_fake = FakeCuda()
    state = types.SimpleNamespace(per_sm=None, asked=[], seen={}, fake=fake)

    def burn(cls):
        if state.per_sm is None:  # a kernel that cannot be asked
            return cls()

        class Burn(cls):
            def occupancy(self, block, shared_mem=0):
                state.asked.append((block, shared_mem))
                return state.per_sm
        return Burn()

    def make_executor(name="eager", device=None, *, verify=True, copy_lowering="auto"):
        if name == "eager":
            return EagerExecutor(eager_fake.device, driver=eager_fake, verify=verify,
                                 copy_lowering=copy_lowering,
                                 kernel_resolver=KernelResolver(eager_fake.device,
                                                                lambda r, d: burn(FakeKernel)))
        return GraphRunner(name, fake.device, verify=verify, copy_lowering=copy_lowering,
                           kernel_resolver=fg.resolver(fake, {"burn": burn(fg.FakeGraphKernel)}))

    def fake_timings(self, kernel, stream, host_in, host_out, grid, batches):
        state.seen["choice"], state.seen["grid"] = self.choice, grid
        return SingleBatch(host_in.nbytes, self.iters, 1.0, 1.0, 1.0, 7,
                           Sustained(host_in.nbytes, 16, 1.0, 1.0, 1.0, 1.25))

    patch_main_job(monkeypatch, fake, make_executor, fake_timings)
    return state


@pytest.mark.parametrize("executor", ["graph", "capture"])
def test_main_job_runs_a_small_kernel_on_two_compute_streams_in_a_cuda_graph(graph_job,
                                                                              executor):
    """``orchestra run --executor graph|capture`` with a burn grid smaller than the GPU (the
    fake's 4 SMs hold 2 blocks each: 8 > the 6 blocks of a 20 KiB batch): by-engine on 4
    streams, verified against numpy; a kernel that fills the GPU or cannot be asked, 3."""
    from orchestra.app.job import MainJob
    from orchestra.app.job.policy import OVERLAP_NOTE

    def run(**kw):
        return MainJob(batches=6, batch_mib=0.02, compute_iters=5, repeat=1,
                       executor=executor, **kw).run()

    graph_job.per_sm = 2
    r = run()
    assert graph_job.seen["grid"] == 6 and graph_job.asked[-1] == (256, 0)
    assert r.verified and r.routing_check is True and r.mismatches == 0
    assert (r.policy, r.streams, r.copy_kernels) == ("by-engine", 4, 0)
    assert graph_job.seen["choice"].streams == 4  # resolved before the timings
    assert graph_job.seen["choice"].kernel_fills_gpu is False
    assert r.policy_reason.endswith(f"streams auto: 4 (upload, 2 compute, download): "
                                    f"{OVERLAP_NOTE}")
    assert f"({executor} executor)" in r.policy_reason
    graph_job.per_sm = 1  # 4 resident blocks: the 6 fill the GPU
    r = run()
    assert r.verified and (r.policy, r.streams) == ("by-engine", 3)
    assert r.policy_reason.endswith("streams auto: 3 (the kernel fills the GPU: one compute "
                                    "stream)")
    graph_job.per_sm = None  # unknown: as before
    r = run()
    assert r.verified and (r.policy, r.streams) == ("by-engine", 3)
    assert graph_job.seen["choice"].kernel_fills_gpu is None
    assert r.policy_reason.endswith("one smaller than the GPU gets 4: two compute streams)")
    # explicit options are kept
    graph_job.per_sm = 2
    r = run(streams=3)
    assert r.verified and (r.policy, r.streams) == ("by-engine", 3)
    r = run(policy="by-engine")
    assert r.verified and (r.policy, r.streams) == ("by-engine", 3)


def test_main_job_eager_keeps_three_streams_with_a_small_kernel(graph_job):
    from orchestra.app.job import MainJob

    graph_job.per_sm = 2
    r = MainJob(batches=6, batch_mib=0.01, compute_iters=5, repeat=1).run()
    assert r.verified and (r.policy, r.streams) == ("by-engine", 3)
    assert graph_job.seen["choice"].kernel_fills_gpu is False  # asked, and eager keeps 3


def test_main_job_with_an_input_file_picks_the_streams_from_the_kernel_too(graph_job,
                                                                           tmp_path):
    from orchestra.app.job import MainJob

    graph_job.per_sm = 2
    src = np.random.default_rng(5).random(6 * 2621 - 50, dtype=np.float32)
    np.save(tmp_path / "in.npy", src)
    r = MainJob(batch_mib=0.01, compute_iters=5, repeat=1, executor="graph",
                input=tmp_path / "in.npy", output=tmp_path / "out.npy",
                staging_slots=3).run()
    assert r.verified and (r.policy, r.streams) == ("by-engine", 4) and r.batches == 6
    want = src.copy()
    for _ in range(5):
        want = np.float32(0.5) * want + np.float32(1.0)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, rtol=1e-6)
    graph_job.per_sm = None
    r = MainJob(batch_mib=0.01, compute_iters=5, repeat=1, executor="graph",
                input=tmp_path / "in.npy", output=tmp_path / "out.npy").run()
    assert r.verified and (r.policy, r.streams) == ("by-engine", 3)


def test_the_graph_runner_answers_the_copy_policy_the_main_job_asks(monkeypatch):
    """MainJob resolves auto from make_executor's result: for the graph executors a
    GraphRunner, whose copy_policy is its executor's."""
    from orchestra.execute.cuda_graph.runner import GraphRunner
    from tests.graphs_for_tests import fake_drivers

    _, graph = fake_drivers(monkeypatch, kernel_host_access=True)
    for kind in ("capture", "graph"):
        with GraphRunner(kind, copy_lowering="kernel") as r:
            assert r.copy_policy() is r.executor.copy_policy()
            assert r.copy_policy().lowering == "kernel"
            assert r.copy_policy("copy-engine").lowering == "copy-engine"
            assert count_copies([4096] * 3, r.copy_policy()) == (6, 6)


def test_main_job_refuses_a_bad_policy_or_stream_count():
    from orchestra.app.job import MainJob

    with pytest.raises(JobConfigError, match="policy must be one of auto, round-robin"):
        MainJob(policy="fastest")
    with pytest.raises(JobConfigError, match="streams must be 'auto' or an int >= 1"):
        MainJob(streams=0)


def test_run_report_prints_the_choice_and_the_chain_times(lane_job, capsys):
    import attrs

    from orchestra.app.job import MainJob
    from orchestra.cli.run_cmd import print_report

    r = MainJob(batches=20, batch_mib=0.01, compute_iters=5, repeat=1, policy="round-robin",
                copy_lowering="kernel").run()
    su = dict(r.sustained, streams=16, h2d_chain_ms=2.0, kernel_chain_ms=1.5, d2h_chain_ms=2.5)
    print_report(attrs.evolve(r, sustained=su, bound_warning=None))
    out = capsys.readouterr().out
    assert "executor eager, policy round-robin, 16 streams" in out
    assert "policy choice: --policy round-robin given; streams auto: 16 lanes" in out
    assert "the faster of 1 and 16 streams (the plan's concurrency)" in out
    assert ("one batch's chain step by step (the same items on one stream; the bound's fill "
            "and drain): H2D 2.0000 ms, kernel 1.5000 ms, D2H 2.5000 ms") in out
    assert "each sustained copy time is the faster of the copy engines and the copy kernel" in out


# -- the peers' contenders -------------------------------------------------------------------------


def test_peers_pipeline_policy_and_the_bound_streams():
    from orchestra.app.peers.harness import bound_streams
    from orchestra.app.peers.orchestra_side import pipeline_policy
    from tests.fake_cuda import FakeDevice

    small = types.SimpleNamespace(batches=1024, batch_bytes=64 * KIB)
    big = types.SimpleNamespace(batches=256, batch_bytes=4 * MIB)
    c = pipeline_policy(small, graph_policy(), executor="graph-build executor")
    assert isinstance(c, PolicyChoice) and (c.policy, c.streams) == ("round-robin", 16)
    assert "(graph-build executor)" in c.reason
    assert (pipeline_policy(small, eager_policy()).policy) == "by-engine"
    assert (pipeline_policy(big, graph_policy()).policy) == "by-engine"
    assert pipeline_policy(small, graph_policy(), "by-engine", 3).streams == 3
    dev = FakeDevice()
    dev.kernel_host_access = True
    assert bound_streams(dev, small) == 16  # the graph rows run 16 lanes
    assert bound_streams(dev, big) == 3     # every contender on 3 streams
    dev.kernel_host_access = False
    assert bound_streams(dev, small) == 3   # no copy kernels anywhere


@pytest.mark.parametrize("args, error", [
    (("528", 256, 132), JobConfigTypeError),  # a string is not a block count
    ((528.9, 256, 132), JobConfigTypeError),  # nor a fraction (was truncated to 528)
    ((528, 256, 1.5), JobConfigTypeError),  # 1.5 SMs (was 1: "fills" a 132-SM GPU)
    ((float("nan"), 256, 132), JobConfigTypeError),  # was a bare int() ValueError
    ((True, 256, 132), JobConfigTypeError),  # a bool is not a grid
    ((528, 256, True), JobConfigTypeError),
    ((0, 256, 132), JobConfigError),  # no blocks: no launch
    ((528, 0, 132), JobConfigError),
    ((528, 256, -3), JobConfigError),  # was None (unknown)
])
def test_fills_gpu_refuses_counts_that_are_not_whole_numbers(args, error):
    from orchestra.app.job.policy import fills_gpu

    with pytest.raises(error):
        fills_gpu(OccupancyKernel(4), *args)


def test_fills_gpu_takes_numpy_counts_and_checks_the_occupancy_answer():
    from orchestra.app.job.policy import fills_gpu

    k = OccupancyKernel(np.int32(4))
    assert fills_gpu(k, np.int64(528), np.int64(256), np.int64(132)) is True
    assert fills_gpu(k, np.int64(527), 256, 132) is False
    assert fills_gpu(k, 528.0, 256, 132) is True  # a whole float is a count
    for bad in (None, "4", 4.5, -1):
        with pytest.raises(JobConfigError, match="occupancy"):
            fills_gpu(OccupancyKernel(bad), 528, 256, 132)


def test_numpy_streams_and_bools_are_what_they_look_like():
    c = choose_policy(streams=np.int64(4), copies=8, copy_kernels=0, batches=4)
    assert c.streams == 4 and type(c.requested_streams) is int
    assert json.loads(json.dumps(c.as_dict()))["requested_streams"] == 4
    for flag, streams in ((np.False_, 4), (np.True_, 3), (np.int64(528) >= np.int64(1056), 4)):
        c = choose_policy(copies=8, copy_kernels=0, batches=4, kernel_fills_gpu=flag)
        assert c.streams == streams and type(c.kernel_fills_gpu) is bool
        assert json.loads(json.dumps(c.as_dict()))["kernel_fills_gpu"] is bool(flag)
    for bad in (np.True_, 4.0, "4", None):
        with pytest.raises(JobConfigError):
            choose_policy(streams=bad, copies=8, copy_kernels=0, batches=4)
    with pytest.raises(JobConfigTypeError):
        choose_policy(copies=8, copy_kernels=0, batches=4, kernel_fills_gpu=np.array(False))


def test_large_batches_keep_one_compute_stream():
    """Two compute streams only up to OVERLAP_MAX_BATCH_BYTES per batch: the 32 x 64 MiB
    pipeline read lower on 4 streams; 4 MiB batches gain."""
    from orchestra.app.job.policy import OVERLAP_MAX_BATCH_BYTES, choose_policy

    kw = dict(copies=64, copy_kernels=0, batches=32, executor="graph executor",
              kernel_fills_gpu=False)
    small = choose_policy(batch_bytes=4 << 20, **kw)
    edge = choose_policy(batch_bytes=OVERLAP_MAX_BATCH_BYTES, **kw)
    large = choose_policy(batch_bytes=64 << 20, **kw)
    unknown = choose_policy(**kw)
    assert (small.policy, small.streams) == ("by-engine", 4)
    assert edge.streams == 4 and unknown.streams == 4
    assert (large.policy, large.streams) == ("by-engine", 3)
    assert "64 MiB" in large.reason and "16 MiB" in large.reason
    explicit = choose_policy(streams=4, batch_bytes=64 << 20, **kw)
    assert explicit.streams == 4  # an explicit --streams is kept as given


def test_batch_bytes_must_be_a_positive_whole_number():
    from orchestra.app.job.policy import choose_policy
    from orchestra.errors import JobConfigError

    kw = dict(copies=64, copy_kernels=0, batches=32, kernel_fills_gpu=False)
    for bad in (0, -5, 2.5, "big", float("nan")):
        with pytest.raises(JobConfigError):
            choose_policy(batch_bytes=bad, **kw)

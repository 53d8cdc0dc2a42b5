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
    assert main(["plan", "--batches", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orchestra plan: the job needs ") and "pinned host memory" in err
    assert err.endswith("but this machine has 16.0 GiB; pass a smaller --batch-mib or fewer "
                        "--batches\n")


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
    assert "policy round-robin, 4 stream(s) (of 99999999999999999999999 requested" in out

"""schedule() and the plan JSON reader given what a caller might pass by mistake: each gets a
ScheduleError / PlanFormatError naming what to change, never a builtin error from inside, nor
an argument silently ignored."""

from __future__ import annotations

import json
import math

import pytest

from orchestra.errors import PlanFormatError, ScheduleArgumentTypeError, ScheduleError
from orchestra.graph import KernelRef, build_pipeline
from orchestra.schedule import Plan, estimate_makespan, schedule
from orchestra.schedule.costs import estimate_costs

K = KernelRef("k.cu", "k")


@pytest.fixture(scope="module")
def graph():
    return build_pipeline(2, 4096, K)[0]


@pytest.mark.parametrize("policy", [["by-engine"], {"by-engine": 1}, None, 3])
def test_a_policy_that_is_not_a_string(graph, policy):
    with pytest.raises(ScheduleArgumentTypeError, match="policy must be a string"):
        schedule(graph, policy)


@pytest.mark.parametrize("costs", [[1.0, 2.0], 5, "fast", (1,)])
def test_costs_of_a_kind_schedule_does_not_take_are_refused_not_ignored(graph, costs):
    with pytest.raises(ScheduleArgumentTypeError, match="costs must be None, a CostModel"):
        schedule(graph, "critical-path", 3, costs=costs)
    with pytest.raises(ScheduleArgumentTypeError):
        estimate_costs(graph, costs)
    with pytest.raises(ScheduleArgumentTypeError):
        estimate_makespan(schedule(graph), graph, costs)


def test_a_bool_cost_is_refused(graph):
    with pytest.raises(ScheduleError, match="got bool True"):
        schedule(graph, "critical-path", 3, costs={n.name: True for n in graph.nodes})


def test_finite_costs_whose_sum_overflows_are_refused(graph):
    # each 1e308 µs is finite; 14 of them are not: the makespan was inf and to_json wrote
    # "Infinity", which Plan.from_json (rightly) refused
    costs = {n.name: 1e308 for n in graph.nodes}
    with pytest.raises(ScheduleError, match="add up to more than a double"):
        schedule(graph, "critical-path", 3, costs=costs)
    with pytest.raises(ScheduleError, match="add up to more than a double"):
        estimate_makespan(schedule(graph), graph, costs)
    big = {n.name: 1e290 for n in graph.nodes}  # large but summable: a plan that round-trips
    plan = schedule(graph, "critical-path", 3, costs=big)
    assert math.isfinite(plan.meta["makespan_us"])
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("blocks, match", [
    ("many", "resident_blocks must be None, a dict"),
    (7, "resident_blocks must be None, a dict"),
    ({"b0.kernel": float("nan")}, "whole number of blocks"),
    ({"b0.kernel": 2.5}, "whole number of blocks"),
    ({"b0.kernel": "8"}, "whole number of blocks"),
    ({"b0.kernel": True}, "whole number of blocks"),
    ({"b0.kernel": -1}, ">= 0"),
])
def test_bad_resident_blocks(graph, blocks, match):
    with pytest.raises(ScheduleError, match=match):
        schedule(graph, "concurrent", 5, resident_blocks=blocks)


def test_whole_resident_blocks_of_any_number_type_are_taken(graph):
    import numpy as np

    ints = schedule(graph, "concurrent", 5, resident_blocks={"b0.kernel": 10**6,
                                                             "b1.kernel": 10**6})
    for value in (np.int64(10**6), 1e6):
        other = schedule(graph, "concurrent", 5, resident_blocks={"b0.kernel": value,
                                                                  "b1.kernel": value})
        assert other == ints
    assert ints.meta["small_kernels"] == 2  # 1 block each, a million fit: both small


@pytest.mark.parametrize("tag", [["run"], {"run": 1}, 1, None])
def test_plan_json_step_kind_that_is_not_a_string(graph, tag):
    d = json.loads(schedule(graph).to_json())
    d["streams"][0]["steps"][0] = [tag, "b0.alloc_in"]
    with pytest.raises(PlanFormatError, match=r"streams\[0\]\.steps\[0\]: unknown step kind"):
        Plan.from_dict(d)


@pytest.mark.parametrize("where, set_empty, what", [
    (r"streams[0].name", lambda d: d["streams"][0].__setitem__("name", ""), "stream"),
    (r"streams[0].steps[0][1]", lambda d: d["streams"][0]["steps"][0].__setitem__(1, ""),
     "node"),
    (r"streams[0].steps[1][1]", lambda d: d["streams"][0]["steps"].insert(1, ["record", ""]),
     "event"),
    (r"streams[1].steps[0][1]", lambda d: d["streams"][1]["steps"].insert(0, ["wait", ""]),
     "event"),
    (r"order[0]", lambda d: d["order"].__setitem__(0, ""), "node"),
])
def test_plan_json_with_an_empty_name_names_where(graph, where, set_empty, what):
    # an empty stream name was accepted ("stream  (role general, ...)" in the printout)
    d = json.loads(schedule(graph).to_json())
    set_empty(d)
    with pytest.raises(PlanFormatError) as info:
        Plan.from_dict(d)
    assert str(info.value) == (f"plan JSON: {where} must be a non-empty string (the {what}'s "
                               "name), got ''")
    assert info.value.path == where and isinstance(info.value, ValueError)


def test_a_stream_spec_needs_a_name():
    from orchestra.errors import PlanError
    from orchestra.schedule import PlanBuilder, StreamSpec

    with pytest.raises(PlanError, match="a stream name must be a non-empty string, got ''"):
        StreamSpec("")
    with pytest.raises(PlanError, match="a stream name must be a non-empty string"):
        PlanBuilder().stream("", role="upload")

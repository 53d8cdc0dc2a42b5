"""Every number of a plan's JSON is checked for type and range, naming the field and its path:
``streams[i].priority`` (an int within a C int, what ``cuStreamCreateWithPriority`` takes; the
device's own range is the run's to check), ``streams[i].device`` (an ordinal from 0 within a C
int) and ``meta.makespan_us`` (a finite number >= 0). `StreamSpec` (so `PlanBuilder`) checks the
same. Costs given to the scheduler are finite numbers >= 0, so no plan it makes carries an
infinite makespan. No GPU needed."""

from __future__ import annotations

import json
import math
import pickle

import pytest

from orchestra.errors import PlanError, PlanFormatError, ScheduleError, int_text
from orchestra.graph import Buffer, Memset, TaskGraph
from orchestra.schedule import Plan, PlanBuilder, StreamSpec, schedule

INT_MAX = 2 ** 31 - 1
NOTE = ("the device's own range (cuCtxGetStreamPriorityRange, e.g. -5 .. 0; lower is more "
        "urgent) is checked when a run creates the stream")


def _doc(priority=0, device=None, meta=None):
    stream = {"name": "s0", "priority": priority, "role": "compute", "steps": [["run", "x"]]}
    if device is not None:
        stream["device"] = device
    return {"format": "orchestra.plan/1", "policy": "manual", "order": ["x"],
            "meta": {} if meta is None else meta,
            "streams": [{"name": "up", "steps": []}, stream]}


def _refused(doc, message, path):
    with pytest.raises(PlanFormatError) as info:
        Plan.from_dict(doc)
    err = info.value
    assert str(err) == message and err.path == path
    assert isinstance(err, PlanError) and isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == message and back.path == path
    return err


@pytest.mark.parametrize("value", [-(2 ** 31), -5, 0, INT_MAX])
def test_priorities_within_a_c_int_load(value):
    plan = Plan.from_json(json.dumps(_doc(priority=value)))
    assert plan.stream("s0").priority == value
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("value", [10 ** 30, INT_MAX + 1, -(2 ** 31) - 1, -(10 ** 400)])
def test_priorities_beyond_a_c_int_are_refused_with_the_path(value):
    _refused(_doc(priority=value),
             f"plan JSON: streams[1].priority must be an int from -2147483648 to 2147483647 (a C"
             f" int), got {int_text(value)}; {NOTE}", "streams[1].priority")


def test_the_json_text_path_refuses_the_same():
    with pytest.raises(PlanFormatError, match=r"^plan JSON: streams\[1\]\.priority must be an "
                                              r"int from -2147483648 to 2147483647 \(a C int\), "
                                              r"got 1000000000000000000000000000000;") as info:
        Plan.from_json(json.dumps(_doc()).replace('"priority": 0', '"priority": ' + "1" + "0" * 30))
    assert info.value.path == "streams[1].priority"


@pytest.mark.parametrize("value,shown", [
    (1.5, "float 1.5"), (1e30, "float 1e+30"), (math.nan, "float nan"), (True, "bool True"),
    ("high", "str 'high'"), (None, "NoneType None"),
])
def test_a_priority_of_another_type_is_refused(value, shown):
    _refused(_doc(priority=value), f"plan JSON: streams[1].priority must be an int, got {shown}",
             "streams[1].priority")


@pytest.mark.parametrize("value,shown", [
    (-1, "-1"), (INT_MAX + 1, "2147483648"), (10 ** 30, "1000000000000000000000000000000"),
    (10 ** 400, "1.000e+400 (a 1329-bit int)"), (1.0, "float 1.0"), (True, "bool True"),
    ("0", "str '0'"),
])
def test_a_device_outside_the_ordinals_is_refused_with_the_path(value, shown):
    _refused(_doc(device=value),
             f"plan JSON: streams[1].device must be a device ordinal (an int from 0 to"
             f" {INT_MAX}), got {shown}", "streams[1].device")


def test_devices_within_range_load():
    plan = Plan.from_dict(_doc(device=INT_MAX))
    assert plan.stream("s0").device == INT_MAX and plan.devices == (0, INT_MAX)


@pytest.mark.parametrize("value,shown", [
    (-1.0, "float -1.0"), (math.inf, "float inf"), (math.nan, "float nan"), (True, "bool True"),
    ("12", "str '12'"), (10 ** 400, "1.000e+400 (a 1329-bit int)"),
])
def test_meta_makespan_must_be_a_finite_number_at_least_0(value, shown):
    _refused(_doc(meta={"makespan_us": value}),
             f"plan JSON: meta.makespan_us must be a finite number >= 0 (microseconds), got"
             f" {shown}", "meta.makespan_us")


def test_meta_makespan_and_other_meta_load():
    plan = Plan.from_dict(_doc(meta={"makespan_us": 12.5, "note": "by hand", "n": -3}))
    assert plan.meta == {"makespan_us": 12.5, "note": "by hand", "n": -3}
    assert Plan.from_dict(_doc(meta={"makespan_us": 0})).meta["makespan_us"] == 0


def test_a_huge_int_in_a_string_field_is_named_briefly():
    doc = _doc()
    doc["policy"] = 10 ** 5000  # str() of it would raise: the message shows its magnitude
    _refused(doc, "plan JSON: policy must be a string, got int 1.000e+5000 (a 16610-bit int)",
             "policy")


# -- StreamSpec and PlanBuilder check the same ------------------------------------------------------


@pytest.mark.parametrize("kw,message", [
    ({"priority": 10 ** 30}, "stream s: priority must be an int from -2147483648 to 2147483647"
                             f" (a C int), got 1000000000000000000000000000000; {NOTE}"),
    ({"priority": 0.5}, "stream s: priority must be an int, got float 0.5"),
    ({"priority": False}, "stream s: priority must be an int, got bool False"),
    ({"device": 2 ** 31}, f"stream s: device must be a device ordinal (an int from 0 to {INT_MAX}),"
                          " got 2147483648"),
])
def test_stream_spec_refuses_out_of_range_numbers(kw, message):
    with pytest.raises(PlanError) as info:
        StreamSpec("s", **kw)
    assert str(info.value) == message and type(info.value) is PlanError
    with pytest.raises(PlanError, match="^stream s: "):
        PlanBuilder().stream("s", **kw)


def test_plan_builder_priorities_round_trip():
    plan = PlanBuilder().stream("hi", priority=-5).run("a").stream("lo", priority=0).run(
        "b").build()
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.stream("hi").priority == -5


# -- costs: no infinite makespan ----------------------------------------------------------------


def _tiny():
    g = TaskGraph()
    g.add(Memset("a", Buffer("b", 64), 0))
    g.add(Memset("f", Buffer("c", 64), 0))
    return g


@pytest.mark.parametrize("cost,shown", [(math.inf, "inf"), (math.nan, "nan"), (-1, "-1.0"),
                                        (10 ** 400, "int 1.000e+400 (a 1329-bit int)"),
                                        ("fast", "str 'fast'")])
def test_a_cost_that_is_not_a_finite_number_at_least_0_is_refused(cost, shown):
    with pytest.raises(ScheduleError) as info:
        schedule(_tiny(), "critical-path", 2, costs={"a": cost, "f": 1})
    assert str(info.value) == f"cost of node a must be a finite number >= 0 µs; got {shown}"


def test_a_critical_path_plan_round_trips_with_its_makespan():
    plan = schedule(_tiny(), "critical-path", 2, costs={"a": 3, "f": 1})
    assert 3.0 <= plan.meta["makespan_us"] <= 4.0  # node a's 3 us, at most both in a row
    assert Plan.from_json(plan.to_json()) == plan

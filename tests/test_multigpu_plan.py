"""Plans over several devices (pure Python): streams per device, cross-device events, the
verifier across devices, and one-device plans byte-identical to the plans before devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestra.errors import PlanError, PlanFormatError
from orchestra.graph import (Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostFunc,
                             HostToDevice, KernelNode, KernelRef, PeerCopy, TaskGraph)
from orchestra.schedule import (POLICIES, Plan, PlanBuilder, RecordEvent, StreamSpec, WaitEvent,
                                schedule, verify)
from orchestra.schedule.devices import graph_devices, node_devices
from tests.plan_golden import digest, golden_plans

REF = KernelRef("k.cu", "burn", params=("const float* x", "float* y", "size_t n", "int iters",
                                        "float s", "float t"))
N = 1024


def two_device_graph(peer_device=None):
    """Device 0: alloc, upload, kernel; a peer copy to device 1; device 1: kernel, download."""
    g = TaskGraph()
    hin, hout = HostBuffer("hin", 4 * N), HostBuffer("hout", 4 * N)
    a, b = Buffer("a", 4 * N, device=0), Buffer("b", 4 * N, device=0)
    c, d = Buffer("c", 4 * N, device=1), Buffer("d", 4 * N, device=1)
    for buf in (a, b, c, d):
        g.add(Alloc(f"alloc_{buf.name}", buf))
    g.add(HostToDevice("up", hin, a))
    g.add(KernelNode("k0", REF, 4, 256, (a, b, N, 1, 2.0, 0.0)))
    kw = {} if peer_device is None else {"device": peer_device}
    g.add(PeerCopy("peer", b, c, **kw))
    g.add(KernelNode("k1", REF, 4, 256, (c, d, N, 1, 1.0, 3.0)))
    g.add(DeviceToHost("down", d, hout))
    for buf in (a, b, c, d):
        g.add(Free(f"free_{buf.name}", buf))
    return g


def test_one_device_plans_are_byte_identical_to_the_plans_before_devices():
    golden = json.loads((Path(__file__).parent / "data" / "plan_json_golden.json").read_text())
    now = golden_plans()
    assert set(now) == set(golden) and len(golden) == 80
    changed = [k for k, text in now.items() if digest(text) != golden[k]]
    assert not changed
    assert all('"device"' not in text for text in now.values())


def test_stream_device_round_trips_and_is_written_only_when_not_zero():
    plan = (PlanBuilder().stream("a").run("x").record("e0")
            .stream("b", device=1).wait("e0").run("y").build())
    d = plan.to_dict()
    assert "device" not in d["streams"][0] and d["streams"][1]["device"] == 1
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.devices == (0, 1) and back.device_of("b") == 1
    assert "device 1" in str(plan)


@pytest.mark.parametrize("bad", [-1, True, "1", 1.0])
def test_a_bad_device_is_refused_in_specs_and_json(bad):
    with pytest.raises(PlanError, match="device must be a device ordinal"):
        StreamSpec("s", device=bad)
    doc = {"format": "orchestra.plan/1", "streams": [{"name": "s", "device": bad, "steps": []}]}
    with pytest.raises(PlanFormatError, match=r"streams\[0\]\.device"):
        Plan.from_dict(doc)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("streams", [1, 3, 5])
def test_each_device_gets_its_own_streams_and_nodes_run_on_their_device(policy, streams):
    g = two_device_graph()
    plan = schedule(g, policy, streams)
    assert plan.devices == (0, 1)
    for s in plan.streams:
        assert s.name.startswith(f"d{s.device}.")
    for node in g.nodes:
        assert plan.device_of(plan.stream_of(node.name)) == node.device, node.name
    assert verify(plan, g) == []


def test_a_cross_device_edge_is_an_event_recorded_on_one_device_and_waited_on_the_other():
    g = two_device_graph()
    plan = schedule(g, "by-engine", 3)
    where = {}
    for s in plan.stream_names:
        for st in plan.steps[s]:
            if isinstance(st, RecordEvent):
                where.setdefault(st.event, [None, []])[0] = plan.device_of(s)
            elif isinstance(st, WaitEvent):
                where.setdefault(st.event, [None, []])[1].append(plan.device_of(s))
    crossing = [ev for ev, (rec, waits) in where.items() if any(w != rec for w in waits)]
    assert crossing  # the peer copy's result crosses to device 1
    # the event after the peer copy (on device 0) is waited for by device 1's kernel stream
    s_peer = plan.stream_of("peer")
    steps = plan.steps[s_peer]
    i = steps.index(next(st for st in steps if getattr(st, "node", None) == "peer"))
    ev = steps[i + 1].event
    assert plan.device_of(s_peer) == 0
    assert 1 in where[ev][1]


def test_a_peer_copy_runs_on_the_device_it_names():
    g = two_device_graph(peer_device=1)  # a pull: device 1 reads device 0's memory
    plan = schedule(g, "by-engine", 3)
    assert plan.device_of(plan.stream_of("peer")) == 1
    assert verify(plan, g) == []


def test_one_other_device_keeps_the_stream_names():
    g = TaskGraph()
    x = Buffer("x", 64, device=1)
    g.add(Alloc("alloc", x))
    g.add(Free("free", x))
    plan = schedule(g, "by-engine", 3)
    assert plan.stream_names == ("upload",) and plan.devices == (1,)
    assert graph_devices(g) == (1,)


def test_a_host_function_follows_its_predecessor_across_devices():
    g = two_device_graph()
    g.add(HostFunc("after_down", lambda: None, reads=[HostBuffer("hout", 4 * N)]))
    g.add(HostFunc("alone", lambda: None))
    order = g.topological_order()
    on = node_devices(g, order)
    assert on["after_down"] == 1 and on["alone"] == 0
    plan = schedule(g, "by-engine", 3)
    assert plan.device_of(plan.stream_of("after_down")) == 1
    assert verify(plan, g) == []


def _manual(with_event: bool):
    """Device 0 runs everything up to the peer copy; device 1 the rest; with or without the
    event that orders the peer copy before device 1's kernel."""
    g = two_device_graph()
    b = PlanBuilder().stream("g0", device=0)
    b.run("alloc_a", "alloc_b", "up", "k0")
    b.stream("g1", device=1).run("alloc_c", "alloc_d")
    b.record("e_alloc")
    b.stream("g0").wait("e_alloc").run("peer")
    if with_event:
        b.record("e_peer")
    b.run("free_a", "free_b")
    b.stream("g1")
    if with_event:
        b.wait("e_peer")
    b.run("k1", "down", "free_c", "free_d")
    return b.build(), g


def test_the_verifier_finds_a_missing_cross_device_event_and_names_it():
    plan, g = _manual(with_event=True)
    assert verify(plan, g) == []
    plan, g = _manual(with_event=False)
    found = verify(plan, g)
    raw = [f for f in found if f.kind == "RAW" and f.nodes == ("peer", "k1")]
    assert raw, [str(f) for f in found]
    msg = raw[0].message
    assert "across devices" in msg and "cross-device event" in msg
    assert "recorded on g0 (device 0) after peer" in msg
    assert "waited for on g1 (device 1) before k1" in msg


def test_a_node_on_a_stream_of_another_device_is_a_finding():
    g = two_device_graph()
    plan = schedule(g, "by-engine", 1)
    steps = {s: list(v) for s, v in plan.steps.items()}
    # move device 1's stream to device 0 by rebuilding the specs
    specs = [StreamSpec(s.name, s.priority, s.role, device=0) for s in plan.streams]
    bad = Plan(specs, steps, plan.policy, plan.order)
    found = [f for f in verify(bad, g) if f.kind == "WRONG_DEVICE"]
    assert {f.nodes[0] for f in found} == {n.name for n in g.nodes if n.device == 1}
    assert "runs on device 1, but the plan puts it on stream d1.main of device 0" in \
        found[0].message


def test_a_device_agnostic_plan_of_a_one_device_graph_has_no_device_findings():
    g = TaskGraph()
    x = Buffer("x", 64, device=1)
    g.add(Alloc("alloc", x))
    g.add(Free("free", x))
    plan = PlanBuilder().stream("s").run("alloc", "free").build()  # device 0 by default
    assert verify(plan, g) == []

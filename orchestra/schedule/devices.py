"""Streams per device: where the scheduler puts the nodes of a graph that spans several GPUs.

A stream belongs to one device (`StreamSpec.device`), and a node that runs on a device
(``Node.device_bound``) must run on one of that device's streams: a kernel's launch, a copy,
an allocation and a collective are enqueued on their own device. The policies pick streams
as for one device; `place_by_device` then gives every device its own copy of the policy's
streams and moves each node to its device's copy:

- every device-bound node of the graph on device 0: the plan is unchanged (the same streams,
  the same JSON as before devices existed);
- all on one other device ``d``: the same stream names, on device ``d``;
- on several devices: stream ``name`` of device ``d`` becomes ``d{d}.name`` (``d0.compute``,
  ``d1.compute``...), each node goes to its own device's stream of the name the policy picked,
  a host function to the device of its latest predecessor (it runs on any stream; following
  its predecessor needs no event in the common case).

``streams`` (the policy's stream budget) is then per device. Event insertion is unchanged: an
edge between nodes on two devices crosses streams, so it becomes an event recorded on the
source device's stream and waited on by the other device's stream (``cuStreamWaitEvent``
takes an event of another device). The critical-path estimate treats the devices as one GPU
(its makespan is pessimistic for several).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Sequence

import attrs

from orchestra.graph import TaskGraph
from orchestra.schedule.plan import StreamSpec


def graph_devices(graph: TaskGraph) -> tuple[int, ...]:
    """The devices the graph's device-bound nodes run on, ascending (``(0,)`` when none does)."""
    nodes = graph.nodes
    if all(t.device_bound for t in set(map(type, nodes))):  # type: ignore[attr-defined]  # device_bound is the class's
        devs = set(map(attrgetter("device"), nodes))  # one pass in C over a long pipeline
        devs.discard(None)
    else:
        devs = {n.device for n in nodes if n.device_bound and n.device is not None}
    return tuple(sorted({int(d) for d in devs})) or (0,)


def stream_name(device: int, name: str) -> str:
    """The name of policy stream ``name`` on ``device`` in a plan over several devices."""
    return f"d{device}.{name}"


def node_devices(graph: TaskGraph, order: Sequence[str]) -> dict[str, int]:
    """Node -> the device whose stream runs it: its own for device-bound nodes; for the others
    (host functions) the device of the latest predecessor in ``order``, else their ``device``
    field when it is one of the graph's devices, else the graph's first device."""
    devs = graph_devices(graph)
    pos = {n: i for i, n in enumerate(order)}
    out: dict[str, int] = {}
    for n in order:
        node = graph.node(n)
        if node.device_bound and node.device is not None:
            out[n] = int(node.device)
            continue
        preds = graph.predecessors(n)
        if preds:
            out[n] = out[max(preds, key=pos.__getitem__)]
        else:
            out[n] = node.device if node.device is not None and node.device in devs \
                else devs[0]
    return out


def place_by_device(graph: TaskGraph, specs: Sequence[StreamSpec], assign: dict[str, str],
                    order: Sequence[str]) -> tuple[tuple[StreamSpec, ...], dict[str, str]]:
    """The policy's ``(specs, assign)`` with streams per device (see the module doc)."""
    devs = graph_devices(graph)
    if devs == (0,):
        return tuple(specs), assign
    if len(devs) == 1:
        return tuple(attrs.evolve(s, device=devs[0]) for s in specs), assign
    on = node_devices(graph, order)
    placed = {n: stream_name(on[n], s) for n, s in assign.items()}
    out = tuple(StreamSpec(stream_name(d, s.name), s.priority, s.role, device=d)
                for d in devs for s in specs)
    return out, placed


__all__ = ["graph_devices", "node_devices", "place_by_device", "stream_name"]

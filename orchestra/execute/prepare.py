"""Checks every executor runs before enqueueing, and the issue order they enqueue in.

`check_run` validates, in this order, and raises before anything is enqueued:

1. ``graph.validate()``: ``after=`` names that exist, no cycle (`GraphError`);
2. plan structure: every graph node run exactly once, no unknown node, the waits can be issued
   (`PlanMismatchError`; always on: no executor can run such a plan);
3. hazards: ``schedule.check(plan, graph)`` (`HazardError`), unless ``verify=False``;
4. allocation order: in issue order every use of a buffer comes after its `Alloc` and before
   its `Free` (`PlanMismatchError`), which the executors' address bookkeeping relies on.

Kernel resolution (`kernels`, `kernel_args`) and bindings (`bindings`) come next, per executor.
"""

from __future__ import annotations

from collections import Counter, deque

from orchestra.execute.errors import PlanMismatchError
from orchestra.graph import Alloc, Free, TaskGraph
from orchestra.schedule import Plan, RunNode, check


def check_plan_structure(plan: Plan, graph: TaskGraph) -> None:
    """Every node of ``graph`` runs exactly once in ``plan`` and ``plan`` runs nothing else."""
    runs = Counter(st.node for ss in plan.steps.values() for st in ss if isinstance(st, RunNode))
    names = {n.name for n in graph.nodes}
    missing = [n.name for n in graph.nodes if n.name not in runs]
    unknown = [n for n in runs if n not in names]
    twice = [n for n, c in runs.items() if c > 1]
    if missing or unknown or twice:
        parts = []
        if missing:
            more = " ..." if len(missing) > 10 else ""
            parts.append("never run: " + ", ".join(missing[:10]) + more)
        if unknown:
            parts.append("not in the graph: " + ", ".join(unknown[:10]))
        if twice:
            parts.append("run more than once: " + ", ".join(twice[:10]))
        raise PlanMismatchError("the plan does not fit the graph (" + "; ".join(parts) + ")")


def issue_order(plan: Plan) -> list:
    """``plan.issue_order()``; a plan whose waits can never be issued is `PlanMismatchError`."""
    try:
        return plan.issue_order()
    except ValueError as exc:
        raise PlanMismatchError(str(exc)) from exc


def check_alloc_order(issue, graph: TaskGraph) -> None:
    """In issue order, every access to a buffer with `Alloc`/`Free` nodes lies between an Alloc
    and the next Free of it (the executor must know the address when it enqueues the use)."""
    managed = {n.buffer.name for n in graph.nodes if isinstance(n, (Alloc, Free))}
    live: dict[str, str | None] = {}
    for stream, step in issue:
        if not isinstance(step, RunNode):
            continue
        node = graph.node(step.node)
        if isinstance(node, Alloc):
            b = node.buffer.name
            if live.get(b):
                raise PlanMismatchError(f"node {node.name} allocates buffer {b} again while the "
                                        f"allocation of {live[b]} is still live (issue order)")
            live[b] = node.name
            continue
        for acc in graph.accesses(node.name):
            b = acc.buffer.name
            if b in managed and not live.get(b):
                raise PlanMismatchError(
                    f"node {node.name} (stream {stream}) uses buffer {b} but is issued before "
                    f"its Alloc (or after its Free); order the plan so the Alloc comes first")
        if isinstance(node, Free):
            live[node.buffer.name] = None


def check_run(plan: Plan, graph: TaskGraph, *, verify: bool = True) -> list:
    """Run checks 1-4 above; return the issue order ``[(stream, step), ...]``."""
    graph.validate()
    check_plan_structure(plan, graph)
    issue = issue_order(plan)
    if verify:
        check(plan, graph)
    check_alloc_order(issue, graph)
    return issue


def assign_event_slots(issue, min_handles: int = 8) -> tuple[dict[int, int], int]:
    """`assign_event_slots_by_device` for a plan on one device: ``(slots, slot count)``."""
    out, where = assign_event_slots_by_device(issue, None, min_handles)
    return out, len(where)


def assign_event_slots_by_device(issue, device_of, min_handles: int = 8
                                 ) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """Reuse event handles within a plan: ``{issue index of a RecordEvent/WaitEvent: slot}`` and
    the number of slots needed.

    A wait uses the state an event had when the wait was *issued* (``cuStreamWaitEvent``;
    likewise during stream capture), so a handle is free again once every wait for its record
    has been issued. Free handles are reused oldest first, and up to ``min_handles`` distinct
    handles are used before any is reused, so a handle is not re-recorded right after its wait.
    Waits for events no step records are left out (they order nothing).

    Devices: an event belongs to the device of the stream that records it, so handles are
    reused only within a device. ``device_of`` maps a plan stream name to its device ordinal
    (None: one device). Returns ``(slots, where)``: ``slots`` as above (global slot numbers),
    ``where[slot] = (device ordinal, index among that device's handles)``.
    """
    from orchestra.schedule import RecordEvent, WaitEvent

    pending = Counter(st.event for _, st in issue if isinstance(st, WaitEvent))
    recorded = {st.event for _, st in issue if isinstance(st, RecordEvent)}
    free: dict[int, deque[int]] = {}  # device -> free global slots, oldest first
    count: dict[int, int] = {}  # device -> handles made on it
    where: list[tuple[int, int]] = []
    slot_of: dict[str, int] = {}
    out: dict[int, int] = {}
    for i, (sname, st) in enumerate(issue):
        if isinstance(st, RecordEvent):
            dev = 0 if device_of is None else device_of(sname)
            q = free.setdefault(dev, deque())
            n = count.get(dev, 0)
            if q and n >= min_handles:
                slot = q.popleft()
            else:
                slot = len(where)
                where.append((dev, n))
                count[dev] = n + 1
            slot_of[st.event] = slot
            out[i] = slot
            if pending[st.event] == 0:
                q.append(slot)  # nobody waits for it: the handle is free at once
        elif isinstance(st, WaitEvent) and st.event in recorded:
            slot = slot_of[st.event]  # issue_order never issues a wait before its record
            out[i] = slot
            pending[st.event] -= 1
            if pending[st.event] == 0:
                free[where[slot][0]].append(slot)
    return out, where

"""What the stream executors (eager, capture) pool and reuse across runs and plans.

`StreamPool`: non-blocking streams by priority (one per plan `StreamSpec`) and sync-only events
(``CU_EVENT_DISABLE_TIMING``), created on first need and reused by every later plan; the
executor's finalizer / ``close()`` synchronizes them, then releases them. The pool holds no
reference to its executor, so a finalizer may hold the pool.

`PlanCache`: ``schedule(graph, policy, streams, costs)`` results, LRU, for the eager executor
and `GraphRunner` (``plan_for``).

`MEMSET_ASYNC`: element size (1, 2, 4) -> the ``cuMemsetD8/D16/D32Async`` entry point both
executors call for a `Memset` node.
"""

from __future__ import annotations

import collections

from cuda.bindings import driver as _d

from orchestra.errors import CudaError
from orchestra.schedule import schedule

MEMSET_ASYNC = {1: _d.cuMemsetD8Async, 2: _d.cuMemsetD16Async, 4: _d.cuMemsetD32Async}


class StreamPool:
    """Streams by priority and sync-only events of one executor on ``device``.

    ``stream_type`` / ``event_type``: what to create them with (``Stream(device, priority)``,
    ``Event(device)``): the executor passes the classes its own module names.
    """

    def __init__(self, device, stream_type, event_type):
        self.device = device
        self._stream_type = stream_type
        self._event_type = event_type
        self.streams: list = []  # every stream the pool holds, in creation order
        self.by_priority: dict[int, list] = {}
        self.events: list = []

    def take_streams(self, plan) -> dict:
        """Plan stream name -> pooled stream: the k-th stream of a priority in the plan gets
        the pool's k-th stream of that priority (created when the pool has fewer)."""
        used: dict[int, int] = {}
        out = {}
        for spec in plan.streams:
            k = used.get(spec.priority, 0)
            used[spec.priority] = k + 1
            pool = self.by_priority.setdefault(spec.priority, [])
            while len(pool) <= k:
                s = self._stream_type(self.device, spec.priority)
                pool.append(s)
                self.streams.append(s)
            out[spec.name] = pool[k]
        return out

    def event(self, slot: int):
        """The sync-only event of ``slot`` (created, with every slot below it, when missing)."""
        while len(self.events) <= slot:
            self.events.append(self._event_type(self.device))  # sync-only: CU_EVENT_DISABLE_TIMING
        return self.events[slot]

    def synchronize(self) -> None:
        """Wait for every stream (a `CudaError` from one is ignored: shutdown goes on)."""
        for s in self.streams:
            try:
                s.synchronize()
            except CudaError:
                pass

    def release(self) -> None:
        """Close every event, then every stream, and forget them (after `synchronize`)."""
        for e in self.events:
            e.close()
        for s in self.streams:
            s.close()
        self.streams.clear()
        self.events.clear()


class PlanCache:
    """Plans by (graph object, node count, policy, streams, costs object), least recently used
    dropped first. Holds the graph and costs it keyed by, so their ids stay unique."""

    def __init__(self):
        self._plans: collections.OrderedDict = collections.OrderedDict()

    def get(self, graph, policy: str, streams: int, costs, size: int, capacity=None):
        """``schedule(graph, policy, streams, costs)``, cached for the same graph object;
        keeps at most ``size`` plans. ``capacity``: ``graph -> resident_blocks`` for the
        policies that need it (`occupancy.capacity_for`), called on a miss only."""
        key = (id(graph), len(graph), policy, streams, id(costs) if costs is not None else None)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is graph and hit[2] is costs:
            self._plans.move_to_end(key)
            return hit[1]
        blocks = capacity(graph) if capacity is not None else None
        plan = schedule(graph, policy, streams, costs, resident_blocks=blocks)
        self._plans[key] = (graph, plan, costs)
        while len(self._plans) > size:
            self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


__all__ = ["MEMSET_ASYNC", "PlanCache", "StreamPool"]

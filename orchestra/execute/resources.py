"""What the executors pool and reuse across runs and plans.

`StreamPool`: non-blocking streams by priority (one per plan `StreamSpec`), side streams (bodies
are captured from one per nesting depth) and sync-only events (``CU_EVENT_DISABLE_TIMING``),
created on first need (through the executor's `DriverAPI`) and
reused by every later plan; the executor's finalizer / ``close()`` synchronizes them, then
releases them. The pool holds no reference to its executor, so a finalizer may hold the pool.

`PlanCache`: ``schedule(graph, policy, streams, costs)`` results by the identity of the graph
and costs objects (an `IdentityLRU`), for the eager executor and `GraphRunner` (``plan_for``).
"""

from __future__ import annotations

from orchestra.errors import CudaError
from orchestra.execute.lru import IdentityLRU
from orchestra.schedule import schedule


class StreamPool:
    """Streams by priority and sync-only events of one executor on ``device`` (and on
    ``others``, the further devices of a multi-device executor), made with
    ``api.stream(device, priority)`` / ``api.event(device)`` (``api``: a `DriverAPI`).

    Thread-safety: not thread-safe: one executor's streams and events, taken and returned under that
    executor's lock; a stream handed out is used by one run at a time.
    """

    def __init__(self, device, api, others=()):
        self.device = device
        self.api = api
        self.others = tuple(others)
        self.streams: list = []  # every stream the pool holds, in creation order
        self.by_priority: dict = {}  # priority (own device) or (ordinal, priority) -> streams
        self.events: list = []  # the own device's events
        self.device_events: dict[int, list] = {}  # the other devices' events, by ordinal
        self.sides: list = []  # side streams by depth - 1: never handed out for a plan

    def take_streams(self, plan, device_of=None) -> dict:
        """Plan stream name -> pooled stream: the k-th stream of a priority (per device) in
        the plan gets the pool's k-th stream of that priority on that device (created when
        the pool has fewer). ``device_of``: plan stream name -> `Device` (default: every
        stream on the pool's own device)."""
        used: dict = {}
        out = {}
        own = self.device.ordinal
        for spec in plan.streams:
            dev = self.device if device_of is None else device_of[spec.name]
            key = spec.priority if dev.ordinal == own else (dev.ordinal, spec.priority)
            k = used.get(key, 0)
            used[key] = k + 1
            pool = self.by_priority.setdefault(key, [])
            while len(pool) <= k:
                s = self.api.stream(dev, spec.priority)
                pool.append(s)
                self.streams.append(s)
            out[spec.name] = pool[k]
        return out

    def side(self, depth: int):
        """The side stream of nesting depth ``depth`` (>= 1): what a capture captures the
        bodies at that depth from (created on first need, priority 0, never a plan stream)."""
        while len(self.sides) < depth:
            s = self.api.stream(self.device, 0)
            self.sides.append(s)
            self.streams.append(s)
        return self.sides[depth - 1]

    def event(self, slot: int, device=None):
        """The sync-only event of ``slot`` on ``device`` (default: the pool's own; created,
        with every slot below it, when missing). An event is recorded on a stream of its own
        device; any device's stream may wait for it."""
        if device is None or device.ordinal == self.device.ordinal:
            events, device = self.events, self.device
        else:
            events = self.device_events.setdefault(device.ordinal, [])
        while len(events) <= slot:
            events.append(self.api.event(device))
        return events[slot]

    def drop(self, stream) -> None:
        """Never hand ``stream`` out again (the driver still reports it capturing after a
        failed capture); it is still synchronized and released with the pool."""
        for pool in self.by_priority.values():
            if stream in pool:
                pool.remove(stream)
        if stream in self.sides:  # a fresh one takes its depth
            fresh = self.api.stream(self.device, 0)
            self.sides[self.sides.index(stream)] = fresh
            self.streams.append(fresh)

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
        for events in self.device_events.values():
            for e in events:
                e.close()
        for s in self.streams:
            s.close()
        self.streams.clear()
        self.by_priority.clear()
        self.sides.clear()
        self.events.clear()
        self.device_events.clear()


class PlanCache:
    """Plans by (graph object, node count, policy, streams, costs object), at most ``size``,
    least recently used dropped first. Holds the graph and costs it keyed by, so their ids
    stay unique.

    Thread-safety: may be shared between threads: the plans live in an `IdentityLRU` (one
    lock); two threads that miss on one key at once both schedule it (the later, equal plan
    replaces the earlier). Scheduling reads the task graph: do not add to it meanwhile.
    """

    def __init__(self, size: int = 16):
        self._plans = IdentityLRU(max(1, int(size)))

    def get(self, graph, policy: str, streams: int, costs, capacity=None):
        """``schedule(graph, policy, streams, costs)``, cached for the same graph object.
        ``capacity``: ``graph -> resident_blocks`` for the policies that need it
        (`occupancy.capacity_for`), called on a miss only."""

        def make():
            blocks = capacity(graph) if capacity is not None else None
            return schedule(graph, policy, streams, costs, resident_blocks=blocks)

        plan, _ = self._plans.get_or_make((graph, costs), (len(graph), policy, streams), make)
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


__all__ = ["PlanCache", "StreamPool"]

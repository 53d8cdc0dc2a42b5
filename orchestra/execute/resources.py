"""What the stream executors (eager, capture) pool and reuse across runs and plans.

`StreamPool`: non-blocking streams by priority (one per plan `StreamSpec`) and sync-only events
(``CU_EVENT_DISABLE_TIMING``), created on first need and reused by every later plan; the
executor's finalizer / ``close()`` synchronizes them, then releases them. The pool holds no
reference to its executor, so a finalizer may hold the pool.

`MEMSET_ASYNC`: element size (1, 2, 4) -> the ``cuMemsetD8/D16/D32Async`` entry point both
executors call for a `Memset` node.
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.errors import CudaError

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


__all__ = ["MEMSET_ASYNC", "StreamPool"]

"""Pinned staging buffers, allocated once and reused: how pageable data reaches the GPU.

Executors copy only from and to page-locked memory (see `orchestra.execute.bindings`). Data that
lives in pageable memory (a memory-mapped ``.npy`` file, a user's array) goes through a small
`StagingPool` of pinned slots: a host step copies a chunk into slot ``k``, an H2D copies the slot
to the device, and the slot is refilled for a later chunk only after that H2D is known done.

In a task graph this is written with `HostFunc` nodes that declare the slot they write
(``writes=[slot]``) or read (``reads=[slot]``): the graph infers the write-after-read edge from
the H2D of chunk ``b`` to the refill for chunk ``b + slots``, the scheduler turns it into stream
order or an event, and the hazard verifier checks it (HOST_WAR). The main job's ``--input`` path
(`orchestra.app.job.graphs.build_staged_graph`, run by `MainJob`) is built that way. Slots are never made per chunk: ``slots`` buffers
serve any number of chunks and runs.
"""

from __future__ import annotations

import numpy as np

from orchestra.driver import PinnedBuffer
from orchestra.driver.owner import Lease, ResourceClosedError
from orchestra.execute.errors import ExecutorArgumentValueError
from orchestra.graph import HostBuffer


class StagingPool:
    """``slots`` pinned buffers of ``slot_bytes`` bytes each (``cuMemHostAlloc``, portable).

    ``names[k]`` is the `HostBuffer` name of slot ``k`` (``f"{prefix}{k}"``); `host_buffers`
    gives the graph-side slots, `bindings` the arrays to bind them to, `view` a typed view.

    Lifetime: each slot is a `PinnedBuffer`, so `lease` (one slot) or `leases` (all of them),
    and ``orchestra.driver.pinned_ranges().lease(lo, hi)`` for a bound slot view, keep a slot's
    memory allocated for a built exec or queued work that reads it. `close()` returns at once
    and the pool reads as closed (`bindings`, `view` and `lease` raise `ResourceClosedError`);
    each slot is freed now if no lease is out, else when its last lease ends (docs/errors.md,
    "Lifetimes").

    Thread-safety: the pool may be shared between threads as its `PinnedBuffer` slots may (leases
    and closes go through their `Owner`; `close` is idempotent), but a slot's memory is plain host
    memory: give each thread (or each run in flight) its own slot.
    """

    def __init__(self, slots: int, slot_bytes: int, device=None, *, prefix: str = "stage"):
        if slots < 1 or slot_bytes < 1:
            raise ExecutorArgumentValueError(
                f"StagingPool needs slots >= 1 and slot_bytes >= 1; got {slots}, "
                f"{slot_bytes}")
        self.slot_bytes = int(slot_bytes)
        self.names = tuple(f"{prefix}{k}" for k in range(slots))
        self.buffers: list[PinnedBuffer] = []
        self._closed = False
        try:
            for _ in range(slots):
                self.buffers.append(PinnedBuffer(self.slot_bytes, device))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.names)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ResourceClosedError("this StagingPool is closed", "StagingPool")

    def host_buffers(self) -> list[HostBuffer]:
        return [HostBuffer(n, self.slot_bytes) for n in self.names]

    def bindings(self) -> dict[str, np.ndarray]:
        """Slot name -> a ``uint8`` view of the slot (``slot_bytes`` long)."""
        self._check_open()
        return {n: b.view(np.uint8) for n, b in zip(self.names, self.buffers)}

    def view(self, k: int, dtype=np.float32, count: int | None = None) -> np.ndarray:
        """Slot ``k`` as a 1-D ``dtype`` array (first ``count`` elements, default all)."""
        self._check_open()
        return self.buffers[k].view(dtype, count)

    def lease(self, k: int) -> Lease:
        """A `Lease` on slot ``k``'s memory (see the class doc)."""
        self._check_open()
        return self.buffers[k].lease()

    def leases(self) -> list[Lease]:
        """A `Lease` on every slot, in slot order (release each one)."""
        self._check_open()
        out: list[Lease] = []
        try:
            for b in self.buffers:
                out.append(b.lease())
        except BaseException:
            for lease in out:
                lease.release()
            raise
        return out

    def close(self) -> None:
        """Close every slot: freed now, or at its last lease's end. Idempotent."""
        self._closed = True
        buffers, self.buffers = self.buffers, []
        error = None
        for b in buffers:
            try:
                b.close()
            except BaseException as exc:  # noqa: BLE001 - every slot must still be closed
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

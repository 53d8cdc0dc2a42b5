"""Leak accounting: how many driver handles orchestra's `Owner` objects hold right now, by kind.

Every `Owner` counts its handle as live from construction until it lets go of it: `close()`,
the finalizer (garbage collection), or `detach()` (the caller took the handle over, as
``DeviceBuffer.free(stream)`` does to free on another stream). A release that fails still ends
the ownership (the owner never retries), so it counts as released; a release skipped because
the primary context is already gone (interpreter exit) too.

    before = live_handles()
    ...                                   # a run, a failed run, a bad input
    assert live_handles() == before       # no stream, event, buffer or pinned memory leaked

Kinds: ``stream``, ``event``, ``device_buffer``, ``pinned_buffer``, ``host_registration``,
``module`` (the names below), plus any other `Owner` ``what`` seen, lower-cased. The cost is
one dict update under a lock per create / release. Allocations the executors make themselves
(raw ``cuMemAllocFromPoolAsync`` in a plan) are not handles here: the pool's ``used_bytes``
accounts for them.
"""

from __future__ import annotations

import threading

#: Owner ``what`` -> the kind `live_handles` reports.
KINDS = {
    "Stream": "stream",
    "Event": "event",
    "DeviceBuffer": "device_buffer",
    "PinnedBuffer": "pinned_buffer",
    "HostRegistration": "host_registration",
    "Module": "module",
}

# RLock: a finalizer (another handle's release) may run on this thread at any bytecode.
_lock = threading.RLock()
_live: dict[str, int] = dict.fromkeys(KINDS.values(), 0)


def kind_of(what: str) -> str:
    """The kind an Owner of ``what`` is counted under (``"Stream"`` -> ``"stream"``)."""
    kind = KINDS.get(what)
    return kind if kind is not None else what.lower()


def opened(kind: str) -> None:
    """One more live handle of ``kind`` (called by `Owner`)."""
    with _lock:
        _live[kind] = _live.get(kind, 0) + 1


def released(kind: str) -> None:
    """One live handle of ``kind`` fewer (called once per handle by `Owner`)."""
    with _lock:
        _live[kind] = _live.get(kind, 0) - 1


def live_handles() -> dict[str, int]:
    """A snapshot: kind -> handles held by orchestra objects now (every standard kind is
    present, 0 when none)."""
    with _lock:
        return dict(_live)


def leaked(before: dict[str, int], after: dict[str, int] | None = None) -> dict[str, int]:
    """Kinds whose count differs between two `live_handles` snapshots (``after`` default:
    now), as ``kind -> after - before``; empty when nothing leaked (or was released extra)."""
    after = live_handles() if after is None else after
    kinds = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(kinds)
            if after.get(k, 0) != before.get(k, 0)}


__all__ = ["KINDS", "kind_of", "leaked", "live_handles", "opened", "released"]

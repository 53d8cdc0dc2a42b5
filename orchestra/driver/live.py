"""Leak accounting: how many driver handles orchestra's `Owner` objects hold right now, by kind.

Every `Owner` counts its handle as live from construction until it lets go of it: the release
(at `close()`, at the garbage collection of its object, or, for a handle closed while leased,
at the end of its last lease), or `detach()` (the caller took the handle over). A release that
fails still ends the ownership (the owner never retries), so it counts as released; a release
skipped because the primary context is already gone (interpreter exit) too.

    before = live_handles()
    ...                                   # a run, a failed run, a bad input
    assert live_handles() == before       # no stream, event, buffer or pinned memory leaked

Kinds: ``stream``, ``event``, ``device_buffer``, ``pinned_buffer``, ``host_registration``,
``module`` (the names below), plus any other `Owner` ``what`` seen, lower-cased, and
``captured_graph`` (`orchestra.driver.captured.CapturedGraph`: a graph and its exec).
`deferred_releases` counts, by the same kinds, the handles closed by their owner but still
held by a `Lease` (diagnostics: a count that does not return to 0 names a lease never ended).
Allocations the executors make themselves (raw ``cuMemAllocFromPoolAsync`` in a plan) are not
handles here: the pool's ``used_bytes`` accounts for them.

The counts take no lock: a finalizer (another handle's release) may run on any thread between
any two bytecodes, also inside an update on the same thread, where a lock would deadlock or a
read-modify-write lose a count. Each count is the length of a list, changed by one atomic
``append`` / ``pop``: one pointer per live handle.
"""

from __future__ import annotations

#: Owner ``what`` -> the kind `live_handles` reports.
KINDS = {
    "Stream": "stream",
    "Event": "event",
    "DeviceBuffer": "device_buffer",
    "PinnedBuffer": "pinned_buffer",
    "HostRegistration": "host_registration",
    "Module": "module",
    "NcclComm": "nccl_comm",
}

_live: dict[str, list] = {kind: [] for kind in KINDS.values()}
_deferred: dict[str, list] = {kind: [] for kind in KINDS.values()}


def kind_of(what: str) -> str:
    """The kind an Owner of ``what`` is counted under (``"Stream"`` -> ``"stream"``)."""
    kind = KINDS.get(what)
    return kind if kind is not None else what.lower()


def _up(counts: dict[str, list], kind: str) -> None:
    slots = counts.get(kind)
    if slots is None:
        slots = counts.setdefault(kind, [])  # atomic: two first users share one list
    slots.append(None)


def _down(counts: dict[str, list], kind: str) -> None:
    try:
        counts[kind].pop()
    except (KeyError, IndexError):  # more ends than starts: an Owner bug, never negative
        pass


def opened(kind: str) -> None:
    """One more live handle of ``kind`` (called by `Owner`)."""
    _up(_live, kind)


def released(kind: str) -> None:
    """One live handle of ``kind`` fewer (called once per handle by `Owner`)."""
    _down(_live, kind)


def deferring(kind: str) -> None:
    """A handle of ``kind`` was closed while leased: its release waits (called by `Owner`)."""
    _up(_deferred, kind)


def deferral_ended(kind: str) -> None:
    """A deferred release of ``kind`` ran (called once per `deferring` by `Owner`)."""
    _down(_deferred, kind)


def _snapshot(counts: dict[str, list]) -> dict[str, int]:
    return {kind: len(slots) for kind, slots in list(counts.items())}  # list(): one C call


def live_handles() -> dict[str, int]:
    """A snapshot: kind -> handles held by orchestra objects now (every standard kind is
    present, 0 when none). A handle closed while leased counts until its last lease ends."""
    return _snapshot(_live)


def deferred_releases() -> dict[str, int]:
    """A snapshot: kind -> handles closed by their owner whose release waits for a `Lease`
    to end (every standard kind present, 0 when none)."""
    return _snapshot(_deferred)


def leaked(before: dict[str, int], after: dict[str, int] | None = None) -> dict[str, int]:
    """Kinds whose count differs between two `live_handles` snapshots (``after`` default:
    now), as ``kind -> after - before``; empty when nothing leaked (or was released extra)."""
    after = live_handles() if after is None else after
    kinds = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(kinds)
            if after.get(k, 0) != before.get(k, 0)}


__all__ = ["KINDS", "deferral_ended", "deferred_releases", "deferring", "kind_of", "leaked",
           "live_handles", "opened", "released"]

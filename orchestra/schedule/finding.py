"""`Finding`: one problem the hazard verifier found in a plan or a graph's edges."""

from __future__ import annotations

import attrs

# Kinds, grouped: data races, lifetime errors, host-array races, plan structure.
KINDS = (
    "RAW", "WAR", "WAW",
    "USE_BEFORE_ALLOC", "USE_AFTER_FREE", "FREE_RACE", "DOUBLE_FREE", "DOUBLE_ALLOC", "NEVER_FREED",
    "HOST_RAW", "HOST_WAR", "HOST_WAW",
    "ORDER", "MISSING", "DUPLICATE", "UNKNOWN_NODE", "EVENT_REUSED", "WAIT_UNRECORDED", "DEADLOCK",
    "WRONG_DEVICE",
)


@attrs.frozen
class Finding:
    """A hazard: ``kind`` (one of `KINDS`), the ``buffer`` it concerns (or None), the two
    ``nodes`` (second may be None), their ``streams`` (None in graph mode) and a ``message`` that
    says what ordering is missing and how to add it.

    WAIT_UNRECORDED names the node the wait holds up (the next node run on its stream) first;
    DEADLOCK (of a plan) lists one held-up node per blocked stream, in ``streams``' order (at
    least two entries); either is None where no node follows the wait. EVENT_REUSED names none.

    Immutable: may be shared between threads freely.
    """

    kind: str
    buffer: str | None
    nodes: tuple
    streams: tuple
    message: str

    def __str__(self) -> str:
        return self.message

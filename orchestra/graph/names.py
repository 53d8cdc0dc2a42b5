"""Generated names for the nodes and buffers `GraphBuilder` names itself.

A generated node name reads ``<kind>:<label>#<n>``: the node kind (``alloc``, ``h2d``,
``kernel``, ``d2h``, ``free``, ``memset``, ``host``), what it works on (the kernel's name, the
host buffer a copy moves, the buffer it allocates) and ``n``, the number of earlier generated
names with the same ``<kind>:<label>``, e.g. ``kernel:saxpy#0``, ``h2d:x#0``, ``alloc:d_x#0``.
A generated buffer name reads ``<label>#<n>``: ``d_x#0`` for the device copy of host buffer
``x`` (CUDA's ``d_`` prefix for device memory), ``buf#0`` for an unnamed device buffer.

Names depend only on the order of the calls that made them, so two identical constructions give
identical names. They never collide with each other (a label never contains ``#``, so
``<base>#<n>`` is one base's ``n``-th name) nor with a user's name: ``#`` is kept for generated
names, and a name the user gives a builder may not contain it (`check_user_name`).
"""

from __future__ import annotations

import re

from orchestra.errors import NameCollisionError

RESERVED = "#"
_SUFFIX = re.compile(r"#\d+$")
_NOT_LABEL = re.compile(r"[#<>\s]+")


def label(text: str, default: str) -> str:
    """What a generated name says about ``text`` (a buffer, kernel or function name): a
    generated ``#<n>`` suffix dropped, ``#``, ``<``, ``>`` and whitespace folded to ``_``
    (``<lambda>`` -> ``lambda``); ``default`` when nothing is left."""
    text = _SUFFIX.sub("", text) if isinstance(text, str) else ""
    text = _NOT_LABEL.sub("_", text).strip("_")
    return text or default


def check_user_name(what: str, name) -> None:
    """Refuse a user-given ``name`` (of a node or buffer, as ``what`` says) that contains the
    character generated names keep for themselves."""
    if isinstance(name, str) and RESERVED in name:
        raise NameCollisionError(
            f"{what} name {name!r} contains {RESERVED!r}, which GraphBuilder keeps for the names"
            f" it generates (e.g. 'kernel:saxpy#0'), so that they never collide with yours:"
            f" pick a name without {RESERVED!r}, or leave the name out to get a generated one")


class NameCounter:
    """Per-base counters: ``peek(base)`` is the next name, ``take(base)`` uses it up.
    Builders peek first and take only once the record built under that name is accepted, so
    a refused call leaves the numbering as it was."""

    __slots__ = ("_next",)

    def __init__(self):
        self._next: dict[str, int] = {}

    def peek(self, base: str) -> str:
        return f"{base}{RESERVED}{self._next.get(base, 0)}"

    def take(self, base: str) -> str:
        name = self.peek(base)
        self._next[base] = self._next.get(base, 0) + 1
        return name

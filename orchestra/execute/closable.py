"""`Closable`: the shared lifetime surface of executors and graph execs."""

from __future__ import annotations

from collections.abc import Callable

from orchestra.errors import ClosedError


class Closable:
    """Mixin for objects with a ``_closed`` flag that their ``close()`` sets: the ``closed``
    property, `_check_open` (``ValueError`` naming the class once closed) and a ``with`` block
    that calls ``close()``.

    Thread-safety: ``closed`` reads one flag; whether ``close`` may race other calls is each
    subclass's to say.
    """

    _closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"this {type(self).__name__} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    close: Callable[[], None]  # each subclass's own: releases its handles, sets _closed


__all__ = ["Closable"]

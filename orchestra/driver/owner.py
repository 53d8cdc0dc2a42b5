"""One object owns one driver handle (the pattern cuda.core uses).

`Owner` holds the handle and a ``weakref.finalize`` that releases it exactly once: on `close()`
(idempotent), or when the owning object is garbage-collected without being closed. The release
is skipped when the device's primary context is already gone (interpreter exit), because the
driver reclaims everything with the context and calling it then could crash. `Resource` gives
every owning class the same ``close()`` / ``closed`` / ``with`` behaviour.

Every `Owner` is counted in `orchestra.driver.live` (``live_handles()``) from construction
until it lets go of its handle (release, skipped release at exit, failed release, or `detach`).
"""

from __future__ import annotations

import weakref

from orchestra.driver import live
from orchestra.driver.device import context_alive
from orchestra.errors import ClosedError


def _release(release, handle, device, kind) -> None:
    try:
        if context_alive(device.ordinal):  # else: released with the primary context at exit
            with device.pushed():  # the GC may run this on any thread
                release(handle)
    finally:
        live.released(kind)  # a failed release also ends the ownership (never retried)


class Owner:
    """Owns ``handle`` on behalf of ``obj``; ``release(handle)`` runs at most once.

    ``what`` names the resource in the "closed" error (``ValueError``) and, through
    `live.kind_of`, the kind it is counted under in ``live_handles()``.
    """

    __slots__ = ("_handle", "_finalizer", "_what", "_kind")

    def __init__(self, obj, handle, release, device, what: str):
        self._handle = handle
        self._what = what
        self._kind = kind = live.kind_of(what)
        self._finalizer = weakref.finalize(obj, _release, release, handle, device, kind)
        self._finalizer.atexit = False  # at exit the primary context release reclaims it
        live.opened(kind)

    @property
    def handle(self):
        if not self._finalizer.alive:
            raise ClosedError(f"this {self._what} is closed")
        return self._handle

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()  # a no-op once released

    def detach(self):
        """Stop owning without releasing: the handle, or None if it was already released."""
        if self._finalizer.detach() is None:
            return None
        live.released(self._kind)
        return self._handle


class Resource:
    """Mixin for classes that own one handle in ``self._own`` (an `Owner`)."""

    _own: Owner

    def close(self) -> None:
        """Release the handle now; calling it again does nothing."""
        self._own.close()

    @property
    def closed(self) -> bool:
        return self._own.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

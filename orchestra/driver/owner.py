"""One object owns one driver handle (the pattern cuda.core uses), and leases defer its release.

`Owner` holds the handle and a ``weakref.finalize`` that closes it exactly once: on `close()`
(idempotent), or when the owning object is garbage-collected without being closed. Closing
releases the handle at once (``cuMemFreeAsync``, ``cuMemFreeHost``, ``cuLibraryUnload``...)
unless a `Lease` is out; then the release is **deferred** until the last lease ends. The
release is skipped when the device's primary context is already gone (interpreter exit),
because the driver reclaims everything with the context and calling it then could crash.
`Resource` gives every owning class the same ``close()`` / ``closed`` / ``lease()`` / ``with``
behaviour.

Lifetimes (docs/errors.md, "Lifetimes"): whatever still refers to a handle (a built graph
exec, queued work) holds a `Lease` on it, taken with ``obj.lease()`` while the object is open.
Closing the object then returns at once and the object reads as closed right away (``closed``
is True, ``.handle`` raises `ResourceClosedError`, no new lease is granted, so it can no
longer be bound to new work), but the handle stays valid for the lease holders and is released
by whichever thread ends the last lease. A lease must be released only after the work that
uses the handle has completed on the device (the run or exec synchronized): the release it may
trigger is not ordered after that work.

Every `Owner` is counted in `orchestra.driver.live` (``live_handles()``) from construction
until it lets go of its handle (release, skipped release at exit, failed release, or `detach`),
so a closed but leased handle still counts until its last lease ends;
``live.deferred_releases()`` counts those.

Thread-safety: leases are taken and ended from any thread, and finalizers (the object's, a
forgotten lease's) may run on any thread between any two bytecodes, also inside another call
on the same owner. The lease bookkeeping therefore takes no lock: every step is one atomic
operation on a builtin container (``set.add`` / ``set.discard`` of a lease's token, ``list.pop``
to claim the one release, the finalizer registry's own pop for the one close), ordered so that
any interleaving releases the handle exactly once, only when it is closed and no lease is out.
"""

from __future__ import annotations

import weakref

from orchestra.driver import live
from orchestra.driver.device import context_alive
from orchestra.errors import ClosedError

#: ``[n]``: bumped every time a leased handle is closed (its release deferred). Holders of
#: leases that skip re-checking an object bound before (the executors' identity fast paths)
#: compare it with the value they saw: a change means some leased object was closed since, so
#: they look again. One list cell, read without a call; the bump follows the object reading as
#: closed, so a reader that sees the old value after the bump has begun still sees the close.
CLOSE_EPOCH = [0]


class ResourceClosedError(ClosedError):
    """A closed resource was used: its handle read, or a lease asked for (binding it to new
    work). A `ClosedError` and a ``ValueError`` (``except ValueError`` still catches it).
    ``.what`` names the kind of resource (``"DeviceBuffer"``...)."""

    def __init__(self, message: str, what: str = ""):
        super().__init__(message)
        self.what = what

    def __reduce__(self):
        return (type(self), (str(self), self.what))


def _release(release, handle, device, kind) -> None:
    try:
        if context_alive(device.ordinal):  # else: released with the primary context at exit
            with device.pushed():  # the GC or the last lease may run this on any thread
                release(handle)
    finally:
        live.released(kind)  # a failed release also ends the ownership (never retried)


class Lease:
    """Keeps an `Owner`'s handle alive: its release waits until every lease has ended.

    ``handle``: the owner's handle, valid while this lease is held, even after the owner was
    closed (raises `ResourceClosedError` once this lease is released). `release()` ends the
    lease (idempotent, thread-safe); if the owner was closed meanwhile and this was its last
    lease, the owner's driver release runs now, on this thread, and a driver error from it
    propagates (it is not retried). A lease is a context manager (``with buf.lease() as l:``);
    one that is garbage-collected unreleased ends itself.

    Release a lease only after the work that used ``handle`` has completed on the device.

    Thread-safety: may be shared between threads; `release` may be called from several at once: one
    ``list.pop`` claims the release, so it ends the lease exactly once.
    """

    __slots__ = ("_claim", "_token", "_handle", "what", "__weakref__")

    def __init__(self, owner: "Owner"):
        self._claim = [owner]  # popped once by release(): the one thread that ends the lease
        self._token = id(self)  # unique while this lease is out (the lease holds itself)
        self._handle = owner._handle
        self.what = owner._what

    @property
    def handle(self):
        if not self._claim:
            raise ResourceClosedError(f"this lease on a {self.what} was released", self.what)
        return self._handle

    @property
    def released(self) -> bool:
        return not self._claim

    @property
    def owner_closed(self) -> bool:
        """True once the leased object was closed (its handle stays valid for this lease, but
        it may not be bound to new work), or once this lease was released."""
        claim = self._claim
        return not claim or claim[0].closed

    def release(self) -> None:
        """End the lease; a no-op if it already ended. See the class doc."""
        try:
            owner = self._claim.pop()
        except IndexError:
            return
        owner._drop(self._token)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        if self._claim:  # the common case, released already, costs no exception
            try:
                self.release()
            except Exception:  # noqa: BLE001 - nothing can be raised from a finalizer
                pass

    def __repr__(self) -> str:
        return f"<Lease on a {self.what}{' (released)' if not self._claim else ''}>"


class Owner:
    """Owns ``handle`` on behalf of ``obj``; ``release(handle)`` runs at most once.

    ``what`` names the resource in the "closed" error (`ResourceClosedError`, a
    ``ValueError``) and, through `live.kind_of`, the kind it is counted under in
    ``live_handles()``. ``on_close`` (optional, no arguments) runs once when the owner closes
    (`close()` or garbage collection), before the release or its deferral: the hook for
    registries that must stop handing the resource out at once (`PinnedRanges`).
    ``release`` (and everything it refers to) is kept until the release has run; it must not
    refer to ``obj``, or ``obj`` could never be collected.

    Thread-safety: `lease`, `close`, the leases' `release` and the finalizer may run on any thread,
    interleaved in any way: the bookkeeping takes no lock but is made of single atomic operations on
    builtin containers, ordered so that the handle is released exactly once, only when closed and no
    lease is out (see the module doc).
    """

    __slots__ = ("_handle", "_finalizer", "_what", "_kind", "_release", "_device",
                 "_leases", "_pending", "_deferred", "_on_close")

    def __init__(self, obj, handle, release, device, what: str, *, on_close=None):
        self._handle = handle
        self._what = what
        self._kind = kind = live.kind_of(what)
        self._release = release
        self._device = device
        self._on_close = on_close
        self._leases: set[int] = set()  # tokens of the leases out now
        self._pending = [True]  # popped by the one caller that runs the release
        self._deferred: list = []  # [True] while a closed handle waits for its leases
        # The callback is a bound method of this Owner, which holds no reference to obj.
        self._finalizer = weakref.finalize(obj, self._closed_cb)
        self._finalizer.atexit = False  # at exit the primary context release reclaims it
        live.opened(kind)

    @property
    def handle(self):
        """The handle; `ResourceClosedError` once closed (even while leases keep it alive)."""
        if not self._finalizer.alive:
            raise ResourceClosedError(f"this {self._what} is closed", self._what)
        return self._handle

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def leases(self) -> int:
        """How many leases are out now (a snapshot)."""
        return len(self._leases)

    @property
    def released(self) -> bool:
        """True once the driver release ran (or was skipped, failed, or the handle detached)."""
        return not self._pending

    def close(self) -> None:
        """Close now; release the handle now, or at the end of the last lease. Idempotent."""
        self._finalizer()  # a no-op once closed

    def lease(self) -> Lease:
        """A new `Lease` on the handle; `ResourceClosedError` if the owner is closed."""
        lease = Lease(self)
        token = lease._token
        self._leases.add(token)  # first in, then look: a concurrent close sees this lease
        if not self._finalizer.alive:
            lease._claim.clear()  # never granted: its __del__ must not end it again
            self._drop(token)
            raise ResourceClosedError(
                f"this {self._what} is closed: it cannot be leased or bound to new work "
                "(work that leased it before the close keeps it alive until it ends)",
                self._what)
        return lease

    def detach(self):
        """Stop owning without releasing: the handle, or None if it was already closed.

        If a lease is out, the owner is closed instead (the release waits for the last
        lease) and None is returned: a leased handle is never handed over.
        """
        if self._finalizer.detach() is None:
            return None
        if self._leases:
            self._closed_cb()  # closed like close(): released at the last lease's end
            return None
        on_close = self._on_close
        if on_close is not None:
            on_close()
        try:
            self._pending.pop()
        except IndexError:  # a lease that was refused meanwhile released it already
            return None
        self._release = None
        live.released(self._kind)
        return self._handle

    # -- the deferral (see the module doc for why there is no lock) ---------------------------

    def _closed_cb(self) -> None:
        on_close = self._on_close
        if on_close is not None:
            on_close()
        if not self._leases:
            self._release_now()  # the un-leased path: released now, as without leases
            return
        live.deferring(self._kind)
        CLOSE_EPOCH[0] += 1  # after the finalizer died: the object reads as closed already
        self._deferred.append(True)
        if not self._leases:  # the last lease ended while this was being marked
            self._release_now()
        if not self._pending:  # released already (here or by the last lease): unmark
            self._end_deferral()

    def _drop(self, token: int) -> None:
        self._leases.discard(token)
        if not self._leases and not self._finalizer.alive:
            self._release_now()

    def _release_now(self) -> None:
        try:
            self._pending.pop()
        except IndexError:
            return  # another thread (or an outer frame on this one) has it
        release, self._release = self._release, None  # drop what it keeps alive
        try:
            _release(release, self._handle, self._device, self._kind)
        finally:
            if self._deferred:
                self._end_deferral()

    def _end_deferral(self) -> None:
        try:
            self._deferred.pop()
        except IndexError:
            return
        live.deferral_ended(self._kind)


class Resource:
    """Mixin for classes that own one handle in ``self._own`` (an `Owner`).

    Thread-safety: `close`, `closed` and `lease` may be called from any thread (they go to the
    `Owner`); what else may be shared is the subclass's to say.
    """

    _own: Owner

    def close(self) -> None:
        """Close now; calling it again does nothing. The handle is released now, or, while a
        `Lease` is out, when the last lease ends."""
        self._own.close()

    @property
    def closed(self) -> bool:
        return self._own.closed

    def lease(self) -> Lease:
        """A `Lease` that keeps the handle alive past a `close()` until it is released.

        Raises `ResourceClosedError` if this object is closed already. Thread-safe."""
        return self._own.lease()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

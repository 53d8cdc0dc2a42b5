"""Non-blocking CUDA streams, and external streams wrapped for ordering.

Every orchestra stream is created with ``CU_STREAM_NON_BLOCKING`` (``cuStreamCreateWithPriority``),
so it never synchronizes implicitly with the legacy default stream, and no orchestra API accepts
``0`` / ``None`` as a stream to enqueue work on: work always goes to an explicit `Stream`.

Streams of other libraries (torch, CuPy, cuda.core, numba: anything with ``__cuda_stream__``, or a
raw handle) are wrapped with `Stream.from_handle` without being owned: orchestra never destroys
them. A non-default one becomes a `Stream` like any other (work may be enqueued on it); the
default streams (handle 0 or 1: the legacy default stream, 2: the per-thread default stream)
become a `DefaultStream`, which only orders work (events recorded on it, waits on it, see
`orchestra.driver.ordering`) and is refused wherever work would be enqueued. Orchestra streams
export ``__cuda_stream__`` (the protocol cuda.core defined: ``(0, handle_int)``).
"""

from __future__ import annotations

import functools

from cuda.bindings import driver

from orchestra.driver.check import cu, ensure_initialized
from orchestra.driver.device import Device, as_device
from orchestra.driver.owner import Owner, Resource, ResourceClosedError
from orchestra.errors import (
    ClosedError,
    CudaError,
    DriverArgumentTypeError,
    DriverArgumentValueError,
    InteropTypeError,
    InteropValueError,
)

# The driver's special stream handles (cuda.h: CU_STREAM_LEGACY, CU_STREAM_PER_THREAD); 0 (NULL)
# is the legacy default stream too in the driver API. The CUDA Array Interface and DLPack use the
# same numbers for the same streams.
LEGACY_STREAM = 1
PER_THREAD_STREAM = 2
DEFAULT_HANDLES = (0, LEGACY_STREAM, PER_THREAD_STREAM)

ORDERING_ONLY = (
    "orchestra never enqueues work on a default stream: wrap it only to order work against it "
    "(orchestra.driver.order_after / order_before, Event.record); enqueue on a Stream(device) or "
    "on a non-default stream of your framework (e.g. torch.cuda.Stream(), "
    "cupy.cuda.Stream(non_blocking=True))")


class Stream(Resource):
    """A non-blocking stream on ``device`` (None: device 0) with a scheduling ``priority``.

    Lower ``priority`` numbers run first; the valid range is the device's
    ``limits.stream_priority_range`` (for example ``-5 .. 0``), and a value outside it raises
    ``ValueError`` naming the range (the driver would clamp silently). Priorities only affect
    kernels, not copies.

    Created with ``cuStreamCreateWithPriority(CU_STREAM_NON_BLOCKING, priority)``, destroyed with
    ``cuStreamDestroy`` on `close()` (idempotent; also a context manager) or by the finalizer.
    Destroying a stream with pending work is allowed: the work completes first.

    Thread-safety: may be shared between threads: the handle never changes while the stream is
    open, and `close` and `lease` go through the `Owner`, whose bookkeeping is atomic, so they
    may race each other and the finalizer from any thread: the handle is released exactly once,
    after the last lease. Work that several threads enqueue on one stream interleaves in
    whatever order their calls happen (the stream orders it only in that order): give each
    thread its own stream, or order the threads yourself. Do not `close` a stream another
    thread is still enqueueing on.
    """

    external = False  # True for a stream wrapped by from_handle (not owned, never destroyed)
    source = None  # the wrapped object (kept alive while this wrapper lives)

    def __init__(self, device: Device | int | None = None, priority: int = 0):
        self.device = as_device(device)
        greatest, least = self.device.limits.stream_priority_range
        if not greatest <= priority <= least:
            raise DriverArgumentValueError(
                f"stream priority {priority} is outside {self.device.name}'s range "
                f"[{greatest} (highest) .. {least} (lowest)]")
        self.priority = int(priority)
        self.device.make_current()
        handle = cu(driver.cuStreamCreateWithPriority,
                    driver.CUstream_flags.CU_STREAM_NON_BLOCKING, self.priority)
        # [True] while open, emptied when the owner closes: a launch path that remembers this
        # stream tests it (a list's truth) instead of the handle property chain
        self._live = [True]
        self._own = Owner(self, handle, functools.partial(cu, driver.cuStreamDestroy),
                          self.device, "Stream", on_close=self._live.clear)

    @property
    def handle(self) -> driver.CUstream:
        """The ``CUstream``; ``ValueError`` once closed."""
        return self._own.handle

    @classmethod
    def from_handle(cls, stream, device: Device | int | None = None) -> "Stream | DefaultStream":
        """Wrap an external stream without owning it: orchestra never destroys it.

        ``stream``: an object with ``__cuda_stream__`` (torch, CuPy, cuda.core, numba streams;
        the method returns ``(0, handle_int)``), a ``CUstream``, an int handle, or an orchestra
        `Stream` / `DefaultStream` (returned as is). ``device``: the device the stream belongs to;
        None asks the driver (``cuStreamGetDevice``) for a non-default stream and means device 0
        for a default one (a default stream belongs to whichever context is current, so name the
        device when it is not 0).

        Returns a `Stream` (``external`` True, ``source`` the wrapped object, kept alive; `close`
        only marks the wrapper closed) for a non-default handle, and a `DefaultStream` for handle
        0 / 1 (the legacy default stream) or 2 (the per-thread default stream), which orders work
        but takes none. Raises `InteropTypeError` for anything else, `InteropValueError` for an
        unknown ``__cuda_stream__`` version or a negative handle. Thread-safe.
        """
        if isinstance(stream, (Stream, DefaultStream)):
            return stream
        value = stream_value(stream)
        if value in DEFAULT_HANDLES:
            return DefaultStream(value, device)
        handle = driver.CUstream(value)
        if device is None:
            ensure_initialized()
            dev = Device.get(int(cu(driver.cuStreamGetDevice, handle)))
        else:
            dev = as_device(device)
        dev.make_current()
        self = cls.__new__(cls)
        self.device = dev
        self.priority = int(cu(driver.cuStreamGetPriority, handle))
        self.external = True
        self.source = stream
        self._own = _Borrowed(handle, "Stream")  # type: ignore[assignment]  # Owner's interface
        return self

    def __cuda_stream__(self) -> tuple[int, int]:
        """The ``__cuda_stream__`` protocol: ``(0, handle_int)`` (version 0, the ``CUstream``
        as an int), so cuda.core, CuPy, numba and torch can wrap this stream."""
        return (0, int(self.handle))

    def synchronize(self) -> None:
        """Block the calling thread until all work on the stream is done (``cuStreamSynchronize``).

        Raises `CudaError` if the work failed (an asynchronous error surfaces here).
        """
        cu(driver.cuStreamSynchronize, self.handle)

    def query(self) -> bool:
        """True when all work on the stream is done (``cuStreamQuery``); never blocks.

        ``CUDA_ERROR_NOT_READY`` means False; any other failure raises `CudaError`.
        """
        try:
            cu(driver.cuStreamQuery, self.handle)
        except CudaError as err:
            if err.name == "CUDA_ERROR_NOT_READY":
                return False
            raise
        return True

    def wait(self, event) -> None:
        """Make later work on this stream wait for ``event`` (an `Event`), without blocking the
        host (``cuStreamWaitEvent``). The event must have been recorded (or the wait is a no-op).
        """
        from orchestra.driver.event import Event

        if not isinstance(event, Event):
            raise DriverArgumentTypeError(
                f"Stream.wait expects an orchestra Event, got {type(event).__name__}")
        cu(driver.cuStreamWaitEvent, self.handle, event.handle, 0)

    def record(self, event=None):
        """Record ``event`` (a new sync-only `Event` if None) on this stream; returns it."""
        from orchestra.driver.event import Event

        if event is None:
            event = Event(self.device)
        event.record(self)
        return event

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"0x{int(self._own.handle):x}"
        kind = "external Stream" if self.external else "Stream"
        return f"<{kind} {state} on device {self.device.ordinal}, priority {self.priority}>"


class _NoLease:
    """What ``lease()`` gives for a borrowed handle: there is no release to defer."""

    __slots__ = ("_handle", "released")

    def __init__(self, handle):
        self._handle, self.released = handle, False

    @property
    def handle(self):
        return self._handle

    def release(self) -> None:
        self.released = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Borrowed:
    """Stands in for an `Owner` for a handle orchestra does not own: ``close()`` only marks the
    wrapper closed, nothing is released, nothing is counted in ``live_handles()``."""

    __slots__ = ("_handle", "_closed", "_what")

    def __init__(self, handle, what: str):
        self._handle, self._closed, self._what = handle, False, what

    @property
    def handle(self):
        if self._closed:
            raise ResourceClosedError(f"this external {self._what} wrapper is closed",
                                      self._what)
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def lease(self) -> _NoLease:
        return _NoLease(self.handle)


class DefaultStream:
    """The legacy default stream (``value`` 0 or 1) or the per-thread default stream (2) of
    ``device``'s primary context, wrapped for ordering only (see `Stream.from_handle`).

    Events may be recorded on it and it may wait for events (`record`, `wait`; the helpers in
    `orchestra.driver.ordering`), and it may be synchronized or queried; nothing is ever
    enqueued on it: ``.handle`` raises `DriverArgumentValueError` saying so, and every API that
    enqueues work refuses it. ``ordering_handle`` is the ``CUstream`` used for the ordering calls
    (``CU_STREAM_LEGACY`` for 0). Never destroyed; `close` does nothing.

    Thread-safety: may be shared between threads: it holds no state that changes. A default
    stream handle means the default stream of the *calling thread's* current context, so `wait`,
    `synchronize` and `query` make the device's context current on the calling thread first.
    """

    external = True
    closed = False

    def __init__(self, value: int = LEGACY_STREAM, device: Device | int | None = None):
        if value not in DEFAULT_HANDLES:
            raise DriverArgumentValueError(
                f"DefaultStream takes 0 / 1 (legacy) or 2 (per-thread), got {value}")
        self.value = LEGACY_STREAM if value == 0 else int(value)
        self.device = as_device(device)
        self.source = None
        self.ordering_handle = driver.CUstream(self.value)

    @property
    def name(self) -> str:
        return "legacy default stream" if self.value == LEGACY_STREAM \
            else "per-thread default stream"

    @property
    def handle(self):
        raise DriverArgumentValueError(
            f"this is the {self.name} (handle {self.value}), wrapped for ordering only: "
            + ORDERING_ONLY)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.value)

    def record(self, event=None):
        """Record ``event`` (a new sync-only `Event` if None) on this stream; returns it."""
        from orchestra.driver.event import Event

        if event is None:
            event = Event(self.device)
        event.record(self)
        return event

    def wait(self, event) -> None:
        """Make later work on this stream wait for ``event`` (``cuStreamWaitEvent``)."""
        from orchestra.driver.event import Event

        if not isinstance(event, Event):
            raise DriverArgumentTypeError(
                f"DefaultStream.wait expects an orchestra Event, got {type(event).__name__}")
        self.device.make_current()
        cu(driver.cuStreamWaitEvent, self.ordering_handle, event.handle, 0)

    def synchronize(self) -> None:
        """Block until the work on this stream is done (``cuStreamSynchronize``)."""
        self.device.make_current()
        cu(driver.cuStreamSynchronize, self.ordering_handle)

    def query(self) -> bool:
        """True when the work on this stream is done (``cuStreamQuery``)."""
        self.device.make_current()
        try:
            cu(driver.cuStreamQuery, self.ordering_handle)
        except CudaError as err:
            if err.name == "CUDA_ERROR_NOT_READY":
                return False
            raise
        return True

    def close(self) -> None:
        """Nothing to release: default streams belong to the context."""

    def __eq__(self, other) -> bool:
        return (isinstance(other, DefaultStream) and other.value == self.value
                and other.device is self.device)

    def __hash__(self) -> int:
        return hash((self.value, self.device.ordinal))

    def __repr__(self) -> str:
        return f"<DefaultStream {self.name} of device {self.device.ordinal}>"


def stream_value(stream) -> int:
    """The int handle of ``stream``: an orchestra `Stream` / `DefaultStream`, an object with
    ``__cuda_stream__`` (a method, or on older cuda.core a property, giving ``(0, handle)``), a
    ``CUstream`` or an int. Raises `InteropTypeError` / `InteropValueError`."""
    if isinstance(stream, Stream):
        return int(stream.handle)
    if isinstance(stream, DefaultStream):
        return stream.value
    proto = getattr(type(stream), "__cuda_stream__", None)
    if proto is not None:
        info = getattr(stream, "__cuda_stream__")
        info = info() if callable(info) else info
        try:
            version, value = info
            version, value = int(version), int(value)
        except (TypeError, ValueError):
            raise InteropValueError(
                f"{type(stream).__name__}.__cuda_stream__ gave {info!r}; the protocol returns "
                "(0, stream_handle_int)") from None
        if version != 0:
            raise InteropValueError(
                f"{type(stream).__name__}.__cuda_stream__ is version {version}; orchestra reads "
                "version 0")
    elif type(stream).__name__ == "CUstream":
        value = int(stream)
    elif type(stream) is int:
        value = stream
    else:
        raise InteropTypeError(
            f"expected a stream: an orchestra Stream, an object with __cuda_stream__ (torch, "
            f"CuPy, cuda.core, numba streams), a CUstream or an int handle; got "
            f"{type(stream).__name__}")
    if value < 0:
        raise InteropValueError(f"a stream handle cannot be negative, got {value}")
    return value


def as_stream(stream, device: Device | int | None = None) -> "Stream | DefaultStream":
    """`Stream.from_handle` for anything but an orchestra stream, which is returned as is."""
    if isinstance(stream, (Stream, DefaultStream)):
        return stream
    return Stream.from_handle(stream, device)


def check_stream(stream, what: str = "this call") -> Stream:
    """Return ``stream`` if it is an open `Stream`; else raise ``TypeError`` / ``ValueError``.

    Refuses ``0`` / ``None`` (the legacy default stream) on purpose.
    """
    if not isinstance(stream, Stream):
        if isinstance(stream, DefaultStream):
            raise DriverArgumentValueError(
                f"{what}: {stream!r} is wrapped for ordering only; " + ORDERING_ONLY)
        raise DriverArgumentTypeError(
            f"{what} needs an orchestra Stream, got {stream!r}; orchestra never enqueues work on "
            "the legacy default stream: create one with Stream(device), or wrap a framework's "
            "stream with Stream.from_handle(obj)")
    if stream.closed:
        raise ClosedError(f"{what}: the stream is closed")
    return stream


def ordering_handle(stream, what: str = "this call"):
    """The ``CUstream`` to record events on / wait with for ``stream``: an open `Stream` or a
    `DefaultStream` (ordering on a default stream is allowed, enqueueing work is not)."""
    if isinstance(stream, DefaultStream):
        return stream.ordering_handle
    return check_stream(stream, what).handle

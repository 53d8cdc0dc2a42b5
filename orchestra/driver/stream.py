"""Non-blocking CUDA streams.

Every orchestra stream is created with ``CU_STREAM_NON_BLOCKING`` (``cuStreamCreateWithPriority``),
so it never synchronizes implicitly with the legacy default stream, and no orchestra API accepts
``0`` / ``None`` as a stream to enqueue work on: work always goes to an explicit `Stream`.
"""

from __future__ import annotations

import functools

from cuda.bindings import driver

from orchestra.driver.check import cu
from orchestra.driver.device import Device, as_device
from orchestra.driver.owner import Owner, Resource
from orchestra.errors import (
    ClosedError,
    CudaError,
    DriverArgumentTypeError,
    DriverArgumentValueError,
)


class Stream(Resource):
    """A non-blocking stream on ``device`` (None: device 0) with a scheduling ``priority``.

    Lower ``priority`` numbers run first; the valid range is the device's
    ``limits.stream_priority_range`` (for example ``-5 .. 0``), and a value outside it raises
    ``ValueError`` naming the range (the driver would clamp silently). Priorities only affect
    kernels, not copies.

    Created with ``cuStreamCreateWithPriority(CU_STREAM_NON_BLOCKING, priority)``, destroyed with
    ``cuStreamDestroy`` on `close()` (idempotent; also a context manager) or by the finalizer.
    Destroying a stream with pending work is allowed: the work completes first.
    """

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
        self._own = Owner(self, handle, functools.partial(cu, driver.cuStreamDestroy),
                          self.device, "Stream")

    @property
    def handle(self) -> driver.CUstream:
        """The ``CUstream``; ``ValueError`` once closed."""
        return self._own.handle

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
        return f"<Stream {state} on device {self.device.ordinal}, priority {self.priority}>"


def check_stream(stream, what: str = "this call") -> Stream:
    """Return ``stream`` if it is an open `Stream`; else raise ``TypeError`` / ``ValueError``.

    Refuses ``0`` / ``None`` (the legacy default stream) on purpose.
    """
    if not isinstance(stream, Stream):
        raise DriverArgumentTypeError(
            f"{what} needs an orchestra Stream, got {stream!r}; orchestra never enqueues work on "
            "the legacy default stream: create one with Stream(device)")
    if stream.closed:
        raise ClosedError(f"{what}: the stream is closed")
    return stream

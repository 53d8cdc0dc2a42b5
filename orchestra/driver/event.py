"""CUDA events: sync-only by default, timing on request, blocking-sync on request."""

from __future__ import annotations

import functools

from cuda.bindings import driver

from orchestra.driver.check import cu
from orchestra.driver.device import Device, as_device
from orchestra.driver.owner import Owner, Resource
from orchestra.driver.stream import ordering_handle
from orchestra.errors import CudaError, DriverArgumentTypeError, DriverArgumentValueError


class Event(Resource):
    """An event on ``device`` (None: device 0).

    ``timing=False`` (the default) creates it with ``CU_EVENT_DISABLE_TIMING``: cheapest for
    joining streams, but it cannot be timed. ``timing=True`` allows `Event.elapsed_ms`.
    ``blocking=True`` adds ``CU_EVENT_BLOCKING_SYNC``: `synchronize` then blocks the calling
    thread on an operating-system primitive until the work is done, instead of following the
    context's scheduling policy (which spins on a core by default); the wake-up costs a few
    microseconds more, but a thread that waits most of the time burns no CPU (what a completion
    thread wants). Created with ``cuEventCreate``, destroyed with ``cuEventDestroy`` on
    `close()` (idempotent) or by the finalizer.

    Thread-safety: recording, querying and synchronizing from several threads is safe (the
    driver's calls are); a wait covers the most recent record made before the wait started.
    """

    def __init__(self, device: Device | int | None = None, timing: bool = False, *,
                 blocking: bool = False):
        self.device = as_device(device)
        self.timing = bool(timing)
        self.blocking = bool(blocking)
        flags = 0 if self.timing else int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if self.blocking:
            flags |= int(driver.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        self.device.make_current()
        handle = cu(driver.cuEventCreate, flags)
        self._own = Owner(self, handle, functools.partial(cu, driver.cuEventDestroy),
                          self.device, "Event")

    @property
    def handle(self) -> driver.CUevent:
        """The ``CUevent``; ``ValueError`` once closed."""
        return self._own.handle

    def record(self, stream) -> "Event":
        """Capture the work enqueued on ``stream`` so far (``cuEventRecord``); returns ``self``.

        ``stream`` must be an orchestra `Stream` (``TypeError`` for 0 / None) or a
        `DefaultStream` (``Stream.from_handle(0)``: recording there only orders, it enqueues no
        work).
        """
        handle = ordering_handle(stream, "Event.record")
        cu(driver.cuEventRecord, self.handle, handle)
        return self

    def synchronize(self) -> None:
        """Block until the recorded work is done (``cuEventSynchronize``); raises `CudaError`
        if it failed."""
        cu(driver.cuEventSynchronize, self.handle)

    def query(self) -> bool:
        """True when the recorded work is done (``cuEventQuery``; ``CUDA_ERROR_NOT_READY`` is
        False). Never blocks."""
        try:
            cu(driver.cuEventQuery, self.handle)
        except CudaError as err:
            if err.name == "CUDA_ERROR_NOT_READY":
                return False
            raise
        return True

    @staticmethod
    def elapsed_ms(start: "Event", end: "Event") -> float:
        """Milliseconds (float, about 0.5 us resolution) between two recorded timing events
        (``cuEventElapsedTime``).

        Raises ``ValueError`` if either event was created without ``timing=True``, and
        `CudaError` ``CUDA_ERROR_NOT_READY`` if ``end`` has not completed yet (call
        ``end.synchronize()`` first).
        """
        for name, ev in (("start", start), ("end", end)):
            if not isinstance(ev, Event):
                raise DriverArgumentTypeError(
                    f"Event.elapsed_ms: {name} must be an Event, got {type(ev).__name__}")
            if not ev.timing:
                raise DriverArgumentValueError(
                    f"Event.elapsed_ms: the {name} event is sync-only; create it with "
                    "Event(device, timing=True) to time it")
        return float(cu(driver.cuEventElapsedTime, start.handle, end.handle))

    def __repr__(self) -> str:
        kind = "timing" if self.timing else "sync-only"
        if self.blocking:
            kind += " blocking-sync"
        state = "closed" if self.closed else f"0x{int(self._own.handle):x}"
        return f"<Event {kind} {state} on device {self.device.ordinal}>"

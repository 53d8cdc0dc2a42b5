"""Order work between streams with one event: orchestra's streams and other libraries' streams.

`order_after(stream, other)` makes later work on ``stream`` wait for the work already enqueued
on ``other``; `order_before(stream, other)` makes later work on ``other`` wait for the work
already enqueued on ``stream`` (handing results back). ``order_after(a, b)`` is
``order_before(b, a)``; the two names exist so a call reads the way the code thinks about it:

    order_after(ours, torch.cuda.current_stream())   # our work starts after torch's producer
    ...enqueue orchestra work on ours...
    order_before(ours, torch.cuda.current_stream())  # torch's later work sees our results

Either argument may be an orchestra `Stream`, a `DefaultStream`, or anything `Stream.from_handle`
wraps (``__cuda_stream__`` objects, ``CUstream``, int handles), including the legacy default
stream (handle 0 / 1) and the per-thread default stream (2): recording an event on them and
waiting on them orders work without enqueueing any. Each call is ``cuEventCreate`` (sync-only) +
``cuEventRecord`` on the earlier stream + ``cuStreamWaitEvent`` on the later one +
``cuEventDestroy`` (allowed at once: the wait keeps what it needs; CUDA Driver API,
``cuStreamWaitEvent`` / ``cuEventDestroy``). Nothing blocks the host. Thread-safe (one event per
call). Not for use inside a stream capture of either stream: order before the capture begins, or
order the graph launch's stream.
"""

from __future__ import annotations

from orchestra.driver.event import Event
from orchestra.driver.stream import DEFAULT_HANDLES, DefaultStream, Stream, stream_value


def _same(a, b) -> bool:
    if isinstance(a, DefaultStream) or isinstance(b, DefaultStream):
        return a == b
    return stream_value(a) == stream_value(b)


def order(producer, waiter) -> None:
    """Later work on ``waiter`` waits for the work already enqueued on ``producer`` (both
    `Stream` or `DefaultStream`). Does nothing when they are the same stream."""
    if _same(producer, waiter):
        return
    producer.device.make_current()
    ev = Event(producer.device)
    try:
        ev.record(producer)
        waiter.wait(ev)
    finally:
        ev.close()


def resolve_pair(a, b, device=None) -> tuple:
    """Wrap two streams for ordering: orchestra streams as they are, non-default handles with
    `Stream.from_handle` (``device`` or the driver's answer), and a default stream given as a raw
    handle on ``device``, else on the other stream's device, else device 0."""
    out: list[Stream | DefaultStream | None] = [None, None]
    for i, x in enumerate((a, b)):
        if isinstance(x, (Stream, DefaultStream)):
            out[i] = x
        elif stream_value(x) not in DEFAULT_HANDLES:
            out[i] = Stream.from_handle(x, device)
    known = device
    if known is None:
        known = next((s.device for s in out if s is not None), None)
    first, second = (o if o is not None else DefaultStream(stream_value(x), known)
                     for o, x in zip(out, (a, b)))
    return first, second


def order_after(stream, other, *, device=None) -> None:
    """Make later work on ``stream`` run after the work already enqueued on ``other``.

    ``stream`` / ``other``: orchestra `Stream` / `DefaultStream`, or anything
    `Stream.from_handle` wraps. ``device``: the device of a stream given as a raw handle (a
    default stream's, by default the other stream's device, else device 0). Raises what
    `Stream.from_handle` raises (`InteropTypeError`, `InteropValueError`), `ClosedError` for a
    closed stream, `CudaError` from the driver.
    """
    waiter, producer = resolve_pair(stream, other, device)
    order(producer, waiter)


def order_before(stream, other, *, device=None) -> None:
    """Make the work already enqueued on ``stream`` run before later work on ``other``: the
    hand-back of results to another library's stream. Arguments and errors as `order_after`."""
    producer, waiter = resolve_pair(stream, other, device)
    order(producer, waiter)

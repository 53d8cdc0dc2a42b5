"""Stream capture as a driver primitive: begin / fork / join / end on explicit streams.

A stream capture records the work enqueued on an *origin* stream, and on every stream that
joins it through an event, into a ``CUgraph`` instead of running it:

    with CaptureSession(origin, mode="thread-local") as cap:   # cuStreamBeginCapture
        cap.fork(s1, s2)          # s1, s2 wait for an event recorded on origin
        ... enqueue work on origin, s1, s2 ...
        cap.join(s1, s2)          # origin waits for an event recorded on each
    graph = cap.graph             # cuStreamEndCapture's CUgraph (the caller owns it)

``mode`` is ``thread-local`` by default (another host thread's CUDA calls cannot invalidate the
capture), ``global`` or ``relaxed`` on request (``CUstreamCaptureMode``). A stream that did work
after its fork or its last join when the session ends is *unjoined* (the driver would fail
``cuStreamEndCapture`` with ``CUDA_ERROR_STREAM_CAPTURE_UNJOINED``): the session joins
it, ends the capture, discards the graph and raises `UnjoinedStreamError` naming it. An
exception inside the block ends the capture (`CaptureSession.abort`) and propagates: every
stream leaves capture mode whatever happened. `capture_status` / `is_capturing` read a stream's
state (``cuStreamGetCaptureInfo``, ``cuStreamIsCapturing``).

The CUDA-graph executors (`orchestra.execute.cuda_graph.capture`) capture whole plans with it.

Two more primitives serve nodes with bodies (conditional nodes, child graphs) inside a capture:
`add_captured_node` adds a node to the graph a stream is capturing into, at the stream's
current position (``cuStreamGetCaptureInfo`` for the graph and the dependencies,
``cuGraphAddNode`` / ``cuGraphAddChildGraphNode`` by the caller, then
``cuStreamUpdateCaptureDependencies`` so the stream's next work follows the new node), and
`CaptureToGraph` captures a stream's work into an existing graph, a body the driver made
(``cuStreamBeginCaptureToGraph`` ... ``cuStreamEndCapture``).
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.api import default_api
from orchestra.driver.check import cu, error_from_result
from orchestra.driver.stream import Stream
from orchestra.errors import CudaError, DriverArgumentValueError, OrchestraError

_CS = _d.CUstreamCaptureStatus
_ACTIVE = _CS.CU_STREAM_CAPTURE_STATUS_ACTIVE
_NONE = _CS.CU_STREAM_CAPTURE_STATUS_NONE

MODES = {
    "thread-local": _d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    "global": _d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
    "relaxed": _d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
}


def capture_mode(mode) -> object:
    """``"thread-local"`` / ``"global"`` / ``"relaxed"`` (or a ``CUstreamCaptureMode``)."""
    if isinstance(mode, _d.CUstreamCaptureMode):
        return mode
    key = str(mode).replace("_", "-").lower()
    if key == "threadlocal":
        key = "thread-local"
    try:
        return MODES[key]
    except KeyError:
        raise DriverArgumentValueError(
            f"capture mode must be one of {', '.join(MODES)}; got {mode!r}") \
            from None


class UnjoinedStreamError(OrchestraError):
    """A stream of a capture is not joined back to the origin stream before the capture ends
    (or does work without having been forked into the capture). ``streams`` names them."""

    def __init__(self, streams, detail: str = ""):
        self.streams = tuple(streams)
        self.detail = detail
        names = ", ".join(self.streams)
        text = (f"stream capture: stream(s) {names} not joined back to the origin stream before "
                "the capture ends (record an event on each after its last work and make the "
                "origin wait for it)")
        if detail:
            text += f": {detail}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.streams, self.detail))


def capture_status(stream, api=None) -> tuple[object, tuple]:
    """``(CUstreamCaptureStatus, dependency nodes)`` of ``stream`` (``cuStreamGetCaptureInfo``;
    the dependencies are meaningful only while ACTIVE). Indexing the result as (status at 1,
    dependencies at 4) fits both the CUDA 12 and the CUDA 13 form of the call. ``api``: the
    `DriverAPI` to ask (default: the process's)."""
    api = api if api is not None else default_api()
    out = api.cuStreamGetCaptureInfo(stream.handle if hasattr(stream, "handle") else stream)
    if out[0]:
        raise error_from_result("cuStreamGetCaptureInfo", out[0])
    status = out[1]
    deps = tuple(out[4] or ()) if status == _ACTIVE else ()
    return status, deps


def add_captured_node(stream, add, api=None):
    """Add a node to the graph ``stream`` is capturing into, after the stream's current
    dependencies, and make the stream's next work depend on it alone. ``add(graph, deps,
    edge_data)`` adds the node (``edge_data``: the dependencies' ``CUgraphEdgeData`` list, or
    None when the driver gave none) and returns the ``CUgraphNode``, which this returns.
    `CudaError` when the stream is not capturing (or a call fails)."""
    api = api if api is not None else default_api()
    h = stream.handle if hasattr(stream, "handle") else stream
    out = api.cuStreamGetCaptureInfo(h)
    if out[0]:
        raise error_from_result("cuStreamGetCaptureInfo", out[0])
    if out[1] != _ACTIVE:
        raise error_from_result("cuStreamGetCaptureInfo", int(
            _d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
            context="adding a node to a capture: the stream is not capturing")
    graph, deps = out[3], list(out[4] or ())
    edges = list(out[5] or ()) if len(out) > 6 else []
    edge_data = edges if edges and all(e is not None for e in edges) else None
    node = add(graph, deps, edge_data)
    set_dependencies = _d.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
    cu(api.cuStreamUpdateCaptureDependencies, h, [node], None, 1, set_dependencies)
    return node


class CaptureToGraph:
    """Capture the work enqueued on ``stream`` inside the block into ``graph`` (an existing
    ``CUgraph``, such as a conditional node's body: ``cuStreamBeginCaptureToGraph``), ending
    the capture on the way out whatever happened (``cuStreamEndCapture``; an error inside the
    block propagates, a failed end raises `CudaError`). ``mode``: ``relaxed`` by default: the
    capture runs inside another one on this thread, whose mode already guards the thread.
    ``api``: the `DriverAPI` (default: the process's).

    Thread-safety: not thread-safe: it begins and ends a capture on the calling thread; use it
    inside one thread's ``with`` block, with no other thread enqueueing on ``stream`` meanwhile.
    """

    def __init__(self, stream, graph, mode="relaxed", api=None):
        self.stream = stream
        self.graph = graph
        self.mode = capture_mode(mode)
        self.api = api if api is not None else default_api()

    def __enter__(self) -> "CaptureToGraph":
        h = self.stream.handle if hasattr(self.stream, "handle") else self.stream
        cu(self.api.cuStreamBeginCaptureToGraph, h, self.graph, None, None, 0, self.mode)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        h = self.stream.handle if hasattr(self.stream, "handle") else self.stream
        err, graph = self.api.cuStreamEndCapture(h)
        if exc_type is None and err:
            raise error_from_result("cuStreamEndCapture", err,
                                    context="capturing into a body graph")
        if exc_type is None and graph is not None and int(graph) != int(self.graph):
            raise OrchestraError("cuStreamEndCapture returned another graph than the body the "
                                 "capture began on")


def is_capturing(stream, api=None) -> bool:
    """True unless ``cuStreamIsCapturing`` reports NONE (ACTIVE or INVALIDATED)."""
    api = api if api is not None else default_api()
    h = stream.handle if hasattr(stream, "handle") else stream
    return cu(api.cuStreamIsCapturing, h) != _NONE


def _key(deps) -> tuple[int, ...]:
    return tuple(sorted(int(n) for n in deps))


class CaptureSession:
    """One stream capture with explicit fork / join (for hand-made captures, and what
    `CaptureExecutor` uses).

        with CaptureSession(origin, mode="thread-local") as cap:   # begins the capture
            cap.fork(s1, s2)          # s1, s2 wait for an event recorded on origin
            ... enqueue work on origin, s1, s2 ...
            cap.join(s1, s2)          # origin waits for an event recorded on each
        graph = cap.graph             # the CUgraph (the caller owns it: cuGraphDestroy)

    On leaving the block `end` checks every stream the session knows (forked or joined): one
    that did work after its fork or its last join is *unjoined*; the session joins it, ends
    the capture, destroys the graph and raises `UnjoinedStreamError` naming it. An exception
    inside the block ends the capture (`abort`) and propagates. ``events``: two sync-only
    events to use for fork and join (created here when not given: before the capture, since
    creating objects during a capture is best avoided). ``api``: the `DriverAPI` every call
    goes through (default: the process's).

    Thread-safety: not thread-safe: one session per capture, driven by one thread. In the default
    ``thread-local`` mode other threads' CUDA calls cannot invalidate the capture, but their work on
    the captured streams would be captured with it: no other thread may enqueue on ``origin`` or a
    forked stream until the session ends.
    """

    def __init__(self, origin: Stream, mode="thread-local", *, events=None, api=None):
        self.origin = origin
        self.mode = capture_mode(mode)
        self.api = api = api if api is not None else default_api()
        if events is None:
            events = (api.event(origin.device), api.event(origin.device))
            self._own_events = True
        else:
            self._own_events = False
        self.fork_event, self.join_event = events
        self.streams: dict[int, tuple[str, Stream]] = {}
        self._mark: dict[int, tuple[int, ...]] = {}  # stream -> deps at its fork / last join
        self._active = False
        self.graph = None

    # -- the sequence -------------------------------------------------------------------------

    def begin(self) -> "CaptureSession":
        if is_capturing(self.origin, self.api):
            raise OrchestraError("CaptureSession.begin: the origin stream is already capturing")
        cu(self.api.cuStreamBeginCapture, self.origin.handle, self.mode)
        self._active = True
        return self

    def capturing_graph(self):
        """The ``CUgraph`` the capture is recording into (``cuStreamGetCaptureInfo`` on the
        origin): what nodes made before any work is captured are created on."""
        out = self.api.cuStreamGetCaptureInfo(self.origin.handle)
        if out[0]:
            raise error_from_result("cuStreamGetCaptureInfo", out[0])
        return out[3]

    def _name(self, s: Stream, name: str | None) -> str:
        return name or repr(s)

    def fork(self, *streams: Stream, names=None) -> None:
        """Bring ``streams`` into the capture: one event recorded on the origin, each waits."""
        cu(self.api.cuEventRecord, self.fork_event.handle, self.origin.handle)
        for i, s in enumerate(streams):
            cu(self.api.cuStreamWaitEvent, s.handle, self.fork_event.handle, 0)
            self.streams[id(s)] = (self._name(s, names[i] if names else None), s)
            self._mark[id(s)] = _key(capture_status(s, self.api)[1])

    def join(self, *streams: Stream, names=None) -> None:
        """Join ``streams`` back: each records an event the origin waits for."""
        for i, s in enumerate(streams):
            cu(self.api.cuEventRecord, self.join_event.handle, s.handle)
            cu(self.api.cuStreamWaitEvent, self.origin.handle, self.join_event.handle, 0)
            if id(s) not in self.streams:
                self.streams[id(s)] = (self._name(s, names[i] if names else None), s)
            self._mark[id(s)] = _key(capture_status(s, self.api)[1])

    def unjoined(self) -> list[tuple[str, Stream]]:
        """Streams with work added since their fork or last join (or no longer capturing
        normally), by the capture status the driver reports now."""
        out = []
        for sid, (name, s) in self.streams.items():
            status, deps = capture_status(s, self.api)
            if status == _ACTIVE and _key(deps) != self._mark.get(sid):
                out.append((name, s))
        return out

    def end(self):
        """Check the joins, then ``cuStreamEndCapture``; returns the ``CUgraph``."""
        status, _ = capture_status(self.origin, self.api)
        if status != _ACTIVE:
            self.abort()
            raise error_from_result("cuStreamEndCapture", int(
                _d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
                context="the capture was invalidated by an earlier illegal call; every stream "
                        "left capture mode and the graph was discarded")
        bad = self.unjoined()
        if bad:
            names = [n for n, _ in bad]
            self.abort()
            raise UnjoinedStreamError(names, "the session joined them and ended the capture; "
                                      "the graph was discarded")
        self._active = False
        self.graph = cu(self.api.cuStreamEndCapture, self.origin.handle)
        return self.graph

    def abort(self) -> list[tuple[str, Stream]]:
        """End the capture whatever its state (joining every known stream first, ignoring
        errors), destroy any graph it returns; return the streams still capturing after that
        (normally none)."""
        if self._active:
            self._active = False
            api = self.api
            for name, s in self.streams.values():
                api.cuEventRecord(self.join_event.handle, s.handle)
                api.cuStreamWaitEvent(self.origin.handle, self.join_event.handle, 0)
            err, graph = api.cuStreamEndCapture(self.origin.handle)
            if graph is not None and int(graph):
                api.cuGraphDestroy(graph)
        left = []
        for name, s in [("origin", self.origin)] + list(self.streams.values()):
            try:
                if is_capturing(s, self.api):
                    left.append((name, s))
            except CudaError:
                left.append((name, s))
        return left

    def close(self) -> None:
        if self._own_events:
            self.fork_event.close()
            self.join_event.close()

    def __enter__(self) -> "CaptureSession":
        return self.begin()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.end()
            else:
                self.abort()
        finally:
            self.close()


__all__ = ["CaptureSession", "CaptureToGraph", "MODES", "UnjoinedStreamError",
           "add_captured_node", "capture_mode", "capture_status", "is_capturing"]

"""`CapturedGraph`: work enqueued on streams, captured into one CUDA graph and launched as one.

    with CapturedGraph(origin, enqueue, others=(s1, s2)) as g:  # capture, instantiate, upload
        g.launch()                                             # cuGraphLaunch on origin
        g.launch(other_stream)

The constructor captures what ``enqueue()`` puts on ``origin`` and on ``others`` (a
`CaptureSession`: ``cuStreamBeginCapture`` on ``origin``, each of ``others`` forked from it
through an event and joined back after ``enqueue()``, ``cuStreamEndCapture``), instantiates the
graph (``cuGraphInstantiate``) and uploads it (``cuGraphUpload``: the first launch then costs
no more than later ones). Work on different streams of the capture becomes independent branches
of the graph, work on one stream a chain, as the CUDA Programming Guide's "Creating a Graph
Using Stream Capture" describes (cross-stream dependencies through events). Each launch is
ordered after earlier work on its stream and after earlier launches of the same exec (driver
API reference, ``cuGraphLaunch``).

What it is for: timing work as a CUDA graph runs it. A graph launches its kernel nodes with
less per-launch overhead than a stream does, so per-item times of small items measured on
streams overstate what a graph of the same items takes (`orchestra.app.job.timing`).

Release: `close()` (idempotent; also the ``with`` block and a finalizer for a forgotten
object) destroys the exec (``cuGraphExecDestroy``: an exec still running is freed by the driver
when it completes) and the graph (``cuGraphDestroy``). A failure anywhere in the constructor
(inside ``enqueue()``, the capture, the instantiation, the upload) releases whatever was made
so far and every stream leaves capture mode before the error propagates. The memory the
captured work reads and writes is the caller's: it must stay allocated until every launch has
completed (synchronize the launch streams before freeing it). `live_handles()` counts an open
one under ``captured_graph``. Not thread-safe: one thread captures and launches.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

from orchestra.driver import live
from orchestra.driver.api import default_api
from orchestra.driver.capture import CaptureSession
from orchestra.driver.check import cu, error_from_result
from orchestra.driver.owner import ResourceClosedError

KIND = "captured_graph"  # what live_handles() counts it under


class _Held:
    """What the finalizer releases (no reference back to the `CapturedGraph`)."""

    def __init__(self, api, device):
        self.api = api
        self.device = device
        self.graph = None  # CUgraph
        self.exec = None  # CUgraphExec


def _release(held: _Held) -> None:
    """Destroy the exec, then the graph; skipped once the primary context is gone (the driver
    reclaims both with it). Errors are not raised: a release runs at most once."""
    try:
        api, dev = held.api, held.device
        if (held.exec is not None or held.graph is not None) and api.context_alive(dev.ordinal):
            with dev.pushed():  # a finalizer may run on any thread
                if held.exec is not None:
                    api.cuGraphExecDestroy(held.exec)
                if held.graph is not None:
                    api.cuGraphDestroy(held.graph)
    finally:
        held.exec = held.graph = None
        live.released(KIND)


class CapturedGraph:
    """The work of ``enqueue()`` on ``origin`` (an orchestra `Stream`) and ``others``, as one
    instantiated CUDA graph (see the module doc).

    Args:
        origin: the stream the capture begins and ends on; also the default launch stream.
        enqueue: called once, inside the capture, with no arguments; it enqueues work on
            ``origin`` and on ``others`` only (the driver turns it into graph nodes instead of
            running it). Nothing it enqueues runs until `launch`.
        others: streams forked from ``origin`` before ``enqueue()`` and joined back after it.
        mode: the capture mode (``"thread-local"``: another thread's CUDA calls cannot
            invalidate the capture; ``"global"``, ``"relaxed"``).
        upload: ``cuGraphUpload`` on ``origin`` right after instantiating.
        api: the `DriverAPI` every driver call goes through (default: the process's).

    Raises: whatever ``enqueue()`` raises; `CudaError` from a failed driver call (also
    ``CUDA_ERROR_STREAM_CAPTURE_UNJOINED`` from ``cuStreamEndCapture`` when work reached a
    stream the capture never joined back). In every case nothing is left: no graph, no exec,
    no stream capturing. (Work on a stream that never joined the capture is not captured at
    all but runs at once: ``enqueue()`` must use ``origin`` and ``others`` only.)

    Attributes: ``origin``, ``device``, ``launches`` (count of launches).

    Thread-safety: not thread-safe: confine it to one thread, or guard it with a lock of your own.
    Launches of one ``CUgraphExec`` serialize on the GPU anyway; `launch` from two threads races on
    the ``launches`` count, and a `close` racing a `launch` can destroy the exec under it.
    """

    def __init__(self, origin, enqueue: Callable[[], object], others: Sequence = (), *,
                 mode="thread-local", upload: bool = True, api=None):
        self.api = api = api if api is not None else default_api()
        self.origin = origin
        self.device = origin.device
        self.launches = 0
        self._held = held = _Held(api, self.device)
        live.opened(KIND)
        self._finalizer = weakref.finalize(self, _release, held)
        self._finalizer.atexit = False  # at exit the primary context release reclaims it
        others = tuple(others)
        try:
            cap = CaptureSession(origin, mode, api=api)
            with cap:  # an error inside: the capture ends, its graph is destroyed
                if others:
                    cap.fork(*others)
                enqueue()
                if others:
                    cap.join(*others)
            held.graph = cap.graph
            held.exec = cu(api.cuGraphInstantiate, held.graph, 0)
            if upload:
                cu(api.cuGraphUpload, held.exec, origin.handle)
        except BaseException:
            self.close()
            raise
        self._graph_launch = api.cuGraphLaunch

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def graph(self):
        """The ``CUgraph`` (owned here: never destroy it yourself)."""
        self._check_open()
        return self._held.graph

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ResourceClosedError("this CapturedGraph is closed", "CapturedGraph")

    def launch(self, stream=None) -> None:
        """Enqueue one launch of the graph on ``stream`` (default: ``origin``;
        ``cuGraphLaunch``). `CudaError` when the driver refuses it; `ResourceClosedError`
        after `close`."""
        self._check_open()
        s = self.origin if stream is None else stream
        (err,) = self._graph_launch(self._held.exec, s.handle)
        if err:
            raise error_from_result("cuGraphLaunch", err, context="a captured graph")
        self.launches += 1

    def close(self) -> None:
        """Destroy the exec and the graph (idempotent). Launches still running finish; the
        memory they use must outlive them (see the module doc)."""
        self._finalizer()

    def __enter__(self) -> "CapturedGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.launches} launches"
        return f"<CapturedGraph on device {getattr(self.device, 'ordinal', '?')} ({state})>"


__all__ = ["CapturedGraph"]

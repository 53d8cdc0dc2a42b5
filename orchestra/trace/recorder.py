"""Recording spans with timing events: the hooks executors call, and the one conversion they share.

Eager (`EagerTracer`): ``begin(streams)`` records an origin event on every stream, ``before`` /
``after`` record a timing event on the node's stream around its enqueue, ``finish()`` waits for
the last events and turns ``cuEventElapsedTime(origin, event)`` into spans.

CUDA graphs (`GraphTracer`): the same two events per node, recorded by event-record nodes inside
the graph (``cuGraphAddEventRecordNode`` when building, ``cuEventRecordWithFlags(...,
CU_EVENT_RECORD_EXTERNAL)`` while capturing); the origin is recorded on the launch stream right
before ``cuGraphLaunch`` (`GraphTracer.mark_launch`).

Both end in `spans_from_event_pairs`. Events come from an `EventPool` (timing events,
``CU_EVENT_DEFAULT``) that a tracer keeps across runs. A tracer serves one run at a time and holds
no global state: make one per executor (or per thread).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import attrs

from orchestra.errors import CallOrderError, NotFoundError, TraceTypeError, TraceValueError
from orchestra.trace.timeline import NodeSpan, Timeline

_TIMELINE_FIELDS = ("streams", "policy", "executor", "device")


@runtime_checkable
class EventTimer(Protocol):
    """What an executor calls when ``trace=True`` (see docs/trace.md).

    Thread-safety: a protocol; the implementations (`EagerTracer`, `GraphTracer`) are not
    thread-safe: one run at a time, driven by the thread that enqueues it.
    """

    def begin(self, streams, *, policy: str = "", meta: Mapping | None = None) -> None:
        """Start a run on ``streams`` (name -> Stream, in track order)."""

    def before(self, stream, node) -> None:
        """Right before ``node`` is enqueued on ``stream`` (a name or the Stream)."""

    def after(self, stream, node) -> None:
        """Right after ``node`` was enqueued on ``stream``."""

    def finish(self) -> Timeline:
        """After the run's work was enqueued (synchronizes on the recorded events)."""

    def abort(self) -> None:
        """The run failed part-way: forget it (the tracer can be used again)."""


@attrs.frozen
class EventPair:
    """``start`` / ``end`` events around ``node`` (a graph node) on ``stream`` (its name).

    Immutable (frozen): the record may be shared between threads freely; the two events are the
    tracer's, recorded only by the run it times.
    """

    stream: str
    node: Any
    start: Any
    end: Any


def event_elapsed_ms(start, end) -> float:
    """``cuEventElapsedTime`` through `orchestra.driver.Event.elapsed_ms`."""
    from orchestra.driver import Event
    return Event.elapsed_ms(start, end)


def spans_from_event_pairs(origin, pairs: Iterable, meta: Mapping | None = None, *,
                           elapsed: Callable[[Any, Any], float] | None = None) -> Timeline:
    """Turn recorded timing events into a `Timeline` (the step shared by eager and graph paths).

    Args:
        origin: the origin event, or a sequence of them (one per stream): the first is the
            reference every event is measured from, and time 0 is the earliest of them.
        pairs: `EventPair` or ``(stream_name, node, start_event, end_event)`` tuples.
        meta: ``streams``, ``policy``, ``executor``, ``device`` become `Timeline` fields;
            ``lowered`` (node name -> ``"copy-kernel"``: host copies run as copy kernels) sets
            those spans' ``lowering`` (and becomes a count in ``Timeline.meta``); other keys go
            to ``Timeline.meta``.
        elapsed: ``f(a, b) -> ms`` (default ``cuEventElapsedTime``); every event must have
            completed (synchronize first).
    """
    el = elapsed or event_elapsed_ms
    origins = list(origin) if isinstance(origin, (list, tuple)) else [origin]
    if not origins:
        raise TraceValueError("spans_from_event_pairs: no origin event")
    ref = origins[0]
    zero = min([0.0] + [float(el(ref, o)) for o in origins[1:]])
    extra = dict(meta or {})
    lowered = extra.pop("lowered", None) or {}
    if lowered:
        extra["copy_kernels"] = len(lowered)
    spans = []
    for p in pairs:
        stream, node, a, b = (p.stream, p.node, p.start, p.end) if isinstance(p, EventPair) else p
        start = float(el(ref, a)) - zero
        end = max(float(el(ref, b)) - zero, start)  # the timer's ~0.5 µs resolution
        spans.append(NodeSpan.from_node(node, stream, start, end,
                                        lowered.get(getattr(node, "name", None))))
    fields = {k: extra.pop(k) for k in _TIMELINE_FIELDS if k in extra}
    return Timeline(spans, **fields, meta=extra)


class EventPool:
    """Timing events (``CU_EVENT_DEFAULT``) on one device, created on demand and reused.

    `take` hands out a free event (creating one if none is free); `reset` makes every event
    free again once the run that used them has been read. `close` destroys them all.

    Thread-safety: not thread-safe: `take` and `reset` change plain lists; a pool belongs to one
    tracer.
    """

    def __init__(self, device=None):
        self.device = device
        self._all: list = []
        self._free: list = []

    def _create(self):
        from orchestra.driver import Event
        return Event(self.device, timing=True)

    def take(self):
        if self._free:
            return self._free.pop()
        ev = self._create()
        self._all.append(ev)
        return ev

    def reset(self) -> None:
        self._free = list(reversed(self._all))

    @property
    def size(self) -> int:
        """Events created so far."""
        return len(self._all)

    @property
    def in_use(self) -> int:
        return len(self._all) - len(self._free)

    def close(self) -> None:
        for ev in self._all:
            ev.close()
        self._all.clear()
        self._free.clear()


def _ordinal(device) -> int:
    if device is None:
        return 0
    return int(getattr(device, "ordinal", device))


def _stream_map(streams) -> dict:
    """name -> stream from a mapping, (name, stream) pairs, stream names, or bare streams."""
    if isinstance(streams, Mapping):
        out = dict(streams)
    else:
        out = {}
        for i, s in enumerate(streams):
            if isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], str):
                out[s[0]] = s[1]
            elif isinstance(s, str):
                out[s] = None
            else:
                out[f"s{i}"] = s
    for name in out:
        if not isinstance(name, str) or not name:
            raise TraceTypeError(f"stream names must be non-empty str; got {name!r}")
    if not out:
        raise TraceValueError("a traced run needs at least one stream")
    return out


class _PairBook:
    """Bookkeeping shared by the tracers: streams, open ``before`` events, finished pairs."""

    def __init__(self, device=None, *, executor: str, pool: EventPool | None = None,
                 elapsed: Callable | None = None):
        self.pool = pool if pool is not None else EventPool(device)
        self.device = device if device is not None else self.pool.device
        self.executor = executor
        self._elapsed = elapsed
        self._streams: dict | None = None
        self._names: dict[int, str] = {}
        self._open: dict[str, tuple[str, Any]] = {}
        self._pairs: list[EventPair] = []
        self._meta: dict = {}

    @property
    def active(self) -> bool:
        """True between `begin` and `finish` / `abort`."""
        return self._streams is not None

    def _begin(self, streams, policy, meta) -> dict:
        if self.active:
            raise CallOrderError(f"{type(self).__name__}.begin: a run is already being traced; "
                                 "call finish() or abort() first")
        live = self._streams = _stream_map(streams)
        self._names = {id(s): n for n, s in live.items() if s is not None}
        self._open, self._pairs = {}, []
        self._meta = {**dict(meta or {}), "streams": tuple(live), "policy": policy,
                      "executor": self.executor, "device": _ordinal(self.device)}
        return live

    def _resolve(self, stream, what) -> tuple[str, Any]:
        live = self._streams
        if live is None:  # not active
            raise CallOrderError(f"{type(self).__name__}.{what}: call begin(streams) first")
        if isinstance(stream, str):
            if stream not in live:
                raise NotFoundError(f"{type(self).__name__}.{what}: unknown stream {stream!r}; "
                                    f"begin() was given {list(live)}")
            return stream, live[stream]
        name = self._names.get(id(stream))
        if name is None:
            raise NotFoundError(
                f"{type(self).__name__}.{what}: {stream!r} is not one of the streams "
                f"given to begin() ({list(live)})")
        return name, stream

    def _open_pair(self, name, node, ev):
        if node.name in self._open:
            raise CallOrderError(f"before({node.name!r}) called twice without after()")
        self._open[node.name] = (name, ev)

    def _close_pair(self, name, node, ev):
        try:
            sname, start = self._open.pop(node.name)
        except KeyError:
            raise CallOrderError(f"after({node.name!r}) without a matching before()") from None
        if sname != name:
            raise CallOrderError(f"node {node.name!r}: before() on stream {sname!r} but after() "
                                 f"on {name!r}")
        self._pairs.append(EventPair(name, node, start, ev))

    def _check_closed(self):
        if self._open:
            raise CallOrderError("finish(): before() without after() for node(s) "
                                 f"{sorted(self._open)}")

    def _read(self, origins) -> Timeline:
        return spans_from_event_pairs(origins, self._pairs, self._meta, elapsed=self._elapsed)

    def close(self) -> None:
        """Destroy the pooled events (idempotent)."""
        self._streams = None
        self._open, self._pairs = {}, []
        self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EagerTracer(_PairBook):
    """`EventTimer` for the eager executor: one timing event on the node's stream before and
    after each node, one origin event per stream at `begin`.

        tracer = EagerTracer(device)
        tracer.begin({"upload": s0, "compute": s1, "download": s2}, policy=plan.policy)
        for stream, node in ...:
            tracer.before(stream, node); enqueue(node, stream); tracer.after(stream, node)
        timeline = tracer.finish()

    The pool's events are reused by the next run (so ``2 * nodes + streams`` events in all).
    ``pool`` and ``elapsed`` are for tests (fake events); normally leave them out.

    Thread-safety: not thread-safe: one run at a time, from `begin` to `finish`, driven by the
    thread that enqueues the run (the executor calls it under its lock).
    """

    def __init__(self, device=None, *, executor: str = "eager", pool: EventPool | None = None,
                 elapsed: Callable | None = None):
        super().__init__(device, executor=executor, pool=pool, elapsed=elapsed)
        self._origins: list = []
        self._last: dict = {}

    def begin(self, streams, *, policy: str = "", meta: Mapping | None = None) -> None:
        """Start a run: ``streams`` maps stream names (track order) to orchestra Streams (or is a
        sequence of ``(name, Stream)`` pairs or bare Streams); records an origin on each."""
        live = self._begin(streams, policy, meta)
        missing = [n for n, s in live.items() if s is None]
        if missing:
            self._streams = None
            raise TraceTypeError(
                f"EagerTracer.begin needs a Stream for every stream name; got none "
                f"for {missing}")
        self.pool.reset()
        self._origins, self._last = [], {}
        try:
            for name, s in live.items():
                ev = self.pool.take()
                ev.record(s)
                self._origins.append(ev)
                self._last[name] = ev
        except BaseException:
            self.abort()
            raise

    def before(self, stream, node) -> None:
        name, s = self._resolve(stream, "before")
        ev = self.pool.take()
        self._open_pair(name, node, ev)
        ev.record(s)

    def after(self, stream, node) -> None:
        name, s = self._resolve(stream, "after")
        ev = self.pool.take()
        self._close_pair(name, node, ev)
        ev.record(s)
        self._last[name] = ev

    def finish(self) -> Timeline:
        """Wait for each stream's last event, read every pair, free the events for reuse."""
        if not self.active:
            raise CallOrderError("EagerTracer.finish: no run in progress (call begin first)")
        self._check_closed()
        try:
            for ev in self._last.values():
                ev.synchronize()
            return self._read(self._origins)
        finally:
            self.abort()

    def abort(self) -> None:
        """Forget the current run (its events go back to the pool)."""
        self._streams = None
        self._open, self._pairs, self._origins, self._last = {}, [], [], {}
        self.pool.reset()


class GraphTracer(_PairBook):
    """Spans for a CUDA graph: the events live in the graph's event-record nodes.

    Building a graph (graph-build executor), per traced node::

        start, end = tracer.pair(stream_name, node)
        # rec_a = cuGraphAddEventRecordNode(graph, node_deps, n, start.handle)
        # the node depends on rec_a; rec_b = cuGraphAddEventRecordNode(graph, [node], 1, end.handle)
        # the node's successors depend on rec_b

    Capturing (capture executor): ``before(stream, node)`` / ``after(stream, node)`` around the
    node's enqueue record with ``CU_EVENT_RECORD_EXTERNAL``, which makes event-record nodes.

    Each launch: ``tracer.mark_launch(stream)`` right before ``cuGraphLaunch`` on ``stream``,
    then (after the launch) ``tracer.finish()``. The events stay bound to the graph exec, so
    `finish` can be called after every launch; `close` the tracer only after the exec is
    destroyed.

    Thread-safety: not thread-safe: used by the build that makes the graph, then by the graph exec
    it belongs to, under the exec's lock (`mark_launch` and `finish` around each launch).
    """

    def __init__(self, device=None, *, executor: str = "graph", pool: EventPool | None = None,
                 elapsed: Callable | None = None):
        super().__init__(device, executor=executor, pool=pool, elapsed=elapsed)
        self._origin: Any = None  # the pool's timing event, recorded before each launch

    def begin(self, streams, *, policy: str = "", meta: Mapping | None = None) -> None:
        """Start describing a graph: ``streams`` are the plan's stream names (Streams too when
        capturing). Drops the pairs of a previous graph and reuses its events."""
        self._streams = None
        self._begin(streams, policy, meta)
        self.pool.reset()
        self._origin = None

    def pair(self, stream: str, node) -> tuple[Any, Any]:
        """Events for the record nodes before and after ``node`` (explicit graph build)."""
        name, _ = self._resolve(stream, "pair")
        start, end = self.pool.take(), self.pool.take()
        self._open_pair(name, node, start)
        self._close_pair(name, node, end)
        return start, end

    def _record(self, ev, stream) -> None:
        from cuda.bindings import driver

        from orchestra.driver import cu
        cu(driver.cuEventRecordWithFlags, ev.handle, stream.handle,
           driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)

    def before(self, stream, node) -> None:
        """While capturing: an event-record node before ``node`` on ``stream`` (a Stream)."""
        name, s = self._resolve(stream, "before")
        if s is None:
            raise TraceTypeError(f"GraphTracer.before: stream {name!r} has no Stream; pass "
                                 "name -> Stream to begin() when capturing")
        ev = self.pool.take()
        self._open_pair(name, node, ev)
        self._record(ev, s)

    def after(self, stream, node) -> None:
        """While capturing: an event-record node after ``node``."""
        name, s = self._resolve(stream, "after")
        ev = self.pool.take()
        self._close_pair(name, node, ev)
        self._record(ev, s)

    def mark_launch(self, stream) -> Any:
        """Record the origin on ``stream`` (an orchestra Stream, not capturing) right before
        ``cuGraphLaunch`` on it; returns the origin event."""
        if not self.active:
            raise CallOrderError("GraphTracer.mark_launch: call begin() and add the pairs first")
        self._check_closed()
        if self._origin is None:
            self._origin = self.pool.take()
        self._origin.record(stream)
        return self._origin

    def finish(self) -> Timeline:
        """After a launch: wait for its events and read them. Call again after each launch."""
        if self._origin is None:
            raise CallOrderError("GraphTracer.finish: no launch marked; call mark_launch(stream) "
                                 "right before cuGraphLaunch")
        self._check_closed()
        for p in self._pairs:
            p.end.synchronize()
        return self._read([self._origin])

    def abort(self) -> None:
        """Forget the graph's pairs (only when the graph will not be launched)."""
        self._streams = None
        self._open, self._pairs, self._origin = {}, [], None
        self.pool.reset()

    @property
    def pairs(self) -> Sequence[EventPair]:
        return tuple(self._pairs)

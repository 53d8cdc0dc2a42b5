"""`NodeSpan` and `Timeline`: when each node of one run ran, as plain data (no CUDA).

Times are milliseconds relative to the run's start (the earliest origin event). Engines are the
graph's own names (``Node.engine``): ``upload`` (H2D copy engine), ``download`` (D2H copy engine),
``compute`` (the SMs), ``host`` (host functions), ``memory`` (stream-ordered alloc/free); any other
string is kept as is.
"""

from __future__ import annotations

import math

import attrs

from orchestra.errors import NotFoundError, TraceTypeError, TraceValueError

ENGINES = ("upload", "compute", "download", "host", "memory")
"""Known engines, in display order (others sort after these, by name)."""

OVERLAP_ENGINES = ("upload", "compute", "download")
"""The hardware engines that can run at once; overlap metrics count these by default."""

ENGINE_COLORS = {
    "upload": "#1f77b4",    # blue
    "compute": "#2ca02c",   # green
    "download": "#ff7f0e",  # orange
    "host": "#9467bd",      # purple
    "memory": "#7f7f7f",    # grey
}
OTHER_COLOR = "#8c564b"


def engine_color(engine: str) -> str:
    """``#rrggbb`` for ``engine`` (the same colours in the PNG and the NVTX ranges)."""
    return ENGINE_COLORS.get(engine, OTHER_COLOR)


def engine_key(engine: str):
    """Sort key: known engines in `ENGINES` order, then the rest by name."""
    return (ENGINES.index(engine), "") if engine in ENGINES else (len(ENGINES), engine)


def _finite(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceValueError(f"NodeSpan {instance.name if hasattr(instance, 'name') else ''}: "
                              f"{attribute.name} must be a finite number of ms; got {value!r}")


@attrs.frozen
class NodeSpan:
    """One node's execution: ``start_ms`` .. ``end_ms`` on ``stream`` (ms from the run's start).

    ``kind`` is the node kind ("h2d", "kernel", ...), ``engine`` the engine it occupies,
    ``nbytes`` the bytes it moves or allocates (None for kernels and host functions),
    ``lowering`` how a host copy ran: ``"copy-kernel"`` (the SMs ran the copy kernel; the
    node's ``engine`` stays its own, "upload" / "download"), else None (a copy engine, or
    not a copy).

    Immutable: may be shared between threads freely.
    """

    name: str
    kind: str
    batch: int | None
    stream: str
    engine: str
    start_ms: float = attrs.field(converter=float, validator=_finite)
    end_ms: float = attrs.field(converter=float, validator=_finite)
    nbytes: int | None = attrs.field(default=None, kw_only=True)
    device: int = attrs.field(default=0, kw_only=True)
    lowering: str | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self):
        if self.end_ms < self.start_ms:
            raise TraceValueError(f"NodeSpan {self.name}: end_ms {self.end_ms} is before start_ms "
                                  f"{self.start_ms}")

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @classmethod
    def from_node(cls, node, stream: str, start_ms: float, end_ms: float,
                  lowering: str | None = None) -> "NodeSpan":
        """A span for graph node ``node`` (duck-typed: ``name``, ``kind``, ``batch``, ``engine``,
        ``device``, and the bytes from ``nbytes`` / ``buffer`` / ``dst``)."""
        return cls(node.name, getattr(node, "kind", "node"), getattr(node, "batch", None), stream,
                   getattr(node, "engine", "compute"), start_ms, end_ms,
                   nbytes=node_bytes(node), device=getattr(node, "device", None) or 0,
                   lowering=lowering)

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def node_bytes(node) -> int | None:
    """Bytes a node copies, sets or allocates; None when it has no such size."""
    for attr in ("nbytes", "buffer", "dst"):
        value = getattr(node, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        n = getattr(value, "nbytes", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return None


def _spans(value):
    spans = tuple(value)
    for s in spans:
        if not isinstance(s, NodeSpan):
            raise TraceTypeError(f"Timeline spans must be NodeSpan; got {type(s).__name__}")
    return spans


@attrs.frozen
class Timeline:
    """The spans of one run plus what ran them.

    Attributes:
        spans: sorted by start (then stream, then name).
        streams: stream names, one track each, in plan order (default: order of first use).
        policy: the plan's policy ("by-engine", "manual", ...).
        executor: "eager", "capture", "graph-build", ...
        device: the device ordinal the events were recorded on.
        meta: JSON-able extras.

    Immutable (frozen; the spans are a tuple of frozen `NodeSpan`), but ``meta`` is a plain dict:
    may be shared between threads freely as long as nobody modifies it.
    """

    spans: tuple[NodeSpan, ...] = attrs.field(converter=_spans)
    streams: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    policy: str = ""
    executor: str = ""
    device: int = 0
    meta: dict = attrs.field(factory=dict, converter=dict)

    def __attrs_post_init__(self):
        streams = list(dict.fromkeys(self.streams))
        if len(streams) != len(self.streams):
            raise TraceValueError(f"Timeline streams must be distinct; got {list(self.streams)}")
        for s in self.spans:  # streams no span names are kept; unnamed ones are appended
            if s.stream not in streams:
                if self.streams:
                    raise TraceValueError(
                        f"span {s.name} is on stream {s.stream!r}, which is not one "
                        f"of the timeline's streams {list(self.streams)}")
                streams.append(s.stream)
        index = {n: i for i, n in enumerate(streams)}
        spans = sorted(self.spans, key=lambda s: (s.start_ms, index[s.stream], s.end_ms, s.name))
        object.__setattr__(self, "streams", tuple(streams))
        object.__setattr__(self, "spans", tuple(spans))

    # -- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self):
        return iter(self.spans)

    def span(self, name: str) -> NodeSpan:
        """The span of node ``name`` (KeyError if it did not run)."""
        for s in self.spans:
            if s.name == name:
                return s
        raise NotFoundError(f"no span for node {name!r} in the timeline")

    def spans_for(self, stream: str | None = None, *, engine: str | None = None,
                  batch: int | None = None) -> tuple[NodeSpan, ...]:
        """Spans on ``stream`` and/or of ``engine`` and/or of ``batch`` (keywords, since stream
        and engine names may be the same word), in start order."""
        if stream is not None and stream not in self.streams:
            raise NotFoundError(
                f"no stream {stream!r} in the timeline; streams: {list(self.streams)}")
        return tuple(s for s in self.spans
                     if (stream is None or s.stream == stream)
                     and (engine is None or s.engine == engine)
                     and (batch is None or s.batch == batch))

    @property
    def engines(self) -> tuple[str, ...]:
        """Engines that ran at least one node, in `ENGINES` order."""
        return tuple(sorted({s.engine for s in self.spans}, key=engine_key))

    # -- metrics (see orchestra.trace.metrics) ----------------------------------------------

    @property
    def start_ms(self) -> float:
        """Start of the first span (0.0 when empty)."""
        return min((s.start_ms for s in self.spans), default=0.0)

    @property
    def end_ms(self) -> float:
        """End of the last span, from the run's start (0.0 when empty)."""
        return max((s.end_ms for s in self.spans), default=0.0)

    @property
    def makespan_ms(self) -> float:
        """First start to last end."""
        return self.end_ms - self.start_ms

    def metrics(self, engines=OVERLAP_ENGINES):
        """`Metrics` for this timeline; overlap counts ``engines``."""
        from orchestra.trace.metrics import compute_metrics
        return compute_metrics(self, engines)

    def busy_ms(self) -> dict[str, float]:
        """Engine -> ms during which at least one of its nodes ran (union of intervals)."""
        from orchestra.trace.metrics import busy_by
        return busy_by(self.spans, lambda s: s.engine)

    def overlap_ms(self, at_least: int = 2, engines=OVERLAP_ENGINES) -> float:
        """ms during which at least ``at_least`` of ``engines`` were busy at once."""
        return self.metrics(engines).overlap_ms(at_least)

    def pair_overlap_ms(self, engines=OVERLAP_ENGINES) -> dict[tuple[str, str], float]:
        """(engine a, engine b) -> ms both were busy."""
        return dict(self.metrics(engines).pairs_ms)

    def efficiency(self, bound_ms: float) -> float:
        """``bound_ms / makespan_ms`` (1.0 = the run took its ideal time)."""
        from orchestra.trace.metrics import efficiency
        return efficiency(bound_ms, self.makespan_ms)

    def summary(self, bound_ms: float | None = None, engines=OVERLAP_ENGINES) -> str:
        """A text table: per engine, per stream, overlap, pairs and (given a bound) efficiency."""
        from orchestra.trace.metrics import summary
        return summary(self, bound_ms, engines)

    def __str__(self) -> str:
        return self.summary()

    # -- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"format": FORMAT, "streams": list(self.streams), "policy": self.policy,
                "executor": self.executor, "device": self.device, "meta": self.meta,
                "spans": [s.to_dict() for s in self.spans]}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        if d.get("format") != FORMAT:
            raise TraceValueError(
                f"not an orchestra timeline (format {d.get('format')!r}, want {FORMAT!r})")
        return cls([NodeSpan(**s) for s in d["spans"]], d.get("streams", ()), d.get("policy", ""),
                   d.get("executor", ""), d.get("device", 0), d.get("meta", {}))


FORMAT = "orchestra.timeline/1"

"""`Plan`: which stream runs each node, in what order, and which events join streams.

A plan is plain data: named streams, each an ordered list of steps (`RunNode`, `RecordEvent`,
`WaitEvent`). Semantics (what executors and the verifier assume):

- steps of one stream run in order;
- each event is recorded once per plan; a wait orders everything before that record (on the
  recording stream, and what that stream had waited for) before every later step of the waiting
  stream; a wait for an event that is never recorded orders nothing;
- the plan ends with every stream synchronized, so host buffers are the caller's again then.

``order`` is the issue order of nodes across streams (the order the plan was built in); executors
enqueue with `issue_order()`, which follows it while never issuing a wait before its record.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import attrs

from orchestra.errors import NotFoundError, PlanError, PlanFormatError

ROLES = ("upload", "compute", "download", "general")
FORMAT = "orchestra.plan/1"


@attrs.frozen
class StreamSpec:
    """A non-blocking stream: ``name``, ``priority`` (CUDA: lower number = higher priority),
    ``role`` (which engine it mostly feeds: upload, compute, download, general) and ``device``
    (the ordinal of the GPU the stream belongs to; its events are recorded there)."""

    name: str
    priority: int = 0
    role: str = attrs.field(default="general")
    device: int = attrs.field(default=0, kw_only=True)

    @role.validator
    def _role(self, attribute, value):
        if value not in ROLES:
            raise PlanError(f"stream {self.name}: role must be one of {ROLES}; got {value!r}")

    @device.validator
    def _device(self, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"stream {self.name}: device must be a device ordinal (an int >= 0);"
                            f" got {value!r}")


@attrs.frozen
class RunNode:
    """Enqueue graph node ``node`` on the stream."""

    node: str


@attrs.frozen
class RecordEvent:
    """Record ``event`` on the stream (``cuEventRecord``)."""

    event: str


@attrs.frozen
class WaitEvent:
    """Make the stream wait for ``event`` (``cuStreamWaitEvent``)."""

    event: str


Step = RunNode | RecordEvent | WaitEvent
_TAGS = {RunNode: "run", RecordEvent: "record", WaitEvent: "wait"}
_BY_TAG = {v: k for k, v in _TAGS.items()}


def _field(step) -> str:
    return step.node if isinstance(step, RunNode) else step.event


def _stream_specs(specs: Iterable[StreamSpec]) -> tuple[StreamSpec, ...]:
    return tuple(specs)


def _names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


@attrs.frozen(eq=True, hash=False)
class Plan:
    """Streams and their ordered steps. ``node_stream`` and ``events`` are derived.

    Attributes:
        streams: the streams, in creation order.
        steps: stream name -> tuple of steps, in enqueue order.
        policy: what made the plan ("by-engine", "manual", ...).
        order: node issue order across streams (empty: stream by stream).
        meta: JSON-able extras, e.g. ``{"makespan_us": ...}`` from the critical-path policy.
        node_stream: node -> stream of its first `RunNode`.
        events: every event name, in order of first record (then unrecorded waits).
    """

    streams: tuple[StreamSpec, ...] = attrs.field(converter=_stream_specs)
    steps: dict = attrs.field(converter=lambda d: {k: tuple(v) for k, v in d.items()})
    policy: str = "manual"
    order: tuple[str, ...] = attrs.field(default=(), converter=_names)
    meta: dict = attrs.field(factory=dict, converter=dict)
    node_stream: dict = attrs.field(init=False, eq=False, repr=False)
    events: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise PlanError(f"plan streams must have distinct names; got {names}")
        unknown = set(self.steps) - set(names)
        if unknown:
            raise PlanError(
                f"plan steps name unknown stream(s) {sorted(unknown)}; streams: {names}")
        steps = {n: self.steps.get(n, ()) for n in names}
        object.__setattr__(self, "steps", steps)
        node_stream, recorded, waited = {}, [], []
        for n in names:
            for st in steps[n]:
                if not isinstance(st, (RunNode, RecordEvent, WaitEvent)):
                    raise PlanError(
                        f"stream {n}: a step must be RunNode, RecordEvent or WaitEvent; got {st!r}")
                if isinstance(st, RunNode):
                    node_stream.setdefault(st.node, n)
                elif isinstance(st, RecordEvent):
                    recorded.append(st.event)
                else:
                    waited.append(st.event)
        object.__setattr__(self, "node_stream", node_stream)
        object.__setattr__(self, "events", tuple(dict.fromkeys(recorded + waited)))

    # -- queries ----------------------------------------------------------------------------

    @property
    def stream_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.streams)

    @property
    def devices(self) -> tuple[int, ...]:
        """The device ordinals the plan's streams belong to, ascending."""
        return tuple(sorted({s.device for s in self.streams}))

    def device_of(self, stream: str) -> int:
        """The device of stream ``stream`` (`NotFoundError` if the plan has no such stream)."""
        return self.stream(stream).device

    def stream(self, name: str) -> StreamSpec:
        for s in self.streams:
            if s.name == name:
                return s
        raise NotFoundError(f"no stream named {name!r} in the plan")

    def stream_of(self, node: str) -> str:
        """The stream of ``node``'s first `RunNode`; `NotFoundError` (a ``KeyError``) if the
        plan does not run it."""
        try:
            return self.node_stream[node]
        except KeyError:
            raise NotFoundError(f"the plan does not run a node named {node!r}") from None

    def nodes(self, stream: str | None = None) -> tuple[str, ...]:
        """Node names run on ``stream`` (or on every stream, stream by stream), in order."""
        names = [stream] if stream is not None else self.stream_names
        return tuple(st.node for n in names for st in self.steps[n] if isinstance(st, RunNode))

    @property
    def event_count(self) -> int:
        """Number of `RecordEvent` steps (events the executor must create)."""
        return sum(isinstance(st, RecordEvent) for ss in self.steps.values() for st in ss)

    @property
    def wait_count(self) -> int:
        """Number of `WaitEvent` steps (cross-stream joins)."""
        return sum(isinstance(st, WaitEvent) for ss in self.steps.values() for st in ss)

    def issue_order(self) -> list[tuple[str, Step]]:
        """Every step as (stream, step) in an order an executor can enqueue them.

        Follows ``order`` (else stream by stream), never putting a wait before the record of its
        event. Raises `PlanError` (a ``ValueError``) when the waits form a cycle (the plan can
        never be issued).
        """
        rank = {n: i for i, n in enumerate(self.order)}
        chunks = {n: _chunks(self.steps[n]) for n in self.stream_names}
        recorded_somewhere = {st.event for ss in self.steps.values() for st in ss
                              if isinstance(st, RecordEvent)}
        head = {n: 0 for n in self.stream_names}
        issued_events: set[str] = set()
        out: list[tuple[str, Step]] = []
        total = sum(len(c) for c in chunks.values())
        big = len(rank) + sum(len(ss) for ss in self.steps.values())
        for _ in range(total):
            best = None
            for si, n in enumerate(self.stream_names):
                if head[n] == len(chunks[n]):
                    continue
                chunk, node = chunks[n][head[n]]
                if any(isinstance(st, WaitEvent) and st.event in recorded_somewhere
                       and st.event not in issued_events for st in chunk):
                    continue
                key = (rank.get(node, big), si)
                if best is None or key < best[0]:
                    best = (key, n)
            if best is None:
                blocked = [f"{n} waits for {st.event}" for n in self.stream_names
                           if head[n] < len(chunks[n]) for st in chunks[n][head[n]][0]
                           if isinstance(st, WaitEvent) and st.event not in issued_events]
                raise PlanError(
                    "plan cannot be issued: waits form a cycle (" + "; ".join(blocked) + ")")
            n = best[1]
            chunk, _node = chunks[n][head[n]]
            head[n] += 1
            for st in chunk:
                if isinstance(st, RecordEvent):
                    issued_events.add(st.event)
                out.append((n, st))
        return out

    # -- text and JSON ----------------------------------------------------------------------

    def __str__(self) -> str:
        after = {}  # event -> "node on stream" it follows
        for n in self.stream_names:
            last = None
            for st in self.steps[n]:
                if isinstance(st, RunNode):
                    last = st.node
                elif isinstance(st, RecordEvent):
                    after[st.event] = f"after {last or '(start)'} on {n}"
        nodes = sum(isinstance(st, RunNode) for ss in self.steps.values() for st in ss)
        lines = [f"plan ({self.policy}): {len(self.streams)} stream(s), {nodes} node(s), "
                 f"{self.event_count} event(s), {self.wait_count} wait(s)"]
        for k, v in sorted(self.meta.items()):
            lines.append(f"  {k}: {v}")
        several = len(self.devices) > 1
        for s in self.streams:
            on = f", device {s.device}" if several else ""
            lines.append(f"stream {s.name} (role {s.role}, priority {s.priority}{on}):")
            for st in self.steps[s.name]:
                tag = _TAGS[type(st)]
                text = f"    {tag:<6} {_field(st)}"
                if isinstance(st, WaitEvent):
                    text += f"   ({after.get(st.event, 'never recorded')})"
                lines.append(text)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The plan as plain data (what `to_json` writes). A stream's ``device`` is written
        only when it is not 0, so a one-device plan on device 0 reads as before devices
        existed."""
        return {
            "format": FORMAT,
            "policy": self.policy,
            "streams": [{"name": s.name, "priority": s.priority, "role": s.role,
                         **({"device": s.device} if s.device else {}),
                         "steps": [[_TAGS[type(st)], _field(st)] for st in self.steps[s.name]]}
                        for s in self.streams],
            "order": list(self.order),
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = 1) -> str:
        """The plan as JSON (stable: same plan, same text)."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan `to_dict` wrote. Raises `PlanFormatError` (a `PlanError`, a ``ValueError``)
        naming what is missing or wrong and where, e.g.
        ``plan JSON: streams[1]: missing "steps"``."""
        _obj(d, "")
        fmt = d.get("format")
        if fmt != FORMAT:
            raise PlanFormatError(
                f"plan JSON: not an orchestra plan (format {fmt!r}, want {FORMAT!r})"
                if "format" in d else
                f'plan JSON: missing "format" (want {FORMAT!r}): not an orchestra plan', "format")
        streams, steps = [], {}
        for i, sd in enumerate(_list(_need(d, "streams", ""), "streams")):
            where = f"streams[{i}]"
            _obj(sd, where)
            name = _str(_need(sd, "name", where), f"{where}.name")
            priority = sd.get("priority", 0)
            if isinstance(priority, bool) or not isinstance(priority, int):
                raise PlanFormatError(f"plan JSON: {where}.priority must be an int, got "
                                      f"{_got(priority)}", f"{where}.priority")
            role = _str(sd.get("role", "general"), f"{where}.role")
            device = sd.get("device", 0)
            if isinstance(device, bool) or not isinstance(device, int) or device < 0:
                raise PlanFormatError(f"plan JSON: {where}.device must be a device ordinal (an int"
                                      f" >= 0), got {_got(device)}", f"{where}.device")
            try:
                streams.append(StreamSpec(name, priority, role, device=device))
            except PlanError as exc:
                raise PlanFormatError(f"plan JSON: {where}: {exc}", where) from None
            if name in steps:
                raise PlanFormatError(f"plan JSON: {where}: a second stream named {name!r}",
                                      f"{where}.name")
            steps[name] = [_step(st, f"{where}.steps[{j}]") for j, st in
                           enumerate(_list(_need(sd, "steps", where), f"{where}.steps"))]
        policy = _str(d.get("policy", "manual"), "policy")
        order = [_str(n, f"order[{j}]") for j, n in enumerate(_list(d.get("order", []), "order"))]
        meta = d.get("meta", {})
        _obj(meta, "meta")
        try:
            return cls(streams, steps, policy, order, meta)
        except PlanError as exc:
            raise PlanFormatError(f"plan JSON: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """`from_dict` of ``json.loads(text)``; text that is not JSON is a `PlanFormatError`
        too (with the line and column ``json`` reports)."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise PlanFormatError(f"plan JSON: not valid JSON: {exc}") from None
        return cls.from_dict(d)


# -- plan JSON checks: each names the path of the bad value -----------------------------------


def _got(value) -> str:
    return f"{type(value).__name__} {value!r}"


def _at(where: str) -> str:
    return f"plan JSON: {where}:" if where else "plan JSON:"


def _obj(value, where: str) -> None:
    if not isinstance(value, dict):
        raise PlanFormatError(f"{_at(where)} expected an object, got {_got(value)}", where)


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise PlanFormatError(f'{_at(where)} missing "{key}"', f"{where}.{key}" if where else key)
    return d[key]


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise PlanFormatError(f"plan JSON: {where} must be a list, got {_got(value)}", where)
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str):
        raise PlanFormatError(f"plan JSON: {where} must be a string, got {_got(value)}", where)
    return value


def _step(value, where: str):
    if not (isinstance(value, list) and len(value) == 2):
        raise PlanFormatError(f"plan JSON: {where} must be a [kind, name] pair such as"
                              f' ["run", "b0.h2d"], got {_got(value)}', where)
    tag, name = value
    if tag not in _BY_TAG:
        raise PlanFormatError(f"plan JSON: {where}: unknown step kind {tag!r}; kinds:"
                              f" {', '.join(_BY_TAG)}", where)
    return _BY_TAG[tag](_str(name, f"{where}[1]"))


def _chunks(steps):
    """Split a stream's steps into (steps, node) units: waits, one run, then its records."""
    out, cur, node = [], [], None
    for st in steps:
        if isinstance(st, WaitEvent) and node is not None:
            out.append((cur, node))
            cur, node = [], None
        if isinstance(st, RunNode):
            if node is not None:
                out.append((cur, node))
                cur = []
            node = st.node
        cur.append(st)
    if cur:
        out.append((cur, node))
    return out


class PlanBuilder:
    """Write a plan by hand; the call order is the issue order.

        plan = (PlanBuilder().stream("up", role="upload").run("alloc", "h2d").record("e0")
                .stream("comp", role="compute").wait("e0").run("kernel").build())
    """

    def __init__(self, policy: str = "manual"):
        self._policy = policy
        self._streams: dict[str, StreamSpec] = {}
        self._steps: dict[str, list] = {}
        self._order: list[str] = []
        self._cur: str | None = None

    def stream(self, name: str, priority: int | None = None, role: str | None = None,
               device: int | None = None) -> "PlanBuilder":
        """Switch to stream ``name``, creating it (priority 0, role general, device 0 unless
        given)."""
        old = self._streams.get(name)
        spec = StreamSpec(name, priority if priority is not None else (old.priority if old else 0),
                          role if role is not None else (old.role if old else "general"),
                          device=device if device is not None else (old.device if old else 0))
        self._streams[name] = spec
        self._steps.setdefault(name, [])
        self._cur = name
        return self

    def _add(self, step):
        if self._cur is None:
            raise PlanError("PlanBuilder: call .stream(name) before adding steps")
        self._steps[self._cur].append(step)
        return self

    def run(self, *nodes: str) -> "PlanBuilder":
        for n in nodes:
            self._add(RunNode(n))
            self._order.append(n)
        return self

    def record(self, event: str) -> "PlanBuilder":
        return self._add(RecordEvent(event))

    def wait(self, event: str) -> "PlanBuilder":
        return self._add(WaitEvent(event))

    def build(self) -> Plan:
        return Plan(tuple(self._streams.values()), self._steps, self._policy, self._order)

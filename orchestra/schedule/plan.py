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
import sys
import weakref
from bisect import bisect_left
from collections import deque
from itertools import repeat
from operator import add, setitem
from collections.abc import Iterable, Mapping

import attrs

from orchestra.errors import NotFoundError, PlanError, PlanFormatError, int_text
from orchestra.graph.trusted import maker
from orchestra.schedule import json_text

ROLES = ("upload", "compute", "download", "general")
FORMAT = "orchestra.plan/1"
# A stream priority and a device ordinal are C ints to the driver (cuStreamCreateWithPriority's
# ``int priority``, CUdevice). The plan is device-independent: a priority outside the device's
# own range (cuCtxGetStreamPriorityRange, e.g. -5 .. 0) is refused when a run creates the stream.
C_INT_MIN, C_INT_MAX = -(1 << 31), (1 << 31) - 1
_DBL_MAX = sys.float_info.max  # a makespan is a double: finite (NaN fails every comparison)
PRIORITY_RANGE_NOTE = ("the device's own range (cuCtxGetStreamPriorityRange, e.g. -5 .. 0; lower"
                       " is more urgent) is checked when a run creates the stream")


def priority_problem(value) -> str | None:
    """What is wrong with ``value`` as a stream priority (an int within a C int), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"must be an int, got {_got(value)}"
    if not C_INT_MIN <= value <= C_INT_MAX:
        return (f"must be an int from {C_INT_MIN} to {C_INT_MAX} (a C int), got"
                f" {int_text(value)}; {PRIORITY_RANGE_NOTE}")
    return None


def device_problem(value) -> str | None:
    """What is wrong with ``value`` as a device ordinal (an int from 0 within a C int), or
    None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= C_INT_MAX:
        shown = int_text(value) if isinstance(value, int) and not isinstance(value, bool) \
            else _got(value)
        return f"must be a device ordinal (an int from 0 to {C_INT_MAX}), got {shown}"
    return None


@attrs.frozen
class StreamSpec:
    """A non-blocking stream: ``name``, ``priority`` (CUDA: lower number = higher priority),
    ``role`` (which engine it mostly feeds: upload, compute, download, general) and ``device``
    (the ordinal of the GPU the stream belongs to; its events are recorded there).

    Immutable: may be shared between threads freely.
    """

    name: str
    priority: int = attrs.field(default=0)
    role: str = attrs.field(default="general")
    device: int = attrs.field(default=0, kw_only=True)

    @priority.validator
    def _priority(self, attribute, value):
        problem = priority_problem(value)
        if problem:
            raise PlanError(f"stream {self.name}: priority {problem}")

    @role.validator
    def _role(self, attribute, value):
        if value not in ROLES:
            raise PlanError(f"stream {self.name}: role must be one of {ROLES}; got {value!r}")

    @device.validator
    def _device(self, attribute, value):
        problem = device_problem(value)
        if problem:
            raise PlanError(f"stream {self.name}: device {problem}")


@attrs.frozen
class RunNode:
    """Enqueue graph node ``node`` on the stream.

    Immutable: may be shared between threads freely.
    """

    node: str


@attrs.frozen
class RecordEvent:
    """Record ``event`` on the stream (``cuEventRecord``).

    Immutable: may be shared between threads freely.
    """

    event: str


@attrs.frozen
class WaitEvent:
    """Make the stream wait for ``event`` (``cuStreamWaitEvent``).

    Immutable: may be shared between threads freely.
    """

    event: str


Step = RunNode | RecordEvent | WaitEvent
_TAGS = {RunNode: "run", RecordEvent: "record", WaitEvent: "wait"}
_STEP_TYPES = frozenset(_TAGS)


class PlanIndex:
    """A plan's steps as integer codes, kept by `insert_events` (which writes them while it
    places the events) for the passes over every step: `Plan.text` and `estimate_makespan`
    look codes up in tables instead of visiting step objects one by one.

    For a graph of ``n`` nodes (`TaskGraph.index`): code ``1 + v`` runs node ``v``, ``1 + n +
    p`` records the event whose source is node ``p``, ``1 + 2n + p`` waits for that event.
    ``codes[k]``: stream ``k``'s steps; ``names``: node names by index; ``sources``: the
    events' source nodes (event ``events[i]`` is recorded after node ``sources[i]``); ``on``:
    each node's stream index. ``graph`` is a weak reference to the graph the plan is for.
    Immutable once made; copying or pickling a plan leaves it behind (it is derived data)."""

    __slots__ = ("graph", "codes", "n", "names", "sources", "events", "on")

    def __init__(self, graph, codes, n, names, sources, events, on):
        self.graph = weakref.ref(graph)
        self.codes, self.n, self.names = codes, n, names
        self.sources, self.events, self.on = sources, events, on

    def __reduce__(self):  # a copy or an unpickled plan has none (it is only a shortcut)
        return (type(None), ())
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

    Thread-safety: frozen, and orchestra never changes a plan once it is made, so one plan may be
    shared by several threads (executors in different threads read it at once). ``steps`` and
    ``meta`` are plain dicts, though: do not modify them while others read the plan. `node_stream`
    and `events` are made on first use and assigned whole (at worst made twice).
    """

    streams: tuple[StreamSpec, ...] = attrs.field(converter=_stream_specs)
    steps: dict = attrs.field(converter=lambda d: {k: tuple(v) for k, v in d.items()})
    policy: str = "manual"
    order: tuple[str, ...] = attrs.field(default=(), converter=_names)
    meta: dict = attrs.field(factory=dict, converter=dict)
    # node_stream and events (the properties), made on first use when `_derived` made the plan
    _node_stream: dict | None = attrs.field(init=False, eq=False, repr=False)
    _events: tuple[str, ...] | None = attrs.field(init=False, eq=False, repr=False)
    _counts: tuple[int, int] = attrs.field(init=False, eq=False, repr=False)  # records, waits
    # from `_derived`: the steps as codes by node index (`PlanIndex`), or None
    _hint: "PlanIndex | None" = attrs.field(init=False, default=None, eq=False, repr=False)

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
                t = type(st)  # exact types first: the common case, and fast on long plans
                if t is RunNode or (t is not RecordEvent and t is not WaitEvent
                                    and isinstance(st, RunNode)):
                    if st.node not in node_stream:
                        node_stream[st.node] = n
                elif t is RecordEvent or isinstance(st, RecordEvent):
                    recorded.append(st.event)
                elif t is WaitEvent or isinstance(st, WaitEvent):
                    waited.append(st.event)
                else:
                    raise PlanError(
                        f"stream {n}: a step must be RunNode, RecordEvent or WaitEvent; got {st!r}")
        object.__setattr__(self, "_node_stream", node_stream)
        object.__setattr__(self, "_events", tuple(dict.fromkeys(recorded + waited)))
        object.__setattr__(self, "_counts", (len(recorded), len(waited)))

    @classmethod
    def _derived(cls, streams: tuple, steps: dict, policy: str, order: tuple, meta: dict,
                 counts: tuple[int, int], index: "PlanIndex | None" = None) -> "Plan":
        """The plan of these fields, without scanning every step as ``__init__`` does: for
        `insert_events`, which makes the steps of known types and knows their ``counts``
        (records, waits; a 50,000-batch plan has over a million steps). ``node_stream`` and
        ``events`` are found when first asked for. The caller guarantees what ``__init__``
        would check and convert: distinct stream names, ``steps`` a dict of tuples of
        `RunNode` / `RecordEvent` / `WaitEvent` with one entry per stream in stream order,
        every node run once, event ``e{i}`` recorded once for each ``i`` below ``counts[0]``
        (and no other event), ``order`` a tuple, ``meta`` a fresh dict. ``index``: the same
        steps as codes (`PlanIndex`)."""
        return _make_plan(streams, steps, policy, order, meta, None, None, counts, index)

    def _by_index(self, graph) -> "PlanIndex | None":
        """The plan's steps as codes (`PlanIndex`) when `insert_events` made it for ``graph``
        (this very object), else None: for `estimate_makespan`."""
        hint = self._hint
        if hint is None or hint.graph() is not graph:
            return None
        return hint

    @property
    def node_stream(self) -> dict[str, str]:
        """Node -> the stream of its first `RunNode` (streams in order, then steps); the plan's
        own table (do not modify it)."""
        ns = self._node_stream
        if ns is None:  # a plan from `_derived`: exact step types, every node run once
            ns = {}
            for name in self.stream_names:
                ns.update(dict.fromkeys([st.node for st in self.steps[name]
                                         if type(st) is RunNode], name))
            object.__setattr__(self, "_node_stream", ns)
        return ns

    @property
    def events(self) -> tuple[str, ...]:
        """Every event name, in order of first record (then events only waited for)."""
        ev = self._events
        if ev is None:  # a plan from `_derived`: every waited event is recorded
            ev = tuple(dict.fromkeys([st.event for name in self.stream_names
                                      for st in self.steps[name] if type(st) is RecordEvent]))
            object.__setattr__(self, "_events", ev)
        return ev

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
        return self._counts[0]

    @property
    def wait_count(self) -> int:
        """Number of `WaitEvent` steps (cross-stream joins)."""
        return self._counts[1]

    def issue_order(self) -> list[tuple[str, Step]]:
        """Every step as (stream, step) in an order an executor can enqueue them.

        Follows ``order`` (else stream by stream), never putting a wait before the record of its
        event. Raises `PlanError` (a ``ValueError``) when the waits form a cycle (the plan can
        never be issued).
        """
        rank = {n: i for i, n in enumerate(self.order)}
        names = self.stream_names
        chunks = [_chunks(self.steps[n]) for n in names]
        recorded_somewhere = {st.event for ss in self.steps.values() for st in ss
                              if isinstance(st, RecordEvent)}
        # per chunk: the events its waits need issued first (most chunks need none)
        needs = [[tuple(st.event for st in chunk if isinstance(st, WaitEvent)
                        and st.event in recorded_somewhere) for chunk, _ in ch] for ch in chunks]
        head = [0] * len(names)
        issued_events: set[str] = set()
        out: list[tuple[str, Step]] = []
        total = sum(len(c) for c in chunks)
        big = len(rank) + sum(len(ss) for ss in self.steps.values())
        for _ in range(total):
            best, best_rank = None, 0
            for si, ch in enumerate(chunks):  # the lowest rank first; ties: the first stream
                h = head[si]
                if h == len(ch):
                    continue
                need = needs[si][h]
                if need and any(ev not in issued_events for ev in need):
                    continue
                r = rank.get(ch[h][1], big)
                if best is None or r < best_rank:
                    best, best_rank = si, r
            if best is None:
                blocked = [f"{n} waits for {st.event}" for si, n in enumerate(names)
                           if head[si] < len(chunks[si]) for st in chunks[si][head[si]][0]
                           if isinstance(st, WaitEvent) and st.event not in issued_events]
                raise PlanError(
                    "plan cannot be issued: waits form a cycle (" + "; ".join(blocked) + ")")
            n = names[best]
            chunk, _node = chunks[best][head[best]]
            head[best] += 1
            for st in chunk:
                if isinstance(st, RecordEvent):
                    issued_events.add(st.event)
                out.append((n, st))
        return out

    # -- text and JSON ----------------------------------------------------------------------

    def __str__(self) -> str:
        return self.text()

    def text(self, notes: Mapping[str, str] | None = None) -> str:
        """The listing ``str(plan)`` gives: per stream its steps, each wait with the record it
        waits for. ``notes``: node name -> a note printed after the node's step (what an
        executor makes of it, e.g. ``"copy kernel"`` for a host copy lowered to the copy
        kernel)."""
        if self._hint is not None:
            return self._text_indexed(self._hint, notes)
        streams = [(sp, self.steps[sp.name]) for sp in self.streams]
        kinds = [list(map(type, ss)) for _, ss in streams]
        if all(set(ks) <= _STEP_TYPES for ks in kinds):
            return self._text_exact(streams, kinds, notes)
        after = {}  # event -> "node on stream" it follows
        nodes = 0
        for n in self.stream_names:
            last = None
            for st in self.steps[n]:
                t = type(st)  # exact types first: the common case, and fast on long plans
                if t is RunNode or (t is not RecordEvent and isinstance(st, RunNode)):
                    last = st.node
                    nodes += 1
                elif t is RecordEvent or isinstance(st, RecordEvent):
                    after[st.event] = f"after {last or '(start)'} on {n}"
        lines = self._text_head(nodes)
        add = lines.append
        several = len(self.devices) > 1
        for s in self.streams:
            on = f", device {s.device}" if several else ""
            add(f"stream {s.name} (role {s.role}, priority {s.priority}{on}):")
            for st in self.steps[s.name]:
                t = type(st)  # the tag column is padded to 6: "run   ", "record", "wait  "
                if t is RunNode:
                    note = notes.get(st.node) if notes else None
                    add("    run    " + st.node if note is None
                        else f"    run    {st.node}   [{note}]")
                elif t is RecordEvent:
                    add("    record " + st.event)
                elif t is WaitEvent:
                    add(f"    wait   {st.event}   ({after.get(st.event, 'never recorded')})")
                else:  # not a step type (the plan refuses those): as before, _TAGS says so
                    add(f"    {_TAGS[t]:<6} {_field(st)}")
        return "\n".join(lines)

    def _text_head(self, nodes: int) -> list[str]:
        lines = [f"plan ({self.policy}): {len(self.streams)} stream(s), {nodes} node(s), "
                 f"{self.event_count} event(s), {self.wait_count} wait(s)"]
        for k, v in sorted(self.meta.items()):
            lines.append(f"  {k}: {v}")
        return lines

    def _text_indexed(self, index: PlanIndex, notes) -> str:
        """`text` from the steps' codes (`PlanIndex`): a line per code, looked up in C."""
        n, names, sources, events = index.n, index.names, index.sources, index.events
        table: list = [None]
        table += map(add, repeat("    run    "), names)
        if notes:
            for v in [i for i, name in enumerate(names) if notes.get(name) is not None]:
                table[1 + v] = f"    run    {names[v]}   [{notes[names[v]]}]"
        table += repeat(None, 2 * n)
        at_record = list(map(add, repeat(1 + n), sources))
        deque(map(setitem, repeat(table), at_record, map(add, repeat("    record "), events)), 0)
        stream_names = self.stream_names
        deque(map(setitem, repeat(table), map(add, repeat(n), at_record),
                  map("    wait   {}   (after {} on {})".format, events,
                      map(names.__getitem__, sources),
                      map(stream_names.__getitem__, map(index.on.__getitem__, sources)))), 0)
        lines = self._text_head(n)
        several = len(self.devices) > 1
        for sp, cs in zip(self.streams, index.codes):
            on = f", device {sp.device}" if several else ""
            lines.append(f"stream {sp.name} (role {sp.role}, priority {sp.priority}{on}):")
            lines += map(table.__getitem__, cs)
        return "\n".join(lines)

    def _text_exact(self, streams, kinds, notes) -> str:
        """`text` of a plan whose steps are all of the exact step types (not subclasses):
        each stream's lines in one pass in C where it can (a long plan has a million)."""
        after = {}  # event -> "node on stream" it follows
        nodes = 0
        for (sp, ss), ks in zip(streams, kinds):
            runs = [i for i, k in enumerate(ks) if k is RunNode]
            nodes += len(runs)
            for i in [i for i, k in enumerate(ks) if k is RecordEvent]:
                j = bisect_left(runs, i) - 1  # the stream's last run before the record
                last = ss[runs[j]].node if j >= 0 else None
                after[ss[i].event] = f"after {last or '(start)'} on {sp.name}"
        lines = self._text_head(nodes)
        several = len(self.devices) > 1
        get = after.get
        for (sp, ss), ks in zip(streams, kinds):
            on = f", device {sp.device}" if several else ""
            lines.append(f"stream {sp.name} (role {sp.role}, priority {sp.priority}{on}):")
            # the tag column is padded to 6: "run   ", "record", "wait  "
            if notes:
                lines += [("    run    " + st.node if notes.get(st.node) is None else
                           f"    run    {st.node}   [{notes[st.node]}]") if k is RunNode else
                          "    record " + st.event if k is RecordEvent else
                          f"    wait   {st.event}   ({get(st.event, 'never recorded')})"
                          for st, k in zip(ss, ks)]
            else:
                lines += ["    run    " + st.node if k is RunNode else
                          "    record " + st.event if k is RecordEvent else
                          f"    wait   {st.event}   ({get(st.event, 'never recorded')})"
                          for st, k in zip(ss, ks)]
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
        """The plan as JSON (stable: same plan, same text; ``json.dumps`` with ``sort_keys``)."""
        if isinstance(indent, int) and not isinstance(indent, bool) and indent >= 0:
            return json_text.dumps(self.to_dict(), indent)
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
            problem = priority_problem(priority)
            if problem:
                raise PlanFormatError(f"plan JSON: {where}.priority {problem}",
                                      f"{where}.priority")
            role = _str(sd.get("role", "general"), f"{where}.role")
            device = sd.get("device", 0)
            problem = device_problem(device)
            if problem:
                raise PlanFormatError(f"plan JSON: {where}.device {problem}", f"{where}.device")
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
        if "makespan_us" in meta:  # the one number a policy writes (the critical-path estimate)
            m = meta["makespan_us"]
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= _DBL_MAX:
                shown = int_text(m) if isinstance(m, int) and not isinstance(m, bool) \
                    else _got(m)
                raise PlanFormatError(f"plan JSON: meta.makespan_us must be a finite number >= 0"
                                      f" (microseconds), got {shown}", "meta.makespan_us")
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
        except RecursionError:  # json.loads recurses per nesting level
            raise PlanFormatError("plan JSON: nested too deeply to parse (a plan is an object "
                                  "of flat lists, a few levels deep)") from None
        return cls.from_dict(d)


# -- plan JSON checks: each names the path of the bad value -----------------------------------


def _got(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{type(value).__name__} {int_text(value)}"  # never thousands of digits
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
    if not isinstance(tag, str) or tag not in _BY_TAG:  # a list or an object is no kind
        raise PlanFormatError(f"plan JSON: {where}: unknown step kind {tag!r}; kinds:"
                              f" {', '.join(_BY_TAG)}", where)
    return _BY_TAG[tag](_str(name, f"{where}[1]"))


# Plan._derived's constructor (every field set as given; `maker` refuses a field list that
# no longer matches the class)
_make_plan = maker(Plan, "streams", "steps", "policy", "order", "meta", "_node_stream",
                   "_events", "_counts", "_hint")


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

    Thread-safety: not thread-safe (every call appends to the builder's lists): use one per thread.
    The `Plan` that `build` returns may be shared.
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

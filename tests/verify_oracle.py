"""The hazard verifier as it was before it was made near-linear: every pair of overlapping
accesses of a buffer compared (quadratic), happens-before from per-node vector clock tuples (plan)
or ancestor bitsets (graph edges); and the transitive reduction by reachability bitsets, the
plan's issue order, text and simulated makespan as they were written before they were made
faster. Kept only as test oracles (tests/test_verify_property.py): the same results, on many
small plans."""

from __future__ import annotations

from collections import defaultdict

from orchestra.errors import HazardError
from orchestra.graph import Mode, TaskGraph
from orchestra.schedule.finding import Finding
from orchestra.schedule.plan import Plan, RecordEvent, RunNode, WaitEvent
from orchestra.schedule.costs import estimate_costs, resource_of, RESOURCES
from orchestra.schedule.plan import _TAGS, Step, _field
from orchestra.schedule.plan import _chunks as _plan_chunks


class PlanOrder:
    """Happens-before of the nodes of ``plan``; ``findings`` holds structural problems
    (a node run twice, an event recorded twice or never, waits that can never be issued)."""

    mode = "plan"

    def __init__(self, plan: Plan):
        names = plan.stream_names
        self.plan = plan
        self.stream_of: dict[str, str] = {}
        self.findings: list[Finding] = []
        self._sid = {n: i for i, n in enumerate(names)}
        self._pos: dict[str, int] = {}
        self._clock: dict[str, tuple[int, ...]] = {}
        self._record_after: dict[str, tuple[str, str | None]] = {}  # event -> (stream, node)
        self.runs: dict[str, int] = {}
        self._build(plan, names)

    def _build(self, plan, names):
        S = len(names)
        recorded_in_plan = {}
        for n in names:
            for st in plan.steps[n]:
                if isinstance(st, RecordEvent):
                    recorded_in_plan.setdefault(st.event, []).append(n)
        for ev, where in recorded_in_plan.items():
            if len(where) > 1:
                self.findings.append(Finding(
                    "EVENT_REUSED", None, (None, None), tuple(where),
                    f"event {ev} is recorded {len(where)} times (on {', '.join(where)}): a plan records "
                    f"each event once; use a new event for each record"))
        cur = [[0] * S for _ in names]
        snap: dict[str, tuple[int, ...]] = {}
        head = [0] * S
        last_node: list[str | None] = [None] * S
        steps = [plan.steps[n] for n in names]
        reported_unrecorded = set()
        while True:
            progress = False
            for s in range(S):
                while head[s] < len(steps[s]):
                    st = steps[s][head[s]]
                    if isinstance(st, WaitEvent):
                        if st.event in snap:
                            cur[s] = list(map(max, cur[s], snap[st.event]))
                        elif st.event in recorded_in_plan:
                            break  # its record has not been reached yet: try other streams
                        elif st.event not in reported_unrecorded:
                            reported_unrecorded.add(st.event)
                            held = _held_up(steps[s], head[s])
                            self.findings.append(Finding(
                                "WAIT_UNRECORDED", None, (held, None), (names[s],),
                                f"stream {names[s]} waits for event {st.event}"
                                + (f" before {held}" if held else "")
                                + f", which no stream records: the wait orders nothing; record "
                                f"{st.event} after the node it should wait for"))
                    elif isinstance(st, RecordEvent):
                        snap[st.event] = tuple(cur[s])  # a re-record overwrites (reported above)
                        self._record_after.setdefault(st.event, (names[s], last_node[s]))
                    else:
                        self._run(st.node, s, names, cur[s])
                        last_node[s] = st.node
                    head[s] += 1
                    progress = True
            if all(head[s] == len(steps[s]) for s in range(S)):
                return
            if not progress:
                blocked = [(names[s], steps[s][head[s]].event, _held_up(steps[s], head[s]))
                           for s in range(S) if head[s] < len(steps[s])]
                held = tuple(h for _, _, h in blocked)
                self.findings.append(Finding(
                    "DEADLOCK", None, held + (None,) * (2 - len(held)), tuple(n for n, _, _ in blocked),
                    "the plan's waits form a cycle and can never all be issued: "
                    + "; ".join(f"stream {n} waits for {ev}" + (f" (holding up {h})" if h else "")
                                + " before it is recorded" for n, ev, h in blocked)
                    + "; each wait must come after its event's record in some issue order"))
                s = self._sid[blocked[0][0]]
                head[s] += 1  # treat the first blocked wait as a no-op and go on

    def _run(self, node, s, names, clock):
        self.runs[node] = self.runs.get(node, 0) + 1
        clock[s] += 1
        if node in self._clock:
            return  # run twice: reported by the verifier; the first run defines the order
        self.stream_of[node] = names[s]
        self._pos[node] = clock[s]
        self._clock[node] = tuple(clock)

    def has(self, node: str) -> bool:
        return node in self._clock

    def before(self, a: str, b: str) -> bool:
        """True when node ``a`` finishes before node ``b`` starts in every execution."""
        if a == b:
            return False
        return self._clock[b][self._sid[self.stream_of[a]]] >= self._pos[a]

    def where(self, node: str) -> str:
        return f"{node} (stream {self.stream_of[node]})"

    def fix(self, a: str, b: str) -> str:
        """The missing-ordering clause: what is missing and how to add it."""
        sa, sb = self.stream_of[a], self.stream_of[b]
        if self.before(b, a):
            return (f"but the plan runs {b} before {a} (the reverse of program order): "
                    f"reorder so {a} runs first")
        if sa == sb:  # cannot happen for one stream, kept for completeness
            return f"and {a} does not precede {b} on stream {sa}"
        return (f"and no event orders {a} before {b}: record an event on {sa} after {a} "
                f"and wait for it on {sb} before {b}")


def _held_up(steps, i):
    """The node a wait at ``steps[i]`` holds up: the stream's next `RunNode` (None if none)."""
    return next((st.node for st in steps[i + 1:] if isinstance(st, RunNode)), None)


class GraphOrder:
    """Happens-before from a graph's edges only (what a CUDA graph built from them guarantees)."""

    mode = "graph"

    def __init__(self, graph, edges=None):
        edges = graph.edges if edges is None else frozenset(edges)
        names = [n.name for n in graph.nodes]
        self._bit = {n: i for i, n in enumerate(names)}
        preds = {n: [] for n in names}
        for p, s in edges:
            preds[s].append(p)
        self.findings: list[Finding] = []
        self.stream_of = {n: None for n in names}
        self.runs = {n: 1 for n in names}
        # ancestors as bitsets, in a topological order of these edges
        self._anc: dict[str, int] = {}
        indeg = {n: len(preds[n]) for n in names}
        succs = {n: [] for n in names}
        for p, s in edges:
            succs[p].append(s)
        ready = [n for n in names if indeg[n] == 0]
        while ready:
            n = ready.pop()
            a = 0
            for p in preds[n]:
                a |= self._anc[p] | (1 << self._bit[p])
            self._anc[n] = a
            for s in succs[n]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    ready.append(s)
        stuck = [n for n in names if n not in self._anc]
        if stuck:
            self.findings.append(Finding("DEADLOCK", None, tuple(stuck[:2]), (None, None),
                                         "the edges form a cycle through: " + ", ".join(stuck)))
            for n in stuck:
                self._anc[n] = 0

    def has(self, node: str) -> bool:
        return node in self._anc

    def before(self, a: str, b: str) -> bool:
        return a != b and bool((self._anc[b] >> self._bit[a]) & 1)

    def where(self, node: str) -> str:
        return node

    def fix(self, a: str, b: str) -> str:
        if self.before(b, a):
            return f"but the edges order {b} before {a} (the reverse of program order)"
        return f"and no path of graph edges orders {a} before {b}: add an edge from {a} to {b}"


_VERB = {Mode.READ: "reads", Mode.WRITE: "writes", Mode.READ_WRITE: "reads and writes"}


def verify(plan: Plan, graph: TaskGraph) -> list[Finding]:
    """Every hazard of running ``plan`` for ``graph``; an empty list means none was found."""
    order = PlanOrder(plan)
    findings = list(order.findings)
    names = {n.name for n in graph.nodes}
    for n in plan.node_stream:
        if n not in names:
            findings.append(Finding("UNKNOWN_NODE", None, (n, None), (plan.node_stream[n], None),
                                    f"the plan runs {n} on stream {plan.node_stream[n]}, but the "
                                    f"graph has no node named {n}"))
    for node in graph.nodes:
        n = node.name
        if n not in order.runs:
            findings.append(Finding("MISSING", None, (n, None), (None, None),
                                    f"{n} is in the graph but the plan never runs it: add it to a "
                                    f"stream after its predecessors"))
        elif order.runs[n] > 1:
            kind = "DOUBLE_FREE" if node.kind == "free" else "DUPLICATE"
            what = f" (each run frees {node.buffer.name} again)" if node.kind == "free" else ""
            findings.append(Finding(kind, getattr(node, "buffer", None) and node.buffer.name,
                                    (n, None), (order.stream_of[n], None),
                                    f"the plan runs {n} {order.runs[n]} times{what}: run each node once"))
    findings += _hazards(order, graph)
    return findings


def verify_graph_edges(graph: TaskGraph, edges=None) -> list[Finding]:
    """Hazards when only ``edges`` (default: the graph's own) order the nodes, as in a CUDA
    graph built from them; pass e.g. ``graph.reduced_edges()`` or hand-picked edges."""
    order = GraphOrder(graph, edges)
    return list(order.findings) + _hazards(order, graph)


def check(plan: Plan, graph: TaskGraph) -> None:
    """Raise `HazardError` listing every finding of `verify` (nothing is enqueued then)."""
    findings = verify(plan, graph)
    if findings:
        raise HazardError(findings)


def _hazards(order, graph) -> list[Finding]:
    out = _races(order, graph)
    out += _lifetimes(order, graph)
    for p, s in sorted(graph.explicit_edges, key=lambda e: (graph.index(e[1]), graph.index(e[0]))):
        if order.has(p) and order.has(s) and not order.before(p, s):
            out.append(Finding("ORDER", None, (p, s), (order.stream_of[p], order.stream_of[s]),
                               f"{order.where(s)} must run after {order.where(p)} (after=), "
                               f"{order.fix(p, s)}"))
    return out


def _streams(order, a, b):
    return (order.stream_of.get(a), order.stream_of.get(b))


def _races(order, graph) -> list[Finding]:
    per_buffer = defaultdict(list)  # buffer key -> [(start, end, program index, node, mode)]
    for i, node in enumerate(graph.nodes):
        if node.kind in ("alloc", "free") or not order.has(node.name):
            continue  # lifetimes are checked separately
        for acc in node.accesses():
            r = acc.range
            per_buffer[r.buffer.key].append((r.offset, r.end, i, node.name, acc.mode))
    found = {}
    for key, accs in per_buffer.items():
        accs.sort(key=lambda x: x[:3])
        buf = graph.buffer(key[1])
        for i, (s1, e1, p1, n1, m1) in enumerate(accs):
            for j in range(i + 1, len(accs)):  # not accs[i + 1:]: a copy per access is O(n^2)
                s2, e2, p2, n2, m2 = accs[j]
                if s2 >= e1:
                    break
                if n1 == n2 or not (m1.writes or m2.writes):
                    continue
                (a, ma, pa), (b, mb, _) = sorted(((n1, m1, p1), (n2, m2, p2)), key=lambda x: x[2])
                if order.before(a, b) or (buf.name, a, b) in found:
                    continue
                # a stale read is the likelier bug, so write -> read-write counts as RAW
                kind = "RAW" if ma.writes and mb.reads else ("WAW" if ma.writes else "WAR")
                lo, hi = max(s1, s2), min(e1, e2)
                label = "host buffer" if buf.is_host else "buffer"
                found[(buf.name, a, b)] = Finding(
                    ("HOST_" if buf.is_host else "") + kind, buf.name, (a, b), _streams(order, a, b),
                    f"{kind} on {label} {buf.name} bytes [{lo}, {hi}): {order.where(a)} {_VERB[ma]}, "
                    f"{order.where(b)} {_VERB[mb]}, {order.fix(a, b)}")
    return sorted(found.values(), key=lambda f: (graph.index(f.nodes[1]), graph.index(f.nodes[0])))


def _lifetimes(order, graph) -> list[Finding]:
    uses = defaultdict(dict)  # buffer name -> {node name: (kind, mode)} in program order
    for node in graph.nodes:
        if order.has(node.name):
            for acc in node.accesses():
                if not acc.buffer.is_host:
                    uses[acc.buffer.name].setdefault(node.name, (node.kind, acc.mode))
    out = []
    for buf, events in uses.items():
        if not any(k in ("alloc", "free") for k, _ in events.values()):
            continue  # external buffer: bound by the caller, not allocated by the plan
        life = _Life(order, buf, out)
        for n, (kind, mode) in events.items():
            life.step(n, kind, mode)
        if life.live is not None:
            out.append(Finding("NEVER_FREED", buf, (life.live, None), _streams(order, life.live, None),
                               f"buffer {buf} is allocated by {order.where(life.live)} but never "
                               f"freed: add a Free after its last use"))
    return out


class _Life:
    """Walks one buffer's Alloc / uses / Free in program order. Lifetime findings report only
    the frontier: the first uses not ordered after the alloc and the last uses not ordered before
    the free (fixing those orders the rest)."""

    def __init__(self, order, buf, out):
        self.order, self.buf, self.out = order, buf, out
        self.live, self.last_free = None, None
        self.uses, self.unalloc = [], []

    def add(self, kind, a, b, text):
        self.out.append(Finding(kind, self.buf, (a, b), _streams(self.order, a, b), text))

    def step(self, n, kind, mode):
        o, w, buf = self.order, self.order.where, self.buf
        if kind == "alloc":
            if self.live is not None:
                self.add("DOUBLE_ALLOC", self.live, n, f"buffer {buf} is allocated by {w(n)} while "
                         f"still allocated by {w(self.live)}: free it first")
            elif self.last_free is not None and not o.before(self.last_free, n):
                self.add("DOUBLE_ALLOC", self.last_free, n, f"buffer {buf} is allocated again by "
                         f"{w(n)} before its free {w(self.last_free)} is known done, "
                         f"{o.fix(self.last_free, n)}")
            self.live, self.uses, self.unalloc = n, [], []
            return
        verb = "frees" if kind == "free" else _VERB[mode]
        if self.live is None:
            if kind == "free" and self.last_free is not None:
                self.add("DOUBLE_FREE", self.last_free, n, f"double free of buffer {buf}: {w(n)} "
                         f"frees it again after {w(self.last_free)}: remove one Free")
            elif self.last_free is not None:
                self.add("USE_AFTER_FREE", self.last_free, n, f"use after free of buffer {buf}: "
                         f"{w(n)} {verb} it after {w(self.last_free)} freed it: move the Free "
                         f"after the buffer's last use")
            else:
                self.add("USE_BEFORE_ALLOC", n, None, f"{w(n)} {verb} buffer {buf}, but no Alloc "
                         f"precedes it: add an Alloc")
            if kind == "free":
                self.last_free = n
            return
        if not o.before(self.live, n) and not any(o.before(u, n) for u in self.unalloc):
            self.unalloc.append(n)
            self.add("USE_BEFORE_ALLOC", self.live, n, f"use before alloc of buffer {buf}: {w(n)} "
                     f"{verb} it, {o.fix(self.live, n)}")
        if kind != "free":
            self.uses.append((n, mode))
            return
        racing = []
        for u, umode in self.uses:
            if o.before(u, n):
                continue
            if o.before(n, u):
                self.add("USE_AFTER_FREE", n, u, f"use after free of buffer {buf}: {w(u)} "
                         f"{_VERB[umode]} it after {w(n)} frees it: move the Free after the "
                         f"buffer's last use")
            else:
                racing.append((u, umode))
        for u, umode in racing:
            if any(o.before(u, v) for v, _ in racing):
                continue  # a later racing use is reported; ordering it orders this one
            hint = (f" (or put the free on {o.stream_of[u]}, the stream of the buffer's last use)"
                    if o.mode == "plan" and u == self.uses[-1][0] else "")
            self.add("FREE_RACE", u, n, f"free of buffer {buf} not ordered after its use: {w(u)} "
                     f"{_VERB[umode]} it, {w(n)} frees it, {o.fix(u, n)}{hint}")
        self.live, self.last_free, self.uses, self.unalloc = None, n, [], []


def transitive_reduction(order, edges) -> frozenset[tuple[str, str]]:
    """The edges of ``edges`` (pairs of names) that no longer path implies; ``order`` is a
    topological order of every name in them. Bitsets of reachable nodes by topological
    position, so dense graphs of thousands of nodes stay fast."""
    pos = {n: i for i, n in enumerate(order)}
    succs: dict[str, list[str]] = {n: [] for n in order}
    for p, s in edges:
        succs[p].append(s)
    reach: dict[str, int] = {}  # bitset of the nodes reachable from n
    for n in reversed(order):
        r = 0
        for s in succs[n]:
            r |= reach[s] | (1 << pos[s])
        reach[n] = r
    out = set()
    for n in order:
        via = 0
        for s in succs[n]:
            via |= reach[s]
        out.update((n, s) for s in succs[n] if not (via >> pos[s]) & 1)
    return frozenset(out)


# Plan.issue_order as it was (a scan of every stream's head chunk per issued chunk)
def issue_order(self) -> list:
    """Every step as (stream, step) in an order an executor can enqueue them.

    Follows ``order`` (else stream by stream), never putting a wait before the record of its
    event. Raises ValueError when the waits form a cycle (the plan can never be issued).
    """
    rank = {n: i for i, n in enumerate(self.order)}
    chunks = {n: _plan_chunks(self.steps[n]) for n in self.stream_names}
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
            raise ValueError("plan cannot be issued: waits form a cycle (" + "; ".join(blocked) + ")")
        n = best[1]
        chunk, _node = chunks[n][head[n]]
        head[n] += 1
        for st in chunk:
            if isinstance(st, RecordEvent):
                issued_events.add(st.event)
            out.append((n, st))
    return out


# estimate_makespan as it was (every stream's head looked up again per step)
def estimate_makespan(plan, graph, costs=None) -> float:
    """Simulated end time (µs) of ``plan``: each stream in order, waits joined, one node at a time
    per engine, the node that can start first going next."""
    cost = estimate_costs(graph, costs)
    names = plan.stream_names
    t_stream = {n: 0.0 for n in names}
    head = {n: 0 for n in names}
    ev_time: dict[str, float] = {}
    recorded = {st.event for ss in plan.steps.values() for st in ss if isinstance(st, RecordEvent)}
    busy = {r: 0.0 for r in RESOURCES.values()}
    res_of = {node.name: resource_of(node) for node in graph.nodes}
    while True:
        best = None
        woke = False  # an event recorded in this pass (a stream before may wait for it)
        for n in names:
            steps, i, t = plan.steps[n], head[n], t_stream[n]
            while i < len(steps) and not isinstance(steps[i], RunNode):
                st = steps[i]
                if isinstance(st, WaitEvent) and st.event in recorded:
                    if st.event not in ev_time:
                        break
                    t = max(t, ev_time[st.event])
                elif isinstance(st, RecordEvent):
                    ev_time[st.event] = t
                    woke = True
                i += 1
            head[n], t_stream[n] = i, t
            if i < len(steps) and isinstance(steps[i], RunNode):
                node = steps[i].node
                res = res_of[node] if node in res_of else resource_of(graph.node(node))
                start = max(t, busy[res]) if res else t
                if best is None or start < best[0]:
                    best = (start, n, res)
        if best is None:
            if woke:  # walk the streams again: one may wait for what was just recorded (the
                continue  # simulation once stopped here, under the plan's real end)
            return max(t_stream.values(), default=0.0)
        start, n, res = best
        end = start + cost[plan.steps[n][head[n]].node]
        if res:
            busy[res] = end
        t_stream[n] = end
        head[n] += 1


# Plan.__str__ as it was
def plan_text(self) -> str:
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
    for s in self.streams:
        lines.append(f"stream {s.name} (role {s.role}, priority {s.priority}):")
        for st in self.steps[s.name]:
            tag = _TAGS[type(st)]
            text = f"    {tag:<6} {_field(st)}"
            if isinstance(st, WaitEvent):
                text += f"   ({after.get(st.event, 'never recorded')})"
            lines.append(text)
    return "\n".join(lines)


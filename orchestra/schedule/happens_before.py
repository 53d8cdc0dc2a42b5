"""Happens-before over a plan (vector clocks per stream) or over a graph's edges (vector clocks
per chain of a chain cover). Both answer ``before(a, b)`` in O(1) after a near-linear build.

Plan: each stream keeps a clock, one counter per stream (how many of that stream's nodes are known
done). Running a node ticks its own counter and stamps the node with its stream and position;
recording an event snapshots the stream's clock; waiting joins that snapshot (element-wise max).
Then ``a`` happens before ``b`` exactly when ``b``'s stream knew ``a`` when ``b`` ran:
``clock(b)[stream(a)] >= position(a)``. Between two waits a stream's clock changes only in its own
counter, so the nodes run between them share one snapshot of the other counters: building is
O(steps + waits x streams), not O(nodes x streams).

Graph edges: reachability by the same idea with chains of a chain cover instead of streams
(`orchestra.graph.reach.ChainClocks`): O(1) per query, built in about linear time for the shapes
orchestra builds (pipelines, plans' stream shapes, kernel chains) instead of the O(nodes^2)
ancestor bitsets it replaced.
"""

from __future__ import annotations

from typing import Any, Callable

from orchestra.graph.reach import ChainClocks
from orchestra.graph.taskgraph import kahn_order
from orchestra.schedule.finding import Finding
from orchestra.schedule.plan import Plan, RecordEvent, RunNode, WaitEvent


class PlanOrder:
    """Happens-before of the nodes of ``plan``; ``findings`` holds structural problems
    (a node run twice, an event recorded twice or never, waits that can never be issued).

    Thread-safety: made once (in one thread), then only read: its queries may run in several threads
    at once. Tables made on first query are assigned whole, so threads that ask at once at most make
    them twice; ``findings`` is a list filled while it is made: do not modify it.
    """

    mode = "plan"

    def __init__(self, plan: Plan):
        names = plan.stream_names
        self.plan = plan
        self.findings: list[Finding] = []
        self._names = names
        self._sid = {n: i for i, n in enumerate(names)}
        # node -> (index of the stream of its first run, its position on that stream (1-based),
        # its stream's clock when it ran): one table, one lookup per node a query asks about
        self._at: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._extra_runs: dict[str, int] = {}  # node -> runs after its first (a broken plan)
        self.device_of = {s.name: s.device for s in plan.streams}  # stream -> its device
        self._stream_of: dict[str, str] | None = None
        self._runs: dict[str, int] | None = None
        # a plan made by insert_events: the same table by node index, from the steps' codes
        # (`PlanIndex`), and ``_at`` made from it when a query by name first asks
        self._rec: list | None = None
        self._index = None
        index = plan._hint
        if index is None or not self._build_codes(index):
            self._build(plan, names)

    def _table(self) -> dict[str, tuple[int, int, tuple[int, ...]]]:
        """``_at``, made from the table by index when the plan's codes built that one."""
        if self._rec is not None and not self._at:
            assert self._index is not None  # set with _rec
            names = self._index.names
            self._at = {names[v]: r for v, r in enumerate(self._rec) if r is not None}
        return self._at

    def _build_codes(self, index) -> bool:
        """`_build` from the steps' codes (`PlanIndex`: the same steps, ints instead of step
        objects): the table by node index. False, having built nothing, when the waits can
        never all be issued (then `_build` walks the steps and reports it)."""
        codes, n = index.codes, index.n
        S = len(codes)
        R, W = 1 + n, 1 + 2 * n
        cur = [[0] * S for _ in range(S)]
        shared: list[tuple[int, ...] | None] = [None] * S  # as in _build
        snap: list[tuple[int, ...] | None] = [None] * n  # by the event's source node
        rec: list = [None] * n
        head = [0] * S
        while True:
            progress = False
            for s in range(S):
                cs, c = codes[s], cur[s]
                i, end = head[s], len(cs)
                while i < end:
                    x = cs[i]
                    if x < R:  # a run (every node runs once in such a plan)
                        k = c[s] = c[s] + 1
                        clock = shared[s]
                        if clock is None:
                            clock = shared[s] = tuple(c)
                        rec[x - 1] = (s, k, clock)
                    elif x < W:  # a record
                        snap[x - R] = tuple(c)
                    else:  # a wait
                        other = snap[x - W]
                        if other is None:
                            break  # its record is not reached yet: try other streams
                        joined = list(map(max, c, other))
                        if joined != c:
                            c = cur[s] = joined
                            shared[s] = None
                    i += 1
                    progress = True
                head[s] = i
            if all(head[s] == len(codes[s]) for s in range(S)):
                self._rec, self._index = rec, index
                return True
            if not progress:
                return False

    @property
    def stream_of(self) -> dict[str, str]:
        """Node -> the stream of its first run (made on first use: findings read it)."""
        if self._stream_of is None:
            names = self._names
            self._stream_of = {n: names[at[0]] for n, at in self._table().items()}
        return self._stream_of

    @property
    def runs(self) -> dict[str, int]:
        """Node -> how many times the plan runs it (made on first use; `nodes_run` and
        `run_twice` answer what the verifier asks without it)."""
        if self._runs is None:
            runs = dict.fromkeys(self._table(), 1)
            for n, k in self._extra_runs.items():
                runs[n] += k
            self._runs = runs
        return self._runs

    def nodes_run(self):
        """The nodes the plan runs (a view)."""
        return self._table().keys()

    def run_twice(self) -> bool:
        """Whether the plan runs some node more than once."""
        return bool(self._extra_runs)

    def _build(self, plan, names):
        S = len(names)
        records = [[st.event for st in plan.steps[n] if type(st) is RecordEvent] for n in names]
        every = [e for evs in records for e in evs]
        recorded_in_plan = set(every)
        if len(recorded_in_plan) != len(every):  # an event recorded more than once: where
            streams: dict[str, list[str]] = {}
            for n, evs in zip(names, records):
                for e in evs:
                    streams.setdefault(e, []).append(n)
            for ev, where in streams.items():
                if len(where) > 1:
                    self.findings.append(Finding(
                        "EVENT_REUSED", None, (None, None), tuple(where),
                        f"event {ev} is recorded {len(where)} times (on {', '.join(where)}): a "
                        f"plan records each event once; use a new event for each record"))
        cur = [[0] * S for _ in names]
        # cur[s] as a tuple, valid until a wait changes a counter other than s's own: the
        # snapshot every node run in between shares (its own counter there is stale; `before`
        # compares positions on one stream directly)
        shared: list[tuple[int, ...] | None] = [None] * S
        snap: dict[str, tuple[int, ...]] = {}
        head = [0] * S
        steps = [plan.steps[n] for n in names]
        reported_unrecorded = set()
        at, extra = self._at, self._extra_runs
        while True:
            progress = False
            for s in range(S):
                ss, c, name = steps[s], cur[s], names[s]
                i, end = head[s], len(steps[s])
                while i < end:
                    st = ss[i]
                    t = type(st)
                    if t is RunNode:
                        node = st.node
                        k = c[s] = c[s] + 1
                        if node in at:  # run twice: reported by the verifier; the first run
                            extra[node] = extra.get(node, 0) + 1  # defines the order
                        else:
                            clock = shared[s]
                            if clock is None:
                                clock = shared[s] = tuple(c)
                            at[node] = (s, k, clock)
                    elif t is WaitEvent:
                        if st.event in snap:
                            other = snap[st.event]
                            joined = list(map(max, c, other))
                            if joined != c:
                                c = cur[s] = joined
                                shared[s] = None
                        elif st.event in recorded_in_plan:
                            break  # its record has not been reached yet: try other streams
                        elif st.event not in reported_unrecorded:
                            reported_unrecorded.add(st.event)
                            held = _held_up(ss, i)
                            self.findings.append(Finding(
                                "WAIT_UNRECORDED", None, (held, None), (name,),
                                f"stream {name} waits for event {st.event}"
                                + (f" before {held}" if held else "")
                                + f", which no stream records: the wait orders nothing; record "
                                f"{st.event} after the node it should wait for"))
                    else:
                        snap[st.event] = tuple(c)  # a re-record overwrites (reported above)
                    i += 1
                    progress = True
                head[s] = i
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

    def has(self, node: str) -> bool:
        return node in self._table()

    def covers(self, graph) -> bool:
        """True when the plan runs every node of ``graph`` once and no other node (known
        without a table by name for a plan `insert_events` made for ``graph``); False when
        that is not known so (then the verifier looks node by node)."""
        index = self._index
        return (index is not None and index.graph() is graph and len(graph) == index.n
                and not self._extra_runs)

    def by_index(self, graph) -> tuple[Callable[[int, int], bool], list[bool]]:
        """``(before, known)`` by `graph`'s node indices (`TaskGraph.index`): ``before(i, j)``
        is `before` of nodes ``i`` and ``j``; ``known[i]`` whether the plan runs node ``i``.
        For the verifier's passes over every access (a table by index, not by name)."""
        index = self._index
        if index is not None and index.graph() is graph:
            rec = self._rec
            assert rec is not None
            if len(graph) > len(rec):  # nodes added since the plan was made: not run
                rec = rec + [None] * (len(graph) - len(rec))
        else:
            get = self._table().get
            rec = [get(n.name) for n in graph.nodes]
        table: list[Any] = rec  # before() is asked only of nodes the plan runs (known)

        def before(i: int, j: int) -> bool:
            if i == j:
                return False
            sa, pa, _ = table[i]
            sb, pb, kb = table[j]
            if sa == sb:
                return pa < pb
            return kb[sa] >= pa

        return before, [r is not None for r in rec]

    def before(self, a: str, b: str) -> bool:
        """True when node ``a`` finishes before node ``b`` starts in every execution."""
        if a == b:
            return False
        at = self._table()
        sa, pa, _ = at[a]
        sb, pb, kb = at[b]
        if sa == sb:
            return pa < pb
        return kb[sa] >= pa

    def maximal(self, nodes) -> set[str]:
        """The nodes of ``nodes`` that finish before none of the others starts: per stream, the
        highest position any of them runs at or knows of, O(len(nodes) x streams)."""
        at = self._table()
        S = len(self._sid)
        own = [0] * S  # highest position run on each stream
        known = [0] * S  # highest position of each stream known to a node of another stream
        for v in nodes:
            sv, pv, snap = at[v]
            if pv > own[sv]:
                own[sv] = pv
            for s in range(S):
                if s != sv and snap[s] > known[s]:
                    known[s] = snap[s]
        # u (on s) is before another node v exactly when v runs later on s, or v is on another
        # stream that knew u's position when v ran
        out = set()
        for u in nodes:
            su, pu, _ = at[u]
            if not (own[su] > pu or known[su] >= pu):
                out.add(u)
        return out

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
        da, db = self.device_of[sa], self.device_of[sb]
        if da != db:
            return (f"and no event orders {a} before {b} across devices: add a cross-device "
                    f"event, recorded on {sa} (device {da}) after {a} and waited for on {sb} "
                    f"(device {db}) before {b}")
        return (f"and no event orders {a} before {b}: record an event on {sa} after {a} "
                f"and wait for it on {sb} before {b}")


def _held_up(steps, i):
    """The node a wait at ``steps[i]`` holds up: the stream's next `RunNode` (None if none)."""
    return next((st.node for st in steps[i + 1:] if isinstance(st, RunNode)), None)


class GraphOrder:
    """Happens-before from a graph's edges only (what a CUDA graph built from them guarantees).

    ``programmatic``: the edges among ``edges`` that are programmatic; each orders only when
    ``waits(consumer)`` is true (default: never), see `orchestra.schedule.verify`.

    Thread-safety: made once (in one thread), then only read: its queries may run in several threads
    at once. Tables made on first query are assigned whole, so threads that ask at once at most make
    them twice; ``findings`` is a list filled while it is made: do not modify it.
    """

    mode = "graph"

    def __init__(self, graph, edges=None, *, programmatic=(), waits=None):
        edges = graph.edges if edges is None else frozenset(edges)
        # a programmatic edge whose consumer does not wait on its grid dependency orders nothing
        self.unordered = frozenset(e for e in programmatic
                                   if e in edges and not (waits is not None and waits(e[1])))
        if self.unordered:
            edges = edges - self.unordered
        names = [n.name for n in graph.nodes]
        preds: dict[str, list[str]] = {n: [] for n in names}
        succs: dict[str, list[str]] = {n: [] for n in names}
        for p, s in edges:
            preds[s].append(p)
            succs[p].append(s)
        self.findings: list[Finding] = []
        self.stream_of = {n: None for n in names}
        self.runs = {n: 1 for n in names}
        # the earliest in program order first: chains follow program order where edges allow
        order = kahn_order(names, edges)
        self._reach = ChainClocks(order, preds, succs)
        stuck = [n for n in names if n not in self._reach]
        if stuck:
            self.findings.append(Finding("DEADLOCK", None, tuple(stuck[:2]), (None, None),
                                         "the edges form a cycle through: " + ", ".join(stuck)))
            for n in stuck:  # ordered with nothing
                self._reach.add_isolated(n)
        self.before = self._reach.reaches  # a reaches b: a finishes before b starts

    def has(self, node: str) -> bool:
        return node in self._reach.chain

    def by_index(self, graph) -> tuple[Callable[[int, int], bool], list[bool]]:
        """As `PlanOrder.by_index`."""
        names = [n.name for n in graph.nodes]
        reaches, chain = self._reach.reaches, self._reach.chain
        return (lambda i, j: reaches(names[i], names[j])), [n in chain for n in names]

    def maximal(self, nodes) -> set[str]:
        """The nodes of ``nodes`` that reach none of the others (`ChainClocks.maximal`)."""
        return self._reach.maximal(nodes)

    def where(self, node: str) -> str:
        return node

    def fix(self, a: str, b: str) -> str:
        if self.before(b, a):
            return f"but the edges order {b} before {a} (the reverse of program order)"
        if (a, b) in self.unordered:
            return (f"and the programmatic edge {a} -> {b} orders nothing: {b} never executes "
                    f"griddepcontrol.wait (cudaGridDependencySynchronize), so it may run beside "
                    f"{a}; make it wait before it touches what {a} writes, or use a full edge")
        return f"and no path of graph edges orders {a} before {b}: add an edge from {a} to {b}"

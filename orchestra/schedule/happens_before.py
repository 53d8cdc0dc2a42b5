"""Happens-before over a plan (vector clocks) or over a graph's edges (reachability bitsets).

Plan: each stream keeps a clock, one counter per stream (how many of that stream's nodes are known
done). Running a node ticks its own counter and stamps the node; recording an event snapshots the
stream's clock; waiting joins that snapshot (element-wise max). Then ``a`` happens before ``b``
exactly when ``b``'s stamp counts ``a``: ``clock[b][stream(a)] >= position(a)``. Building is
O(steps x streams); each query is O(1).
"""

from __future__ import annotations

from orchestra.schedule.finding import Finding
from orchestra.schedule.plan import Plan, RecordEvent, RunNode, WaitEvent


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
    """Happens-before from a graph's edges only (what a CUDA graph built from them guarantees).

    ``programmatic``: the edges among ``edges`` that are programmatic; each orders only when
    ``waits(consumer)`` is true (default: never), see `orchestra.schedule.verify`."""

    mode = "graph"

    def __init__(self, graph, edges=None, *, programmatic=(), waits=None):
        edges = graph.edges if edges is None else frozenset(edges)
        # a programmatic edge whose consumer does not wait on its grid dependency orders nothing
        self.unordered = frozenset(e for e in programmatic
                                   if e in edges and not (waits is not None and waits(e[1])))
        if self.unordered:
            edges = edges - self.unordered
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
        if (a, b) in self.unordered:
            return (f"and the programmatic edge {a} -> {b} orders nothing: {b} never executes "
                    f"griddepcontrol.wait (cudaGridDependencySynchronize), so it may run beside "
                    f"{a}; make it wait before it touches what {a} writes, or use a full edge")
        return f"and no path of graph edges orders {a} before {b}: add an edge from {a} to {b}"

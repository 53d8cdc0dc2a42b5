"""Hazard verifier: does a plan (or a graph's edges) order everything the program needs?

It checks, against happens-before (`happens_before`):
- data races: every pair of accesses to overlapping bytes of one buffer, at least one a write,
  must be ordered the way program (insertion) order has them: RAW, WAR, WAW; on host buffers the
  kinds are HOST_RAW/HOST_WAR/HOST_WAW (a host array reused before a copy is known done);
- lifetimes of device buffers with Alloc/Free nodes: use before alloc, use after free, a free not
  ordered after every use (FREE_RACE), double free, alloc while still allocated, never freed.
  A buffer with neither an Alloc nor a Free is external (bound at run time) and only race-checked;
- ``after=`` edges; and plan structure: nodes missing, run twice, unknown; events recorded twice
  or never; waits that can never be issued; a node on a stream of another device than its own
  (WRONG_DEVICE).
Devices: streams belong to devices (`StreamSpec.device`), and happens-before is the same across
them (an event recorded on one device's stream orders what waits for it on another's), so a
race between nodes on two devices is found like any other; its message names the cross-device
event to add.
The plan ends with all streams synchronized, so D2H results are the caller's at the end; that needs
no check. Races are found against a per-buffer frontier of byte ranges (`races`), lifetimes by one
walk per buffer, so a correct plan costs about linear time in nodes x accesses.

Bodies (task graphs a node runs as a unit: conditional branches and loop bodies, child graphs)
are seen through: the node holding them accesses what they touch as a whole (so it is checked
like any node, and happens-before runs through it), and each body is verified on its own edges
(`verify_graph_edges`, recursively: the order every executor gives a body at least), its
findings saying which body. A loop body runs to completion before its next iteration, so no
hazard crosses iterations.

Programmatic edges (`verify_graph_edges(..., programmatic=, waits=)`): a programmatic edge
p -> c lets kernel c start before kernel p completes; c's ``griddepcontrol.wait`` then waits
until p has completed and its memory is visible. The model: such an edge orders c after p
(everything c accesses, and everything ordered after c) exactly when c waits on its grid
dependency, under the kernel author's contract that c touches what depends on p only after
its wait; when c does not wait it orders nothing (c may run entirely beside p).
"""

from __future__ import annotations

from orchestra.errors import HazardError, ScheduleArgumentTypeError
from orchestra.graph import Alloc, Free, TaskGraph
from orchestra.graph.collector import paused
from orchestra.schedule.devices import graph_devices
from orchestra.schedule.finding import Finding
from orchestra.schedule.happens_before import GraphOrder, PlanOrder
from orchestra.schedule.plan import Plan
from orchestra.schedule.races import _LIFETIME_KINDS, VERB, accesses_by_buffer, by_node, races


def verify(plan: Plan, graph: TaskGraph) -> list[Finding]:
    """Every hazard of running ``plan`` for ``graph`` (and inside its nodes' bodies); an empty
    list means none was found. `ScheduleArgumentTypeError` when ``plan`` is not a `Plan` or
    ``graph`` not a `TaskGraph` (the arguments swapped, say)."""
    if not isinstance(plan, Plan) or not isinstance(graph, TaskGraph):
        raise ScheduleArgumentTypeError(
            f"verify(plan, graph) needs a Plan and a TaskGraph, in that order; got "
            f"{type(plan).__name__} and {type(graph).__name__}")
    with paused():  # no cycles made: the collector's passes over the graph would find nothing
        return _verify(plan, graph)


def _verify(plan: Plan, graph: TaskGraph) -> list[Finding]:
    order = PlanOrder(plan)
    findings = list(order.findings)
    if order.covers(graph):  # every node of the graph run once, no other: nothing to report
        return findings + _devices(plan, graph, order) + _hazards(order, graph) + \
            body_findings(graph)
    ran = order.nodes_run()
    # the usual plan runs every node of the graph once: two passes in C say so
    unknown = ran - graph.node_map().keys()
    if unknown:
        for n in plan.node_stream:
            if n in unknown:
                findings.append(Finding("UNKNOWN_NODE", None, (n, None),
                                        (plan.node_stream[n], None),
                                        f"the plan runs {n} on stream {plan.node_stream[n]}, but "
                                        f"the graph has no node named {n}"))
    if len(ran) - len(unknown) == len(graph) and not order.run_twice():
        nodes: tuple = ()  # every node run, none twice
    else:
        nodes = graph.nodes
    for node in nodes:
        n = node.name
        if n not in order.runs:
            findings.append(Finding("MISSING", None, (n, None), (None, None),
                                    f"{n} is in the graph but the plan never runs it: add it to a "
                                    f"stream after its predecessors"))
        elif order.runs[n] > 1:
            buffer = node.buffer.name if isinstance(node, (Alloc, Free)) else None
            kind = "DOUBLE_FREE" if node.kind == "free" else "DUPLICATE"
            what = f" (each run frees {buffer} again)" if node.kind == "free" else ""
            findings.append(Finding(kind, buffer,
                                    (n, None), (order.stream_of[n], None),
                                    f"the plan runs {n} {order.runs[n]} times{what}: run each node once"))
    findings += _devices(plan, graph, order)
    findings += _hazards(order, graph)
    return findings + body_findings(graph)


def _devices(plan: Plan, graph: TaskGraph, order) -> list[Finding]:
    """WRONG_DEVICE: a device-bound node on a stream of another device. A plan whose streams all
    say device 0 for a graph on one device is device-agnostic (its executor runs its streams on
    that device), so only plans over several devices, or naming one, are checked."""
    if set(plan.devices) == {0} and len(graph_devices(graph)) <= 1:
        return []
    out = []
    for node in graph.nodes:
        s = order.stream_of.get(node.name)
        if s is None or not node.device_bound:
            continue
        d = order.device_of[s]
        if d != node.device:
            out.append(Finding("WRONG_DEVICE", None, (node.name, None), (s, None),
                               f"{node.name} runs on device {node.device}, but the plan puts it "
                               f"on stream {s} of device {d}: run it on a stream of device "
                               f"{node.device}"))
    return out


def verify_graph_edges(graph: TaskGraph, edges=None, *, programmatic=(),
                       waits=None) -> list[Finding]:
    """Hazards when only ``edges`` (default: the graph's own) order the nodes, as in a CUDA
    graph built from them; pass e.g. ``graph.reduced_edges()`` or hand-picked edges. Bodies are
    verified on their own edges (see the module doc).

    ``programmatic``: the ``(producer, consumer)`` edges of ``edges`` that are programmatic;
    ``waits(consumer)`` says whether the consumer kernel executes ``griddepcontrol.wait``
    (default None: no consumer is known to wait, so programmatic edges order nothing). A
    programmatic edge orders only where its consumer waits (the module doc's model)."""
    with paused():  # as in verify
        order = GraphOrder(graph, edges, programmatic=programmatic, waits=waits)
        return list(order.findings) + _hazards(order, graph) + body_findings(graph)


def body_findings(graph: TaskGraph) -> list[Finding]:
    """The findings of every body of ``graph``'s nodes, each verified on its own edges
    (recursively), the message naming the body."""
    out: list[Finding] = []
    if not graph._may_have_bodies():
        return out
    for node in graph.nodes:
        for i, body in enumerate(node.bodies):
            which = (f"body {i} of {node.name}" if len(node.bodies) > 1
                     else f"the body of {node.name}")
            for f in verify_graph_edges(body):
                out.append(Finding(f.kind, f.buffer, f.nodes, f.streams,
                                   f"in {which}: {f.message}"))
    return out


def check(plan: Plan, graph: TaskGraph) -> None:
    """Raise `HazardError` listing every finding of `verify` (nothing is enqueued then)."""
    findings = verify(plan, graph)
    if findings:
        raise HazardError(findings)


def _hazards(order, graph) -> list[Finding]:
    collected = accesses_by_buffer(order, graph)
    out = races(order, graph, collected)
    out += _lifetimes(order, graph, collected)
    # the explicit (after=) edges, by (successor, predecessor) program order: each node's
    # after= names that are its predecessors (the others still wait for a node: no edge)
    before, known = collected[2], collected[3]
    nodes, back = graph._by_index()
    for v, node in enumerate(nodes):
        after = node.after
        if not after or not known[v]:
            continue
        preds = {nodes[v - d].name: v - d for d in back[v]}
        for p in sorted({preds[a] for a in after if a in preds}):
            if known[p] and not before(p, v):
                a, b = nodes[p].name, node.name
                out.append(Finding("ORDER", None, (a, b), (order.stream_of[a],
                                                           order.stream_of[b]),
                                   f"{order.where(b)} must run after {order.where(a)} "
                                   f"(after=), {order.fix(a, b)}"))
    return out


def _streams(order, a, b):
    return (order.stream_of.get(a), order.stream_of.get(b))


def _lifetimes(order, graph, collected=None) -> list[Finding]:
    per_buffer, _, before, _ = collected or accesses_by_buffer(order, graph)
    out: list[Finding] = []
    nodes = graph.nodes
    for entry in per_buffer.values():  # one buffer at a time, in order of first use
        buf, idx, accs, _ = by_node(entry)
        if buf.is_host or not any(nodes[v].kind in _LIFETIME_KINDS for v in idx):
            continue  # external buffer: bound by the caller, not allocated by the plan
        life = _Life(order, buf.name, out, nodes, before)
        seen = -1
        for v, acc in zip(idx, accs):
            if v != seen:  # a node's first access to the buffer stands for all of them
                seen = v
                life.step(v, nodes[v].kind, acc.mode)
        if life.live is not None:
            live = nodes[life.live].name
            out.append(Finding("NEVER_FREED", buf.name, (live, None),
                               _streams(order, live, None),
                               f"buffer {buf.name} is allocated by {order.where(live)} but "
                               f"never freed: add a Free after its last use"))
    return out


class _Life:
    """Walks one buffer's Alloc / uses / Free in program order, by node index (``before``:
    the order by index; findings name the nodes). Lifetime findings report only the frontier:
    the first uses not ordered after the alloc and the last uses not ordered before the free
    (fixing those orders the rest)."""

    def __init__(self, order, buf, out, nodes, before):
        self.order, self.buf, self.out, self.nodes, self.before = order, buf, out, nodes, before
        self.live, self.last_free = None, None
        self.uses, self.unalloc = [], []

    def add(self, kind, a, b, text):
        a = self.nodes[a].name
        b = self.nodes[b].name if b is not None else None
        self.out.append(Finding(kind, self.buf, (a, b), _streams(self.order, a, b), text))

    def _where(self, v):
        return self.order.where(self.nodes[v].name)

    def _fix(self, a, b):
        return self.order.fix(self.nodes[a].name, self.nodes[b].name)

    def step(self, n, kind, mode):
        o, buf, before, nodes = self.order, self.buf, self.before, self.nodes
        w, fix = self._where, self._fix
        if kind == "alloc":
            if self.live is not None:
                self.add("DOUBLE_ALLOC", self.live, n, f"buffer {buf} is allocated by {w(n)} while "
                         f"still allocated by {w(self.live)}: free it first")
            elif self.last_free is not None and not before(self.last_free, n):
                self.add("DOUBLE_ALLOC", self.last_free, n, f"buffer {buf} is allocated again by "
                         f"{w(n)} before its free {w(self.last_free)} is known done, "
                         f"{fix(self.last_free, n)}")
            self.live, self.uses, self.unalloc = n, [], []
            return
        verb = "frees" if kind == "free" else VERB[mode]
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
        if not before(self.live, n) and not any(before(u, n) for u in self.unalloc):
            self.unalloc.append(n)
            self.add("USE_BEFORE_ALLOC", self.live, n, f"use before alloc of buffer {buf}: {w(n)} "
                     f"{verb} it, {fix(self.live, n)}")
        if kind != "free":
            self.uses.append((n, mode))
            return
        racing = []
        for u, umode in self.uses:
            if before(u, n):
                continue
            if before(n, u):
                self.add("USE_AFTER_FREE", n, u, f"use after free of buffer {buf}: {w(u)} "
                         f"{VERB[umode]} it after {w(n)} frees it: move the Free after the "
                         f"buffer's last use")
            else:
                racing.append((u, umode))
        if len(racing) > 1:
            last_names = o.maximal([nodes[u].name for u, _ in racing])
            last = {u for u, _ in racing if nodes[u].name in last_names}
        else:
            last = {u for u, _ in racing}
        for u, umode in racing:
            if u not in last:
                continue  # a later racing use is reported; ordering it orders this one
            hint = (f" (or put the free on {o.stream_of[nodes[u].name]}, the stream of the "
                    f"buffer's last use)" if o.mode == "plan" and u == self.uses[-1][0] else "")
            self.add("FREE_RACE", u, n, f"free of buffer {buf} not ordered after its use: {w(u)} "
                     f"{VERB[umode]} it, {w(n)} frees it, {fix(u, n)}{hint}")
        self.live, self.last_free, self.uses, self.unalloc = None, n, [], []

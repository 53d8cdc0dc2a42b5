"""Body graphs: task graphs a node holds and runs as one unit (a conditional node's branches or
loop body, a child graph). Pure Python.

A node with bodies (``node.bodies``, a tuple of `TaskGraph`; empty for most kinds) is one node
of its graph: it accesses, as a whole, every byte range its bodies touch (`body_accesses`), so
the edges inferred around it, the hazard verifier and the scheduler treat it like any other
node, and happens-before runs through it (whatever precedes it precedes every body node, every
body node precedes whatever follows it). Inside, each body is a task graph of its own, with its
own inferred edges.

`walk` visits every node of a graph and of the bodies in it, depth first. `check_bodies` (run by
`TaskGraph.validate` for graphs with bodies or conditions) checks what the executors rely on:

- node names are unique across a graph and every body in it (executors key nodes by name), and
  no body holds, directly or not, the graph it is in;
- every body is valid (no cycle, no ``after=`` naming a missing node);
- conditions (`Condition`): each is tested by exactly one node (the driver associates a
  conditional handle with a single conditional node); the kernels that set it are in that
  node's graph, before it, or in its bodies (at any depth): the handle belongs to the graph
  holding the node; a condition with a default is not also set before its node.
"""

from __future__ import annotations

from itertools import repeat

from collections.abc import Iterator
from typing import Any

from orchestra.errors import GraphError, NameCollisionError
from orchestra.graph.buffers import Access, Condition, Mode


def body_accesses(bodies) -> tuple[Access, ...]:
    """What a node holding ``bodies`` accesses as a whole: every byte range a node of a body
    touches, in first-use order, READ where the bodies only read it and READ_WRITE where a
    body node writes it (a body may run or not, once or many times, so from outside its writes
    are read-modify-writes: what follows sees the old bytes or new ones)."""
    modes: dict = {}  # (buffer key, offset, nbytes) -> [range, writes]
    for body in bodies:
        for node in body.nodes:
            for acc in node.accesses():
                r = acc.range
                key = (r.buffer.key, r.offset, r.nbytes)
                entry = modes.get(key)
                if entry is None:
                    modes[key] = [r, acc.mode.writes]
                elif acc.mode.writes:
                    entry[1] = True
    return tuple(Access(r, Mode.READ_WRITE if writes else Mode.READ)
                 for r, writes in modes.values())


def walk(graph, containers: tuple = ()) -> Iterator[tuple]:
    """``(node, containers)`` for every node of ``graph`` and of the bodies in it, depth first
    (a node, then its bodies' nodes, then the next node); ``containers`` is the chain of nodes
    holding it, outermost first (empty at the top). `GraphError` for a body that holds the
    graph it is in."""
    yield from _walk(graph, tuple(containers), frozenset({id(graph)}))


def _walk(graph, chain: tuple, seen: frozenset) -> Iterator[tuple]:
    if not getattr(graph, "_control", True):
        # no node of it has bodies (TaskGraph.add sets _control for one that has): the nodes
        # alone, without asking each for its bodies (a long pipeline has hundreds of thousands)
        yield from zip(graph.nodes, repeat(chain))
        return
    for node in graph.nodes:
        yield node, chain
        for body in node.bodies:
            if id(body) in seen:
                raise GraphError(f"node {node.name}: a body of it holds the graph it is in; "
                                 "a body must be a separate TaskGraph")
            yield from _walk(body, chain + (node,), seen | {id(body)})


def container_of(graph) -> dict:
    """Node name -> the name of the node whose body holds it (None at the top level), for
    every node of ``graph`` and its bodies."""
    return {node.name: (chain[-1].name if chain else None) for node, chain in walk(graph)}


def _where(chain) -> str:
    return f"the body of {chain[-1].name}" if chain else "the graph"


def check_bodies(graph) -> None:
    """The checks of the module doc; `GraphError` (`NameCollisionError` for a name used twice)
    naming the nodes and the condition concerned."""
    first: dict[str, tuple] = {}  # node name -> its chain
    testers: dict[str, tuple] = {}  # condition name -> (node, chain, graph)
    setters: list[tuple] = []  # (node, chain, condition)
    graph_of: dict[str, Any] = {}  # node name -> the TaskGraph it is in
    for node, chain in walk(graph):
        name = node.name
        if name in first:
            raise NameCollisionError(
                f"node name {name!r} is used in {_where(first[name])} and in {_where(chain)}; "
                "node names must be unique across a graph and its bodies")
        first[name] = chain
        for body in node.bodies:
            body.validate(bodies=False)  # its own bodies come in this walk
            for n in body.nodes:
                graph_of[n.name] = body
        tested = node.tests
        if tested is not None:
            if tested.name in testers:
                other = testers[tested.name][0]
                raise GraphError(
                    f"condition {tested.name} is tested by {other.name} and by {name}; the "
                    "driver associates a conditional handle with a single conditional node: "
                    "give each node its own Condition")
            testers[tested.name] = (node, chain)
        if not node.bodies:
            for acc in node.accesses():
                if isinstance(acc.buffer, Condition) and acc.mode.writes:
                    setters.append((node, chain, acc.buffer))
    for n in graph.nodes:
        graph_of.setdefault(n.name, graph)
    for node, chain, cond in setters:
        found = testers.get(cond.name)
        if found is None:
            raise GraphError(f"kernel {node.name} sets condition {cond.name}, but no conditional "
                             "node tests it: add the If / While / Switch that reads it")
        tester, tchain = found
        if any(c is tester for c in chain):
            continue  # inside the tester's bodies: sets it for the next test (a loop body)
        if tchain != chain:
            raise GraphError(
                f"kernel {node.name} sets condition {cond.name} from {_where(chain)}, but "
                f"{tester.name} tests it in {_where(tchain)}: the handle belongs to the graph "
                f"holding {tester.name}; set it there (before {tester.name}) or in its bodies")
        g = graph_of[tester.name]
        if g.index(node.name) > g.index(tester.name):
            raise GraphError(f"kernel {node.name} sets condition {cond.name} after "
                             f"{tester.name} tests it; set it before (or in its bodies)")
        if cond.default is not None:
            raise GraphError(
                f"condition {cond.name} has a default ({cond.default}) and kernel {node.name} "
                f"also sets it before {tester.name}: give it one or the other (with a setter "
                "before the node, use no default)")


__all__ = ["body_accesses", "check_bodies", "container_of", "walk"]

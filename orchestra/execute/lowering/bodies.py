"""Lowering the bodies of a node (a conditional node's branches, a child graph): what an entry
of a kind with bodies calls, on both contexts.

Streams (eager and capture, `StreamContext`):

- `lower_body(ctx, body, stream, container)`: the body's steps (one driver call each, made by
  each body node's entry) on ``stream``, in the body's topological order. The eager executor
  runs them right on the node's own stream when the node's step decides to; in a capture they
  go on a side stream that captures into the body graph (`capture_body`). The steps share the
  run's address slots, kernel resolutions and handles; in a capture every body node gets an
  inner `NodeRecord` (``built.inner``) and its binding users are `InnerUser`s, which replays do
  not rewrite (see below).
- `capture_body(ctx, body, steps, stream, cugraph)`: inside a capture, make what the body's
  nodes need on the body graph (`begin_graph`), then capture ``steps`` from ``stream`` into
  ``cugraph`` (`orchestra.driver.capture.CaptureToGraph`, relaxed mode: the thread's own
  capture already guards it).
- `side_stream(ctx)`: the stream a node's bodies are captured from: one per nesting depth, from
  the executor's pool, never a stream of the plan.

Explicit builds (`GraphContext`):

- `build_body(ctx, body, cugraph, container)`: add the body's nodes to ``cugraph`` (a body graph
  the driver made, or a child graph's embedded graph) through their entries, each after its
  dependencies in the body (its transitively reduced edges), after `begin_graph`.

`begin_graph(nodes, ctx, cugraph)` calls every entry's ``begin_graph`` hook (conditional
handles are made there, on the graph that will hold the conditional node).

What can change after instantiation: nodes inside bodies are not updated node by node (the
driver updates a body's nodes in a whole-graph update, ``cuGraphExecUpdate``, under the same
rules as other nodes, but orchestra does not address them one by one): a replay that would
rewrite one (a host array or scalar used inside a body) is refused before any call, naming the
node; `GraphExec.update` rebuilds and updates the whole graph, bodies included.
"""

from __future__ import annotations

from orchestra.driver.capture import CaptureToGraph
from orchestra.errors import OrchestraError
from orchestra.execute.bindings import BindingUser
from orchestra.execute.lowering.table import lowering_for


class InnerUser(BindingUser):
    """A binding user (`BindingUser`) whose node is inside the body of node ``inside``: the
    build writes it like any other; replays refuse to rewrite it (see the module doc).

    Thread-safety: not thread-safe: a mutable record of a `BindingTable`, changed only by its table,
    under the lock of the table's owner (an executor, a `GraphExec`).
    """

    __slots__ = ("inside",)

    def __init__(self, record, params, field: str, offset: int, inside: str):
        super().__init__(record, params, field, offset)
        self.inside = inside


def begin_graph(nodes, ctx, cugraph) -> None:
    """Every entry's ``begin_graph`` hook for ``nodes`` (of the graph ``cugraph`` will hold)."""
    for node in nodes:
        lowering_for(node).begin_graph(node, ctx, cugraph)


def body_order(body) -> list:
    """``[(node, [names of its dependencies])]`` for ``body``: topological order (ties: program
    order), dependencies from its transitively reduced edges."""
    order = body.topological_order()
    preds: dict[str, list[str]] = {n: [] for n in order}
    for p, s in body.reduced_edges():
        preds[s].append(p)
    pos = {n: i for i, n in enumerate(order)}
    return [(body.node(n), sorted(preds[n], key=pos.__getitem__)) for n in order]


# -- streams --------------------------------------------------------------------------------


def side_stream(ctx):
    """The stream ``ctx``'s node captures its bodies from (one per depth, pooled); `OrchestraError`
    outside a capture."""
    if ctx.side_streams is None:
        raise OrchestraError("side streams exist only inside a capture")
    return ctx.side_streams(ctx.depth + 1)


def lower_body(ctx, body, stream, container: str) -> list:
    """The steps of ``body`` on ``stream`` (see the module doc); ``container``: the node whose
    body it is."""
    sub = ctx.sub(container)
    built = ctx.built
    steps = []
    for node, _ in body_order(body):
        entry = lowering_for(node)
        if built is not None:  # capture: every body node gets its (inner) record, of the kind
            # it becomes (a host copy lowered to a copy kernel is a kernel node)
            built.inner_record(node.name, entry.graph_node_of(node, ctx.copies), container)
        steps.append(entry.stream(node, sub, stream))
    return steps


def capture_body(ctx, body, steps, stream, cugraph) -> None:
    """Capture ``steps`` (`lower_body` on ``stream``) into ``cugraph``, the body graph of
    ``body``, after `begin_graph` for its nodes."""
    begin_graph(body.nodes, ctx, cugraph)
    with CaptureToGraph(stream, cugraph, "relaxed", ctx.api):
        for step in steps:
            step()


# -- explicit builds ------------------------------------------------------------------------


def build_body(ctx, body, cugraph, container: str) -> list:
    """Add ``body``'s nodes to ``cugraph`` (see the module doc); returns their records."""
    sub = ctx.sub(cugraph, container)
    begin_graph(body.nodes, sub, cugraph)
    tail: dict[str, object] = {}
    records = []
    for node, deps in body_order(body):
        rec = lowering_for(node).graph(node, sub, [tail[d] for d in deps])
        tail[node.name] = rec.gnode
        records.append(rec)
    return records


__all__ = ["InnerUser", "begin_graph", "body_order", "build_body", "capture_body",
           "lower_body", "side_stream"]

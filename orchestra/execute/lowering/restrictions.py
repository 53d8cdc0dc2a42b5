"""What the driver allows inside a body graph, checked before any CUDA call (pure Python).

Each rule lists the CUDA graph node kinds (a lowering's ``graph_node``) a body may hold; every
node of the body, at any depth (nested bodies and child graphs included: the driver applies the
rules recursively), must be of one of them, or `BodyRestrictionError` names it:

- `CONDITIONAL_BODY`: kernel, memcpy, memset, child-graph and conditional nodes (and empty
  ones) only (CUDA Programming Guide, "Conditional Node Body Graph Requirements";
  ``CUDA_CONDITIONAL_NODE_PARAMS``): no host functions, no event record / wait nodes, no graph
  memory (alloc / free) nodes. Copies there may use only device memory or pinned host memory
  (pageable memory is refused by orchestra everywhere, see `orchestra.execute.bindings`);
  kernels there may not use dynamic parallelism or device graph launch (orchestra launches
  neither). Tracing adds event nodes around a conditional node, never inside its bodies.
- `CHILD_GRAPH`: no graph memory nodes (``cuGraphChildGraphNodeGetGraph``: "Allocation and free
  nodes cannot be added to the returned graph") and no conditional nodes
  (``CUDA_CHILD_GRAPH_NODE_PARAMS``: "The graph must not contain conditional nodes").

Every executor checks the rules, the eager one too (it runs bodies on the host's say-so and
could run anything), so a graph that runs eagerly also builds as a CUDA graph.
"""

from __future__ import annotations

import attrs

from orchestra.errors import GraphError
from orchestra.execute.lowering.table import lowering_for
from orchestra.graph.bodies import walk


class BodyRestrictionError(GraphError, ValueError):
    """A body graph holds a node the driver does not allow there (``node``: its name,
    ``container``: the node holding the body). Raised before any CUDA call."""

    def __init__(self, message: str, node: str = "", container: str = ""):
        self.node = node
        self.container = container
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.node, self.container))


@attrs.frozen
class BodyRule:
    """``what`` (how messages name the body), ``allowed`` (CUDA graph node kinds), ``source``
    (the documentation the rule comes from).

    Immutable: may be shared between threads freely.
    """

    what: str
    allowed: frozenset
    source: str


CONDITIONAL_BODY = BodyRule(
    "a conditional node's body",
    frozenset({"kernel", "memcpy", "memset", "graph", "conditional", "empty"}),
    "CUDA Programming Guide, Conditional Node Body Graph Requirements")
CHILD_GRAPH = BodyRule(
    "a child graph",
    frozenset({"kernel", "memcpy", "memset", "graph", "host", "empty", "event_record",
               "wait_event"}),
    "cuGraphChildGraphNodeGetGraph / CUDA_CHILD_GRAPH_NODE_PARAMS")

_NAMES = {"mem_alloc": "graph memory allocation (Alloc)", "mem_free": "graph memory free (Free)",
          "host": "host function", "conditional": "conditional", "kernel": "kernel",
          "memcpy": "memcpy", "memset": "memset", "graph": "child graph"}


def check_body(container, rule: BodyRule) -> None:
    """Every node in the bodies of ``container`` (at any depth) is of a kind ``rule`` allows;
    else `BodyRestrictionError` naming the node, its kind and the container."""
    allowed = ", ".join(sorted(_NAMES.get(k, k.replace("_", " ")) for k in rule.allowed
                               if k != "empty"))
    for body in container.bodies:
        for node, chain in walk(body):
            kind = lowering_for(node).graph_node
            if kind not in rule.allowed:
                where = (f"the body of {chain[-1].name}, inside {container.name}" if chain
                         else f"the body of {container.name}")
                raise BodyRestrictionError(
                    f"node {node.name} ({type(node).__name__}: a "
                    f"{_NAMES.get(kind or '', kind)} node) cannot be in {where}: "
                    f"{rule.what} may hold only {allowed} nodes ({rule.source}); move it "
                    f"out of the body, before or after {container.name}",
                    node.name, container.name)


__all__ = ["BodyRestrictionError", "BodyRule", "CHILD_GRAPH", "CONDITIONAL_BODY", "check_body"]

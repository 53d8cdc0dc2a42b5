"""The lowering table: per node kind, one `Lowering` that knows how it runs on CUDA.

Every executor lowers every node through the entry registered for the node's class, and only
through it (`lowering_for`); no executor names a node kind. An entry says:

- ``stream(node, ctx, stream)``: the step (a callable making one driver call) that enqueues
  the node on a stream. The eager executor calls the steps on every run, the capture executor
  calls them once inside a stream capture: one code path for both (``ctx.capture`` tells an
  entry to also record the graph node's parameter struct, which replays rewrite);
- ``graph(node, ctx, deps)``: add the node to a CUDA graph (graph-build), returning its
  `NodeRecord`;
- ``resolve(node, executor)``: per-node work before any CUDA call (a kernel is compiled,
  loaded, its arguments checked and packed); its result is ``ctx.resolved[node.name]``
  (every node is resolved, the nodes of bodies too). The executors call
  ``resolve_with(node, executor, copies)``, which is ``resolve`` unless an entry needs the
  build's `CopyPolicy` (``copies``: the host copies, which may become copy kernels);
- ``begin_graph(node, ctx, cugraph)``: what the node needs made on the CUDA graph that will
  hold it before any node of that graph is added or captured (a conditional node's handle,
  which kernels before it take as an argument); ``ctx.handles`` keeps what it made. The
  executors call it for every node of a graph (and `lowering.bodies` for every body) once
  the ``CUgraph`` exists;
- ``graph_node`` / ``driver_node_type``: the CUDA graph node kind it becomes (what
  `cuda_graph.spec.translate` gives and ``cuGraphNodeGetType`` reports); an entry whose node
  can become one of several kinds says which with ``graph_node_of(node, copies)`` (a host
  copy: ``"memcpy"``, or ``"kernel"`` when lowered to a copy kernel);
- ``replay_params``: the parameter struct a replay rewrites (``CUDA_MEMCPY3D`` for copies,
  ``CUDA_KERNEL_NODE_PARAMS`` for kernels), with the entry registering every field a binding
  writes (``ctx.use``);
- ``captures_one_node``: whether capturing the stream step adds exactly one graph node (False
  for NCCL calls, which may add several; replays never rewrite those);
- ``engine``: the node class's engine (upload, download, compute, memory, host), which the
  scheduler places nodes by and the trace colours them by; ``on_device``: whether the node
  runs on the executor's device (a host function does not).

Adding a node kind: its record class in `orchestra.graph.nodes`, one module here with its
`Lowering` subclass decorated with `register`, and that module's import in this package's
``__init__``. The contexts an entry receives: `lowering.stream.StreamContext` and
`lowering.graph.GraphContext`; a kind with bodies lowers them with `lowering.bodies`
(``lower_body`` onto a stream, ``capture_body`` into a body graph inside a capture,
``build_body`` into a body graph of an explicit build) and checks them with
`lowering.restrictions`.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from orchestra.errors import GraphError
from orchestra.graph import Node

LOWERINGS: dict[type, "Lowering"] = {}


class NoLoweringError(GraphError):
    """A node's class has no entry in the lowering table: no executor can run it. Raised
    before any CUDA call."""


class Lowering:
    """Base of every entry (see the module doc). Subclasses set ``node_type`` and the class
    attributes, and override what they support; an entry is stateless (one instance serves
    every executor and thread).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type: ClassVar[type[Node]]
    graph_node: ClassVar[str | None] = None
    driver_node_type: ClassVar[str | None] = None
    replay_params: ClassVar[str | None] = None
    on_device: ClassVar[bool] = True
    #: a capture of the node's stream step adds exactly one graph node (the capture executor
    #: records it for replays); False for library calls that may add several (NCCL)
    captures_one_node: ClassVar[bool] = True

    @property
    def kind(self) -> str:
        """The orchestra node kind (``node_type.kind``)."""
        return self.node_type.kind

    @property
    def engine(self) -> str:
        """The engine the node occupies (``node_type.engine``): scheduling and tracing."""
        return self.node_type.engine

    def resolve(self, node, executor) -> Any:
        """Work for ``node`` before any CUDA call, on ``executor`` (an `ExecutorBase`); the
        result is kept as ``ctx.resolved[node.name]``. Default: nothing (None)."""
        return None

    def resolve_with(self, node, executor, copies=None) -> Any:
        """`resolve` with the build's `CopyPolicy` (``copies``; None: the default policy).
        Entries whose lowering depends on it override this; others inherit `resolve`."""
        return self.resolve(node, executor)

    def graph_node_of(self, node, copies=None) -> str | None:
        """The CUDA graph node kind ``node`` becomes under ``copies`` (a `CopyPolicy` or
        None). Default: ``graph_node``."""
        return self.graph_node

    def begin_graph(self, node, ctx, cugraph) -> None:
        """Make what ``node`` needs on ``cugraph`` (the ``CUgraph`` that will hold it) before
        any node of that graph is added or captured; ``ctx``: the `StreamContext` (capture)
        or `GraphContext`. Default: nothing."""

    def stream(self, node, ctx, stream) -> Callable[[], None]:
        """The step that enqueues ``node`` on ``stream`` (an orchestra `Stream`). ``ctx``: the
        `StreamContext`. The step raises `CudaError` when its driver call fails."""
        raise GraphError(f"node {node.name}: the {ctx.executor_name} executor cannot run node "
                         f"kind {node.kind!r} ({type(node).__name__}) on a stream")

    def graph(self, node, ctx, deps: list):
        """Add ``node`` to ``ctx.graph`` after ``deps`` (``CUgraphNode`` list; ``ctx``: the
        `GraphContext`); return its `NodeRecord` (``ctx.record``). Raises `CudaError` when
        the driver refuses."""
        raise GraphError(f"node {node.name}: node kind {node.kind!r} ({type(node).__name__}) "
                         "has no CUDA graph node translation; run it with the eager executor")

    def __repr__(self) -> str:
        return f"<Lowering {self.node_type.__name__} -> {self.graph_node}>"


def register(cls: type[Lowering]) -> type[Lowering]:
    """Class decorator: register an instance of the `Lowering` subclass ``cls`` for its
    ``node_type`` (replacing an earlier entry for that class). Returns ``cls``."""
    LOWERINGS[cls.node_type] = cls()
    return cls


def lowering_for(node) -> Lowering:
    """The entry for ``node``: registered for its class, else for the nearest base class that
    has one. `NoLoweringError` when none does."""
    cls = type(node)
    entry = LOWERINGS.get(cls)
    if entry is not None:
        return entry
    for base in cls.__mro__[1:]:
        entry = LOWERINGS.get(base)
        if entry is not None:
            return entry
    raise NoLoweringError(
        f"node {node.name}: node kind {node.kind!r} ({cls.__name__}) has no entry in the "
        "lowering table (orchestra.execute.lowering), so no executor can run it; register a "
        "Lowering for its class")


def missing_lowerings(classes) -> list[type]:
    """The node classes of ``classes`` that `lowering_for` would refuse."""
    out = []
    for cls in classes:
        if not any(c in LOWERINGS for c in cls.__mro__):
            out.append(cls)
    return out


__all__ = ["LOWERINGS", "Lowering", "NoLoweringError", "lowering_for",
           "missing_lowerings", "register"]

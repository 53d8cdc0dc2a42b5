"""`GraphContext`: what a node's `Lowering.graph` reads and fills while a CUDA graph is built
node by node (the graph-build executor makes one per build).

Nodes are added in creation order (every node after its dependencies), so a buffer's address
is known when its users are added: an allocation node's address is returned by the driver
(``cuGraphAddMemAllocNode`` writes it into the parameter struct), bound host arrays and
external device buffers come from the binding table.
"""

from __future__ import annotations

import copy

from orchestra.driver.check import cu
from orchestra.execute.bindings import BindingUser
from orchestra.execute.hostfunc import HostCallbacks
from orchestra.execute.lowering.bodies import InnerUser
from orchestra.execute.lowering.table import lowering_for


class GraphContext:
    """Attributes: ``api`` (the `DriverAPI`), ``graph`` (the ``CUgraph``), ``context`` (the
    ``CUcontext`` memcpy and memset nodes name), ``device`` (the `Device`), ``resolved`` (node
    name -> what the entry's `resolve` returned), ``built`` (the `BuiltGraph`: records in
    creation order, kernels, allocations), ``bindings`` (its `BindingTable`), ``handles``
    (condition name -> its conditional handle as an int, created before the nodes that use
    it are added), ``container`` (the node whose body ``graph`` is, None at the top),
    ``executor_name``, ``copies`` (the build's `CopyPolicy`, the same in every body). `sub`
    makes the context of a body graph (`orchestra.execute.lowering.bodies`).

    Thread-safety: not thread-safe: part of one build or run, used by the thread that makes it,
    under its executor's lock (or a `GraphExec`'s); never share one.
    """

    executor_name = "graph-build"

    def __init__(self, api, graph, device, resolved: dict, built, bindings, copies=None):
        self.api = api
        self.copies = copies
        self.graph = graph
        self.device = device
        self.context = device.context
        self.resolved = resolved
        self.built = built
        self.bindings = bindings
        self._dptrs: dict[str, object] = {}  # buffer -> CUdeviceptr of its live allocation
        self._addr = {name: b.address for name, b in bindings.external.items()}
        self.alloc_of: dict[str, int] = {}  # Alloc node -> address
        self.handles: dict[str, int] = {}
        self.container: str | None = None

    def sub(self, cugraph, container: str) -> "GraphContext":
        """The context of a body graph ``cugraph`` of node ``container``: everything shared
        (addresses, resolutions, handles, the build)."""
        sub = copy.copy(self)
        sub.graph = cugraph
        sub.container = container
        return sub

    def add(self, call: str, deps: list, *args):
        """``api.<call>(graph, deps or None, len(deps), *args)``, checked (`CudaError` naming
        the call): the new ``CUgraphNode``."""
        return cu(getattr(self.api, call), self.graph, deps or None, len(deps), *args)

    def add_node(self, params, deps: list, edge_data=None):
        """``cuGraphAddNode(graph, deps, edge_data, len(deps), params)`` (a
        ``CUgraphNodeParams``), checked: the new ``CUgraphNode``."""
        return cu(self.api.cuGraphAddNode, self.graph, deps or None, edge_data, len(deps),
                  params)

    def record(self, node, gnode, params, kind: str | None = None):
        """The `NodeRecord` of ``node``, added to the build, of CUDA node kind ``kind``
        (default: its entry's ``graph_node_of(node, copies)``; a host copy lowered to a copy
        kernel is a ``"kernel"``); inside a body an inner record (``built.inner``)."""
        if kind is None:
            kind = lowering_for(node).graph_node_of(node, self.copies)
        if self.container is not None:
            rec = self.built.inner_record(node.name, kind, self.container)
            rec.gnode, rec.params = gnode, params
            return rec
        return self.built.record(node.name, kind, gnode, params)

    def device_address(self, buffer: str) -> int:
        """The base address of device buffer ``buffer``: its latest graph allocation, or the
        external device buffer bound to it."""
        return self._addr[buffer]

    def host_address(self, buffer: str) -> int:
        """The address of the host array bound to host buffer ``buffer``."""
        return self.bindings.host[buffer].address

    def allocated(self, node, dptr) -> None:
        """``node`` (an `Alloc`) allocated ``dptr`` (a ``CUdeviceptr``) in the graph."""
        b = node.buffer.name
        self._dptrs[b] = dptr
        self._addr[b] = self.built.allocs[b] = int(dptr)
        self.alloc_of[node.name] = int(dptr)

    def freed(self, node):
        """``node`` (a `Free`) frees its buffer's live graph allocation: that ``CUdeviceptr``."""
        return self._dptrs.pop(node.buffer.name)

    def use(self, binding: str, record, params, field: str, offset: int) -> None:
        """``params.<field>`` of ``record`` holds binding ``binding``'s address + ``offset``
        (what a replay rewrites; inside a body an `InnerUser`, which replays refuse); names
        that are not bindings are ignored."""
        if self.container is None:
            user = BindingUser(record, params, field, offset)
        else:
            user = InnerUser(record, params, field, offset, self.container)
        self.bindings.use(binding, user)

    @property
    def callbacks(self):
        """The build's `HostCallbacks` table (made on first use)."""
        if self.built.callbacks is None:
            self.built.callbacks = HostCallbacks()
        return self.built.callbacks


__all__ = ["GraphContext"]

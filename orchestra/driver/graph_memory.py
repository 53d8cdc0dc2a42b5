"""Graph memory: what the device's graph allocator holds (``cuDeviceGetGraphMemAttribute``).

Allocation nodes of CUDA graphs take memory from a per-device graph allocator, not from a
memory pool; these queries say how much is in use and reserved, and `trim_graph_memory` gives
back what no exec is using (``cuDeviceGraphMemTrim``).
"""

from __future__ import annotations

import attrs
from cuda.bindings import driver as _d

from orchestra.driver.check import cu
from orchestra.driver.device import as_device


@attrs.frozen
class GraphMemory:
    """``cuDeviceGetGraphMemAttribute`` for one device, in bytes: memory currently associated
    with graphs (``used``), the graph allocator's reservation (``reserved``) and their high
    watermarks.

    Immutable: may be shared between threads freely.
    """

    used: int
    used_high: int
    reserved: int
    reserved_high: int


def graph_memory(device=None) -> GraphMemory:
    """The device's graph-memory attributes (``cuDeviceGetGraphMemAttribute``)."""
    dev = as_device(device)
    dev.make_current()
    A = _d.CUgraphMem_attribute

    def get(a):
        return int(cu(_d.cuDeviceGetGraphMemAttribute, dev.handle, a))

    return GraphMemory(get(A.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT),
                       get(A.CU_GRAPH_MEM_ATTR_USED_MEM_HIGH),
                       get(A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
                       get(A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH))


def trim_graph_memory(device=None) -> None:
    """Return graph-allocator memory no exec is using to the OS (``cuDeviceGraphMemTrim``)."""
    dev = as_device(device)
    dev.make_current()
    cu(_d.cuDeviceGraphMemTrim, dev.handle)


__all__ = ["GraphMemory", "graph_memory", "trim_graph_memory"]

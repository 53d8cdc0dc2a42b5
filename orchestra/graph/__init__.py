"""Task graphs: buffers, node records and dependency inference (pure Python, no CUDA).

    g = TaskGraph()
    x = Buffer("x", 4096)
    g.add(Alloc("alloc", x)); g.add(HostToDevice("up", HostBuffer("h", 4096), x)) ...

or, with generated names and the Alloc / Free inserted for you (docs/building.md):

    with GraphBuilder() as b:
        x = b.to_device(b.host_input("h", 4096)) ...
    g = b.graph

Edges come from what nodes read and write (RAW, WAR, WAW on overlapping bytes) plus ``after=``.
"""

from orchestra.graph.batch import Batch, add_batch, build_pipeline, elementwise_args
from orchestra.graph.builder import GraphBuilder, Lifetime
from orchestra.graph.buffers import Access, Buffer, BufferRange, Condition, HostBuffer, Mode
from orchestra.graph.kernel_ref import KernelRef
from orchestra.graph.nodes import (
    Alloc,
    ChildGraph,
    DeviceToHost,
    Free,
    HostFunc,
    HostToDevice,
    In,
    InOut,
    KernelNode,
    Memset,
    Node,
    Out,
)
from orchestra.graph.ranges import RangeTracker
from orchestra.graph.taskgraph import TaskGraph

Kernel = KernelNode  # the short name for the node kind

__all__ = [
    "Access", "Alloc", "Batch", "Buffer", "BufferRange", "ChildGraph", "Condition",
    "DeviceToHost", "Free",
    "GraphBuilder", "HostBuffer", "HostFunc", "HostToDevice", "In", "InOut", "Kernel",
    "KernelNode", "KernelRef", "Lifetime", "Memset", "Mode", "Node", "Out", "RangeTracker",
    "TaskGraph", "add_batch", "build_pipeline", "elementwise_args",
]

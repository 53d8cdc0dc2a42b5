"""Task graphs: buffers, node records and dependency inference (pure Python, no CUDA).

    g = TaskGraph()
    x = Buffer("x", 4096)
    g.add(Alloc("alloc", x)); g.add(HostToDevice("up", HostBuffer("h", 4096), x)) ...

Edges come from what nodes read and write (RAW, WAR, WAW on overlapping bytes) plus ``after=``.
"""

from orchestra.graph.batch import Batch, add_batch, build_pipeline, elementwise_args
from orchestra.graph.buffers import Access, Buffer, BufferRange, HostBuffer, Mode
from orchestra.graph.kernel_ref import KernelRef
from orchestra.graph.nodes import (
    Alloc,
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
    "Access", "Alloc", "Batch", "Buffer", "BufferRange", "DeviceToHost", "Free", "HostBuffer",
    "HostFunc", "HostToDevice", "In", "InOut", "Kernel", "KernelNode", "KernelRef", "Memset",
    "Mode", "Node", "Out", "RangeTracker", "TaskGraph", "add_batch", "build_pipeline",
    "elementwise_args",
]

"""Task graphs: buffers, node records and dependency inference (pure Python, no CUDA).

    g = TaskGraph()
    x = Buffer("x", 4096)
    g.add(Alloc("alloc", x)); g.add(HostToDevice("up", HostBuffer("h", 4096), x)) ...

or, with generated names and the Alloc / Free inserted for you (docs/building.md):

    with GraphBuilder() as b:
        x = b.to_device(b.host_input("h", 4096)) ...
    g = b.graph

Edges come from what nodes read and write (RAW, WAR, WAW on overlapping bytes) plus ``after=``.
Control flow: `If` / `While` / `Switch` run body task graphs on a `Condition` a kernel sets on
the GPU; `ChildGraph` runs a task graph as one node (docs/graphs.md).
"""

from orchestra.graph.batch import Batch, add_batch, build_pipeline, elementwise_args
from orchestra.graph.builder import GraphBuilder, Lifetime
from orchestra.graph.buffers import Access, Buffer, BufferRange, Condition, HostBuffer, Mode
from orchestra.graph.collectives import (
    AllGather,
    AllReduce,
    Broadcast,
    Collective,
    ReduceScatter,
    Recv,
    Send,
)
from orchestra.graph.kernel_ref import KernelRef
from orchestra.graph.nodes import (
    COPY_LOWERINGS,
    Alloc,
    ChildGraph,
    Conditional,
    DeviceToHost,
    Free,
    HostFunc,
    HostToDevice,
    If,
    In,
    InOut,
    KernelNode,
    Memset,
    Node,
    Out,
    PeerCopy,
    Switch,
    While,
)
from orchestra.graph.ranges import RangeTracker
from orchestra.graph.taskgraph import TaskGraph

Kernel = KernelNode  # the short name for the node kind

__all__ = [
    "COPY_LOWERINGS", "Access", "AllGather", "AllReduce", "Alloc", "Batch", "Broadcast",
    "Buffer", "BufferRange", "ChildGraph", "Collective", "Condition", "Conditional",
    "DeviceToHost", "Free", "GraphBuilder", "HostBuffer", "HostFunc", "HostToDevice", "If",
    "In", "InOut", "Kernel", "KernelNode", "KernelRef", "Lifetime", "Memset", "Mode", "Node",
    "Out", "PeerCopy", "RangeTracker", "Recv", "ReduceScatter", "Send", "Switch", "TaskGraph",
    "While", "add_batch", "build_pipeline", "elementwise_args",
]

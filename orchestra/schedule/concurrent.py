"""The ``concurrent`` policy: by-engine's copy streams, and independent kernels that do not fill
the GPU on separate compute streams, so they run at once.

A kernel *fills the GPU* when its grid has at least as many blocks as the device holds resident
at once for its launch shape (``cuOccupancyMaxActiveBlocksPerMultiprocessor`` x SM count). Such
a kernel gains nothing from a second stream: its blocks already occupy every SM and the next
kernel's blocks start as they drain. A smaller kernel leaves SMs idle, and kernels on separate
streams share the GPU (CUDA Programming Guide, "Concurrent Kernel Execution"). This module is
pure Python: the capacity comes in as ``resident_blocks`` (kernel node name -> blocks, or a
callable node -> blocks or None), which the executors fill from ``Kernel.occupancy()`` and the
device's SM count (`orchestra.execute.occupancy`). A kernel without a known capacity counts as
filling the GPU, so without the parameter the plan keeps every kernel on one stream.

Streams: 1 -> ``main``; 2 -> ``main`` + ``download``; 3 -> ``upload``, ``compute``,
``download``; S > 3 -> ``upload``, ``compute0`` .. ``compute{S-3}``, ``download``. Copies,
allocations, frees and host functions go where by-engine puts them. Kernels are placed in the
graph's topological order by a small simulation over estimated costs (`costs.estimate_costs`):

- a kernel that fills the GPU goes on the stream of its latest kernel predecessor (else the
  first compute stream), and in the simulation waits for every running kernel: large kernels
  stay together and in order;
- a smaller kernel continues its latest kernel predecessor's stream when that stream is free
  by the time its inputs are, else goes to the compute stream where it can start earliest
  (ties: the lowest index), so the independent kernels of a fan-out or a diamond spread over
  the compute streams.

Events come from `events.insert_events`: one wait only where an edge crosses streams and is
not already implied, so streams meet only where the graph joins them.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Mapping

from orchestra.errors import ScheduleArgumentTypeError, ScheduleError
from orchestra.schedule.costs import Costs, estimate_costs
from orchestra.schedule.plan import StreamSpec

ResidentBlocks = Mapping[str, int] | Callable | None


def grid_blocks(node) -> int:
    """Blocks in a kernel node's grid (x * y * z)."""
    return math.prod(node.grid)


def capacity_of(node, resident_blocks: ResidentBlocks) -> int | None:
    """Blocks of ``node``'s launch shape the device holds at once, or None when unknown."""
    if resident_blocks is None:
        return None
    if isinstance(resident_blocks, Mapping):
        value = resident_blocks.get(node.name)
    elif callable(resident_blocks):
        value = resident_blocks(node)
    else:
        raise ScheduleArgumentTypeError(
            "resident_blocks must be None, a dict kernel node name -> blocks or a callable "
            f"node -> blocks; got {type(resident_blocks).__name__} {resident_blocks!r:.80}")
    if value is None:
        return None
    # a block count: an int (numpy's too), or a float holding one; not a bool, NaN or 2.5
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            isinstance(value, numbers.Integral) or float(value).is_integer()):
        raise ScheduleError(f"resident_blocks of kernel node {node.name} must be a whole "
                            f"number of blocks >= 0 (Kernel.occupancy() x SMs); got "
                            f"{type(value).__name__} {value!r:.80}")
    value = int(value)
    if value < 0:
        raise ScheduleError(f"resident_blocks of kernel node {node.name} must be >= 0; got "
                            f"{value}")
    return value


def fills_gpu(node, resident_blocks: ResidentBlocks) -> bool:
    """True when kernel ``node`` occupies every SM (grid >= resident capacity) or its capacity
    is unknown."""
    cap = capacity_of(node, resident_blocks)
    return cap is None or grid_blocks(node) >= cap


def _streams(S: int):
    if S == 1:
        return (StreamSpec("main"),), "main", "main", ["main"]
    if S == 2:
        return (StreamSpec("main"), StreamSpec("download", role="download")), "main", \
            "download", ["main"]
    lanes = ["compute"] if S == 3 else [f"compute{i}" for i in range(S - 2)]
    specs = (StreamSpec("upload", role="upload"),
             *(StreamSpec(c, role="compute") for c in lanes),
             StreamSpec("download", role="download"))
    return specs, "upload", "download", lanes


def concurrent(graph, S: int, costs: Costs = None, resident_blocks: ResidentBlocks = None):
    """(stream specs, node -> stream, order, meta) of the ``concurrent`` policy (module doc).

    ``meta``: ``small_kernels`` (kernels that do not fill the GPU) and ``makespan_us`` (the
    simulation's estimate)."""
    specs, up, down, lanes = _streams(S)
    L = len(lanes)
    cost = estimate_costs(graph, costs)
    order = graph.topological_order()
    gpos = {n: i for i, n in enumerate(order)}
    assign: dict[str, str] = {}
    lane_of: dict[str, int] = {}  # kernel (and compute-engine) node -> lane index
    finish: dict[str, float] = {}
    lane_free = [0.0] * L
    small = 0
    for n in order:
        node = graph.node(n)
        preds = graph.predecessors(n)
        ready = max((finish[p] for p in preds), default=0.0)
        if node.engine == "compute":  # kernels, memsets and other SM work
            kernel_preds = [p for p in preds if p in lane_of]
            latest = max(kernel_preds, key=lambda p: (finish[p], gpos[p]), default=None)
            follow = lane_of[latest] if latest is not None else None
            if node.kind == "kernel" and not fills_gpu(node, resident_blocks):
                small += 1
                if follow is not None and lane_free[follow] <= ready:
                    lane = follow
                else:
                    lane = min(range(L), key=lambda i: (max(lane_free[i], ready), i))
                start = max(ready, lane_free[lane])
            else:
                lane = follow if follow is not None else 0
                start = max(ready, *lane_free)  # the whole GPU: after every running kernel
            finish[n] = start + cost[n]
            lane_free[lane] = finish[n]
            lane_of[n] = lane
            assign[n] = lanes[lane]
            continue
        finish[n] = ready + cost[n]
        if node.kind == "free" or node.engine == "host":
            latest = max(preds, key=gpos.__getitem__, default=None)
            assign[n] = assign[latest] if latest is not None else lanes[0]
        elif node.engine in ("upload", "memory"):
            assign[n] = up
        elif node.engine == "download":
            assign[n] = down
        else:
            assign[n] = lanes[0]
    meta = {"small_kernels": small,
            "makespan_us": round(max(finish.values(), default=0.0), 3)}
    return specs, assign, order, meta


__all__ = ["ResidentBlocks", "capacity_of", "concurrent", "fills_gpu", "grid_blocks"]

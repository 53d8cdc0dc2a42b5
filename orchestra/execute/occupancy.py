"""Resident capacity per kernel node: what the ``concurrent`` policy needs to know which
kernels fill the GPU.

For each kernel node, the blocks the device holds at once for its launch shape:
``Kernel.occupancy(block, shared_mem)`` (``cuOccupancyMaxActiveBlocksPerMultiprocessor``) times
the device's SM count (``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``). The executors pass
`resident_blocks` to ``schedule(..., resident_blocks=)`` when a plan is made for a policy of
``schedule.CAPACITY_POLICIES``; a kernel whose occupancy cannot be queried (a test fake without
``occupancy``) is left out, which the policy reads as "fills the GPU".
"""

from __future__ import annotations

from orchestra.schedule import CAPACITY_POLICIES


def resident_blocks(graph, kernels, device) -> dict[str, int]:
    """Kernel node name -> resident blocks for its (block, shared_mem) on ``device``.

    ``kernels``: the executor's `KernelResolver` (resolving compiles or loads each kernel once,
    as the first run would). Raises what the resolver raises (compile errors name the node)."""
    sm = int(getattr(device, "sm_count", 0) or 0)
    out: dict[str, int] = {}
    if sm <= 0:
        return out
    memo: dict = {}
    for node in graph.nodes:
        if node.kind != "kernel":
            continue
        key = (node.kernel, node.block, node.shared_mem)
        if key not in memo:
            k = kernels.resolve(node.kernel, node.name)
            occupancy = getattr(k, "occupancy", None)
            memo[key] = None if occupancy is None else int(occupancy(node.block,
                                                                     node.shared_mem)) * sm
        if memo[key] is not None:
            out[node.name] = memo[key]
    return out


def capacity_for(policy: str, kernels, device):
    """The ``resident_blocks`` callback a plan cache uses: ``graph -> resident_blocks(...)``
    for the policies that need it, else None."""
    if policy not in CAPACITY_POLICIES:
        return None
    return lambda graph: resident_blocks(graph, kernels, device)


__all__ = ["capacity_for", "resident_blocks"]

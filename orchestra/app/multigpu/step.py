"""The data-parallel step's graph (the one examples/data_parallel_step.py shows): per rank
H2D, ``y = 2x + 1``, all-reduce of y in place, ``z = y / 2``, D2H; and graphs of one
collective or peer copies for the benchmark (pure Python)."""

from __future__ import annotations

from orchestra.graph import (Alloc, AllReduce, Buffer, DeviceToHost, Free, HostBuffer,
                             HostToDevice, KernelNode, KernelRef, PeerCopy, TaskGraph)

BURN = KernelRef("burn.cu", "burn", params=("const float* x", "float* y", "size_t n",
                                            "int iters", "float s", "float t"))


def step_graph(comm, n: int, block: int = 256) -> TaskGraph:
    """Rank ``comm.rank``'s step over ``n`` float32 (``y`` is an external buffer)."""
    d, nbytes = comm.device, 4 * n
    grid = max(1, min(4096, -(-n // (4 * block))))
    g = TaskGraph()
    hin, hout = HostBuffer("shard_in", nbytes), HostBuffer("shard_out", nbytes)
    x, z, y = (Buffer(k, nbytes, device=d) for k in ("x", "z", "y"))
    g.add(Alloc("alloc_x", x))
    g.add(Alloc("alloc_z", z))
    g.add(HostToDevice("h2d", hin, x))
    g.add(KernelNode("scale", BURN, grid, block, (x, y, n, 1, 2.0, 1.0)))
    g.add(AllReduce("all_reduce", y, y, comm=comm))
    g.add(KernelNode("halve", BURN, grid, block, (y, z, n, 1, 0.5, 0.0)))
    g.add(DeviceToHost("d2h", z, hout))
    g.add(Free("free_x", x))
    g.add(Free("free_z", z))
    return g


def all_reduce_graph(comm, nbytes: int, reps: int = 1) -> TaskGraph:
    """``reps`` in-place all-reduces of external buffer ``buf`` (float32)."""
    g = TaskGraph()
    buf = Buffer("buf", nbytes, device=comm.device)
    for i in range(reps):
        g.add(AllReduce(f"ar{i}", buf, buf, comm=comm))
    return g


def peer_copy_graph(nbytes: int, pairs, reps: int = 1) -> TaskGraph:
    """``reps`` peer copies per ``(src device, dst device)`` pair between external buffers
    ``src{a}_{b}`` and ``dst{a}_{b}``; each copy runs on its source device (a push)."""
    g = TaskGraph()
    for a, b in pairs:
        src = Buffer(f"src{a}_{b}", nbytes, device=a)
        dst = Buffer(f"dst{a}_{b}", nbytes, device=b)
        for i in range(reps):
            g.add(PeerCopy(f"copy{a}_{b}_{i}", src, dst))
    return g


def reference(global_in):
    """Every rank's z for the step: ``0.5 * sum_r (2 x_r + 1)`` (float64 sums)."""
    import numpy as np

    return (0.5 * (2.0 * global_in.astype(np.float64) + 1.0).sum(axis=0)).astype(np.float32)


__all__ = ["BURN", "all_reduce_graph", "peer_copy_graph", "reference", "step_graph"]

"""A data-parallel step on every GPU: H2D, kernel, all-reduce, kernel, D2H, one CUDA graph per
GPU, replayed.

Each rank takes one shard x_r of a global array (``--shard-mib`` MiB of float32):

    y_r = 2 x_r + 1            (burn kernel)
    y_r = sum over ranks of y  (NCCL all-reduce, in place)
    z_r = 0.5 y_r              (burn kernel)

so every rank's z is 0.5 * sum_r (2 x_r + 1), checked against numpy. The step is captured
once per GPU (the capture executor: the all-reduce is a node of the graph like the copies and
kernels) and replayed with fresh shards; ``--eager`` steps are timed too.

Two ways to run:

    python examples/data_parallel_step.py                # one process, one thread per GPU
    python -m orchestra.launch --nproc 2 examples/data_parallel_step.py   # one process per GPU

With one GPU both are one rank (the all-reduce of one rank is the identity).

The all-reduced buffer is allocated once outside the graph (an external buffer bound at
build): NCCL may register the buffers it is given, and memory that lives across replays suits
that; the input and output buffers are allocated by the graph itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP off (no multicast objects)

from orchestra.graph import (Alloc, AllReduce, Buffer, DeviceToHost, Free, HostBuffer,  # noqa
                             HostToDevice, KernelNode, KernelRef, TaskGraph)

BURN = KernelRef("burn.cu", "burn",  # cuda_src/burn.cu: y = x * s + t, iters times
                 params=("const float* x", "float* y", "size_t n", "int iters", "float s",
                         "float t"))


def step_graph(comm, n: int, block: int = 256) -> TaskGraph:
    """Rank ``comm.rank``'s step over ``n`` float32 (a multiple of 4) on ``comm.device``."""
    d, nbytes = comm.device, 4 * n
    grid = max(1, min(4096, -(-n // (4 * block))))
    g = TaskGraph()
    hin, hout = HostBuffer("shard_in", nbytes), HostBuffer("shard_out", nbytes)
    x, z = Buffer("x", nbytes, device=d), Buffer("z", nbytes, device=d)
    y = Buffer("y", nbytes, device=d)  # external: bound to a DeviceBuffer
    g.add(Alloc("alloc_x", x))
    g.add(Alloc("alloc_z", z))
    g.add(HostToDevice("h2d", hin, x))
    g.add(KernelNode("scale", BURN, grid, block, (x, y, n, 1, 2.0, 1.0)))
    g.add(AllReduce("all_reduce", y, y, comm=comm, op="sum", dtype="float32"))
    g.add(KernelNode("halve", BURN, grid, block, (y, z, n, 1, 0.5, 0.0)))
    g.add(DeviceToHost("d2h", z, hout))
    g.add(Free("free_x", x))
    g.add(Free("free_z", z))
    return g


def shards(step: int, nranks: int, n: int, seed: int = 0) -> np.ndarray:
    """Step ``step``'s global input: ``nranks`` shards of ``n`` float32 (the same on every
    rank, so each process can check against all of it)."""
    rng = np.random.default_rng([seed, step])
    return rng.standard_normal((nranks, n)).astype(np.float32)


def reference(global_in: np.ndarray) -> np.ndarray:
    return (0.5 * (2.0 * global_in.astype(np.float64) + 1.0).sum(axis=0)).astype(np.float32)


def run_rank(comm, n: int, steps: int, eager_steps: int, seed: int = 0) -> dict:
    """Run rank ``comm.rank``'s step eagerly ``eager_steps + 1`` times, then capture it and
    replay it ``steps`` times, checking every output against numpy. Returns the timings (ms
    per step, host fill and check included)."""
    from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream
    from orchestra.execute import CaptureExecutor, EagerExecutor

    g = step_graph(comm, n)
    hin = PinnedBuffer.empty((n,), np.float32, device=comm.device)
    hout = PinnedBuffer.empty((n,), np.float32, device=comm.device)
    setup = Stream(comm.device)
    y = DeviceBuffer.allocate(4 * n, setup)
    setup.synchronize()
    bindings = {"shard_in": hin.array, "shard_out": hout.array, "y": y}
    worst = 0.0

    def check(step):
        nonlocal worst
        want = reference(shards(step, comm.nranks, n, seed))
        err = float(np.max(np.abs(hout.array - want)))
        worst = max(worst, err)
        tol = 1e-5 * comm.nranks * (1.0 + float(np.max(np.abs(want))))
        if not err <= tol:
            raise AssertionError(f"rank {comm.rank}, step {step}: max error {err} > {tol}")

    out = {"rank": comm.rank, "device": comm.device}
    try:
        # eager steps first: NCCL connects lazily on a communicator's first collective, which
        # is best done outside a stream capture
        with EagerExecutor(comm.device) as ex:
            t0 = time.perf_counter()
            for s in range(eager_steps + 1):
                hin.array[:] = shards(s, comm.nranks, n, seed)[comm.rank]
                ex.run(g, bindings=bindings)
                check(s)
            out["eager_ms"] = (time.perf_counter() - t0) * 1e3 / (eager_steps + 1)
        with CaptureExecutor(comm.device) as cx:
            first = eager_steps + 1
            hin.array[:] = shards(first, comm.nranks, n, seed)[comm.rank]
            exe = cx.build(g, bindings=bindings)  # the whole step: one CUDA graph
            try:
                exe.launch(sync=True)
                check(first)
                t0 = time.perf_counter()
                for s in range(first + 1, first + 1 + steps):
                    hin.array[:] = shards(s, comm.nranks, n, seed)[comm.rank]
                    exe.replay({"shard_in": hin.array}, sync=True)
                    check(s)
                out["graph_ms"] = (time.perf_counter() - t0) * 1e3 / max(1, steps)
            finally:
                exe.close()
    finally:
        y.close()
        setup.close()
    out["max_error"] = worst
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard-mib", type=float, default=1.0, help="MiB of float32 per rank (1)")
    ap.add_argument("--steps", type=int, default=20, help="graph replays (20)")
    ap.add_argument("--eager", type=int, default=5, help="eager steps before them (5)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="one process: this many GPUs (default: every visible GPU)")
    args = ap.parse_args(argv)
    n = max(4, int(args.shard_mib * (1 << 20)) // 16 * 4)

    from orchestra.errors import NoDeviceError

    try:
        if "ORCHESTRA_RANK" in os.environ:  # started by python -m orchestra.launch
            from orchestra.nccl import init_from_env

            with init_from_env() as comm:
                results = [run_rank(comm, n, args.steps, args.eager)]
        else:
            from orchestra.driver.device import device_count
            from orchestra.nccl import run_per_device

            ranks = args.ranks if args.ranks is not None else device_count()
            results = run_per_device(lambda c: run_rank(c, n, args.steps, args.eager),
                                     list(range(ranks)))
    except NoDeviceError as exc:
        print(f"data_parallel_step: {exc}", file=sys.stderr)
        return 3
    for r in results:
        print(f"rank {r['rank']} (device {r['device']}): {4 * n / 2**20:.2f} MiB shard, eager "
              f"{r['eager_ms']:.3f} ms/step, graph {r['graph_ms']:.3f} ms/step (host fill and "
              f"check included), max error {r['max_error']:.2e}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A task graph built with `GraphBuilder`: out = 2 * x + y (saxpy) over a few batches.

No node or device buffer is named and no Alloc / Free is written: the builder names the nodes
(kernel:saxpy#0, h2d:x#0, ...) and allocates each batch's device buffers right before their
first use and frees them right after their last. Then the graph is planned on three streams,
run by the eager executor and as a CUDA graph (built once, replayed), checked against numpy.

    python examples/build_graph.py          # needs an NVIDIA GPU
    python examples/build_graph.py --plan   # print the plan only; no GPU needed
"""

import argparse
import sys

import numpy as np

from orchestra.graph import GraphBuilder, KernelRef, Out

SAXPY = KernelRef("saxpy.cu", "saxpy",  # cuda_src/saxpy.cu: out[i] = a * x[i] + y[i]
                  params=("float a", "const float* x", "const float* y", "float* out", "size_t n"))
A = 2.0  # a power of two: a * x is exact, so the float32 result is bit-exact against numpy


def build(n: int = 1 << 20, batches: int = 4, block: int = 256):
    """The graph: per batch, x and y up, saxpy, out down; ``n`` float32 elements per batch."""
    nbytes = 4 * n
    with GraphBuilder() as g:
        x = g.host_input("x", batches * nbytes)
        y = g.host_input("y", batches * nbytes)
        out = g.host_output("out", batches * nbytes)
        for b in range(batches):
            with g.batch(b):
                lo = b * nbytes
                dx = g.to_device(x.range(lo, nbytes))  # graph-allocated, named d_x#<b>
                dy = g.to_device(y.range(lo, nbytes))
                dout = g.device_buffer(nbytes)         # graph-allocated, named buf#<b>
                g.kernel(SAXPY, grid=-(-n // block), block=block, args=(A, dx, dy, Out(dout), n))
                g.to_host(dout, out.range(lo, nbytes))
    return g.graph


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="store_true", help="print the plan only (no GPU needed)")
    ap.add_argument("--n", type=int, default=1 << 20, help="float32 elements per batch")
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args(argv)

    from orchestra.schedule import schedule

    graph = build(args.n, args.batches)
    plan = schedule(graph, "by-engine", streams=3)
    if args.plan:
        print(plan)
        return 0

    from orchestra.driver import Device, PinnedBuffer
    from orchestra.errors import NoDeviceError
    from orchestra.execute import EagerExecutor, GraphBuildExecutor

    try:
        dev = Device.get(0)
    except NoDeviceError as exc:  # one line, not a traceback
        print(f"build_graph: {exc}", file=sys.stderr)
        return 2
    total = args.n * args.batches
    x, y, out = (PinnedBuffer.empty(total, np.float32, dev) for _ in range(3))
    rng = np.random.default_rng(0)
    x.array[:] = rng.random(total, dtype=np.float32)
    y.array[:] = rng.random(total, dtype=np.float32)
    expect = (A * x.array.astype(np.float64) + y.array).astype(np.float32)
    bindings = {"x": x.array, "y": y.array, "out": out.array}
    try:
        with EagerExecutor(dev) as ex:
            out.array[:] = np.nan
            ex.run(graph, plan, bindings)
            assert np.array_equal(out.array, expect), "eager run: wrong output"
        with GraphBuildExecutor(dev) as gx:
            out.array[:] = np.nan
            exe = gx.run(graph, plan, bindings)  # build, instantiate, launch once
            try:
                assert np.array_equal(out.array, expect), "CUDA graph launch: wrong output"
                out.array[:] = np.nan
                exe.replay()
                assert np.array_equal(out.array, expect), "CUDA graph replay: wrong output"
            finally:
                exe.close()
    finally:
        for buf in (x, y, out):
            buf.close()
    print(f"{len(graph)} nodes ({args.batches} batches) on {len(plan.streams)} streams: eager run,"
          f" CUDA graph launch and replay match numpy")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Jacobi sweeps until the residual is small, the loop run entirely on the GPU by a WHILE node,
against the host-driven loop (launch, copy the residual flag back, test, repeat).

The system: ``A u = b`` with ``A`` tridiagonal, ``diag`` on the diagonal and -1 beside it
(diagonally dominant for ``diag > 2``, so Jacobi converges: the error shrinks by about
``2 / diag`` per sweep). One iteration is one kernel on one block: two Jacobi sweeps (x -> y ->
x), then the residual ``max |b - A x|`` reduced in shared memory; thread 0 counts the iteration,
stores whether to go on (residual above the tolerance and fewer than ``--max-iters``
iterations) in the condition's flag and sets the WHILE node's condition with
``cudaGraphSetConditional``.

The same task graph runs three ways:

- ``graph-build`` / ``capture``: a CUDA graph with a WHILE node; one ``cuGraphLaunch`` runs every
  iteration, the host waits once;
- ``eager (host loop)``: orchestra's eager executor, which has no graph: it launches the
  iteration, copies the flag back, waits, tests and launches again (the kernel gets handle 0 and
  skips ``cudaGraphSetConditional``).

Prints iterations, wall time per solve and the result against a float64 numpy solve (Thomas
algorithm), and exits non-zero when a result is wrong or the runs disagree. Needs a GPU.

    python examples/while_converge.py [--n 4096] [--tol 1e-5] [--diag 2.2] [--repeat 10]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from orchestra.driver import Device, PinnedBuffer
from orchestra.execute import CaptureExecutor, EagerExecutor, GraphBuildExecutor
from orchestra.graph import (
    Alloc,
    Buffer,
    Condition,
    DeviceToHost,
    Free,
    HostBuffer,
    HostToDevice,
    In,
    InOut,
    KernelNode,
    KernelRef,
    Memset,
    Out,
    TaskGraph,
    While,
)

BLOCK = 1024  # one block, a power of two (the reduction halves it)

SOURCE = r"""
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// One Jacobi iteration on one block: x -> y -> x, then the residual of x.
extern "C" __global__ void jacobi_iteration(cudaGraphConditionalHandle h, float* x, float* y,
                                            const float* b, int n, float diag, float tol,
                                            unsigned int* flag, int* iters, int max_iters,
                                            float* residual)
{
    __shared__ float red[1024];
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float l = i > 0 ? x[i - 1] : 0.0f, r = i < n - 1 ? x[i + 1] : 0.0f;
        y[i] = (b[i] + l + r) / diag;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float l = i > 0 ? y[i - 1] : 0.0f, r = i < n - 1 ? y[i + 1] : 0.0f;
        x[i] = (b[i] + l + r) / diag;
    }
    __syncthreads();
    float m = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float l = i > 0 ? x[i - 1] : 0.0f, r = i < n - 1 ? x[i + 1] : 0.0f;
        m = fmaxf(m, fabsf(b[i] - (diag * x[i] - l - r)));
    }
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        int it = *iters + 1;
        *iters = it;
        *residual = red[0];
        unsigned int more = (red[0] > tol && it < max_iters) ? 1u : 0u;
        *flag = more;                            // what the eager executor reads back
        if (h) cudaGraphSetConditional(h, more); // handle 0: no graph (eager)
    }
}
"""

JACOBI = KernelRef(SOURCE, "jacobi_iteration")


def solve_graph(n: int, diag: float, tol: float, max_iters: int) -> TaskGraph:
    """b, x0 up; iterations = 0; WHILE (Jacobi iteration); x, iterations, residual down."""
    x, y, b = Buffer("x", 4 * n), Buffer("y", 4 * n), Buffer("b", 4 * n)
    flag, iters, res = Buffer("flag", 4), Buffer("iters", 4), Buffer("residual", 4)
    more = Condition("more", default=1, flag=flag)  # the body runs at least once
    body = TaskGraph()
    body.add(KernelNode("iteration", JACOBI, 1, BLOCK,
                        (more, InOut(x), InOut(y), In(b), n, diag, tol, Out(flag), InOut(iters),
                         max_iters, Out(res))))
    g = TaskGraph()
    for buf in (x, y, b, flag, iters, res):
        g.add(Alloc(f"alloc_{buf.name}", buf))
    g.add(HostToDevice("up_b", HostBuffer("host_b", 4 * n), b))
    g.add(HostToDevice("up_x", HostBuffer("host_x0", 4 * n), x))
    g.add(Memset("zero_iters", iters, 0))
    g.add(While("solve", more, body))
    g.add(DeviceToHost("down_x", x, HostBuffer("host_x", 4 * n)))
    g.add(DeviceToHost("down_iters", iters, HostBuffer("host_iters", 4)))
    g.add(DeviceToHost("down_residual", res, HostBuffer("host_residual", 4)))
    for buf in (x, y, b, flag, iters, res):
        g.add(Free(f"free_{buf.name}", buf))
    return g


def thomas(diag: float, b: np.ndarray) -> np.ndarray:
    """float64 solve of the tridiagonal system (diag on the diagonal, -1 beside it)."""
    n = len(b)
    c = np.zeros(n)
    d = np.zeros(n)
    c[0], d[0] = -1.0 / diag, b[0] / diag
    for i in range(1, n):
        m = diag + c[i - 1]
        c[i] = -1.0 / m
        d[i] = (b[i] + d[i - 1]) / m
    x = np.zeros(n)
    x[-1] = d[-1]
    for i in range(n - 2, -1, -1):
        x[i] = d[i] - c[i] * x[i + 1]
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="unknowns (default 4096)")
    ap.add_argument("--tol", type=float, default=1e-5, help="residual tolerance (max norm)")
    ap.add_argument("--diag", type=float, default=2.2, help="diagonal of A (> 2)")
    ap.add_argument("--max-iters", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=10, help="timed solves per executor")
    args = ap.parse_args(argv)
    if args.n < 2 or args.diag <= 2 or args.tol <= 0 or args.repeat < 1:
        ap.error("need --n >= 2, --diag > 2, --tol > 0, --repeat >= 1")
    dev = Device.get(0)
    n = args.n
    rng = np.random.default_rng(0)
    pins = {name: PinnedBuffer(nbytes, dev) for name, nbytes in (
        ("host_b", 4 * n), ("host_x0", 4 * n), ("host_x", 4 * n), ("host_iters", 4),
        ("host_residual", 4))}
    arrays = {"host_b": pins["host_b"].view(np.float32),
              "host_x0": pins["host_x0"].view(np.float32),
              "host_x": pins["host_x"].view(np.float32),
              "host_iters": pins["host_iters"].view(np.int32),
              "host_residual": pins["host_residual"].view(np.float32)}
    arrays["host_b"][:] = rng.uniform(-1, 1, n).astype(np.float32)
    arrays["host_x0"][:] = 0
    exact = thomas(args.diag, arrays["host_b"].astype(np.float64))
    bound = 10 * args.tol / (args.diag - 2)  # ||A^-1|| <= 1 / (diag - 2): error <= that x res
    graph = solve_graph(n, args.diag, args.tol, args.max_iters)
    rows, results = [], {}
    for name in ("graph-build", "capture", "eager (host loop)"):
        walls = []
        if name == "eager (host loop)":
            with EagerExecutor(dev) as ex:
                for _ in range(args.repeat + 1):  # the first one compiles and prepares
                    arrays["host_x"][:] = np.nan
                    walls.append(ex.run(graph, bindings=arrays).wall_ms)
        else:
            cls = GraphBuildExecutor if name == "graph-build" else CaptureExecutor
            with cls(dev) as ex:
                exe = ex.build(graph, bindings=arrays)
                try:
                    for _ in range(args.repeat + 1):
                        arrays["host_x"][:] = np.nan
                        t0 = time.perf_counter()
                        exe.launch(sync=True)
                        walls.append((time.perf_counter() - t0) * 1e3)
                finally:
                    exe.close()
        x = arrays["host_x"].copy()
        results[name] = x
        err = float(np.max(np.abs(x.astype(np.float64) - exact)))
        rows.append((name, int(arrays["host_iters"][0]), float(np.median(walls[1:])),
                     float(arrays["host_residual"][0]), err))
    print(f"while_converge: {dev.name}, n={n}, diag={args.diag}, tol={args.tol:g}, "
          f"median of {args.repeat} solves")
    print(f"{'executor':<18} {'iterations':>10} {'wall ms':>9} {'residual':>10} "
          f"{'max |x - x64|':>14}")
    for name, iters, wall, res, err in rows:
        print(f"{name:<18} {iters:>10d} {wall:>9.3f} {res:>10.3g} {err:>14.3g}")
    host = rows[-1][2]
    for name, _, wall, _, _ in rows[:-1]:
        print(f"{name}: {host / wall:.1f}x faster than the host-driven loop")
    ok = True
    if len({r[1] for r in rows}) != 1:
        print("FAIL: the executors ran different numbers of iterations")
        ok = False
    if any(not np.array_equal(results[k], results["graph-build"]) for k in results):
        print("FAIL: the executors' results differ")
        ok = False
    for name, iters, _, res, err in rows:
        if not (res <= args.tol or iters == args.max_iters) or err > bound:
            print(f"FAIL: {name}: residual {res:.3g}, error {err:.3g} (bound {bound:.3g})")
            ok = False
    print("OK: every result within the bound of the float64 solve" if ok else "FAILED")
    for p in pins.values():
        p.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

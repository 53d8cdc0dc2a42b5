"""What a CUDA graph launch costs the host and the GPU, per node kind and size (needs a GPU).

    python benchmarks/probe_graph_launch.py [--launches 30] [--json FILE] [--quick]

Pure cuda-python (``cuGraphCreate`` / ``cuGraphAdd*Node`` / ``cuGraphInstantiate`` /
``cuGraphLaunch``) plus orchestra's compiler for the two kernels (NVRTC via
`orchestra.compiler.compile`). Every graph is built explicitly and measured the same way:

- **host µs**: the time until ``cuGraphLaunch`` returns, the GPU drained first
  (``cuStreamSynchronize`` before each launch), median of ``--launches`` (>= 30) launches;
- **GPU ms**: timing events recorded on the launch stream right before and after the same
  launches, median;
- **first launch**: the host time of the first launch of a fresh instantiation without
  ``cuGraphUpload``, and of another fresh one after ``cuGraphUpload`` (the upload maps the
  graph's resources ahead).

Graphs (every node of one graph depends on the one before it, except where it says fan-out or
roots, so GPU time per node is one node's time):

- chains of empty kernels (1, 64, 1024, 7168 nodes), a fan-out (one root, 64 / 1024 / 7168
  children) and independent roots (64 / 1024 single-node chains);
- memcpy nodes H2D and D2H of 4 KiB - 64 MiB, the pinned host side addressed as
  ``CU_MEMORYTYPE_HOST`` (``srcHost`` / ``dstHost``, what orchestra's graph executors build), as
  ``CU_MEMORYTYPE_DEVICE`` with its UVA pointer, and as ``CU_MEMORYTYPE_UNIFIED``;
- memory alloc / free node pairs (64 KiB and 1 MiB, 64 and 1024 pairs);
- copy kernels: a grid-stride 16-byte copy (``uint4`` loads and stores) that reads (H2D) or
  writes (D2H) the pinned host memory through its UVA address, at grids 4 - 264 blocks of 256
  threads, for the same sizes as the memcpy nodes.

Copies per graph: 64 up to 1 MiB, 16 at 4 MiB, 4 at 16 and 64 MiB. Every copy graph's output is
checked once after its timed launches (the destination poisoned first, compared byte for byte).

The crossover per direction is the smallest size from which the memcpy node is no dearer than
the best copy kernel at every larger size measured, judged twice: by GPU µs per node, and by
cost per node = max(host µs per node, GPU µs per node) (a graph launch pays whichever is
larger when it is the only work). The next step chooses the default lowering from it.
Expected on an H200: about 40 s in all (``--quick``: about 10 s, fewer sizes and grids).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

try:
    import orchestra  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
SIZES = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
QUICK_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB)
GRIDS = (4, 16, 64, 132, 264)
QUICK_GRIDS = (16, 132)
BLOCK = 256
ADDRESSING = ("host", "uva-device", "unified")

SOURCE = r"""
extern "C" __global__ void empty_kernel() {}

// Grid-stride copy of n16 16-byte words; either side may be pinned host memory through its
// UVA address (the SMs load and store over PCIe).
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                  unsigned long long n16)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n16; i += stride)
        dst[i] = src[i];
}
"""


def copies_for(size: int) -> int:
    """Copy nodes per graph for copies of ``size`` bytes."""
    if size <= 1 * MIB:
        return 64
    return 16 if size <= 4 * MIB else 4


def fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def crossover(sizes, memcpy_cost, kernel_cost):
    """The smallest size from which ``memcpy_cost[s] <= kernel_cost[s]`` holds for it and
    every larger size in ``sizes``; None when the memcpy node loses at the largest size.
    Sizes with a missing cost on either side are skipped."""
    both = [s for s in sorted(sizes) if s in memcpy_cost and s in kernel_cost]
    best = None
    for s in reversed(both):
        if memcpy_cost[s] <= kernel_cost[s]:
            best = s
        else:
            break
    return best


def crossovers(rows) -> dict:
    """Per direction: the crossover by GPU time and by cost (see the module doc), with the
    best copy-kernel grid per size."""
    out = {}
    for direction in ("h2d", "d2h"):
        mem_gpu, mem_cost, k_gpu, k_cost, best_grid = {}, {}, {}, {}, {}
        for r in rows:
            if r.get("direction") != direction or not r.get("ok", True):
                continue
            s = r["size"]
            g, c = r["gpu_us_per_node"], r["cost_us_per_node"]
            if r["kind"] == "memcpy":
                mem_gpu[s] = min(mem_gpu.get(s, g), g)
                mem_cost[s] = min(mem_cost.get(s, c), c)
            elif r["kind"] == "copy-kernel":
                if c < k_cost.get(s, float("inf")):
                    best_grid[s] = r["grid"]
                k_gpu[s] = min(k_gpu.get(s, g), g)
                k_cost[s] = min(k_cost.get(s, c), c)
        sizes = sorted(set(mem_gpu) | set(k_gpu))
        out[direction] = {"by_gpu": crossover(sizes, mem_gpu, k_gpu),
                          "by_cost": crossover(sizes, mem_cost, k_cost),
                          "best_grid": {str(s): g for s, g in sorted(best_grid.items())}}
    return out


def describe_crossover(value, sizes) -> str:
    if value is None:
        return f"above {fmt_size(max(sizes))} (copy kernels win at every size measured)"
    if value == min(sizes):
        return f"{fmt_size(value)} or below (memcpy nodes win at every size measured)"
    return f"{fmt_size(value)}"


# -- the GPU side ---------------------------------------------------------------------------------


class Probe:
    """A context, a stream, two events, the kernels and the pinned / device buffers."""

    def __init__(self, launches: int, max_size: int):
        from cuda.bindings import driver as d

        from orchestra.compiler import compile as nvrtc_compile

        self.d, self.launches = d, launches
        ok = self.ok
        ok(d.cuInit(0))
        self.dev = ok(d.cuDeviceGet(0))
        self.ctx = ok(d.cuDevicePrimaryCtxRetain(self.dev))
        ok(d.cuCtxSetCurrent(self.ctx))
        major = ok(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev))
        minor = ok(d.cuDeviceGetAttribute(
            d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev))
        self.name = ok(d.cuDeviceGetName(64, self.dev)).split(b"\0")[0].decode()
        cubin = nvrtc_compile(SOURCE, arch=f"sm_{major}{minor}").cubin
        self.module = ok(d.cuModuleLoadData(cubin))
        self.empty = ok(d.cuModuleGetFunction(self.module, b"empty_kernel"))
        self.copy16 = ok(d.cuModuleGetFunction(self.module, b"copy16"))
        self.stream = ok(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.ev0, self.ev1 = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
        self.max_size = max_size
        self.h_src = ok(d.cuMemHostAlloc(max_size, 0))   # pinned, H2D source (pattern A)
        self.h_dst = ok(d.cuMemHostAlloc(max_size, 0))   # pinned, D2H destination
        self.d_dst = ok(d.cuMemAlloc(max_size))          # H2D destination
        self.d_src = ok(d.cuMemAlloc(max_size))          # D2H source (pattern B)
        words = max_size // 4
        self.pat_a = (np.arange(words, dtype=np.uint32) * np.uint32(2654435761)) ^ np.uint32(7)
        self.pat_b = self.pat_a[::-1].copy()
        self.host_view(self.h_src)[:] = self.pat_a
        ok(d.cuMemcpyHtoD(self.d_src, self.pat_b.ctypes.data, max_size))
        self._keep = []

    def ok(self, res):
        if int(res[0]):
            from orchestra.driver.check import error_from_result

            raise error_from_result("probe_graph_launch driver call", res[0])
        return res[1] if len(res) == 2 else (None if len(res) == 1 else res[1:])

    def host_view(self, ptr) -> np.ndarray:
        buf = (ctypes.c_uint32 * (self.max_size // 4)).from_address(int(ptr))
        return np.frombuffer(buf, dtype=np.uint32)

    # -- node builders ---------------------------------------------------------------------

    def kernel_params(self, func, grid, args):
        d = self.d
        p = d.CUDA_KERNEL_NODE_PARAMS()
        p.func = func
        p.gridDimX, p.gridDimY, p.gridDimZ = grid, 1, 1
        p.blockDimX, p.blockDimY, p.blockDimZ = BLOCK if args else 32, 1, 1
        p.sharedMemBytes = 0
        if args:
            vals = [ctypes.c_uint64(int(a)) for a in args]
            arr = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
            self._keep.append((vals, arr))
            p.kernelParams = ctypes.addressof(arr)
        else:
            p.kernelParams = 0
        p.extra = 0
        return p

    def memcpy_params(self, direction, size, addressing):
        d = self.d
        mt = d.CUmemorytype
        p = d.CUDA_MEMCPY3D()
        host = self.h_src if direction == "h2d" else self.h_dst
        dev = self.d_dst if direction == "h2d" else self.d_src
        side = "src" if direction == "h2d" else "dst"
        other = "dst" if side == "src" else "src"
        if addressing == "host":
            setattr(p, f"{side}MemoryType", mt.CU_MEMORYTYPE_HOST)
            setattr(p, f"{side}Host", int(host))
        else:
            kind = mt.CU_MEMORYTYPE_DEVICE if addressing == "uva-device" else \
                mt.CU_MEMORYTYPE_UNIFIED
            setattr(p, f"{side}MemoryType", kind)
            setattr(p, f"{side}Device", int(host))  # UVA: the pinned pointer is valid there
        setattr(p, f"{other}MemoryType", mt.CU_MEMORYTYPE_DEVICE)
        setattr(p, f"{other}Device", int(dev))
        p.WidthInBytes = size
        p.Height = 1
        p.Depth = 1
        return p

    def build(self, add_nodes):
        """A graph built by ``add_nodes(graph)``; returns it."""
        g = self.ok(self.d.cuGraphCreate(0))
        add_nodes(g)
        return g

    def chain(self, g, count, add_one):
        prev = None
        for _ in range(count):
            deps = [prev] if prev is not None else None
            prev = add_one(g, deps, 1 if prev is not None else 0)

    # -- measurement ------------------------------------------------------------------------

    def measure(self, g, nodes: int, check=None) -> dict:
        """Host and GPU time of ``g``'s launches (see the module doc); ``check()`` -> (ok,
        detail) after one more launch whose destination it poisoned first."""
        d, ok, s = self.d, self.ok, self.stream
        out = {"nodes": nodes}
        exe = ok(d.cuGraphInstantiate(g, 0))
        ok(d.cuStreamSynchronize(s))
        t0 = time.perf_counter_ns()
        ok(d.cuGraphLaunch(exe, s))
        out["first_launch_us"] = (time.perf_counter_ns() - t0) / 1e3
        ok(d.cuStreamSynchronize(s))
        ok(d.cuGraphExecDestroy(exe))
        exe = ok(d.cuGraphInstantiate(g, 0))
        ok(d.cuGraphUpload(exe, s))
        ok(d.cuStreamSynchronize(s))
        t0 = time.perf_counter_ns()
        ok(d.cuGraphLaunch(exe, s))
        out["first_launch_uploaded_us"] = (time.perf_counter_ns() - t0) / 1e3
        ok(d.cuStreamSynchronize(s))
        host, gpu = [], []
        try:
            for _ in range(self.launches):
                ok(d.cuStreamSynchronize(s))  # drained: only the call itself is timed
                ok(d.cuEventRecord(self.ev0, s))
                t0 = time.perf_counter_ns()
                (err,) = d.cuGraphLaunch(exe, s)
                t1 = time.perf_counter_ns()
                ok((err,))
                ok(d.cuEventRecord(self.ev1, s))
                ok(d.cuEventSynchronize(self.ev1))
                host.append((t1 - t0) / 1e3)
                gpu.append(float(ok(d.cuEventElapsedTime(self.ev0, self.ev1))))
            if check is not None:
                poison, compare = check
                poison()
                ok(d.cuGraphLaunch(exe, s))
                ok(d.cuStreamSynchronize(s))
                out["ok"], out["check"] = compare()
        finally:
            d.cuStreamSynchronize(s)
            d.cuGraphExecDestroy(exe)
            d.cuGraphDestroy(g)
            self._keep.clear()
        h, gm = statistics.median(host), statistics.median(gpu)
        out.update(host_us=h, gpu_ms=gm, host_us_per_node=h / nodes,
                   gpu_us_per_node=gm * 1e3 / nodes,
                   cost_us_per_node=max(h / nodes, gm * 1e3 / nodes), launches=len(host))
        return out

    def copy_check(self, direction, size):
        """(poison, compare) for a copy of ``size`` bytes in ``direction``."""
        d, ok, words = self.d, self.ok, size // 4

        if direction == "h2d":
            def poison():
                ok(d.cuMemsetD8(self.d_dst, 0xFF, size))

            def compare():
                got = np.empty(words, np.uint32)
                ok(d.cuMemcpyDtoH(got.ctypes.data, self.d_dst, size))
                good = np.array_equal(got, self.pat_a[:words])
                return good, "device copy == pinned source" if good else "H2D copy WRONG"
        else:
            view = self.host_view(self.h_dst)

            def poison():
                view[:words] = 0xFFFFFFFF

            def compare():
                good = np.array_equal(view[:words], self.pat_b[:words])
                return good, "pinned copy == device source" if good else "D2H copy WRONG"
        return poison, compare

    # -- the graphs -----------------------------------------------------------------------------

    def empty_chain(self, count):
        d, ok = self.d, self.ok
        params = self.kernel_params(self.empty, 1, ())

        def add(g):
            self.chain(g, count, lambda g, deps, n: ok(d.cuGraphAddKernelNode(g, deps, n, params)))
        return self.measure(self.build(add), count)

    def empty_fan_out(self, width, root: bool):
        d, ok = self.d, self.ok
        params = self.kernel_params(self.empty, 1, ())

        def add(g):
            deps, n = None, 0
            if root:
                deps, n = [ok(d.cuGraphAddKernelNode(g, None, 0, params))], 1
            for _ in range(width):
                ok(d.cuGraphAddKernelNode(g, deps, n, params))
        return self.measure(self.build(add), width + int(root))

    def memcpy_chain(self, direction, size, addressing):
        d, ok = self.d, self.ok
        params = self.memcpy_params(direction, size, addressing)
        k = copies_for(size)

        def add(g):
            self.chain(g, k, lambda g, deps, n: ok(d.cuGraphAddMemcpyNode(g, deps, n, params,
                                                                          self.ctx)))
        return self.measure(self.build(add), k, self.copy_check(direction, size))

    def copy_kernel_chain(self, direction, size, grid):
        d, ok = self.d, self.ok
        src, dst = ((self.h_src, self.d_dst) if direction == "h2d" else (self.d_src, self.h_dst))
        params = self.kernel_params(self.copy16, grid, (int(src), int(dst), size // 16))
        k = copies_for(size)

        def add(g):
            self.chain(g, k, lambda g, deps, n: ok(d.cuGraphAddKernelNode(g, deps, n, params)))
        return self.measure(self.build(add), k, self.copy_check(direction, size))

    def alloc_free_chain(self, pairs, size):
        d, ok = self.d, self.ok

        def add(g):
            prev = None
            for _ in range(pairs):
                p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
                p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                p.poolProps.location.id = int(self.dev)
                p.bytesize = size
                deps = [prev] if prev is not None else None
                a = ok(d.cuGraphAddMemAllocNode(g, deps, 1 if prev is not None else 0, p))
                dptr = p.dptr
                if int(dptr) == 0:  # the binding did not write the address back: ask the node
                    dptr = ok(d.cuGraphMemAllocNodeGetParams(a)).dptr
                prev = ok(d.cuGraphAddMemFreeNode(g, [a], 1, dptr))
        return self.measure(self.build(add), 2 * pairs)

    def close(self):
        d = self.d
        d.cuStreamSynchronize(self.stream)
        d.cuMemFree(self.d_dst)
        d.cuMemFree(self.d_src)
        d.cuMemFreeHost(self.h_src)
        d.cuMemFreeHost(self.h_dst)
        d.cuEventDestroy(self.ev0)
        d.cuEventDestroy(self.ev1)
        d.cuStreamDestroy(self.stream)
        d.cuModuleUnload(self.module)
        d.cuDevicePrimaryCtxRelease(self.dev)


def run(probe: Probe, sizes, grids, log) -> list[dict]:
    rows = []

    def add(row):
        rows.append(row)
        log(row)

    for count in (1, 64, 1024, 7168):
        add({"kind": "empty-kernel chain", "what": f"{count} nodes", **probe.empty_chain(count)})
    for width in (64, 1024, 7168):
        add({"kind": "empty-kernel fan-out", "what": f"1 root + {width}",
             **probe.empty_fan_out(width, True)})
    for width in (64, 1024):
        add({"kind": "empty-kernel roots", "what": f"{width} roots",
             **probe.empty_fan_out(width, False)})
    for pairs, size in ((64, 64 * KIB), (1024, 64 * KIB), (64, MIB)):
        add({"kind": "alloc/free", "what": f"{pairs} pairs of {fmt_size(size)}",
             **probe.alloc_free_chain(pairs, size)})
    for direction in ("h2d", "d2h"):
        for size in sizes:
            for addressing in ADDRESSING:
                add({"kind": "memcpy", "direction": direction, "size": size,
                     "what": f"{direction} {fmt_size(size)} {addressing}",
                     "addressing": addressing,
                     **probe.memcpy_chain(direction, size, addressing)})
            for grid in grids:
                add({"kind": "copy-kernel", "direction": direction, "size": size, "grid": grid,
                     "what": f"{direction} {fmt_size(size)} grid {grid}",
                     **probe.copy_kernel_chain(direction, size, grid)})
    return rows


HEAD = ("kind", "what", "nodes", "host us", "host us/node", "GPU ms", "GPU us/node",
        "first us", "first us (uploaded)", "check")


def cells(r) -> tuple:
    check = "-" if "ok" not in r else ("ok" if r["ok"] else "WRONG")
    return (r["kind"], r["what"], r["nodes"], f"{r['host_us']:.1f}",
            f"{r['host_us_per_node']:.3f}", f"{r['gpu_ms']:.3f}", f"{r['gpu_us_per_node']:.3f}",
            f"{r['first_launch_us']:.1f}", f"{r['first_launch_uploaded_us']:.1f}", check)


def format_table(rows) -> str:
    table = [HEAD] + [cells(r) for r in rows]
    widths = [max(len(str(t[i])) for t in table) for i in range(len(HEAD))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip()
                     for t in table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=30,
                    help="timed launches per graph, median (default 30, at least 30)")
    ap.add_argument("--json", metavar="FILE", help="also write every row and the crossover")
    ap.add_argument("--quick", action="store_true",
                    help=f"sizes {', '.join(fmt_size(s) for s in QUICK_SIZES)} and grids "
                         f"{', '.join(map(str, QUICK_GRIDS))} only")
    args = ap.parse_args(argv)
    from orchestra.driver import Device
    from orchestra.errors import NoDeviceError

    try:
        Device.get(0)
    except NoDeviceError as exc:
        print(f"probe_graph_launch: {exc}", file=sys.stderr)
        return 2
    sizes = QUICK_SIZES if args.quick else SIZES
    grids = QUICK_GRIDS if args.quick else GRIDS
    t_start = time.perf_counter()
    probe = Probe(max(30, args.launches), max(sizes))

    def log(row):
        print(f"[{time.perf_counter() - t_start:5.1f} s] {row['kind']}: {row['what']}: host "
              f"{row['host_us']:.1f} us, GPU {row['gpu_ms']:.3f} ms", file=sys.stderr,
              flush=True)

    try:
        rows = run(probe, sizes, grids, log)
    finally:
        probe.close()
    cross = crossovers(rows)
    print(f"probe_graph_launch: {probe.name}; host us = until cuGraphLaunch returns, GPU "
          f"drained first, median of {max(30, args.launches)}; GPU ms = events around the "
          "launch; every node of a chain after the one before it")
    print(format_table(rows))
    print()
    for direction, c in cross.items():
        print(f"crossover {direction}: memcpy nodes no dearer than the best copy kernel from "
              f"{describe_crossover(c['by_cost'], sizes)} by max(host, GPU) per node; from "
              f"{describe_crossover(c['by_gpu'], sizes)} by GPU time per node; best copy-kernel "
              f"grid per size: " + ", ".join(f"{fmt_size(int(s))}: {g}"
                                             for s, g in c["best_grid"].items()))
    bad = [r["what"] for r in rows if r.get("ok") is False]
    if bad:
        print(f"COPY CHECK FAILED: {', '.join(bad)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"device": probe.name, "launches": max(30, args.launches), "block": BLOCK,
             "rows": rows, "crossover": cross,
             "elapsed_s": round(time.perf_counter() - t_start, 1)}, indent=1))
        print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

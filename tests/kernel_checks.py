#!/usr/bin/env python3
"""GPU checks of the kernel library: each kernel against its numpy reference on random data with
ragged sizes. One named check per kernel (or kernel variant); runnable standalone, so the same
checks run under compute-sanitizer:

    python3 tests/kernel_checks.py --list
    python3 tests/kernel_checks.py pipeline_block_2 [more names...]
    python3 tests/kernel_checks.py all
    python3 tests/kernel_checks.py --isolate all        # each check in its own process
    compute-sanitizer --tool racecheck python3 tests/kernel_checks.py --small --isolate all
    tests/run_sanitizers.sh                              # tools x checks, one process each

Exit status 0 when every selected check passed (or was skipped for a too-old GPU), 1 when one
failed, 2 for bad usage. ``--small`` caps the large sizes (use it under racecheck, which is
slow). In one process a failed check does not stop the others, except a sticky CUDA error (an
unusable context, e.g. after a sanitizer killed a kernel): then the rest cannot run, which is why
``--isolate`` runs every check in a child process (compute-sanitizer follows child processes:
``--target-processes all`` is its default) with a timeout (``--timeout``, seconds).
``--build-cubins DIR`` compiles every kernel here (no GPU) into DIR; ``--cubins DIR`` (or
``$ORCHESTRA_KERNEL_CUBINS``) makes the checks load those cubins instead of compiling: how
kernels built by a newer NVRTC reach a GPU machine with an older one (docs/kernels.md, synccheck).
tests/test_kernels_gpu.py runs each check in a subprocess with a timeout, so a kernel that hangs
fails its test instead of hanging the suite.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

# Runnable from anywhere without an install: the repository root holds the package.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402

from orchestra.app.kernels_bench import catalog as cat  # noqa: E402
from orchestra.app.kernels_bench import reference as ref  # noqa: E402


class CheckFailed(AssertionError):
    pass


class Skip(Exception):
    pass


CHECKS: dict = {}


def check(name: str):
    def register(fn):
        CHECKS[name] = fn
        return fn
    return register


class Ctx:
    """Device, stream, random numbers and buffer helpers for one run."""

    def __init__(self, small: bool, seed: int = 1234):
        from orchestra.driver import Device, Stream

        self.small = small
        self.device = Device.get(0)
        self.device.make_current()
        self.stream = Stream(self.device)
        self.rng = np.random.default_rng(seed)
        self.large = 100_003 if small else 1_000_003  # odd on purpose
        self._keep: list = []

    def kernel(self, key: str):
        s = cat.spec(key)
        if tuple(self.device.compute_capability) < tuple(s.min_cc):
            raise Skip(f"{key} needs compute capability {s.min_cc}, the device has"
                       f" {self.device.compute_capability}")
        return cat.load(s, self.device)

    def randn(self, n: int) -> np.ndarray:
        return self.rng.standard_normal(n).astype(np.float32)

    def upload(self, arr: np.ndarray):
        from orchestra.driver import DeviceBuffer, PinnedBuffer

        arr = np.ascontiguousarray(arr)
        pin = PinnedBuffer.empty(arr.shape, arr.dtype, self.device)
        pin.array[...] = arr
        buf = DeviceBuffer.allocate(arr.nbytes, self.stream)
        buf.copy_from_host(pin, self.stream, sync=True)
        pin.close()
        return buf

    def output(self, n: int, dtype=np.float32):
        """A device buffer of n elements filled with 0xFF bytes (NaN for floats), so an element
        the kernel fails to write can never match the reference."""
        from orchestra.driver import DeviceBuffer

        buf = DeviceBuffer.allocate(n * np.dtype(dtype).itemsize, self.stream)
        buf.memset(0xFF, self.stream)
        return buf

    def download(self, buf, n: int, dtype=np.float32) -> np.ndarray:
        from orchestra.driver import PinnedBuffer

        pin = PinnedBuffer.empty((n,), dtype, self.device)
        buf.copy_to_host(pin, self.stream, sync=True)
        out = pin.array.copy()
        pin.close()
        return out

    def aligned16(self, *bufs) -> None:
        for b in bufs:
            if b.ptr % 16:
                raise CheckFailed(f"device buffer at 0x{b.ptr:x} is not 16-byte aligned; the"
                                  " kernel requires it")

    def expect(self, what: str, got, want, **tol) -> None:
        ok, detail = ref.close(got, want, **tol)
        if not ok:
            raise CheckFailed(f"{what}: {detail}")
        print(f"    ok  {what}")


def _grids(ctx: Ctx, blocks_needed: int) -> list[int]:
    """A small grid (many tiles per block: the pipelines' steady state) and one big enough for
    a tile per block (prologue straight into epilogue)."""
    return sorted({min(3, blocks_needed), max(1, blocks_needed)})


# -- unified block pipeline, 1..4 stages --------------------------------------------------------

def _pipeline_block(ctx: Ctx, stages: int) -> None:
    k = ctx.kernel(f"pipeline_block<{stages}>")
    block = 256
    tile = cat.pipeline_block_tile(block)
    smem = cat.pipeline_block_smem(stages, block)
    a, b = 1.5, -0.25
    for n in (1, 3, block - 1, block + 1, tile - 1, tile + 5, 3 * tile + 7, ctx.large):
        x = ctx.randn(n)
        dx, dy = ctx.upload(x), ctx.output(n)
        ctx.aligned16(dx, dy)
        for grid in _grids(ctx, -(-n // tile)):
            dy.memset(0xFF, ctx.stream)
            k.launch(ctx.stream, grid, block, (dx, dy, n, a, b), smem)
            ctx.stream.synchronize()
            ctx.expect(f"n={n} grid={grid}", ctx.download(dy, n), ref.pipeline_block(x, a, b))
        dx.free()
        dy.free()


for _s in cat.STAGE_COUNTS:
    check(f"pipeline_block_{_s}")(lambda ctx, _s=_s: _pipeline_block(ctx, _s))


@check("pipeline_thread")
def _pipeline_thread(ctx: Ctx) -> None:
    k = ctx.kernel("pipeline_thread")
    block = 256
    c = 0.25
    for n in (1, 3, block - 1, block + 1, 4 * block + 3, ctx.large):
        x = ctx.randn(n)
        dx, dy = ctx.upload(x), ctx.output(n)
        ctx.aligned16(dx, dy)
        for grid in _grids(ctx, -(-n // (4 * block))):
            dy.memset(0xFF, ctx.stream)
            k.launch(ctx.stream, grid, block, (dx, dy, n, c), cat.pipeline_thread_smem(block))
            ctx.stream.synchronize()
            ctx.expect(f"n={n} grid={grid}", ctx.download(dy, n), ref.pipeline_thread(x, c))
        dx.free()
        dy.free()


@check("pipeline_primitives")
def _pipeline_primitives(ctx: Ctx) -> None:
    k = ctx.kernel("pipeline_primitives")
    for block in (256, 96):
        tile = 4 * block
        for n in (1, 2, block - 1, block + 1, tile - 1, tile + 1, 5 * tile + 3, ctx.large):
            x = ctx.randn(n)
            dx, dy = ctx.upload(x), ctx.output(n)
            ctx.aligned16(dx, dy)
            for grid in _grids(ctx, -(-n // tile)):
                dy.memset(0xFF, ctx.stream)
                k.launch(ctx.stream, grid, block, (dx, dy, n),
                         cat.pipeline_primitives_smem(block))
                ctx.stream.synchronize()
                ctx.expect(f"block={block} n={n} grid={grid}", ctx.download(dy, n),
                           ref.pipeline_primitives(x, block))
            dx.free()
            dy.free()


@check("producer_consumer")
def _producer_consumer(ctx: Ctx) -> None:
    k = ctx.kernel("producer_consumer")
    block = 128
    for buffer_len in (1, 100, 256):
        for n in (1, buffer_len - 1 or 1, buffer_len + 1, 7 * buffer_len + 3, ctx.large):
            x = ctx.randn(n)
            dx, dy = ctx.upload(x), ctx.output(n)
            for grid in _grids(ctx, -(-n // buffer_len)):
                dy.memset(0xFF, ctx.stream)
                k.launch(ctx.stream, grid, block, (dx, dy, n, buffer_len),
                         cat.producer_consumer_smem(buffer_len))
                ctx.stream.synchronize()
                ctx.expect(f"buffer_len={buffer_len} n={n} grid={grid}", ctx.download(dy, n),
                           ref.producer_consumer(x))
            dx.free()
            dy.free()


@check("warp_specialized")
def _warp_specialized(ctx: Ctx) -> None:
    k = ctx.kernel("warp_specialized")
    block, tile = cat.WARP_SPECIALIZED_THREADS, cat.WARP_SPECIALIZED_TILE
    a, b = 0.75, 0.5
    for n in (1, 3, block - 1, block + 1, tile - 1, tile + 2, 9 * tile + 1, ctx.large):
        x = ctx.randn(n)
        dx, dy = ctx.upload(x), ctx.output(n)
        ctx.aligned16(dx, dy)
        for grid in _grids(ctx, -(-n // tile)):
            dy.memset(0xFF, ctx.stream)
            k.launch(ctx.stream, grid, block, (dx, dy, n, a, b))
            ctx.stream.synchronize()
            ctx.expect(f"n={n} grid={grid}", ctx.download(dy, n), ref.warp_specialized(x, a, b))
        dx.free()
        dy.free()


@check("early_exit_segments")
def _early_exit_segments(ctx: Ctx) -> None:
    k = ctx.kernel("early_exit_segments")
    block = 128
    for nseg, max_len in ((1, 5), (block - 1, 40), (block + 1, 1), (1000 if ctx.small else 5000, 60)):
        off = ref.ragged_offsets(ctx.rng, nseg, max_len)
        total = int(off[-1])
        x = ctx.randn(max(total, 1))
        dx, doff, dy = ctx.upload(x), ctx.upload(off), ctx.output(max(total, 1))
        k.launch(ctx.stream, -(-nseg // block), block, (dx, dy, doff, nseg),
                 cat.early_exit_segments_smem(block))
        ctx.stream.synchronize()
        got = ctx.download(dy, max(total, 1))[:total]
        ctx.expect(f"nseg={nseg} floats={total}", got, ref.early_exit_segments(x[:total], off),
                   rtol=1e-6, atol=1e-6)
        dx.free()
        doff.free()
        dy.free()


@check("early_exit_warps")
def _early_exit_warps(ctx: Ctx) -> None:
    k = ctx.kernel("early_exit_warps")
    for block in (256, 32):
        for nseg, max_len in ((1, 3), (9, 100), (300 if ctx.small else 2000, 300)):
            off = ref.ragged_offsets(ctx.rng, nseg, max_len)
            total = int(off[-1])
            x = ctx.randn(max(total, 1))
            dx, doff, ds = ctx.upload(x), ctx.upload(off), ctx.output(nseg)
            k.launch(ctx.stream, -(-nseg * 32 // block), block, (dx, ds, doff, nseg),
                     cat.early_exit_warps_smem(block))
            ctx.stream.synchronize()
            ctx.expect(f"block={block} nseg={nseg} floats={total}", ctx.download(ds, nseg),
                       ref.early_exit_warps(x[:total], off), rtol=1e-4, atol=1e-3)
            dx.free()
            doff.free()
            ds.free()


# -- programmatic dependent launch ----------------------------------------------------------------

def _pdl_allowed(key: str) -> bool:
    from orchestra.app.kernels_bench.pdl import kernel_waits_on_grid_dependency

    ptx, entry = cat.ptx_text(cat.spec(key))
    return kernel_waits_on_grid_dependency(ptx, entry)


@check("pdl_pair")
def _pdl_pair(ctx: Ctx) -> None:
    prim, sec = ctx.kernel("pdl_primary"), ctx.kernel("pdl_secondary")
    if not _pdl_allowed("pdl_secondary"):
        raise CheckFailed("pdl_secondary does not wait on its grid dependency")
    block = 256
    for n in (1, block - 1, block + 1, ctx.large):
        x, w = ctx.randn(n), ctx.randn(n)
        dx, dw, dy, dz = ctx.upload(x), ctx.upload(w), ctx.output(n), ctx.output(n)
        grid = -(-n // block)
        for pdl in (False, True):
            for rep in range(3):  # repeated: the early start is a race if the wait were missing
                dy.memset(0xFF, ctx.stream)
                dz.memset(0xFF, ctx.stream)
                prim.launch(ctx.stream, grid, block, (dx, dy, n))
                sec.launch(ctx.stream, grid, block, (dy, dw, dz, n), pdl=pdl)
            ctx.stream.synchronize()
            ctx.expect(f"n={n} pdl={pdl}", ctx.download(dz, n), ref.pdl_pair(x, w))
        for b in (dx, dw, dy, dz):
            b.free()


@check("pdl_c12")
def _pdl_c12(ctx: Ctx) -> None:
    """Case C12: PDL is refused for a consumer that never waits; launched without PDL it is
    correct."""
    from orchestra.app.kernels_bench.pdl import PdlWithoutWaitError, require_grid_dependency_wait

    ptx, entry = cat.ptx_text(cat.spec("pdl_secondary_nowait"))
    try:
        require_grid_dependency_wait(ptx, entry)
    except PdlWithoutWaitError as exc:
        print(f"    ok  refused: {exc}")
    else:
        raise CheckFailed("pdl_secondary_nowait was not recognised as a kernel that never waits")
    for key in ("pdl_secondary", "pdl_chain_step", "pdl_chain_step_after_wait"):
        ptx, entry = cat.ptx_text(cat.spec(key))
        require_grid_dependency_wait(ptx, entry)  # must not raise
        print(f"    ok  {key} waits on its grid dependency")
    prim, sec = ctx.kernel("pdl_primary"), ctx.kernel("pdl_secondary_nowait")
    n, block = ctx.large, 256
    x, w = ctx.randn(n), ctx.randn(n)
    dx, dw, dy, dz = ctx.upload(x), ctx.upload(w), ctx.output(n), ctx.output(n)
    prim.launch(ctx.stream, -(-n // block), block, (dx, dy, n))
    sec.launch(ctx.stream, -(-n // block), block, (dy, dw, dz, n))  # no PDL: stream order holds
    ctx.stream.synchronize()
    ctx.expect(f"nowait consumer without PDL, n={n}", ctx.download(dz, n), ref.pdl_pair(x, w))
    for b in (dx, dw, dy, dz):
        b.free()


@check("pdl_chain")
def _pdl_chain(ctx: Ctx) -> None:
    n, block, steps = 1000, 256, 101
    x0 = ctx.randn(n)
    for key in ("pdl_chain_step", "pdl_chain_step_after_wait"):
        k = ctx.kernel(key)
        if not _pdl_allowed(key):
            raise CheckFailed(f"{key} does not wait on its grid dependency")
        for pdl in (False, True):
            bufs = [ctx.upload(x0), ctx.output(n)]
            for i in range(steps):  # as in the bench: every link but the first carries PDL
                k.launch(ctx.stream, -(-n // block), block, (bufs[i % 2], bufs[(i + 1) % 2], n),
                         pdl=pdl and i > 0)
            ctx.stream.synchronize()
            ctx.expect(f"{key}: {steps} steps pdl={pdl}", ctx.download(bufs[steps % 2], n),
                       ref.pdl_chain(x0, steps), rtol=0, atol=0)
            for b in bufs:
                b.free()


# -- clusters and distributed shared memory -------------------------------------------------------

@check("cluster_dsmem")
def _cluster_dsmem(ctx: Ctx) -> None:
    k = ctx.kernel("cluster_dsmem")
    for block in (128, 256):
        for cluster in (1, 2, 4, 8):
            for n in (1, block - 1, block + 1, 5 * block + 3, ctx.large):
                grid = cat.cluster_grid(n, block, cluster)
                x = ctx.randn(n)
                dx, dy = ctx.upload(x), ctx.output(n)
                k.launch(ctx.stream, grid, block, (dx, dy, n), block * 4,
                         cluster=(cluster, 1, 1))
                ctx.stream.synchronize()
                ctx.expect(f"block={block} cluster={cluster} n={n}", ctx.download(dy, n),
                           ref.cluster_dsmem(x, block, cluster, grid))
                dx.free()
                dy.free()


@check("cluster_dsmem_pair")
def _cluster_dsmem_pair(ctx: Ctx) -> None:
    k = ctx.kernel("cluster_dsmem_pair")  # __cluster_dims__(2, 1, 1): no launch attribute
    block = 128
    for n in (1, block + 1, 3 * block, ctx.large):
        grid = cat.cluster_grid(n, block, 2)
        x = ctx.randn(n)
        dx, dy = ctx.upload(x), ctx.output(n)
        k.launch(ctx.stream, grid, block, (dx, dy, n), block * 4)
        ctx.stream.synchronize()
        ctx.expect(f"n={n} grid={grid}", ctx.download(dy, n), ref.cluster_dsmem(x, block, 2, grid))
        dx.free()
        dy.free()


# -- hand-written PTX -----------------------------------------------------------------------------

@check("cp_async_scale")
def _cp_async_scale(ctx: Ctx) -> None:
    k = ctx.kernel("cp_async_scale")
    scale = -1.75
    for block in (cat.CP_ASYNC_MAX_THREADS, 64):
        for n in (1, 2, 3, 5, 4 * block - 1, 4 * block + 1, 8 * block + 3, ctx.large):
            x = ctx.randn(n)
            dx, dy = ctx.upload(x), ctx.output(n)
            ctx.aligned16(dx, dy)
            for grid in _grids(ctx, -(-n // (4 * block))):
                dy.memset(0xFF, ctx.stream)
                k.launch(ctx.stream, grid, block, (dx, dy, n, scale))
                ctx.stream.synchronize()
                ctx.expect(f"block={block} n={n} grid={grid}", ctx.download(dy, n),
                           ref.cp_async_scale(x, scale), rtol=0, atol=0)
            dx.free()
            dy.free()


# -- the copy kernel (host <-> device copies lowered to the SMs) --------------------------------

_COPY_OFFSETS = ((0, 0), (1, 1), (3, 7), (4, 0), (8, 8), (8, 0), (0, 12), (5, 13), (15, 1))


def _page_aligned(nbytes: int) -> np.ndarray:
    """A fresh numpy byte array starting on a 4 KiB page (for register_host)."""
    raw = np.zeros(nbytes + 8192, np.uint8)
    start = (-raw.ctypes.data) % 4096
    return raw[start:start + nbytes]


@check("copy_kernel")
def _copy_kernel(ctx: Ctx) -> None:
    """cuda_src/copy.cu launched directly: H2D and D2H between pinned host memory (a
    PinnedBuffer and a registered array, both addressed at their host pointer) and device
    memory, ragged sizes, every relative alignment (16-, 8-, 4-byte and byte paths), heads and
    tails, one block and the lowering's grid; the bytes around each copy must stay untouched."""
    from cuda.bindings import driver as d

    from orchestra.driver import DeviceBuffer, PinnedBuffer, register_host
    from orchestra.execute.lowering.copy import copy_kernel_ref
    from orchestra.execute.lowering.copy_policy import COPY_BLOCK, copy_grid
    from orchestra.kernel import load_kernel

    dev = ctx.device
    if not dev.kernel_host_access:
        raise Skip("the device's kernels cannot address pinned host memory")
    ref = copy_kernel_ref()
    k = load_kernel(ref.source, ref.name, params=ref.params, device=dev)
    big = (64 << 10) if ctx.small else (1 << 20)
    sizes = (1, 2, 3, 15, 16, 17, 31, 255, 4096, 4099, 65541, big + 3)
    cap = max(sizes) + 64
    pin = PinnedBuffer(cap, dev)
    reg_array = _page_aligned(cap)
    reg = register_host(reg_array, dev)
    dbuf = DeviceBuffer.allocate(cap, ctx.stream)
    scratch = PinnedBuffer(cap, dev)
    pattern = ctx.rng.integers(0, 256, cap, dtype=np.uint8)  # what the sources hold
    backwards = pattern[::-1].copy()
    try:
        for name, host, hptr in (("PinnedBuffer", pin.view(np.uint8), pin.ptr),
                                 ("register_host", reg_array, reg.ptr)):
            err, mapped = d.cuMemHostGetDevicePointer(hptr, 0)
            if int(err) or int(mapped) != hptr:
                raise CheckFailed(f"{name}: cuMemHostGetDevicePointer gave {err}, "
                                  f"{int(mapped) if not int(err) else 0:#x} for host {hptr:#x}: "
                                  "kernels cannot use the host pointer")
            print(f"    ok  {name}: device pointer == host pointer ({hptr:#x})")
            for n in sizes:
                for ho, do in _COPY_OFFSETS:
                    for grid in sorted({1, copy_grid(n, dev.sm_count)}):
                        # H2D: host[ho, ho+n) -> device[do, do+n)
                        host[:] = pattern
                        dbuf.memset(0xAB, ctx.stream)
                        k.launch(ctx.stream, grid, COPY_BLOCK, (dbuf.ptr + do, hptr + ho, n, 0))
                        dbuf.copy_to_host(scratch, ctx.stream, sync=True)
                        got = scratch.view(np.uint8)
                        if not (np.array_equal(got[do:do + n], host[ho:ho + n])
                                and (got[:do] == 0xAB).all() and (got[do + n:] == 0xAB).all()):
                            raise CheckFailed(f"{name} H2D n={n} host+{ho} dev+{do} grid={grid}")
                        # D2H: device[do, do+n) -> host[ho, ho+n)
                        src = backwards
                        scratch.view(np.uint8)[:] = src
                        dbuf.copy_from_host(scratch, ctx.stream, sync=True)
                        host[:] = 0xCD
                        k.launch(ctx.stream, grid, COPY_BLOCK, (hptr + ho, dbuf.ptr + do, n, 1))
                        ctx.stream.synchronize()
                        if not (np.array_equal(host[ho:ho + n], src[do:do + n])
                                and (host[:ho] == 0xCD).all() and (host[ho + n:] == 0xCD).all()):
                            raise CheckFailed(f"{name} D2H n={n} host+{ho} dev+{do} grid={grid}")
            print(f"    ok  {name}: {len(sizes)} sizes x {len(_COPY_OFFSETS)} offset pairs, "
                  "both directions, bytes around each copy untouched")
    finally:
        ctx.stream.synchronize()
        dbuf.free(ctx.stream)
        ctx.stream.synchronize()
        reg.close()
        pin.close()
        scratch.close()


def _burn(x, iters=2):
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


@check("copy_lowering")
def _copy_lowering(ctx: Ctx) -> None:
    """The copy lowering through every executor (eager, capture, graph-build): a pipeline of
    ragged batches and a byte graph of odd sizes at odd offsets, with every copy a copy kernel
    and with every copy on the copy engines: outputs bit-identical to each other and to numpy;
    then replays of the copy-kernel graphs with rebound host arrays, each verified."""
    from orchestra.app.job.graphs import burn_kernel_ref
    from orchestra.driver import PinnedBuffer
    from orchestra.execute import EagerExecutor
    from orchestra.execute.cuda_graph.build import GraphBuildExecutor
    from orchestra.execute.cuda_graph.capture import CaptureExecutor
    from orchestra.graph import Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostToDevice
    from orchestra.graph import TaskGraph, build_pipeline

    dev = ctx.device
    if not dev.kernel_host_access:
        raise Skip("the device's kernels cannot address pinned host memory")
    sizes = [4096, 4100, 12, 65540, 16] if ctx.small else [4096, 4100, 12, 65540, 1 << 20, 16]
    total = sum(sizes)
    pipe, _ = build_pipeline(len(sizes), sizes, burn_kernel_ref(), scalars=(2, 0.5, 1.0),
                             host_in=HostBuffer("x", total), host_out=HostBuffer("y", total))
    odd = (1, 15, 17, 1000, 4099)
    nbytes = sum(odd) + 3
    bytes_graph = TaskGraph()
    hin, hout, dbuf = HostBuffer("in", nbytes), HostBuffer("out", nbytes), Buffer("d", nbytes)
    bytes_graph.add(Alloc("alloc", dbuf))
    off = 3
    for i, n in enumerate(odd):
        bytes_graph.add(HostToDevice(f"up{i}", hin.range(off, n), dbuf.range(off, n)))
        off += n
    off = 3
    for i, n in enumerate(odd):
        bytes_graph.add(DeviceToHost(f"down{i}", dbuf.range(off, n), hout.range(off, n)))
        off += n
    bytes_graph.add(Free("free", dbuf))
    keep = []

    def pinned(shape, dtype):
        p = PinnedBuffer.empty(shape, dtype, dev)
        keep.append(p)
        return p.array

    xs = [pinned(total // 4, np.float32) for _ in range(3)]
    ys = [pinned(total // 4, np.float32) for _ in range(3)]
    for x in xs:
        x[:] = ctx.randn(total // 4)
    bx, by = pinned(nbytes, np.uint8), pinned(nbytes, np.uint8)
    bx[:] = ctx.rng.integers(0, 256, nbytes, dtype=np.uint8)
    want_bytes = bx.copy()
    want_bytes[:3] = 0
    try:
        for kind in ("eager", "capture", "graph-build"):
            cls = {"eager": EagerExecutor, "capture": CaptureExecutor,
                   "graph-build": GraphBuildExecutor}[kind]
            with cls(dev) as ex:
                outs = {}
                for lowering in ("copy-engine", "kernel"):
                    ys[0][:] = np.nan
                    by[:] = 0
                    if kind == "eager":
                        res = ex.run(pipe, bindings={"x": xs[0], "y": ys[0]},
                                     copy_lowering=lowering)
                        copies = res.copy_kernels
                        ex.run(bytes_graph, bindings={"in": bx, "out": by},
                               copy_lowering=lowering)
                    else:
                        exe = ex.run(pipe, None, {"x": xs[0], "y": ys[0]},
                                     copy_lowering=lowering)
                        copies = exe.copy_kernels
                        exe.close()
                        ex.run(bytes_graph, None, {"in": bx, "out": by},
                               copy_lowering=lowering).close()
                    want = 2 * len(sizes) if lowering == "kernel" else 0
                    if copies != want:
                        raise CheckFailed(f"{kind} {lowering}: {copies} copy kernels, want {want}")
                    outs[lowering] = ys[0].copy()
                    if not np.array_equal(by, want_bytes):
                        raise CheckFailed(f"{kind} {lowering}: odd sizes / offsets wrong")
                if outs["kernel"].tobytes() != outs["copy-engine"].tobytes():
                    raise CheckFailed(f"{kind}: copy kernels and copy engines differ")
                ctx.expect(f"{kind}: copy kernels == copy engines == numpy", outs["kernel"],
                           _burn(xs[0]), rtol=0, atol=0)
                if kind == "eager":
                    continue
                exe = ex.build(pipe, bindings={"x": xs[0], "y": ys[0]}, copy_lowering="kernel")
                try:
                    for r in range(6):
                        i = r % 3
                        ys[i][:] = np.nan
                        exe.replay({"x": xs[i], "y": ys[i]})
                        if not np.array_equal(ys[i], _burn(xs[i])):
                            raise CheckFailed(f"{kind}: replay {r} with rebound arrays {i}")
                finally:
                    exe.close()
                print(f"    ok  {kind}: 6 replays rebinding 3 host array sets")
    finally:
        for p in keep:
            p.close()


# -- runner -------------------------------------------------------------------------------------

def run(names: list[str], small: bool = False) -> int:
    """Run the named checks in this process; 0 when all passed or skipped, 1 otherwise."""
    from orchestra.errors import CudaError

    ctx = Ctx(small)
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"[{name}]", flush=True)
        try:
            CHECKS[name](ctx)
        except Skip as exc:
            print(f"SKIP {name}: {exc}", flush=True)
            continue
        except CheckFailed as exc:
            print(f"FAIL {name}: {exc}", flush=True)
            failed.append(name)
            continue
        except CudaError as exc:
            print(f"FAIL {name}: {exc}", flush=True)
            failed.append(name)
            if exc.sticky:
                print("the CUDA context is unusable; stopping", flush=True)
                break
            continue
        except Exception:  # noqa: BLE001 - report and carry on with the other checks
            traceback.print_exc()
            print(f"FAIL {name}: unexpected error", flush=True)
            failed.append(name)
            continue
        print(f"PASS {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{len(names) - len(failed)} of {len(names)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def run_isolated(names: list[str], small: bool = False, cubins: str | None = None,
                 timeout: float = 900.0) -> int:
    """Run each named check in its own child process (this script), one after the other; a
    check whose child does not finish within ``timeout`` seconds is killed and failed. 0 when
    all passed or skipped, 1 otherwise."""
    failed = []
    for name in names:
        argv = [sys.executable, str(Path(__file__).resolve()), name]
        argv += ["--small"] if small else []
        argv += ["--cubins", cubins] if cubins else []
        sys.stdout.flush()
        try:
            rc = subprocess.run(argv, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"FAIL {name}: no result within {timeout:g} s (a hung kernel?); killed",
                  flush=True)
            rc = None
        if rc != 0:
            if rc not in (None, 1):
                print(f"FAIL {name}: its process exited with status {rc}", flush=True)
            failed.append(name)
    print(f"{len(names) - len(failed)} of {len(names)} checks passed (one process each)"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="check names, or 'all'")
    p.add_argument("--list", action="store_true", help="print the check names and exit")
    p.add_argument("--small", action="store_true",
                   help="smaller large sizes (for compute-sanitizer racecheck)")
    p.add_argument("--isolate", action="store_true",
                   help="run every check in its own child process")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="with --isolate: seconds a check may take (900)")
    p.add_argument("--cubins", metavar="DIR",
                   help="load the kernels from the prebuilt cubins in DIR (--build-cubins)")
    p.add_argument("--build-cubins", metavar="DIR",
                   help="compile every kernel for --arch into DIR and exit (no GPU needed)")
    p.add_argument("--arch", default="sm_90", help="with --build-cubins: target (sm_90)")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CHECKS))
        return 0
    if args.build_cubins:
        from orchestra.compiler import nvrtc_version

        for path in cat.build_cubins(args.build_cubins, arch=args.arch):
            print(path)
        print("NVRTC %d.%d, %s; use them with --cubins %s" % (*nvrtc_version(), args.arch,
                                                              args.build_cubins))
        return 0
    names = list(CHECKS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in CHECKS]
    if not names or unknown:
        print(f"unknown check(s): {', '.join(unknown)}; known: {', '.join(CHECKS)}, all"
              if unknown else "name at least one check, or 'all' (--list shows them)",
              file=sys.stderr)
        return 2
    if args.cubins:
        if not Path(args.cubins).is_dir():
            print(f"--cubins {args.cubins}: no such directory", file=sys.stderr)
            return 2
        os.environ[cat.PREBUILT_ENV] = str(Path(args.cubins).resolve())
    if args.isolate:
        return run_isolated(names, args.small, os.environ.get(cat.PREBUILT_ENV) or None,
                            args.timeout)
    from orchestra.errors import NoDeviceError

    try:
        return run(names, args.small)
    except NoDeviceError as exc:
        print(f"no GPU: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

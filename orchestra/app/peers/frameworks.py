"""CuPy and PyTorch contenders (needs a GPU and the peer installed; `optional.probe` decides).

Same kernel source for all: CuPy compiles cuda_src/burn.cu (and pdl.cu for the chain) itself
with ``cupy.RawKernel``; PyTorch has no way to compile a given CUDA source, so its rows launch
burn's orchestra-compiled cubin on torch's stream (``cuLaunchKernel`` through
`orchestra.kernel.Kernel.launch`) and use torch for streams, pinned tensors, copies and
``torch.cuda.graph``. The pinned host arrays are the benchmark's own (orchestra's
`PinnedBuffer`), viewed by torch with ``torch.from_numpy`` and by CuPy through their addresses.

Pipelines (``w`` as in `cuda_python`):

- `CuPyLoop`: the classic loop on three non-blocking CuPy streams, CuPy's memory pool;
- `CuPyGraph`: the same loop captured once with CuPy's stream capture (device buffers for
  every batch allocated up front, as a capture needs), launched per run;
- `TorchLoop`: the classic loop on three ``torch.cuda.Stream``s, the caching allocator,
  ``copy_(non_blocking=True)``;
- `TorchGraph`: the same captured with ``torch.cuda.graph`` (buffers up front), replayed.

Requests: `CuPyRequest`, `TorchRequest` (eager or graph). Chain: `CuPyChain` (CuPy has no PDL
launch attribute: without PDL only).
"""

from __future__ import annotations

import time

import numpy as np

from orchestra.app.peers.cuda_python import burn_st


def _burn_source() -> str:
    from orchestra.compiler.sources import kernel_source_dir

    return (kernel_source_dir() / "burn.cu").read_text()


class _Peer:
    mode = "eager"
    host_us: float | None = None

    def note(self) -> str:
        return ""


# -- CuPy ---------------------------------------------------------------------------------------


class _CuPyStreams(_Peer):
    family = "cupy"

    def _setup(self, w, cp):
        self.cp, self.w = cp, w
        self.kernel = cp.RawKernel(_burn_source(), "burn")
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
        self.xaddr, self.yaddr = w.x.ctypes.data, w.y.ctypes.data
        s, t = burn_st(w)
        self.tail = (np.uint64(w.n), np.int32(w.iters), np.float32(s), np.float32(t))

    def _synchronize(self):
        for s in self.streams:
            s.synchronize()

    def close(self):
        self._synchronize()
        self.cp.get_default_memory_pool().free_all_blocks()


class CuPyLoop(_CuPyStreams):
    """The pipeline with CuPy: the classic loop on three streams (the burn kernel as a RawKernel).

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    name = "CuPy, classic loop on 3 streams (RawKernel)"

    def __init__(self, w, cp):
        self._setup(w, cp)

    def __call__(self):
        cp, w = self.cp, self.w
        rt = cp.cuda.runtime
        nb, n = w.batch_bytes, w.n
        t0 = time.perf_counter_ns()
        for b in range(w.batches):
            s = self.streams[b % 3]
            off = b * nb
            with s:
                din = cp.empty(n, cp.float32)
                dout = cp.empty(n, cp.float32)
                rt.memcpyAsync(din.data.ptr, self.xaddr + off, nb, rt.memcpyHostToDevice, s.ptr)
                self.kernel((w.grid,), (w.block,), (din, dout) + self.tail)
                rt.memcpyAsync(self.yaddr + off, dout.data.ptr, nb, rt.memcpyDeviceToHost, s.ptr)
                del din, dout  # back to CuPy's pool, stream-ordered on s
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        self._synchronize()


class CuPyGraph(_CuPyStreams):
    """The pipeline with CuPy, its classic three-stream loop captured once (stream capture) and
    launched per run.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    name = "CuPy, classic loop captured (stream capture)"
    mode = "graph"

    def __init__(self, w, cp):
        self._setup(w, cp)
        rt = cp.cuda.runtime
        nb, n = w.batch_bytes, w.n
        self.din = cp.empty((w.batches, n), cp.float32)
        self.dout = cp.empty((w.batches, n), cp.float32)
        s0 = self.streams[0]
        with s0:  # load the module and check the launch outside the capture
            self.kernel((w.grid,), (w.block,), (self.din[0], self.dout[0]) + self.tail)
        s0.synchronize()
        self._events = []
        s0.begin_capture()
        try:
            fork = cp.cuda.Event(disable_timing=True)
            fork.record(s0)
            for s in self.streams[1:]:
                s.wait_event(fork)
            for b in range(w.batches):
                s = self.streams[b % 3]
                off = b * nb
                with s:
                    rt.memcpyAsync(self.din[b].data.ptr, self.xaddr + off, nb,
                                   rt.memcpyHostToDevice, s.ptr)
                    self.kernel((w.grid,), (w.block,), (self.din[b], self.dout[b]) + self.tail)
                    rt.memcpyAsync(self.yaddr + off, self.dout[b].data.ptr, nb,
                                   rt.memcpyDeviceToHost, s.ptr)
            for s in self.streams[1:]:
                join = cp.cuda.Event(disable_timing=True)
                join.record(s)
                s0.wait_event(join)
                self._events.append(join)
            self._events.append(fork)
        finally:
            self.graph = s0.end_capture()

    def __call__(self):
        s0 = self.streams[0]
        t0 = time.perf_counter_ns()
        self.graph.launch(stream=s0)
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        s0.synchronize()

    def close(self):
        self._synchronize()
        self.graph = None
        self.din = self.dout = None
        super().close()


def _capture_cupy(stream, enqueue):
    """``enqueue()`` captured on the CuPy ``stream``: its ``cupy.cuda.Graph`` (capture mode
    is left whether or not ``enqueue`` raises)."""
    stream.begin_capture()
    try:
        enqueue()
    finally:
        graph = stream.end_capture()
    return graph


class CuPyRequest(_Peer):
    """One request with CuPy: memcpyAsync, the RawKernel, memcpyAsync, synchronize (device
    buffers allocated once); ``graph=True``: captured once, launched per request.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    family = "cupy"

    def __init__(self, r, cp, graph: bool = False):
        self.cp, self.r, self.graph_mode = cp, r, graph
        self.mode = "graph" if graph else "eager"
        self.name = "CuPy graph (stream capture)" if graph else "CuPy eager (RawKernel)"
        self.kernel = cp.RawKernel(_burn_source(), "burn")
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.din = cp.empty(r.n, cp.float32)
        self.dout = cp.empty(r.n, cp.float32)
        s, t = burn_st(r)
        self.args = (self.din, self.dout, np.uint64(r.n), np.int32(r.iters), np.float32(s),
                     np.float32(t))
        self.nb = 4 * r.n
        self.xaddr, self.yaddr = r.x.ctypes.data, r.y.ctypes.data
        with self.stream:
            self.kernel((r.grid,), (r.block,), self.args)  # load + check outside any capture
        self.stream.synchronize()
        self.graph = _capture_cupy(self.stream, self._enqueue) if graph else None

    def _enqueue(self):
        rt, r, s = self.cp.cuda.runtime, self.r, self.stream
        with s:
            rt.memcpyAsync(self.din.data.ptr, self.xaddr, self.nb, rt.memcpyHostToDevice, s.ptr)
            self.kernel((r.grid,), (r.block,), self.args)
            rt.memcpyAsync(self.yaddr, self.dout.data.ptr, self.nb, rt.memcpyDeviceToHost, s.ptr)

    def __call__(self):
        if self.graph is not None:
            self.graph.launch(stream=self.stream)
        else:
            self._enqueue()
        self.stream.synchronize()

    def close(self):
        self.stream.synchronize()
        self.graph = None
        self.din = self.dout = None


class CuPyChain(_Peer):
    """The chain with CuPy: ``c.kernels`` launches of ``pdl_chain_step`` (pdl.cu compiled by
    CuPy) over two CuPy buffers; without PDL (CuPy's launch has no attributes); ``graph=True``
    captures it once.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    family = "cupy"

    def __init__(self, c, cp, graph: bool = False):
        from orchestra.compiler.sources import kernel_source_dir

        self.cp, self.c, self.graph_mode = cp, c, graph
        self.mode = "graph" if graph else "eager"
        self.name = "CuPy graph (stream capture)" if graph else "CuPy stream (RawKernel)"
        src = (kernel_source_dir() / "pdl.cu").read_text()
        self.kernel = cp.RawKernel(src, "pdl_chain_step")
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.bufs = [cp.empty(c.n, cp.float32), cp.empty(c.n, cp.float32)]
        self.n = np.uint64(c.n)
        with self.stream:
            self.kernel((c.grid,), (c.block,), (self.bufs[0], self.bufs[1], self.n))
        self.stream.synchronize()
        self.graph = _capture_cupy(self.stream, self._enqueue) if graph else None

    def _enqueue(self):
        k, c, b, n = self.kernel, self.c, self.bufs, self.n
        grid, block = (c.grid,), (c.block,)
        with self.stream:
            for i in range(c.kernels):
                k(grid, block, (b[i % 2], b[(i + 1) % 2], n))

    def reset(self):
        self.bufs[0].set(self.c.x0, stream=self.stream)
        self.stream.synchronize()

    def result(self) -> np.ndarray:
        out = self.bufs[self.c.kernels % 2].get(stream=self.stream)
        self.stream.synchronize()
        return out

    def __call__(self):
        t0 = time.perf_counter_ns()
        if self.graph is not None:
            self.graph.launch(stream=self.stream)
        else:
            self._enqueue()
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        self.stream.synchronize()

    def close(self):
        self.stream.synchronize()
        self.graph = None
        self.bufs = []


# -- PyTorch ------------------------------------------------------------------------------------


class _TorchPeer(_Peer):
    family = "torch"

    def _setup(self, w, torch):
        from cuda.bindings import driver as d

        self.torch, self.d, self.w = torch, d, w
        self.dev = torch.device("cuda", w.dev.ordinal)
        self.st = burn_st(w)

    def _launch(self, stream, din, dout, n):
        w = self.w
        s, t = self.st
        w.kernel.launch(self.d.CUstream(stream.cuda_stream), w.grid, w.block,
                        [din.data_ptr(), dout.data_ptr(), n, w.iters, s, t])


class TorchLoop(_TorchPeer):
    """The pipeline with PyTorch: the classic loop on three streams (the burn cubin on torch's
    stream).

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    name = "PyTorch, classic loop on 3 streams (burn cubin on torch's stream)"

    def __init__(self, w, torch):
        self._setup(w, torch)
        self.streams = [torch.cuda.Stream(device=self.dev) for _ in range(3)]
        self.x = torch.from_numpy(w.x)
        self.y = torch.from_numpy(w.y)
        w.dev.make_current()

    def __call__(self):
        torch, w = self.torch, self.w
        n = w.n
        w.dev.make_current()
        t0 = time.perf_counter_ns()
        for b in range(w.batches):
            s = self.streams[b % 3]
            lo = b * n
            with torch.cuda.stream(s):
                din = torch.empty(n, dtype=torch.float32, device=self.dev)
                dout = torch.empty(n, dtype=torch.float32, device=self.dev)
                din.copy_(self.x[lo:lo + n], non_blocking=True)
                self._launch(s, din, dout, n)
                self.y[lo:lo + n].copy_(dout, non_blocking=True)
                del din, dout  # the caching allocator reuses them on s
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        for s in self.streams:
            s.synchronize()

    def close(self):
        for s in self.streams:
            s.synchronize()
        self.torch.cuda.empty_cache()


class TorchGraph(_TorchPeer):
    """The pipeline with PyTorch, its classic loop captured once (``torch.cuda.graph``) and replayed
    per run.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    name = "PyTorch, classic loop captured (torch.cuda.graph)"
    mode = "graph"

    def __init__(self, w, torch):
        self._setup(w, torch)
        n = w.n
        self.s0 = torch.cuda.Stream(device=self.dev)
        side = [torch.cuda.Stream(device=self.dev) for _ in range(2)]
        self.x = torch.from_numpy(w.x).view(w.batches, n)
        self.y = torch.from_numpy(w.y).view(w.batches, n)
        self.din = torch.empty((w.batches, n), dtype=torch.float32, device=self.dev)
        self.dout = torch.empty((w.batches, n), dtype=torch.float32, device=self.dev)
        w.dev.make_current()
        with torch.cuda.stream(self.s0):  # the launch checked and cached outside the capture
            self._launch(self.s0, self.din[0], self.dout[0], n)
        self.s0.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.s0, capture_error_mode="thread_local"):
            cur = torch.cuda.current_stream()
            for s in side:
                s.wait_stream(cur)
            streams = [cur, *side]
            for b in range(w.batches):
                s = streams[b % 3]
                with torch.cuda.stream(s):
                    self.din[b].copy_(self.x[b], non_blocking=True)
                    self._launch(s, self.din[b], self.dout[b], n)
                    self.y[b].copy_(self.dout[b], non_blocking=True)
            for s in side:
                cur.wait_stream(s)
        self.side = side

    def __call__(self):
        torch = self.torch
        with torch.cuda.stream(self.s0):
            t0 = time.perf_counter_ns()
            self.graph.replay()
            self.host_us = (time.perf_counter_ns() - t0) / 1e3
        self.s0.synchronize()

    def close(self):
        self.s0.synchronize()
        self.graph = None
        self.din = self.dout = None
        self.torch.cuda.empty_cache()


class TorchRequest(_TorchPeer):
    """One request with PyTorch: ``copy_(non_blocking=True)`` from the pinned input, burn on
    torch's stream (arguments packed once), ``copy_`` back, ``Stream.synchronize``; with
    ``graph=True`` the three captured with ``torch.cuda.graph`` and replayed per request.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    def __init__(self, r, torch, graph: bool = False):
        self._setup(r, torch)
        self.graph_mode = graph
        self.mode = "graph" if graph else "eager"
        self.name = "PyTorch graph (torch.cuda.graph)" if graph else "PyTorch eager"
        self.stream = torch.cuda.Stream(device=self.dev)
        self.x = torch.from_numpy(r.x)
        self.y = torch.from_numpy(r.y)
        self.din = torch.empty(r.n, dtype=torch.float32, device=self.dev)
        self.dout = torch.empty(r.n, dtype=torch.float32, device=self.dev)
        s, t = self.st
        self.packed = r.kernel.pack([self.din.data_ptr(), self.dout.data_ptr(), r.n, r.iters,
                                     s, t])
        self.cu_stream = self.d.CUstream(self.stream.cuda_stream)
        r.dev.make_current()
        with torch.cuda.stream(self.stream):
            self._enqueue()
        self.stream.synchronize()
        self.graph = None
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream,
                                  capture_error_mode="thread_local"):
                self._enqueue()

    def _enqueue(self):
        r = self.w
        self.din.copy_(self.x, non_blocking=True)
        r.kernel.launch(self.cu_stream, r.grid, r.block, self.packed)
        self.y.copy_(self.dout, non_blocking=True)

    def __call__(self):
        torch = self.torch
        with torch.cuda.stream(self.stream):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._enqueue()
        self.stream.synchronize()

    def close(self):
        self.stream.synchronize()
        self.graph = None
        self.din = self.dout = None


__all__ = ["CuPyChain", "CuPyGraph", "CuPyLoop", "CuPyRequest", "TorchGraph", "TorchLoop",
           "TorchRequest"]

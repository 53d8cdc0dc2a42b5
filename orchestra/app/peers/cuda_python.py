"""Hand-written cuda-python contenders: every driver call written out, no orchestra executor
on the hot path (needs a GPU).

Pipelines (``w``: an object with ``dev``, ``batches``, ``batch_bytes``, ``n`` (elements per
batch), ``x`` / ``y`` (pinned float32 arrays of every batch), ``kernel`` (burn's
`orchestra.kernel.Kernel`; only its ``function`` handle is used), ``grid``, ``block``,
``iters`` and optionally ``burn_st`` (burn's s and t, default 0.5 and 1.0)):

- `ByHand` ``"by-engine"``: upload / compute / download streams joined by events, every
  ``cuMemAllocFromPoolAsync`` / ``cuMemcpy*Async`` / ``cuLaunchKernel`` / ``cuEventRecord`` /
  ``cuStreamWaitEvent`` / ``cuMemFreeAsync`` written out, arguments packed per launch the way
  the cuda-python samples do; ``"classic"``: batch ``b`` wholly on stream ``b % 3``;
- `BareGraph`: the by-engine work captured by hand into a CUDA graph, instantiated, uploaded
  and launched with ``cuGraphLaunch``.

Requests (`BareRequest`): one H2D -> kernel -> D2H on one stream with prepacked arguments and
``cuStreamSynchronize``, or the same three captured once and launched. Chains (`BareChain`):
dependent launches of one link kernel, ``cuLaunchKernel``, or ``cuLaunchKernelEx`` with the
programmatic-stream-serialization attribute (PDL), from a stream or captured.

Every contender: ``name``, ``family`` ("cuda-python"), ``mode`` ("eager" / "graph"),
``__call__()`` enqueues (or launches) everything and synchronizes, ``host_us`` the host time of
the enqueue / launch part of the last call, ``note()``, ``close()``.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np


def _fail(call: str, err):
    """The `CudaError` for a failed ``CUresult`` of ``call``."""
    from orchestra.driver.check import error_from_result

    return error_from_result(call, err, context="hand-written cuda-python contender")


def _ok(res, call: str = "a driver call"):
    """A cuda-python result tuple -> its value(s); a `CudaError` naming the result otherwise."""
    if int(res[0]):
        raise _fail(call, res[0])
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def burn_st(w) -> tuple[float, float]:
    return tuple(getattr(w, "burn_st", (0.5, 1.0)))


def burn_params(din, dout, n, iters, s, t):
    """(kept objects, address) of a burn parameter array, packed with ctypes."""
    vals = (ctypes.c_uint64(int(din)), ctypes.c_uint64(int(dout)), ctypes.c_uint64(int(n)),
            ctypes.c_int32(int(iters)), ctypes.c_float(s), ctypes.c_float(t))
    params = (ctypes.c_void_p * 6)(*[ctypes.addressof(v) for v in vals])
    return (vals, params), ctypes.addressof(params)


class _Timed:
    family = "cuda-python"
    mode = "eager"
    host_us: float | None = None

    def note(self) -> str:
        return ""


class ByHand(_Timed):
    """cuda-python, written out: no orchestra executor on the hot path.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    def __init__(self, w, style: str):
        from cuda.bindings import driver as d

        from orchestra.driver import MemoryPool

        self.d, self.w, self.style = d, w, style
        self.name = ("cuda-python by hand, by-engine + events" if style == "by-engine"
                     else "cuda-python by hand, classic loop (b % 3)")
        w.dev.make_current()
        self.pool = MemoryPool.default(w.dev).handle
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.streams = [_ok(d.cuStreamCreateWithPriority(flags, 0)) for _ in range(3)]
        ev_flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        n_ev = 2 * w.batches if style == "by-engine" else 0
        self.events = [_ok(d.cuEventCreate(ev_flags)) for _ in range(n_ev)]
        self.func = w.kernel.function
        self.xaddr, self.yaddr = w.x.ctypes.data, w.y.ctypes.data
        self.s, self.t = burn_st(w)

    def _launch(self, din, dout, n, stream):
        d, w = self.d, self.w
        vals = (np.array([int(din)], np.uint64), np.array([int(dout)], np.uint64),
                np.array([n], np.uint64), np.array([w.iters], np.int32),
                np.array([self.s], np.float32), np.array([self.t], np.float32))
        params = np.array([v.ctypes.data for v in vals], dtype=np.uint64)
        _ok(d.cuLaunchKernel(self.func, w.grid, 1, 1, w.block, 1, 1, 0, stream,
                             params.ctypes.data, 0))

    def __call__(self):
        d, w, ok = self.d, self.w, _ok
        nb, n = w.batch_bytes, w.n
        t0 = time.perf_counter_ns()
        if self.style == "by-engine":
            up, comp, down = self.streams
            for b in range(w.batches):
                off = b * nb
                din = ok(d.cuMemAllocFromPoolAsync(nb, self.pool, up))
                dout = ok(d.cuMemAllocFromPoolAsync(nb, self.pool, up))
                ok(d.cuMemcpyHtoDAsync(din, self.xaddr + off, nb, up))
                ev_up, ev_k = self.events[2 * b], self.events[2 * b + 1]
                ok(d.cuEventRecord(ev_up, up))
                ok(d.cuStreamWaitEvent(comp, ev_up, 0))
                self._launch(din, dout, n, comp)
                ok(d.cuEventRecord(ev_k, comp))
                ok(d.cuMemFreeAsync(din, comp))
                ok(d.cuStreamWaitEvent(down, ev_k, 0))
                ok(d.cuMemcpyDtoHAsync(self.yaddr + off, dout, nb, down))
                ok(d.cuMemFreeAsync(dout, down))
        else:
            for b in range(w.batches):
                s = self.streams[b % 3]
                off = b * nb
                din = ok(d.cuMemAllocFromPoolAsync(nb, self.pool, s))
                dout = ok(d.cuMemAllocFromPoolAsync(nb, self.pool, s))
                ok(d.cuMemcpyHtoDAsync(din, self.xaddr + off, nb, s))
                self._launch(din, dout, n, s)
                ok(d.cuMemcpyDtoHAsync(self.yaddr + off, dout, nb, s))
                ok(d.cuMemFreeAsync(din, s))
                ok(d.cuMemFreeAsync(dout, s))
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        for s in self.streams:
            ok(d.cuStreamSynchronize(s))

    def close(self):
        d = self.d
        for s in self.streams:
            d.cuStreamSynchronize(s)
        for e in self.events:
            d.cuEventDestroy(e)
        for s in self.streams:
            d.cuStreamDestroy(s)


class BareGraph(_Timed):
    """The by-engine work captured with raw cuda-python: no orchestra on any path.

    ``launch()`` / ``sync()`` / ``gpu_ms()`` (timing events around one launch); with a
    workload that has alternate arrays ``x2`` / ``y2``, ``rebind()`` moves every H2D / D2H
    node onto the other set (``cuGraphExecMemcpyNodeSetParams``) and launches.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    name = "cuda-python bare captured graph (by-engine shape)"
    mode = "graph"

    def __init__(self, w):
        from cuda.bindings import driver as d

        from orchestra.driver import MemoryPool

        self.d, self.w = d, w
        w.dev.make_current()
        pool = MemoryPool.default(w.dev).handle  # configured before the capture
        ok = _ok
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.origin = ok(d.cuStreamCreateWithPriority(flags, 0))
        up, comp, down = (ok(d.cuStreamCreateWithPriority(flags, 0)) for _ in range(3))
        ev_flags = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        events = [ok(d.cuEventCreate(ev_flags)) for _ in range(2 * w.batches + 2)]
        self.t0, self.t1 = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
        self.streams, self.events = (up, comp, down), events
        self.graph = self.exec = None
        nb, n = w.batch_bytes, w.n
        xaddr, yaddr = w.x.ctypes.data, w.y.ctypes.data
        func = w.kernel.function
        s_, t_ = burn_st(w)
        keep = []
        ok(d.cuStreamBeginCapture(self.origin,
                                  d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            fork, join = events[-2], events[-1]
            ok(d.cuEventRecord(fork, self.origin))
            for s in (up, comp, down):
                ok(d.cuStreamWaitEvent(s, fork, 0))
            for b in range(w.batches):
                off = b * nb
                din = ok(d.cuMemAllocFromPoolAsync(nb, pool, up))
                dout = ok(d.cuMemAllocFromPoolAsync(nb, pool, up))
                ok(d.cuMemcpyHtoDAsync(din, xaddr + off, nb, up))
                ev_up, ev_k = events[2 * b], events[2 * b + 1]
                ok(d.cuEventRecord(ev_up, up))
                ok(d.cuStreamWaitEvent(comp, ev_up, 0))
                kept, address = burn_params(din, dout, n, w.iters, s_, t_)
                keep.append(kept)
                ok(d.cuLaunchKernel(func, w.grid, 1, 1, w.block, 1, 1, 0, comp, address, 0))
                ok(d.cuEventRecord(ev_k, comp))
                ok(d.cuMemFreeAsync(din, comp))
                ok(d.cuStreamWaitEvent(down, ev_k, 0))
                ok(d.cuMemcpyDtoHAsync(yaddr + off, dout, nb, down))
                ok(d.cuMemFreeAsync(dout, down))
            for s in (up, comp, down):
                ok(d.cuEventRecord(join, s))
                ok(d.cuStreamWaitEvent(self.origin, join, 0))
        finally:
            err, graph = d.cuStreamEndCapture(self.origin)  # always leave capture mode
        if int(err):
            self.close()
            raise _fail("cuStreamEndCapture", err)
        self.graph = graph
        self.exec = ok(d.cuGraphInstantiate(self.graph, 0))
        ok(d.cuGraphUpload(self.exec, self.origin))
        ok(d.cuStreamSynchronize(self.origin))
        self.nodes = 7 * w.batches
        self.copies = []
        if hasattr(w, "x2") and hasattr(w, "y2"):
            self._rebind_sets(w)

    def _rebind_sets(self, w):
        """The memcpy nodes of the captured graph, each with two parameter objects: one on the
        workload's arrays, one on the alternate arrays (same offsets), for `rebind`."""
        d, ok = self.d, _ok
        count = d.cuGraphGetNodes(self.graph, 0)[2]
        nodes = d.cuGraphGetNodes(self.graph, count)[1]
        memcpy = d.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMCPY
        host = d.CUmemorytype.CU_MEMORYTYPE_HOST
        bases = {"src": (w.x.ctypes.data, w.x2.ctypes.data),
                 "dst": (w.y.ctypes.data, w.y2.ctypes.data)}
        for node in nodes:
            if d.cuGraphNodeGetType(node)[1] != memcpy:
                continue
            pair = []
            for which in (0, 1):
                p = ok(d.cuGraphMemcpyNodeGetParams(node))
                side = "src" if p.srcMemoryType == host else "dst"
                field = f"{side}Host"
                base, alt = bases[side]
                off = int(getattr(p, field)) - base
                setattr(p, field, (base, alt)[which] + off)
                pair.append(p)
            self.copies.append((node, tuple(pair)))
        self._which = 0

    def rebind(self):
        """Every H2D / D2H node onto the other array set (``cuGraphExecMemcpyNodeSetParams``
        with prepared parameters, the fewest calls there are), then ``cuGraphLaunch``."""
        d = self.d
        self._which ^= 1
        ex, ctx, which = self.exec, self.w.dev.context, self._which
        for node, pair in self.copies:
            (err,) = d.cuGraphExecMemcpyNodeSetParams(ex, node, pair[which], ctx)
            if err:
                raise _fail("cuGraphExecMemcpyNodeSetParams", err)
        self.launch()

    def launch(self):
        (err,) = self.d.cuGraphLaunch(self.exec, self.origin)
        if err:
            raise _fail("cuGraphLaunch", err)

    def sync(self):
        _ok(self.d.cuStreamSynchronize(self.origin))

    def __call__(self):
        t0 = time.perf_counter_ns()
        self.launch()
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        self.sync()

    def gpu_ms(self) -> float:
        d = self.d
        _ok(d.cuEventRecord(self.t0, self.origin))
        self.launch()
        _ok(d.cuEventRecord(self.t1, self.origin))
        _ok(d.cuEventSynchronize(self.t1))
        return float(_ok(d.cuEventElapsedTime(self.t0, self.t1)))

    def close(self):
        d = self.d
        d.cuStreamSynchronize(self.origin)
        if self.exec is not None:
            d.cuGraphExecDestroy(self.exec)
            self.exec = None
        if self.graph is not None:
            d.cuGraphDestroy(self.graph)
            self.graph = None
        for e in self.events + [self.t0, self.t1]:
            d.cuEventDestroy(e)
        self.events = []
        for s in self.streams + (self.origin,):
            d.cuStreamDestroy(s)
        self.streams = ()


def _capture(d, stream, enqueue):
    """Capture ``enqueue()`` on ``stream`` (thread-local): an uploaded (graph, exec)."""
    _ok(d.cuStreamBeginCapture(stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    try:
        enqueue()
    finally:
        err, graph = d.cuStreamEndCapture(stream)  # always leave capture mode
    if int(err):
        raise _fail("cuStreamEndCapture", err)
    try:
        gexec = _ok(d.cuGraphInstantiate(graph, 0))
        _ok(d.cuGraphUpload(gexec, stream))
        _ok(d.cuStreamSynchronize(stream))
    except BaseException:
        d.cuGraphDestroy(graph)
        raise
    return graph, gexec


def _non_blocking_stream(d):
    """A new ``CU_STREAM_NON_BLOCKING`` stream of priority 0 (``cuStreamCreateWithPriority``)."""
    return _ok(d.cuStreamCreateWithPriority(d.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))


def _drain_and_destroy_capture(d, stream, graph, gexec) -> None:
    """Synchronize ``stream``, then destroy what `_capture` made (``gexec`` None: nothing was
    captured)."""
    d.cuStreamSynchronize(stream)
    if gexec is not None:
        d.cuGraphExecDestroy(gexec)
        d.cuGraphDestroy(graph)


class BareRequest(_Timed):
    """One request by hand: ``cuMemcpyHtoDAsync``, ``cuLaunchKernel`` (arguments packed once),
    ``cuMemcpyDtoHAsync``, ``cuStreamSynchronize`` on device buffers allocated once; with
    ``graph=True`` the three calls captured once and each request one ``cuGraphLaunch`` and
    the synchronize. ``r``: the request data (``dev``, ``x``, ``y`` pinned float32 of ``n``,
    ``kernel``, ``grid``, ``block``, ``iters``, ``burn_st``).

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    def __init__(self, r, graph: bool = False):
        from cuda.bindings import driver as d

        self.d, self.r, self.graph_mode = d, r, graph
        self.mode = "graph" if graph else "eager"
        self.name = ("cuda-python bare captured graph (launch + sync)" if graph
                     else "cuda-python bare: 3 async calls + stream sync")
        r.dev.make_current()
        nb = 4 * r.n
        self.nb = nb
        self.stream = _non_blocking_stream(d)
        self.din = _ok(d.cuMemAlloc(nb))
        self.dout = _ok(d.cuMemAlloc(nb))
        s_, t_ = burn_st(r)
        self._keep, self.address = burn_params(self.din, self.dout, r.n, r.iters, s_, t_)
        self.func = r.kernel.function
        self.xaddr, self.yaddr = r.x.ctypes.data, r.y.ctypes.data
        self.cugraph = self.exec = None
        if graph:
            self.cugraph, self.exec = _capture(d, self.stream, self._enqueue)

    def _enqueue(self):
        d, r, s = self.d, self.r, self.stream
        _ok(d.cuMemcpyHtoDAsync(self.din, self.xaddr, self.nb, s))
        _ok(d.cuLaunchKernel(self.func, r.grid, 1, 1, r.block, 1, 1, 0, s, self.address, 0))
        _ok(d.cuMemcpyDtoHAsync(self.yaddr, self.dout, self.nb, s))

    def __call__(self):
        d = self.d
        if self.graph_mode:
            (err,) = d.cuGraphLaunch(self.exec, self.stream)
            if err:
                raise _fail("cuGraphLaunch", err)
        else:
            self._enqueue()
        (err,) = d.cuStreamSynchronize(self.stream)
        if err:
            raise _fail("cuStreamSynchronize", err)

    def close(self):
        d = self.d
        _drain_and_destroy_capture(d, self.stream, self.cugraph, self.exec)
        d.cuMemFree(self.din)
        d.cuMemFree(self.dout)
        d.cuStreamDestroy(self.stream)


class BareChain(_Timed):
    """``c.kernels`` dependent launches of the link kernel by hand (``c``: the chain data with
    ``dev``, ``bufs`` (two `DeviceBuffer`), ``n``, ``kernels``, ``step`` (the link `Kernel`),
    ``grid``, ``block``): ``cuLaunchKernel``, or with ``pdl`` ``cuLaunchKernelEx`` and the
    programmatic-stream-serialization attribute on every link but the first; ``graph=True``
    captures the chain once and launches it.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    def __init__(self, c, *, pdl: bool, graph: bool):
        from cuda.bindings import driver as d

        self.d, self.c, self.pdl, self.graph_mode = d, c, pdl, graph
        self.mode = "graph" if graph else "eager"
        how = "captured graph" if graph else "stream"
        self.name = f"cuda-python bare {how}" + (", PDL" if pdl else "")
        c.dev.make_current()
        self.stream = _non_blocking_stream(d)
        self.func = c.step.function
        self._keep, self.addresses = [], []
        a, b = c.bufs[0].ptr, c.bufs[1].ptr
        for src, dst in ((a, b), (b, a)):
            vals = (ctypes.c_uint64(src), ctypes.c_uint64(dst), ctypes.c_uint64(c.n))
            params = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in vals])
            self._keep.append((vals, params))
            self.addresses.append(ctypes.addressof(params))
        cfg = d.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = c.grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = c.block, 1, 1
        cfg.sharedMemBytes = 0
        cfg.hStream = self.stream
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        value = d.CUlaunchAttributeValue()
        value.programmaticStreamSerializationAllowed = 1
        attr.value = value
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        self.cfg = cfg
        self.cugraph = self.exec = None
        if graph:
            self.cugraph, self.exec = _capture(d, self.stream, self._enqueue)

    def _enqueue(self):
        d, c, s, func, addr = self.d, self.c, self.stream, self.func, self.addresses
        g, b = c.grid, c.block
        _ok(d.cuLaunchKernel(func, g, 1, 1, b, 1, 1, 0, s, addr[0], 0))
        if self.pdl:
            cfg = self.cfg
            for i in range(1, c.kernels):
                (err,) = d.cuLaunchKernelEx(cfg, func, addr[i % 2], 0)
                if err:
                    raise _fail("cuLaunchKernelEx", err)
        else:
            for i in range(1, c.kernels):
                (err,) = d.cuLaunchKernel(func, g, 1, 1, b, 1, 1, 0, s, addr[i % 2], 0)
                if err:
                    raise _fail("cuLaunchKernel", err)

    def __call__(self):
        d = self.d
        t0 = time.perf_counter_ns()
        if self.graph_mode:
            _ok(d.cuGraphLaunch(self.exec, self.stream))
        else:
            self._enqueue()
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        _ok(d.cuStreamSynchronize(self.stream))

    def close(self):
        _drain_and_destroy_capture(self.d, self.stream, self.cugraph, self.exec)
        self.d.cuStreamDestroy(self.stream)


__all__ = ["BareChain", "BareGraph", "BareRequest", "ByHand", "burn_params"]

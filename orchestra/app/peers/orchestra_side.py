"""orchestra's contenders: the eager executor, and the capture and graph-build executors'
`GraphExec` replayed (needs a GPU).

Pipelines (`OrchestraPipeline`): the job's task graph (``build_pipeline``: alloc -> H2D -> burn
-> D2H -> free per batch, bounded in flight as the main job is: `in_flight_for`), with the
policy and streams the main job's ``auto`` picks for the executor's copy lowering and the
kernel's size (`pipeline_policy`: round-robin lanes when most copies run as copy kernels, else
by-engine on 3 streams; for the capture and graph-build replays 4, two compute streams, when
the burn kernel is smaller than the GPU and batches are at most 16 MiB, as on (b)). Requests (`OrchestraRequest`):
one H2D -> burn -> D2H on external device buffers (allocated once), or with allocations in the
graph; eager on one stream, or a graph replayed.
Chains (`OrchestraChain`): ``kernels`` dependent ``pdl_chain_step`` nodes over two external
buffers, optionally with the ``pdl`` launch attribute on every link but the first; eager on one
stream, capture (PDL becomes programmatic edges), or graph-build (which builds full edges:
PDL is left out there, and the row says so).

``__call__()`` runs once and waits; ``host_us``: the enqueue time of the last eager run
(`RunResult.enqueue_us`) or the host time of the replay's launch call.
"""

from __future__ import annotations

import time

from orchestra.app.job.graphs import in_flight_for
from orchestra.app.job.policy import AUTO, choose_policy, count_copies


class _Ours:
    family = "orchestra"
    host_us: float | None = None
    build_ms: float | None = None

    def note(self) -> str:
        return f"build {self.build_ms:.1f} ms" if self.build_ms is not None else ""


def _executor(kind: str, dev, resolver, copy_lowering: str = "auto"):
    from orchestra.execute import CaptureExecutor, EagerExecutor, GraphBuildExecutor

    cls = {"eager": EagerExecutor, "capture": CaptureExecutor,
           "graph-build": GraphBuildExecutor}[kind]
    return cls(dev, kernel_resolver=resolver, copy_lowering=copy_lowering)


def pipeline_policy(w, copy_policy, policy: str = AUTO, streams: int | str = AUTO,
                    executor: str = "the executor"):
    """The `PolicyChoice` for pipeline workload data ``w`` (``batches``, ``batch_bytes``, and
    ``kernel_fills_gpu`` where known: `harness.PipelineData` sets it from the burn kernel's
    occupancy) whose copies ``copy_policy`` (a `CopyPolicy`) lowers: the main job's
    `choose_policy`, the lanes capped at the batches in flight (`in_flight_for`), so the graph
    rows run on two compute streams where ``orchestra run --executor graph`` would."""
    sizes = [w.batch_bytes] * w.batches
    copies, kernels = count_copies(sizes, copy_policy)
    return choose_policy(policy, streams, copies=copies, copy_kernels=kernels,
                         batches=w.batches, in_flight=in_flight_for(sizes), executor=executor,
                         eager=executor.startswith("eager"),
                         kernel_fills_gpu=getattr(w, "kernel_fills_gpu", None),
                         batch_bytes=w.batch_bytes)


class _Replay(_Ours):
    """Shared by the graph rows: build once, ``replay(sync=False)`` timed, then wait."""

    mode = "graph"

    def _build(self, graph, plan, bindings, **kw):
        t0 = time.perf_counter_ns()
        self.exe = self.ex.build(graph, plan, bindings, **kw)
        self.build_ms = (time.perf_counter_ns() - t0) / 1e6

    def _run_graph(self):
        t0 = time.perf_counter_ns()
        self.exe.replay(sync=False)
        self.host_us = (time.perf_counter_ns() - t0) / 1e3
        self.exe.synchronize()

    def close(self):
        exe = getattr(self, "exe", None)
        if exe is not None:
            exe.close()
        self.ex.close()


class OrchestraPipeline(_Replay):
    """``kind``: "eager", "capture" or "graph-build"; ``w`` as in `cuda_python`, plus
    ``resolver`` (the shared `KernelResolver`). ``policy`` / ``streams``: ``"auto"`` (default:
    `pipeline_policy`) or given; ``copy_lowering``: the executor's. ``choice``: the resolved
    `PolicyChoice`.

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    def __init__(self, w, kind: str, policy: str = AUTO, streams: int | str = AUTO,
                 copy_lowering: str = "auto"):
        self.kind, self.mode = kind, ("eager" if kind == "eager" else "graph")
        self.ex = _executor(kind, w.dev, w.resolver, copy_lowering)
        self.exe = None
        try:
            self._setup(w, policy, streams, copy_lowering)
        except BaseException:  # nothing of a half-built contender stays behind
            self.close()
            raise

    def _setup(self, w, policy, streams, copy_lowering) -> None:
        from orchestra.app.job.graphs import burn_kernel_ref
        from orchestra.app.peers.cuda_python import burn_st
        from orchestra.graph import HostBuffer, build_pipeline

        kind = self.kind
        self.choice = c = pipeline_policy(w, self.ex.copy_policy(), policy, streams,
                                          f"{kind} executor")
        policy, streams = c.policy, c.streams
        what = "eager" if kind == "eager" else f"{kind} replay"
        lowering = "" if copy_lowering == "auto" else f", copies {copy_lowering}"
        self.name = f"orchestra {what} ({policy}, {streams} streams{lowering})"
        total = w.batches * w.batch_bytes
        s, t = burn_st(w)
        self.graph, _ = build_pipeline(
            w.batches, w.batch_bytes, burn_kernel_ref(), host_in=HostBuffer("host_in", total),
            host_out=HostBuffer("host_out", total), grid=w.grid, block=w.block,
            scalars=(w.iters, s, t),
            in_flight=in_flight_for([w.batch_bytes] * w.batches))
        self.bindings = {"host_in": w.x, "host_out": w.y}
        if kind == "eager":
            self.plan = self.ex.prepare(self.graph, policy=policy, streams=streams)
        else:
            self._build(self.graph, None, self.bindings, policy=policy, streams=streams)
            self.plan = self.exe.plan

    def __call__(self):
        if self.kind == "eager":
            res = self.ex.run(self.graph, self.plan, self.bindings)
            self.host_us = res.enqueue_us
        else:
            self._run_graph()


class OrchestraRequest(_Replay):
    """One request (``r``: ``dev``, ``resolver``, ``x`` / ``y`` pinned of ``n`` floats, grid,
    block, iters, burn_st). ``external``: device buffers allocated once and bound (else the
    graph allocates and frees them per run).

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    def __init__(self, r, kind: str, external: bool = True):
        from orchestra.app.job.graphs import burn_kernel_ref
        from orchestra.app.peers.cuda_python import burn_st
        from orchestra.driver import DeviceBuffer, Stream
        from orchestra.graph import (Alloc, Buffer, DeviceToHost, Free, HostBuffer,
                                     HostToDevice, In, KernelNode, Out, TaskGraph)

        self.kind, self.mode = kind, ("eager" if kind == "eager" else "graph")
        bufs = "external buffers" if external else "allocated in the graph"
        what = "eager, 1 stream" if kind == "eager" else f"{kind} replay"
        self.name = f"orchestra {what}, {bufs}"
        nb = 4 * r.n
        s, t = burn_st(r)
        hin, hout = HostBuffer("host_in", nb), HostBuffer("host_out", nb)
        din, dout = Buffer("d_in", nb), Buffer("d_out", nb)
        g = TaskGraph()
        if not external:
            g.add(Alloc("alloc_in", din))
            g.add(Alloc("alloc_out", dout))
        g.add(HostToDevice("h2d", hin, din))
        g.add(KernelNode("kernel", burn_kernel_ref(), r.grid, r.block,
                         (In(din), Out(dout), r.n, r.iters, s, t)))
        g.add(DeviceToHost("d2h", dout, hout))
        if not external:
            g.add(Free("free_in", din))
            g.add(Free("free_out", dout))
        self.graph = g
        self.bindings = {"host_in": r.x, "host_out": r.y}
        self._own, self._stream = [], None
        if external:
            self._stream = Stream(r.dev)
            self._own = [DeviceBuffer.allocate(nb, self._stream),
                         DeviceBuffer.allocate(nb, self._stream)]
            self._stream.synchronize()
            self.bindings.update(d_in=self._own[0], d_out=self._own[1])
        self.ex = _executor(kind, r.dev, r.resolver)
        self.exe = None
        if kind == "eager":
            self.plan = self.ex.prepare(g, policy="by-engine", streams=1)
        else:
            self._build(g, None, self.bindings)

    def __call__(self):
        if self.kind == "eager":
            self.ex.run(self.graph, self.plan, self.bindings)
        else:
            self.exe.replay(sync=True)

    def close(self):
        super().close()
        for b in self._own:
            b.close()
        if self._stream is not None:
            self._stream.synchronize()
            self._stream.close()


class OrchestraChain(_Replay):
    """The chain (``c``: ``dev``, ``resolver``, ``bufs`` (two `DeviceBuffer`), ``n``,
    ``kernels``, ``step_ref`` (the link's `KernelRef`), ``grid``, ``block``).

    Thread-safety: not thread-safe: a benchmark contender, driven by one thread (the harness runs
    contenders one after another); its streams, buffers and graphs are its own.
    """

    def __init__(self, c, kind: str, pdl: bool):
        from orchestra.graph import Buffer, In, KernelNode, Out, TaskGraph

        self.kind, self.mode = kind, ("eager" if kind == "eager" else "graph")
        self.pdl = bool(pdl) and kind != "graph-build"
        what = "eager, 1 stream" if kind == "eager" else f"{kind} replay"
        self.name = f"orchestra {what}" + (", PDL" if pdl else "")
        nb = 4 * c.n
        a, b = Buffer("a", nb), Buffer("b", nb)
        g = TaskGraph()
        for i in range(c.kernels):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            attributes = {"pdl": True} if (self.pdl and i > 0) else {}
            g.add(KernelNode(f"k{i}", c.step_ref, c.grid, c.block, (In(src), Out(dst), c.n),
                             attributes=attributes))
        self.graph = g
        self.bindings = {"a": c.bufs[0], "b": c.bufs[1]}
        self.ex = _executor(kind, c.dev, c.resolver)
        self.exe = None
        self._note = ("graph-build builds full edges: PDL left out" if (pdl and not self.pdl)
                      else "")
        if kind == "eager":
            self.plan = self.ex.prepare(g, policy="by-engine", streams=1)
        else:
            self._build(g, None, self.bindings)

    def note(self) -> str:
        parts = [p for p in (self._note, super().note()) if p]
        return "; ".join(parts)

    def __call__(self):
        if self.kind == "eager":
            res = self.ex.run(self.graph, self.plan, self.bindings)
            self.host_us = res.enqueue_us
        else:
            self._run_graph()


__all__ = ["OrchestraChain", "OrchestraPipeline", "OrchestraRequest", "pipeline_policy"]

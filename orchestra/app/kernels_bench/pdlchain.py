"""``orchestra bench pdl``: a chain of small dependent kernels, with and without programmatic
dependent launch (PDL), timed on the GPU, from a stream and as a CUDA graph.

The chain is ``kernels`` launches of one link kernel (cuda_src/pdl.cu): launch k reads what
launch k - 1 wrote (y = x + 1, two buffers used in turn), so without PDL each launch waits for
the previous one to finish and for its own launch latency; with PDL (launch attribute
PROGRAMMATIC_STREAM_SERIALIZATION on every link but the first) link k + 1 may be launched while
link k runs and only its griddepcontrol.wait waits for link k. PDL is applied only after the
kernel's PTX has been checked to contain griddepcontrol.wait
(`orchestra.app.kernels_bench.pdl`). Two links are timed: ``pdl_chain_step`` (trigger, then wait:
the next link is launched as early as possible) and ``pdl_chain_step_after_wait`` (wait, then
trigger).

Stream mode - timing the GPU, not the host: the stream is first held by pdl_spin (a one-thread
kernel that spins a gate on %globaltimer) while the host enqueues the whole chain; the start
event is recorded behind the gate, the end event after the last link, so the elapsed time is the
GPU's time for the chain alone. The gate is scaled from the host's measured enqueue time (3x the
warm-up chain's, at least 5 ms) unless ``gate_ms`` is given; if enqueueing still took longer
than 80% of the gate, the gate is doubled and the chain run again (up to 3 times), and a run
still host-bound is flagged.

Graph mode: the same launches are stream-captured into a CUDA graph (capture turns the PDL
attribute into programmatic edges: counted from ``cuGraphGetEdges`` and reported), instantiated
and uploaded once; each timed replay is one ``cuGraphLaunch`` between the events, so there are no
host gaps to hide.

Graph-build mode: the chain as an orchestra task graph (one `KernelNode` per link, the ``pdl``
attribute on every link but the first) built node by node by the `GraphBuildExecutor`, which
gives each PDL link a programmatic edge from the link before it (``cuGraphAddDependencies`` with
``CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`` edge data from port
``CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC``): the same link kernel, the same edges (type and port,
reported for both graph forms) as the capture, timed the same way. Goal: <= 0.55 us per kernel.

GPU microseconds per kernel = elapsed / kernels, median over ``repeats`` chains (after one
warm-up). Every chain's final output is compared with numpy. Goal: <= 0.7 us per
kernel with PDL, judged on the stream chains.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import numpy as np

from orchestra.errors import BenchConfigError
from orchestra.app.kernels_bench import catalog as cat
from orchestra.app.kernels_bench import reference as ref
from orchestra.app.kernels_bench.common import median
from orchestra.app.kernels_bench.pdl import require_grid_dependency_wait

GOAL_US = 0.7
BUILD_GOAL_US = 0.55  # the explicitly built graph with programmatic edges
#: The link kernels timed, the default (trigger first) first.
LINKS = ("pdl_chain_step", "pdl_chain_step_after_wait")
MIN_GATE_MS = 5.0


@attrs.frozen
class ChainResult:
    mode: str              # "stream" or "graph"
    kernel: str
    pdl: bool
    us_per_kernel: float
    chain_ms: float
    host_enqueue_ms: float  # stream: enqueueing the chain; graph: the cuGraphLaunch call
    gate_ms: float          # stream: the gate's length (max over the timed chains); graph: 0
    host_bound: bool
    programmatic_edges: int | None  # graph: edges of type PROGRAMMATIC; stream: None
    verified: bool
    detail: str


@attrs.frozen
class PdlReport:
    device: str
    kernels: int
    n: int
    block: int
    grid: int
    repeats: int
    results: tuple

    def result(self, pdl: bool, mode: str = "stream", kernel: str = LINKS[0]) -> ChainResult:
        return next(r for r in self.results
                    if r.pdl == pdl and r.mode == mode and r.kernel == kernel)

    def best(self, pdl: bool = True, mode: str = "stream") -> ChainResult | None:
        rows = [r for r in self.results if r.pdl == pdl and r.mode == mode and r.verified]
        return min(rows, key=lambda r: r.us_per_kernel) if rows else None

    @property
    def goal_met(self) -> bool:
        b = self.best(True, "stream")
        return b is not None and not b.host_bound and b.us_per_kernel <= GOAL_US

    @property
    def build_goal_met(self) -> bool | None:
        """The graph-build row with PDL within `BUILD_GOAL_US` (None without that row)."""
        b = self.best(True, "graph-build")
        return None if b is None else b.us_per_kernel <= BUILD_GOAL_US

    @property
    def verified(self) -> bool:
        return all(r.verified for r in self.results)

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d["results"] = [attrs.asdict(r) for r in self.results]
        d.update(goal_us=GOAL_US, goal_met=self.goal_met, build_goal_us=BUILD_GOAL_US,
                 build_goal_met=self.build_goal_met, verified=self.verified)
        return d


class _Chain:
    """Buffers, packed arguments and events for timing chains of one link kernel."""

    def __init__(self, dev, kernel_key: str, kernels: int, n: int, block: int):
        from orchestra.driver import DeviceBuffer, Event, PinnedBuffer, Stream

        spec = self.spec = cat.spec(kernel_key)
        self.dev = dev
        ptx, entry = cat.ptx_text(spec, arch=dev.arch)
        require_grid_dependency_wait(ptx, entry)  # never PDL on a kernel that does not wait
        self.key = kernel_key
        self.step = cat.load(spec, dev)
        self.spin = cat.load("pdl_spin", dev)
        self.kernels, self.n, self.block = kernels, n, block
        self.grid = -(-n // block)
        self.stream = Stream(dev)
        self.x0 = np.random.default_rng(7).standard_normal(n).astype(np.float32)
        self.want = ref.pdl_chain(self.x0, kernels)
        self.pin = PinnedBuffer.empty((n,), np.float32, dev)
        self.bufs = [DeviceBuffer.allocate(4 * n, self.stream),
                     DeviceBuffer.allocate(4 * n, self.stream)]
        self.packed = [self.step.pack((self.bufs[0], self.bufs[1], n)),
                       self.step.pack((self.bufs[1], self.bufs[0], n))]
        self.start, self.end = Event(dev, timing=True), Event(dev, timing=True)

    def reset(self) -> None:
        self.pin.array[:] = self.x0
        self.bufs[0].copy_from_host(self.pin, self.stream, sync=True)

    def enqueue(self, pdl: bool) -> None:
        """The chain's launches; the first link never carries PDL (it follows the gate)."""
        step, stream, grid, block, packed = (self.step, self.stream, self.grid, self.block,
                                             self.packed)
        step.launch(stream, grid, block, packed[0])
        for i in range(1, self.kernels):
            step.launch(stream, grid, block, packed[i % 2], pdl=pdl)

    def verify(self) -> tuple[bool, str]:
        self.bufs[self.kernels % 2].copy_to_host(self.pin, self.stream, sync=True)
        return ref.close(self.pin.array, self.want, rtol=0, atol=0)

    def close(self) -> None:
        self.stream.synchronize()
        for b in self.bufs:
            b.free()
        self.stream.synchronize()
        for o in (self.start, self.end, self.pin, self.stream):
            o.close()

    # -- stream chains ------------------------------------------------------------------------

    def _gated_run(self, pdl: bool, gate: float) -> tuple[float, float]:
        """One chain behind a gate of ``gate`` ms: (GPU ms, host enqueue ms)."""
        from orchestra.driver import Event

        self.reset()
        self.spin.launch(self.stream, 1, 1, (int(gate * 1e6),))
        self.start.record(self.stream)
        t0 = time.perf_counter()
        self.enqueue(pdl)
        host_ms = (time.perf_counter() - t0) * 1e3
        self.end.record(self.stream)
        self.end.synchronize()
        return Event.elapsed_ms(self.start, self.end), host_ms

    def stream_result(self, pdl: bool, repeats: int, gate_ms: float | None) -> ChainResult:
        # Warm-up chain (untimed) behind a generous gate; it measures the host's enqueue time.
        _, warm_host = self._gated_run(pdl, gate_ms or 50.0)
        ok_all, detail = self.verify()
        gate0 = gate_ms or max(MIN_GATE_MS, 3.0 * warm_host)
        per_kernel, chains, hosts, gates, bound = [], [], [], [], False
        for _ in range(repeats):
            gate = gate0
            for attempt in range(4):
                chain_ms, host_ms = self._gated_run(pdl, gate)
                if host_ms < 0.8 * gate or attempt == 3:
                    break
                gate *= 2  # the host was still enqueueing when the gate opened
            ok, det = self.verify()
            ok_all &= ok
            detail = detail if ok else det
            per_kernel.append(chain_ms * 1e3 / self.kernels)
            chains.append(chain_ms)
            hosts.append(host_ms)
            gates.append(gate)
            bound |= host_ms >= 0.8 * gate
        return ChainResult("stream", self.key, pdl, median(per_kernel), median(chains),
                           median(hosts), max(gates), bound, None, ok_all,
                           detail if not ok_all else
                           f"final output == x0 + {self.kernels} on all {self.n} floats")

    # -- graph chains ---------------------------------------------------------------------------

    def graph_result(self, pdl: bool, repeats: int) -> ChainResult:
        from cuda.bindings import driver as d

        from orchestra.driver import cu

        h = self.stream.handle
        cu(d.cuStreamBeginCapture, h, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            self.enqueue(pdl)
        finally:
            err, graph = d.cuStreamEndCapture(h)  # always leave capture mode
        if int(err):
            from orchestra.driver.check import error_from_result

            raise error_from_result("cuStreamEndCapture", err, context="pdl chain capture")
        gexec = None
        try:
            edges = _programmatic_edges(graph)
            ports = _edge_ports(graph)
            gexec = cu(d.cuGraphInstantiate, graph, 0)
            cu(d.cuGraphUpload, gexec, h)
            timed = self._timed_launches(lambda: cu(d.cuGraphLaunch, gexec, h), repeats)
        finally:
            if gexec is not None:
                cu(d.cuGraphExecDestroy, gexec)
            cu(d.cuGraphDestroy, graph)
        return self._graph_row("graph", pdl, edges, ports, timed)

    def _timed_launches(self, launch: Callable[[], None], repeats: int) -> tuple:
        """``repeats`` timed launches of a graph (after one warm-up), each between the two
        events on the chain's stream and verified: ``(per kernel us, chain ms, host ms, ok,
        detail)`` lists / values."""
        from orchestra.driver import Event

        per_kernel, chains, hosts, ok_all, detail = [], [], [], True, ""
        for rep in range(repeats + 1):  # the first launch warms up
            self.reset()
            self.start.record(self.stream)
            t0 = time.perf_counter()
            launch()
            host_ms = (time.perf_counter() - t0) * 1e3
            self.end.record(self.stream)
            self.end.synchronize()
            chain_ms = Event.elapsed_ms(self.start, self.end)
            ok, det = self.verify()
            ok_all &= ok
            detail = detail if ok else det
            if rep:
                per_kernel.append(chain_ms * 1e3 / self.kernels)
                chains.append(chain_ms)
                hosts.append(host_ms)
        return per_kernel, chains, hosts, ok_all, detail

    def _graph_row(self, mode: str, pdl: bool, edges, ports: str, timed) -> ChainResult:
        per_kernel, chains, hosts, ok_all, detail = timed
        return ChainResult(mode, self.key, pdl, median(per_kernel), median(chains),
                           median(hosts), 0.0, False, edges, ok_all,
                           detail if not ok_all else
                           f"final output == x0 + {self.kernels} on all {self.n} floats"
                           + (f"; edges {ports}" if ports else ""))

    # -- explicitly built graphs ----------------------------------------------------------------

    def build_result(self, pdl: bool, repeats: int) -> ChainResult:
        """The chain as a task graph built node by node (`GraphBuildExecutor`): with ``pdl``,
        every link but the first has the pdl attribute and so a programmatic edge from the link
        before it; the exec is launched on the chain's stream between the events."""
        from orchestra.execute import GraphBuildExecutor
        from orchestra.graph import Buffer, In, KernelNode, KernelRef, Out, TaskGraph

        ref = KernelRef(str(self.spec.path()), self.spec.name)
        n = self.n
        bufs = (Buffer("x0", 4 * n), Buffer("x1", 4 * n))
        g = TaskGraph()
        for i in range(self.kernels):
            g.add(KernelNode(f"link{i}", ref, self.grid, self.block,
                             (In(bufs[i % 2]), Out(bufs[(i + 1) % 2]), n),
                             attributes={"pdl": True} if (pdl and i) else {}))
        with GraphBuildExecutor(self.dev) as ex:
            exe = ex.build(g, bindings={"x0": self.bufs[0], "x1": self.bufs[1]},
                           stream=self.stream)
            try:
                edges = _programmatic_edges(exe.cugraph)
                ports = _edge_ports(exe.cugraph)
                timed = self._timed_launches(lambda: exe.launch(self.stream), repeats)
            finally:
                exe.close()
        return self._graph_row("graph-build", pdl, edges, ports, timed)


def _programmatic_edges(graph) -> int | None:
    """How many of ``graph``'s edges are PROGRAMMATIC dependencies; None when the driver
    cannot say (the count is informative only)."""
    from cuda.bindings import driver as d

    try:
        err, *_, count = d.cuGraphGetEdges(graph, 0)
        if int(err):
            return None
        if not int(count):
            return 0
        err, _from, _to, data, count = d.cuGraphGetEdges(graph, int(count))
        if int(err) or data is None:
            return None
        prog = int(d.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        return sum(1 for e in list(data)[:int(count)] if int(e.type) == prog)
    except Exception:  # noqa: BLE001 - older bindings: no edge data
        return None


def _edge_ports(graph) -> str:
    """The kinds of ``graph``'s edges: ``"programmatic from port 1: 999, full: 0"`` (type and
    ``from_port``, from ``cuGraphGetEdges``); empty when the driver cannot say."""
    from collections import Counter

    from cuda.bindings import driver as d

    try:
        err, *_, count = d.cuGraphGetEdges(graph, 0)
        if int(err) or not int(count):
            return ""
        err, _from, _to, data, count = d.cuGraphGetEdges(graph, int(count))
        if int(err) or data is None:
            return ""
        prog = int(d.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        kinds = Counter(("programmatic" if int(e.type) == prog else "full", int(e.from_port))
                        for e in list(data)[:int(count)])
        return ", ".join(f"{t} from port {p}: {c}" for (t, p), c in sorted(kinds.items()))
    except Exception:  # noqa: BLE001 - older bindings: no edge data
        return ""


def run_pdl_chain(*, kernels: int = 1000, n: int = 256, block: int = 256, repeats: int = 5,
                  gate_ms: float | None = None, graphs: bool = True, links=LINKS,
                  device=None, progress: Callable[[str, int, int], None] | None = None
                  ) -> PdlReport:
    """Measure (see the module doc). ``gate_ms`` None: scaled from the host's enqueue time.
    ``graphs``: also time the chains as CUDA graph replays. ``links``: the link kernels.
    ``progress(stage, done, total)`` is called before each measured configuration. With
    ``graphs``, each link is also timed as a captured graph and as a task graph built node by
    node (programmatic edges)."""
    from orchestra.driver import Device

    if kernels < 1 or n < 1 or repeats < 1 or (gate_ms is not None and gate_ms <= 0):
        raise BenchConfigError("need kernels >= 1, n >= 1, repeats >= 1, gate_ms > 0")
    dev = device if isinstance(device, Device) else Device.get(device or 0)
    dev.make_current()
    results: list[ChainResult] = []
    grid = -(-n // block)
    # without PDL the links behave alike: time one (the first) without, every one with PDL
    total = (len(links) + 1) * (3 if graphs else 1)

    def step(what: str) -> None:
        if progress is not None:
            progress(what, len(results), total)

    for key in links:
        chain = _Chain(dev, key, kernels, n, block)
        try:
            for pdl in (False, True):
                if pdl or key == links[0]:
                    step(f"{key} stream chain{' with PDL' if pdl else ''}")
                    results.append(chain.stream_result(pdl, repeats, gate_ms))
            if graphs:
                for pdl in (False, True):
                    if pdl or key == links[0]:
                        step(f"{key} graph chain{' with PDL' if pdl else ''}")
                        results.append(chain.graph_result(pdl, repeats))
                for pdl in (False, True):
                    if pdl or key == links[0]:
                        step(f"{key} built graph chain{' with PDL' if pdl else ''}")
                        results.append(chain.build_result(pdl, repeats))
        finally:
            chain.close()
    return PdlReport(dev.name, kernels, n, block, grid, repeats, tuple(results))

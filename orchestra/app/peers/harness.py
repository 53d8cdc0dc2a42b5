"""``orchestra bench peers``: every contender on every workload, in one process on one GPU
(needs a GPU; `run_peers` is the entry point).

Per workload: the data (one pinned input and one pinned output array; float32 uniform [0, 1)
from a fixed seed), the bound from sustained times measured in the same run for the batch size
at hand (`orchestra.app.job.bound`), then every contender built and run round by round,
interleaved, so that drift hits all alike: round 0 warms up, rounds 1..repeat are timed. Every
run's output is poisoned with NaN first and compared with numpy after, outside the timing: in
full on the warm-up and the last round (and every round of outputs up to 4 Mi elements), on a
sample covering every batch in between (`check.sample_indices`). A contender that fails to
build or to run is reported as skipped with the error, and the others go on.

The request workload runs ``requests`` single requests per contender in chunks of 100,
interleaved, each one poisoned, timed (host clock around the call, which waits) and checked;
wall = p50, beside it the p99. The chain workload resets its input, runs the chain and checks
the final buffer against numpy every run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import platform
import statistics
import time
from typing import Callable

import numpy as np

from orchestra.app.peers import check as ck
from orchestra.app.peers import optional
from orchestra.app.peers.report import PeersReport, Row, add_ratios
from orchestra.app.peers.workloads import Workload
from orchestra.errors import BenchConfigError

BLOCK = 256
REQUEST_CHUNK = 100
REQUEST_WARMUP = 50
BURN_ST = (ck.SCALE, ck.SHIFT)

_log = logging.getLogger(__name__)


@contextlib.contextmanager
def _watchdog(seconds: float | None):
    """After ``seconds`` faulthandler dumps every thread's stack and exits with status 1: a
    hung workload never holds the GPU forever."""
    if not seconds:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# -- data ---------------------------------------------------------------------------------------


class PipelineData:
    """The data of a pipeline workload, its kernel and its bound (closes its pinned arrays).

    Thread-safety: not thread-safe: made and used by the harness's thread; the contenders that read
    it run one after another.
    """

    def __init__(self, dev, spec: Workload, resolver, seed: int = 0):
        from orchestra.app.job import data as jd
        from orchestra.app.job.graphs import burn_grid, burn_kernel_ref
        from orchestra.app.job.policy import fills_gpu
        from orchestra.app.job.sustained import items_for
        from orchestra.app.job.timing import BatchTimer
        from orchestra.driver import PinnedBuffer, Stream

        self.dev, self.spec, self.resolver = dev, spec, resolver
        self.batches, self.batch_bytes = spec.batches, spec.batch_bytes
        self.n = spec.batch_bytes // 4
        self.total = self.n * self.batches
        self.sizes = [self.batch_bytes] * self.batches
        self.block = BLOCK
        self.burn_st = BURN_ST
        self.pin_in = PinnedBuffer.empty(self.total, np.float32, dev)
        try:
            self.pin_out = PinnedBuffer.empty(self.total, np.float32, dev)
        except BaseException:
            self.pin_in.close()
            raise
        self.x, self.y = self.pin_in.array, self.pin_out.array
        jd.fill_uniform(self.x, seed)
        self.grid = burn_grid(self.n, BLOCK, dev.sm_count)
        self.kernel = resolver.resolve(burn_kernel_ref())
        # what orchestra's auto reads (two compute streams for a kernel smaller than the GPU)
        self.kernel_fills_gpu = fills_gpu(self.kernel, self.grid, BLOCK, dev.sm_count)
        with Stream(dev) as s:
            timer = BatchTimer(self.kernel, s, self.x[:self.n], self.y[:self.n],
                               grid=self.grid, block=BLOCK)
            try:
                iters = spec.iters
                if iters is None:  # calibrate to the slower copy, then make it odd
                    iters = timer.measure(None).iters
                self.iters = ck.odd_iters(iters)
                self.streams = bound_streams(dev, self)
                # eager and graph contenders share the bound: the items both ways, the
                # faster counting
                self.single = timer.measure(
                    self.iters, items=items_for(self.batches, self.batch_bytes,
                                                streams=self.streams),
                    streams=self.streams, launch="both")
            finally:
                timer.close()
        self.bound = self.single.bound(self.sizes)
        self.sample = (ck.sample_indices(self.total, self.n) if self.total > ck.SAMPLE_ABOVE
                       else None)

    def poison(self, full: bool) -> None:
        ck.poison(self.y, None if full or self.sample is None else self.sample)

    def check(self, full: bool) -> tuple[bool, str]:
        if full or self.sample is None:
            return ck.check_negated(self.x, self.y)
        return ck.check_sample(self.x, self.y, self.sample)

    def info(self) -> dict:
        su = self.single.sustained
        assert su is not None  # measured with items= above
        return {**self.spec.as_dict(), "label": self.spec.label, "iters_used": self.iters,
                "bound": self.bound.as_dict(), "kernel_fills_gpu": self.kernel_fills_gpu,
                "bound_line": (f"{self.bound.describe()}; sustained per batch ({su.items} "
                               f"items, the faster of 1 and {su.streams} streams): H2D "
                               f"{su.h2d_ms:.4f}, kernel {su.kernel_ms:.4f}, D2H "
                               f"{su.d2h_ms:.4f}, pair {su.pair_ms:.4f} ms ({su.copies}; "
                               f"{su.launch_note}); burn "
                               f"{self.iters} iters")}

    def close(self) -> None:
        del self.x, self.y  # the views go before the pinned memory behind them
        self.pin_in.close()
        self.pin_out.close()


def bound_streams(dev, w) -> int:
    """The most streams any pipeline contender of workload data ``w`` runs on: 3 for the
    hand-written and framework peers and for by-engine, the streams of orchestra's ``auto``
    (`orchestra_side.pipeline_policy`, eager and graph modes): its lanes where its copies run
    as copy kernels, 4 for the graph rows' by-engine when the kernel is smaller than the GPU
    (``w.kernel_fills_gpu`` False) and batches are at most 16 MiB. The bound's sustained times are measured spread over
    that many streams, so that it holds for the contender with the most concurrency."""
    from orchestra.app.peers.orchestra_side import pipeline_policy
    from orchestra.execute.copy_table import copy_policy
    from orchestra.execute.lowering.copy_policy import MODES

    return max(3, *(pipeline_policy(w, copy_policy(dev, mode),
                                    executor=f"{mode} executor").streams for mode in MODES))


class RequestData:
    """One request's pinned input / output (``n`` floats), kernel and bound.

    Thread-safety: not thread-safe: made and used by the harness's thread; the contenders that read
    it run one after another.
    """

    def __init__(self, dev, spec: Workload, resolver, seed: int = 0):
        from orchestra.app.job.graphs import burn_grid, burn_kernel_ref
        from orchestra.app.job.timing import BatchTimer
        from orchestra.driver import PinnedBuffer, Stream

        self.dev, self.spec, self.resolver = dev, spec, resolver
        self.n = spec.batch_bytes // 4
        self.block = BLOCK
        self.burn_st = BURN_ST
        self.iters = ck.odd_iters(spec.iters or 1)
        self.pin_in = PinnedBuffer.empty(self.n, np.float32, dev)
        self.pin_out = PinnedBuffer.empty(self.n, np.float32, dev)
        self.x, self.y = self.pin_in.array, self.pin_out.array
        self.x[:] = np.random.default_rng(seed).random(self.n, dtype=np.float32)
        self.want = ck.negate(self.x)
        self.grid = burn_grid(self.n, BLOCK, dev.sm_count)
        self.kernel = resolver.resolve(burn_kernel_ref())
        with Stream(dev) as s:
            timer = BatchTimer(self.kernel, s, self.x, self.y, grid=self.grid, block=BLOCK)
            try:
                # per-item times of 16 back-to-back requests: one gated item alone still
                # carries a launch gap per step, so h + k + d of single items overstates
                # what one request must take (runs beat it by ~3%)
                self.single = timer.measure(self.iters, items=16, launch="both")
            finally:
                timer.close()
        self.bound = self.single.bound(1)

    def info(self) -> dict:
        return {**self.spec.as_dict(), "label": self.spec.label, "iters_used": self.iters,
                "bound": self.bound.as_dict(),
                "bound_line": f"{self.bound.describe()} (one request, sustained per-item GPU times of 16)"}

    def close(self) -> None:
        del self.x, self.y  # the views go before the pinned memory behind them
        self.pin_in.close()
        self.pin_out.close()


class ChainData:
    """Two device buffers, the link kernel, the input and the numpy result of the chain.

    Thread-safety: not thread-safe: made and used by the harness's thread; the contenders that read
    it run one after another.
    """

    def __init__(self, dev, spec: Workload, resolver, seed: int = 7):
        from orchestra.app.kernels_bench import reference as ref
        from orchestra.compiler.sources import kernel_source_dir
        from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream
        from orchestra.graph import KernelRef

        self.dev, self.spec, self.resolver = dev, spec, resolver
        self.n, self.kernels = spec.batch_bytes // 4, spec.kernels
        self.block = BLOCK
        self.grid = -(-self.n // BLOCK)
        self.step_ref = KernelRef(str(kernel_source_dir() / "pdl.cu"), "pdl_chain_step")
        self.step = resolver.resolve(self.step_ref)
        self.x0 = np.random.default_rng(seed).standard_normal(self.n).astype(np.float32)
        self.want = ref.pdl_chain(self.x0, self.kernels)
        self.stream = Stream(dev)
        self.pin = PinnedBuffer.empty((self.n,), np.float32, dev)
        self.bufs = [DeviceBuffer.allocate(4 * self.n, self.stream),
                     DeviceBuffer.allocate(4 * self.n, self.stream)]
        self.stream.synchronize()

    def reset(self) -> None:
        self.pin.array[:] = self.x0
        self.bufs[0].copy_from_host(self.pin, self.stream, sync=True)

    def result(self) -> np.ndarray:
        self.bufs[self.kernels % 2].copy_to_host(self.pin, self.stream, sync=True)
        return self.pin.array.copy()

    def info(self) -> dict:
        return {**self.spec.as_dict(), "label": self.spec.label,
                "bound_line": (f"no bound (efficiency -): {self.kernels} dependent launches of "
                               f"pdl_chain_step, {self.n} floats, grid {self.grid} x "
                               f"{self.block}")}

    def close(self) -> None:
        self.stream.synchronize()
        for b in self.bufs:
            b.close()
        self.stream.synchronize()
        self.pin.close()
        self.stream.close()


# -- contenders ---------------------------------------------------------------------------------


def pipeline_contenders(w, peers: dict) -> list[tuple[str, Callable]]:
    """(label, factory) of every pipeline contender; peers: name -> module (present ones)."""
    from orchestra.app.peers import cuda_python as cp_
    from orchestra.app.peers import frameworks as fw
    from orchestra.app.peers.orchestra_side import OrchestraPipeline

    out = [("orchestra eager", lambda: OrchestraPipeline(w, "eager")),
           ("orchestra capture", lambda: OrchestraPipeline(w, "capture")),
           ("orchestra graph-build", lambda: OrchestraPipeline(w, "graph-build")),
           ("cuda-python classic loop", lambda: cp_.ByHand(w, "classic")),
           ("cuda-python by-engine", lambda: cp_.ByHand(w, "by-engine")),
           ("cuda-python bare graph", lambda: cp_.BareGraph(w))]
    if "cupy" in peers:
        out += [("CuPy loop", lambda: fw.CuPyLoop(w, peers["cupy"])),
                ("CuPy graph", lambda: fw.CuPyGraph(w, peers["cupy"]))]
    if "torch" in peers:
        out += [("PyTorch loop", lambda: fw.TorchLoop(w, peers["torch"])),
                ("PyTorch graph", lambda: fw.TorchGraph(w, peers["torch"]))]
    return out


def request_contenders(r, peers: dict) -> list[tuple[str, Callable]]:
    from orchestra.app.peers import cuda_python as cp_
    from orchestra.app.peers import frameworks as fw
    from orchestra.app.peers.orchestra_side import OrchestraRequest

    out = [("orchestra eager", lambda: OrchestraRequest(r, "eager", external=False)),
           ("orchestra eager external", lambda: OrchestraRequest(r, "eager")),
           ("orchestra capture", lambda: OrchestraRequest(r, "capture")),
           ("orchestra graph-build", lambda: OrchestraRequest(r, "graph-build")),
           ("cuda-python bare", lambda: cp_.BareRequest(r)),
           ("cuda-python bare graph", lambda: cp_.BareRequest(r, graph=True))]
    if "cupy" in peers:
        out += [("CuPy eager", lambda: fw.CuPyRequest(r, peers["cupy"])),
                ("CuPy graph", lambda: fw.CuPyRequest(r, peers["cupy"], graph=True))]
    if "torch" in peers:
        out += [("PyTorch eager", lambda: fw.TorchRequest(r, peers["torch"])),
                ("PyTorch graph", lambda: fw.TorchRequest(r, peers["torch"], graph=True))]
    return out


def chain_contenders(c, peers: dict) -> list[tuple[str, Callable]]:
    from orchestra.app.peers import cuda_python as cp_
    from orchestra.app.peers import frameworks as fw
    from orchestra.app.peers.orchestra_side import OrchestraChain

    out: list[tuple[str, Callable]] = []
    for pdl in (False, True):
        out += [(f"orchestra eager pdl={pdl}", lambda pdl=pdl: OrchestraChain(c, "eager", pdl)),
                (f"orchestra capture pdl={pdl}",
                 lambda pdl=pdl: OrchestraChain(c, "capture", pdl))]
    out.append(("orchestra graph-build", lambda: OrchestraChain(c, "graph-build", False)))
    for graph in (False, True):
        for pdl in (False, True):
            out.append((f"cuda-python graph={graph} pdl={pdl}",
                        lambda g=graph, p=pdl: cp_.BareChain(c, pdl=p, graph=g)))
    if "cupy" in peers:
        out += [("CuPy stream", lambda: fw.CuPyChain(c, peers["cupy"])),
                ("CuPy graph", lambda: fw.CuPyChain(c, peers["cupy"], graph=True))]
    return out


def _build_all(factories, label: str, skipped: list, log) -> list:
    made = []
    for what, make in factories:
        try:
            made.append(make())
            log(f"{label}: built {made[-1].name}")
        except Exception as exc:  # noqa: BLE001 - one broken contender must not stop the rest
            skipped.append(f"{label}: {what}: could not be built ({type(exc).__name__}: "
                           f"{_short(exc)})")
            log(f"{label}: {what}: build failed: {type(exc).__name__}: {exc}")
    return made


def _short(exc, limit: int = 160) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _close_all(items) -> None:
    for c in items:
        try:
            c.close()
        except Exception:  # noqa: BLE001 - closing after a failure: keep closing the rest
            pass


# -- runs -----------------------------------------------------------------------------------------


def run_pipeline(w: PipelineData, peers: dict, repeat: int, skipped: list, log,
                 factories=None) -> list[Row]:
    """Every pipeline contender (``factories``: (label, factory) pairs, default
    `pipeline_contenders`) over ``repeat`` timed rounds after a warm-up, interleaved; one
    `Row` each (a contender that fails to build or run goes to ``skipped``)."""
    label = w.spec.label
    if factories is None:
        factories = pipeline_contenders(w, peers)
    impls = _build_all(factories, label, skipped, log)
    walls: dict[int, list[float]] = {id(c): [] for c in impls}
    host: dict[int, list[float]] = {id(c): [] for c in impls}
    ok = {id(c): (True, "") for c in impls}
    live = list(impls)
    try:
        for rnd in range(repeat + 1):
            full = rnd == 0 or rnd == repeat
            for c in list(live):
                w.poison(full)
                t0 = time.perf_counter_ns()
                try:
                    c()
                except Exception as exc:  # noqa: BLE001 - drop the contender, report it
                    live.remove(c)
                    skipped.append(f"{label}: {c.name}: failed in round {rnd} "
                                   f"({type(exc).__name__}: {_short(exc)})")
                    log(f"{label}: {c.name} failed: {exc}")
                    continue
                wall = (time.perf_counter_ns() - t0) / 1e6
                good, detail = w.check(full)
                if not good and ok[id(c)][0]:
                    ok[id(c)] = (False, detail)
                if rnd:
                    walls[id(c)].append(wall)
                    if c.host_us is not None:
                        host[id(c)].append(c.host_us)
            log(f"{label}: round {rnd} done")
    finally:
        _close_all(impls)
    rows = []
    for c in live:
        wall = statistics.median(walls[id(c)])
        good, detail = ok[id(c)]
        note = c.note() if good else f"{detail}; {c.note()}".rstrip("; ")
        hu = statistics.median(host[id(c)]) if host[id(c)] else None
        rows.append(Row(label, c.name, c.family, c.mode, wall, runs=len(walls[id(c)]),
                        efficiency=w.bound.efficiency(wall),
                        host_us_per_node=None if hu is None else hu / w.spec.nodes,
                        verified=good, note=note, wall_ms_runs=walls[id(c)]))
    return rows


def run_requests(r: RequestData, peers: dict, skipped: list, log,
                 factories=None) -> list[Row]:
    """``r.spec.requests`` single requests per contender (after `REQUEST_WARMUP`), in chunks
    of `REQUEST_CHUNK` interleaved; each poisoned, timed and checked; p50 / p99 rows."""
    label = r.spec.label
    if factories is None:
        factories = request_contenders(r, peers)
    impls = _build_all(factories, label, skipped, log)
    times: dict[int, list[float]] = {id(c): [] for c in impls}
    bad = {id(c): 0 for c in impls}
    first = {id(c): "" for c in impls}
    live = list(impls)
    want, y = r.want, r.y
    total = r.spec.requests

    def one(c, timed):
        y[:] = np.nan
        t0 = time.perf_counter_ns()
        c()
        dt = (time.perf_counter_ns() - t0) / 1e6
        good, detail = ck.check_equal(y, want)
        if not good:
            bad[id(c)] += 1
            first[id(c)] = first[id(c)] or detail
        if timed:
            times[id(c)].append(dt)

    try:
        for c in list(live):
            try:
                for _ in range(REQUEST_WARMUP):
                    one(c, False)
            except Exception as exc:  # noqa: BLE001
                live.remove(c)
                skipped.append(f"{label}: {c.name}: failed ({type(exc).__name__}: "
                               f"{_short(exc)})")
        done = 0
        while done < total:
            chunk = min(REQUEST_CHUNK, total - done)
            for c in list(live):
                try:
                    for _ in range(chunk):
                        one(c, True)
                except Exception as exc:  # noqa: BLE001
                    live.remove(c)
                    skipped.append(f"{label}: {c.name}: failed ({type(exc).__name__}: "
                                   f"{_short(exc)})")
            done += chunk
        log(f"{label}: {total} requests per contender done")
    finally:
        _close_all(impls)
    rows = []
    for c in live:
        t = np.asarray(times[id(c)])
        p50 = float(np.percentile(t, 50))
        p99 = float(np.percentile(t, 99))
        good = bad[id(c)] == 0
        note = "" if good else f"{bad[id(c)]} wrong outputs; first: {first[id(c)]}"
        rows.append(Row(label, c.name, c.family, c.mode, p50, runs=t.size, p99_ms=p99,
                        efficiency=r.bound.efficiency(p50), verified=good, note=note,
                        wall_ms_runs=[]))
    return rows


def run_chain(c: ChainData, peers: dict, repeat: int, skipped: list, log,
              factories=None) -> list[Row]:
    """Every chain contender, ``repeat`` timed runs after a warm-up, interleaved; each run
    resets the input and checks the final buffer (the contender's own ``reset`` / ``result``
    where it has them, else the shared buffers')."""
    label = c.spec.label
    if factories is None:
        factories = chain_contenders(c, peers)
    impls = _build_all(factories, label, skipped, log)
    walls: dict[int, list[float]] = {id(x): [] for x in impls}
    host: dict[int, list[float]] = {id(x): [] for x in impls}
    ok = {id(x): (True, "") for x in impls}
    live = list(impls)
    try:
        for rnd in range(repeat + 1):
            for x in list(live):
                reset = getattr(x, "reset", c.reset)
                result = getattr(x, "result", c.result)
                try:
                    reset()
                    t0 = time.perf_counter_ns()
                    x()
                    wall = (time.perf_counter_ns() - t0) / 1e6
                    good, detail = ck.check_equal(result(), c.want)
                except Exception as exc:  # noqa: BLE001
                    live.remove(x)
                    skipped.append(f"{label}: {x.name}: failed ({type(exc).__name__}: "
                                   f"{_short(exc)})")
                    continue
                if not good and ok[id(x)][0]:
                    ok[id(x)] = (False, detail)
                if rnd:
                    walls[id(x)].append(wall)
                    if x.host_us is not None:
                        host[id(x)].append(x.host_us)
    finally:
        _close_all(impls)
    rows = []
    for x in live:
        wall = statistics.median(walls[id(x)])
        good, detail = ok[id(x)]
        hu = statistics.median(host[id(x)]) if host[id(x)] else None
        note = x.note() if good else detail
        rows.append(Row(label, x.name, x.family, x.mode, wall, runs=len(walls[id(x)]),
                        host_us_per_node=None if hu is None else hu / c.kernels,
                        verified=good, note=note, wall_ms_runs=walls[id(x)]))
    return rows


# -- entry point ----------------------------------------------------------------------------------


def versions(peers: dict) -> dict:
    from cuda.bindings import driver as d

    import orchestra

    out = {"orchestra": getattr(orchestra, "__version__", "?"), "python": platform.python_version(),
           "numpy": np.__version__}
    try:
        import cuda.bindings

        out["cuda-bindings"] = getattr(cuda.bindings, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    err, v = d.cuDriverGetVersion()
    if not int(err):
        out["driver CUDA"] = f"{int(v) // 1000}.{int(v) % 1000 // 10}"
    for name, mod in peers.items():
        out[name] = optional.version_of(mod)
    return out


def probe_peers(skip=(), prober=optional.probe) -> tuple[dict, list[str]]:
    """(peer name -> module for those that run, notes for those that do not)."""
    notes: list[str] = []
    peers: dict = {}
    for name in optional.PEERS:
        if name in skip:
            notes.append(f"{optional.LABEL[name]}: left out (--skip)")
            continue
        got = prober(name)
        if isinstance(got, optional.Skip):
            notes.append(got.note)
        else:
            peers[name] = got
    return peers, notes


def run_peers(workloads: list[Workload], *, repeat: int = 5, device=0, skip=(),
              progress: Callable[[str, int, int], None] | None = None,
              workload_timeout_s: float | None = 240.0, prober=optional.probe) -> PeersReport:
    """Run ``workloads`` (see `workloads.parse_workloads`) and return the `PeersReport`.

    ``repeat``: timed runs per contender (>= 1; the request workload always times its
    ``requests``). ``skip``: peers to leave out ("cupy", "torch"). ``progress(stage, done,
    total)``: called as each workload starts (the CLI's bar); every step is also logged at
    DEBUG level. ``workload_timeout_s``: a workload running longer dumps every stack and
    exits (status 1). Raises `NoDeviceError` without a GPU (before any work)."""
    from orchestra.driver import Device
    from orchestra.execute import KernelResolver

    if repeat < 1:
        raise BenchConfigError(f"repeat must be >= 1; got {repeat!r}")
    dev = device if isinstance(device, Device) else Device.get(device or 0)
    dev.make_current()
    peers, skipped = probe_peers(skip, prober)
    dev.make_current()  # a peer's import may have changed the current context
    resolver = KernelResolver(dev)
    t_start = time.perf_counter()

    def stamp(msg):
        _log.debug("[%6.1f s] %s", time.perf_counter() - t_start, msg)

    rows: list[Row] = []
    infos: list[dict] = []
    for i, spec in enumerate(workloads):
        if progress is not None:
            progress(spec.label, i, len(workloads))
        stamp(f"{spec.label}: setting up")
        with _watchdog(workload_timeout_s):
            if spec.kind == "pipeline":
                pipe = PipelineData(dev, spec, resolver)
                try:
                    infos.append(pipe.info())
                    stamp(f"{spec.label}: {pipe.bound.describe()}")
                    rows += run_pipeline(pipe, peers, repeat, skipped, stamp)
                finally:
                    pipe.close()
            elif spec.kind == "request":
                req = RequestData(dev, spec, resolver)
                try:
                    infos.append(req.info())
                    rows += run_requests(req, peers, skipped, stamp)
                finally:
                    req.close()
            else:
                chain = ChainData(dev, spec, resolver)
                try:
                    infos.append(chain.info())
                    rows += run_chain(chain, peers, repeat, skipped, stamp)
                finally:
                    chain.close()
        stamp(f"{spec.label}: done")
    if progress is not None:
        progress("done", len(workloads), len(workloads))
    add_ratios(rows)
    return PeersReport(dev.name, versions(peers), infos, rows, skipped, repeat)


__all__ = ["ChainData", "PipelineData", "RequestData", "chain_contenders",
           "pipeline_contenders", "probe_peers", "request_contenders", "run_chain", "run_peers",
           "run_pipeline", "run_requests", "versions"]

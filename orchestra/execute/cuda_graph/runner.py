"""`GraphRunner`: a graph executor behind the eager executor's interface.

``orchestra run --executor capture|graph`` and the main job drive every executor the same way
(``prepare(graph, policy=, streams=, costs=)`` -> plan; ``run(graph, plan, bindings)`` ->
`RunResult`; ``kernels``; ``close()``). `GraphRunner` gives the graph executors that shape:

- the first ``run`` of a (graph, plan) builds and instantiates its CUDA graph (capture or
  explicit build; the time goes to ``RunResult.prepare_ms``) with that run's bindings; the exec
  is cached (a `GraphCache`, LRU, ``cache_size``) and leased for each launch, so an eviction
  never closes an exec while a run launches it;
- every ``run`` is then a `GraphExec.replay` with the run's bindings (only arrays that changed
  are rebound) and one ``cuGraphLaunch``; ``wall_ms`` is host time from the replay call to the
  end of the synchronize, ``enqueue_us`` the replay call alone;
- ``dot(path)`` writes the last exec's graph with ``cuGraphDebugDotPrint`` (``--graph-dot``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Mapping

from orchestra.errors import NotReadyError
from orchestra.execute.closable import Closable
from orchestra.execute.cuda_graph.cache import GraphCache
from orchestra.execute.cuda_graph.executor import GraphExecutorBase
from orchestra.execute.errors import ExecutorArgumentValueError
from orchestra.execute.occupancy import capacity_for
from orchestra.execute.resources import PlanCache
from orchestra.execute.result import RunResult
from orchestra.graph import TaskGraph
from orchestra.schedule import Plan

log = logging.getLogger(__name__)

KINDS = {"capture": "capture", "graph": "graph-build", "graph-build": "graph-build"}


class GraphRunner(Closable):
    """``kind``: ``"capture"`` or ``"graph"`` (explicit build). Other arguments as for the
    executors (`CaptureExecutor`, `GraphBuildExecutor`; ``copy_lowering``: how host copies
    are built, see `GraphExecutorBase.build`); ``trace=True`` builds traced execs (each run's
    `RunResult.timeline` is set).

    Thread-safety: may be shared between threads: `run`, `synchronize` and `close` hold the runner's
    re-entrant lock, so runs from several threads serialize (one exec per signature, launched one
    run at a time).
    """

    def __init__(self, kind: str = "capture", device=None, *, verify: bool = True,
                 kernel_resolver=None, cache_size: int = 8, auto_free: bool = False,
                 mode="thread-local", trace: bool = False, driver=None, copy_lowering="auto"):
        if kind not in KINDS:
            raise ExecutorArgumentValueError(
                f"GraphRunner kind must be one of {', '.join(KINDS)}; got {kind!r}")
        self.kind = KINDS[kind]
        self.executor: GraphExecutorBase
        if self.kind == "capture":
            from orchestra.execute.cuda_graph.capture import CaptureExecutor

            self.executor = CaptureExecutor(device, mode=mode, verify=verify,
                                            kernel_resolver=kernel_resolver, auto_free=auto_free,
                                            driver=driver, copy_lowering=copy_lowering)
        else:
            from orchestra.execute.cuda_graph.build import GraphBuildExecutor

            self.executor = GraphBuildExecutor(device, verify=verify,
                                               kernel_resolver=kernel_resolver,
                                               auto_free=auto_free, driver=driver,
                                               copy_lowering=copy_lowering)
        self.device = self.executor.device
        self.kernels = self.executor.kernels
        self.trace = bool(trace)
        self.cache_size = max(1, int(cache_size))
        self._plans = PlanCache(self.cache_size)
        self._execs = GraphCache(max_entries=self.cache_size)  # key -> _Cached
        self._lock = threading.RLock()
        self.last_exec = None
        self._closed = False

    def copy_policy(self, copy_lowering=None):
        """The `CopyPolicy` the runner's executor lowers host copies with
        (`ExecutorBase.copy_policy`: ``copy_lowering`` or None for the runner's own)."""
        return self.executor.copy_policy(copy_lowering)

    # -- plans --------------------------------------------------------------------------------

    def plan_for(self, graph: TaskGraph, policy: str = "by-engine", streams: int = 3,
                 costs=None) -> Plan:
        """``schedule(graph, policy, streams, costs)``, cached for the same graph object
        (``concurrent``: with each kernel's resident capacity, `occupancy`)."""
        return self._plans.get(graph, policy, streams, costs,
                               capacity_for(policy, self.kernels, self.device))

    def prepare(self, graph: TaskGraph, plan: Plan | None = None, *, policy: str = "by-engine",
                streams: int = 3, costs=None) -> Plan:
        """The plan (scheduled when None); the CUDA graph itself is built by the first `run`,
        which has the bindings it bakes in."""
        self._check_open()
        return plan if plan is not None else self.plan_for(graph, policy, streams, costs)

    # -- running ------------------------------------------------------------------------------

    def run(self, graph: TaskGraph, plan: Plan | None = None,
            bindings: Mapping[str, Any] | None = None, *, policy: str = "by-engine",
            streams: int = 3, sync: bool = True, tracer=None, costs=None,
            trace: bool = False) -> RunResult:
        """Build (first time) or replay the graph exec of (graph, plan) with ``bindings``;
        returns a `RunResult` like the eager executor's. ``tracer``: anything truthy builds a
        traced exec (the graph's own event-record nodes; the eager `EventTimer` protocol does
        not apply to a graph); ``trace=True`` does the same (the eager executor's spelling)."""
        with self._lock:
            self._check_open()
            plan = plan if plan is not None else self.plan_for(graph, policy, streams, costs)
            trace = self.trace or trace or tracer is not None
            # the entry holds graph and plan, so their ids cannot be reused while it is cached
            key = (id(graph), len(graph), id(plan), trace)
            built_ms: list[float] = []

            def build(_key):
                t0 = time.perf_counter_ns()
                exe = self.executor.build(graph, plan, bindings, trace=trace)
                built_ms.append((time.perf_counter_ns() - t0) / 1e6)
                log.debug("graph runner: built a %s exec of %d nodes in %.1f ms", self.kind,
                          exe.node_count, built_ms[-1])
                return _Cached(graph, plan, exe)

            with self._execs.lease(key, build) as cached:
                exe = cached.exe
                self.last_exec = exe
                t0 = time.perf_counter_ns()
                exe.replay(bindings, sync=False)
                t1 = time.perf_counter_ns()
                timeline = None
                wall = None
                if sync:
                    timeline = exe.synchronize()
                    wall = (time.perf_counter_ns() - t0) / 1e6
                nodes = exe.node_count  # while leased: an evicted exec closes at the lease's end
            prepare_ms = built_ms[0] if built_ms else 0.0
            return RunResult(wall, (t1 - t0) / 1e3, nodes, 1, plan.event_count,
                             plan.wait_count, len(plan.streams), plan.policy, prepare_ms,
                             timeline, exe.copy_kernels)

    def synchronize(self):
        """Wait for the last exec's launches (``sync=False`` runs)."""
        with self._lock:
            if self.last_exec is not None and not self.last_exec.closed:
                return self.last_exec.synchronize()
            return None

    def dot(self, path, *, verbose: bool = False) -> str:
        """The last exec's graph as DOT (``cuGraphDebugDotPrint``); ValueError before any run."""
        if self.last_exec is None or self.last_exec.closed:
            raise NotReadyError("no graph has been built yet: run() first")
        return self.last_exec.dot(path, verbose=verbose)

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Close every cached exec, then the executor (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._execs.clear()  # closes every exec (a leased one at its lease's end)
            self._plans.clear()
            self.last_exec = None
            self.executor.close()

    def __repr__(self) -> str:
        return f"<GraphRunner {self.kind}: {len(self._execs)} cached execs>"


class _Cached:
    """A cached exec with the graph and plan it was built from (kept alive: the cache key
    holds their ids); closing it closes the exec."""

    __slots__ = ("graph", "plan", "exe")

    def __init__(self, graph, plan, exe):
        self.graph, self.plan, self.exe = graph, plan, exe

    def close(self) -> None:
        self.exe.close()


__all__ = ["GraphRunner", "KINDS"]

"""`GraphExecutorBase`: what the capture and the graph-build executor share on top of
`ExecutorBase`: ``build`` (a `BuiltGraph` instantiated into a `GraphExec`, not launched),
``run`` (build and launch once), the rebuild an exec's ``update`` uses, and the graph-memory
opt-in (``auto_free``)."""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping

from orchestra.driver import Stream
from orchestra.execute.base import ExecutorBase
from orchestra.execute.cuda_graph.built import BuiltGraph
from orchestra.execute.cuda_graph.exec import AUTO_FREE_ON_LAUNCH, GraphExec
from orchestra.execute.errors import ExecutorArgumentTypeError
from orchestra.graph import TaskGraph
from orchestra.schedule import Plan, schedule


class GraphExecutorBase(ExecutorBase):
    """Shared setup of the graph executors (see `ExecutorBase`), plus ``auto_free``: allow
    Allocs without Frees and instantiate with ``CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH``
    (the opt-in to allocations the graph does not free).

    Subclasses implement ``_build_graph(taskgraph, plan, bindings, *, trace, policy, streams,
    costs, auto_free, copies, **kw) -> BuiltGraph`` (``copies``: the build's `CopyPolicy`).

    Thread-safety: see `CaptureExecutor` (captures serialize on the executor's lock) and
    `GraphBuildExecutor` (serialize builds yourself); `close` holds the executor's lock.
    """

    _build_graph: Callable[..., BuiltGraph]  # each subclass's own (see above)

    executor_name = "graph"
    _device_verb = "builds for"
    _takes = "build()"

    def __init__(self, device=None, *, verify: bool = True, kernel_resolver=None,
                 auto_free: bool = False, driver=None, copy_lowering="auto"):
        super().__init__(device, verify=verify, kernel_resolver=kernel_resolver, driver=driver,
                         copy_lowering=copy_lowering)
        self.auto_free = bool(auto_free)

    def _plan(self, graph, plan, policy, streams, costs, need: bool) -> Plan | None:
        if plan is not None:
            if not isinstance(plan, Plan):
                raise ExecutorArgumentTypeError(
                    f"plan must be a schedule.Plan, got {type(plan).__name__}")
            return plan
        if not need:
            return None
        from orchestra.execute.occupancy import capacity_for

        capacity = capacity_for(policy, self.kernels, self.device)
        return schedule(graph, policy, streams, costs,
                        resident_blocks=capacity(graph) if capacity is not None else None)

    # -- public -------------------------------------------------------------------------------

    def build(self, graph: TaskGraph, plan: Plan | None = None,
              bindings: Mapping[str, Any] | None = None, *, policy: str = "by-engine",
              streams: int = 3, costs=None, trace: bool = False, upload: bool = True,
              auto_free: bool | None = None, stream: Stream | None = None,
              copy_lowering=None, **kw) -> GraphExec:
        """Build ``graph``'s CUDA graph and instantiate it: a `GraphExec`, not launched.

        ``bindings`` (host buffer name -> pinned array, external device buffer name ->
        DeviceBuffer) are checked like the eager executor's, leased until the exec closes
        (docs/errors.md, "Lifetimes"; the modules of the graph's kernels too) and built into
        the graph (replays rebind host arrays and re-point device buffers in place).
        `ClosedBindingError` for a value its owner closed, before any graph is made.
        ``trace``: every launch returns a `Timeline`. ``auto_free``
        (default: the executor's): allow Allocs without Frees and instantiate with
        ``CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH``. ``stream``: the exec's default
        launch stream (default: a new non-blocking one it owns). ``copy_lowering``:
        ``"auto"`` / ``"kernel"`` / ``"copy-engine"`` / a `CopyPolicy` for this build's host
        copies (default: the executor's; a node's own ``lowering=`` wins; `update` rebuilds
        with the same): copy kernels become kernel nodes, which cost no host time at
        ``cuGraphLaunch`` where each memcpy node costs 1.3-1.9 µs (docs/graphs.md).
        """
        if not isinstance(graph, TaskGraph):
            raise ExecutorArgumentTypeError(
                f"build() takes a TaskGraph, got {type(graph).__name__}")
        self._check_open()
        auto_free = self.auto_free if auto_free is None else bool(auto_free)
        options = dict(trace=bool(trace), policy=policy, streams=streams, costs=costs,
                       auto_free=auto_free, copies=self.copy_policy(copy_lowering), **kw)
        built = self._build_graph(graph, plan, bindings, **options)
        rebuild = functools.partial(self._rebuild, options)
        flags = AUTO_FREE_ON_LAUNCH if auto_free else 0
        return GraphExec(built, self.device, flags=flags, upload=upload, rebuild=rebuild,
                         stream=stream, driver=self.api)

    def _rebuild(self, options, graph, plan, bindings):
        self._check_open()
        return self._build_graph(graph, plan, bindings, **options)

    def run(self, graph: TaskGraph, plan: Plan | None = None,
            bindings: Mapping[str, Any] | None = None, **kw) -> GraphExec:
        """`build`, launch once and wait: the exec (``exec.timeline`` when traced,
        ``exec.wall_ms`` the launch-to-done host time). Keep it to `replay`; close it when
        done."""
        exe = self.build(graph, plan, bindings, **kw)
        try:
            t0 = time.perf_counter_ns()
            exe.launch(sync=True)
            exe.wall_ms = (time.perf_counter_ns() - t0) / 1e6
        except BaseException:
            exe.close()
            raise
        return exe


__all__ = ["GraphExecutorBase"]

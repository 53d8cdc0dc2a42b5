"""`ExecutorBase`: what the eager, the capture and the graph-build executor share.

- setup: the `DriverAPI` every driver call goes through (``driver=``, default: the process's),
  the `Device`, the default memory pool configured now (at setup, never during a capture), a
  `KernelResolver`, a `PinnedCheck`, the stream / event pool, one lock;
- the pre-run checks, composed one way for every executor (`_checked`): the graph's type,
  then the executor's own plan and graph checks (`_plan_checks`: plan structure, issue order
  and allocation order for the stream executors, the graph-memory policy and the capture's
  fork / join for the graph executors, the hazard verifier unless ``verify=False``), then
  every node's device, then every node's lowering ``resolve`` (kernels compiled, loaded,
  arguments packed), all before the first CUDA call that enqueues or builds anything;
- closing: ``close()`` (idempotent, also ``with``) and a finalizer synchronize the pooled
  streams, then release them, the tracers' events and the host-function tables.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, ClassVar

from orchestra.driver.api import default_api
from orchestra.errors import OrchestraError
from orchestra.execute.bindings import BindingTable, PinnedCheck, release_keep
from orchestra.execute.closable import Closable
from orchestra.execute.errors import ExecutorArgumentTypeError
from orchestra.execute.kernels import KernelResolver
from orchestra.execute.lowering import lowering_for
from orchestra.execute.resources import StreamPool
from orchestra.graph import TaskGraph
from orchestra.graph.bodies import walk


def _shutdown(api, pool: StreamPool, tracers: list, keep: list) -> None:
    """Finalizer / close(): wait for pending work (host functions may still call a
    trampoline), then release the pooled streams and events and the tracers' timing events;
    ``keep`` (host-function tables, binding tables, what kept bound memory alive) goes only
    after the synchronize."""
    if api.context_alive(pool.device.ordinal):
        pool.synchronize()
    for t in tracers:
        try:
            t.close()
        except Exception:  # noqa: BLE001 - events die with the context anyway
            pass
    tracers.clear()
    pool.release()
    items, keep[:] = list(keep), []
    release_keep(items)


class ExecutorBase(Closable):
    """Shared setup, checks and lifetime of the executors (see the module doc).

    Args:
        device: a `Device`, an ordinal or None (device 0). Every node that runs on a device
            must be on this one.
        verify: run the hazard verifier before a plan's first run / a graph's build.
        kernel_resolver: a shared `KernelResolver` (default: a new one for ``device``).
        driver: the `DriverAPI` (default: `orchestra.driver.api.default_api()`).
    """

    executor_name: ClassVar[str] = "executor"
    _device_verb: ClassVar[str] = "runs on"  # for the wrong-device error
    _takes: ClassVar[str] = "run()"  # for the wrong-type error

    def __init__(self, device=None, *, verify: bool = True, kernel_resolver=None, driver=None):
        self.api = api = driver if driver is not None else default_api()
        self.device = api.as_device(device)
        self.verify = bool(verify)
        self.kernels = (kernel_resolver if kernel_resolver is not None
                        else KernelResolver(self.device))  # an empty resolver is falsy
        self.device.make_current()
        self.pool = api.default_pool(self.device)  # release threshold set once, at setup
        self._pinned = PinnedCheck(api.is_pinned)
        self._lock = threading.RLock()
        self._stream_pool = StreamPool(self.device, api)
        self._tracers: list = []  # tracers whose events the executor owns
        self._keep: list = []  # released after the final synchronize (see _shutdown)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, api, self._stream_pool,
                                           self._tracers, self._keep)
        self._finalizer.atexit = False

    # -- pools --------------------------------------------------------------------------------

    @property
    def streams(self) -> tuple:
        """Every stream the executor has created (pooled, reused by every plan)."""
        return tuple(self._stream_pool.streams)

    @property
    def event_count(self) -> int:
        """Sync-only events the executor has created (pooled)."""
        return len(self._stream_pool.events)

    # -- the checks, one order for every executor ---------------------------------------------

    def _checked(self, graph, plan, **opts) -> tuple:
        """Every check before the first CUDA call: ``(what _plan_checks returned, resolved)``
        with ``resolved`` node name -> the node lowering's `resolve` result. Raises what the
        checks raise (`GraphError`, `PlanMismatchError`, `HazardError`, `GraphMemoryError`,
        `UnjoinedStreamError`, kernel and argument errors, `NoLoweringError`)."""
        if not isinstance(graph, TaskGraph):
            raise ExecutorArgumentTypeError(
                f"{self._takes} takes a TaskGraph, got {type(graph).__name__}")
        shape = self._plan_checks(graph, plan, **opts)
        self._check_devices(graph)
        return shape, self._resolve(graph)

    # each executor's own checks of ``graph`` (and ``plan``), hazards included unless
    # ``verify=False``; returns what its build needs (issue order, translation, ...)
    _plan_checks: Callable[..., Any]

    def _check_devices(self, graph: TaskGraph) -> None:
        ordinal = self.device.ordinal
        for node, _ in walk(graph):  # the nodes of bodies too
            if lowering_for(node).on_device and node.device != ordinal:
                raise OrchestraError(
                    f"node {node.name} is on device {node.device}, but this "
                    f"{type(self).__name__} {self._device_verb} device {ordinal}; use one "
                    "executor per device")

    def _resolve(self, graph: TaskGraph) -> dict:
        """Node name -> its lowering's `resolve` result, for the nodes (of the graph and of
        every body in it) that have one (kernels: fresh packed arguments, never shared between
        prepared plans or execs)."""
        out = {}
        for node, _ in walk(graph):
            r = lowering_for(node).resolve(node, self)
            if r is not None:
                out[node.name] = r
        return out

    def _bindings(self, graph: TaskGraph, bindings=None) -> BindingTable:
        """A `BindingTable` for ``graph`` (the executor's pinned checks) bound to ``bindings``
        (all checks: `BindingError`, `PageableMemoryError`)."""
        table = BindingTable(graph, self._pinned)
        table.bind(bindings)
        return table

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending work, then release the pooled streams and events (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._on_close()
            self._finalizer()

    def _on_close(self) -> None:
        """What a subclass drops before the pools are released."""


__all__ = ["ExecutorBase"]

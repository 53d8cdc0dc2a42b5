"""`ExecutorBase`: what the eager, the capture and the graph-build executor share.

- setup: the `DriverAPI` every driver call goes through (``driver=``, default: the process's),
  the `Device`, the copy lowering (``copy_lowering=``, `copy_policy`), the default memory pool
  configured now (at setup, never during a capture), a
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

import attrs

from orchestra.driver.api import default_api
from orchestra.driver.owner import ResourceClosedError
from orchestra.execute.bindings import BindingTable, PinnedCheck, release_keep
from orchestra.execute.closable import Closable
from orchestra.execute.copy_table import copy_policy
from orchestra.execute.errors import ExecutorArgumentTypeError, ExecutorDeviceError
from orchestra.execute.lowering.copy_policy import CopyPolicy, check_lowering
from orchestra.execute.kernels import KernelResolver
from orchestra.execute.lowering import lowering_for
from orchestra.execute.lowering.collective import check_ranks
from orchestra.execute.resources import StreamPool
from orchestra.graph import HostFunc, TaskGraph
from orchestra.graph.bodies import walk
from orchestra.schedule import Plan


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
            must be on this one (or on one of ``devices``).
        devices: more devices the executor runs on (the eager executor: plans over several
            GPUs; streams, events, pools and kernels per device).
        verify: run the hazard verifier before a plan's first run / a graph's build.
        kernel_resolver: a shared `KernelResolver` (default: a new one for ``device``).
        driver: the `DriverAPI` (default: `orchestra.driver.api.default_api()`).
        copy_lowering: how host copies are lowered unless a build / run or the node says
            otherwise: ``"auto"`` (copy kernels below the device's crossover, see
            `lowering.copy_policy`), ``"kernel"``, ``"copy-engine"``, or a `CopyPolicy`.
            `CopyLoweringError` for anything else.

    Thread-safety: `close` holds the executor's re-entrant lock; the shared pieces (the
    `KernelResolver`, the `PinnedCheck`, the per-device pools) are safe to use from several threads.
    What else may be shared is each executor's to say: see `EagerExecutor`, `CaptureExecutor`,
    `GraphBuildExecutor`.
    """

    executor_name: ClassVar[str] = "executor"
    copy_mode: ClassVar[str] = "graph"  # which crossover applies (CopyCrossover modes)
    _device_verb: ClassVar[str] = "runs on"  # for the wrong-device error
    _takes: ClassVar[str] = "run()"  # for the wrong-type error

    def __init__(self, device=None, *, verify: bool = True, kernel_resolver=None, driver=None,
                 devices=None, copy_lowering="auto"):
        self.api = api = driver if driver is not None else default_api()
        self.device = api.as_device(device)
        others = [] if devices is None else [api.as_device(d) for d in devices]
        extra: dict = {}  # ordinal -> Device, first mention kept, the own device left out
        for d in others:
            if d.ordinal != self.device.ordinal:
                extra.setdefault(d.ordinal, d)
        self.devices = (self.device,) + tuple(extra.values())
        self.verify = bool(verify)
        if not isinstance(copy_lowering, CopyPolicy):
            check_lowering(copy_lowering)
        self.copy_lowering = copy_lowering
        self._copy_policies: dict = {}
        self.kernels = (kernel_resolver if kernel_resolver is not None
                        else KernelResolver(self.device))  # an empty resolver is falsy
        loader = getattr(self.kernels, "loader", None)  # the other devices load the same way
        self._resolvers = {d.ordinal: KernelResolver(d, loader) for d in self.devices[1:]}
        self.pools = {}
        for d in reversed(self.devices):  # the executor's own device ends current
            d.make_current()
            self.pools[d.ordinal] = api.default_pool(d)  # release threshold set at setup
        self.pool = self.pools[self.device.ordinal]
        self._pinned = PinnedCheck(api.is_pinned)
        self._lock = threading.RLock()
        self._stream_pool = StreamPool(self.device, api, others=self.devices[1:])
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

    # -- copy lowering -------------------------------------------------------------------------

    def copy_policy(self, copy_lowering=None) -> CopyPolicy:
        """The `CopyPolicy` a build or run lowers its host copies with: ``copy_lowering``
        (``"auto"`` / ``"kernel"`` / ``"copy-engine"``, a `CopyPolicy`; None: the executor's
        ``copy_lowering``) on this device, with its crossover table (`copy_table`). Cached per
        name. `CopyLoweringError` for an unknown name."""
        if copy_lowering is None:
            copy_lowering = self.copy_lowering
        if isinstance(copy_lowering, CopyPolicy):
            return copy_lowering
        p = self._copy_policies.get(copy_lowering)
        if p is None:
            p = self._copy_policies[copy_lowering] = copy_policy(
                self.device, self.copy_mode, check_lowering(copy_lowering))
        return p

    # -- the checks, one order for every executor ---------------------------------------------

    def _checked(self, graph, plan, **opts) -> tuple:
        """Every check before the first CUDA call: ``(what _plan_checks returned, resolved)``
        with ``resolved`` node name -> the node lowering's `resolve` result. ``opts`` go to
        `_plan_checks`; ``opts["copies"]`` (a `CopyPolicy`) also to every entry's
        ``resolve_with``. Raises what the checks raise (`GraphError`, `PlanMismatchError`,
        `HazardError`, `GraphMemoryError`, `UnjoinedStreamError`, kernel and argument errors,
        `NoLoweringError`, `CopyLoweringError`)."""
        if not isinstance(graph, TaskGraph):
            raise ExecutorArgumentTypeError(
                f"{self._takes} takes a TaskGraph, got {type(graph).__name__}")
        shape = self._plan_checks(graph, plan, **opts)
        self._check_devices(graph, plan)
        check_ranks(graph)  # collectives: one rank of a communicator per graph
        return shape, self._resolve(graph, opts.get("copies"))

    # each executor's own checks of ``graph`` (and ``plan``), hazards included unless
    # ``verify=False``; returns what its build needs (issue order, translation, ...)
    _plan_checks: Callable[..., Any]

    def kernel_resolver(self, ordinal: int) -> KernelResolver:
        """The `KernelResolver` of device ``ordinal`` (one of the executor's devices)."""
        if ordinal == self.device.ordinal:
            return self.kernels
        return self._resolvers[ordinal]

    @property
    def multi_device(self) -> bool:
        """True when the executor runs on several devices (``devices=``)."""
        return len(self.devices) > 1

    def stream_devices(self, plan) -> dict:
        """Plan stream name -> the `Device` it runs on. A plan whose streams all say device 0
        is device-agnostic on a one-device executor (its streams run on the executor's
        device); otherwise each stream's ``device`` must be one of the executor's
        (`ExecutorDeviceError` otherwise)."""
        if plan.devices == (0,) and not self.multi_device:
            return {name: self.device for name in plan.stream_names}
        by_ordinal = {d.ordinal: d for d in self.devices}
        out = {}
        for spec in plan.streams:
            dev = by_ordinal.get(spec.device)
            if dev is None:
                raise ExecutorDeviceError(
                    f"plan stream {spec.name} is on device {spec.device}, but this "
                    f"{type(self).__name__} {self._device_verb} device(s) "
                    f"{sorted(by_ordinal)}" + self._devices_hint())
            out[spec.name] = dev
        return out

    def _devices_hint(self) -> str:
        if self._takes == "run()":
            return "; pass devices=(...) to run on several"
        return "; a CUDA graph is built for one device: use one executor (and graph) per device"

    def _check_devices(self, graph: TaskGraph, plan=None) -> None:
        """Every device-bound node on one of the executor's devices, and (with a plan) on a
        stream of its own device."""
        ordinals = {d.ordinal for d in self.devices}
        for node, _ in walk(graph):  # the nodes of bodies too
            if lowering_for(node).on_device and node.device not in ordinals:
                where = (f"device {self.device.ordinal}" if len(ordinals) == 1
                         else f"devices {sorted(ordinals)}")
                raise ExecutorDeviceError(
                    f"node {node.name} is on device {node.device}, but this "
                    f"{type(self).__name__} {self._device_verb} {where}; use one executor "
                    "per device" + (" (or pass devices=(...) to run on several)"
                                    if self._takes == "run()" else ""))
        if plan is None or not isinstance(plan, Plan):
            return
        sdev = self.stream_devices(plan)
        for node in graph.nodes:
            if not (node.device_bound and lowering_for(node).on_device):
                continue
            s = plan.node_stream.get(node.name)
            if s is not None and sdev[s].ordinal != node.device:
                raise ExecutorDeviceError(
                    f"node {node.name} runs on device {node.device}, but the plan puts it on "
                    f"stream {s} of device {sdev[s].ordinal}: run it on a stream of device "
                    f"{node.device}")

    def _resolve(self, graph: TaskGraph, copies=None) -> dict:
        """Node name -> its lowering's `resolve` result, for the nodes (of the graph and of
        every body in it) that have one (kernels and copy kernels: fresh packed arguments,
        never shared between prepared plans or execs). ``copies``: the `CopyPolicy` (None:
        the executor's); a body's host copies are lowered by the same policy."""
        if copies is None:
            copies = self.copy_policy()
        nodes = [node for node, _ in walk(graph)]
        if copies.d2h_system_fence and not any(isinstance(n, HostFunc) for n in nodes):
            # no host thread reads host memory in stream order: synchronizing makes a copy
            # kernel's stores visible (CopyPolicy.d2h_system_fence)
            copies = attrs.evolve(copies, d2h_system_fence=False)
        out = {}
        for node in nodes:
            r = lowering_for(node).resolve_with(node, self, copies)
            if r is not None:
                out[node.name] = r
        return out

    def _bindings(self, graph: TaskGraph, bindings=None) -> BindingTable:
        """A `BindingTable` for ``graph`` (the executor's pinned checks) bound to ``bindings``
        (all checks: `BindingError`, `ClosedBindingError`, `PageableMemoryError`), each value
        leased (docs/errors.md, "Lifetimes"); release it (`release_keep`) once no work of the
        graph can run."""
        table = BindingTable(graph, self._pinned, where=f"the {self.executor_name} "
                             "executor's build")
        table.bind(bindings)
        return table

    def _lease_modules(self, resolved: dict) -> list:
        """A `Lease` on the `Module` of every kernel in ``resolved`` (node name -> its
        lowering's resolve result), once per module: the code a prepared plan or a built graph
        launches stays loaded until it is released (docs/errors.md, "Lifetimes"). Kernels
        without a leasable module (test fakes) need none. Raises `ResourceClosedError` naming
        the node when a module was closed since it was resolved, leasing nothing."""
        leases: list = []
        seen: set[int] = set()
        try:
            for name, r in resolved.items():
                kernel = getattr(r, "kernel", None)
                module = getattr(kernel, "module", None)
                lease = getattr(module, "lease", None)
                if not callable(lease) or id(module) in seen:
                    continue
                seen.add(id(module))
                try:
                    leases.append(lease())
                except ResourceClosedError:
                    raise ResourceClosedError(
                        f"kernel node {name}: kernel {getattr(kernel, 'name', '?')!r} belongs "
                        f"to a Module that was closed while the {self.executor_name} "
                        "executor prepared it; run or build again (its resolver loads a "
                        "closed module again)", "Module") from None
        except BaseException:
            release_keep(leases)
            raise
        return leases

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

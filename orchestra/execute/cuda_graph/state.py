"""What a `GraphExec` holds, how it is released, and the fields its parts share.

`ExecState` is everything the exec's finalizer releases (no reference back to the exec, so a
forgotten exec is still released): the ``CUgraphExec``, the graphs it owns, its launch streams,
tracers, auto_free allocations, and the builds and retired bindings that keep bound memory
alive; `release_exec` releases it. `ExecParts` declares the state the exec's parts
(`cuda_graph.exec`, `cuda_graph.replay`, `cuda_graph.update`) share, for the type checker.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from orchestra.driver import Device, Stream
from orchestra.errors import CudaError
from orchestra.execute.bindings import Binding, BindingTable, release_keep

if TYPE_CHECKING:
    from orchestra.execute.cuda_graph.built import BuiltGraph, NodeRecord
    from orchestra.execute.cuda_graph.replay import KernelScalars
    from orchestra.execute.cuda_graph.update import UpdateResult
    from orchestra.schedule import Plan


class ExecState:
    """Everything the finalizer releases (no reference back to the `GraphExec`).

    Thread-safety: changed under the owning `GraphExec`'s lock, and released once by its finalizer,
    which may run on any thread (it makes the device's context current with `Device.pushed`).
    """

    def __init__(self, device: Device, api):
        self.device = device
        self.api = api
        self.exec = None  # CUgraphExec
        self.graphs: list = []  # every CUgraph the exec owns (instantiation graph first)
        self.tracers: list = []
        self.unfreed: list[int] = []
        self.launched = False
        self.streams: dict[int, Stream] = {}  # streams launched on since the last synchronize
        self.own_stream: Stream | None = None
        self.owns_stream = True  # False when the caller gave the stream: not closed here
        self.keep: list = []  # BuiltGraphs (leased bindings and modules, packed args, callbacks)
        self.retired: list = []  # what kept memory alive that a replay unbound meanwhile


def release_exec(state: ExecState) -> None:
    """Destroy the exec, free what it left allocated, destroy its graphs, close its tracers.
    Runs on `close()` or from the finalizer (then inside ``device.pushed()``)."""
    dev, api = state.device, state.api
    if api.context_alive(dev.ordinal):
        with dev.pushed():
            own = [state.own_stream] if state.own_stream is not None else []
            for s in list(state.streams.values()) + own:
                try:
                    if not s.closed:
                        s.synchronize()
                except CudaError:
                    pass
            if state.exec is not None:
                api.cuGraphExecDestroy(state.exec)
            if state.unfreed and state.launched:
                # auto_free graphs: the last launch's allocations are live (the opt-in); a
                # graph allocation may be freed with cuMemFree once its work is done.
                for dptr in state.unfreed:
                    api.cuMemFree(dptr)
            for g in state.graphs:
                api.cuGraphDestroy(g)
    state.exec = None
    state.graphs.clear()
    state.unfreed = []
    for t in state.tracers:
        try:
            t.close()
        except Exception:  # noqa: BLE001 - events die with the context anyway
            pass
    state.tracers.clear()
    state.streams.clear()
    if state.own_stream is not None:
        if state.owns_stream:
            state.own_stream.close()
        state.own_stream = None
    # the graphs are gone: what kept their bound memory alive may go too
    release_keep([b.keeps for b in state.keep] + state.retired)
    state.keep.clear()
    state.retired.clear()


class ExecParts:
    """The fields of a `GraphExec` that its parts read and write (declarations only: the
    exec's ``__init__`` and ``_adopt`` set them).

    Thread-safety: as `GraphExec`'s: its methods run under the exec's re-entrant lock; it is not
    used on its own.
    """

    device: Device
    flags: int
    plan: Plan | None
    launches: int
    last_update: UpdateResult | None
    _api: Any  # the DriverAPI
    _lock: threading.RLock
    _closed: bool
    _state: ExecState
    _exec: Any  # the CUgraphExec
    _sh: Any  # the exec's own stream's CUstream
    _ctx: Any  # the CUcontext memcpy updates name
    _ctx_key: Any  # the context's int, as `Device.make_current` caches it per thread
    _built: BuiltGraph
    _records: dict[str, NodeRecord]
    _table: BindingTable
    _host: dict[str, Binding]
    _kernels: dict[str, KernelScalars]
    _rebinds: dict  # binding name -> `replay.Rebind`
    _close_epoch: int
    repoint_updates: int
    taskgraph: Any
    _tracer: Any
    _own_pending: bool
    _inst_nodes: list
    _rebuild: Callable | None
    # the driver calls of launches and replays, bound once
    _graph_launch: Callable
    _set_memcpy: Callable
    _set_kernel: Callable
    # methods one part calls on another
    _check_open: Callable[[], None]
    _adopt: Callable[[BuiltGraph], None]
    _plan_replays: Callable[[], None]
    update: Callable[..., Any]
    _upload: Callable[[Any], None]
    _launch: Callable[..., Any]
    _launch_error: Callable[[Any], Any]
    _synchronize: Callable[..., Any]
    _reapply_enabled: Callable[[], None]


__all__ = ["ExecParts", "ExecState", "release_exec"]

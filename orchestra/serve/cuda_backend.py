"""The CUDA backends of the serving engine: instances built on orchestra's executors.

- ``"graph"`` (default): `GraphBuildExecutor` builds each instance's CUDA graph node by node;
  a launch is one ``cuGraphLaunch`` of the instance's `GraphExec` on its own stream.
- ``"capture"``: the same with `CaptureExecutor` (stream capture of the plan).
- ``"eager"``: one `EagerExecutor` per instance (its own streams); a launch enqueues the plan.

Per instance: the task graph from the user's ``build(signature)`` (a `ServeGraph`), pinned
staging (one `PinnedBuffer` per input and output, bound to the graph's host buffers), the exec,
a blocking-sync `Event` recorded after every launch the completion thread must see
(``CU_EVENT_BLOCKING_SYNC``: that thread sleeps in the driver instead of spinning), and two
timing events for sampled GPU times. `Instance.wait` (the caller's thread) is the exec's
``synchronize()``: ``cuStreamSynchronize`` on the instance's own stream, which follows the
context's scheduling policy (spin by default): the latency of a bare program's wait.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any, Callable, Mapping

import attrs
from cuda.bindings import driver as _d

from orchestra.driver import Device, Event, PinnedBuffer, cu, is_pinned
from orchestra.errors import OrchestraError
from orchestra.graph import TaskGraph
from orchestra.serve.backend import Backend, Instance
from orchestra.serve.errors import ServeConfigTypeError, ServeConfigValueError


def _name_map(value) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    return {str(v): str(v) for v in value}


@attrs.frozen
class ServeGraph:
    """What an engine's ``build(signature)`` returns for one instance of one bucket.

    Attributes:
        graph: the `TaskGraph` (H2D from host buffers, kernels, D2H to host buffers, ...).
        inputs: request input name -> the `HostBuffer` name it is copied to (a list of names
            when they are the same); the host buffer must be exactly ``rows * row bytes``.
        outputs: request output name -> the `HostBuffer` the graph writes it to.
        bindings: every other binding the graph needs (external device buffers by name).
        owned: objects with ``close()`` (e.g. the `DeviceBuffer` objects in ``bindings``)
            that the instance closes after its last launch.
        plan: a `Plan` to build with (default: the executor schedules it).

    Immutable (frozen) record, but it holds ``graph`` (a `TaskGraph`), ``bindings`` and
    ``owned`` by reference: the instance built from it owns them, so build a new one per
    instance and share none of those objects between instances (or threads).
    """

    graph: TaskGraph
    inputs: Mapping[str, str] = attrs.field(converter=_name_map)
    outputs: Mapping[str, str] = attrs.field(converter=_name_map)
    bindings: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    owned: tuple = attrs.field(default=(), converter=tuple)
    plan: Any = None


def signature_for(rows: int, index: int, inputs) -> Any:
    """The `orchestra.execute.Signature` a build function gets: every input at ``rows`` rows,
    topology ``(("instance", index),)``."""
    from orchestra.execute import Signature

    shapes = tuple(sorted((name, s.shape(rows), s.dtype.name) for name, s in inputs.items()))
    return Signature(shapes, (("instance", index),), shapes)


def _host_buffers(sg: ServeGraph, rows: int, specs, side: str) -> dict[str, Any]:
    """Request name -> the graph's `HostBuffer`, checked against the declared specs."""
    hosts = {b.name: b for b in sg.graph.host_buffers}
    names = sg.inputs if side == "input" else sg.outputs
    if set(names) != set(specs):
        raise ServeConfigValueError(f"ServeGraph.{side}s names {sorted(names)}, the engine "
                                    f"declares {sorted(specs)}")
    out = {}
    for name, spec in specs.items():
        hb = hosts.get(names[name])
        if hb is None:
            known = sorted(hosts) or "none"
            raise ServeConfigValueError(f"ServeGraph {side} {name}: the graph has no host buffer "
                                        f"{names[name]!r} (host buffers: {known})")
        need = rows * spec.row_nbytes
        if hb.nbytes != need:
            raise ServeConfigValueError(f"ServeGraph {side} {name}: host buffer {hb.name} is "
                                        f"{hb.nbytes} bytes; {rows} rows of {spec.describe()} are "
                                        f"{need} bytes")
        out[name] = hb
    return out


class _CudaInstance(Instance):
    """What the three CUDA instance kinds share: staging, events, the owned resources."""

    def __init__(self, backend: "CudaBackend", rows: int, index: int, inputs, outputs):
        self.rows = rows
        self.device = backend.device
        self._owned: list = []
        self._pins: list = []
        self._events: list = []
        self.inputs, self.outputs = {}, {}
        self._host_name: dict[str, str] = {}
        t0 = time.perf_counter_ns()
        try:
            sg = backend.build_fn(signature_for(rows, index, inputs))
            if not isinstance(sg, ServeGraph):
                raise ServeConfigTypeError(f"the engine's build function must return a "
                                           f"ServeGraph; got {type(sg).__name__}")
            self._owned.extend(sg.owned)
            self.fn_ms = (time.perf_counter_ns() - t0) / 1e6
            bindings = dict(sg.bindings)
            for side, specs, dest in (("input", inputs, self.inputs),
                                      ("output", outputs, self.outputs)):
                for name, hb in _host_buffers(sg, rows, specs, side).items():
                    spec = specs[name]
                    pin = PinnedBuffer(hb.nbytes, self.device)
                    self._pins.append(pin)
                    a = pin.view(spec.dtype).reshape(spec.shape(rows))
                    a[...] = 0
                    dest[name] = a
                    bindings[hb.name] = a
                    if side == "input":
                        self._host_name[name] = hb.name
            self._staging = {self._host_name[n]: a for n, a in self.inputs.items()}
            self._bound = dict(self._staging)  # host buffer name -> array bound now
            self.done_event = self._event(blocking=True)
            self._t0 = self._event(timing=True)
            self._t1 = self._event(timing=True)
            self._setup(backend, sg, bindings)
        except BaseException:
            self.close()
            raise

    def _event(self, **kw) -> Event:
        ev = Event(self.device, **kw)
        self._events.append(ev)
        return ev

    @abc.abstractmethod
    def _setup(self, backend, sg, bindings) -> None:
        """Build the exec or executor of this instance kind (``bindings``: staging included)."""

    def _rebind(self, bind) -> dict | None:
        """The host bindings to change for this launch: a zero-copy array, or back to the
        staging array after one."""
        if bind is None:
            if self._bound is self._staging:
                return None
            changes = self._staging
            self._bound = self._staging
            return changes
        changes = {self._host_name[n]: a for n, a in bind.items()}
        self._bound = changes
        return changes

    def finish(self, timed):
        if timed:
            return Event.elapsed_ms(self._t0, self._t1)
        return None

    def close(self) -> None:
        errors = []
        for obj in self._close_order():
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing; report the first
                errors.append(exc)
        self._owned, self._pins, self._events = [], [], []
        if errors:
            raise errors[0]

    def _close_order(self) -> list:
        return [*self._owned, *self._events, *self._pins]


class GraphInstance(_CudaInstance):
    """An instance whose launch is one ``cuGraphLaunch`` of its own `GraphExec`.

    Thread-safety: used by one launch at a time (the engine's lease): `launch` and `finish` must not
    run in two threads at once; `wait` and `wait_blocking` may run at once (the engine's completion
    threads wait while the submitting thread goes on).
    """

    def _setup(self, backend, sg, bindings):
        with backend.build_lock:  # graph executors build one graph at a time
            self.exec = backend.executor.build(sg.graph, sg.plan, bindings,
                                               streams=backend.streams)
        self.build_ms = self.fn_ms + self.exec.build_ms
        self.instantiate_ms = self.exec.instantiate_ms
        self._sh = self.exec.stream.handle  # the exec's own stream: only this instance's work
        self._done_h = self.done_event.handle
        self._t0h, self._t1h = self._t0.handle, self._t1.handle
        # host nodes report their errors through the exec's synchronize()
        self._host_nodes = any(n.kind == "host" for n in sg.graph.nodes)
        self._rebound = False

    def launch(self, *, notify, timed, bind=None):
        self.device.make_current()
        sh = self._sh
        if timed:
            cu(_d.cuEventRecord, self._t0h, sh)
        changes = self._rebind(bind) if (bind is not None or self._bound is not self._staging) \
            else None
        if changes:
            self.exec.replay(changes, sync=False)  # cuGraphExecMemcpyNodeSetParams + launch
            self._rebound = True
        else:
            self.exec.launch()
        if timed:
            cu(_d.cuEventRecord, self._t1h, sh)
        if notify:
            cu(_d.cuEventRecord, self._done_h, sh)

    def wait(self):
        # cuStreamSynchronize on the exec's own stream (the context's scheduling policy: spin
        # by default), without the exec's lock and bookkeeping: the caller's latency path
        cu(_d.cuStreamSynchronize, self._sh)

    def wait_blocking(self):
        self.done_event.synchronize()

    def finish(self, timed):
        if self._host_nodes or self._rebound:
            # returns at once (the launch is done): reports host-function errors, releases the
            # arrays a zero-copy rebind retired
            self._rebound = False
            self.exec.synchronize()
        return super().finish(timed)

    def _close_order(self):
        ex = getattr(self, "exec", None)
        return ([ex] if ex is not None else []) + super()._close_order()


class EagerInstance(_CudaInstance):
    """An instance with its own `EagerExecutor` (its own streams); a launch enqueues the plan
    with ``sync=False``.

    Thread-safety: used by one launch at a time (the engine's lease); its `EagerExecutor` serializes
    what reaches it under its own lock, so `wait` from another thread waits for the launch to be
    enqueued first.
    """

    def _setup(self, backend, sg, bindings):
        from orchestra.execute import EagerExecutor

        t0 = time.perf_counter_ns()
        self.executor = EagerExecutor(self.device, verify=backend.verify,
                                      kernel_resolver=backend.kernels)
        self.graph = sg.graph
        self.plan = self.executor.prepare(sg.graph, sg.plan, streams=backend.streams)
        self._bindings = bindings
        self.build_ms = self.fn_ms + (time.perf_counter_ns() - t0) / 1e6
        self.instantiate_ms = 0.0
        self._streams = self.executor.streams
        self._done = [self.done_event] + [self._event(blocking=True)
                                          for _ in self._streams[1:]]

    def launch(self, *, notify, timed, bind=None):
        self.device.make_current()
        s0 = self._streams[0]
        changes = self._rebind(bind) if (bind is not None or self._bound is not self._staging) \
            else None
        if changes:
            self._bindings.update(changes)
        if timed:
            self._t0.record(s0)
        self.executor.run(self.graph, self.plan, self._bindings, sync=False)
        if timed:
            self._t1.record(s0)
        if notify:
            for ev, s in zip(self._done, self._streams):
                ev.record(s)

    def wait(self):
        self.executor.synchronize()

    def wait_blocking(self):
        for ev in self._done:
            ev.synchronize()

    def finish(self, timed):
        self.executor.synchronize()
        return super().finish(timed)

    def _close_order(self):
        ex = getattr(self, "executor", None)
        return ([ex] if ex is not None else []) + super()._close_order()


class CudaBackend(Backend):
    """Instances built with one of orchestra's executors (see the module doc).

    Args:
        build_fn: ``build(signature) -> ServeGraph``.
        executor: ``"graph"``, ``"capture"``, ``"eager"``, or a `GraphBuildExecutor` /
            `CaptureExecutor` object to build graphs with (then not closed here).
        device: a `Device` or ordinal (None: device 0).
        verify: the hazard verifier (for executors made here).
        streams: streams of the plan each instance is scheduled with (default 1: a request's
            copy-in, kernels and copy-out form a chain; instances give the concurrency).

    Thread-safety: `create` may run in several threads (graph builds are serialized with a
    lock); instances are used by one launch at a time.
    """

    def __init__(self, build_fn: Callable, executor="graph", *, device=None,
                 verify: bool = True, streams: int = 1):
        from orchestra.execute import CaptureExecutor, GraphBuildExecutor, KernelResolver

        self.build_fn = build_fn
        # a Device (or a stand-in with the same methods), else an ordinal
        self.device = (Device.get(device or 0) if device is None or isinstance(device, int)
                       else device)
        self.verify = bool(verify)
        self.streams = int(streams)
        self.build_lock = threading.Lock()
        self._own_executor = False
        self.instance_type: type[_CudaInstance]
        self.executor: Any = None
        self.kernels = None
        if isinstance(executor, str):
            kinds = {"graph": GraphBuildExecutor, "graph-build": GraphBuildExecutor,
                     "capture": CaptureExecutor}
            if executor == "eager":
                self.name = "eager"
                self.instance_type = EagerInstance
                self.kernels = KernelResolver(self.device)
            elif executor in kinds:
                self.executor = kinds[executor](self.device, verify=verify)
                self._own_executor = True
                self.name = self.executor.executor_name
                self.instance_type = GraphInstance
            else:
                raise ServeConfigValueError(f"executor must be 'graph', 'capture' or 'eager' (or a "
                                            f"graph executor object); got {executor!r}")
        elif hasattr(executor, "build") and hasattr(executor, "executor_name"):
            self.executor = executor
            self.name = executor.executor_name
            self.instance_type = GraphInstance
        else:
            raise ServeConfigTypeError(f"executor must be 'graph', 'capture', 'eager' or a graph "
                                       f"executor; got {type(executor).__name__}")

    def create(self, rows, index, inputs, outputs):
        return self.instance_type(self, rows, index, inputs, outputs)

    def check_pinned(self, name, array):
        if not is_pinned(array):
            from orchestra.execute import PageableMemoryError
            from orchestra.execute.errors import PIN_HOWTO

            raise PageableMemoryError(f"input {name} was submitted with pinned=True but is in "
                                      f"pageable memory; {PIN_HOWTO}, or submit it without "
                                      "pinned=True (it is then copied into pinned staging)")

    def graph_memory(self):
        from orchestra.execute import graph_memory

        return graph_memory(self.device).used

    def thread_init(self):
        self.device.make_current()

    def trim(self) -> None:
        """Return graph memory no exec uses to the driver (``cuDeviceGraphMemTrim``)."""
        self.device.make_current()
        cu(_d.cuDeviceGraphMemTrim, self.device.handle)

    def close(self):
        if self._own_executor and self.executor is not None:
            self.executor.close()
        self.executor = None
        try:
            self.trim()
        except OrchestraError:
            pass


def make_backend(build_fn, executor="graph", *, device=None, verify=True, streams=1
                 ) -> CudaBackend:
    """The `CudaBackend` an `Engine` builds for ``executor``."""
    return CudaBackend(build_fn, executor, device=device, verify=verify, streams=streams)


__all__ = ["CudaBackend", "EagerInstance", "GraphInstance", "ServeGraph",
           "make_backend", "signature_for"]

"""The seam between the engine and what runs a bucket: `Backend` makes `Instance` objects.

The engine (queues, buckets, padding, batching, futures, asyncio, backpressure, statistics,
shutdown, the broken state) only talks to this interface, so it runs unchanged on the CUDA
backends (`orchestra.serve.cuda_backend`: graph-build, capture, eager) and on `NumpyBackend`
(plain numpy, no GPU: tests, and checking serving logic on a laptop).

An instance is one executable copy of a bucket: its own staging arrays (``inputs`` /
``outputs``, ``rows`` rows each), its own exec or executor, its own device buffers. The engine
leases it to one launch at a time (a request or a dynamic batch): it fills ``inputs``, calls
`Instance.launch`, waits with `Instance.wait` (the caller's thread, lowest latency) or
`Instance.wait_blocking` (the completion thread, no busy polling), calls `Instance.finish`
once, reads ``outputs`` and only then gives the instance to the next launch.
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from typing import Callable, Mapping

import numpy as np

from orchestra.serve.tensors import TensorSpec


class Instance(abc.ABC):
    """One leased executable copy of a bucket (see the module doc).

    Attributes: ``rows`` (bucket rows), ``inputs`` / ``outputs`` (name -> staging array of
    shape ``(rows, *row_shape)``; the engine writes inputs before `launch` and reads outputs
    after `finish`), ``build_ms`` / ``instantiate_ms`` (what building it cost), ``dirty`` (rows
    of input staging written by the last copied launch: the engine zeroes stale padding).

    Thread-safety: the engine leases an instance to one launch at a time; `wait` and
    `wait_blocking` may run at once in two threads for the same launch (the caller and the
    completion thread), everything else is called by the one thread that holds the lease.
    """

    rows: int
    inputs: Mapping[str, np.ndarray]
    outputs: Mapping[str, np.ndarray]
    build_ms: float = 0.0
    instantiate_ms: float = 0.0
    dirty: int = 0

    @abc.abstractmethod
    def launch(self, *, notify: bool, timed: bool, bind: Mapping[str, np.ndarray] | None = None
               ) -> None:
        """Start the work that reads ``inputs`` and writes ``outputs`` (asynchronously).

        ``notify``: make `wait_blocking` usable for this launch (a blocking-sync event).
        ``timed``: measure its GPU time (`finish` returns it). ``bind``: input name -> an
        already pinned array of exactly ``(rows, *row_shape)`` to read instead of the staging
        array (zero-copy); backends that cannot bind copy it into staging.
        """

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the last launch is done, with the lowest latency available (the
        driver's default wait). Raises `CudaError` when the work failed."""

    def wait_blocking(self) -> None:
        """Block until the last launch is done without busy polling (default: `wait`)."""
        self.wait()

    def finish(self, timed: bool) -> float | None:
        """Bookkeeping once the launch is known done (called once per launch, by the thread
        that completes it); returns the GPU milliseconds when the launch was ``timed``."""
        return None

    def close(self) -> None:
        """Release everything the instance owns (after its last launch finished)."""


class Backend(abc.ABC):
    """Makes instances for the engine. ``name``: what `Engine.stats` reports as the executor.

    Thread-safety: `create` may be called from several threads (the engine serializes nothing
    itself); implementations lock what they share.
    """

    name = "backend"

    @abc.abstractmethod
    def create(self, rows: int, index: int, inputs: dict[str, TensorSpec],
               outputs: dict[str, TensorSpec]) -> Instance:
        """Instance ``index`` (0 .. instances - 1) of the bucket of ``rows`` rows."""

    def check_pinned(self, name: str, array: np.ndarray) -> None:
        """Raise when ``array`` may not be used zero-copy (``pinned=True`` requests)."""

    def graph_memory(self) -> int | None:
        """Bytes of graph memory in use on the device now (None when not applicable)."""
        return None

    def thread_init(self) -> None:
        """Called once at the start of each engine thread (e.g. make the device current)."""

    def close(self) -> None:
        """Release what the backend shares between instances (after every instance closed)."""


class NumpyInstance(Instance):
    """`NumpyBackend`'s instance: ``fn`` runs synchronously inside `launch`, or on the backend's
    device thread (``device_thread=True``).

    Thread-safety: used by one launch at a time (the engine's lease), like every `Instance`; `wait`
    may run in several threads at once (it takes and gives back the launch's lock).
    """

    def __init__(self, fn, rows, inputs, outputs, device=None):
        self.rows = rows
        self._fn = fn
        self.inputs = {n: np.zeros(s.shape(rows), s.dtype) for n, s in inputs.items()}
        self.outputs = {n: np.zeros(s.shape(rows), s.dtype) for n, s in outputs.items()}
        self._gpu_ms = None
        self.launches = 0
        self._device = device
        # held from launch until the device thread ran it: wait() acquires and releases it
        self._running = threading.Lock()
        self._error: BaseException | None = None
        self._bind = None

    def launch(self, *, notify, timed, bind=None):
        if self._device is None:
            self._bind = bind
            self.run()
            return
        self._running.acquire()
        self._bind = bind
        self._error = None
        self._device.put(self)

    def run(self) -> None:
        """The launch's work (in `launch`, or on the device thread)."""
        bind = self._bind
        self._bind = None
        src = self.inputs
        if bind:
            src = dict(src)
            src.update(bind)
        t0 = time.perf_counter_ns()
        res = self._fn(src)
        if type(res) is np.ndarray or not isinstance(res, Mapping):
            res = {next(iter(self.outputs)): res}
        for name, dst in self.outputs.items():
            np.copyto(dst, res[name])
        self._gpu_ms = (time.perf_counter_ns() - t0) / 1e6
        self.launches += 1

    def wait(self):
        if self._device is not None:
            self._running.acquire()  # released by the device thread once the launch ran
            self._running.release()
            if self._error is not None:
                raise self._error

    def finish(self, timed):
        return self._gpu_ms if timed else None


class NumpyBackend(Backend):
    """A backend that runs ``fn(inputs) -> outputs`` with numpy.

    ``fn`` takes ``{name: array (bucket rows, *row_shape)}`` (padded rows included) and returns
    ``{name: array}`` or, for one output, the array; it must work row by row (padding rows
    must not change the other rows' results), as the engine's kernels must.

    ``device_thread=False`` (default): ``fn`` runs synchronously inside `Instance.launch`.
    ``device_thread=True``: launches run in order on one worker thread of the backend, a
    stand-in for a GPU: `Instance.launch` returns at once and `Instance.wait` blocks (without
    the GIL) until the worker ran the launch, so the engine's host path (dispatch, hand-offs,
    completion) runs as it does on a GPU; `orchestra bench serve --cpu` profiles it this way.
    An exception of ``fn`` is raised by the launch's `Instance.wait`.

    Thread-safety: `create` may run in several threads (the device thread is started once, under the
    backend's lock; ``created`` is a plain counter that concurrent creates may undercount);
    instances are independent; ``fn`` must be safe to call from several threads
    (``device_thread=True``: it is only called on the worker thread).
    """

    name = "numpy"

    def __init__(self, fn: Callable, *, device_thread: bool = False):
        self.fn = fn
        self.created = 0
        self.device_thread = bool(device_thread)
        self._q: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def create(self, rows, index, inputs, outputs):
        q = None
        if self.device_thread:
            with self._lock:
                if self._q is None:
                    self._q = queue.SimpleQueue()
                    self._thread = threading.Thread(target=_device_loop, args=(self._q,),
                                                    name="orchestra-numpy-device", daemon=True)
                    self._thread.start()
                q = self._q
        self.created += 1
        return NumpyInstance(self.fn, rows, inputs, outputs, q)

    def close(self):
        with self._lock:
            q, t = self._q, self._thread
            self._q = self._thread = None
        if q is not None:
            q.put(None)
            t.join()


def _device_loop(q: queue.SimpleQueue) -> None:
    """`NumpyBackend`'s device thread: run launches in the order they were made."""
    while True:
        inst = q.get()
        if inst is None:
            return
        try:
            inst.run()
        except BaseException as exc:  # noqa: BLE001 - the launch's wait() raises it
            inst._error = exc
        inst._running.release()


__all__ = ["Backend", "Instance", "NumpyBackend", "NumpyInstance"]

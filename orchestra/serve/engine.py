"""`Engine`: many threads and asyncio tasks submit requests; each runs on a leased instance of
the smallest shape bucket that fits it (docs/serving.md has the whole design).

    with Engine(build, inputs={"x": ((1024,), "float32")},
                outputs={"y": ((1024,), "float32")}, buckets="pow2", max_rows=64) as engine:
        engine.warmup()
        y = engine(x)                       # blocking, lowest latency
        fut = engine.submit(x)              # concurrent.futures.Future, from any thread
        y = await engine.run(x)             # asyncio

The life of one request, in the default ``dispatch="caller"`` mode:

1. ``submit`` checks it (dtype, shape, rows, contiguity) before anything is enqueued; a bad
   request gets a future already failed with the specific error, and nothing else happens.
2. Under the engine's lock it leases a free instance of its bucket, or joins the bucket's
   bounded queue (backpressure: wait up to a timeout or raise `Overloaded`).
3. With an instance, the *caller's thread* copies the input into the instance's pinned staging
   (zeroing stale padding), launches, records a blocking-sync event and hands the launch to the
   completion thread. No thread hop before the GPU starts.
4. Whoever sees the completion first completes the future: ``future.result()`` in the caller's
   thread waits on the instance's stream itself (the driver's default wait, as a bare
   cuda-python program does), while the completion thread waits on the blocking-sync event
   (the thread sleeps in the kernel: no busy polling, no Python code on a driver thread) for
   futures nobody waits on (callbacks, asyncio). The finisher copies the outputs out (sliced to
   the request's rows), returns the instance (starting the next queued request on it) and sets
   the result.

With dynamic batching, requests wait in one arrival-order queue; a batch (the requests at its
head that fit ``max_batch`` rows, concatenated along axis 0) is started by the thread whose
request fills it, or by the thread that returns an instance while a full or overdue batch
waits, and by the batcher thread (the delay timer: a timerfd the queuing thread arms, see
`orchestra.serve.timer`) once its first request waited ``max_delay_us``. The thread that
fills a batch some caller blocks on (its own ``engine(x)``, or a follower asleep in
``result()``) also waits for it on the instance's stream and completes all of its requests:
no completion-thread hop. With ``dispatch="thread"`` the batcher thread forms and launches
everything; the rest is the same.
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import ctypes
import functools
import json
import logging
import numbers
import os
import queue
import threading
import time
import traceback
import weakref
from concurrent.futures import InvalidStateError
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from orchestra.errors import CallOrderError, CudaError, OrchestraError
from orchestra.serve.admission import AdmissionSettings
from orchestra.serve.backend import Backend, Instance
from orchestra.serve.buckets import Buckets, bucket_sizes, positive_count
from orchestra.serve.errors import (
    EngineBroken,
    EngineClosed,
    Overloaded,
    RequestTooLarge,
    ServeConfigTypeError,
    ServeConfigValueError,
    StopIterationRaised,
    check_timeout,
)
from orchestra.serve.future import ServeFuture
from orchestra.serve.stats import BucketStats, percentiles
from orchestra.serve.tensors import check_inputs, check_out, tensor_specs
from orchestra.serve.timer import deadline_timer

log = logging.getLogger(__name__)

_now = time.perf_counter_ns
_STOP = object()
_RAISED_AT = "raised at (most recent call last):\n"  # _drop_engine_frames' note
_TABLE_ROWS = 1 << 14  # requests up to this many rows find their bucket in one list lookup
# completion threads an engine may start (each one a thread blocked on the driver; more than
# this are many threads for no gain: head-of-line waits need a few, not hundreds)
MAX_COMPLETION_THREADS = 64


@attrs.frozen
class Batching:
    """Dynamic batching: requests arriving within ``max_delay_us`` microseconds of the first
    one waiting are concatenated along axis 0 into one launch of at most ``max_batch`` rows
    (None: the largest bucket), on the smallest bucket that fits the batch. A request larger
    than ``max_batch`` rows runs alone. Immutable: safe to share between threads and engines."""

    max_batch: int | None = None
    max_delay_us: float = 200.0

    def __attrs_post_init__(self):
        if self.max_batch is not None:
            positive_count("max_batch (rows)", self.max_batch)
        if isinstance(self.max_delay_us, bool) or not isinstance(self.max_delay_us,
                                                                 numbers.Real):
            raise ServeConfigTypeError(f"max_delay_us must be microseconds (a number); got "
                                       f"{self.max_delay_us!r}")
        if not self.max_delay_us >= 0:
            raise ServeConfigValueError(f"max_delay_us must be >= 0; got {self.max_delay_us}")
        if not self.max_delay_us <= threading.TIMEOUT_MAX * 1e6:  # inf: the engine's int() failed
            raise ServeConfigValueError(
                f"max_delay_us must be at most {threading.TIMEOUT_MAX * 1e6:.3g} (the longest "
                f"wait Python can make); got {self.max_delay_us}")


# -- requests, launches, futures ---------------------------------------------------------------


class _Group:
    """A request split into chunks (``split=True``): one future, outputs assembled in place."""

    __slots__ = ("fut", "remaining", "outputs", "error", "started", "cancelled", "lock")

    def __init__(self, fut, chunks: int, outputs: dict):
        self.fut = fut
        self.remaining = chunks
        self.outputs = outputs
        self.error: BaseException | None = None
        self.started = False
        self.cancelled = False
        self.lock = threading.Lock()


class _Req:
    __slots__ = ("arrays", "rows", "bucket", "out", "t0", "fut", "group", "pinned", "caller")

    def __init__(self, arrays, rows, bucket, out, t0, fut, group=None, pinned=False):
        self.caller = 0  # the blocking call's thread id: launched there, it waits there too
        self.arrays = arrays
        self.rows = rows
        self.bucket = bucket
        self.out = out
        self.t0 = t0
        self.fut = fut  # the ServeFuture (the group's for a chunk)
        self.group = group
        self.pinned = pinned


class _Launch:
    """One leased instance running one request or one batch. ``claim`` makes exactly one
    thread finish it (or fail it)."""

    __slots__ = ("inst", "bucket", "reqs", "timed", "waiter", "inline", "_token", "done",
                 "started", "rows")

    def __init__(self, inst: Instance, bucket, reqs, rows: int = 0):
        self.inst = inst
        self.bucket = bucket
        self.reqs = reqs
        self.rows = rows  # request rows of a batch (0: one request, its rows)
        self.timed = False
        self.waiter = False  # a caller is waiting in result(): the completion thread skips it
        self.inline = False  # launched by the blocking call: no event, no completion thread
        self._token = [True]
        self.done = False
        self.started = False  # the instance's work was enqueued

    def claim(self) -> bool:
        """True for exactly one caller (``list.pop`` is atomic: cheaper than a lock)."""
        try:
            self._token.pop()
        except IndexError:
            return False
        self.done = True
        return True


def _set_result(fut, value) -> None:
    try:
        fut.set_result(value)
    except InvalidStateError:  # cancelled meanwhile (a queued request) or already failed
        pass


def _set_exception(fut, exc) -> None:
    try:
        fut.set_exception(exc)
    except InvalidStateError:
        pass


class _Bucket:
    __slots__ = ("rows", "instances", "free", "queue", "building", "stats", "ready", "error")

    def __init__(self, rows: int):
        self.rows = rows
        self.instances: list[Instance] = []
        self.free: list[Instance] = []
        self.queue: collections.deque = collections.deque()
        self.building = False
        self.ready = False
        self.error: BaseException | None = None  # why the last build failed
        self.stats = BucketStats(rows)


# -- the engine ----------------------------------------------------------------------------


class Engine(AdmissionSettings):
    """A serving engine over shape buckets of executable task graphs.

    Args:
        build: ``build(signature) -> ServeGraph``: the task graph (and its bindings) for one
            instance of one bucket; ``signature`` is an `orchestra.execute.Signature` whose
            ``shape(name)`` is ``(bucket rows, *row_shape)`` for every input and whose
            ``get("instance")`` is the instance number. Called once per instance (a graph with
            alloc/free nodes has one instantiation, so every instance builds its own): return
            fresh device buffers each time. Not used with ``backend=``.
        inputs, outputs: ``{name: (row_shape, dtype)}``: what a request sends and gets back,
            any number of rows along axis 0 (outputs have the request's rows).
        buckets: ``"vllm"`` (default: 1, 2, 4, then steps of 8), ``"pow2"`` or a list of row
            counts; ``max_rows``: the largest bucket (default 256; with a list, added to it).
        executor: ``"graph"`` (`GraphBuildExecutor`, default), ``"capture"``
            (`CaptureExecutor`), ``"eager"`` (`EagerExecutor` per instance), or a graph
            executor object to build with.
        backend: a `Backend` instead of ``build`` / ``executor`` (e.g. `NumpyBackend`).
        instances: instances per bucket (K): how many requests of one bucket run at once.
        queue_limit: requests that may wait for an instance (or for the dispatcher) at once.
        on_full: ``"block"`` (default: ``submit`` waits up to ``submit_timeout`` seconds,
            None or ``inf``: forever, then raises `Overloaded`) or ``"raise"`` (`Overloaded`
            at once). ``submit_timeout`` is checked as ``submit``'s ``timeout`` is. Both may
            be set on the engine later (checked the same way); the other settings are fixed
            when it is made.
        batching: None (default: one request per launch), a `Batching`, or True (its
            defaults). Requires a kernel that works row by row.
        split: allow requests above the largest bucket: they run as chunks of the largest
            bucket, outputs concatenated (default False: `RequestTooLarge`).
        dispatch: ``"caller"`` (default: the submitting thread launches when an instance is
            free; with batching, the thread that fills a batch starts it) or ``"thread"``
            (one dispatcher thread launches everything).
        completion_threads: threads that wait on blocking-sync events (default 1, at most
            `MAX_COMPLETION_THREADS` = 64).
        timing_every: measure GPU time on every n-th launch (timing events; 0: never).
        zero_padding: zero the padding rows of input staging that a larger earlier request
            left behind (default True: a request never sees another's data).
        completions_per_turn: asyncio (`run`): at most this many awaited futures of one
            event loop are resolved per drain (default 16), and a drain stops early after
            0.25 ms (`TURN_BUDGET_NS`); the rest go on in later iterations, after the timers
            that came due, so a burst of completions never holds the loop (its lag) for long.
            Each resolved task resumes in the loop's next iteration.
        device, verify, streams: for the CUDA backends (the device; the hazard verifier; the
            eager executor's stream count).

    Thread-safety: every public method may be called from any thread at once, except that
    `close` must not be called from a future's done-callback (it joins the engine's threads).
    Instances are never shared: a launch holds its instance until its outputs are copied out.
    """

    def __init__(self, build: Callable | None = None, *, inputs, outputs, buckets="vllm",
                 max_rows: int | None = None, executor="graph", backend: Backend | None = None,
                 instances: int = 2, queue_limit: int = 1024, on_full: str = "block",
                 submit_timeout: float | None = None, batching=None, split: bool = False,
                 dispatch: str = "caller", completion_threads: int = 1, timing_every: int = 64,
                 zero_padding: bool = True, completions_per_turn: int = 16, device=None,
                 verify: bool = True, streams: int = 1):
        self._inputs = tensor_specs(inputs, "inputs")
        self._outputs = tensor_specs(outputs, "outputs")
        self.buckets = Buckets(bucket_sizes(buckets, max_rows))
        instances = positive_count("instances", instances)
        queue_limit = positive_count("queue_limit", queue_limit)
        self._init_admission(on_full, submit_timeout)
        if dispatch not in ("caller", "thread"):
            raise ServeConfigValueError(f"dispatch must be 'caller' or 'thread'; got {dispatch!r}")
        self.completions_per_turn = positive_count("completions_per_turn", completions_per_turn)
        if positive_count("completion_threads", completion_threads) > MAX_COMPLETION_THREADS:
            raise ServeConfigValueError(
                f"completion_threads must be at most {MAX_COMPLETION_THREADS}; got "
                f"{completion_threads} (each one is a thread waiting on the driver: a few "
                "cover head-of-line waits; more instances or buckets serve more at once)")
        if batching is True:
            batching = Batching()
        if batching is not None and not isinstance(batching, Batching):
            raise ServeConfigTypeError(f"batching must be None, True or a Batching; got "
                                       f"{batching!r}")
        if batching is not None:
            mb = batching.max_batch if batching.max_batch is not None else self.buckets.largest
            if mb > self.buckets.largest:
                raise ServeConfigValueError(f"max_batch {mb} rows is above the largest bucket "
                                            f"({self.buckets.largest} rows)")
            self._max_batch = mb
            self._max_delay_ns = int(batching.max_delay_us * 1000)
        else:
            self._max_batch = 0
            self._max_delay_ns = 0
        self.batching = batching
        self.instances = int(instances)
        self.queue_limit = int(queue_limit)
        self.split = bool(split)
        self.dispatch = dispatch
        # one FIFO of requests (the batcher thread and, with dispatch "caller", the submitting
        # and finishing threads form launches from its head) instead of per-bucket queues
        self._fifo = batching is not None or dispatch == "thread"
        # an int, -5 and 1.5 refused (int() took them as 0 and 1)
        self.timing_every = positive_count("timing_every (0: never)", timing_every, least=0)
        self.zero_padding = bool(zero_padding)
        if backend is None:
            if build is None:
                raise ServeConfigTypeError("Engine needs build (a function returning a "
                                           "ServeGraph) or backend=")
            from orchestra.serve.cuda_backend import make_backend

            backend = make_backend(build, executor, device=device, verify=verify,
                                   streams=streams)
        elif build is not None:
            raise ServeConfigTypeError("give build or backend=, not both")
        elif not isinstance(backend, Backend):
            raise ServeConfigTypeError(f"backend must be an orchestra.serve.Backend (e.g. "
                                       f"NumpyBackend(fn)); got {type(backend).__name__}")
        self.backend = backend
        self.executor = backend.name
        self._single_output = next(iter(self._outputs)) if len(self._outputs) == 1 else None

        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # queue space (blocked submitters)
        self._space_waiting = 0  # submitters waiting on _space (under the lock)
        self._work = threading.Condition(self._lock)  # the dispatcher: requests, instances
        self._idle = threading.Condition(self._lock)  # close(): nothing queued or running
        self._built = threading.Condition(self._lock)  # warmup(): a bucket's build ended
        self._buckets: dict[int, _Bucket] = {}  # the buckets requests have touched
        # rows -> the bucket a request of that many rows runs on (index 0 unused): one list
        # lookup per request instead of a bisect and a dict lookup, for up to _TABLE_ROWS
        # rows (a list as long as max_rows would be built for any max_rows: 10**8 rows, 800
        # MB); `_bucket_of` bisects above it
        table = {rows: _Bucket(rows) for rows in self.buckets.sizes}
        self._by_rows: list[_Bucket] = [table[self.buckets.sizes[0]]]  # [0]: never used
        for rows in range(1, min(self.buckets.largest, _TABLE_ROWS) + 1):
            self._by_rows.append(table[self.buckets.pick(rows) or self.buckets.largest])
        self._table = table
        self._inline = 0  # blocking calls running on their own thread (no _Launch object)
        self._fast_in = (next(iter(self._inputs.values())) if len(self._inputs) == 1
                         else None)
        self._fast_name = self._fast_in.name if self._fast_in is not None else ""
        self._fast_ndim = 1 + len(self._fast_in.row_shape) if self._fast_in is not None else 0
        self._aio_q: queue.SimpleQueue | None = None  # the asyncio bridge (run())
        self._bridge_closed = False  # set by close() once the bridge is gone: run() refuses
        self._bridge_lock = threading.Lock()  # _bridge_closed vs run()'s hand-over only
        self._cancel_all = False  # close(cancel=True): the bridge cancels what it still holds
        # event loop -> its _LoopInbox (completions handed to it, its in-flight bound)
        self._aio_boxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._running: set[_Launch] = set()
        self._queued = 0
        self._batchq: collections.deque = collections.deque()
        self._batch_rows = 0  # rows waiting in _batchq
        # when the batcher thread wakes up: 0 while it runs, None while it waits for a notify
        # (nothing queued, or the head waits for an instance or a build), else the head's
        # batching deadline (ns); other threads notify it only when it would oversleep
        self._timer_due: int | None = 0
        self._head_missed = False  # the head batch waited for its bucket's build
        # (head request, requests, rows) of the head's batch once no later request can join
        # it (`_form_batches`); a later head is another request, so the check is `is`
        self._head_plan: tuple | None = None
        # set by _form_batches: the batching deadline (ns) of the head it left waiting for
        # more requests, 0 when it left the head waiting for an instance or a build (or the
        # FIFO empty). The batcher sleeps until this deadline; reading the clock again
        # instead can see the deadline passed that _form_batches saw ahead, and sleep
        # without a timeout with a due batch queued.
        self._head_due = 0
        # dynamic batching with dispatch "caller": the delay timer is a timerfd that the
        # thread queuing a head arms without waking the batcher thread (None: the condition
        # variable timer above); _armed_due is the deadline it is armed for (0: none pending)
        self._tfd = (deadline_timer() if batching is not None and dispatch == "caller"
                     else None)
        self._armed_due = 0
        self._state = "open"  # open | closing | closed
        self._broken: BaseException | None = None
        self._stopping = False
        self._building = 0
        self._nlaunch = 0
        self._bad = 0
        self._overloaded = 0
        self._cancelled = 0
        self._threads: list[threading.Thread] = []
        self._cq: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(completion_threads):
            self._start_thread(self._completion_loop, f"orchestra-serve-completion-{i}")
        if self._tfd is not None:
            self._start_thread(self._timer_loop, "orchestra-serve-dispatch")
        elif self._fifo:
            self._start_thread(self._batcher_loop, "orchestra-serve-dispatch")

    def _start_thread(self, target, name) -> None:
        t = threading.Thread(target=self._thread_main, args=(target,), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _thread_main(self, target) -> None:
        try:
            self.backend.thread_init()
        except Exception:  # noqa: BLE001 - the loop reports errors per launch
            log.exception("serve: thread setup failed")
        target()

    # -- properties -----------------------------------------------------------------------------

    @property
    def inputs(self) -> dict:
        return dict(self._inputs)

    @property
    def outputs(self) -> dict:
        return dict(self._outputs)

    @property
    def broken(self) -> BaseException | None:
        """The sticky `CudaError` that broke the engine, or None."""
        return self._broken

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    # -- submitting -------------------------------------------------------------------------

    def submit(self, inputs, *, out=None, pinned: bool = False,
               timeout: Any = ...) -> ServeFuture:
        """Submit one request; returns its `ServeFuture` (the outputs: one array for a
        one-output engine, else ``{name: array}``).

        Args:
            inputs: ``{name: array}`` (one array for a one-input engine): numpy arrays or
                host tensors (CPU torch tensors, DLPack / ``__array_interface__`` objects,
                read through a view of their memory; device tensors raise `InputTypeError`),
                C-contiguous, the declared dtype, shape ``(rows, *row_shape)``. Copied into the instance's pinned
                staging when the request launches (at once when an instance is free; keep the
                arrays unchanged until the future is done).
            out: arrays to write the outputs into (``(rows, *row_shape)``, the dtype,
                C-contiguous, writable); default: new arrays the caller owns.
            pinned: the inputs are page-locked (`PinnedBuffer` memory or `register_host`) and
                the instance may read them directly (zero-copy) when the request fills its
                bucket exactly and runs alone; the arrays must then stay unchanged and alive
                until the future is done.
            timeout: seconds to wait for queue space with ``on_full="block"`` (default: the
                engine's ``submit_timeout``; None or ``inf``: no limit).

        A bad request returns a future already failed with `BadRequest` / `InputTypeError` /
        `RequestTooLarge` (or `PageableMemoryError` for ``pinned=True``); nothing is enqueued.
        Raises `Overloaded` (queue full), `EngineBroken` (a sticky CUDA error), `EngineClosed`;
        `ServeConfigTypeError` / `ServeConfigValueError` for a ``timeout`` that is not a
        number, a bool, NaN or negative (before anything is checked or queued).
        """
        timeout = self._submit_timeout if timeout is ... else check_timeout(timeout, "timeout")
        return self._submit(inputs, out, pinned, timeout, self._block, False)

    def __call__(self, inputs, *, out=None, pinned: bool = False):
        """Run one request and wait for it in this thread: the lowest-latency path. Without
        batching (dispatch "caller"): no future, no event, no completion thread, no thread
        hop when an instance is free: check, lease, copy into the staging, launch, wait on
        the instance's stream, copy out, give the instance back. With dynamic batching the
        request joins the batch queue like a submitted one; when it fills a batch this thread
        launches the batch, waits for it on the instance's stream and completes every
        request of it (no thread hop either). Returns the outputs; raises what `submit`
        raises and what the request fails with (a bad request raises its `BadRequest`
        here)."""
        if not self._fifo and out is None and not pinned:
            t0 = _now()
            spec = self._fast_in
            if (spec is not None and type(inputs) is np.ndarray and inputs.dtype == spec.dtype
                    and inputs.ndim == self._fast_ndim and inputs.shape[1:] == spec.row_shape
                    and inputs.flags.c_contiguous):
                arrays, rows = None, inputs.shape[0]  # the checks _check_array makes, inline
            else:
                try:
                    arrays, rows = check_inputs(self._inputs, inputs)
                except OrchestraError:
                    self._count_bad()
                    raise
            if 0 < rows <= self.buckets.largest:
                b = self._bucket_of(rows)
                inst = None
                with self._lock:
                    if (b.ready and b.free and not b.queue and self._state == "open"
                            and self._broken is None):
                        inst = b.free.pop()
                        self._inline += 1
                        b.stats.hits += 1
                if inst is not None:
                    return self._call_inline(b, inst, inputs if arrays is None else arrays,
                                             rows, t0)
        # queued, being built, split, out=/pinned, or dispatched by the thread: the general path
        fut = self._submit(inputs, out, pinned, self._submit_timeout, self._block,
                           True)
        return fut.result()

    def _call_inline(self, b: _Bucket, inst: Instance, inputs, rows: int, t0: int):
        """The blocking call on a leased instance, in the calling thread (counted in
        ``_inline`` until the instance is back). ``inputs``: the one input array, or the
        checked ``{name: array}``."""
        gpu_ms = None
        try:
            staging = inst.inputs
            whole = rows == inst.rows
            if type(inputs) is np.ndarray:
                dst = staging[self._fast_name]
                if whole:
                    np.copyto(dst, inputs)
                else:
                    dst[:rows] = inputs
            else:
                for name, a in inputs.items():
                    if whole:
                        np.copyto(staging[name], a)
                    else:
                        staging[name][:rows] = a
            if inst.dirty > rows and self.zero_padding:
                for a in staging.values():
                    a[rows:inst.dirty] = 0
            inst.dirty = rows
            every = self.timing_every
            timed = False
            if every:
                self._nlaunch += 1
                timed = every == 1 or self._nlaunch % every == 1
            inst.launch(notify=False, timed=timed)
            inst.wait()
            gpu_ms = inst.finish(timed)
            result: Any
            if self._single_output is not None:
                a = inst.outputs[self._single_output]
                result = a.copy() if whole else a[:rows].copy()
            else:
                result = {n: (a.copy() if whole else a[:rows].copy())
                          for n, a in inst.outputs.items()}
        except BaseException as exc:
            self._inline_failed(b, inst, exc)
            raise
        nxt = self._inline_done(b, inst, rows, gpu_ms)
        if nxt is not None:
            self._run(nxt)
        b.stats.latency_us.add((_now() - t0) / 1e3)
        return result

    def _inline_done(self, b: _Bucket, inst: Instance, rows: int, gpu_ms, failed: int = 0):
        """Give an inline call's instance back (or to the bucket's next queued request:
        returned, to start outside the lock)."""
        st = b.stats
        nxt = None
        with self._lock:
            self._inline -= 1
            if failed:
                st.failed += 1
            else:
                st.requests += 1
                st.launches += 1
                st.rows_served += rows
                if gpu_ms is not None:
                    st.gpu_ms.add(gpu_ms)
            if self._broken is None:  # an inline call runs only with dispatch "caller"
                nxt = self._hand_back(b, inst)
            if self._state != "open":
                self._notify_idle()
        return nxt

    def _inline_failed(self, b: _Bucket, inst: Instance, exc: BaseException) -> None:
        sticky = isinstance(exc, CudaError) and exc.sticky
        if sticky:
            with self._lock:
                self._inline -= 1
                b.stats.failed += 1
                self._notify_idle()
            self._break(exc)
            return
        try:  # a launch that failed part-way may still run: never lease staging it reads
            inst.wait()
        except BaseException:  # noqa: BLE001 - already failing this request
            pass
        nxt = self._inline_done(b, inst, 0, None, failed=1)
        if nxt is not None:
            self._run(nxt)

    def _notify_idle(self) -> None:
        """Under the lock: wake close() when nothing is queued or running. Only close() waits
        for it, so the hot paths call this only once the engine is no longer open."""
        if not self._running and not self._queued and not self._inline:
            self._idle.notify_all()

    async def run(self, inputs, *, out=None, pinned: bool = False):
        """``await engine.run(x)``: the outputs, delivered on the caller's event loop.

        The loop is never blocked: on the loop thread the request is only checked (a bad one
        raises its `BadRequest` here) and handed to the engine's asyncio bridge thread
        (a ``SimpleQueue``: no lock the engine holds), which leases an instance or queues the
        request, copies and launches; the thread that completes the request (the completion
        thread, or the bridge) hands it to the loop's inbox, which wakes the loop once per
        burst of completions (one write to an ``eventfd`` the loop watches, or
        ``call_soon_threadsafe`` where the loop cannot watch one) and resolves the awaited
        ``asyncio.Future`` objects in bounded turns: at most ``completions_per_turn`` per loop
        iteration and for about `TURN_BUDGET_NS` (0.25 ms; docs/serving.md). Each awaiting
        task resumes in the loop's next iteration, as after any asyncio future. At
        most ``queue_limit`` requests of one loop are in flight at once: further ones
        await a free slot (``on_full="block"``) or raise `Overloaded` (``on_full="raise"``):
        back-pressure that awaits instead of blocking. Cancelling the awaiting task cancels
        the request if it has not started. If the loop is closed before the request
        completes, the result is dropped (nothing is raised on engine threads).

        ``inputs``, ``out``, ``pinned``: as `submit`. Raises what `submit`'s future would
        (`BadRequest`, `InputTypeError`, `RequestTooLarge`, `PageableMemoryError`, the
        launch's own error) and `Overloaded`, `EngineClosed`, `EngineBroken`. Call it on a
        running event loop (any number of loops and tasks at once)."""
        loop = asyncio.get_running_loop()
        t0 = _now()
        rows = self._fast_rows(inputs, out, pinned)
        if rows:
            # one plain array of a one-input engine: checked inline, one request
            reqs = [_Req({self._fast_name: inputs}, rows, self._bucket_of(rows).rows, None, t0,
                         None)]
        else:
            try:
                reqs = self._requests(inputs, out, pinned, t0)
            except OrchestraError:
                self._count_bad()
                raise
        self._check_open()
        box = self._aio_boxes.get(loop)
        if box is None:
            box = self._inbox(loop)
        slots = box.sem
        if not slots.take():  # no slot free (or others await one first)
            if not self._block:
                self._count_overloaded()
                raise Overloaded(f"{self.queue_limit} requests of this event loop are in "
                                 f"flight (queue_limit={self.queue_limit}); retry later")
            await slots.acquire()
        fut = ServeFuture(self)
        if len(reqs) == 1:
            reqs[0].fut = fut
        else:
            for r in reqs:
                r.fut = fut
        if reqs[0].group is not None:
            reqs[0].group.fut = fut
        aio = loop.create_future()
        fut._aio = aio
        # the inbox's one shared callback list instead of add_done_callback: no list and no
        # bound method per request (two objects fewer for the garbage collector to traverse
        # while a thousand requests are in flight); nobody else sees this future, so nobody
        # adds to the list, and completing the future only drops its reference to it
        fut._done_callbacks = box.callbacks
        try:
            q = self._aio_q
            if q is None:
                q = self._start_bridge()
            # close() sets the flag under this lock before its last sweep; not the engine's
            # lock: the loop thread would sleep behind the engine's threads holding it, then
            # wait for the GIL to come back (up to a switch interval of loop lag)
            with self._bridge_lock:
                refused = self._bridge_closed
                if not refused:
                    q.put(reqs)
        except BaseException:
            slots.release()
            raise
        if refused:  # the engine closed while this request awaited its slot
            slots.release()
            raise EngineClosed("the engine closed before the request was admitted")
        # the bridge holds the requests now; this frame keeps only what it needs (one object
        # fewer per request in flight for the collector to traverse)
        del reqs
        try:
            return await aio
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            # the exception's traceback holds this frame and the future holds the exception:
            # the frame lets go of the future (no reference cycle per failed request)
            del fut, aio
            raise

    def _inbox(self, loop) -> _LoopInbox:
        """The loop's inbox (made on its first request; on the loop's thread)."""
        box = _LoopInbox(loop, _Slots(self.queue_limit), self.completions_per_turn,
                         wake_fd=True)
        self._aio_boxes[loop] = box
        return box

    def _start_bridge(self) -> queue.SimpleQueue:
        with self._lock:
            if self._aio_q is None:
                self._check_open()
                q: queue.SimpleQueue = queue.SimpleQueue()
                self._start_thread(functools.partial(self._bridge_loop, q),
                                   "orchestra-serve-asyncio")
                self._aio_q = q
            return self._aio_q

    def _bridge_loop(self, q: queue.SimpleQueue) -> None:
        """The asyncio bridge: admits what `run` handed over (waiting for queue space here,
        never on a loop), starts launches, offloads bucket builds to their own thread."""
        while True:
            reqs = q.get()
            if reqs is _STOP:
                # close(): the loops' inboxes give their eventfds back once their requests
                # in flight are delivered (nothing new comes: run() refuses from here on)
                while True:
                    try:
                        boxes = list(self._aio_boxes.values())
                        break
                    except RuntimeError:  # a loop added its inbox meanwhile: again
                        continue
                for box in boxes:
                    box.retire()
                return
            self._bridge_admit(reqs)
            # not held while this thread waits for the next request: the last request (its
            # future, its result) would stay alive until then, a cancelled one's included
            del reqs

    def _bridge_admit(self, reqs: list[_Req]) -> None:
        """The bridge thread: admit and start one `run` request (its locals go with it)."""
        try:
            fut = reqs[0].fut
            if fut.cancelled():
                with self._lock:
                    self._cancelled += 1
                return
            if self._cancel_all:
                if not fut.cancel():
                    _set_exception(fut, EngineClosed("the engine closed with cancel=True"))
                with self._lock:
                    self._cancelled += 1
                return
            try:
                todo = self._admit(reqs, self._submit_timeout, self._block,
                                   bridge=True)
            except OrchestraError as exc:  # Overloaded, EngineClosed, EngineBroken
                for r in reqs:
                    self._fail(r, exc)
                return
            if todo:
                self._run_todo(todo, build_here=False)
        except BaseException as exc:  # noqa: BLE001 - never let an error end this thread
            log.exception("serve: the asyncio bridge failed a request")
            for r in reqs:
                if r.fut is not None and not r.fut.done():
                    self._fail(r, exc)

    def _fast_rows(self, inputs, out, pinned) -> int:
        """The rows of ``inputs`` when it is one plain C-contiguous array of a one-input
        engine's dtype and row shape that fits a bucket, with no ``out=`` / ``pinned`` (the
        checks `check_inputs` makes, inline: `submit`'s and `run`'s fast path); else 0."""
        spec = self._fast_in
        if (spec is not None and out is None and not pinned and type(inputs) is np.ndarray
                and inputs.dtype == spec.dtype and inputs.ndim == self._fast_ndim
                and inputs.shape[1:] == spec.row_shape
                and inputs.flags.c_contiguous and 0 < inputs.shape[0] <= self.buckets.largest):
            return inputs.shape[0]
        return 0

    def _count_overloaded(self) -> None:
        with self._lock:
            self._overloaded += 1

    def _submit(self, inputs, out, pinned, timeout, block, inline) -> ServeFuture:
        t0 = _now()
        rows = self._fast_rows(inputs, out, pinned)
        if rows:
            # one input, checked inline, one request
            fut = ServeFuture(self)
            r = _Req({self._fast_name: inputs}, rows, self._bucket_of(rows).rows, None, t0, fut)
            if self._fifo and not inline:
                todo = self._enqueue(r)
                if todo is not None:
                    if todo:
                        self._run_watching(todo, build_here=True)
                    return fut
            reqs = [r]
        else:
            try:
                reqs = self._requests(inputs, out, pinned, t0)
            except OrchestraError as exc:  # a bad request fails its own future, nothing queued
                return self._refused(exc)
            fut = ServeFuture(self)
            for r in reqs:
                r.fut = fut
            if reqs[0].group is not None:
                reqs[0].group.fut = fut
        if inline:
            reqs[0].caller = threading.get_ident()
        todo = self._admit(reqs, timeout, block)
        if todo:
            if not self._fifo or self.dispatch != "caller":
                self._run_todo(todo, build_here=True)
                return fut
            # dynamic batching: the batches this submit started that a blocking call waits
            # on (its own, or another thread's sleeping in result()) are waited for and
            # completed right here, on the instance's stream: no completion thread, no event
            self._run_watching(todo, build_here=True)
        return fut

    def _enqueue(self, r: _Req) -> list | None:
        """`_admit` for the common FIFO submit (dynamic batching or the dispatcher thread; one
        plain request, queue space left, the engine open) in one short hold of the lock:
        append it and start what that can start (`_fifo_appended`). Returns what
        `_run_watching` starts, or None when the request needs `_admit` (no space, closing,
        broken)."""
        with self._lock:
            if (self._state != "open" or self._broken is not None
                    or self._queued >= self.queue_limit):
                return None
            q = self._batchq
            was_empty = not q
            q.append(r)
            self._batch_rows += r.rows
            self._queued += 1
            return self._fifo_appended(was_empty)

    def _fifo_appended(self, was_empty: bool) -> list:
        """Under the lock, after requests joined the FIFO: what that can start. With the
        dispatcher thread, it is woken when it has something new to do. With dynamic batching
        (dispatch "caller") batches are formed here, by the submitting thread, only when the
        FIFO was empty (the new head needs its delay timer), a batch is full, or close() began
        (every batch goes at once): every other change that can start a batch forms batches
        itself (an instance given back, a build done, the deadline), so calling it per
        request would only look at the same head again."""
        if self.dispatch == "thread":
            if was_empty or self.batching is None or self._batch_rows >= self._max_batch:
                self._work.notify()
            return []
        if was_empty or self._batch_rows >= self._max_batch or self._state != "open":
            return self._form_batches()
        return []

    def _build_quietly(self, b) -> None:
        try:
            self.backend.thread_init()
            self._build(b)
        except BaseException:  # noqa: BLE001 - the waiting requests carry the error
            log.debug("serve: background build of the %d-row bucket failed", b.rows,
                      exc_info=True)

    def _refused(self, exc: OrchestraError) -> ServeFuture:
        """A future failed with a bad request's error. The frames of the checks are cleared
        first: the exception's traceback would keep them (and the request's arrays) alive as
        long as the future, and no frame of the raise may refer to the future itself (a
        cycle per bad request, left to the cyclic GC)."""
        self._count_bad()
        traceback.clear_frames(exc.__traceback__)  # the caller's running frame is skipped
        fut = ServeFuture(self)
        fut.set_exception(exc)
        return fut

    def _count_bad(self) -> None:
        with self._lock:
            self._bad += 1

    def _requests(self, inputs, out, pinned, t0) -> list[_Req]:
        """The request's `_Req` list (one, or the chunks of a split); the caller sets their
        future."""
        arrays, rows = check_inputs(self._inputs, inputs)
        outs = check_out(self._outputs, out, rows) if out is not None else None
        if pinned:
            for name, a in arrays.items():
                self.backend.check_pinned(name, a)
        bucket = self.buckets.pick(rows)
        if bucket is not None:
            return [_Req(arrays, rows, bucket, outs, t0, None, None, bool(pinned))]
        if not self.split:
            raise RequestTooLarge(rows, self.buckets.largest)
        # split into chunks of the largest bucket; outputs assembled in place
        if outs is None:
            outs = {n: np.empty(s.shape(rows), s.dtype) for n, s in self._outputs.items()}
        else:
            for n, s in self._outputs.items():
                outs.setdefault(n, np.empty(s.shape(rows), s.dtype))
        step = self.buckets.largest
        starts = range(0, rows, step)
        group = _Group(None, len(starts), outs)
        reqs = []
        for lo in starts:
            hi = min(rows, lo + step)
            reqs.append(_Req({n: a[lo:hi] for n, a in arrays.items()}, hi - lo,
                             self.buckets.pick(hi - lo), {n: a[lo:hi] for n, a in outs.items()},
                             t0, None, group, False))
        return reqs

    def _check_open(self) -> None:
        if self._broken is not None:
            raise EngineBroken(self._broken)
        if self._state != "open":
            raise EngineClosed("the engine is closed; create a new Engine to serve again")

    def _bucket_of(self, rows: int) -> _Bucket:
        """The bucket a request (or batch) of ``rows`` rows runs on (1 <= rows <= the
        largest bucket): one list lookup up to `_TABLE_ROWS` rows, a bisect above."""
        if rows <= _TABLE_ROWS:
            return self._by_rows[rows]
        return self._table[self.buckets.pick(rows) or self.buckets.largest]

    def _bucket(self, rows: int) -> _Bucket:
        b = self._buckets.get(rows)
        if b is None:
            b = self._buckets[rows] = self._table[rows]
        return b

    def _admit(self, reqs: list[_Req], timeout, block, bridge: bool = False) -> list:
        """Lease instances or queue (under the lock); returns what this thread starts outside
        the lock (`_run_todo`: launches, buckets to build, batches to fail). ``bridge``:
        requests `run` accepted before close() began are still admitted while the engine is
        closing (close() drains them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if not (bridge and self._state == "closing" and self._broken is None):
                    self._check_open()
                if self._fifo:
                    need = len(reqs)
                else:
                    need = sum(1 for r in reqs if not self._buckets.get(r.bucket)
                               or not self._buckets[r.bucket].free
                               or self._buckets[r.bucket].queue)
                if not need or self._queued + need <= self.queue_limit or self._queued == 0:
                    break
                if not block:
                    self._overloaded += 1
                    raise Overloaded(f"the queue is full ({self._queued} requests waiting, "
                                     f"queue_limit={self.queue_limit}); retry later")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._overloaded += 1
                    raise Overloaded(f"no queue space within {timeout} s ({self._queued} "
                                     f"requests waiting, queue_limit={self.queue_limit})")
                self._space_waiting += 1
                try:
                    self._space.wait(left)
                finally:
                    self._space_waiting -= 1
            if self._fifo:
                q = self._batchq
                was_empty = not q
                if len(reqs) == 1:
                    q.append(reqs[0])
                    self._batch_rows += reqs[0].rows
                else:
                    q.extend(reqs)
                    self._batch_rows += sum(r.rows for r in reqs)
                self._queued += len(reqs)
                return self._fifo_appended(was_empty)
            todo: list = []
            builds = []
            for r in reqs:
                b = self._bucket(r.bucket)
                st = b.stats
                if b.free and not b.queue:
                    st.hits += 1
                    launch = _Launch(b.free.pop(), b, [r])
                    self._running.add(launch)
                    todo.append(launch)
                    continue
                if b.ready:
                    st.hits += 1
                else:
                    st.misses += 1
                    if not b.building:
                        b.building = True
                        self._building += 1
                        builds.append(b)
                b.queue.append(r)
                self._queued += 1
                if len(b.queue) > st.queue_high:
                    st.queue_high = len(b.queue)
            return todo + builds if builds else todo

    def _form_batches(self) -> list:
        """Under the lock: the launches that may start now from the head of the FIFO, as
        `_run_todo` items: each launch is the head request alone (no batching), or the
        requests at the head that fit ``max_batch`` rows once the batch is full (the next
        request would not fit, or ``max_batch`` rows are reached) or its first request waited
        ``max_delay_us``; on the smallest bucket of the batch's rows, with a free instance.
        Stops at a head that must wait (for more requests, an instance or a build: a build
        it starts is a `_Bucket` item). With dispatch "caller" (batching), every thread that
        queues a request or returns an instance calls this, so a full batch never waits for
        the batcher thread; the thread is only the delay timer then."""
        q = self._batchq
        todo: list = []
        self._head_due = 0
        if not q or self._broken is not None:
            return todo
        batching = self.batching is not None
        mb = self._max_batch
        now = 0
        while q:
            if not batching:
                n, total = 1, q[0].rows
            else:
                # not full: due yet? (once close() began, every batch goes at once)
                if self._batch_rows < mb and self._state == "open":
                    if not now:
                        now = _now()
                    due = q[0].t0 + self._max_delay_ns
                    if now < due:
                        self._head_due = due
                        break
                n, total = self._head_batch()
            b = self._bucket_of(total)
            if not b.ready:
                self._head_missed = True
                if not b.building:
                    b.building = True
                    self._building += 1
                    self._buckets.setdefault(b.rows, b)
                    todo.append(b)
                break
            if not b.free:
                break
            if n == 1:
                reqs = [q.popleft()]
            else:
                reqs = [q.popleft() for _ in range(n)]
            self._head_plan = None
            self._batch_rows -= total
            self._queued -= n
            if self._space_waiting:  # Condition.notify costs two lock calls even for nobody
                self._space.notify(n)
            st = b.stats
            if self._head_missed:
                self._head_missed = False
                st.misses += n
            else:
                st.hits += n
            launch = _Launch(b.free.pop(), b, reqs, total)
            self._running.add(launch)
            todo.append(launch)
        if self._head_due and self._tfd is not None:
            # the head waits for its deadline: arm the timerfd for it unless it is armed for
            # exactly that (re-arming replaces an earlier head's deadline, which passed
            # without a batch to start). The batcher thread is not woken: it sleeps in the
            # timer's read until the deadline passes
            if self._head_due != self._armed_due:
                self._armed_due = self._head_due
                self._tfd.arm(self._head_due - now)
        elif self._head_due and self._timer_due is None and self.dispatch == "caller":
            # the head waits for its deadline and the timer sleeps without one: arm it (a
            # full head waiting for an instance needs no timer: the instance's return
            # starts it). Marked armed at once, so the requests queued before the batcher
            # runs do not notify it again; it reads the head's deadline itself when it wakes
            # (a later head's deadline is never earlier: the FIFO's heads arrive in order)
            self._timer_due = self._head_due
            self._work.notify()
        return todo

    def _head_batch(self) -> tuple[int, int]:
        """Under the lock, the FIFO not empty, batching: (requests, rows) of the batch at its
        head, the head requests that fit ``max_batch`` rows. A batch no later request can join
        (the next did not fit, or it is full) is kept for its head: while the head waits for
        an instance, each call would scan the same requests again."""
        q = self._batchq
        plan = self._head_plan
        if plan is not None and plan[0] is q[0]:
            return plan[1], plan[2]
        mb = self._max_batch
        n = total = 0
        for r in q:
            if n and total + r.rows > mb:
                break
            total += r.rows
            n += 1
        self._head_plan = (q[0], n, total) if n < len(q) or total >= mb else None
        return n, total

    def _run_todo(self, todo: list, build_here: bool, mine: list | None = None) -> None:
        """Outside the lock: start the launches, build the buckets (here, or on a thread of
        their own when ``build_here`` is false: an engine thread never blocks on a build) and
        fail the batches of `_admit` / `_form_batches` / `_hand_back`. ``mine``: this thread
        (a submitting caller) waits for the launches it starts that a blocking call waits on;
        `_start` appends those to the list (they record no event for the completion
        thread)."""
        for item in todo:
            kind = type(item)
            if kind is _Launch:
                self._run(item, mine)
            elif kind is _Bucket:
                if build_here:
                    self._build(item)
                else:
                    threading.Thread(target=self._build_quietly, args=(item,), daemon=True,
                                     name=f"orchestra-serve-build-{item.rows}").start()
            else:
                reqs, exc = item
                for r in reqs:
                    self._fail(r, exc)

    def _run_watching(self, todo: list, build_here: bool) -> None:
        """`_run_todo`, then wait for (and complete) the launches it started that a blocking
        call waits on, on the instance's stream, in this thread (see `_start`'s ``mine``)."""
        mine: list[_Launch] = []
        self._run_todo(todo, build_here=build_here, mine=mine)
        for launch in mine:
            if not launch.done:
                self._wait_launch(launch)

    # -- launching ----------------------------------------------------------------------------

    def _run(self, launch, mine: list | None = None) -> None:
        """Start ``launch`` (a `_Launch`, None, or a `_run_todo` list), and whatever its end
        hands on (a launch with nothing left to run gives its instance to the next).
        ``mine``: see `_run_todo`."""
        while launch is not None:
            if type(launch) is list:
                self._run_todo(launch, build_here=False, mine=mine)
                return
            launch = self._start(launch, mine)

    def _set_running(self, r: _Req) -> bool:
        g = r.group
        if g is None:
            try:
                return r.fut.set_running_or_notify_cancel()
            except RuntimeError:  # failed meanwhile (engine broken)
                return False
        with g.lock:
            if not g.started:
                g.started = True
                try:
                    g.cancelled = not g.fut.set_running_or_notify_cancel()
                except RuntimeError:
                    g.cancelled = True
            if g.cancelled:
                g.remaining -= 1
                return False
            return True

    def _start(self, launch: _Launch, mine: list | None = None) -> _Launch | None:
        """Copy the inputs in and launch; returns the next launch to start when this one had
        nothing to run (every request cancelled) or failed. ``mine`` (a submitting caller's
        list, dynamic batching): a launch with this thread's own blocking call in it, or a
        request whose caller sleeps in ``result()``, is watched by this thread (appended to
        ``mine``: no event, no completion thread)."""
        reqs = launch.reqs
        if len(reqs) == 1:
            r0 = reqs[0]
            if not self._set_running(r0):
                reqs = []
        else:
            keep = []
            for r in reqs:
                if r.group is None:  # `_set_running` inline: one call per request saved
                    try:
                        if r.fut.set_running_or_notify_cancel():
                            keep.append(r)
                    except RuntimeError:  # failed meanwhile (engine broken)
                        pass
                elif self._set_running(r):
                    keep.append(r)
            reqs = keep
            r0 = reqs[0] if reqs else None
        if len(reqs) != len(launch.reqs):
            with self._lock:
                self._cancelled += len(launch.reqs) - len(reqs)
            launch.reqs = reqs
            launch.rows = sum(r.rows for r in reqs)
            if not reqs:
                launch.claim()
                return self._release(launch, None)
        inst = launch.inst
        # the blocking call launching its own request waits for it right here: no event, no
        # completion thread
        if mine is None:
            launch.inline = (r0.caller != 0 and len(reqs) == 1
                             and r0.caller == threading.get_ident())
        else:
            # a submitting caller started this batch: it watches the batch when somebody
            # blocks on it (its own engine(x) call, or a caller asleep in result(): a
            # follower); otherwise the completion thread does, and nobody waits here
            me = threading.get_ident()
            for r in reqs:
                if r.caller == me or r.fut._sleepers:
                    launch.inline = True
                    break
        try:
            bind = None
            if len(reqs) == 1 and r0.pinned and r0.rows == inst.rows:
                bind = r0.arrays
            else:
                staging = inst.inputs
                if len(reqs) == 1:
                    row = r0.rows
                    if row == inst.rows:
                        for name, a in r0.arrays.items():
                            np.copyto(staging[name], a)
                    else:
                        for name, a in r0.arrays.items():
                            staging[name][:row] = a
                else:
                    # a batch: one concatenation per input straight into its staging rows
                    # (one call, and one release of the GIL, for all the batch's rows)
                    row = launch.rows
                    for name, dst in staging.items():
                        np.concatenate([r.arrays[name] for r in reqs], axis=0,
                                       out=dst if row == inst.rows else dst[:row])
                if inst.dirty > row and self.zero_padding:
                    for a in staging.values():
                        a[row:inst.dirty] = 0
                inst.dirty = row
            every = self.timing_every
            if every:
                self._nlaunch += 1
                launch.timed = every == 1 or self._nlaunch % every == 1
            inst.launch(notify=not launch.inline, timed=launch.timed, bind=bind)
            launch.started = True
        except BaseException as exc:  # noqa: BLE001 - fail this launch's requests, keep serving
            return self._launch_failed(launch, exc)
        # only now may a caller's result() wait on it (an unlaunched instance looks done)
        for r in reqs:
            r.fut._launches.append(launch)
        if not launch.inline:
            self._cq.put(launch)
        elif mine is not None:
            mine.append(launch)
        return None

    # -- completing -----------------------------------------------------------------------------

    def _wait_inline(self, fut: ServeFuture) -> None:
        """``result()`` in the caller's thread: wait on each launch of the request's own
        instance, then complete it (unless another thread did first). While the request is
        still queued, the caller completes other started launches nobody waits on instead of
        sleeping (`_help`)."""
        if not fut._launches:
            self._help(fut)
        for launch in list(fut._launches):
            # one thread waits on a launch's instance and completes all of its requests (a
            # batch's other callers wait on their futures: one wake-up each, not two)
            if not launch.done and not launch.waiter:
                self._wait_launch(launch)

    def _help(self, fut: ServeFuture) -> None:
        """A caller waits for a request that is still queued: meanwhile it waits on a started
        launch that nobody waits on and completes it (copy-out, results, the instance's next
        batch), until its own request is launched or done or no such launch is left. A deep
        queue would otherwise leave every completion, and every launch that follows one, to
        the completion thread: one thread doing the host work of all requests and waiting
        for the GIL behind the callers at every step."""
        while not fut._launches and not fut.done():
            launch = None
            # a look without the lock first (tuple() of a set is one C call: atomic under the
            # GIL): most of the time nothing is left to help with and the lock is not taken
            if not any(x.started and not x.waiter and not x.done and not x.inline
                       for x in tuple(self._running)):
                return
            with self._lock:
                for x in self._running:
                    if x.started and not x.waiter and not x.done and not x.inline:
                        launch = x
                        x.waiter = True
                        break
            if launch is None:
                return
            self._wait_launch(launch)

    def _wait_launch(self, launch: _Launch) -> None:
        launch.waiter = True
        try:
            launch.inst.wait()
        except BaseException as exc:  # noqa: BLE001 - the future carries it
            self._run(self._launch_failed(launch, exc))
            return
        self._finish(launch)

    def _completion_loop(self) -> None:
        cq = self._cq
        while True:
            launch = cq.get()
            if launch is _STOP:
                return
            try:
                if launch.done or launch.waiter:
                    continue  # completed already, or a caller waits on it and completes it
                try:
                    launch.inst.wait_blocking()
                except BaseException as exc:  # noqa: BLE001
                    self._run(self._launch_failed(launch, exc))
                    continue
                self._finish(launch)
            except BaseException:  # noqa: BLE001 - never let an error end this thread
                log.exception("serve: completion of a launch failed")

    def _finish(self, launch: _Launch) -> None:
        if not launch.claim():
            return
        inst = launch.inst
        reqs = launch.reqs
        block = None
        results: list[dict] = []
        try:
            gpu_ms = inst.finish(launch.timed)
            single = self._single_output
            if (len(reqs) > 1 and single is not None
                    and all(r.out is None and r.group is None for r in reqs)):
                # the common batch: one output, new arrays, no chunks: one copy of the rows,
                # each request a view of its rows in it (`_split_outputs` without the dicts)
                st = inst.outputs[single]
                block = st[:launch.rows].copy() if launch.rows != inst.rows else st.copy()
            elif len(reqs) == 1:
                r = reqs[0]
                n = r.rows
                whole = n == inst.rows
                outs = {}
                for name, st in inst.outputs.items():
                    src = st if whole else st[:n]
                    dst = None if r.out is None else r.out.get(name)
                    if dst is None:
                        outs[name] = src.copy()
                    else:
                        np.copyto(dst, src)
                        outs[name] = dst
                results = [outs]
            else:
                results = self._split_outputs(inst, reqs, launch.rows)
        except BaseException as exc:  # noqa: BLE001
            self._run(self._launch_failed(launch, exc, claimed=True))
            return
        nxt = self._release(launch, gpu_ms)
        # the completion thread's queue may still hold this launch: let it hold no request
        # (and so no future, no result)
        launch.reqs = ()
        if nxt is not None:
            self._run(nxt)  # the next queued request first: keep the GPU busy
        stats = launch.bucket.stats
        if block is not None:
            lat = stats.latency_us
            now = _now()
            row = 0
            for r in reqs:
                end = row + r.rows
                lat.add((now - r.t0) / 1e3)
                _set_result(r.fut, block[row:end])
                row = end
            return
        for r, outs in zip(reqs, results):
            self._deliver(r, outs, stats)

    def _split_outputs(self, inst: Instance, reqs: list[_Req], rows: int) -> list[dict]:
        """A batch's outputs per request. One copy of the batch's rows per output (one call,
        one release of the GIL) into a new array, and each request gets its rows of it as a
        view: the block belongs to the batch's requests only (the engine never writes it
        again), so the views are the callers' own; requests with ``out=`` get their rows
        copied into their arrays instead."""
        blocks = {}
        for name, st in inst.outputs.items():
            if any(r.out is None or name not in r.out for r in reqs):
                blocks[name] = st[:rows].copy() if rows != inst.rows else st.copy()
        results = []
        row = 0
        for r in reqs:
            n = r.rows
            end = row + n
            outs = {}
            for name, st in inst.outputs.items():
                dst = None if r.out is None else r.out.get(name)
                if dst is None:
                    outs[name] = blocks[name][row:end]
                else:
                    np.copyto(dst, st[row:end])
                    outs[name] = dst
            results.append(outs)
            row = end
        return results

    def _deliver(self, r: _Req, outs: dict, stats: BucketStats) -> None:
        g = r.group
        if g is None:
            stats.latency_us.add((_now() - r.t0) / 1e3)
            _set_result(r.fut, outs[self._single_output] if self._single_output else outs)
            return
        with g.lock:
            g.remaining -= 1
            last = g.remaining == 0
        if last:
            stats.latency_us.add((_now() - r.t0) / 1e3)
            if g.error is not None:
                _set_exception(g.fut, g.error)
            else:
                o = g.outputs
                _set_result(g.fut, o[self._single_output] if self._single_output else o)

    def _fail(self, r: _Req, exc: BaseException) -> None:
        g = r.group
        if g is None:
            _set_exception(r.fut, exc)
            return
        with g.lock:
            if g.error is None:
                g.error = exc
            g.remaining -= 1
            last = g.remaining <= 0
        if last:
            _set_exception(g.fut, g.error)

    def _launch_failed(self, launch: _Launch, exc: BaseException, claimed: bool = False):
        """Fail ``launch``'s requests with ``exc``; a sticky CUDA error breaks the engine.
        Returns the next launch to start (None when broken)."""
        if not claimed and not launch.claim():
            return None  # someone else completed or failed it
        _drop_engine_frames(exc)
        if not isinstance(exc, Exception):  # KeyboardInterrupt and friends: fail, re-raise
            for r in launch.reqs:
                self._fail(r, EngineClosed(f"the request was interrupted: {exc!r}"))
            nxt = self._release(launch, None, failed=len(launch.reqs))
            launch.reqs = ()
            if nxt is not None:
                # the instance went to the next queued request (or batches): this thread is
                # interrupted, so they start on a thread of their own instead of never
                threading.Thread(target=self._run_quietly, args=(nxt,), daemon=True,
                                 name="orchestra-serve-handoff").start()
            raise exc
        sticky = isinstance(exc, CudaError) and exc.sticky
        for r in launch.reqs:
            self._fail(r, exc)
        if sticky:
            self._break(exc)
            with self._lock:
                self._running.discard(launch)
                launch.bucket.stats.failed += len(launch.reqs)
                self._idle.notify_all()
            return None
        try:  # a launch that failed part-way may still run: never lease staging it reads
            launch.inst.wait()
        except BaseException as again:  # noqa: BLE001 - already failing this launch
            if again is exc:
                # the instance raised the same error again, which put this frame (holding
                # the launch, its requests and their futures) into the traceback the futures
                # keep, dropped above: a reference cycle per failed request otherwise
                exc.with_traceback(None)
            del again
        nxt = self._release(launch, None, failed=len(launch.reqs))
        launch.reqs = ()
        return nxt

    def _run_quietly(self, launch) -> None:
        """`_run` on a thread of its own (an interrupted thread's hand-over)."""
        try:
            self.backend.thread_init()
            self._run(launch)
        except BaseException:  # noqa: BLE001 - the launches' futures carry their errors
            log.exception("serve: starting the next launch after an interrupted one failed")

    def _release(self, launch: _Launch, gpu_ms, failed: int = 0) -> _Launch | None:
        """Return the launch's instance (or hand it to the bucket's next queued request:
        returned, to start outside the lock). Updates the counters."""
        b = launch.bucket
        st = b.stats
        inst = launch.inst
        nxt = None
        with self._lock:
            self._running.discard(launch)
            n = len(launch.reqs)
            if failed:
                st.failed += failed
            elif n:
                st.requests += n
                st.launches += 1
                st.rows_served += launch.reqs[0].rows if n == 1 else sum(r.rows
                                                                         for r in launch.reqs)
                if gpu_ms is not None:
                    st.gpu_ms.add(gpu_ms)
            if self._broken is None:
                nxt = self._hand_back(b, inst)
            if self._state != "open":
                self._notify_idle()
        return nxt

    def _hand_back(self, b: _Bucket, inst: Instance):
        """Under the lock: ``inst`` goes to the bucket's next queued request (dispatch
        "caller": the launch returned, to start outside the lock) or back to the free list
        (dispatch "thread": the dispatcher is woken to use it; batching with dispatch
        "caller": the batches at the FIFO's head that may go now are returned, a list for
        `_run`)."""
        if b.queue:  # per-bucket queues: dispatch "caller" without batching
            r = b.queue.popleft()
            self._queued -= 1
            if self._space_waiting:
                self._space.notify()
            nxt = _Launch(inst, b, [r])
            self._running.add(nxt)
            return nxt
        b.free.append(inst)
        if self._fifo:
            if self.dispatch == "thread":
                self._work.notify()
            elif self._batchq:
                return self._form_batches() or None
        return None

    def _break(self, exc: BaseException) -> None:
        """A sticky CUDA error: fail every pending request with it, refuse new work."""
        with self._lock:
            if self._broken is None:
                self._broken = exc
                log.error("serve: sticky CUDA error, the engine is broken: %s", exc)
            queued = list(self._batchq)
            self._batchq.clear()
            self._head_plan = None
            self._batch_rows = 0
            for b in self._buckets.values():
                queued.extend(b.queue)
                b.queue.clear()
            self._queued = 0
            running = list(self._running)
            self._space.notify_all()
            self._work.notify_all()
            self._idle.notify_all()
            self._built.notify_all()
        for r in queued:
            self._fail(r, exc)
        for launch in running:
            if launch.claim():
                for r in launch.reqs:
                    self._fail(r, exc)
                with self._lock:
                    self._running.discard(launch)
                    launch.bucket.stats.failed += len(launch.reqs)
        with self._lock:
            self._idle.notify_all()

    # -- the dispatcher thread (dispatch="thread", batching) -------------------------------------

    def _batcher_loop(self) -> None:
        """The batcher thread (a FIFO: dynamic batching or dispatch "thread"). With dispatch
        "thread" it forms and starts every launch; with dispatch "caller" (batching) the
        threads that queue requests and return instances start full batches themselves and
        this thread is the delay timer: it sleeps until the head's ``max_delay_us`` deadline
        and starts the batch then."""
        thread_mode = self.dispatch == "thread"
        while True:
            todo = None
            try:
                with self._lock:
                    while True:
                        todo = self._form_batches()
                        if todo:
                            break
                        if not self._batchq and self._stopping:
                            self._timer_due = 0
                            return
                        # the head's deadline when it waits for more requests; None (a
                        # notify wakes this thread) when it waits for an instance or a
                        # build, or nothing is queued
                        due = self._head_due or None
                        self._timer_due = due
                        self._work.wait(None if due is None else max(0, due - _now()) / 1e9)
                    self._timer_due = 0
                self._run_todo(todo, build_here=thread_mode)
            except BaseException as exc:  # noqa: BLE001 - never let an error end this thread
                log.exception("serve: dispatch failed")
                self._fail_todo(todo, exc)

    def _fail_todo(self, todo, exc: BaseException) -> None:
        """The batcher's catch-all: fail every request of the launches ``todo`` held that is
        not done yet (the error ended their dispatch)."""
        for item in todo or ():
            if type(item) is _Launch:
                for r in item.reqs:
                    if r.fut is not None and not r.fut.done():
                        self._fail(r, exc)

    def _timer_loop(self) -> None:
        """The batcher thread with a timerfd (dynamic batching, dispatch "caller"): the
        threads that queue requests and return instances start full batches themselves and
        arm the timer for the head's deadline (`_form_batches`); this thread sleeps in the
        timer's read and, when a deadline passed, starts the batch that is due (and arms the
        timer again for the next head)."""
        tfd = self._tfd
        assert tfd is not None  # started only with a timer
        while True:
            todo = None
            try:
                tfd.wait()
                with self._lock:
                    # the expiration is consumed: nothing is armed now (a head armed again
                    # since is armed once more below: harmless)
                    self._armed_due = 0
                    if self._stopping and not self._batchq:
                        return
                    todo = self._form_batches()
                if todo:
                    # an overdue batch whose callers sleep in result() is waited for and
                    # completed here (no completion-thread hop); the next deadline waits at
                    # most one batch (every caller that queues or finishes also starts
                    # overdue batches meanwhile)
                    self._run_watching(todo, build_here=False)
            except BaseException as exc:  # noqa: BLE001 - never let an error end this thread
                log.exception("serve: dispatch failed")
                self._fail_todo(todo, exc)

    # -- building -----------------------------------------------------------------------------

    def _build(self, b: _Bucket, raise_errors: bool = False) -> None:
        """Build bucket ``b``'s instances in this thread (``b.building`` was set by the caller
        under the lock), then start what waits for them."""
        t0 = _now()
        insts: list[Instance] = []
        err = None
        try:
            mem0 = self.backend.graph_memory()
            for k in range(self.instances):
                insts.append(self.backend.create(b.rows, k, self._inputs, self._outputs))
                self._check_staging(insts[-1], b.rows)
            mem1 = self.backend.graph_memory()
        except BaseException as exc:  # noqa: BLE001 - fails the requests waiting for it
            err = exc
            for inst in insts:
                _close_quietly(inst)
            insts = []
        launches = []
        with self._lock:
            b.building = False
            self._building -= 1
            st = b.stats
            if err is None:
                st.builds += 1
                st.build_ms = sum(i.build_ms for i in insts)
                st.instantiate_ms = sum(i.instantiate_ms for i in insts)
                st.graph_bytes = None if mem0 is None or mem1 is None else mem1 - mem0
                st.wall_ms = (_now() - t0) / 1e6
                b.error = None
                b.instances = insts
                b.free = list(insts)
                b.ready = True
                if not self._fifo:
                    while b.free and b.queue and self._broken is None:
                        r = b.queue.popleft()
                        self._queued -= 1
                        launch = _Launch(b.free.pop(), b, [r])
                        self._running.add(launch)
                        launches.append(launch)
                    self._space.notify_all()
                elif self.dispatch == "caller":
                    launches = self._form_batches()
            else:
                b.error = err
                if self._fifo:
                    # the head batch waited for this build: it fails with it (the next batch
                    # for this bucket tries the build again)
                    failed = self._pop_head_batch(b)
                    if self.dispatch == "caller" and not (isinstance(err, CudaError)
                                                          and err.sticky):
                        # nobody else forms batches now (the batcher thread is only the
                        # delay timer): the requests behind it would wait forever. A head
                        # that grew past this bucket while it built goes on another
                        self._head_missed = False
                        launches = self._form_batches()
                else:
                    failed = list(b.queue)
                    b.queue.clear()
                    self._queued -= len(failed)
                st.failed += len(failed)
                self._space.notify_all()
            self._work.notify_all()
            self._built.notify_all()
            if self._state != "open":
                self._notify_idle()
        if err is not None:
            # repr: a MemoryError (or any error raised bare) has an empty str
            log.warning("serve: building the %d-row bucket failed: %r", b.rows, err)
            if isinstance(err, CudaError) and err.sticky:
                self._break(err)
            for r in failed:
                self._fail(r, err)
        # what the build let start (after a failure too: the batches behind a failed head)
        self._run_todo(launches, build_here=False)
        if err is not None and (raise_errors or not isinstance(err, Exception)):
            raise err

    def _check_staging(self, inst: Instance, rows: int) -> None:
        """A backend's instance staging, checked once when it is built: exactly the declared
        inputs and outputs, each a plain (not a subclass), C-contiguous, writable ndarray of
        the declared dtype and shape ``(rows, *row_shape)``. The engine copies requests into
        and out of these arrays without checking each time (a short or strided one would fail
        with numpy's error, or corrupt, at the first request; an undeclared input fails every
        batch's concatenation; a subclass's copies would reach callers as that subclass)."""
        for what, specs, arrays in (("inputs", self._inputs, inst.inputs),
                                    ("outputs", self._outputs, inst.outputs)):
            prefix = f"backend {self.backend.name!r}: the {rows}-row instance's {what}"
            try:
                names = list(arrays)
            except TypeError:
                names = None
            if names is None or not hasattr(arrays, "get"):
                raise ServeConfigTypeError(f"{prefix} must be a mapping of name -> "
                                           f"numpy.ndarray; got {type(arrays).__name__}")
            extra = [n for n in names if n not in specs]
            if extra:
                raise ServeConfigValueError(
                    f"{prefix} has {', '.join(map(repr, extra))}, which the engine does not "
                    f"declare (declared: {list(specs)}): make Backend.create return staging "
                    "for exactly the declared names")
            for name, spec in specs.items():
                a = arrays.get(name)
                where = f"{prefix}[{name!r}]"
                if a is None:
                    raise ServeConfigTypeError(f"{where} is missing (it has {names}): make "
                                               "Backend.create return staging for every "
                                               "declared name")
                if type(a) is not np.ndarray:
                    hint = (" (numpy.asarray(a) is a plain array over the same memory)"
                            if isinstance(a, np.ndarray) else "")
                    raise ServeConfigTypeError(
                        f"{where} must be a numpy.ndarray (plain, not a subclass: its "
                        f"staging); got {type(a).__name__}{hint}")
                want = spec.shape(rows)
                bad = [f"shape {a.shape} (declared {want})" if a.shape != want else "",
                       f"dtype {a.dtype.str} (declared {spec.dtype.str})"
                       if a.dtype != spec.dtype else "",
                       "not C-contiguous" if not a.flags.c_contiguous else "",
                       "read-only" if not a.flags.writeable else ""]
                bad = [x for x in bad if x]
                if bad:
                    raise ServeConfigValueError(f"{where} is {', '.join(bad)}: make Backend.create "
                                                "return staging as the engine declares it")

    def _pop_head_batch(self, b: _Bucket) -> list[_Req]:
        """Under the lock: take the FIFO's head batch if it runs on bucket ``b``."""
        q = self._batchq
        if not q:
            return []
        n, total = (1, q[0].rows) if self.batching is None else self._head_batch()
        if self._bucket_of(total) is not b:
            return []
        reqs = [q.popleft() for _ in range(n)]
        self._head_plan = None
        self._batch_rows -= total
        self._queued -= n
        self._head_missed = False
        return reqs

    def warmup(self, buckets: Sequence[int] | None = None) -> list[dict]:
        """Build every bucket (or the given row counts) now, largest first, so that no request
        pays for a build. Returns per bucket ``{"rows", "instances", "build_ms",
        "instantiate_ms", "graph_bytes", "wall_ms"}`` (sums over the bucket's instances;
        ``graph_bytes``: graph memory in use after minus before, None without a GPU). Raises
        what a build raises (e.g. `CompileError`, `GraphError`); `ServeConfigTypeError` when
        ``buckets`` is not a sequence of row counts, `ServeConfigValueError` for a row count
        that is not one of the engine's buckets."""
        if buckets is not None and (isinstance(buckets, (str, bytes))
                                    or not isinstance(buckets, collections.abc.Iterable)):
            raise ServeConfigTypeError(f"warmup takes a sequence of bucket row counts (e.g. "
                                       f"[{self.buckets.largest}]) or None for every bucket; "
                                       f"got {buckets!r}")
        sizes = sorted(self.buckets.sizes if buckets is None else
                       {self._known_bucket(r) for r in buckets}, reverse=True)
        out = []
        for rows in sizes:
            with self._lock:
                self._check_open()
                b = self._bucket(rows)
                mine = not b.ready and not b.building
                if mine:
                    b.building = True
                    self._building += 1
            if mine:
                self._build(b, raise_errors=True)
            else:
                with self._lock:
                    while b.building:
                        self._built.wait()
                    if b.error is not None and not b.ready:
                        raise b.error
            st = b.stats
            out.append({"rows": rows, "instances": len(b.instances), "build_ms": st.build_ms,
                        "instantiate_ms": st.instantiate_ms, "graph_bytes": st.graph_bytes,
                        "wall_ms": st.wall_ms})
        return out

    def _known_bucket(self, rows: int) -> int:
        if rows not in self.buckets.sizes:
            raise ServeConfigValueError(f"{rows} is not a bucket of this engine "
                                        f"({list(self.buckets)})")
        return rows

    # -- statistics ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """A snapshot: ``{"engine": {...}, "buckets": {rows: {...}}, "latency_us": {...}}``.

        Per bucket: ``requests`` (completed), ``failed``, ``hits`` / ``misses`` (admitted to a
        built bucket / waited for its build), ``launches``, ``requests_per_launch``,
        ``batch_fill`` (request rows / bucket rows launched), ``queue_depth`` / ``queue_high``,
        ``latency_us`` (submit to future done: p50/p95/p99 of the last 65,536), ``gpu_ms``
        (sampled launches), ``build_ms`` / ``instantiate_ms`` / ``graph_bytes``. The engine
        part: state, executor, dispatch, batching, queue, in flight, bad / overloaded /
        cancelled request counts, the sticky error if broken."""
        with self._lock:
            buckets = {rows: b.stats.as_dict(len(b.queue), len(b.instances), len(b.free))
                       for rows, b in sorted(self._buckets.items())}
            lat = [b.stats.latency_us.values() for b in self._buckets.values()]
            all_lat = np.concatenate(lat) if lat else np.empty(0)
            eng = {
                "state": "broken" if self._broken is not None else self._state,
                "executor": self.executor,
                "dispatch": self.dispatch,
                "batching": None if self.batching is None else {
                    "max_batch": self._max_batch,
                    "max_delay_us": self.batching.max_delay_us},
                "buckets": list(self.buckets),
                "instances_per_bucket": self.instances,
                "queue_limit": self.queue_limit,
                "queued": self._queued,
                "in_flight": len(self._running) + self._inline,
                "bad_requests": self._bad,
                "overloaded": self._overloaded,
                "cancelled": self._cancelled,
                "broken_by": None if self._broken is None else str(self._broken),
            }
        return {"engine": eng, "buckets": buckets, "latency_us": percentiles(all_lat)}

    def stats_json(self, **kw) -> str:
        """`stats` as JSON text (``json.dumps`` keywords pass through)."""
        return json.dumps(self.stats(), **kw)

    # -- shutdown -------------------------------------------------------------------------------

    def close(self, cancel: bool = False) -> None:
        """Stop taking work, finish (or with ``cancel=True`` cancel) what is queued, wait for
        what runs, join the engine's threads and release every instance (execs, pinned
        staging, events, device buffers) and the backend. Idempotent; ``with`` calls it.

        Queued requests that are cancelled get cancelled futures; running ones always complete
        (GPU work cannot be taken back). A broken engine fails everything and releases what the
        dead context allows."""
        if threading.current_thread() in self._threads:
            raise CallOrderError("Engine.close() called from an engine thread (a future's "
                               "done-callback); close it from another thread")
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closing"
            dropped = []
            if cancel:
                dropped = list(self._batchq)
                self._batchq.clear()
                self._head_plan = None
                self._batch_rows = 0
                for b in self._buckets.values():
                    dropped.extend(b.queue)
                    b.queue.clear()
                self._queued = 0
                self._cancelled += len(dropped)
                self._cancel_all = True
            self._space.notify_all()
            self._work.notify_all()
            bridge = self._aio_q
            # partial batches waiting for their delay go now (drain), not at their deadline
            flush = (self._form_batches() if self._fifo and self.dispatch == "caller"
                     and not cancel else [])
        if flush:
            self._run_todo(flush, build_here=False)
        for r in dropped:
            if r.group is None:
                if not r.fut.cancel():
                    _set_exception(r.fut, EngineClosed("the engine closed with cancel=True"))
            else:
                g = r.group
                if not g.fut.cancel():
                    self._fail(r, EngineClosed("the engine closed with cancel=True"))
        if bridge is not None:  # it admits (or cancels) what run() handed over, then stops
            bridge.put(_STOP)
            for t in self._threads:
                if t.name == "orchestra-serve-asyncio":
                    t.join()
            with self._bridge_lock:  # from here run() refuses instead of handing over
                self._bridge_closed = True
            while True:  # handed over while the bridge was stopping: refused
                try:
                    reqs = bridge.get_nowait()
                except queue.Empty:
                    break
                if reqs is not _STOP:
                    for r in reqs:
                        self._fail(r, EngineClosed("the engine closed before the request "
                                                   "was admitted"))
        self._drain()
        self._stopping = True
        with self._lock:
            self._work.notify_all()
            if self._tfd is not None:
                self._tfd.arm(1)  # the timer thread wakes, sees _stopping and ends
        for _ in range(sum(1 for t in self._threads if "completion" in t.name)):
            self._cq.put(_STOP)
        for t in self._threads:
            t.join()
        if self._tfd is not None:
            self._tfd.close()
        with self._lock:
            insts = [i for b in self._buckets.values() for i in b.instances]
            for b in self._buckets.values():
                b.instances, b.free = [], []
                b.ready = False
            self._state = "closed"
        for inst in insts:
            _close_quietly(inst)
        _close_quietly(self.backend)

    def _drain(self) -> None:
        """Wait until nothing is queued, building or running. Launches nobody completes (a
        caller's wait interrupted) are completed here after a quiet period."""
        while True:
            with self._lock:
                if self._broken is not None and not self._building:
                    return
                if not (self._queued or self._running or self._building or self._inline):
                    return
                progressed = self._idle.wait(0.2)
                stuck = [] if progressed else [x for x in self._running
                                               if x.started and not x.done]
            for launch in stuck:
                try:
                    launch.inst.wait()  # not the event: a blocking call's launch records none
                except BaseException as exc:  # noqa: BLE001
                    self._run(self._launch_failed(launch, exc))
                    continue
                self._finish(launch)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "broken" if self._broken is not None else self._state
        return (f"<Engine {self.executor} {state}: buckets {list(self.buckets)}, "
                f"{self.instances} instances each, dispatch={self.dispatch}>")


def _drop_engine_frames(exc: BaseException) -> None:
    """Detach a failed launch's error from the frames it was raised through, keeping where
    it arose as a note (``traceback.format_tb``; shown when the error is printed). Those
    frames, and through ``f_back`` every engine frame below them, hold the launch, its
    requests and their futures, and each future keeps the error: a reference cycle per
    failed request, freed only by the cyclic collector. Idempotent: an error failing several
    launches (a sticky one) gets one note. Never raises: the error's own type may refuse
    attributes (a ``__setattr__`` that raises, ``__notes__`` that is not a list), and an
    error here would leave the launch's instance leased and its requests waiting forever."""
    tb = exc.__traceback__
    if tb is None:
        return
    # with_traceback sets the slot directly (a type's own __setattr__ is not called)
    exc.with_traceback(None)
    notes = getattr(exc, "__notes__", None)
    # the note itself marks the error as noted: an attribute of our own would be refused by
    # types that take no new attributes, and give them one note per failed launch
    if not (isinstance(notes, list) and any(type(n) is str and n.startswith(_RAISED_AT)
                                            for n in notes)):
        try:
            exc.add_note(_RAISED_AT + "".join(traceback.format_tb(tb)).rstrip())
        except Exception:  # noqa: BLE001 - the type refuses notes: the error goes without
            log.debug("serve: %s takes no note of where it arose", type(exc).__name__)
    del tb


def _close_quietly(obj) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - a dead context refuses releases; keep closing the rest
        log.debug("serve: closing %r failed", obj, exc_info=True)


# -- the asyncio bridge's delivery to event loops ------------------------------------------

# how long one drain of a loop's inbox may resolve awaited futures before it lets the loop's
# timers and I/O run and goes on in a later iteration (resolving one takes well under a
# microsecond: the bound matters when the drain is slowed, by a thread holding the GIL or a
# collection, and caps what one burst costs the loop beside completions_per_turn)
TURN_BUDGET_NS = 250_000


class _Slots:
    """One event loop's requests in flight, at most ``size`` (`Engine.run`'s
    ``queue_limit``): what `asyncio.Semaphore` does for it, with `take` for the common case
    (a free slot: one comparison, no coroutine; ``Semaphore.locked`` costs a generator per
    call). ``_value``: the free slots. Tasks that await a slot get it in arrival order.

    Thread-safety: the loop's thread only (as `asyncio.Semaphore`).
    """

    __slots__ = ("_value", "size", "_waiters")

    def __init__(self, size: int):
        self._value = size
        self.size = size
        self._waiters: collections.deque | None = None  # futures of tasks awaiting a slot

    def locked(self) -> bool:
        return self._value == 0

    def idle(self) -> bool:
        """Nothing in flight."""
        return self._value == self.size

    def take(self) -> bool:
        """Take a free slot now (True); False when none is free or tasks await one (they
        come first)."""
        if self._value and not self._waiters:
            self._value -= 1
            return True
        return False

    async def acquire(self) -> bool:
        """Await a slot (behind the tasks already awaiting one)."""
        if self.take():
            return True
        fut = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = collections.deque()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot, then cancelled: the next task gets it
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise
        return True

    def release(self) -> None:
        """Give a slot back: to the first task awaiting one, else to the free count."""
        w = self._waiters
        while w:
            fut = w.popleft()
            if not fut.done():
                fut.set_result(True)
                return
        self._value += 1


class _EventFd:
    """A non-blocking ``eventfd(2)`` written and read through ``ctypes.PyDLL``: the system call
    (about a microsecond) keeps the GIL. Released around it (``os.eventfd_read``), another
    thread could take the GIL, and the loop's thread would wait to get it back: up to a
    switch interval of lag per wake-up.

    Thread-safety: `write` from any thread while open (the inbox serializes it with `close`
    under its lock); `read` on the loop's thread; `close` once.
    """

    __slots__ = ("fd", "_buf", "_one", "_bufp", "_onep", "__weakref__")
    _read: Any = None  # libc's read and write through PyDLL, made once
    _write: Any = None

    def __init__(self):
        if _EventFd._read is None:
            libc = ctypes.PyDLL(None)
            for name in ("read", "write"):
                fn = getattr(libc, name)
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
                fn.restype = ctypes.c_ssize_t
                setattr(_EventFd, "_" + name, fn)
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._buf = ctypes.c_uint64(0)
        self._one = ctypes.c_uint64(1)
        self._bufp = ctypes.addressof(self._buf)
        self._onep = ctypes.addressof(self._one)

    def write(self) -> None:
        """Make the fd readable (adds one to its counter)."""
        _EventFd._write(self.fd, self._onep, 8)

    def read(self) -> None:
        """Reset the counter: the fd is not readable until the next `write` (nothing to read
        is EAGAIN, ignored)."""
        _EventFd._read(self.fd, self._bufp, 8)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _eventfd() -> _EventFd | None:
    """A new `_EventFd`, or None where there is none (not Linux, no libc, no fd left)."""
    if not hasattr(os, "eventfd"):
        return None
    try:
        return _EventFd()
    except (OSError, AttributeError):
        return None


def _loop_error(exc: BaseException) -> BaseException:
    """What the awaiting task gets for a request that raised ``exc``: ``exc`` itself, but
    for a ``StopIteration``, which asyncio refuses in a future (it would end the task's
    coroutine as a return): a ``TypeError`` that says so, ``exc`` as its cause. Made here, not
    caught from asyncio: a caught error's traceback would keep the drain's frame alive."""
    if isinstance(exc, StopIteration):
        err = StopIterationRaised(f"the request raised {type(exc).__name__}, which asyncio "
                                  "cannot raise into the awaiting task; raise another exception "
                                  "from the launch")
        err.__cause__ = exc
        return err
    return exc


class _LoopInbox:
    """The completions of one event loop's requests, delivered in bounded chunks.

    Any thread that completes a request appends its future (`push`, the future's
    done-callback); only the push that finds no delivery pending wakes the loop, however many
    complete: one write to the inbox's ``eventfd``, which the loop watches (``add_reader``;
    its callback reads the fd and drains), or, where the loop cannot watch one (not Linux, a
    loop without ``add_reader``, ``wake_fd=False``), one ``call_soon_threadsafe``. The
    eventfd spares the loop what ``call_soon_threadsafe`` costs it per wake-up: a handle, and
    a callback that reads the loop's self-pipe (two ``recv`` calls, each releasing the GIL,
    the loop's thread then waiting to get it back while the engine's threads hold it).

    On the loop, `drain` resolves the awaited ``asyncio.Future`` objects in the order their
    requests completed (``set_result`` / ``set_exception``; one whose task was cancelled
    meanwhile is skipped), each task then resuming in the loop's next iteration as after
    any future. It stops after ``per_turn`` of them, or once `TURN_BUDGET_NS` passed, and
    when more wait it goes on with ``call_later(0)``: in the next loop iteration, after the
    timers and I/O that came due meanwhile. So one iteration resumes at most ``per_turn``
    awaiting tasks, however many requests completed at once. ``sem`` bounds the loop's
    requests in flight (`Engine.run`: a `_Slots`).

    `retire` (the bridge thread, when the engine closes): once nothing is in flight, the
    loop stops watching the eventfd and it is closed.

    Thread-safety: `push` and `retire` from any thread; `drain` on the loop's thread only.
    """

    __slots__ = ("_loop", "sem", "per_turn", "items", "lock", "scheduled", "callbacks",
                 "_fd", "_pending", "retired", "__weakref__")

    def __init__(self, loop, sem, per_turn: int, wake_fd: bool = False):
        # weak: the engine's WeakKeyDictionary of inboxes must not keep its loops alive
        self._loop = weakref.ref(loop)
        self.callbacks = [self.push]  # every request's done-callbacks (`Engine.run`)
        # the list and its bound method are a cycle (inbox -> list -> method -> inbox): it
        # is broken when the loop goes, so the inbox is freed then by reference counting
        weakref.finalize(loop, self.callbacks.clear)
        self.sem = sem
        self.per_turn = per_turn
        self.items: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False  # a delivery is pending on the loop (set and cleared under lock)
        self._pending = False  # a drain is scheduled with call_later (loop thread only)
        self.retired = False
        self._fd: _EventFd | None = None
        if wake_fd:
            fd = _eventfd()
            if fd is not None:
                try:
                    loop.add_reader(fd.fd, self._woken)
                except (NotImplementedError, AttributeError, RuntimeError, OSError):
                    fd.close()  # e.g. asyncio's Proactor loop: call_soon_threadsafe instead
                else:
                    # closed with the inbox where the engine never closed (or the loop closed
                    # with requests in flight): nobody can write to it any more then
                    weakref.finalize(self, fd.close)
                    self._fd = fd

    @property
    def loop(self):
        """The event loop (None once it is gone)."""
        return self._loop()

    def push(self, fut) -> None:
        self.items.append(fut)
        with self.lock:
            if self.scheduled:
                return
            self.scheduled = True
            fd = self._fd
            if fd is not None:
                fd.write()  # under the lock: `_detach` closes it under the lock
                return
        loop = self._loop()
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # "Event loop is closed": nobody is left to tell (dropped)
            pass

    def retire(self) -> None:
        """The engine closes: give the eventfd back once nothing is in flight (the loop is
        woken to look; an inbox without an eventfd holds nothing to give back)."""
        self.retired = True
        with self.lock:
            fd = self._fd
            if fd is not None:
                fd.write()

    def _woken(self) -> None:
        """The eventfd's reader callback: a wake-up from `push` (or `retire`)."""
        fd = self._fd
        if fd is not None:
            fd.read()
        if self._pending:
            return  # `retire`'s wake-up while a drain is scheduled anyway
        self.drain()

    def drain(self) -> None:
        self._pending = False
        deadline = _now() + TURN_BUDGET_NS
        items = self.items
        release = self.sem.release
        left = self.per_turn
        try:
            while left:
                try:
                    fut = items.popleft()
                except IndexError:
                    break
                left -= 1
                release()
                aio = fut._aio
                fut._aio = None
                if aio.done():  # its task was cancelled: nobody awaits the result
                    continue
                if fut.cancelled():
                    aio.cancel()
                elif fut._exception is not None:
                    aio.set_exception(_loop_error(fut._exception))
                else:
                    aio.set_result(fut._result)
                if _now() >= deadline:
                    break
        finally:  # also when a signal's exception (KeyboardInterrupt) raised through here
            self._drained()

    def _drained(self) -> None:
        """After a drain: the delivery is over when the inbox is empty; else another drain
        goes on in the next loop iteration."""
        items = self.items
        if not items:
            with self.lock:
                if not items:
                    self.scheduled = False
                    if self.retired and self._fd is not None and self.sem.idle():
                        self._detach()
                    return
        loop = self._loop()
        if loop is not None:
            self._pending = True
            loop.call_later(0, self.drain)

    def _detach(self) -> None:
        """Under the lock, on the loop's thread: stop watching the eventfd and close it; a
        later wake-up (none is expected: nothing is in flight and run() refuses) goes through
        ``call_soon_threadsafe``."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        loop = self._loop()
        if loop is not None and not loop.is_closed():
            loop.remove_reader(fd.fd)
        fd.close()


__all__ = ["Batching", "Engine", "ServeFuture"]

"""`ProcessEngine`: an `Engine` in a process of its own, for servers whose own threads (an
asyncio event loop above all) must not share a GIL with the engine's.

In one process, every thread that runs Python takes turns on one GIL: the engine's completion,
dispatch and bridge threads hold it while they copy and launch, and an event loop that wants it
back waits for them (the loop's lag; docs/serving.md measures it). `ProcessEngine` starts the
engine in a child process (``multiprocessing``'s ``spawn``: a fresh interpreter, no CUDA
state inherited) and keeps only this in the client process:

- **shared memory** of ``slots`` slots (`orchestra.serve.wire.SlotLayout`), each with room for
  one request's inputs and outputs of up to ``max_rows`` rows. A request's inputs are copied
  into a free slot; the engine process submits the slot's views (``out=`` its output views),
  its instances copy them through their pinned staging (``zero_copy=True``: the shared memory
  is page-locked and read in place); the client copies the outputs out into arrays the caller
  owns and the slot is free again. ``slots`` bounds the requests in flight.
- **two pipes** of 16-byte records: ``(request id, slot, rows)`` to the engine process,
  ``(request id, slot, error bytes)`` back (a failed request's exception travels pickled: a
  `BadRequest` or `CudaError` arrives as itself). No pickling on the way of a request.
- **completions** read either by one reader thread (default) or, with ``loop=``, by that event
  loop itself (``loop.add_reader`` on the response pipe): then nothing else in the client
  process runs Python for the engine, and the loop resolves at most ``completions_per_turn``
  requests per iteration.

Control calls (`warmup`, `stats`, `close`) travel pickled over a third connection.

Costs against an in-process `Engine` (measured in docs/serving.md): each request's copies into
and out of its slot run on the client's threads (on the loop with ``loop=``), a pipe write and
a wake-up of the other process per request, a process start (seconds: an interpreter,
orchestra, the CUDA context), and the engine's statistics only by a control call. For an
asyncio server it measured faster and with a lower maximum lag; for threads, slower.

Spawn rules apply: the factory and its arguments are pickled (a module-level function, not a
lambda), and a script that makes a `ProcessEngine` needs ``if __name__ == "__main__":`` (the
child imports the parent's main module).
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import concurrent.futures
import itertools
import json
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from orchestra.errors import CallOrderError, CudaError, OrchestraError
from orchestra.serve import process_child, wire
from orchestra.serve.admission import AdmissionSettings
from orchestra.serve.errors import (
    BadRequest,
    EngineBroken,
    EngineClosed,
    EngineProcessError,
    Overloaded,
    RequestTooLarge,
    ServeConfigTypeError,
    ServeConfigValueError,
    check_timeout,
)
from orchestra.serve.buckets import positive_count
from orchestra.serve.future import ServeFuture
from orchestra.serve.tensors import check_inputs, check_out, tensor_specs

log = logging.getLogger(__name__)
_now = time.perf_counter_ns
_running_loop = asyncio._get_running_loop  # None off a loop: no exception to catch
#: a drain of completions on the event loop (``loop=``) stops after this many ns
TURN_BUDGET_NS = 250_000
#: latency samples kept for `ProcessEngine.stats` (the most recent)
LATENCY_SAMPLES = 100_000


class _Entry:
    """One request in flight: its future (concurrent, or asyncio with ``loop``), ``out=``
    arrays, submit time (ns), slot and rows."""

    __slots__ = ("fut", "loop", "out", "t0", "slot", "rows")

    def __init__(self, fut, loop, out, t0: int, slot: int, rows: int):
        self.fut = fut
        self.loop = loop
        self.out = out
        self.t0 = t0
        self.slot = slot
        self.rows = rows


def _set_aio(fut, result, exc) -> None:
    """On the future's loop: complete it unless its task was cancelled meanwhile."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class ProcessEngine(AdmissionSettings):
    """An `Engine` made by ``factory(*args, **kwargs)`` in a child process, served through
    shared memory (see the module doc).

    Args:
        factory: a picklable callable (a module-level function or a ``functools.partial`` of
            one) that returns the `Engine`, called in the child process.
        args, kwargs: its arguments (picklable).
        slots: requests in flight at once (1..4096, default 64): the shared memory holds this
            many requests' inputs and outputs. Give the engine a ``queue_limit`` of at least
            this many.
        max_rows: the most rows of one request (default: the engine's largest bucket; above
            it with an engine made with ``split=True``). A slot's size follows from it.
        on_full: ``"block"`` (default: `submit` waits up to ``submit_timeout`` seconds for a
            free slot, None: forever, then raises `Overloaded`; `run` awaits one) or
            ``"raise"`` (`Overloaded` at once). ``on_full`` and ``submit_timeout`` may be set
            later too (checked as here); the other settings are fixed.
        start_timeout: seconds the child may take to make the engine (default 120: a cold
            compile cache compiles the kernels there).
        loop: an asyncio event loop (Unix selector loops, uvloop) that reads the completions
            itself (``add_reader``): no client thread runs for the engine. Blocking calls
            (`__call__`, a future's ``result()``) must then not run on that loop's thread:
            only the loop can deliver their answer (`CallOrderError`). Default None: a
            reader thread.
        completions_per_turn: with ``loop=``: requests resolved per loop iteration at most
            (default 4; a drain also stops after 0.25 ms). Here the loop itself copies each
            output out of its slot and resumes the awaiting task, so a request costs the loop
            some 50-80 µs: from 1,000 tasks, 16 per iteration measured a lag maximum of
            2.0-3.2 ms and 4 one of 0.9-2.0 ms in the same runs, for 0-5% fewer requests per
            second (on another machine start 4 gave 1.2-3.6 ms, once 9.7 ms with the loop
            saturated: a 1 ms bound is not kept on every run; H200 host,
            benchmarks/RESULTS.md, 2026-12-03). An in-process `Engine`
            keeps 16: its loop does less per request.
        zero_copy: True: the engine process page-locks the shared memory and submits the
            slots with ``pinned=True``, so a request that fills its bucket is read in place (a
            rebinding of the instance's graph per request). Default False: its instances copy
            each request into their own pinned staging, as for an in-process `Engine`, which
            measured faster for 64 KiB requests (H200 host: 10,957 against 6,314 req/s from
            1,000 asyncio tasks; docs/serving.md).
        restarts: how many times a new engine process may replace one that died or whose
            engine a sticky CUDA error broke (default 0: the `ProcessEngine` is broken then).
            The requests in flight fail with `EngineProcessError`; while the new process
            starts, new requests are refused with `Overloaded` (retry them).

    Raises `ServeConfigTypeError` / `ServeConfigValueError` for bad arguments (before any
    process starts), what the factory raised (its type, with a note), or
    `EngineProcessError` when the child did not start in time or died starting.

    Thread-safety: every public method may be called from any thread at once (and `run` from
    any event loop), except blocking calls on the ``loop=`` thread (see above). Futures are
    completed on the reader thread (or the loop): keep their callbacks short.
    """

    def __init__(self, factory: Callable, args: tuple = (), kwargs: dict | None = None, *,
                 slots: int = 64, max_rows: int | None = None, on_full: str = "block",
                 submit_timeout: float | None = None, start_timeout: float = 120.0,
                 loop: asyncio.AbstractEventLoop | None = None,
                 completions_per_turn: int = 4, zero_copy: bool = False, restarts: int = 0):
        # every argument checked before dict() / tuple() / int() could raise a builtin error
        if kwargs is not None and not isinstance(kwargs, collections.abc.Mapping):
            raise ServeConfigTypeError(f"kwargs must be a mapping (the factory's keyword "
                                       f"arguments) or None; got {type(kwargs).__name__}")
        if not isinstance(args, (tuple, list)):
            raise ServeConfigTypeError(f"args must be a tuple (the factory's positional "
                                       f"arguments); got {type(args).__name__}")
        kwargs = dict(kwargs or {})
        if not callable(factory):
            raise ServeConfigTypeError(f"factory must be callable (it makes the Engine in the "
                                       f"child process); got {type(factory).__name__}")
        try:
            pickle.dumps((factory, tuple(args), kwargs))
        except Exception as exc:  # noqa: BLE001 - any pickling failure says the same
            raise ServeConfigTypeError(
                f"the factory and its arguments must be picklable: the engine process starts "
                f"with multiprocessing's spawn ({type(exc).__name__}: {exc}); use a "
                f"module-level function (or functools.partial of one), not a lambda or a "
                f"closure") from exc
        self._init_admission(on_full, submit_timeout)
        slots = positive_count("slots", slots)
        if slots > wire.MAX_SLOTS:
            raise ServeConfigValueError(f"slots must be 1..{wire.MAX_SLOTS}; got {slots}")
        if max_rows is not None:
            max_rows = positive_count("max_rows", max_rows)
        if not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
            raise ServeConfigValueError(f"start_timeout must be > 0 seconds; got "
                                        f"{start_timeout}")
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ServeConfigValueError(f"restarts must be an int >= 0; got {restarts!r}")
        completions_per_turn = positive_count("completions_per_turn", completions_per_turn)
        if loop is not None and not isinstance(loop, asyncio.AbstractEventLoop):
            raise ServeConfigTypeError(f"loop must be an asyncio event loop or None; got "
                                       f"{type(loop).__name__}")
        if loop is not None and loop.is_closed():
            raise ServeConfigValueError("loop is closed")
        self.zero_copy = bool(zero_copy)
        self.completions_per_turn = completions_per_turn
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._space_waiting = 0
        self._aio_waiting: collections.deque = collections.deque()  # (loop, future) for a slot
        # {future: its loop}: waiters of other loops woken (`_wake` sent) but not yet run; the
        # free slots they will take stay in the pool meanwhile
        self._waking: dict = {}
        self._ctl_lock = threading.Lock()
        self._pending: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._state = "starting"  # starting | open | restarting | closing | closed
        self._closed_event = threading.Event()
        self._restart_idle = threading.Event()  # set while no restart runs
        self._restart_idle.set()
        self._broken: EngineProcessError | None = None
        self._latency: collections.deque = collections.deque(maxlen=LATENCY_SAMPLES)
        self._counts = {"requests": 0, "failed": 0, "bad": 0, "overloaded": 0, "cancelled": 0,
                        "restarts": 0}
        self.restarts = restarts
        self._restart_cause: BaseException | None = None
        self._loop: Any = loop  # None, or the event loop that reads the completions
        self._shm: Any = None
        self._final_stats: dict | None = None
        self._spawn_args = (factory, tuple(args), kwargs)
        self._start_timeout = start_timeout
        # the engine process of now (a restart replaces it) and, for the finalizer, the list
        # that holds it; a forgotten engine (the loop's reader holds it weakly, as the reader
        # thread does): the loop stops reading, its process's connections close (the child
        # sees its control connection end, cancels and exits), the child is waited for, the
        # shared memory unlinked
        child = _ChildProc(*self._spawn_args)
        self._child = child
        self._children = [child]
        self._shms: list = []
        self._finalizer = weakref.finalize(self, _abandon, self._children, self._shms, loop)
        try:
            self._start(child, max_rows, slots, start_timeout)
        except BaseException:
            self._end()
            raise
        self._state = "open"
        try:
            self._read_from(child)
        except BaseException:
            self.close(cancel=True)
            raise

    def _read_from(self, child: _ChildProc) -> None:
        """Start reading ``child``'s responses: on the event loop (``loop=``) or a thread."""
        if self._loop is None:
            self._start_reader_thread(child)
        else:
            self._watch_on_loop(child)

    # -- start ------------------------------------------------------------------------------

    def _start(self, child: _ChildProc, max_rows: int | None, slots: int,
               timeout: float) -> None:
        desc = child.recv(timeout, "while the factory made the engine")
        self._desc = desc
        self._inputs = tensor_specs(desc["inputs"], "inputs")
        self._outputs = tensor_specs(desc["outputs"], "outputs")
        self.largest = int(desc["largest"])
        self.executor = desc["executor"]
        self.pid = int(desc["pid"])
        if max_rows is None:
            max_rows = self.largest
        elif max_rows > self.largest and not desc["split"]:
            raise ServeConfigValueError(
                f"max_rows {max_rows} is above the engine's largest bucket ({self.largest} "
                f"rows) and the engine does not split requests (make it with split=True)")
        self.max_rows = max_rows
        layout = wire.slot_layout(self._inputs, self._outputs, self.max_rows, slots)
        from multiprocessing import shared_memory

        _check_shm_space(layout.nbytes)
        shm = shared_memory.SharedMemory(create=True, size=layout.nbytes)
        self._shm = shm
        self._shms.append(shm)
        # every page touched now, not by the first request that uses it (a page fault per
        # 4 KiB on the way of a request, in both processes)
        np.ndarray((layout.nbytes,), np.uint8, buffer=shm.buf).fill(0)
        self.layout = layout
        self.slots = slots
        self._attach(child, timeout)
        self._in_views = [layout.views(shm.buf, s, "inputs") for s in range(slots)]
        self._out_views = [layout.views(shm.buf, s, "outputs") for s in range(slots)]
        self._free = list(range(slots - 1, -1, -1))
        self._single_out = next(iter(self._outputs)) if len(self._outputs) == 1 else None

    def _attach(self, child: _ChildProc, timeout: float) -> None:
        child.ctl.send(("attach", self._shm.name, self.layout, self.zero_copy))
        self.pinned = bool(child.recv(timeout, "while it attached the shared memory"))

    # -- describing -------------------------------------------------------------------------

    @property
    def inputs(self) -> dict:
        """``{name: TensorSpec}`` of a request's inputs (the engine's)."""
        return dict(self._inputs)

    @property
    def outputs(self) -> dict:
        return dict(self._outputs)

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    @property
    def broken(self) -> EngineProcessError | None:
        """The `EngineProcessError` of an engine process that exited while serving (with no
        restart left, or whose restart failed), or None."""
        return self._broken

    # -- submitting -------------------------------------------------------------------------

    def _check(self, inputs, out):
        arrays, rows = check_inputs(self._inputs, inputs)
        if rows < 1:
            raise BadRequest("a request has at least one row (axis 0 is empty)")
        if rows > self.max_rows:
            raise RequestTooLarge(rows, self.max_rows, "" if self.max_rows == self.largest else
                                  f"this ProcessEngine's slots hold {self.max_rows} rows: "
                                  f"its max_rows")
        outs = check_out(self._outputs, out, rows) if out is not None else None
        return arrays, rows, outs

    def _count(self, what: str) -> None:
        # under the lock: the threads and loops that count at once lose no update (a
        # read-modify-write of the dict is not atomic)
        with self._lock:
            self._counts[what] += 1

    def _check_open(self) -> None:
        """Under the lock: raise unless new requests may start."""
        if self._broken is not None:
            raise self._broken
        if self._state != "open":
            if self._state == "restarting":
                self._counts["overloaded"] += 1
                raise Overloaded(f"the engine process is being restarted (after: "
                                 f"{self._restart_cause}); retry in a few seconds")
            raise EngineClosed("the ProcessEngine is closing or closed")

    def _full(self) -> Overloaded:
        """Under the lock: the `Overloaded` of an ``on_full="raise"`` request finding no slot
        (counted)."""
        self._counts["overloaded"] += 1
        return Overloaded(f"all {self.slots} slots of the ProcessEngine are in flight; retry "
                          f"later, or make it with more slots")

    def _take_slot(self, timeout) -> int:
        with self._lock:
            self._check_open()
            if self._free and not self._aio_waiting:
                return self._free.pop()
            if not self._block:
                raise self._full()
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._free:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._counts["overloaded"] += 1
                    raise Overloaded(f"no slot of the ProcessEngine came free within "
                                     f"{timeout:g} s ({self.slots} in flight)")
                self._space_waiting += 1
                try:
                    self._space.wait(left)
                finally:
                    self._space_waiting -= 1
                self._check_open()
            return self._free.pop()

    def _send(self, arrays: dict, entry: _Entry) -> None:
        """Copy the inputs into the entry's slot and write its request record; on failure the
        slot is free again and the error raised."""
        slot, rows = entry.slot, entry.rows
        try:
            in_views = self._in_views
            if not in_views:  # close() ran to its end since this request took its slot
                raise EngineClosed("the ProcessEngine is closing or closed")
            views = in_views[slot]
            for name, a in arrays.items():
                views[name][:rows] = a
            rid = next(self._ids)
            with self._lock:
                self._check_open()
                self._pending[rid] = entry
                try:
                    os.write(self._child.req_fd, wire.REQUEST.pack(rid, slot, rows))
                except OSError:  # the child is gone: the reader reports how
                    del self._pending[rid]
                    raise self._gone_error() from None
                self._counts["requests"] += 1
        except BaseException:
            self._release(slot)
            raise

    def submit(self, inputs, *, out=None, timeout: Any = ...) -> concurrent.futures.Future:
        """Submit one request; returns a `ServeFuture` (a `concurrent.futures.Future`) of its
        outputs (one array for a one-output engine, else ``{name: array}``, arrays the caller
        owns).

        ``inputs``: as `Engine.submit` (numpy arrays or host tensors, C-contiguous, the
        declared dtype, ``(rows, *row_shape)``, at most ``max_rows`` rows); copied into a slot
        before this returns, so the caller may change them at once. ``out``: arrays to copy
        the outputs into instead. ``timeout``: seconds to wait for a free slot with
        ``on_full="block"`` (default ``submit_timeout``; None or ``inf``: no limit).

        A bad request returns a future already failed with `BadRequest` / `InputTypeError` /
        `RequestTooLarge`; nothing is sent. Raises `Overloaded`, `EngineClosed`,
        `EngineProcessError`; `ServeConfigTypeError` / `ServeConfigValueError` for a
        ``timeout`` that is not a number, a bool, NaN or negative (as `Engine.submit`). A
        submitted request runs to the end (``cancel()`` returns
        False)."""
        t0 = _now()
        if timeout is not ...:
            timeout = check_timeout(timeout, "timeout")
        try:
            arrays, rows, outs = self._check(inputs, out)
        except OrchestraError as exc:
            self._count("bad")
            fut = ServeFuture()
            fut.set_exception(exc)
            return fut
        slot = self._take_slot(self._submit_timeout if timeout is ... else timeout)
        fut = ServeFuture()
        fut.set_running_or_notify_cancel()
        self._send(arrays, _Entry(fut, None, outs, t0, slot, rows))
        return fut

    def __call__(self, inputs, *, out=None):
        """Run one request and wait for its outputs in this thread; raises what `submit` and
        the request raise. Not on the ``loop=`` thread (`CallOrderError`)."""
        self._not_on_own_loop("engine(x)")
        fut = self.submit(inputs, out=out)
        return fut.result()

    def _not_on_own_loop(self, what: str) -> None:
        if self._loop is not None and _running_loop() is self._loop:
            raise CallOrderError(f"{what} blocks, and this ProcessEngine's completions are "
                                 f"read by the event loop it would block; use await "
                                 f"engine.run(x) there")

    async def run(self, inputs, *, out=None):
        """``await engine.run(x)``: the outputs, on the caller's event loop (any loop, any
        number of tasks). Only checks, a copy into a slot and a pipe write run on the loop;
        with ``on_full="block"`` a request that finds no free slot awaits one. Cancelling the
        awaiting task drops the result (the request itself runs to the end). Raises what
        `submit` and its future raise."""
        loop = asyncio.get_running_loop()
        t0 = _now()
        try:
            arrays, rows, outs = self._check(inputs, out)
        except OrchestraError:
            self._count("bad")
            raise
        stranded = False
        with self._lock:
            self._check_open()
            slot = self._free.pop() if self._free and not self._aio_waiting else None
            if slot is None:
                if not self._block:
                    raise self._full()
                wait = loop.create_future()
                self._aio_waiting.append((loop, wait))
                # free slots but a queue: a wake-up that a closed loop will never run left a
                # slot spare: the queue moves on now, not at the next release
                stranded = bool(self._free) and self._spare() > 0
        if slot is None:
            if stranded:
                self._release(None)
            try:
                slot = await wait
            except asyncio.CancelledError:
                if wait.done() and not wait.cancelled() and wait.exception() is None:
                    self._release(wait.result())  # handed a slot as it was cancelled
                raise
        fut = loop.create_future()
        self._send(arrays, _Entry(fut, loop, outs, t0, slot, rows))
        try:
            return await fut
        except asyncio.CancelledError:
            self._count("cancelled")
            raise

    # -- slots ------------------------------------------------------------------------------

    def _release(self, slot: int | None) -> None:
        """``slot`` is free (None: only look for a free slot no woken request is on its way
        to take): back to the pool, and the first asyncio request awaiting a slot is handed
        one at once when it awaits on this thread's running loop, else woken on its own loop
        to take one there (`_wake`). With no asyncio request waiting, a thread waiting in
        `submit` is woken.

        The slot stays in the pool until the woken request takes it: a loop that stops or
        closes before it runs the wake-up loses no slot (it went with the slot before), and
        a request that comes meanwhile may take it (the woken one then queues again first).
        """
        here = _running_loop()
        while True:
            with self._lock:
                if slot is not None:
                    self._free.append(slot)
                    slot = None
                target = None
                while self._aio_waiting and self._spare() > 0:
                    loop, wait = self._aio_waiting.popleft()
                    if wait.done():  # its task was cancelled
                        continue
                    if loop is here:
                        wait.set_result(self._free.pop())
                        continue
                    self._waking[wait] = loop
                    target = (loop, wait)
                    break
                else:
                    if not self._aio_waiting and self._space_waiting and self._spare() > 0:
                        self._space.notify()
                    return
                more = bool(self._aio_waiting) and len(self._free) > len(self._waking)
            loop, wait = target
            try:
                loop.call_soon_threadsafe(self._wake, wait)
            except RuntimeError:  # that loop is closed: the next waiter
                with self._lock:
                    self._waking.pop(wait, None)
                continue
            if not more:
                return

    def _spare(self) -> int:
        """Under the lock: free slots that no woken request is on its way to take. A wake-up
        sent to a loop that closed since can never run: it no longer counts (checked only
        when no slot seems spare, so a release costs no scan)."""
        n = len(self._free) - len(self._waking)
        if n <= 0 and self._free and self._waking:
            for wait, loop in list(self._waking.items()):
                if loop.is_closed():
                    del self._waking[wait]
            n = len(self._free) - len(self._waking)
        return n

    def _wake(self, wait) -> None:
        """On the waiter's loop, woken by `_release`: take a free slot; when a request that
        came meanwhile took it, queue again at the head; a waiter whose task was cancelled
        passes the wake-up on."""
        with self._lock:
            self._waking.pop(wait, None)
            if not wait.done():
                if self._free:
                    wait.set_result(self._free.pop())
                elif self._state in ("open", "restarting") and self._broken is None:
                    self._aio_waiting.appendleft((wait.get_loop(), wait))
                else:  # _fail_slot_waiters ran while it was woken
                    wait.set_exception(self._broken or EngineClosed(
                        "the ProcessEngine closed before the request found a slot"))
                return
        self._release(None)

    # -- completions ------------------------------------------------------------------------

    def _complete(self, rid: int, slot: int, err: bytes, batch: dict | None) -> None:
        """One response: copy the outputs out, free the slot, complete the future (asyncio
        futures of other loops, and all of them from the reader thread, are collected in
        ``batch`` per loop)."""
        with self._lock:
            entry = self._pending.pop(rid, None)
            if err and entry is not None:
                self._counts["failed"] += 1
        if entry is None:
            log.error("serve: the engine process answered request %d, which is not pending",
                      rid)
            return
        fut, loop = entry.fut, entry.loop
        exc = None
        result: Any = None
        if err:
            exc = wire.decode_error(err)
            if self.restarts and _breaks_engine(exc):
                self._begin_restart(exc)
        elif not fut.done():  # a cancelled task's outputs are not copied
            rows = entry.rows
            # out= may name only some outputs (as for an in-process Engine): the others come
            # back as new arrays, not left out of the result
            out = entry.out or {}
            result = {}
            for name, v in self._out_views[slot].items():
                a = out.get(name)
                if a is None:
                    result[name] = v[:rows].copy()
                else:
                    np.copyto(a, v[:rows])
                    result[name] = a
            one = self._single_out
            if one is not None:
                result = result[one]
        entry.out = None
        self._release(slot)
        self._latency.append((_now() - entry.t0) / 1e3)
        if loop is None:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        elif batch is None and loop is self._loop:
            _set_aio(fut, result, exc)
        elif batch is not None:
            batch.setdefault(loop, []).append((fut, result, exc))
        else:
            try:
                loop.call_soon_threadsafe(_set_aio, fut, result, exc)
            except RuntimeError:  # that loop is closed: nobody awaits it any more
                pass

    def _fail_slot_waiters(self, exc: BaseException) -> None:
        """Fail every asyncio request awaiting a slot with ``exc`` and wake the threads
        waiting for one (the engine no longer takes requests: they see why themselves)."""
        with self._lock:
            waiting = list(self._aio_waiting)
            self._aio_waiting.clear()
            self._space.notify_all()
        batch: dict = {}
        for loop, wait in waiting:
            batch.setdefault(loop, []).append((wait, None, exc))
        self._hand_batches(batch)

    @staticmethod
    def _hand_batches(batch: dict) -> None:
        for loop, items in batch.items():
            try:
                loop.call_soon_threadsafe(_set_many, items)
            except RuntimeError:  # that loop is closed: nobody awaits these any more
                pass

    def _start_reader_thread(self, child: _ChildProc) -> None:
        # the thread holds the engine weakly: a forgotten engine is still collected, and its
        # finalizer ends the process (the thread then sees the end of the pipe)
        t = threading.Thread(target=_read_responses, args=(weakref.ref(self), child),
                             name="orchestra-serve-process-reader", daemon=True)
        child.thread = t
        t.start()

    def _watch_on_loop(self, child: _ChildProc) -> None:
        os.set_blocking(child.resp_fd, False)
        loop: Any = self._loop
        # the engine held weakly (a bound method would keep a forgotten engine alive as long
        # as the loop runs): its finalizer removes the reader
        ref = weakref.ref(self)
        if _running_loop() is loop:
            self._loop.add_reader(child.resp_fd, _readable, ref, child)
            return
        done = threading.Event()
        failed: list = []

        def add():
            try:
                loop.add_reader(child.resp_fd, _readable, ref, child)
            except BaseException as exc:  # noqa: BLE001 - raised in the constructor
                failed.append(exc)
            done.set()

        if loop.is_running():
            loop.call_soon_threadsafe(add)
            done.wait()
        else:
            add()
        if failed:  # the constructor closes; a restart thread breaks the engine (its close()
            # would wait for the very restart that calls it)
            raise ServeConfigValueError(f"loop cannot watch the response pipe "
                                        f"({failed[0]!r}); use loop=None") from failed[0]

    def _on_readable(self, child: _ChildProc) -> None:
        if child.handed:
            return
        try:
            data = os.read(child.resp_fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(child.resp_fd)
            # answers still buffered (a drain stops at completions_per_turn) are delivered
            # first: their outputs are in the slots; _child_gone would fail them
            while (rec := child.reader.pop()) is not None:
                self._complete(rec[0], rec[1], rec[2], None)
            child.handed = True
            # on a thread: _child_gone waits for the process to be reaped (a GPU process can
            # take seconds after its pipes closed), which would hold up the loop
            t = threading.Thread(target=self._child_gone, args=(child,), daemon=True,
                                 name="orchestra-serve-process-gone")
            child.gone_thread = t
            t.start()
            return
        child.reader.feed(data)
        if not child.turn_pending:
            # in the next iteration, not here: a drain scheduled in the last one may already
            # have run in this one, and two drains would resume 2 x completions_per_turn tasks
            # in the next (the long iterations of a saturated loop)
            child.turn_pending = True
            self._loop.call_soon(self._drain_turn, child)

    def _drain_turn(self, child: _ChildProc) -> None:
        """On the loop: resolve up to ``completions_per_turn`` requests (and for at most
        `TURN_BUDGET_NS`); the rest in the next iteration."""
        child.turn_pending = False
        if child.handed:  # close() gave the rest to the reader thread
            return
        reader, limit = child.reader, self.completions_per_turn
        end = _now() + TURN_BUDGET_NS
        n = 0
        while (rec := reader.pop()) is not None:
            self._complete(rec[0], rec[1], rec[2], None)
            n += 1
            if n >= limit or _now() > end:
                if reader.pending:
                    child.turn_pending = True
                    self._loop.call_soon(self._drain_turn, child)
                return

    def _gone_error(self, child: _ChildProc | None = None) -> EngineProcessError:
        if self._broken is not None:
            return self._broken
        code = (child or self._child).proc.exitcode
        return EngineProcessError(f"the engine process exited ({exit_text(code)}); make a new "
                                  f"ProcessEngine to serve again", code)

    def _child_gone(self, child: _ChildProc) -> None:
        """``child``'s response pipe ended: it closed (close(), a restart) or died. Fail what
        is still pending; a death while serving starts a restart when one is left, else
        breaks the engine. On the reader thread, or a thread of its own with ``loop=`` (it
        waits up to 5 s for the process to be reaped, for its exit code)."""
        child.proc.join(5)
        restart = False
        with self._lock:
            if self._state == "open":
                cause = self._gone_error(child)
                if self._counts["restarts"] < self.restarts:
                    self._state = "restarting"
                    self._restart_idle.clear()
                    self._restart_cause = cause
                    restart = True
                else:
                    self._broken = cause
                log.error("serve: %s%s", cause, "; restarting it" if restart else "")
            if self._state == "restarting":  # those awaiting a slot wait for the new one
                exc = EngineProcessError(
                    f"the engine process was replaced before it answered (restart after: "
                    f"{self._restart_cause}); the request is lost, retry it",
                    child.proc.exitcode)
            else:
                exc = self._broken or EngineProcessError(
                    f"the engine process ended before it answered "
                    f"({exit_text(child.proc.exitcode)})", child.proc.exitcode)
            pending = list(self._pending.values())
            self._pending.clear()
            self._counts["failed"] += len(pending)
            self._space.notify_all()
        batch: dict = {}
        for e in pending:
            if e.loop is None:
                e.fut.set_exception(exc)
            else:
                batch.setdefault(e.loop, []).append((e.fut, None, exc))
            self._release(e.slot)
        self._hand_batches(batch)
        if self._state != "restarting":
            self._fail_slot_waiters(exc)
        child.gone.set()
        if restart:
            self._start_restarter(child)

    # -- restarting -------------------------------------------------------------------------

    def _begin_restart(self, cause: BaseException) -> None:
        """A response said the engine is broken (a sticky CUDA error): replace the process
        when a restart is left."""
        with self._lock:
            if self._state != "open" or self._counts["restarts"] >= self.restarts:
                return
            self._state = "restarting"
            self._restart_idle.clear()
            self._restart_cause = cause
            child = self._child
            try:
                child.conns[0].close()  # no request reaches the broken engine any more
            except OSError:
                pass
        log.error("serve: the engine process's engine is broken (%s); restarting it", cause)
        self._start_restarter(child)

    def _start_restarter(self, old: _ChildProc) -> None:
        threading.Thread(target=self._restart, args=(old,), daemon=True,
                         name="orchestra-serve-process-restart").start()

    def _restart(self, old: _ChildProc) -> None:
        """The restart thread: end ``old`` (its answers still delivered), start a new engine
        process on the same shared memory, serve from it."""
        try:
            if not old.gone.is_set():
                try:
                    with self._ctl_lock:
                        old.ctl.send(("close", True))
                        if old.ctl.poll(30):
                            old.ctl.recv()
                except (EOFError, OSError):
                    pass
                if not old.gone.wait(30):
                    old.proc.terminate()
                    old.gone.wait(30)
            old.finalizer()
            new = _ChildProc(*self._spawn_args)
            self._children.append(new)
            try:
                desc = new.recv(self._start_timeout, "while the factory made the engine again")
                same = {k: desc[k] for k in ("inputs", "outputs")}
                if same != {k: self._desc[k] for k in ("inputs", "outputs")}:
                    raise EngineProcessError(f"the restarted engine serves other tensors "
                                             f"({same}) than the first ({self._desc})")
                self._attach(new, self._start_timeout)
            except BaseException:
                new.finalizer()
                raise
            with self._lock:
                self._children.remove(old)
                if self._state != "restarting":  # closed meanwhile
                    start = False
                else:
                    self._child = new
                    self.pid = int(desc["pid"])
                    self._counts["restarts"] += 1
                    self._state = "open"
                    self._space.notify_all()
                    start = True
            if start:
                self._read_from(new)
                log.warning("serve: the engine process was restarted (pid %d)", self.pid)
            else:  # close() ran meanwhile (it gave up waiting for this restart): end it here
                new.finalizer()
        except BaseException as exc:  # noqa: BLE001 - the engine is broken then
            err = EngineProcessError(f"the engine process could not be restarted after "
                                     f"{self._restart_cause} ({type(exc).__name__}: {exc})")
            err.__cause__ = exc
            log.error("serve: %s", err)
            with self._lock:
                self._broken = err
                if self._state == "restarting":
                    self._state = "open"  # broken: every call raises err
            self._fail_slot_waiters(err)
        finally:
            self._restart_idle.set()

    # -- control ----------------------------------------------------------------------------

    def _control(self, op: str, arg=None):
        with self._ctl_lock:
            if self._state == "closed":
                raise EngineClosed("the ProcessEngine is closed")
            ctl = self._child.ctl
            try:
                ctl.send((op, arg))
                kind, value = ctl.recv()
            except (EOFError, OSError) as exc:
                raise self._gone_error() from exc
        if kind == "error":
            raise wire.decode_error(value)
        return value

    def warmup(self, buckets=None) -> list[dict]:
        """`Engine.warmup` in the engine process: builds the buckets (default all), returns its
        report (per bucket: build ms, instantiate ms, graph memory bytes). Blocks until it is
        done (on an event loop too: it needs no loop to answer)."""
        return self._control("warmup", buckets)

    def stats(self) -> dict:
        """The engine's `Engine.stats` (from the engine process; its latencies are measured
        there) with ``"process"``: this side's view: pid, slots, ``in_flight``, counts
        (``requests`` sent, ``failed``, ``bad`` refused here, ``overloaded``, ``cancelled``
        awaits) and ``latency_us`` p50/p95/p99 from submit to the future's completion here
        (the most recent `LATENCY_SAMPLES`). After `close`: the engine's last statistics."""
        if self._state == "closed":
            engine = self._final_stats or {}
        else:
            engine = self._control("stats")
        lat = np.fromiter(self._latency, float) if self._latency else None
        pct = ({f"p{q}": float(np.percentile(lat, q)) for q in (50, 95, 99)}
               if lat is not None else {})
        with self._lock:
            in_flight = len(self._pending)
        return {**engine, "process": {"pid": self.pid, "slots": self.slots,
                                      "max_rows": self.max_rows, "pinned": self.pinned,
                                      "in_flight": in_flight, **self._counts,
                                      "latency_us": pct}}

    def stats_json(self, **kw) -> str:
        """`stats` as JSON (``json.dumps`` keywords pass through)."""
        return json.dumps(self.stats(), default=str, **kw)

    # -- closing ----------------------------------------------------------------------------

    def close(self, cancel: bool = False) -> None:
        """Stop taking requests; let the engine process finish (or, ``cancel=True``, cancel)
        what it holds; deliver every answer; end the process; free the shared memory.
        Idempotent; a second caller waits for the first. Not from a future's callback."""
        if not self._restart_idle.is_set():  # a restart first ends (or fails)
            self._restart_idle.wait(self._start_timeout + 90)
        with self._lock:
            if self._state in ("closing", "closed"):
                first = False
            else:
                first = True
                self._state = "closing"
        if not first:
            self._closed_event.wait()
            return
        try:
            self._fail_slot_waiters(EngineClosed("the ProcessEngine closed before the request "
                                                 "found a slot"))
            child = self._child
            if self._loop is not None and not child.handed:
                _unwatch(self._loop, child)  # answers are read by a thread while it drains
                self._start_reader_thread(child)
            with self._lock:
                child.conns[0].close()  # the child reads every request written, then the end
            if not child.gone.is_set():
                try:
                    self._final_stats = self._control("close", bool(cancel))
                except OrchestraError as exc2:
                    log.warning("serve: closing the engine process: %s", exc2)
            if child.thread is not None:
                child.thread.join()
            if child.gone_thread is not None:  # the loop saw the end: its answers first
                child.gone_thread.join()
        finally:
            self._in_views = self._out_views = []  # no view may hold the shared memory
            self._end()  # joins (or ends) the process, closes connections, frees memory
            with self._lock:
                self._state = "closed"
            self._closed_event.set()

    def _end(self) -> None:
        """The finalizer, with the engine processes ended (waited for) in this thread: a
        `close` on the loop's thread returns once they exited."""
        for child in list(self._children):
            if self._loop is not None and not child.handed:  # before its descriptor closes
                _unwatch(self._loop, child)
            child.finalizer()
        self._finalizer()

    async def aclose(self, cancel: bool = False) -> None:
        """`close` from a coroutine: in the loop's default executor, the loop keeps running."""
        await asyncio.get_running_loop().run_in_executor(None, self.close, cancel)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<ProcessEngine pid {getattr(self, 'pid', None)} {self._state}, "
                f"{len(self._pending)} in flight>")


def _readable(ref, child: _ChildProc) -> None:
    """The loop's reader of ``child``'s response pipe (``loop=``)."""
    engine = ref()
    if engine is not None:
        engine._on_readable(child)
    elif not child.handed:  # collected, its finalizer's removal still on its way
        child.handed = True
        loop = _running_loop()
        if loop is not None:
            loop.remove_reader(child.resp_fd)


def _unwatch(loop, child: _ChildProc, timeout: float = 5.0) -> None:
    """Stop reading ``child``'s responses on ``loop``, from any thread: at once on the loop's
    thread (or while it does not run), else in a callback on it, waited for up to ``timeout``
    s (a stuck loop is given up on). Afterwards no drain of the loop runs for ``child``
    (``handed``); a closed loop reads nothing any more."""
    fd = child.resp_fd
    if loop.is_closed():
        child.handed = True
        return
    if _running_loop() is loop or not loop.is_running():
        loop.remove_reader(fd)
        child.handed = True
        return
    done = threading.Event()

    def remove():
        loop.remove_reader(fd)
        child.handed = True
        done.set()

    try:
        loop.call_soon_threadsafe(remove)
    except RuntimeError:  # closed meanwhile
        child.handed = True
        return
    if not done.wait(timeout):  # the loop is stuck: go on regardless
        child.handed = True


def _read_responses(ref, child: _ChildProc) -> None:
    """The reader thread: every response of ``child`` until it closes its end (or the engine
    is gone)."""
    fd, reader = child.resp_fd, child.reader
    os.set_blocking(fd, True)
    while True:
        engine = ref()
        if engine is None:
            return
        batch: dict = {}
        while (rec := reader.pop()) is not None:
            engine._complete(rec[0], rec[1], rec[2], batch)
        if batch:
            engine._hand_batches(batch)
        del engine
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            engine = ref()
            if engine is not None:
                engine._child_gone(child)
            return
        reader.feed(data)


def _breaks_engine(exc: BaseException) -> bool:
    """Whether a request's error says the engine process's CUDA context is unusable."""
    return isinstance(exc, EngineBroken) or (isinstance(exc, CudaError) and exc.sticky)


def exit_text(code: int | None, unknown: str = "exit code not known yet: the process is still "
                                               "being reaped") -> str:
    """How a process ended, for a message, from its ``multiprocessing`` exit code: ``"exit
    code 3"``, ``"killed by signal SIGKILL"`` (a negative code: the signal that ended it), or
    ``unknown`` for None (by default: gone, its pipes closed, but not reaped yet, which for a
    GPU process can take seconds)."""
    if code is None:
        return unknown
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal, without a name
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _check_shm_space(nbytes: int, where: str = "/dev/shm") -> None:
    """Refuse slots that the shared-memory file system cannot hold: a tmpfs hands out pages
    lazily, and touching one past its size kills the process with SIGBUS (a container's
    /dev/shm is often 64 MiB)."""
    try:
        st = os.statvfs(where)
    except OSError:  # no /dev/shm: SharedMemory says what is wrong
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ServeConfigValueError(
            f"the slots need {nbytes / 2**20:.1f} MiB of shared memory but {where} has "
            f"{free / 2**20:.1f} MiB free; give fewer slots or a smaller max_rows, or a larger "
            f"{where} (docker run --shm-size)")


def _set_many(items) -> None:
    for fut, result, exc in items:
        _set_aio(fut, result, exc)


class _ChildProc:
    """One engine process (spawned at once) and its connections: ``conns`` = (request pipe's
    write end, response pipe's read end, control connection), the response `RecordReader`,
    the reader thread (or ``handed`` once the event loop stopped reading it; the thread that
    handles the end of its responses when the loop read it), ``gone`` (set once its responses
    ended and what was pending failed). ``finalizer`` closes the
    connections and waits for the process (ends it when it does not exit).

    Thread-safety: owned by its `ProcessEngine` (under its locks)."""

    def __init__(self, factory, args: tuple, kwargs: dict):
        ctx = multiprocessing.get_context("spawn")
        req_r, req_w = ctx.Pipe(duplex=False)
        resp_r, resp_w = ctx.Pipe(duplex=False)
        ctl, ctl_child = ctx.Pipe()
        self.proc = ctx.Process(target=process_child.main, name="orchestra-serve-engine",
                                args=(factory, args, kwargs, req_r, resp_w, ctl_child),
                                daemon=True)
        self.conns = (req_w, resp_r, ctl)
        self.ctl = ctl
        self.req_fd = req_w.fileno()
        self.resp_fd = resp_r.fileno()
        self.reader = wire.RecordReader(wire.RESPONSE, sized=True)
        self.thread: threading.Thread | None = None
        self.gone_thread: threading.Thread | None = None  # loop=: _child_gone's thread
        self.handed = False
        self.turn_pending = False
        self.gone = threading.Event()
        self.finalizer = weakref.finalize(self, _end_child, self.proc, self.conns)
        try:
            self.proc.start()
        except BaseException:
            self.finalizer()
            raise
        finally:
            for c in (req_r, resp_w, ctl_child):  # the child's ends: its own copies now
                c.close()

    def recv(self, timeout: float, what: str):
        """The next start-up message, or the error that says why none came."""
        ctl, proc = self.ctl, self.proc
        try:
            ready = ctl.poll(timeout)
            msg = ctl.recv() if ready else None
        except (EOFError, OSError):
            proc.join(5)
            raise EngineProcessError(f"the engine process exited {what} "
                                     f"({exit_text(proc.exitcode)})", proc.exitcode) from None
        if msg is None:
            raise EngineProcessError(f"the engine process did not answer within "
                                     f"{timeout:g} s {what} (start_timeout)")
        if msg[0] == "error":
            exc = wire.decode_error(msg[1])
            exc.add_note("(raised in the engine process, by the ProcessEngine factory)")
            raise exc
        return msg[1]


def _end_child(proc, conns) -> None:
    """Close the connections (the child then closes its engine and exits) and wait for the
    child (end it if it does not exit)."""
    for c in conns:
        try:
            c.close()
        except OSError:
            pass
    if proc.pid is None:  # never started
        return
    proc.join(30)
    if proc.is_alive():
        log.warning("serve: the engine process %s did not exit; terminating it", proc.pid)
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _abandon(children: list, shms: list, loop) -> None:
    """Stop reading on ``loop`` (``loop=``: the reader is removed before the connections
    close, so its descriptor cannot be reused under it), end every engine process
    (`_end_child`) and unlink the shared memory: `close`'s last step, and a forgotten
    engine's finalizer, which may run on any thread: on an event loop's thread the processes
    are waited for on a thread of their own, not there."""
    for child in list(children):
        if loop is not None and not child.handed:
            _unwatch(loop, child)
    ends = [child.finalizer for child in list(children)]
    if ends and _running_loop() is not None:
        threading.Thread(target=lambda: [end() for end in ends], daemon=True,
                         name="orchestra-serve-process-end").start()
    else:
        for end in ends:
            end()
    for shm in shms:
        try:
            shm.close()
        except BufferError:  # a view is still alive: its memory goes when it does
            pass
        try:
            shm.unlink()
        except FileNotFoundError:
            pass

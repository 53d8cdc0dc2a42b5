"""`ServeFuture`: the future of one request, a `concurrent.futures.Future` made cheap.

The standard future pays for a `threading.Condition` per request (a reentrant lock, a deque
of waiters and bound methods: about 3 µs and several objects the garbage collector tracks)
and takes it for every query (``done()``, ``set_running_or_notify_cancel()``,
``set_result()``). A serving engine makes one future per request, from many threads at once,
so `ServeFuture` keeps the same API and states on a plain lock instead:

- ``_condition`` is a plain `threading.Lock` (still named so: `concurrent.futures.wait` and
  `as_completed` take it with ``with f._condition`` and install their waiters in
  ``f._waiters``, which `ServeFuture` notifies as the standard future does);
- queries read ``_state`` without the lock (one attribute read: atomic);
- a thread that blocks in ``result()`` / ``exception()`` sleeps on a lock of its own, acquired
  once and released by the thread that completes the future: one wake-up per sleeper, no
  condition variable, nothing allocated for a future nobody sleeps on.

Thread-safety: as `concurrent.futures.Future`: any thread may wait, cancel, query or add
callbacks; the engine completes it from one of its threads or a caller's.
"""

from __future__ import annotations

import concurrent.futures
import numbers
from concurrent.futures import CancelledError, InvalidStateError
from concurrent.futures._base import (  # the standard future's states (cf.wait reads them)
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    LOGGER,
    PENDING,
    RUNNING,
)
from threading import Lock
from typing import Any

from orchestra.serve.errors import FutureStateError, ResultTimeout, check_timeout

_DONE = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
_CANCELLED = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED))


class ServeFuture(concurrent.futures.Future):
    """The future of one request: a `concurrent.futures.Future` (``isinstance`` holds;
    `concurrent.futures.wait`, `as_completed` and `asyncio.wrap_future` accept it) on a
    plain lock instead of a condition variable (see the module doc).

    ``result()`` / ``exception()`` without a timeout, called once the request is launched,
    wait in the calling thread on the request's own launch (and complete the future
    themselves when they see the completion first): no thread hop on the way back. Called
    while the request is still queued, they first complete other started launches nobody
    waits on, then sleep until their own request completes. Callbacks run on the thread that
    completes the future (an engine thread or a caller's): keep them short and never call
    `Engine.close` from one. Their ``timeout`` is seconds as the standard future takes them
    (negative: do not wait); ``inf`` or anything above ``threading.TIMEOUT_MAX`` waits without
    a limit; a value that is not a real number, a bool or NaN raises `ServeConfigTypeError` /
    `ServeConfigValueError`; `ResultTimeout` when the request did not complete in time.

    Thread-safety: as `concurrent.futures.Future`.
    """

    # no __slots__: the base class has a __dict__ (and subclasses of it may add attributes)

    def __init__(self, engine=None):  # the base __init__ (a Condition) is not called
        self._condition = Lock()
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list = []  # concurrent.futures.wait / as_completed waiters
        self._done_callbacks: list | None = None
        self._sleepers: list | None = None  # locks of threads blocked in result()
        self._engine = engine
        # the launches running this request, for result() to wait on; emptied when the future
        # completes (a launch refers to its requests, which refer to this future: keeping the
        # list would make a reference cycle per request, freed only by the cyclic GC)
        self._launches: list = []
        self._aio: Any = None  # run(): the awaiting asyncio future (the loop inbox resolves it)

    # -- queries -----------------------------------------------------------------------------

    def done(self) -> bool:
        return self._state in _DONE

    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def running(self) -> bool:
        return self._state == RUNNING

    def __repr__(self) -> str:
        state = self._state
        if state == FINISHED:
            if self._exception is not None:
                return (f"<{type(self).__name__} at {id(self):#x} state=finished raised "
                        f"{type(self._exception).__name__}>")
            return (f"<{type(self).__name__} at {id(self):#x} state=finished returned "
                    f"{type(self._result).__name__}>")
        return f"<{type(self).__name__} at {id(self):#x} state={state.lower()}>"

    # -- waiting -----------------------------------------------------------------------------

    def _sleep(self, timeout) -> None:
        """Block until the future is done or ``timeout`` seconds passed (None: forever). The
        waker is whoever completes or cancels the future: it releases every sleeper's lock
        after setting the state under ``_condition``."""
        if self._state in _DONE:
            return
        me = Lock()
        me.acquire()
        with self._condition:
            if self._state in _DONE:
                return
            if self._sleepers is None:
                self._sleepers = [me]
            else:
                self._sleepers.append(me)
        if me.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            return
        with self._condition:  # timed out: leave no lock behind for the completer
            if self._sleepers is not None and me in self._sleepers:
                self._sleepers.remove(me)

    def _wait_finished(self, timeout) -> None:
        """Until FINISHED (the caller checked it is not yet): `CancelledError` if cancelled,
        `ResultTimeout` after ``timeout`` s. A blocking wait (``timeout=None``) on a request
        of the engine lets the engine run it in this thread where it can (`_wait_inline`)."""
        given = timeout
        if timeout is not None:
            timeout = _wait_seconds(timeout)
        if timeout is None and self._engine is not None and self._state not in _DONE:
            self._engine._wait_inline(self)
        self._sleep(timeout)
        state = self._state
        if state in _CANCELLED:
            raise CancelledError()
        if state != FINISHED:
            raise ResultTimeout(f"the request did not complete within {given} s (it "
                                "keeps running: wait again, or cancel it)")

    def result(self, timeout=None):
        if self._state != FINISHED:
            self._wait_finished(timeout)
        if self._exception is not None:
            try:
                raise self._exception
            finally:
                self = None  # no frame of the raise keeps the future (a cycle per failure)
        return self._result

    def exception(self, timeout=None):
        if self._state != FINISHED:
            self._wait_finished(timeout)
        return self._exception

    # -- callbacks -----------------------------------------------------------------------------

    def add_done_callback(self, fn) -> None:
        with self._condition:
            if self._state not in _DONE:
                if self._done_callbacks is None:
                    self._done_callbacks = [fn]
                else:
                    self._done_callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - as concurrent.futures: logged, not raised
            LOGGER.exception("exception calling callback for %r", self)

    def _invoke_callbacks(self) -> None:
        callbacks = self._done_callbacks
        if callbacks is None:
            return
        self._done_callbacks = None
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - as concurrent.futures: logged, not raised
                LOGGER.exception("exception calling callback for %r", self)

    # -- completing (the engine) -----------------------------------------------------------

    def _finish(self, result, exception, notify: str) -> None:
        """Set the result or exception under the lock, then wake the sleepers and run the
        callbacks outside it. ``notify``: the method of `concurrent.futures.wait`'s waiters
        to call."""
        with self._condition:
            if self._state in _DONE:
                raise InvalidStateError(f"{self._state}: {self!r}")
            self._result = result
            self._exception = exception
            self._state = FINISHED
            sleepers = self._sleepers
            self._sleepers = None
            if self._waiters:
                for w in self._waiters:
                    getattr(w, notify)(self)
        self._launches.clear()
        if sleepers is not None:
            for me in sleepers:
                me.release()
        self._invoke_callbacks()

    def set_result(self, result) -> None:
        self._finish(result, None, "add_result")

    def set_exception(self, exception) -> None:
        self._finish(None, exception, "add_exception")

    def cancel(self) -> bool:
        with self._condition:
            state = self._state
            if state in (RUNNING, FINISHED):
                return False
            if state in _CANCELLED:
                return True
            self._state = CANCELLED
            sleepers = self._sleepers
            self._sleepers = None
        if sleepers is not None:
            for me in sleepers:
                me.release()
        self._invoke_callbacks()
        return True

    def set_running_or_notify_cancel(self) -> bool:
        with self._condition:
            state = self._state
            if state == PENDING:
                self._state = RUNNING
                return True
            if state == CANCELLED:
                self._state = CANCELLED_AND_NOTIFIED
                for w in self._waiters:
                    w.add_cancelled(self)
                return False
        LOGGER.critical("Future %s in unexpected state: %s", id(self), state)
        raise FutureStateError(f"the future is {state.lower()} already; it cannot start")


def _wait_seconds(timeout) -> float | None:
    """The ``timeout`` of ``result()`` / ``exception()``: seconds as `concurrent.futures.Future`
    takes them (a negative one: do not wait), and None for no limit: ``inf`` and anything above
    ``threading.TIMEOUT_MAX``, which a lock's ``acquire`` refuses with a builtin
    ``OverflowError``. A value that is not a real number (or a bool) raises
    `ServeConfigTypeError`, NaN `ServeConfigValueError` (`check_timeout`)."""
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout < 0:
        return 0.0
    return check_timeout(timeout, "timeout")  # the rest, or its error


__all__ = ["ServeFuture"]

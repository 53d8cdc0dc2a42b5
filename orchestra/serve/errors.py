"""The serving engine's errors (plain Python).

A bad request fails its own future with a `BadRequest` (or one of its subclasses) and nothing
is enqueued for it; the engine keeps serving. `Overloaded`, `EngineClosed` and `EngineBroken`
are raised by ``submit`` itself: the engine refuses the work.
"""

from __future__ import annotations

import math
import numbers
import threading

from orchestra.errors import ClosedError, OrchestraError, StateError


class ServeError(OrchestraError):
    """Base class of the serving engine's own errors."""


class BadRequest(ServeError, ValueError):
    """A request that cannot be served as given (missing or unknown input, wrong shape, rows
    differing between inputs, a wrong ``out=`` array). The message says what to change."""


class InputTypeError(BadRequest, TypeError):
    """An input that is not a numpy array, has the wrong dtype, or is not C-contiguous."""


class RequestTooLarge(BadRequest):
    """A request with more rows than the largest bucket (and the engine may not split it).

    Attributes: ``rows`` (what the request has), ``largest`` (the largest bucket).
    """

    def __init__(self, rows: int, largest: int, hint: str = ""):
        self.rows = int(rows)
        self.largest = int(largest)
        msg = (f"the request has {rows} rows, more than the largest bucket ({largest} rows); "
               "send at most that many rows per request, add a larger bucket, or create the "
               "engine with split=True to split such requests")
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.rows, self.largest))


class ServeConfigError(ServeError):
    """An engine, bucket list, tensor declaration or `ServeGraph` that cannot be served (root of
    the two below; never raised itself)."""


class ServeConfigValueError(ServeConfigError, ValueError):
    """A configuration value out of range or unknown (``instances=0``, a bucket of 0 rows, a
    host buffer of the wrong size, ``max_batch`` above the largest bucket)."""


class ServeConfigTypeError(ServeConfigError, TypeError):
    """A configuration of the wrong kind (``inputs`` not a mapping, a build function that does
    not return a `ServeGraph`)."""


class StopIterationRaised(ServeError, TypeError):
    """``await Engine.run(...)``: the request's launch raised ``StopIteration``, which asyncio
    cannot raise into the awaiting task (a coroutine would end as if it returned); this is
    raised instead, the ``StopIteration`` as its ``__cause__``. Raise another exception from
    the backend."""


class Overloaded(ServeError):
    """The engine's queue is full (``queue_limit`` requests waiting for an instance) and the
    request was not admitted (``on_full="raise"``, or the ``timeout`` of a blocking submit
    expired). Retry later, or raise ``queue_limit`` / ``instances``."""


class EngineClosed(ServeError, ClosedError):
    """The engine is closing or closed and takes no new work (a `ClosedError`)."""


class ResultTimeout(ServeError, TimeoutError):
    """``ServeFuture.result(timeout)`` / ``exception(timeout)``: the request did not complete
    within ``timeout`` seconds (it keeps running; wait again or cancel it). A
    `concurrent.futures.TimeoutError` (the builtin `TimeoutError`), as the standard future
    raises."""


class TimerError(ServeError, OSError):
    """The dynamic batcher's delay timer (a Linux ``timerfd``) refused a system call
    (``errno`` and ``strerror`` as an `OSError`): the engine's timer was closed or the
    process ran out of file descriptors. Close the engine and create a new one."""


class FutureStateError(ServeError, RuntimeError):
    """A `ServeFuture` moved to running that is running or done already (the engine's own
    bookkeeping: a `RuntimeError`, as the standard future raises)."""


class EngineBroken(ServeError, StateError):
    """A sticky CUDA error made the device context unusable: every pending request failed with
    it and the engine refuses new work. ``cause`` is the `CudaError`. Only a new process can use
    the GPU again."""

    def __init__(self, cause):
        self.cause = cause
        super().__init__(f"the serving engine is broken by a sticky CUDA error ({cause}); the "
                         "CUDA context is unusable: restart the process to serve again")

    def __reduce__(self):
        return (type(self), (self.cause,))


class EngineProcessError(ServeError, StateError):
    """`ProcessEngine`: the engine process did not start (its factory raised: the factory's
    error is the ``__cause__``; or it did not answer within ``start_timeout``), or it exited
    while requests were in flight (``exitcode`` says how: negative for the signal that ended
    it). Every pending request fails with it and the `ProcessEngine` refuses new work; make a
    new one to serve again."""

    def __init__(self, message: str, exitcode: int | None = None):
        self.exitcode = exitcode
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.exitcode))


def check_timeout(value, what: str) -> float | None:
    """A timeout argument of `Engine` and `ProcessEngine` (``what`` names it in the message):
    None or seconds >= 0 (a real number: numpy's too, not a bool), returned as a float (``-0.0``
    as ``0.0``), or None for no limit: ``inf``, and any value above ``threading.TIMEOUT_MAX``
    (about 292 years on Linux), which ``Condition.wait`` would refuse with a builtin
    ``OverflowError``; an integer too large for a float counts as such a value too. Raises
    `ServeConfigTypeError` for another kind of value and `ServeConfigValueError` for a
    negative one or NaN (the wait it bounds would raise a builtin error, or never end)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ServeConfigTypeError(f"{what} must be seconds (a number) or None; got "
                                   f"{type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond a float's range: seconds >= 0 decides below
        seconds = -math.inf if value <= 0 else math.inf
    if not seconds >= 0:
        raise ServeConfigValueError(f"{what} must be >= 0 seconds or None; got {value}")
    return None if seconds > threading.TIMEOUT_MAX else seconds + 0.0


ON_FULL = ("block", "raise")


def check_on_full(value) -> str:
    """The ``on_full`` setting of `Engine` and `ProcessEngine`: ``"block"`` or ``"raise"``.
    Raises `ServeConfigTypeError` for a value that is not a string, `ServeConfigValueError`
    for another string."""
    if not isinstance(value, str):
        raise ServeConfigTypeError(f"on_full must be the string 'block' or 'raise'; got "
                                   f"{type(value).__name__}")
    if value not in ON_FULL:
        raise ServeConfigValueError(f"on_full must be 'block' or 'raise'; got {value!r}")
    return value


__all__ = ["BadRequest", "EngineBroken", "EngineClosed", "EngineProcessError", "FutureStateError",
           "InputTypeError", "Overloaded", "RequestTooLarge", "ResultTimeout", "ServeConfigError",
           "ServeConfigTypeError", "ServeConfigValueError", "ServeError", "StopIterationRaised",
           "TimerError"]

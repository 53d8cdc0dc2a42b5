"""The dynamic batcher's delay timer: a Linux ``timerfd`` that any thread re-arms with one
system call, without waking the thread that waits on it.

Why not a condition variable: a thread sleeping in ``Condition.wait(timeout)`` can only be
given an earlier deadline by a notify, which wakes it, and a woken Python thread must take
the GIL back before it can sleep again: a hand-off of several microseconds, contended by
every thread that submits. Under a closed loop each batch starts a new head (its first
request), so the timer thread was woken once or twice per batch although full batches never
need it. A ``timerfd`` (``timerfd_create(2)`` on ``CLOCK_MONOTONIC``) is armed by
``timerfd_settime(2)`` from the thread that queues the head (about 1 to 2 µs, the GIL kept:
the call is made through ``ctypes.PyDLL``); the timer thread sleeps in ``read(2)`` (GIL
released) and wakes only when a deadline really passes. Re-arming replaces the pending
deadline and clears an expiration not read yet (``timerfd_settime`` resets the count), so a
batch that went out in time leaves nothing to wake up for.

`deadline_timer()` returns None where no ``timerfd`` exists (not Linux, no libc symbol): the
engine then keeps its condition-variable timer.
"""

from __future__ import annotations

import ctypes
import os
import sys

from orchestra.serve.errors import TimerError

_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class DeadlineTimer:
    """A one-shot timer on ``CLOCK_MONOTONIC`` (a ``timerfd``).

    `arm` sets (or replaces) the one pending expiration ``delay_ns`` nanoseconds from now;
    `wait` blocks until an expiration happened, without the GIL.

    Thread-safety: `arm` from any thread, serialized by the caller (the argument block is
    shared: the engine arms under its lock); `wait` from one thread; `close` once that
    thread is done.
    """

    def __init__(self, libc):
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._settime.restype = ctypes.c_int
        create = libc.timerfd_create
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        create.restype = ctypes.c_int
        fd = create(_CLOCK_MONOTONIC, os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise TimerError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd = fd
        self._spec = _Itimerspec()
        self._value = self._spec.it_value
        self._ref = ctypes.addressof(self._spec)
        self.arms = 0  # how often it was armed (statistics, tests)

    def arm(self, delay_ns: int) -> None:
        """Expire ``delay_ns`` ns from now (at least 1 ns: zero would disarm), replacing the
        pending expiration. Raises `TimerError` (an `OSError`) if the kernel refuses (a
        closed timer)."""
        value = self._value
        if delay_ns < 1:
            value.tv_sec, value.tv_nsec = 0, 1
        else:
            value.tv_sec, value.tv_nsec = divmod(int(delay_ns), 1_000_000_000)
        self.arms += 1
        if self._settime(self.fd, 0, self._ref, None) != 0:
            err = ctypes.get_errno()
            raise TimerError(err, f"timerfd_settime: {os.strerror(err)}")

    def wait(self) -> None:
        """Block until the timer expired (a ``read`` of its expiration count; the GIL is
        released while it waits; EINTR is retried by Python)."""
        os.read(self.fd, 8)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def deadline_timer() -> DeadlineTimer | None:
    """A new `DeadlineTimer`, or None where ``timerfd`` is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        # PyDLL: the calls keep the GIL (a system call of a microsecond; releasing the GIL
        # around it would let another thread take it and make this one wait to get it back)
        libc = ctypes.PyDLL(None, use_errno=True)
        return DeadlineTimer(libc)
    except (OSError, AttributeError):
        return None


__all__ = ["DeadlineTimer", "deadline_timer"]

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
engine then keeps its condition-variable timer. The event loop's lag probe
(`orchestra.serve.loop_lag.TimerLagProbe`) uses one too, non-blocking and armed at absolute
instants, as a file descriptor the loop watches.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import weakref

from orchestra.serve.errors import TimerError

_CLOCK_MONOTONIC = 1
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_MAX_NS = 2**63 - 1  # the kernel's range (KTIME_MAX); a larger tv_sec wrapped around in C


def _clamp_ns(ns, what: str) -> int:
    """``ns`` as whole ns within 1 (zero would disarm) to `_MAX_NS`; `TimerError` for NaN."""
    if ns != ns:
        raise TimerError(errno.EINVAL, f"{what} is NaN: give a number of the clock's range")
    return int(max(1, min(ns, _MAX_NS)))


class DeadlineTimer:
    """A one-shot timer on ``CLOCK_MONOTONIC`` (a ``timerfd``).

    `arm` sets (or replaces) the one pending expiration ``delay_ns`` nanoseconds from now,
    `arm_at` at an instant of ``CLOCK_MONOTONIC``; `wait` blocks until an expiration
    happened, without the GIL; made ``nonblocking``, `expired` reads it without waiting (for
    an event loop's ``add_reader``).

    Thread-safety: `arm` and `arm_at` from any thread, serialized by the caller (the
    argument block is shared: the engine arms under its lock); `wait` or `expired` from one
    thread; `close` once that thread is done.
    """

    def __init__(self, libc, nonblocking: bool = False):
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._settime.restype = ctypes.c_int
        create = libc.timerfd_create
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        create.restype = ctypes.c_int
        fd = create(_CLOCK_MONOTONIC, os.O_CLOEXEC | (os.O_NONBLOCK if nonblocking else 0))
        if fd < 0:
            err = ctypes.get_errno()
            raise TimerError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd = fd
        # the fd closed with the timer when its owner forgets `close` (a probe never stopped)
        self._closer = weakref.finalize(self, os.close, fd)
        self._spec = _Itimerspec()
        self._value = self._spec.it_value
        self._ref = ctypes.addressof(self._spec)
        self.arms = 0  # how often it was armed (statistics, tests)

    def arm(self, delay_ns: int) -> None:
        """Expire ``delay_ns`` ns from now (at least 1 ns: zero would disarm; at most
        ``2**63 - 1`` ns, about 292 years, the kernel's range: more, infinity too, is that),
        replacing the pending expiration. Raises `TimerError` (an `OSError`) if the kernel
        refuses (a closed timer), or for a NaN."""
        # the engine's hot path: a delay in range skips the clamp
        ns = int(delay_ns) if 1 <= delay_ns < _MAX_NS else _clamp_ns(delay_ns, "delay_ns")
        self._value.tv_sec, self._value.tv_nsec = divmod(ns, 1_000_000_000)
        self._set(0)

    def arm_at(self, due_s: float) -> None:
        """Expire at ``due_s``, in s of ``CLOCK_MONOTONIC`` (``time.perf_counter``'s clock on
        Linux; ``TFD_TIMER_ABSTIME``), replacing the pending expiration; an instant passed
        (0, negative) expires at once, one beyond the kernel's range (infinity) is as far
        ahead as it goes. Raises `TimerError` as `arm` does."""
        # an int exactly (a huge one would not fit a float); anything else as a float (a
        # numpy integer multiplied would wrap around)
        ns = _clamp_ns(due_s * 1_000_000_000 if isinstance(due_s, int) else float(due_s) * 1e9,
                       "due_s")
        self._value.tv_sec, self._value.tv_nsec = divmod(ns, 1_000_000_000)
        self._set(_TFD_TIMER_ABSTIME)

    def _set(self, flags: int) -> None:
        self.arms += 1
        if self._settime(self.fd, flags, self._ref, None) != 0:
            err = ctypes.get_errno()
            raise TimerError(err, f"timerfd_settime: {os.strerror(err)}")

    def wait(self) -> None:
        """Block until the timer expired (a ``read`` of its expiration count; the GIL is
        released while it waits; EINTR is retried by Python)."""
        os.read(self.fd, 8)

    def expired(self) -> bool:
        """Read the expirations of a ``nonblocking`` timer: False when there was none yet."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        self.fd = -1
        self._closer()  # once: a second call does nothing


def deadline_timer(nonblocking: bool = False) -> DeadlineTimer | None:
    """A new `DeadlineTimer` (its fd ``O_NONBLOCK`` when ``nonblocking``), or None where
    ``timerfd`` is not available (`open_deadline_timer` says why)."""
    return open_deadline_timer(nonblocking)[0]


def open_deadline_timer(nonblocking: bool = False) -> tuple[DeadlineTimer | None, str | None]:
    """`deadline_timer` and, where it gives None, why: not Linux, no libc symbol, or the
    kernel refused the timer (``timerfd_create``'s error: out of file descriptors, say)."""
    if not sys.platform.startswith("linux"):
        return None, "timer file descriptors are Linux's"
    global _libc
    try:
        # PyDLL: the calls keep the GIL (a system call of a microsecond; releasing the GIL
        # around it would let another thread take it and make this one wait to get it back).
        # Made once: each PyDLL's function-pointer types are reference cycles, left to a
        # full collection (a timer made during a server's load would leave them behind)
        if _libc is None:
            _libc = ctypes.PyDLL(None, use_errno=True)
        return DeadlineTimer(_libc, nonblocking), None
    except TimerError as exc:  # the symbol is there; the kernel said no
        return None, str(exc)
    except (OSError, AttributeError):
        return None, "libc has no timerfd_create"


_libc: ctypes.PyDLL | None = None


__all__ = ["DeadlineTimer", "deadline_timer", "open_deadline_timer"]

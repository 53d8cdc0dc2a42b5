"""An asyncio event loop's lag, measured from outside the loop, and why it was late.

`TimerLagProbe` samples how late the loop runs the reader callback of a timer file descriptor
that becomes readable at a known instant (the lag a socket's data sees); `LoopLagProbe`, how
late it runs a callback handed to it from another thread at a known instant (that counts in the
thread's own wait for the GIL and a CPU). `lag_causes` puts every late sample down to the
garbage collector (`GcPauses`), the loop's own callbacks, the probe thread, or a wait for a CPU
(`RunQueueClock`), for the GIL or the machine. Used by ``orchestra bench serve --mode
asyncio``; usable beside any asyncio server.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import random
import sys
import threading
import time
import weakref
from typing import Any

from orchestra.errors import BenchConfigError, CallOrderError
from orchestra.serve.timer import DeadlineTimer, open_deadline_timer


def _check_gap(gap_s: float) -> None:
    """A probe's mean gap between instants: a positive, finite number of seconds (0 had it
    fire on every loop turn; NaN and infinity failed when it ran)."""
    if not 0 < gap_s < float("inf"):
        raise BenchConfigError(f"a lag probe's gap_s is {gap_s!r}: give a positive number of "
                               f"seconds (the default, 0.001, samples about every ms)")


class GcPauses:
    """Collections of the cyclic garbage collector while installed: (start s, end s, gen)."""

    def __init__(self):
        self.pauses: list[tuple[float, float, int]] = []
        self._t = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses.append((self._t, time.perf_counter(), info["generation"]))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


LAG_BOUND_MS = 1.0  # the goal: the event loop's lag never above 1 ms


def overlap_ms(spans, t0: float, t1: float) -> float:
    """How much of the window ``t0``-``t1`` (s) the ``spans`` (``(start s, end s, ...)``
    each, in any order) cover, in ms: where spans overlap one another (the stalls of two
    probes, say), that time counts once."""
    inside = sorted((max(t0, s[0]), min(t1, s[1])) for s in spans if s[1] > t0 and s[0] < t1)
    total, end = 0.0, t0
    for a, b in inside:  # the union of the clipped spans, in order of their starts
        if b > end:
            total += b - max(a, end)
            end = b
    return total * 1e3


def host_stalled(sample, host_stalls, bound_ms: float = LAG_BOUND_MS) -> bool:
    """Whether the sample (the form `lag_causes` takes) would have been within ``bound_ms``
    without the host stalls (``(start s, end s)`` each) that overlap the time its callback
    waited (the window's last ``lag`` ms)."""
    t1, lag = sample[1], sample[2]
    return bool(host_stalls) and lag - overlap_ms(host_stalls, t1 - lag / 1e3, t1) <= bound_ms


MACHINE_STALL = "machine stall (a separate process stalled at the same time)"
PROBE_WAIT = "probe thread late handing over (waiting for the GIL or a CPU; the loop was running)"


def lag_causes(samples, pauses, bound_ms: float = LAG_BOUND_MS, host_stalls=()) -> dict:
    """Why the probe woke late, for every sample above ``bound_ms`` (`lag_cause` each).
    Returns ``{cause: {"count", "max_ms"}}``."""
    out: dict = {}
    # read once per sample each: an iterator (a generator of stalls) would be used up by the
    # first late sample
    pauses, host_stalls = list(pauses), list(host_stalls or ())
    for sample in samples:
        cause = lag_cause(sample, pauses, bound_ms, host_stalls)
        if cause is None:
            continue
        c = out.setdefault(cause, {"count": 0, "max_ms": 0.0})
        c["count"] += 1
        c["max_ms"] = max(c["max_ms"], sample[2])
    return out


def lag_cause(sample, pauses, bound_ms: float = LAG_BOUND_MS, host_stalls=()) -> str | None:
    """Why one sample was late (None: it was within ``bound_ms``).

    ``sample``: ``(start s, end s, lag ms, loop-thread CPU ms)``, optionally with a fifth
    item: the ms the loop thread spent runnable but not running in the window (waiting for a
    CPU: the scheduler's run-queue wait, `RunQueueClock`; None where unknown), and a sixth:
    how late the probe's own thread handed the callback over (`LoopLagProbe`; None where no
    thread hands it over, `TimerLagProbe`). ``pauses``:
    `GcPauses.pauses`. ``host_stalls``: ``(start s, end s)`` stalls a separate process saw
    (`orchestra.serve.host_stalls.HostStallProbe`).

    A late wake-up is put down to the garbage collector when its pauses within the window
    cover half the lag or more; else to the loop's own callbacks when the loop thread was on
    a CPU for at least half the window (it ran callbacks: too much work per loop iteration),
    unless the probe's own thread handed the callback over so late that without that delay
    the lag would have been within ``bound_ms`` (`PROBE_WAIT`: the loop was running and the
    probe thread waited, for the GIL the running loop held or for a CPU; a socket that
    became ready then waited only the rest, which was within the bound);
    else to waiting: the loop thread was ready but did not run. With the run-queue wait
    known, a wait for a CPU when that wait covers half the lag or more (more runnable threads
    than CPUs). A wait that is not for a CPU is put down to the machine (`MACHINE_STALL`)
    when, without the host stalls while the callback waited, the lag would have been within
    ``bound_ms`` (`host_stalled`); else to the GIL (asleep while another thread ran Python),
    or, with the run-queue wait unknown, to "the GIL or a CPU".
    """
    t0, t1, lag, cpu = sample[:4]
    rq = sample[4] if len(sample) > 4 else None
    if lag <= bound_ms:
        return None
    if overlap_ms(pauses, t0, t1) >= lag / 2:
        gens = [g for a, b, g in pauses if b > t0 and a < t1]
        return f"garbage collector (generation {max(gens)})"
    if cpu >= (t1 - t0) * 1e3 / 2:
        own = sample[5] if len(sample) > 5 else None
        if own is not None and lag - own <= bound_ms:
            return PROBE_WAIT
        return "loop busy running callbacks"
    if rq is not None and rq >= lag / 2:
        return "loop thread waiting for a CPU (runnable, all CPUs busy)"
    if host_stalled(sample, host_stalls, bound_ms):
        return MACHINE_STALL
    if rq is None:
        return "loop thread waiting for the GIL or a CPU"
    return "loop thread waiting for the GIL"


class RunQueueClock:
    """The calling thread's time spent runnable but not running (waiting for a CPU), in ns,
    from Linux's ``/proc/thread-self/schedstat`` (its second field). Read through
    ``ctypes.PyDLL`` (``pread``, the GIL kept: released, the probe reading it would itself
    wait for the GIL). `open` returns None where the file or libc is missing; a call returns
    None when a read fails. `close` closes the file (a clock dropped unclosed closes it when
    it is collected: a probe never stopped leaks no fd).

    Thread-safety: made and read on one thread (the file is that thread's).
    """

    _pread: Any = None  # libc's pread through PyDLL, made once (a new PyDLL per probe would
    # leave its function-pointer type's reference cycle to the collector)

    _Buf = ctypes.c_char * 128  # one type (create_string_buffer makes one per call: a cycle)

    def __init__(self, fd: int):
        self._fd = fd
        self._buf = RunQueueClock._Buf()
        # the fd closed with the clock when its owner forgets `close` (a probe never stopped)
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls) -> RunQueueClock | None:
        if not sys.platform.startswith("linux"):
            return None
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        clock = None
        try:
            if RunQueueClock._pread is None:
                pread = ctypes.PyDLL(None, use_errno=True).pread
                pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                  ctypes.c_long]
                pread.restype = ctypes.c_ssize_t
                RunQueueClock._pread = pread
            clock = cls(fd)
            if clock() is not None:
                return clock
        except (OSError, AttributeError):  # no libc symbol: no run-queue clock
            pass
        if clock is not None:
            clock.close()  # its finalizer owns the fd now
        else:
            os.close(fd)
        return None

    def __call__(self) -> int | None:
        """The run-queue wait so far (ns), or None if the file could not be read or parsed
        (the probe then records the wait as unknown)."""
        n = RunQueueClock._pread(self._fd, self._buf, 127, 0)
        fields = self._buf.raw[:n].split() if n > 0 else []
        return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None

    def close(self) -> None:
        self._fd = -1
        self._closer()  # once: a second call does nothing


class _LagSampler:
    """What both lag probes share: the loop, the instants' mean gap and seed, the samples, and
    each sample's clocks on the loop's thread (the window since the sample before, the loop
    thread's CPU time and its run-queue wait in it)."""

    kind = ""  # "thread" or "timerfd": which probe measured (the bench's rows say it)

    def __init__(self, loop: asyncio.AbstractEventLoop, gap_s: float = 0.001, seed: int = 0):
        _check_gap(gap_s)
        self.loop, self.gap_s, self.seed = loop, gap_s, seed
        self.samples: list[tuple] = []
        self._rq: RunQueueClock | None = None
        self._last: tuple = ()

    def _open_clocks(self) -> None:  # on the loop's thread: the clocks read are that thread's
        self._rq = RunQueueClock.open()
        self._last = self._clocks()

    def _close_clocks(self) -> None:
        if self._rq is not None:
            self._rq.close()
            self._rq = None

    def _clocks(self) -> tuple:
        rq = self._rq() if self._rq is not None else None
        return time.perf_counter(), time.thread_time(), rq

    def _sample(self, due: float, own_ms: float | None) -> float:
        """One sample of a callback due at ``due`` (s) running now; returns now (s)."""
        t1, c1, q1 = now = self._clocks()
        t0, c0, q0 = self._last
        self._last = now
        self.samples.append((t0, t1, (t1 - due) * 1e3, (c1 - c0) * 1e3,
                             (q1 - q0) / 1e6 if q1 is not None and q0 is not None else None,
                             own_ms))
        return t1


class LoopLagProbe(_LagSampler):
    """An event loop's lag, measured from outside it: how late the loop runs a callback
    handed to it, from a thread of the probe's own, at an instant picked in advance.

    The thread sleeps until each instant, then hands the loop a callback
    (``loop.call_soon_threadsafe``, which wakes the loop's selector as a readable socket
    does); the sample is the time from the instant until the callback runs, in ms. That is how
    long anything that becomes ready (a connection, a response, a completion) waits for the
    loop: the rest of the iteration under way, then the callbacks ahead of it. The gaps between
    instants are drawn at random, uniform in 0.5-1.5 x ``gap_s`` (seeded; s, positive and
    finite, else `BenchConfigError`): a probe re-armed when it wakes keeps the phase of
    whatever woke the loop, and samples the same moment of a periodic stall each time. The
    loop's timers are not used: uvloop's count whole ms from the start of an iteration
    (libuv's loop time), so a timer there fires up to 1 ms early and a timer-based probe
    reads up to 1 ms low; asyncio's own loop rounds its selector's timeout up to whole ms.

    Each sample also counts in the probe's own costs, so it reads a little high, never low:
    its thread's oversleep (the thread asks Linux for a 1 ns timer slack,
    ``prctl(PR_SET_TIMERSLACK)``, instead of the default 50 µs) and the loop's wake-up. Its
    thread holds the GIL for a few µs per sample; while another thread holds the GIL, the
    sample is late by that wait too, as the loop is. Its largest cost is measured apart: how
    late its thread handed the callback over (the time from the instant to the hand-over:
    the oversleep, its wait for a CPU, and its wait for the GIL, which a loop that runs
    callbacks back to back holds for up to ``sys.getswitchinterval()``, 5 ms, before it is
    made to let go). A socket that becomes ready needs no thread to run and no GIL;
    `lag_cause` puts a sample down to the probe (`PROBE_WAIT`) when that delay is what broke
    the bound, and `TimerLagProbe` measures without a thread at all.

    `stop` returns the samples, one per callback run, each ``(start s, end s, lag ms,
    loop-thread CPU ms, run-queue wait ms or None, hand-over delay ms)``: the window from the
    previous sample's end to this one's (``time.perf_counter``), the lag, the loop thread's
    CPU time in the window (``time.thread_time``) and its wait for a CPU in it
    (`RunQueueClock`, None where Linux does not say), and how late the probe's thread handed
    the callback over: the form `lag_causes` takes.

    Thread-safety: `start` and `stop` are called on the loop's thread (the CPU and run-queue
    clocks read are that thread's), once each, in that order.
    """

    kind = "thread"

    def __init__(self, loop: asyncio.AbstractEventLoop, gap_s: float = 0.001, seed: int = 0):
        super().__init__(loop, gap_s, seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling (on the loop's thread). A probe starts once (`CallOrderError`
        again: make a new one)."""
        if self._thread is not None:
            raise CallOrderError("this LoopLagProbe was started already; make a new one")
        self._open_clocks()
        self._thread = threading.Thread(target=self._hand_over, daemon=True,
                                        name="orchestra-loop-lag-probe")
        self._thread.start()

    def stop(self) -> list[tuple]:
        """Stop sampling (on the loop's thread) and return the samples. Callbacks already
        handed over and not yet run are dropped; the thread is joined (it sleeps at most
        1.5 x ``gap_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._close_clocks()
        return self.samples

    def _ran(self, due: float, own_ms: float) -> None:  # on the loop: one sample
        if not self._stop.is_set():
            self._sample(due, own_ms)

    def _hand_over(self) -> None:  # the probe's thread
        _fine_timer_slack()
        rnd, clock, gap = random.Random(self.seed), time.perf_counter, self.gap_s
        due = clock() + gap * rnd.uniform(0.5, 1.5)
        while not self._stop.is_set():
            wait = due - clock()
            if wait > 0:
                time.sleep(wait)
            # the probe's own delay: its oversleep, then its waits for a CPU and for the GIL
            # (time.sleep takes the GIL back before it returns)
            own_ms = (clock() - due) * 1e3
            try:
                self.loop.call_soon_threadsafe(self._ran, due, own_ms)
            except RuntimeError:  # the loop was closed under the probe: nothing to measure
                return
            # from the later of the instant and now: a sample that was itself late (the GIL)
            # does not make the next ones come in a burst
            due = max(due, clock()) + gap * rnd.uniform(0.5, 1.5)


class TimerLagProbe(_LagSampler):
    """An event loop's lag as a socket sees it: a timer file descriptor (a non-blocking
    `orchestra.serve.timer.DeadlineTimer`, armed at absolute instants) the loop watches
    (``loop.add_reader``) becomes readable at an instant picked in advance, and the sample is
    the time from that instant until the loop runs its reader callback, in ms: the rest of the
    iteration under way, the loop's poll, then the callbacks ahead of it. No
    thread of the probe's own is involved, so neither a thread's wait for a CPU nor its wait
    for the GIL is counted in (`LoopLagProbe` counts both); the loop thread's own waits (for
    the GIL held by another thread, for a CPU, a machine stall) are, as they delay a socket's
    data too. The instants are drawn as `LoopLagProbe`'s (uniform 0.5-1.5 x ``gap_s`` apart,
    seeded), each from the later of the one before and the callback that read it; the timer
    is armed from the callback (``timerfd_settime``, a few µs on the loop per sample).

    `stop` returns the samples in `LoopLagProbe`'s form, ``(start s, end s, lag ms,
    loop-thread CPU ms, run-queue wait ms or None, None)``: no probe thread, so no wait of
    its own. `unavailable` says why it cannot run on this machine (None: it can).

    Thread-safety: `start` is called on the loop's thread while the loop runs, `stop` on
    that thread after it (also once the loop is closed), once each, in that order (`stop`
    again is a no-op).
    """

    kind = "timerfd"

    def __init__(self, loop: asyncio.AbstractEventLoop, gap_s: float = 0.001, seed: int = 0):
        super().__init__(loop, gap_s, seed)
        self._timer: DeadlineTimer | None = None
        self._started = False
        self._due = 0.0
        self._rnd = random.Random(seed)

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot run the probe (None: it can)."""
        timer, why = TimerLagProbe._open_timer()
        if timer is not None:
            timer.close()
        return why

    @staticmethod
    def _open_timer() -> tuple[DeadlineTimer | None, str | None]:
        timer, why = open_deadline_timer(nonblocking=True)  # why not: not Linux, no timerfd
        if timer is not None and (time.get_clock_info("perf_counter").implementation
                                  != "clock_gettime(CLOCK_MONOTONIC)"):
            timer.close()  # its instants would not be perf_counter's
            return None, "time.perf_counter is not CLOCK_MONOTONIC here"
        return timer, why

    def start(self) -> None:
        """Start sampling (on the loop's thread). Raises `BenchConfigError` where
        `unavailable` says why not; a probe starts once (`CallOrderError` again: make a new
        one)."""
        if self._started:
            raise CallOrderError("this TimerLagProbe was started already; make a new one")
        timer, why = self._open_timer()
        if timer is None:
            raise BenchConfigError(f"the timer-fd lag probe cannot run here: {why}; use "
                                   f"LoopLagProbe (a thread's callbacks) instead")
        self._timer, self._started = timer, True
        self._open_clocks()
        self._due = self._last[0] + self.gap_s * self._rnd.uniform(0.5, 1.5)
        try:
            timer.arm_at(self._due)
            self.loop.add_reader(timer.fd, self._ran)
        except BaseException:
            self._close()
            raise

    def stop(self) -> list[tuple]:
        """Stop sampling (on the loop's thread) and return the samples; the timer's fd is
        closed (also when the loop was closed first: it dropped the reader then)."""
        if self._timer is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._timer.fd)
            self._close()
        return self.samples

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.close()
            self._timer = None
        self._close_clocks()

    def _ran(self) -> None:  # the loop's reader callback: one sample, the next instant armed
        timer = self._timer
        if timer is None or not timer.expired():
            return
        t1 = self._sample(self._due, None)  # no thread: no hand-over delay
        self._due = max(self._due, t1) + self.gap_s * self._rnd.uniform(0.5, 1.5)
        timer.arm_at(self._due)


def _fine_timer_slack() -> None:
    """Ask Linux for a 1 ns timer slack for the calling thread (``prctl(PR_SET_TIMERSLACK)``):
    its sleeps then end within µs of their deadline instead of up to 50 µs after it. Nothing
    where that is not available."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return
    try:
        if _prctl is None:  # made once: a CDLL's function-pointer types are reference cycles
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl(29, 1, 0, 0, 0)  # 29: PR_SET_TIMERSLACK, in ns
    except (OSError, AttributeError):
        pass


_prctl: Any = None


LAG_PROBES = ("auto", "timerfd", "thread")


def make_lag_probe(loop: asyncio.AbstractEventLoop, kind: str = "auto",
                   gap_s: float = 0.001) -> tuple[TimerLagProbe | LoopLagProbe, str | None]:
    """The lag probe ``kind`` for ``loop`` and, where ``"auto"`` could not have the timer
    probe, why not. ``"auto"``: `TimerLagProbe` where this machine has timer file descriptors,
    else `LoopLagProbe`; ``"timerfd"``: `TimerLagProbe` (`BenchConfigError` where it cannot
    run); ``"thread"``: `LoopLagProbe`."""
    if kind not in LAG_PROBES:
        raise BenchConfigError(f"lag probe {kind!r}: use one of {', '.join(LAG_PROBES)}")
    if kind == "thread":
        return LoopLagProbe(loop, gap_s), None
    why = TimerLagProbe.unavailable()
    if why is None:
        return TimerLagProbe(loop, gap_s), None
    if kind == "timerfd":
        raise BenchConfigError(f"--lag-probe timerfd cannot run here: {why}; use "
                               f"--lag-probe thread")
    return LoopLagProbe(loop, gap_s), why

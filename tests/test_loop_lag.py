"""`TimerLagProbe` and `LoopLagProbe` measure an event loop's lag from outside it: real stalls of
known length on a real loop (asyncio's own and, where installed, uvloop), read back from the
samples; a loop busy with short callbacks back to back reads as short lag through the timer fd,
and the thread probe's lateness is its own; the thread ends with `stop` or with the loop."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

import numpy as np
import pytest

from orchestra.errors import BenchConfigError
from orchestra.serve import loop_lag
from orchestra.serve.loop_lag import PROBE_WAIT, LoopLagProbe, TimerLagProbe, lag_cause, make_lag_probe
from orchestra.serve.timer import deadline_timer

try:
    import uvloop
except ImportError:  # the uvloop extra
    uvloop = None

LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    uvloop is None, reason="uvloop not installed (pip install 'orchestra[uvloop]')"))]


def run_on(loop_kind: str, main):
    if loop_kind == "uvloop":
        return uvloop.run(main())
    return asyncio.run(main())


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="timer file descriptors are Linux's")
PROBES = [pytest.param(TimerLagProbe, marks=linux, id="timerfd"),
          pytest.param(LoopLagProbe, id="thread")]


@pytest.mark.parametrize("probe_cls", PROBES)
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_probe_reads_stalls_of_the_loop_at_their_length(loop_kind, probe_cls):
    """20 stalls of 3 ms (a callback spinning on the loop, at random moments): samples that
    came due during a stall read its remaining length, so the longest is close to 3 ms;
    no sample is negative, and the windows chain."""

    async def main():
        probe = probe_cls(asyncio.get_running_loop(), seed=3)
        probe.start()
        rnd = random.Random(5)
        try:
            for _ in range(20):
                await asyncio.sleep(rnd.uniform(0.004, 0.008))
                spin(0.003)
            await asyncio.sleep(0.005)
        finally:
            samples = probe.stop()
        return samples

    samples = run_on(loop_kind, main)
    lag = np.array([s[2] for s in samples])
    assert len(samples) > 50, len(samples)  # about one per ms over ~0.2 s
    assert lag.min() >= 0.0, lag.min()
    # a sample is due at a random moment of the stall it falls in: over 20 stalls one came
    # due in the first third of one (the chance that none did is below 1e-6)
    assert lag.max() >= 2.0, sorted(lag)[-5:]
    for prev, cur in zip(samples, samples[1:]):
        assert cur[0] == prev[1]  # each window starts where the one before ended


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_stop_joins_the_thread_and_drops_callbacks_still_queued(loop_kind):
    async def main():
        probe = LoopLagProbe(asyncio.get_running_loop(), gap_s=0.0005)
        probe.start()
        await asyncio.sleep(0.05)
        spin(0.004)  # the thread hands over callbacks meanwhile: queued, not yet run
        samples = probe.stop()
        n = len(samples)
        await asyncio.sleep(0.01)  # the queued ones run now, and are dropped
        return probe, samples, n

    probe, samples, n = run_on(loop_kind, main)
    assert n > 10 and len(samples) == n
    assert not probe._thread.is_alive()


def started_on(loop, probe_cls, gap_s: float = 0.0005):
    """A probe of ``probe_cls`` started on ``loop`` (not running yet), after 10 ms of
    sampling there; the loop is left as it is (open, not running)."""
    probe = probe_cls(loop, gap_s=gap_s)

    async def start():
        probe.start()
        await asyncio.sleep(0.01)

    loop.run_until_complete(start())
    return probe


def test_the_thread_ends_when_the_loop_is_closed_under_it():
    loop = asyncio.new_event_loop()
    probe = started_on(loop, LoopLagProbe)
    loop.close()  # without stop: the next hand-over finds the loop closed
    probe._thread.join(timeout=2)
    assert not probe._thread.is_alive()
    probe.stop()  # still safe, and idempotent
    probe.stop()


@linux
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_loop_busy_with_short_callbacks_reads_short_and_the_thread_probes_delay_is_its_own(
        loop_kind):
    """0.3 s of 0.1 ms callbacks back to back (the loop never sleeps, and polls between them):
    a timer fd's reader waits one callback and a poll, so the timer probe reads well under
    1 ms. The thread probe's thread waits for the GIL the running loop holds, tens of ms at a
    time (it may hand nothing over at all): however late its samples are, the hand-over
    delay takes all but the loop's part, and a sample above 1 ms of a loop that ran is put
    down to the probe."""

    async def busy(probe_cls):
        loop = asyncio.get_running_loop()
        end = time.perf_counter() + 0.3
        done = loop.create_future()

        def step():
            spin(0.0001)
            if time.perf_counter() < end:
                loop.call_soon(step)
            else:
                done.set_result(None)

        probe = probe_cls(loop, seed=1)
        probe.start()
        loop.call_soon(step)
        try:
            await done
        finally:
            samples = probe.stop()
        return samples

    timer = run_on(loop_kind, lambda: busy(TimerLagProbe))
    lag = np.array([s[2] for s in timer])
    assert len(timer) > 100, len(timer)  # about one per ms over 0.3 s
    assert np.median(lag) < 0.5, sorted(lag)[-5:]
    assert all(s[5] is None for s in timer)  # no thread: no hand-over delay
    thread = run_on(loop_kind, lambda: busy(LoopLagProbe))
    for s in thread:
        assert s[2] - s[5] < 1.0, s  # the loop's part, after the hand-over
        if s[2] > 1.0 and s[3] >= (s[1] - s[0]) * 1e3 / 2:  # the loop ran (not preempted)
            assert lag_cause(s, []) == PROBE_WAIT, s


@linux
def test_the_timer_probe_stops_watching_and_closes_its_fd():
    async def main():
        loop = asyncio.get_running_loop()
        probe = TimerLagProbe(loop, gap_s=0.0005)
        probe.start()
        fd = probe._timer.fd
        await asyncio.sleep(0.03)
        samples = list(probe.stop())
        probe.stop()  # again: nothing
        await asyncio.sleep(0.01)  # no reader left: no more samples
        return fd, samples, probe

    fd, samples, probe = asyncio.run(main())
    assert len(samples) > 10 and probe.samples == samples
    with pytest.raises(OSError):
        os.fstat(fd)


@linux
def test_a_timer_armed_at_an_instant_fires_then_and_not_before():
    """`DeadlineTimer.arm_at` takes time.perf_counter's instants (CLOCK_MONOTONIC)."""
    timer = deadline_timer(nonblocking=True)
    assert timer is not None
    try:
        due = time.perf_counter() + 0.005
        timer.arm_at(due)
        assert not timer.expired()  # not yet, and the read did not block
        while not timer.expired():
            pass
        now = time.perf_counter()
        assert due <= now < due + 0.002, (now - due) * 1e3
    finally:
        timer.close()


def test_make_lag_probe_picks_the_timer_where_it_can_and_says_why_not(monkeypatch):
    loop = asyncio.new_event_loop()
    try:
        probe, why = make_lag_probe(loop, "thread")
        assert isinstance(probe, LoopLagProbe) and why is None
        with pytest.raises(BenchConfigError, match="use one of auto, timerfd, thread"):
            make_lag_probe(loop, "socket")
        if sys.platform.startswith("linux"):
            probe, why = make_lag_probe(loop, "auto")
            assert isinstance(probe, TimerLagProbe) and why is None

        monkeypatch.setattr(loop_lag.sys, "platform", "darwin")
        assert TimerLagProbe.unavailable() == "timer file descriptors are Linux's"
        monkeypatch.undo()
        monkeypatch.setattr(TimerLagProbe, "_open_timer",
                            staticmethod(lambda: (None, "no timerfd in this test")))
        probe, why = make_lag_probe(loop, "auto")
        assert isinstance(probe, LoopLagProbe) and why == "no timerfd in this test"
        with pytest.raises(BenchConfigError, match="--lag-probe thread"):
            make_lag_probe(loop, "timerfd")
        with pytest.raises(BenchConfigError, match="no timerfd in this test"):
            TimerLagProbe(loop).start()
    finally:
        loop.close()


@linux
@pytest.mark.parametrize("probe_cls", PROBES)
def test_a_probe_starts_once(probe_cls):
    from orchestra.errors import CallOrderError

    async def main():
        probe = probe_cls(asyncio.get_running_loop(), gap_s=0.0005)
        probe.start()
        try:
            with pytest.raises(CallOrderError, match="make a new one"):
                probe.start()
            await asyncio.sleep(0.01)
        finally:
            samples = probe.stop()
        return samples

    assert run_on("asyncio", main)  # the first start still samples


@linux
@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_timer_probes_fd_is_closed_when_the_loop_closes_first_or_it_is_dropped(loop_kind):
    import gc

    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    probe = started_on(loop, TimerLagProbe)
    fd = probe._timer.fd
    loop.close()  # before stop: the loop dropped the reader
    assert probe.stop() and probe._timer is None  # the samples so far; the fd closed
    with pytest.raises(OSError):
        os.fstat(fd)
    loop = asyncio.new_event_loop()
    probe = started_on(loop, TimerLagProbe, gap_s=0.001)
    fd = probe._timer.fd
    loop.close()
    del probe  # never stopped: the timer's finalizer closes its fd
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


def _schedstat_fds() -> set[str]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").endswith("/schedstat"):
                out.add(name)
        except OSError:  # the listing's own fd, gone already
            pass
    return out


@linux
@pytest.mark.parametrize("probe_cls", PROBES)
def test_a_probe_never_stopped_leaves_no_fd_open_once_dropped(probe_cls):
    """A probe never stopped, its loop closed and the probe dropped: no fd of its own stays
    open (the timer's and the run-queue clock's schedstat file both close with them)."""
    import gc

    before = _schedstat_fds()
    loop = asyncio.new_event_loop()
    probe = started_on(loop, probe_cls)
    assert probe._rq is not None  # this machine has the run-queue clock: it is the point
    assert _schedstat_fds() - before
    loop.close()
    if isinstance(probe, LoopLagProbe):
        probe._thread.join(1)  # its thread ends with the loop
    del probe
    gc.collect()
    assert _schedstat_fds() - before == set()


@linux
def test_a_timer_armed_at_the_past_fires_at_once_and_far_ahead_or_never_does_not():
    """`arm_at`: an instant passed (0, negative) expires at once; one beyond the clock's range
    (huge, infinity) is "never", not a wrapped-around instant (2.0 ** 64 s read as 0 disarmed
    the timer); NaN is refused as a `TimerError`, as `arm` refuses it."""
    import ctypes

    from orchestra.serve import timer as timer_mod
    from orchestra.serve.errors import TimerError

    timer = deadline_timer(nonblocking=True)
    assert timer is not None
    spec = timer_mod._Itimerspec()

    def left_s():
        assert timer_mod._libc.timerfd_gettime(timer.fd, ctypes.byref(spec)) == 0
        return spec.it_value.tv_sec + spec.it_value.tv_nsec / 1e9

    try:
        for past in (0, -1, -1e30, float("-inf"), time.perf_counter() - 1):
            timer.arm_at(past)
            time.sleep(0.001)
            assert timer.expired(), past
        for far in (1e12, 2.0 ** 63, 2.0 ** 64, 2.0 ** 65 + 3600, 1e30, float("inf")):
            timer.arm_at(far)
            assert left_s() > 1e8 and not timer.expired(), far  # armed, years ahead
        for far in (2 ** 64 * 10 ** 9 + 10 ** 9, 10 ** 30, float("inf")):
            timer.arm(far)
            assert left_s() > 1e8 and not timer.expired(), far
        for nan in (float("nan"),):
            with pytest.raises(TimerError, match="NaN"):
                timer.arm_at(nan)
            with pytest.raises(TimerError, match="NaN"):
                timer.arm(nan)
    finally:
        timer.close()


@pytest.mark.parametrize("probe_cls", PROBES)
@pytest.mark.parametrize("gap_s", [0, -0.001, float("nan"), float("inf")])
def test_a_probe_refuses_a_gap_that_is_not_a_positive_number_of_seconds(probe_cls, gap_s):
    """0 or less had the probe fire on every loop turn (the probe itself the loop's load);
    NaN and infinity failed in `start` (timer) or killed the probe's thread (thread)."""
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(BenchConfigError, match="gap_s"):
            probe_cls(loop, gap_s=gap_s)
    finally:
        loop.close()


@linux
def test_a_timer_that_could_not_be_made_says_why_not_that_libc_lacks_it(monkeypatch):
    """Out of file descriptors (timerfd_create: EMFILE), the timer probe's reason is that,
    not "libc has no timerfd_create" (which sent the user looking for another libc)."""
    import errno

    from orchestra.serve import timer as timer_mod
    from orchestra.serve.errors import TimerError

    def refuse(self, libc, nonblocking=False):
        raise TimerError(errno.EMFILE, "timerfd_create: Too many open files")

    monkeypatch.setattr(timer_mod.DeadlineTimer, "__init__", refuse)
    assert deadline_timer() is None  # the engine still falls back to its condition variable
    why = TimerLagProbe.unavailable()
    assert why is not None and "Too many open files" in why, why
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(BenchConfigError, match="Too many open files"):
            make_lag_probe(loop, "timerfd")
    finally:
        loop.close()

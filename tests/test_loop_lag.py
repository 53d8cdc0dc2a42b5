"""`LoopLagProbe` measures an event loop's lag from outside it: real stalls of known length on a
real loop (asyncio's own and, where installed, uvloop), read back from the samples; its thread
ends with `stop` or with the loop."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from orchestra.serve.loop_lag import LoopLagProbe

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


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_probe_reads_stalls_of_the_loop_at_their_length(loop_kind):
    """20 stalls of 3 ms (a callback spinning on the loop, at random moments): samples that
    came due during a stall read its remaining length, so the longest is close to 3 ms;
    no sample is negative, and the windows chain."""

    async def main():
        probe = LoopLagProbe(asyncio.get_running_loop(), seed=3)
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


def test_the_thread_ends_when_the_loop_is_closed_under_it():
    loop = asyncio.new_event_loop()
    probe = LoopLagProbe(loop, gap_s=0.0005)

    async def start():
        probe.start()
        await asyncio.sleep(0.01)

    loop.run_until_complete(start())
    loop.close()  # without stop: the next hand-over finds the loop closed
    probe._thread.join(timeout=2)
    assert not probe._thread.is_alive()
    probe.stop()  # still safe, and idempotent
    probe.stop()

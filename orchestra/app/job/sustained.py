"""Sustained per-item times on the GPU: K back-to-back items behind a gate.

Timing one copy alone measures its launch latency and the clocks of an idle GPU along with the
copy; a full pipeline hides both. So the bound (`orchestra.app.job.bound`) is built from
*sustained* times: K items of one kind enqueued back to back, elapsed / K. Enqueueing from
Python is slower than a small copy runs, so the stream is first held by a gate kernel (one
thread spinning on ``%globaltimer``) while the host enqueues the K items; the start event is
recorded behind the gate, so the elapsed time is the GPU's alone. The gate is scaled from the
host's measured enqueue time (3x the warm-up's, at least `MIN_GATE_MS`); a sample whose
enqueue outlasted 80% of its gate is taken again with the gate doubled (up to 3 times).

Measured per item of ``nbytes`` (`BatchTimer.sustained`): K H2Ds on one stream; K D2Hs; K
kernels on one stream and spread round-robin over several streams (kernels smaller than the
GPU overlap across streams, as round-robin and concurrent-kernel plans let them; the faster
counts); K H2Ds on one stream while K D2Hs run on another (per pair). Every kind is also
spread over the plan's streams (`BatchTimer.sustained`), and K grows to `ITEMS_PER_STREAM`
per stream for plans of many streams (`items_for`).

When the run is a CUDA graph, the "enqueue" the gate holds the stream for is one
``cuGraphLaunch`` of the K items captured into a graph beforehand
(`orchestra.driver.captured.CapturedGraph`): the same gate, events and median, and the GPU
time is that of the items as a graph runs them.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

#: The gate kernel: one thread holds its stream for ``ns`` nanoseconds of GPU time.
GATE_SOURCE = r"""
extern "C" __global__ void orchestra_gate(unsigned long long ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""
MIN_GATE_MS = 0.5
SIZING_GATE_MS = 20.0  # the untimed run that measures the host's enqueue time
MAX_ITEMS = 16
#: Items per stream when the items are spread over many streams (a lane plan's concurrency):
#: with one item per stream the elapsed time is one item's latency plus the streams' start
#: skew, not a rate; enough back to back on each stream make it one (on an H200, 4 per stream
#: left the first item's latency in the rate: a 16-lane run of 64 KiB copy kernels beat its
#: bound by 2-6%; 16 per stream amortize it).
ITEMS_PER_STREAM = 16
ITEM_BYTES_BUDGET = 1 << 30  # K * item bytes stays under this (huge items need few of them)


def items_for(batches: int, nbytes: int, max_items: int = MAX_ITEMS, *,
              streams: int = 1) -> int:
    """K for a pipeline of ``batches`` batches of ``nbytes`` whose plan runs on ``streams``
    streams: as many as the pipeline has, at most the larger of ``max_items`` and
    `ITEMS_PER_STREAM` per stream, and at most 1 GiB of items (at least 1)."""
    most = max(int(max_items), ITEMS_PER_STREAM * max(1, int(streams)))
    return max(1, min(int(batches), most, ITEM_BYTES_BUDGET // max(1, int(nbytes))))


class GatedTimer:
    """Times work held behind a gate on ``stream`` (`orchestra.driver.Stream`).

    `elapsed_ms(enqueue, others)`: gate ``stream``, fork each stream of ``others`` from it
    (an event after the gate), record the start event, call ``enqueue()`` (which enqueues on
    ``stream`` and ``others``), join ``others`` back, record the end event, wait; returns the
    GPU ms between the events. `median_ms` repeats that. `close()` frees the events.

    Thread-safety: not thread-safe: its gate, fork and timing events are reused by every
    measurement; use one per thread, from the thread that enqueues the timed work.
    """

    def __init__(self, stream, *, repeats: int = 5, warmup: int = 1,
                 gate_ms: float | None = None):
        from orchestra.driver import Event
        from orchestra.kernel import load_kernel

        self.stream = stream
        dev = stream.device
        self.gate = load_kernel(GATE_SOURCE, "orchestra_gate", device=dev)
        self.repeats, self.warmup = int(repeats), int(warmup)
        self.gate_ms = gate_ms
        self.start, self.end = Event(dev, timing=True), Event(dev, timing=True)
        self.fork = Event(dev)
        self._joins: list = []
        self.host_bound = False  # a sample's enqueue outlasted its gate even after doubling

    def _join_event(self, i: int):
        from orchestra.driver import Event

        while len(self._joins) <= i:
            self._joins.append(Event(self.stream.device))
        return self._joins[i]

    def _once(self, enqueue: Callable[[], None], others: Sequence, gate_ms: float
              ) -> tuple[float, float]:
        from orchestra.driver import Event

        s = self.stream
        self.gate.launch(s, 1, 1, (int(gate_ms * 1e6),))
        self.start.record(s)
        if others:
            self.fork.record(s)
            for o in others:
                o.wait(self.fork)
        t0 = time.perf_counter()
        enqueue()
        host_ms = (time.perf_counter() - t0) * 1e3
        for i, o in enumerate(others):
            j = self._join_event(i)
            j.record(o)
            s.wait(j)
        self.end.record(s)
        self.end.synchronize()
        return Event.elapsed_ms(self.start, self.end), host_ms

    def elapsed_ms(self, enqueue: Callable[[], None], others: Sequence = (),
                   gate_ms: float = MIN_GATE_MS) -> tuple[float, float]:
        """(GPU ms, the gate it needed in ms): retried with a doubled gate while the host's
        enqueue outlasted 80% of it (at most 3 times; then `host_bound` is set)."""
        gate = gate_ms
        ms, host_ms = self._once(enqueue, others, gate)
        for _ in range(3):
            if host_ms < 0.8 * gate:
                return ms, gate
            gate *= 2
            ms, host_ms = self._once(enqueue, others, gate)
        self.host_bound = host_ms >= 0.8 * gate
        return ms, gate

    def median_ms(self, enqueue: Callable[[], None], others: Sequence = ()) -> float:
        """Median GPU ms of ``repeats`` gated samples after ``warmup``. Without a given
        ``gate_ms`` one untimed run behind a generous gate first measures the host's enqueue
        time, and the gate is 3x that (at least `MIN_GATE_MS`)."""
        gate = self.gate_ms
        if gate is None:
            _, host_ms = self._once(enqueue, others, SIZING_GATE_MS)
            gate = max(MIN_GATE_MS, 3.0 * host_ms)
        samples = []
        for r in range(self.warmup + self.repeats):
            ms, gate = self.elapsed_ms(enqueue, others, gate)
            if r >= self.warmup:
                samples.append(ms)
        return statistics.median(samples)

    def close(self) -> None:
        self.stream.synchronize()
        for e in (self.start, self.end, self.fork, *self._joins):
            e.close()
        self._joins.clear()


__all__ = ["GATE_SOURCE", "GatedTimer", "ITEMS_PER_STREAM", "MAX_ITEMS", "MIN_GATE_MS",
           "items_for"]

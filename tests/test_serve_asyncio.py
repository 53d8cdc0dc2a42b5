"""The engine's asyncio path on the CPU (NumpyBackend): how many completions one loop turn
resolves, cancellation of an awaiting task whose request runs, close with awaits pending, the
loop never waiting for the engine's lock, and what a request in flight leaves for the
garbage collector to traverse. Every output is compared with numpy's."""

from __future__ import annotations

import asyncio
import collections
import gc
import math
import threading
import time

import numpy as np
import pytest

from orchestra.serve import Batching, Engine, EngineClosed
from orchestra.serve.backend import NumpyBackend
import orchestra.serve.engine as engine_mod
from orchestra.serve.engine import _LoopInbox

ROW = 4
SPEC_IN = {"x": ((ROW,), "float32")}
SPEC_OUT = {"y": ((ROW,), "float32")}


def f(x):
    return x * np.float32(2) + np.float32(1)


def row(k: int, n: int = 1) -> np.ndarray:
    return (np.arange(n * ROW, dtype=np.float32).reshape(n, ROW) + np.float32(10 * k))


def gated_engine(gate: threading.Event, entered: threading.Event | None = None, **kw):
    """An engine whose launches run on NumpyBackend's device thread and wait for ``gate``."""
    def fn(d):
        if entered is not None:
            entered.set()
        assert gate.wait(10), "the test never opened the gate"
        return f(d["x"])

    return Engine(backend=NumpyBackend(fn, device_thread=True), inputs=SPEC_IN,
                  outputs=SPEC_OUT, **kw)


async def until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.001)


def block_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


@pytest.mark.parametrize("n,k", [(50, 16), (16, 16), (7, 3), (1, 16)])
def test_a_burst_of_n_completions_is_resolved_over_ceil_n_over_k_loop_turns(n, k, monkeypatch):
    """``n`` requests complete in one batch while the loop is held; the loop then resumes
    exactly ``k`` awaiting tasks per turn (the last turn the rest), over ceil(n/k) turns,
    with one drain callback per turn; every output is right."""
    gate = threading.Event()
    per_turn = []
    outputs = {}
    drains = [0]
    drain = _LoopInbox.drain

    def counting_drain(self):
        drains[0] += 1
        drain(self)

    monkeypatch.setattr(_LoopInbox, "drain", counting_drain)

    async def main(e):
        loop = asyncio.get_running_loop()
        done = [0]

        async def task(j):
            x = row(j)
            outputs[j] = (await e.run(x), f(x))
            done[0] += 1

        tasks = [asyncio.ensure_future(task(j)) for j in range(n)]
        await until(lambda: e.stats()["engine"]["in_flight"] == 1)  # the one batch runs
        box = e._aio_boxes[loop]

        def hold():  # the whole burst completes while the loop is busy in this callback
            gate.set()
            block_until(lambda: len(box.items) == n)

        def tick(last=[0]):
            per_turn.append(done[0] - last[0])
            last[0] = done[0]
            if done[0] < n:
                loop.call_soon(tick)

        loop.call_soon(hold)
        loop.call_soon(tick)
        await asyncio.gather(*tasks)
        return box

    with gated_engine(gate, buckets=[64], batching=Batching(max_batch=n, max_delay_us=5e6),
                      completions_per_turn=k) as e:
        box = asyncio.run(main(e))
    counts = [c for c in per_turn if c]
    assert counts == [k] * (n // k) + ([n % k] if n % k else []), per_turn
    assert len(counts) == math.ceil(n / k)
    assert drains[0] == math.ceil(n / k)
    for j, (y, ref) in outputs.items():
        assert y.tobytes() == ref.tobytes(), j
    # every slot back, no delivery pending, and the shared done-callback list unchanged
    assert box.sem._value == e.queue_limit and not box.scheduled and not box.items
    assert box.callbacks == [box.push]


def test_cancelling_a_task_whose_request_runs_frees_its_slot_and_the_engine_serves_on():
    gate, entered = threading.Event(), threading.Event()

    async def main(e):
        loop = asyncio.get_running_loop()
        t = asyncio.ensure_future(e.run(row(1)))
        await until(entered.is_set)  # on the device: it cannot be taken back
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        box = e._aio_boxes[loop]
        assert box.sem._value == e.queue_limit - 1  # the request still holds its slot
        gate.set()
        await until(lambda: box.sem._value == e.queue_limit)  # completed: slot back
        y = await asyncio.wait_for(e.run(row(2, 3)), 10)
        assert y.tobytes() == f(row(2, 3)).tobytes()
        return box

    with gated_engine(gate, entered, buckets=[4], instances=1, queue_limit=8) as e:
        box = asyncio.run(main(e))
        st = e.stats()["buckets"][4]
        assert st["requests"] == 2 and st["failed"] == 0  # the cancelled one ran to the end
    assert not box.items and not box.scheduled


def test_close_with_awaits_pending_cancels_the_queued_and_completes_the_running():
    gate, entered = threading.Event(), threading.Event()

    async def main(e):
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(e.run(row(0, 2)))
        await until(entered.is_set)
        queued = [asyncio.ensure_future(e.run(row(j))) for j in range(1, 6)]
        await until(lambda: e.stats()["engine"]["queued"] == 5)
        closer = threading.Thread(target=e.close, kwargs={"cancel": True})
        closer.start()
        await until(lambda: all(t.done() for t in queued))
        for t in queued:
            assert t.cancelled()
        assert not running.done()  # it waits on the device; close() waits for it
        gate.set()
        y = await asyncio.wait_for(running, 10)
        assert y.tobytes() == f(row(0, 2)).tobytes()
        await loop.run_in_executor(None, closer.join, 10)
        assert not closer.is_alive()
        with pytest.raises(EngineClosed):
            await e.run(row(9))
        box = e._aio_boxes[loop]
        await until(lambda: box.sem._value == e.queue_limit)
        return box

    e = gated_engine(gate, entered, buckets=[4], instances=1)
    box = asyncio.run(main(e))
    assert e.closed and e.stats()["engine"]["cancelled"] == 5
    assert not box.items and not box.scheduled


def test_run_hands_over_while_another_thread_holds_the_engines_lock():
    """On the loop thread, run() takes no lock the engine's threads hold: a thread holding
    the engine's lock (as its threads do while they admit, finish and batch) does not stop
    the loop; the request completes once the lock is free, with the right output."""
    async def main(e):
        assert (await e.run(row(1))).tobytes() == f(row(1)).tobytes()  # the bridge is up
        held, release = threading.Event(), threading.Event()
        timed_out = []

        def holder():
            with e._lock:
                held.set()
                if not release.wait(5):
                    timed_out.append(True)

        h = threading.Thread(target=holder)
        h.start()
        assert held.wait(5)
        t = asyncio.ensure_future(e.run(row(2, 2)))
        for _ in range(20):
            await asyncio.sleep(0)  # the task's first step (the hand-over) ran
        assert not timed_out and not t.done()  # the loop ran on while the lock was held
        release.set()
        y = await asyncio.wait_for(t, 10)
        await asyncio.get_running_loop().run_in_executor(None, h.join, 5)
        assert not timed_out
        assert y.tobytes() == f(row(2, 2)).tobytes()

    with Engine(backend=NumpyBackend(lambda d: f(d["x"]), device_thread=True), inputs=SPEC_IN,
                outputs=SPEC_OUT, buckets=[4]) as e:
        asyncio.run(main(e))


def test_a_request_in_flight_leaves_few_objects_for_the_garbage_collector():
    """The young generation's collection traverses what requests in flight keep alive: per
    awaiting request the engine keeps one `_Req`, one `ServeFuture` (its lock and two
    lists), no done-callback list or bound method of its own and not the request list."""
    gate = threading.Event()
    n = 200
    counts: collections.Counter = collections.Counter()

    async def main(e):
        assert (await e.run(row(0))).tobytes() == f(row(0)).tobytes()  # warm: bridge, box
        gate.clear()
        xs = [row(j) for j in range(n)]
        gc.collect()
        gc.freeze()  # what was alive before: out of the count
        try:
            tasks = [asyncio.ensure_future(e.run(x)) for x in xs]
            await until(lambda: e.stats()["engine"]["queued"] == n - 1)
            gc.collect(0)
            for o in gc.get_objects(0) + gc.get_objects(1) + gc.get_objects(2):
                counts[type(o).__name__] += 1
        finally:
            gc.unfreeze()
        gate.set()
        ys = await asyncio.gather(*tasks)
        for x, y in zip(xs, ys):
            assert y.tobytes() == f(x).tobytes()

    gate.set()
    with gated_engine(gate, buckets=[1], instances=1, queue_limit=4 * n) as e:
        asyncio.run(main(e))
    assert counts["_Req"] == n and counts["ServeFuture"] == n, counts
    assert counts["list"] <= 2 * n + 20, counts  # the future's two (waiters, launches)
    assert counts["method"] <= 10, counts  # no bound done-callback per request


# -- run()'s own checks and its in-flight bound ------------------------------------------------


def test_slots_hand_a_freed_slot_to_the_first_waiter_and_skip_cancelled_ones():
    async def main():
        s = engine_mod._Slots(2)
        assert s.take() and s.take() and not s.take() and s.locked()
        order = []

        async def waiter(k):
            await s.acquire()
            order.append(k)

        ws = [asyncio.ensure_future(waiter(k)) for k in range(3)]
        await asyncio.sleep(0)
        ws[0].cancel()  # cancelled while waiting: gets nothing
        await asyncio.sleep(0)
        s.release()  # to waiter 1
        await asyncio.sleep(0)
        assert order == [1]
        s.release()  # to waiter 2, handed over; cancel it before it runs: passed on to nobody
        ws[2].cancel()
        await asyncio.gather(*ws, return_exceptions=True)
        assert order == [1] and s._value == 1  # waiter 2's slot came back
        assert s.take()  # a free slot again
        s.release()
        s.release()
        assert s.idle()

    asyncio.run(main())


@pytest.mark.parametrize("bad, cls, message", [
    (np.zeros((2, ROW), np.float64), "InputTypeError", "float64"),
    (np.zeros((2, ROW + 1), np.float32), "BadRequest", "shape"),
    (np.zeros((0, ROW), np.float32), "BadRequest", "rows"),
    (np.zeros((9, ROW), np.float32), "RequestTooLarge", "9 rows"),
    (np.zeros((ROW, 3), np.float32).T, "InputTypeError", "contiguous"),
    ([[1.0] * ROW], "InputTypeError", "list"),
])
def test_run_refuses_a_bad_request_on_the_loop_as_submit_does(bad, cls, message):
    """run()'s inline checks for a plain array (its fast path) and check_inputs for the rest
    refuse what submit refuses, with the same error; nothing is handed over."""
    async def main(e):
        with pytest.raises(Exception) as info:
            await e.run(bad)
        return info.value

    with Engine(backend=NumpyBackend(lambda d: f(d["x"])), inputs=SPEC_IN, outputs=SPEC_OUT,
                buckets=[4, 8]) as e:
        exc = asyncio.run(main(e))
        assert type(exc).__name__ == cls and message in str(exc), exc
        with pytest.raises(type(exc)):
            e.submit(bad).result(timeout=5)
        assert e.stats()["engine"]["bad_requests"] == 2
        assert e._aio_q is None  # never handed to the bridge

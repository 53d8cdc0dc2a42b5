"""The engine's asyncio path on the CPU (NumpyBackend): how many completions one loop turn
resolves and for how long (the drain's time budget, timers served between turns), the
eventfd wake-up and its fallback, what run() awaits (results, errors, context, futures
already done), cancellation of an awaiting task whose request is queued or runs, close with
awaits pending, the loop never waiting for the engine's lock, what a request in flight leaves
for the garbage collector to traverse, run()'s own checks and its in-flight bound. Every
output is compared with numpy's (or the value the completion carried)."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import gc
import math
import os
import threading
import time
import weakref

import numpy as np
import pytest

from orchestra.serve import Batching, Engine, EngineClosed, ServeFuture
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
    with one drain callback per turn; every output is right. (The drain's time budget is
    lifted here: a loaded machine could stretch a turn of 16 tiny steps past it.)"""
    monkeypatch.setattr(engine_mod, "TURN_BUDGET_NS", 10**10)
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
    """The request of a cancelled task runs to the end: its slot comes back once it
    completed, the drain leaves the cancelled future it awaited as it is, and nothing keeps
    the request's result once it completed (its `ServeFuture` is freed: no engine thread
    holds the last request it handled while it waits for the next)."""
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
        gc.collect()
        (sf,) = [o for o in gc.get_objects() if isinstance(o, ServeFuture) and o._engine is e]
        gone = weakref.ref(sf)
        aio = sf._aio
        assert aio.cancelled()  # the task's cancel cancelled what it awaited
        del sf
        gate.set()
        await until(lambda: box.sem._value == e.queue_limit)  # completed: slot back
        assert aio.cancelled()  # skipped by the drain: not resolved
        await until(lambda: gone() is None)  # by reference counting: no collection here
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


# -- one loop iteration's work: the drain's time budget ---------------------------------------


def burst(e, n: int, gate: threading.Event, after, marks: list):
    """``n`` tasks whose requests complete in one batch while the loop is held; each task
    calls ``after(j)`` once its output arrived (and was checked). Returns the coroutine;
    ``marks`` gets ("done", j) per task and ("turn", count) per loop iteration."""
    async def main():
        loop = asyncio.get_running_loop()
        done = [0]

        async def task(j):
            x = row(j)
            y = await e.run(x)
            assert y.tobytes() == f(x).tobytes()
            marks.append(("done", j))
            done[0] += 1
            after(j)

        tasks = [asyncio.ensure_future(task(j)) for j in range(n)]
        await until(lambda: e.stats()["engine"]["in_flight"] == 1)
        box = e._aio_boxes[loop]

        def hold():
            gate.set()
            block_until(lambda: len(box.items) == n)

        def tick(last=[0]):
            marks.append(("turn", done[0] - last[0]))
            last[0] = done[0]
            if done[0] < n:
                loop.call_soon(tick)

        loop.call_soon(hold)
        loop.call_soon(tick)
        await asyncio.gather(*tasks)
        return box

    return main()


class _Done:
    """What the inbox takes from a completing thread, as a `ServeFuture` gives it: the
    awaited asyncio future (``_aio``), the result or the exception, cancelled or not."""

    def __init__(self, aio, result=None, exception=None, cancelled=False):
        self._aio, self._result, self._exception = aio, result, exception
        self._cancelled = cancelled

    def cancelled(self) -> bool:
        return self._cancelled


def count_drains(monkeypatch, waiting: list) -> list:
    """Per drain of any inbox, how many of ``waiting`` it resolved (the drain wrapped)."""
    turns: list = []
    drain = _LoopInbox.drain

    def counted(self):
        before = sum(w.done() for w in waiting)
        drain(self)
        turns.append(sum(w.done() for w in waiting) - before)

    monkeypatch.setattr(_LoopInbox, "drain", counted)
    return turns


def test_a_drain_stops_once_its_time_budget_is_spent_resolving(monkeypatch):
    """The drain reads the clock after each future it resolves and stops once 0.25 ms
    passed, although completions_per_turn allows 16: with a clock that moves 0.1 ms per
    read, 3 per drain (0.1, 0.2, 0.3 ms after the start), 10 completions over 4 drains; each
    awaiting coroutine gets its own value, each slot comes back."""
    clock = [0]

    def fake_now():  # only the drain reads it here: no engine runs in this test
        clock[0] += 100_000
        return clock[0]

    monkeypatch.setattr(engine_mod, "_now", fake_now)
    assert engine_mod.TURN_BUDGET_NS == 250_000
    waiting: list = []
    turns = count_drains(monkeypatch, waiting)

    async def main():
        loop = asyncio.get_running_loop()
        box = _LoopInbox(loop, engine_mod._Slots(10), per_turn=16)
        for k in range(10):
            assert box.sem.take()
            waiting.append(loop.create_future())
        tasks = [asyncio.ensure_future(_await(w)) for w in waiting]
        await asyncio.sleep(0)
        for k, w in enumerate(waiting):
            box.push(_Done(w, result=np.full(ROW, k, np.float32)))
        ys = await asyncio.gather(*tasks)
        await until(lambda: not box.scheduled)
        return box, ys

    box, ys = asyncio.run(main())
    assert turns == [3, 3, 3, 1], turns
    for k, y in enumerate(ys):
        assert y.tobytes() == np.full(ROW, k, np.float32).tobytes()
    assert box.sem.idle() and not box.items


def test_with_no_time_budget_one_completion_is_resolved_per_loop_turn(monkeypatch):
    """The engine's path with the budget at 0: each drain resolves one future (the clock has
    passed the deadline after the first), so a burst of 8 resumes one task per loop
    iteration although completions_per_turn allows 16; every output is right."""
    monkeypatch.setattr(engine_mod, "TURN_BUDGET_NS", 0)
    gate = threading.Event()
    marks: list = []
    with gated_engine(gate, buckets=[8], batching=Batching(max_batch=8, max_delay_us=5e6),
                      completions_per_turn=16) as e:
        box = asyncio.run(burst(e, 8, gate, lambda j: None, marks))
    per_turn = [c for kind, c in marks if kind == "turn" and c]
    assert per_turn == [1] * 8, per_turn
    assert sorted(j for kind, j in marks if kind == "done") == list(range(8))
    assert box.sem.idle() and not box.scheduled and not box.items


def test_a_timer_that_comes_due_during_a_drain_runs_before_the_drain_goes_on():
    """The drain goes on with call_later(0), after the timers that came due: a timer that
    comes due while the first drain resolves (one per turn here) runs before the second
    drain resolves the next future (with call_soon it would wait behind that drain)."""
    marks: list = []

    class Marking(asyncio.Future):
        def set_result(self, value):
            marks.append(("resolved", value))
            if value == 0:
                self.get_loop().call_later(0, marks.append, ("timer", None))
            super().set_result(value)

    async def main():
        loop = asyncio.get_running_loop()
        box = _LoopInbox(loop, engine_mod._Slots(4), per_turn=1, wake_fd=True)
        futs = [Marking(loop=loop) for _ in range(4)]
        for k, w in enumerate(futs):
            assert box.sem.take()
            box.push(_Done(w, result=k))
        assert await asyncio.gather(*futs) == [0, 1, 2, 3]
        await until(lambda: not box.scheduled)
        return box

    box = asyncio.run(main())
    assert marks[:3] == [("resolved", 0), ("timer", None), ("resolved", 1)], marks
    assert [v for kind, v in marks if kind == "resolved"] == [0, 1, 2, 3]
    assert box.sem.idle()


def test_a_drain_skips_futures_already_done_and_cancels_those_of_cancelled_requests():
    """The inbox resolves only what is still awaited: a future whose task was cancelled is
    left as it is (its slot still comes back), a cancelled request cancels its future, a
    failed one gets its exception (a StopIteration as a TypeError: asyncio refuses it)."""
    async def main():
        loop = asyncio.get_running_loop()
        box = _LoopInbox(loop, engine_mod._Slots(5), per_turn=16)
        gone, cancelled, failed, stop, ok = (loop.create_future() for _ in range(5))
        gone.cancel()
        err = KeyError("k")
        for w, kw in ((gone, {"result": 1}), (cancelled, {"cancelled": True}),
                      (failed, {"exception": err}), (stop, {"exception": StopIteration(3)}),
                      (ok, {"result": 5})):
            assert box.sem.take()
            box.push(_Done(w, **kw))
        await until(lambda: ok.done())
        assert gone.cancelled() and cancelled.cancelled()
        assert failed.exception() is err
        assert isinstance(stop.exception(), TypeError)
        assert isinstance(stop.exception().__cause__, StopIteration)
        assert "StopIteration" in str(stop.exception())
        assert ok.result() == 5
        await until(lambda: not box.scheduled)
        return box

    box = asyncio.run(main())
    assert box.sem.idle() and not box.items


def test_the_inbox_wakes_the_loop_through_its_eventfd_once_per_burst(monkeypatch):
    """On Linux the loop watches the inbox's eventfd: a burst of completions is one write to
    it (no call_soon_threadsafe, no self-pipe read); every output is right. When the engine
    closes, the loop stops watching the fd and it is closed."""
    writes = []
    real_write = engine_mod._EventFd.write

    def counted(self):
        writes.append(self.fd)
        real_write(self)

    monkeypatch.setattr(engine_mod._EventFd, "write", counted)
    gate = threading.Event()
    marks: list = []
    with gated_engine(gate, buckets=[32], batching=Batching(max_batch=20, max_delay_us=5e6)) as e:
        async def main():
            loop = asyncio.get_running_loop()
            threadsafe = []
            real = loop.call_soon_threadsafe

            def counting(*a, **kw):
                threadsafe.append(a)
                return real(*a, **kw)

            loop.call_soon_threadsafe = counting
            box = await burst(e, 20, gate, lambda j: None, marks)
            assert box._fd is not None, "no eventfd on this Linux loop"
            fd = box._fd.fd
            assert fd in loop._selector.get_map()
            n_writes = len(writes)
            await loop.run_in_executor(None, e.close)
            await until(lambda: box._fd is None)  # detached on the loop once all delivered
            assert fd not in loop._selector.get_map()
            assert not [a for a in threadsafe if getattr(a[0], "__self__", None) is box]
            return n_writes

        if not hasattr(os, "eventfd"):
            pytest.skip("no eventfd here")
        n_writes = asyncio.run(main())
    assert n_writes == 1, writes
    assert sorted(j for kind, j in marks if kind == "done") == list(range(20))


def test_a_loop_that_cannot_watch_an_fd_is_woken_with_call_soon_threadsafe(monkeypatch):
    """A loop whose add_reader is not implemented (asyncio's Proactor loop, say) gets its
    wake-ups through call_soon_threadsafe; outputs and errors arrive as usual."""
    def no_reader(self, fd, cb, *args):
        raise NotImplementedError

    monkeypatch.setattr(asyncio.SelectorEventLoop, "add_reader", no_reader)

    def fn(d):
        if d["x"][0, 0] < 0:
            raise ValueError("negative input")
        return f(d["x"])

    async def main(e):
        xs = [row(j, 1 + j % 3) for j in range(30)]
        ys = await asyncio.gather(*(e.run(x) for x in xs))
        for x, y in zip(xs, ys):
            assert y.tobytes() == f(x).tobytes()
        with pytest.raises(ValueError, match="negative input"):
            await e.run(-row(1))
        return e._aio_boxes[asyncio.get_running_loop()]

    with Engine(backend=NumpyBackend(fn, device_thread=True), inputs=SPEC_IN, outputs=SPEC_OUT,
                buckets=[4]) as e:
        box = asyncio.run(main(e))
    assert box._fd is None and box.sem.idle() and not box.scheduled


# -- what run() awaits: results, errors, context --------------------------------------------------------------


def test_run_results_errors_and_context_through_wait_for_shield_and_gather():
    """run() awaited directly, through wait_for, shield and gather: the right outputs; a
    failing launch raises its own error in the awaiting task; the task's step after the
    await runs in the task's own context (its ContextVar values) and as the current task."""
    var = contextvars.ContextVar("var")

    def fn(d):
        if d["x"][0, 0] < 0:
            raise ValueError("negative input")
        return f(d["x"])

    async def one(j):
        var.set(j)
        me = asyncio.current_task()
        x = row(j, 1 + j % 4)
        if j % 3 == 0:
            y = await e.run(x)
        elif j % 3 == 1:
            y = await asyncio.wait_for(e.run(x), 10)
        else:
            y = await asyncio.shield(e.run(x))
        assert var.get() == j and asyncio.current_task() is me
        return y

    async def main():
        ys = await asyncio.gather(*(one(j) for j in range(40)))
        for j, y in enumerate(ys):
            assert y.tobytes() == f(row(j, 1 + j % 4)).tobytes()
        with pytest.raises(ValueError, match="negative input"):
            await e.run(-row(3))
        assert (await e.run(row(5))).tobytes() == f(row(5)).tobytes()  # serves on

    with Engine(backend=NumpyBackend(fn, device_thread=True), inputs=SPEC_IN, outputs=SPEC_OUT,
                buckets=[4]) as e:
        asyncio.run(main())


def test_a_failed_request_keeps_no_frame_of_the_loop_or_the_inbox_alive():
    """The error a failed request raises in its awaiting task is raised by asyncio's own
    future code: the traceback keeps no frame of the inbox's drain or of the loop's
    machinery alive (a frame there would link the whole calling stack, and each failed
    request would keep its own copy), nor the asyncio future the task awaited."""
    def fn(d):
        raise ValueError("refused")

    async def main(e):
        for _ in range(5):
            try:
                await e.run(row(1))
            except ValueError as exc:
                assert "refused" in str(exc)
            else:
                raise AssertionError("the request did not fail")

    with Engine(backend=NumpyBackend(fn, device_thread=True), inputs=SPEC_IN, outputs=SPEC_OUT,
                buckets=[4]) as e:
        asyncio.run(main(e))  # warm: the bridge, the first loop's one-time objects
        gc.collect()
        gc.disable()
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(main(e))
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            kept = [o for o in gc.garbage if type(o) is asyncio.Future]
            frames = collections.Counter(o.f_code.co_qualname for o in gc.garbage
                                         if type(o).__name__ == "frame")
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
            loop.close()
    assert not kept, kept
    ours = {"_LoopInbox.drain", "_LoopInbox._woken", "Handle._run", "BaseEventLoop._run_once"}
    assert not ours & set(frames), frames


def test_a_launch_that_raises_stopiteration_raises_a_typeerror_in_the_awaiting_task():
    """asyncio refuses a StopIteration in a future (it would end the awaiting coroutine as
    a return): the task gets a TypeError that names it, the StopIteration as its cause, and
    the engine serves on with the right output."""
    def fn(d):
        if d["x"][0, 0] < 0:
            raise StopIteration("no more")
        return f(d["x"])

    async def main(e):
        with pytest.raises(TypeError, match="StopIteration") as info:
            await e.run(-row(1))
        assert isinstance(info.value.__cause__, StopIteration)
        assert (await e.run(row(2, 2))).tobytes() == f(row(2, 2)).tobytes()
        return e._aio_boxes[asyncio.get_running_loop()]

    with Engine(backend=NumpyBackend(fn, device_thread=True), inputs=SPEC_IN, outputs=SPEC_OUT,
                buckets=[4]) as e:
        box = asyncio.run(main(e))
    assert box.sem.idle()


def test_cancelling_a_task_whose_request_is_queued_cancels_the_request():
    gate, entered = threading.Event(), threading.Event()

    async def main(e):
        running = asyncio.ensure_future(e.run(row(0)))
        await until(entered.is_set)
        queued = asyncio.ensure_future(e.run(row(1)))
        await until(lambda: e.stats()["engine"]["queued"] == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        assert (await running).tobytes() == f(row(0)).tobytes()
        assert (await e.run(row(2))).tobytes() == f(row(2)).tobytes()
        box = e._aio_boxes[asyncio.get_running_loop()]
        await until(box.sem.idle)

    with gated_engine(gate, entered, buckets=[4], instances=1) as e:
        asyncio.run(main(e))
        st = e.stats()
    assert st["engine"]["cancelled"] == 1 and st["buckets"][4]["requests"] == 2


async def _await(w):
    return await w


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

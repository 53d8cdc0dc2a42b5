"""`ProcessEngine` on the CPU: an `Engine` over `NumpyBackend` in a spawned child process, fed
through shared memory. Every output is checked against numpy computed here; the failure paths
(bad requests, errors raised in the child, a factory that raises, a child that is killed, a
full set of slots) fail only what they should, and close() leaves no process and no shared
memory behind. The record framing and slot layout (`orchestra.serve.wire`) are tested on
their own first."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest

from orchestra.errors import CallOrderError
from orchestra.serve import (
    BadRequest,
    Batching,
    Engine,
    EngineClosed,
    EngineProcessError,
    InputTypeError,
    NumpyBackend,
    Overloaded,
    RequestTooLarge,
    ServeConfigTypeError,
    ServeConfigValueError,
)
from orchestra.serve import wire
from orchestra.serve.process import ProcessEngine
from tests.helpers import in_threads
from orchestra.serve.tensors import tensor_specs

ROW = 64


class Unpicklable(Exception):
    """An exception whose arguments cannot be pickled back (it keeps a lock)."""

    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


def _fn(d, delay=0.0):
    x = d["x"]
    if delay:
        time.sleep(delay)
    if (x == -1).any():
        raise KeyError("minus one")  # travels back pickled, as itself
    if (x == -2).any():
        raise Unpicklable("minus two")
    if (x == -3).any():  # what a kernel reading unmapped memory makes the engine see
        from orchestra.errors import CudaError

        raise CudaError("cuStreamSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
    return {"y": x * 2 + 1, "s": x.sum(axis=1, keepdims=True, dtype=np.float64)}


def _reference(x):
    return x * 2 + 1, x.sum(axis=1, keepdims=True, dtype=np.float64)


def cpu_engine(delay=0.0, batching=False, max_rows=8, device_thread=True, queue_limit=4096):
    """The factory the child calls (module level: it is pickled by reference)."""
    import functools

    return Engine(backend=NumpyBackend(functools.partial(_fn, delay=delay),
                                       device_thread=device_thread),
                  inputs={"x": ((ROW,), "float32")},
                  outputs={"y": ((ROW,), "float32"), "s": ((1,), "float64")},
                  buckets="pow2", max_rows=max_rows, queue_limit=queue_limit,
                  batching=Batching(max_batch=max_rows, max_delay_us=200) if batching else None)


def slow_restart_engine(marker):
    """`cpu_engine`, made 1.5 s slower once ``marker`` exists (a restart's window)."""
    if os.path.exists(marker):
        time.sleep(1.5)
    return cpu_engine()


def failing_factory():
    raise ServeConfigValueError("the factory refuses")


def not_an_engine():
    return 42


def _x(rows, seed):
    return np.random.default_rng(seed).standard_normal((rows, ROW)).astype(np.float32)


def _check(out, x):
    y, s = _reference(x)
    assert np.array_equal(out["y"], y)
    np.testing.assert_allclose(out["s"], s, rtol=1e-12)


def _gone(name: str) -> bool:
    return not os.path.exists(f"/dev/shm/{name.lstrip('/')}")


@pytest.fixture(scope="module")
def pe():
    e = ProcessEngine(cpu_engine, slots=16)
    yield e
    e.close()


# -- wire --------------------------------------------------------------------------------------


def test_record_reader_reassembles_records_split_anywhere():
    payload = b"abc" * 50
    data = (wire.RESPONSE.pack(7, 3, 0) + wire.RESPONSE.pack(8, 4, len(payload)) + payload
            + wire.RESPONSE.pack(9, 5, 0))
    for cut in range(1, len(data)):
        r = wire.RecordReader(wire.RESPONSE, sized=True)
        got = []
        for part in (data[:cut], data[cut:]):
            r.feed(part)
            while (rec := r.pop()) is not None:
                got.append(rec)
        assert got == [(7, 3, b""), (8, 4, payload), (9, 5, b"")], cut
        assert r.pending == 0


def test_slot_layout_aligns_regions_and_pages():
    specs_in = tensor_specs({"a": ((3,), "float32"), "b": ((5,), "uint8")}, "inputs")
    specs_out = tensor_specs({"y": ((7,), "float64")}, "outputs")
    lay = wire.slot_layout(specs_in, specs_out, 10, 3)
    offs = [lay.inputs["a"][0], lay.inputs["b"][0], lay.outputs["y"][0]]
    assert offs == [0, 128, 192]  # 120 bytes -> 128; 50 -> 64; aligned to 64
    assert lay.slot_bytes == 4096 and lay.nbytes == 3 * 4096
    buf = bytearray(lay.nbytes)
    v = lay.views(buf, 2, "outputs")["y"]
    v[:] = 1.5
    assert np.frombuffer(buf, np.float64, 70, 2 * 4096 + 192).tolist() == [1.5] * 70
    with pytest.raises(ServeConfigValueError):
        wire.slot_layout(specs_in, specs_out, 10, wire.MAX_SLOTS + 1)


def test_errors_round_trip_or_become_remote_errors():
    back = wire.decode_error(wire.encode_error(RequestTooLarge(9, 8)))
    assert isinstance(back, RequestTooLarge) and "9" in str(back)
    back = wire.decode_error(wire.encode_error(Unpicklable("x")))
    assert isinstance(back, wire.RemoteError) and "Unpicklable: x" in str(back)
    assert isinstance(wire.decode_error(b"not a pickle"), wire.RemoteError)
    assert isinstance(pickle.loads(pickle.dumps(EngineProcessError("m", -9))),
                      EngineProcessError)


# -- serving -----------------------------------------------------------------------------------


def test_many_threads_get_their_own_outputs(pe):
    def client(k):
        rng = np.random.default_rng(k)
        for i in range(40):
            x = _x(int(rng.integers(1, 9)), 1000 * k + i)
            if i % 2:
                _check(pe(x), x)
            else:
                f = pe.submit(x)
                x_copy = x.copy()
                x[:] = 0  # the inputs were copied into a slot before submit returned
                _check(f.result(timeout=30), x_copy)

    in_threads(client, 8)
    st = pe.stats()
    assert st["process"]["in_flight"] == 0
    assert sum(b["requests"] for b in st["buckets"].values()) >= 320


def test_out_arrays_are_filled(pe):
    x = _x(3, 5)
    out = {"y": np.full((3, ROW), np.nan, np.float32), "s": np.zeros((3, 1))}
    res = pe(x, out=out)
    assert res["y"] is out["y"]
    _check(out, x)


def test_out_for_some_outputs_only_returns_all_of_them(pe):
    # as an in-process Engine: the outputs without an out= array come back as new arrays
    x = _x(5, 6)
    y = np.full((5, ROW), np.nan, np.float32)
    res = pe(x, out={"y": y})
    assert set(res) == {"y", "s"} and res["y"] is y
    _check(res, x)
    s = np.zeros((5, 1))
    res = pe.submit(x, out={"s": s}).result(timeout=30)
    assert set(res) == {"y", "s"} and res["s"] is s
    _check(res, x)


def test_requests_are_checked_while_another_thread_imports_numpy_ma(pe, monkeypatch):
    # stats() (np.percentile) imports numpy.ma lazily, in the client and in the engine
    # process; a request checked meanwhile saw the half-made module (AttributeError:
    # MaskedArray), seen with 16 threads submitting while one called stats()
    import sys
    import types

    monkeypatch.setitem(sys.modules, "numpy.ma", types.ModuleType("numpy.ma"))
    x = _x(3, 8)
    _check(pe(x), x)


def test_bad_requests_fail_their_own_future_and_nothing_else(pe):
    sent = pe.stats()["process"]["requests"]
    f = pe.submit(_x(2, 1).astype(np.float64))
    assert isinstance(f.exception(timeout=5), InputTypeError)
    with pytest.raises(RequestTooLarge):
        pe(_x(9, 1))  # above max_rows (the largest bucket)
    with pytest.raises(BadRequest):
        pe(np.zeros((0, ROW), np.float32))
    with pytest.raises(BadRequest):
        pe({"x": _x(1, 1), "z": _x(1, 1)})
    assert pe.stats()["process"]["requests"] == sent  # nothing reached the engine process
    x = _x(4, 9)
    _check(pe(x), x)


def test_errors_raised_in_the_engine_process_come_back(pe):
    x = _x(2, 3)
    x[1, 5] = -1
    with pytest.raises(KeyError, match="minus one"):
        pe(x)
    x[1, 5] = -2
    with pytest.raises(wire.RemoteError, match="Unpicklable: minus two"):
        pe(x)
    x = _x(2, 4)
    _check(pe(x), x)  # still serving


def test_asyncio_on_a_reader_thread_engine(pe):
    async def main():
        xs = [_x(1 + k % 8, 50 + k) for k in range(200)]
        outs = await asyncio.gather(*(pe.run(x) for x in xs))
        for o, x in zip(outs, xs):
            _check(o, x)
        with pytest.raises(InputTypeError):
            await pe.run(xs[0].astype(np.int32))

    asyncio.run(main())


def test_loop_reads_completions_and_slots_are_awaited():
    async def main():
        loop = asyncio.get_running_loop()
        e = ProcessEngine(cpu_engine, kwargs={"batching": True}, slots=4, loop=loop,
                          completions_per_turn=3)
        try:
            xs = [_x(1 + k % 8, 700 + k) for k in range(300)]
            outs = await asyncio.gather(*(e.run(x) for x in xs))  # 300 tasks on 4 slots
            for o, x in zip(outs, xs):
                _check(o, x)
            with pytest.raises(CallOrderError):
                e(xs[0])  # only this loop could deliver its answer
            # a thread's blocking call is answered through the loop
            x = xs[1]
            got = await asyncio.to_thread(e, x)
            _check(got, x)
            st = e.stats()
            assert st["process"]["slots"] == 4 and st["process"]["in_flight"] == 0
            fills = [b["batch_fill"] for b in st["buckets"].values() if b["launches"]]
            assert fills  # batching ran in the engine process
        finally:
            await e.aclose()
        assert e.closed and _gone(e._shm.name)
        with pytest.raises(EngineClosed):
            await e.run(xs[0])

    asyncio.run(main())


def test_loop_resolves_at_most_completions_per_turn_per_iteration():
    # the response pipe's reader drained at once when no drain was scheduled, so in one
    # iteration a drain scheduled in the one before (which emptied what was read) and the
    # reader's own drain of new answers both ran: twice completions_per_turn tasks resumed
    # in the next iteration (the long iterations of a busy loop)
    from types import SimpleNamespace

    r, w = os.pipe()
    os.set_blocking(r, False)  # as the loop's end of the response pipe
    soon = []
    e = object.__new__(ProcessEngine)
    e._loop = SimpleNamespace(call_soon=lambda fn, *a: soon.append((fn, a)))
    e.completions_per_turn = 3
    done = []
    e._complete = lambda rid, slot, err, batch: done.append(rid)
    child = SimpleNamespace(handed=False, turn_pending=False, resp_fd=r,
                            reader=wire.RecordReader(wire.RESPONSE, sized=True))

    def answer(*rids):
        os.write(w, b"".join(wire.RESPONSE.pack(rid, 0, 0) for rid in rids))

    def iteration(readable: bool) -> int:
        """One loop iteration: the callbacks scheduled in the last one, then the reader."""
        before, due = len(done), soon[:]
        soon.clear()
        for fn, a in due:
            fn(*a)
        if readable:
            e._on_readable(child)
        return len(done) - before

    try:
        answer(*range(5))
        counts = [iteration(True)]  # 5 answers: 3 now or in the next iteration, 2 after
        answer(5, 6, 7)  # more arrive while 2 are still to resolve
        counts += [iteration(True) for _ in range(4)]
        assert done == list(range(8))
        assert max(counts) <= 3, counts
    finally:
        os.close(r)
        os.close(w)


def test_cancelled_task_drops_its_result_and_frees_the_slot():
    async def main():
        e = ProcessEngine(cpu_engine, kwargs={"delay": 0.05}, slots=1,
                          loop=asyncio.get_running_loop())
        try:
            t = asyncio.ensure_future(e.run(_x(1, 1)))
            await asyncio.sleep(0.01)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            x = _x(2, 2)
            _check(await e.run(x), x)  # the one slot came back
        finally:
            await e.aclose()

    asyncio.run(main())


def test_loop_delivers_answers_read_before_the_engine_process_ended():
    # the loop resolves completions_per_turn answers per iteration; when the pipe's end was
    # read with answers still buffered, those requests failed with EngineProcessError
    # although their outputs were in the slots (the reader thread delivers them)
    async def main():
        e = ProcessEngine(cpu_engine, slots=8, loop=asyncio.get_running_loop(),
                          completions_per_turn=1)
        try:
            xs = [_x(1 + k, 40 + k) for k in range(8)]
            futs = [e.submit(x) for x in xs]
            import fcntl
            import struct
            import termios

            def unread() -> int:
                n = fcntl.ioctl(e._child.resp_fd, termios.FIONREAD, b"\0\0\0\0")
                return struct.unpack("i", n)[0]

            t = time.monotonic() + 30  # the loop is blocked: it reads nothing meanwhile
            while time.monotonic() < t and unread() < 8 * wire.RESPONSE.size:
                time.sleep(0.01)  # until every answer lies in the pipe
            os.kill(e.pid, signal.SIGKILL)
            e._child.proc.join(30)
            for f, x in zip(futs, xs):
                _check(await asyncio.wrap_future(f), x)
        finally:
            await e.aclose()

    asyncio.run(main())


def test_a_ctrl_c_reaching_the_engine_process_leaves_it_serving():
    # a terminal's Ctrl-C reaches every process of the group: the engine process died of it
    # (KeyboardInterrupt and its traceback), failing the requests in flight before the
    # client could close it
    e = ProcessEngine(cpu_engine, kwargs={"delay": 0.2})
    try:
        x = _x(3, 51)
        fut = e.submit(x)  # in flight when the signal comes
        time.sleep(0.05)
        os.kill(e.pid, signal.SIGINT)
        _check(fut.result(timeout=30), x)
        y = _x(2, 52)
        _check(e.submit(y).result(timeout=30), y)
        assert e._child.proc.is_alive()
    finally:
        e.close()
    assert e._child.proc.exitcode == 0


def test_full_slots_raise_or_time_out():
    e = ProcessEngine(cpu_engine, kwargs={"delay": 0.3}, slots=1, on_full="raise")
    try:
        f = e.submit(_x(1, 1))
        with pytest.raises(Overloaded):
            e.submit(_x(1, 2))
        _check(f.result(timeout=10), _x(1, 1))
        e.on_full = "block"
        f = e.submit(_x(1, 3))
        with pytest.raises(Overloaded, match="within 0.05 s"):
            e.submit(_x(1, 4), timeout=0.05)
        g = e.submit(_x(1, 5), timeout=10)  # waits for the slot
        _check(f.result(timeout=10), _x(1, 3))
        _check(g.result(timeout=10), _x(1, 5))
        assert e.stats()["process"]["overloaded"] == 2
    finally:
        e.close()


def test_close_drains_pending_requests_and_frees_everything():
    e = ProcessEngine(cpu_engine, kwargs={"delay": 0.01}, slots=32)
    name, proc = e._shm.name, e._child.proc
    xs = [_x(1 + k % 8, k) for k in range(30)]
    futs = [e.submit(x) for x in xs]
    e.close()
    for f, x in zip(futs, xs):
        _check(f.result(timeout=0), x)
    assert not proc.is_alive() and proc.exitcode == 0
    assert _gone(name)
    with pytest.raises(EngineClosed):
        e.submit(xs[0])
    assert e.stats()["process"]["requests"] == 30  # the engine's last statistics
    e.close()  # idempotent


def test_close_between_taking_a_slot_and_sending_raises_engine_closed():
    # a submitter that took a slot just before another thread's close() ran to the end: it
    # indexed the cleared slot views (IndexError) instead of raising EngineClosed
    e = ProcessEngine(cpu_engine, slots=2)
    x = _x(2, 2)
    _check(e(x), x)
    take = e._take_slot

    def take_then_close(timeout):
        slot = take(timeout)
        t = threading.Thread(target=e.close)
        t.start()
        t.join()
        return slot

    e._take_slot = take_then_close
    with pytest.raises(EngineClosed):
        e.submit(x)
    assert e.closed and _gone(e._shm.name)


def test_killed_engine_process_fails_pending_and_refuses_new_work():
    e = ProcessEngine(cpu_engine, kwargs={"delay": 0.5}, slots=8)
    name = e._shm.name
    futs = [e.submit(_x(1, k)) for k in range(4)]
    os.kill(e.pid, signal.SIGKILL)
    for f in futs:
        exc = f.exception(timeout=10)
        assert isinstance(exc, EngineProcessError) and exc.exitcode == -signal.SIGKILL
    assert isinstance(e.broken, EngineProcessError)
    with pytest.raises(EngineProcessError, match="killed by signal SIGKILL"):
        e.submit(_x(1, 9))
    e.close()
    assert _gone(name)


def test_factory_errors_and_bad_arguments():
    with pytest.raises(ServeConfigValueError, match="the factory refuses") as info:
        ProcessEngine(failing_factory)
    assert any("engine process" in n for n in info.value.__notes__)
    with pytest.raises(ServeConfigTypeError, match="must return an Engine"):
        ProcessEngine(not_an_engine)
    with pytest.raises(ServeConfigTypeError, match="picklable"):
        ProcessEngine(lambda: None)
    with pytest.raises(ServeConfigValueError, match="slots"):
        ProcessEngine(cpu_engine, slots=0)
    with pytest.raises(ServeConfigValueError, match="on_full"):
        ProcessEngine(cpu_engine, on_full="drop")
    with pytest.raises(ServeConfigValueError, match="max_rows 9 is above"):
        ProcessEngine(cpu_engine, max_rows=9)


def test_bad_arguments_raise_orchestra_errors_not_builtins(pe):
    # each raised a bare ValueError / TypeError before
    for kw in ({"completions_per_turn": "a"}, {"completions_per_turn": None},
               {"completions_per_turn": True}, {"kwargs": [1]}, {"args": 5},
               {"submit_timeout": "1"}, {"submit_timeout": -1}):
        with pytest.raises((ServeConfigTypeError, ServeConfigValueError)):
            ProcessEngine(cpu_engine, **kw)
    x = _x(2, 1)
    for t in ("1", [1], -1.0):
        with pytest.raises((ServeConfigTypeError, ServeConfigValueError), match="timeout"):
            pe.submit(x, timeout=t)
    _check(pe.submit(x, timeout=5).result(timeout=30), x)


def test_forgotten_engine_process_exits():
    import gc

    e = ProcessEngine(cpu_engine, slots=2)
    proc, name = e._child.proc, e._shm.name
    x = _x(1, 1)
    _check(e(x), x)
    del e
    gc.collect()
    proc.join(30)
    assert not proc.is_alive()
    assert _gone(name)


def test_slots_beyond_the_shared_memory_file_system_are_refused(monkeypatch):
    from orchestra.serve import process

    class Small:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(process.os, "statvfs", lambda where: Small)
    with pytest.raises(ServeConfigValueError, match="shm-size"):
        process._check_shm_space(1 << 20)
    process._check_shm_space(1 << 16)  # fits


def _wait_open(e, old_pid, timeout=60.0):
    """Wait until the ProcessEngine serves from a new engine process."""
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if e.pid != old_pid and e._state == "open":
            return
        time.sleep(0.05)
    raise AssertionError(f"no restart within {timeout} s (state {e._state})")


def test_a_dead_engine_process_is_replaced_while_restarts_are_left():
    e = ProcessEngine(cpu_engine, kwargs={"delay": 0.2}, slots=8, restarts=1)
    try:
        pid = e.pid
        futs = [e.submit(_x(1, k)) for k in range(3)]
        os.kill(pid, signal.SIGKILL)
        for f in futs:
            assert isinstance(f.exception(timeout=10), EngineProcessError)
        try:  # refused while the new process starts, or served by it
            e.submit(_x(1, 1)).result(timeout=30)
        except Overloaded as exc:
            assert "restarted" in str(exc)
        _wait_open(e, pid)
        x = _x(5, 77)
        _check(e(x), x)
        st = e.stats()["process"]
        assert st["restarts"] == 1 and st["pid"] == e.pid != pid
        os.kill(e.pid, signal.SIGKILL)  # no restart left: broken
        t = time.monotonic() + 10
        while e.broken is None and time.monotonic() < t:
            time.sleep(0.05)
        with pytest.raises(EngineProcessError):
            e(x)
    finally:
        e.close()
    assert _gone(e._shm.name)


def test_a_restart_that_cannot_watch_its_loop_breaks_the_engine_at_once(tmp_path):
    # the loop= loop closed while a restart ran: the restart thread called close(), which
    # waited for that very restart to end (start_timeout + 90 s) before the engine broke
    marker = str(tmp_path / "slow")
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever)
    t.start()
    e = ProcessEngine(slow_restart_engine, (marker,), slots=2, loop=loop, restarts=1,
                      start_timeout=60)
    try:
        x = _x(2, 5)
        _check(e(x), x)  # a thread's call, answered through the loop
        open(marker, "w").close()
        os.kill(e.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while e._state != "restarting" and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.call_soon_threadsafe(loop.stop)
        t.join()
        loop.close()  # the new process is still starting (1.5 s)
        deadline = time.monotonic() + 45
        while e.broken is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(e.broken, EngineProcessError), e._state
        with pytest.raises(EngineProcessError):
            e.submit(x)
    finally:
        e.close()
    assert _gone(e._shm.name)


def test_a_sticky_error_in_the_engine_process_restarts_it():
    e = ProcessEngine(cpu_engine, slots=8, restarts=2)
    try:
        pid = e.pid
        x = _x(2, 3)
        x[0, 0] = -3
        from orchestra.errors import CudaError

        with pytest.raises(CudaError) as info:
            e(x)
        assert info.value.sticky
        _wait_open(e, pid)
        y = _x(3, 4)
        _check(e(y), y)
        assert e.stats()["process"]["restarts"] == 1
    finally:
        e.close()


# -- slots handed over between threads and loops ------------------------------------------------


def _loop_in_thread():
    """A new event loop running in a thread of its own: (loop, thread)."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    return loop, t


def _wait_until(pred, timeout=10.0, what="the condition"):
    t = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > t:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(0.002)


def test_a_slot_handed_to_a_loop_that_closes_before_taking_it_is_not_lost():
    # _release passed the slot to the waiter of another loop in a call_soon_threadsafe
    # callback; the loop closed before it ran: the slot never came back (one slot fewer for
    # good, and with slots=1 no request was ever admitted again)
    e = ProcessEngine(cpu_engine, kwargs={"delay": 0.05}, slots=2)
    try:
        held = [e._take_slot(None), e._take_slot(None)]  # both slots in use
        loop, t = _loop_in_thread()
        x = _x(1, 1)
        waiter = asyncio.run_coroutine_threadsafe(e.run(x), loop)
        _wait_until(lambda: len(e._aio_waiting) == 1, what="the run() awaiting a slot")
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        e._release(held.pop())  # to the waiter of the stopped loop ...
        loop.close()  # ... which closes before it runs another callback
        e._release(held.pop())
        assert not waiter.done()  # its task never ran again
        st = e.stats()["process"]
        assert st["in_flight"] == 0 and sorted(e._free) == [0, 1]
        # every slot serves again: two requests in flight at once, neither refused
        e.on_full = "raise"
        xs = [_x(3, 10), _x(5, 11)]
        futs = [e.submit(x) for x in xs]
        for f, x in zip(futs, xs):
            _check(f.result(timeout=30), x)
        assert e.stats()["process"]["overloaded"] == 0
    finally:
        e.close()


def test_a_request_queued_behind_a_wake_up_lost_to_a_closed_loop_is_served():
    # the first waiter's loop closed with its wake-up pending: the next request to come
    # moves the queue on (the second waiter, of a live loop, takes the slot), then is served
    e = ProcessEngine(cpu_engine, slots=1)
    try:
        held = e._take_slot(None)
        dead, t_dead = _loop_in_thread()
        live, t_live = _loop_in_thread()
        xb, xc, xd = _x(2, 20), _x(3, 21), _x(4, 22)
        asyncio.run_coroutine_threadsafe(e.run(xb), dead)
        _wait_until(lambda: len(e._aio_waiting) == 1, what="the first waiter")
        c = asyncio.run_coroutine_threadsafe(e.run(xc), live)
        _wait_until(lambda: len(e._aio_waiting) == 2, what="the second waiter")
        dead.call_soon_threadsafe(dead.stop)
        t_dead.join(10)
        e._release(held)  # the wake-up goes to the stopped loop ...
        dead.close()  # ... and is never run
        assert not c.done()

        async def later():
            return await e.run(xd)

        _check(asyncio.run(asyncio.wait_for(later(), 30)), xd)
        _check(c.result(timeout=30), xc)
        assert sorted(e._free) == [0] and not e._waking and not e._aio_waiting
        live.call_soon_threadsafe(live.stop)
        t_live.join(10)
        live.close()
    finally:
        e.close()


def test_threads_and_tasks_of_other_loops_share_few_slots():
    # completions free the slots on the reader thread: every asyncio waiter is woken on its
    # own loop and may find its slot taken by a thread meanwhile (it queues again first)
    e = ProcessEngine(cpu_engine, slots=2)
    try:
        def client(k):
            if k % 2:
                for i in range(30):
                    x = _x(1 + (k + i) % 8, 100 * k + i)
                    _check(e(x), x)
                return

            async def tasks():
                xs = [_x(1 + (k + i) % 8, 100 * k + i) for i in range(30)]
                outs = await asyncio.gather(*(e.run(x) for x in xs))
                for o, x in zip(outs, xs):
                    _check(o, x)

            asyncio.run(tasks())

        in_threads(client, 6)
        st = e.stats()["process"]
        assert st["in_flight"] == 0 and st["requests"] == 180
        assert sorted(e._free) == [0, 1] and not e._waking and not e._aio_waiting
    finally:
        e.close()


class _SwitchingCounts(dict):
    """``_counts`` whose reads run Python code, so a thread switch can fall between the read
    and the write of ``counts[k] += 1`` (CPython 3.11 switches threads only at such points;
    a free-threaded build at any): an update outside the lock is then lost."""

    def __getitem__(self, key):
        return dict.__getitem__(self, key)


def test_counts_from_many_threads_are_exact(pe, monkeypatch):
    import sys

    before = pe.stats()["process"]
    monkeypatch.setattr(pe, "_counts", _SwitchingCounts(pe._counts))
    bad = _x(2, 1).astype(np.float64)  # refused in the client: counted as bad
    n = 1000
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def client(k):
            if k % 2:
                for _ in range(n):
                    assert isinstance(pe.submit(bad).exception(timeout=5), InputTypeError)
                return

            async def refused():
                for _ in range(n):
                    with pytest.raises(InputTypeError):
                        await pe.run(bad)

            asyncio.run(refused())

        in_threads(client, 8)
    finally:
        sys.setswitchinterval(interval)
    after = pe.stats()["process"]
    assert after["bad"] - before["bad"] == 8 * n
    assert after["requests"] == before["requests"] and after["in_flight"] == 0


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_dead_engine_process_does_not_hold_up_the_loop(restarts):
    # the loop read the end of the response pipe and joined the process right there
    # (proc.join(5)): a process reaped late held every callback of the loop that long. On
    # the CPU a killed process is reaped at once; a GPU process can take seconds (its device
    # file is released after its pipes closed): its join returns only 1 s after the kill
    async def main():
        loop = asyncio.get_running_loop()
        e = ProcessEngine(cpu_engine, kwargs={"delay": 0.3}, slots=4, loop=loop,
                          restarts=restarts)
        gaps: list = []
        stop = asyncio.Event()

        async def probe():
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.005)
                gaps.append(time.monotonic() - t)

        p = asyncio.ensure_future(probe())
        try:
            proc, pid = e._child.proc, e.pid
            join = proc.join
            reaped = [float("inf")]

            def late_join(timeout=None):
                left = reaped[0] - time.monotonic()
                if left > 0:
                    time.sleep(left if timeout is None else min(left, timeout))
                return join(timeout)

            proc.join = late_join
            xs = [_x(1 + k, 60 + k) for k in range(3)]
            tasks = [asyncio.ensure_future(e.run(x)) for x in xs]
            await asyncio.sleep(0.05)  # every request reached the engine process
            reaped[0] = time.monotonic() + 1.0
            os.kill(pid, signal.SIGKILL)
            for t in tasks:
                with pytest.raises(EngineProcessError) as info:
                    await asyncio.wait_for(t, 10)
                assert info.value.exitcode == -signal.SIGKILL
            if restarts:
                deadline = time.monotonic() + 60
                while not (e.pid != pid and e._state == "open"):
                    assert time.monotonic() < deadline, e._state
                    await asyncio.sleep(0.02)
                x = _x(4, 70)
                _check(await e.run(x), x)  # served by the new process, read by this loop
                assert e.stats()["process"]["restarts"] == 1
            else:
                while e.broken is None:
                    await asyncio.sleep(0.01)
                with pytest.raises(EngineProcessError, match="killed by signal SIGKILL"):
                    await e.run(xs[0])
            await asyncio.sleep(max(0.0, reaped[0] - time.monotonic()) + 0.05)
        finally:
            stop.set()
            await p
            await e.aclose()
        assert max(gaps) < 0.5, max(gaps)

    asyncio.run(main())


# -- timeout arguments: one check for both engines ---------------------------------------------

BAD_TIMEOUTS = [pytest.param(v, err, id=repr(v)) for v, err in (
    ("1", ServeConfigTypeError), ([1], ServeConfigTypeError), (True, ServeConfigTypeError),
    (float("nan"), ServeConfigValueError), (-1, ServeConfigValueError),
    (-0.5, ServeConfigValueError), (float("-inf"), ServeConfigValueError),
    (-10 ** 400, ServeConfigValueError))]


@pytest.fixture(scope="module")
def local():
    """The same engine as `pe`'s, in this process."""
    e = cpu_engine()
    yield e
    e.close()


def _sent(e) -> int:
    st = e.stats()
    if "process" in st:
        return st["process"]["requests"]
    return sum(b["requests"] for b in st["buckets"].values())


@pytest.mark.parametrize("which", ["Engine", "ProcessEngine"])
@pytest.mark.parametrize("bad, error", BAD_TIMEOUTS)
def test_bad_timeouts_are_refused_before_anything_is_queued(which, bad, error, pe, local):
    # Engine.submit took any timeout: a wrong one passed unnoticed while an instance was
    # free, and raised a builtin TypeError (or waited oddly) once the queue was full
    e = pe if which == "ProcessEngine" else local
    x = _x(2, 31)
    sent = _sent(e)
    with pytest.raises(error, match=r"^timeout must be"):
        e.submit(x, timeout=bad)
    assert _sent(e) == sent
    _check(e.submit(x, timeout=5).result(timeout=30), x)


@pytest.mark.parametrize("bad, error", BAD_TIMEOUTS)
def test_bad_submit_timeouts_are_refused_by_both_constructors(bad, error):
    with pytest.raises(error, match=r"^submit_timeout must be"):
        Engine(backend=NumpyBackend(_fn), inputs={"x": ((ROW,), "float32")},
               outputs={"y": ((ROW,), "float32")}, submit_timeout=bad)
    with pytest.raises(error, match=r"^submit_timeout must be"):
        ProcessEngine(cpu_engine, submit_timeout=bad)


@pytest.mark.parametrize("which", ["Engine", "ProcessEngine"])
def test_settings_changed_while_serving_are_checked_and_followed(which, pe, local):
    # on_full and submit_timeout were plain attributes: a wrong value set after construction
    # passed unnoticed and surfaced as a builtin error (or an odd wait) once the engine filled
    e = pe if which == "ProcessEngine" else local
    assert (e.on_full, e.submit_timeout) == ("block", None)
    for param in BAD_TIMEOUTS:
        bad, error = param.values
        with pytest.raises(error, match=r"^submit_timeout must be"):
            e.submit_timeout = bad
    for bad in ("Block", "drop"):
        with pytest.raises(ServeConfigValueError, match=r"^on_full must be 'block' or 'raise'"):
            e.on_full = bad
    for bad in (None, 1, b"block"):  # the wrong kind: a TypeError, as submit_timeout's
        with pytest.raises(ServeConfigTypeError, match=r"^on_full must be the string 'block'"):
            e.on_full = bad
    assert (e.on_full, e.submit_timeout) == ("block", None)  # nothing changed
    try:
        e.submit_timeout = np.float32(2.5)
        assert e.submit_timeout == 2.5 and type(e.submit_timeout) is float
        e.submit_timeout = float("inf")
        assert e.submit_timeout is None  # inf: no limit, as in the constructor
        e.on_full = "raise"
        assert e.on_full == "raise"
        x = _x(2, 33)
        _check(e.submit(x).result(timeout=30), x)  # still serving
    finally:
        e.on_full, e.submit_timeout = "block", None


@pytest.mark.parametrize("which", ["Engine", "ProcessEngine"])
def test_minus_zero_timeout_is_zero(which, pe, local):
    e = pe if which == "ProcessEngine" else local
    try:
        e.submit_timeout = -0.0
        assert e.submit_timeout == 0.0 and str(e.submit_timeout) == "0.0"
    finally:
        e.submit_timeout = None


@pytest.mark.parametrize("huge", [float("inf"), 1e10, 1e300, 10 ** 400], ids=["inf", "1e10", "1e300", "10**400"])
def test_an_infinite_timeout_waits_without_a_limit(huge):
    # float("inf") reached Condition.wait, which raised a builtin OverflowError; so did any
    # value above threading.TIMEOUT_MAX (10 ** 400 at once: float() of it overflows)
    xs = [_x(1, 40 + k) for k in range(4)]
    e = cpu_engine(delay=0.1, queue_limit=1)  # 2 instances and 1 queued: full
    try:
        futs = [e.submit(x) for x in xs[:3]]
        futs.append(e.submit(xs[3], timeout=huge))  # waits for queue space
        for f, x in zip(futs, xs):
            _check(f.result(timeout=30), x)
    finally:
        e.close()
    pe1 = ProcessEngine(cpu_engine, kwargs={"delay": 0.1}, slots=1)
    try:
        first = pe1.submit(xs[0])
        pe1.submit_timeout = huge
        assert pe1.submit_timeout is None
        second = pe1.submit(xs[1])  # waits for the one slot
        _check(first.result(timeout=30), xs[0])
        _check(second.result(timeout=30), xs[1])
    finally:
        pe1.close()


# -- a forgotten loop= engine ------------------------------------------------------------------


async def _until_exited(proc, timeout=10.0):
    deadline = time.monotonic() + timeout
    while proc.is_alive():
        assert time.monotonic() < deadline, "the engine process did not exit"
        await asyncio.sleep(0.01)


def test_a_forgotten_loop_engine_is_collected_on_its_loop():
    # the loop's reader callback (a bound method) held the engine: it was never collected,
    # its engine process never ended, until close()
    import gc
    import weakref

    async def main():
        loop = asyncio.get_running_loop()
        e = ProcessEngine(cpu_engine, slots=2, loop=loop)
        proc, fd, name = e._child.proc, e._child.resp_fd, e._shm.name
        x = _x(3, 80)
        _check(await e.run(x), x)
        ref = weakref.ref(e)
        del e
        gc.collect()
        try:
            assert ref() is None
            assert not loop.remove_reader(fd)  # the finalizer removed it, at once here
            await _until_exited(proc)
            assert _gone(name)
        finally:
            left = ref()
            if left is not None:  # the failure above: leave no process behind
                await left.aclose()

    asyncio.run(main())


def test_a_forgotten_loop_engine_is_collected_from_another_thread():
    import gc
    import weakref

    loop, t = _loop_in_thread()
    try:
        e = ProcessEngine(cpu_engine, slots=2, loop=loop)
        proc, fd, name = e._child.proc, e._child.resp_fd, e._shm.name
        x = _x(2, 81)
        _check(e(x), x)  # this thread's call, answered through the loop
        ref = weakref.ref(e)
        del e
        gc.collect()  # the finalizer runs here, not on the loop's thread
        try:
            assert ref() is None

            async def reader_left():
                return loop.remove_reader(fd)

            assert not asyncio.run_coroutine_threadsafe(reader_left(), loop).result(10)
            proc.join(10)
            assert not proc.is_alive() and _gone(name)
        finally:
            left = ref()
            if left is not None:
                left.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


def test_exit_text_says_how_a_process_ended():
    from orchestra.serve.process import exit_text

    assert exit_text(0) == "exit code 0" and exit_text(3) == "exit code 3"
    assert exit_text(-9) == "killed by signal SIGKILL"
    assert exit_text(-15) == "killed by signal SIGTERM"
    assert exit_text(-200) == "killed by signal 200"  # no such signal's name: its number
    assert "not known yet" in exit_text(None) and "None" not in exit_text(None)

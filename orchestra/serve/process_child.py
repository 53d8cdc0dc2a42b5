"""The engine process of a `ProcessEngine`: the `Engine` the client's factory makes, fed from
the request pipe, answering on the response pipe (`orchestra.serve.wire`), controlled over a
`multiprocessing` connection.

Its threads: the main thread answers control messages (warm-up, statistics, close); one reader
thread turns request records into `Engine.submit` calls whose inputs and ``out=`` arrays are
views of the request's slot; the engine's own threads complete them, and each completion writes
its response record (under a lock: an error record can be longer than ``PIPE_BUF``).

When the client goes away without closing (its control connection ends), the engine is closed
with ``cancel=True`` and the process exits. SIGINT is ignored: a Ctrl-C at a terminal reaches
every process of its group, and this one's life is the client's to end (`ProcessEngine.close`,
or the client's exit) after the requests in flight are answered; interrupted on its own, it
would fail them and print a traceback.

Thread-safety: runs once per process, in the process `ProcessEngine` starts.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading

from orchestra.serve import wire
from orchestra.serve.errors import EngineClosed, ServeConfigTypeError, ServeConfigValueError

log = logging.getLogger(__name__)


def main(factory, args, kwargs, req_fd, resp_fd, ctl) -> None:
    """The engine process's entry point (``multiprocessing`` target). ``req_fd`` / ``resp_fd``:
    the `multiprocessing` connections whose file descriptors carry the records; ``ctl``: the
    control connection."""
    from multiprocessing import shared_memory

    from orchestra.serve.engine import Engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client ends this process (module doc)
    try:
        engine = factory(*args, **kwargs)
        if not isinstance(engine, Engine):
            raise ServeConfigTypeError(f"the ProcessEngine factory must return an Engine; it "
                                       f"returned {type(engine).__name__}")
    except BaseException as exc:  # noqa: BLE001 - the client raises it
        ctl.send(("error", wire.encode_error(exc)))
        return
    try:
        ctl.send(("ready", _describe(engine)))
        # ("attach", shared memory name, SlotLayout, zero-copy wanted)
        op, name, layout, zero_copy = ctl.recv()
        shm = shared_memory.SharedMemory(name=name)
    except BaseException:  # noqa: BLE001 - the client is gone or failed to start: just end
        engine.close(cancel=True)
        return
    child = _Child(engine, shm, layout, req_fd.fileno(), resp_fd.fileno(), zero_copy)
    try:
        ctl.send(("attached", child.pinned))
        child.start()
        _serve_control(engine, ctl, child)
    finally:
        child.close()
        # the client's connection objects own the descriptors: close them after the engine
        req_fd.close()
        resp_fd.close()


def _describe(engine) -> dict:
    """What the client needs to check requests and lay out the slots."""
    return {"inputs": {n: (s.row_shape, s.dtype.str) for n, s in engine.inputs.items()},
            "outputs": {n: (s.row_shape, s.dtype.str) for n, s in engine.outputs.items()},
            "largest": engine.buckets.largest, "split": engine.split,
            "executor": engine.executor, "pid": os.getpid()}


def _serve_control(engine, ctl, child) -> None:
    while True:
        try:
            op, arg = ctl.recv()
        except (EOFError, OSError):  # the client is gone: nothing will read the answers
            child.stop_reading()
            engine.close(cancel=True)
            return
        try:
            if op == "warmup":
                ctl.send(("ok", engine.warmup(arg)))
            elif op == "stats":
                ctl.send(("ok", engine.stats()))
            elif op == "close":
                # every request the client wrote is read before the engine closes: the client
                # closed its end of the request pipe before sending this
                child.stop_reading()
                engine.close(cancel=bool(arg))
                ctl.send(("ok", engine.stats()))
                return
            else:
                ctl.send(("error", wire.encode_error(
                    ServeConfigValueError(f"unknown control message {op!r}"))))
        except BaseException as exc:  # noqa: BLE001 - answered, the process keeps serving
            ctl.send(("error", wire.encode_error(exc)))


class _Child:
    """The engine process's side of the slots: views of each slot, the request reader thread,
    the response writer. With ``zero_copy`` and an engine on a GPU it page-locks the shared
    memory and submits requests with ``pinned=True`` (an instance may read a slot directly)."""

    def __init__(self, engine, shm, layout: wire.SlotLayout, req_fd: int, resp_fd: int,
                 zero_copy: bool):
        self.engine = engine
        self.shm = shm
        self.layout = layout
        self.req_fd = req_fd
        self.resp_fd = resp_fd
        self._write_lock = threading.Lock()
        self._reg = None
        self.pinned = False
        cuda = sys.modules.get("orchestra.serve.cuda_backend")
        if zero_copy and cuda is not None and isinstance(engine.backend, cuda.CudaBackend):
            try:
                import numpy as np

                from orchestra.driver import register_host

                whole = np.ndarray((layout.nbytes,), np.uint8, buffer=shm.buf)
                self._reg = register_host(whole, engine.backend.device)
                self.pinned = True
            except Exception as exc:  # noqa: BLE001 - copies into staging instead
                log.warning("serve: the engine process could not page-lock the shared "
                            "memory (%s); inputs are copied into pinned staging", exc)
        self._ins = [layout.views(shm.buf, s, "inputs") for s in range(layout.slots)]
        self._outs = [layout.views(shm.buf, s, "outputs") for s in range(layout.slots)]
        # (slot, rows) -> the request's input and output views, made on first use: a request
        # of a size seen before on that slot costs no slicing, and its arrays are the very
        # objects bound before (the engine's instances skip their checks for those)
        self._views: dict[tuple[int, int], tuple[dict, dict]] = {}
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read_requests,
                                        name="orchestra-serve-process-requests", daemon=True)
        self._reader.start()

    def stop_reading(self) -> None:
        """Wait until the reader saw the end of the request pipe (the client closed it, or
        exited)."""
        if self._reader is not None:
            self._reader.join()

    def _read_requests(self) -> None:
        reader = wire.RecordReader(wire.REQUEST, sized=False)
        submit = self.engine.submit
        pinned = self.pinned
        views = self._views
        while True:
            try:
                data = os.read(self.req_fd, 1 << 16)
            except OSError:
                return
            if not data:
                return  # the client closed the pipe (close(), or it exited)
            reader.feed(data)
            while (rec := reader.pop()) is not None:
                rid, slot, rows = rec
                try:
                    v = views.get((slot, rows))
                    if v is None:
                        v = views[slot, rows] = (
                            {n: a[:rows] for n, a in self._ins[slot].items()},
                            {n: a[:rows] for n, a in self._outs[slot].items()})
                    fut = submit(v[0], out=v[1], pinned=pinned)
                except BaseException as exc:  # noqa: BLE001 - Overloaded, closed, broken
                    self._respond(rid, slot, exc)
                    continue
                fut.add_done_callback(functools.partial(self._done, rid, slot))

    def _done(self, rid: int, slot: int, fut) -> None:
        if fut.cancelled():
            exc = EngineClosed("the engine closed with cancel=True before the request ran")
        else:
            exc = fut.exception()
        self._respond(rid, slot, exc)

    def _respond(self, rid: int, slot: int, exc: BaseException | None) -> None:
        payload = b"" if exc is None else wire.encode_error(exc)
        data = wire.RESPONSE.pack(rid, slot, len(payload)) + payload
        with self._write_lock:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.resp_fd, view):]
            except OSError:  # the client is gone
                pass

    def close(self) -> None:
        if self._reg is not None:
            try:
                self._reg.close()
            except Exception:  # noqa: BLE001 - the process ends next
                pass
        self._ins = self._outs = []
        self._views = {}
        try:
            self.shm.close()
        except BufferError:  # a view still referenced somewhere: the process ends next
            pass

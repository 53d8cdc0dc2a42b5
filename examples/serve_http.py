"""An HTTP endpoint over orchestra.serve.Engine, with aiohttp (pip install 'orchestra[serve-http]').

    python examples/serve_http.py --port 8080            # needs an NVIDIA GPU
    python examples/serve_http.py --port 8080 --cpu      # the same server, numpy instead of CUDA
    python examples/serve_http.py --port 8080 --process  # the engine in a process of its own
    python examples/serve_http.py --port 8080 --workers 4  # 4 server processes on one port

    POST /infer   body: float32 little-endian bytes, rows x --row floats
                  (Content-Type: application/octet-stream), or JSON {"x": [[...], ...]}
                  of finite numbers -> the output in the same form: y = x * 0.5 + 1 per
                  element (the demo graph); 400 says what was wrong with a request
    GET  /stats   the engine's statistics (JSON)
    GET  /health  "ok" once the engine is warm

A request of r rows runs on the smallest bucket that fits (padded, sliced back); many concurrent
connections share the engine: each handler awaits ``engine.run`` on the server's event loop,
which never blocks. Bad input is 400 with the engine's message, a full queue 503, a broken GPU
context 500 (restart the process). With --process the engine runs in a child process, and a
new one replaces it after a sticky CUDA error (503 while it starts). With --workers K, K server
processes (each its own engine on the same GPU) listen on the one port (SO_REUSEPORT: the
kernel spreads the connections): one Python process serves as many requests as its GIL lets
through, K serve more (docs/serving.md, "Several processes"); they stop when this process
does, even when it is killed. --port 0 serves on a free port, and "serving on" says which; a
port already in use (by anything, a second server too) is one line and exit status 1. Ctrl-C
(SIGINT, at the terminal: every process of the group) or SIGTERM stops the server and closes
the engine (every worker's): exit status 0, or 128 + the signal's number (130 for SIGINT) when
it came before the server said "serving on".
"""

from __future__ import annotations

import os
import signal

if __name__ == "__main__":
    # a Ctrl-C while the modules below load (about a second: numpy, aiohttp, orchestra) would
    # end in a KeyboardInterrupt traceback from inside some import: exit 130 at once and
    # quietly, as one while the engine starts does. Nothing needs cleaning up yet (at most
    # main()'s listening sockets, which the exit closes), and os._exit cannot be caught on
    # its way out as an exception could; main() puts Python's own handler back before the
    # engine starts
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

import argparse
import asyncio
import errno
import functools
import json
import multiprocessing
import multiprocessing.connection
import socket
import sys
from collections.abc import Callable

import numpy as np
from aiohttp import web

from orchestra.errors import NoDeviceError, OrchestraError
from orchestra.serve import (BadRequest, Engine, EngineBroken, EngineProcessError, NumpyBackend,
                             Overloaded, ProcessEngine)
from orchestra.serve.demo import demo_graph, demo_reference

ENGINE = web.AppKey("engine", object)  # an Engine or a ProcessEngine


JSON_FORM = 'send {"x": [...]}: one row of floats, or a list of rows'


def _json_rows(body) -> np.ndarray:
    """A JSON request's rows as float32 (one row or a list of rows), or a 400 that says what
    to send: the body must be an object with "x", and its numbers finite (JSON's null, and
    Python's NaN and Infinity tokens, are not JSON numbers)."""
    if not isinstance(body, dict) or "x" not in body:
        raise web.HTTPBadRequest(text=f"the JSON body has no \"x\": {JSON_FORM}")
    try:
        x = np.asarray(body["x"], dtype=np.float32)
    except (ValueError, TypeError):
        raise web.HTTPBadRequest(text=f"\"x\" is not numbers in rows of equal length: "
                                      f"{JSON_FORM}") from None
    if not np.isfinite(x).all():
        raise web.HTTPBadRequest(text="\"x\" holds null, NaN or infinity: JSON input must be "
                                      "finite numbers (send application/octet-stream, float32 "
                                      "bytes, for the others)")
    return x.reshape(1, -1) if x.ndim == 1 else x


def make_app(engine, row: int) -> web.Application:
    """The aiohttp application serving ``engine`` (one float32 input ``x`` of ``row`` floats
    per row, one output)."""

    async def infer(request: web.Request) -> web.Response:
        as_json = request.content_type == "application/json"
        try:
            if as_json:
                x = _json_rows(await request.json())
            else:
                raw = await request.read()
                if len(raw) % (4 * row):
                    raise web.HTTPBadRequest(text=f"the body is {len(raw)} bytes: send whole "
                                                  f"rows of {row} float32 values "
                                                  f"({4 * row} bytes each)")
                x = np.frombuffer(raw, dtype="<f4").reshape(-1, row)
        except (ValueError, KeyError, TypeError) as exc:
            raise web.HTTPBadRequest(text=f"could not read the request: {exc}") from None
        try:
            y = await engine.run(np.ascontiguousarray(x))
        except BadRequest as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        except Overloaded as exc:
            raise web.HTTPServiceUnavailable(text=str(exc)) from None
        except (EngineBroken, EngineProcessError) as exc:
            raise web.HTTPInternalServerError(text=str(exc)) from None
        if as_json:
            try:  # strict JSON: NaN and Infinity are not JSON numbers
                text = json.dumps({"y": y.tolist()}, allow_nan=False)
            except ValueError:
                raise web.HTTPUnprocessableEntity(
                    text="the result holds NaN or infinity, which JSON cannot carry: send the "
                         "request as application/octet-stream (float32 bytes) to get it"
                ) from None
            return web.json_response(text=text)
        return web.Response(body=y.astype("<f4").tobytes(),
                            content_type="application/octet-stream")

    async def stats(request: web.Request) -> web.Response:
        # with --workers, each server process answers for its own engine: server_pid says which
        return web.json_response({**json.loads(engine.stats_json()), "server_pid": os.getpid()})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app[ENGINE] = engine
    app.router.add_post("/infer", infer)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    return app


def engine_for(row: int, max_rows: int, instances: int, batching: bool, cpu: bool,
               device: int) -> Engine:
    """The engine this server runs (module level: with --process the engine process calls it)."""
    spec = {"x": ((row,), "float32")}
    out = {"y": ((row,), "float32")}
    kw = dict(inputs=spec, outputs=out, buckets="pow2", max_rows=max_rows,
              instances=instances, batching=True if batching else None)
    if cpu:
        return Engine(backend=NumpyBackend(lambda d: demo_reference(d["x"])), **kw)
    return Engine(functools.partial(demo_graph, memory="external"), device=device, **kw)


def make_engine(args):
    """An `Engine`, or with --process a `ProcessEngine` (the engine in a process of its own,
    replaced up to --restarts times after a sticky CUDA error)."""
    how = (args.row, args.max_rows, args.instances, args.batching, args.cpu, args.device)
    if args.process:
        return ProcessEngine(engine_for, how, slots=256, restarts=args.restarts)
    return engine_for(*how)


def listening_sockets(host: str, port: int, count: int) -> list:
    """``count`` TCP sockets listening on ``host``:``port`` (port 0: a free one the system picks),
    made before any engine so that a taken port fails at once. Several: one per --workers
    process, with SO_REUSEPORT (the kernel spreads the connections over them, and one that
    arrives for a worker still warming up waits in its socket's queue). SO_REUSEPORT would
    also let a second server that sets it bind beside this one, so a plain bind comes first:
    it fails where anything listens on the port already (a second server started in the same
    instant could still slip through; anything later is refused)."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    if count == 1:
        return [socket.create_server((host, port), family=family)]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server does
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # here too
        probe.bind((host, port))
        port = probe.getsockname()[1]
    socks: list = []
    try:
        for _ in range(count):
            socks.append(socket.create_server((host, port), family=family, reuse_port=True))
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]  # the real one, also with --port 0
    return f"http://[{host}]:{port}/infer" if ":" in host else f"http://{host}:{port}/infer"


def serve(args, sock: socket.socket, stop=None, ready=None) -> int:
    """Make and warm up the engine, then serve on ``sock`` until SIGINT or SIGTERM. As a
    --workers process (module level: every worker runs it) ``stop`` is its `_Stop` and
    ``ready`` the event it sets once it serves."""
    engine = None
    try:
        engine = make_engine(args)
        engine.warmup()
    except NoDeviceError as exc:
        print(f"serve_http: {exc} (or run with --cpu)", file=sys.stderr)
        return 2
    except OrchestraError as exc:
        print(f"serve_http: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the server served: no traceback, nothing left
        if engine is not None:
            engine.close()
        return 130
    app = make_app(engine, args.row)

    async def close_engine(app):
        app[ENGINE].close()

    app.on_cleanup.append(close_engine)
    if stop is None:
        print(f"serving on {url(args.host, sock)}", flush=True)
        web.run_app(app, sock=sock, print=None)
        return 0
    if stop.requested:  # stopped while the engine warmed up
        engine.close()
        return 0
    return asyncio.run(_serve_worker(app, sock, stop, ready))


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def ignore_stop_signals() -> None:
    """Once a process is stopping: a stop signal that comes later (a second Ctrl-C) must not
    end it by a signal. A handler of its own would not do: Python puts the default handler
    back for such a signal as it exits, and a repeat that came then would kill the process
    (exit status -2, or -15); SIG_IGN is what it leaves in place."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class _Stop:
    """When a --workers process stops: at the first SIGINT or SIGTERM, or once its parent has
    exited (killed, it could not stop this one: nobody else would; noticed once it serves).
    Repeats are ignored: a Ctrl-C at a terminal reaches every process of the group and the
    parent passes the stop on as well, and a second one must not interrupt the engine while
    it closes."""

    def __init__(self) -> None:
        self.requested = False
        self._wake: Callable[[], object] | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # a repeat finds the stop requested and does nothing (SIG_IGN set here instead would
        # make Python raise for a second signal that came with this one, awaiting its turn)
        if not self.requested:
            self.requested = True
            if self._wake is not None:
                self._wake()

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        # a signal handler runs on the main thread between two bytecodes, perhaps while the
        # loop sleeps in its selector: call_soon_threadsafe wakes the loop (as asyncio.run's
        # own SIGINT handler does)
        self._wake = lambda: loop.call_soon_threadsafe(stopped.set)
        # the parent holds the only write end of the pipe behind this descriptor: it turns
        # readable (end of file) when the parent exits, however it exits
        parent = multiprocessing.parent_process()
        assert parent is not None and parent.sentinel is not None
        loop.add_reader(parent.sentinel, stopped.set)
        try:
            if not self.requested:
                await stopped.wait()
        finally:
            loop.remove_reader(parent.sentinel)
            self._wake = None


async def _serve_worker(app, sock, stop: _Stop, ready) -> int:
    """One --workers process: serve on its listening socket (the parent made it), say so,
    serve until told to stop, then close (the engine with it)."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        ready.set()
        await stop.wait()
    finally:
        await runner.cleanup()  # on_cleanup: the engine closes
    return 0


def _worker(args, sock, ready) -> None:
    stop = _Stop()
    # the parent started this process with SIGINT and SIGTERM blocked (a signal mask outlives
    # fork and exec), so that one sent while it imported did not raise KeyboardInterrupt there:
    # with the handlers in place, one that came meanwhile is delivered now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    code = serve(args, sock, stop, ready)
    ignore_stop_signals()  # served and closed
    sys.exit(code)


def serve_workers(args, socks: list) -> int:
    """--workers K: K processes (spawned: no CUDA state inherited), each serving on one of
    ``socks``; this one says "serving on" once every one serves. SIGINT or SIGTERM (here, or at
    every process of the group, as Ctrl-C at a terminal does) stops them all, each closing its
    engine: exit status 0, or 128 + the signal's number when that came before all of them
    served. If one exits by itself (or fails to start) the others are stopped too and the exit
    status is 1."""
    stopping: list[int] = []  # the signals that came
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in socks]
    procs = [ctx.Process(target=_worker, args=(args, sock, ev), name=f"serve_http-worker-{k}")
             for k, (sock, ev) in enumerate(zip(socks, ready))]
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the workers unblock them (_worker)
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    where = url(args.host, socks[0])
    for sock in socks:
        sock.close()  # each worker has its own: once it exits, nothing listens on its socket
    announced = False
    while not stopping and all(p.is_alive() for p in procs):
        if not announced and all(ev.is_set() for ev in ready):
            print(f"serving on {where} with {args.workers} worker processes", flush=True)
            announced = True
        # short: a signal's handler only notes it, and the wait goes on to its timeout
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.1)
    ignore_stop_signals()  # stopping: from here on a stop signal is a repeat, not noted
    early = [p for p in procs if not p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.terminate()  # SIGTERM: the worker's graceful exit, its engine closes
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    if early and not stopping:
        codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in early)
        print(f"serve_http: a worker exited on its own ({codes}); stopped the others",
              file=sys.stderr)
        return 1
    failed = [p for p in procs if p.exitcode != 0]
    if failed:
        codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in failed)
        print(f"serve_http: a worker did not stop cleanly ({codes})", file=sys.stderr)
        return 1
    return 0 if announced else 128 + stopping[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="HTTP inference endpoint over orchestra.serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="default 8080; 0: a free one (the "
                                                           "server prints which)")
    p.add_argument("--row", type=int, default=1024, help="floats per row (default 1024)")
    p.add_argument("--max-rows", type=int, default=64, help="the largest bucket (default 64)")
    p.add_argument("--instances", type=int, default=4, help="instances per bucket (4)")
    p.add_argument("--batching", action="store_true", help="dynamic batching on")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="numpy instead of CUDA (no GPU needed)")
    p.add_argument("--process", action="store_true",
                   help="run the engine in a process of its own (orchestra.serve.ProcessEngine)")
    p.add_argument("--restarts", type=int, default=3,
                   help="with --process: how often a new engine process may replace one that "
                        "died or hit a sticky CUDA error (default 3)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes on the one port, each with its own engine on the "
                        "same GPU (default 1; Linux: SO_REUSEPORT)")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be 0-65535 (0: a free one), got {args.port}")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1 and not hasattr(socket, "SO_REUSEPORT"):
        p.error("--workers above 1 needs SO_REUSEPORT (Linux)")
    try:
        socks = listening_sockets(args.host, args.port, args.workers)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"serve_http: port {args.port} on {args.host} is in use", file=sys.stderr)
        else:
            print(f"serve_http: cannot listen on {args.host}:{args.port}: "
                  f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    # from here on a Ctrl-C is serve()'s KeyboardInterrupt (and aiohttp's graceful stop once
    # it serves) or serve_workers()'s handlers: Python's own handler back (asyncio.Runner,
    # which run_app uses, only installs its own over that one)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.workers > 1:
            return serve_workers(args, socks)
        return serve(args, socks[0])
    finally:
        for sock in socks:
            sock.close()

if __name__ == "__main__":
    sys.exit(main())

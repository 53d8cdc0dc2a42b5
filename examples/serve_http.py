"""An HTTP endpoint over orchestra.serve.Engine, with aiohttp (pip install 'orchestra[serve-http]').

    python examples/serve_http.py --port 8080            # needs an NVIDIA GPU
    python examples/serve_http.py --port 8080 --cpu      # the same server, numpy instead of CUDA
    python examples/serve_http.py --port 8080 --process  # the engine in a process of its own
    python examples/serve_http.py --port 8080 --workers 4  # 4 server processes on one port

    POST /infer   body: float32 little-endian bytes, rows x --row floats
                  (Content-Type: application/octet-stream), or JSON {"x": [[...], ...]}
                  -> the output in the same form: y = x * 0.5 + 1 per element (the demo graph)
    GET  /stats   the engine's statistics (JSON)
    GET  /health  "ok" once the engine is warm

A request of r rows runs on the smallest bucket that fits (padded, sliced back); many concurrent
connections share the engine: each handler awaits ``engine.run`` on the server's event loop,
which never blocks. Bad input is 400 with the engine's message, a full queue 503, a broken GPU
context 500 (restart the process). With --process the engine runs in a child process, and a
new one replaces it after a sticky CUDA error (503 while it starts). With --workers K, K server
processes (each its own engine on the same GPU) listen on the one port (SO_REUSEPORT: the
kernel spreads the connections): one Python process serves as many requests as its GIL lets
through, K serve more (docs/serving.md, "Several processes"). Ctrl-C stops the server and
closes the engine (every worker's).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys

import numpy as np
from aiohttp import web

from orchestra.errors import NoDeviceError, OrchestraError
from orchestra.serve import (BadRequest, Engine, EngineBroken, EngineProcessError, NumpyBackend,
                             Overloaded, ProcessEngine)
from orchestra.serve.demo import demo_graph, demo_reference

ENGINE = web.AppKey("engine", object)  # an Engine or a ProcessEngine


def make_app(engine, row: int) -> web.Application:
    """The aiohttp application serving ``engine`` (one float32 input ``x`` of ``row`` floats
    per row, one output)."""

    async def infer(request: web.Request) -> web.Response:
        as_json = request.content_type == "application/json"
        try:
            if as_json:
                body = await request.json()
                x = np.asarray(body["x"], dtype=np.float32)
                if x.ndim == 1:
                    x = x.reshape(1, -1)
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
            return web.json_response({"y": y.tolist()})
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


def serve(args, ready=None) -> int:
    """Make and warm up the engine, then serve until SIGINT (or, as a --workers process, until
    SIGINT or SIGTERM: ``ready`` is the event it sets once it listens). Module level: every
    worker process runs it."""
    try:
        engine = make_engine(args)
        engine.warmup()
    except NoDeviceError as exc:
        print(f"serve_http: {exc} (or run with --cpu)", file=sys.stderr)
        return 2
    except OrchestraError as exc:
        print(f"serve_http: {exc}", file=sys.stderr)
        return 1
    app = make_app(engine, args.row)

    async def close_engine(app):
        app[ENGINE].close()

    app.on_cleanup.append(close_engine)
    if ready is None:
        print(f"serving on http://{args.host}:{args.port}/infer", flush=True)
        web.run_app(app, host=args.host, port=args.port, print=None)
        return 0
    return asyncio.run(_serve_worker(app, args, ready))


async def _serve_worker(app, args, ready) -> int:
    """One --workers process: listen with SO_REUSEPORT beside the others, say so, serve until
    SIGINT or SIGTERM, then close (the engine with it)."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, args.host, args.port, reuse_port=True).start()
        except OSError as exc:  # the port is taken by a process that did not set SO_REUSEPORT
            print(f"serve_http: cannot listen on {args.host}:{args.port}: {exc}",
                  file=sys.stderr)
            return 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        ready.set()
        await stop.wait()
    finally:
        await runner.cleanup()  # on_cleanup: the engine closes
    return 0


def _worker(args, ready) -> None:
    sys.exit(serve(args, ready))


def serve_workers(args) -> int:
    """--workers K: K processes (spawned: no CUDA state inherited) serving on one port; this one
    says "serving on" once every one listens. SIGINT or SIGTERM here stops them all (each
    closes its engine); if one exits by itself (or fails to start) the others are stopped too
    and the exit status is 1."""
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(args.workers)]
    procs = [ctx.Process(target=_worker, args=(args, ev), name=f"serve_http-worker-{k}")
             for k, ev in enumerate(ready)]
    stopping: list = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    for p in procs:
        p.start()
    announced = False
    try:
        while not stopping and all(p.is_alive() for p in procs):
            if not announced and all(ev.is_set() for ev in ready):
                print(f"serving on http://{args.host}:{args.port}/infer with {args.workers} "
                      f"worker processes", flush=True)
                announced = True
            multiprocessing.connection.wait([p.sentinel for p in procs],
                                            timeout=0.5 if announced else 0.05)
    except KeyboardInterrupt:
        stopping.append("SIGINT")
    early = [p for p in procs if not p.is_alive()]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGINT)  # the worker's graceful exit: its engine closes
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
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="HTTP inference endpoint over orchestra.serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
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
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.workers > 1:
        if not hasattr(socket, "SO_REUSEPORT"):
            p.error("--workers above 1 needs SO_REUSEPORT (Linux)")
        return serve_workers(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())

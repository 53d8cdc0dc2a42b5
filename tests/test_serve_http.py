"""The HTTP example (examples/serve_http.py) started on 127.0.0.1 with a free port and driven by
aiohttp's client from many concurrent connections; every response is checked against numpy.
On the CPU with ``--cpu`` (numpy instead of CUDA), on the GPU as shipped. Skipped without
aiohttp (the ``serve-http`` extra)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the HTTP example needs aiohttp "
                                                "(pip install 'orchestra[serve-http]')")

from orchestra.serve.demo import demo_reference  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve_http.py"
ROW = 256
MAX_ROWS = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port), "--row",
                             str(ROW), "--max-rows", str(MAX_ROWS), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def _stop(proc, timeout: float = 60.0) -> str:
    """Stop the server with SIGINT (its graceful exit: every engine closes), killed if it does
    not exit within ``timeout``. Its remaining output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read()


async def _wait_ready(session, base: str, proc, timeout: float = 90.0) -> None:
    t = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n"
                                 f"{proc.stdout.read()}")
        try:
            async with session.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > t:
            raise AssertionError("the server did not come up")
        await asyncio.sleep(0.1)


async def _requests(session, base: str, rng, requests: int, wrong: list) -> None:
    """``requests`` POSTs of 1..MAX_ROWS rows at once; the index of every response that
    differs from numpy's goes into ``wrong``."""

    async def one(i):
        rows = 1 + i % MAX_ROWS
        x = (rng.standard_normal((rows, ROW)) * 10).astype(np.float32)
        async with session.post(f"{base}/infer", data=x.tobytes(),
                                headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 200, await r.text()
            y = np.frombuffer(await r.read(), dtype="<f4").reshape(rows, ROW)
        if y.tobytes() != demo_reference(x).tobytes():
            wrong.append(i)

    await asyncio.gather(*(one(i) for i in range(requests)))


async def _drive(port: int, proc, connections: int = 32, requests: int = 400) -> dict:
    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    wrong = []
    async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections)) as session:
        await _wait_ready(session, base, proc)

        await _requests(session, base, rng, requests, wrong)
        # JSON in, JSON out
        x = [[1.0] * ROW, [2.0] * ROW]
        async with session.post(f"{base}/infer", json={"x": x}) as r:
            assert r.status == 200
            got = np.asarray((await r.json())["y"], np.float32)
        assert got.tobytes() == demo_reference(np.asarray(x, np.float32)).tobytes()
        # bad requests: 400 with the engine's message, the server keeps serving
        async with session.post(f"{base}/infer", data=b"\0" * 6,
                                headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 400 and "whole rows" in await r.text()
        too_big = np.zeros((MAX_ROWS + 1, ROW), np.float32).tobytes()
        async with session.post(f"{base}/infer", data=too_big,
                                headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 400 and "largest bucket" in await r.text()
        async with session.get(f"{base}/stats") as r:
            stats = await r.json()
    assert not wrong, f"{len(wrong)} wrong responses"
    return stats


def _run(*extra: str) -> None:
    port = _free_port()
    proc = _start(port, *extra)
    try:
        stats = asyncio.run(_drive(port, proc))
        served = sum(b["requests"] for b in stats["buckets"].values())
        assert served == 400 + 1
        if "--process" in extra:  # the too-large one was refused before it left the server
            assert stats["engine"]["bad_requests"] == 0
            assert stats["process"]["bad"] == 1 and stats["process"]["requests"] == 401
        else:
            assert stats["engine"]["bad_requests"] == 1  # the too-large one reached it
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out


async def _drive_workers(port: int, proc, workers: int, requests: int = 400) -> dict:
    """Every request on a connection of its own (the kernel picks a worker per connection);
    then each worker's statistics, asked until every worker has answered."""
    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(1)
    wrong = []
    conn = aiohttp.TCPConnector(limit=32, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        await _wait_ready(session, base, proc)

        await _requests(session, base, rng, requests, wrong)
        by_pid: dict = {}
        for _ in range(400):
            async with session.get(f"{base}/stats") as r:
                st = await r.json()
            by_pid[st["server_pid"]] = st
            if len(by_pid) == workers:
                break
    assert not wrong, f"{len(wrong)} wrong responses"
    return by_pid


def _run_workers(workers: int, *extra: str) -> None:
    port = _free_port()
    proc = _start(port, "--workers", str(workers), *extra)
    try:
        # a worker that still warms up does not listen yet, and the kernel gives every
        # connection to the others: the server says "serving on" once all of them listen
        t = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("serving on"):
                break
            assert time.monotonic() < t, "the workers did not all come up"
        else:
            raise AssertionError(f"the server exited with {proc.wait()} before serving")
        by_pid = asyncio.run(_drive_workers(port, proc, workers))
        assert len(by_pid) == workers, f"only {len(by_pid)} of {workers} workers answered"
        served = [sum(b["requests"] for b in st["buckets"].values()) for st in by_pid.values()]
        assert sum(served) == 400 and all(n > 0 for n in served), served
    finally:
        out = _stop(proc)  # the parent stops every worker
    assert proc.returncode == 0, out


def test_http_example_with_two_worker_processes_on_one_port():
    _run_workers(2, "--cpu")


def test_http_example_refuses_zero_workers():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--workers", "0", "--cpu"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--workers must be >= 1, got 0" in out.stderr


def test_http_example_on_the_cpu_backend():
    _run("--cpu")


def test_http_example_with_batching_on_the_cpu_backend():
    _run("--cpu", "--batching")


def test_http_example_with_the_engine_in_a_process_of_its_own():
    _run("--cpu", "--process")


@pytest.mark.gpu
def test_http_example_on_the_gpu():
    _run()


@pytest.mark.gpu
def test_http_example_on_the_gpu_with_batching():
    _run("--batching")


@pytest.mark.gpu
def test_http_example_on_the_gpu_with_the_engine_in_a_process_of_its_own():
    _run("--process")


@pytest.mark.gpu
def test_http_example_on_the_gpu_with_two_worker_processes():
    _run_workers(2, "--batching")

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


def _start(port: int, *extra: str, new_session: bool = False) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(EXAMPLE), "--port", str(port), "--row",
                             str(ROW), "--max-rows", str(MAX_ROWS), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=new_session)


def _serving_port(proc, timeout: float = 120.0) -> int:
    """The port of the server's "serving on" line (with --workers, printed once every worker
    serves), read from its output."""
    t = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith("serving on"):
            port = int(line.split()[2].rsplit(":", 1)[1].split("/")[0])
            assert port != 0, line
            return port
        assert time.monotonic() < t, "the server did not come up"
    raise AssertionError(f"the server exited with {proc.wait()} before serving")


def _stop(proc, sig=signal.SIGINT, group: bool = False, timeout: float = 60.0) -> str:
    """Stop the server with ``sig`` (its graceful exit: every engine closes), sent to it or,
    with ``group``, to its whole process group as a terminal's Ctrl-C is; killed if it does
    not exit within ``timeout``. Its remaining output."""
    if proc.poll() is None:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read()


def _children(pid: int) -> list:
    """The pids of ``pid``'s multiprocessing children that still run (Linux: /proc)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and b"spawn_main" in cmd:
            found.append(int(d.name))
    return found


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


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
        # bad JSON: 400s that say what to send, before the engine sees them
        for body, says in (([1.0] * ROW, 'has no "x"'), ({"y": 1}, 'has no "x"'),
                           ({"x": [[1.0], [1.0, 2.0]]}, "rows of equal length"),
                           ({"x": [None] * ROW}, "null, NaN or infinity")):
            async with session.post(f"{base}/infer", json=body) as r:
                assert r.status == 400 and says in await r.text(), (body, await r.text())
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


def _run(*extra: str, port: int | None = None) -> None:
    proc = _start(_free_port() if port is None else port, *extra)
    try:
        port = _serving_port(proc)
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


def _run_workers(workers: int, *extra: str, port: int | None = None) -> None:
    proc = _start(_free_port() if port is None else port, "--workers", str(workers), *extra)
    try:
        # a worker that still warms up does not serve yet, and every connection would go to
        # the others: the server says "serving on" once all of them serve
        port = _serving_port(proc)
        by_pid = asyncio.run(_drive_workers(port, proc, workers))
        assert len(by_pid) == workers, f"only {len(by_pid)} of {workers} workers answered"
        served = [sum(b["requests"] for b in st["buckets"].values()) for st in by_pid.values()]
        assert sum(served) == 400 and all(n > 0 for n in served), served
    finally:
        out = _stop(proc)  # the parent stops every worker
    assert proc.returncode == 0, out


def _assert_clean(out: str) -> None:
    assert "Traceback" not in out and "Error" not in out, out


def test_http_example_with_two_worker_processes_on_one_port():
    _run_workers(2, "--cpu")


def test_http_example_with_two_worker_processes_on_port_0():
    _run_workers(2, "--cpu", port=0)  # one free port for both, and the server says which


def test_http_example_on_port_0():
    _run("--cpu", port=0)


@pytest.mark.parametrize("workers", [1, 2])
def test_http_example_on_a_taken_port_says_so(workers):
    with socket.socket() as held:  # a listener of another program, no SO_REUSEPORT
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, str(EXAMPLE), "--port", str(port), "--cpu",
                              "--workers", str(workers)], capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 1, out
    assert out.stderr == f"serve_http: port {port} on 127.0.0.1 is in use\n", out.stderr
    assert "serving on" not in out.stdout, out.stdout


def test_a_second_http_example_with_workers_on_the_same_port_is_refused():
    first = _start(_free_port(), "--workers", "2", "--cpu")
    try:
        port = _serving_port(first)
        second = subprocess.run([sys.executable, str(EXAMPLE), "--port", str(port), "--cpu",
                                 "--workers", "2"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second
        assert second.stderr == f"serve_http: port {port} on 127.0.0.1 is in use\n", second
        assert "serving on" not in second.stdout
        by_pid = asyncio.run(_drive_workers(port, first, 2, requests=40))  # the first serves on
        assert len(by_pid) == 2
    finally:
        out = _stop(first)
    assert first.returncode == 0, out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("again", [None, 0.02, 0.1], ids=["once", "again-after-0.02s",
                                                         "again-after-0.1s"])
def test_http_example_workers_stop_on_a_ctrl_c_at_the_terminal(again):
    # a terminal's Ctrl-C: SIGINT to every process of the group, the workers as well as the
    # parent, which passes the stop on to them too; pressed twice, the second one reaches
    # them while they stop
    proc = _start(_free_port(), "--workers", "2", "--cpu", new_session=True)
    try:
        _serving_port(proc)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        if again is not None:
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(again)
    finally:
        out = _stop(proc, group=True)
    assert proc.returncode == 0, out
    _assert_clean(out)
    assert not [pid for pid in workers if _running(pid)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_http_example_ctrl_c_while_the_workers_start():
    proc = _start(_free_port(), "--workers", "2", "--cpu", new_session=True)
    try:
        t = time.monotonic() + 60
        while not _children(proc.pid):  # the workers have just been started: none serves yet
            assert proc.poll() is None and time.monotonic() < t, proc.stdout.read()
            time.sleep(0.005)
    finally:
        out = _stop(proc, group=True)
    assert proc.returncode == 130, out  # stopped before it served
    assert "serving on" not in out
    _assert_clean(out)


def _mapped(pid: int, name: str) -> bool:
    """Whether a file whose path contains ``name`` is mapped into process ``pid`` (Linux)."""
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # not started yet, or gone
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02])
def test_http_example_ctrl_c_while_it_imports_its_modules(delay):
    # a Ctrl-C while the example loads numpy, aiohttp and orchestra (about a second, before
    # main() runs) was a KeyboardInterrupt traceback from inside some import; it is exit
    # status 130 and nothing printed, as a Ctrl-C while the engine starts is. The signal goes
    # once numpy's extension module is mapped: Python's own start-up is over and the
    # example's imports are under way, with aiohttp's and orchestra's still to come
    proc = _start(_free_port(), "--cpu")
    try:
        t = time.monotonic() + 60
        while not _mapped(proc.pid, "_multiarray_umath"):
            assert proc.poll() is None and time.monotonic() < t, proc.stdout.read()
            time.sleep(0.0005)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out
    assert "serving on" not in out
    _assert_clean(out)
    assert "KeyboardInterrupt" not in out and len(out.splitlines()) <= 1, out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_http_example_workers_stop_when_the_parent_is_killed():
    proc = _start(_free_port(), "--workers", "2", "--cpu")
    workers: list = []
    try:
        _serving_port(proc)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        proc.kill()  # SIGKILL: the parent cannot stop them
        proc.wait()
        t = time.monotonic() + 20
        while [pid for pid in workers if _running(pid)] and time.monotonic() < t:
            time.sleep(0.05)
        left = [pid for pid in workers if _running(pid)]
        assert not left, f"workers {left} outlived their parent"
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        _stop(proc)


def test_http_example_refuses_zero_workers():
    out = subprocess.run([sys.executable, str(EXAMPLE), "--workers", "0", "--cpu"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--workers must be >= 1, got 0" in out.stderr


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_http_example_refuses_a_port_out_of_range(port):
    # 99999 was an OverflowError traceback from bind(), -1 a resolver's message and status 1
    out = subprocess.run([sys.executable, str(EXAMPLE), "--port", port, "--cpu"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert f"--port must be 0-65535 (0: a free one), got {port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


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

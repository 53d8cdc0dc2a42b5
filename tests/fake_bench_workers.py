"""Worker processes for tests/test_serve_bench_processes.py that fail or hang on purpose, in
place of `orchestra.serve.bench_processes._worker` (a test sets that module attribute; the
spawned children import this module by name to run them). Module level, so they pickle."""

from __future__ import annotations

import os
import signal
import time

from orchestra.serve.bench_processes import _worker


def dies_before_the_start(o, contender, threads, index, barrier, conn):
    """Worker 1 exits with status 3 while the others warm up (a crash: no answer, and the
    barrier is not broken by it); every other worker is the real one."""
    if index == 1:
        os._exit(3)
    _worker(o, contender, threads, index, barrier, conn)


def runs_on(o, contender, threads, index, barrier, conn):
    """Writes its pid to ``$ORCHESTRA_TEST_PIDS/<index>``, waits at the barrier and then
    sleeps far past any test, as a worker in a long window does; worker 1 ignores SIGTERM as
    one stuck where SIGTERM does not end it, so only SIGKILL does."""
    if index == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    folder = os.environ["ORCHESTRA_TEST_PIDS"]
    with open(os.path.join(folder, f"{index}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, f"{index}.tmp"), os.path.join(folder, str(index)))
    barrier.wait(60)
    time.sleep(600)


def killed_in_its_window(o, contender, threads, index, barrier, conn):
    """Worker 1 is killed (SIGKILL) once the windows have started; every other worker is the
    real one and hands back its figures."""
    if index == 1:
        barrier.wait(60)
        os.kill(os.getpid(), signal.SIGKILL)
    _worker(o, contender, threads, index, barrier, conn)

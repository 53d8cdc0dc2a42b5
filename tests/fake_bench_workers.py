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

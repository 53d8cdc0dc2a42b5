"""Stalls of the machine itself, seen from a process of their own: what of an event loop's
lag no code in the server could have avoided.

An event loop's lag (`orchestra.serve.loop_lag`) counts everything that kept the loop from
running: its own callbacks, the garbage collector, the GIL, and the machine under it. On a
virtual machine the hypervisor can stop a virtual CPU for a while (steal); interrupts and
page reclaim can hold a CPU too. `HostStallProbe` runs a second Python process that does
nothing but fixed CPU work in chunks of about 10-20 µs and notes every gap between two chunk
ends longer than ``threshold_ms`` in which it was not waiting for a CPU (a gap spent in
Linux's run queue is this machine's own work on that CPU, counted apart as ``preempted``).
That process shares no GIL, no memory and no callbacks with the server.

`lag_causes` takes its stalls (``host_stalls=``) for the late samples in which the loop
thread was off its CPU without waiting for one (what would otherwise read as a wait for the
GIL): such a sample is put down to the machine when it would have been within the bound
without a stall the probe saw at the same time. The attribution is conservative: the probe
sees stalls of its own CPU only, so a stop of the loop's CPU alone is not seen, and a sample
in which the loop thread ran (busy) stays the loop's. The probe keeps one CPU busy while it
runs. Linux only (``time.perf_counter`` is ``CLOCK_MONOTONIC``, the same clock in both
processes; steal and the run-queue wait are read from ``/proc``).

Run as a script (``python host_stalls.py THRESHOLD_MS``) it is the measuring process: it
prints ``ready``, measures until its standard input closes, and prints one JSON line; it
imports only the standard library (it starts in about 20-50 ms).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import select
import subprocess
import sys
import time

_CHUNK_ITERS = 300  # about 15-20 µs of bytecode on a 2-3 GHz core
_MAX_STALLS = 100_000  # a list this long is a machine stalling all the time: enough to say so


def _steal_ms() -> float | None:
    """The whole machine's steal time so far in ms (``/proc/stat``, its 8th cpu field), or
    None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1e3 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _run_queue_s(fd: int | None) -> float | None:
    """This thread's time so far runnable but not running, in s (``schedstat``'s second
    field), or None where unknown."""
    if fd is None:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _measure(threshold_s: float, stdin_fd: int) -> dict:
    """The measuring process's loop: chunks of fixed work until ``stdin_fd`` is readable (its
    end closed); every gap between chunk ends over ``threshold_s`` plus the chunk's own time
    is a stall ``(start s, end s)``, unless this thread spent half of it or more waiting for
    a CPU (Linux's run queue: a CPU busy with other work of this machine, counted apart as
    ``preempted``)."""
    pc = time.perf_counter
    steal0 = _steal_ms()
    try:
        rq_fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        rq_fd = None
    stalls: list[tuple[float, float]] = []
    preempted = 0
    chunks = 0
    work = range(_CHUNK_ITERS)
    # the chunk's own time, measured before the run: a gap is a stall only past it
    t = pc()
    for _ in range(200):
        s = 0
        for i in work:
            s += i
    chunk_s = (pc() - t) / 200
    limit = threshold_s + chunk_s
    t0 = last = pc()
    rq = _run_queue_s(rq_fd)
    while True:
        for _ in range(64):  # about 1 ms between looks at stdin
            s = 0
            for i in work:
                s += i
            now = pc()
            if now - last > limit:
                # the run-queue wait since the last reading (at most ~1 ms before the gap)
                rq1 = _run_queue_s(rq_fd)
                gap = now - last - chunk_s
                if rq is not None and rq1 is not None and rq1 - rq >= gap / 2:
                    preempted += 1
                elif len(stalls) < _MAX_STALLS:
                    stalls.append((last + chunk_s, now))
                rq = rq1
                now = pc()
            last = now
        chunks += 64
        if select.select([stdin_fd], [], [], 0)[0]:
            break
        rq = _run_queue_s(rq_fd)
        last = pc()
    steal1 = _steal_ms()
    if rq_fd is not None:
        os.close(rq_fd)
    return {"stalls": stalls, "preempted": preempted, "chunks": chunks, "seconds": last - t0,
            "chunk_us": chunk_s * 1e6,
            "steal_ms": None if steal0 is None or steal1 is None else steal1 - steal0}


def _ready_line(proc: subprocess.Popen, timeout: float) -> bytes | None:
    """The measuring process's first line (``ready``; what it wrote before its output ended),
    or None when no line came within ``timeout`` s (a process that never starts to measure
    must not hang `start`). Its output
    is read byte by byte up to the newline: nothing past that line is taken from the pipe."""
    out = proc.stdout
    if out is None:
        return b""
    fd, line = out.fileno(), b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n") and len(line) < 64:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        got = os.read(fd, 1)
        if not got:
            return line
        line += got
    return line


class HostStallProbe:
    """Stalls of the host during a window, from a separate measuring process.

    ``threshold_ms``: the shortest gap (beyond its ~20 µs chunk) counted as a stall.
    `start` starts the process and returns once it measures (an interpreter start, tens of
    ms); `stop` ends it and returns ``{"stalls": [(start s, end s), ...]
    (time.perf_counter), "preempted" (gaps spent waiting for a CPU, not stalls), "chunks",
    "seconds", "chunk_us", "steal_ms" (the whole machine's steal in the window, None where
    unknown)}``, or None where the probe could not run (not Linux, or the process failed or
    did not answer within ``timeout``: the bench then says so and attributes nothing);
    ``why`` then says which, in words.

    Thread-safety: one thread starts and stops it.
    """

    def __init__(self, threshold_ms: float = 0.25):
        # orchestra's own errors imported here: run as a script, this file imports only the stdlib
        from orchestra.serve.errors import ServeConfigTypeError, ServeConfigValueError

        if isinstance(threshold_ms, bool) or not isinstance(threshold_ms, numbers.Real):
            raise ServeConfigTypeError(f"HostStallProbe: threshold_ms must be a number of ms, "
                                       f"got {threshold_ms!r}")
        # a float: the measuring process parses its repr (numpy's is "np.float64(...)")
        ms = float(threshold_ms)
        if not (math.isfinite(ms) and ms > 0):
            raise ServeConfigValueError(f"HostStallProbe: threshold_ms must be a finite number "
                                        f"of ms above 0 (0 or less counts every chunk as a "
                                        f"stall), got {ms:g}")
        self.threshold_ms: float = ms
        self._proc: subprocess.Popen | None = None
        self.why: str | None = None  # why the last start or stop gave nothing (None: it did)

    def start(self, timeout: float = 5.0) -> HostStallProbe:
        """Start the measuring process and wait (at most ``timeout`` s) until it measures; a
        process that does not say so in time is ended (`stop` then returns None). Nothing
        where it runs already."""
        if self._proc is not None:
            return self
        if not sys.platform.startswith("linux"):
            self.why = f"Linux only, this is {sys.platform}"
            return self
        self.why = None
        try:
            # -I: no site-packages, no user environment; the script imports only the stdlib
            self._proc = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), repr(self.threshold_ms)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as exc:
            self._proc = None
            self.why = f"the measuring process did not start: {exc}"
            return self
        try:
            line = _ready_line(self._proc, timeout)
        except BaseException:  # Ctrl-C while waiting: no measuring process left behind
            self._kill()
            raise
        if line is None or line.strip() != b"ready":
            p = self._proc
            self._kill()
            if line is None:
                self.why = f"the measuring process did not start to measure within {timeout:g} s"
            elif not line:  # its output ended: it exited (or closed it)
                self.why = (f"the measuring process ended (exit status {p.returncode}) "
                            f"before it measured")
            else:
                self.why = f"the measuring process said {line.strip()[:40]!r}, not ready"
        return self

    def _kill(self) -> None:
        p, self._proc = self._proc, None
        if p is not None:
            p.kill()
            p.communicate()

    def stop(self, timeout: float = 5.0) -> dict | None:
        """End the measuring process and return what it saw (None: it did not run). Safe to
        call twice (the second returns None)."""
        p, self._proc = self._proc, None
        if p is None:
            self.why = self.why or "not running (not started, or stopped already)"
            return None
        try:
            out, _ = p.communicate(b"", timeout=timeout)  # closing stdin ends its loop
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            self.why = f"the measuring process did not answer within {timeout:g} s"
            return None
        except BaseException:  # Ctrl-C while waiting: no measuring process left behind
            p.kill()
            p.wait()
            raise
        try:
            got = _checked(json.loads(out.decode().splitlines()[-1]))
        except (ValueError, IndexError):
            got = None
        if got is None:
            self.why = ("the measuring process ended without its result" if p.returncode
                        else "the measuring process's result could not be read")
        return got


_KEYS = ("preempted", "chunks", "seconds", "chunk_us", "steal_ms")


def _number(v, none: bool = False) -> bool:
    return (v is None and none) or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _checked(got) -> dict | None:
    """The measuring process's answer in the form `HostStallProbe.stop` returns, or None when
    it is not that form (the process is this file, but what it printed is read as data: an
    answer that is not the dict it writes is a probe that did not run, never an error)."""
    if not isinstance(got, dict) or not isinstance(got.get("stalls"), list):
        return None
    if not all(k in got and _number(got[k], none=k == "steal_ms") for k in _KEYS):
        return None
    stalls = []
    for s in got["stalls"]:
        if not (isinstance(s, list) and len(s) == 2 and _number(s[0]) and _number(s[1])):
            return None
        stalls.append((float(s[0]), float(s[1])))
    got["stalls"] = stalls
    return got


if __name__ == "__main__":
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    result = _measure(float(sys.argv[1]) / 1e3, sys.stdin.fileno())
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()

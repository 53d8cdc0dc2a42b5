"""Serving ceiling probe (CPU only): the most requests/s CPython lets T threads hand through a
batcher, each thread with one request in flight (window 1, the default) or W requests in flight
(--window W), when nothing but the hand-off costs.

    python benchmarks/probe_serve_ceiling.py [--threads 8] [--gpu-us 40] [--seconds 1.5]
    python benchmarks/probe_serve_ceiling.py --window 1,32 --batches 32 --kib 64,1

No engine, no GPU: the leanest batching a Python process can do.

One request in flight per thread (window 1): each request copies its ``--kib`` KiB into a
batch's staging under one lock; the thread that fills a batch of B requests is its leader: it
releases the GIL for ``--gpu-us`` µs (libc ``usleep`` through ctypes: the stand-in for launch +
H2D + kernel + D2H + synchronize), writes the outputs (one numpy multiply), and wakes each
member on its own lock; each member copies its rows out. One wake-up per request and no timer:
the smallest hand-off cost possible. Copies are numpy's (which release the GIL for more than a
few hundred elements) or one memmove that keeps it. B must divide the threads (a batch is one
request of each of B threads); a B above the threads runs as the threads.

W requests in flight per thread (window W >= 2): each thread is a closed-loop client with a
sliding window: it submits until W of its requests are in flight, waits for the oldest, compares
every byte of its output with the expected bytes (``y.tobytes() != expected``, the check
``orchestra bench serve`` makes), counts it and submits another. A request is a
(1, KiB*256) float32 array (each thread's own value) and a lock the thread holds from the start;
submitting appends it to one FIFO under a condition. One batcher thread takes up to B requests
from the FIFO, waiting at most ``--delay-us`` after the first of them was queued for the batch
to fill (a partial batch goes at once when the run stops), and per batch makes one
``np.concatenate`` of the inputs into staging, releases the GIL for ``--gpu-us`` µs, makes one
``np.multiply`` into the output staging and one copy of the batch's output rows into a new
block; each request gets its row (a view of that block) and is woken by the release of its lock.
Here B need not divide the threads. A wrong output fails the run (exit status 1).

What it shows (docs/serving.md, "How fast threads can go"): with one request in flight per
thread, the hand-offs of the GIL, not the bytes, bound requests/s; with W in flight, the
batcher's per-batch cost is shared by B requests and each thread pays one submit, one wake-up
and one check per request. An engine cannot exceed these rows on the same host: compare a
windowed row with ``orchestra bench serve --mode closed --batching on --threads T --window W
--mix KiBK --max-batch B*rows --max-delay-us D`` (rows: the request's KiB / ``--row-kib``,
16 for 64 KiB requests of 4 KiB rows). Printed: requests/s (best of ``--repeats``) and process
CPU µs per request (all threads).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import math
import os
import sys
import threading
import time
from typing import Callable, NamedTuple, Optional

import numpy as np

_libc = ctypes.CDLL(None)  # CDLL foreign calls release the GIL
_usleep = _libc.usleep
# PYFUNCTYPE: a foreign call that keeps the GIL
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr)  # type: ignore[attr-defined]


class ProbeFailed(RuntimeError):
    """The run cannot give a row: a thread did not stop, or a thread failed."""


def run(threads: int, batch: int, gpu_us: int, seconds: float, kib: int,
        held: bool) -> tuple[float, float]:
    """(requests/s, CPU µs per request) of one closed-loop run of ``threads`` threads with one
    request of ``kib`` KiB each in flight, in batches of ``batch`` (which must divide
    ``threads``) formed by the thread that fills one; ``held``: copies by a memmove that keeps
    the GIL instead of numpy's. Raises ProbeFailed if a thread did not stop."""
    n = kib * 256
    sets = threads + 1  # staging sets: enough that a batch never waits for one
    ins = [np.full(n, i, np.float32) for i in range(threads)]
    outs = [np.empty(n, np.float32) for _ in range(threads)]
    st_in = [np.empty(batch * n, np.float32) for _ in range(sets)]
    st_out = [np.empty(batch * n, np.float32) for _ in range(sets)]
    in_addr = [a.ctypes.data for a in st_in]
    out_addr = [a.ctypes.data for a in st_out]
    free_sets = list(range(sets))
    lock = threading.Lock()
    pending: list[int] = []
    current = [-1]  # the staging set being filled, -1: none
    left = [batch] * sets
    slot_of, set_of = [0] * threads, [0] * threads
    wakers = [threading.Lock() for _ in range(threads)]
    for w in wakers:
        w.acquire()
    stop = [False]
    counts = [0] * threads

    def worker(i: int) -> None:
        x, y, me = ins[i], outs[i], wakers[i]
        xa, ya = x.ctypes.data, y.ctypes.data
        done = 0
        while not stop[0]:
            with lock:
                if current[0] < 0:
                    current[0] = free_sets.pop()
                s = current[0]
                pos = len(pending)
                if held:
                    _memmove(in_addr[s] + pos * n * 4, xa, n * 4)
                else:
                    st_in[s][pos * n:(pos + 1) * n] = x
                pending.append(i)
                full = len(pending) == batch
                if full:
                    members = pending[:]
                    pending.clear()
                    current[0] = -1
            if full:
                _usleep(gpu_us)
                np.multiply(st_in[s], 2.0, out=st_out[s])
                for k, j in enumerate(members):
                    slot_of[j], set_of[j] = k, s
                for j in members:
                    if j != i:
                        wakers[j].release()
                k = members.index(i)
            else:
                me.acquire()
                k, s = slot_of[i], set_of[i]
            if held:
                _memmove(ya, out_addr[s] + k * n * 4, n * 4)
            else:
                y[:] = st_out[s][k * n:(k + 1) * n]
            with lock:
                left[s] -= 1
                if left[s] == 0:  # the last member out gives the set back
                    left[s] = batch
                    free_sets.append(s)
            done += 1
        counts[i] = done

    ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop[0] = True
    time.sleep(0.05)
    for w in wakers:  # members of a batch that never filled
        if w.locked():
            w.release()
    for t in ts:
        t.join(2)
    stuck = sum(t.is_alive() for t in ts)
    if stuck:  # its requests are not counted: the row would be too low
        raise ProbeFailed(f"{stuck} of {threads} threads did not stop within 2 s of the end")
    dt = time.perf_counter() - t0
    total = sum(counts)
    return total / dt, (time.process_time() - c0) / max(1, total) * 1e6


class _Request:
    """One windowed request: its input row, when it was queued (perf_counter s), its output
    row once done (a view of its batch's output block) and the lock its thread waits on (held
    from creation, released by the batcher)."""

    __slots__ = ("x", "t0", "y", "done")

    def __init__(self, x: np.ndarray, t0: float) -> None:
        self.x = x
        self.t0 = t0
        self.y: Optional[np.ndarray] = None
        self.done = threading.Lock()
        self.done.acquire()


class Windowed(NamedTuple):
    """One windowed run: requests/s and process CPU µs per request over the measured time,
    the requests counted in it, the outputs compared (counted ones and those drained after the
    end), how many differed and what the first one was (empty when none)."""
    rate: float
    cpu_us: float
    requests: int
    checked: int
    wrong: int
    first_wrong: str


def run_windowed(threads: int, window: int, batch: int, gpu_us: int, seconds: float, kib: int,
                 delay_us: float,
                 tamper: Optional[Callable[[np.ndarray], None]] = None) -> Windowed:
    """One closed-loop run of ``threads`` threads, each with ``window`` requests of ``kib`` KiB
    in flight, through one batcher thread that forms batches of up to ``batch`` requests,
    waiting at most ``delay_us`` µs after the first of a batch was queued for it to fill, and
    holds each batch ``gpu_us`` µs without the GIL. Every output is compared byte for byte
    with its expected value; the first difference stops the run (the result says so, the
    caller fails). ``tamper(block)``, if given, may change each batch's (k, KiB*256) float32
    output block before it is handed out (to test the check). Raises ProbeFailed if a thread
    failed or did not stop."""
    n = kib * 256
    delay = delay_us * 1e-6
    perf_counter = time.perf_counter
    q: collections.deque[_Request] = collections.deque()
    cv = threading.Condition(threading.Lock())
    stop = [False]
    ended = threading.Event()  # set by a failure: the run need not sleep its seconds out
    counts = [0] * threads
    checked = [0] * threads
    wrong = [0] * threads
    first_wrong: list[str] = []
    errors: list[str] = []
    st_in = np.empty((batch, n), np.float32)
    st_out = np.empty((batch, n), np.float32)

    def end() -> None:  # the first wrong output or failure ends the run
        with cv:
            stop[0] = True
            cv.notify_all()
        ended.set()

    def batcher() -> None:
        reqs: list[_Request] = []
        popleft = q.popleft
        try:
            while True:
                with cv:
                    while not q:
                        if stop[0]:  # stopped and drained: no thread waits on a request now
                            return
                        cv.wait()
                    if len(q) < batch:
                        due = q[0].t0 + delay
                        while len(q) < batch and not stop[0]:
                            left = due - perf_counter()
                            if left <= 0:
                                break
                            cv.wait(left)
                    reqs = [popleft() for _ in range(min(batch, len(q)))]
                k = len(reqs)
                np.concatenate([r.x for r in reqs], out=st_in[:k])
                _usleep(gpu_us)
                np.multiply(st_in[:k], 2.0, out=st_out[:k])
                block = st_out[:k].copy()
                if tamper is not None:
                    tamper(block)
                for i, r in enumerate(reqs):
                    r.y = block[i]
                    r.done.release()
                reqs = []
        except BaseException as e:  # wake every waiting thread (no output: it fails) and stop
            errors.append(f"the batcher thread failed: {e!r}")
            with cv:
                stop[0] = True
                reqs += q
                q.clear()
            ended.set()
            for r in reqs:
                if r.done.locked():
                    r.done.release()

    def worker(i: int) -> None:
        x = np.full((1, n), i + 1, np.float32)  # i + 1: no thread's output is all zeros
        expected = np.full(n, 2.0 * (i + 1), np.float32).tobytes()
        inflight: collections.deque[_Request] = collections.deque()
        push, pop, append = inflight.append, inflight.popleft, q.append
        done = seen = 0

        def check(r: _Request) -> bool:
            y = r.y
            if y is not None and y.tobytes() == expected:
                return True
            wrong[i] += 1
            if not first_wrong:
                if y is None:
                    first_wrong.append(f"thread {i}: a request got no output")
                else:
                    got = y.tobytes()
                    at = next(j for j in range(len(got)) if got[j] != expected[j])
                    first_wrong.append(
                        f"thread {i}, request {seen}: byte {at:,} of {len(got):,} is "
                        f"{got[at]:#04x}, expected {expected[at]:#04x} (float32 "
                        f"{float(y[at // 4])!r} at index {at // 4:,}, expected "
                        f"{2.0 * (i + 1)!r})")
            end()
            return False

        try:
            while True:
                stopping = False
                while len(inflight) < window:
                    r = _Request(x, perf_counter())
                    with cv:
                        if stop[0]:
                            stopping = True
                            break
                        append(r)
                        m = len(q)
                        if m == 1 or m == batch:  # the batcher may wait for a first or a full
                            cv.notify()
                    push(r)
                if stopping:
                    break
                r = pop()
                r.done.acquire()
                seen += 1
                if not check(r):
                    break
                done += 1
                counts[i] = done
            while inflight:  # drained after the end: compared, not counted
                r = pop()
                r.done.acquire()
                seen += 1
                if not check(r):
                    break
        except BaseException as e:
            errors.append(f"thread {i} failed: {e!r}")
            end()
        checked[i] = seen

    bt = threading.Thread(target=batcher, daemon=True)
    ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    bt.start()
    t0, c0 = perf_counter(), time.process_time()
    for t in ts:
        t.start()
    ended.wait(seconds)
    with cv:
        stop[0] = True
        cv.notify_all()
    dt, cpu = perf_counter() - t0, time.process_time() - c0
    total = sum(counts)
    # the drain: at most every request in flight, each its own batch
    grace = 2 + threads * window * gpu_us * 1e-6
    limit = time.monotonic() + grace
    for t in ts + [bt]:
        t.join(max(0.0, limit - time.monotonic()))
    if errors:
        raise ProbeFailed("; ".join(errors))
    stuck = sum(t.is_alive() for t in ts)
    if stuck or bt.is_alive():  # its requests are not counted: the row would be too low
        raise ProbeFailed(f"{stuck} of {threads} threads"
                          f"{' and the batcher' if bt.is_alive() else ''} did not stop within "
                          f"{grace:.0f} s of the end")
    return Windowed(total / dt, cpu / max(1, total) * 1e6, total, sum(checked), sum(wrong),
                    first_wrong[0] if first_wrong else "")


def _counts(what: str, minimum: int, example: str):
    """An argparse type: comma-separated ints >= ``minimum`` (``--batches``, ``--kib``)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what}: comma-separated ints >= {minimum}, e.g. {example}; got "
                f"{text!r}") from None
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"expected {what} >= {minimum}; got {text!r}")
        return values
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0; got "
                                         f"{text!r}")
    return value


#: usleep takes less than a second (POSIX); the stand-in for one batch's GPU time.
MAX_GPU_US = 999_999


def _delay_us(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_DELAY_US:
        raise argparse.ArgumentTypeError(f"expected µs from 0 to {MAX_DELAY_US:,}; got "
                                         f"{text!r}")
    return value


#: the longest batch delay: a second is far past any batching delay worth measuring.
MAX_DELAY_US = 1_000_000


def main(argv=None) -> int:
    """The command line (see the module docstring and --help); 0, or 1 after a wrong output or
    a failed run (one line on stderr), or argparse's exit 2 for bad arguments."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="--window 1 (the default): each thread has one request in flight and the thread "
               "that fills a batch leads it; each batch size must divide --threads (a larger "
               "one runs as --threads). --window W >= 2: each thread keeps W requests in "
               "flight (a sliding window: submit until W, wait for the oldest, compare every "
               "byte of its output, submit another) through one batcher thread that forms "
               "batches of up to B (any B >= 1), waiting at most --delay-us for a full one. "
               "No engine can beat these rows on the same host: compare a windowed row with "
               "'orchestra bench serve --mode closed --batching on --threads T --window W "
               "--mix KiBK --max-batch B*rows --max-delay-us D' (rows: KiB per request / "
               "--row-kib, 16 for 64 KiB in 4 KiB rows). A wrong output fails the run (exit "
               "status 1).")
    p.add_argument("--threads", type=int, default=8, help="submitting threads (default 8)")
    p.add_argument("--window", type=_counts("requests in flight per thread", 1, "1,32"),
                   default=[1],
                   help="requests in flight per thread, comma-separated (default 1: one "
                        "request each, the thread filling a batch leads it; W >= 2: a "
                        "sliding window of W through one batcher thread)")
    p.add_argument("--batches", type=_counts("requests per batch", 1, "8,4,2"), default=[8, 4, 2],
                   help="requests per batch, comma-separated (with --window 1 each must divide "
                        "--threads, a larger one runs as --threads; with W >= 2 the most a "
                        "batch takes; default 8,4,2)")
    p.add_argument("--delay-us", type=_delay_us, default=200.0,
                   help="--window W >= 2: the longest a batch waits to fill after its first "
                        f"request was queued, µs (0 to {MAX_DELAY_US:,}; default 200)")
    p.add_argument("--gpu-us", type=int, default=40,
                   help=f"GIL-free stand-in per batch, µs (0 to {MAX_GPU_US:,}; default 40)")
    p.add_argument("--kib", type=_counts("request sizes in KiB", 1, "64,1"), default=[64, 1],
                   help="request sizes in KiB, comma-separated (default 64,1)")
    p.add_argument("--seconds", type=_seconds, default=1.5,
                   help="seconds per run (default 1.5)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per row, the best printed (default 3)")
    a = p.parse_args(argv)
    if a.threads < 1 or not 0 <= a.gpu_us <= MAX_GPU_US or a.repeats < 1:
        p.error(f"--threads, --repeats >= 1, --gpu-us from 0 to {MAX_GPU_US:,}")
    windowed = any(w > 1 for w in a.window)
    # one request in flight per thread: a batch holds at most one request of each thread
    single = list(dict.fromkeys(min(b, a.threads) for b in a.batches))
    bad = [b for b in single if a.threads % b]
    if 1 in a.window and bad:
        p.error(f"each batch size must divide --threads ({a.threads}); "
                f"{', '.join(map(str, bad))} does not (with --window 1 a batch is one request "
                f"of each of its threads)")
    if windowed:
        print(f"{a.threads} threads, {','.join(map(str, a.window))} requests each in flight, "
              f"{a.gpu_us} us GIL-free per batch, batch delay {a.delay_us:g} us (window >= 2), "
              f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}, best of {a.repeats} "
              f"runs of {a.seconds} s; every windowed output compared byte for byte")
    else:  # the table as it was before windows: no window column
        print(f"{a.threads} threads, one request each in flight, {a.gpu_us} us GIL-free per "
              f"batch, {os.cpu_count()} CPUs, python {sys.version.split()[0]}, best of "
              f"{a.repeats} runs of {a.seconds} s")
    wcol = f" {'window':>6}" if windowed else ""
    print(f"{'KiB':>5}{wcol} {'batch':>5} {'copies':>12} {'req/s':>9} {'cpu us/req':>10}")

    def row(kib: int, w: int, b: int, how: str, rate: float, cpu_us: float) -> None:
        wcol = f" {w:6d}" if windowed else ""
        print(f"{kib:5d}{wcol} {b:5d} {how:>12} {rate:9,.0f} {cpu_us:10.1f}", flush=True)

    for kib in a.kib:
        for w in a.window:
            where = f"window {w}, {kib} KiB"
            try:
                if w == 1:
                    for b in single:
                        for held in (False, True):
                            best = max(run(a.threads, b, a.gpu_us, a.seconds, kib, held)
                                       for _ in range(a.repeats))
                            row(kib, w, b, "memmove+GIL" if held else "numpy", *best)
                    continue
                for b in a.batches:
                    where = f"window {w}, batch {b}, {kib} KiB"
                    runs = []
                    for _ in range(a.repeats):
                        r = run_windowed(a.threads, w, b, a.gpu_us, a.seconds, kib, a.delay_us)
                        if r.wrong:
                            print(f"probe_serve_ceiling: wrong output ({where}): {r.wrong:,} "
                                  f"of {r.checked:,} outputs differ; first: {r.first_wrong}",
                                  file=sys.stderr)
                            return 1
                        runs.append(r)
                    top = max(runs, key=lambda r: r.rate)
                    row(kib, w, b, "numpy", top.rate, top.cpu_us)
            except ProbeFailed as e:
                print(f"probe_serve_ceiling: {where}: {e}", file=sys.stderr)
                return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())

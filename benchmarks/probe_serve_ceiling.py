"""Serving ceiling probe (CPU only): the most requests/s CPython lets T threads hand through a
batcher, each thread with one request in flight, when nothing but the hand-off costs.

    python benchmarks/probe_serve_ceiling.py [--threads 8] [--gpu-us 40] [--seconds 1.5]

No engine, no GPU: the leanest batching a Python process can do. Each request copies its
``--kib`` KiB into a batch's staging under one lock; the thread that fills a batch of B
requests is its leader: it releases the GIL for ``--gpu-us`` µs (libc ``usleep`` through
ctypes: the stand-in for launch + H2D + kernel + D2H + synchronize), writes the outputs (one
numpy multiply), and wakes each member on its own lock; each member copies its rows out. One
wake-up per request and no timer: the smallest hand-off cost possible. Copies are numpy's
(which release the GIL for more than a few hundred elements) or one memmove that keeps it.

What it shows (docs/serving.md, "How fast threads can go"): with one request in flight per
thread, the hand-offs of the GIL, not the bytes, bound requests/s; an engine cannot exceed
these rows on the same host. Printed: requests/s (best of ``--repeats``) and process CPU µs
per request (all threads).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import sys
import threading
import time

import numpy as np

_libc = ctypes.CDLL(None)  # CDLL foreign calls release the GIL
_usleep = _libc.usleep
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t)(ctypes._memmove_addr)  # keeps the GIL


def run(threads: int, batch: int, gpu_us: int, seconds: float, kib: int,
        held: bool) -> tuple[float, float]:
    """(requests/s, CPU µs per request) of one closed-loop run."""
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
    current = [None]
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
                if current[0] is None:
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
                    current[0] = None
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
        raise RuntimeError(f"{stuck} of {threads} threads did not stop within 2 s of the end")
    dt = time.perf_counter() - t0
    total = sum(counts)
    return total / dt, (time.process_time() - c0) / max(1, total) * 1e6


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--batches", type=_counts("requests per batch", 1, "8,4,2"), default=[8, 4, 2],
                   help="requests per batch, comma-separated (each must divide --threads; "
                        "default 8,4,2)")
    p.add_argument("--gpu-us", type=int, default=40,
                   help=f"GIL-free stand-in per batch, µs (0 to {MAX_GPU_US:,}; default 40)")
    p.add_argument("--kib", type=_counts("request sizes in KiB", 1, "64,1"), default=[64, 1],
                   help="request sizes in KiB, comma-separated (default 64,1)")
    p.add_argument("--seconds", type=_seconds, default=1.5)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    if a.threads < 1 or not 0 <= a.gpu_us <= MAX_GPU_US or a.repeats < 1:
        p.error(f"--threads, --repeats >= 1, --gpu-us from 0 to {MAX_GPU_US:,}")
    batches = a.batches
    bad = [b for b in batches if a.threads % b]
    if bad:
        p.error(f"each batch size must divide --threads ({a.threads}); "
                f"{', '.join(map(str, bad))} does not")
    print(f"{a.threads} threads, one request each in flight, {a.gpu_us} us GIL-free per batch, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}, best of {a.repeats} runs "
          f"of {a.seconds} s")
    print(f"{'KiB':>5} {'batch':>5} {'copies':>12} {'req/s':>9} {'cpu us/req':>10}")
    for kib in a.kib:
        for b in batches:
            for held in (False, True):
                best = max(run(a.threads, b, a.gpu_us, a.seconds, kib, held)
                           for _ in range(a.repeats))
                how = "memmove+GIL" if held else "numpy"
                print(f"{kib:5d} {b:5d} {how:>12} {best[0]:9,.0f} {best[1]:10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

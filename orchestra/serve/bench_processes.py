"""``orchestra bench serve --mode closed --processes K``: the closed loop's threads split over
K processes, each with its own engine (and its own peers), their measured windows started
together.

Why: one CPython process hands requests through one GIL. On the H200 host 8 threads with
dynamic batching, 64 KiB requests, reached about 26,000-32,000 requests/s in one process,
and the leanest batcher that CPython allows (``benchmarks/probe_serve_ceiling.py``) about
35,000, while the GPU and the link were far from busy. A server that needs more runs several
processes, each embedding its own engine on the same GPU (as web servers run several
workers); this measures what they serve together.

Each worker process (multiprocessing's ``spawn``: no CUDA state inherited) builds the
workload and the contender, warms it up and waits at a barrier shared with the others; then
every process runs its measured window of ``--duration`` seconds. Requests/s is the sum of
every process's requests over the span from the first window's start to the last one's end
(``time.monotonic``, one clock for every process on the host), so a late start counts
against the total; the latency percentiles are over every process's requests.

The parent waits on every worker's result pipe and process at once: a worker that fails or
dies is seen at once, the others are stopped, and the row is failed (`Result.failed`: the
worker, how it ended, its message), which fails the run's verification. Ctrl-C or SIGTERM
to the parent stops every worker (SIGTERM, then SIGKILL) before it exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import threading
import time
from multiprocessing import connection

import numpy as np

from orchestra.errors import BenchConfigError, StoppedBySignal
from orchestra.serve.bench import (
    PEER_NAMES,
    PEERS,
    BenchOptions,
    Result,
    Workload,
    _dur,
    _engine_variants,
    engine_instances,
    engine_label,
    engine_result,
    peer_result,
    peer_skipped,
)
from orchestra.serve.process import exit_text

# seconds a worker may take to start (an interpreter, orchestra, a CUDA context, the engine's
# warm-up), and beyond its window to hand back its result
START_TIMEOUT_S = 180.0
RESULT_TIMEOUT_S = 120.0
# once every result is in: how long the workers get to exit on their own (their engines are
# closed by then); after a failure or a stop: how long a SIGTERM gets before SIGKILL
JOIN_TIMEOUT_S = 10.0
STOP_GRACE_S = 1.0


MAX_PROCESSES = 256  # each an interpreter with its own engine (and CUDA context)


def split_threads(threads: int, processes: int) -> list[int]:
    """``threads`` spread over ``processes`` as evenly as they go (the first ones get one more);
    `BenchConfigError` when there are fewer threads than processes or more processes than
    `MAX_PROCESSES`."""
    if processes > MAX_PROCESSES:  # checked before the list of counts is made
        raise BenchConfigError(f"--processes must be at most {MAX_PROCESSES} (each is a Python "
                               f"process with its own engine), got {processes}")
    if processes < 1 or threads < processes:
        raise BenchConfigError(f"--processes {processes} needs at least as many --threads "
                               f"(got {threads}): every process runs one or more")
    return [threads // processes + (k < threads % processes) for k in range(processes)]


def _worker(o: BenchOptions, contender: tuple, threads: int, index: int, barrier, conn) -> None:
    """In a worker process: run ``contender`` (``("engine", variant)`` or ``("peer", kind)``)
    with ``threads`` threads and send its figures back (or the error, as text)."""
    # the parent stops the workers (SIGTERM) when it is interrupted: a terminal's Ctrl-C,
    # which reaches the whole process group, must not also end them mid-send on their own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    waited: list[float] = []
    try:
        w = Workload(o.mix, int(o.row_kib * 256), o.iters)

        def sync():
            waited.append(time.monotonic())
            barrier.wait(START_TIMEOUT_S)

        seed = 1000 + 100 * index  # each process its own inputs
        if contender[0] == "engine":
            r = engine_result(w, o, contender[1], threads, sync=sync, seed=seed)
        else:
            r = peer_result(contender[1], "closed", w, o, threads, _dur(o), sync=sync, seed=seed)
        lat = np.asarray(r.latency_us, dtype=np.float64)
        conn.send({"requests": r.requests, "wrong": r.wrong,
                   "errors": r.errors, "note": r.note, "batch_fill": r.batch_fill,
                   "window": r.extra.get("window"), "latency": lat.tobytes(),
                   "extra": {k: v for k, v in r.extra.items() if k != "window"}})
    except BaseException as exc:  # noqa: BLE001 - reported in the parent's table
        barrier.abort()
        if isinstance(exc, threading.BrokenBarrierError):
            # not this worker's failure (the bare class name said nothing): the one that
            # broke the barrier has its own error, or nobody came in time
            late = waited and time.monotonic() - waited[0] >= START_TIMEOUT_S
            answer = {"error": f"the other workers were not all ready within "
                               f"{START_TIMEOUT_S:.0f} s" if late else
                               "another worker failed before the start; see its error",
                      "secondary": not late}
        else:
            answer = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        try:
            conn.send(answer)
        except OSError:
            pass
        conn.close()
        sys.exit(1)  # the exit status says so too (no traceback: SystemExit)
    conn.close()


def ended(p) -> str:
    """How the process ``p`` ended, in words: ``exit code 3``, ``killed by signal SIGKILL``,
    ``still running``."""
    return exit_text(p.exitcode, unknown="still running")


def contender_name(o: BenchOptions, contender: tuple, counts: list[int]) -> str:
    """A contender's name in the table, from the configuration (not from a worker, which may
    have failed): an engine variant's with its instances per bucket in each process, as
    `engine_result` counts them for that process's ``counts[k]`` threads (``3/2 inst/bucket``
    when the threads split unevenly and every thread needs its own), or a peer's."""
    if contender[0] != "engine":
        return PEER_NAMES[contender[1]]
    inst = sorted({engine_instances(o, contender[1][1], n) for n in counts}, reverse=True)
    return f"{engine_label(o, contender[1])}, {'/'.join(map(str, inst))} inst/bucket"


def _across(o: BenchOptions, contender: tuple, counts: list[int]) -> Result:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(counts))
    procs, conns = [], []
    answers: list[dict | None] = [None] * len(counts)
    stop_after = 0.0  # interrupted (Ctrl-C, SIGTERM) or failed to start: stop them at once
    try:
        for k, n in enumerate(counts):
            mine, theirs = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(o, contender, n, k, barrier, theirs),
                            daemon=True, name=f"orchestra-bench-serve-{k}")
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(mine)
        failed = _collect(procs, conns, barrier, answers,
                          START_TIMEOUT_S + _dur(o) + RESULT_TIMEOUT_S)
        # after a failure the row is lost: the others are stopped rather than waited for
        stop_after = STOP_GRACE_S if failed else JOIN_TIMEOUT_S
    except BaseException:
        barrier.abort()  # a worker still starting returns from the barrier, not into a window
        raise
    finally:
        _stop(procs, stop_after)
        for c in conns:
            c.close()
    for a, p in zip(answers, procs):
        if a is not None and "error" in a:
            a.setdefault("exit", ended(p))
    return merge([a if a is not None else {"error": "gave no result"} for a in answers], counts,
                 contender_name(o, contender, counts))


def _collect(procs: list, conns: list, barrier, answers: list, timeout_s: float) -> bool:
    """Every worker's answer into ``answers[k]``, in the order they come: the result pipes and
    the process sentinels are waited on together, so a worker that dies (at any point, even
    before the start barrier, which a killed process does not break) is seen at once rather
    than after the workers before it in the list have answered. The first failure aborts the
    barrier (the others waiting there return at once) and leaves the rest `STOP_GRACE_S` to
    answer; who has not by then, or by ``timeout_s``, is left to `_stop`. True when a worker
    failed (or timed out)."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(enumerate(zip(conns, procs)))
    failed_at: float | None = None
    while waiting:
        limit = deadline if failed_at is None else min(deadline, failed_at + STOP_GRACE_S)
        ready = set(connection.wait([x for c, p in waiting.values() for x in (c, p.sentinel)],
                                    max(0.0, limit - time.monotonic())))
        if not ready:
            break
        for k, (c, p) in list(waiting.items()):
            if c not in ready and p.sentinel not in ready:
                continue
            answer = _read(c, p)
            if answer is None:
                continue  # alive, nothing sent yet
            del waiting[k]
            answers[k] = answer
            if "error" in answer and failed_at is None:
                failed_at = time.monotonic()
                barrier.abort()  # the others must not wait for it
    for k in waiting:
        if failed_at is None:  # nobody failed: the deadline passed
            answers[k] = {"error": "gave no result in time, stopped",
                          "exit": f"still running after the {timeout_s:.0f} s timeout "
                                  f"(start {START_TIMEOUT_S:.0f} s + window + result "
                                  f"{RESULT_TIMEOUT_S:.0f} s)"}
        else:
            answers[k] = {"error": "stopped after another worker failed", "secondary": True}
    return failed_at is not None or bool(waiting)


def _read(c, p) -> dict | None:
    """The answer of the worker ``p`` on ``c`` once one of them is ready: what it sent, or the
    error of a worker that ended without sending; None while a live worker's pipe is empty."""
    try:
        if c.poll(0):
            return c.recv()
    except (EOFError, OSError):
        pass  # the worker closed its end without a word: it is ending
    else:
        if p.is_alive():
            return None
    p.join(STOP_GRACE_S)  # its end closed: the exit status follows at once
    return {"error": "ended without handing back a result"}  # its exit status: `ended`


def _stop(procs: list, wait_s: float) -> None:
    """Every worker ended, with one shared deadline: ``wait_s`` to exit on its own, then
    SIGTERM and `STOP_GRACE_S`, then SIGKILL (a worker stuck in a driver call or a full pipe
    ignores nothing else)."""
    for wait, end in ((wait_s, "terminate"), (STOP_GRACE_S, "kill")):
        deadline = time.monotonic() + wait  # one deadline for them all, not one each
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                getattr(p, end)()
    for p in procs:
        p.join(STOP_GRACE_S)  # a SIGKILL ends it at once: this reaps it


def merge(answers: list[dict], counts: list[int], base: str) -> Result:
    """One row from every worker's figures (``answers[k]``: worker k's): requests and errors
    summed, requests/s over the span from the first window's start to the last one's end,
    latency over every request; named ``base`` (`contender_name`) and the split. A worker
    that failed fails the row (``failed``: its index, how it ended, its message): the
    survivors' figures stay in it, but they measure fewer processes than the row names."""
    ok = [a for a in answers if "error" not in a]
    bad = [(_failure(k, len(answers), a), a) for k, a in enumerate(answers) if "error" in a]
    failed = [text for text, _ in bad]
    # the workers that failed on their own, not those the first one's failure stopped
    first = [text for text, a in bad if not a.get("secondary")] or failed
    per = "/".join(map(str, sorted(set(counts), reverse=True)))
    res = Result("closed", f"{base}, {len(counts)} processes x {per} threads")
    res.failed = "; ".join(first) or None
    windows = [a["window"] for a in ok if a["window"]]
    res.requests = sum(a["requests"] for a in ok)
    res.wrong = sum(a["wrong"] for a in ok)
    res.errors = sum(a["errors"] for a in ok) + len(failed)
    if windows:
        res.seconds = max(b for _, b in windows) - min(a for a, _ in windows)
    lat = [np.frombuffer(a["latency"], dtype=np.float64) for a in ok]
    res.latency_us = np.concatenate(lat).tolist() if lat else []
    fills = [(a["batch_fill"], a["requests"]) for a in ok if a["batch_fill"] is not None]
    if fills and sum(n for _, n in fills):
        res.batch_fill = sum(f * n for f, n in fills) / sum(n for _, n in fills)
    notes = [a["note"] for a in ok if a["note"]]
    res.note = "; ".join(dict.fromkeys(notes + first))
    res.extra.update({
        "processes": len(counts), "threads_per_process": counts,
        "per_process_req_per_s": [a["requests"] / (a["window"][1] - a["window"][0])
                                  if a["window"] else 0.0 for a in ok],
        "start_spread_ms": (max(a for a, _ in windows) - min(a for a, _ in windows)) * 1e3
        if windows else None})
    if failed:
        res.extra["worker_errors"] = failed
    for key in ("warmup_ms", "buckets", "graph_bytes"):
        vals = [a["extra"][key] for a in ok if key in a["extra"]]
        if vals:
            res.extra[key] = max(vals)
    return res


@contextlib.contextmanager
def _sigterm_raises():
    """While the workers run, SIGTERM raises `StoppedBySignal` in the main thread, so that
    `_across` stops them on its way out: SIGTERM's default action would end this process at
    once and leave them running their windows out. The old handler is back afterwards. Only
    the main thread can set a handler (and only there does the signal raise); elsewhere this
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if fired:  # stopping already: a second SIGTERM must not cut the stopping short
            return
        fired.append(signum)
        raise StoppedBySignal("stopped by SIGTERM; every worker process was stopped, no "
                              "results", signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        # None: a handler set outside Python, which cannot be put back; the default is nearest
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


def _failure(k: int, n: int, a: dict) -> str:
    how = f" ({a['exit']})" if a.get("exit") else ""
    return f"worker {k} of {n}{how}: {a['error']}"


def run_closed_across(w: Workload, o: BenchOptions, notes: list) -> list[Result]:
    """The closed mode with ``o.processes`` worker processes: every engine variant, then the
    peers, each in its own set of processes."""
    counts = split_threads(o.threads, o.processes)
    contenders: list[tuple] = [("engine", v) for v in _engine_variants(o)]
    if o.peers and o.engine.backend_factory is None:
        for kind in PEERS:
            why = peer_skipped(kind)
            if why is None:
                contenders.append(("peer", kind))
            else:
                notes.append(why)
    with _sigterm_raises():
        out = [_across(o, c, counts) for c in contenders]
    spread = [r.extra["start_spread_ms"] for r in out if r.extra.get("start_spread_ms")]
    notes.append(f"closed: {o.processes} processes ({'/'.join(map(str, counts))} threads), "
                 "each with its own engine or peer on the same GPU, their windows started "
                 "together; req/s = every process's requests over the span from the first "
                 "start to the last end" + (f" (starts within {max(spread):.1f} ms)"
                                            if spread else ""))
    return out


__all__ = ["contender_name", "ended", "merge", "run_closed_across", "split_threads"]

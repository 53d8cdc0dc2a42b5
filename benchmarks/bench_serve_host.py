"""The serving engine's host cost per request, on the CPU (no GPU needed).

Closed loop: T threads, each with one request in flight (``--window``), through
`orchestra.serve.Engine` on a `NumpyBackend` whose launches run on its device thread (a
stand-in for a GPU: ``launch`` returns at once, ``wait`` blocks without the GIL). The device
function is a plain copy (``y = x``), so the device thread costs little and what is measured
is the engine's host path. Every output is checked against numpy.

Printed per variant (medians over ``--repeats`` runs): requests/s, process CPU µs per request
(all threads: the host cost), voluntary context switches per request (the thread wake-ups:
every blocking wait that slept counts one, a wait for the GIL included) of all threads and of
the engine's own threads alone (batcher, completion: the hand-offs; the device thread, a
stand-in for the GPU, is in the total only), requests per launch (the batch size). Everything
is counted over the measured interval while every thread is alive (a thread that ended takes
its counters out of ``/proc/self/task``).

    python benchmarks/bench_serve_host.py                    # all variants, 8 threads
    python benchmarks/bench_serve_host.py --variants batching --repeats 7
    python benchmarks/bench_serve_host.py --variants batching,batching-call   # engine(x) too
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np

from orchestra.serve import Batching, Engine, NumpyBackend


def _ctx_switches() -> tuple[int, int]:
    """Voluntary context switches so far: of every thread of this process, and of the
    engine's own threads (named ``orchestra-serve-*``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    total = engine = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as fh:
                for line in fh:
                    if line.startswith("voluntary_ctxt_switches"):
                        n = int(line.split()[1])
                        total += n
                        if names.get(int(tid), "").startswith("orchestra-serve"):
                            engine += n
                        break
        except OSError:  # the thread ended meanwhile
            pass
    return total, engine


def make_engine(variant: str, threads: int, row_floats: int, rows: int, delay_us: float,
                device_thread: bool):
    be = NumpyBackend(lambda d: d["x"], device_thread=device_thread)
    spec_in = {"x": ((row_floats,), "float32")}
    spec_out = {"y": ((row_floats,), "float32")}
    if variant.startswith("batching"):
        return Engine(backend=be, inputs=spec_in, outputs=spec_out, buckets="pow2",
                      max_rows=rows * threads, instances=2, queue_limit=4096,
                      batching=Batching(max_batch=rows * threads, max_delay_us=delay_us))
    return Engine(backend=be, inputs=spec_in, outputs=spec_out, buckets="pow2",
                  max_rows=rows, instances=threads, queue_limit=4096)


def run_once(variant: str, threads: int, duration: float, row_floats: int, rows: int,
             delay_us: float, device_thread: bool, window: int) -> dict:
    e = make_engine(variant, threads, row_floats, rows, delay_us, device_thread)
    e.warmup()
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1)
    counts = [0] * threads
    wrong = [0] * threads
    call = variant in ("call", "batching-call")  # engine(x); the others submit().result()

    def worker(k):
        rng = np.random.default_rng(k)
        xs = [rng.standard_normal((rows, row_floats)).astype(np.float32) for _ in range(4)]
        refs = [x.tobytes() for x in xs]
        for i in range(20):  # warm
            e.submit(xs[i % 4]).result()
        barrier.wait()
        n = bad = 0
        if call:
            while not stop.is_set():
                i = n & 3
                bad += e(xs[i]).tobytes() != refs[i]
                n += 1
                counts[k] = n
        else:
            inflight = []
            while not stop.is_set():
                while len(inflight) < window:
                    i = (n + len(inflight)) & 3
                    inflight.append((i, e.submit(xs[i])))
                i, fut = inflight.pop(0)
                bad += fut.result().tobytes() != refs[i]
                n += 1
                counts[k] = n
            for i, fut in inflight:
                fut.result()
        wrong[k] = bad

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    st0 = e.stats()["buckets"]
    n0 = sum(counts)
    (cs0, ecs0), cpu0, t0 = _ctx_switches(), time.process_time(), time.perf_counter()
    time.sleep(duration)
    (cs1, ecs1), cpu1, t1 = _ctx_switches(), time.process_time(), time.perf_counter()
    n = sum(counts) - n0
    st = e.stats()["buckets"]
    stop.set()
    for t in ts:
        t.join()
    e.close()
    wall = t1 - t0
    cpu = cpu1 - cpu0
    cs, ecs = cs1 - cs0, ecs1 - ecs0
    launches = sum(b["launches"] for b in st.values()) - sum(b["launches"]
                                                             for b in st0.values())
    served = sum(b["requests"] for b in st.values()) - sum(b["requests"] for b in st0.values())
    return {"rps": n / wall, "cpu_us": cpu / n * 1e6, "wakeups": cs / n,
            "engine_wakeups": ecs / n, "per_launch": served / max(1, launches), "wrong": sum(wrong), "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--duration", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--row-floats", type=int, default=1024, help="floats per row (4 KiB)")
    ap.add_argument("--rows", type=int, default=16, help="rows per request (64 KiB)")
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--max-delay-us", type=float, default=200.0)
    ap.add_argument("--inline-device", action="store_true",
                    help="run the device function inside launch (no device thread)")
    ap.add_argument("--variants", default="call,submit,batching,batching-call",
                    help="call (engine(x)), submit (submit(x).result()), batching "
                         "(submit(x).result() with dynamic batching), batching-call "
                         "(engine(x) with dynamic batching)")
    a = ap.parse_args()
    print(f"{a.threads} threads, window {a.window}, {a.rows} x {a.row_floats * 4 // 1024} KiB "
          f"rows per request, median of {a.repeats} runs of {a.duration:g} s, "
          f"{os.cpu_count()} CPUs")
    print(f"{'variant':<16} {'req/s':>9} {'cpu us/req':>11} {'wakeups/req':>12} "
          f"{'engine thr':>11} {'req/launch':>11} {'wrong':>6}")
    for v in a.variants.split(","):
        runs = [run_once(v, a.threads, a.duration, a.row_floats, a.rows, a.max_delay_us,
                         not a.inline_device, a.window) for _ in range(a.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{v:<16} {med['rps']:>9,.0f} {med['cpu_us']:>11.1f} {med['wakeups']:>12.2f} "
              f"{med['engine_wakeups']:>11.2f} {med['per_launch']:>11.2f} "
              f"{sum(r['wrong'] for r in runs):>6}")


if __name__ == "__main__":
    main()

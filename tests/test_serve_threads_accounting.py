"""Many threads on one engine (CPU backend), good and bad requests mixed: every output equals
numpy's, every bad request fails alone, and once closed the engine's counts add up (bucket
requests == good requests, bad_requests == bad ones, nothing failed, queued or in flight)."""

import threading

import numpy as np
import pytest

from orchestra.errors import OrchestraError
from orchestra.serve import Batching, Engine, NumpyBackend

COLS = 160  # small rows: many requests per second, batches of several


def _fn(d):
    return {"y": d["x"] * np.float32(3) + d["b"], "z": (d["x"] - d["b"]).astype(np.float64)}


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("dispatch", ["caller", "thread"])
def test_32_threads_good_and_bad_requests_counts_add_up(batching, dispatch):
    threads, per_thread = 32, 40
    engine = Engine(backend=NumpyBackend(_fn, device_thread=True),
                    inputs={"x": ((COLS,), "f4"), "b": ((COLS,), "f4")},
                    outputs={"y": ((COLS,), "f4"), "z": ((COLS,), "f8")}, buckets="pow2",
                    max_rows=32, batching=Batching(max_delay_us=100) if batching else None,
                    dispatch=dispatch, queue_limit=10_000)
    good, bad, wrong, errors = [0] * threads, [0] * threads, [], []

    def work(k):
        rng = np.random.default_rng(k)
        for i in range(per_thread):
            n = int(rng.integers(2, 33))
            x = rng.standard_normal((n, COLS)).astype(np.float32)
            b = rng.standard_normal((n, COLS)).astype(np.float32)
            want = _fn({"x": x, "b": b})
            try:
                if i % 5 == 0:  # a Fortran-order input: refused before anything is queued
                    bad[k] += 1
                    exc = engine.submit({"x": np.asfortranarray(x), "b": b}).exception(30)
                    if not isinstance(exc, OrchestraError):
                        wrong.append(("accepted", k, i))
                    continue
                if i % 5 == 1:
                    out = {"z": np.empty((n, COLS), np.float64)}
                    got = engine.submit({"x": x, "b": b}, out=out).result(30)
                    if got["z"] is not out["z"]:
                        wrong.append(("out", k, i))
                else:
                    got = engine({"x": x, "b": b})
                good[k] += 1
                if not all(np.array_equal(got[n_], want[n_]) for n_ in want):
                    wrong.append(("values", k, i, n))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    engine.close()
    assert not errors and not wrong
    st = engine.stats()
    buckets = st["buckets"].values()
    assert sum(b["requests"] for b in buckets) == sum(good)
    assert sum(b["failed"] for b in buckets) == 0
    assert st["engine"]["bad_requests"] == sum(bad) == threads * per_thread // 5
    assert st["engine"]["state"] == "closed"
    assert st["engine"]["queued"] == 0 and st["engine"]["in_flight"] == 0

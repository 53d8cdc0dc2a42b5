"""Arguments of `orchestra.serve` on the CPU (`NumpyBackend`) that raised builtin errors
(``OverflowError``, ``TypeError``, ``AttributeError``) deep inside the engine, now refused
with the serving engine's own errors before anything runs, every result still checked
against numpy."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from orchestra.errors import OrchestraError
from orchestra.serve import Engine, NumpyBackend
from orchestra.serve.errors import ResultTimeout, ServeConfigTypeError, ServeConfigValueError

from tests.test_serve import ROW, SPEC_IN, SPEC_OUT, f, rows  # the same engine and requests


def gated_engine(gate: threading.Event, **kw):
    """An engine whose launches wait for ``gate`` on the backend's device thread."""

    def fn(d):
        gate.wait(10)
        return f(d["x"])

    kw.setdefault("buckets", "pow2")
    kw.setdefault("max_rows", 16)
    return Engine(backend=NumpyBackend(fn, device_thread=True), inputs=SPEC_IN,
                  outputs=SPEC_OUT, **kw)


# -- ServeFuture.result / exception timeouts ------------------------------------------------


@pytest.mark.parametrize("method", ["result", "exception"])
@pytest.mark.parametrize("timeout", [math.inf, 1e300, 10**400, float(threading.TIMEOUT_MAX) * 2])
def test_result_timeout_beyond_timeout_max_waits_without_limit(method, timeout):
    # a lock's acquire refuses such timeouts with a builtin OverflowError; the future takes
    # them as "no limit", as Engine.submit's timeout= does
    gate = threading.Event()
    with gated_engine(gate) as e:
        x = rows(3)
        fut = e.submit(x)
        threading.Timer(0.05, gate.set).start()
        got = getattr(fut, method)(timeout=timeout)
        if method == "result":
            assert got.tobytes() == f(x).tobytes()
        else:
            assert got is None and fut.result().tobytes() == f(x).tobytes()


@pytest.mark.parametrize("timeout, error", [("1", ServeConfigTypeError),
                                            (True, ServeConfigTypeError),
                                            (math.nan, ServeConfigValueError)])
def test_result_timeout_of_the_wrong_kind_is_an_orchestra_error(timeout, error):
    gate = threading.Event()
    with gated_engine(gate) as e:
        x = rows(2)
        fut = e.submit(x)
        with pytest.raises(error, match="timeout") as info:
            fut.result(timeout=timeout)
        assert isinstance(info.value, OrchestraError)
        with pytest.raises(error):
            fut.exception(timeout=timeout)
        gate.set()
        assert fut.result(timeout=5).tobytes() == f(x).tobytes()  # the request still runs


def test_result_negative_timeout_still_times_out_at_once():
    # concurrent.futures.Future's behaviour: a negative timeout does not wait
    gate = threading.Event()
    with gated_engine(gate) as e:
        fut = e.submit(rows(1))
        t0 = time.monotonic()
        with pytest.raises(ResultTimeout, match="within -1 s"):
            fut.result(timeout=-1)
        assert time.monotonic() - t0 < 2.0
        gate.set()
        assert fut.result(timeout=5).tobytes() == f(rows(1)).tobytes()


# -- configuration: the engine's own errors, not builtin ones ---------------------------------


def numpy_engine(**kw):
    kw.setdefault("buckets", "pow2")
    kw.setdefault("max_rows", 16)
    kw.setdefault("inputs", SPEC_IN)
    kw.setdefault("outputs", SPEC_OUT)
    kw.setdefault("backend", NumpyBackend(lambda d: f(d["x"])))
    return Engine(**kw)


@pytest.mark.parametrize("kw, error, match", [
    (dict(inputs={"x": ((ROW,), "float99")}), ServeConfigTypeError, r"inputs\['x'\]: 'float99'"),
    (dict(outputs={"y": ((ROW,), 5)}), ServeConfigTypeError, r"outputs\['y'\]: 5 is not"),
    (dict(inputs={"x": ((4.5,), "float32")}), ServeConfigTypeError, "row shape"),
    (dict(inputs={"x": ("4", "float32")}), ServeConfigTypeError, "row shape"),
    (dict(inputs={"x": (None, "float32")}), ServeConfigTypeError, "row shape"),
    (dict(inputs={"x": ((True,), "float32")}), ServeConfigTypeError, "row shape"),
    (dict(timing_every="x"), ServeConfigTypeError, "timing_every"),
    (dict(timing_every=None), ServeConfigTypeError, "timing_every"),
    (dict(timing_every=1.5), ServeConfigTypeError, "timing_every"),
    (dict(timing_every=-5), ServeConfigValueError, "timing_every"),
    (dict(backend="numpy"), ServeConfigTypeError, "Backend"),
    (dict(buckets=[1, 2], max_rows="8"), ServeConfigTypeError, "max_rows"),
    (dict(buckets=[1, 2], max_rows=2.5), ServeConfigTypeError, "max_rows"),
    (dict(buckets=[1, 2], max_rows=True), ServeConfigTypeError, "max_rows"),
    (dict(buckets=[1, 2], max_rows=0), ServeConfigValueError, "max_rows must be >= 1"),
])
def test_bad_configuration_is_a_serve_config_error(kw, error, match):
    with pytest.raises(error, match=match):
        numpy_engine(**kw)


@pytest.mark.parametrize("delay, error", [("1", ServeConfigTypeError),
                                          (None, ServeConfigTypeError),
                                          (True, ServeConfigTypeError),
                                          (-1, ServeConfigValueError)])
def test_batching_delay_of_the_wrong_kind(delay, error):
    from orchestra.serve import Batching

    with pytest.raises(error, match="max_delay_us"):
        Batching(max_delay_us=delay)


def test_good_configuration_after_the_checks_still_serves():
    # what the checks take: numpy ints, a one-int row shape, timing_every 0 (never)
    spec = {"x": (np.int64(ROW), np.float32)}
    with numpy_engine(inputs=spec, timing_every=0, buckets=[1, 3], max_rows=np.int32(5)) as e:
        assert list(e.buckets) == [1, 3, 5]
        for n in (1, 2, 3, 4, 5):
            x = rows(n)
            assert e(x).tobytes() == f(x).tobytes()
        assert e.stats()["buckets"][5]["gpu_ms"]["count"] == 0  # never timed
    with numpy_engine(timing_every=1) as e:
        for n in (1, 3, 16):
            x = rows(n)
            assert e.submit(x).result(timeout=5).tobytes() == f(x).tobytes()
        assert sum(b["gpu_ms"]["count"] for b in e.stats()["buckets"].values()) == 3


@pytest.mark.parametrize("arg", [4, "4", b"4", 4.0])
def test_warmup_of_a_non_sequence_is_a_serve_config_error(arg):
    with numpy_engine() as e:
        with pytest.raises(ServeConfigTypeError, match="sequence of bucket row counts"):
            e.warmup(arg)
        assert [w["rows"] for w in e.warmup([4])] == [4]
        x = rows(3)
        assert e(x).tobytes() == f(x).tobytes()


# -- orchestra bench serve --mode open: the arrival loop leaves the GIL to the engine ---------


def test_open_loop_arrivals_do_not_hold_the_gil_between_requests():
    # the Poisson generator spun for the whole gap between arrivals, holding the GIL: the
    # engine's completion thread and the CPU backend's device thread got it only when the
    # switch interval forced a switch, so every request's latency was a few switch intervals
    # (p50 33-56 ms at 200 req/s on --cpu with the default 5 ms). With a 20 ms interval that
    # would be >= 20 ms; sleeping through the gap leaves well under a millisecond.
    import sys

    from orchestra.serve.bench import S, T, Workload, _poisson, cpu_backend_factory
    from orchestra.serve.demo import demo_reference

    w = Workload("4K", row_floats=1024)
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.02)
    try:
        with Engine(backend=cpu_backend_factory(w), inputs={"x": ((1024,), "float32")},
                    outputs={"y": ((1024,), "float32")}, buckets="pow2", max_rows=1,
                    instances=4) as e:
            x = w.requests[0][0][0]
            assert e(x).tobytes() == demo_reference(x, 1, S, T).tobytes()
            r = _poisson("open", w, e, rate=200, duration=0.5)
    finally:
        sys.setswitchinterval(old)
    assert r.requests > 20 and r.wrong == 0 and r.errors == 0  # every output checked
    assert len(r.latency_us) == r.requests
    assert r.pct()["p50"] < 10_000, r.pct()


@pytest.mark.parametrize("mix, message", [
    ("1e400K", "request size '1e400K': give bytes"),  # int(inf): OverflowError's own text
    ("99999999999999999999K", "give smaller sizes"),  # numpy's "Maximum allowed dimension"
    ("4K:1,2000M", "for the 16 requests of each size made before the load"),
])
def test_bench_mix_sizes_past_what_can_be_made_are_usage_errors(mix, message, capsys,
                                                                 monkeypatch):
    from orchestra.cli import job_options
    from orchestra.cli.main import main as cli
    from orchestra.serve.bench import parse_size

    monkeypatch.setattr(job_options, "host_memory_bytes", lambda: 24 << 30)  # a 24 GiB host
    assert cli(["bench", "serve", "--cpu", "--mode", "latency", "--requests", "5",
                "--mix", mix]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    if mix == "1e400K":
        with pytest.raises(OrchestraError, match="give bytes"):
            parse_size(mix)
    # a size that fits still runs, every output compared with numpy's
    assert cli(["bench", "serve", "--cpu", "--mode", "latency", "--requests", "5",
                "--mix", "8K", "--json"]) == 0
    out = capsys.readouterr().out
    import json

    rows = json.loads(out)["results"]
    assert rows and all(r["wrong"] == 0 and r["errors"] == 0 and r["requests"] == 5
                        for r in rows)

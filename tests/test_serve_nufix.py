"""A new user's pass over `orchestra.serve` on the CPU (`NumpyBackend`): arguments that raised
builtin errors (``OverflowError``, ``TypeError``, ``AttributeError``) deep inside the engine,
now refused with the serving engine's own errors before anything runs, every result still
checked against numpy."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from orchestra.errors import OrchestraError
from orchestra.serve import Engine, NumpyBackend
from orchestra.serve.errors import ResultTimeout, ServeConfigTypeError, ServeConfigValueError

ROW = 4
SPEC_IN = {"x": ((ROW,), "float32")}
SPEC_OUT = {"y": ((ROW,), "float32")}


def f(x):
    return x * np.float32(3) + np.float32(1)


def rows(n, seed=0):
    return np.random.default_rng(seed + n).standard_normal((n, ROW)).astype(np.float32)


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

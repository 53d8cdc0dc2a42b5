"""Engine inputs / out= of odd host objects: buffer-protocol objects (which the docs promise)
and a malformed ``__array_interface__`` (an OrchestraError naming the input, never numpy's
raw ValueError)."""

import array

import numpy as np
import pytest

from orchestra.driver.interop import host_view
from orchestra.errors import InteropValueError
from orchestra.serve import Engine, NumpyBackend
from orchestra.serve.errors import InputTypeError


@pytest.fixture
def engine():
    eng = Engine(backend=NumpyBackend(lambda d: {"y": d["x"] * 2 + 1}),
                 inputs={"x": ((4,), "float32")}, outputs={"y": ((4,), "float32")}, max_rows=8)
    yield eng
    eng.close()


class _BadInterface:
    __array_interface__ = {"shape": (3, 4)}  # no typestr: numpy raises ValueError


def test_memoryview_input_and_out(engine):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(engine(memoryview(x)), x * 2 + 1)
    np.testing.assert_array_equal(engine.submit({"x": memoryview(x)}).result(timeout=10),
                                  x * 2 + 1)
    out = np.zeros((3, 4), np.float32)
    engine(x, out=memoryview(out))
    np.testing.assert_array_equal(out, x * 2 + 1)


def test_array_array_of_floats_as_one_dim_input():
    eng = Engine(backend=NumpyBackend(lambda d: {"y": d["x"] - 1}), inputs={"x": ((), "float32")},
                 outputs={"y": ((), "float32")}, max_rows=8)
    try:
        a = array.array("f", [1.0, 2.0, 5.0])
        np.testing.assert_array_equal(eng(a), np.array([0.0, 1.0, 4.0], np.float32))
    finally:
        eng.close()


def test_bytes_input_wrong_dtype_is_input_type_error(engine):
    with pytest.raises(InputTypeError, match="dtype uint8"):
        engine(np.zeros((2, 4), np.float32).tobytes())


def test_read_only_buffer_out_refused(engine):
    x = np.ones((1, 4), np.float32)
    with pytest.raises(Exception, match="read-only") as e:
        engine(x, out=memoryview(bytes(16)).cast("f", (1, 4)))
    assert type(e.value).__name__ == "BadRequest"


def test_malformed_array_interface_is_orchestra_error(engine):
    with pytest.raises(InputTypeError, match="input x.*typestr"):
        engine(_BadInterface())
    with pytest.raises(InputTypeError, match="out y.*typestr"):
        engine(np.ones((3, 4), np.float32), out=_BadInterface())
    with pytest.raises(InteropValueError, match="__array_interface__"):
        host_view(_BadInterface())

"""Dtypes a request or an engine's spec may carry that numpy names alike or never makes: the
errors say which dtype differs and how to convert, and specs no request could match are
refused when the engine is made."""

import numpy as np
import pytest

from orchestra.serve import Engine, InputTypeError, NumpyBackend, ServeConfigTypeError
from orchestra.serve.tensors import TensorSpec


def _engine(dtype, row=(4,)):
    return Engine(backend=NumpyBackend(lambda d: d["x"]), inputs={"x": (row, dtype)},
                  outputs={"y": (row, dtype)}, buckets=[4])


def _follow(message: str, engine, x):
    """The array the message's ``.astype(...)`` advice makes from ``x``."""
    advice = message.rsplit(".astype(", 1)[1].rsplit(")", 1)[0]
    return x.astype(eval(advice, {"np": np, "engine": engine}))  # noqa: S307 - our own text


@pytest.mark.parametrize("spec, sent", [("<f4", ">f4"), (">f4", "<f4"), (">i8", "<i8"),
                                        ("<M8[ns]", "<M8[s]"), ("S4", "S3"), ("U2", "S2")])
def test_a_dtype_numpy_names_alike_is_told_apart_and_the_advice_works(spec, sent):
    with _engine(spec) as engine:
        x = np.arange(8).astype(sent).reshape(2, 4)
        with pytest.raises(InputTypeError) as ei:
            engine(x)
        msg = str(ei.value)
        got, want = msg.split("dtype ", 1)[1].split("; convert", 1)[0].split(", the engine takes ")
        assert got != want  # '>f4' and '<f4' are both "float32" to numpy
        y = engine(_follow(msg, engine, x))
        assert y.dtype == np.dtype(spec)
        np.testing.assert_array_equal(y, x.astype(spec))
        out = np.empty((2, 4), sent)
        with pytest.raises(InputTypeError, match="out y: dtype"):
            engine.submit(x.astype(spec), out=out).result(5)
        assert engine.stats()["engine"]["bad_requests"] == 2


@pytest.mark.parametrize("spec", ["<f4", ">f4", "<M8[ns]", "S4"])
def test_a_non_array_gets_asarray_advice_that_works(spec):
    """A list in a dict of inputs: the np.asarray advice names a dtype that numpy takes (it
    said np.datetime64[ns] and np.bytes32 before) and that the engine then serves."""
    e = Engine(backend=NumpyBackend(lambda d: d["x"]), inputs={"x": ((4,), spec),
               "z": ((4,), spec)}, outputs={"y": ((4,), spec)}, buckets=[4])
    with e:
        good = np.arange(8).astype(spec).reshape(2, 4)
        with pytest.raises(InputTypeError, match="np.asarray") as ei:
            e({"x": good.tolist(), "z": good})
        advice = str(ei.value).rsplit("dtype=", 1)[1].rsplit(")", 1)[0]
        x = np.asarray(good.tolist(), dtype=eval(advice, {"np": np, "engine": e}))  # noqa: S307
        assert x.dtype == np.dtype(spec)
        np.testing.assert_array_equal(e({"x": x, "z": good}), good)


def test_a_structure_of_other_alignment_is_told_apart_and_the_advice_works():
    fields = [("a", "u1"), ("b", "<f4")]
    with _engine(fields) as engine:
        x = np.zeros((2, 4), np.dtype(fields, align=True))
        x["a"], x["b"] = 7, np.arange(8).reshape(2, 4)
        with pytest.raises(InputTypeError, match="the engine takes structured") as ei:
            engine(x)
        y = engine(_follow(str(ei.value), engine, x))
        assert y.dtype == np.dtype(fields)
        np.testing.assert_array_equal(y["a"], x["a"])
        np.testing.assert_array_equal(y["b"], x["b"])


def test_a_subarray_dtype_is_refused_with_the_row_shape_to_use():
    with pytest.raises(ServeConfigTypeError, match=r"\(\(4, 3\), '<f4'\)"):
        _engine(("f4", (3,)))
    with _engine("<f4", row=(4, 3)) as engine:  # what the message says
        x = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
        np.testing.assert_array_equal(engine(x), x)


@pytest.mark.parametrize("dtype", ["S", "U", "V0", "S0"])
def test_a_dtype_without_a_size_is_refused(dtype):
    with pytest.raises(ServeConfigTypeError, match="has no size"):
        TensorSpec("x", (4,), dtype)


@pytest.mark.parametrize("batching", [False, True])
def test_masked_arrays_are_refused_not_served_without_their_mask(batching):
    with Engine(backend=NumpyBackend(lambda d: d["x"] * 2), inputs={"x": ((4,), "f4")},
                outputs={"y": ((4,), "f4")}, buckets=[4], batching=batching or None) as engine:
        data = np.arange(8, dtype=np.float32).reshape(2, 4)
        masked = np.ma.masked_array(data, mask=data > 5)
        with pytest.raises(InputTypeError, match="masked array"):
            engine(masked)
        assert engine.submit(masked).exception(5) is not None
        with pytest.raises(InputTypeError, match=r"out y is a masked array"):
            engine.submit(data, out=np.ma.masked_array(np.empty((2, 4), np.float32))).result(5)
        np.testing.assert_array_equal(engine(masked.filled(0)), np.where(data > 5, 0, data) * 2)
        np.testing.assert_array_equal(engine(masked.data), data * 2)
        st = engine.stats()
        assert st["engine"]["bad_requests"] == 3
        assert sum(b["requests"] for b in st["buckets"].values()) == 2

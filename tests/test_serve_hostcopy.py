"""The engine's request copies (orchestra.serve.hostcopy) against numpy's, both sides of the
limit where they stop keeping the GIL."""

import threading

import numpy as np
import pytest

from orchestra.serve import hostcopy
from orchestra.serve.hostcopy import HOLD_LIMIT, copied, copy_into


@pytest.mark.parametrize("nbytes", [0, 4, 4096, 64 << 10, HOLD_LIMIT, HOLD_LIMIT + 64,
                                    4 * HOLD_LIMIT])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.float64, np.int16])
def test_copies_match_numpy(nbytes, dtype):
    item = np.dtype(dtype).itemsize
    n = nbytes // item
    rng = np.random.default_rng(nbytes + item)
    src = rng.integers(0, 255, size=n).astype(dtype)
    if n % 4 == 0 and n:
        src = src.reshape(4, n // 4)  # rows, as the engine's requests come
    dst = np.full(src.shape, 7, dtype)
    copy_into(dst, src)
    np.testing.assert_array_equal(dst, src)
    out = copied(src)
    np.testing.assert_array_equal(out, src)
    assert out.shape == src.shape and out.dtype == src.dtype
    assert out.flags.c_contiguous and out.flags.writeable
    if src.size:
        assert not np.shares_memory(out, src)  # a copy the caller owns
        src.flat[0] += 1
        assert out.flat[0] != src.flat[0]


def test_copy_into_a_prefix_of_staging_leaves_the_rest():
    staging = np.zeros((16, 1024), np.float32)
    req = np.arange(5 * 1024, dtype=np.float32).reshape(5, 1024)
    copy_into(staging[:5], req)
    np.testing.assert_array_equal(staging[:5], req)
    assert not staging[5:].any()
    out = copied(staging[:5])
    np.testing.assert_array_equal(out, req)


def test_small_copies_keep_the_gil_and_large_ones_do_not(monkeypatch):
    """Below the limit the copy is the held memmove; above it numpy's copy (which releases the
    GIL): which path ran is seen through the functions it calls."""
    calls = []
    real = hostcopy._memmove
    monkeypatch.setattr(hostcopy, "_memmove", lambda d, s, n: calls.append(n) or real(d, s, n))
    small = np.ones(1024, np.float32)
    copy_into(np.empty_like(small), small)
    copied(small)
    assert calls == [4096, 4096]
    big = np.ones(HOLD_LIMIT // 4 + 1, np.float32)
    copy_into(np.empty_like(big), big)
    out = copied(big)
    assert calls == [4096, 4096]  # numpy did those
    np.testing.assert_array_equal(out, big)


def test_copies_from_many_threads_stay_exact():
    rng = np.random.default_rng(3)
    srcs = [rng.standard_normal((16, 1024)).astype(np.float32) for _ in range(8)]
    bad = []

    def work(k):
        dst = np.empty_like(srcs[k])
        for _ in range(300):
            copy_into(dst, srcs[k])
            if not np.array_equal(copied(dst), srcs[k]):
                bad.append(k)
    ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


# -- arrays the memmove must not take: numpy's copy (its result, its error), never wrong bytes


def _layouts(shape, dtype, seed):
    """The same values (shape ``shape``) in layouts a caller or a custom backend may hand
    over: C order, Fortran order, rows reversed, columns reversed, a column block of a wider
    buffer, a view at an offset."""
    rng = np.random.default_rng(seed)
    vals = rng.integers(0, 1000, size=shape).astype(dtype)
    wide = np.zeros((shape[0], 3 * shape[1]), dtype)
    wide[:, shape[1]:2 * shape[1]] = vals
    tall = np.zeros((shape[0] + 3, shape[1]), dtype)
    tall[3:] = vals
    rev_rows = np.ascontiguousarray(vals[::-1])[::-1]
    rev_cols = np.ascontiguousarray(vals[:, ::-1])[:, ::-1]
    return {"C": vals.copy(), "F": np.asfortranarray(vals), "rows reversed": rev_rows,
            "columns reversed": rev_cols, "column block": wide[:, shape[1]:2 * shape[1]],
            "offset view": tall[3:]}


LAYOUTS = list(_layouts((2, 2), np.float32, 0))


@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_copy_into_any_layout_matches_numpy(src_layout, dst_layout):
    shape = (6, 200)  # 1200 elements, 4.8 KB: above NUMPY_HOLDS, below HOLD_LIMIT
    src = _layouts(shape, np.float32, 1)[src_layout]
    dst = _layouts(shape, np.float32, 2)[dst_layout]
    copy_into(dst, src)
    np.testing.assert_array_equal(dst, src)
    out = copied(src)
    np.testing.assert_array_equal(out, src)
    assert out.flags.c_contiguous and not np.shares_memory(out, src)


def test_copy_into_never_writes_past_a_smaller_destination():
    """A destination of fewer rows (a custom backend's short staging) is numpy's broadcast
    error; the bytes after it (here the rest of the buffer it is a view of) stay as they
    were."""
    buf = np.full((16, 128), -1.0, np.float32)
    src = np.ones((8, 128), np.float32)  # 1024 elements, 4 KiB
    with pytest.raises(ValueError):
        copy_into(buf[:7], src)
    assert (buf[7:] == -1).all()


def test_copy_into_other_dtypes_and_shapes_are_numpys():
    src = np.arange(1024, dtype=np.float32).reshape(8, 128)
    wide = np.zeros((8, 128), np.float64)  # a cast, as np.copyto casts
    copy_into(wide, src)
    np.testing.assert_array_equal(wide, src.astype(np.float64))
    same_bytes = np.zeros((4, 256), np.float32)  # equal nbytes, other shape: numpy refuses
    with pytest.raises(ValueError):
        copy_into(same_bytes, src)
    assert not same_bytes.any()
    as_int = np.zeros((8, 128), np.int32)  # equal itemsize, unsafe cast: numpy refuses
    with pytest.raises(TypeError):
        copy_into(as_int, src)
    assert not as_int.any()


def test_copy_into_a_read_only_array_is_refused():
    raw = bytes(4096)
    dst = np.frombuffer(raw, np.float32).reshape(8, 128)  # read-only: an immutable bytes
    with pytest.raises(ValueError):
        copy_into(dst, np.ones((8, 128), np.float32))
    assert raw == bytes(4096)


def test_object_arrays_are_copied_by_numpy_with_their_references():
    import sys

    token = object()
    src = np.empty((8, 128), object)
    src[...] = token
    before = sys.getrefcount(token)
    dst = np.empty((8, 128), object)
    copy_into(dst, src)
    out = copied(src)
    assert sys.getrefcount(token) == before + 2 * src.size  # each copy holds references
    assert all(v is token for v in dst.flat) and all(v is token for v in out.flat)
    del dst, out
    assert sys.getrefcount(token) == before


def test_copies_of_at_most_numpy_holds_elements_are_numpys(monkeypatch):
    """Up to NUMPY_HOLDS elements numpy keeps the GIL itself and copies for less than the
    ctypes call costs: no memmove there."""
    calls = []
    real = hostcopy._memmove
    monkeypatch.setattr(hostcopy, "_memmove", lambda d, s, n: calls.append(n) or real(d, s, n))
    small = np.arange(hostcopy.NUMPY_HOLDS, dtype=np.float32).reshape(5, -1)
    dst = np.empty_like(small)
    copy_into(dst, small)
    out = copied(small)
    assert calls == []
    np.testing.assert_array_equal(dst, small)
    np.testing.assert_array_equal(out, small)
    one_more = np.arange(hostcopy.NUMPY_HOLDS + 1, dtype=np.uint8)
    copy_into(np.empty_like(one_more), one_more)
    assert calls == [hostcopy.NUMPY_HOLDS + 1]


def test_address_is_the_array_interfaces_pointer():
    base = np.arange(4096, dtype=np.uint8)
    sub = type("Sub", (np.ndarray,), {})
    for a in (base, base[17:], base[100:].reshape(-1, 4)[3:], np.ones((3, 3)).view(sub),
              np.ma.masked_array(np.ones(10)), np.empty(0), np.empty((0, 5))[:, 2:]):
        assert hostcopy.address(a) == a.__array_interface__["data"][0]


def test_copied_keeps_what_copy_keeps():
    class Tagged(np.ndarray):
        pass

    src = np.arange(2048, dtype=np.float32).reshape(16, 128).view(Tagged)
    out = copied(src)
    assert type(out) is Tagged and not np.shares_memory(out, src)
    np.testing.assert_array_equal(out, src)
    copy_into(out, np.zeros((16, 128), np.float32))  # a subclass is written into alike
    assert not out.any()


# -- the engine over a custom backend whose staging is not what the engine's own are


@pytest.mark.parametrize("layout", ["F", "rows reversed", "columns reversed", "column block"])
@pytest.mark.parametrize("batching", [False, True])
def test_engine_over_strided_custom_staging_serves_exact_outputs(layout, batching):
    """A `Backend` of the user's may hand the engine staging views of its own buffers: the
    request copies in and out give numpy's result for any layout (the engine's own staging is
    C-contiguous; the memmove must not assume a custom backend's is)."""
    from orchestra.serve import Backend, Batching, Engine, Instance

    class Inst(Instance):
        def __init__(self, rows, ins, outs):
            self.rows = rows
            self.inputs = {n: _layouts(s.shape(rows), s.dtype, 5)[layout] for n, s in ins.items()}
            self.outputs = {n: _layouts(s.shape(rows), s.dtype, 6)[layout]
                            for n, s in outs.items()}

        def launch(self, *, notify, timed, bind=None):
            self.outputs["y"][...] = self.inputs["x"] * 2 + 1

        def wait(self):
            pass

    class Custom(Backend):
        name = "custom"

        def create(self, rows, index, inputs, outputs):
            return Inst(rows, inputs, outputs)

    with Engine(backend=Custom(), inputs={"x": ((128,), "float32")},
                outputs={"y": ((128,), "float32")}, buckets=[4, 8],
                batching=Batching(max_delay_us=0) if batching else None) as engine:
        rng = np.random.default_rng(7)
        for n in (8, 5, 4, 3, 8, 1):  # whole buckets and prefixes, > NUMPY_HOLDS elements
            x = rng.standard_normal((n, 128)).astype(np.float32)
            want = x * 2 + 1
            np.testing.assert_array_equal(engine(x), want)
            np.testing.assert_array_equal(engine.submit(x).result(10), want)
            out = np.empty((n, 128), np.float32)
            assert engine.submit(x, out=out).result(10) is out
            np.testing.assert_array_equal(out, want)


def test_engine_over_short_custom_staging_fails_the_request_not_the_heap():
    """A custom backend whose staging has fewer rows than its bucket: the request fails with
    numpy's error and the memory after the staging is untouched."""
    from orchestra.serve import Backend, Engine, Instance

    bufs = []

    class Inst(Instance):
        def __init__(self, rows):
            self.rows = rows
            buf = np.full((rows + 4, 128), -1.0, np.float32)
            bufs.append(buf)
            self.inputs = {"x": buf[:rows - 1]}
            self.outputs = {"y": np.zeros((rows, 128), np.float32)}

        def launch(self, *, notify, timed, bind=None):
            pass

        def wait(self):
            pass

    class Short(Backend):
        def create(self, rows, index, inputs, outputs):
            return Inst(rows)

    with Engine(backend=Short(), inputs={"x": ((128,), "float32")},
                outputs={"y": ((128,), "float32")}, buckets=[8], instances=1) as engine:
        x = np.ones((8, 128), np.float32)
        with pytest.raises(ValueError):
            engine(x)
        with pytest.raises(ValueError):
            engine.submit(x).result(10)
    assert bufs and all((b[7:] == -1).all() for b in bufs)

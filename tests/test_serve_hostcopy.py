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

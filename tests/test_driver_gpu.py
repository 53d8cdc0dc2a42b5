"""orchestra.driver on a real GPU (skipped without one): devices, streams, events, the memory
pool, stream-ordered device buffers, pinned and registered host memory, many host threads."""

import gc
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from orchestra.driver import (
    Device,
    DeviceBuffer,
    Event,
    MemoryPool,
    PinnedBuffer,
    Stream,
    context_alive,
    device_count,
    devices,
    is_pinned,
    register_host,
)
from orchestra.errors import CudaError

pytestmark = pytest.mark.gpu

UINT64_MAX = (1 << 64) - 1


@pytest.fixture
def dev():
    return Device.get(0)


@pytest.fixture
def stream(dev):
    with Stream(dev) as s:
        yield s


def test_device_properties(dev):
    assert Device.get(0) is dev
    assert device_count() >= 1 and devices()[0] is dev
    assert "NVIDIA" in dev.name
    assert dev.compute_capability >= (7, 0)
    assert dev.sm_count > 0 and dev.warp_size == 32
    assert dev.async_engine_count >= 1
    assert dev.total_memory > 1 << 30
    major, minor = dev.compute_capability
    assert dev.arch == f"sm_{major}{minor}"
    assert re.fullmatch(r"sm_\d+", dev.arch)
    lim = dev.limits
    assert lim.max_threads_per_block >= 1024
    assert lim.max_block_dim[0] >= 1024 and lim.max_grid_dim[0] >= 2**31 - 1
    assert lim.max_shared_memory_per_block == 48 * 1024
    assert lim.max_shared_memory_per_block_optin >= lim.max_shared_memory_per_block
    assert lim.memory_pools_supported
    greatest, least = lim.stream_priority_range
    assert greatest <= least
    assert context_alive(0)


def test_device_ordinal_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        Device.get(device_count())


def test_make_current_and_synchronize(dev):
    assert dev.make_current() is dev
    dev.make_current()  # cached: no driver call
    dev.make_current(force=True)
    dev.synchronize()


@pytest.mark.parametrize("nbytes", [4, 4 * 1000 + 3, (8 << 20) + 1])
def test_pinned_device_pinned_round_trip(stream, nbytes):
    rng = np.random.default_rng(nbytes)
    src = PinnedBuffer(nbytes)
    n_floats = nbytes // 4
    src.view(np.float32, n_floats)[:] = rng.standard_normal(n_floats, dtype=np.float32)
    src.array[n_floats * 4:] = rng.integers(0, 256, nbytes - n_floats * 4, dtype=np.uint8)
    dst = PinnedBuffer(nbytes)
    dst.array[:] = 0
    with DeviceBuffer.allocate(nbytes, stream) as buf:
        assert buf.nbytes == nbytes and buf.ptr != 0 and buf.device.ordinal == 0
        buf.copy_from_host(src, stream)
        buf.copy_to_host(dst, stream)
        stream.synchronize()
    assert dst.array.tobytes() == src.array.tobytes()  # bit-exact, odd byte counts included
    src.close()
    dst.close()


def test_pinned_empty_array_shape_dtype_and_base(stream):
    buf = PinnedBuffer.empty((3, 5), np.float32)
    arr = buf.array
    assert arr.shape == (3, 5) and arr.dtype == np.float32 and buf.nbytes == 60
    assert _owner_of(arr) is buf  # a live view keeps the pinned memory allocated
    assert is_pinned(arr)
    arr[:] = np.arange(15, dtype=np.float32).reshape(3, 5)
    out = PinnedBuffer.empty((3, 5), np.float32)
    with DeviceBuffer.allocate(60, stream) as d:
        d.copy_from_host(arr, stream)
        d.copy_to_host(out.array, stream, sync=True)
    np.testing.assert_array_equal(out.array, arr)
    del arr
    buf.close()
    buf.close()
    with pytest.raises(ValueError, match="closed"):
        buf.ptr


def _owner_of(arr):
    while isinstance(arr, np.ndarray):
        arr = arr.base
    return arr


def test_pinned_array_outlives_owner_reference():
    arr = PinnedBuffer.empty(1024, np.uint8).array  # the PinnedBuffer is only reachable via .base
    gc.collect()
    assert isinstance(_owner_of(arr), PinnedBuffer) and not _owner_of(arr).closed
    arr[:] = 7  # still allocated: writing must not crash
    assert int(arr.sum()) == 7 * 1024


def test_impossible_allocation_is_out_of_memory_and_pool_still_works(stream):
    with pytest.raises(CudaError) as info:
        buf = DeviceBuffer.allocate(1 << 50, stream)
        stream.synchronize()
        buf.close()
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert info.value.call == "cuMemAllocFromPoolAsync"
    assert not info.value.sticky
    host = PinnedBuffer.empty(256, np.int32)
    host.array[:] = np.arange(256, dtype=np.int32)
    back = PinnedBuffer.empty(256, np.int32)
    with DeviceBuffer.allocate(1024, stream) as buf:
        buf.copy_from_host(host, stream)
        buf.copy_to_host(back, stream, sync=True)
    np.testing.assert_array_equal(back.array, host.array)


def test_pool_release_threshold_is_high(dev):
    pool = MemoryPool.default(dev)
    assert MemoryPool.default() is pool
    assert pool.release_threshold == UINT64_MAX
    pool.release_threshold = 1 << 30
    assert pool.release_threshold == 1 << 30
    MemoryPool.default(dev, release_threshold=UINT64_MAX)
    assert pool.release_threshold == UINT64_MAX


def test_pool_inserts_no_hidden_cross_stream_waits(dev):
    pool = MemoryPool.default(dev)
    assert pool.internal_dependencies is False
    pool.internal_dependencies = True
    assert pool.internal_dependencies is True
    pool.internal_dependencies = False
    assert pool.internal_dependencies is False


def test_pool_used_bytes_back_to_baseline_after_close(dev, stream):
    gc.collect()
    stream.synchronize()
    pool = MemoryPool.default(dev)
    before = pool.used_bytes
    bufs = [DeviceBuffer.allocate(1 << 20, stream) for _ in range(4)]
    assert pool.used_bytes >= before + 4 * (1 << 20)
    assert pool.used_high >= pool.used_bytes
    assert pool.reserved_bytes >= pool.used_bytes
    for b in bufs:
        b.close()
        b.close()  # idempotent
    stream.synchronize()
    assert pool.used_bytes == before
    reserved = pool.reserved_bytes
    assert reserved > 0  # the high threshold keeps the memory after a synchronize
    pool.reset_peaks()
    assert pool.used_high == pool.used_bytes
    pool.trim(0)
    assert pool.reserved_bytes <= reserved
    assert pool.reserved_high >= pool.reserved_bytes


def test_free_on_another_stream(dev, stream):
    pool = MemoryPool.default(dev)
    stream.synchronize()
    before = pool.used_bytes
    buf = DeviceBuffer.allocate(4096, stream)
    buf.memset(0xAB, stream)
    done = stream.record(Event(dev))
    with Stream(dev) as other:
        other.wait(done)
        buf.free(other)
        buf.free(other)
        other.synchronize()
    assert buf.closed and pool.used_bytes == before


def test_memset(stream):
    out = PinnedBuffer(1000)
    with DeviceBuffer.allocate(1000, stream) as buf:
        buf.memset(0x5A, stream)
        buf.copy_to_host(out, stream, sync=True)
        with pytest.raises(ValueError, match="0..255"):
            buf.memset(256, stream)
    assert np.all(out.array == 0x5A)


def test_pageable_array_is_refused(stream):
    pageable = np.zeros(1024, np.float32)
    assert not is_pinned(pageable)
    with DeviceBuffer.allocate(pageable.nbytes, stream) as buf:
        with pytest.raises(TypeError, match="PinnedBuffer|register_host"):
            buf.copy_from_host(pageable, stream)
        with pytest.raises(TypeError, match="pageable"):
            buf.copy_to_host(pageable, stream)
        with pytest.raises(ValueError, match="4096"):
            buf.copy_from_host(PinnedBuffer(100), stream)


def test_is_pinned_plain_arrays_never_raise():
    assert is_pinned(np.zeros(3)) is False
    assert is_pinned(np.zeros(0)) is False
    assert is_pinned(np.zeros((8, 8))[:, ::3]) is False
    assert is_pinned(np.float64(1.0).reshape(1)) is False


def test_register_host_pins_and_copies(stream):
    # Allocate through a large array so no other live registration shares its pages.
    src = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
    dst = np.zeros_like(src)
    assert not is_pinned(src)
    with register_host(src) as reg_src, register_host(dst) as reg_dst:
        assert is_pinned(src) and is_pinned(dst)
        assert reg_src.nbytes == src.nbytes and reg_src.array is src
        with DeviceBuffer.allocate(src.nbytes, stream) as buf:
            buf.copy_from_host(src, stream)
            buf.copy_to_host(reg_dst, stream, sync=True)
    assert reg_src.closed and reg_dst.closed
    assert not is_pinned(src)
    np.testing.assert_array_equal(dst, src)


def test_event_timing_around_a_copy(dev, stream):
    nbytes = 64 << 20
    host = PinnedBuffer(nbytes)
    host.array[:] = 1
    start, end = Event(dev, timing=True), Event(dev, timing=True)
    with DeviceBuffer.allocate(nbytes, stream) as buf:
        start.record(stream)
        buf.copy_from_host(host, stream)
        end.record(stream)
        end.synchronize()
    assert end.query() and start.query()
    ms = Event.elapsed_ms(start, end)
    assert isinstance(ms, float) and ms > 0
    start.close()
    end.close()
    end.close()


def test_sync_only_event_elapsed_raises(dev, stream):
    a, b = Event(dev), Event(dev)
    a.record(stream)
    b.record(stream)
    b.synchronize()
    with pytest.raises(ValueError, match="sync-only"):
        Event.elapsed_ms(a, b)
    with pytest.raises(TypeError, match="legacy default stream"):
        a.record(0)


def test_stream_priority_range(dev):
    greatest, least = dev.limits.stream_priority_range
    for p in (greatest, least):
        with Stream(dev, priority=p) as s:
            assert s.priority == p
    for bad in (greatest - 1, least + 1):
        with pytest.raises(ValueError, match=re.escape(f"[{greatest} (highest) .. {least}")):
            Stream(dev, priority=bad)


def test_stream_close_twice_and_query(dev):
    s = Stream(dev)
    assert s.query() is True  # nothing enqueued yet
    buf = DeviceBuffer.allocate(1 << 20, s)
    buf.memset(1, s)
    s.query()  # either answer is fine, but it must not raise
    buf.close()
    s.synchronize()
    assert s.query() is True
    s.close()
    s.close()
    assert s.closed
    with pytest.raises(ValueError, match="closed"):
        s.handle


def test_buffer_freed_after_its_stream_was_closed(dev):
    pool = MemoryPool.default(dev)
    s = Stream(dev)
    s.synchronize()
    before = pool.used_bytes
    buf = DeviceBuffer.allocate(4096, s)
    s.close()
    buf.close()  # falls back to a device synchronize + cuMemFree
    assert pool.used_bytes == before


def test_forgotten_resources_are_released_by_the_finalizer(dev):
    pool = MemoryPool.default(dev)
    s = Stream(dev)
    s.synchronize()
    before = pool.used_bytes
    DeviceBuffer.allocate(1 << 20, s)  # dropped at once
    Event(dev)
    PinnedBuffer(4096)
    gc.collect()
    s.synchronize()
    assert pool.used_bytes == before


def test_many_threads_make_current_allocate_copy_free(dev):
    n = (1 << 20) + 12

    all_started = threading.Barrier(4)  # four distinct threads, all at once

    def work(seed):
        all_started.wait(timeout=60)
        dev.make_current()
        with Stream(dev) as s:
            src = PinnedBuffer(n)
            src.array[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
            out = PinnedBuffer(n)
            for _ in range(5):
                with DeviceBuffer.allocate(n, s) as buf:
                    buf.copy_from_host(src, s)
                    buf.copy_to_host(out, s)
                s.synchronize()
                if out.array.tobytes() != src.array.tobytes():
                    return f"thread {seed}: data mismatch"
            src.close()
            out.close()
        return threading.current_thread().name

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(4)))
    assert all("mismatch" not in r for r in results)
    assert len(set(results)) == 4

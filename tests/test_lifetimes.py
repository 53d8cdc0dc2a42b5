"""Lifetimes without a GPU: leases on `Owner` defer a closed handle's release until the last
lease ends (pure Python with fake release functions, then `DeviceBuffer`, `PinnedBuffer`,
`HostRegistration`, `Module` and `StagingPool` on a fake driver that records every call), and
`GraphCache` leases keep an evicted exec open until its last lease (threads).

The rule under test (docs/errors.md, "Lifetimes"): closing a resource that is leased returns at
once, the object reads as closed right away, the driver release runs exactly once when the last
lease ends, and ``live_handles()`` counts the handle until then.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import random
import threading
import time
import types
import weakref
from collections import Counter

import numpy as np
import pytest
from cuda.bindings import driver

import orchestra.driver as od
from orchestra.driver import check as check_mod
from orchestra.driver import host as host_mod
from orchestra.driver import memory as memory_mod
from orchestra.driver import owner as owner_mod
from orchestra.driver import stream as stream_mod
from orchestra.driver.owner import Lease, ResourceClosedError
from orchestra.errors import CudaError, OrchestraError
from orchestra.execute.cuda_graph.cache import CacheLease, GraphCache

# -- pure Python: Owner with fake release functions ------------------------------------------


@pytest.fixture
def fake_device(monkeypatch):
    # earlier tests' handles still held by garbage cycles go now, not during the test (its
    # live_handles() counts before and after would differ by them)
    gc.collect()
    alive = {"value": True}
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: alive["value"])
    dev = types.SimpleNamespace(ordinal=0, pushed=contextlib.nullcontext)
    return dev, alive


class Thing(od.Resource):
    """A resource owning one fake handle; ``released`` is the list its release appends to."""

    def __init__(self, released, device, handle="h", what="Event"):
        self._own = od.Owner(self, handle, released.append, device, what)


def test_close_while_leased_defers_the_release_to_the_last_lease(fake_device):
    dev, _ = fake_device
    before, deferred_before = od.live_handles(), od.deferred_releases()
    released = []
    t = Thing(released, dev, "h1", "DeviceBuffer")
    a, b = t.lease(), t.lease()
    assert isinstance(a, Lease) and a.handle == "h1" and t._own.leases == 2
    t.close()
    # closed at once, released not yet
    assert t.closed and released == []
    with pytest.raises(ResourceClosedError, match="this DeviceBuffer is closed"):
        t._own.handle
    assert od.live_handles()["device_buffer"] == before["device_buffer"] + 1
    assert od.deferred_releases()["device_buffer"] == deferred_before["device_buffer"] + 1
    assert a.handle == "h1"  # the lease still reads the handle
    a.release()
    a.release()  # idempotent: does not count as b's release
    assert released == [] and a.released and not b.released
    with pytest.raises(ResourceClosedError, match="lease on a DeviceBuffer was released"):
        a.handle
    b.release()
    assert released == ["h1"]
    assert od.live_handles() == before and od.deferred_releases() == deferred_before
    t.close()
    b.release()
    assert released == ["h1"]


def test_unleased_close_releases_at_once(fake_device):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    t = Thing(released, dev, "h2")
    t.lease().release()  # a lease that ended changes nothing
    t.close()
    assert released == ["h2"] and od.live_handles() == before


def test_lease_after_close_is_refused_with_a_clear_error(fake_device):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    t = Thing(released, dev, "h3", "PinnedBuffer")
    t.close()
    with pytest.raises(ResourceClosedError) as info:
        t.lease()
    message = str(info.value)
    assert "this PinnedBuffer is closed: it cannot be leased or bound to new work" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, OrchestraError)
    assert info.value.what == "PinnedBuffer"
    assert released == ["h3"] and od.live_handles() == before
    # also refused while another lease keeps the closed handle alive
    u = Thing(released, dev, "h4")
    keep = u.lease()
    u.close()
    with pytest.raises(ResourceClosedError):
        u.lease()
    assert released == ["h3"]
    keep.release()
    assert released == ["h3", "h4"]


def test_lease_is_a_context_manager(fake_device):
    dev, _ = fake_device
    released = []
    t = Thing(released, dev, "h5")
    with t.lease() as lease:
        t.close()
        assert lease.handle == "h5" and released == []
    assert released == ["h5"] and lease.released


def test_object_collected_while_leased_waits_for_the_last_lease(fake_device):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    t = Thing(released, dev, "h6", "Module")
    ref = weakref.ref(t)
    lease = t.lease()
    del t
    gc.collect()
    assert ref() is None  # the lease keeps the handle, not the object
    assert released == [] and od.live_handles()["module"] == before["module"] + 1
    assert od.deferred_releases()["module"] >= 1
    lease.release()
    assert released == ["h6"] and od.live_handles() == before


def test_forgotten_lease_ends_itself_when_collected(fake_device):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    t = Thing(released, dev, "h7")
    t.lease()  # dropped at once
    t.close()
    assert released == ["h7"]
    u = Thing(released, dev, "h8")
    lease = u.lease()
    u.close()
    assert released == ["h7"]
    del lease
    gc.collect()
    assert released == ["h7", "h8"] and od.live_handles() == before


def test_detach_while_leased_closes_instead_of_handing_over(fake_device):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    t = Thing(released, dev, "h9")
    lease = t.lease()
    assert t._own.detach() is None and t.closed and released == []
    lease.release()
    assert released == ["h9"] and od.live_handles() == before
    u = Thing(released, dev, "h10")
    assert u._own.detach() == "h10" and released == ["h9"]  # not leased: handed over
    assert od.live_handles() == before


def test_deferred_release_error_propagates_from_the_last_lease_once(fake_device):
    dev, _ = fake_device
    before = od.live_handles()
    calls = []

    def failing(handle):
        calls.append(handle)
        raise CudaError("cuMemFreeHost", 1, "CUDA_ERROR_INVALID_VALUE")

    class Bad(od.Resource):
        def __init__(self):
            self._own = od.Owner(self, "hb", failing, dev, "PinnedBuffer")

    b = Bad()
    lease = b.lease()
    b.close()  # deferred: nothing raised here
    with pytest.raises(CudaError, match="cuMemFreeHost"):
        lease.release()
    lease.release()
    assert calls == ["hb"] and b._own.released
    assert od.live_handles() == before  # ownership ended; never retried
    assert od.deferred_releases()["pinned_buffer"] == 0


def test_deferred_release_is_skipped_once_the_context_is_gone(fake_device):
    dev, alive = fake_device
    before = od.live_handles()
    t = Thing([], dev, "h11", "Stream")
    lease = t.lease()
    t.close()
    alive["value"] = False  # interpreter exit released the primary context
    lease.release()  # must not call the release (it would fail()), still counts as released
    assert t._own.released and od.live_handles() == before


class _Reentrant(set):
    """A lease-token set that closes its owner in the middle of an add or a discard: what a
    finalizer (the owner's object collected) running between two bytecodes does."""

    def __init__(self, owner, on):
        super().__init__()
        self.owner, self.on = owner, on

    def add(self, token):
        if self.on == "before-add":
            self.owner.close()
        super().add(token)
        if self.on == "after-add":
            self.owner.close()

    def discard(self, token):
        if self.on == "before-discard":
            self.owner.close()
        super().discard(token)
        if self.on == "after-discard":
            self.owner.close()


@pytest.mark.parametrize("on", ["before-add", "after-add"])
def test_close_inside_lease_refuses_it_and_releases_once(fake_device, on):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    t = Thing(released, dev, "hr")
    t._own._leases = _Reentrant(t._own, on)
    with pytest.raises(ResourceClosedError):
        t.lease()
    assert released == ["hr"] and od.live_handles() == before
    assert od.deferred_releases()["event"] == 0


@pytest.mark.parametrize("on", ["before-discard", "after-discard"])
def test_close_inside_the_last_lease_release_releases_once(fake_device, on):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    t = Thing(released, dev, "hd")
    lease = t.lease()
    reentrant = _Reentrant(t._own, on)
    reentrant |= t._own._leases
    t._own._leases = reentrant
    lease.release()
    assert released == ["hd"] and t.closed and od.live_handles() == before
    assert od.deferred_releases()["event"] == 0


def test_many_threads_lease_while_others_close(fake_device):
    """Leases taken and ended on 8 threads while 2 threads close the owners at random: every
    handle is released exactly once, never while a lease on it is out, and every count is back
    to its baseline."""
    dev, _ = fake_device
    before, deferred_before = od.live_handles(), od.deferred_releases()
    n = 64
    active = Counter()
    released = Counter()
    bad = []
    lock = threading.Lock()

    by_leaser = []

    def release(h):
        with lock:
            if active[h]:
                bad.append(f"handle {h} released with {active[h]} lease(s) out")
            released[h] += 1
            if threading.current_thread().name.startswith("leaser"):
                by_leaser.append(h)  # deferred: the last lease ended after the close

    class T(od.Resource):
        def __init__(self, h):
            self._own = od.Owner(self, h, release, dev, "DeviceBuffer")

    things = [T(h) for h in range(n)]
    refused = Counter()
    stop = threading.Event()

    def leaser(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            t = things[rng.randrange(n)]
            try:
                lease = t.lease()
            except ResourceClosedError:
                refused[seed] += 1
                continue
            h = lease.handle
            with lock:
                active[h] += 1
            if released[h]:
                bad.append(f"lease granted on released handle {h}")
            time.sleep(0) if rng.random() < 0.5 else None
            with lock:
                active[h] -= 1
            lease.release()

    def closer(seed):
        rng = random.Random(seed)
        order = list(range(n))
        rng.shuffle(order)
        for i in order:
            time.sleep(rng.random() * 1e-4)
            things[i].close()

    workers = [threading.Thread(target=leaser, args=(s,), name=f"leaser{s}") for s in range(8)]
    closers = [threading.Thread(target=closer, args=(100 + s,)) for s in range(2)]
    for w in workers + closers:
        w.start()
    for c in closers:
        c.join()
    stop.set()
    for w in workers:
        w.join()
    assert not bad, bad[:5]
    assert sorted(released) == list(range(n)) and set(released.values()) == {1}
    assert sum(refused.values()) > 0 and by_leaser  # the closes really raced the leases
    print(f"{len(by_leaser)} of {n} releases deferred to a lease's end, "
          f"{sum(refused.values())} leases refused")
    assert od.live_handles() == before and od.deferred_releases() == deferred_before


# -- the driver resources on a fake driver ---------------------------------------------------


OK = driver.CUresult.CUDA_SUCCESS


class FakeMemoryDriver:
    """The driver calls behind streams, device buffers and pinned / registered host memory.

    Device memory is host memory; a freed allocation is filled with 0xDD, so a read of freed
    memory shows. Every call is logged as (name, args)."""

    def __init__(self):
        self.log: list = []
        self.mem: dict[int, np.ndarray] = {}
        self.host: dict[int, np.ndarray] = {}
        self.registered: dict[int, int] = {}
        self.streams = 0
        self.used = 0
        self.lock = threading.Lock()

    def calls(self, name):
        return [args for n, args in self.log if n == name]

    def _log(self, name, *args):
        with self.lock:
            self.log.append((name, args))

    def cuStreamCreateWithPriority(self, flags, priority):
        self.streams += 1
        self._log("cuStreamCreateWithPriority")
        return (OK, driver.CUstream(7000 + self.streams))

    def cuStreamDestroy(self, s):
        self._log("cuStreamDestroy", int(s))
        return (OK,)

    def cuStreamSynchronize(self, s):
        self._log("cuStreamSynchronize", int(s))
        return (OK,)

    def cuCtxSynchronize(self):
        self._log("cuCtxSynchronize")
        return (OK,)

    def cuMemAllocFromPoolAsync(self, nbytes, pool, stream):
        arr = np.zeros(nbytes + 64, np.uint8)
        ptr = (arr.ctypes.data + 63) // 64 * 64
        self.mem[ptr] = arr[ptr - arr.ctypes.data:][:nbytes]
        self.used += nbytes
        self._log("cuMemAllocFromPoolAsync", nbytes, int(stream))
        return (OK, driver.CUdeviceptr(ptr))

    def cuMemFreeAsync(self, dptr, stream):
        ptr = int(dptr)
        arr = self.mem.pop(ptr)
        arr[:] = 0xDD
        self.used -= arr.nbytes
        self._log("cuMemFreeAsync", ptr, int(stream))
        return (OK,)

    def cuMemHostAlloc(self, nbytes, flags):
        arr = np.zeros(nbytes, np.uint8)
        self.host[arr.ctypes.data] = arr
        self._log("cuMemHostAlloc", nbytes)
        return (OK, arr.ctypes.data)

    def cuMemFreeHost(self, ptr):
        self.host.pop(int(ptr))[:] = 0xDD
        self._log("cuMemFreeHost", int(ptr))
        return (OK,)

    def cuMemHostRegister(self, ptr, nbytes, flags):
        self.registered[int(ptr)] = nbytes
        self._log("cuMemHostRegister", int(ptr), nbytes)
        return (OK,)

    def cuMemHostUnregister(self, ptr):
        del self.registered[int(ptr)]
        self._log("cuMemHostUnregister", int(ptr))
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst, src, nbytes, stream):
        self._log("cuMemcpyDtoHAsync", int(dst), int(src), nbytes)
        ctypes.memmove(int(dst), int(src), nbytes)
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        self._log("cuMemcpyHtoDAsync", int(dst), int(src), nbytes)
        ctypes.memmove(int(dst), int(src), nbytes)
        return (OK,)

    def cuLibraryUnload(self, lib):
        self._log("cuLibraryUnload", lib)
        return (OK,)


@pytest.fixture
def fake_mem(monkeypatch):
    fake = FakeMemoryDriver()
    limits = types.SimpleNamespace(stream_priority_range=(-5, 0))
    dev = types.SimpleNamespace(ordinal=0, name="Fake GPU", limits=limits,
                                make_current=lambda force=False: None,
                                pushed=contextlib.nullcontext)
    pool = types.SimpleNamespace(handle="pool", device=dev)

    real_cu = check_mod.cu

    def fake_cu(fn, *args):
        return real_cu(getattr(fake, fn.__name__), *args)

    for mod in (memory_mod, host_mod, stream_mod):
        monkeypatch.setattr(mod, "cu", fake_cu)
        monkeypatch.setattr(mod, "as_device", lambda d=None: dev)
    monkeypatch.setattr(check_mod, "cu", fake_cu)  # Module's release binds it at construction
    monkeypatch.setattr(memory_mod.MemoryPool, "default",
                        classmethod(lambda cls, d=None, r=None: pool))
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: True)
    fake.device = dev
    return fake


def test_device_buffer_closed_while_leased_is_freed_once_after_the_last_lease(fake_mem):
    before, deferred_before = od.live_handles(), od.deferred_releases()
    s = od.Stream()
    buf = od.DeviceBuffer.allocate(256, s)
    host = np.arange(64, dtype=np.float32)
    data = fake_mem.mem[buf.ptr]
    data.view(np.float32)[:] = host
    lease, lease2 = buf.lease(), buf.lease()
    ptr = int(lease.handle)
    buf.close()
    assert buf.closed and fake_mem.calls("cuMemFreeAsync") == []
    with pytest.raises(ResourceClosedError, match="this DeviceBuffer is closed"):
        buf.ptr
    with pytest.raises(ResourceClosedError):
        buf.lease()
    with pytest.raises(ValueError):  # still the ValueError it always was
        buf.memset(0, s)
    assert od.live_handles()["device_buffer"] == before["device_buffer"] + 1
    assert od.deferred_releases()["device_buffer"] == deferred_before["device_buffer"] + 1
    # the memory behind the lease is intact: nothing else can have been given this address
    other = od.DeviceBuffer.allocate(256, s)
    assert other.ptr != ptr
    np.testing.assert_array_equal(np.frombuffer(fake_mem.mem[ptr], np.float32), host)
    lease.release()
    assert fake_mem.calls("cuMemFreeAsync") == []
    lease2.release()
    assert fake_mem.calls("cuMemFreeAsync") == [(ptr, int(s.handle))]  # the allocating stream
    other.close()
    s.close()
    assert od.live_handles() == before and od.deferred_releases() == deferred_before
    assert fake_mem.used == 0


def test_device_buffer_free_on_another_stream_while_leased(fake_mem):
    before = od.live_handles()
    s, t = od.Stream(), od.Stream()
    sh, th = int(s.handle), int(t.handle)
    a = od.DeviceBuffer.allocate(64, s)
    b = od.DeviceBuffer.allocate(64, s)
    c = od.DeviceBuffer.allocate(64, s)
    pa, pb, pc = a.ptr, b.ptr, c.ptr
    la, lb, lc = a.lease(), b.lease(), c.lease()
    a.free(t)
    b.free(t)
    c.free(t)
    with pytest.raises(TypeError, match="legacy default stream"):
        c.free(0)  # the stream is still checked, before anything
    assert fake_mem.calls("cuMemFreeAsync") == []
    la.release()  # t open: on t, the stream free() named
    t.close()
    lb.release()  # t closed by now: on the allocating stream
    s.close()
    lc.release()  # both closed: context synchronize, then a private stream
    frees = fake_mem.calls("cuMemFreeAsync")
    assert frees[:2] == [(pa, th), (pb, sh)]
    assert frees[2][0] == pc and frees[2][1] not in (sh, th)  # the private stream
    assert fake_mem.calls("cuCtxSynchronize") == [()]
    assert od.live_handles() == before and fake_mem.used == 0


def test_device_buffer_unleased_free_on_another_stream_is_immediate(fake_mem):
    before = od.live_handles()
    s, t = od.Stream(), od.Stream()
    a = od.DeviceBuffer.allocate(64, s)
    p = a.ptr
    a.free(t)
    a.free(s)  # twice: nothing
    assert fake_mem.calls("cuMemFreeAsync") == [(p, int(t._own._handle))]
    s.close()
    t.close()
    assert od.live_handles() == before


def test_device_buffer_collected_while_leased(fake_mem):
    before = od.live_handles()
    s = od.Stream()
    buf = od.DeviceBuffer.allocate(64, s)
    lease = buf.lease()
    p = buf.ptr
    del buf
    gc.collect()
    assert fake_mem.calls("cuMemFreeAsync") == [] and p in fake_mem.mem
    lease.release()
    assert fake_mem.calls("cuMemFreeAsync") == [(p, int(s._own._handle))]
    s.close()
    assert od.live_handles() == before


def test_pinned_buffer_closed_while_leased(fake_mem):
    before = od.live_handles()
    ranges = od.pinned_ranges()
    pb = od.PinnedBuffer.empty(16, np.float32)
    view = pb.array
    view[:] = np.arange(16)
    lo, hi = view.ctypes.data, view.ctypes.data + view.nbytes
    assert ranges.covers(lo, hi) and od.is_pinned(view)
    lease = pb.lease()
    v0 = ranges.version
    pb.close()
    assert ranges.version > v0  # earlier "covered" answers must be checked again
    assert pb.closed and fake_mem.calls("cuMemFreeHost") == []
    for use in (lambda: pb.ptr, lambda: pb.array, lambda: pb.view(np.uint8), pb.lease):
        with pytest.raises(ResourceClosedError, match="PinnedBuffer is closed"):
            use()
    # the range stays (the memory is pinned) but reads as closed
    assert not ranges.covers(lo, hi) and ranges.closed_owner(lo, hi) == "PinnedBuffer"
    assert not od.is_pinned(view)
    with pytest.raises(ResourceClosedError, match="belongs to a PinnedBuffer that is closed"):
        ranges.lease(lo, hi)
    s = od.Stream()
    dbuf = od.DeviceBuffer.allocate(view.nbytes, s)
    with pytest.raises(ResourceClosedError, match="memory of a PinnedBuffer that is closed"):
        dbuf.copy_from_host(view, s)  # close-then-bind is refused, not read
    np.testing.assert_array_equal(view, np.arange(16, dtype=np.float32))  # still allocated
    lease.release()
    assert fake_mem.calls("cuMemFreeHost") == [(lo,)]
    assert ranges.closed_owner(lo, hi) is None and not ranges.covers(lo, hi)
    assert ranges.lease(lo, hi) is None  # unknown memory now
    dbuf.close()
    s.close()
    assert od.live_handles() == before


def test_pinned_ranges_lease_keeps_the_memory_behind_a_view(fake_mem):
    before = od.live_handles()
    ranges = od.pinned_ranges()
    pb = od.PinnedBuffer(4096)
    sub = pb.view(np.float32)[100:200]
    lo = sub.ctypes.data
    lease = ranges.lease(lo, lo + sub.nbytes)
    assert isinstance(lease, Lease) and lease.handle == pb.ptr
    assert ranges.lease(lo, lo + 8192) is None  # runs past the buffer: not wholly orchestra's
    outside = np.zeros(16)
    assert ranges.lease(outside.ctypes.data, outside.ctypes.data + 128) is None
    del pb, sub
    gc.collect()  # the buffer object is gone; the lease holds the memory
    assert fake_mem.calls("cuMemFreeHost") == [] and ranges.closed_owner(lo, lo + 4) is not None
    lease.release()
    assert len(fake_mem.calls("cuMemFreeHost")) == 1 and od.live_handles() == before


def test_host_registration_closed_while_leased_keeps_the_array(fake_mem):
    before = od.live_handles()
    ranges = od.pinned_ranges()
    a = np.arange(1024, dtype=np.float32)
    ptr = a.ctypes.data
    ref = weakref.ref(a)
    reg = od.register_host(a)
    lease = ranges.lease(ptr, ptr + a.nbytes)
    assert lease is not None and lease.handle == ptr
    reg.close()
    with pytest.raises(ResourceClosedError, match="HostRegistration is closed"):
        reg.ptr
    assert not od.is_pinned(a) and ranges.closed_owner(ptr, ptr + 4) == "HostRegistration"
    del a, reg
    gc.collect()
    assert ref() is not None  # kept alive: it is still registered and leased
    assert fake_mem.calls("cuMemHostUnregister") == [] and ptr in fake_mem.registered
    lease.release()
    assert fake_mem.calls("cuMemHostUnregister") == [(ptr,)]
    gc.collect()
    assert ref() is None and od.live_handles() == before


def test_pinned_range_of_new_memory_at_a_reused_address_is_kept(fake_mem):
    """The release removes its own range only: memory pinned again at the same address by a
    new owner between the driver call and the removal keeps its range."""
    ranges = od.pinned_ranges()
    a = np.zeros(512, np.uint8)
    reg = od.register_host(a)
    ptr = a.ctypes.data
    other_owner = object()
    real = fake_mem.cuMemHostUnregister

    def unregister_then_reregister(p):
        out = real(p)
        ranges.add(ptr, 512, other_owner)  # someone pinned the same address meanwhile
        return out

    fake_mem.cuMemHostUnregister = unregister_then_reregister
    reg.close()
    assert ranges._find(ptr, ptr + 512)[1] is other_owner
    ranges.discard(ptr)
    assert ranges._find(ptr, ptr + 512) is None


def test_module_closed_while_leased_unloads_after_the_last_lease(fake_mem):
    from orchestra.kernel.module import Module

    before = od.live_handles()
    m = Module("lib-handle", b"\x7fELF", fake_mem.device)
    lease = m.lease()
    m.close()
    assert m.closed and fake_mem.calls("cuLibraryUnload") == []
    with pytest.raises(ResourceClosedError, match="Module is closed"):
        m.library
    with pytest.raises(ResourceClosedError, match="load it again"):
        m.kernel("burn")
    with pytest.raises(ResourceClosedError):
        m.lease()
    assert od.live_handles()["module"] == before["module"] + 1
    lease.release()
    assert fake_mem.calls("cuLibraryUnload") == [("lib-handle",)]
    assert od.live_handles() == before


def test_staging_pool_closed_while_slots_are_leased(fake_mem):
    from orchestra.execute.staging import StagingPool

    before = od.live_handles()
    pool = StagingPool(3, 256)
    views = pool.bindings()
    ptrs = [v.ctypes.data for v in views.values()]
    l0 = pool.lease(0)
    l2 = od.pinned_ranges().lease(ptrs[2], ptrs[2] + 256)  # through a bound view's range
    all_leases = pool.leases()
    assert len(all_leases) == 3
    for lease in all_leases:
        lease.release()
    pool.close()
    assert pool.closed
    assert fake_mem.calls("cuMemFreeHost") == [(ptrs[1],)]  # the one slot not leased
    for use in (pool.bindings, lambda: pool.view(0), lambda: pool.lease(0), pool.leases):
        with pytest.raises(ResourceClosedError, match="StagingPool is closed"):
            use()
    pool.close()  # idempotent
    l2.release()
    assert fake_mem.calls("cuMemFreeHost") == [(ptrs[1],), (ptrs[2],)]
    l0.release()
    assert fake_mem.calls("cuMemFreeHost") == [(ptrs[1],), (ptrs[2],), (ptrs[0],)]
    assert od.live_handles() == before


# -- GraphCache leases -----------------------------------------------------------------------


class FakeExec:
    """Counts its closes and refuses a replay once closed (what a freed exec would do)."""

    made: list = []

    def __init__(self, sig):
        self.sig = sig
        self.closes = 0
        self.replays = 0
        self.replays_after_close = 0
        self.lock = threading.Lock()
        FakeExec.made.append(self)

    def replay(self):
        with self.lock:
            if self.closes:
                self.replays_after_close += 1
            self.replays += 1

    def close(self):
        with self.lock:
            self.closes += 1
            self.closed_by = threading.current_thread().name


@pytest.fixture
def execs():
    FakeExec.made = []
    return FakeExec.made


def test_cache_lease_keeps_an_evicted_exec_open(execs):
    c = GraphCache(max_entries=2)
    s = [c.signature({"x": (n, "float32")}) for n in (1, 2, 3)]
    with c.lease(s[0], FakeExec) as e0:
        assert isinstance(e0, FakeExec) and c.stats["misses"] == 1
        assert c.evict(s[0]) and s[0] not in c
        assert e0.closes == 0 and c.deferred == 1
        e0.replay()
    assert e0.closes == 1 and c.deferred == 0
    # capacity eviction while leased
    lease = c.lease(s[0], FakeExec)
    e0b = lease.value
    assert e0b is not e0 and isinstance(lease, CacheLease)
    c.get_or_build(s[1], FakeExec)
    c.get_or_build(s[2], FakeExec)  # evicts s0, leased
    assert s[0] not in c and e0b.closes == 0 and c.stats["evictions"] == 1
    lease.release()
    lease.release()  # idempotent
    assert e0b.closes == 1
    # a hit leases too; put() replacing a leased value closes it at the lease's end
    with c.lease(s[1]) as e1:
        c.put(s[1], "replacement")
        assert e1.closes == 0 and c.get(s[1]) == "replacement"
    assert e1.closes == 1
    # clear() with a lease out
    lease2 = c.lease(s[2])
    e2 = lease2.value
    c.clear()
    assert e2.closes == 0 and len(c) == 0
    lease2.release()
    assert e2.closes == 1
    assert all(e.closes == 1 for e in execs)


def test_cache_lease_miss_without_build_fn_and_failed_build(execs):
    c = GraphCache()
    sig = c.signature({"x": (4, "f4")})
    with pytest.raises(KeyError, match="no cached value"):
        c.lease(sig)

    def bad(_):
        raise RuntimeError("build failed")

    with pytest.raises(RuntimeError):
        c.lease(sig, bad)
    assert sig not in c
    with c.lease(sig, FakeExec) as e:
        pass
    assert e.closes == 0 and c.get(sig) is e  # not evicted: stays open in the cache
    c.close()
    assert e.closes == 1


def test_cache_lease_collected_unreleased_is_ended_by_the_next_call(execs):
    c = GraphCache(max_entries=1)
    s0, s1 = c.signature(n=0), c.signature(n=1)
    lease = c.lease(s0, FakeExec)
    e0 = lease.value
    c.get_or_build(s1, FakeExec)  # evicts s0 (leased)
    assert e0.closes == 0
    del lease
    gc.collect()
    assert e0.closes == 0  # a finalizer does not take the cache's lock
    c.get(s1)
    assert e0.closes == 1 and c.deferred == 0


def test_many_threads_lease_and_replay_while_others_evict(execs):
    """8 threads lease and replay execs of 6 signatures in a cache of 2 while 2 threads
    evict, put over and clear: no exec is closed while leased (a replay never meets a closed
    exec), and every exec ever built is closed exactly once after its last lease."""
    c = GraphCache(max_entries=2)
    sigs = [c.signature({"x": (n, "float32")}) for n in range(1, 7)]
    stop = threading.Event()
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                with c.lease(rng.choice(sigs), FakeExec) as exe:
                    exe.replay()
                    if rng.random() < 0.3:
                        time.sleep(0)
                    exe.replay()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def evictor(seed):
        rng = random.Random(seed)
        try:
            for i in range(400):
                r = rng.random()
                if r < 0.5:
                    c.evict(rng.choice(sigs))
                elif r < 0.8:
                    c.put(rng.choice(sigs), FakeExec(None))
                else:
                    c.clear()
                if i % 16 == 0:
                    time.sleep(0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(s,), name=f"worker{s}") for s in range(8)]
    evictors = [threading.Thread(target=evictor, args=(100 + s,)) for s in range(2)]
    for t in workers + evictors:
        t.start()
    for t in evictors:
        t.join()
    stop.set()
    for t in workers:
        t.join()
    assert not errors, errors[:3]
    assert c.deferred == 0  # every deferred close ran at its lease's end
    deferred = [e for e in execs if getattr(e, "closed_by", "").startswith("worker")]
    assert deferred  # evictions really met leased execs (closed by their last lease)
    print(f"{len(execs)} execs, {len(deferred)} closed at a lease's end")
    c.clear()
    assert len(execs) > 20 and sum(e.replays for e in execs) > 100
    assert [e for e in execs if e.replays_after_close] == []
    assert {e.closes for e in execs} == {1}


def test_graph_runner_leases_its_exec_and_closes_evicted_ones_once(monkeypatch):
    """`GraphRunner` keeps its execs in a `GraphCache` of ``cache_size`` and leases the one it
    launches: alternating two graphs in a cache of 1 rebuilds each time and destroys every
    exec exactly once (fake graph driver)."""
    from orchestra.execute.cuda_graph.runner import GraphRunner
    from orchestra.app.job.graphs import BURN_PARAMS
    from orchestra.graph import KernelRef, build_pipeline
    from tests import fake_graph_cuda as fg

    fake = fg.install(monkeypatch)
    burn = KernelRef("burn.cu", "burn", params=BURN_PARAMS)

    def job(batches, seed):
        n = 1024
        g, bs = build_pipeline(batches, [4 * n] * batches, burn, scalars=(2, 0.5, 1.0))
        rng = np.random.default_rng(seed)
        bind = {}
        for b in bs:
            bind[b.host_in.buffer.name] = rng.standard_normal(n).astype(np.float32)
            bind[b.host_out.buffer.name] = np.full(n, np.nan, np.float32)
        return g, bs, bind

    def check(bs, bind):
        for b in bs:
            x = bind[b.host_in.buffer.name]
            ref = (x * np.float32(0.5) + np.float32(1)) * np.float32(0.5) + np.float32(1)
            np.testing.assert_array_equal(bind[b.host_out.buffer.name], ref)

    ga, bsa, binda = job(2, 0)
    gb, bsb, bindb = job(3, 1)
    with GraphRunner("graph", fake.device, kernel_resolver=fg.resolver(fake),
                     cache_size=1) as runner:
        for g, bs, bind in ((ga, bsa, binda), (gb, bsb, bindb), (ga, bsa, binda)):
            r = runner.run(g, None, bind)
            check(bs, bind)
            assert r.prepare_ms > 0  # rebuilt: the other graph evicted it
        r = runner.run(ga, None, binda)
        assert r.prepare_ms == 0.0
        assert fake.counts["cuGraphInstantiate"] == 3
        assert fake.counts["cuGraphExecDestroy"] == 2  # the two evicted ones, once each
    assert fake.counts["cuGraphExecDestroy"] == 3 and not fake.live_graphs


# The executors' side of the rule (execs and eager runs lease what they are bound to) is in
# tests/test_exec_lifetimes.py.

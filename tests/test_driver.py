"""orchestra.driver tests that run without a GPU: errors, the checked-call helper, the owner
helper, and input validation that must refuse bad arguments before any driver call."""

import contextlib
import gc
import pickle
import types

import attrs
import numpy as np
import pytest
from cuda.bindings import driver

import orchestra.driver as od
from orchestra.driver import owner as owner_mod
from orchestra.driver.check import cu, device_available
from orchestra.driver.host import host_span
from orchestra.driver.stream import check_stream
from orchestra.errors import CudaError, NoDeviceError, OrchestraError

no_gpu = pytest.mark.skipif(device_available(), reason="checks the behaviour without a driver")


# --- errors ---------------------------------------------------------------------------------

def test_cuda_error_str_format():
    err = CudaError("cuMemAllocAsync", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
    assert str(err) == "cuMemAllocAsync: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
    assert not err.sticky
    assert isinstance(err, OrchestraError)


def test_cuda_error_without_message_and_with_context():
    assert str(CudaError("cuInit", 100, "CUDA_ERROR_NO_DEVICE")) == "cuInit: CUDA_ERROR_NO_DEVICE"
    err = CudaError("cuLaunchKernel", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument")
    assert str(err.with_context("node k0")).endswith("[node k0]")


def test_cuda_error_pickle_round_trip():
    err = CudaError("cuMemAllocAsync", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory", "batch 3")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is CudaError
    assert (back.call, back.code, back.name, back.message, back.context) == (
        "cuMemAllocAsync", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory", "batch 3")
    assert str(back) == str(err)


def test_sticky_error_says_context_is_unusable():
    err = CudaError("cuStreamSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS",
                    "an illegal memory access was encountered")
    assert err.sticky
    assert "context is unusable" in str(err)
    assert "restart" in str(err)
    assert pickle.loads(pickle.dumps(err)).sticky


# --- cu() -----------------------------------------------------------------------------------

def test_cu_raises_named_error_for_failing_result():
    def cuMemAllocAsync(nbytes, stream):  # the fake's name is what the error reports
        return (driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)

    with pytest.raises(CudaError) as info:
        cu(cuMemAllocAsync, 1 << 50, None)
    err = info.value
    assert err.call == "cuMemAllocAsync"
    assert err.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert err.code == int(driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    # Without a driver cuGetErrorString cannot answer, so the message may be empty.
    assert str(err).startswith("cuMemAllocAsync: CUDA_ERROR_OUT_OF_MEMORY")


def test_cu_returns_outputs():
    ok = driver.CUresult.CUDA_SUCCESS
    assert cu(lambda: (ok,)) is None
    assert cu(lambda: (ok, 7)) == 7
    assert cu(lambda: (ok, 1, 2)) == (1, 2)


@no_gpu
def test_device_get_raises_no_device_error_without_driver():
    with pytest.raises(NoDeviceError, match="no CUDA device"):
        od.Device.get()
    with pytest.raises(NoDeviceError):
        od.device_count()
    assert od.device_available() is False


# --- the owner helper -----------------------------------------------------------------------

class _Thing:
    """Stands in for a resource class: owns one fake handle."""

    def __init__(self, release, device):
        self._own = od.Owner(self, "handle-1", release, device, "Thing")


class _ThingResource(od.Resource):
    def __init__(self, release, device):
        self._own = od.Owner(self, 42, release, device, "ThingResource")


@pytest.fixture
def fake_device(monkeypatch):
    alive = {"value": True}
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: alive["value"])
    dev = types.SimpleNamespace(ordinal=0, pushed=contextlib.nullcontext)
    return dev, alive


def test_owner_close_twice_releases_once(fake_device):
    dev, _ = fake_device
    released = []
    thing = _Thing(released.append, dev)
    assert thing._own.handle == "handle-1" and not thing._own.closed
    thing._own.close()
    thing._own.close()
    assert released == ["handle-1"]
    assert thing._own.closed
    with pytest.raises(ValueError, match="Thing is closed"):
        thing._own.handle


def test_owner_finalizer_releases_forgotten_handle(fake_device):
    dev, _ = fake_device
    released = []
    thing = _Thing(released.append, dev)
    del thing
    gc.collect()
    assert released == ["handle-1"]


def test_owner_finalizer_skips_release_when_context_is_gone(fake_device):
    dev, alive = fake_device
    released = []
    thing = _Thing(released.append, dev)
    alive["value"] = False  # what the exit hook does when it releases the primary context
    del thing
    gc.collect()
    assert released == []


def test_owner_detach_hands_back_handle_without_release(fake_device):
    dev, _ = fake_device
    released = []
    thing = _Thing(released.append, dev)
    assert thing._own.detach() == "handle-1"
    assert thing._own.detach() is None
    thing._own.close()
    del thing
    gc.collect()
    assert released == []


def test_owner_explicit_close_propagates_release_error(fake_device):
    dev, _ = fake_device

    def failing(handle):
        raise CudaError("cuStreamDestroy", 400, "CUDA_ERROR_INVALID_HANDLE")

    thing = _Thing(failing, dev)
    with pytest.raises(CudaError, match="cuStreamDestroy"):
        thing._own.close()
    assert thing._own.closed  # never retried


def test_resource_context_manager_closes(fake_device):
    dev, _ = fake_device
    released = []
    with _ThingResource(released.append, dev) as res:
        assert not res.closed
    assert res.closed and released == [42]
    res.close()
    assert released == [42]


# --- leak accounting (live_handles) ---------------------------------------------------------

class _Owned(od.Resource):
    def __init__(self, release, device, what):
        self._own = od.Owner(self, object(), release, device, what)


def test_live_handles_reports_every_kind():
    live = od.live_handles()
    for kind in ("stream", "event", "device_buffer", "pinned_buffer", "host_registration",
                 "module"):
        assert isinstance(live[kind], int), kind
    live["stream"] += 100  # a snapshot, not the registry itself
    assert od.live_handles()["stream"] == live["stream"] - 100


@pytest.mark.parametrize("what, kind", [("Stream", "stream"), ("Event", "event"),
                                        ("DeviceBuffer", "device_buffer"),
                                        ("PinnedBuffer", "pinned_buffer"),
                                        ("HostRegistration", "host_registration"),
                                        ("Module", "module")])
def test_live_handles_counts_create_and_close(fake_device, what, kind):
    dev, _ = fake_device
    before = od.live_handles()
    released = []
    a, b = _Owned(released.append, dev, what), _Owned(released.append, dev, what)
    assert od.live_handles()[kind] == before[kind] + 2
    assert od.leaked(before) == {kind: 2}
    a.close()
    a.close()  # idempotent: counted once
    assert od.live_handles()[kind] == before[kind] + 1
    b.close()
    assert od.live_handles() == before and od.leaked(before) == {}
    assert len(released) == 2


def test_live_handles_finalizer_detach_and_failures(fake_device):
    dev, alive = fake_device
    before = od.live_handles()

    forgotten = _Owned(lambda h: None, dev, "Stream")
    del forgotten
    gc.collect()
    assert od.live_handles() == before  # the finalizer released it

    taken = _Owned(lambda h: pytest.fail("detach must not release"), dev, "DeviceBuffer")
    assert taken._own.detach() is not None
    assert od.live_handles() == before  # the caller owns it now
    assert taken._own.detach() is None
    taken.close()
    assert od.live_handles() == before

    def failing(handle):
        raise CudaError("cuEventDestroy", 400, "CUDA_ERROR_INVALID_HANDLE")

    bad = _Owned(failing, dev, "Event")
    with pytest.raises(CudaError):
        bad.close()
    assert od.live_handles() == before  # ownership ends; never retried

    at_exit = _Owned(lambda h: pytest.fail("no release after the context is gone"), dev,
                     "PinnedBuffer")
    alive["value"] = False
    at_exit.close()
    assert od.live_handles() == before


def test_live_handles_other_owner_kinds_are_lower_cased(fake_device):
    dev, _ = fake_device
    thing = _Thing(lambda h: None, dev)
    assert od.live_handles().get("thing", 0) >= 1
    thing._own.close()
    assert od.live_handles().get("thing", 0) == 0


# --- validation that happens before any driver call ------------------------------------------

def test_legacy_default_stream_is_refused():
    for bad in (0, None):
        with pytest.raises(TypeError, match="legacy default stream"):
            check_stream(bad, "test")
        with pytest.raises(TypeError, match="legacy default stream"):
            od.DeviceBuffer.allocate(16, bad)


def test_device_buffer_size_must_be_positive():
    with pytest.raises(ValueError, match="positive size"):
        od.DeviceBuffer.allocate(0, None)


def test_host_span_refuses_non_contiguous_arrays():
    a = np.zeros((4, 4), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="np.ascontiguousarray"):
        host_span(a, a.nbytes, "copy", writable=False)


def test_host_span_names_both_sizes():
    a = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="40 bytes.*64"):
        host_span(a, 64, "copy", writable=False)


def test_host_span_refuses_object_dtype_and_other_types():
    with pytest.raises(TypeError, match="dtype=object"):
        host_span(np.empty(2, object), 16, "copy", writable=False)
    with pytest.raises(TypeError, match="numpy array"):
        host_span(b"abc", 3, "copy", writable=False)


def test_host_span_refuses_read_only_destination():
    a = np.zeros(4, np.uint8)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        host_span(a, 4, "copy_to_host", writable=True)


def test_register_host_refuses_bad_arrays():
    with pytest.raises(ValueError, match="np.ascontiguousarray"):
        od.register_host(np.zeros((8, 8))[::2])
    ro = np.zeros(8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        od.register_host(ro)
    with pytest.raises(TypeError, match="numpy array"):
        od.register_host([1, 2, 3])


@no_gpu
def test_is_pinned_never_raises_for_plain_arrays_without_driver():
    assert od.is_pinned(np.zeros(16)) is False
    assert od.is_pinned(np.zeros(0)) is False
    assert od.is_pinned(np.zeros((4, 4))[:, ::2]) is False


def test_device_limits_is_frozen():
    limits = od.DeviceLimits(1024, (1024, 1024, 64), (2**31 - 1, 65535, 65535), 48 << 10,
                             227 << 10, 65536, True, True, True, 0, -5)
    assert limits.stream_priority_range == (-5, 0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        limits.max_threads_per_block = 1


def test_public_names():
    for name in ("Device", "Stream", "Event", "MemoryPool", "DeviceBuffer", "PinnedBuffer",
                 "HostRegistration", "register_host", "is_pinned", "cu", "ensure_initialized",
                 "device_available", "device_count", "devices"):
        assert hasattr(od, name), name

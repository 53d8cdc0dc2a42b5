"""Host tensors of other libraries as an engine's inputs and ``out=`` arrays (CPU, NumpyBackend).

Stand-ins for the libraries: an object that speaks only DLPack on the host (as a CPU torch
tensor does), one with only ``__array_interface__``, and device tensors (DLPack on a CUDA
device, the CUDA Array Interface), which an engine refuses before anything is queued.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from orchestra.serve import Engine, InputTypeError, NumpyBackend
from tests.test_serve import SPEC_IN, SPEC_OUT, f, numpy_engine, rows


class DLPackHost:
    """A host tensor that exports only through DLPack (numpy's own capsule underneath)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, *args, **kw):
        return self._a.__dlpack__(*args, **kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class ArrayInterfaceHost:
    def __init__(self, a):
        self._a = a
        self.__array_interface__ = a.__array_interface__


class DLPackDevice:
    """A CUDA tensor as DLPack describes it (device type 2, kDLCUDA): never exported here."""

    def __dlpack__(self, *args, **kw):
        raise AssertionError("an engine must not export a device tensor")

    def __dlpack_device__(self):
        return (2, 0)


class CAIDevice:
    __cuda_array_interface__ = {"shape": (4, 8), "typestr": "<f4", "data": (1 << 40, False),
                                "version": 3, "strides": None}


@pytest.mark.parametrize("wrap", [DLPackHost, ArrayInterfaceHost], ids=["dlpack", "array-if"])
def test_host_tensors_run_like_numpy_arrays_on_every_entry_point(wrap):
    x3, x5 = rows(3), rows(5)
    with numpy_engine() as e:
        assert e(wrap(x3)).tobytes() == f(x3).tobytes()
        assert e.submit(wrap(x5)).result(5).tobytes() == f(x5).tobytes()
        assert e({"x": wrap(x3)}).tobytes() == f(x3).tobytes()

        async def one():
            return await e.run(wrap(x5))

        assert asyncio.run(one()).tobytes() == f(x5).tobytes()
        # out= a host tensor: the outputs are written into its memory
        dst = np.full((3, x3.shape[1]), np.nan, np.float32)
        e(wrap(x3), out=wrap(dst))
        assert dst.tobytes() == f(x3).tobytes()


def test_a_host_tensor_of_the_wrong_dtype_or_shape_is_refused_naming_the_fix():
    with numpy_engine() as e:
        with pytest.raises(InputTypeError, match=r"dtype float64.*astype\(np.float32\)"):
            e(DLPackHost(rows(2).astype(np.float64)))
        fut = e.submit(ArrayInterfaceHost(rows(2)[:, :3].copy()))
        with pytest.raises(Exception, match="shape"):
            fut.result(5)
        ok = e(rows(2))  # still serving
        assert ok.tobytes() == f(rows(2)).tobytes()
        assert e.stats()["engine"]["bad_requests"] == 2


@pytest.mark.parametrize("dev", [DLPackDevice(), CAIDevice()], ids=["dlpack-cuda", "cai"])
def test_a_device_tensor_is_refused_before_anything_is_queued(dev):
    launches = []
    be = NumpyBackend(lambda d: launches.append(1) or f(d["x"]))
    with Engine(backend=be, inputs=SPEC_IN, outputs=SPEC_OUT, buckets=[4]) as e:
        with pytest.raises(InputTypeError, match="device memory.*host"):
            e(dev)
        fut = e.submit({"x": dev})
        with pytest.raises(InputTypeError, match="device memory"):
            fut.result(5)
        assert launches == []
        assert e.stats()["engine"]["bad_requests"] == 2


def test_the_view_of_a_host_tensor_shares_its_memory_until_the_request_is_done():
    """The request reads the tensor's own memory (nothing copied at submit): a change made
    after submit but before the launch is what runs, as with a numpy array."""
    from tests.test_serve import gated_engine, wait_for

    x = rows(4)
    with gated_engine(instances=1) as e:
        first = e.submit(rows(4, seed=1))  # holds the only instance
        second = e.submit(DLPackHost(x))
        x[:] = 2.0
        wait_for(lambda: e.backend.complete() == 1)
        assert first.result(5).tobytes() == f(rows(4, seed=1)).tobytes()
        wait_for(lambda: e.backend.complete() == 1)
        assert second.result(5).tobytes() == f(np.full_like(x, 2.0)).tobytes()

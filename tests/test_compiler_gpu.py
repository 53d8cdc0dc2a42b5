"""GPU tests of orchestra.compiler: load, launch and check the repository kernels against numpy.

Run on the lent GPU machine: ``python -m pytest -q -m gpu tests/test_compiler_gpu.py``.
Skipped with a reason when no CUDA device is present (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import orchestra.compiler as oc
from orchestra.compiler import KernelNotFoundError, PtxVersionError, load_kernel
from tests.helpers import TINY_PTX

pytestmark = pytest.mark.gpu

TEMPLATE_SRC = r"""
template <typename T> __global__ void scale(T* p, T a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= a;
}
"""


@pytest.fixture
def stream(dev):
    from orchestra.driver import Stream

    s = Stream(dev)
    yield s
    s.synchronize()
    s.close()


def upload(arr: np.ndarray, stream):
    from orchestra.driver import DeviceBuffer, PinnedBuffer

    arr = np.ascontiguousarray(arr)
    buf = DeviceBuffer.allocate(arr.nbytes, stream)
    host = PinnedBuffer.empty(arr.shape, arr.dtype)
    host.array[...] = arr
    buf.copy_from_host(host, stream, sync=True)
    host.close()
    return buf


def empty(n: int, stream, dtype=np.float32, fill: int = 0):
    from orchestra.driver import DeviceBuffer

    buf = DeviceBuffer.allocate(max(n, 1) * np.dtype(dtype).itemsize, stream)
    buf.memset(fill, stream)
    return buf


def download(buf, n: int, stream, dtype=np.float32) -> np.ndarray:
    from orchestra.driver import PinnedBuffer

    host = PinnedBuffer.empty(buf.nbytes // np.dtype(dtype).itemsize, dtype)
    buf.copy_to_host(host, stream, sync=True)
    out = host.array[:n].copy()
    host.close()
    return out


def grid_for(n: int, dev, block: int = 256, per_thread: int = 1) -> int:
    need = -(-max(n, 1) // (block * per_thread))
    return max(1, min(need, 4 * dev.sm_count))


@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 3])
def test_saxpy_matches_numpy(dev, stream, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    a = np.float32(2.5)
    k = load_kernel("saxpy.cu", "saxpy", device=dev)
    assert [p.name for p in k.params] == ["a", "x", "y", "out", "n"]
    xd, yd, od = upload(x, stream), upload(y, stream), empty(n, stream)
    k.launch(stream, grid_for(n, dev), 256, [a, xd, yd, od, n])
    out = download(od, n, stream)
    ref = float(a) * x.astype(np.float64) + y.astype(np.float64)
    # one fused rounding (or two without contraction): |err| <= 2**-23 * (|a x| + |y|)
    bound = 2.0 ** -23 * (np.abs(float(a) * x.astype(np.float64)) + np.abs(y)) + 1e-30
    assert np.all(np.abs(out - ref) <= bound)


def test_vector_add_is_exact(dev, stream):
    n = 123457
    rng = np.random.default_rng(1)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    k = load_kernel("vector_add.cu", "vector_add", device=dev)
    ad, bd, cd = upload(a, stream), upload(b, stream), empty(n, stream)
    k.launch(stream, grid_for(n, dev), (256, 1, 1), [ad, bd, cd, n])
    np.testing.assert_array_equal(download(cd, n, stream), a + b)


def _burn_ref(x: np.ndarray, iters: int) -> np.ndarray:
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1000, (1 << 20) + 7])
def test_burn_bit_exact(dev, stream, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 100).astype(np.float32)
    iters = 17
    k = load_kernel("burn.cu", "burn", device=dev)
    xd, yd = upload(x, stream), empty(n, stream)
    k.launch(stream, grid_for(n, dev, per_thread=4), 256, [xd, yd, n, iters, 0.5, 1.0])
    out = download(yd, n, stream)
    ref = _burn_ref(x, iters)
    assert out.tobytes() == ref.tobytes()


def test_burn_unaligned_pointers_take_the_scalar_path(dev, stream):
    n = 1003
    x = np.arange(n + 1, dtype=np.float32) - 500.25
    k = load_kernel("burn.cu", "burn", device=dev)
    xd, yd = upload(x, stream), empty(n + 1, stream)
    k.launch(stream, 8, 128, [xd.ptr + 4, yd.ptr + 4, n, 9, 0.5, 1.0])
    out = download(yd, n + 1, stream)[1:]
    assert out.tobytes() == _burn_ref(x[1:], 9).tobytes()


def test_launch_limits_are_checked_before_launch(dev, stream):
    n = 256
    k = load_kernel("vector_add.cu", "vector_add", device=dev)
    a = upload(np.ones(n, np.float32), stream)
    c = empty(n, stream)
    args = [a, a, c, n]
    with pytest.raises(ValueError, match="max threads per block"):
        k.launch(stream, 1, 2048, args)
    with pytest.raises(ValueError, match="max block dims"):
        k.launch(stream, 1, (1, 1, 128), args)
    ymax = dev.limits.max_grid_dim[1]
    with pytest.raises(ValueError, match="max grid dims"):
        k.launch(stream, (1, ymax + 1), 32, args)
    optin = dev.limits.max_shared_memory_per_block_optin
    with pytest.raises(ValueError, match="opt-in limit"):
        k.launch(stream, 1, 32, args, shared_mem=optin + 1)
    with pytest.raises(ValueError, match="legacy default stream"):
        k.launch(None, 1, 32, args)
    # nothing ran: the output is still all zeros
    assert not download(c, n, stream).any()


def test_dynamic_shared_memory_above_48k_is_opted_in(dev, stream):
    n = 1000
    k = load_kernel("vector_add.cu", "vector_add", device=dev)
    a = upload(np.full(n, 2, np.float32), stream)
    c = empty(n, stream)
    smem = 100 * 1024
    assert smem <= dev.limits.max_shared_memory_per_block_optin
    k.launch(stream, 4, 256, [a, a, c, n], shared_mem=smem)
    assert (download(c, n, stream) == 4).all()
    from cuda.bindings import driver

    from orchestra.driver import cu

    got = cu(driver.cuFuncGetAttribute,
             driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
             k.function)
    assert got >= smem


def test_unknown_kernel_name_lists_names(dev):
    res = oc.compile("saxpy.cu", arch=dev.arch)
    mod = oc.Module.load(res, dev)
    with pytest.raises(KernelNotFoundError) as info:
        mod.kernel("sxapy")
    assert "saxpy" in str(info.value) and info.value.available == ("saxpy",)
    with pytest.raises(KeyError):
        mod.kernel("nothing")
    assert mod.kernel_names() == ["saxpy"]
    mod.close()
    mod.close()  # idempotent


def test_packed_args_reuse_and_set(dev, stream):
    n = 4096
    x = np.arange(n, dtype=np.float32)
    y = np.ones(n, np.float32)
    k = load_kernel("saxpy.cu", "saxpy", device=dev)
    xd, yd, od = upload(x, stream), upload(y, stream), empty(n, stream)
    packed = k.pack([2.0, xd, yd, od, n])
    k.launch(stream, 16, 256, packed)
    np.testing.assert_allclose(download(od, n, stream), 2 * x + 1, rtol=1e-6)
    packed.set("a", 3.0)
    k.launch(stream, 16, 256, packed)
    np.testing.assert_allclose(download(od, n, stream), 3 * x + 1, rtol=1e-6)
    packed.set("n", 10)  # only the first 10 change now
    packed.set("a", -1.0)
    k.launch(stream, 16, 256, packed)
    out = download(od, n, stream)
    np.testing.assert_allclose(out[:10], -x[:10] + 1, rtol=1e-6)
    np.testing.assert_allclose(out[10:], 3 * x[10:] + 1, rtol=1e-6)


def test_argument_errors_before_launch(dev, stream):
    k = load_kernel("saxpy.cu", "saxpy", device=dev)
    od = empty(4, stream)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        k.launch(stream, 1, 32, [1.0, od, od, od])
    with pytest.raises(TypeError, match="needs device memory"):
        k.launch(stream, 1, 32, [1.0, np.zeros(4, np.float32), od, od, 4])
    with pytest.raises(ValueError, match="does not fit in uint64"):
        k.launch(stream, 1, 32, [1.0, od, od, od, -1])


def test_out_of_range_arguments_are_refused_and_nan_reaches_the_kernel(dev, stream):
    """A float parameter given an int beyond any double, or a size_t given 2**64, is a
    KernelArgumentValueError naming it and its range (never an OverflowError), and nothing is
    launched: the output keeps its fill. NaN and inf are floats the kernel receives as is."""
    from orchestra.errors import KernelArgumentValueError

    n = 256
    k = load_kernel("saxpy.cu", "saxpy", device=dev)
    xd, yd = upload(np.arange(n, dtype=np.float32), stream), upload(np.ones(n, np.float32), stream)
    od = empty(n, stream, fill=0x3F)  # 0x3F3F3F3F bytes: 0.7473 as float32
    fill = download(od, n, stream)
    with pytest.raises(KernelArgumentValueError, match=r"parameter a \(float\): the int "
                                                       r"1\.000e\+400 .*does not fit in float32"):
        k.launch(stream, 1, 256, [10 ** 400, xd, yd, od, n])
    with pytest.raises(KernelArgumentValueError, match=r"parameter n \(size_t\): "
                                                       r"18446744073709551616 does not fit in "
                                                       r"uint64: pass an int from 0 to"):
        k.launch(stream, 1, 256, [1.0, xd, yd, od, 2 ** 64])
    stream.synchronize()
    np.testing.assert_array_equal(download(od, n, stream), fill)  # nothing ran
    k.launch(stream, 1, 256, [float("nan"), xd, yd, od, n])
    assert np.isnan(download(od, n, stream)).all()
    k.launch(stream, 1, 256, [float("inf"), xd, yd, od, n])
    out = download(od, n, stream)
    assert np.isnan(out[0]) and (out[1:] == np.inf).all()  # inf * 0 is NaN, inf * x > 0 is inf
    for b in (xd, yd, od):
        b.free(stream)


def test_declared_params_are_verified_against_the_image(dev):
    res = oc.compile("saxpy.cu", arch=dev.arch)
    mod = oc.Module.load(res, dev)
    with pytest.raises(ValueError, match="parameters in the image"):
        mod.kernel("saxpy", params=("float*", "int"))
    with pytest.raises(ValueError, match="offset"):
        mod.kernel("saxpy", params=("double", "const float*", "const float*", "float*", "int"))


def test_load_kernel_is_memoized(dev):
    a = load_kernel("saxpy.cu", "saxpy", device=dev)
    b = load_kernel("saxpy.cu", "saxpy", device=dev.ordinal)
    assert a is b
    assert a.attributes.num_regs > 0 and a.attributes.max_threads_per_block >= 256
    assert a.occupancy(256) >= 1


def test_template_kernel_by_name_expression(dev, stream):
    n = 1000
    k = load_kernel(TEMPLATE_SRC, "scale", name_expression="scale<float>",
                    params=("float* p", "float a", "int n"), device=dev)
    assert k.lowered_name.startswith("_Z")
    p = upload(np.arange(n, dtype=np.float32), stream)
    k.launch(stream, 4, 256, {"p": p, "a": 0.5, "n": n})
    np.testing.assert_array_equal(download(p, n, stream), np.arange(n, dtype=np.float32) * 0.5)
    with pytest.raises(TypeError, match="params="):
        load_kernel(TEMPLATE_SRC, "scale", name_expression="scale<double>", device=dev).pack([])


def test_launch_with_attributes(dev, stream):
    n = 4096
    k = load_kernel("vector_add.cu", "vector_add", device=dev)
    a = upload(np.full(n, 1.5, np.float32), stream)
    c = empty(n, stream)
    least = dev.limits.least_stream_priority
    k.launch(stream, 16, 256, [a, a, c, n], priority=least)
    k.launch(stream, 16, 256, [a, a, c, n], pdl=True)
    k.launch(stream, 16, 256, [a, a, c, n], cluster=(2, 1, 1))
    k.launch(stream, 8, 256, [a, a, c, n], cooperative=True)
    assert (download(c, n, stream) == 3.0).all()
    blocks = k.occupancy(256) * dev.sm_count
    with pytest.raises(ValueError, match="co-resident"):
        k.launch(stream, blocks + 1, 256, [a, a, c, n], cooperative=True)
    with pytest.raises(ValueError, match="does not divide"):
        k.launch(stream, 15, 256, [a, a, c, n], cluster=2)


def test_ptx_module_load_checks_driver_version(dev, stream):
    from orchestra.kernel.module import driver_version

    res = oc.compile("vector_add.cu", arch=dev.arch, ptx=True)
    need = oc.required_cuda_for_ptx(oc.ptx_isa_version(res.cubin))
    have = driver_version()
    if (have // 1000, have % 1000 // 10) < need:
        with pytest.raises(PtxVersionError) as info:
            oc.Module.load(res, dev)
        assert str(have) in str(info.value)
        return
    mod = oc.Module.load(res, dev, source=(oc.kernel_source_dir() / "vector_add.cu").read_text())
    k = mod.kernel("vector_add")
    n = 100
    a = upload(np.ones(n, np.float32), stream)
    c = empty(n, stream)
    k.launch(stream, 1, 128, [a, a, c, n])
    assert (download(c, n, stream) == 2).all()


def test_linked_ptx_runs(dev, stream):
    ptx = TINY_PTX
    if dev.arch != "sm_90":
        ptx = ptx.replace("sm_90", dev.arch)
    k = load_kernel(ptx, "add_one", params=("float* p",), device=dev)
    p = upload(np.array([41.0], np.float32), stream)
    k.launch(stream, 1, 1, [p])
    assert download(p, 1, stream)[0] == 42.0

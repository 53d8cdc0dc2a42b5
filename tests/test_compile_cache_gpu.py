"""GPU: a header in an include directory given through ``options=`` / ``KernelRef(options=...)``
is edited between two loads; the second load compiles again and the kernel computes the new
value (case C18 on the device).

Run on the GPU machine: ``python -m pytest -q -m gpu tests/test_compile_cache_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

N = 64
SRC = ('#include "value.h"\n'
       'extern "C" __global__ void put_value(int* p) {\n'
       '    int i = threadIdx.x;\n'
       '    p[i] = VALUE + i;\n'
       '}\n')


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src" / "put_value.cu"
    src.parent.mkdir()
    src.write_text(SRC)
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "value.h").write_text("#pragma once\n#define VALUE 7\n")
    return src, inc


def _run_load_kernel(kernel, dev) -> np.ndarray:
    from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream

    stream = Stream(dev)
    buf = DeviceBuffer.allocate(4 * N, stream)
    host = PinnedBuffer.empty(N, np.int32, dev)
    try:
        buf.memset(0, stream)
        kernel.launch(stream, 1, N, [buf])
        buf.copy_to_host(host, stream, sync=True)
        return host.array.copy()
    finally:
        stream.synchronize()
        buf.close()
        host.close()
        stream.close()


def test_load_kernel_with_an_options_include_dir_runs_the_edited_header(dev, tree):
    from orchestra.compiler import load_kernel

    src, inc = tree
    opts = ("-I", str(inc))
    k1 = load_kernel(src, "put_value", options=opts, device=dev)
    np.testing.assert_array_equal(_run_load_kernel(k1, dev), 7 + np.arange(N, dtype=np.int32))
    assert load_kernel(src, "put_value", options=opts, device=dev) is k1  # unchanged: memo
    (inc / "value.h").write_text("#pragma once\n#define VALUE 1000\n")
    k2 = load_kernel(src, "put_value", options=opts, device=dev)
    assert k2 is not k1
    np.testing.assert_array_equal(_run_load_kernel(k2, dev), 1000 + np.arange(N, dtype=np.int32))
    # the first module stays loaded and keeps computing what it was compiled from
    np.testing.assert_array_equal(_run_load_kernel(k1, dev), 7 + np.arange(N, dtype=np.int32))


def _graph(ref):
    from orchestra.graph import (Alloc, Buffer, DeviceToHost, Free, HostBuffer, KernelNode, Out,
                                 TaskGraph)

    d, h = Buffer("d", 4 * N), HostBuffer("h", 4 * N)
    g = TaskGraph()
    g.add(Alloc("alloc", d))
    g.add(KernelNode("put", ref, 1, N, (Out(d),)))
    g.add(DeviceToHost("down", d, h))
    g.add(Free("free", d))
    return g


def test_kernel_ref_options_include_dir_edit_reaches_a_new_executor(dev, tree):
    from orchestra.driver import PinnedBuffer
    from orchestra.execute import EagerExecutor
    from orchestra.graph import KernelRef

    src, inc = tree
    ref = KernelRef(str(src), "put_value", params=("int* p",), options=(f"-I{inc}",))
    g = _graph(ref)
    out = PinnedBuffer.empty(N, np.int32, dev)
    try:
        with EagerExecutor(dev) as ex:
            ex.run(g, bindings={"h": out.array})
            np.testing.assert_array_equal(out.array, 7 + np.arange(N, dtype=np.int32))
        (inc / "value.h").write_text("#pragma once\n#define VALUE -5\n")
        out.array[:] = 0
        with EagerExecutor(dev) as ex:
            ex.run(g, bindings={"h": out.array})
            np.testing.assert_array_equal(out.array, -5 + np.arange(N, dtype=np.int32))
    finally:
        out.close()

"""Bad input without a GPU: the rows of docs/errors.md that no other CPU test covers yet.

Most rows already have their test (docs/errors.md names it). These add what was missing: the
executor refusing before it creates a stream or makes a driver call when the kernel does not
compile (a real NVRTC run) or its header is missing, when the graph has a cycle, when a kernel
scalar has the wrong numpy dtype or a launch exceeds the device's grid / shared memory limits,
when a kernel name is unknown, and when a host array holds Python objects. The last test keeps
the table honest: every test it names exists.

The executor runs on the fake driver of tests/fake_cuda.py (the validation code is the real one).
"""

import re
from pathlib import Path

import numpy as np
import pytest

from orchestra.compiler import KernelNotFoundError
from orchestra.compiler import compile as nvrtc_compile
from orchestra.errors import CompileError, GraphError
from orchestra.execute import BindingError, EagerExecutor, KernelResolver
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import (
    Buffer, In, KernelNode, KernelRef, Memset, Out, TaskGraph, build_pipeline,
)
from tests.fake_cuda import FakeCuda, FakeKernel

ROOT = Path(__file__).resolve().parent.parent
K = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)


@pytest.fixture
def fake(monkeypatch):
    return FakeCuda(monkeypatch)


def compiling_executor(fake):
    """An executor whose kernels really go through NVRTC (for sm_90), then run on the fake."""
    def loader(ref, device):
        nvrtc_compile(ref.source, arch="sm_90", options=ref.options)
        return FakeKernel()
    return EagerExecutor(kernel_resolver=KernelResolver(fake.device, loader))


def one_kernel_graph(ref, args=None, *, grid=1, block=256, shared_mem=0):
    x, y = Buffer("x", 4096), Buffer("y", 4096)
    g = TaskGraph()
    g.add(Memset("zero_x", x, 0))  # x and y are external: bound below
    args = (In(x), Out(y), 1024, 3, 0.5, 1.0) if args is None else args
    g.add(KernelNode("k", ref, grid, block, args, shared_mem=shared_mem))
    return g


class Ext:
    """An external device buffer look-alike (int .ptr, .nbytes)."""

    def __init__(self, nbytes):
        self.ptr, self.nbytes = 0x10000, nbytes


def assert_nothing_happened(fake, ex):
    assert fake.driver_calls() == [] and fake.used == 0
    assert ex.streams == () and ex.event_count == 0  # refused before any stream or event


def test_compile_error_through_the_executor_creates_nothing(fake, tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void burn(const float* x, float* y, unsigned long n,\n'
                   '                                int iters, float s, float t) {\n'
                   '    y[0] = undefined_thing;\n'
                   '}\n')
    ex = compiling_executor(fake)
    with pytest.raises(CompileError) as info:
        ex.run(one_kernel_graph(KernelRef(str(src), "burn", params=BURN_PARAMS)),
               bindings={"x": Ext(4096), "y": Ext(4096)})
    assert f"{src}(3)" in str(info.value) and "undefined_thing" in str(info.value)
    assert any("kernel node k" in n for n in info.value.__notes__)
    assert_nothing_happened(fake, ex)


def test_missing_header_through_the_executor_creates_nothing(fake, tmp_path):
    src = tmp_path / "k.cu"
    src.write_text('#include "not_there.cuh"\n'
                   'extern "C" __global__ void burn(const float* x, float* y, unsigned long n,\n'
                   '                                int iters, float s, float t) {}\n')
    ex = compiling_executor(fake)
    with pytest.raises(CompileError, match=r'"not_there.cuh".*cannot open source file') as info:
        ex.run(one_kernel_graph(KernelRef(str(src), "burn", params=BURN_PARAMS)),
               bindings={"x": Ext(4096), "y": Ext(4096)})
    assert "include directories tried" in str(info.value)
    assert_nothing_happened(fake, ex)


def test_cycle_through_the_executor_creates_nothing(fake):
    g = TaskGraph()
    b = Buffer("b", 64)
    g.add(Memset("first", b, 0, after=("second",)))
    g.add(Memset("second", b, 1))  # writes b after `first`: an inferred edge first -> second
    ex = EagerExecutor(kernel_resolver=KernelResolver(fake.device, lambda r, d: FakeKernel()))
    with pytest.raises(GraphError) as info:
        ex.run(g, bindings={"b": Ext(64)})
    assert str(info.value) == (
        "cycle: first -> second -> first (first -> second: WAW b, second -> first: after=); no "
        "order can run these nodes: remove an after= or add the nodes in the order they must "
        "run (buffer dependencies follow insertion order)")
    assert_nothing_happened(fake, ex)


@pytest.mark.parametrize("case, exc, pattern", [
    ("float64 scalar", TypeError,
     r"kernel node k: parameter s \(float\): numpy float64 scalar does not match the declared "
     r"float32"),
    # a grid or block past CUDA's own limits is refused when the node is made
    # (test_kernel_node_refuses_a_grid_or_block_past_cuda_limits): only the device's are left
    ("shared memory", ValueError, r"kernel node k: .*opt-in limit"),
    ("missing argument", TypeError, r"kernel node k: kernel burn.*takes 6 arguments, got 5"),
    ("float for int", TypeError, r"kernel node k: parameter iters \(int\): got a float"),
])
def test_kernel_launch_refusals_through_the_executor_create_nothing(fake, case, exc, pattern):
    x, y = Buffer("x", 4096), Buffer("y", 4096)
    args, kw = (In(x), Out(y), 1024, 3, 0.5, 1.0), {}
    if case == "float64 scalar":
        args = (In(x), Out(y), 1024, 3, np.float64(0.5), 1.0)
    elif case == "shared memory":
        kw["shared_mem"] = 227 * 1024 + 1
    elif case == "missing argument":
        args = args[:5]
    else:
        args = (In(x), Out(y), 1024, 3.0, 0.5, 1.0)
    ex = EagerExecutor(kernel_resolver=KernelResolver(fake.device, lambda r, d: FakeKernel()))
    with pytest.raises(exc, match=pattern):
        ex.run(one_kernel_graph(K, args, **kw), bindings={"x": Ext(4096), "y": Ext(4096)})
    assert_nothing_happened(fake, ex)


def test_unknown_kernel_name_through_the_executor_names_the_node(fake):
    def loader(ref, device):
        raise KernelNotFoundError(ref.name, ("burn",))  # what Module.kernel raises on the GPU
    ex = EagerExecutor(kernel_resolver=KernelResolver(fake.device, loader))
    ref = KernelRef("cuda_src/burn.cu", "brun", params=BURN_PARAMS)
    with pytest.raises(KernelNotFoundError, match="no kernel named 'brun' in the module; kernels "
                                                  "present: burn") as info:
        ex.run(one_kernel_graph(ref), bindings={"x": Ext(4096), "y": Ext(4096)})
    assert isinstance(info.value, KeyError)
    assert "while resolving kernel 'brun' from cuda_src/burn.cu (kernel node k)" in \
        info.value.__notes__
    assert_nothing_happened(fake, ex)


def test_host_array_of_python_objects_is_refused(fake):
    g, _ = build_pipeline(1, 4096, K, scalars=(3, 0.5, 1.0))
    ex = EagerExecutor(kernel_resolver=KernelResolver(fake.device, lambda r, d: FakeKernel()))
    objs = np.empty(512, dtype=object)  # 4096 bytes of pointers on a 64-bit host
    with pytest.raises(BindingError, match=r"binding b0.host_in: an array of Python objects "
                                           r"\(dtype=object\) cannot be copied to the GPU"):
        ex.run(g, bindings={"b0.host_in": objs, "b0.host_out": np.zeros(1024, np.float32)})
    assert fake.driver_calls() == [] and fake.used == 0


def test_every_test_the_errors_table_names_exists():
    text = (ROOT / "docs" / "errors.md").read_text()
    named = re.findall(r"`(tests/test_\w+\.py)::(test_\w+)`", text)
    assert len(named) >= 20, "the table names a test for each row"
    for path, name in named:
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"

"""Every GPU-relevant row of docs/errors.md, through the public API on a real device (skipped
without one).

Each case feeds one bad input to `EagerExecutor.run`, `Kernel.launch`, `DeviceBuffer`,
`load_kernel` or `MainJob`, asserts the exception type and a fragment of its message, and then
that nothing was lost: the default pool's used bytes are back where they were and
`orchestra.driver.live_handles()` equals its value before the case (no stream, event, device
buffer, pinned buffer, host registration or module left behind). The burn kernel's module is
loaded once first (`load_kernel` memoizes modules per device: a cache, not a leak), so module
counts compare too.

The faulting kernel (an illegal address: a sticky error) runs in a child process, because it
leaves the context unusable for the rest of the process.
"""

import contextlib
import gc
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from orchestra.compiler import KernelNotFoundError, load_kernel
from orchestra.compiler import cache as cubin_cache
from orchestra.compiler import compile as nvrtc_compile
from orchestra.driver import (
    DeviceBuffer, PinnedBuffer, Stream, leaked, live_handles,
)
from orchestra.errors import CompileError, CudaError, GraphError, HazardError, NodeFieldValueError
from orchestra.execute import BindingError, EagerExecutor, PageableMemoryError
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.graph import (
    Alloc, Buffer, Free, HostBuffer, HostToDevice, In, KernelNode, KernelRef, Memset,
    Out, TaskGraph, build_pipeline,
)
from orchestra.app.job import MainJob, burn_kernel_ref
from orchestra.schedule import PlanBuilder

pytestmark = pytest.mark.gpu

N = 16 * 1024  # floats per batch


def burn(dev):
    """The burn kernel (`load_kernel` memoizes it per device, as the executors' resolver does)."""
    ref = burn_kernel_ref()
    return load_kernel(ref.source, ref.name, params=ref.params, device=dev)


@pytest.fixture(scope="module", autouse=True)
def burn_loaded(dev):
    return burn(dev)  # loaded before any case: its module is not counted as a case's leak


@contextlib.contextmanager
def nothing_lost(dev, pool):
    """The pool's used bytes and every live-handle count are the same after the block."""
    gc.collect()
    dev.synchronize()
    used0, live0 = pool.used_bytes, live_handles()
    yield
    gc.collect()
    dev.synchronize()
    assert pool.used_bytes == used0, f"pool used bytes {used0} -> {pool.used_bytes}"
    assert leaked(live0) == {}, f"handles left behind: {leaked(live0)}"


class Job:
    """Two burn batches over one pinned input / output pair (closed by `close`)."""

    def __init__(self, dev, batches=2, n=N):
        nbytes = 4 * n
        self.hin = HostBuffer("host_in", batches * nbytes)
        self.hout = HostBuffer("host_out", batches * nbytes)
        self.graph, _ = build_pipeline(batches, nbytes, burn_kernel_ref(), host_in=self.hin,
                                       host_out=self.hout, grid=8, block=256,
                                       scalars=(3, 0.5, 1.0))
        self.pin_in = PinnedBuffer.empty(batches * n, np.float32, dev)
        self.pin_out = PinnedBuffer.empty(batches * n, np.float32, dev)
        self.x, self.y = self.pin_in.array, self.pin_out.array
        self.x[:] = 1.0

    def bindings(self, **override):
        return {"host_in": self.x, "host_out": self.y, **override}

    def close(self):
        del self.x, self.y
        self.pin_in.close()
        self.pin_out.close()


@contextlib.contextmanager
def job_and_executor(dev, **kw):
    job = Job(dev)
    try:
        with EagerExecutor(dev, **kw) as ex:
            yield job, ex
    finally:
        job.close()


def kernel_graph(ref, args=None, *, grid=8, block=256, shared_mem=0):
    """Alloc x, y -> kernel -> free: one kernel node named k."""
    x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
    g = TaskGraph()
    g.add(Alloc("alloc_x", x))
    g.add(Alloc("alloc_y", y))
    g.add(Memset("zero_x", x, 0))
    args = (In(x), Out(y), N, 3, 0.5, 1.0) if args is None else args
    g.add(KernelNode("k", ref, grid, block, args, shared_mem=shared_mem))
    g.add(Free("free_x", x))
    g.add(Free("free_y", y))
    return g


def run_refused(dev, graph, exc, pattern, **run_kw):
    """`EagerExecutor.run` refuses ``graph`` with ``exc`` matching ``pattern``; nothing is lost
    and no stream of the executor has work pending."""
    with EagerExecutor(dev) as ex:
        with pytest.raises(exc, match=pattern) as info:
            ex.run(graph, **run_kw)
        for s in ex.streams:
            assert s.query()
    return info.value


# -- wrong dtype ------------------------------------------------------------------------------

def test_wrong_dtype_kernel_scalar(dev, pool):
    ref = burn_kernel_ref()
    x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
    with nothing_lost(dev, pool):
        run_refused(dev, kernel_graph(ref, (In(x), Out(y), N, 3, np.float64(0.5), 1.0)),
                    TypeError, r"kernel node k: parameter s \(float\): numpy float64 scalar does "
                               r"not match the declared float32")
        with Stream(dev) as s, DeviceBuffer.allocate(4 * N, s) as d:
            with pytest.raises(TypeError, match="float64 scalar does not match"):
                burn(dev).launch(s, 8, 256, [d, d, N, 3, np.float64(0.5), 1.0])
            s.synchronize()


def test_wrong_dtype_job_input_file(dev, pool, tmp_path):
    path = tmp_path / "x64.npy"
    np.save(path, np.ones(1000, np.float64))
    with nothing_lost(dev, pool):
        with pytest.raises(ValueError, match=r"the array is float64; orchestra run --input "
                                             r"streams float32"):
            MainJob(input=path, device=dev, compute_iters=3, repeat=1).run()


# -- wrong size, non-contiguous, pageable ------------------------------------------------------

def test_wrong_size(dev, pool):
    with nothing_lost(dev, pool):
        with job_and_executor(dev) as (job, ex):
            short = job.pin_out.array[:-1]  # pinned, one float short
            with pytest.raises(BindingError, match=r"binding host_out: the array has \d+ bytes "
                                                   r".* but host buffer host_out has \d+ bytes"):
                ex.run(job.graph, bindings=job.bindings(host_out=short))
            del short
            ex.run(job.graph, bindings=job.bindings())  # the executor still works
        with Stream(dev) as s, DeviceBuffer.allocate(4096, s) as d, PinnedBuffer(100, dev) as h:
            with pytest.raises(ValueError, match="the host side has 100 bytes, the device "
                                                 "buffer 4096"):
                d.copy_from_host(h, s)
            s.synchronize()


def test_non_contiguous_array(dev, pool):
    with nothing_lost(dev, pool):
        with job_and_executor(dev) as (job, ex):
            with PinnedBuffer.empty(4 * N * 2, np.float32, dev) as big:
                strided = big.array[::2][: job.x.size]  # pinned, the right size, strided
                with pytest.raises(BindingError, match="not C-contiguous"):
                    ex.run(job.graph, bindings=job.bindings(host_in=strided))
                with Stream(dev) as s, DeviceBuffer.allocate(strided.nbytes, s) as d:
                    with pytest.raises(ValueError, match="not contiguous"):
                        d.copy_from_host(strided, s)
                    s.synchronize()
                del strided


def test_pageable_host_memory(dev, pool):
    with nothing_lost(dev, pool):
        with job_and_executor(dev) as (job, ex):
            pageable = np.zeros_like(job.y)
            with pytest.raises(PageableMemoryError, match="pageable memory.*PinnedBuffer.empty"
                                                          r".*register_host\(array\)"):
                ex.run(job.graph, bindings=job.bindings(host_out=pageable))
            assert not pageable.any()
        with Stream(dev) as s, DeviceBuffer.allocate(4096, s) as d:
            with pytest.raises(TypeError, match="pageable memory"):
                d.copy_to_host(np.zeros(1024, np.float32), s)
            s.synchronize()


# -- launch limits ------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["block", "grid", "shared memory"])
def test_launch_limits(dev, pool, what):
    lim = dev.limits
    kw = {"block": {"block": 2 * lim.max_threads_per_block},
          "grid": {"grid": (1, lim.max_grid_dim[1] + 1)},
          "shared memory": {"shared_mem": lim.max_shared_memory_per_block_optin + 1}}[what]
    pattern = {"block": "above the device's max threads per block",
               "grid": "exceeds the device's max grid dims",
               "shared memory": "opt-in limit"}[what]
    with nothing_lost(dev, pool):
        if what == "shared memory":  # the device's own limit: refused when the run resolves it
            run_refused(dev, kernel_graph(burn_kernel_ref(), **kw), ValueError,
                        rf"kernel node k: launch of burn: .*{pattern}")
        else:  # past CUDA's limits on every GPU: refused when the node is made
            with pytest.raises(NodeFieldValueError,
                               match=rf"KernelNode k: {what} [xy] = \d+ is above CUDA's limit"):
                kernel_graph(burn_kernel_ref(), **kw)
        with Stream(dev) as s, DeviceBuffer.allocate(4 * N, s) as d:
            args = [d, d, N, 3, 0.5, 1.0]
            with pytest.raises(ValueError, match=pattern):
                burn(dev).launch(s, kw.get("grid", 8), kw.get("block", 256), args,
                                        shared_mem=kw.get("shared_mem", 0))
            s.synchronize()


def test_main_job_block_over_the_limit(dev, pool):
    with nothing_lost(dev, pool):
        with pytest.raises(ValueError, match="launch of burn: block .* above the device's max "
                                             "threads per block"):
            MainJob(batches=2, batch_mib=1, compute_iters=3, repeat=1, device=dev,
                    block=2 * dev.limits.max_threads_per_block).run()


# -- kernels: unknown name, arguments, compile errors, headers, the cache ----------------------

def test_unknown_kernel_name(dev, pool):
    ref = burn_kernel_ref()
    with nothing_lost(dev, pool):
        err = run_refused(dev, kernel_graph(KernelRef(ref.source, "brun", params=BURN_PARAMS)),
                          KernelNotFoundError, "no kernel named 'brun' in the module; kernels "
                                               "present: burn")
        assert isinstance(err, KeyError)
        assert any("(kernel node k)" in n for n in err.__notes__)
        with pytest.raises(KernelNotFoundError, match="kernels present: burn"):
            load_kernel(ref.source, "brun", params=BURN_PARAMS, device=dev)


@pytest.mark.parametrize("case", ["count", "type", "buffer for scalar"])
def test_wrong_argument_count_or_type(dev, pool, case):
    x, y = Buffer("x", 4 * N), Buffer("y", 4 * N)
    args, exc, pattern = {
        "count": ((In(x), Out(y), N, 3, 0.5), TypeError, "takes 6 arguments, got 5"),
        "type": ((In(x), Out(y), N, 3.0, 0.5, 1.0), TypeError,
                 r"parameter iters \(int\): got a float"),
        "buffer for scalar": ((In(x), Out(y), In(x), 3, 0.5, 1.0), TypeError,
                              "argument 2 is buffer x but parameter n is a scalar"),
    }[case]
    with nothing_lost(dev, pool):
        run_refused(dev, kernel_graph(burn_kernel_ref(), args), exc, rf"kernel node k: .*{pattern}")
        with Stream(dev) as s, DeviceBuffer.allocate(4 * N, s) as d:
            with pytest.raises(TypeError, match="takes 6 arguments, got 5"):
                burn(dev).launch(s, 8, 256, [d, d, N, 3, 0.5])
            s.synchronize()


def test_nvrtc_compile_error(dev, pool, tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void burn(const float* x, float* y, unsigned long n,\n'
                   '                                int iters, float s, float t) {\n'
                   '    y[0] = undefined_thing;\n'
                   '}\n')
    with nothing_lost(dev, pool):
        err = run_refused(dev, kernel_graph(KernelRef(str(src), "burn", params=BURN_PARAMS)),
                          CompileError, r'broken.cu\(3\): error: identifier "undefined_thing" '
                                        r'is undefined')
        assert "include directories tried" in str(err) and err.call == "nvrtcCompileProgram"


def test_missing_header(dev, pool, tmp_path):
    src = tmp_path / "k.cu"
    src.write_text('#include "not_there.cuh"\n'
                   'extern "C" __global__ void burn(const float* x, float* y, unsigned long n,\n'
                   '                                int iters, float s, float t) {}\n')
    with nothing_lost(dev, pool):
        run_refused(dev, kernel_graph(KernelRef(str(src), "burn", params=BURN_PARAMS)),
                    CompileError, r'missing header "not_there.cuh" \(cannot open source file\)')


def test_corrupted_cache_entry_is_recompiled_and_runs(dev, pool):
    # a source no other test compiles, so neither the cache nor the module memo has it
    source = (f"// {uuid.uuid4()}\n"
              'extern "C" __global__ void twice(float* p, int n) {\n'
              "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
              "    if (i < n) p[i] *= 2.0f;\n"
              "}\n")
    first = nvrtc_compile(source, arch=dev.arch)
    entry = cubin_cache.entry_path("nvrtc", first.key)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    with nothing_lost(dev, pool):
        k = load_kernel(source, "twice", device=dev)  # no exception: discarded and recompiled
        with Stream(dev) as s, DeviceBuffer.allocate(4096, s) as d, \
                PinnedBuffer.empty(1024, np.float32, dev) as h:
            h.array[:] = np.arange(1024, dtype=np.float32)
            d.copy_from_host(h, s)
            k.launch(s, 4, 256, [d, 1024])
            d.copy_to_host(h, s, sync=True)
            assert (h.array == 2 * np.arange(1024, dtype=np.float32)).all()
        assert k.module._image == first.cubin  # the same cubin as before the damage
        k.module.close()  # the memoized module: closed here so the counts compare
    assert cubin_cache.decode_entry(entry.read_bytes()) is not None  # rewritten whole


# -- graphs and plans -------------------------------------------------------------------------

def test_graph_with_a_cycle(dev, pool):
    g = TaskGraph()
    b = Buffer("b", 4096)
    g.add(Alloc("a", b, after=("f",)))
    g.add(Memset("m", b, 0))
    g.add(Free("f", b))
    with nothing_lost(dev, pool):
        run_refused(dev, g, GraphError, r"cycle: .*; no order can run these nodes")


def test_hazardous_hand_written_plan(dev, pool):
    with nothing_lost(dev, pool):
        with job_and_executor(dev) as (job, ex):
            names = [n.name for n in job.graph.nodes if n.batch == 0]
            assert names == ["b0.alloc_in", "b0.alloc_out", "b0.h2d", "b0.kernel", "b0.d2h",
                             "b0.free_in", "b0.free_out"]
            # batch 0's kernel on its own stream with no event after the upload; batch 1 fine
            plan = (PlanBuilder().stream("up").run("b0.alloc_in", "b0.alloc_out", "b0.h2d")
                    .stream("k").run("b0.kernel")
                    .stream("up").run("b0.d2h", "b0.free_in", "b0.free_out",
                                      *[n.name for n in job.graph.nodes if n.batch == 1])
                    .build())
            job.y[:] = -1.0
            with pytest.raises(HazardError, match=r"RAW on buffer b0.in .* no event orders "
                                                  r"b0.h2d before b0.kernel"):
                ex.run(job.graph, plan, job.bindings())
            assert (job.y == -1.0).all() and ex.streams == ()  # nothing enqueued or created


# -- device memory ------------------------------------------------------------------------------

def test_out_of_memory(dev, pool):
    with nothing_lost(dev, pool):
        with Stream(dev) as s:
            with pytest.raises(CudaError) as info:
                DeviceBuffer.allocate(1 << 50, s)
            assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY" and not info.value.sticky
            assert str(info.value).startswith("cuMemAllocFromPoolAsync: CUDA_ERROR_OUT_OF_MEMORY")
            s.synchronize()
        # part-way through a run: batches 0 and 1 allocate, batch 2 cannot
        g = TaskGraph()
        h = HostBuffer("h", 1 << 20)
        for b in range(3):
            d = Buffer(f"d{b}", (1 << 20) if b != 2 else 1 << 50)
            g.add(Alloc(f"b{b}.alloc", d, batch=b))
            if b != 2:
                g.add(HostToDevice(f"b{b}.up", h, d, batch=b))
            g.add(Free(f"b{b}.free", d, batch=b))
        with PinnedBuffer(1 << 20, dev) as pin, EagerExecutor(dev) as ex:
            with pytest.raises(CudaError) as info:
                ex.run(g, bindings={"h": pin.view()}, policy="round-robin", streams=1)
            err = info.value
            assert err.call == "cuMemAllocFromPoolAsync"
            assert err.name == "CUDA_ERROR_OUT_OF_MEMORY" and not err.sticky
            assert "[node b2.alloc (alloc) on stream s0]" in str(err)
            ok = TaskGraph()  # the executor still runs
            for node in g.nodes:
                if node.batch != 2:
                    ok.add(node)
            ex.run(ok, bindings={"h": pin.view()}, policy="round-robin", streams=1)


# -- a kernel that faults: sticky, in a child process --------------------------------------------

FAULT_CHILD = textwrap.dedent('''
    import sys
    from orchestra.errors import CudaError
    from orchestra.execute import EagerExecutor
    from orchestra.graph import KernelNode, KernelRef, TaskGraph

    SOURCE = """
    extern "C" __global__ void fault(unsigned long long address) {
        *reinterpret_cast<volatile int*>(address) = 1;   // no memory is mapped there
    }
    """
    g = TaskGraph()
    g.add(KernelNode("poke", KernelRef(SOURCE, "fault", params=("unsigned long long address",)),
                     1, 1, (16,)))
    ex = EagerExecutor()
    try:
        ex.run(g, policy="round-robin", streams=1)
    except CudaError as err:
        print("FAILED", type(err).__name__, err.call, err.name, "sticky" if err.sticky else "-")
        print("MESSAGE", err)
        try:  # the context is unusable: the next call fails too
            from orchestra.driver import Stream
            s = Stream()
            s.synchronize()
            print("AFTER ok")
        except CudaError as again:
            print("AFTER", again.name, "sticky" if again.sticky else "-")
        sys.stdout.flush()
        sys.exit(3)
    print("NO ERROR")
''')


def test_faulting_kernel_is_sticky_and_says_restart():
    proc = subprocess.run([sys.executable, "-c", FAULT_CHILD], capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout
    assert proc.returncode != 0, out + proc.stderr
    assert proc.returncode == 3, out + proc.stderr  # exited through our handler, not a crash
    failed = next(line for line in out.splitlines() if line.startswith("FAILED"))
    _, kind, call, name, sticky = failed.split()
    assert kind == "CudaError" and sticky == "sticky"
    assert name in ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED"), out
    message = next(line for line in out.splitlines() if line.startswith("MESSAGE"))
    assert name in message
    assert "this is a sticky error: the CUDA context is unusable and the process must be " \
           "restarted" in message
    after = next(line for line in out.splitlines() if line.startswith("AFTER"))
    assert after != "AFTER ok" and after.endswith("sticky"), out

"""Interop on a real GPU with torch and CuPy (each test is skipped when its framework is absent):
framework arrays into `Kernel.launch`, orchestra memory out to the frameworks, and the
stream-ordered hand-off of case C15 in both directions.

Every ordering test first runs the same work *unordered* (a raw address, or a protocol
description without a stream) and asserts that it sees the unfinished data: a producer's long
kernel (a ``clock64`` spin, then a fill) is still running when the consumer reads, so a wrong
order shows as wrong data. Then it runs ordered through the protocol and asserts the finished
values, bit for bit.

Each test body runs in a fresh interpreter (a crash in the DLPack ABI or a sticky CUDA error
fails that test, not the suite); it prints ``PASS ...`` lines and exits 0, or prints ``FAIL ...``
and exits 1. Each takes a few seconds (framework import, one NVRTC compile, spins of ~0.2 s).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = textwrap.dedent(r'''
    import gc
    import sys

    import numpy as np

    from orchestra.compiler import load_kernel
    from orchestra.driver import (Device, DeviceBuffer, MemoryPool, PinnedBuffer, Stream,
                                  device_view, order_after, order_before)
    from orchestra.errors import DriverArgumentValueError

    SOURCE = r"""
    extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = a * x[i] + b;
    }
    extern "C" __global__ void copy(const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i];
    }
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }
    extern "C" __global__ void fill(float* x, float value, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] = value;
    }
    """
    N = 1 << 22
    GRID, BLOCK = N // 256, 256
    CYCLES = 400_000_000  # ~0.2 s at 2 GHz: a producer still running when the consumer reads

    dev = Device.get(0)
    dev.make_current()
    K = {name: load_kernel(SOURCE, name, device=dev) for name in ("axpb", "copy", "spin", "fill")}
    ours = Stream(dev)
    # First launches load the kernels (lazy loading) before any timing-sensitive work.
    K["axpb"].launch(ours, 1, 32, [0, 0, 1.0, 0.0, 0])
    K["copy"].launch(ours, 1, 32, [0, 0, 0])
    K["spin"].launch(ours, 1, 1, [0])
    K["fill"].launch(ours, 1, 32, [0, 0.0, 0])
    ours.synchronize()
    out = DeviceBuffer.allocate(N * 4, ours)
    host = PinnedBuffer.empty(N, np.float32)

    def check(cond, what):
        print(("PASS " if cond else "FAIL ") + what, flush=True)
        if not cond:
            sys.exit(1)

    def read_out():
        out.copy_to_host(host.array, ours, sync=True)
        return host.array

    def reset_out():
        out.memset(0xFF, ours)  # NaN everywhere: a copy that never ran shows too
        ours.synchronize()

    class CAI:
        """Only the CUDA Array Interface of something (keeps it alive)."""
        def __init__(self, desc, owner=None):
            self.desc, self.owner = desc, owner
        @property
        def __cuda_array_interface__(self):
            return self.desc
''')


def _run(body: str, framework: str) -> str:
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "FAIL" not in proc.stdout and "PASS" in proc.stdout, out
    return proc.stdout


def test_torch_tensor_into_kernel_launch_on_torchs_stream():
    _run(r'''
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.arange(N, device="cuda", dtype=torch.float32)
        y = torch.full((N,), -1.0, device="cuda")
        K["axpb"].launch(torch.cuda.current_stream(), GRID, BLOCK, [x, y, 2.0, 1.0, N])
        ref = x * 2.0 + 1.0
        check(torch.equal(y, ref), "torch reads the kernel's output on its stream, bit-exact")
    with device_view(x, stream=s) as v:
        check(v.ptr == x.data_ptr() and v.protocol == "dlpack" and v.dtype == np.float32,
              "the tensor's own memory, through DLPack: no copy")
    # the legacy default stream (torch's current stream outside a stream block) takes no work
    try:
        K["axpb"].launch(torch.cuda.current_stream(), GRID, BLOCK, [x, y, 2.0, 1.0, N])
        check(False, "a launch on the legacy default stream is refused")
    except DriverArgumentValueError as err:
        check("legacy default stream" in str(err) and "order_after" in str(err),
              "a launch on the legacy default stream is refused, saying to order instead")
    # orchestra's stream handed to torch through __cuda_stream__
    theirs = torch.cuda.ExternalStream(ours.__cuda_stream__()[1])
    with torch.cuda.stream(theirs):
        z = torch.zeros(N, device="cuda")
        K["axpb"].launch(ours, GRID, BLOCK, [x, z, 3.0, 1.0, N])  # 3x + 1 < 2**24: exact
        check(torch.equal(z, x * 3.0 + 1.0), "torch on orchestra's stream sees its result")
    # a pinned torch CPU tensor is host memory orchestra copies from and to, without a copy
    from orchestra.driver import host_view
    pinned = torch.arange(N, dtype=torch.float32).pin_memory()
    a = host_view(pinned)
    check(a.ctypes.data == pinned.data_ptr() and a.dtype == np.float32 and a.shape == (N,),
          "host_view shares the pinned tensor's memory")
    out.copy_from_host(a, ours, sync=True)
    back = torch.empty(N, dtype=torch.float32).pin_memory()
    out.copy_to_host(host_view(back), ours, sync=True)
    check(torch.equal(back, pinned), "a pinned tensor round-trips through a DeviceBuffer")
    # a strided tensor is refused with the fix in the message
    try:
        K["axpb"].launch(s, GRID // 2, BLOCK, [x[::2], y, 2.0, 1.0, N // 2])
        check(False, "a strided tensor is refused")
    except ValueError as err:
        check(".contiguous()" in str(err), "a strided tensor is refused: " + str(err)[:80])
    torch.cuda.synchronize()
    ''', "torch")


def test_cupy_array_into_kernel_launch_on_cupys_stream():
    _run(r'''
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.arange(N, dtype=cp.float32)
        y = cp.full(N, -1.0, dtype=cp.float32)
        K["axpb"].launch(s, GRID, BLOCK, [x, y, 2.0, 1.0, N])  # DLPack (CuPy has both)
        check(bool((y == x * 2 + 1).all()), "CuPy reads the kernel's output on its stream")
        z = cp.full(N, -1.0, dtype=cp.float32)
        desc = x.__cuda_array_interface__
        check(desc["version"] >= 3 and desc.get("stream") == s.ptr,
              f"CuPy's interface names its stream: {desc.get('stream')} == {s.ptr}")
        K["axpb"].launch(s, GRID, BLOCK, [CAI(desc, x), CAI(z.__cuda_array_interface__, z),
                                          2.0, 1.0, N])  # the CUDA Array Interface path
        check(bool((z == x * 2 + 1).all()), "the same through the CUDA Array Interface")
        check(bool(cp.array_equal(y, z)), "both paths agree bit for bit")
    v = device_view(CAI(x.__cuda_array_interface__, x), stream=ours)
    check(v.ptr == x.data.ptr and v.device == 0, "the array's own memory: no copy")
    s.synchronize()
    ''', "cupy")


def test_c15_torch_producer_still_running_when_orchestra_consumes():
    _run(r'''
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    x = torch.zeros(N, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")

    def long_producer(value):
        # a long kernel on torch's current stream (the legacy default stream), then the write
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(CYCLES)
        else:
            for _ in range(40):
                busy.copy_(busy @ busy / 4096.0)
        x.fill_(value)

    torch.cuda.synchronize()
    # unordered: a raw address, nothing waits for torch's stream
    reset_out()
    long_producer(1.0)
    K["copy"].launch(ours, GRID, BLOCK, [x.data_ptr(), out, N])
    check(bool((read_out() == 0.0).all()),
          "unordered, orchestra reads the tensor before the producer finished (the check can fail)")
    torch.cuda.synchronize()

    # ordered through DLPack: torch makes orchestra's stream wait for its current stream
    x.zero_()
    torch.cuda.synchronize()
    reset_out()
    long_producer(1.0)
    K["copy"].launch(ours, GRID, BLOCK, [x, out, N])
    check(bool((read_out() == 1.0).all()), "through DLPack orchestra reads the finished tensor")
    torch.cuda.synchronize()

    # ordered by hand: order_after before orchestra's work, order_before to hand results back
    x.zero_()
    # torch's first allocation of a result size is a cudaMalloc, which synchronizes the whole
    # device and would hide the race the unordered check looks for: have the caching
    # allocator hold those blocks first
    torch.isnan(x).all(), (x == 2.0).all()
    torch.cuda.synchronize()
    reset_out()
    long_producer(2.0)
    order_after(ours, torch.cuda.current_stream())
    K["spin"].launch(ours, 1, 1, [CYCLES])  # orchestra's own long work on the result
    K["copy"].launch(ours, GRID, BLOCK, [x.data_ptr(), out, N])
    unordered_view = torch.from_dlpack(out.view(np.float32, (N,)).__dlpack__(stream=-1))
    check(bool(torch.isnan(unordered_view).all()),
          "without order_before torch reads orchestra's output too early (the check can fail)")
    torch.cuda.synchronize()
    reset_out()
    x.zero_()
    torch.cuda.synchronize()
    long_producer(2.0)
    order_after(ours, torch.cuda.current_stream())
    K["spin"].launch(ours, 1, 1, [CYCLES])
    K["copy"].launch(ours, GRID, BLOCK, [x.data_ptr(), out, N])
    order_before(ours, torch.cuda.current_stream())
    y = torch.from_dlpack(out.view(np.float32, (N,)).__dlpack__(stream=-1))
    check(bool((y == 2.0).all()), "order_after / order_before hand the tensor over and back")
    del unordered_view, y
    torch.cuda.synchronize()

    # a producer on a non-default torch stream
    s = torch.cuda.Stream()
    reset_out()
    with torch.cuda.stream(s):
        x.zero_()
        torch.cuda._sleep(CYCLES) if hasattr(torch.cuda, "_sleep") else None
        x.fill_(3.0)
        K["copy"].launch(ours, GRID, BLOCK, [x, out, N])
    check(bool((read_out() == 3.0).all()), "a producer on torch.cuda.Stream() is waited for")
    torch.cuda.synchronize()
    ''', "torch")


def test_c15_cupy_producer_ordered_through_the_interface_stream():
    _run(r'''
    import cupy as cp

    P = cp.cuda.Stream(non_blocking=True)
    with P:
        x = cp.zeros(N, dtype=cp.float32)
        x.fill(0)  # compiled now, outside the timed window
    P.synchronize()

    def long_producer(value):
        # the producer's long kernel and its write, on CuPy's stream P
        K["spin"].launch(P, 1, 1, [CYCLES])
        K["fill"].launch(P, GRID, BLOCK, [x.data.ptr, value, N])
        with P:
            return x.__cuda_array_interface__  # CuPy names P as the stream to wait for

    reset_out()
    desc = long_producer(5.0)
    check(desc.get("stream") == P.ptr, "CuPy's interface names the producer's stream")
    no_stream = {k: v for k, v in desc.items() if k != "stream"}
    no_stream["version"] = 2  # v2: the protocol says the producer synchronized (it did not)
    K["copy"].launch(ours, GRID, BLOCK, [CAI(no_stream, x), out, N])
    check(bool((read_out() == 0.0).all()),
          "without the stream orchestra reads too early (the check can fail)")
    P.synchronize()
    with P:
        x.fill(0)
    P.synchronize()
    reset_out()
    desc = long_producer(5.0)
    K["copy"].launch(ours, GRID, BLOCK, [CAI(desc, x), out, N])
    check(bool((read_out() == 5.0).all()),
          "an event on the interface's stream orders orchestra after the producer")
    view = device_view(CAI(desc, x), stream=ours)
    check(view.ordering.startswith("event:"), view.ordering)
    P.synchronize()
    ''', "cupy")


def test_device_buffer_read_by_torch_while_orchestras_stream_writes():
    _run(r'''
    import torch

    torch.zeros(1, device="cuda")
    # torch's first allocation of a result size is a cudaMalloc, which synchronizes the whole
    # device and would hide the race the unordered check looks for: have the caching
    # allocator hold those blocks first
    warm = torch.zeros(N, device="cuda")
    (warm == 0.0).all(), (warm == 7.0).all()
    del warm
    torch.cuda.synchronize()
    pool = MemoryPool.default(dev)
    buf = DeviceBuffer.allocate(N * 4, ours)

    def long_write(value):
        buf.memset(0, ours)
        ours.synchronize()
        K["spin"].launch(ours, 1, 1, [CYCLES])
        K["fill"].launch(ours, GRID, BLOCK, [buf, value, N])

    long_write(7.0)
    early = torch.from_dlpack(buf.view(np.float32, (N,)).__dlpack__(stream=-1))
    check(bool((early == 0.0).all()), "unordered, torch reads before orchestra wrote (the check "
          "can fail)")
    ours.synchronize()
    del early
    long_write(7.0)
    t = torch.from_dlpack(buf.view(np.float32, (N,)))  # torch passes its current stream
    check(t.data_ptr() == buf.ptr and t.dtype == torch.float32 and t.shape == (N,),
          "torch sees orchestra's memory without a copy, typed")
    check(bool((t == 7.0).all()), "torch's stream waited for orchestra's write")
    whole = torch.from_dlpack(buf)
    check(whole.dtype == torch.uint8 and whole.numel() == N * 4, "a DeviceBuffer is bytes")
    del whole
    # the memory outlives a close while torch holds it
    used = pool.used_bytes
    buf.close()
    check(pool.used_bytes == used, "closing the buffer while torch holds it frees nothing")
    check(bool((t == 7.0).all()), "torch still reads the closed buffer's memory")
    del t
    gc.collect()
    torch.cuda.synchronize()
    check(pool.used_bytes == used - N * 4, "torch letting go frees the memory")
    ''', "torch")


def test_device_buffer_read_by_cupy_while_orchestras_stream_writes():
    _run(r'''
    import cupy as cp

    buf = DeviceBuffer.allocate(N * 4, ours)
    warm = cp.zeros(16, dtype=cp.float32)  # CuPy compiles its kernels on first use: not
    bool((warm == 0).all())                # inside the timed window below
    cp.cuda.Device().synchronize()

    def long_write(value):
        buf.memset(0, ours)
        ours.synchronize()
        K["spin"].launch(ours, 1, 1, [CYCLES])
        K["fill"].launch(ours, GRID, BLOCK, [buf, value, N])

    long_write(7.0)
    view = buf.view(np.float32, (N,))
    desc = {k: v for k, v in view.__cuda_array_interface__.items() if k != "stream"}
    desc["version"] = 2
    early = cp.asarray(CAI(desc, view))
    check(bool((early == 0).all()), "unordered, CuPy reads before orchestra wrote (the check can "
          "fail)")
    ours.synchronize()
    del early
    long_write(7.0)
    a = cp.asarray(buf.view(np.float32, (N,)))  # the interface names orchestra's stream
    check(a.data.ptr == buf.ptr, "CuPy sees orchestra's memory without a copy")
    check(bool((a == 7).all()), "CuPy synchronized with orchestra's stream")
    long_write(9.0)
    b = cp.from_dlpack(buf.view(np.float32, (N,)))  # DLPack: CuPy passes its stream
    check(b.data.ptr == buf.ptr and bool((b == 9).all()),
          "through DLPack CuPy's stream waited for orchestra's write")
    del a, b
    gc.collect()
    cp.cuda.Device().synchronize()
    ''', "cupy")

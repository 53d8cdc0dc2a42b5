"""Lifetimes on a real GPU (skipped without one): a resource closed while leased stays usable
through the lease's handle, nothing else is handed its memory, and the driver release runs when
the last lease ends, after which ``live_handles()`` and the pool's used bytes are back at their
baseline (docs/errors.md, "Lifetimes").

Each case runs in a child process (``sys.executable -c``), so a crash (a use of freed memory
can segfault or poison the context) is a failed test, not a hung or poisoned suite. The child
prints OK as its last line after every check passed.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = '''
import gc
import weakref

import numpy as np
from cuda.bindings import driver

from orchestra.compiler import load_kernel
from orchestra.driver import (
    Device, DeviceBuffer, MemoryPool, PinnedBuffer, ResourceClosedError, Stream, cu,
    deferred_releases, is_pinned, leaked, live_handles, pinned_ranges, register_host,
)
from orchestra.driver.host import _host_locked


def burn_ref(x, iters):
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


def expect_closed(fn, fragment):
    try:
        fn()
    except ResourceClosedError as exc:
        assert fragment in str(exc), str(exc)
    else:
        raise AssertionError("no ResourceClosedError: " + fragment)


def disjoint(a, b, nbytes):
    return a + nbytes <= b or b + nbytes <= a


dev = Device.get(0)
dev.make_current()
pool = MemoryPool.default(dev)
kernel = load_kernel("burn.cu", "burn", device=dev)
s = Stream(dev)
N = 1 << 16
NB = 4 * N
GRID = min(-(-N // 1024), 4 * dev.sm_count)
rng = np.random.default_rng(0)
s.synchronize()
gc.collect()
base_live = live_handles()
base_deferred = deferred_releases()
base_used = pool.used_bytes


def at_baseline(kinds=None):
    s.synchronize()
    gc.collect()
    now = live_handles()
    if kinds is not None:
        now = {k: now[k] for k in kinds}
        base = {k: base_live[k] for k in kinds}
    else:
        base = base_live
    assert now == base, leaked(base, now)
    assert deferred_releases() == base_deferred, deferred_releases()
    assert pool.used_bytes == base_used, (pool.used_bytes, base_used)
'''


def run_child(body: str, timeout: int = 120) -> str:
    code = PRELUDE + textwrap.dedent(body) + "\nprint('OK')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr[-4000:]
    print(out)
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{out}"
    assert proc.stdout.strip().endswith("OK"), out
    return proc.stdout


def test_device_buffer_closed_while_leased_is_used_by_a_kernel_through_the_lease():
    run_child('''
    x = DeviceBuffer.allocate(NB, s)
    y = DeviceBuffer.allocate(NB, s)
    hin = PinnedBuffer.empty(N, np.float32, dev)
    hout = PinnedBuffer.empty(N, np.float32, dev)
    hin.array[:] = rng.standard_normal(N).astype(np.float32)
    x.copy_from_host(hin, s)
    lx, ly = x.lease(), y.lease()
    xp, yp = int(lx.handle), int(ly.handle)
    x.close()
    y.free(s)
    assert x.closed and y.closed
    expect_closed(lambda: x.ptr, "this DeviceBuffer is closed")
    expect_closed(x.lease, "cannot be leased")
    assert live_handles()["device_buffer"] == base_live["device_buffer"] + 2
    assert deferred_releases()["device_buffer"] == base_deferred["device_buffer"] + 2
    assert pool.used_bytes >= base_used + 2 * NB  # still allocated
    # a new allocation cannot be given the leased memory
    decoy = DeviceBuffer.allocate(NB, s)
    decoy.memset(0xFF, s)
    assert disjoint(decoy.ptr, xp, NB) and disjoint(decoy.ptr, yp, NB)
    kernel.launch(s, GRID, 256, [lx.handle, ly.handle, N, 3, 0.5, 1.0])
    cu(driver.cuMemcpyDtoHAsync, hout.ptr, ly.handle, NB, s.handle)
    s.synchronize()
    assert hout.array.tobytes() == burn_ref(hin.array, 3).tobytes(), "wrong kernel output"
    decoy.copy_to_host(hout, s, sync=True)
    assert (hout.view(np.uint8) == 0xFF).all(), "the kernel wrote into another allocation"
    decoy.close()
    lx.release()
    assert live_handles()["device_buffer"] == base_live["device_buffer"] + 1
    ly.release()
    ly.release()  # idempotent
    hin.close()
    hout.close()
    at_baseline()
    ''')


def test_pinned_buffer_closed_while_leased_is_copied_from_through_the_lease():
    run_child('''
    src = PinnedBuffer.empty(N, np.float32, dev)
    data = rng.standard_normal(N).astype(np.float32)
    src.array[:] = data
    view = src.array
    lo = view.ctypes.data
    lease = pinned_ranges().lease(lo, lo + NB)  # what an executor binding the view takes
    assert lease is not None and lease.handle == src.ptr
    src.close()
    expect_closed(lambda: src.ptr, "this PinnedBuffer is closed")
    expect_closed(lambda: src.array, "this PinnedBuffer is closed")
    expect_closed(lambda: pinned_ranges().lease(lo, lo + NB),
                  "belongs to a PinnedBuffer that is closed")
    assert not is_pinned(view)  # not for new work
    assert _host_locked(lo) and _host_locked(lo + NB - 1)  # but still page-locked
    assert live_handles()["pinned_buffer"] == base_live["pinned_buffer"] + 1
    d = DeviceBuffer.allocate(NB, s)
    out = PinnedBuffer.empty(N, np.float32, dev)
    cu(driver.cuMemcpyHtoDAsync, d.handle, lease.handle, NB, s.handle)
    d.copy_to_host(out, s, sync=True)
    assert out.array.tobytes() == data.tobytes(), "wrong copy from the closed, leased buffer"
    del view
    lease.release()
    assert pinned_ranges().lease(lo, lo + NB) is None  # the range goes with the memory
    d.close()
    out.close()
    at_baseline()
    ''')


def test_host_registration_closed_while_leased_is_copied_through_the_lease():
    run_child('''
    a = rng.standard_normal(N).astype(np.float32)  # pageable until registered
    expected = a.copy()
    reg = register_host(a)
    lo = a.ctypes.data
    lease = reg.lease()
    reg.close()
    expect_closed(lambda: reg.ptr, "this HostRegistration is closed")
    assert not is_pinned(a)
    assert _host_locked(lo), "unregistered while leased"
    ref = weakref.ref(a)
    del reg, a
    gc.collect()
    assert ref() is not None, "the registered array was let go while leased"
    d = DeviceBuffer.allocate(NB, s)
    y = DeviceBuffer.allocate(NB, s)
    cu(driver.cuMemcpyHtoDAsync, d.handle, lease.handle, NB, s.handle)
    kernel.launch(s, GRID, 256, [d, y, N, 2, 0.5, 1.0])
    cu(driver.cuMemcpyDtoHAsync, lease.handle, y.handle, NB, s.handle)  # back into the array
    s.synchronize()
    arr = ref()
    assert arr.tobytes() == burn_ref(expected, 2).tobytes(), "wrong round trip"
    assert live_handles()["host_registration"] == base_live["host_registration"] + 1
    lease.release()
    assert not _host_locked(lo), "cuMemHostUnregister did not run at the lease's end"
    del arr  # the registration let go of it: the last reference
    gc.collect()
    assert ref() is None
    d.close()
    y.close()
    at_baseline()
    ''')


def test_c19_graph_exec_replays_right_after_its_external_buffer_was_closed_under_a_lease():
    """A built graph's external device buffers are closed by their owner and the graph is
    replayed: the leases (the executor's part of the rule) keep the memory alive, the replays
    are right, no other allocation is touched, and everything returns to its baseline once the
    exec is closed and the leases end. Capture and explicit build."""
    run_child('''
    from orchestra.execute import CaptureExecutor, GraphBuildExecutor
    from orchestra.graph import (
        Buffer, DeviceToHost, HostBuffer, HostToDevice, In, KernelNode, Out, TaskGraph,
    )
    from orchestra.app.job import burn_kernel_ref

    g = TaskGraph()
    x, y = Buffer("x", NB), Buffer("y", NB)
    hin, hout = HostBuffer("hin", NB), HostBuffer("hout", NB)
    g.add(HostToDevice("up", hin, x))
    g.add(KernelNode("k", burn_kernel_ref(), GRID, 256, (In(x), Out(y), N, 3, 0.5, 1.0)))
    g.add(DeviceToHost("down", y, hout))
    memory = ("device_buffer", "pinned_buffer", "host_registration")
    for cls in (CaptureExecutor, GraphBuildExecutor):
        with cls(dev) as ex:
            xb = DeviceBuffer.allocate(NB, s)
            yb = DeviceBuffer.allocate(NB, s)
            pin_in = PinnedBuffer.empty(N, np.float32, dev)
            pin_out = PinnedBuffer.empty(N, np.float32, dev)
            check = PinnedBuffer.empty(N, np.float32, dev)
            pin_in.array[:] = rng.standard_normal(N).astype(np.float32)
            s.synchronize()
            exe = ex.build(g, None, {"x": xb, "y": yb, "hin": pin_in.array,
                                     "hout": pin_out.array})
            keep = [xb.lease(), yb.lease()]
            xp, yp = int(keep[0].handle), int(keep[1].handle)
            xb.close()
            yb.close()
            del xb, yb
            decoy = DeviceBuffer.allocate(NB, s)
            decoy.memset(0xFF, s)
            s.synchronize()
            assert disjoint(decoy.ptr, xp, NB) and disjoint(decoy.ptr, yp, NB), "memory reused"
            for i in range(3):
                pin_in.array[:] = rng.standard_normal(N).astype(np.float32)
                pin_out.array[:] = np.nan
                exe.launch(sync=True)
                assert pin_out.array.tobytes() == burn_ref(pin_in.array, 3).tobytes(), \\
                    f"{cls.__name__}: replay {i} after the close is wrong"
            decoy.copy_to_host(check, s, sync=True)
            assert (check.view(np.uint8) == 0xFF).all(), "a replay wrote another allocation"
            assert live_handles()["device_buffer"] == base_live["device_buffer"] + 3
            exe.close()
            for lease in keep:
                lease.release()
            decoy.close()
            for p in (pin_in, pin_out, check):
                p.close()
            at_baseline(memory)
            print(cls.__name__, "replays right after the close; memory back at baseline")
    at_baseline(memory + ("stream", "event"))
    ''', timeout=180)

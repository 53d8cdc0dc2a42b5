"""Rebinding replays and repeated kernel launches on a real GPU (skipped without one).

Each body runs in a child process (a wrong address in a copy kernel would be a sticky CUDA
error that spoils every later test):

- the one-request job graph (alloc -> H2D -> burn -> D2H -> free, 64 KiB), capture and
  graph-build, its copies as copy kernels (the default below the crossover) and on the copy
  engines: 4 pinned input/output sets bound round robin over 200 replays, half of them waited
  for one by one and half queued four at a time, the burn iterations changed every group:
  every output bit-identical to numpy;
- a graph with external device buffers re-pointed round robin (3 buffers for each side) along
  with its host arrays: every output right, no exec update needed;
- `Kernel.launch` repeated with the very `PackedArgs` (rewritten in place between launches: a
  new output pointer and iteration count each time) and with the very tuple of ints: every
  launch's own output right.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _COMMON + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


_COMMON = r"""
import numpy as np
from orchestra.driver import Device, DeviceBuffer, PinnedBuffer, Stream

dev = Device.get(0)
dev.make_current()
N = 16384  # 64 KiB of float32


def ref(x, iters):
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


def same(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


keep = []


def pinned():
    p = PinnedBuffer.empty(N, np.float32, dev)
    keep.append(p)
    return p.array  # one view per buffer, bound again and again (a pool's slots)
"""

_ROUND_ROBIN = r"""
from orchestra.app.job import build_job_graph
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.execute.cuda_graph.capture import CaptureExecutor

rng = np.random.default_rng(3)
SETS = 4
xs = [pinned() for _ in range(SETS)]
ys = [pinned() for _ in range(SETS)]
for x in xs:
    x[:] = rng.standard_normal(N).astype(np.float32)
jg = build_job_graph([4 * N], iters=1, sm_count=dev.sm_count, in_flight=None)
kname = jg.batches[0].kernel.name
checked = 0
for kind, cls in (("capture", CaptureExecutor), ("graph-build", GraphBuildExecutor)):
    for lowering in ("auto", "copy-engine"):
        with cls(dev) as ex:
            exe = ex.build(jg.graph, None, {"host_in": xs[0], "host_out": ys[0]},
                           copy_lowering=lowering)
            want_kernels = 2 if lowering == "auto" and dev.kernel_host_access else 0
            assert exe.copy_kernels == want_kernels, (kind, lowering, exe.copy_kernels)
            for group in range(50):
                iters = 1 + group % 3
                order = [(group + j) % SETS for j in range(SETS)]
                queued = group % 2 == 1
                for j, i in enumerate(order):
                    ys[i][:] = np.nan
                    scalars = {kname: {"iters": iters}} if j == 0 else None
                    exe.replay({"host_in": xs[i], "host_out": ys[i]}, scalars,
                               sync=not queued)
                    if not queued:
                        assert same(ys[i], ref(xs[i], iters)), (kind, lowering, group, i)
                        checked += 1
                if queued:
                    exe.synchronize()
                    for i in order:
                        assert same(ys[i], ref(xs[i], iters)), (kind, lowering, group, i)
                        checked += 1
            assert exe.repoint_updates == 0 and exe.launches == 200
            exe.close()
for p in keep:
    p.close()
print("OK", checked)
"""


def test_round_robin_host_rebinding_keeps_outputs_bit_exact_in_a_child():
    proc = _child(_ROUND_ROBIN, timeout=300)
    assert proc.returncode == 0 and "OK 800" in proc.stdout, proc.stdout + proc.stderr


_EXTERNAL = r"""
from orchestra.app.job.graphs import burn_kernel_ref
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.execute.cuda_graph.capture import CaptureExecutor
from orchestra.graph import Buffer, DeviceToHost, HostBuffer, HostToDevice, In, KernelNode
from orchestra.graph import Out, TaskGraph

NB = 4 * N
g = TaskGraph()
x, y = Buffer("x", NB), Buffer("y", NB)
g.add(HostToDevice("up", HostBuffer("hin", NB), x))
g.add(KernelNode("k", burn_kernel_ref(), 16, 256, (In(x), Out(y), N, 2, 0.5, 1.0)))
g.add(DeviceToHost("down", y, HostBuffer("hout", NB)))
s = Stream(dev)
dxs = [DeviceBuffer.allocate(NB, s) for _ in range(3)]
dys = [DeviceBuffer.allocate(NB, s) for _ in range(3)]
s.synchronize()
rng = np.random.default_rng(5)
hins = [pinned() for _ in range(2)]
houts = [pinned() for _ in range(2)]
for h in hins:
    h[:] = rng.standard_normal(N).astype(np.float32)
checked = 0
for kind, cls in (("capture", CaptureExecutor), ("graph-build", GraphBuildExecutor)):
    with cls(dev) as ex:
        exe = ex.build(g, None, {"x": dxs[0], "y": dys[0], "hin": hins[0], "hout": houts[0]})
        for r in range(60):
            i, j = r % 3, (r // 3) % 2
            houts[j][:] = np.nan
            exe.replay({"x": dxs[i], "y": dys[(i + r) % 3], "hin": hins[j], "hout": houts[j]})
            assert same(houts[j], ref(hins[j], 2)), (kind, r)
            checked += 1
        assert exe.repoint_updates == 0, exe.last_update
        exe.close()
for b in dxs + dys:
    b.free(s)
s.synchronize()
s.close()
for p in keep:
    p.close()
print("OK", checked)
"""


def test_external_buffers_repointed_round_robin_in_a_child():
    proc = _child(_EXTERNAL)
    assert proc.returncode == 0 and "OK 120" in proc.stdout, proc.stdout + proc.stderr


_LAUNCH = r"""
from orchestra.app.job.graphs import burn_kernel_ref
from orchestra.execute import KernelResolver

k = KernelResolver(dev).resolve(burn_kernel_ref())
s = Stream(dev)
NB = 4 * N
x = DeviceBuffer.allocate(NB, s)
outs = [DeviceBuffer.allocate(NB, s) for _ in range(4)]
hx = pinned()
hx[:] = np.random.default_rng(9).standard_normal(N).astype(np.float32)
x.copy_from_host(hx, s, sync=True)
packed = k.pack([x, outs[0], N, 1, 0.5, 1.0])
for i in range(4):  # the very PackedArgs every time, two fields rewritten in between
    packed.set("y", outs[i])
    packed.set("iters", i + 1)
    k.launch(s, 16, 256, packed)
args = (x.ptr, outs[0].ptr, N, 5, 0.5, 1.0)  # the very tuple: packed once
for _ in range(3):
    k.launch(s, 16, 256, args)
k.launch(s, 16, 256, (x.ptr, outs[1].ptr, N, 6, 0.5, 1.0))  # another tuple: packed anew
s.synchronize()
got = pinned()
wants = [ref(hx, 5), ref(hx, 6), ref(hx, 3), ref(hx, 4)]
for out, want in zip(outs, wants):
    out.copy_to_host(got, s, sync=True)
    assert same(got, want)
x.free(s)
for o in outs:
    o.free(s)
s.synchronize()
s.close()
for p in keep:
    p.close()
print("OK launches")
"""


def test_repeated_kernel_launches_pass_rewritten_and_new_arguments_in_a_child():
    proc = _child(_LAUNCH)
    assert proc.returncode == 0 and "OK launches" in proc.stdout, proc.stdout + proc.stderr

"""Three-way overlap through the Python API: upload, compute and download at once.

16 batches of 16 MiB: alloc -> H2D -> burn -> D2H -> free, placed by engine on three streams
(uploads, kernels, downloads) joined by events, run by the eager executor, checked with numpy.
Needs an NVIDIA GPU:  python examples/three_way_overlap.py
"""

import sys

import numpy as np

from orchestra.driver import Device, PinnedBuffer
from orchestra.execute import EagerExecutor
from orchestra.graph import HostBuffer, build_pipeline
from orchestra.app.job import burn_grid, burn_kernel_ref
from orchestra.app.job.data import burn_reference
from orchestra.errors import NoDeviceError
from orchestra.schedule import schedule

BATCHES, BATCH_MIB, ITERS = 16, 16, 500
try:
    dev = Device.get(0)
except NoDeviceError as exc:  # one line, not a traceback
    print(f"three_way_overlap: {exc}", file=sys.stderr)
    sys.exit(2)
n = BATCH_MIB * 2**20 // 4  # float32 elements per batch
x = PinnedBuffer.empty(BATCHES * n, np.float32, dev)  # one pinned array for all batches
y = PinnedBuffer.empty(BATCHES * n, np.float32, dev)
x.array[:] = np.random.default_rng(0).random(BATCHES * n, dtype=np.float32)

host_in, host_out = HostBuffer("in", 4 * BATCHES * n), HostBuffer("out", 4 * BATCHES * n)
graph, batches = build_pipeline(BATCHES, 4 * n, burn_kernel_ref(), host_in=host_in,
                                host_out=host_out, grid=burn_grid(n, 256, dev.sm_count),
                                block=256, scalars=(ITERS, 0.5, 1.0))  # burn(x, y, n, iters, s, t)
plan = schedule(graph, "by-engine", streams=3)
print(f"{len(graph)} nodes on {len(plan.streams)} streams, {plan.event_count} events")

with EagerExecutor(dev) as ex:
    ex.run(graph, plan, {"in": x.array, "out": y.array})  # first run: compile + prepare
    result = ex.run(graph, plan, {"in": x.array, "out": y.array})
print(f"wall {result.wall_ms:.2f} ms, {2 * 4 * BATCHES * n / result.wall_ms / 1e6:.1f} GB/s "
      f"moved, host {result.host_us_per_node:.2f} us per node")

for b in (0, BATCHES - 1):  # spot-check two batches against numpy (bit-exact)
    lo = b * n
    assert np.array_equal(y.array[lo:lo + n], burn_reference(x.array[lo:lo + n], ITERS)), b
print("outputs match numpy")
x.close()
y.close()

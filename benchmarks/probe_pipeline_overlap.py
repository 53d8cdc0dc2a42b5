"""Pipeline overlap probe (GPU): where a pipeline of equal stages loses against its bound.

    python benchmarks/probe_pipeline_overlap.py [--iters 2500] [--items 96] [--mib 4]

Per-item GPU times (``--items`` back to back, behind a gate kernel, median of 7; see
`orchestra.app.job.sustained`) of the main job's burn kernel on ``--mib`` MiB and of H2D / D2H
copies of that size: the kernels alone on one and two streams, each behind an event wait,
the copies alone and both directions at once, the kernels beside independent H2D + D2H pairs
(no dependencies: the least a pipeline of those items can take), and a by-engine pipeline
written by hand (H2D -> kernel -> D2H per item, events where streams meet) with one and two
compute streams. When the kernel takes as long as the copies (``orchestra run``'s default
calibration) the "beside" row is the limit: kernels run slower while both copy directions
stream, so no schedule reaches the bound made of each kind's time alone.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

try:
    import orchestra  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from orchestra.app.job.graphs import burn_grid, burn_kernel_ref, burn_scalars
from orchestra.app.job.sustained import GatedTimer
from orchestra.driver import Device, DeviceBuffer, Event, PinnedBuffer, Stream
from orchestra.kernel import load_kernel

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--iters", type=int, default=2500, help="burn iterations per element")
ap.add_argument("--items", type=int, default=96, help="items per measurement")
ap.add_argument("--mib", type=float, default=4.0, help="MiB per item")
ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
args = ap.parse_args()
from orchestra.app.job.checks import MAX_ITERS  # noqa: E402

# an item is at least 16 bytes (sizes are rounded down to 16): --mib 1e-9 was 0 bytes, --mib
# inf an OverflowError, --iters above the kernel's C int wrapped
if not 1 <= args.iters <= MAX_ITERS or args.items < 2 or not 16 <= args.mib * (1 << 20) < 2**40:
    ap.error(f"--iters from 1 to {MAX_ITERS:,}, --items >= 2, --mib from 16 bytes (about "
             "1.53e-05) to under 1 TiB (1048576)")
iters, K = args.iters, args.items
from orchestra.errors import OrchestraError  # noqa: E402

_excepthook = sys.excepthook


def _orchestra_error_in_one_line(kind, exc, tb):
    """An orchestra error past this point (out of pinned or device memory for --items x
    --mib, a driver error) is the user's message, not a traceback; the exit status stays 1."""
    if isinstance(exc, OrchestraError):
        print(f"probe_pipeline_overlap: {exc}", file=sys.stderr)
    else:
        _excepthook(kind, exc, tb)


sys.excepthook = _orchestra_error_in_one_line
try:
    dev = Device.get(0)
except OrchestraError as exc:
    sys.exit(f"probe_pipeline_overlap: {exc}")
nbytes = int(args.mib * (1 << 20)) // 16 * 16
n = nbytes // 4
ref = burn_kernel_ref()
kern = load_kernel(ref.source, ref.name, params=ref.params, device=dev)
grid, block = burn_grid(n, 256, dev.sm_count), 256
print(f"burn {iters} iters, grid {grid} x {block}, {K} items of {nbytes} bytes, {dev.name}")
s = Stream(dev); u = Stream(dev); d = Stream(dev); s2 = Stream(dev)
pin_in = PinnedBuffer.empty(n * K, np.float32, dev); pin_out = PinnedBuffer.empty(n * K, np.float32, dev)
hin = [pin_in.array[i*n:(i+1)*n] for i in range(K)]; hout = [pin_out.array[i*n:(i+1)*n] for i in range(K)]
din = [DeviceBuffer.allocate(nbytes, s) for _ in range(K)]
dout = [DeviceBuffer.allocate(nbytes, s) for _ in range(K)]
s.synchronize()
packs = [kern.pack([din[i].ptr, dout[i].ptr, n, *burn_scalars(iters)]) for i in range(K)]
evs_a = [Event(dev) for _ in range(K)]; evs_b = [Event(dev) for _ in range(K)]
done = Event(dev); done.record(u); u.synchronize()
g = GatedTimer(s, repeats=7, warmup=1)
rows = []
def report(name, ms):
    """One row: ``ms`` for the K items, printed and kept as µs per item."""
    rows.append((name, ms / K * 1e3))
    print(f"{name:70s} {ms / K * 1e3:8.2f} us/item", flush=True)


def row(name, fn, others=()):
    report(name, g.median_ms(fn, list(others)))

def kernels():
    for i in range(K): kern.launch(s, grid, block, packs[i])
def kernels_wait_done():
    for i in range(K):
        s.wait(done); kern.launch(s, grid, block, packs[i])
def kernels_wait_fresh():
    for i in range(K):
        evs_a[i].record(u); s.wait(evs_a[i]); kern.launch(s, grid, block, packs[i])
def kernels_2streams():
    for i in range(K): kern.launch((s, s2)[i % 2], grid, block, packs[i])
def h2ds():
    for i in range(K): din[i].copy_from_host(hin[i], u)
def d2hs():
    for i in range(K): dout[i].copy_to_host(hout[i], d)
def pairs():
    for i in range(K): din[i].copy_from_host(hin[i], u); dout[i].copy_to_host(hout[i], d)
def kernels_beside_pairs():
    pairs(); kernels()
def pipeline(nc=1):
    cs = (s, s2)[:nc]
    def run():
        for i in range(K):
            din[i].copy_from_host(hin[i], u); evs_a[i].record(u)
            c = cs[i % nc]; c.wait(evs_a[i]); kern.launch(c, grid, block, packs[i]); evs_b[i].record(c)
            d.wait(evs_b[i]); dout[i].copy_to_host(hout[i], d)
    return run

row("kernels, 1 stream", kernels)
row("kernels, 2 streams", kernels_2streams, [s2])
row("kernels, each behind a wait on a done event", kernels_wait_done, [u])
row("kernels, each behind a wait on an event just recorded on an idle stream", kernels_wait_fresh, [u])
row("H2D alone (upload stream)", h2ds, [u])
row("D2H alone (download stream)", d2hs, [d])
row("H2D + D2H pairs at once", pairs, [u, d])
row("kernels beside independent H2D + D2H pairs (max of the three)", kernels_beside_pairs, [u, d])
# the kernels' own span while pairs run beside them
e0, e1 = Event(dev, timing=True), Event(dev, timing=True)
def kernels_span():
    pairs(); e0.record(s); kernels(); e1.record(s)
vals = []
for r in range(8):
    g.elapsed_ms(kernels_span, [u, d], 5.0)
    if r: vals.append(Event.elapsed_ms(e0, e1))
report("kernels' own span beside pairs", statistics.median(vals))
row("pipeline by hand, by-engine, 1 compute stream", pipeline(1), [u, d])
row("pipeline by hand, by-engine, 2 compute streams", pipeline(2), [u, d, s2])
if args.json:
    print(json.dumps({"iters": iters, "items": K, "grid": grid, "rows": rows}))

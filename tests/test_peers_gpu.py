"""GPU tests of this work: the sustained times behind the bound are physical and the main job
never beats its bound (by-engine, round-robin, concurrent, and lane plans over copy kernels);
a graph run's sustained items are timed as a CUDA graph, no slower than on streams, and the
run stays within that bound; the concurrent policy's plan on real occupancy gives exact outputs;
short runs of `orchestra bench peers`, benchmarks/bench_fanout.py and
benchmarks/probe_graph_launch.py (each in a child process with a timeout, every output
checked by the programs themselves)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def _run(argv, timeout=180):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"{' '.join(map(str, argv[1:]))} did not finish within {timeout} s\n{out}")


def test_sustained_times_are_physical(dev):
    from orchestra.app.job.graphs import burn_grid, burn_kernel_ref
    from orchestra.app.job.timing import BatchTimer
    from orchestra.driver import PinnedBuffer, Stream
    from orchestra.execute import KernelResolver

    n = 1 << 20  # 4 MiB
    kernel = KernelResolver(dev).resolve(burn_kernel_ref())
    with PinnedBuffer.empty(n, np.float32, dev) as pin_in, \
            PinnedBuffer.empty(n, np.float32, dev) as pin_out, Stream(dev) as s:
        pin_in.array[:] = 1.0
        timer = BatchTimer(kernel, s, pin_in.array, pin_out.array,
                           grid=burn_grid(n, 256, dev.sm_count), block=256)
        try:
            single = timer.measure(64, items=8, streams=3)
        finally:
            timer.close()
    su = single.sustained
    assert su.items == 8 and su.nbytes == 4 * n and su.streams in (1, 3)
    for t in (su.h2d_ms, su.d2h_ms, su.kernel_ms, su.pair_ms):
        assert 0.0 < t < 50.0
    # back to back, the launch latency of a copy alone is hidden: never much slower per item
    assert su.h2d_ms <= 1.25 * single.t_h2d_ms and su.d2h_ms <= 1.25 * single.t_d2h_ms
    # a pair moves twice the bytes of one copy over a link that is no faster than one way
    assert su.pair_ms >= 0.8 * max(su.h2d_ms, su.d2h_ms)
    # 4 MiB over PCIe or NVLink-C2C: between 1 and 1000 GB/s
    assert 1.0 < (4 * n) / (su.h2d_ms * 1e6) < 1000.0
    # each copy time is the faster of the copy engines and the copy kernel, and says which
    assert su.copies.startswith("H2D by copy ") and "D2H by copy " in su.copies, su.copies
    b = single.bound(8)
    assert b.bound_ms >= 8 * min(su.h2d_ms, su.pair_ms)


@pytest.mark.parametrize("policy", ["by-engine", "round-robin", "concurrent"])
def test_the_main_job_never_beats_its_bound(dev, policy):
    from orchestra.app.job import MainJob

    r = MainJob(batches=12, batch_mib=4, policy=policy, streams=5, repeat=3, device=dev).run()
    assert r.verified, r.check
    assert r.bound_warning is None, (r.efficiency, r.bound_terms, r.sustained)
    assert r.sustained["items"] == 12 and r.bound_limiter in r.bound_terms
    print(f"\n{policy}: wall {r.wall_ms:.3f} ms, bound {r.bound_ms:.3f} ms "
          f"({r.bound_limiter}), efficiency {r.efficiency:.3f}; sustained {r.sustained}")


# Was a known bug: the sustained times behind the bound were measured on streams, and a CUDA
# graph of 16 lanes launches its copy kernels faster than a stream does; on the H200, 1024 x 64
# KiB graph and capture runs reached 1.02-1.06 of that bound and 4096 x 4 KiB 1.66. The
# sustained items of a graph run are now timed as one CUDA graph, and these runs stay below it
# (H200: 0.65-0.93).


@pytest.mark.parametrize("executor,lowering", [
    ("graph", "auto"), ("graph", "kernel"), ("capture", "kernel"), ("eager", "kernel")])
def test_a_lane_plan_never_beats_its_bound(dev, executor, lowering):
    """``--policy auto`` with copy kernels: round-robin over 16 lanes, the sustained times
    measured over those 16 streams, and the run stays below its bound (efficiency <= 1.01)."""
    from orchestra.app.job import MainJob
    from orchestra.app.job.sustained import items_for

    r = MainJob(batches=256, batch_mib=0.0625, compute_iters=1, executor=executor,
                copy_lowering=lowering, repeat=3, device=dev).run()
    assert r.verified, r.check
    copies = 512
    if lowering == "kernel":
        assert r.copy_kernels == copies
    # "auto": this device's crossover decides; the eager executor keeps by-engine on 3; the
    # graph executors' by-engine runs two compute streams (a 16-block burn grid is smaller
    # than any GPU this runs on)
    lanes = 2 * r.copy_kernels >= copies and executor != "eager"
    by = ("by-engine", 3 if executor == "eager" else 4)
    assert (r.policy, r.streams) == (("round-robin", 16) if lanes else by), r.policy_reason
    assert r.sustained["streams"] == r.streams
    assert r.sustained["items"] == items_for(256, 64 << 10, streams=r.streams)  # 256, 48, 64
    assert r.sustained["launch"] == ("stream" if executor == "eager" else "graph")
    print(f"\n{executor} {lowering}: {r.policy} x{r.streams}, wall {r.wall_ms:.3f} ms, bound "
          f"{r.bound_ms:.3f} ms ({r.bound_limiter}), efficiency {r.efficiency:.3f}")
    assert r.bound_warning is None and r.efficiency <= 1.01, (r.efficiency, r.bound_terms,
                                                             r.sustained)


# -- the sustained items of a graph run, timed as a CUDA graph ----------------------------------

# The child's body: 64 KiB items (copy engines, copy kernels, burn at 1 iteration), 256 of
# them over 16 streams (a lane plan's concurrency), timed on streams and as one CUDA graph;
# prints the two `Sustained` records and the captured graphs left open (must be 0) as JSON.
_GRAPH_VS_STREAM = r"""
import json, sys
import numpy as np
from orchestra.app.job.graphs import burn_grid, burn_kernel_ref
from orchestra.app.job.timing import BatchTimer
from orchestra.driver import Device, PinnedBuffer, Stream, live_handles
from orchestra.execute import KernelResolver

dev = Device.get(0)
dev.make_current()
n = 16384  # 64 KiB of float32
kernel = KernelResolver(dev).resolve(burn_kernel_ref())
grid = burn_grid(n, 256, dev.sm_count)
kernel.launch_config(grid, 256)
out = {}
with PinnedBuffer.empty(n, np.float32, dev) as pin_in, \
        PinnedBuffer.empty(n, np.float32, dev) as pin_out, Stream(dev) as s:
    pin_in.array[:] = 1.0
    timer = BatchTimer(kernel, s, pin_in.array, pin_out.array, grid=grid, block=256)
    try:
        for launch in ("stream", "graph"):
            out[launch] = timer.sustained(256, 1, streams=16, copy_kernel=True,
                                          launch=launch).as_dict()
    finally:
        timer.close()
out["captured_graphs_open"] = live_handles().get("captured_graph", 0)
print(json.dumps(out))
"""


def test_sustained_items_timed_as_a_graph_are_no_slower_than_on_streams():
    """For 64 KiB items over 16 lanes, the per-item times measured as one CUDA graph are at
    most those measured on streams (5% noise allowed): a graph launches the copy kernels
    with less overhead per launch, which is why graph runs beat a stream-timed bound."""
    proc = _run([sys.executable, "-c", _GRAPH_VS_STREAM], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    st, gr = rep["stream"], rep["graph"]
    assert (st["launch"], gr["launch"]) == ("stream", "graph")
    assert gr["items"] == st["items"] == 256 and gr["streams"] == st["streams"] == 16
    assert rep["captured_graphs_open"] == 0
    rows = [(k, st[k], gr[k], gr[k] / st[k]) for k in (
        "h2d_ms", "d2h_ms", "pair_ms", "kernel_ms", "h2d_chain_ms", "d2h_chain_ms",
        "kernel_chain_ms")]
    print("\n64 KiB x 256 over 16 streams, per item (ms): stream / graph / ratio\n" + "\n".join(
        f"  {k:16s} {s:.5f} {g:.5f} {r:.3f}" for k, s, g, r in rows)
          + f"\n  copies: stream {st['copies']}; graph {gr['copies']}")
    for t in (st, gr):
        for k in ("h2d_ms", "d2h_ms", "pair_ms", "kernel_ms"):
            assert 0.0 < t[k] < 1.0, (k, t)
    for k in ("h2d_ms", "d2h_ms"):  # the copies' rates at the lanes' concurrency
        assert gr[k] <= 1.05 * st[k], (k, rows)


@pytest.mark.parametrize("executor,batches,mib", [
    ("graph", 1024, 0.0625), ("capture", 1024, 0.0625), ("graph", 4096, 4 / 1024)])
def test_a_graph_run_stays_within_its_graph_timed_bound(executor, batches, mib):
    """``orchestra run --executor graph|capture`` on small batches (lanes of copy kernels in a
    CUDA graph under ``--policy auto``): the sustained items are timed as a graph, and the run
    stays within the 1.01 BOUND BUG limit the run also prints (the stream-timed bound was
    beaten by up to 1.10 at 1024 x 64 KiB and 1.66 at 4096 x 4 KiB; timed as a graph, an H200
    ran these at 0.65-0.93)."""
    proc = _run([sys.executable, "-m", "orchestra.cli.main", "run", "--batches", str(batches),
                 "--batch-mib", repr(mib), "--executor", executor, "--json"], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout)
    su = r["sustained"]
    print(f"\n{executor} {batches} x {mib * 1024:g} KiB: {r['policy']} x{r['streams']}, wall "
          f"{r['wall_ms']:.3f} ms, bound {r['bound_ms']:.3f} ms ({r['bound_limiter']}), "
          f"efficiency {r['efficiency']:.3f}{' (BOUND BUG > 1.01)' if r['bound_warning'] else ''}"
          f"; sustained {su}")
    assert r["verified"] is True, r["check"]
    assert su["launch"] == "graph" and su["streams"] == r["streams"]
    assert r["efficiency"] <= 1.01 and not r["bound_warning"], (r["efficiency"],
                                                                  r["bound_terms"], su)


def test_bench_copy_lowering_small_run_picks_lanes_for_copy_kernels(tmp_path):
    out = tmp_path / "lowering.json"
    proc = _run([sys.executable, "benchmarks/bench_copy_lowering.py", "--workloads",
                 "256x4KiB@1", "--repeat", "3", "--json", str(out)], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # 1: an output was wrong
    rows = {r["contender"]: r for r in json.loads(out.read_text())["results"]["256x4KiB@1"]}
    assert all(r["ok"] for r in rows.values())
    auto, by = rows["graph auto"], rows["graph auto by-engine"]
    assert by["plan"] == "by-engine x3" and rows["bare"]["plan"] == "by-engine x3"
    # the graph rows' auto by-engine: two compute streams (a 1-block burn grid)
    want = "round-robin x16" if 2 * auto["copy_kernels"] >= 512 else "by-engine x4"
    assert auto["plan"] == want, auto
    assert rows["graph copy-engine"]["plan"] == "by-engine x4"
    assert rows["eager kernel"]["plan"] == "by-engine x3"  # eager keeps by-engine
    assert rows["eager copy-engine"]["plan"] == "by-engine x3"
    print("\n" + proc.stdout[-2000:])


def test_concurrent_policy_on_real_occupancy_spreads_small_kernels(dev):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_fanout
    finally:
        sys.path.pop(0)
    from orchestra.app.job import burn_kernel_ref
    from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream
    from orchestra.execute import EagerExecutor, KernelResolver

    width, grid, iters = 6, 2, 101
    n = grid * 256 * 4
    g = bench_fanout.build_graph(width, n, grid, iters)
    resolver = KernelResolver(dev)
    big = resolver.resolve(burn_kernel_ref()).occupancy(256) * dev.sm_count
    assert big > grid  # the kernels are small
    x = np.random.default_rng(5).random(width * n, dtype=np.float32)
    with Stream(dev) as s, EagerExecutor(dev, kernel_resolver=resolver) as ex, \
            PinnedBuffer.empty(width * n, np.float32, dev) as pin, \
            PinnedBuffer.empty(width * n, np.float32, dev) as out:
        xin = DeviceBuffer.allocate(4 * width * n, s)
        yout = DeviceBuffer.allocate(4 * width * n, s)
        try:
            pin.array[:] = x
            xin.copy_from_host(pin, s, sync=True)
            plan = ex.prepare(g, policy="concurrent", streams=width + 2)
            lanes = {plan.stream_of(f"k{i}") for i in range(width)}
            assert len(lanes) == width, plan.node_stream
            out.array[:] = np.nan
            ex.run(g, plan, {"x": xin, "y": yout, "host_out": out.array})
            assert out.array.tobytes() == (x * np.float32(-1) + np.float32(0)).tobytes()
        finally:
            s.synchronize()
            xin.close()
            yout.close()
            s.synchronize()


def test_bench_peers_small_run_verifies_every_contender():
    proc = _run([sys.executable, "-m", "orchestra.cli.main", "bench", "peers", "--workloads",
                 "8x1MiB,request,chain", "--repeat", "1", "--json"], timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["verified"] is True, [r for r in rep["rows"] if not r["verified"]]
    assert rep["bound_bugs"] == [], rep["bound_bugs"]
    assert proc.returncode == 0
    fams = {r["family"] for r in rep["rows"]}
    assert {"orchestra", "cuda-python"} <= fams
    for peer, fam in (("CuPy", "cupy"), ("PyTorch", "torch")):
        assert fam in fams or any(s.startswith(peer) for s in rep["skipped"]), rep["skipped"]
    labels = {w["label"] for w in rep["workloads"]}
    assert labels == {"8 x 1 MiB", "(d) 1 x 64 KiB request", "(e) chain of 1000 kernels"}
    for r in rep["rows"]:
        if r["family"] == "orchestra" and r["workload"] == "8 x 1 MiB":
            assert r["ratio"] >= 1.0
    print("\n" + "\n".join(rep["skipped"]))


def test_bench_fanout_small_run():
    proc = _run([sys.executable, "benchmarks/bench_fanout.py", "--width", "4", "--iters",
                 "1001", "--repeat", "2", "--json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert not rep["failures"] and len(rep["rows"]) == 6
    conc = [r for r in rep["rows"] if r["policy"] == "concurrent"]
    assert all(r["compute_streams"] == 4 for r in conc)
    assert all(r["compute_streams"] == 1 for r in rep["rows"] if r["policy"] == "by-engine")


def test_probe_graph_launch_quick(tmp_path):
    out = tmp_path / "probe.json"
    proc = _run([sys.executable, "benchmarks/probe_graph_launch.py", "--quick", "--json",
                 str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    kinds = {r["kind"] for r in rep["rows"]}
    assert kinds == {"empty-kernel chain", "empty-kernel fan-out", "empty-kernel roots",
                     "alloc/free", "memcpy", "copy-kernel"}
    assert all(r["ok"] for r in rep["rows"] if "ok" in r)
    assert set(rep["crossover"]) == {"h2d", "d2h"}
    assert all(r["launches"] >= 30 for r in rep["rows"])
    assert "crossover h2d" in proc.stdout and "crossover d2h" in proc.stdout

"""The serving engine on a real GPU (skipped without one).

- every executor (graph-build, capture, eager) and both memory kinds (external buffers, graph
  allocations): the smallest bucket, padding, slicing back, bit-exact; too large refused (C14);
  warm-up reports build / instantiate times and graph memory;
- many threads and asyncio tasks at once, every output checked, with and without batching;
- instance leasing never lets two requests share an instance (poison check under contention);
- zero-copy pinned inputs, and pageable memory refused for pinned=True;
- close() leaves live handles, pool and graph memory at baseline, also after an asyncio loop
  was closed with requests in flight (C17);
- a sticky CUDA error (a kernel reading an unmapped address) in a child process: every pending
  future fails with the CudaError, the engine refuses new work, close() returns;
- the bench command's latency and closed modes end with verified outputs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from orchestra.driver import MemoryPool, PinnedBuffer, live_handles
from orchestra.execute import PageableMemoryError, graph_memory
from orchestra.serve import Batching, Engine, Instance, RequestTooLarge
from orchestra.serve.cuda_backend import CudaBackend
from orchestra.serve.demo import demo_graph, demo_reference

pytestmark = pytest.mark.gpu

ROW = 1024
SPEC_IN = {"x": ((ROW,), "float32")}
SPEC_OUT = {"y": ((ROW,), "float32")}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows(n, seed=0):
    return (np.random.default_rng(seed * 7919 + n).standard_normal((n, ROW)) * 10
            ).astype(np.float32)


def engine(executor="graph", memory="external", iters=1, **kw):
    kw.setdefault("buckets", [1, 4, 16])
    return Engine(functools.partial(demo_graph, memory=memory, iters=iters),
                  inputs=SPEC_IN, outputs=SPEC_OUT, executor=executor, **kw)


@pytest.mark.parametrize("executor, memory", [
    ("graph", "external"), ("graph", "graph"), ("capture", "external"), ("capture", "graph"),
    ("eager", "external"), ("eager", "graph")])
def test_c14_buckets_bit_exact_on_every_executor(dev, executor, memory):
    with engine(executor, memory, iters=3, instances=2, timing_every=1) as e:
        report = e.warmup()
        print(f"\n{executor}/{memory} warm-up: {report}")
        assert [r["rows"] for r in report] == [16, 4, 1]
        for r in report:
            assert r["instances"] == 2 and r["build_ms"] > 0
            if executor != "eager":
                assert r["instantiate_ms"] > 0
            if executor == "eager" or memory == "external":
                assert r["graph_bytes"] == 0, r  # no graph allocations at all
            else:
                assert r["graph_bytes"] >= 0, r
        for n in (1, 4, 3, 16, 5, 2):  # one row, exactly a bucket, in between
            x = rows(n)
            assert e(x).tobytes() == demo_reference(x, 3).tobytes(), n
            assert e.submit(x).result().tobytes() == demo_reference(x, 3).tobytes(), n
        with pytest.raises(RequestTooLarge, match="17 rows"):
            e.submit(rows(17)).result()
        st = e.stats()
        assert st["engine"]["executor"] == {"graph": "graph-build"}.get(executor, executor)
        assert st["buckets"][4]["requests"] == 6 and st["engine"]["bad_requests"] == 1
        assert st["buckets"][16]["gpu_ms"]["count"] == 4  # every launch timed
        assert st["buckets"][16]["gpu_ms"]["mean"] > 0


def test_split_when_allowed(dev):
    with engine(buckets=[4, 16], split=True) as e:
        x = rows(40)
        assert e(x).tobytes() == demo_reference(x).tobytes()


@pytest.mark.parametrize("batching", [False, True])
def test_many_threads_and_asyncio_tasks_every_output_checked(dev, batching):
    kw = {"batching": Batching(max_batch=64, max_delay_us=200)} if batching else {}
    wrong = []
    with engine(buckets="pow2", max_rows=64, instances=4, **kw) as e:
        e.warmup()

        def worker(k):
            for i in range(60):
                x = rows(1 + (k * 7 + i) % 16, seed=100 * k + i)
                y = e.submit(x).result() if i % 2 else e(x)
                if y.tobytes() != demo_reference(x).tobytes():
                    wrong.append(("thread", k, i))

        async def tasks():
            async def one(i):
                x = rows(1 + i % 16, seed=10_000 + i)
                y = await e.run(x)
                if y.tobytes() != demo_reference(x).tobytes():
                    wrong.append(("task", i))
            await asyncio.gather(*(one(i) for i in range(300)))

        loop_thread = threading.Thread(target=lambda: asyncio.run(tasks()))
        loop_thread.start()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(worker, range(8)))
        loop_thread.join(60)
        st = e.stats()
        served = sum(b["requests"] for b in st["buckets"].values())
    assert not wrong
    assert served == 8 * 60 + 300
    if batching:
        launches = sum(b["launches"] for b in st["buckets"].values())
        assert launches <= served


class _Poisoned(Instance):
    """Wraps a CUDA instance: NaN-poisons the output staging at every launch (a request still
    reading the previous outputs would see NaN) and records a launch made while the instance is
    still leased."""

    def __init__(self, inner, violations):
        self.inner = inner
        self.rows = inner.rows
        self.inputs, self.outputs = inner.inputs, inner.outputs
        self.build_ms, self.instantiate_ms = inner.build_ms, inner.instantiate_ms
        self.busy = False
        self.violations = violations

    def launch(self, **kw):
        if self.busy:
            self.violations.append(self.rows)
        self.busy = True
        for a in self.outputs.values():
            a.fill(np.nan)
        self.inner.launch(**kw)

    def wait(self):
        self.inner.wait()

    def wait_blocking(self):
        self.inner.wait_blocking()

    def finish(self, timed):
        self.busy = False
        return self.inner.finish(timed)

    def close(self):
        self.inner.close()


class _PoisonBackend(CudaBackend):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.violations = []

    def create(self, rows, index, inputs, outputs):
        return _Poisoned(super().create(rows, index, inputs, outputs), self.violations)


@pytest.mark.parametrize("dispatch", ["caller", "thread", "batching"])
def test_instance_leasing_never_shares_an_instance(dev, dispatch):
    # a slow kernel (20,000 steps of v + 1: exact, input-dependent) and 16 threads on 2
    # instances of one bucket: heavy contention
    iters = 20_000
    backend = _PoisonBackend(functools.partial(demo_graph, iters=iters, s=1.0, t=1.0), "graph",
                             device=dev)
    wrong = []
    # "batching": dynamic batches of up to 8 rows, started by the threads that fill them
    kw = ({"batching": Batching(max_batch=8, max_delay_us=100)} if dispatch == "batching"
          else {"dispatch": dispatch})
    with Engine(backend=backend, inputs=SPEC_IN, outputs=SPEC_OUT, buckets=[8], instances=2,
                **kw) as e:
        def worker(k):
            for i in range(12):
                n = 1 + (k + i) % 8
                x = np.full((n, ROW), np.float32(k * 100 + i), np.float32)  # unique per request
                y = e.submit(x).result() if (k + i) % 2 else e(x)
                if y.tobytes() != (x + np.float32(iters)).tobytes():
                    wrong.append((k, i))

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(worker, range(16)))
        assert e.stats()["buckets"][8]["requests"] == 16 * 12
    assert not backend.violations
    assert not wrong


def test_zero_copy_pinned_inputs_and_pageable_refused(dev):
    with engine(buckets=[4, 16]) as e:
        pin = PinnedBuffer.empty((4, ROW), np.float32, dev)
        try:
            pin.array[:] = rows(4)
            y = e(pin.array, pinned=True)  # fills bucket 4: the exec reads it in place
            assert y.tobytes() == demo_reference(pin.array).tobytes()
            x3 = rows(3)
            assert e(x3).tobytes() == demo_reference(x3).tobytes()  # back on staging
            fut = e.submit(rows(4), pinned=True)  # pageable memory, said to be pinned
            with pytest.raises(PageableMemoryError, match="pinned=True"):
                fut.result()
            assert e(pin.array, pinned=True).tobytes() == demo_reference(pin.array).tobytes()
        finally:
            e.close()
            pin.close()


def test_torch_cpu_tensors_in_and_out_pinned_or_not(dev):
    """CPU torch tensors wherever numpy arrays go (read through DLPack views): pageable ones
    copied into staging, a pinned one read in place with pinned=True, out= a tensor written in
    place; a CUDA tensor refused before anything is queued."""
    torch = pytest.importorskip("torch")
    from orchestra.serve import InputTypeError

    with engine(buckets=[4, 16]) as e:
        x3 = rows(3)
        assert e(torch.from_numpy(x3)).tobytes() == demo_reference(x3).tobytes()
        t4 = torch.from_numpy(rows(4)).pin_memory()
        want = demo_reference(t4.numpy())
        assert e(t4, pinned=True).tobytes() == want.tobytes()
        dst = torch.full((4, ROW), float("nan"))
        e.submit(t4, out=dst).result()
        assert dst.numpy().tobytes() == want.tobytes()
        if torch.cuda.is_available():
            with pytest.raises(InputTypeError, match="device memory"):
                e(t4.cuda())


@pytest.mark.parametrize("memory", ["external", "graph"])
def test_close_leaves_handles_pool_and_graph_memory_at_baseline(dev, memory):
    pool = MemoryPool.default(dev)
    with engine(memory=memory) as e:  # first use: the kernel's module is loaded for good
        e(rows(2))
    handles, used, gmem = live_handles(), pool.used_bytes, graph_memory(dev).used
    e = engine(memory=memory, instances=3)
    e.warmup()
    for n in (1, 3, 9, 16):
        e(rows(n))
    futs = [e.submit(rows(n)) for n in range(1, 17)]
    e.close()  # drains the pending futures first
    assert all(f.result(timeout=0).shape[0] == n for n, f in zip(range(1, 17), futs))
    assert live_handles() == handles
    assert pool.used_bytes == used
    assert graph_memory(dev).used == gmem


def test_c17_loop_closed_with_requests_in_flight_then_close_at_baseline(dev):
    pool = MemoryPool.default(dev)
    with engine(iters=1) as e:
        e(rows(1))
    handles, used, gmem = live_handles(), pool.used_bytes, graph_memory(dev).used
    errors = []
    old = threading.excepthook
    threading.excepthook = errors.append
    try:
        e = engine(iters=2_000_000, instances=2)  # milliseconds per request: still in flight
        e.warmup()
        loop = asyncio.new_event_loop()

        async def start():
            return [asyncio.ensure_future(e.run(rows(n))) for n in (1, 2, 3, 4, 5, 6)]

        tasks = loop.run_until_complete(start())
        loop.run_until_complete(asyncio.sleep(0.001))
        loop.close()  # requests still on the GPU and in the queue
        e.close()
    finally:
        threading.excepthook = old
    assert not errors
    assert not any(t.done() for t in tasks)
    for t in tasks:  # pending on purpose: asyncio would warn when they are freed
        t._log_destroy_pending = False
    assert live_handles() == handles
    assert pool.used_bytes == used
    assert graph_memory(dev).used == gmem


_STICKY_CHILD = r"""
import os, sys
import numpy as np
from orchestra.errors import CudaError
from orchestra.graph import (Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostToDevice, In,
                             KernelNode, Out, TaskGraph)
from orchestra.serve import Engine, EngineBroken
from orchestra.serve.cuda_backend import ServeGraph
from orchestra.serve import demo

ROW = 1024

class Unmapped:  # an "external device buffer" at an address nothing maps (next to null)
    ptr = 16
    nbytes = 1 << 30

def build(sig):
    rows = sig.shape("x")[0]
    n = rows * ROW
    g = TaskGraph()
    hin, hout = HostBuffer("x_host", 4 * n), HostBuffer("y_host", 4 * n)
    dx, dy, bad = Buffer("x_dev", 4 * n), Buffer("y_dev", 4 * n), Buffer("bad", 4 * n)
    g.add(Alloc("ax", dx)); g.add(Alloc("ay", dy))
    g.add(HostToDevice("h2d", hin, dx))
    src = bad if rows == 4 else dx  # the 4-row bucket's kernel reads unmapped memory
    iters = 1 if rows == 4 else 200_000
    g.add(KernelNode("k", demo.kernel_ref(), 64, 256, (In(src), Out(dy), n, iters, 0.5, 1.0)))
    g.add(DeviceToHost("d2h", dy, hout))
    g.add(Free("fx", dx)); g.add(Free("fy", dy))
    return ServeGraph(g, inputs={"x": "x_host"}, outputs={"y": "y_host"},
                      bindings={"bad": Unmapped()} if rows == 4 else {})

e = Engine(build, inputs={"x": ((ROW,), "float32")}, outputs={"y": ((ROW,), "float32")},
           buckets=[1, 4], instances=1, queue_limit=64)
e.warmup()
x1 = np.ones((1, ROW), np.float32)
assert (e(x1) == 2).all()  # v = 0.5 v + 1 from 1 reaches its fixed point 2 exactly
# bucket 1 (a slow kernel, about half a millisecond): one running, seven queued
pending = [e.submit(np.ones((1, ROW), np.float32) * k) for k in range(8)]
bad = e.submit(np.ones((3, ROW), np.float32))  # bucket 4: reads unmapped memory
exc = bad.exception()
assert isinstance(exc, CudaError) and exc.sticky, repr(exc)
failed = 0
for f in pending:
    err = f.exception()
    if err is not None:
        assert isinstance(err, CudaError) and err.sticky, repr(err)
        failed += 1
assert failed >= 7, failed  # at least every queued one
assert e.broken is not None and e.stats()["engine"]["state"] == "broken"
try:
    e.submit(x1)
    raise AssertionError("a broken engine took new work")
except EngineBroken as b:
    assert "restart the process" in str(b), b
    assert b.cause is e.broken
e.close()
print("sticky:", exc.name, "failed pending:", failed)
print("CHILD-OK", flush=True)
sys.stdout.flush()
os._exit(0)
"""


def test_sticky_error_fails_every_pending_future_in_a_child_process():
    proc = subprocess.run([sys.executable, "-c", _STICKY_CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0 and "CHILD-OK" in proc.stdout
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in proc.stdout or "sticky: CUDA_ERROR" in proc.stdout


@pytest.mark.parametrize("mode, extra", [
    ("latency", ["--requests", "300"]),
    ("closed", ["--duration", "0.5", "--threads", "4", "--no-peers"]),
    ("asyncio", ["--tasks", "100", "--requests", "1000", "--no-peers"]),
    ("soak", ["--requests", "3000", "--threads", "4"]),
])
def test_bench_serve_modes_verify_their_outputs(mode, extra):
    proc = subprocess.run([sys.executable, "-m", "orchestra.cli.main", "bench", "serve",
                           "--mode", mode, "--json", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["verified"] is True
    assert all(r["wrong"] == 0 and r["requests"] > 0 for r in rep["results"])
    if mode == "latency":
        names = [r["name"] for r in rep["results"]]
        assert "cuda-python (bare)" in names
    if mode == "soak":
        (r,) = rep["results"]
        assert r["bad_refused_ok"] == r["bad_requests"] > 0
        assert r["first"]["live_handles"] == r["last"]["live_handles"]

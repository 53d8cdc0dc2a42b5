"""`ProcessEngine` on a real GPU (skipped without one): the engine process page-locks the
shared memory and its graph instances read and write the slots; many threads and an event
loop that reads the completions itself get bit-exact outputs, with and without dynamic
batching; close() ends the process and unlinks the shared memory."""

from __future__ import annotations

import asyncio
import functools
import os

import numpy as np
import pytest

from orchestra.serve import Batching, Engine
from orchestra.serve.demo import demo_graph, demo_reference
from orchestra.serve.process import ProcessEngine
from tests.helpers import in_threads

pytestmark = pytest.mark.gpu

ROW = 1024


def gpu_engine(executor="graph", batching=False):
    """The factory the engine process calls."""
    return Engine(functools.partial(demo_graph, iters=2), inputs={"x": ((ROW,), "float32")},
                  outputs={"y": ((ROW,), "float32")}, executor=executor, buckets="pow2",
                  max_rows=16, instances=2,
                  batching=Batching(max_batch=16, max_delay_us=100) if batching else None)


class _Unmapped:  # an "external device buffer" at an address nothing maps (next to null)
    ptr = 16
    nbytes = 1 << 30


def _sticky_build(sig):
    """The demo's graph, except that the 4-row bucket's kernel reads unmapped memory."""
    from orchestra.graph import (Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostToDevice,
                                 In, KernelNode, Out, TaskGraph)
    from orchestra.serve import demo
    from orchestra.serve.cuda_backend import ServeGraph

    rows = sig.shape("x")[0]
    n = rows * ROW
    g = TaskGraph()
    hin, hout = HostBuffer("x_host", 4 * n), HostBuffer("y_host", 4 * n)
    dx, dy, bad = Buffer("x_dev", 4 * n), Buffer("y_dev", 4 * n), Buffer("bad", 4 * n)
    g.add(Alloc("ax", dx))
    g.add(Alloc("ay", dy))
    g.add(HostToDevice("h2d", hin, dx))
    g.add(KernelNode("k", demo.kernel_ref(), 64, 256,
                     (In(bad if rows == 4 else dx), Out(dy), n, 2, 0.5, 1.0)))
    g.add(DeviceToHost("d2h", dy, hout))
    g.add(Free("fx", dx))
    g.add(Free("fy", dy))
    return ServeGraph(g, inputs={"x": "x_host"}, outputs={"y": "y_host"},
                      bindings={"bad": _Unmapped()} if rows == 4 else {})


def sticky_engine():
    return Engine(_sticky_build, inputs={"x": ((ROW,), "float32")},
                  outputs={"y": ((ROW,), "float32")}, buckets=[1, 4], instances=1)


def _x(n, seed):
    return (np.random.default_rng(seed).standard_normal((n, ROW)) * 10).astype(np.float32)


@pytest.mark.parametrize("executor, zero_copy", [
    ("graph", True), ("capture", True), ("eager", True), ("graph", False)])
def test_threads_get_bit_exact_outputs_through_pinned_slots(executor, zero_copy):
    with ProcessEngine(gpu_engine, (executor,), slots=32, zero_copy=zero_copy) as e:
        assert e.pinned is zero_copy  # the engine process registered the shared memory
        report = e.warmup()
        assert sorted(r["rows"] for r in report) == [1, 2, 4, 8, 16]
        def client(k):
            for i in range(60):
                x = _x(1 + (k + i) % 16, 100 * k + i)
                y = e(x) if i % 2 else e.submit(x).result(timeout=60)
                assert np.array_equal(y, demo_reference(x, 2)), (k, i)

        in_threads(client, 8)
        st = e.stats()
        assert st["process"]["requests"] == 480 and st["process"]["failed"] == 0
        name, proc = e._shm.name, e._child.proc
    assert proc.exitcode == 0
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")


def test_event_loop_reads_completions_with_batching():
    async def main():
        e = ProcessEngine(gpu_engine, kwargs={"batching": True}, slots=64,
                          loop=asyncio.get_running_loop())
        try:
            e.warmup()
            xs = [_x(1 + k % 4, 9000 + k) for k in range(1000)]
            ys = await asyncio.gather(*(e.run(x) for x in xs))
            bad = sum(not np.array_equal(y, demo_reference(x, 2)) for x, y in zip(xs, ys))
            assert bad == 0
            fills = [b["batch_fill"] for b in e.stats()["buckets"].values() if b["launches"]]
            assert fills and max(fills) > 0
        finally:
            await e.aclose()

    asyncio.run(main())


def test_a_sticky_cuda_error_restarts_the_engine_process():
    from orchestra.errors import CudaError

    with ProcessEngine(sticky_engine, slots=8, restarts=1) as e:
        x = _x(1, 1)
        assert np.array_equal(e(x), demo_reference(x, 2))
        pid = e.pid
        with pytest.raises(CudaError) as info:
            e(_x(3, 2))  # the 4-row bucket: an illegal address, the context is lost
        assert info.value.sticky
        import time

        t = time.monotonic() + 90
        while (e.pid == pid or e._state != "open") and time.monotonic() < t:
            time.sleep(0.1)
        assert e.pid != pid and e.broken is None
        x = _x(1, 3)
        assert np.array_equal(e(x), demo_reference(x, 2))  # a new CUDA context serves
        assert e.stats()["process"]["restarts"] == 1

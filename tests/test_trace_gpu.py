"""GPU tests of the trace recorders with real timing events (skipped without a device).

They drive the tracers by hand with driver-level copies, the way the executors will: the eager
tracer around copies on two streams, and the graph tracer through stream capture
(``CU_EVENT_RECORD_EXTERNAL`` event-record nodes) and a launch.
"""

import json

import pytest

from orchestra.graph import Buffer, HostBuffer, HostToDevice, Memset
from orchestra.trace import EagerTracer, GraphTracer, to_chrome_trace

pytestmark = pytest.mark.gpu

NBYTES = 32 << 20


@pytest.fixture
def device():
    from orchestra.driver import Device
    return Device.get(0)


def test_eager_tracer_times_copies_on_two_streams(device):
    from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream

    s0, s1 = Stream(device), Stream(device)
    host = [PinnedBuffer(NBYTES, device) for _ in range(4)]
    bufs = [DeviceBuffer.allocate(NBYTES, s0 if i % 2 == 0 else s1) for i in range(4)]
    nodes = [HostToDevice(f"b{i}.h2d", HostBuffer(f"h{i}", NBYTES), Buffer(f"d{i}", NBYTES), batch=i)
             for i in range(4)]
    with EagerTracer(device) as tracer:
        for run in range(2):  # the second run reuses the first run's events
            tracer.begin({"s0": s0, "s1": s1}, policy="round-robin")
            for i, node in enumerate(nodes):
                stream = s0 if i % 2 == 0 else s1
                tracer.before(stream, node)
                bufs[i].copy_from_host(host[i], stream)
                tracer.after(stream, node)
            tl = tracer.finish()
            assert tracer.pool.size == 2 + 2 * len(nodes)
        assert len(tl) == 4 and tl.streams == ("s0", "s1")
        for s in tl:
            assert s.start_ms >= 0 and s.duration_ms > 0 and s.engine == "upload"
        # same-stream nodes do not overlap and keep their order
        for name in tl.streams:
            spans = tl.spans_for(name)
            assert all(a.end_ms <= b.start_ms + 1e-3 for a, b in zip(spans, spans[1:]))
        assert tl.busy_ms()["upload"] <= tl.makespan_ms + 1e-6
        data = json.loads(json.dumps(to_chrome_trace(tl)))
        assert sum(e["ph"] == "X" for e in data["traceEvents"]) == 4
    for b in bufs:
        b.close()
    s0.synchronize(); s1.synchronize()
    for h in host:
        h.close()
    s0.close(); s1.close()


def test_graph_tracer_through_stream_capture(device):
    from cuda.bindings import driver

    from orchestra.driver import DeviceBuffer, Stream, cu

    stream = Stream(device)
    buf = DeviceBuffer.allocate(NBYTES, stream)
    stream.synchronize()
    nodes = [Memset(f"m{i}", Buffer("x", NBYTES), i) for i in range(3)]
    tracer = GraphTracer(device, executor="capture")
    tracer.begin({"main": stream})
    cu(driver.cuStreamBeginCapture, stream.handle,
       driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    try:
        for i, node in enumerate(nodes):
            tracer.before(stream, node)
            buf.memset(i, stream)
            tracer.after(stream, node)
    finally:
        graph = cu(driver.cuStreamEndCapture, stream.handle)
    exe = cu(driver.cuGraphInstantiate, graph, 0)
    try:
        for _launch in range(2):
            tracer.mark_launch(stream)
            cu(driver.cuGraphLaunch, exe, stream.handle)
            tl = tracer.finish()
            assert [s.name for s in tl] == ["m0", "m1", "m2"]
            assert all(s.start_ms >= 0 and s.duration_ms >= 0 for s in tl)
            assert tl.executor == "capture"
        stream.synchronize()
    finally:
        cu(driver.cuGraphExecDestroy, exe)
        cu(driver.cuGraphDestroy, graph)
        tracer.close()
        buf.close()
        stream.synchronize()
        stream.close()

"""`orchestra.driver.captured.CapturedGraph` on the graph fake (tests/fake_graph_cuda.py): the
work of several streams captured into one graph (a chain per stream), instantiated, uploaded,
launched; the exec and the graph released on close, on every failure while it is made, and by
the finalizer of a forgotten one."""

from __future__ import annotations

import gc
import re

import pytest

from orchestra.driver import live_handles
from orchestra.driver.captured import CapturedGraph
from orchestra.driver.owner import ResourceClosedError
from orchestra.errors import CudaError
from tests.fake_graph_cuda import install


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


def _streams(fake, n):
    return [fake.stream(fake.device) for _ in range(n)]


def _items(fake, streams, k, tag="item"):
    """enqueue(): k empty nodes, item i on streams[i % len(streams)]."""
    def enqueue():
        for i in range(k):
            (err,) = fake._enqueue(streams[i % len(streams)].handle, "empty", {"tag": (tag, i)})
            assert not err
    return enqueue


def _live():
    return live_handles().get("captured_graph", 0)


def _all_released(fake):
    return (fake.live_graphs == [] and all(e.graph is None for e in fake.execs.values())
            and not fake.capture)


def _fails_released(fake, exc_type, match, make):
    """``make()`` raises ``exc_type`` matching ``match``, and everything was released before
    the error reached the caller (checked while the traceback, and with it the half-made
    object, is still alive: its finalizer cannot have done it)."""
    try:
        make()
    except exc_type as exc:
        assert re.search(match, str(exc)), str(exc)
        return _all_released(fake)
    raise AssertionError(f"{make} did not raise {exc_type.__name__}")


def test_the_work_of_each_stream_becomes_one_chain_of_the_graph(fake):
    origin, s1, s2 = _streams(fake, 3)
    before = _live()
    g = CapturedGraph(origin, _items(fake, [origin, s1, s2], 9), (s1, s2))
    assert _live() == before + 1 and not fake.capture  # the capture ended
    nodes = fake.graphs[int(g.graph)].nodes
    assert [n.params["tag"][1] for n in nodes] == list(range(9))
    # item i follows item i - 3 (its stream's previous one) alone; the first three are roots
    for i, n in enumerate(nodes):
        assert n.deps == ([] if i < 3 else [int(nodes[i - 3].id)]), i
    assert fake.counts["cuGraphInstantiate"] == fake.counts["cuGraphUpload"] == 1
    assert fake.log[fake.log.index(("cuGraphInstantiate", 0)) + 1][0] == "cuGraphUpload"
    g.launch()
    g.launch(s1)
    assert g.launches == 2 and fake.counts["cuGraphLaunch"] == 2
    (exe,) = fake.execs.values()
    assert exe.launches == 2 and exe.graph is fake.graphs[int(g.graph)]
    g.close()
    assert _all_released(fake) and _live() == before
    assert fake.counts["cuGraphExecDestroy"] == fake.counts["cuGraphDestroy"] == 1
    g.close()  # idempotent
    assert fake.counts["cuGraphExecDestroy"] == fake.counts["cuGraphDestroy"] == 1
    assert g.closed and "closed" in repr(g)
    with pytest.raises(ResourceClosedError, match="CapturedGraph is closed"):
        g.launch()
    assert fake.counts["cuGraphLaunch"] == 2


def test_one_stream_and_no_upload(fake):
    (origin,) = _streams(fake, 1)
    with CapturedGraph(origin, _items(fake, [origin], 4), upload=False) as g:
        nodes = fake.graphs[int(g.graph)].nodes
        assert len(nodes) == 4 and [len(n.deps) for n in nodes] == [0, 1, 1, 1]
        assert fake.counts["cuGraphUpload"] == 0
    assert _all_released(fake)


def test_an_error_inside_the_capture_leaves_nothing(fake):
    origin, s1 = _streams(fake, 2)
    before = _live()

    def enqueue():
        _items(fake, [origin, s1], 3)()
        raise RuntimeError("boom")

    assert _fails_released(fake, RuntimeError, "boom",
                           lambda: CapturedGraph(origin, enqueue, (s1,)))
    assert fake.counts["cuGraphInstantiate"] == 0 and _live() == before


def test_work_left_on_a_stream_the_capture_never_joined_back_leaves_nothing(fake):
    origin, s1, s2 = _streams(fake, 3)

    def unknown():  # s2 joins the capture through s1's event but is never joined back
        _items(fake, [origin, s1], 2)()
        fake.cuEventRecord(99, s1.handle)
        fake.cuStreamWaitEvent(s2.handle, 99, 0)
        _items(fake, [s2], 1)()

    assert _fails_released(fake, CudaError, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
                           lambda: CapturedGraph(origin, unknown, (s1,)))
    assert fake.counts["cuGraphInstantiate"] == 0



@pytest.mark.parametrize("call", ["cuGraphInstantiate", "cuGraphUpload"])
def test_a_failed_instantiation_or_upload_releases_the_graph(fake, call):
    origin, s1 = _streams(fake, 2)
    before = _live()
    fake.fail[call] = 1
    assert _fails_released(fake, CudaError, call,
                           lambda: CapturedGraph(origin, _items(fake, [origin, s1], 4), (s1,)))
    assert _live() == before
    assert fake.counts["cuGraphDestroy"] == 1
    assert fake.counts["cuGraphExecDestroy"] == (call == "cuGraphUpload")


def test_a_failed_launch_raises_and_close_still_releases(fake):
    origin, s1 = _streams(fake, 2)
    g = CapturedGraph(origin, _items(fake, [origin, s1], 4), (s1,))
    fake.fail["cuGraphLaunch"] = 1
    with pytest.raises(CudaError, match="cuGraphLaunch"):
        g.launch()
    assert g.launches == 0
    g.close()
    assert _all_released(fake)


def test_a_forgotten_graph_is_released_by_its_finalizer(fake):
    origin, s1 = _streams(fake, 2)
    before = _live()
    g = CapturedGraph(origin, _items(fake, [origin, s1], 4), (s1,))
    g.launch()
    del g
    gc.collect()
    assert _all_released(fake) and _live() == before

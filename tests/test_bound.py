"""The pipeline bound from given sustained times (orchestra.app.job.bound): fill and drain,
duplex overlap, one batch, kernel-bound and copy-bound pipelines, ragged batches, the loud
warning, and the link term's small linear program against a brute-force search."""

import contextlib
import itertools
import types

import numpy as np

import pytest

from orchestra.app.job.bound import (
    EFFICIENCY_LIMIT,
    Sustained,
    bound_warning,
    middle_ms,
    pipeline_bound,
)

MIB64 = 64 << 20


def S(h, k, d, p, nbytes=MIB64, items=16):
    return Sustained(nbytes, items, h, k, d, p)


def test_balanced_pipeline_with_duplex_is_link_bound():
    # the worked example of docs/execution.md: 32 x 64 MiB on an H200
    b = pipeline_bound(S(1.22, 1.22, 1.22, 1.336), 32)
    assert b.upload_ms == pytest.approx(32 * 1.22 + 2 * 1.22)
    assert b.download_ms == pytest.approx(2 * 1.22 + 32 * 1.22)
    assert b.compute_ms == pytest.approx(1.22 + 32 * 1.22 + 1.22)
    # fill (h + k) and drain (k + d) move one direction only; the 30 pairs left run at once
    assert b.link_ms == pytest.approx(4 * 1.22 + 30 * 1.336)
    assert b.limiter == "link" and b.bound_ms == pytest.approx(44.96)


def test_no_duplex_cost_gives_the_classic_flow_shop_bound():
    # p = max(h, d): both directions at once cost nothing extra; h + k + d + (N - 1) * max
    b = pipeline_bound(S(1.0, 1.0, 1.0, 1.0), 10)
    assert b.bound_ms == pytest.approx(1 + 1 + 1 + 9 * 1.0)
    assert b.link_ms == pytest.approx(b.bound_ms)


def test_fill_and_drain_are_counted_once():
    # copy-bound, kernel tiny: fill h + k, drain k + d, N - 1 - k/h pairs in the middle
    h, k, d, p = 2.0, 0.5, 2.0, 2.2
    b = pipeline_bound(S(h, k, d, p), 8)
    a = 8 - (h + k) / h
    assert b.link_ms == pytest.approx((h + k) + (k + d) + a * p)
    assert b.upload_ms == pytest.approx(8 * h + k + d)
    assert b.limiter == "link"


def test_one_batch_is_h_plus_k_plus_d():
    # K = N = 1: nothing overlaps; the link term does not apply (fill and drain would
    # count the kernel twice)
    b = pipeline_bound(S(1.0, 2.0, 3.0, 3.5), 1)
    assert b.bound_ms == pytest.approx(6.0)
    assert b.link_ms is None and "link" not in b.terms
    assert b.as_dict()["terms_ms"] == {"upload": 6.0, "download": 6.0, "compute": 6.0}


def test_kernel_bound():
    b = pipeline_bound(S(1.0, 3.0, 1.0, 1.2), 20)
    assert b.limiter == "compute"
    assert b.bound_ms == pytest.approx(1 + 20 * 3 + 1)


def test_copy_bound_without_duplex_overlap_to_gain():
    # both at once slower than one after the other: the middle runs the directions in turn,
    # and the upload engine alone is no longer the limit
    h, k, d, p = 1.0, 0.1, 1.0, 2.5
    b = pipeline_bound(S(h, k, d, p), 10)
    a_h, a_d = 10 - (h + k) / h, 10 - (k + d) / d
    assert b.link_ms == pytest.approx((h + k) + (k + d) + a_h * h + a_d * d)
    assert b.limiter == "link" and b.bound_ms > b.upload_ms


def test_upload_bound_when_downloads_are_short():
    # D2H of a reduced output: 0.1 ms; upload dominates
    b = pipeline_bound(S(2.0, 0.5, 0.1, 2.05), 10)
    assert b.upload_ms == pytest.approx(10 * 2.0 + 0.6)
    assert b.limiter in ("upload", "link")
    assert b.bound_ms == pytest.approx(max(b.terms.values()))


def test_noisy_pair_time_below_a_solo_copy_only_lowers_the_engine_terms():
    lo = pipeline_bound(S(1.0, 0.2, 1.0, 0.9), 10)
    hi = pipeline_bound(S(1.0, 0.2, 1.0, 1.0), 10)
    assert lo.upload_ms < hi.upload_ms and lo.bound_ms <= hi.bound_ms


def test_ragged_batches_use_the_smallest_for_fill_and_drain():
    full = MIB64
    sizes = [full] * 3 + [full // 4]
    b = pipeline_bound(S(1.0, 1.0, 1.0, 1.0), sizes)
    assert b.batches == pytest.approx(3.25) and b.smallest == pytest.approx(0.25)
    assert b.upload_ms == pytest.approx(3.25 + 0.25 * 2)
    # never above the same pipeline with every batch full
    assert b.bound_ms <= pipeline_bound(S(1.0, 1.0, 1.0, 1.0), 4).bound_ms
    with pytest.raises(ValueError):
        pipeline_bound(S(1, 1, 1, 1), [])
    with pytest.raises(ValueError):
        pipeline_bound(S(1, 1, 1, 1), 0)


def test_sustained_rejects_bad_times():
    with pytest.raises(ValueError, match="pair_ms"):
        Sustained(4, 1, 1.0, 1.0, 1.0, float("nan"))
    with pytest.raises(ValueError, match="items"):
        Sustained(4, 0, 1.0, 1.0, 1.0, 1.0)


def _brute_middle(a_h, a_d, h, d, p, steps=400):
    best = float("inf")
    top = p * max(a_h, a_d)
    for i in range(steps + 1):
        c = top * i / steps
        best = min(best, c + h * max(0, a_h - c / p) + d * max(0, a_d - c / p))
    return best


@pytest.mark.parametrize("a_h,a_d,h,d,p", [
    (10, 10, 1.0, 1.0, 1.1), (10, 4, 1.0, 2.0, 2.1), (3, 9, 1.5, 1.0, 3.0),
    (5, 5, 1.0, 1.0, 2.5), (0, 7, 1.0, 1.0, 1.2), (-1, 3, 1.0, 1.0, 1.2)])
def test_middle_is_the_minimum_over_the_overlap_time(a_h, a_d, h, d, p):
    assert middle_ms(a_h, a_d, h, d, p) == pytest.approx(_brute_middle(max(a_h, 0), a_d, h, d,
                                                                       p), rel=1e-3)


def _simulate_lockstep(n, h, k, d, p):
    """A concrete schedule: step t runs H2D(t), kernel(t-1), D2H(t-2); a step with both copies
    costs max(p, k), otherwise the longest of what runs. Any real schedule is >= the bound."""
    total = 0.0
    for t in range(n + 2):
        up, comp, down = t < n, 0 <= t - 1 < n, 0 <= t - 2 < n
        if up and down:
            total += max(p, k if comp else 0.0)
        else:
            total += max(h if up else 0.0, k if comp else 0.0, d if down else 0.0)
    return total


@pytest.mark.parametrize("n,h,k,d,p", list(itertools.product(
    (1, 2, 3, 8, 32), (1.0,), (0.1, 1.0, 2.5), (1.0, 0.5), (1.0, 1.1, 1.6))))
def test_the_bound_never_exceeds_a_feasible_schedule(n, h, k, d, p):
    p = max(p, h, d)  # a pair is never faster than its slower copy alone
    b = pipeline_bound(S(h, k, d, p), n)
    assert b.bound_ms <= _simulate_lockstep(n, h, k, d, p) + 1e-9


def test_bound_warning_is_loud_above_the_limit():
    assert bound_warning(1.0) is None and bound_warning(EFFICIENCY_LIMIT) is None
    msg = bound_warning(1.036, "round-robin")
    assert msg.startswith("BOUND BUG") and "1.036" in msg and "round-robin" in msg


# -- the gated timer's logic on fakes (no GPU) ---------------------------------------------------

class _Clock:
    def __init__(self):
        self.host = 0.0  # s
        self.gpu = 0.0   # ms

    def perf_counter(self):
        return self.host


def _gated(monkeypatch, gate_ms=None):
    import orchestra.driver as od
    import orchestra.kernel as ok
    from orchestra.app.job import sustained

    clock = _Clock()
    gates = []

    class Event:
        def __init__(self, device=None, timing=False):
            self.t = None

        def record(self, stream):
            self.t = clock.gpu

        def synchronize(self):
            pass

        def close(self):
            pass

        @staticmethod
        def elapsed_ms(a, b):
            return b.t - a.t

    class Gate:
        def launch(self, stream, grid, block, args):
            gates.append(args[0] / 1e6)

    class Stream:
        device = None
        waited = 0

        def wait(self, event):
            Stream.waited += 1

        def synchronize(self):
            pass

    monkeypatch.setattr(od, "Event", Event)
    monkeypatch.setattr(ok, "load_kernel", lambda *a, **k: Gate())
    monkeypatch.setattr(sustained, "time", clock)
    return sustained.GatedTimer(Stream(), repeats=3, warmup=1, gate_ms=gate_ms), clock, gates, \
        Stream


def test_gated_timer_sizes_the_gate_from_the_enqueue_time(monkeypatch):
    timer, clock, gates, stream_cls = _gated(monkeypatch)
    gpu_ms = iter([9.0, 1.0, 2.0, 3.0, 4.0])  # sizing run, warm-up, then three timed

    def enqueue():
        clock.host += 0.002  # 2 ms of host time
        clock.gpu += next(gpu_ms)

    assert timer.median_ms(enqueue) == 3.0
    assert gates[0] == 20.0 and set(gates[1:]) == {6.0}  # 3 x the 2 ms enqueue
    assert not timer.host_bound
    other = stream_cls()
    timer.median_ms(lambda: None, [other, other])
    assert stream_cls.waited == 2 * 5 + 2 * 5  # each other stream forked in and joined back


def test_gated_timer_doubles_a_gate_the_host_outlasts(monkeypatch):
    timer, clock, gates, _ = _gated(monkeypatch, gate_ms=1.0)

    def enqueue():
        clock.host += 0.002
        clock.gpu += 1.0

    ms, gate = timer.elapsed_ms(enqueue, (), 1.0)
    assert gates == [1.0, 2.0, 4.0] and gate == 4.0 and ms == 1.0 and not timer.host_bound
    gates.clear()

    def slow():
        clock.host += 1.0  # always longer than the gate
    timer.elapsed_ms(slow, (), 1.0)
    assert gates == [1.0, 2.0, 4.0, 8.0] and timer.host_bound


# -- lanes: rate times at the plan's concurrency, chain times for fill and drain -----------------

def test_chain_times_make_fill_and_drain_and_rate_times_the_rest():
    # a lane plan's sustained times: 16 lanes make each stage's rate 16x its chain step
    hc, kc, dc = 1.6e-3, 0.8e-3, 1.28e-3
    h, k, d = hc / 16, kc / 16, dc / 16
    s = Sustained(65536, 64, h, k, d, max(h, d), 16, h2d_chain_ms=hc, kernel_chain_ms=kc,
                  d2h_chain_ms=dc)
    assert s.chain == (hc, kc, dc)
    b = pipeline_bound(s, 1024)
    assert b.upload_ms == pytest.approx(1024 * h + kc + dc)
    assert b.download_ms == pytest.approx(hc + kc + 1024 * d)
    assert b.compute_ms == pytest.approx(hc + 1024 * k + dc)
    fill, drain = hc + kc, kc + dc
    a_h, a_d = 1024 - fill / h, 1024 - drain / d
    assert b.link_ms == pytest.approx(fill + drain + _brute_middle(a_h, a_d, h, d, max(h, d)),
                                      rel=1e-3)
    # without chain times the rate times stand in for them (the bound before lanes)
    plain = pipeline_bound(Sustained(65536, 64, h, k, d, max(h, d), 16), 1024)
    assert plain.upload_ms == pytest.approx(1024 * h + k + d)
    assert plain.bound_ms < b.bound_ms


def test_chain_times_below_the_rate_times_are_refused():
    with pytest.raises(ValueError, match="kernel_chain_ms must be a time >= kernel_ms"):
        Sustained(4, 16, 1.0, 1.0, 1.0, 1.0, 3, kernel_chain_ms=0.5)
    with pytest.raises(ValueError, match="h2d_chain_ms"):
        Sustained(4, 16, 1.0, 1.0, 1.0, 1.0, 3, h2d_chain_ms=float("nan"))


def _lanes_wall(n, lanes, hc, kc, dc):
    """A lane plan with no contention at all (latency-bound steps, each lane's batches one
    after another): ceil(n / lanes) chains of hc + kc + dc."""
    return -(-n // lanes) * (hc + kc + dc)


@pytest.mark.parametrize("n,lanes,hc,kc,dc", [
    (1024, 16, 2.35e-3, 1.2e-3, 1.4e-3), (4096, 16, 2.35e-3, 0.7e-3, 1.4e-3),
    (20, 16, 3.7e-3, 1.2e-3, 1.4e-3), (16, 16, 1.0, 1.0, 1.0), (64, 12, 1.0, 0.1, 2.0)])
def test_the_lane_bound_holds_where_the_one_stream_bound_does_not(n, lanes, hc, kc, dc):
    """A lane plan runs ``lanes`` chains at once: the bound from times measured at that
    concurrency (each stage's rate: ``lanes`` items per chain step) stays below its wall,
    while a bound from one-stream times (every H2D after the other) is beaten."""
    wall = _lanes_wall(n, lanes, hc, kc, dc)
    h, k, d = hc / lanes, kc / lanes, dc / lanes
    lane = Sustained(65536, 4 * lanes, h, k, d, max(h, d), lanes, h2d_chain_ms=hc,
                     kernel_chain_ms=kc, d2h_chain_ms=dc)
    assert pipeline_bound(lane, n).bound_ms <= wall + 1e-12
    one = Sustained(65536, 16, hc, kc, dc, max(hc, dc))
    if n > lanes:
        assert pipeline_bound(one, n).bound_ms > 1.01 * wall  # efficiency > 1.01: a bug


class _FakeStream:
    made = 0

    def __init__(self, device=None, priority=0):
        _FakeStream.made += 1
        self.id = _FakeStream.made
        self.handle = 0x9000 + self.id  # what a capture on the graph fake keys streams by
        self.device = device

    def synchronize(self):
        pass

    def close(self):
        pass


def _fake_timer(monkeypatch, latency, copy_kernel_latency=None, *, fake=None,
                graph_latency=None):
    """A `BatchTimer` over fakes: every copy and kernel is logged with its stream, and the
    gated timer's elapsed time is a model of the GPU: items on one stream run one after the
    other, items on different streams at once (``latency``: kind -> ms per item).

    ``fake``: a `FakeGraphDriver` made the process's driver API: an item enqueued on a stream
    it is capturing becomes an empty node of the captured graph tagged with its kind (logged
    as captured, not run), and a measurement whose enqueue launches a graph takes the graph's
    longest path, ``graph_latency`` (kind -> ms) per node: as a graph runs it, each node
    after its dependencies, independent branches at once."""
    import orchestra.driver as od
    import orchestra.kernel as ok
    from orchestra.app.job import sustained
    from orchestra.app.job.timing import BatchTimer

    log = []  # (kind, stream, captured) per enqueued item
    timed = []  # (kinds, streams used, the others forked) per gated measurement
    launched = []  # the nodes of the graph of every graph launch
    checked = []  # the kernels whose launch configuration was checked (launch_config)
    if fake is not None:
        real_launch = fake.cuGraphLaunch

        def graph_launch(h, stream):
            launched.append(list(fake.execs[int(h)].graph.nodes))  # what this launch runs
            return real_launch(h, stream)
        monkeypatch.setattr(fake, "cuGraphLaunch", graph_launch)

    def enqueue(kind, stream):
        captured = fake is not None and fake._capturing(stream.handle) is not None
        if captured:
            (err,) = fake._enqueue(stream.handle, "empty", {"tag": kind})
            assert not err
        log.append((kind, stream, captured))

    def graph_ms(nodes):
        """The launched graph's longest path."""
        done: dict = {}
        for n in nodes:  # creation order: every node after its dependencies
            done[int(n.id)] = max((done[d] for d in n.deps), default=0.0) + \
                graph_latency[n.params["tag"]]
        return max(done.values())

    class Buf:
        ptr = 0x1000

        @classmethod
        def allocate(cls, nbytes, stream):
            return cls()

        def copy_from_host(self, src, stream, sync=False):
            enqueue("h2d", stream)

        def copy_to_host(self, out, stream, sync=False):
            enqueue("d2h", stream)

        def close(self):
            pass

    class Kernel:
        def __init__(self, kind):
            self.kind = kind

        def pack(self, args):
            return tuple(args)

        def launch(self, stream, grid, block, packed):
            kind = self.kind
            if kind == "copy":  # the copy kernel: src is a device pointer for a D2H
                kind = "kh2d" if packed[0] == Buf.ptr else "kd2h"
            enqueue(kind, stream)

        def launch_config(self, grid, block):
            checked.append(self.kind)

    class Gated:
        def __init__(self, stream, repeats=5, warmup=1, gate_ms=None):
            self.stream = stream

        def median_ms(self, enqueue, others=()):
            start, graphs = len(log), len(launched)
            enqueue()
            items = log[start:]
            if len(launched) > graphs:  # the enqueue was a graph launch: nothing enqueued
                assert not items and len(launched) == graphs + 1 and not others
                timed.append(("graph", launched[-1]))
                return graph_ms(launched[-1])
            assert not any(captured for *_, captured in items)
            per: dict = {}
            for kind, stream, _ in items:
                per[stream.id] = per.get(stream.id, 0.0) + latency[kind]
            timed.append(({k for k, *_ in items}, {s.id for _, s, _ in items},
                          {o.id for o in others}))
            return max(per.values())

        def close(self):
            pass

    class Pinned:
        def __init__(self, n):
            self.array = np.zeros(n, np.uint8)

        @classmethod
        def empty(cls, n, dtype=np.uint8, device=None):
            return cls(n)

        def close(self):
            pass

    monkeypatch.setattr(od, "DeviceBuffer", Buf)
    monkeypatch.setattr(od, "Event", lambda *a, **k: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(od, "Stream", _FakeStream)
    monkeypatch.setattr(od, "PinnedBuffer", Pinned)
    monkeypatch.setattr(sustained, "GatedTimer", Gated)
    monkeypatch.setattr(ok, "load_kernel", lambda *a, **k: Kernel("copy"))
    host = np.zeros(16384, np.float32)  # 64 KiB
    dev = types.SimpleNamespace(sm_count=132, kernel_host_access=False, name="fake", ordinal=0,
                                pushed=contextlib.nullcontext)
    timer = BatchTimer(Kernel("kernel"), _FakeStream(dev), host, host, grid=16, block=256)
    timer.fakes = types.SimpleNamespace(launched=launched, checked=checked)
    return timer, log, timed


def test_the_sustained_times_are_measured_over_the_lanes(monkeypatch):
    """With ``streams=16`` every kind is timed on one stream and spread over 16 (pairs: 16 for
    the H2Ds and 16 more for the D2Hs), each with the other streams forked from the gate; the
    rate times come from the spread, the chain times from one stream."""
    lat = {"h2d": 8e-3, "d2h": 6e-3, "kernel": 1.2e-3, "kh2d": 3.7e-3, "kd2h": 1.4e-3}
    timer, log, timed = _fake_timer(monkeypatch, lat)
    su = timer.sustained(64, 1, streams=16, copy_kernel=True)
    assert (su.items, su.streams) == (64, 16)
    by_width = {w: [t for t in timed if len(t[1]) == w] for w in (1, 2, 16, 32)}
    assert sum(map(len, by_width.values())) == len(timed) == 14
    lanes, pairs = by_width[16], by_width[32]
    # H2D and D2H by copy engine and by copy kernel, and burn: on one stream and on 16
    assert sorted(k for t in by_width[1] for k in t[0]) == sorted(
        k for t in lanes for k in t[0]) == ["d2h", "h2d", "kd2h", "kernel", "kh2d"]
    # pairs by copy engine and by copy kernel: on 1 + 1 streams and on 16 + 16
    assert len(by_width[2]) == len(pairs) == 2
    for kinds, used, others in lanes:
        assert len(kinds) == 1 and others == used - {timer.stream.id}
    for kinds, used, others in pairs:
        assert len(kinds) == 2 and others == used - {timer.stream.id}
    # 64 items on 16 lanes: 4 after each other per lane; the faster mechanism counts
    assert su.h2d_ms == pytest.approx(4 * 3.7e-3 / 64) and su.d2h_ms == pytest.approx(
        4 * 1.4e-3 / 64)
    assert su.kernel_ms == pytest.approx(4 * 1.2e-3 / 64)
    assert su.pair_ms == pytest.approx(4 * 3.7e-3 / 64)
    assert su.copies == "H2D by copy kernel, D2H by copy kernel, pair by copy kernel"
    # a chain's steps: the items back to back on one stream
    assert su.chain == pytest.approx((3.7e-3, 1.2e-3, 1.4e-3))
    timer.close()


def test_without_copy_kernels_only_the_copy_engines_are_timed(monkeypatch):
    lat = {"h2d": 8e-3, "d2h": 6e-3, "kernel": 1.2e-3, "kh2d": 1e-9, "kd2h": 1e-9}
    timer, log, timed = _fake_timer(monkeypatch, lat)
    su = timer.sustained(12, 1, streams=3, copy_kernel=False)
    assert not any(k.startswith("k") and k != "kernel" for k, *_ in log)
    assert su.copies == "H2D by copy engine, D2H by copy engine, pair by copy engine"
    assert (su.items, su.streams) == (12, 3)
    assert su.h2d_ms == pytest.approx(4 * 8e-3 / 12) and su.h2d_chain_ms == pytest.approx(8e-3)
    assert {len(used) for _, used, _ in timed} == {1, 2, 3, 6}
    one = timer.sustained(12, 1, streams=1, copy_kernel=False)
    assert one.h2d_ms == one.h2d_chain_ms == pytest.approx(8e-3)
    timer.close()


# -- a run that is a CUDA graph: the sustained items as one graph ----------------------------------

_LAT = {"h2d": 8e-3, "d2h": 6e-3, "kernel": 1.2e-3, "kh2d": 3.7e-3, "kd2h": 1.4e-3}


def _graph_shape(nodes):
    """(nodes, chains) of a launched graph, checking that it is ``chains`` independent chains
    filled round-robin: the first ``chains`` nodes are roots, node j follows node j - chains
    alone (the items of one stream back to back, item i on stream i % chains)."""
    chains = sum(1 for n in nodes if not n.deps)
    for j, n in enumerate(nodes):
        want = [] if j < chains else [int(nodes[j - chains].id)]
        assert n.deps == want, (j, chains)
    return len(nodes), chains


def _released(fake):
    """Every graph and exec the fake made is destroyed and no stream is capturing."""
    return (fake.live_graphs == [] and all(e.graph is None for e in fake.execs.values())
            and not fake.capture)


def test_a_graph_run_times_the_sustained_items_as_one_graph_on_the_lanes(monkeypatch):
    """``launch="graph"``: each kind's K items are captured into one graph on the very streams
    they are spread over (a chain per stream, round-robin), instantiated, uploaded, launched
    behind the gate; the time is the graph's GPU time / K; every graph and exec is destroyed."""
    from orchestra.driver import live_handles
    from tests.fake_graph_cuda import install

    fake = install(monkeypatch)
    glat = {k: v / 2 for k, v in _LAT.items()}  # a graph runs each item in half the time
    before = live_handles().get("captured_graph", 0)
    timer, log, timed = _fake_timer(monkeypatch, _LAT, fake=fake, graph_latency=glat)
    su = timer.sustained(64, 1, streams=16, copy_kernel=True, launch="graph")
    assert su.launch == "graph" and su.launch_note == "launched as one CUDA graph"
    # nothing was enqueued outside a capture: the graph launches are all the GPU ran
    assert len(log) == 14 * 64 + 4 * 64 and all(captured for *_, captured in log)
    assert len(timed) == 14 and all(t[0] == "graph" for t in timed)
    for call in ("cuStreamBeginCapture", "cuStreamEndCapture", "cuGraphInstantiate",
                 "cuGraphUpload", "cuGraphLaunch", "cuGraphExecDestroy"):
        assert fake.counts[call] == 14, call
    assert _released(fake) and live_handles().get("captured_graph", 0) == before
    assert set(timer.fakes.checked) == {"kernel", "copy"}  # checked before any capture
    # H2D, D2H (engine and kernel) and burn: 64 items on 1 stream and on 16; pairs: 2 x 64
    # items on 1 + 1 streams and on 16 + 16
    shapes = sorted(_graph_shape(nodes) for _, nodes in timed)
    assert shapes == sorted([(64, 1)] * 5 + [(64, 16)] * 5 + [(128, 2)] * 2 + [(128, 32)] * 2)
    # the graph's longest path / K: 4 items after each other on each of 16 chains
    assert su.h2d_ms == pytest.approx(4 * glat["kh2d"] / 64)
    assert su.d2h_ms == pytest.approx(4 * glat["kd2h"] / 64)
    assert su.kernel_ms == pytest.approx(4 * glat["kernel"] / 64)
    assert su.pair_ms == pytest.approx(4 * glat["kh2d"] / 64)
    assert su.chain == pytest.approx((glat["kh2d"], glat["kernel"], glat["kd2h"]))
    assert su.copies == "H2D by copy kernel, D2H by copy kernel, pair by copy kernel"
    timer.close()


def test_an_eager_run_times_the_sustained_items_on_streams(monkeypatch):
    from tests.fake_graph_cuda import install

    fake = install(monkeypatch)
    timer, log, timed = _fake_timer(monkeypatch, _LAT, fake=fake,
                                    graph_latency={k: v / 2 for k, v in _LAT.items()})
    su = timer.sustained(64, 1, streams=16, copy_kernel=True)  # launch="stream", the default
    assert su.launch == "stream"
    assert not any(captured for *_, captured in log) and len(timed) == 14
    assert fake.counts["cuStreamBeginCapture"] == fake.counts["cuGraphLaunch"] == 0
    assert su.h2d_ms == pytest.approx(4 * _LAT["kh2d"] / 64)  # the stream model's times
    timer.close()


def test_both_launches_take_the_faster_of_each(monkeypatch):
    """``launch="both"`` (a bound shared by eager and graph contenders): every kind on streams
    and as a graph, the faster per kind."""
    from tests.fake_graph_cuda import install

    fake = install(monkeypatch)
    glat = dict(_LAT, kernel=_LAT["kernel"] / 3, kh2d=2 * _LAT["kh2d"])
    timer, log, timed = _fake_timer(monkeypatch, _LAT, fake=fake, graph_latency=glat)
    su = timer.sustained(64, 1, streams=16, copy_kernel=True, launch="both")
    assert su.launch == "both" and len(timed) == 28
    assert sum(t[0] == "graph" for t in timed) == 14 and _released(fake)
    assert su.kernel_ms == pytest.approx(4 * glat["kernel"] / 64)  # the graph was faster
    assert su.h2d_ms == pytest.approx(4 * _LAT["kh2d"] / 64)     # the streams were
    assert su.chain == pytest.approx((_LAT["kh2d"], glat["kernel"], _LAT["kd2h"]))
    timer.close()


@pytest.mark.parametrize("fail", [("cuGraphLaunch", 3), ("cuGraphInstantiate", 2),
                                  ("cuGraphUpload", 5), ("enqueue", 4)])
def test_a_failure_while_timing_as_a_graph_releases_every_graph(monkeypatch, fail):
    """A driver call that fails part-way (a launch, an instantiation, an upload) or an item
    that cannot be enqueued inside a capture: the error propagates, and every graph and exec
    made so far is destroyed, no stream is left capturing, no handle is left live."""
    from orchestra.driver import live_handles
    from orchestra.errors import CudaError
    from tests.fake_graph_cuda import install

    fake = install(monkeypatch)
    before = live_handles().get("captured_graph", 0)
    timer, log, timed = _fake_timer(monkeypatch, _LAT, fake=fake,
                                    graph_latency={k: v / 2 for k, v in _LAT.items()})
    call, nth = fail
    if call == "enqueue":  # the nth capture's 10th item raises while the streams capture
        real = fake._enqueue
        seen = []

        def enqueue(stream, kind, params, programmatic=False):
            if fake.counts["cuStreamBeginCapture"] == nth:
                seen.append(1)
                if len(seen) == 10:
                    raise RuntimeError("cannot enqueue")
            return real(stream, kind, params, programmatic)
        monkeypatch.setattr(fake, "_enqueue", enqueue)
        with pytest.raises(RuntimeError, match="cannot enqueue"):
            timer.sustained(64, 1, streams=16, copy_kernel=True, launch="graph")
        assert fake.counts["cuGraphInstantiate"] == nth - 1
    else:
        fake.fail[call] = nth
        with pytest.raises(CudaError, match=call):
            timer.sustained(64, 1, streams=16, copy_kernel=True, launch="graph")
        assert fake.counts[call] == nth
    assert fake.counts["cuStreamBeginCapture"] >= 1
    assert _released(fake) and live_handles().get("captured_graph", 0) == before
    # one graph per capture, each destroyed once (an aborted capture's by the capture)
    assert fake.counts["cuGraphDestroy"] == fake.counts["cuStreamEndCapture"]
    assert fake.counts["cuGraphExecDestroy"] == fake.counts["cuGraphInstantiate"] - (
        call == "cuGraphInstantiate")  # the failed instantiation made no exec
    timer.close()


def test_an_unknown_launch_is_refused_before_anything_is_timed(monkeypatch):
    timer, log, timed = _fake_timer(monkeypatch, _LAT)
    with pytest.raises(ValueError, match="launched as one of stream, graph, both"):
        timer.measure(1, items=16, launch="graphs")
    assert log == [] and timed == []
    with pytest.raises(ValueError, match="Sustained.launch"):
        Sustained(4, 16, 1.0, 1.0, 1.0, 1.0, launch="cuda graph")
    timer.close()


def test_items_grow_with_the_streams():
    from orchestra.app.job.sustained import items_for

    assert items_for(1024, 65536) == 16 and items_for(1024, 65536, streams=3) == 48
    assert items_for(1024, 65536, streams=16) == 256  # 16 per lane
    assert items_for(20, 65536, streams=16) == 20    # never more than the pipeline has
    assert items_for(1024, 64 << 20, streams=16) == 16  # at most 1 GiB of items

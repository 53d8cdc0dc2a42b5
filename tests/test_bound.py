"""The pipeline bound from given sustained times (orchestra.app.job.bound): fill and drain,
duplex overlap, one batch, kernel-bound and copy-bound pipelines, ragged batches, the loud
warning, and the link term's small linear program against a brute-force search."""

import itertools

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

"""`orchestra.graph.collector.paused`: the cyclic collector off during schedule() / verify(),
back as it was afterwards, also with nesting, threads and errors."""

from __future__ import annotations

import gc
import threading

import pytest

from orchestra.graph import KernelRef, build_pipeline
from orchestra.graph.collector import paused
from orchestra.schedule import schedule, verify

K = KernelRef("k.cu", "k")


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_turns_the_collector_off_and_back_on(collector_on):
    with paused():
        assert not gc.isenabled()
        with paused():  # nested
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError):
        with paused():
            1 / 0
    assert gc.isenabled()


def test_paused_keeps_a_collector_the_program_turned_off_off(collector_on):
    gc.disable()
    with paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_concurrent_pauses_end_with_the_last_one(collector_on):
    entered, release = threading.Event(), threading.Event()

    def worker():
        with paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    with paused():  # this thread's pause ends first: the worker's keeps the collector off
        assert not gc.isenabled()
    assert not gc.isenabled()
    release.set()
    t.join(10)
    assert gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_schedule_and_verify_run_without_the_collector_and_leave_it_as_it_was(
        enabled, collector_on):
    g, _ = build_pipeline(6, 4096, K, scalars=(), in_flight=2)
    seen = []

    def cost(node):  # called inside schedule(): the collector is off there
        seen.append(gc.isenabled())
        return 1.0

    if not enabled:
        gc.disable()
    plan = schedule(g, "critical-path", 3, costs=cost)
    assert seen and not any(seen)
    assert verify(plan, g) == []
    assert gc.isenabled() is enabled

"""Many threads querying one task graph at once: a graph `build_pipeline` made keeps its tables
by name unmade until something asks (`TaskGraph._add_known`), and the first threads to ask
must not see them half made (schedule() and verify() from many threads on one graph)."""

from __future__ import annotations

import sys
import threading

import pytest

from orchestra.graph import KernelRef, build_pipeline
from orchestra.schedule import POLICIES, schedule, verify

K = KernelRef("k.cu", "k")


@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads interleave often: a half-made table is seen
    yield
    sys.setswitchinterval(old)


def test_schedule_and_verify_from_many_threads_on_a_fresh_pipeline(fast_switching):
    expected = {p: schedule(build_pipeline(40, 4096, K, in_flight=3)[0], p, 5).to_json()
                for p in POLICIES}
    for _trial in range(3):
        g, _ = build_pipeline(40, 4096, K, in_flight=3)  # tables by name not made yet
        start = threading.Barrier(12)
        got: list = []

        def work(i):
            try:
                start.wait()
                policy = POLICIES[i % len(POLICIES)]
                if i % 3 == 0:
                    g.edges  # the edge dicts by name, made by whichever thread asks first
                plan = schedule(g, policy, 5)
                got.append((policy, plan.to_json(), verify(plan, g)))
            except Exception as exc:  # noqa: BLE001 - reported below, with its thread
                got.append((i, type(exc).__name__, str(exc)))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [r for r in got if not isinstance(r[0], str)]
        assert errors == []
        assert len(got) == 12
        for policy, text, findings in got:
            assert text == expected[policy]
            assert findings == []

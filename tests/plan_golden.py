"""The graphs whose one-device plans must stay byte-identical (tests/test_multigpu_plan.py):
``python -m tests.plan_golden OUT.json`` writes the SHA-256 of every ``Plan.to_json()`` of
them (tests/data/plan_json_golden.json was written by the code before plans had devices)."""

from __future__ import annotations

import hashlib
import json
import sys


def golden_plans() -> dict[str, str]:
    from orchestra.app.job.graphs import build_job_graph, build_staged_graph
    from orchestra.graph import (Buffer, GraphBuilder, HostBuffer, HostFunc, KernelRef,
                                 build_pipeline)
    from orchestra.schedule import schedule

    ref = KernelRef("k.cu", "burn", params=("const float* x", "float* y", "size_t n",
                                            "int iters", "float s", "float t"))
    graphs = {
        "job6": build_job_graph([4096] * 6, iters=3).graph,
        "job_ragged": build_job_graph([4096] * 4 + [1024], iters=2, in_flight=2).graph,
        "staged": build_staged_graph([4096] * 5, slots=2, iters=1).graph,
        "pipeline": build_pipeline(7, 2048, ref, in_flight=3)[0],
    }
    with GraphBuilder() as g:
        h = g.host_input("in", 4096)
        o = g.host_output("out", 4096)
        x = g.to_device(h)
        y = g.device_buffer(4096)
        g.kernel(ref, 4, 256, (x, y, 1024, 1, 1.0, 0.0))
        g.host_func(lambda: None, reads=[h])
        g.to_host(y, o)
    graphs["builder"] = g.graph
    out = {}
    for gname, graph in graphs.items():
        for policy in ("round-robin", "by-engine", "critical-path", "concurrent"):
            for streams in (1, 2, 3, 5):
                plan = schedule(graph, policy, streams)
                out[f"{gname}/{policy}/{streams}"] = plan.to_json()
    return out


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump({k: digest(v) for k, v in golden_plans().items()}, f, indent=0,
                  sort_keys=True)

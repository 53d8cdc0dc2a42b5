"""`orchestra plan`: the plan `orchestra run` would execute, without a GPU.

Builds the same task graph from the same options, schedules it and prints the per-stream listing
and the counts of nodes, edges, events and waits (``--json``: one JSON object). The critical-path
policy needs cost estimates: here it uses the default cost model (copies at 50 GB/s, a kernel as
long as its input's copy), while `orchestra run` measures the copies and the kernel first.
"""

from __future__ import annotations

from orchestra.cli.job_options import add_graph_options, fmt_bytes

COST_NOTE = ("default cost model (no GPU measurements): copies at 50 GB/s, a kernel as long as "
             "its input's copy; `orchestra run` measures them first")


def register(sub) -> None:
    p = sub.add_parser("plan", help="print the main job's plan (streams, nodes, events); "
                                    "no GPU needed")
    add_graph_options(p)
    p.add_argument("--summary", action="store_true",
                   help="print the counts only, not the per-stream listing")
    p.set_defaults(func=run)


def build(args):
    """(graph, plan, info) for the options: the graph `orchestra run` would build."""
    from orchestra.job import (
        batch_bytes_from_mib, batch_sizes, build_job_graph, build_staged_graph,
    )
    from orchestra.schedule import schedule

    iters = 1 if args.compute_iters == "auto" else args.compute_iters
    batch_bytes = batch_bytes_from_mib(args.batch_mib)
    per = batch_bytes // 4
    source = None
    if args.input:
        from orchestra.job.inputs import open_input

        inp = open_input(args.input)  # what `orchestra run --input` accepts, and nothing else
        sizes = batch_sizes(inp.size, per)
        slots = max(1, min(args.staging_slots, len(sizes)))
        jg = build_staged_graph(sizes, slots=slots, iters=iters, block=args.block)
        source = f"{args.input} ({inp.size} float32, {len(sizes)} batches, {slots} staging slots)"
    else:
        sizes = batch_sizes(args.batches * per, per)
        jg = build_job_graph(sizes, iters=iters, block=args.block)
    plan = schedule(jg.graph, args.policy, args.streams)
    return jg, plan, source


def run(args) -> int:
    from orchestra.schedule import estimate_makespan, json_text

    jg, plan, source = build(args)
    graph = jg.graph
    makespan_ms = estimate_makespan(plan, graph) / 1e3
    info = {
        "batches": len(jg.sizes),
        "batch_bytes": max(jg.sizes),
        "data_bytes": jg.total_bytes,
        "policy": args.policy,
        "streams": len(plan.streams),
        "streams_requested": args.streams,
        "nodes": len(graph),
        "edges": len(graph.edges),
        "events": plan.event_count,
        "waits": plan.wait_count,
        "compute_iters": args.compute_iters,
        "input": args.input,
        "cost_model": COST_NOTE,
        "estimated_makespan_ms": round(makespan_ms, 3),
    }
    if args.json:
        # json.dumps(..., indent=1, sort_keys=True)'s text, fast on long plans
        print(json_text.dumps({**info, "plan": plan.to_dict()}, indent=1))
        return 0
    what = source or (f"{info['batches']} batches x {fmt_bytes(info['batch_bytes'])} "
                      f"({fmt_bytes(info['data_bytes'])})")
    streams = f"{info['streams']} stream(s)"
    if info["streams"] < args.streams:
        streams += f" (of {args.streams} requested: no node would run on the others)"
    print(f"orchestra plan: {what}, policy {args.policy}, {streams}, "
          f"compute iters {args.compute_iters}")
    if not args.summary:
        print(plan)
    print(f"counts: {info['nodes']} nodes, {info['edges']} edges, {info['events']} events, "
          f"{info['waits']} waits, {info['streams']} streams")
    print(f"estimated makespan: {makespan_ms:.3f} ms ({COST_NOTE})")
    if args.policy == "critical-path":
        print("critical-path placed the nodes with the default cost model: no GPU is used here")
    return 0

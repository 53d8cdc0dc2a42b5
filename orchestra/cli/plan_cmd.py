"""`orchestra plan`: the plan `orchestra run` would execute, without a GPU.

Builds the same task graph from the same options, schedules it and prints the per-stream listing
(each host copy that ``--executor`` with ``--copy-lowering`` would run as a copy kernel marked
``[copy kernel]``, by the default crossover) and the counts of nodes, edges,
events, waits and copy lowerings (``--json``: one JSON object). The critical-path
policy needs cost estimates: here it uses the default cost model (copies at 50 GB/s, a kernel as
long as its input's copy), while `orchestra run` measures the copies and the kernel first.
"""

from __future__ import annotations

import argparse
import gc
import logging

from orchestra.cli import progress
from orchestra.errors import counted
from orchestra.cli.job_options import (
    DEFAULT_STAGING_SLOTS, add_graph_options, check_options, device_budget, fmt_bytes,
)

log = logging.getLogger(__name__)

COST_NOTE = ("default cost model (no GPU measurements): copies at 50 GB/s, a kernel as long as "
             "its input's copy; `orchestra run` measures them first")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the main job's plan (streams, nodes, events); "
                                    "no GPU needed")
    add_graph_options(p)
    p.add_argument("--executor", choices=("eager", "capture", "graph"), default="eager",
                   help="the executor `orchestra run --executor` would use: it decides which "
                        "crossover the copy lowering uses (eager, or the CUDA graph "
                        "executors); default eager")
    p.add_argument("--summary", action="store_true",
                   help="print the counts only, not the per-stream listing")
    p.set_defaults(func=run)


def build(args: argparse.Namespace, update: progress.Update = progress._noop):
    """(job graph, plan, source description, memory needs, `PolicyChoice`, `copy_lowering`'s
    dict) for the options: the graph `orchestra run` would build, after the checks `run` makes
    (`check_options`), scheduled with the policy and streams ``auto`` resolves to."""
    from orchestra.app.job import (
        batch_bytes_from_mib, batch_sizes, build_job_graph, build_staged_graph, open_input,
    )
    from orchestra.app.job.policy import choose_policy
    from orchestra.schedule import schedule

    iters = 1 if args.compute_iters == "auto" else args.compute_iters
    per = batch_bytes_from_mib(args.batch_mib) // 4
    source = None
    if args.input:
        inp = open_input(args.input)  # what `orchestra run --input` accepts, and nothing else
        needs = check_options(args, "plan", input_elements=inp.size)
        sizes = batch_sizes(inp.size, per)
        slots = max(1, min(args.staging_slots or DEFAULT_STAGING_SLOTS, len(sizes)))
        update(0, total=3,
               description=f"plan: building the graph ({counted(len(sizes), 'batch')})")
        jg = build_staged_graph(sizes, slots=slots, iters=iters, block=args.block)
        source = (f"{args.input} ({inp.size} float32, {counted(len(sizes), 'batch')}, "
                  f"{counted(slots, 'staging slot')})")
        in_flight = slots  # a slot's next batch waits for the one before it
    else:
        needs = check_options(args, "plan")
        sizes = batch_sizes(needs["batches"] * per, per)
        update(0, total=3,
               description=f"plan: building the graph ({counted(len(sizes), 'batch')})")
        jg = build_job_graph(sizes, iters=iters, block=args.block,
                             device_budget=device_budget(args))
        in_flight = needs["in_flight"]
    log.debug("plan: task graph of %d nodes, %d edges", len(jg.graph), jg.graph.edge_count)
    copies = copy_lowering(args, jg.graph)
    c = copies["info"]
    choice = choose_policy(args.policy, args.streams, copies=c["copies"],
                           copy_kernels=c["copy_kernels"], batches=len(sizes),
                           in_flight=in_flight, executor=f"{args.executor} executor",
                           eager=args.executor == "eager")
    update(1, description=f"plan: scheduling {len(jg.graph)} nodes ({choice.policy})")
    plan = schedule(jg.graph, choice.policy, choice.streams)
    log.debug("plan: %d streams, %d events, %d waits", len(plan.streams), plan.event_count,
              plan.wait_count)
    return jg, plan, source, needs, choice, copies


def run(args: argparse.Namespace) -> int:
    # The command builds one large graph and plan that live until it returns: the cyclic
    # garbage collector finds nothing to free in them, but its full passes over millions of
    # node records took about a third of a 50,000-batch plan's time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(args)
    finally:
        if was_enabled:
            gc.enable()


def _run(args: argparse.Namespace) -> int:
    from orchestra.schedule import estimate_makespan, json_text

    if args.json and args.summary:
        log.warning("--summary does not apply with --json (the JSON object holds the counts "
                    "and the plan)")
    with progress.task("plan", total=3) as update:
        jg, plan, source, needs, choice, copies = build(args, update)
        update(2, description="plan: estimating the makespan")
        graph = jg.graph
        makespan_ms = estimate_makespan(plan, graph) / 1e3
        info = {
            "batches": len(jg.sizes),
            "batch_bytes": max(jg.sizes),
            "data_bytes": jg.total_bytes,
            "policy": choice.policy,
            "policy_requested": args.policy,
            "policy_choice": choice.as_dict(),
            "streams": len(plan.streams),
            "streams_requested": args.streams,
            "nodes": len(graph),
            "edges": graph.edge_count,
            "events": plan.event_count,
            "waits": plan.wait_count,
            "compute_iters": args.compute_iters,
            "input": args.input,
            "pinned_bytes": needs["pinned_bytes"],
            "device_batch_bytes": needs["device_batch_bytes"],
            "device_peak_bytes": needs["device_peak_bytes"],
            "in_flight": needs["in_flight"],
            "cost_model": COST_NOTE,
            "estimated_makespan_ms": round(makespan_ms, 3),
        }
        info["copy_lowering"] = copies["info"]
        update(3, description="plan: formatting")
        # json_text.dumps: json.dumps(..., indent=1, sort_keys=True)'s text, fast on long plans
        text = (json_text.dumps({**info, "plan": plan.to_dict()}, indent=1)
                if args.json else format_text(args, info, plan, source, copies["notes"],
                                              choice))
    print(text)  # after the bar is gone
    return 0


def copy_lowering(args: argparse.Namespace, graph) -> dict:
    """How the executor would lower the job's host copies, without a GPU: the default crossover
    (`orchestra run` uses the table measured for its device, when there is one) on a device
    whose kernels can address pinned host memory. ``{"info": JSON-able summary, "notes": node
    name -> "copy kernel" for each copy lowered to the copy kernel}`` (the listing marks those;
    the others run on copy engines, as every copy did before)."""
    from orchestra.execute.lowering.copy_policy import DEFAULT_CROSSOVER, CopyPolicy
    from orchestra.graph.bodies import walk

    mode = "eager" if args.executor == "eager" else "graph"
    policy = CopyPolicy(args.copy_lowering, mode, DEFAULT_CROSSOVER, True, "the GPU")
    copies = [n for n, _ in walk(graph) if n.kind in ("h2d", "d2h")]  # bodies' copies too
    # what choose() reads of a copy: its kind, its own lowering and its size (a long pipeline
    # has 100,000 copies of a few shapes)
    chosen: dict[tuple, str] = {}
    kernels = []
    for n in copies:
        key = (n.kind, getattr(n, "lowering", "auto"), n.nbytes)
        how = chosen.get(key)
        if how is None:
            how = chosen[key] = policy.choose(n)
        if how == "kernel":
            kernels.append(n.name)
    notes = dict.fromkeys(kernels, "copy kernel")
    info = {"lowering": args.copy_lowering, "executor": args.executor, "mode": mode,
            "copies": len(copies), "copy_kernels": len(notes),
            "copy_engine": len(copies) - len(notes),
            "crossover": {k: v for k, v in DEFAULT_CROSSOVER.as_dict().items()
                          if k != "measured"},
            "summary": policy.summary()}
    return {"info": info, "notes": notes}


def format_text(args: argparse.Namespace, info: dict, plan, source: str | None,
                notes: dict | None = None, choice=None) -> str:
    """The human-readable listing `orchestra plan` prints (``choice``: the `PolicyChoice`)."""
    what = source or (f"{counted(info['batches'], 'batch')} x "
                      f"{fmt_bytes(info['batch_bytes'])} "
                      f"({fmt_bytes(info['data_bytes'])})")
    asked = choice.streams if choice is not None else args.streams
    streams = counted(info["streams"], "stream")
    if info["streams"] < asked:
        streams += f" (of {asked} requested: no node would run on the others)"
    lines = [f"orchestra plan: {what}, policy {info['policy']}, {streams}, "
             f"compute iters {args.compute_iters}"]
    if choice is not None:
        lines.append(f"policy choice: {choice.describe()}")
    if not args.summary:
        lines.append(plan.text(notes))
    c = info.get("copy_lowering")
    lines += [
        "counts: " + ", ".join(counted(info[k], k[:-1]) for k in
                               ("nodes", "edges", "events", "waits", "streams")),
    ]
    if c is not None:
        lines.append(f"copies ({c['executor']} executor): {c['copies']}, {c['copy_kernels']} as "
                     f"copy kernels, {c['copy_engine']} on copy engines; {c['summary']} "
                     "(no GPU asked: `orchestra run` uses the table measured for its device, "
                     "`orchestra tune copies`)")
    lines += [
        f"memory: {fmt_bytes(info['pinned_bytes'])} pinned host, "
        f"{fmt_bytes(info['device_batch_bytes'])} device per batch, up to "
        f"{fmt_bytes(info['device_peak_bytes'])} with "
        + ("every batch in flight" if info.get("in_flight") is None
           else f"at most {counted(info['in_flight'], 'batch')} in flight "
                "(--device-budget-mib)"),
        f"estimated makespan: {info['estimated_makespan_ms']:.3f} ms ({COST_NOTE})",
    ]
    if info["policy"] == "critical-path":
        lines.append("critical-path placed the nodes with the default cost model: no GPU is "
                     "used here")
    return "\n".join(lines)

"""The ``orchestra bench serve`` subcommand's options (registered by `orchestra.cli.bench`)."""

from __future__ import annotations

import sys

MODES = ("all", "latency", "closed", "open", "asyncio", "soak")

# Upper limits of the counts, checked before anything is made (a huge count used to start
# threads, tasks or instances until MemoryError). Each is far past what measures anything new
# and still runs on one machine:
# - threads: each is a thread of this process with its own stack, and in the closed loop
#   without batching (and the soak, with a 256 KiB ring of samples) its own engine instance
#   of every bucket, whatever --instances says (so up to 4096 there); past a few dozen
#   the GIL's hand-offs, not the thread count, set the requests/s (docs/serving.md), and Linux
#   starts 4096 threads without tuning (their stacks are reserved, not resident).
MAX_THREADS = 4096
# - instances per bucket: each holds its own device buffers, pinned staging and CUDA graph,
#   all built at warm-up, and a GPU runs at most 128 kernels at once (CUDA's limit of
#   resident grids per device): 8 times that is more than ever run a bucket's requests
#   together.
MAX_INSTANCES = 1024
# - asyncio tasks: each task and its input picker (a seeded random.Random) take about 4 KiB
#   before the load starts, so 1,000,000 are about 4 GiB (and the default 20 requests each,
#   20,000,000 latencies); a server's connections per process are far fewer.
MAX_TASKS = 1_000_000
# - requests in flight per thread in the closed loop: each holds its output until its thread
#   waits for it (64 KiB requests: 4 GiB per thread at the limit), so --threads x --window x
#   the largest request is also checked against the machine's memory; by Little's law 65536
#   in flight at the ~35,000 requests/s one process serves is about 2 s of queueing each.
MAX_WINDOW = 65536
# - requests: every request's latency is kept until the table is printed (up to 32 bytes each
#   in the asyncio load's list: 100,000,000 are about 3 GiB), and at ~35,000 requests/s per
#   process 100,000,000 take about 48 minutes: longer than any soak this measures.
MAX_REQUESTS = 100_000_000


def register(bsub) -> None:
    p = bsub.add_parser(
        "serve", help="the serving engine under load, with bare cuda-python and PyTorch peers",
        description="Serve float32 requests through orchestra.serve.Engine (H2D, a kernel, D2H "
                    "per request) and, in the same run, through bare cuda-python and PyTorch "
                    "CUDA graph replay; every output is checked bit for bit. Exit status 1 when "
                    "an output is wrong, a bad request was not refused, or a worker process "
                    "of --processes failed.")
    p.add_argument("--mode", choices=MODES, default="all",
                   help="latency (one thread), closed (threads in a closed loop), open "
                        "(Poisson arrivals), asyncio (many tasks, event-loop lag), soak "
                        "(long run, 1%% bad requests, memory first/last), all = latency + "
                        "closed (default)")
    p.add_argument("--mix", "--size", dest="mix", default="64K",
                   help="request sizes with weights, e.g. 64K or 4K:1,64K:8,256K:1 "
                        "(default 64K)")
    p.add_argument("--row-kib", type=float, default=4.0,
                   help="KiB per row (axis 0 of a request; buckets and batches count rows; "
                        "default 4)")
    p.add_argument("--iters", type=int, default=1,
                   help="kernel steps per element (default 1)")
    p.add_argument("--threads", type=int, default=8,
                   help=f"submitting threads (default 8, at most {MAX_THREADS})")
    p.add_argument("--window", type=int, default=1,
                   help=f"requests in flight per thread in the closed loop (default 1, at "
                        f"most {MAX_WINDOW}, and --threads x --window requests' outputs "
                        f"must fit in this machine's memory)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds per contender (closed, open; default 3) or the soak's limit "
                        "(default 600: the soak stops at --requests or this, whichever first)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per contender (latency, default 2,000), in all (asyncio, "
                        "default 20 per task; soak, default 1,000,000, or --duration first; "
                        f"at most {MAX_REQUESTS:,})")
    p.add_argument("--tasks", type=int, default=1000,
                   help=f"asyncio tasks (default 1,000, at most {MAX_TASKS:,})")
    p.add_argument("--rate", type=float, default=10_000.0,
                   help="offered requests/s in the open loop (default 10,000)")
    p.add_argument("--batching", choices=("off", "on", "both"), default="both",
                   help="dynamic batching off, on, or both in turn (default both)")
    p.add_argument("--dispatch", choices=("caller", "thread", "both"), default="both",
                   help="without batching: the caller's thread launches, a dispatcher thread "
                        "does, or both in turn (default both); with batching, thread: the "
                        "batcher thread forms and launches every batch, else the thread that "
                        "fills a batch or gives an instance back does")
    p.add_argument("--max-batch", type=int, default=None,
                   help="rows per dynamic batch (default 8 of the largest request)")
    p.add_argument("--max-delay-us", type=float, default=200.0,
                   help="how long a batch waits for more requests, us (default 200)")
    p.add_argument("--instances", type=int, default=2,
                   help=f"instances per bucket (default 2, at most {MAX_INSTANCES}; the "
                        f"closed loop without batching uses at least one per thread)")
    p.add_argument("--executor", choices=("graph", "capture", "eager"), default="graph",
                   help="how instances run (default graph: explicitly built CUDA graphs)")
    p.add_argument("--memory", choices=("external", "graph"), default="external",
                   help="device buffers per instance: allocated once (external, default) or "
                        "graph allocations (alloc/free nodes)")
    p.add_argument("--no-peers", action="store_true",
                   help="skip the bare cuda-python and PyTorch peers")
    p.add_argument("--device", type=int, default=0, help="device ordinal (0)")
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: the engine runs on NumpyBackend with a device thread (launches "
                        "complete on a worker thread, as on a GPU), to measure and profile the "
                        "engine's host path; no peers")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="asyncio: leave the garbage collector as it is (default: gc.freeze() "
                        "after the warm-up, as docs/serving.md recommends for a lag bound)")
    p.add_argument("--gc-young-ms", type=float, default=None,
                   help="asyncio: gc.disable() during the load and a collection of the young "
                        "generation every this many ms from the event loop, as "
                        "docs/serving.md recommends for a lag bound (default 5; 0: the "
                        "automatic collector; refused with the other modes)")
    p.add_argument("--arrivals-per-turn", type=int, default=None, metavar="N",
                   help="asyncio: tasks started per event-loop iteration while the load "
                        "ramps up, as a server's connections arrive (default 8); each first "
                        "step submits a request, so N adds to an iteration's work as "
                        "--completions-per-turn does")
    p.add_argument("--no-host-probe", action="store_true",
                   help="asyncio: leave out the separate process that measures the host's own "
                        "stalls during the load (it keeps one CPU busy, and runs only with 4 CPUs "
                        "or more; by default its stalls are matched against the late loop "
                        "samples)")
    p.add_argument("--lag-probe", choices=("auto", "timerfd", "thread"), default="auto",
                   help="asyncio: how the event loop's lag is measured: timerfd, a timer file "
                        "descriptor the loop watches becomes readable at known instants (the "
                        "lag a socket's data sees; Linux); thread, a thread hands the loop a "
                        "callback at known instants (that also counts the thread's own wait "
                        "for the GIL and a CPU); auto (default): timerfd where Linux has it, else "
                        "thread, and the output says why")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="asyncio: the event loop the tasks run on: asyncio's own (default) or "
                        "uvloop's (libuv, as uvicorn uses; pip install 'orchestra[uvloop]')")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the run, in ms (default: Python's 5 ms)")
    p.add_argument("--completions-per-turn", type=int, default=None, metavar="N",
                   help="asyncio: awaited requests the engine resolves per event-loop "
                        "iteration at most (default: the engine's own, 16 in process and 4 "
                        "with --process; fewer: shorter iterations, so less lag, for a little "
                        "more loop overhead per request)")
    p.add_argument("--process", action="store_true",
                   help="closed, asyncio: run the engine in a process of its own "
                        "(orchestra.serve.ProcessEngine: requests through shared memory; with "
                        "asyncio the event loop reads the completions itself)")
    p.add_argument("--processes", type=int, default=1, metavar="K",
                   help="closed: split --threads over K processes, each with its own engine "
                        "(and its own peers) on the same GPU, their measured windows started "
                        "together: what K server processes serve at once, past one Python "
                        "process's GIL (default 1)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw the latency CDF of every contender (needs matplotlib)")
    p.set_defaults(func=run_cmd,
                   no_device_hint=" (orchestra bench serve runs kernels: it needs an NVIDIA GPU)")


def _check_numbers(args) -> None:
    """Every option checked before the device is opened (a bad option is exit 2 with or
    without a GPU, never 3): counts >= 1, finite positive rates and durations, the size mix
    and row size the workload will parse, and --plot's folder and matplotlib."""
    import math

    from orchestra.errors import BenchConfigError, int_text
    from orchestra.serve.bench import parse_mix

    for name in ("threads", "window", "tasks", "instances", "iters", "processes"):
        if getattr(args, name) < 1:
            raise BenchConfigError(f"--{name.replace('_', '-')} must be >= 1")
    for name, limit, what in (
            ("threads", MAX_THREADS, "each is a thread of this process, and without batching "
                                     "an engine instance of every bucket; past a few dozen "
                                     "the GIL, not the thread count, sets the requests/s"),
            ("instances", MAX_INSTANCES, "per bucket, each with its own device buffers, "
                                         "staging and graph built at warm-up; a GPU runs at "
                                         "most 128 kernels at once"),
            ("tasks", MAX_TASKS, "each task and its input picker take about 4 KiB before "
                                 "the load starts"),
            ("window", MAX_WINDOW, "requests in flight per thread, each holding its output "
                                   "until its thread waits for it"),
            ("requests", MAX_REQUESTS, "each request's latency is kept until the table is "
                                       "printed")):
        value = getattr(args, name)
        if value is not None and value > limit:
            raise BenchConfigError(f"--{name} must be at most {limit:,} ({what}), got "
                                   f"{int_text(value)}; pass a smaller --{name}")
    for name in ("requests", "max_batch", "completions_per_turn", "arrivals_per_turn"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise BenchConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name, value in (("duration", args.duration), ("rate", args.rate),
                        ("switch-interval-ms", args.switch_interval_ms),
                        ("row-kib", args.row_kib)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BenchConfigError(f"--{name} must be a finite number > 0, got {value}")
    if args.gc_young_ms is not None and not (math.isfinite(args.gc_young_ms)
                                             and args.gc_young_ms >= 0):
        raise BenchConfigError(f"--gc-young-ms must be a finite number >= 0, got "
                               f"{args.gc_young_ms}")
    if not (math.isfinite(args.max_delay_us) and args.max_delay_us >= 0):
        raise BenchConfigError(f"--max-delay-us must be a finite number >= 0, got "
                               f"{args.max_delay_us}")
    if args.processes > 1:
        if args.mode not in ("closed", "all"):
            raise BenchConfigError(f"--processes applies to the closed loop (--mode closed or "
                                   f"all), not --mode {args.mode}")
        if args.process:
            raise BenchConfigError("--processes and --process are two ways to use processes; "
                                   "pass one of them")
        from orchestra.serve.bench_processes import split_threads

        split_threads(args.threads, args.processes)  # BenchConfigError: fewer threads
    # options of the asyncio load alone, refused elsewhere rather than taken and left unused
    # (--mode all is latency + closed: no asyncio load)
    asyncio_only = [f"--{name.replace('_', '-')}" for name in
                    ("arrivals_per_turn", "completions_per_turn", "gc_young_ms", "loop",
                     "lag_probe")
                    if getattr(args, name) not in (None, "asyncio", "auto")]
    asyncio_only += [flag for flag, given in (("--no-gc-freeze", args.no_gc_freeze),
                                              ("--no-host-probe", args.no_host_probe)) if given]
    if asyncio_only and args.mode != "asyncio":
        raise BenchConfigError(f"{', '.join(asyncio_only)} appl"
                               f"{'ies' if len(asyncio_only) == 1 else 'y'} to the asyncio "
                               f"load (--mode asyncio), not --mode {args.mode}")
    if args.loop != "asyncio":
        from orchestra.serve.bench import loop_runner

        loop_runner(args.loop)  # BenchConfigError when uvloop is not installed
    if args.rate < 1:  # below one request a second the Poisson gaps overflow the clock
        raise BenchConfigError(f"--rate must be at least 1 request/s, got {args.rate:g}")
    if args.max_delay_us > 1e6:  # a batch that never fills would outwait the whole run
        raise BenchConfigError(f"--max-delay-us must be at most 1,000,000 (1 s): a batch that "
                               f"does not fill waits that long; got {args.max_delay_us:g}")
    # upper limits: what the kernel and the waits can take (each once failed or hung later)
    import threading

    if args.iters > 2**31 - 1:  # serve_burn's int iters
        raise BenchConfigError(f"--iters must be at most {2**31 - 1} (the kernel's int "
                               f"parameter), got {int_text(args.iters)}")
    if args.duration is not None and args.duration > threading.TIMEOUT_MAX:  # a wait's timeout
        raise BenchConfigError(f"--duration is beyond the longest wait Python can make "
                               f"({threading.TIMEOUT_MAX:.3g} s), got {args.duration:g}")
    row_floats = int(args.row_kib * 256)
    if row_floats < 1:
        raise BenchConfigError(f"--row-kib {args.row_kib}: a row must hold at least one float32 "
                               "(--row-kib 0.00390625 or more)")
    try:
        mix = parse_mix(args.mix)
    except ValueError as exc:  # a weight that is not a number (float('x'))
        if isinstance(exc, BenchConfigError):
            raise
        raise BenchConfigError(f"--mix {args.mix!r}: give SIZE[:WEIGHT],... with a number "
                               "> 0 as each weight, e.g. 4K:1,64K:8") from None
    row_bytes = 4 * row_floats
    for nbytes, weight in mix:
        if not math.isfinite(weight):
            raise BenchConfigError(f"--mix {args.mix!r}: weights must be finite numbers > 0")
        if nbytes % row_bytes:
            raise BenchConfigError(f"--mix {args.mix!r}: request size {nbytes} bytes is not a "
                                   f"whole number of {row_bytes}-byte rows; pick a multiple or "
                                   "change --row-kib")
    from orchestra.cli.job_options import fmt_bytes, host_memory_bytes

    host = host_memory_bytes()
    from orchestra.serve.bench import POOL

    # the workload makes POOL requests of every size before the load, each with its expected
    # output as an array and as bytes (and numpy's float64 draw of it for a moment): a size
    # past the machine's memory failed there with numpy's "Maximum allowed dimension
    # exceeded", or was killed for memory
    largest = max(nbytes for nbytes, _ in mix)
    need = POOL * 3 * sum(nbytes for nbytes, _ in mix) + 2 * largest
    if host is not None and need > host:
        raise BenchConfigError(
            f"--mix {args.mix!r}: requests of up to {fmt_bytes(largest)} need "
            f"{fmt_bytes(need)} for the {POOL} requests of each size made before the load and "
            f"their expected outputs, but this machine has {fmt_bytes(host)}; give smaller "
            "sizes")
    if args.max_batch is not None:
        need = args.max_batch * row_bytes  # the largest bucket's input (and its output)
        if host is not None and need > host:  # the engine's bucket table then took forever
            raise BenchConfigError(
                f"--max-batch {int_text(args.max_batch)}: a batch of that many "
                f"{row_bytes}-byte rows needs {fmt_bytes(need)} per buffer but this machine "
                f"has {fmt_bytes(host)}; pass a smaller --max-batch")
    if args.window > 1 and args.mode in ("closed", "all"):
        # every request in flight may hold its output (a new array) until its thread waits
        # for it: at the limits, 4096 x 65536 requests of 64 KiB would be 16 TiB
        largest = max(nbytes for nbytes, _ in mix)
        need = args.threads * args.window * largest
        if host is not None and need > host:
            raise BenchConfigError(
                f"--threads {args.threads} x --window {args.window} requests in flight of up "
                f"to {fmt_bytes(largest)} each may hold {fmt_bytes(need)} of outputs but this "
                f"machine has {fmt_bytes(host)}; pass a smaller --window or fewer --threads")
    if args.device < 0:
        raise BenchConfigError(f"--device must be >= 0, got {args.device}")
    if args.plot:
        import importlib.util

        from orchestra.cli.trace_out import check_outputs
        from orchestra.errors import MissingExtraError
        from orchestra.serve.bench import PLOT_MISSING

        if importlib.util.find_spec("matplotlib") is None:
            raise MissingExtraError(PLOT_MISSING)
        problem = check_outputs(None, args.plot)  # the folder
        if problem:
            raise BenchConfigError(problem)


def options(args):
    from orchestra.serve.bench import BenchOptions, EngineConfig, cpu_backend_factory

    _check_numbers(args)
    return BenchOptions(
        mode=args.mode, mix=args.mix, row_kib=args.row_kib, iters=args.iters,
        threads=args.threads, window=args.window, duration=args.duration,
        requests=args.requests, tasks=args.tasks, rate=args.rate, batching=args.batching,
        dispatch=args.dispatch, peers=not args.no_peers, gc_freeze=not args.no_gc_freeze,
        switch_interval_ms=args.switch_interval_ms,
        process=args.process, processes=args.processes, loop=args.loop,
        host_probe=not args.no_host_probe, lag_probe=args.lag_probe,
        **({} if args.arrivals_per_turn is None
           else {"arrivals_per_turn": args.arrivals_per_turn}),
        **({} if args.gc_young_ms is None else {"gc_young_ms": args.gc_young_ms}),
        engine=EngineConfig(executor=args.executor, instances=args.instances,
                            memory=args.memory, device=args.device, max_batch=args.max_batch,
                            max_delay_us=args.max_delay_us,
                            completions_per_turn=args.completions_per_turn,
                            backend_factory=cpu_backend_factory if args.cpu else None))


def run_cmd(args) -> int:
    from orchestra.driver import Device
    from orchestra.serve.bench import main

    o = options(args)
    try:
        if args.cpu:
            return main(o, as_json=args.json, plot=args.plot,
                        device_name="CPU (NumpyBackend, device thread)")
        dev = Device.get(args.device)
        return main(o, as_json=args.json, plot=args.plot, device_name=dev.name)
    except KeyboardInterrupt:
        # the CLI exits 130 without a word; with worker processes say what became of them
        if o.processes > 1:
            print("orchestra bench serve: interrupted; every worker process was stopped, no "
                  "results", file=sys.stderr)
        raise

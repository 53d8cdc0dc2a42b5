"""The graph options `orchestra run` and `orchestra plan` share (the same graph either way),
and the checks both make of them.

`check_options` is every check `orchestra run` makes of these options that does not need the
GPU: ``plan`` calls it too, so ``plan`` refuses what ``run`` refuses (``--block 2048``) with the
same message, and both warn about options that do not apply. Pinned host memory beyond this
machine's memory is the exception: ``run`` refuses it before allocating anything, ``plan``
(which allocates nothing) prints the plan and warns that ``run`` would refuse it here. `check_device` adds the checks against the device (its block
limit and memory); ``run`` makes them before any work.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from orchestra.cli.exit_codes import UsageError
from orchestra.graph import COPY_LOWERINGS
from orchestra.graph.fields import MAX_BYTES
from orchestra.schedule import POLICIES

log = logging.getLogger(__name__)

DEFAULT_BATCHES = 32
DEFAULT_STAGING_SLOTS = 4
#: maxThreadsPerBlock of every CUDA GPU since compute capability 2.0 (CUDA C++ Programming
#: Guide, "Compute Capabilities", technical specifications table).
MAX_BLOCK = 1024
#: Host memory building and scheduling one batch's graph takes (7 nodes, their edges, events
#: and the plan's steps), rounded up: `orchestra plan --batches 50000` peaked at 660 MB. A job
#: whose graph would not fit in this machine's memory is refused before it is built.
GRAPH_BYTES_PER_BATCH = 16 << 10


def compute_iters(text: str):
    """``auto`` or an int from 0 to `MAX_ITERS`, the burn kernel's ``int iters`` (argparse
    type)."""
    from orchestra.app.job.checks import MAX_ITERS
    from orchestra.errors import int_text

    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 0, got {text!r}") from None
    if not 0 <= value <= MAX_ITERS:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int from 0 to {MAX_ITERS} "
                                         f"(the kernel's int parameter), got {int_text(value)}")
    return value


def _int_at_least(text: str, minimum: int) -> int:
    """``text`` as an int >= ``minimum``, else the argparse error saying so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {value}")
    return value


def streams_count(text: str):
    """An argparse type: ``auto`` or an int >= 1 (``--streams``)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return _int_at_least(text, 1)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 1, got {text!r}") \
            from None


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (``--batches``, ``--repeat``), refused while parsing."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: an int >= 0 (``--warmup``, ``--device``), refused while parsing."""
    return _int_at_least(text, 0)


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file: the same path once resolved (links and
    ``..`` followed), or, both existing, the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return False


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def add_graph_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=positive_int, default=None,
                   help=f"number of batches (default {DEFAULT_BATCHES}; with --input the file's "
                        "size sets it)")
    p.add_argument("--batch-mib", type=positive_float, default=64.0,
                   help="MiB of float32 per batch (default 64; may be fractional)")
    p.add_argument("--streams", type=streams_count, default="auto", metavar="N|auto",
                   help="streams; 'auto' (default): 16 lanes (at most the batches in "
                        "flight) for round-robin when the copies run as copy kernels, else 3; "
                        "with --policy auto and --executor capture or graph, 4 when the "
                        "kernel is smaller than the GPU and batches are at most 16 MiB (two "
                        "compute streams, so kernels of two batches overlap; `orchestra plan` "
                        "has no GPU to ask and shows 3)")
    p.add_argument("--policy", choices=("auto", *POLICIES), default="auto",
                   help="stream placement; 'auto' (default): round-robin lanes (batch b on "
                        "stream b %% N) when most copies run as copy kernels (small copies in "
                        "a CUDA graph, or --copy-lowering kernel), else by-engine")
    p.add_argument("--compute-iters", type=compute_iters, default="auto", metavar="N|auto",
                   help="burn iterations per element; 'auto' (default) makes the kernel take "
                        "as long as the slower copy")
    p.add_argument("--block", type=positive_int, default=256,
                   help="threads per block of the kernel (default 256)")
    p.add_argument("--input", metavar="FILE.npy",
                   help="stream a float32 .npy file (memory-mapped) through pinned staging "
                        "slots instead of generated data")
    p.add_argument("--staging-slots", type=positive_int, default=None,
                   help=f"pinned staging slots per direction with --input (default "
                        f"{DEFAULT_STAGING_SLOTS})")
    p.add_argument("--copy-lowering", choices=COPY_LOWERINGS, default="auto",
                   help="how host copies run: auto (default: copy kernels below the device's "
                        "crossover, see `orchestra tune copies`), kernel (every copy a copy "
                        "kernel on the SMs) or copy-engine (cuMemcpy*Async / memcpy nodes)")
    p.add_argument("--device-budget-mib", type=positive_float, default=8192.0,
                   help="device memory the batches in flight may hold together (default 8192): "
                        "a job whose batches all fit runs unbounded; else batch b allocates "
                        "after batch b-k freed, with k as large as the budget allows (at least 6)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def fmt_bytes(n: int) -> str:
    """``4.00 GiB``, ``64.0 MiB``, ``12.0 KiB``, ``100 B`` (and TiB)."""
    if n >= 2**70:  # beyond any machine: by its magnitude, never hundreds of digits
        return f"{n / 2**60:.3g} EiB"
    for unit, scale in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30),
                        ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}"
    return f"{n} B"


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``sysconf``), or None where it is not known."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def memory_needs(args: argparse.Namespace, input_elements: int | None = None) -> dict[str, int]:
    """Bytes the job needs, from the options alone (no graph is built):

    ``batch_bytes`` (one batch, from ``--batch-mib``), ``batches``, ``pinned_bytes`` (page-locked host memory: the
    whole input and output, or the staging slots with ``--input``), ``device_batch_bytes`` (one
    batch's input and output buffers on the device, at least what a run needs at once; with
    ``--input`` the largest batch is at most the file's size) and
    ``device_peak_bytes`` (what the batches that may be in flight together hold)."""
    from orchestra.app.job import batch_bytes_from_mib

    batch_bytes = batch_bytes_from_mib(args.batch_mib)
    if input_elements is not None:
        batches = -(-input_elements * 4 // batch_bytes)
        slots = max(1, min(args.staging_slots or DEFAULT_STAGING_SLOTS, batches))
        pinned = 2 * slots * min(batch_bytes, input_elements * 4)
    else:
        batches = args.batches or DEFAULT_BATCHES
        pinned = 2 * batches * batch_bytes
    # the largest batch the device holds: an input smaller than --batch-mib is one short batch
    largest = batch_bytes if input_elements is None else min(batch_bytes, input_elements * 4)
    return {"batch_bytes": batch_bytes, "batches": batches, "pinned_bytes": pinned,
            "device_batch_bytes": 2 * largest,
            **_in_flight(args, input_elements, largest, batches)}


def _in_flight(args, input_elements, largest: int, batches: int) -> dict[str, Any]:
    """``in_flight`` (batches that may hold device memory together; None: all of them) and
    ``device_peak_bytes``: generated data as `build_job_graph` bounds it under
    ``--device-budget-mib``; with ``--input`` the staging slots pace the batches, counted as
    `MIN_IN_FLIGHT` (an estimate)."""
    from orchestra.app.job.graphs import MIN_IN_FLIGHT

    if input_elements is not None:
        bound = min(MIN_IN_FLIGHT, batches)
        return {"in_flight": bound, "device_peak_bytes": 2 * largest * bound}
    # `in_flight_for` / `device_peak_bytes` of ``batches`` sizes of ``largest`` bytes, without
    # the list of them (``--batches 10**20`` must reach the host-memory check, not a list)
    per = 2 * largest
    budget = device_budget(args)
    limit = None if per * batches <= budget else max(MIN_IN_FLIGHT, budget // per)
    return {"in_flight": limit,
            "device_peak_bytes": per * (batches if limit is None else min(limit, batches))}


def device_budget(args: argparse.Namespace) -> int:
    """``--device-budget-mib`` in bytes."""
    return int(args.device_budget_mib * 2**20)


def check_options(args: argparse.Namespace, command: str,
                  input_elements: int | None = None) -> dict[str, Any]:
    """The checks `orchestra run` and `orchestra plan` both make, before any work.

    Raises `UsageError` for what cannot run anywhere: ``--staging-slots`` without ``--input``,
    a block over `MAX_BLOCK` threads, memory beyond what a 64-bit size counts (``--batch-mib
    1e300``), and (``command`` ``"run"``) pinned host memory beyond
    this machine's memory, which ``"plan"`` only warns about (it allocates nothing; the
    warning says `orchestra run` would refuse the job here, and why). Logs a warning for each
    option that does not apply (``--batches`` with ``--input``). Returns `memory_needs`.
    ``input_elements``: the ``--input`` array's size (after `open_input`).
    """
    if args.staging_slots is not None and not args.input:
        raise UsageError("--staging-slots needs --input (the generated data is made in pinned "
                         "memory and needs no staging slots)")
    if args.block > MAX_BLOCK:
        raise UsageError(f"--block {args.block}: a block has at most {MAX_BLOCK} threads on "
                         f"every CUDA GPU; pass --block {MAX_BLOCK} or fewer (256 is the default)")
    if args.input and args.batches is not None:
        log.warning("--batches does not apply with --input: the file's size and --batch-mib "
                    "set the number of batches")
    needs = memory_needs(args, input_elements)
    host = host_memory_bytes()
    if host is not None and needs["pinned_bytes"] > host:
        what = ("two staging pools of --staging-slots batches" if args.input
                else "the whole input and output")
        why = (f"the job needs {fmt_bytes(needs['pinned_bytes'])} of pinned host memory "
               f"({what}) but this machine has {fmt_bytes(host)}")
        fix = "pass a smaller --batch-mib" + ("" if args.input else " or fewer --batches")
        if command != "plan":
            raise UsageError(f"{why}; {fix}")
        # plan only plans: the plan is printed, and what run would refuse is said on stderr
        log.warning("`orchestra run` would refuse this job on this machine: %s; %s", why, fix)
    if host is not None and needs["batches"] * GRAPH_BYTES_PER_BATCH > host:
        raise UsageError(
            f"{needs['batches']} batches: their task graph and plan need about "
            f"{fmt_bytes(needs['batches'] * GRAPH_BYTES_PER_BATCH)} of host memory to build "
            f"(about {GRAPH_BYTES_PER_BATCH >> 10} KiB a batch) but this machine has "
            f"{fmt_bytes(host)}; pass "
            + ("a larger --batch-mib" if args.input else "fewer --batches or a larger "
               "--batch-mib with the same data"))
    if max(needs["pinned_bytes"], needs["device_batch_bytes"]) > MAX_BYTES:
        # no machine has it, and no CUDA size (64 bits) counts it: refused by plan too
        raise UsageError(
            f"the job needs {fmt_bytes(needs['pinned_bytes'])} of pinned host memory and "
            f"{fmt_bytes(needs['device_batch_bytes'])} of device memory per batch: beyond the "
            f"16 EiB a 64-bit size can count; pass a smaller --batch-mib"
            + ("" if args.input else " or fewer --batches"))
    log.debug("%s: %d batches of %s, %s pinned, %s device memory per batch (%s with every "
              "batch in flight)", command, needs["batches"], fmt_bytes(needs["batch_bytes"]),
              fmt_bytes(needs["pinned_bytes"]), fmt_bytes(needs["device_batch_bytes"]),
              fmt_bytes(needs["device_peak_bytes"]))
    return needs


def check_device(args: argparse.Namespace, needs: dict[str, Any], device: Any) -> None:
    """`orchestra run`'s checks against ``device`` (a `Device`), before any work: the block
    limit and the device memory one batch needs. Warns when the batches that may be in flight
    together might not fit."""
    limit = device.limits.max_threads_per_block
    if args.block > limit:
        raise UsageError(f"--block {args.block}: {device.name} runs at most {limit} threads per "
                         "block")
    total = device.total_memory
    if needs["device_batch_bytes"] > total:
        raise UsageError(
            f"one batch needs {fmt_bytes(needs['device_batch_bytes'])} of device memory (its "
            f"input and output) but {device.name} has {fmt_bytes(total)}; pass a smaller "
            "--batch-mib")
    if needs["device_peak_bytes"] > total:
        log.warning("the batches in flight together may need %s of device memory and %s has "
                    "%s: the run may fail with CUDA_ERROR_OUT_OF_MEMORY; a smaller "
                    "--device-budget-mib or --batch-mib avoids it", fmt_bytes(needs["device_peak_bytes"]), device.name,
                    fmt_bytes(total))

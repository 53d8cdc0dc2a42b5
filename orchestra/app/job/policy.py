"""Which stream policy and how many streams the main job runs with: ``--policy auto`` and
``--streams auto`` (pure Python, no CUDA).

`choose_policy` resolves them from how the job's host copies run (`count_copies` with the
executor's `CopyPolicy`):

- **most copies run as copy kernels** (at least half; in CUDA graphs below the crossover,
  256 KiB by default, or any executor with ``--copy-lowering kernel``): ``round-robin`` over
  `LANES` streams, each batch's chain alloc -> H2D -> kernel -> D2H -> free on stream
  ``b % lanes`` (a *lane*). A copy kernel reading or writing pinned host memory over PCIe is
  latency-bound (on an H200 a 4 KiB H2D copy kernel took 2.35 µs of GPU time, an empty
  kernel 0.66 µs), and copy kernels do not use the copy engines: many small ones run at once
  on the SMs. ``by-engine`` puts every H2D on one upload stream, so they run one after
  another; lanes overlap those latencies. Measured on an H200 with the graph-build executor
  (wall speed-up over a bare captured graph of memcpy nodes): 4096 x 4 KiB by-engine 3
  streams 2.35x, round-robin 6 5.62x, 12 10.0x, 24 12.8x; 1024 x 64 KiB by-engine 1.56x,
  round-robin 6 2.96x, 12 3.37x, 24 3.07x. 16 lanes sit between the best of both (the
  64 KiB pipeline already lost at 24, where the host launch time also grew by 40%).
- **otherwise** (copies on the copy engines: large copies, eager's default crossover):
  ``by-engine`` over `DEFAULT_STREAMS` streams (upload, compute, download): one copy engine
  per direction is what moves large copies fastest, and a stream per engine feeds them.
  With a CUDA graph executor (capture, graph) and a kernel that does not fill the GPU (its
  grid has fewer blocks than the device holds at once: ``kernel_fills_gpu=False``, from
  `fills_gpu`), `OVERLAP_STREAMS` streams: two compute streams (``compute0`` /
  ``compute1``, batch kernels alternating), so one batch's kernel overlaps the next one's
  (the burn kernel's grid is capped at 4 blocks per SM, 528 on an H200's 132 SMs, fewer
  than it holds at once). Measured on an H200, 256 x 4 MiB batches, wall ms, median of 5:
  graph executor 24.29 on 3 streams, 23.29 on 4 (kernels of 2500 iterations), 22.97 and
  22.50 (1500); eager 24.64 and 24.25 (2500), 23.39 and 23.70 (1500): noise-level, and lost
  with the shorter kernel, so eager keeps 3. Batches above `OVERLAP_MAX_BATCH_BYTES`
  (16 MiB) keep 3 as well: at 64 MiB the kernels are long and the graph rows read lower on 4.
  A kernel whose size is unknown (``None``:
  `orchestra plan` without a GPU, a kernel without ``occupancy``) keeps 3, and so does a job
  with one batch in flight (no second kernel to overlap with).

Lanes are capped at the batch count and at the batches that may be in flight together (more
streams than that would hold nothing). An explicit ``--policy`` or ``--streams`` is kept as
given; ``--streams auto`` with an explicit policy is the lane count for ``round-robin`` when the
copies run as copy kernels, else `DEFAULT_STREAMS`.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Iterable

import attrs
import numpy as np

from orchestra.app.job.checks import whole
from orchestra.errors import JobConfigError, JobConfigTypeError, counted
from orchestra.schedule import POLICIES

AUTO = "auto"
#: Streams of a lane plan (round-robin over copy-kernel chains); see the module doc.
LANES = 16
#: by-engine's upload, compute and download streams; the default before ``auto`` existed.
DEFAULT_STREAMS = 3
#: by-engine's streams under ``auto`` for a CUDA graph executor whose kernel does not fill the
#: GPU: upload, two compute streams, download (see the module doc).
OVERLAP_STREAMS = 4
#: Batches above this many bytes keep one compute stream under auto: two compute streams won
#: on an H200 at 4 MiB batches (a kernel's ramp-down overlaps the next one's start, a few µs of
#: ~90), while at 64 MiB (kernels of 1.2 ms, nothing to gain) the graph rows of `orchestra
#: bench peers` read 0.957-0.968 of the bound on 4 streams where they had read 0.990-0.995 on 3.
OVERLAP_MAX_BATCH_BYTES = 16 << 20
#: Why (the reason's tail for that case).
OVERLAP_NOTE = ("the kernel has fewer blocks than the GPU holds at once, so kernels of two "
                "batches overlap on two compute streams (H200, 256 x 4 MiB, graph executor: "
                "24.3 ms on 3 streams, 23.3 ms on 4)")
#: What ``--policy`` accepts.
POLICY_CHOICES = (AUTO, *POLICIES)
LANE_POLICY = "round-robin"
#: Why the eager executor keeps by-engine under ``auto`` even with copy kernels.
EAGER_LANES_NOTE = ("the eager executor enqueues every copy kernel from the host, so lanes add "
                    "host work instead of hiding latency (H200, 1024 x 64 KiB with copy "
                    "kernels: 16 lanes 55.0 ms, by-engine on 3 streams 30.7 ms): by-engine")


@attrs.frozen
class PolicyChoice:
    """A resolved ``(policy, streams)`` and why. ``requested_policy`` / ``requested_streams``:
    what was asked for (``"auto"`` or the value given); ``copies`` / ``copy_kernels``: the
    job's host copies and how many of them run as copy kernels; ``lanes``: whether the plan
    runs each batch's chain in its own lane (round-robin with copy kernels);
    ``kernel_fills_gpu``: what the job's kernel was said to do (None: unknown). Immutable: may
    be shared between threads freely."""

    policy: str
    streams: int
    requested_policy: str
    requested_streams: int | str
    reason: str
    copies: int = 0
    copy_kernels: int = 0
    kernel_fills_gpu: bool | None = None

    @property
    def lanes(self) -> bool:
        """True for round-robin over copy-kernel chains: the plan's concurrency is its
        stream count (what the bound's sustained times are measured at)."""
        return self.policy == LANE_POLICY and _mostly_kernels(self.copies, self.copy_kernels)

    @property
    def auto(self) -> bool:
        """Whether ``auto`` decided the policy or the stream count."""
        return AUTO in (self.requested_policy, self.requested_streams)

    def as_dict(self) -> dict:
        return {"policy": self.policy, "streams": self.streams,
                "requested_policy": self.requested_policy,
                "requested_streams": self.requested_streams, "reason": self.reason,
                "copies": self.copies, "copy_kernels": self.copy_kernels, "lanes": self.lanes,
                "kernel_fills_gpu": self.kernel_fills_gpu}

    def describe(self) -> str:
        """One line for printouts: ``round-robin on 16 stream(s) (auto: ...)``."""
        return f"{self.policy} on {counted(self.streams, 'stream')} ({self.reason})"


@attrs.frozen
class _Copy:
    """What `CopyPolicy.choose` reads of a host copy node, for counting without a graph."""

    name: str
    kind: str
    nbytes: int
    lowering: str = "auto"


def count_copies(sizes: Iterable[int], copy_policy) -> tuple[int, int]:
    """``(host copies, copy kernels)`` of the main job over batches of ``sizes`` bytes (one H2D
    and one D2H each, no per-node lowering) under ``copy_policy`` (a `CopyPolicy`: its
    ``choose``). O(distinct sizes). Raises what ``choose`` raises (`CopyLoweringError` for
    ``"kernel"`` on a device that cannot run copy kernels)."""
    copies = kernels = 0
    for nbytes, count in Counter(int(s) for s in sizes).items():
        for kind in ("h2d", "d2h"):
            copies += count
            if copy_policy.choose(_Copy(f"{kind}{nbytes}", kind, nbytes)) == "kernel":
                kernels += count
    return copies, kernels


def fills_gpu(kernel, grid: int, block: int, sm_count: int | None,
              shared_mem: int = 0) -> bool | None:
    """Whether a launch of ``kernel`` with ``grid`` blocks of ``block`` threads and
    ``shared_mem`` bytes of dynamic shared memory fills the GPU: at least as many blocks as the
    device holds at once, ``kernel.occupancy(block, shared_mem)`` (blocks per SM,
    ``cuOccupancyMaxActiveBlocksPerMultiprocessor``) times ``sm_count`` SMs, the test the
    ``concurrent`` policy makes (`orchestra.execute.occupancy`). None (unknown) for a kernel
    without ``occupancy`` (a test fake) or an unknown SM count (0 / None). Every count is a
    whole number (numpy ints too; `checks.whole`): ``grid`` and ``block`` >= 1, ``sm_count``
    and ``shared_mem`` >= 0, and so must ``occupancy``'s answer be; anything else (a string,
    a bool, 1.5 SMs, nan) is `JobConfigTypeError` / `JobConfigError`, never truncated. Raises
    what ``occupancy`` raises (a block size the device refuses). Thread-safety: as the
    kernel's ``occupancy`` (the driver's query is)."""
    grid, block = whole("grid (blocks)", grid, 1), whole("block (threads)", block, 1)
    shared_mem = whole("shared_mem (bytes)", shared_mem, 0)
    sm = 0 if sm_count is None else whole("sm_count (None: unknown)", sm_count, 0)
    occupancy = getattr(kernel, "occupancy", None)
    if occupancy is None or sm == 0:
        return None
    per_sm = whole("kernel.occupancy() (blocks per SM)", occupancy(block, shared_mem), 0)
    return grid >= per_sm * sm


def _mostly_kernels(copies: int, copy_kernels: int) -> bool:
    return copy_kernels > 0 and 2 * copy_kernels >= copies


def check_policy(policy) -> str:
    """``policy`` if it is one of `POLICY_CHOICES`, else `JobConfigError` naming them."""
    if policy not in POLICY_CHOICES:
        raise JobConfigError(f"policy must be one of {', '.join(POLICY_CHOICES)}; got "
                             f"{policy!r}")
    return policy


def check_streams(streams) -> int | str:
    """``"auto"`` or an int >= 1 (numpy ints too, returned as an int), else `JobConfigError`
    (a bool, a float, a string other than ``"auto"``)."""
    if isinstance(streams, str) and streams == AUTO:
        return AUTO
    try:
        n = None if isinstance(streams, (bool, float)) else operator.index(streams)
    except TypeError:  # a string, None, a numpy bool
        n = None
    if n is None or n < 1:
        raise JobConfigError(f"streams must be 'auto' or an int >= 1; got {streams!r}")
    return n


def choose_policy(policy: str = AUTO, streams: int | str = AUTO, *, copies: int,
                  copy_kernels: int, batches: int, in_flight: int | None = None,
                  executor: str = "the executor", lanes: int = LANES,
                  eager: bool = False, kernel_fills_gpu: bool | None = None,
                  batch_bytes: int | None = None) -> PolicyChoice:
    """Resolve ``policy`` / ``streams`` (see the module doc) for a job of ``batches`` batches
    whose ``copies`` host copies include ``copy_kernels`` copy kernels; ``in_flight``: the
    batches that may hold device memory together (None: all), a cap on the lanes;
    ``executor``: its name, for the reason; ``eager``: the eager executor runs the job, whose
    ``auto`` is by-engine on `DEFAULT_STREAMS` whatever the copies and the kernel (see
    `EAGER_LANES_NOTE`); ``kernel_fills_gpu``: whether the job's kernel fills the GPU
    (`fills_gpu`; None: unknown, which keeps `DEFAULT_STREAMS`): False gives by-engine under
    ``--policy auto --streams auto`` `OVERLAP_STREAMS` streams for the other executors (when
    at least two batches may be in flight and ``batch_bytes``, the largest batch's bytes, is
    at most `OVERLAP_MAX_BATCH_BYTES`; None: not known, no limit). Pure Python, thread-safe.
    Raises
    `JobConfigError` for an unknown policy, a stream count that is neither ``"auto"`` nor an
    int >= 1, or counts out of range; `JobConfigTypeError` for a ``kernel_fills_gpu`` that is
    not True, False or None."""
    policy = str(check_policy(policy))
    streams = check_streams(streams)
    if isinstance(kernel_fills_gpu, np.bool_):  # what a numpy comparison gives
        kernel_fills_gpu = bool(kernel_fills_gpu)
    if kernel_fills_gpu is not None and not isinstance(kernel_fills_gpu, bool):
        raise JobConfigTypeError(f"kernel_fills_gpu must be True, False or None (unknown); "
                                 f"got {kernel_fills_gpu!r}")
    # counts by name: nan, 2.5 or a string once passed through or failed in int()
    copies = whole("copies", copies, 0)
    copy_kernels = whole("copy_kernels", copy_kernels, 0, copies)
    batches, lanes = whole("batches", batches, 1), whole("lanes", lanes, 1)
    if in_flight is not None:
        in_flight = whole("in_flight (None: every batch)", in_flight, 1)
    kernels = _mostly_kernels(copies, copy_kernels)
    cap = batches if in_flight is None else min(batches, in_flight)
    lane_count = max(1, min(lanes, cap))
    how = f"{copy_kernels} of {copies} host copies run as copy kernels ({executor})"
    if policy == AUTO and eager:
        resolved = "by-engine"
        why = f"auto: {how}; {EAGER_LANES_NOTE}" if kernels else (
            f"auto: {how}; by-engine feeds one copy engine per direction")
        kernels = False  # the stream count below: by-engine's
    elif policy == AUTO:
        resolved = LANE_POLICY if kernels else "by-engine"
        if kernels:  # the lanes: the streams given, else the lane count
            n_lanes = lane_count if streams == AUTO else int(streams)
            why = (f"auto: {how}, which are latency-bound and overlap on the SMs: batch b "
                   f"runs in lane b % {n_lanes}")
        else:
            why = f"auto: {how}; by-engine feeds one copy engine per direction"
    else:
        resolved = policy
        why = f"--policy {policy} given"
    # two compute streams only where auto chose by-engine too: an explicit --policy keeps
    # the stream count it always had; one batch in flight has no kernel to overlap with
    could_overlap = (policy == AUTO and streams == AUTO and resolved == "by-engine"
                     and not eager and cap >= 2)
    if batch_bytes is not None:
        batch_bytes = whole("batch_bytes (None: unknown)", batch_bytes, 1)
    if could_overlap and kernel_fills_gpu is False:
        if batch_bytes is not None and batch_bytes > OVERLAP_MAX_BATCH_BYTES:
            n = DEFAULT_STREAMS
            why += (f"; streams auto: {n} (batches of {batch_bytes / (1 << 20):g} MiB: kernels "
                    f"long enough that a second compute stream gains nothing; above "
                    f"{OVERLAP_MAX_BATCH_BYTES >> 20} MiB one compute stream)")
        else:
            n = OVERLAP_STREAMS
            why += f"; streams auto: {n} (upload, 2 compute, download): {OVERLAP_NOTE}"
    elif could_overlap:
        # why not 4: `orchestra plan` (no GPU to ask) shows 3 where `orchestra run` may use 4
        n = DEFAULT_STREAMS
        why += f"; streams auto: {n} " + (
            "(the kernel fills the GPU: one compute stream)" if kernel_fills_gpu else
            f"(the kernel's size against the GPU is unknown here; one smaller than the GPU "
            f"gets {OVERLAP_STREAMS}: two compute streams)")
    elif streams == AUTO:
        n = lane_count if (resolved == LANE_POLICY and kernels) else DEFAULT_STREAMS
        if resolved == LANE_POLICY and kernels:
            limit = ""
            if lane_count < lanes:
                what = counted(cap, "batch")
                if in_flight is not None and in_flight < batches:
                    what += " in flight"
                limit = f" ({lanes}, capped at the {what})"
            why += f"; streams auto: {counted(n, 'lane')}{limit}"
        else:
            why += f"; streams auto: {n}"
    else:
        n = int(streams)
        why += f"; --streams {n} given"
    return PolicyChoice(resolved, n, policy, streams, why, copies, copy_kernels,
                        kernel_fills_gpu)


__all__ = ["AUTO", "DEFAULT_STREAMS", "EAGER_LANES_NOTE", "LANES", "LANE_POLICY",
           "OVERLAP_MAX_BATCH_BYTES", "OVERLAP_NOTE", "OVERLAP_STREAMS", "POLICY_CHOICES",
           "PolicyChoice", "check_policy", "check_streams", "choose_policy", "count_copies",
           "fills_gpu"]

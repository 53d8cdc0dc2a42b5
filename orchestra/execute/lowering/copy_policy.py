"""Which host copies become copy kernels: the choice per copy, pure Python (no CUDA calls).

A `HostToDevice` / `DeviceToHost` node runs either on a copy engine (``cuMemcpy*Async``, a
memcpy node in a CUDA graph) or as the copy kernel of ``cuda_src/copy.cu`` (the SMs load or
store the pinned host memory through its unified address; a kernel node in a CUDA graph). Why:
measured on an H200 (driver 580), every memcpy node costs 1.3-1.9 µs of host time at every
``cuGraphLaunch`` while kernel nodes cost about nothing, and small copies also finish sooner on
the SMs; large copies belong on the copy engines (an SM copy of 64 MiB ran at 51 GB/s alone and
fell far behind with a D2H running). docs/graphs.md has the numbers.

`CopyPolicy.choose(node)` decides, most specific first:

1. the node's own ``lowering=`` (``"kernel"`` or ``"copy-engine"``);
2. the build's or run's ``copy_lowering=`` (else the executor's), when not ``"auto"``;
3. ``"auto"``: a copy kernel when the copy is smaller than the crossover for its executor mode
   and direction (`CopyCrossover`: measured once per device by `orchestra tune copies` /
   `orchestra.execute.measure_copy_crossover`, cached on disk; otherwise `DEFAULT_CROSSOVER`).

A copy kernel needs a device whose kernels can address pinned host memory through its host
pointer (``kernel_host_access``: unified addressing and
``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``); without it ``"auto"`` keeps
every copy on the copy engines and an explicit ``"kernel"`` raises `CopyLoweringError`.
"""

from __future__ import annotations

import math

import attrs

from orchestra.execute.errors import CopyLoweringError
from orchestra.graph.nodes import COPY_LOWERINGS

KIB = 1 << 10
MODES = ("graph", "eager")
"""Executor modes with their own crossover: ``graph`` (capture and graph-build: what a copy
costs at every graph launch) and ``eager`` (a copy enqueued on a stream per run)."""

COPY_BLOCK = 256
"""Threads per block of the copy kernel."""


def copy_grid(nbytes: int, sm_count: int) -> int:
    """Blocks for a copy of ``nbytes``: ``ceil(sqrt(nbytes / 256))`` clamped to
    ``[1, sm_count]``. It reproduces the best grids measured for the copy kernel on an H200
    (4 KiB: 4, 64 KiB: 16, 1 MiB: 64, 16 MiB and up: all 132 SMs; `benchmarks/
    probe_graph_launch.py`): reads of host memory over PCIe are latency-bound, so a few
    requests in flight per block beat one thread per 16 bytes."""
    want = math.isqrt(max(0, int(nbytes) - 1) // 256) + 1
    return max(1, min(int(sm_count) if sm_count else 1, want))


@attrs.frozen
class CopyCrossover:
    """Per executor mode (`MODES`) and direction: under ``"auto"``, a copy of *fewer* bytes
    than the threshold becomes a copy kernel (0: never; a huge value: always).

    ``source``: where the numbers come from (``"default"``, or the measurement: device, date);
    ``measured``: the measurement's rows (a dict, informational; empty for the default).

    Immutable (frozen), but ``measured`` is a plain dict: may be shared between threads freely as
    long as nobody modifies it.
    """

    graph_h2d: int
    graph_d2h: int
    eager_h2d: int
    eager_d2h: int
    source: str = "default"
    measured: dict = attrs.field(factory=dict, eq=False, hash=False)

    def threshold(self, mode: str, direction: str) -> int:
        """Bytes below which a copy of ``direction`` (``"h2d"`` / ``"d2h"``) is a kernel in
        executor mode ``mode``."""
        return getattr(self, f"{mode}_{direction}")

    def as_dict(self) -> dict:
        return {"graph_h2d": self.graph_h2d, "graph_d2h": self.graph_d2h,
                "eager_h2d": self.eager_h2d, "eager_d2h": self.eager_d2h,
                "source": self.source, "measured": self.measured}

    @classmethod
    def from_dict(cls, d: dict) -> "CopyCrossover":
        return cls(int(d["graph_h2d"]), int(d["graph_d2h"]), int(d["eager_h2d"]),
                   int(d["eager_d2h"]), str(d.get("source", "measured")),
                   dict(d.get("measured") or {}))


DEFAULT_CROSSOVER = CopyCrossover(graph_h2d=256 * KIB, graph_d2h=256 * KIB, eager_h2d=0,
                                  eager_d2h=0, source="default")
"""Without a measured table: in CUDA graphs (capture, graph-build) copies below 256 KiB are
copy kernels (at 64 KiB the SM copy won both host and GPU time on an H200, at 1 MiB it lost GPU
time); eager runs keep every copy on the copy engines (there a copy kernel's launch costs the
host as much as ``cuMemcpy*Async``; `orchestra tune copies` measures whether the GPU side gains)."""


def check_lowering(value, what: str = "copy_lowering") -> str:
    """``value`` if it is one of `COPY_LOWERINGS`, else `CopyLoweringError` naming ``what``."""
    if not isinstance(value, str) or value not in COPY_LOWERINGS:
        raise CopyLoweringError(f"{what} must be one of {', '.join(map(repr, COPY_LOWERINGS))}"
                                f"; got {value!r}")
    return value


@attrs.frozen
class CopyPolicy:
    """How one build or run lowers its host copies (see the module doc).

    ``lowering``: the build-wide choice (`COPY_LOWERINGS`); ``mode``: ``"graph"`` or
    ``"eager"`` (which crossover applies); ``crossover``: the `CopyCrossover`;
    ``kernel_host_access``: whether the device's kernels can address pinned host memory
    (False: copy kernels are impossible); ``device``: a label for messages;
    ``d2h_system_fence``: whether a D2H copy kernel ends every thread with
    ``__threadfence_system()``. The executors set it per graph: on when the graph (or a body in
    it) has a `HostFunc`, which reads host memory on a host thread in stream order; off
    otherwise, because the host reads a D2H's bytes only after synchronizing with the stream
    or an event, and a kernel's writes to mapped memory are visible to the host by then (CUDA
    C++ Programming Guide, "Mapped Memory"; the fence cost 1.8 µs per 64 KiB copy on an H200).
    Immutable and hashable: the eager executor keys its prepared plans by it.

    Immutable: may be shared between threads freely.
    """

    lowering: str = attrs.field(default="auto", validator=lambda i, a, v: check_lowering(v))
    mode: str = "graph"
    crossover: CopyCrossover = DEFAULT_CROSSOVER
    kernel_host_access: bool = True
    device: str = "the device"
    d2h_system_fence: bool = True

    def choose(self, node) -> str:
        """``"kernel"`` or ``"copy-engine"`` for host copy ``node`` (its ``lowering``,
        ``kind`` and ``nbytes``). `CopyLoweringError` when a copy kernel is asked for
        explicitly but the device cannot run one."""
        own = getattr(node, "lowering", "auto")
        want = own if own != "auto" else self.lowering
        if want == "auto":
            if not self.kernel_host_access:
                return "copy-engine"
            limit = self.crossover.threshold(self.mode, node.kind)
            return "kernel" if node.nbytes < limit else "copy-engine"
        if want == "kernel" and not self.kernel_host_access:
            who = (f"node {node.name} asks for lowering='kernel'" if own != "auto" else
                   f"copy_lowering='kernel' was asked for (node {node.name})")
            raise CopyLoweringError(
                f"{who}, but the kernels of {self.device} cannot address pinned host memory "
                "through its host pointer (no unified addressing, or "
                "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0); use "
                "lowering='copy-engine' or 'auto'")
        return want

    def reason(self, node) -> str:
        """Why `choose` decided as it did, in words (plan printouts)."""
        own = getattr(node, "lowering", "auto")
        if own != "auto":
            return f"node lowering={own!r}"
        if self.lowering != "auto":
            return f"copy_lowering={self.lowering!r}"
        if not self.kernel_host_access:
            return "auto: the device cannot run copy kernels"
        limit = self.crossover.threshold(self.mode, node.kind)
        cmp = "<" if node.nbytes < limit else ">="
        return (f"auto: {fmt_bytes(node.nbytes)} {cmp} {fmt_bytes(limit)} "
                f"({self.crossover.source} crossover, {self.mode} {node.kind})")

    def summary(self) -> str:
        """One line: the build-wide choice and the crossovers in effect."""
        if self.lowering != "auto":
            return f"copy lowering {self.lowering!r} for every copy without its own lowering="
        if not self.kernel_host_access:
            return f"copy lowering auto: every copy on the copy engines ({self.device} cannot " \
                   "run copy kernels)"
        c = self.crossover
        h2d, d2h = c.threshold(self.mode, "h2d"), c.threshold(self.mode, "d2h")
        head = f"copy lowering auto ({c.source} crossover, {self.mode} mode): "
        if h2d == 0 and d2h == 0:
            return head + "every copy on the copy engines"
        return head + (f"copy kernels below {fmt_bytes(h2d)} (h2d) / {fmt_bytes(d2h)} (d2h)")


def fmt_bytes(n: int) -> str:
    """``4 KiB``, ``256 KiB``, ``1 MiB``, ``100 B``, ``0 B``; fractions with one decimal."""
    n = int(n)
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


__all__ = ["COPY_BLOCK", "COPY_LOWERINGS", "CopyCrossover", "CopyPolicy", "DEFAULT_CROSSOVER",
           "MODES", "check_lowering", "copy_grid", "fmt_bytes"]

"""The main job's task graphs (pure Python: `orchestra plan` builds them without a GPU).

Generated data (`build_job_graph`): one host buffer ``host_in`` and one ``host_out`` holding every
batch, sliced into consecutive batch ranges by `build_pipeline`; per batch alloc -> H2D -> burn
-> D2H -> free. The last batch may be shorter (ragged).

A user's file (`build_staged_graph`): the same batches, but each batch's data goes through
pinned staging slots: a `HostFunc` fills slot ``b % slots`` from the file before the H2D, and
another drains the output slot into the result file after the D2H. The graph infers the
slot-reuse edges (a refill waits for the H2D that read the slot before it).
"""

from __future__ import annotations

from typing import Callable, Sequence

import attrs

from orchestra.errors import JobConfigError
from orchestra.graph import HostBuffer, HostFunc, KernelRef, TaskGraph, add_batch
from orchestra.graph import build_pipeline
from orchestra.app.job.data import SCALE, SHIFT
from orchestra.schedule import CostModel

MIB = 1 << 20
ELEMENT = 4  # float32

# cuda_src/burn.cu: burn(const float* x, float* y, size_t n, int iters, float s, float t), the
# elementwise argument layout `add_batch` uses by default
BURN_PARAMS = ("const float* x", "float* y", "size_t n", "int iters", "float s", "float t")


def burn_kernel_ref() -> KernelRef:
    """``cuda_src/burn.cu``'s ``burn(const float* x, float* y, size_t n, int iters, float s,
    float t)``."""
    from orchestra.compiler.sources import kernel_source_dir

    return KernelRef(str(kernel_source_dir() / "burn.cu"), "burn", params=BURN_PARAMS)


def batch_bytes_from_mib(batch_mib: float) -> int:
    """MiB (may be fractional) -> bytes, a whole number of float32 elements, at least one."""
    if not batch_mib > 0:
        raise JobConfigError(f"batch size must be > 0 MiB; got {batch_mib!r}")
    return max(ELEMENT, int(batch_mib * MIB) // ELEMENT * ELEMENT)


def batch_sizes(total_elements: int, batch_elements: int) -> list[int]:
    """Bytes per batch for ``total_elements`` floats in batches of ``batch_elements`` (the last
    one shorter when they do not divide)."""
    if total_elements < 1 or batch_elements < 1:
        raise JobConfigError("need at least one element and a batch of at least one element")
    full, rest = divmod(total_elements, batch_elements)
    return [batch_elements * ELEMENT] * full + ([rest * ELEMENT] if rest else [])


def burn_grid(n: int, block: int = 256, sm_count: int | None = None) -> int:
    """Blocks for ``n`` elements: each thread handles 4 per step (float4), grid-stride loop;
    capped at 4 blocks per SM when the SM count is known (burn.cu's launch note)."""
    blocks = max(1, -(-n // (4 * block)))
    return min(blocks, 4 * sm_count) if sm_count else blocks


def burn_scalars(iters: int) -> tuple:
    return (int(iters), SCALE, SHIFT)


@attrs.frozen
class JobGraph:
    """A built job graph: ``graph``, its `Batch` records, the host buffers to bind.

    Immutable (frozen) record, but ``graph`` is a `TaskGraph` and ``batches`` a list: share it
    between threads only as read-only data (see `TaskGraph`).
    """

    graph: TaskGraph
    batches: list
    host_buffers: tuple[HostBuffer, ...]
    sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


#: Device memory (bytes) the batches of a job may hold at once before the pipeline bounds how
#: many are in flight (`orchestra run` / `plan` ``--device-budget-mib``). A job whose batches
#: all fit is not bounded: on an H200 the bounding edges (batch ``b`` allocates after batch
#: ``b - k`` freed) cost 3-6% of GPU time at 4-64 MiB per batch whatever ``k`` (6 or 12), and
#: an unbounded graph ran exactly as fast as the hand-captured one.
DEVICE_BUDGET = 8 << 30
#: Once bounded, at least this many batches in flight: enough for upload, compute and download
#: of different batches plus slack, and for round-robin over up to this many streams.
MIN_IN_FLIGHT = 6


def in_flight_for(sizes: Sequence[int], budget: int = DEVICE_BUDGET) -> int | None:
    """How many batches of ``sizes`` bytes (each one input and one output buffer on the device)
    may hold device memory at once under ``budget`` bytes: None (no bound) when every batch fits
    together, else ``budget // (2 * max(sizes))`` but at least `MIN_IN_FLIGHT`."""
    largest = 2 * max(sizes)
    if largest * len(sizes) <= budget:
        return None
    return max(MIN_IN_FLIGHT, budget // largest)


def device_peak_bytes(sizes: Sequence[int], budget: int = DEVICE_BUDGET) -> int:
    """The device memory the batches in flight hold together at most (bytes), under ``budget``
    (see `in_flight_for`)."""
    bound = in_flight_for(sizes, budget)
    largest = 2 * max(sizes)
    return largest * (len(sizes) if bound is None else min(bound, len(sizes)))


def build_job_graph(sizes: Sequence[int], *, iters: int, block: int = 256,
                    sm_count: int | None = None, kernel: KernelRef | None = None,
                    in_flight: int | str | None = "auto",
                    device_budget: int = DEVICE_BUDGET) -> JobGraph:
    """Batches of ``sizes`` bytes over one ``host_in`` and one ``host_out`` buffer; batch
    ``b`` allocates after batch ``b - in_flight`` freed (see `build_pipeline`). ``in_flight``:
    ``"auto"`` (default) picks it from ``device_budget`` bytes (`in_flight_for`: no bound when
    every batch fits), an int bounds it, None never bounds it."""
    sizes = tuple(int(s) for s in sizes)
    if in_flight == "auto":
        in_flight = in_flight_for(sizes, device_budget)
    elif isinstance(in_flight, str):
        raise JobConfigError(f"in_flight must be 'auto', an int >= 1 or None; got {in_flight!r}")
    total = sum(sizes)
    host_in, host_out = HostBuffer("host_in", total), HostBuffer("host_out", total)
    grid = burn_grid(max(sizes) // ELEMENT, block, sm_count)
    graph, batches = build_pipeline(len(sizes), list(sizes), kernel or burn_kernel_ref(),
                                    host_in=host_in, host_out=host_out, grid=grid, block=block,
                                    scalars=burn_scalars(iters), in_flight=in_flight)
    return JobGraph(graph, batches, (host_in, host_out), sizes)


def _noop():
    return None


def build_staged_graph(sizes: Sequence[int], *, slots: int, iters: int,
                       fill: Callable[[int], Callable] | None = None,
                       drain: Callable[[int], Callable] | None = None, block: int = 256,
                       sm_count: int | None = None, kernel: KernelRef | None = None,
                       slot_bytes: int | None = None) -> JobGraph:
    """Batches streamed through ``slots`` pinned input slots ``stage_in{k}`` and output slots
    ``stage_out{k}`` (`HostBuffer`s of ``slot_bytes``, default the largest batch).

    ``fill(b)`` / ``drain(b)`` return the host functions of batch ``b`` (copy the file chunk into
    its slot / the slot into the result); None makes no-op functions (for planning).
    """
    sizes = tuple(int(s) for s in sizes)
    if slots < 1:
        raise JobConfigError(f"need at least one staging slot; got {slots}")
    slot_bytes = slot_bytes or max(sizes)
    ins = [HostBuffer(f"stage_in{k}", slot_bytes) for k in range(slots)]
    outs = [HostBuffer(f"stage_out{k}", slot_bytes) for k in range(slots)]
    grid = burn_grid(max(sizes) // ELEMENT, block, sm_count)
    kernel = kernel or burn_kernel_ref()
    graph = TaskGraph()
    batches = []
    for b, size in enumerate(sizes):
        k = b % slots
        hin, hout = ins[k].range(0, size), outs[k].range(0, size)
        graph.add(HostFunc(f"b{b}.fill", fill(b) if fill else _noop, writes=[hin], batch=b))
        batches.append(add_batch(graph, index=b, kernel=kernel, nbytes=size, host_in=hin,
                                 host_out=hout, grid=grid, block=block,
                                 scalars=burn_scalars(iters)))
        graph.add(HostFunc(f"b{b}.drain", drain(b) if drain else _noop, reads=[hout], batch=b))
    return JobGraph(graph, batches, tuple(ins + outs), sizes)


def job_costs(batch_bytes: int, t_h2d_ms: float, t_kernel_ms: float, t_d2h_ms: float
              ) -> CostModel:
    """A `CostModel` from single-batch timings (for ``--policy critical-path`` on the GPU):
    copy bandwidths in GB/s and the kernel's time in µs."""
    def gbps(ms):
        return batch_bytes / (ms * 1e6) if ms > 0 else 1e3
    return CostModel(h2d_gbps=gbps(t_h2d_ms), d2h_gbps=gbps(t_d2h_ms),
                     kernel_us=t_kernel_ms * 1e3)

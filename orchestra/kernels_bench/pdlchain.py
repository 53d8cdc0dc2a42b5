"""``orchestra bench pdl``: a chain of small dependent kernels, with and without programmatic
dependent launch (PDL), timed on the GPU.

The chain is ``kernels`` launches of pdl_chain_step (cuda_src/pdl.cu): launch k reads what
launch k - 1 wrote (y = x + 1, two buffers used in turn), so without PDL each launch waits for
the previous one to finish and for its own launch latency; with PDL (launch attribute
PROGRAMMATIC_STREAM_SERIALIZATION on every link) link k + 1 is launched while link k runs and
only its griddepcontrol.wait waits for link k. PDL is applied only after the kernel's PTX has
been checked to contain griddepcontrol.wait (case C12: `orchestra.kernels_bench.pdl`).

Timing the GPU, not the host: the stream is first held by pdl_spin (a one-thread kernel that
spins ``gate_ms`` on %globaltimer) while the host enqueues the whole chain; the start event is
recorded behind the gate, the end event after the last link, so the elapsed time is the GPU's
time for the chain alone. If enqueueing took longer than the gate, the gate is doubled and the
chain run again (up to 3 times); a run still host-bound is flagged. GPU microseconds per kernel
= elapsed / kernels, median over ``repeats`` chains. The chain's final output is compared with
numpy. Goal (issue 5): <= 0.7 us per kernel with PDL.
"""

from __future__ import annotations

import time

import attrs
import numpy as np

from orchestra.kernels_bench import catalog as cat
from orchestra.kernels_bench import reference as ref
from orchestra.kernels_bench.common import median
from orchestra.kernels_bench.pdl import require_grid_dependency_wait

GOAL_US = 0.7


@attrs.frozen
class ChainResult:
    pdl: bool
    us_per_kernel: float
    chain_ms: float
    host_enqueue_ms: float
    gate_ms: float
    host_bound: bool
    verified: bool
    detail: str


@attrs.frozen
class PdlReport:
    device: str
    kernels: int
    n: int
    block: int
    grid: int
    repeats: int
    results: tuple

    def result(self, pdl: bool) -> ChainResult:
        return next(r for r in self.results if r.pdl == pdl)

    @property
    def goal_met(self) -> bool:
        return self.result(True).us_per_kernel <= GOAL_US

    @property
    def verified(self) -> bool:
        return all(r.verified for r in self.results)

    def as_dict(self) -> dict:
        d = attrs.asdict(self)
        d["results"] = [attrs.asdict(r) for r in self.results]
        d.update(goal_us=GOAL_US, goal_met=self.goal_met, verified=self.verified)
        return d


def run_pdl_chain(*, kernels: int = 1000, n: int = 256, block: int = 256, repeats: int = 5,
                  gate_ms: float = 100.0, device=None) -> PdlReport:
    """Measure (see the module doc)."""
    from orchestra.driver import Device, DeviceBuffer, Event, PinnedBuffer, Stream

    if kernels < 1 or n < 1 or repeats < 1 or gate_ms <= 0:
        raise ValueError("need kernels >= 1, n >= 1, repeats >= 1, gate_ms > 0")
    dev = device if isinstance(device, Device) else Device.get(device or 0)
    dev.make_current()
    spec = cat.spec("pdl_chain_step")
    ptx, entry = cat.ptx_text(spec, arch=dev.arch)
    require_grid_dependency_wait(ptx, entry)  # C12: never PDL on a kernel that does not wait
    step = cat.load(spec, dev)
    spin = cat.load("pdl_spin", dev)
    grid = -(-n // block)
    stream = Stream(dev)
    x0 = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    want = ref.pdl_chain(x0, kernels)
    pin = PinnedBuffer.empty((n,), np.float32, dev)
    bufs = [DeviceBuffer.allocate(4 * n, stream), DeviceBuffer.allocate(4 * n, stream)]
    packed = [step.pack((bufs[0], bufs[1], n)), step.pack((bufs[1], bufs[0], n))]
    start, end = Event(dev, timing=True), Event(dev, timing=True)
    results = []
    try:
        for pdl in (False, True):
            per_kernel, chains, hosts, gates, bound, ok_all, detail = [], [], [], [], False, True, ""
            for rep in range(repeats + 1):  # the first chain warms up
                gate = gate_ms
                for attempt in range(4):
                    pin.array[:] = x0
                    bufs[0].copy_from_host(pin, stream, sync=True)
                    spin.launch(stream, 1, 1, (int(gate * 1e6),))
                    start.record(stream)
                    t0 = time.perf_counter()
                    for i in range(kernels):
                        step.launch(stream, grid, block, packed[i % 2], pdl=pdl)
                    host_ms = (time.perf_counter() - t0) * 1e3
                    end.record(stream)
                    end.synchronize()
                    if host_ms < 0.8 * gate or attempt == 3:
                        break
                    gate *= 2  # the host was still enqueueing when the gate opened
                chain_ms = Event.elapsed_ms(start, end)
                bufs[kernels % 2].copy_to_host(pin, stream, sync=True)
                ok, det = ref.close(pin.array, want, rtol=0, atol=0)
                ok_all &= ok
                if not ok:
                    detail = det
                if rep == 0:
                    continue
                per_kernel.append(chain_ms * 1e3 / kernels)
                chains.append(chain_ms)
                hosts.append(host_ms)
                gates.append(gate)
                bound |= host_ms >= 0.8 * gate
            results.append(ChainResult(
                pdl, median(per_kernel), median(chains), median(hosts), max(gates), bound,
                ok_all, detail or f"final output == x0 + {kernels} on all {n} floats"))
    finally:
        stream.synchronize()
        for b in bufs:
            b.free()
        stream.synchronize()
        for o in (start, end, pin, stream):
            o.close()
    return PdlReport(dev.name, kernels, n, block, grid, repeats, tuple(results))

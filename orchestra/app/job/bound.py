"""The fill-aware pipeline bound from sustained per-item times (pure Python, no CUDA).

A pipeline of N batches, each H2D -> kernel -> D2H, cannot finish sooner than any of four
lower bounds; the bound is the largest (docs/execution.md, "The bound", has a worked example).
The inputs are *sustained* per-item times, measured in the same run for the batch size at hand
(`orchestra.app.job.timing.BatchTimer.sustained`): K back-to-back items of one kind, the stream
held by a gate kernel while the host enqueues them, elapsed / K. A single item timed alone
includes launch latency and idle clocks, which a full pipeline hides; that is why a bound made
of single-item times was beaten by real runs. The items are launched as the run launches its
work: on streams for the eager executor, as one CUDA graph for the graph executors (a graph
launches small kernels faster than a stream, and a graph of lanes beat a stream-timed bound).

With ``h``, ``k``, ``d`` the sustained H2D, kernel and D2H times per item at the plan's
concurrency (the faster of one stream and the plan's streams: a lane plan runs L batches at
once), ``p`` the time per pair when K H2Ds and K D2Hs run at once (both directions of the link
busy), ``hc``, ``kc``, ``dc`` the same items back to back on one stream (one step of a single
batch's chain: its H2D, kernel and D2H depend on each other, so no concurrency hides them; by
construction ``hc >= h``), N the batches counted by bytes and ``f`` the smallest batch as a
fraction of a full one (any batch may go first or last):

- upload engine:   ``N * h + f * (kc + dc)``  (every H2D, then the last one's kernel and D2H)
- download engine: ``f * (hc + kc) + N * d``
- compute:         ``f * hc + N * k + f * dc``
- link (duplex):   ``fill + drain + M`` with ``fill = f * (hc + kc)`` and
  ``drain = f * (kc + dc)``: no D2H can start before some H2D and its kernel are done, and no
  H2D runs during the last kernel and D2H; in those phases only one direction is busy. The middle
  must move the remaining ``a_h = N - fill / h`` H2D items and ``a_d = N - drain / d`` D2H
  items; time-sharing between "H2D alone" (1/h items per ms), "D2H alone" (1/d) and "both at
  once" (1/p of each) takes at least ``M = min over c of c + h * max(0, a_h - c / p) +
  d * max(0, a_d - c / p)`` (a small linear program whose minimum lies at c = 0, p * a_h or
  p * a_d). The two phases are disjoint only when the run lasts at least ``fill + drain``, so
  the term applies when one of the other three terms already reaches that (short pipelines:
  it does not, and ``link_ms`` is None).

Each term is a valid lower bound on its own, so the maximum is too: a plan of L streams runs
at most L items at once, so no stage of it goes faster than that stage alone spread over L
streams (the rate times), and a batch's chain is never faster than its steps one after
another (the chain times). Without chain times (``*_chain_ms`` None) the rate times stand in
for them, as before lanes existed. The engine terms use
``min(h, p)`` / ``min(d, p)`` as the fastest per-item rate, so a noisy ``p`` below a solo time can
only lower them. Efficiency = bound / wall; a value above `EFFICIENCY_LIMIT` means the bound
was measured wrong (`bound_warning`).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from orchestra.errors import JobConfigError

#: An efficiency above this is a bug in the bound (measurement noise stays well below it).
EFFICIENCY_LIMIT = 1.01

TERMS = ("upload", "download", "compute", "link")

#: How sustained items may be launched (`Sustained.launch`): enqueued on streams, captured into
#: one CUDA graph and launched as one, or both ways (the faster of each counts); and how each
#: reads in printouts.
LAUNCHES = ("stream", "graph", "both")
LAUNCH_NOTES = {"stream": "launched on streams", "graph": "launched as one CUDA graph",
                "both": "launched on streams and as one CUDA graph, the faster of each"}


@attrs.frozen
class Sustained:
    """Sustained per-item times (ms) of items of ``nbytes`` bytes, from ``items`` back-to-back
    items each: H2D, kernel, D2H alone, and ``pair_ms`` per H2D + D2H pair run at once.

    ``streams``: how many streams the items were also spread over (each time is the faster of
    one stream and that many: small items overlap across streams; the plan's concurrency).
    ``copies``: which mechanism each copy time came from (copy engine or copy kernel, the
    faster counts), for printouts. ``h2d_chain_ms``, ``kernel_chain_ms``, ``d2h_chain_ms``:
    the per-item times of the items back to back on one stream (a step of one batch's chain;
    None: the rate times above), at least the rate times (`JobConfigError` otherwise).
    ``launch``: how the items were launched (one of `LAUNCHES`; `JobConfigError` otherwise):
    ``"stream"`` (enqueued on streams, as the eager executor runs), ``"graph"`` (captured into
    one CUDA graph and launched as one, as the graph executors run), or ``"both"`` (each
    kind both ways, the faster counting); `launch_note` says it in words.

    Immutable: may be shared between threads freely.
    """

    nbytes: int
    items: int
    h2d_ms: float
    kernel_ms: float
    d2h_ms: float
    pair_ms: float
    streams: int = 1
    copies: str = "copy engines"
    h2d_chain_ms: float | None = None
    kernel_chain_ms: float | None = None
    d2h_chain_ms: float | None = None
    launch: str = "stream"

    def __attrs_post_init__(self):
        for name in ("h2d_ms", "kernel_ms", "d2h_ms", "pair_ms"):
            v = getattr(self, name)
            if not (v >= 0):
                raise JobConfigError(f"Sustained.{name} must be a time >= 0 ms; got {v!r}")
        for name in ("h2d", "kernel", "d2h"):
            v = getattr(self, f"{name}_chain_ms")
            if v is not None and not (v >= getattr(self, f"{name}_ms")):
                raise JobConfigError(
                    f"Sustained.{name}_chain_ms must be a time >= {name}_ms (one stream is "
                    f"never faster than the best of one and several); got {v!r}")
        if self.launch not in LAUNCHES:
            raise JobConfigError(f"Sustained.launch must be one of {', '.join(LAUNCHES)}; got "
                                 f"{self.launch!r}")
        if self.nbytes < 1 or self.items < 1 or self.streams < 1:
            raise JobConfigError("Sustained needs nbytes >= 1, items >= 1 and streams >= 1")

    @property
    def chain(self) -> tuple[float, float, float]:
        """(H2D, kernel, D2H) ms of one batch's chain step by step: the one-stream times, or
        the rate times where those were not measured."""
        return (self.h2d_ms if self.h2d_chain_ms is None else self.h2d_chain_ms,
                self.kernel_ms if self.kernel_chain_ms is None else self.kernel_chain_ms,
                self.d2h_ms if self.d2h_chain_ms is None else self.d2h_chain_ms)

    @property
    def launch_note(self) -> str:
        """How the items were launched, in words (`LAUNCH_NOTES`)."""
        return LAUNCH_NOTES[self.launch]

    def as_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class PipelineBound:
    """The bound of one pipeline: each term (ms), the largest (``bound_ms``) and which term
    it is (``limiter``: "upload", "download", "compute" or "link"). Immutable: may be shared
    between threads freely."""

    batches: float
    smallest: float  # the smallest batch as a fraction of a full one
    upload_ms: float
    download_ms: float
    compute_ms: float
    link_ms: float | None  # None: the pipeline is too short for the term to apply
    sustained: Sustained

    @property
    def terms(self) -> dict[str, float]:
        """Term name -> ms, the link term left out when it does not apply."""
        t = {"upload": self.upload_ms, "download": self.download_ms,
             "compute": self.compute_ms}
        if self.link_ms is not None:
            t["link"] = self.link_ms
        return t

    @property
    def bound_ms(self) -> float:
        return max(self.terms.values())

    @property
    def limiter(self) -> str:
        t = self.terms
        return max((n for n in TERMS if n in t), key=t.__getitem__)

    def efficiency(self, wall_ms: float) -> float:
        """bound / wall (0.0 for a wall time <= 0)."""
        return self.bound_ms / wall_ms if wall_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {"bound_ms": self.bound_ms, "limiter": self.limiter, "terms_ms": self.terms,
                "batches": self.batches, "smallest": self.smallest,
                "sustained": self.sustained.as_dict()}

    def describe(self) -> str:
        """One line: the bound, its limiter and every term."""
        terms = ", ".join(f"{k} {v:.3f}" for k, v in self.terms.items())
        return f"bound {self.bound_ms:.3f} ms ({self.limiter}-bound; terms ms: {terms})"


def middle_ms(a_h: float, a_d: float, h: float, d: float, p: float) -> float:
    """The least time to move ``a_h`` H2D and ``a_d`` D2H items when each direction alone takes
    ``h`` / ``d`` ms per item and both at once take ``p`` ms per pair: the minimum over the
    time ``c`` spent with both busy of ``c + h * (a_h - c/p)+ + d * (a_d - c/p)+``."""
    a_h, a_d = max(0.0, a_h), max(0.0, a_d)

    def cost(c):
        return c + h * max(0.0, a_h - c / p) + d * max(0.0, a_d - c / p)

    if p <= 0:  # both directions for free: only what one of them needs beyond the other
        return 0.0
    return min(cost(0.0), cost(p * a_h), cost(p * a_d))


def pipeline_bound(s: Sustained, sizes: Sequence[int] | float) -> PipelineBound:
    """The bound (see the module doc) of a pipeline of batches of ``sizes`` bytes each (or a
    number of full batches of ``s.nbytes``). Times of shorter batches scale by their byte
    fraction, which can only lower a term (an item's time has a fixed part). Raises
    `JobConfigError` (a ``ValueError``) for no batches."""
    if isinstance(sizes, (int, float)):
        if not sizes > 0:
            raise JobConfigError(f"need at least one batch; got {sizes!r}")
        n = float(sizes)
        f = min(1.0, n)
    else:
        sizes = [int(x) for x in sizes]
        if not sizes or min(sizes) < 1:
            raise JobConfigError("need at least one batch of at least one byte")
        n = sum(sizes) / s.nbytes
        f = min(sizes) / s.nbytes
    h, k, d, p = s.h2d_ms, s.kernel_ms, s.d2h_ms, s.pair_ms
    hc, kc, dc = s.chain
    upload = n * min(h, p) + f * (kc + dc)
    download = f * (hc + kc) + n * min(d, p)
    compute = f * hc + n * k + f * dc
    fill, drain = f * (hc + kc), f * (kc + dc)
    link = None
    if max(upload, download, compute) >= fill + drain:
        a_h = n - fill / h if h > 0 else 0.0
        a_d = n - drain / d if d > 0 else 0.0
        link = fill + drain + middle_ms(a_h, a_d, h, d, p)
    return PipelineBound(n, f, upload, download, compute, link, s)


def bound_warning(efficiency: float, what: str = "run") -> str | None:
    """A loud message when ``efficiency`` exceeds `EFFICIENCY_LIMIT` (the bound is not a lower
    bound: a measurement bug), else None."""
    if efficiency > EFFICIENCY_LIMIT:
        return (f"BOUND BUG: {what} efficiency {efficiency:.3f} > {EFFICIENCY_LIMIT}: the run "
                "beat its lower bound, so the sustained times behind the bound were measured "
                "wrong (please report it with the --json output)")
    return None


__all__ = ["EFFICIENCY_LIMIT", "LAUNCHES", "LAUNCH_NOTES", "PipelineBound", "Sustained",
           "TERMS", "bound_warning", "middle_ms", "pipeline_bound"]

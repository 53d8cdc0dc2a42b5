"""Pausing Python's cyclic garbage collector around passes over a whole graph.

The scheduler and the verifier make tables proportional to the graph (clocks, frontiers,
per-node records) and no reference cycles. While they run, the cyclic collector still starts
now and then, and each full collection walks every object alive, the graph's records
included: on a 64,000-node graph that walk (memory-bound, a few hundred ms) happened during
`schedule` + `verify` while at 16,000 nodes it did not, so their time grew by more than 4x
for 4x the nodes (`benchmarks/bench_verify.py`). Those passes find nothing to free there.
`paused()` turns the collector off for the duration and back on after, so these functions
cost what their own work costs. Reference counting still frees everything as usual; only
cycles made meanwhile (by other threads) wait until the collector runs again.

Thread-safe: nested and concurrent pauses keep the collector off until the last one ends,
and it is turned back on only if it was on when the first began (a program that turned it
off keeps it off). A thread that calls `gc.enable()` / `gc.disable()` itself while a pause
is on may have its change undone when the pause ends.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0  # pauses in progress (all threads)
_resume = False  # whether the collector was on when the first of them began


@contextmanager
def paused() -> Iterator[None]:
    """A with-block during which the cyclic garbage collector does not run (see the module
    doc); it runs again afterwards if it was enabled before."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


__all__ = ["paused"]

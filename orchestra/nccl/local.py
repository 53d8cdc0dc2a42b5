"""One process driving several GPUs: one host thread per GPU, each its rank's own program.

`run_per_device(fn, devices)` creates a communicator per device with one ``ncclCommInitAll``,
starts one thread per device (that device's context current on it) and calls ``fn(comm)``
there; the thread builds its rank's graph, runs or captures it with its own executor, and the
collectives meet across the threads. One thread per GPU is what NCCL recommends for several
GPUs in one process: a single thread issuing every rank's collective would need NCCL group
calls around them, and a graph launch may block until the other GPUs' launches arrive, which
deadlocks a single thread (NCCL's "Using NCCL with CUDA Graphs"). The capture executors'
default thread-local capture mode keeps the threads' captures apart.

With one device it degenerates to one thread and a one-rank communicator.
"""

from __future__ import annotations

import threading
from typing import Callable

from orchestra.nccl.communicator import Communicator
from orchestra.nccl.errors import RankTimeoutError


def run_per_device(fn: Callable[[Communicator], object], devices=None, *, comms=None,
                   api=None, driver=None, timeout: float | None = None) -> list:
    """``[fn(comm) for each rank]``, each call on its own thread (see the module doc).

    ``devices``: ordinals (None: every visible device); ``comms``: communicators made before
    (then ``devices`` is ignored and they are not closed here). The communicators made here
    are closed when every thread has returned. The first exception of a rank is re-raised
    (with a note naming the rank) after every thread ended; ``timeout`` bounds the wait for
    each thread (None: no bound; a thread still running then is a `RankTimeoutError`).
    """
    own = comms is None
    if own:
        comms = Communicator.init_all(devices, api=api, driver=driver)
    results: list = [None] * len(comms)
    errors: list = [None] * len(comms)

    def body(i: int, comm: Communicator) -> None:
        try:
            comm._device.make_current()
            results[i] = fn(comm)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors[i] = exc

    threads = [threading.Thread(target=body, args=(i, c), name=f"orchestra-rank{c.rank}")
               for i, c in enumerate(comms)]
    try:
        for t in threads:
            t.start()
        stuck = []
        for t, c in zip(threads, comms):
            t.join(timeout)
            if t.is_alive():
                stuck.append(c.rank)
    finally:
        if own and not any(t.is_alive() for t in threads):  # a running rank keeps its comm
            for c in comms:
                c.close()
    for i, exc in enumerate(errors):
        if exc is not None:
            exc.add_note(f"in rank {comms[i].rank} (device {comms[i].device})")
            raise exc
    if stuck:
        raise RankTimeoutError(f"ranks {stuck} did not finish within {timeout} s", stuck)
    return results


__all__ = ["run_per_device"]

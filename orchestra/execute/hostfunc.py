"""Host functions (`HostFunc` nodes) run by the driver in stream order.

``cuLaunchHostFunc(stream, fn, userData)`` (and graph host nodes) take a C function pointer.
`HostCallbacks` owns one ctypes trampoline for all of an executor's host functions: ``userData``
is an integer token naming the Python callable, so no ctypes object is created per run, and the
trampoline lives as long as the table (an executor keeps its table until its streams are
synchronized, so the driver never calls a freed pointer).

A host function runs on a driver thread and must not call CUDA (the driver forbids it). An
exception it raises cannot cross the C boundary: the trampoline records ``(node, exception)``
and the executor re-raises it after the run (`HostFunctionError`).

Capturing a host function: the capture executor enqueues through the driver's own
``cuLaunchHostFunc`` entry point (`orchestra.driver.entry_points.launch_host_func`), never
cuda-bindings' wrapper, whose one-shot record a captured node would call after it was freed.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Callable

_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostCallbacks:
    """Token -> callable table behind one C trampoline.

    ``address``: the trampoline's C function pointer (int), for ``cuLaunchHostFunc`` /
    ``CUDA_HOST_NODE_PARAMS.fn``; pass the token from `add` as ``userData``.

    Thread-safety: may be shared between threads: `add` and `remove` are single dict operations and
    token numbers come from one counter; the trampoline runs on the driver's host-function thread
    and records errors under the table's lock.
    """

    def __init__(self):
        self._fns: dict[int, tuple[Callable[[], object], str]] = {}
        self._errors: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)  # 0 would arrive as a NULL pointer
        fns, errors, lock = self._fns, self._errors, self._lock

        def trampoline(token):  # runs on a driver thread, holding the GIL (ctypes takes it)
            entry = fns.get(token or 0)
            if entry is None:
                with lock:
                    errors.append(("?", RuntimeError(f"unknown host function token {token}")))
                return
            try:
                entry[0]()
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                with lock:
                    errors.append((entry[1], exc))

        self._trampoline = _HOSTFN(trampoline)
        self.address = ctypes.cast(self._trampoline, ctypes.c_void_p).value

    def add(self, fn: Callable[[], object], label: str) -> int:
        """Register ``fn`` (called with no arguments) under a new token; ``label`` (the node
        name) names it in errors."""
        token = next(self._tokens)
        self._fns[token] = (fn, label)
        return token

    def remove(self, token: int) -> None:
        self._fns.pop(token, None)

    def call(self, token: int) -> None:
        """Call the trampoline from Python (what the driver does; used by tests)."""
        self._trampoline(token)

    @property
    def errors(self) -> int:
        """How many errors wait for `take_errors` (no lock: a list's length is read
        atomically; the runs' fast path asks this once per run)."""
        return len(self._errors)

    def take_errors(self) -> list[tuple[str, BaseException]]:
        """The ``(node, exception)`` pairs recorded since the last call, oldest first."""
        with self._lock:
            out = list(self._errors)
            self._errors.clear()
        return out

    def __len__(self) -> int:
        return len(self._fns)

"""Host functions (`HostFunc` nodes) run by the driver in stream order.

``cuLaunchHostFunc(stream, fn, userData)`` (and graph host nodes) take a C function pointer.
`HostCallbacks` owns one ctypes trampoline for all of an executor's host functions: ``userData``
is an integer token naming the Python callable, so no ctypes object is created per run, and the
trampoline lives as long as the table (an executor keeps its table until its streams are
synchronized, so the driver never calls a freed pointer).

A host function runs on a driver thread and must not call CUDA (the driver forbids it). An
exception it raises cannot cross the C boundary: the trampoline records ``(node, exception)``
and the executor re-raises it after the run (`HostFunctionError`).

Capturing a host function: cuda-bindings' own ``cuLaunchHostFunc`` (12.x through 13.3.1 at
least; 13.5.0 passes the arguments through) does not hand ``fn`` / ``userData`` to the driver:
it mallocs a ``{callback, userData}`` record and enqueues its own ``cuHostCallbackWrapper`` with
that record; the wrapper calls ``callback(userData)`` and then *frees the record*. That is right
for a one-shot stream launch (the eager executor), but a stream capture turns the call into a
graph host node whose parameters are the wrapper and the record: the first graph launch frees
the record, the second calls through freed memory (a segfault on a driver thread).
`launch_host_func` therefore calls the driver's own entry point
(``cuGetProcAddress("cuLaunchHostFunc")``, else the symbol in libcuda.so.1) through ctypes, so
the captured node holds the trampoline and the token themselves, as a node from
``cuGraphAddHostNode`` does (cuda-bindings passes ``CUDA_HOST_NODE_PARAMS`` through unchanged).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Callable

_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
_LAUNCH_HOSTFN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p)
_raw: tuple | None = None  # (the driver module it came from, ctypes function or None, source)


def driver_launch_host_func(driver=None):
    """The driver's own ``cuLaunchHostFunc`` as a ctypes function ``(stream, fn, userData) ->
    CUresult`` (ints), or None when it cannot be found. Looked up once per driver module:
    ``cuGetProcAddress`` through ``driver`` (default: ``cuda.bindings.driver``), else the
    exported symbol of ``libcuda.so.1``. `driver_launch_host_func_source` says which."""
    global _raw
    if driver is None:
        from cuda.bindings import driver as driver_mod

        driver = driver_mod
    if _raw is not None and _raw[0] is driver:
        return _raw[1]
    fn, source = None, "not found"
    try:
        err, pfn, _status = driver.cuGetProcAddress(b"cuLaunchHostFunc", 12000, 0)
        if not err and pfn and int(pfn):
            fn, source = _LAUNCH_HOSTFN(int(pfn)), "cuGetProcAddress"
    except Exception:  # noqa: BLE001 - try the exported symbol below
        pass
    if fn is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = ctypes.cast(lib.cuLaunchHostFunc, _LAUNCH_HOSTFN)
            source = "libcuda.so.1"
        except (OSError, AttributeError):
            fn = None
    _raw = (driver, fn, source)
    return fn


def driver_launch_host_func_source() -> str:
    """Where `driver_launch_host_func` found the entry point (``"cuGetProcAddress"``,
    ``"libcuda.so.1"``, ``"not found"``), or ``"not looked up"``."""
    return _raw[2] if _raw is not None else "not looked up"


def launch_host_func(driver, stream, fn_address: int, token: int) -> int:
    """Enqueue ``fn_address(token)`` on ``stream`` (a ``CUstream`` or its int) with the
    driver's ``cuLaunchHostFunc``; returns the ``CUresult`` as an int. Safe inside a stream
    capture: the host node gets exactly ``fn_address`` and ``token`` (see the module doc).

    ``driver`` is the module the caller uses (``cuda.bindings.driver``); a stand-in driver
    (tests) without ``cuGetProcAddress`` gets its own ``cuLaunchHostFunc(stream, CUhostFn,
    token)`` called instead. Raises `OrchestraError` when the real driver's entry point cannot
    be found (cuda-bindings' ``cuLaunchHostFunc`` is not used as a fallback: in a capture it
    would crash the second launch)."""
    from cuda.bindings import driver as real

    if driver is real or hasattr(driver, "cuGetProcAddress"):
        fn = driver_launch_host_func(driver)
        if fn is None:
            from orchestra.errors import OrchestraError

            raise OrchestraError(
                "cannot enqueue a host function for capture: the driver's cuLaunchHostFunc "
                "entry point was found neither by cuGetProcAddress nor in libcuda.so.1 "
                "(cuda-bindings' own cuLaunchHostFunc frees its callback record after the "
                "first call, so a captured host node would crash the second launch)")
        return int(fn(int(stream), int(fn_address), int(token)))
    (err,) = driver.cuLaunchHostFunc(stream, driver.CUhostFn(int(fn_address)), int(token))
    return int(err)


class HostCallbacks:
    """Token -> callable table behind one C trampoline.

    ``address``: the trampoline's C function pointer (int), for ``cuLaunchHostFunc`` /
    ``CUDA_HOST_NODE_PARAMS.fn``; pass the token from `add` as ``userData``.
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

    def take_errors(self) -> list[tuple[str, BaseException]]:
        """The ``(node, exception)`` pairs recorded since the last call, oldest first."""
        with self._lock:
            out = list(self._errors)
            self._errors.clear()
        return out

    def __len__(self) -> int:
        return len(self._fns)

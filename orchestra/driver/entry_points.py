"""Driver entry points called through ctypes, where cuda-bindings' wrappers fall short.

Both are looked up once per driver module with ``cuGetProcAddress`` (the driver's own table of
entry points, versioned: CUDA 12.0 forms) and called with orchestra's own ctypes types.

``cuLaunchHostFunc`` (`launch_host_func`): cuda-bindings' own ``cuLaunchHostFunc`` (12.x
through 13.3.1 at least; 13.5.0 passes the arguments through) does not hand ``fn`` /
``userData`` to the driver:
it mallocs a ``{callback, userData}`` record and enqueues its own ``cuHostCallbackWrapper`` with
that record; the wrapper calls ``callback(userData)`` and then *frees the record*. That is right
for a one-shot stream launch (the eager executor), but a stream capture turns the call into a
graph host node whose parameters are the wrapper and the record: the first graph launch frees
the record, the second calls through freed memory (a segfault on a driver thread).
`launch_host_func` therefore calls the driver's own entry point
(``cuGetProcAddress("cuLaunchHostFunc")``, else the symbol in libcuda.so.1) through ctypes, so
the captured node holds the trampoline and the token themselves, as a node from
``cuGraphAddHostNode`` does (cuda-bindings passes ``CUDA_HOST_NODE_PARAMS`` through unchanged).

``cuGraphExecUpdate`` (`exec_update`): cuda-bindings returns ``(err, None)`` when the update is
refused, dropping the ``CUgraphExecUpdateResultInfo`` exactly when it says why (which result,
which node); the driver's entry point is called with orchestra's struct instead.
"""

from __future__ import annotations

import ctypes

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
    driver's ``cuLaunchHostFunc``, found through ``driver`` (the bindings module,
    `driver_launch_host_func`); returns the ``CUresult`` as an int. Safe inside a stream
    capture: the host node gets exactly ``fn_address`` and ``token`` (see the module doc).
    Raises `OrchestraError` when the entry point cannot be found (cuda-bindings'
    ``cuLaunchHostFunc`` is not used as a fallback: in a capture it would crash the second
    launch)."""
    fn = driver_launch_host_func(driver)
    if fn is None:
        from orchestra.errors import OrchestraError

        raise OrchestraError(
            "cannot enqueue a host function: the driver's cuLaunchHostFunc entry point was "
            "found neither by cuGetProcAddress nor in libcuda.so.1 (cuda-bindings' own "
            "cuLaunchHostFunc frees its callback record after the first call, so a captured "
            "host node would crash the second launch)")
    return int(fn(int(stream), int(fn_address), int(token)))


# -- cuGraphExecUpdate with its result info ------------------------------------------------


class _UpdateResultInfo(ctypes.Structure):
    """``CUgraphExecUpdateResultInfo``: ``{CUgraphExecUpdateResult result; CUgraphNode
    errorNode; CUgraphNode errorFromNode;}``."""

    _fields_ = [("result", ctypes.c_int), ("errorNode", ctypes.c_void_p),
                ("errorFromNode", ctypes.c_void_p)]


_UPDATE_FN_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.POINTER(_UpdateResultInfo))
_update_fn: tuple | None = None  # (the driver module it came from, the ctypes function)


def exec_update(exec_, graph, driver=None) -> tuple[int, int | None, int | None, int | None]:
    """``cuGraphExecUpdate(exec_, graph)`` -> ``(CUresult, CUgraphExecUpdateResult,
    errorNode, errorFromNode)`` as ints (None when unknown). ``driver``: the module whose
    entry points to use (default ``cuda.bindings.driver``).

    cuda-bindings returns ``(err, None)`` when the call fails, dropping the result info exactly
    when it says why; so the driver's own entry point (``cuGetProcAddress("cuGraphExecUpdate",
    12000)``: the CUDA 12+ form taking a ``CUgraphExecUpdateResultInfo*``) is called through
    ctypes with orchestra's struct. If that is unavailable, the bindings' call is used and a
    refusal's reason is unknown.
    """
    global _update_fn
    if driver is None:
        from cuda.bindings import driver as default_driver
        driver = default_driver
    _d = driver
    if _update_fn is None or _update_fn[0] is not _d:
        _update_fn = (_d, None)
        try:
            err, pfn, _status = _d.cuGetProcAddress(b"cuGraphExecUpdate", 12000, 0)
            if not err and pfn:
                _update_fn = (_d, _UPDATE_FN_TYPE(int(pfn)))
        except Exception:  # noqa: BLE001 - fall back to the bindings' call below
            pass
    fn = _update_fn[1]
    if fn is not None:
        info = _UpdateResultInfo()
        err = fn(int(exec_), int(graph), ctypes.byref(info))
        return int(err), int(info.result), info.errorNode, info.errorFromNode
    err, info = _d.cuGraphExecUpdate(exec_, graph)
    if info is None:
        return int(err), (0 if not err else None), None, None
    en, ef = info.errorNode, info.errorFromNode
    return (int(err), int(info.result), None if en is None else int(en),
            None if ef is None else int(ef))


__all__ = ["driver_launch_host_func", "driver_launch_host_func_source", "exec_update",
           "launch_host_func"]

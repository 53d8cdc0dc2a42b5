"""The one checked-call helper for the CUDA driver API, driver start-up and fork safety.

cuda-bindings returns ``(CUresult, *values)`` from every driver function instead of raising.
`cu(fn, *args)` calls ``fn``, raises `CudaError` naming ``fn`` on failure, and returns the
values (one value unwrapped, several as a tuple, none as ``None``). Every driver call in
orchestra goes through it, so no result is ever dropped.

`ensure_initialized` runs ``cuInit`` once, after checking that the driver is new enough
(``cuDriverGetVersion`` >= 13000: CUDA 13.0, driver R580 or newer; else `DriverTooOldError`).
Failures of the bindings themselves (``cuda.bindings`` not importable, a driver lacking an entry
point: cuda-bindings' ``FunctionNotFoundError``) become `DriverBindingError`, and a missing driver
library `NoDeviceError`: all three are `NoDeviceError`s, one line and exit code 2 in the CLI.

Fork safety: CUDA does not support ``fork()`` once initialized: it copies none of its internal
state or threads into the child, so CUDA use there is undefined (NVIDIA CUDA C++ Guidelines,
rule 1.6: fork must be followed by exec). An ``os.register_at_fork`` hook marks a child forked
after ``cuInit``; in it, `ensure_initialized` and the error path of `cu` / `error_from_result`
raise `CudaForkError`, which says to use the spawn start method. The parent is untouched, and `cu`'s success path pays
nothing for this (the flag is read only when a call already failed).
"""

from __future__ import annotations

import os
import threading

from orchestra.errors import (
    REQUIRED_DRIVER_VERSION,
    CudaError,
    CudaForkError,
    DriverBindingError,
    DriverTooOldError,
    NoDeviceError,
    cuda_version_text,
)

_init_lock = threading.Lock()
_initialized = False
_forked = False  # True in a process forked after cuInit (see _after_fork_in_child)

# cuda-bindings' own failures, by class name (their module is private): a driver entry point the
# installed driver lacks, and a driver library that cannot be loaded.
_MISSING_ENTRY_POINT = ("FunctionNotFoundError",)
_LIBRARY_NOT_LOADED = ("NotSupportedError", "DynamicLibNotFoundError")


def _after_fork_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: runs in the child right after ``fork()``."""
    global _initialized, _forked, _init_lock
    _init_lock = threading.Lock()  # another thread may have held it at the fork
    if _initialized:
        _forked = True
        _initialized = False  # the next ensure_initialized takes the slow path and refuses


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def forked_after_init() -> bool:
    """True in a process forked (``os.fork()``, multiprocessing's ``fork`` start method) after
    CUDA was initialized in an ancestor: it cannot use CUDA (`CudaForkError`)."""
    return _forked


def _driver():
    """Import the driver bindings; a failing import is `DriverBindingError`."""
    try:
        from cuda.bindings import driver
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken extension module
        raise DriverBindingError(
            f"cuda.bindings (cuda-python's driver bindings) cannot be imported:"
            f" {type(exc).__name__}: {exc}; reinstall it with pip install"
            f" 'cuda-bindings>=13,<14'") from exc
    return driver


def binding_failure(call: str, exc: BaseException) -> NoDeviceError | None:
    """The orchestra error for an exception raised by a cuda-bindings function itself (not a
    ``CUresult``), or None when ``exc`` is not a binding-level failure.

    ``FunctionNotFoundError`` (the driver lacks ``call``'s entry point) -> `DriverBindingError`
    naming the call and the driver version; a driver library that cannot be loaded ->
    `NoDeviceError`.
    """
    kind = type(exc).__name__
    if kind in _MISSING_ENTRY_POINT:
        return DriverBindingError(
            f"{call}: the NVIDIA driver has no entry point for it ({exc}); orchestra needs"
            f" CUDA {cuda_version_text(REQUIRED_DRIVER_VERSION)} (driver R580 or newer), the"
            f" driver here supports {_found_version_text()}: update the NVIDIA driver")
    if kind in _LIBRARY_NOT_LOADED:
        return NoDeviceError(f"the driver library could not be loaded: {exc}")
    return None


def _found_version_text() -> str:
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"CUDA {cuda_version_text(version)}"
    except Exception:  # noqa: BLE001 - the version is a courtesy in an error message
        pass
    return "an unknown CUDA version"


def error_from_result(call: str, result, context: str = "") -> CudaError:
    """Build a `CudaError` for a failed ``CUresult`` (asks the driver for its message); in a
    child forked after ``cuInit`` a `CudaForkError` (a `CudaError`) that says why."""
    driver = _driver()
    code = int(result)
    try:
        name = driver.CUresult(code).name
    except ValueError:
        name = f"CUresult({code})"
    message = ""
    try:
        err, text = driver.cuGetErrorString(driver.CUresult(code))
        if int(err) == 0 and text:
            message = text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - the message is a courtesy; the code and name are kept
        pass
    if _forked:
        return CudaForkError(call, code, name, message, context)
    return CudaError(call, code, name, message, context)


def cu(fn, *args):
    """Call driver function ``fn(*args)`` and check its ``CUresult``.

    Returns the call's outputs: ``None``, the single value, or a tuple.
    Raises `CudaError` with ``fn``'s name, the ``CUresult`` name and the driver's message
    (`CudaForkError` in a child forked after ``cuInit``); a binding-level failure (a driver
    without ``fn``'s entry point) is `DriverBindingError`.
    """
    try:
        out = fn(*args)
    except RuntimeError as exc:  # a try block costs nothing until something raises
        err = binding_failure(getattr(fn, "__name__", repr(fn)), exc)
        if err is None:
            raise
        raise err from exc
    if out[0]:  # CUresult is an IntEnum; CUDA_SUCCESS == 0
        raise error_from_result(fn.__name__, out[0])
    n = len(out)
    if n == 1:
        return None
    if n == 2:
        return out[1]
    return out[1:]


def ensure_initialized() -> None:
    """Run ``cuInit(0)`` once per process.

    Raises, each a `NoDeviceError` (the CLI: one line, exit 2):
    `DriverTooOldError` when ``cuDriverGetVersion`` reports a CUDA older than 13.0;
    `DriverBindingError` when cuda.bindings cannot import or reach the driver;
    `NoDeviceError` when the driver library is missing or no device is present
    (``CUDA_ERROR_NO_DEVICE``, ``CUDA_ERROR_NOT_FOUND`` from the loader, and friends).
    Raises `CudaForkError` in a process forked after CUDA was initialized in its parent.
    """
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if _initialized:
            return
        if _forked:
            raise CudaForkError()
        driver = _driver()
        # cuDriverGetVersion needs no cuInit (CUDA Driver API, "Version Management"); checking
        # it first reports an old driver as such rather than as a failed cuInit.
        result, version = _call_at_start(driver.cuDriverGetVersion)
        if not result and int(version) < REQUIRED_DRIVER_VERSION:
            raise DriverTooOldError(int(version))
        (result,) = _call_at_start(driver.cuInit, 0)
        if result:
            name = driver.CUresult(int(result)).name
            if name in ("CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_INSUFFICIENT_DRIVER",
                        "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
                        "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "CUDA_ERROR_UNKNOWN"):
                raise NoDeviceError(f"cuInit: {name}")
            raise error_from_result("cuInit", result)
        count = cu(driver.cuDeviceGetCount)
        if count == 0:
            raise NoDeviceError("cuDeviceGetCount reports 0 devices")
        _initialized = True


def _call_at_start(fn, *args):
    """A start-up call whose exceptions (the driver library cannot be loaded: cuda.pathfinder
    raises; an entry point is missing) become `NoDeviceError` / `DriverBindingError`."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises is "no driver"
        err = binding_failure(fn.__name__, exc)
        if err is None:
            err = NoDeviceError(f"the driver library could not be loaded: {exc}")
        raise err from exc


def device_available() -> bool:
    """True when a CUDA device can be used; never raises (used to skip GPU tests), except
    `CudaForkError` in a process forked after CUDA was initialized (it cannot use CUDA and
    should not pretend there is no GPU)."""
    try:
        ensure_initialized()
    except NoDeviceError:
        return False
    return True

"""The one checked-call helper for the CUDA driver API.

cuda-bindings returns ``(CUresult, *values)`` from every driver function instead of raising.
`cu(fn, *args)` calls ``fn``, raises `CudaError` naming ``fn`` on failure, and returns the
values (one value unwrapped, several as a tuple, none as ``None``). Every driver call in
orchestra goes through it, so no result is ever dropped.
"""

from __future__ import annotations

import threading

from orchestra.errors import CudaError, NoDeviceError

_init_lock = threading.Lock()
_initialized = False


def _driver():
    """Import the driver bindings; a missing package or driver library is `NoDeviceError`."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - cuda-bindings is a hard dependency
        raise NoDeviceError(f"cuda.bindings is not importable: {exc}") from exc
    return driver


def error_from_result(call: str, result, context: str = "") -> CudaError:
    """Build a `CudaError` for a failed ``CUresult`` (asks the driver for its message)."""
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
    return CudaError(call, code, name, message, context)


def cu(fn, *args):
    """Call driver function ``fn(*args)`` and check its ``CUresult``.

    Returns the call's outputs: ``None``, the single value, or a tuple.
    Raises `CudaError` with ``fn``'s name, the ``CUresult`` name and the driver's message.
    """
    out = fn(*args)
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

    Raises `NoDeviceError` when the driver library is missing or no device is present
    (``CUDA_ERROR_NO_DEVICE``, ``CUDA_ERROR_NOT_FOUND`` from the loader, and friends).
    """
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if _initialized:
            return
        driver = _driver()
        try:
            (result,) = driver.cuInit(0)
        except Exception as exc:  # cuda.pathfinder raises when libcuda.so cannot be loaded
            raise NoDeviceError(f"the driver library could not be loaded: {exc}") from exc
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


def device_available() -> bool:
    """True when a CUDA device can be used; never raises (used to skip GPU tests)."""
    try:
        ensure_initialized()
    except NoDeviceError:
        return False
    return True

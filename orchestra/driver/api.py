"""`DriverAPI`: the one object through which the executors reach the CUDA driver.

Every executor (eager, capture, graph-build), every `GraphExec` and every `CaptureSession` takes
its driver calls from one `DriverAPI` and nowhere else:

- the driver functions by their cuda-bindings names (``api.cuGraphLaunch``,
  ``api.cuMemcpyHtoDAsync``, ...), looked up in ``cuda.bindings.driver`` on first use and then
  plain attributes of the object, so an executor binds the ones its hot paths call once
  (``self._launch = api.cuGraphLaunch``) and calls them without a lookup per call;
- the driver layer's own objects an executor makes or asks about: `as_device`, `stream`,
  `event`, `default_pool`, `pinned_buffer`, `context_alive`, `check_stream`, `is_pinned`,
  `device_count`, `context_of`, `enable_peer_access`;
- the entry points cuda-bindings does not wrap usably (`launch_host_func`, `exec_update`;
  see `orchestra.driver.entry_points`).

cuda-bindings' types and enums (``CUDA_MEMCPY3D``, ``CUgraphNodeType``, ...) are imported from
``cuda.bindings.driver`` directly: they make no driver call.

`default_api()` is the process's API (the real driver); executors take another with their
``driver=`` argument, and `use_api` swaps the process default for a block (CPU tests run every
executor on a stand-in that way: one object, no patched module names). Production code never
asks what kind of API it has.
"""

from __future__ import annotations

import contextlib
import threading


class DriverAPI:
    """The real driver: cuda-bindings' ``driver`` module plus the driver layer's objects.

    ``module``: the bindings module (default ``cuda.bindings.driver``).

    Thread-safety: may be shared between threads (one per process is): driver functions are looked
    up on first use and cached as attributes (an idempotent write), and the objects its methods make
    are independent of each other.
    """

    def __init__(self, module=None):
        if module is None:
            from cuda.bindings import driver as module
        self.module = module
        self._host_func_entry = None

    def __getattr__(self, name: str):
        # Reached only for names not yet bound on the instance: driver functions ("cu..."),
        # looked up once and cached as instance attributes.
        if not name.startswith("cu"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        try:
            fn = getattr(self.module, name)
        except AttributeError:
            raise AttributeError(f"the driver bindings have no {name}") from None
        self.__dict__[name] = fn
        return fn

    # -- the driver layer's objects -----------------------------------------------------------

    def as_device(self, device=None):
        """The `Device` for ``device`` (a `Device`, an ordinal or None: device 0)."""
        from orchestra.driver.device import as_device

        return as_device(device)

    def context_alive(self, ordinal: int) -> bool:
        """False once the device's primary context was released (interpreter exit)."""
        from orchestra.driver.device import context_alive

        return context_alive(ordinal)

    def stream(self, device, priority: int = 0):
        """A new non-blocking `Stream` on ``device`` with ``priority``."""
        from orchestra.driver.stream import Stream

        return Stream(device, priority)

    def event(self, device):
        """A new sync-only `Event` (``CU_EVENT_DISABLE_TIMING``) on ``device``."""
        from orchestra.driver.event import Event

        return Event(device)

    def default_pool(self, device):
        """The device's default `MemoryPool`, configured at first use (release threshold
        ``UINT64_MAX``, internal dependencies off): call it at setup, never inside a capture."""
        from orchestra.driver.memory import MemoryPool

        return MemoryPool.default(device)

    def pinned_buffer(self, nbytes: int, device):
        """A new `PinnedBuffer` of ``nbytes`` bytes (page-locked host memory, ``.array``
        ``.ptr`` ``.close()``) for ``device``."""
        from orchestra.driver.host import PinnedBuffer

        return PinnedBuffer(nbytes, device)

    def device_count(self) -> int:
        """Visible devices (``cuDeviceGetCount``)."""
        from orchestra.driver.device import device_count

        return device_count()

    def enable_peer_access(self, a: int, b: int) -> None:
        """Peer access between devices ``a`` and ``b``, both ways, once per pair
        (`orchestra.driver.peer.enable_peer_access`: `PeerAccessError` naming a pair that
        cannot)."""
        from orchestra.driver.peer import enable_peer_access

        enable_peer_access(a, b)

    def context_of(self, ordinal: int):
        """Device ``ordinal``'s primary context (``CUcontext``)."""
        return self.as_device(ordinal).context

    def check_stream(self, stream, what: str = "this call"):
        """``stream`` if it is an open `Stream`, else ``TypeError`` / ``ValueError``."""
        from orchestra.driver.stream import check_stream

        return check_stream(stream, what)

    def is_pinned(self, array) -> bool:
        """Whether ``array``'s memory is page-locked (``cuPointerGetAttribute``)."""
        from orchestra.driver.host import is_pinned

        return is_pinned(array)

    # -- entry points beside cuda-bindings ----------------------------------------------------

    def launch_host_func(self, stream, fn_address: int, token: int) -> int:
        """``cuLaunchHostFunc(stream, fn_address, token)`` through the driver's own entry point
        (safe to capture: see `orchestra.driver.entry_points`); returns the ``CUresult`` as an
        int. `OrchestraError` when the entry point cannot be found."""
        entry = self._host_func_entry
        if entry is None:
            from orchestra.driver.entry_points import driver_launch_host_func, launch_host_func

            if driver_launch_host_func(self.module) is None:
                launch_host_func(self.module, stream, fn_address, token)  # raises, naming why
            entry = self._host_func_entry = driver_launch_host_func(self.module)
        return int(entry(int(stream), int(fn_address), int(token)))

    def exec_update(self, exec_, graph) -> tuple:
        """``cuGraphExecUpdate`` with its result info: ``(CUresult, CUgraphExecUpdateResult,
        errorNode, errorFromNode)`` as ints (see `orchestra.driver.entry_points.exec_update`)."""
        from orchestra.driver.entry_points import exec_update

        return exec_update(exec_, graph, self.module)

    def __repr__(self) -> str:
        return f"<DriverAPI over {getattr(self.module, '__name__', self.module)!r}>"


_lock = threading.Lock()
_default = None


def default_api():
    """The process's driver API: the one executors use when not given ``driver=`` (the real
    `DriverAPI` unless `use_api` swapped it)."""
    global _default
    api = _default
    if api is None:
        with _lock:
            if _default is None:
                _default = DriverAPI()
            api = _default
    return api


@contextlib.contextmanager
def use_api(api):
    """Make ``api`` the process's default driver API inside the block (and restore the
    previous one after). Objects made inside keep the API they were made with."""
    global _default
    with _lock:
        previous = _default
        _default = api
    try:
        yield api
    finally:
        with _lock:
            _default = previous


__all__ = ["DriverAPI", "default_api", "use_api"]

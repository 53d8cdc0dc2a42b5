"""Run-time bindings: which host array (and which external device buffer) each graph buffer is.

A `HostBuffer` of a graph is a named slot; every run binds it to a numpy array with
``bindings={"name": array}``. All executors resolve bindings here, before anything is enqueued:

- every host buffer of the graph must be bound, and every name in ``bindings`` must be one of
  the graph's buffers (one `BindingError` lists all missing and unknown names);
- a host array must be C-contiguous, exactly ``HostBuffer.nbytes`` bytes (the error names both
  sizes), writable when the graph writes it (a D2H destination), and **pinned**:
  orchestra refuses pageable host memory with `PageableMemoryError` (a ``TypeError``) that says
  how to pin it. Pinned memory is what makes copies asynchronous; staging pageable data through
  pinned buffers is the caller's job (`orchestra.execute.staging.StagingPool` helps; the main
  job's ``--input`` path does it);
- a device `Buffer` that no `Alloc` node creates is *external*: bind it to a `DeviceBuffer`
  (anything with ``.ptr`` and ``.nbytes``) of at least ``Buffer.nbytes`` bytes.

Pinned checks are cached (`PinnedCheck`): memory from `PinnedBuffer` / `register_host` is found in
the driver layer's registry of pinned ranges without a driver call; other memory (pinned by
another library) is asked of the driver once and remembered while the array's memory owner lives.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, Callable, Mapping

import attrs
import numpy as np

from orchestra.driver import host as _host
from orchestra.errors import NotFoundError
from orchestra.execute.errors import PIN_HOWTO, BindingError, PageableMemoryError
from orchestra.graph import Alloc, Buffer, Free, HostBuffer, TaskGraph


# any object with the writable buffer protocol (a TypeError otherwise, caught by the caller)
_from_buffer: Callable[[Any], ctypes.c_char] = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def host_address(a: np.ndarray) -> int:
    """The address of a C-contiguous array's first byte (0.4 µs, against 2.4 µs for
    ``a.ctypes.data``); read-only, empty or strided arrays take the slow path."""
    try:
        return _addressof(_from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def is_pinned(array: np.ndarray) -> bool:
    """The driver's answer (``cuPointerGetAttribute``); a module-level seam tests replace."""
    return _host.is_pinned(array)


def _memory_owner(a):
    """The object that owns ``a``'s memory: the end of its ``.base`` chain."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


class PinnedCheck:
    """Answers "is this C-contiguous array page-locked?" with as few driver calls as possible.

    1. orchestra's own pinned memory (`orchestra.driver.pinned_ranges`): a bisect, no driver call;
    2. an earlier positive driver answer for the same address range and the same memory owner
       (kept by weak reference, so a freed array's address reused later is asked again);
    3. the driver (`is_pinned`: two ``cuPointerGetAttribute`` queries); positive answers are
       remembered. Negative answers are not (the user may pin the array next).

    ``driver_queries`` counts step 3 (tests and benchmarks read it).
    """

    MAX_REMEMBERED = 1024

    def __init__(self):
        self._known: dict[tuple[int, int], Any] = {}
        self.driver_queries = 0

    def __call__(self, array: np.ndarray) -> bool:
        lo = host_address(array)
        hi = lo + array.nbytes
        if _host.pinned_ranges().covers(lo, hi):
            return True
        owner = _memory_owner(array)
        ref = self._known.get((lo, hi))
        if ref is not None and ref() is owner:
            return True
        self.driver_queries += 1
        if not is_pinned(array):
            return False
        try:
            ref = weakref.ref(owner)
        except TypeError:  # an owner without weak references: never cached
            return True
        if len(self._known) >= self.MAX_REMEMBERED:
            self._known.clear()
        self._known[(lo, hi)] = ref
        return True


@attrs.frozen
class HostBinding:
    """A resolved host binding: ``address`` (int) of ``array`` (kept alive by this record)."""

    name: str
    array: np.ndarray
    address: int
    nbytes: int


@attrs.frozen
class DeviceBinding:
    """A resolved external device buffer: ``address`` (int) of ``obj`` (kept alive)."""

    name: str
    obj: Any
    address: int
    nbytes: int


@attrs.frozen
class ResolvedBindings:
    """Everything a run needs from ``bindings``: addresses by buffer name."""

    host: Mapping[str, HostBinding]
    device: Mapping[str, DeviceBinding]

    def address(self, name: str) -> int:
        b = self.host.get(name) or self.device.get(name)
        if b is None:
            raise NotFoundError(f"no binding named {name!r}")
        return b.address


def _describe(a: np.ndarray) -> str:
    return f"shape {a.shape}, {a.dtype}, {a.nbytes} bytes"


def as_host_array(name: str, value) -> np.ndarray:
    """The numpy array behind a host binding's ``value`` (an array, a `PinnedBuffer`, a live
    `HostRegistration`); `BindingError` for anything else."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, _host.PinnedBuffer):
        return value.view(np.uint8)
    if isinstance(value, _host.HostRegistration):
        value.ptr  # noqa: B018 - ValueError once unregistered
        return value.array
    raise BindingError(
        f"binding {name}: expected a pinned numpy array, a PinnedBuffer or a HostRegistration; "
        f"got {type(value).__name__}")


def check_writable(name: str, a: np.ndarray, writer: str | None) -> None:
    """`BindingError` when node ``writer`` (None: no node) writes host buffer ``name`` but ``a``
    is read-only."""
    if writer is not None and not a.flags.writeable:
        raise BindingError(f"binding {name}: the array is read-only, but node {writer} "
                           "writes it; bind a writable pinned array")


def check_host_array(name: str, value, nbytes: int, writer: str | None,
                     pinned: PinnedCheck) -> np.ndarray:
    """Every check of one host binding, before anything is enqueued: the array behind
    ``value``, no Python objects, C-contiguous, exactly ``nbytes`` bytes, writable when node
    ``writer`` writes it, page-locked (``pinned``). Returns the array; raises `BindingError`
    or `PageableMemoryError`, each saying what to change."""
    a = as_host_array(name, value)
    if a.dtype.hasobject:
        raise BindingError(f"binding {name}: an array of Python objects (dtype=object) "
                           "cannot be copied to the GPU")
    if not a.flags.c_contiguous:
        raise BindingError(
            f"binding {name}: the array is not C-contiguous ({_describe(a)}, strides "
            f"{a.strides}); copy it into a pinned contiguous array first, e.g. "
            f"pinned = PinnedBuffer.empty(a.shape, a.dtype); pinned.array[...] = a")
    if a.nbytes != nbytes:
        raise BindingError(
            f"binding {name}: the array has {a.nbytes} bytes ({_describe(a)}) but host "
            f"buffer {name} has {nbytes} bytes; the sizes must match exactly")
    check_writable(name, a, writer)
    if not pinned(a):
        raise PageableMemoryError(
            f"binding {name}: the array ({_describe(a)}) is in pageable memory; orchestra "
            f"copies asynchronously and only from or to page-locked memory: {PIN_HOWTO}")
    return a


class BindingSpec:
    """What a graph needs bound: its host buffers (and which of them it writes) and its external
    device buffers. Computed once per graph; `resolve` checks one run's ``bindings``."""

    def __init__(self, graph: TaskGraph):
        self.host: dict[str, HostBuffer] = {b.name: b for b in graph.host_buffers}
        allocated = {n.buffer.name for n in graph.nodes if isinstance(n, (Alloc, Free))}
        self.external: dict[str, Buffer] = {b.name: b for b in graph.buffers
                                            if b.name not in allocated}
        self.allocated = frozenset(allocated)
        written: dict[str, str] = {}
        for node in graph.nodes:
            if node.kind == "host":
                continue  # a host function writes host memory with the CPU: read-only is its call
            for acc in node.accesses():
                if acc.buffer.is_host and acc.mode.writes:
                    written.setdefault(acc.buffer.name, node.name)
        self.written = written

    def resolve(self, bindings: Mapping[str, Any] | None,
                pinned: PinnedCheck | None = None) -> ResolvedBindings:
        """Check ``bindings`` (name -> array / DeviceBuffer) and return the addresses.

        Raises `BindingError` (a ``ValueError``) or `PageableMemoryError` (a ``TypeError``);
        both say what to change.
        """
        bindings = {} if bindings is None else bindings
        if not isinstance(bindings, Mapping):
            raise BindingError(f"bindings must be a mapping of buffer name -> array; got "
                               f"{type(bindings).__name__}")
        pinned = pinned if pinned is not None else PinnedCheck()
        missing = [n for n in self.host if n not in bindings]
        missing += [n for n in self.external if n not in bindings]
        unknown = [n for n in bindings if n not in self.host and n not in self.external]
        if missing or unknown:
            parts = []
            if missing:
                parts.append("unbound: " + ", ".join(
                    f"{n} ({self._kind(n)}, {self._size(n)} bytes)" for n in missing))
            if unknown:
                allocated = [n for n in unknown if n in self.allocated]
                other = [n for n in unknown if n not in self.allocated]
                if other:
                    known = sorted(self.host) + sorted(self.external)
                    parts.append("not buffers of the graph: " + ", ".join(map(repr, other))
                                 + f" (it binds: {', '.join(known) if known else 'nothing'})")
                if allocated:
                    parts.append("allocated by the graph's own Alloc nodes, so they cannot be "
                                 "bound: " + ", ".join(map(repr, allocated)))
            raise BindingError("bindings do not match the graph; " + "; ".join(parts))
        host = {}
        for name, buf in self.host.items():
            host[name] = self._host(name, buf, bindings[name], pinned)
        device = {}
        for name, dbuf in self.external.items():
            device[name] = self._device(name, dbuf, bindings[name])
        return ResolvedBindings(host, device)

    def _kind(self, name):
        return "host buffer" if name in self.host else "external device buffer"

    def _size(self, name):
        return (self.host.get(name) or self.external[name]).nbytes

    def _host(self, name: str, buf: HostBuffer, value, pinned: PinnedCheck) -> HostBinding:
        a = check_host_array(name, value, buf.nbytes, self.written.get(name), pinned)
        return HostBinding(name, a, host_address(a), a.nbytes)

    def _device(self, name: str, buf: Buffer, value) -> DeviceBinding:
        ptr, nbytes = getattr(value, "ptr", None), getattr(value, "nbytes", None)
        if not isinstance(ptr, int) or not isinstance(nbytes, int):
            raise BindingError(
                f"binding {name}: external device buffer {name} needs a DeviceBuffer (anything "
                f"with int .ptr and .nbytes); got {type(value).__name__}")
        if nbytes < buf.nbytes:
            raise BindingError(f"binding {name}: the device buffer has {nbytes} bytes but buffer "
                               f"{name} needs {buf.nbytes}")
        dev = getattr(value, "device", None)
        ordinal = getattr(dev, "ordinal", dev)
        if isinstance(ordinal, int) and ordinal != buf.device:
            raise BindingError(f"binding {name}: the device buffer is on device {ordinal} but "
                               f"buffer {name} is on device {buf.device}")
        return DeviceBinding(name, value, ptr, nbytes)

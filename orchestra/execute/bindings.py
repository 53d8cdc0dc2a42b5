"""Run-time bindings: which host array (and which external device buffer) each graph buffer is.

A `HostBuffer` of a graph is a named slot; every run binds it to a numpy array with
``bindings={"name": array}``. Every executor and every graph exec keeps one `BindingTable`
per graph and checks bindings through it, before anything is enqueued:

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

The table is the fast path of eager runs and graph replays alike: a buffer bound to the very
object it was bound to before costs an identity test while orchestra's pinned ranges are
unchanged (`orchestra.driver.PinnedRanges.version`); an array checked before (a pool of staging
arrays bound in turn) is remembered by weak reference and skips the layout, size and pinned
checks; only writability is checked every time. Each `Binding` lists its *users*: where its
address is written (an eager run's address slot; a graph node's parameter record, field and
byte offset, with a ctypes cell over the field when its offset in the struct is known), so a
rebinding rewrites exactly those fields. Each also holds what keeps the bound memory alive
(``keep``) while it is bound.

Pinned checks are cached (`PinnedCheck`): memory from `PinnedBuffer` / `register_host` is found in
the driver layer's registry of pinned ranges without a driver call; other memory (pinned by
another library) is asked of the driver once and remembered while the array's memory owner lives.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Mapping

import attrs
import numpy as np

from orchestra.driver import host as _host
from orchestra.driver.owner import Lease
from orchestra.errors import NotFoundError
from orchestra.execute.errors import PIN_HOWTO, BindingError, PageableMemoryError
from orchestra.execute.lru import IdentityLRU
from orchestra.graph import Alloc, Buffer, Free, TaskGraph

# any object with the writable buffer protocol (a TypeError otherwise, caught by the caller)
_from_buffer: Callable[[Any], ctypes.c_char] = ctypes.c_char.from_buffer
_addressof = ctypes.addressof
_RANGES = _host.pinned_ranges()  # the process-wide registry of orchestra's pinned ranges


def host_address(a: np.ndarray) -> int:
    """The address of a C-contiguous array's first byte (0.4 µs, against 2.4 µs for
    ``a.ctypes.data``); read-only, empty or strided arrays take the slow path."""
    try:
        return _addressof(_from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


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
    3. the driver: ``query(array)`` (default: the process driver API's ``is_pinned``, two
       ``cuPointerGetAttribute`` queries); positive answers are remembered (the most recent
       `MAX_REMEMBERED`). Negative answers are not (the user may pin the array next).

    ``driver_queries`` counts step 3 (tests and benchmarks read it).
    """

    MAX_REMEMBERED = 1024

    def __init__(self, query: Callable[[np.ndarray], bool] | None = None):
        if query is None:
            from orchestra.driver.api import default_api

            query = default_api().is_pinned
        self._query = query
        self._known = IdentityLRU(self.MAX_REMEMBERED, weak=True)  # (owner,), (lo, hi)
        self.driver_queries = 0

    def __call__(self, array: np.ndarray) -> bool:
        lo = host_address(array)
        hi = lo + array.nbytes
        if _RANGES.covers(lo, hi):
            return True
        owner = _memory_owner(array)
        try:
            if self._known.get((owner,), (lo, hi)) is not None:
                return True
        except TypeError:  # an owner without weak references: never remembered
            pass
        self.driver_queries += 1
        if not self._query(array):
            return False
        try:
            self._known.put((owner,), (lo, hi), True)
        except TypeError:
            pass
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


# -- the checks ------------------------------------------------------------------------------


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


def check_device_buffer(name: str, value, buf: Buffer) -> int:
    """The address of ``value``, an external device buffer for graph buffer ``buf``: anything
    with int ``.ptr`` and ``.nbytes`` (a `DeviceBuffer`), at least ``buf.nbytes`` bytes, on
    ``buf``'s device when it says. `BindingError` otherwise."""
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
    return ptr


# -- users: where a bound address is written -------------------------------------------------


# Byte offsets of the address fields in the cuda-bindings parameter structs (the C ABI:
# CUDA_MEMCPY3D has four 8-byte source fields, then the memory type, srcHost at 40,
# srcDevice at 48, ..., dstHost at 128, dstDevice at 136; CUDA_MEMSET_NODE_PARAMS starts with
# dst). A rebinding writes the address straight into the struct through a ctypes cell (0.1 µs
# instead of 0.5 µs for the cuda-bindings property); `field_cell` checks the offset against
# the property first and returns None (use the property) if it does not match, so a field of
# another struct that has one of these names is safe.
FIELD_OFFSETS = {"srcHost": 40, "srcDevice": 48, "dstHost": 128, "dstDevice": 136, "dst": 0}
_PROBE = 0x0123456789ABCDEF


def field_cell(params, field: str):
    """A ``ctypes.c_uint64`` over ``params.<field>`` inside the cuda-bindings struct, or None."""
    try:
        offset = FIELD_OFFSETS[field]
        cell = ctypes.c_uint64.from_address(int(params.getPtr()) + offset)
        old = int(getattr(params, field))
        setattr(params, field, _PROBE)
        hit = cell.value == _PROBE
        setattr(params, field, old)
        return cell if hit and cell.value == old else None
    except Exception:  # noqa: BLE001 - the property path always works
        return None


class BindingUser:
    """One place a binding's address is written: ``record`` (the graph's `NodeRecord`, whose
    ``kind`` says which ``cuGraphExec*NodeSetParams`` applies it, and ``gnode`` the node),
    ``params`` (the struct the field lives in: the record's parameter struct, or a kernel's
    packed argument struct), ``field`` and ``offset`` (bytes into the buffer: the field holds
    address + offset). ``cell``: a ctypes cell over the field (None: set the attribute)."""

    __slots__ = ("record", "params", "field", "offset", "cell", "gnode")

    def __init__(self, record, params, field: str, offset: int):
        self.record = record
        self.params = params
        self.field = field
        self.offset = int(offset)
        self.cell = field_cell(params, field)
        self.gnode = None  # the record's CUgraphNode, copied by the exec that applies it

    def set(self, address: int) -> None:
        if self.cell is not None:
            self.cell.value = address + self.offset
        else:
            setattr(self.params, self.field, address + self.offset)

    def __repr__(self) -> str:
        where = getattr(self.record, "name", "?")
        return f"<BindingUser {where}.{self.field} +{self.offset}>"


class SlotUser:
    """An address slot of an eager run's address table: ``slots[index]`` holds the address."""

    __slots__ = ("slots", "index")
    record = None

    def __init__(self, slots: list, index: int):
        self.slots = slots
        self.index = index

    def set(self, address: int) -> None:
        self.slots[self.index] = address


# -- the table -------------------------------------------------------------------------------


class Binding:
    """One bindable buffer of a graph and what is bound to it now.

    ``name``; ``kind`` (``"host"`` or ``"device"``: an external device buffer); ``buffer``
    (the graph's `HostBuffer` / `Buffer`); ``nbytes``; ``writer`` (the node that writes a host
    buffer, else None); ``value`` (the object given in ``bindings``, None before the first
    bind), ``array`` (the numpy array behind a host value), ``address``; ``keep`` (what keeps
    the bound memory alive while it is bound: the value itself); ``version`` (of the pinned
    ranges when the value was checked); ``users`` (`BindingUser` / `SlotUser` list).
    """

    __slots__ = ("name", "kind", "buffer", "nbytes", "writer", "value", "array", "address",
                 "keep", "version", "users")

    def __init__(self, name: str, kind: str, buffer, writer: str | None = None):
        self.name = name
        self.kind = kind
        self.buffer = buffer
        self.nbytes = buffer.nbytes
        self.writer = writer
        self.value: Any = None
        self.array: Any = None  # np.ndarray once a host value is bound
        self.address = 0
        self.keep: Any = None
        self.version = -1
        self.users: list = []

    def __repr__(self) -> str:
        state = "unbound" if self.value is None else f"{self.address:#x}"
        return f"<Binding {self.kind} {self.name}: {state}, {len(self.users)} users>"


class BindingTable:
    """What a graph needs bound, and what is bound: one `Binding` per host buffer (`host`) and
    per external device buffer (`external`), computed once per graph.

    `resolve` checks a whole ``bindings`` mapping (a run, a build); `check` one value (a
    replay); `commit` records a checked value. ``pinned``: the `PinnedCheck` to use (default:
    a new one). Not thread-safe: its owner (an executor, a graph exec) holds its own lock.

    Also importable as ``BindingSpec`` (its earlier name).
    """

    CHECKED_MAX = 64  # remembered checked arrays (a pool of staging arrays bound in turn)

    def __init__(self, graph: TaskGraph, pinned: PinnedCheck | None = None):
        self.pinned = pinned if pinned is not None else PinnedCheck()
        allocated = {n.buffer.name for n in graph.nodes if isinstance(n, (Alloc, Free))}
        self.allocated = frozenset(allocated)
        written: dict[str, str] = {}
        for node in graph.nodes:
            if node.kind == "host":
                continue  # a host function writes host memory with the CPU: read-only is its call
            for acc in node.accesses():
                if acc.buffer.is_host and acc.mode.writes:
                    written.setdefault(acc.buffer.name, node.name)
        self.written = written
        self.host: dict[str, Binding] = {
            b.name: Binding(b.name, "host", b, written.get(b.name)) for b in graph.host_buffers}
        self.external: dict[str, Binding] = {
            b.name: Binding(b.name, "device", b) for b in graph.buffers
            if b.name not in allocated}
        self._checked = IdentityLRU(self.CHECKED_MAX, weak=True)  # (value,), (name,)

    # -- lookups ------------------------------------------------------------------------------

    def get(self, name: str) -> Binding | None:
        return self.host.get(name) or self.external.get(name)

    def values(self) -> dict:
        """buffer name -> the bound object, external device buffers first."""
        return {**{n: b.value for n, b in self.external.items()},
                **{n: b.value for n, b in self.host.items()}}

    def use(self, name: str, user) -> None:
        """Register ``user`` as a place binding ``name``'s address is written; names that are
        not bindings (buffers the graph allocates) are ignored."""
        b = self.host.get(name) or self.external.get(name)
        if b is not None:
            b.users.append(user)

    # -- checks -------------------------------------------------------------------------------

    def check(self, b: Binding, value, version: int) -> tuple:
        """Every check of ``value`` for binding ``b`` (``version``: the pinned ranges' version
        read before): ``(array or None, address)``. The fast paths: the very object bound now,
        or an array checked before, while the pinned ranges are unchanged (writability is
        checked every time). Raises `BindingError` / `PageableMemoryError`."""
        if b.kind == "device":
            if value is b.value and b.version >= 0:  # bound before (and not released since)
                return None, b.address
            return None, check_device_buffer(b.name, value, b.buffer)
        if value is b.value and version == b.version:
            check_writable(b.name, b.array, b.writer)
            return b.array, b.address
        try:
            hit = self._checked.get((value,), (b.name,))
        except TypeError:  # no weak references: checked every time
            hit = None
        if hit is not None and hit[1] == version:
            a = value if type(value) is np.ndarray else as_host_array(b.name, value)
            check_writable(b.name, a, b.writer)
            return a, hit[0]
        a = check_host_array(b.name, value, b.nbytes, b.writer, self.pinned)
        address = host_address(a)
        try:
            self._checked.put((value,), (b.name,), (address, version))
        except TypeError:
            pass
        return a, address

    def commit(self, b: Binding, value, array, address: int, version: int):
        """Record ``value`` (checked with `check`) as bound to ``b``; returns what kept the
        previous value alive (to `release_keep` once the work queued with it is done)."""
        old = b.keep
        b.value = value
        b.array = array
        b.address = address
        b.version = version
        b.keep = self.keep_alive(b, value, array)
        return old

    def keep_alive(self, b: Binding, value, array):
        """What keeps ``value``'s memory alive while it is bound to ``b``: the value itself
        (the one place a reference-counted lease on the memory behind it would be taken)."""
        return value

    def release(self) -> None:
        """Unbind everything: release what kept the bound memory alive (only once no queued
        work uses it); the table binds again from scratch."""
        for b in (*self.host.values(), *self.external.values()):
            keep, b.keep, b.value, b.array, b.version = b.keep, None, None, None, -1
            release_keep(keep)

    def unknown(self, bindings: Mapping) -> None:
        """`BindingError` listing every buffer ``bindings`` leaves unbound and every name that
        is not a binding of the graph (what an all-buffers bind needs)."""
        missing = [n for n in self.host if n not in bindings]
        missing += [n for n in self.external if n not in bindings]
        unknown = [n for n in bindings if n not in self.host and n not in self.external]
        if not missing and not unknown:
            return
        parts = []
        if missing:
            parts.append("unbound: " + ", ".join(
                f"{n} ({self._kind(n)}, {(self.host.get(n) or self.external[n]).nbytes} bytes)"
                for n in missing))
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

    def _kind(self, name):
        return "host buffer" if name in self.host else "external device buffer"

    # -- whole runs ---------------------------------------------------------------------------

    def bind(self, bindings: Mapping[str, Any] | None) -> list:
        """Check ``bindings`` (name -> array / DeviceBuffer: every buffer of the graph, nothing
        else), all before changing anything, then commit them and write the addresses of the
        changed ones to their users. Returns what kept the replaced values alive.

        Raises `BindingError` (a ``ValueError``) or `PageableMemoryError` (a ``TypeError``);
        both say what to change.
        """
        bindings = {} if bindings is None else bindings
        if not isinstance(bindings, Mapping):
            raise BindingError(f"bindings must be a mapping of buffer name -> array; got "
                               f"{type(bindings).__name__}")
        host, external = self.host, self.external
        if len(bindings) != len(host) + len(external):
            self.unknown(bindings)
        version = _RANGES.version
        checked: list[tuple[Any, ...]] = []
        try:
            for name, b in host.items():
                value = bindings[name]
                if value is b.value and version == b.version:
                    if b.writer is not None and not b.array.flags.writeable:
                        check_writable(name, b.array, b.writer)  # raises
                    continue
                checked.append((b, value) + self.check(b, value, version))
            for name, b in external.items():
                value = bindings[name]
                if value is not b.value or b.version < 0:
                    checked.append((b, value) + self.check(b, value, version))
        except KeyError:
            self.unknown(bindings)
            raise
        except Exception:
            self.unknown(bindings)  # a missing or unknown name is reported before a bad value
            raise
        released = []
        for b, value, array, address in checked:
            released.append(self.commit(b, value, array, address, version))
            for u in b.users:
                u.set(address)
        return released

    def resolve(self, bindings: Mapping[str, Any] | None,
                pinned: PinnedCheck | None = None) -> ResolvedBindings:
        """`bind` ``bindings`` and return the addresses as `ResolvedBindings` (``pinned``
        replaces the table's `PinnedCheck`)."""
        if pinned is not None:
            self.pinned = pinned
        self.bind(bindings)
        return ResolvedBindings(
            {n: HostBinding(n, b.array, b.address, b.nbytes) for n, b in self.host.items()},
            {n: DeviceBinding(n, b.value, b.address, b.value.nbytes)
             for n, b in self.external.items()})


BindingSpec = BindingTable  # its earlier name


def release_keep(keep) -> None:
    """End what `BindingTable.keep_alive` (or `commit`) handed out: a `BindingTable`'s keeps,
    a lease (``release()``), each item of a list or tuple; a plain object needs nothing."""
    if keep is None:
        return
    if isinstance(keep, BindingTable):
        keep.release()
    elif isinstance(keep, (list, tuple)):
        for k in keep:
            release_keep(k)
    elif isinstance(keep, Lease):
        keep.release()


__all__ = ["Binding", "BindingSpec", "BindingTable", "BindingUser", "DeviceBinding",
           "FIELD_OFFSETS", "HostBinding", "PinnedCheck", "ResolvedBindings", "SlotUser",
           "as_host_array", "check_device_buffer", "check_host_array", "check_writable",
           "field_cell", "host_address", "release_keep"]

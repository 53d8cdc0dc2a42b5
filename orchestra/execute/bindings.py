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
import weakref
from typing import Any, Callable, Mapping

import attrs
import numpy as np

from orchestra.driver import host as _host
from orchestra.driver.owner import CLOSE_EPOCH, Lease, ResourceClosedError
from orchestra.errors import NotFoundError
from orchestra.execute.errors import (
    PIN_HOWTO,
    BindingError,
    ClosedBindingError,
    PageableMemoryError,
)
from orchestra.execute.lru import IdentityLRU
from orchestra.graph import Alloc, Buffer, Free, TaskGraph

# any object with the writable buffer protocol (a TypeError otherwise, caught by the caller)
_from_buffer: Callable[[Any], ctypes.c_char] = ctypes.c_char.from_buffer
_addressof = ctypes.addressof
_RANGES = _host.pinned_ranges()  # the process-wide registry of orchestra's pinned ranges
_CLOSES = CLOSE_EPOCH  # bumped when a leased object is closed
_SELF = object()  # a remembered keep that is the value itself


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

    Thread-safety: may be shared between threads: the pinned ranges and the remembered answers are
    behind their own locks; ``driver_queries`` is a plain counter that concurrent calls may
    undercount.
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
    """A resolved host binding: ``address`` (int) of ``array`` (kept alive by this record).

    Immutable (frozen), but ``array`` is the caller's numpy array, held by reference: the record may
    be shared, the array's contents are guarded by whoever writes them.
    """

    name: str
    array: np.ndarray
    address: int
    nbytes: int


@attrs.frozen
class DeviceBinding:
    """A resolved external device buffer: ``address`` (int) of ``obj`` (kept alive).

    Immutable (frozen): may be shared between threads freely; ``obj`` is held by reference, not
    copied.
    """

    name: str
    obj: Any
    address: int
    nbytes: int


@attrs.frozen
class ResolvedBindings:
    """Everything a run needs from ``bindings``: addresses by buffer name.

    Immutable (frozen), but the two mappings are plain dicts held by reference: may be shared
    between threads as long as nobody modifies them.
    """

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
    lo = host_address(a)
    closed = _RANGES.closed_owner(lo, lo + a.nbytes)
    if closed is not None:  # pinned only until the work bound to it before is done
        raise ResourceClosedError(
            f"binding {name}: the host memory [{lo:#x}, {lo + a.nbytes:#x}) belongs to a "
            f"{closed} that is closed", closed)
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
    """A ``ctypes.c_uint64`` over ``params.<field>``, or None: inside a cuda-bindings struct at
    the field's `FIELD_OFFSETS` offset, or over an 8-byte integer field of a ctypes struct (a
    kernel's packed arguments, `orchestra.compiler.args`). The cell does not keep ``params``
    alive: its user holds both."""
    try:
        if isinstance(params, ctypes.Structure):
            desc = getattr(type(params), field)
            if desc.size != 8 or not isinstance(getattr(params, field), int):
                return None
            cell = ctypes.c_uint64.from_address(_addressof(params) + desc.offset)
        else:
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
    address + offset). ``cell``: a ctypes cell over the field (None: set the attribute).

    Thread-safety: not thread-safe: a mutable record of a `BindingTable`, changed only by its table,
    under the lock of the table's owner (an executor, a `GraphExec`).
    """

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
    """An address slot of an eager run's address table: ``slots[index]`` holds the address.

    Thread-safety: not thread-safe: a mutable record of a `BindingTable`, changed only by its table,
    under the lock of the table's owner (an executor, a `GraphExec`).
    """

    __slots__ = ("slots", "index")
    record = None

    def __init__(self, slots: list, index: int):
        self.slots = slots
        self.index = index

    def set(self, address: int) -> None:
        self.slots[self.index] = address


# -- the table -------------------------------------------------------------------------------


def bind_version() -> int:
    """What a checked binding's validity depends on, as one int that only grows: the pinned
    ranges' version (a range removed or its owner closed) plus the close epoch (a leased
    object closed, `orchestra.driver.owner.CLOSE_EPOCH`). An identity fast path is valid while
    it is unchanged."""
    return _RANGES.version + _CLOSES[0]


class Binding:
    """One bindable buffer of a graph and what is bound to it now.

    ``name``; ``kind`` (``"host"`` or ``"device"``: an external device buffer); ``buffer``
    (the graph's `HostBuffer` / `Buffer`); ``nbytes``; ``writer`` (the node that writes a host
    buffer, else None); ``value`` (the object given in ``bindings``, None before the first
    bind), ``array`` (the numpy array behind a host value), ``address``; ``keep`` (what keeps
    the bound memory alive while it is bound: the table's `Held` lease on the memory's owner,
    else the value itself); ``leaser`` (the callable that made the lease, None for a kept object);
    ``version`` (`bind_version` when the value was checked, -1 while unbound); ``users``
    (`BindingUser` / `SlotUser` list); ``known``: values checked for this binding before,
    ``id(value) -> (weak reference, address, version, leaser, keep or None)`` (a few staging
    arrays or device buffers bound in turn skip their checks and their lease lookup:
    `BindingTable.remembered`).

    Thread-safety: not thread-safe: a mutable record of a `BindingTable`, changed only by its table,
    under the lock of the table's owner (an executor, a `GraphExec`).
    """

    __slots__ = ("name", "kind", "buffer", "nbytes", "writer", "value", "array", "address",
                 "keep", "leaser", "version", "users", "known")

    KNOWN_MAX = 8

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
        self.leaser: Any = None
        self.version = -1
        self.users: list = []
        self.known: dict = {}

    def __repr__(self) -> str:
        state = "unbound" if self.value is None else f"{self.address:#x}"
        return f"<Binding {self.kind} {self.name}: {state}, {len(self.users)} users>"


def _leaser_of(value, array):
    """The callable that leases the memory behind a checked binding value, or None (the value
    itself is kept): ``value.lease`` for anything that has one (`DeviceBuffer`, `PinnedBuffer`,
    `HostRegistration`, another library's buffer with a ``lease()``), else, for a numpy array,
    the ``lease`` of the `PinnedBuffer` / `HostRegistration` whose pinned range holds it
    (`orchestra.driver.pinned_ranges`); None for memory pinned outside orchestra."""
    lease = getattr(value, "lease", None)
    if callable(lease) and not isinstance(value, np.ndarray):
        return lease
    if array is None:
        return None
    lo = host_address(array)
    owner = _RANGES.owner(lo, lo + array.nbytes)
    return owner.lease if owner is not None else None


class BindingTable:
    """What a graph needs bound, and what is bound: one `Binding` per host buffer (`host`) and
    per external device buffer (`external`), computed once per graph.

    `bind` checks a whole ``bindings`` mapping (a run, a build); `check` one value (a
    replay), `acquire` what keeps it alive, `commit` records it. ``pinned``: the `PinnedCheck`
    to use (default: a new one). ``where`` names what the table binds for (``"the eager
    executor's run"``, ``"a capture GraphExec"``): the closed-resource errors say it.

    Lifetimes (docs/errors.md, "Lifetimes"): every bound value is held by a lease on the memory
    behind it (`acquire`: one `Held` lease per owner, shared) while it is bound; a value
    replaced by a rebinding is returned by `commit` / `bind` for its owner to `release_keep`
    once no queued run or launch can read it; the table keeps a lease no binding uses (a pool
    of staging arrays is bound again soon) until its owner closes (`sweep`, run by the table's
    owner when nothing is queued) or the table is released (`release`). A value whose owner is
    closed is refused with `ClosedBindingError` before anything changes.

    Also importable as ``BindingSpec`` (its earlier name).

    Thread-safety: not thread-safe: its owner (an executor, a graph exec) calls it under its own
    lock.
    """

    CHECKED_MAX = 64  # remembered checked arrays (a pool of staging arrays bound in turn)
    HELD_MAX = 64  # leases kept for owners no binding uses now (bound again soon, often)

    def __init__(self, graph: TaskGraph, pinned: PinnedCheck | None = None, where: str = ""):
        self.pinned = pinned if pinned is not None else PinnedCheck()
        self.where = where
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
        self.all: dict[str, Binding] = {**self.host, **self.external}
        self._checked = IdentityLRU(self.CHECKED_MAX, weak=True)  # (value,), (name,)
        self._held: dict[int, Held] = {}  # id(lease source) -> its Held lease

    # -- lookups ------------------------------------------------------------------------------

    def get(self, name: str) -> Binding | None:
        return self.all.get(name)

    def values(self) -> dict:
        """buffer name -> the bound object, external device buffers first."""
        return {**{n: b.value for n, b in self.external.items()},
                **{n: b.value for n, b in self.host.items()}}

    def use(self, name: str, user) -> None:
        """Register ``user`` as a place binding ``name``'s address is written; names that are
        not bindings (buffers the graph allocates) are ignored."""
        b = self.all.get(name)
        if b is not None:
            b.users.append(user)

    # -- checks -------------------------------------------------------------------------------

    def closed_error(self, name: str, what: str, detail: str = "") -> ClosedBindingError:
        """The `ClosedBindingError` for binding ``name`` whose ``what`` was closed."""
        where = f" ({self.where})" if self.where else ""
        return ClosedBindingError(
            f"binding {name}{where}: the {what or 'object'} bound to it is closed{detail}; it "
            f"cannot be bound to new work (work bound to it before the close keeps its memory "
            f"until that work is done); bind an open one", name, what)

    def check(self, b: Binding, value, version: int) -> tuple:
        """Every check of ``value`` for binding ``b`` (``version``: `bind_version` read
        before): ``(array or None, address, leaser)``. The fast paths: the very object bound
        now, or an array checked before for this binding (or any binding of the table), while
        ``version`` is unchanged (writability is checked every time). Raises `BindingError`,
        `ClosedBindingError` (its owner closed), `PageableMemoryError`."""
        if b.kind == "device":
            if value is b.value and version == b.version:  # bound before, nothing closed since
                return None, b.address, b.leaser
            try:
                ptr = check_device_buffer(b.name, value, b.buffer)
            except ResourceClosedError as exc:
                raise self.closed_error(b.name, exc.what or type(value).__name__) from None
            return None, ptr, _leaser_of(value, None)
        if value is b.value and version == b.version:
            check_writable(b.name, b.array, b.writer)
            return b.array, b.address, b.leaser
        known = b.known.get(id(value))
        if known is not None and known[2] == version and known[0]() is value:
            a = value if type(value) is np.ndarray else as_host_array(b.name, value)
            if b.writer is not None and not a.flags.writeable:
                check_writable(b.name, a, b.writer)  # raises
            return a, known[1], known[3]
        try:
            hit = self._checked.get((value,), (b.name,))
        except TypeError:  # no weak references: checked every time
            hit = None
        if hit is not None and hit[1] == version:
            a = value if type(value) is np.ndarray else as_host_array(b.name, value)
            check_writable(b.name, a, b.writer)
            self._know(b, value, hit[0], version, hit[2])
            return a, hit[0], hit[2]
        try:
            a = check_host_array(b.name, value, b.nbytes, b.writer, self.pinned)
        except ResourceClosedError as exc:  # a closed PinnedBuffer / HostRegistration given
            raise self.closed_error(b.name, exc.what or type(value).__name__) from None
        address = host_address(a)
        leaser = _leaser_of(value, a)
        try:
            self._checked.put((value,), (b.name,), (address, version, leaser))
        except TypeError:
            pass
        self._know(b, value, address, version, leaser)
        return a, address, leaser

    @staticmethod
    def _know(b: Binding, value, address: int, version: int, leaser) -> None:
        known = b.known
        if len(known) >= b.KNOWN_MAX:
            known.clear()
        try:
            known[id(value)] = (weakref.ref(value), address, version, leaser, None)
        except TypeError:  # no weak references
            pass

    @staticmethod
    def remembered(b: Binding, value, version: int):
        """The fast path of `check` + `acquire` in one step, for a numpy array or an external
        device buffer checked and leased for ``b`` before, with nothing unpinned or closed
        since (``version``) and writability unchanged: ``(address, keep, leaser)`` with the
        use of its `Held` lease counted, else None (take `check` and `acquire`)."""
        known = b.known.get(id(value))
        if known is None or known[2] != version or known[0]() is not value:
            return None
        keep = known[4]
        if keep is None:
            return None
        if keep is _SELF:  # the value keeps itself (memory pinned outside orchestra)
            keep = value
        if b.kind == "host":
            if type(value) is not np.ndarray or (b.writer is not None
                                                 and not value.flags.writeable):
                return None
        if type(keep) is Held:
            if not keep.lease._claim:  # ended by a sweep (an owner beyond HELD_MAX)
                return None
            keep.count += 1
        return known[1], keep, known[3]
    def acquire(self, b: Binding, value, leaser):
        """What keeps ``value`` (checked for ``b``) alive while it is bound: the binding's own
        keep when ``value`` is bound already; else the table's `Held` lease on the value's
        owner (``leaser.__self__``), taken from ``leaser`` the first time and shared by every
        binding of that owner's memory; None ``leaser``: the value itself.
        `ClosedBindingError` when the owner was closed since the check."""
        if value is b.value and b.keep is not None:  # re-checked after some close elsewhere
            return b.keep
        if leaser is None:
            return value
        source = getattr(leaser, "__self__", leaser)
        held = self._held.get(id(source))  # the entry holds source: its id is not reused
        if held is not None:
            # `check` found the owner open at this version, and a lease of the table ends only
            # under its owner's lock (here held): the lease is still out unless it ended
            # before a close that `check` would have seen
            if held.lease.released:
                raise self.closed_error(b.name, held.lease.what)
            held.count += 1
            return held
        try:
            lease = leaser()
        except ResourceClosedError as exc:
            raise self.closed_error(b.name, exc.what) from None
        held = self._held[id(source)] = Held(lease, source)
        return held

    @staticmethod
    def kept(b: Binding, value, keep) -> None:
        """Note ``keep`` (from `acquire`) in ``b``'s entry for ``value``, for `remembered`."""
        known = b.known.get(id(value))
        if keep is value:
            keep = _SELF  # never the value itself: the entry must not keep it alive
        if known is not None and known[4] is not keep and known[0]() is value:
            b.known[id(value)] = known[:4] + (keep,)

    def commit(self, b: Binding, value, array, address: int, version: int, keep, leaser=None):
        """Record ``value`` (checked with `check`, kept by ``keep`` from `acquire`) as bound
        to ``b``; returns what kept the previous value alive (None when ``keep`` is the same),
        for its owner to `release_keep` once the work queued with it is done."""
        old = b.keep
        b.value = value
        b.array = array
        b.address = address
        b.version = version
        b.keep = keep
        b.leaser = leaser
        return None if old is keep else old

    def keep_alive(self, b: Binding, value, array):
        """What keeps ``value``'s memory alive while it is bound to ``b``: a lease on its
        owner (see `acquire`), else the value itself."""
        return self.acquire(b, value, _leaser_of(value, array))

    def release(self) -> None:
        """Unbind everything and end every lease the table holds (call it only once no queued
        work uses them); the table binds again from scratch."""
        for b in self.all.values():
            keep, b.keep, b.value, b.array, b.version, b.leaser = (b.keep, None, None, None, -1,
                                                                    None)
            release_keep(keep)
        held, self._held = self._held, {}
        for h in held.values():
            h.count = 0
            h.lease.release()
        for b in self.all.values():
            b.known.clear()

    @property
    def held(self) -> int:
        """How many leases the table holds now (bound or kept for a rebinding)."""
        return len(self._held)

    def sweep(self) -> int:
        """End the leases no binding uses any more (``count`` 0: every value bound to them was
        replaced and the work queued with it is done) whose owner was closed, and, beyond
        `HELD_MAX` entries, the unused ones that are oldest. Call it only once no queued work
        can read them. Returns how many leases ended."""
        held = self._held
        if not held:
            return 0
        spare = len(held) - self.HELD_MAX
        ended = 0
        for key, h in list(held.items()):
            if h.count <= 0 and (spare > 0 or h.lease.owner_closed):
                del held[key]
                h.lease.release()
                spare -= 1
                ended += 1
        return ended

    def drop_closed(self) -> int:
        """Unbind every binding whose leased owner was closed and `sweep` (only once no queued
        work uses them): the memory goes now, and binding the closed object again is
        refused. Returns how many bindings were dropped."""
        dropped = 0
        for b in self.all.values():
            keep = b.keep
            if type(keep) is Held and keep.lease.owner_closed:
                b.keep, b.value, b.array, b.version, b.leaser = None, None, None, -1, None
                keep.count -= 1
                dropped += 1
        self.sweep()
        return dropped

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

    def bind(self, bindings: Mapping[str, Any] | None) -> list | tuple:
        """Check ``bindings`` (name -> array / DeviceBuffer: every buffer of the graph, nothing
        else) and lease what they need, all before changing anything, then commit them and
        write the addresses of the changed ones to their users. Returns what kept the replaced
        values alive (release it once no queued work uses them).

        Raises `BindingError` (a ``ValueError``; `ClosedBindingError` for a closed value) or
        `PageableMemoryError` (a ``TypeError``); each says what to change.
        """
        if type(bindings) is not dict:  # the common case skips the ABC check
            bindings = {} if bindings is None else bindings
            if not isinstance(bindings, Mapping):
                raise BindingError(f"bindings must be a mapping of buffer name -> array; got "
                                   f"{type(bindings).__name__}")
        host, external = self.host, self.external
        if len(bindings) != len(host) + len(external):
            self.unknown(bindings)
        version = bind_version()
        checked: list[tuple[Any, ...]] = []  # (binding, value, array, address, leaser, keep)
        remember = self.remembered
        try:
            for name, b in host.items():
                value = bindings[name]
                if value is b.value and version == b.version:
                    if b.writer is not None and not b.array.flags.writeable:
                        check_writable(name, b.array, b.writer)  # raises
                    continue
                fast = remember(b, value, version)
                if fast is not None:  # checked and leased for this binding before
                    checked.append((b, value, value, fast[0], fast[2], fast[1]))
                else:
                    checked.append((b, value) + self.check(b, value, version) + (None,))
            for name, b in external.items():
                value = bindings[name]
                if value is not b.value or version != b.version:
                    fast = remember(b, value, version)
                    if fast is not None:
                        checked.append((b, value, None, fast[0], fast[2], fast[1]))
                    else:
                        checked.append((b, value) + self.check(b, value, version) + (None,))
        except BaseException as exc:
            for entry in checked:  # uses counted by `remembered` end again
                if entry[5] is not None:
                    release_keep(entry[5])
            if isinstance(exc, Exception):
                self.unknown(bindings)  # a missing or unknown name before a bad value
            raise
        if not checked:  # every value bound already: nothing to lease or write
            return _NOTHING
        keeps: list = []
        try:
            for b, value, _array, address, leaser, keep in checked:
                if keep is None:
                    keep = self.acquire(b, value, leaser)
                    if b.kind == "device":
                        self._know(b, value, address, version, leaser)
                    self.kept(b, value, keep)
                keeps.append(keep)
        except BaseException:
            for entry, keep in zip(checked, keeps):
                if keep is not entry[0].keep:
                    release_keep(keep)
            for entry in checked[len(keeps):]:
                if entry[5] is not None:
                    release_keep(entry[5])
            raise
        released = []
        for (b, value, array, address, leaser, _), keep in zip(checked, keeps):
            old = self.commit(b, value, array, address, version, keep, leaser)
            if old is not None:
                released.append(old)
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
_NOTHING: tuple = ()  # what bind returns when nothing changed


class Held:
    """A lease a `BindingTable` holds on one owner (``source``: the object whose ``lease()``
    made it), shared by the bindings bound to that owner's memory: ``count`` of them, plus the
    replaced values whose work may still run. At 0 the lease stays with the table (the next
    rebinding to the same memory costs no new lease) until `BindingTable.sweep` or `release`
    ends it.

    Thread-safety: not thread-safe: a mutable record of a `BindingTable`, changed only by its table,
    under the lock of the table's owner (an executor, a `GraphExec`).
    """

    __slots__ = ("lease", "count", "source", "epoch")

    def __init__(self, lease: Lease, source):
        self.lease = lease
        self.count = 1
        self.source = source
        self.epoch = _CLOSES[0]  # a close of its owner (leased: deferred) moves the epoch on

    def __repr__(self) -> str:
        return f"<Held {self.lease!r} x{self.count}>"


def release_keep(keep) -> None:
    """End what `BindingTable.acquire` (or `commit`, `bind`) handed out, once no queued work
    uses it: a `Held` lease's use (the table ends the lease later), a `BindingTable`'s keeps,
    a lease (``release()``), each item of a list or tuple; a plain object needs nothing."""
    if type(keep) is Held:
        keep.count -= 1
        if keep.count <= 0 and _CLOSES[0] != keep.epoch and keep.lease.owner_closed:
            keep.lease.release()  # unused and closed: nobody may bind it again
        return
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
           "FIELD_OFFSETS", "Held", "HostBinding", "PinnedCheck", "ResolvedBindings", "SlotUser",
           "as_host_array", "check_device_buffer", "check_host_array", "check_writable",
           "field_cell", "host_address", "release_keep"]

"""Replaying a graph exec with new host arrays, new external device buffers and new scalar
kernel arguments.

Replay updates are per node of the instantiated graph (``cuGraphExecMemcpyNodeSetParams``,
``cuGraphExecKernelNodeSetParams``, ``cuGraphExecMemsetNodeSetParams``), with parameters built
from orchestra's own records: each memcpy / kernel / memset node keeps the ``CUDA_MEMCPY3D`` /
``CUDA_KERNEL_NODE_PARAMS`` / ``CUDA_MEMSET_NODE_PARAMS`` object (and the packed kernel
argument struct its ``kernelParams`` points into) created when the graph was built. Parameters
are never read back from the driver.

Every binding has a prebuilt `Rebind`: the fields its address is written to (ctypes cells
straight into the structs where the field's offset is known, else the attribute) and, per node
it reaches, the node's SetParams call with its arguments bound once (``functools.partial`` over
the exec, the node, its parameter struct, the context). A rebinding writes exactly those
fields and calls exactly those nodes' SetParams; bindings that did not change, and the nodes
they reach, cost nothing (a name given with the very object bound now costs one identity
test while `bindings.bind_version` is unchanged).

Host arrays and external device buffers go through the exec's `BindingTable`, the same one a
build filled, with the same checks as a build (size, layout, writability, page-locked memory;
a device buffer at least the graph buffer's size, on its device); an array checked before (a
pool of staging arrays bound in turn) is remembered and skips those checks, except
writability. A new value is leased (docs/errors.md, "Lifetimes"); the lease of the value it
replaces is released once no launch can read it (at the next `synchronize`, or at once when
nothing is pending). An external device buffer is **re-pointed in place**; where the driver
refuses that for a node, the exec is updated for the caller instead (`GraphExec.update` with
the new binding: ``cuGraphExecUpdate``, else a new instantiation), with a log warning and
``last_update`` saying so.

Nodes inside bodies (conditional branches and loop bodies, child graphs) are not updated node
by node: a rebinding of a host array a body node uses, or new scalars for a kernel inside a
body, is refused before any call, naming the node (`GraphExec.update` rebuilds the whole graph
and updates it, bodies included; see `orchestra.execute.lowering.bodies`).

`Replay` is the part of `GraphExec` that does it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

import numpy as np

from orchestra.driver.check import error_from_result
from orchestra.errors import (
    ClosedError,
    KernelArgumentTypeError,
    KernelArgumentValueError,
    prefixed,
)
from orchestra.driver import host as _host
from orchestra.driver.device import _tls
from orchestra.driver.owner import CLOSE_EPOCH as _CLOSES
from orchestra.execute.bindings import _SELF, Held as _Held, bind_version, release_keep
from orchestra.execute.cuda_graph.state import ExecParts
from orchestra.execute.errors import BindingError, ClosedBindingError

log = logging.getLogger(__name__)
_RANGES = _host.pinned_ranges()
_ndarray = np.ndarray

#: CUDA graph node kind -> the per-node update that applies a rewritten parameter struct
SET_PARAMS = {"memcpy": "cuGraphExecMemcpyNodeSetParams",
              "kernel": "cuGraphExecKernelNodeSetParams",
              "memset": "cuGraphExecMemsetNodeSetParams"}
_WITH_CONTEXT = frozenset(("memcpy", "memset"))  # these SetParams take the CUcontext too


class KernelScalars:
    """A kernel node's replay state: its `KernelArgs` (``ka``), record, parameter struct,
    graph node, packed struct, the per-parameter (field, converter) slots looked up once, and
    ``apply`` (its ``cuGraphExecKernelNodeSetParams`` with every argument bound).

    Thread-safety: as `GraphExec`'s: its methods run under the exec's re-entrant lock; it is not
    used on its own.
    """

    __slots__ = ("ka", "rec", "params", "gnode", "struct", "layout", "pointers", "slots",
                 "apply")

    def __init__(self, ka, rec):
        self.ka = ka
        self.rec = rec
        self.params = rec.params
        self.gnode = rec.gnode
        self.struct = ka.packed.struct
        self.layout = ka.packed.layout
        self.pointers = frozenset(p.index for p in ka.pointers)
        self.slots: dict = {}
        self.apply = None

    def slot(self, node: str, key):
        slot = self.slots.get(key)
        if slot is None:
            layout = self.layout
            i = layout.resolve(key)
            if i in self.pointers or layout.params[i].is_pointer:
                raise KernelArgumentTypeError(
                    f"scalars[{node!r}]: parameter {layout.params[i].name} is a "
                    "pointer the graph binds to its buffers; only scalar "
                    "parameters can be replayed with new values")
            slot = self.slots[key] = (layout.field_names[i], layout.converters[i])
        return slot


class Rebind:
    """How a new address of one binding reaches the instantiated graph.

    ``binding`` (the `Binding`); ``cells`` (``(ctypes cell, offset)`` per field written
    straight into its struct); ``fields`` (``(struct, field, offset)`` per field set as an
    attribute: packed kernel arguments, fields of unknown offset); ``nodes`` (``(apply,
    record, call)`` per node the binding reaches: ``apply()`` is the node's SetParams with its
    arguments bound, ``call`` its name); ``unsupported`` (records of a kind no per-node update
    applies to: a rebinding updates the whole exec instead).

    Precomputed for the replay's fast path: ``inner`` (a user inside a body, which replays
    refuse); ``fast``: 0 when every rebinding takes the full path (``inner``, ``unsupported``),
    1 for an external device buffer, 2 for a host buffer nodes only read, 3 for one a node
    writes (the bound array's writability is checked at every rebinding); ``one``: ``(cell,
    offset, apply)`` when the binding has one field and one node (the usual case), else
    None.

    Thread-safety: as `GraphExec`'s: its methods run under the exec's re-entrant lock; it is not
    used on its own.
    """

    __slots__ = ("binding", "cells", "fields", "nodes", "unsupported", "inner", "fast", "one")

    def __init__(self, binding, cells, fields, nodes, unsupported):
        self.binding = binding
        self.cells = cells
        self.fields = fields
        self.nodes = nodes
        self.unsupported = unsupported
        self.inner = next((u for u in binding.users if getattr(u, "inside", None)), None)
        host = binding.kind == "host"
        self.fast = 0 if self.inner is not None or unsupported else (
            1 if not host else 3 if binding.writer is not None else 2)
        self.one = (cells[0][0], cells[0][1], nodes[0][0]) \
            if len(cells) == 1 and not fields and len(nodes) == 1 else None

    def write(self, address: int) -> None:
        """Write ``address`` (+ each field's offset) into every field (no driver call)."""
        for cell, off in self.cells:
            cell.value = address + off
        for struct, field, off in self.fields:
            setattr(struct, field, address + off)

    @property
    def calls(self) -> str:
        """The per-node updates a rebinding makes, for messages."""
        names = sorted({c for _, _, c in self.nodes})
        return ", ".join(names) if names else "no per-node update"


def plan_rebinds(table, setters: dict, exec_, ctx) -> dict:
    """binding name -> `Rebind` for every binding of ``table`` (a `BindingTable` whose users
    name records of the exec's instantiation graph). ``setters``: node kind -> the bound
    SetParams function; ``exec_`` / ``ctx``: the ``CUgraphExec`` and ``CUcontext`` they are
    bound to (a new instantiation needs a new plan)."""
    plans = {}
    for name, b in table.all.items():
        cells: list = []
        fields: list = []
        records: dict = {}
        for u in b.users:
            rec = u.record
            if rec is None:
                continue  # an eager slot: no graph node
            if u.cell is not None:
                cells.append((u.cell, u.offset))
            else:
                fields.append((u.params, u.field, u.offset))
            records.setdefault(id(rec), rec)
        nodes, unsupported = [], []
        for rec in records.values():
            fn = setters.get(rec.kind)
            if fn is None or rec.params is None:
                unsupported.append(rec)
            elif rec.kind in _WITH_CONTEXT:
                nodes.append((functools.partial(fn, exec_, rec.gnode, rec.params, ctx), rec,
                              SET_PARAMS[rec.kind]))
            else:
                nodes.append((functools.partial(fn, exec_, rec.gnode, rec.params), rec,
                              SET_PARAMS[rec.kind]))
        plans[name] = Rebind(b, tuple(cells), tuple(fields), tuple(nodes), tuple(unsupported))
    return plans


class Replay(ExecParts):
    """`GraphExec.replay` and `GraphExec.scalars` (a part of `GraphExec`: it uses the exec's
    state, lock, binding table and bound driver functions).

    Thread-safety: as `GraphExec`'s: its methods run under the exec's re-entrant lock; it is not
    used on its own.
    """

    def replay(self, bindings: Mapping[str, Any] | None = None,
               scalars: Mapping[str, Mapping] | None = None, *, stream=None,
               sync: bool = True):
        """Launch again with new host arrays, new external device buffers and/or new scalar
        kernel arguments.

        Args:
            bindings: buffer name -> what to bind, only those that change (a name bound to
                the very same object as before costs an identity test): a host buffer ->
                pinned array (numpy array, `PinnedBuffer`, `HostRegistration`; same byte size
                as the graph's host buffer, C-contiguous, writable for outputs, page-locked);
                an external device buffer -> a `DeviceBuffer` (anything with int ``.ptr`` and
                ``.nbytes``: at least the graph buffer's size, on its device), re-pointed in
                place (``cuGraphExecKernelNodeSetParams`` for kernel pointer arguments,
                ``cuGraphExecMemcpyNodeSetParams`` / ``cuGraphExecMemsetNodeSetParams`` for
                copies and memsets at their byte offsets; where the driver refuses, the exec
                is updated for the caller: see the module doc).
            scalars: kernel node name -> {parameter name or index: value} (scalar parameters
                only; checked like ``Kernel.pack``). Values persist for later launches.
            stream: launch stream (default: the exec's own).
            sync: wait for the launch (default) and return the `Timeline` when traced.

        Each change becomes one SetParams per node the changed binding reaches; nothing is
        re-instantiated. Raises before anything is launched (changes already applied stay
        applied): `BindingError` (`ClosedBindingError` for an object its owner closed: work
        bound to it before keeps running on its memory, new work may not bind it),
        `PageableMemoryError`, ``TypeError`` / ``ValueError`` for scalars, `ClosedError` once
        the exec is closed. Thread-safe: the exec's lock covers the rebinding, the launch and
        (``sync=True``) the wait, so two threads replaying one exec each get their own
        outputs, one after the other.
        """
        # acquire / release rather than a with-block: half the cost on this hot path
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                raise ClosedError("this GraphExec is closed")
            if getattr(_tls, "ctx", None) != self._ctx_key:  # another host thread: its context
                self.device.make_current()
            if bindings:
                try:
                    items = bindings.items()
                except AttributeError:
                    raise BindingError(f"bindings must be a mapping of buffer name -> array; "
                                       f"got {type(bindings).__name__}") from None
                plans = self._rebinds
                version = _RANGES.version + _CLOSES[0]  # bind_version(), inlined
                # what a replaced value's keep goes to: launches may still read it
                retired = self._state.retired if self._own_pending or self._state.streams \
                    else None
                for name, value in items:
                    p = plans.get(name)
                    if p is None:
                        raise BindingError(self._unknown_binding(name))
                    b = p.binding
                    # the very object bound now, nothing unpinned or closed since: no work
                    if value is b.value and b.version == version:
                        continue
                    # A value checked and leased for this binding before, nothing unpinned or
                    # closed since, its lease still out and (outputs) still writable: no
                    # checks, no lease lookup; its address is written and the nodes it reaches
                    # updated (`BindingTable.remembered` + `_rebind` + `commit`, inlined: the
                    # hot path of a pool of staging arrays bound in turn).
                    k = b.known.get(id(value))
                    fast = p.fast
                    if (k is None or not fast or k[2] != version or k[0]() is not value
                            or (keep := k[4]) is None
                            or (fast > 1 and (type(value) is not _ndarray
                                              or (fast == 3 and not value.flags.writeable)))):
                        if self._rebind(p, value, version):  # the exec was updated instead
                            plans = self._rebinds
                            version = bind_version()
                        continue
                    if type(keep) is _Held:
                        if not keep.lease._claim:  # ended by a sweep: lease it again
                            if self._rebind(p, value, version):
                                plans = self._rebinds
                                version = bind_version()
                            continue
                        keep.count += 1
                    elif keep is _SELF:  # memory pinned outside orchestra: kept by the value
                        keep = value
                    addr = k[1]
                    if addr != b.address:
                        try:
                            one = p.one
                            if one is not None:  # one field, one node: the common case
                                one[0].value = addr + one[1]
                                (err,) = one[2]()
                                refused = self._refused(p, p.nodes[0], err) if err else None
                            else:  # a fast plan has no unsupported node: _apply writes all
                                refused = self._apply(p, addr)
                        except BaseException:
                            if keep is not b.keep:
                                release_keep(keep)
                            p.write(b.address)  # the structs back on the bound address
                            raise
                        if refused is not None:  # the exec is updated for the caller instead
                            if keep is not b.keep:
                                release_keep(keep)  # the rebuild takes its own lease
                            self._update_for(b, value, refused)
                            plans = self._rebinds
                            version = bind_version()
                            continue
                    old = b.keep
                    b.value = value
                    b.array = value if fast > 1 else None
                    b.address = addr
                    b.version = version
                    b.keep = keep
                    b.leaser = k[3]
                    if old is not keep and old is not None:
                        if retired is not None:
                            retired.append(old)  # launches may still read it
                        elif type(old) is _Held:  # release_keep, inlined
                            old.count -= 1
                            if old.count <= 0 and _CLOSES[0] != old.epoch \
                                    and old.lease.owner_closed:
                                old.lease.release()
                        else:
                            release_keep(old)
            if scalars:
                try:
                    items = scalars.items()
                except AttributeError:
                    raise KernelArgumentTypeError(
                        "scalars must map kernel node name -> {parameter: value}; "
                        f"got {type(scalars).__name__}") from None
                for node, values in items:
                    self._set_scalars(node, values)
            if stream is None and self._tracer is None:  # the common path, inlined
                (err,) = self._graph_launch(self._exec, self._sh)
                if err:
                    self._launch_error(err)
                self._own_pending = True
                self._state.launched = True
                self.launches += 1
                return self._synchronize() if sync else None
            return self._launch(stream, sync)
        finally:
            lock.release()

    def _rebind(self, p, value, version: int) -> bool:
        """Check, lease and apply ``value`` for ``p.binding``; True when the exec was updated
        instead of re-pointed in place (its bindings and plans are new)."""
        b = p.binding
        inner = p.inner
        if inner is not None:
            raise BindingError(
                f"binding {b.name}: host buffer {b.name} is used by node {inner.record.name} "
                f"inside the body of {inner.inside}, which replays do not update node by node; "
                f"bind it with update(graph, bindings=...) (a whole-graph update) or build anew")
        table = self._table
        fast = table.remembered(b, value, version)
        if fast is not None:  # checked and leased before: no checks, no new lease
            addr, keep, leaser = fast
            a = value if b.kind == "host" else None
        else:
            try:
                a, addr, leaser = table.check(b, value, version)
            except ClosedBindingError:
                raise
            except BindingError as exc:
                if b.kind == "device":  # say how the replay would have applied it
                    exc.add_note(f"a replay re-points external device buffer {b.name} in "
                                 f"place ({p.calls})")
                raise
            keep = table.acquire(b, value, leaser)
            if b.kind == "device":
                table._know(b, value, addr, version, leaser)
            table.kept(b, value, keep)
        if addr != b.address:
            try:
                refused = self._apply(p, addr)
            except BaseException:
                if keep is not b.keep:
                    release_keep(keep)
                p.write(b.address)  # the structs back on the bound address
                raise
            if refused is not None:
                if keep is not b.keep:
                    release_keep(keep)  # the rebuild takes its own lease
                self._update_for(b, value, refused)
                return True
        old = table.commit(b, value, a, addr, version, keep, leaser)
        if old is not None:
            if self._own_pending or self._state.streams:
                self._state.retired.append(old)  # launches may still read it
            else:
                release_keep(old)
        return False

    def _apply(self, p, addr: int) -> str | None:
        """Write ``addr`` into ``p``'s fields and call each node's SetParams: None when done;
        on a refusal put the nodes changed so far back on the bound address and return why
        (the exec is updated instead), or raise the `CudaError` when the exec cannot update
        itself."""
        if p.unsupported:
            return (f"node {p.unsupported[0].name} ({p.unsupported[0].kind}) has no per-node "
                    "parameter update")
        for cell, off in p.cells:  # Rebind.write, inlined
            cell.value = addr + off
        for struct, field, off in p.fields:
            setattr(struct, field, addr + off)
        for node in p.nodes:
            (err,) = node[0]()
            if err:
                return self._refused(p, node, err)
        return None

    def _refused(self, p, node, err) -> str:
        """A node's SetParams refused: put the nodes changed so far back on the bound address
        (the exec stays consistent) and return why, or raise the `CudaError` when the exec
        cannot update itself."""
        b = p.binding
        _, rec, call = node
        p.write(b.address)
        for undo in p.nodes[:p.nodes.index(node)]:
            undo[0]()
        what = "external device buffer" if b.kind == "device" else "host buffer"
        error = error_from_result(call, err, context=f"node {rec.name}, re-pointing {what} "
                                  f"{b.name}")
        if self._rebuild is None:
            raise error
        return f"{call} refused node {rec.name} ({error.name})"

    def _update_for(self, b, value, reason: str) -> None:
        """Re-point binding ``b`` to ``value`` by updating the whole exec (a rebuild with the
        new binding, then ``cuGraphExecUpdate`` or a new instantiation), and say so."""
        what = "external device buffer" if b.kind == "device" else "host buffer"
        if self._rebuild is None:
            raise BindingError(f"binding {b.name}: {reason}, and this GraphExec was not made "
                               "by an executor, so it cannot update itself; build a new exec")
        bindings = self._table.values()
        bindings[b.name] = value
        result = self.update(self.taskgraph, self.plan, bindings)
        message = (f"re-pointing {what} {b.name}: {reason}; updated the exec with the new "
                   f"binding instead ({result.message})")
        log.warning(message)
        self.last_update = type(result)(result.updated, result.reinstantiated, result.reason,
                                        result.node, result.from_node, message)
        self.repoint_updates += 1

    def _unknown_binding(self, name: str) -> str:
        if name in self._built.allocs:
            return (f"binding {name}: buffer {name} is allocated by the graph itself (its Alloc "
                    "node), so it cannot be bound")
        host = ", ".join(sorted(self._table.host)) or "none"
        ext = ", ".join(sorted(self._table.external)) or "none"
        return (f"binding {name}: not a host buffer or external device buffer of this graph "
                f"(host buffers: {host}; external device buffers: {ext})")

    def _set_scalars(self, node: str, values: Mapping) -> None:
        entry = self._kernels.get(node)
        if entry is None and node in self._built.inner:
            raise KernelArgumentValueError(
                f"scalars: kernel node {node} is inside the body of "
                f"{self._built.inner[node].container}, which replays do not update node by "
                "node; change it with update(graph) (a whole-graph update) or build anew")
        if entry is None:
            known = ", ".join(sorted(self._kernels)) or "none"
            raise KernelArgumentValueError(
                f"scalars: {node!r} is not a kernel node of this graph (kernel "
                f"nodes: {known})")
        struct = entry.struct
        try:
            items = values.items()
        except AttributeError:
            raise KernelArgumentTypeError(
                f"scalars[{node!r}] must map parameter name or index -> value; got "
                f"{type(values).__name__}") from None
        for key, value in items:
            field, conv = entry.slot(node, key)
            try:
                setattr(struct, field, conv(value))
            except (TypeError, ValueError) as exc:
                raise prefixed(exc, f"kernel node {node}: ", KernelArgumentTypeError,
                               KernelArgumentValueError) from exc
        (err,) = entry.apply()
        if err:
            raise error_from_result("cuGraphExecKernelNodeSetParams", err, context=f"node {node}")

    def scalars(self, node: str) -> dict:
        """The current packed arguments of kernel node ``node``: {parameter name: value}.
        `ClosedError` once the exec is closed, `KernelArgumentValueError` for a node that is not
        one of its kernel nodes."""
        if self._closed:
            raise ClosedError("this GraphExec is closed")
        entry = self._kernels.get(node)
        if entry is None:
            raise KernelArgumentValueError(f"scalars: {node!r} is not a kernel node of this graph")
        packed = entry.ka.packed
        return {p.name: v for p, v in zip(packed.layout.params, packed.values())}


__all__ = ["KernelScalars", "Rebind", "Replay", "SET_PARAMS", "plan_rebinds"]

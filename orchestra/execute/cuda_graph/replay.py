"""Replaying a graph exec with new host arrays and new scalar kernel arguments.

Replay updates are per node of the instantiated graph (``cuGraphExecMemcpyNodeSetParams``,
``cuGraphExecKernelNodeSetParams``), with parameters built from orchestra's own records: each
memcpy / kernel node keeps the ``CUDA_MEMCPY3D`` / ``CUDA_KERNEL_NODE_PARAMS`` object (and the
packed kernel argument struct its ``kernelParams`` points into) created when the graph was
built, and a replay changes only the field that changed (``srcHost`` / ``dstHost`` through a
ctypes cell, one packed scalar) before handing the same object to the driver. Parameters are
never read back from the driver.

The bindings go through the exec's `BindingTable`, the same one a build filled: a host buffer
bound to the very object it is bound to costs an identity test (while orchestra's pinned ranges
are unchanged; its writability is not checked again); a new array is checked (C-contiguous, same byte size, writable if the graph
writes it, page-locked: orchestra's own pinned ranges first, the driver only for memory pinned
elsewhere); an array checked before (a pool of staging arrays bound in turn) is remembered by
weak reference and skips those checks, except writability, until the pinned ranges lose a
range (a `PinnedBuffer` closed, a registration undone) or an `update` changes the build. Each
binding lists the fields its address is written to (`BindingUser`), so a rebinding rewrites
exactly those.

Nodes inside bodies (conditional branches and loop bodies, child graphs) are not updated node
by node: a rebinding of a host array a body node uses, or new scalars for a kernel inside a
body, is refused before any call, naming the node (`GraphExec.update` rebuilds the whole graph
and updates it, bodies included; see `orchestra.execute.lowering.bodies`).

`Replay` is the part of `GraphExec` that does it.
"""

from __future__ import annotations

from typing import Any, Mapping

from orchestra.driver import host as _host
from orchestra.driver.check import error_from_result
from orchestra.errors import (
    ClosedError,
    KernelArgumentTypeError,
    KernelArgumentValueError,
    prefixed,
)
from orchestra.execute.bindings import release_keep
from orchestra.execute.cuda_graph.state import ExecParts
from orchestra.execute.errors import BindingError

_RANGES = _host.pinned_ranges()  # the process-wide registry (one object): its version


class KernelScalars:
    """A kernel node's replay state: its `KernelArgs` (``ka``), record, parameter struct,
    graph node, packed struct, and the per-parameter (field, converter) slots looked up once."""

    __slots__ = ("ka", "rec", "params", "gnode", "struct", "layout", "pointers", "slots")

    def __init__(self, ka, rec):
        self.ka = ka
        self.rec = rec
        self.params = rec.params
        self.gnode = rec.gnode
        self.struct = ka.packed.struct
        self.layout = ka.packed.layout
        self.pointers = frozenset(p.index for p in ka.pointers)
        self.slots: dict = {}

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


class Replay(ExecParts):
    """`GraphExec.replay` and `GraphExec.scalars` (a part of `GraphExec`: it uses the exec's
    state, lock, binding table and bound driver functions)."""

    def replay(self, bindings: Mapping[str, Any] | None = None,
               scalars: Mapping[str, Mapping] | None = None, *, stream=None,
               sync: bool = True):
        """Launch again with new host arrays and/or new scalar kernel arguments.

        Args:
            bindings: host buffer name -> pinned array (numpy array, `PinnedBuffer`,
                `HostRegistration`), only those that change; a name bound to the very same
                object as before costs nothing (an external device buffer too; another one is
                refused: its address is in the graph's nodes). Same byte size as the graph's
                host buffer, C-contiguous, writable for outputs, page-locked.
            scalars: kernel node name -> {parameter name or index: value} (scalar parameters
                only; checked like ``Kernel.pack``). Values persist for later launches.
            stream: launch stream (default: the exec's own).
            sync: wait for the launch (default) and return the `Timeline` when traced.

        Each change becomes one ``cuGraphExec*NodeSetParams`` per affected node of the
        instantiated graph; nothing is re-instantiated. Raises `BindingError` /
        `PageableMemoryError` / ``TypeError`` / ``ValueError`` before anything is launched
        (changes already applied stay applied). Thread-safe (the exec's lock).
        """
        with self._lock:
            if self._closed:
                raise ClosedError("this GraphExec is closed")
            if bindings:
                try:
                    items = bindings.items()
                except AttributeError:
                    raise BindingError(f"bindings must be a mapping of host buffer name -> "
                                       f"array; got {type(bindings).__name__}") from None
                host = self._host
                version = _RANGES.version
                for name, value in items:
                    b = host.get(name)
                    # the very object bound now, its memory still pinned: nothing to do
                    if b is None or value is not b.value or b.version != version:
                        self._rebind(name, b, value, version)
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

    def _rebind(self, name: str, b, value, version: int) -> None:
        if b is None:
            e = self._table.external.get(name)
            if e is not None and value is e.value and e.version >= 0:
                return  # the external device buffer bound already: nothing changes
            raise BindingError(self._unknown_binding(name))
        inner = next((u for u in b.users if getattr(u, "inside", None)), None)
        if inner is not None:
            raise BindingError(
                f"binding {name}: host buffer {name} is used by node {inner.record.name} inside "
                f"the body of {inner.inside}, which replays do not update node by node; bind "
                f"it with update(graph, bindings=...) (a whole-graph update) or build anew")
        table = self._table
        a, addr = table.check(b, value, version)
        if addr != b.address:
            exec_, ctx, set_memcpy = self._exec, self._ctx, self._set_memcpy
            users = b.users
            for u in users:
                cell = u.cell
                if cell is not None:
                    cell.value = addr + u.offset
                else:
                    setattr(u.params, u.field, addr + u.offset)
                (err,) = set_memcpy(exec_, u.gnode, u.params, ctx)
                if err:
                    self._rollback(b, u)
                    raise error_from_result("cuGraphExecMemcpyNodeSetParams", err,
                                            context=f"node {u.record.name}, rebinding {name}")
        old = table.commit(b, value, a, addr, version)
        if old is not None and old is not b.keep:
            if self._own_pending or self._state.streams:
                self._state.retired.append(old)  # launches may still read it
            else:
                release_keep(old)

    def _rollback(self, b, failed) -> None:
        """Put the nodes changed so far (up to ``failed``) back on the bound array, so the exec
        stays consistent after a refused update."""
        if b.value is None:
            return
        for u in b.users:
            u.set(b.address)
            self._set_memcpy(self._exec, u.gnode, u.params, self._ctx)
            if u is failed:
                break

    def _unknown_binding(self, name: str) -> str:
        if name in self._table.external:
            return (f"binding {name}: external device buffer {name} is baked into the graph "
                    "(its address is in the graph's nodes); build a new exec to change it")
        if name in self._built.allocs:
            return f"binding {name}: buffer {name} is allocated by the graph itself"
        known = ", ".join(sorted(self._host)) or "none"
        return f"binding {name}: not a host buffer of this graph (host buffers: {known})"

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
        (err,) = self._set_kernel(self._exec, entry.gnode, entry.params)
        if err:
            raise error_from_result("cuGraphExecKernelNodeSetParams", err, context=f"node {node}")

    def scalars(self, node: str) -> dict:
        """The current packed arguments of kernel node ``node``: {parameter name: value}."""
        packed = self._kernels[node].ka.packed
        return {p.name: v for p, v in zip(packed.layout.params, packed.values())}


__all__ = ["KernelScalars", "Replay"]

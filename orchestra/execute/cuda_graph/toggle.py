"""Switching nodes of an instantiated graph off and on without re-instantiating it
(``cuGraphNodeSetEnabled``): optional work (a debug copy, a logging kernel) left in the graph
and skipped by the launches that do not need it.

A disabled node behaves as an empty node until it is enabled again; its parameters stay as they
are (CUDA driver API, ``cuGraphNodeSetEnabled``). The driver switches kernel, memcpy and memset
nodes only (on this driver a child graph node gives CUDA_ERROR_INVALID_VALUE), and orchestra
addresses the nodes at the top of the graph only, so any other node (a host function, a memory
node, a child graph, a conditional node, a node inside a body) is refused by name before the
call. Only later launches see a change; launches already queued run as they were. A disabled
node stays disabled across `GraphExec.update` (its state is applied again to the updated or
re-instantiated graph) while a node of that name is still there.

`Toggle` is the part of `GraphExec` that does it.
"""

from __future__ import annotations

from orchestra.driver.check import error_from_result
from orchestra.execute.cuda_graph.state import ExecParts
from orchestra.execute.errors import ExecutorArgumentValueError

#: the CUDA graph node kinds ``cuGraphNodeSetEnabled`` switches
SWITCHABLE = frozenset({"kernel", "memcpy", "memset"})


class Toggle(ExecParts):
    """`GraphExec.disable`, `GraphExec.enable`, `GraphExec.is_enabled`, `GraphExec.disabled`
    (a part of `GraphExec`: it uses the exec's lock, records and driver API).

    Thread-safety: as `GraphExec`'s: its methods run under the exec's re-entrant lock; it is not
    used on its own.
    """

    _disabled: set

    def disable(self, *nodes: str) -> None:
        """Switch the orchestra nodes ``nodes`` off for later launches (``cuGraphNodeSetEnabled``
        with 0). `ExecutorArgumentValueError` before any call for a node the driver cannot
        switch (see the module doc) or that is not in the graph. Thread-safe."""
        self._set_enabled(nodes, False)

    def enable(self, *nodes: str) -> None:
        """Switch ``nodes`` on again (``cuGraphNodeSetEnabled`` with 1); as `disable`."""
        self._set_enabled(nodes, True)

    def is_enabled(self, node: str) -> bool:
        """Whether ``node`` runs in the next launch (orchestra's own record of what it set)."""
        with self._lock:
            self._check_open()
            self._switchable(node)
            return node not in self._disabled

    @property
    def disabled(self) -> frozenset:
        """The nodes switched off now."""
        return frozenset(self._disabled)

    def _set_enabled(self, nodes, enabled: bool) -> None:
        with self._lock:
            self._check_open()
            records = [self._switchable(n) for n in nodes]  # every check before any call
            for rec in records:
                self._set_node_enabled(rec, enabled)
                if enabled:
                    self._disabled.discard(rec.name)
                else:
                    self._disabled.add(rec.name)

    def _set_node_enabled(self, rec, enabled: bool) -> None:
        (err,) = self._api.cuGraphNodeSetEnabled(self._exec, rec.gnode, 1 if enabled else 0)
        if err:
            raise error_from_result("cuGraphNodeSetEnabled", err,
                                    context=f"{'enabling' if enabled else 'disabling'} node "
                                            f"{rec.name} ({rec.kind})")

    def _switchable(self, node: str):
        rec = self._records.get(node)
        if rec is None:
            inner = self._built.inner.get(node)
            if inner is not None:
                raise ExecutorArgumentValueError(
                    f"node {node} is inside the body of {inner.container}: only nodes at the "
                    "top of the graph can be switched off; switch the node holding it "
                    "(a kernel of its own) or build the graph without it")
            known = ", ".join(sorted(n for n, r in self._records.items()
                                     if r.kind in SWITCHABLE)) or "none"
            raise ExecutorArgumentValueError(
                f"node {node!r} is not a node of this graph (switchable nodes: {known})")
        if rec.kind not in SWITCHABLE:
            raise ExecutorArgumentValueError(
                f"node {node} is a {rec.kind} node: cuGraphNodeSetEnabled switches kernel, "
                f"memcpy and memset nodes only (the driver refuses the others); move the "
                f"optional work into a kernel, copy or memset to switch it off")
        return rec

    def _reapply_enabled(self) -> None:
        """After an update or a re-instantiation: switch the disabled nodes off again (those
        still in the graph; the others are forgotten)."""
        for name in sorted(self._disabled):
            rec = self._records.get(name)
            if rec is None or rec.kind not in SWITCHABLE:
                self._disabled.discard(name)
                continue
            self._set_node_enabled(rec, False)


__all__ = ["SWITCHABLE", "Toggle"]

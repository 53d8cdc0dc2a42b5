"""A graph exec made to run a new task graph: ``cuGraphExecUpdate`` in place when the new
CUDA graph is topologically identical, else the new graph instantiated instead.

`UpdateResult` says which happened and, for a refusal, the driver's
``CUgraphExecUpdateResult`` and the offending nodes (``cuGraphExecUpdate``'s result info,
through the driver's own entry point: `orchestra.driver.entry_points.exec_update`). `Update`
is the part of `GraphExec` that does it.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import attrs
from cuda.bindings import driver as _d

from orchestra.driver.check import cu
from orchestra.errors import OrchestraError
from orchestra.execute.bindings import release_keep
from orchestra.execute.cuda_graph.built import BuiltGraph
from orchestra.execute.cuda_graph.state import ExecParts
from orchestra.schedule import verify

log = logging.getLogger(__name__)


@attrs.frozen
class UpdateResult:
    """What `GraphExec.update` did: ``updated`` (``cuGraphExecUpdate`` accepted the new graph)
    or ``reinstantiated`` (it refused: ``reason`` is the ``CUgraphExecUpdateResult`` name,
    ``node`` / ``from_node`` the offending orchestra nodes when the driver named them,
    ``message`` one line saying so).

    Immutable: may be shared between threads freely.
    """

    updated: bool
    reinstantiated: bool
    reason: str | None = None
    node: str | None = None
    from_node: str | None = None
    message: str = ""


class Update(ExecParts):
    """`GraphExec.update` and what it needs (a part of `GraphExec`: it uses the exec's state,
    lock and driver API).

    Thread-safety: as `GraphExec`'s: its methods run under the exec's re-entrant lock; it is not
    used on its own.
    """

    def update(self, taskgraph, plan=None, bindings: Mapping[str, Any] | None = None
               ) -> UpdateResult:
        """Make this exec run ``taskgraph`` (a new structure or new sizes with the same node
        kinds and order): build its CUDA graph the way this exec was built (with ``plan``, else
        the current plan while it is still valid for ``taskgraph``, else a new schedule), try
        ``cuGraphExecUpdate``; when the driver refuses, report its ``CUgraphExecUpdateResult``
        and the offending node (``last_update``, a log warning) and instantiate the new graph
        instead. ``bindings`` default: the current ones (they must fit the new graph).
        Returns the `UpdateResult`."""
        with self._lock:
            self._check_open()
            if self._rebuild is None:
                raise OrchestraError("this GraphExec was not made by an executor; it cannot "
                                     "rebuild for update()")
            if bindings is None:  # the current host arrays and external device buffers
                bindings = self._table.values()
            built = self._rebuild(taskgraph, self._plan_for(taskgraph, plan), bindings)
            try:
                self.device.make_current()
                err, result, error_node, error_from = self._api.exec_update(self._state.exec,
                                                                            built.cugraph)
            except BaseException:
                self._discard(built)
                raise
            ok = not err and result == 0
            if ok:
                # Per-node updates keep naming nodes of the instantiation graph; the updated
                # graph is topologically identical and built in the same order, so the i-th
                # orchestra node of the new build pairs with the i-th of the first.
                for rec, gnode in zip((built.records[n] for n in built.order), self._inst_nodes):
                    rec.gnode = gnode
                self._state.graphs.append(built.cugraph)  # kept: its nodes back the update
                self._adopt(built)
                self._plan_replays()
                self._reapply_enabled()
                self.last_update = UpdateResult(True, False, None, None, None,
                                                "cuGraphExecUpdate accepted the new graph")
                return self.last_update
            if result is None:
                reason = "unknown (the result info was not available)"
            else:
                try:
                    reason = _d.CUgraphExecUpdateResult(result).name
                except ValueError:
                    reason = f"CUgraphExecUpdateResult({result})"
            node = built.node_name(error_node)
            from_node = built.node_name(error_from)
            msg = f"cuGraphExecUpdate refused the new graph: {reason}"
            if err:
                try:
                    msg += f" ({_d.CUresult(err).name})"
                except ValueError:
                    msg += f" (CUresult {err})"
            if node:
                msg += f" at node {node}"
            if from_node:
                msg += f" (edge from {from_node})"
            msg += "; instantiated the new graph instead"
            log.warning(msg)
            self._reinstantiate(built)
            self._reapply_enabled()
            self.last_update = UpdateResult(False, True, reason, node, from_node, msg)
            return self.last_update

    def _plan_for(self, taskgraph, plan):
        """The plan to rebuild ``taskgraph`` with: the one given; else the current plan when it
        runs exactly the new graph's nodes and the hazard verifier finds nothing wrong with it
        for the new graph (same stream order, same topology: what ``cuGraphExecUpdate`` needs,
        where a fresh schedule of new sizes may order the nodes differently); else None (the
        executor schedules anew)."""
        old = self.plan
        if plan is not None or old is None:
            return plan
        if set(old.node_stream) != {n.name for n in taskgraph.nodes}:
            return None
        try:
            return old if not verify(old, taskgraph) else None
        except OrchestraError:  # e.g. the new graph has a cycle: let the rebuild report it
            return None

    def _discard(self, built: BuiltGraph) -> None:
        try:
            self._api.cuGraphDestroy(built.cugraph)
        finally:
            if built.tracer is not None:
                built.tracer.close()
            release_keep(built.keeps)  # never launched: its leases can go now

    def _reinstantiate(self, built: BuiltGraph) -> None:
        try:
            new_exec = cu(self._api.cuGraphInstantiate, built.cugraph, self.flags)
        except BaseException:
            self._discard(built)
            raise
        # the old exec: wait for its launches, destroy it and its graphs (a host function of
        # those launches that raised is reported by the next synchronize, not here: the swap
        # must complete)
        self._synchronize(raise_host_errors=False)
        old = self._state
        api = self._api
        api.cuGraphExecDestroy(old.exec)
        if old.unfreed and old.launched:
            for dptr in old.unfreed:
                api.cuMemFree(dptr)
        old.unfreed = []
        for g in old.graphs:
            api.cuGraphDestroy(g)
        for t in old.tracers:
            t.close()
        old.graphs = [built.cugraph]
        old.tracers = []
        release_keep([b.keeps for b in old.keep] + old.retired)  # synchronized above
        old.keep = []
        old.retired = []
        old.launched = False
        old.exec = new_exec
        self._exec = new_exec
        self._adopt(built)
        self._inst_nodes = [built.records[n].gnode for n in built.order]
        self._plan_replays()
        self._upload(None)


__all__ = ["Update", "UpdateResult"]

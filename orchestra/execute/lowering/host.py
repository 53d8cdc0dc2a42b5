"""Lowering of `HostFunc`: a Python callable run by the driver in stream order.

    stream      cuLaunchHostFunc through the driver's own entry point (`DriverAPI.
                launch_host_func`): the callback is one C trampoline per table
                (`HostCallbacks`), ``userData`` the callable's token; captured, the host node
                holds exactly those two (cuda-bindings' wrapper would capture a one-shot
                record that the first launch frees)
    graph       cuGraphAddHostNode (CUDA_HOST_NODE_PARAMS: fn = the trampoline, userData =
                the token)

A host function runs on the host, so it is not bound to the executor's device.
"""

from __future__ import annotations

from cuda.bindings import driver as _d

from orchestra.driver.check import error_from_result
from orchestra.execute.lowering.table import Lowering, register
from orchestra.graph import HostFunc


def host_params(fn_address: int, token: int):
    """``CUDA_HOST_NODE_PARAMS``: the trampoline ``fn_address`` called with ``token``."""
    p = _d.CUDA_HOST_NODE_PARAMS()
    p.fn = _d.CUhostFn(fn_address)
    p.userData = token
    return p


@register
class HostFuncLowering(Lowering):
    """The lowering of `HostFunc` nodes (see the module doc).

    Thread-safety: stateless (class attributes and methods only): the one registered instance serves
    every executor and thread at once.
    """

    node_type = HostFunc
    graph_node = "host"
    driver_node_type = "CU_GRAPH_NODE_TYPE_HOST"
    on_device = False

    def stream(self, node, ctx, stream):
        callbacks = ctx.callbacks
        token = callbacks.add(node.fn, node.name)
        ctx.tokens.append(token)
        launch, fn_address, sh = ctx.api.launch_host_func, callbacks.address, stream.handle

        def step():
            err = launch(sh, fn_address, token)
            if err:
                raise error_from_result("cuLaunchHostFunc", err)
        return step

    def graph(self, node, ctx, deps):
        callbacks = ctx.callbacks
        token = callbacks.add(node.fn, node.name)
        params = host_params(callbacks.address, token)
        gnode = ctx.add("cuGraphAddHostNode", deps, params)
        return ctx.record(node, gnode, params)


__all__ = ["HostFuncLowering", "host_params"]

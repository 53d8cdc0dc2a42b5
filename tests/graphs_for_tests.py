"""Graphs, references and executors on the fake drivers that several CPU test modules share
(imported as ``tests.graphs_for_tests``).

The burn kernel (``cuda_src/burn.cu``; the fakes run it the same way) applies
``v = v * 0.5 + 1`` ``iters`` times to every float32 element; exact in float32, so outputs
compare bit for bit.
"""

from __future__ import annotations

import numpy as np

from orchestra.execute import EagerExecutor, KernelResolver
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.execute.cuda_graph.capture import CaptureExecutor
from orchestra.graph import (
    Alloc,
    Buffer,
    Condition,
    DeviceToHost,
    Free,
    HostBuffer,
    HostToDevice,
    In,
    KernelNode,
    Memset,
    Out,
    TaskGraph,
    build_pipeline,
)
from tests import fake_graph_cuda as fg
from tests.fake_cuda import FakeCuda


def burn_reference(x, iters=3):
    """What the burn kernel makes of the float32 array ``x`` (numpy, same shape)."""
    v = x.copy()
    for _ in range(iters):
        v = v * np.float32(0.5) + np.float32(1)
    return v


def burn_pipeline(kernel, batches, sizes, *, iters=3, seed=0):
    """`build_pipeline` of ``batches`` batches of ``sizes`` bytes (an int, or one per batch)
    through ``kernel`` (burn, ``iters`` iterations), with bindings: random float32 inputs
    (``seed``), NaN outputs. Returns ``(graph, batches, bindings)``."""
    g, bs = build_pipeline(batches, sizes, kernel, scalars=(iters, 0.5, 1.0))
    rng = np.random.default_rng(seed)
    bind = {}
    for b in bs:
        bind[b.host_in.buffer.name] = rng.standard_normal(b.nbytes // 4).astype(np.float32)
        bind[b.host_out.buffer.name] = np.full(b.nbytes // 4, np.nan, np.float32)
    return g, bs, bind


def check_burn_outputs(bs, bind, iters=3):
    """Every batch's host output equals `burn_reference` of its host input, bit for bit."""
    for b in bs:
        np.testing.assert_array_equal(bind[b.host_out.buffer.name],
                                      burn_reference(bind[b.host_in.buffer.name], iters))


def fake_drivers(monkeypatch, *, kernel_host_access=False):
    """(eager fake, graph fake): the graph fake installed as the process's default driver API
    (undone by ``monkeypatch``); ``kernel_host_access``: both devices' kernels address pinned
    host memory (what the copy kernel needs)."""
    eager = FakeCuda()
    graph = fg.install(monkeypatch)
    eager.device.kernel_host_access = kernel_host_access
    graph.device.kernel_host_access = kernel_host_access
    return eager, graph


def fake_executor(kind, fakes, *, eager_kernel, graph_kernels=None, **kw):
    """An executor of ``kind`` ("eager", "capture", "graph-build") on ``fakes`` (eager fake,
    graph fake): the eager one resolves kernels with ``eager_kernel(ref, device)``, the graph
    ones with `fake_graph_cuda.resolver` over ``graph_kernels``; ``kw`` goes to the class."""
    eager, graph = fakes
    if kind == "eager":
        return EagerExecutor(eager.device, driver=eager,
                             kernel_resolver=KernelResolver(eager.device, eager_kernel), **kw)
    cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
    return cls(graph.device, driver=graph, kernel_resolver=fg.resolver(graph, graph_kernels),
               **kw)


def branch_graph(setter, make_node, *, flag=True):
    """choice (host) -> src; acc = 0; ``setter``(cond, src, flag); ``make_node(cond)``; acc ->
    out (a condition without a flag buffer when ``flag`` is false)."""
    src, fl, acc = Buffer("src", 4), Buffer("flag", 4), Buffer("acc", 4)
    cond = Condition("c", flag=fl if flag else None)
    g = TaskGraph()
    for b in (src, fl, acc):
        g.add(Alloc(f"a_{b.name}", b))
    g.add(HostToDevice("up", HostBuffer("choice", 4), src))
    g.add(Memset("zero", acc, 0))
    g.add(KernelNode("set", setter, 1, 1, (cond, In(src), Out(fl))))
    g.add(make_node(cond))
    g.add(DeviceToHost("down", acc, HostBuffer("out", 4)))
    for b in (src, fl, acc):
        g.add(Free(f"f_{b.name}", b))
    return g

"""The graph the serving benchmark, the HTTP example and the GPU tests serve: ``y = f(x)``
elementwise on float32 rows, ``f`` = ``iters`` steps of ``v = fmaf(v, s, t)``.

    engine = Engine(functools.partial(demo_graph, iters=1),
                    inputs={"x": ((1024,), "float32")}, outputs={"y": ((1024,), "float32")})

Per instance: ``x_host`` -> H2D -> ``x_dev`` -> kernel -> ``y_dev`` -> D2H -> ``y_host``. The
device buffers are either external (``memory="external"``, the default: two `DeviceBuffer`
objects per instance, allocated once, closed with the instance) or graph allocations
(``memory="graph"``: `Alloc` / `Free` nodes, so the graph has one instantiation and every
instance builds its own). With ``s = 0.5`` and ``t = 1`` each step is exact up to one rounding,
so `demo_reference` (numpy float32) is bit-exact with the GPU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from orchestra.serve.errors import ServeConfigValueError
from orchestra.graph import (
    Alloc,
    Buffer,
    DeviceToHost,
    Free,
    HostBuffer,
    HostToDevice,
    In,
    KernelNode,
    KernelRef,
    Out,
    TaskGraph,
)
from orchestra.serve.cuda_backend import ServeGraph

SOURCE = r"""
// serve_burn: y[i] = x[i] after iters steps of v = fmaf(v, s, t); grid-stride loop, any grid.
extern "C" __global__ void serve_burn(const float* __restrict__ x, float* __restrict__ y,
                                      size_t n, int iters, float s, float t)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = x[i];
        for (int k = 0; k < iters; ++k) {
            v = fmaf(v, s, t);
        }
        y[i] = v;
    }
}
"""

PARAMS = ("const float* x", "float* y", "size_t n", "int iters", "float s", "float t")


def kernel_ref() -> KernelRef:
    """The demo kernel (`SOURCE`) as a `KernelRef`."""
    return KernelRef(SOURCE, "serve_burn", params=PARAMS)


def demo_reference(x: np.ndarray, iters: int = 1, s: float = 0.5, t: float = 1.0) -> np.ndarray:
    """What the demo graph computes, in numpy float32 (bit-exact for s = 0.5, t = 1)."""
    v = np.array(x, dtype=np.float32, copy=True)
    for _ in range(iters):
        v = v * np.float32(s) + np.float32(t)
    return v


class _Owned:
    """External device buffers of one instance and their allocating stream: freed in stream
    order, waited for (so the pool's used bytes drop at once), then the stream closed."""

    def __init__(self, stream, buffers):
        self.stream = stream
        self.buffers = buffers

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers = []
        if self.stream is not None and not self.stream.closed:
            self.stream.synchronize()
            self.stream.close()
        self.stream = None


def demo_graph(sig, *, input: str = "x", output: str = "y", iters: int = 1, s: float = 0.5,
               t: float = 1.0, memory: str = "external", block: int = 256, device=None
               ) -> ServeGraph:
    """The demo `ServeGraph` for ``sig`` (an `orchestra.execute.Signature`: ``sig.shape(input)``
    is ``(bucket rows, *row_shape)``, float32). ``memory``: ``"external"`` or ``"graph"``
    (see the module doc). ``device``: where external buffers are allocated (default 0)."""
    shape = sig.shape(input)
    n = math.prod(shape)
    nbytes = 4 * n
    ordinal = 0 if device is None else int(getattr(device, "ordinal", device))
    g = TaskGraph()
    hin, hout = HostBuffer("x_host", nbytes), HostBuffer("y_host", nbytes)
    dx, dy = Buffer("x_dev", nbytes, ordinal), Buffer("y_dev", nbytes, ordinal)
    if memory == "graph":
        g.add(Alloc("alloc_x", dx, device=ordinal))
        g.add(Alloc("alloc_y", dy, device=ordinal))
    elif memory != "external":
        raise ServeConfigValueError(f"memory must be 'external' or 'graph'; got {memory!r}")
    grid = max(1, min(-(-n // block), 1024))
    g.add(HostToDevice("h2d", hin, dx, device=ordinal))
    g.add(KernelNode("kernel", kernel_ref(), grid, block,
                     (In(dx), Out(dy), n, int(iters), float(s), float(t)), device=ordinal))
    g.add(DeviceToHost("d2h", dy, hout, device=ordinal))
    bindings: dict[str, Any] = {}
    owned: tuple = ()
    if memory == "graph":
        g.add(Free("free_x", dx, device=ordinal))
        g.add(Free("free_y", dy, device=ordinal))
    else:
        from orchestra.driver import DeviceBuffer, Stream

        stream = Stream(ordinal)
        bufs = []
        try:
            bufs = [DeviceBuffer.allocate(nbytes, stream), DeviceBuffer.allocate(nbytes, stream)]
            stream.synchronize()  # the allocations are usable on every stream from now on
        except BaseException:
            _Owned(stream, bufs).close()
            raise
        bindings = {"x_dev": bufs[0], "y_dev": bufs[1]}
        owned = (_Owned(stream, bufs),)
    return ServeGraph(g, inputs={input: "x_host"}, outputs={output: "y_host"},
                      bindings=bindings, owned=owned)


__all__ = ["PARAMS", "SOURCE", "demo_graph", "demo_reference", "kernel_ref"]

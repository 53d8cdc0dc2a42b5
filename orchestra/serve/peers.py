"""The peers `orchestra bench serve` measures in the same run: the same requests served by bare
cuda-python (a stream per thread) and by PyTorch CUDA graph replay per thread.

Every peer has the engine's semantics: a request is a numpy array the caller owns, copied into
pinned staging, run (H2D, the demo kernel, D2H), waited for, and copied out into a new array.
Each thread makes its own client (``client = Peer.client(); y = client(x)``).
"""

from __future__ import annotations

import math
import threading

import numpy as np

from orchestra.serve.demo import PARAMS, SOURCE, demo_reference

_capture_lock = threading.Lock()  # one torch graph capture at a time in the process


class BareClient:
    """One thread's bare cuda-python loop: ``cuMemcpyHtoDAsync``, ``cuLaunchKernel``,
    ``cuMemcpyDtoHAsync``, ``cuStreamSynchronize`` on the thread's own stream, from pinned
    staging sized for the largest request.

    Thread-safety: not thread-safe: one per thread (its stream, buffers and packed arguments are its
    own), used by the thread that made it.
    """

    def __init__(self, device, max_elems: int, iters: int, s: float, t: float, block=256):
        from cuda.bindings import driver

        from orchestra.compiler import load_kernel
        from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream

        self._d = driver
        self.device = device
        device.make_current()
        self.kernel = load_kernel(SOURCE, "serve_burn", params=PARAMS, device=device)
        self.stream = Stream(device)
        nbytes = 4 * max_elems
        self.din = DeviceBuffer.allocate(nbytes, self.stream)
        self.dout = DeviceBuffer.allocate(nbytes, self.stream)
        self.hin = PinnedBuffer(nbytes, device)
        self.hout = PinnedBuffer(nbytes, device)
        self.stream.synchronize()
        self.iters, self.s, self.t, self.block = iters, s, t, block
        self._args: dict[int, tuple] = {}  # elements -> (packed args, grid)
        self._in = self.hin.view(np.float32)
        self._out = self.hout.view(np.float32)

    def _launch_args(self, n: int):
        a = self._args.get(n)
        if a is None:
            packed = self.kernel.pack((self.din.ptr, self.dout.ptr, n, self.iters, self.s,
                                       self.t))
            grid = max(1, min(-(-n // self.block), 1024))
            a = self._args[n] = (packed, grid)
        return a

    def __call__(self, x: np.ndarray) -> np.ndarray:
        d = self._d
        n = x.size
        nbytes = 4 * n
        packed, grid = self._launch_args(n)
        sh = self.stream.handle
        np.copyto(self._in[:n], x.reshape(-1))
        (err,) = d.cuMemcpyHtoDAsync(self.din.ptr, self.hin.ptr, nbytes, sh)
        assert not err, err
        (err,) = d.cuLaunchKernel(self.kernel.function, grid, 1, 1, self.block, 1, 1, 0, sh,
                                  packed.address, 0)
        assert not err, err
        (err,) = d.cuMemcpyDtoHAsync(self.hout.ptr, self.dout.ptr, nbytes, sh)
        assert not err, err
        (err,) = d.cuStreamSynchronize(sh)
        assert not err, err
        return self._out[:n].reshape(x.shape).copy()

    def close(self) -> None:
        for buf in (self.din, self.dout):
            buf.close()
        self.stream.synchronize()
        self.stream.close()
        for pin in (self.hin, self.hout):
            pin.close()


class TorchClient:
    """One thread's PyTorch CUDA graph per request size: captured once (pinned host tensors,
    H2D copy, one kernel ``t + s * x`` per iteration, D2H copy), replayed on the thread's own
    stream.

    Thread-safety: not thread-safe: one per thread, used by the thread that made it (its constructor
    makes its stream that thread's current torch stream); captures of different clients are
    serialized by a module lock.
    """

    def __init__(self, shapes, iters: int, s: float, t: float, device: int = 0):
        import torch

        self.torch = torch
        self.dev = torch.device("cuda", device)
        self.stream = torch.cuda.Stream(self.dev)
        torch.cuda.set_stream(self.stream)  # per thread: replay() launches on it
        self.graphs = {}
        for shape in shapes:
            n = math.prod(shape)
            hin = torch.zeros(n, dtype=torch.float32, pin_memory=True)
            hout = torch.zeros(n, dtype=torch.float32, pin_memory=True)
            din = torch.zeros(n, dtype=torch.float32, device=self.dev)
            dout = torch.zeros(n, dtype=torch.float32, device=self.dev)
            tt = torch.full((n,), t, dtype=torch.float32, device=self.dev)

            def body():
                din.copy_(hin, non_blocking=True)
                v = din
                for _ in range(iters):
                    torch.add(tt, v, alpha=s, out=dout)
                    v = dout
                hout.copy_(dout, non_blocking=True)

            with _capture_lock:
                with torch.cuda.stream(self.stream):
                    body()  # warm-up outside the capture
                self.stream.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=self.stream,
                                      capture_error_mode="thread_local"):
                    body()
                self.stream.synchronize()
            self.graphs[tuple(shape)] = (g, hin.numpy(), hout.numpy(), (hin, hout, din, dout,
                                                                          tt))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        g, hin, hout, _ = self.graphs[x.shape]
        np.copyto(hin, x.reshape(-1))
        g.replay()
        self.stream.synchronize()
        return hout.reshape(x.shape).copy()

    def close(self) -> None:
        self.graphs.clear()


def torch_available() -> str | None:
    """None when PyTorch with CUDA is importable, else why not."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA device"
    return None


__all__ = ["BareClient", "TorchClient", "demo_reference", "torch_available"]

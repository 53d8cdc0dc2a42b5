"""Host cost of `Kernel.launch`'s Python path, without a GPU: the driver call is replaced by a
no-op, so what is timed is argument handling, stream resolution and the interop path.

    python benchmarks/bench_launch_host.py [--launches 20000] [--repeats 30]

Prints one table of nanoseconds per launch (the minimum over ``--repeats`` runs of
``--launches`` launches: the least disturbed run on a shared machine), and each row's cost over
the bare loop (the stubbed ``cuLaunchKernel`` called with prepacked arguments, what
``benchmarks/bench_launch.py`` calls "bare"):

* ``PackedArgs`` on an orchestra `Stream` (an owned, open one): the fast path (the very
  stream, dimensions and arguments of the last launch);
* a tuple of ints, the same tuple every launch (packed once);
* a list of ints, and a list of `DeviceBuffer`-like objects (``.ptr``), packed on every launch;
* a list with a DLPack object (an orchestra `BufferView` over fake memory, consumed through the
  protocol each launch: export, capsule, checks);
* a list with a CUDA Array Interface object without a stream (checks, one pointer query).

Compare two checkouts by running it in each. On a GPU, benchmarks/bench_launch.py gives the
real launch cost, with the driver call.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

try:
    import orchestra  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)

    import numpy as np
    from cuda.bindings import driver

    from orchestra.compiler.params import normalize_params
    from orchestra.driver import interop
    from orchestra.driver.stream import Stream, _Borrowed
    from orchestra.kernel import module as mod

    ok = (driver.CUresult.CUDA_SUCCESS,)

    def stub(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        return ok

    mod._launch = stub  # the driver call costs nothing here
    params = normalize_params(("const float* a", "const float* b", "float* c", "int n"))
    mod.Kernel._verify_params = lambda self: None
    dev = types.SimpleNamespace(ordinal=0, make_current=lambda force=False: None)
    k = mod.Kernel(types.SimpleNamespace(device=dev, _image=b""), "vector_add", "vector_add",
                   "kernel", "function", params)
    k._plain[(4, 256, 0)] = (4, 1, 1, 256, 1, 1, 0)
    stream = Stream.__new__(Stream)  # an owned, open orchestra Stream over a fake handle
    stream.device, stream.priority = dev, 0
    stream._own = _Borrowed(driver.CUstream(0x5000), "Stream")
    stream._live = [True]  # the open marker Stream.__init__ sets

    class Buf:
        def __init__(self, ptr):
            self._ptr = ptr

        @property
        def ptr(self):
            return self._ptr

    memory = np.zeros(4096, np.uint8)
    base = memory.ctypes.data

    class CAI:
        __cuda_array_interface__ = {"version": 3, "shape": (1024,), "typestr": "<f4",
                                    "data": (base, False), "strides": None, "stream": None}

    class DLPackLike:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
            from orchestra.driver import dlpack

            return dlpack.make_capsule(base, (1024,), (1,), np.dtype(np.float32), (2, 0),
                                       versioned=max_version is not None)

    interop._pointer_device = lambda ptr, want, what: 0  # the pointer query, without a driver
    ints = [base, base, base + 2048, 1024]
    bufs = [Buf(base), Buf(base), Buf(base + 2048), 1024]
    packed = k.pack(ints)
    ints_tuple = tuple(ints)
    func, handle, address = k.function, stream.handle, packed.address

    def bare():
        (err,) = stub(func, 4, 1, 1, 256, 1, 1, 0, handle, address, 0)
        if err:
            raise RuntimeError(err)
    with_dlpack = [DLPackLike(), base, base + 2048, 1024]
    with_cai = [CAI(), base, base + 2048, 1024]

    def best_ns(fn) -> float:
        per = []
        for _ in range(args.repeats):
            t0 = time.perf_counter_ns()
            for _ in range(args.launches):
                fn()
            per.append((time.perf_counter_ns() - t0) / args.launches)
        return min(per)

    rows = [
        ("bare cuLaunchKernel call, prepacked", best_ns(bare)),
        ("Kernel.launch, PackedArgs", best_ns(lambda: k.launch(stream, 4, 256, packed))),
        ("Kernel.launch, the same tuple of ints",
         best_ns(lambda: k.launch(stream, 4, 256, ints_tuple))),
        ("Kernel.launch, ints packed each time", best_ns(lambda: k.launch(stream, 4, 256, ints))),
        ("Kernel.launch, .ptr objects packed each time",
         best_ns(lambda: k.launch(stream, 4, 256, bufs))),
        ("Kernel.launch, one DLPack argument", best_ns(lambda: k.launch(stream, 4, 256,
                                                                      with_dlpack))),
        ("Kernel.launch, one CUDA Array Interface argument",
         best_ns(lambda: k.launch(stream, 4, 256, with_cai))),
    ]
    print(f"host ns per Kernel.launch (driver call stubbed), min of {args.repeats} x "
          f"{args.launches}")
    width = max(len(r[0]) for r in rows)
    floor = rows[0][1]
    print(f"  {'':<{width}}  {'ns':>9}  {'over bare':>9}")
    for label, ns in rows:
        print(f"  {label:<{width}}  {ns:9.0f}  {ns - floor:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

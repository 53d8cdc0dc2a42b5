"""orchestra.serve: a serving engine over shape buckets of executable task graphs.

    from orchestra.serve import Engine, ServeGraph

    engine = Engine(build, inputs={"x": ((1024,), "float32")},
                    outputs={"y": ((1024,), "float32")}, buckets="pow2", max_rows=64)
    engine.warmup()
    fut = engine.submit(x)          # any thread; concurrent.futures.Future
    y = await engine.run(x)         # asyncio
    y = engine(x)                   # blocking
    engine.close()

- `Engine` (`engine`): futures, buckets, instance leasing, dynamic batching (`Batching`),
  backpressure, statistics, shutdown; `ServeFuture`.
- `ProcessEngine` (`process`, `process_child`, `wire`): an `Engine` in a child process, served
  through shared memory, so the client's threads (an event loop) share no GIL with it.
- `ServeGraph` and the CUDA backends (`cuda_backend`: graph-build, capture, eager);
  `Backend` / `Instance` (`backend`): the seam, with `NumpyBackend` for CPU-only use.
- `buckets`, `tensors` (request checks), `errors`, `stats`; `demo` (the graph the benchmark
  and the HTTP example serve); `bench` (``orchestra bench serve``).

The docs page is docs/serving.md.
"""

from orchestra.serve.backend import Backend, Instance, NumpyBackend
from orchestra.serve.buckets import Buckets, bucket_sizes, pow2_buckets, vllm_buckets
from orchestra.serve.engine import Batching, Engine, ServeFuture
from orchestra.serve.errors import (
    BadRequest,
    EngineBroken,
    EngineClosed,
    EngineProcessError,
    InputTypeError,
    Overloaded,
    RequestTooLarge,
    ResultTimeout,
    ServeConfigError,
    ServeConfigTypeError,
    ServeConfigValueError,
    ServeError,
)
from orchestra.serve.tensors import TensorSpec


def __getattr__(name):
    # the CUDA backend module imports the executors: only when asked for
    if name in ("ServeGraph", "CudaBackend"):
        from orchestra.serve import cuda_backend

        return getattr(cuda_backend, name)
    if name == "ProcessEngine":  # multiprocessing, only when asked for
        from orchestra.serve.process import ProcessEngine

        return ProcessEngine
    raise AttributeError(f"module 'orchestra.serve' has no attribute {name!r}")


__all__ = [
    "Backend", "BadRequest", "Batching", "Buckets", "CudaBackend", "Engine", "EngineBroken",
    "EngineClosed", "EngineProcessError", "InputTypeError", "Instance", "NumpyBackend",
    "Overloaded", "ProcessEngine", "RequestTooLarge", "ResultTimeout", "ServeConfigError",
    "ServeConfigTypeError", "ServeConfigValueError", "ServeError", "ServeFuture", "ServeGraph",
    "TensorSpec", "bucket_sizes", "pow2_buckets", "vllm_buckets",
]

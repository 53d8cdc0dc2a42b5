"""orchestra.execute: run a task graph's plan on the GPU.

- `EagerExecutor`: enqueue each step onto pooled non-blocking streams (`eager`).
- CUDA Graphs (the `cuda_graph` sub-package): `CaptureExecutor`, `GraphBuildExecutor`, both
  giving a `GraphExec` (launch, replay with new inputs and scalars, update); `GraphCache`;
  `GraphRunner` (the eager interface over a graph executor).
- The lowering table (`lowering`): per node kind, how it is enqueued on a stream (eager and
  capture share it), added to a CUDA graph, and which parameter record a replay rewrites;
  host copies on a copy engine or as a copy kernel (`lowering.copy_policy`, the crossover
  table per device in `copy_table`).
- What every executor shares (`base.ExecutorBase`): the driver API it calls through, device
  checks, the pre-run checks (`prepare`), kernel resolution (`kernels`, `kernel_args`), the
  binding table and pinned checks (`bindings`), host-function trampolines (`hostfunc`),
  pooled streams and sync-only events and the plan cache (`resources`), closing; pinned
  staging for callers (`staging`); `RunResult` (`result`); `IdentityLRU` (`lru`).

``make_executor(name)`` builds an executor by the name ``orchestra run --executor`` takes.
"""

from orchestra.execute.bindings import (
    BindingSpec,
    BindingTable,
    DeviceBinding,
    HostBinding,
    PinnedCheck,
    ResolvedBindings,
)
from orchestra.execute.eager import EagerExecutor
from orchestra.execute.errors import (
    BindingError,
    BucketOverflowError,
    ClosedBindingError,
    CopyLoweringError,
    ExecutorArgumentError,
    ExecutorArgumentTypeError,
    ExecutorArgumentValueError,
    ExecutorUnavailable,
    HostFunctionError,
    PageableMemoryError,
    PlanMismatchError,
)
from orchestra.execute.hostfunc import HostCallbacks
from orchestra.execute.kernel_args import KernelArgs, PointerArg, resolve_kernel_node
from orchestra.execute.kernels import KernelResolver
from orchestra.execute.copy_table import load_crossover, save_crossover
from orchestra.execute.lowering import Lowering, NoLoweringError, lowering_for
from orchestra.execute.lowering.conditional import EagerConditionError
from orchestra.execute.lowering.copy_policy import (
    DEFAULT_CROSSOVER,
    CopyCrossover,
    CopyPolicy,
)
from orchestra.execute.lowering.restrictions import BodyRestrictionError
from orchestra.execute.prepare import assign_event_slots, check_run
from orchestra.execute.result import RunResult
from orchestra.execute.staging import StagingPool

from orchestra.driver.capture import CaptureSession  # noqa: E402  (documented here too)
from orchestra.driver.graph_memory import graph_memory  # noqa: E402
from orchestra.execute.cuda_graph import (  # noqa: E402
    CaptureError,
    CaptureExecutor,
    GraphBuildExecutor,
    GraphCache,
    GraphExec,
    GraphRunner,
    Signature,
    UpdateResult,
)

EXECUTORS = ("eager", "capture", "graph")
AVAILABLE_EXECUTORS = ("eager", "capture", "graph")


def make_executor(name: str = "eager", device=None, *, verify: bool = True, driver=None,
                  copy_lowering="auto"):
    """The executor called ``name`` on ``device``: "eager" (`EagerExecutor`), "capture" or
    "graph" (a `GraphRunner` over `CaptureExecutor` / `GraphBuildExecutor`: the same
    prepare / run / kernels / close interface). ``driver``: the `DriverAPI` (default: the
    process's); ``copy_lowering``: how host copies run (`ExecutorBase`). Unknown names raise
    `ExecutorUnavailable`."""
    if name == "eager":
        return EagerExecutor(device, verify=verify, driver=driver, copy_lowering=copy_lowering)
    if name in ("capture", "graph"):
        return GraphRunner(name, device, verify=verify, driver=driver,
                           copy_lowering=copy_lowering)
    if name in EXECUTORS:
        raise ExecutorUnavailable(f"the {name!r} executor is not available yet; use "
                                  f"{', '.join(AVAILABLE_EXECUTORS)}")
    raise ExecutorUnavailable(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")


__all__ = [
    "CaptureError", "CaptureExecutor", "CaptureSession", "GraphBuildExecutor", "GraphCache",
    "GraphExec", "GraphRunner", "Signature", "UpdateResult", "graph_memory",
    "AVAILABLE_EXECUTORS", "BindingError", "BindingSpec", "BindingTable", "BodyRestrictionError",
    "BucketOverflowError", "ClosedBindingError", "CopyCrossover", "CopyLoweringError",
    "CopyPolicy", "DEFAULT_CROSSOVER", "DeviceBinding", "EXECUTORS", "EagerConditionError",
    "EagerExecutor", "ExecutorArgumentError",
    "ExecutorArgumentTypeError", "ExecutorArgumentValueError", "ExecutorUnavailable",
    "HostBinding", "HostCallbacks", "HostFunctionError", "KernelArgs", "KernelResolver",
    "Lowering", "NoLoweringError", "PageableMemoryError", "PinnedCheck", "PlanMismatchError",
    "PointerArg", "ResolvedBindings", "RunResult", "StagingPool", "assign_event_slots",
    "check_run", "load_crossover", "lowering_for", "make_executor", "resolve_kernel_node",
    "save_crossover",
]

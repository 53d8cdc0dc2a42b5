"""orchestra.execute.cuda_graph: task graphs run as CUDA graphs.

- `spec`: the pure translation of a task graph into a CUDA graph's shape, and the graph-memory
  policy (every `Alloc` freed in the graph, or ``auto_free``);
- `capture_plan`: the pure fork / join step list of a stream capture and its check;
- `capture`: `CaptureExecutor` (a plan enqueued inside one stream capture);
- `build`: `GraphBuildExecutor` (the graph built node by node);
- `executor`: what both graph executors share (on top of `execute.base.ExecutorBase`);
- `built`: `BuiltGraph` and `NodeRecord`, what a build made (replays and updates work from it);
- `exec`: `GraphExec` (instantiate, launch, synchronize, close), with its parts `replay` (new
  host arrays and scalars), `update` (exec update, else re-instantiate) and `state` (what it
  holds and releases);
- `runner`: `GraphRunner` (the eager executor's interface over a graph executor);
- `cache`: `GraphCache` (execs by input-shape signature, pure Python).
"""

from orchestra.execute.cuda_graph.build import GraphBuildExecutor, prepare_build
from orchestra.execute.cuda_graph.cache import BucketPolicy, GraphCache, Signature, pad_to
from orchestra.execute.cuda_graph.capture import CaptureError, CaptureExecutor
from orchestra.execute.cuda_graph.exec import GraphExec, UpdateResult
from orchestra.execute.cuda_graph.runner import GraphRunner
from orchestra.execute.cuda_graph.spec import GraphMemoryError, GraphSpec, SpecNode, translate

__all__ = [
    "BucketPolicy", "CaptureError", "CaptureExecutor", "GraphBuildExecutor", "GraphCache",
    "GraphExec", "GraphMemoryError", "GraphRunner", "GraphSpec", "Signature", "SpecNode",
    "UpdateResult", "pad_to", "prepare_build", "translate",
]

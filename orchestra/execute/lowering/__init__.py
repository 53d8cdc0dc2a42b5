"""orchestra.execute.lowering: per node kind, one entry that knows how the node runs on CUDA.

- `table`: `Lowering` (the entry's interface), `register`, `lowering_for`;
- `stream`: a plan lowered onto streams (`lower_plan`: the steps the eager and the capture
  executor both run), `StreamContext`, `Addresses`;
- `graph`: `GraphContext`, what an entry fills while a CUDA graph is built node by node;
- one module per node kind: `memory` (`Alloc`, `Free`), `copy` (`HostToDevice`,
  `DeviceToHost`), `kernel` (`KernelNode`), `memset` (`Memset`), `host` (`HostFunc`), `peer`
  (`PeerCopy`), `collective` (the NCCL kinds), `child` (`ChildGraph`), `conditional` (`If`,
  `While`, `Switch`), each with its parameter records;
- for kinds with bodies: `bodies` (lowering a body onto a stream, capturing it into a body
  graph, building it into one) and `restrictions` (what the driver allows in a body).

A new node kind: its record class in `orchestra.graph.nodes`, its module here (a `Lowering`
subclass under `register`), and its import below. No executor names a node kind.
"""

from orchestra.execute.lowering.table import (
    LOWERINGS,
    Lowering,
    NoLoweringError,
    lowering_for,
    missing_lowerings,
    register,
)

# the entries: importing a module registers its node kinds
from orchestra.execute.lowering import copy, host, kernel, memory, memset  # noqa: E402, F401
from orchestra.execute.lowering import collective, peer  # noqa: E402, F401
from orchestra.execute.lowering import child, conditional  # noqa: E402, F401

__all__ = ["LOWERINGS", "Lowering", "NoLoweringError", "lowering_for", "missing_lowerings",
           "register"]

"""orchestra.nccl: NCCL communicators for the collective node kinds (optional extra ``nccl``).

- `Communicator` (``init_rank`` with a shared unique id, ``init_all`` for the local GPUs),
  owned and leased like every handle;
- `bootstrap`: the unique id through a `FileStore`, a `TCPStore`, ``torch.distributed`` or
  MPI; `init_process`, `init_from_env` (what ``python -m orchestra.launch`` sets);
- `run_per_device`: one process, one thread per GPU;
- `NcclAPI` (`default_nccl`, `use_nccl`): the seam to nccl4py's bindings.

The collectives themselves are graph nodes (`orchestra.graph.AllReduce` ...): docs/multigpu.md.
Importing this package does not import nccl4py; the first NCCL call does.
"""

from orchestra.nccl.api import NcclAPI, default_nccl, nvls_off, use_nccl
from orchestra.nccl.bootstrap import (
    FileStore,
    TCPStore,
    env_rank,
    init_from_env,
    init_process,
    store_from_url,
    unique_id_from_mpi,
    unique_id_from_torch,
)
from orchestra.nccl.communicator import Communicator, unique_id
from orchestra.nccl.errors import BootstrapError, NcclError, NcclUsageError, RankTimeoutError
from orchestra.nccl.local import run_per_device

__all__ = [
    "BootstrapError", "Communicator", "FileStore", "NcclAPI", "NcclError", "NcclUsageError",
    "RankTimeoutError", "TCPStore", "default_nccl", "env_rank", "init_from_env", "init_process", "nvls_off",
    "run_per_device", "store_from_url", "unique_id", "unique_id_from_mpi",
    "unique_id_from_torch", "use_nccl",
]

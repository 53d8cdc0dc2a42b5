"""``orchestra bench peers``: orchestra against hand-written cuda-python, CuPy and PyTorch, in
one process on one GPU with the same kernel source, every output checked.

- `workloads`: the five workloads and ``--workloads`` parsing (pure);
- `report`: rows, ratios to orchestra's best, the table, JSON, the ratio chart (pure);
- `check`: output checks against numpy (pure);
- `optional`: which peers are installed (a missing one is skipped with a note);
- `harness` (GPU): data, bounds, contenders run round by round (`run_peers`);
- `orchestra_side`, `cuda_python`, `frameworks` (GPU): the contenders.
"""

from orchestra.app.peers.report import PeersReport, Row, add_ratios, format_table
from orchestra.app.peers.workloads import (
    BUILTIN,
    DEFAULT,
    Workload,
    parse_workloads,
)

__all__ = ["BUILTIN", "DEFAULT", "PeersReport", "Row", "Workload",
           "add_ratios", "format_table", "parse_workloads"]

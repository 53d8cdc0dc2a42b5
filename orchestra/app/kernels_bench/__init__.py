"""The kernel library's Python side: what each kernel in ``cuda_src/`` and ``ptx/`` needs to be
launched, numpy references, the programmatic-dependent-launch check and the two
benchmarks behind ``orchestra bench``.

Modules:
    catalog    one `KernelSpec` per kernel (source, name, name expression, parameters, launch
               requirements) and `load` to get a launchable `orchestra.kernel.Kernel`.
    reference  numpy reference of every kernel.
    pdl        `kernel_waits_on_grid_dependency` and friends: does a kernel execute
               ``griddepcontrol.wait`` before it may be launched with the PDL attribute?
    stages     ``orchestra bench stages``: the block-scope pipeline at 1-4 stages vs a D2D copy.
    pdlchain   ``orchestra bench pdl``: a chain of small dependent kernels with and without PDL.

Only `catalog.load`, `stages` and `pdlchain` need a GPU; the rest runs anywhere.
"""

from orchestra.app.kernels_bench.pdl import (
    entry_points,
    kernel_waits_on_grid_dependency,
    kernels_waiting_on_grid_dependency,
)

__all__ = ["entry_points", "kernel_waits_on_grid_dependency", "kernels_waiting_on_grid_dependency"]

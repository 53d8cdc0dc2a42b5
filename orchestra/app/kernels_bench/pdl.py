"""Does a kernel wait on its grid dependency? The check lives in the library
(`orchestra.compiler.griddep`, which the executors use for programmatic edges); the kernel
benchmarks and their tests import it from here too."""

from orchestra.compiler.griddep import (
    PdlWithoutWaitError,
    entry_points,
    kernel_waits_on_grid_dependency,
    kernels_waiting_on_grid_dependency,
    require_grid_dependency_wait,
)

__all__ = ["PdlWithoutWaitError", "entry_points", "kernel_waits_on_grid_dependency",
           "kernels_waiting_on_grid_dependency", "require_grid_dependency_wait"]

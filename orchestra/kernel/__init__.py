"""orchestra.kernel: loaded device code and its launches.

- `Module`: an image (cubin, fatbin, PTX) loaded as a ``CUlibrary`` on one device;
- `Kernel`: one entry point of a module, with argument packing (`orchestra.compiler.args`),
  launch checks (`orchestra.compiler.launch`) and checked launches (``cuLaunchKernel`` /
  ``cuLaunchKernelEx``);
- `load_kernel`: compile (through the on-disk cache), load and look up, memoized.

The compiler (`orchestra.compiler`) turns sources into images without a GPU; this package puts
them on one. `orchestra.compiler` re-exports `Module`, `Kernel` and `load_kernel` under their
documented names.
"""

from orchestra.kernel.module import (
    Kernel,
    KernelAttributes,
    KernelNotFoundError,
    Module,
    clear_memo,
    driver_version,
    load_kernel,
)

__all__ = ["Kernel", "KernelAttributes", "KernelNotFoundError", "Module", "clear_memo",
           "driver_version", "load_kernel"]

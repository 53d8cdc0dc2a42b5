"""orchestra.compiler: CUDA C++ -> cubin with NVRTC (cached), PTX -> cubin with nvJitLink,
argument packing and launch checks. Loaded modules, kernels and launches are `orchestra.kernel`
(re-exported here: `Module`, `Kernel`, `load_kernel`).

Public API::

    compile(source_or_path, *, arch=None, options=(), name_expressions=(), include_dirs=(),
            ptx=False) -> CompileResult
    compile_to_file(source_or_path, out=None, *, arch=None, ptx=False, options=(),
                    include_dirs=()) -> (CompileResult, Path)      # `orchestra compile`
    link_ptx(ptx_source_or_path, *, arch, options=()) -> bytes (cubin)
    Module.load(image, device=None, *, source=None, lowered_names=None) -> Module
    Module.kernel(name, params=None) -> Kernel
    load_kernel(path_or_source, name, *, name_expression=None, options=(), params=None,
                device=None, include_dirs=()) -> Kernel
    Kernel.pack(args) -> PackedArgs;  PackedArgs.set(index_or_name, value)
    Kernel.launch(stream, grid, block, args, shared_mem=0, *, cooperative=False,
                  cluster=None, pdl=False, priority=None)
    Kernel.occupancy(block, shared_mem=0) -> int;  Kernel.attributes
    parse_params(source, kernel_name) -> tuple[Param, ...]
    kernel_source_dir(), ptx_source_dir()
    cache_info() -> CacheInfo;  cache_clear() -> (entries, bytes)   # `orchestra cache`

See docs/ARCHITECTURE.md. Everything here runs without a GPU; `Module`/`Kernel`/`load_kernel`
(from `orchestra.kernel`) need one.
"""

from orchestra.compiler.args import ArgLayout, PackedArgs
from orchestra.compiler.cache import (
    CacheConfigError,
    CacheDirError,
    CacheInfo,
    cache_clear,
    cache_dir,
    cache_enabled,
    cache_info,
)
from orchestra.compiler.elf import kernel_names
from orchestra.compiler.launch import (
    LaunchConfig,
    build_launch_config,
    check_launch,
    launch_attribute_values,
    launch_attributes,
    normalize_dims,
)
from orchestra.compiler.nvrtc import (
    CompileJob,
    CompileResult,
    NameExpressionError,
    compile,
    compile_to_file,
    default_output_path,
    nvrtc_version,
    prepare_compile,
)
from orchestra.compiler.params import Param, normalize_params, parse_params
from orchestra.compiler.ptx import (
    PtxVersionError,
    check_ptx_loadable,
    link_ptx,
    ptx_isa_version,
    required_cuda_for_ptx,
)
from orchestra.compiler.sources import kernel_source_dir, ptx_source_dir
from orchestra.compiler.target import normalize_arch

# Loaded code lives in orchestra.kernel (which imports this package); its documented names are
# re-exported here on first use, so ``from orchestra.compiler import load_kernel`` keeps working.
_KERNEL_NAMES = ("Kernel", "KernelAttributes", "KernelNotFoundError", "Module", "load_kernel")


def __getattr__(name):
    if name in _KERNEL_NAMES:
        import orchestra.kernel

        return getattr(orchestra.kernel, name)
    raise AttributeError(f"module 'orchestra.compiler' has no attribute {name!r}")


__all__ = [
    "ArgLayout", "CacheConfigError", "CacheDirError", "CacheInfo", "CompileJob", "CompileResult", "Kernel",
    "KernelAttributes", "KernelNotFoundError", "LaunchConfig", "Module", "NameExpressionError",
    "PackedArgs", "Param", "PtxVersionError", "build_launch_config", "cache_clear", "cache_dir",
    "cache_enabled", "cache_info", "check_launch", "check_ptx_loadable", "compile", "compile_to_file", "default_output_path", "kernel_names",
    "kernel_source_dir", "launch_attribute_values", "launch_attributes", "link_ptx", "load_kernel",
    "normalize_arch", "normalize_dims", "normalize_params", "nvrtc_version", "parse_params",
    "prepare_compile", "ptx_isa_version", "ptx_source_dir", "required_cuda_for_ptx",
]

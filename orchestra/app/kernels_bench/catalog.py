"""Every kernel of the library with what it takes to launch it.

The source files' header comments are the full statement of each kernel's launch requirements;
`KernelSpec` carries the parts code needs (block size, dynamic shared memory, cluster, compute
capability) so tests, checks and benchmarks launch each kernel the same way.

`load(spec, device)` returns a launchable ``orchestra.kernel.Kernel`` (NVRTC for ``.cu``,
nvJitLink for ``.ptx``); `compile_spec` and `ptx_text` work without a GPU.

Prebuilt cubins: `build_cubins(directory)` compiles every source once here (no GPU needed) and
writes ``<source>.cubin`` + ``<source>.json`` (lowered names, source digest, compiler version);
with ``$ORCHESTRA_KERNEL_CUBINS`` set to that directory, `load` takes the kernels from those
files instead of compiling. This is how the kernels built by a newer NVRTC reach a GPU machine
whose own NVRTC is older: compute-sanitizer's synccheck needs cubins from NVRTC 13.1 or newer to
tell ``cp.async.mbarrier.arrive`` (which libcu++'s block-scope ``producer_commit`` uses) from a
plain arrival (docs/kernels.md). A cubin whose source changed since it was built is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import attrs

from orchestra.errors import NotFoundError, PrebuiltCubinError, UnsupportedDeviceError

#: Directory of prebuilt cubins (`build_cubins`) that `load` uses instead of compiling.
PREBUILT_ENV = "ORCHESTRA_KERNEL_CUBINS"

#: float4 per thread per stage in pipeline_block.cu (PB_VEC).
PIPELINE_BLOCK_VEC = 2
#: stages of pipeline_thread.cu / pipeline_primitives.cu / producer_consumer.cu / early_exit.cu
PIPELINE_THREAD_STAGES = 4
PIPELINE_PRIMITIVES_STAGES = 3
PRODUCER_CONSUMER_STAGES = 2
EARLY_EXIT_STAGES = 2
EARLY_EXIT_CHUNK = 4
#: warp_specialized.cu: fixed block of 1 loader + 4 compute + 1 storer warp; tile in floats.
WARP_SPECIALIZED_THREADS = 192
WARP_SPECIALIZED_TILE = 2048
#: ptx/cp_async.ptx: .maxntid 128
CP_ASYNC_MAX_THREADS = 128

STAGE_COUNTS = (1, 2, 3, 4)


@attrs.frozen
class KernelSpec:
    """One kernel.

    Attributes:
        key: short unique label (``"pipeline_block<2>"``, ``"pdl_secondary"``).
        source: file name in ``cuda_src/`` (``.cu``) or ``ptx/`` (``.ptx``).
        name: the kernel's name (``extern "C"``) or, for a template, its name expression.
        params: explicit parameter types when they cannot be read from the source (templates,
            PTX); None otherwise.
        min_cc: lowest compute capability (major, minor).
        name_expression: True when ``name`` is an NVRTC name expression.
    """

    key: str
    source: str
    name: str
    params: tuple | None = None
    min_cc: tuple = (8, 0)
    name_expression: bool = False

    @property
    def is_ptx(self) -> bool:
        return self.source.endswith(".ptx")

    def path(self) -> Path:
        from orchestra.compiler import kernel_source_dir, ptx_source_dir

        return (ptx_source_dir() if self.is_ptx else kernel_source_dir()) / self.source


_PB_PARAMS = ("const float* x", "float* y", "unsigned long long n", "float a", "float b")
CP_ASYNC_PARAMS = ("const float* x", "float* y", "unsigned long long n", "float scale")

SPECS: tuple[KernelSpec, ...] = (
    *(KernelSpec(f"pipeline_block<{s}>", "pipeline_block.cu", f"pipeline_block<{s}>",
                 _PB_PARAMS, name_expression=True) for s in STAGE_COUNTS),
    KernelSpec("pipeline_thread", "pipeline_thread.cu", "pipeline_thread"),
    KernelSpec("pipeline_primitives", "pipeline_primitives.cu", "pipeline_primitives"),
    KernelSpec("producer_consumer", "producer_consumer.cu", "producer_consumer"),
    KernelSpec("warp_specialized", "warp_specialized.cu", "warp_specialized"),
    KernelSpec("early_exit_segments", "early_exit.cu", "early_exit_segments"),
    KernelSpec("early_exit_warps", "early_exit.cu", "early_exit_warps"),
    KernelSpec("pdl_primary", "pdl.cu", "pdl_primary", min_cc=(9, 0)),
    KernelSpec("pdl_secondary", "pdl.cu", "pdl_secondary", min_cc=(9, 0)),
    KernelSpec("pdl_secondary_nowait", "pdl.cu", "pdl_secondary_nowait", min_cc=(9, 0)),
    KernelSpec("pdl_chain_step", "pdl.cu", "pdl_chain_step", min_cc=(9, 0)),
    KernelSpec("pdl_chain_step_after_wait", "pdl.cu", "pdl_chain_step_after_wait",
               min_cc=(9, 0)),
    KernelSpec("pdl_spin", "pdl.cu", "pdl_spin", min_cc=(7, 0)),
    KernelSpec("cluster_dsmem", "cluster_dsmem.cu", "cluster_dsmem", min_cc=(9, 0)),
    KernelSpec("cluster_dsmem_pair", "cluster_dsmem.cu", "cluster_dsmem_pair", min_cc=(9, 0)),
    KernelSpec("cp_async_scale", "cp_async.ptx", "cp_async_scale", CP_ASYNC_PARAMS),
)

_BY_KEY = {s.key: s for s in SPECS}


def spec(key: str) -> KernelSpec:
    """The `KernelSpec` called ``key``; ``KeyError`` listing the keys otherwise."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise NotFoundError(f"no kernel {key!r}; known: {', '.join(_BY_KEY)}") from None


def sources() -> dict[str, list[KernelSpec]]:
    """Source file -> the specs it holds (one compile per file covers them all)."""
    out: dict[str, list[KernelSpec]] = {}
    for s in SPECS:
        out.setdefault(s.source, []).append(s)
    return out


# -- launch requirements ------------------------------------------------------------------------

def pipeline_block_smem(stages: int, block: int) -> int:
    """Dynamic shared memory of ``pipeline_block<stages>`` for ``block`` threads."""
    return stages * block * PIPELINE_BLOCK_VEC * 16


def pipeline_block_tile(block: int) -> int:
    """Floats per tile (= per stage) of pipeline_block."""
    return block * PIPELINE_BLOCK_VEC * 4


def pipeline_thread_smem(block: int) -> int:
    return PIPELINE_THREAD_STAGES * block * 16


def pipeline_primitives_smem(block: int) -> int:
    return PIPELINE_PRIMITIVES_STAGES * block * 16


def producer_consumer_smem(buffer_len: int) -> int:
    return PRODUCER_CONSUMER_STAGES * buffer_len * 4


def early_exit_segments_smem(block: int) -> int:
    return EARLY_EXIT_STAGES * EARLY_EXIT_CHUNK * block * 4


def early_exit_warps_smem(block: int) -> int:
    return EARLY_EXIT_STAGES * block * 4


def cluster_grid(n: int, block: int, cluster: int) -> int:
    """Blocks for the cluster kernels: enough for n, rounded up to a multiple of ``cluster``."""
    blocks = max(1, -(-n // block))
    return -(-blocks // cluster) * cluster


# -- compiling and loading ----------------------------------------------------------------------

def compile_spec(s: KernelSpec, *, arch: str = "sm_90", ptx: bool = False):
    """Compile the file of ``s`` for ``arch`` (no GPU needed): a ``CompileResult`` for a
    ``.cu`` (``ptx=True`` gives PTX), cubin bytes from nvJitLink for a ``.ptx``."""
    from orchestra.compiler import compile, link_ptx

    if s.is_ptx:
        return link_ptx(s.path(), arch=arch)
    exprs = tuple(o.name for o in sources()[s.source] if o.name_expression)
    return compile(s.path(), arch=arch, name_expressions=exprs, ptx=ptx)


def ptx_text(s: KernelSpec, *, arch: str = "sm_90") -> tuple[str, str]:
    """``(PTX text, entry name)`` of kernel ``s``: the file itself for ``.ptx``, NVRTC's PTX
    for ``.cu`` (the entry name is the lowered name for a name expression)."""
    if s.is_ptx:
        return s.path().read_text(), s.name
    res = compile_spec(s, arch=arch, ptx=True)
    text = bytes(res.cubin).rstrip(b"\0").decode("utf-8", errors="replace")
    return text, res.lowered_names.get(s.name, s.name)


def load(s: KernelSpec | str, device=None):
    """A launchable ``orchestra.kernel.Kernel`` for ``s`` (a spec or its key) on ``device``
    (compiled/linked for that device's arch, cached; or taken from the prebuilt cubins of
    ``$ORCHESTRA_KERNEL_CUBINS``). Raises ``RuntimeError`` when the device's compute capability
    is below ``s.min_cc`` or a prebuilt cubin is missing, stale or for another arch."""
    from orchestra.kernel import load_kernel
    from orchestra.driver import Device

    s = spec(s) if isinstance(s, str) else s
    dev = device if isinstance(device, Device) else Device.get(device or 0)
    if tuple(dev.compute_capability) < tuple(s.min_cc):
        raise UnsupportedDeviceError(f"kernel {s.key} needs compute capability"
                                     f" {s.min_cc[0]}.{s.min_cc[1]}+, {dev.name} has"
                                     f" {dev.compute_capability[0]}.{dev.compute_capability[1]}")
    prebuilt = os.environ.get(PREBUILT_ENV, "")
    if prebuilt:
        return _load_prebuilt(s, dev, Path(prebuilt))
    if s.name_expression:
        return load_kernel(s.path(), s.name, name_expression=s.name, params=s.params, device=dev)
    return load_kernel(s.path(), s.name, params=s.params, device=dev)


# -- prebuilt cubins ------------------------------------------------------------------------------

def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_cubins(directory, *, arch: str = "sm_90") -> list[Path]:
    """Compile (NVRTC) or link (nvJitLink) every source of the library for ``arch`` and write
    ``<source>.cubin`` and ``<source>.json`` into ``directory`` (created). No GPU needed.
    Returns the cubin paths."""
    from orchestra.compiler import nvrtc_version
    from orchestra.compiler.ptx import nvjitlink_version

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for src, specs in sources().items():
        res = compile_spec(specs[0], arch=arch)
        if specs[0].is_ptx:
            image, names, tool = bytes(res), {}, "nvjitlink %d.%d" % nvjitlink_version()
        else:
            image, names = bytes(res.cubin), dict(res.lowered_names)
            tool = "nvrtc %d.%d" % nvrtc_version()
        cubin = out / f"{src}.cubin"
        cubin.write_bytes(image)
        meta = {"source": src, "sha256": _digest(specs[0].path()), "arch": arch,
                "compiler": tool, "lowered_names": names}
        (out / f"{src}.json").write_text(json.dumps(meta, indent=1) + "\n")
        written.append(cubin)
    return written


_prebuilt_lock = threading.Lock()
_prebuilt_modules: dict = {}


def _load_prebuilt(s: KernelSpec, dev, directory: Path):
    from orchestra.kernel import Module

    cubin, meta_path = directory / f"{s.source}.cubin", directory / f"{s.source}.json"
    if not cubin.is_file() or not meta_path.is_file():
        raise PrebuiltCubinError(
            f"${PREBUILT_ENV}={directory}: no {cubin.name} / {meta_path.name}; build them with:"
            " python3 tests/kernel_checks.py --build-cubins DIR")
    meta = json.loads(meta_path.read_text())
    if meta.get("sha256") != _digest(s.path()):
        raise PrebuiltCubinError(f"{cubin} was built from another version of {s.source}; rebuild"
                                 " with: python3 tests/kernel_checks.py --build-cubins DIR")
    if meta.get("arch") != dev.arch:
        raise PrebuiltCubinError(f"{cubin} is for {meta.get('arch')}, the device is {dev.arch}")
    key = (dev.ordinal, str(cubin.resolve()))
    with _prebuilt_lock:
        module = _prebuilt_modules.get(key)
        if module is None or module.closed:
            text = None if s.is_ptx else s.path().read_text()
            module = _prebuilt_modules[key] = Module.load(
                cubin.read_bytes(), dev, source=text, lowered_names=meta.get("lowered_names"))
    return module.kernel(s.name, params=s.params)

"""Launch configuration: dimensions, checks against device and kernel limits, launch attributes.

Everything here but `launch_attributes`/`build_launch_config` is plain Python: `check_launch`
takes the limits as arguments, so it is tested on the CPU, and the graph-build executor runs the
same checks before it adds a kernel node. Every check raises `LaunchConfigValueError` (a
``ValueError``; wrong types: `LaunchConfigTypeError`, a ``TypeError``) naming the limit it hit,
before anything is enqueued.

Launch attributes (``cuLaunchKernelEx`` / kernel-node attributes):

* ``cooperative=True`` -> ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE`` (grid-wide sync); the device must
  support cooperative launch and the whole grid must be co-resident:
  ``blocks <= cuOccupancyMaxActiveBlocksPerMultiprocessor * SM count``;
* ``cluster=(x, y, z)`` -> ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`` (thread block clusters,
  compute capability 9.0+); each cluster dimension must divide the grid dimension, and the
  cluster may hold at most 8 blocks (16 when the kernel allows non-portable sizes);
* ``pdl=True`` -> ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (programmatic
  dependent launch, compute capability 9.0+);
* ``priority=p`` -> ``CU_LAUNCH_ATTRIBUTE_PRIORITY``; ``p`` must lie in the device's stream
  priority range (``greatest <= p <= least``, e.g. -5 .. 0; lower is more urgent).
"""

from __future__ import annotations

import operator

import attrs

from orchestra.errors import LaunchConfigTypeError, LaunchConfigValueError, int_text

_UINT_MAX = 2**32 - 1
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1

PORTABLE_CLUSTER_SIZE = 8
NON_PORTABLE_CLUSTER_SIZE = 16


def normalize_dims(value, what: str) -> tuple[int, int, int]:
    """An int or a 1-3 tuple/list of ints -> ``(x, y, z)`` padded with 1.

    Raises `LaunchConfigTypeError` (a ``TypeError``) for other types, `LaunchConfigValueError`
    (a ``ValueError``) for a dimension below 1 or above 2**32 - 1, or more than 3 entries.
    """
    if isinstance(value, (tuple, list)):
        items = list(value)
        if not 1 <= len(items) <= 3:
            raise LaunchConfigValueError(
                f"{what} must have 1 to 3 dimensions, got {len(items)}: {value!r}")
    else:
        items = [value]
    out = []
    for v in items:
        if isinstance(v, bool):
            raise LaunchConfigTypeError(f"{what} dimensions must be ints, got {value!r}")
        try:
            v = operator.index(v)
        except TypeError:
            raise LaunchConfigTypeError(f"{what} dimensions must be ints, got {value!r}") from None
        if not 1 <= v <= 0xFFFFFFFF:
            raise LaunchConfigValueError(
                f"{what} dimensions must be between 1 and 2**32-1, got {value!r}")
        out.append(v)
    while len(out) < 3:
        out.append(1)
    return (out[0], out[1], out[2])


@attrs.frozen
class LaunchConfig:
    """One launch's shape and attributes (plain data; reusable for kernel graph nodes).

    ``grid``/``block``: ``(x, y, z)``; ``shared_mem``: dynamic shared memory per block in bytes;
    ``cluster``: ``(x, y, z)`` blocks per cluster or None; ``priority``: int or None.

    Immutable: may be shared between threads freely.
    """

    grid: tuple
    block: tuple
    shared_mem: int = 0
    cooperative: bool = False
    cluster: tuple | None = None
    pdl: bool = False
    priority: int | None = None

    @classmethod
    def make(cls, grid, block, shared_mem=0, *, cooperative=False, cluster=None, pdl=False,
             priority=None) -> "LaunchConfig":
        """Normalize and type-check the arguments (`normalize_dims`); limits are checked by
        `check_launch`."""
        try:
            smem = operator.index(shared_mem)
        except TypeError:
            raise LaunchConfigTypeError(
                f"shared_mem must be an int (bytes), got {shared_mem!r}") from None
        if isinstance(shared_mem, bool) or smem < 0:
            raise LaunchConfigValueError(
                f"shared_mem must be a byte count >= 0, got "
                f"{repr(shared_mem) if isinstance(shared_mem, bool) else int_text(smem)}")
        if smem > _UINT_MAX:  # cuLaunchKernel's sharedMemBytes is an unsigned int
            raise LaunchConfigValueError(
                f"shared_mem must be a byte count from 0 to {_UINT_MAX} (an unsigned int), got "
                f"{int_text(smem)}")
        if priority is not None:
            if isinstance(priority, bool):
                raise LaunchConfigTypeError(f"priority must be an int, got {priority!r}")
            try:
                priority = operator.index(priority)
            except TypeError:
                raise LaunchConfigTypeError(f"priority must be an int, got {priority!r}") from None
            if not _INT_MIN <= priority <= _INT_MAX:  # CU_LAUNCH_ATTRIBUTE_PRIORITY: an int
                raise LaunchConfigValueError(
                    f"priority must be an int from {_INT_MIN} to {_INT_MAX}, got "
                    f"{int_text(priority)}")
        return cls(normalize_dims(grid, "grid"), normalize_dims(block, "block"), smem,
                   bool(cooperative), None if cluster is None else normalize_dims(cluster,
                   "cluster"),
                   bool(pdl), priority)

    @property
    def threads_per_block(self) -> int:
        b = self.block
        return b[0] * b[1] * b[2]

    @property
    def blocks(self) -> int:
        g = self.grid
        return g[0] * g[1] * g[2]

    @property
    def needs_ex(self) -> bool:
        """True when a launch attribute is set (``cuLaunchKernelEx`` instead of
        ``cuLaunchKernel``)."""
        return self.cooperative or self.cluster is not None or self.pdl \
            or self.priority is not None


def check_launch(cfg: LaunchConfig, limits, *, kernel_name: str = "kernel",
                 kernel_max_threads: int | None = None, static_shared: int = 0,
                 max_dynamic_shared: int | None = None, compute_capability=(9, 0),
                 sm_count: int | None = None, occupancy=None,
                 non_portable_cluster: bool = False) -> int:
    """Check ``cfg`` against the device ``limits`` (a `DeviceLimits`) and the kernel's own.

    Args:
        kernel_max_threads: ``CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`` (registers and
            ``__launch_bounds__`` can make it lower than the device's).
        static_shared: ``CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES``.
        max_dynamic_shared: the kernel's current ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``
            (default: the 48 KiB limit minus ``static_shared``).
        occupancy: for cooperative launches, a callable ``(threads, shared_mem) -> blocks per
            SM`` (``cuOccupancyMaxActiveBlocksPerMultiprocessor``) or an int.

    Returns the dynamic shared memory size the kernel must be opted in to
    (``cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)``) before this launch,
    or 0 when no opt-in is needed.

    Raises `LaunchConfigValueError` (a ``ValueError``) naming the limit that the launch exceeds.
    """
    name = kernel_name
    bx, by, bz = cfg.block
    threads = bx * by * bz
    if threads > limits.max_threads_per_block:
        raise LaunchConfigValueError(
            f"launch of {name}: block {cfg.block} has {threads} threads, above the device's max"
            f" threads per block ({limits.max_threads_per_block})")
    for axis, v, lim in zip("xyz", cfg.block, limits.max_block_dim):
        if v > lim:
            raise LaunchConfigValueError(
                f"launch of {name}: block dimension {axis} = {v} exceeds the device's max block"
                f" dims {tuple(limits.max_block_dim)}")
    if kernel_max_threads is not None and threads > kernel_max_threads:
        raise LaunchConfigValueError(
            f"launch of {name}: block {cfg.block} has {threads} threads, above the kernel's max"
            f" threads per block ({kernel_max_threads}, limited by its register use or"
            " __launch_bounds__)")
    for axis, v, lim in zip("xyz", cfg.grid, limits.max_grid_dim):
        if v > lim:
            raise LaunchConfigValueError(
                f"launch of {name}: grid dimension {axis} = {v} exceeds the device's max grid"
                f" dims {tuple(limits.max_grid_dim)}")

    optin_needed = 0
    smem = cfg.shared_mem
    if max_dynamic_shared is None:
        max_dynamic_shared = max(limits.max_shared_memory_per_block - static_shared, 0)
    if smem > max_dynamic_shared:
        if static_shared + smem > limits.max_shared_memory_per_block_optin:
            raise LaunchConfigValueError(
                f"launch of {name}: shared memory per block {smem} bytes dynamic +"
                f" {static_shared} static = {smem + static_shared} bytes exceeds the device's"
                f" opt-in limit (max shared memory per block optin ="
                f" {limits.max_shared_memory_per_block_optin} bytes)")
        optin_needed = smem

    if cfg.pdl and tuple(compute_capability) < (9, 0):
        raise LaunchConfigValueError(
            f"launch of {name}: programmatic dependent launch (pdl=True) needs compute capability"
            f" 9.0 or newer; this device is {compute_capability[0]}.{compute_capability[1]}")

    if cfg.cluster is not None:
        if not limits.cluster_launch:
            raise LaunchConfigValueError(
                f"launch of {name}: this device does not support thread block"
                " clusters (cluster launch needs compute capability 9.0+)")
        size = cfg.cluster[0] * cfg.cluster[1] * cfg.cluster[2]
        cap = NON_PORTABLE_CLUSTER_SIZE if non_portable_cluster else PORTABLE_CLUSTER_SIZE
        if size > cap:
            raise LaunchConfigValueError(
                f"launch of {name}: cluster {cfg.cluster} has {size} blocks, above the max"
                f" cluster size {cap}" + ("" if non_portable_cluster else
                                          " (portable limit; the kernel does not allow"
                                          " non-portable cluster sizes)"))
        for axis, g, c in zip("xyz", cfg.grid, cfg.cluster):
            if g % c:
                raise LaunchConfigValueError(
                    f"launch of {name}: cluster dimension {axis} = {c} does not divide grid"
                    f" dimension {axis} = {g} (cluster dims must divide the grid)")

    if cfg.cooperative:
        if not limits.cooperative_launch:
            raise LaunchConfigValueError(
                f"launch of {name}: this device does not support cooperative"
                " launch")
        per_sm = occupancy(threads, smem) if callable(occupancy) else occupancy
        if per_sm is not None and sm_count is not None:
            cap = int(per_sm) * int(sm_count)
            if cfg.blocks > cap:
                raise LaunchConfigValueError(
                    f"launch of {name}: cooperative grid {cfg.grid} has {cfg.blocks} blocks, but"
                    f" only {cap} can be co-resident ({sm_count} SMs x {per_sm} blocks per SM"
                    f" for {threads} threads and {smem} bytes of shared memory,"
                    " cuOccupancyMaxActiveBlocksPerMultiprocessor)")

    if cfg.priority is not None:
        lo, hi = limits.greatest_stream_priority, limits.least_stream_priority
        if not lo <= cfg.priority <= hi:
            raise LaunchConfigValueError(
                f"launch of {name}: priority {cfg.priority} is outside the device's stream"
                f" priority range {lo} (highest) .. {hi} (lowest)")
    return optin_needed


def launch_attribute_values(cfg: LaunchConfig, *, id_type=None, value_type=None,
                            pdl: bool = True) -> list:
    """``[(CUlaunchAttributeID, CUlaunchAttributeValue), ...]`` for ``cfg``'s attributes: the
    form kernel graph nodes take (``cuGraphKernelNodeSetAttribute``).

    ``id_type`` / ``value_type``: the enum and value class to build instead (the graph
    executors pass ``CUkernelNodeAttrID`` / ``CUkernelNodeAttrValue``). ``pdl=False`` leaves
    the PDL attribute out."""
    from cuda.bindings import driver

    ids = id_type if id_type is not None else driver.CUlaunchAttributeID
    value = value_type if value_type is not None else driver.CUlaunchAttributeValue
    out = []
    if cfg.cooperative:
        v = value()
        v.cooperative = 1
        out.append((ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, v))
    if cfg.cluster is not None:
        v = value()
        v.clusterDim.x, v.clusterDim.y, v.clusterDim.z = cfg.cluster
        out.append((ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, v))
    if pdl and cfg.pdl:
        v = value()
        v.programmaticStreamSerializationAllowed = 1
        out.append((ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, v))
    if cfg.priority is not None:
        v = value()
        v.priority = cfg.priority
        out.append((ids.CU_LAUNCH_ATTRIBUTE_PRIORITY, v))
    return out


def launch_attributes(cfg: LaunchConfig) -> list:
    """``cfg``'s attributes as a list of ``CUlaunchAttribute`` (for ``CUlaunchConfig.attrs``):
    the pairs of `launch_attribute_values`, each in one struct."""
    from cuda.bindings import driver

    out = []
    for attr_id, value in launch_attribute_values(cfg):
        a = driver.CUlaunchAttribute()
        a.id = attr_id
        a.value = value
        out.append(a)
    return out


def build_launch_config(cfg: LaunchConfig, stream_handle):
    """A ``CUlaunchConfig`` for ``cuLaunchKernelEx``: dims, dynamic shared memory, stream and
    the attribute list of `launch_attributes`."""
    from cuda.bindings import driver

    c = driver.CUlaunchConfig()
    c.gridDimX, c.gridDimY, c.gridDimZ = cfg.grid
    c.blockDimX, c.blockDimY, c.blockDimZ = cfg.block
    c.sharedMemBytes = cfg.shared_mem
    c.hStream = stream_handle
    attrs_list = launch_attributes(cfg)
    c.attrs = attrs_list
    c.numAttrs = len(attrs_list)
    return c

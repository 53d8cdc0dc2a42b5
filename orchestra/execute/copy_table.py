"""The crossover table per device, on disk: where host copies stop being copy kernels.

`load_crossover(device)` returns the `CopyCrossover` measured for this device
(`orchestra.execute.copy_tuning.measure_copy_crossover`, ``orchestra tune copies``) when one is
cached, else `DEFAULT_CROSSOVER`; `save_crossover` stores one. The table lives in orchestra's
on-disk cache next to the cubins (``$ORCHESTRA_CACHE_DIR``; namespace ``crossover``: the same
size cap, LRU eviction and ``orchestra cache clear``), keyed by what makes the numbers differ:
the device name, compute capability, SM and copy-engine counts, the driver version and the copy
kernel's source. `copy_policy` builds the `CopyPolicy` an executor lowers its copies with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading

from orchestra.execute.lowering.copy_policy import (
    DEFAULT_CROSSOVER,
    CopyCrossover,
    CopyPolicy,
    check_lowering,
)

log = logging.getLogger(__name__)

NAMESPACE = "crossover"
_memo: dict[tuple, CopyCrossover] = {}
_lock = threading.Lock()


def _driver_version() -> int:
    from orchestra.driver.check import driver_version

    return driver_version()


def _copy_source_digest() -> str:
    from orchestra.compiler.sources import kernel_source_dir

    try:
        return hashlib.sha256((kernel_source_dir() / "copy.cu").read_bytes()).hexdigest()[:16]
    except OSError:
        return "missing"


def device_key(device) -> tuple:
    """What the crossover of ``device`` depends on (a `Device`, or anything with ``name``,
    ``arch``, ``sm_count``)."""
    return (str(getattr(device, "name", "?")), str(getattr(device, "arch", "?")),
            int(getattr(device, "sm_count", 0) or 0),
            int(getattr(device, "async_engine_count", 0) or 0), _driver_version(),
            _copy_source_digest())


def _cache_key(device) -> tuple[str, tuple]:
    from orchestra.compiler import cache

    parts = device_key(device)
    return cache.make_key(NAMESPACE, *parts), parts


def load_crossover(device) -> CopyCrossover:
    """The measured `CopyCrossover` of ``device`` from the on-disk cache, else
    `DEFAULT_CROSSOVER`. A device whose kernels cannot address host memory
    (``kernel_host_access`` false or missing) always gets the default (it never runs copy
    kernels). Read once per process and cache directory. Thread-safe."""
    if not getattr(device, "kernel_host_access", False):
        return DEFAULT_CROSSOVER
    from orchestra.compiler import cache

    key, parts = _cache_key(device)
    memo_key = (str(cache.cache_dir(create=False)), key)
    with _lock:
        hit = _memo.get(memo_key)
        if hit is not None:
            return hit
        found = DEFAULT_CROSSOVER
        try:
            entry = cache.load(NAMESPACE, key)
        except Exception as exc:  # noqa: BLE001 - a bad cache setting: say so, use the default
            log.warning("copy crossover: the cache cannot be read (%s); using the default", exc)
            entry = None
        if entry is not None:
            try:
                found = CopyCrossover.from_dict(json.loads(entry.image.decode("utf-8")))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("copy crossover entry for %s is unreadable (%s); using the default",
                            parts[0], exc)
        _memo[memo_key] = found
        return found


def save_crossover(device, crossover: CopyCrossover):
    """Store ``crossover`` as ``device``'s table (later `load_crossover` calls in any process
    return it). Returns the entry's path, or None when the cache is off or not writable."""
    from orchestra.compiler import cache

    key, parts = _cache_key(device)
    data = json.dumps(crossover.as_dict(), sort_keys=True).encode("utf-8")
    path = cache.store(NAMESPACE, key, data, "", {"device": parts[0]})
    with _lock:
        _memo[(str(cache.cache_dir(create=False)), key)] = crossover
    return path


def forget_crossovers() -> None:
    """Drop the in-process memo (the next `load_crossover` reads the disk again)."""
    with _lock:
        _memo.clear()


def copy_policy(device, mode: str, lowering: str = "auto",
                crossover: CopyCrossover | None = None) -> CopyPolicy:
    """The `CopyPolicy` for ``device`` in executor mode ``mode`` (``"graph"`` / ``"eager"``)
    with the build-wide ``lowering``; ``crossover`` default: `load_crossover(device)`. Raises
    `CopyLoweringError` for an unknown ``lowering``."""
    check_lowering(lowering)
    access = bool(getattr(device, "kernel_host_access", False))
    table = crossover if crossover is not None else load_crossover(device)
    label = f"device {getattr(device, 'ordinal', '?')} ({getattr(device, 'name', '?')})"
    return CopyPolicy(lowering, mode, table, access, label)


__all__ = ["NAMESPACE", "copy_policy", "device_key", "forget_crossovers", "load_crossover",
           "save_crossover"]

"""Kernel resolution: a graph's `KernelRef` (plain data) -> a loaded `orchestra.kernel.Kernel`.

`KernelResolver` compiles (through the on-disk cubin cache), loads and looks up each distinct
`KernelRef` once per device and remembers the result; every executor resolves kernels through
one, before anything is enqueued, so a compile error, a missing kernel or bad parameter
declarations stop a run before its first copy.
"""

from __future__ import annotations

import threading
from typing import Callable

from orchestra.graph import KernelRef


def _default_loader(ref: KernelRef, device):
    from orchestra.kernel import load_kernel

    return load_kernel(ref.source, ref.name, name_expression=ref.name_expression,
                       options=tuple(ref.options), params=ref.params, device=device)


class KernelResolver:
    """`KernelRef` -> `orchestra.kernel.Kernel` on ``device``, memoized.

    ``loader(ref, device) -> Kernel`` defaults to `orchestra.kernel.load_kernel` (compile with
    the cache, load the module, look the kernel up); tests pass a fake.
    """

    def __init__(self, device, loader: Callable | None = None):
        self.device = device
        self._loader = loader or _default_loader
        self._memo: dict[KernelRef, object] = {}
        self._lock = threading.Lock()

    def resolve(self, ref: KernelRef, node: str | None = None):
        """The `Kernel` for ``ref``. Errors (`CompileError`, `KernelNotFoundError`, ...) keep
        their type and get a note naming ``node``."""
        k = self._memo.get(ref)
        if k is not None and not _module_closed(k):
            return k
        with self._lock:
            k = self._memo.get(ref)
            if k is None or _module_closed(k):  # a closed module: load it again
                try:
                    k = self._loader(ref, self.device)
                except Exception as exc:
                    where = f" (kernel node {node})" if node else ""
                    exc.add_note(f"while resolving kernel {ref.name!r} from "
                                 f"{_short(ref.source)}{where}")
                    raise
                self._memo[ref] = k
        return k

    @property
    def loader(self) -> Callable:
        """The ``loader(ref, device)`` this resolver loads kernels with."""
        return self._loader

    def __len__(self) -> int:
        return len(self._memo)

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()


def _module_closed(kernel) -> bool:
    """True when ``kernel``'s `Module` was closed (its kernels serve only work that leased
    it before); kernels without a module (test fakes) never are."""
    return bool(getattr(getattr(kernel, "module", None), "closed", False))


def _short(source: str) -> str:
    return source if "\n" not in source and len(source) < 120 else "inline source"

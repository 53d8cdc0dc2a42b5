"""Kernel resolution: a graph's `KernelRef` (plain data) -> a loaded `orchestra.kernel.Kernel`.

`KernelResolver` compiles (through the on-disk cubin cache), loads and looks up each distinct
`KernelRef` once per device and remembers the result; every executor resolves kernels through
one, before anything is enqueued, so a compile error, a missing kernel or bad parameter
declarations stop a run before its first copy. It also answers, once per kernel, whether the
kernel executes ``griddepcontrol.wait`` (`waits_on_grid_dependency`): what a kernel node
launched with the ``pdl`` attribute, the consumer of a programmatic edge, must do.
"""

from __future__ import annotations

import threading
from typing import Callable

from orchestra.graph import KernelRef


def _default_loader(ref: KernelRef, device):
    from orchestra.kernel import load_kernel

    return load_kernel(ref.source, ref.name, name_expression=ref.name_expression,
                       options=tuple(ref.options), params=ref.params, device=device)


def ptx_waits(ref: KernelRef, kernel, device) -> bool:
    """Whether ``ref``'s kernel executes ``griddepcontrol.wait``, from its PTX
    (`orchestra.compiler.griddep`): a ``.ptx`` source is its own PTX, a CUDA C++ one is
    compiled to PTX with the kernel's options for the device's architecture (NVRTC, cached on
    disk like the cubin). ``kernel`` (the loaded one) is not needed."""
    from orchestra.compiler import compile as nvrtc_compile
    from orchestra.compiler.griddep import kernel_waits_on_grid_dependency
    from orchestra.compiler.ptx import is_ptx
    from orchestra.compiler.sources import read_source

    text = read_source(ref.source, inline_name="inline.cu").text
    if ref.source.endswith(".ptx") or is_ptx(text):
        return kernel_waits_on_grid_dependency(text, ref.name)
    exprs = (ref.name_expression,) if ref.name_expression else ()
    res = nvrtc_compile(ref.source, arch=device.arch, options=tuple(ref.options),
                        name_expressions=exprs, ptx=True)
    ptx = res.cubin.decode() if isinstance(res.cubin, bytes) else res.cubin
    entry = res.lowered_names.get(ref.name_expression, ref.name_expression) if exprs else ref.name
    return kernel_waits_on_grid_dependency(ptx, entry)


class KernelResolver:
    """`KernelRef` -> `orchestra.kernel.Kernel` on ``device``, memoized.

    ``loader(ref, device) -> Kernel`` defaults to `orchestra.kernel.load_kernel` (compile with
    the cache, load the module, look the kernel up); tests pass a fake. ``waits(ref, kernel,
    device) -> bool`` answers `waits_on_grid_dependency` (default `ptx_waits`; a loaded kernel
    with a ``waits`` attribute, as the CPU tests' fakes have, answers for itself).

    Thread-safety: may be shared between threads (executors share one): a kernel is loaded once per
    `KernelRef` under the resolver's lock, and the memo is read without it.
    """

    def __init__(self, device, loader: Callable | None = None, waits: Callable | None = None):
        self.device = device
        self._loader = loader or _default_loader
        self._waits = waits
        self._memo: dict[KernelRef, object] = {}
        self._waits_memo: dict[KernelRef, bool] = {}
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

    def waits_on_grid_dependency(self, ref: KernelRef, node: str | None = None) -> bool:
        """Whether ``ref``'s kernel executes ``griddepcontrol.wait`` (memoized; resolves the
        kernel first). Errors keep their type and get a note naming ``node``."""
        hit = self._waits_memo.get(ref)
        if hit is not None:
            return hit
        kernel = self.resolve(ref, node)
        own = getattr(kernel, "waits", None)
        try:
            if self._waits is not None:
                answer = bool(self._waits(ref, kernel, self.device))
            elif isinstance(own, bool):
                answer = own
            else:
                answer = ptx_waits(ref, kernel, self.device)
        except Exception as exc:
            where = f" (kernel node {node})" if node else ""
            exc.add_note(f"while checking whether kernel {ref.name!r} waits on its grid "
                         f"dependency{where}")
            raise
        self._waits_memo[ref] = answer
        return answer

    def __len__(self) -> int:
        return len(self._memo)

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._waits_memo.clear()


def _module_closed(kernel) -> bool:
    """True when ``kernel``'s `Module` was closed (its kernels serve only work that leased
    it before); kernels without a module (test fakes) never are."""
    return bool(getattr(getattr(kernel, "module", None), "closed", False))


def _short(source: str) -> str:
    return source if "\n" not in source and len(source) < 120 else "inline source"

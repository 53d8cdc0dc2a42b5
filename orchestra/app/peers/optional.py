"""Which peers can run: CuPy and PyTorch are optional; a missing one is skipped with a note.

`probe(name)` imports the peer and checks it sees a CUDA device; it returns the module or a
`Skip` saying why not (not installed, no CUDA build, import failure). Nothing here initializes
CUDA unless the peer is installed.
"""

from __future__ import annotations

import importlib
from typing import Callable

import attrs

from orchestra.errors import BenchConfigError

PEERS = ("cupy", "torch")
INSTALL = {"cupy": "pip install cupy-cuda12x (or the wheel for your CUDA)",
           "torch": "pip install torch (a CUDA build)"}
LABEL = {"cupy": "CuPy", "torch": "PyTorch"}


@attrs.frozen
class Skip:
    """A peer that does not run, and why (``note``: one line for the report).

    Immutable: may be shared between threads freely.
    """

    peer: str
    note: str


def _cuda_ok(name: str, mod) -> str | None:
    """Why ``mod`` cannot run on the GPU, or None."""
    try:
        if name == "torch":
            if not mod.cuda.is_available():
                return "torch.cuda.is_available() is False (a CPU-only build?)"
        elif name == "cupy":
            if mod.cuda.runtime.getDeviceCount() < 1:
                return "cupy sees no CUDA device"
    except Exception as exc:  # noqa: BLE001 - any failure to reach the GPU is a skip
        return f"{type(exc).__name__}: {exc}"
    return None


def probe(name: str, importer: Callable[[str], object] = importlib.import_module):
    """The imported peer module, or a `Skip`. ``importer`` is for tests."""
    if name not in PEERS:
        raise BenchConfigError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    label = LABEL[name]
    try:
        mod = importer(name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing in (None, name):
            return Skip(name, f"{label} is not installed ({INSTALL[name]}); its rows are left "
                              "out")
        return Skip(name, f"{label} does not import: {exc}; its rows are left out")
    except Exception as exc:  # noqa: BLE001 - a broken install is a skip, not a crash
        return Skip(name, f"{label} does not import: {type(exc).__name__}: {exc}; its rows "
                          "are left out")
    why = _cuda_ok(name, mod)
    if why is not None:
        return Skip(name, f"{label} cannot use the GPU ({why}); its rows are left out")
    return mod


def version_of(mod) -> str:
    return str(getattr(mod, "__version__", "?"))


__all__ = ["INSTALL", "LABEL", "PEERS", "Skip", "probe", "version_of"]

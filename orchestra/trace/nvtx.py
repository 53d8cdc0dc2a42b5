"""NVTX ranges (visible in Nsight Systems) when the ``nvtx`` package is installed; no-ops otherwise.

``pip install orchestra[nvtx]``. Ranges are host-side: around an eager executor's enqueue of a
node they show when the node was *issued*; the GPU-side times come from the event timeline.
"""

from __future__ import annotations

import contextlib

from orchestra.trace.timeline import engine_color

DOMAIN = "orchestra"

try:  # an optional extra
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx = None


def nvtx_available() -> bool:
    """True when the ``nvtx`` package is importable (ranges are then emitted)."""
    return _nvtx is not None


def _color(color):
    if isinstance(color, str) and color.startswith("#") and len(color) == 7:
        return int(color[1:], 16)
    return color


@contextlib.contextmanager
def nvtx_range(name: str, color: str | int | None = None, domain: str = DOMAIN):
    """A ``with`` block inside NVTX range ``name``; ``color`` is ``#rrggbb``, an NVTX colour
    name ("blue", "green", ...) or an ARGB int. Does nothing when ``nvtx`` is missing."""
    lib = _nvtx
    if lib is None:
        yield
        return
    lib.push_range(message=str(name), color=_color(color), domain=domain)
    try:
        yield
    finally:
        lib.pop_range(domain=domain)


def node_range(node, domain: str = DOMAIN):
    """`nvtx_range` named after a graph node and coloured by its engine."""
    return nvtx_range(node.name, engine_color(getattr(node, "engine", "compute")), domain)

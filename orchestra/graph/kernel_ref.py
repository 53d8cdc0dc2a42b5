"""`KernelRef`: which kernel a node launches, as plain data.

The executor resolves it with the compiler (source -> cubin -> function); the graph only reads the
declared parameter strings, to default a bare buffer argument bound to a ``const T*`` parameter to
a read.
"""

from __future__ import annotations

import re

import attrs

from orchestra.errors import GraphError
from orchestra.graph.buffers import Mode


def _str_tuple(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _opt_str_tuple(value):
    return None if value is None else _str_tuple(value)


_WORD = re.compile(r"[A-Za-z_]\w*")


def pointee_is_const(param: str) -> bool | None:
    """For a declaration like ``"const float* __restrict__ x"``: True if the pointee is const.

    Returns None when the parameter is not a pointer. ``float* const p`` (a const pointer to
    mutable data) is not const for our purpose: the kernel may write through it.
    """
    if "*" not in param and "[" not in param:
        return None
    head = param.split("*", 1)[0] if "*" in param else param.split("[", 1)[0]
    return "const" in _WORD.findall(head)


@attrs.frozen
class KernelRef:
    """A kernel to launch, resolved later by the executor through `orchestra.compiler`.

    Attributes:
        source: a path to a ``.cu``/``.ptx`` file or the source text itself.
        name: the kernel's name (``extern "C"`` name, or the template's base name).
        name_expression: for templates, the instantiation to compile, e.g. ``"scale<float>"``.
        params: the parameter declarations, e.g. ``("const float* x", "float* y", "size_t n")``;
            None when unknown (then bare buffer arguments default to read-write).
        options: NVRTC options, e.g. ``("-O3",)``.
    """

    source: str
    name: str
    name_expression: str | None = None
    params: tuple[str, ...] | None = attrs.field(default=None, converter=_opt_str_tuple)
    options: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)

    def __attrs_post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise GraphError(f"KernelRef.source must be a path or source text; got {self.source!r}")
        if not isinstance(self.name, str) or not self.name:
            raise GraphError(f"KernelRef.name must be the kernel's name; got {self.name!r}")

    def default_mode(self, index: int) -> Mode:
        """The access mode of a bare buffer passed as argument ``index``.

        READ for a declared ``const T*`` parameter, otherwise READ_WRITE (the safe choice).
        """
        if self.params is not None and index < len(self.params):
            if pointee_is_const(self.params[index]):
                return Mode.READ
        return Mode.READ_WRITE

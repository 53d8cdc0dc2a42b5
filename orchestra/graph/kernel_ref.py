"""`KernelRef`: which kernel a node launches, as plain data.

The executor resolves it with the compiler (source -> cubin -> function); the graph only reads the
declared parameter strings, to default a bare buffer argument bound to a ``const T*`` parameter to
a read.
"""

from __future__ import annotations

import os
import re

import attrs

from orchestra.errors import NodeFieldTypeError, NodeFieldValueError
from orchestra.graph.buffers import Mode
from orchestra.graph.fields import check_name, check_str_tuple, got, str_tuple


def _opt_str_tuple(value):
    return None if value is None else str_tuple(value)


def _source(value):
    # A pathlib.Path is a path like a str one; keep the record plain (hashable, JSON-able).
    return os.fspath(value) if isinstance(value, os.PathLike) else value


_WORD = re.compile(r"[A-Za-z_]\w*")
# NVRTC options that set the target architecture (orchestra.compiler.nvrtc.ARCH_OPTIONS; the
# graph layer imports no compiler, a test keeps the two equal).
ARCH_OPTIONS = ("-arch", "--gpu-architecture", "-gpu-architecture", "--arch")


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
        source: a path to a ``.cu``/``.ptx`` file (str or ``os.PathLike``, kept as str) or the
            source text itself.
        name: the kernel's name (``extern "C"`` name, or the template's base name).
        name_expression: for templates, the instantiation to compile, e.g. ``"scale<float>"``.
        params: the parameter declarations, e.g. ``("const float* x", "float* y", "size_t n")``;
            None when unknown (then bare buffer arguments default to read-write).
        options: NVRTC options, e.g. ``("-O3",)``; never an architecture (``-arch=sm_80``,
            ``--gpu-architecture=...``): the executor compiles for the device that runs the
            kernel (`NodeFieldValueError` says so).

    A field of the wrong type raises `NodeFieldTypeError` (a ``TypeError``), an empty name or
    source, or an option that sets the architecture, `NodeFieldValueError` (a ``ValueError``),
    both naming the field.

    Immutable: may be shared between threads freely.
    """

    source: str = attrs.field(converter=_source)
    name: str
    name_expression: str | None = None
    params: tuple[str, ...] | None = attrs.field(default=None, converter=_opt_str_tuple)
    options: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)

    def __attrs_post_init__(self):
        check_name("KernelRef", "name", self.name)
        record = f"KernelRef {self.name}"
        if not isinstance(self.source, str):
            raise NodeFieldTypeError(f"{record}: source must be a path (str or Path) or the"
                                     f" source text (str), got {got(self.source)}")
        check_name(record, "source", self.source)
        if self.name_expression is not None and not isinstance(self.name_expression, str):
            raise NodeFieldTypeError(f"{record}: name_expression must be a str or None, got"
                                     f" {got(self.name_expression)}")
        if self.params is not None:
            check_str_tuple(record, "params", self.params,
                            item="a C parameter declaration (str)",
                            expected="None or a list/tuple of C parameter declarations (str)")
        check_str_tuple(record, "options", self.options)
        for o in self.options:
            if o.startswith(ARCH_OPTIONS):
                raise NodeFieldValueError(
                    f"{record}: option {o!r} sets the target architecture, which is the"
                    f" device's: an executor compiles each kernel for the GPU that runs it;"
                    f" drop the option")

    def default_mode(self, index: int) -> Mode:
        """The access mode of a bare buffer passed as argument ``index``.

        READ for a declared ``const T*`` parameter, otherwise READ_WRITE (the safe choice).
        """
        if self.params is not None and index < len(self.params):
            if pointee_is_const(self.params[index]):
                return Mode.READ
        return Mode.READ_WRITE

"""A kernel node's launch, resolved once: checked launch configuration and packed arguments.

"Pack once, rewrite changed fields": `resolve_kernel_node` validates the node's scalars with the
compiler's packer (`Kernel.pack`: arity, integer widths, float vs int, no silent casts) and
checks its grid, block, shared memory and launch attributes against the device's and the
kernel's limits (`Kernel.launch_config`), all before anything is enqueued. Buffer arguments
become pointer fields whose address is written later with `KernelArgs.bind` (eager: after each
run's allocations; graph executors: once per graph, then per update). A `Condition` argument
becomes a handle field (`HandleArg`) the executor writes with the conditional handle of the
graph being built or captured (0 where there is none: the eager executor). The driver copies the
parameter values when a launch call returns (or when a graph node is set), so rewriting a field
afterwards never changes work already enqueued.
"""

from __future__ import annotations

from typing import Mapping

import attrs

from orchestra.compiler.args import value_text
from orchestra.errors import (
    KernelArgumentTypeError,
    KernelArgumentValueError,
    LaunchConfigTypeError,
    LaunchConfigValueError,
    prefixed,
)
from orchestra.graph import Buffer, BufferRange, Condition, In, InOut, KernelNode, Out
from orchestra.graph.buffers import as_range

LAUNCH_ATTRIBUTES = ("cluster", "cooperative", "pdl", "priority")


@attrs.frozen
class PointerArg:
    """Parameter ``index`` (ctypes field ``field``) holds the address of ``buffer`` + ``offset``.

    Immutable: may be shared between threads freely.
    """

    index: int
    field: str
    buffer: str
    offset: int


@attrs.frozen
class HandleArg:
    """Parameter ``index`` (ctypes field ``field``) holds the conditional handle of condition
    ``condition`` (a name)."""

    index: int
    field: str
    condition: str


class KernelArgs:
    """One kernel node, ready to launch: ``kernel`` (`orchestra.kernel.Kernel`), ``config`` (checked
    `LaunchConfig`), ``packed`` (`PackedArgs`), ``pointers`` (`PointerArg` per buffer argument),
    ``handles`` (`HandleArg` per `Condition` argument), ``attributes`` (launch keyword
    arguments: cooperative, cluster, pdl, priority).

    Thread-safety: not thread-safe: `bind` writes addresses into its packed struct in place; one
    belongs to one prepared plan or built graph, used under its owner's lock.
    """

    __slots__ = ("node", "kernel", "config", "packed", "pointers", "handles", "attributes")

    def __init__(self, node, kernel, config, packed, pointers, attributes, handles=()):
        self.node = node
        self.kernel = kernel
        self.config = config
        self.packed = packed
        self.pointers = tuple(pointers)
        self.handles = tuple(handles)
        self.attributes = dict(attributes)

    def bind(self, addresses: Mapping[str, int]) -> None:
        """Write each buffer argument's address (``addresses[buffer] + offset``) into its field."""
        struct = self.packed.struct
        for p in self.pointers:
            setattr(struct, p.field, addresses[p.buffer] + p.offset)

    def bind_handles(self, handles: Mapping[str, int]) -> None:
        """Write each condition argument's handle (``handles[condition]``, 0 when absent) into
        its field."""
        struct = self.packed.struct
        for h in self.handles:
            setattr(struct, h.field, int(handles.get(h.condition, 0)))

    @property
    def needs_ex(self) -> bool:
        """True when a launch attribute is set (``cuLaunchKernelEx`` / kernel node attributes)."""
        return bool(self.attributes)

    def __repr__(self) -> str:
        return f"<KernelArgs {self.node.name}: {self.packed!r}>"


def _buffer_target(arg):
    if isinstance(arg, (In, Out, InOut)):
        return arg.target
    if isinstance(arg, (Buffer, BufferRange)):
        return as_range(arg)
    return None


def resolve_kernel_node(node: KernelNode, kernel, addresses: Mapping[str, int] | None = None
                        ) -> KernelArgs:
    """Check and pack ``node`` for ``kernel`` (an `orchestra.kernel.Kernel`).

    ``addresses`` (buffer name -> device address) fills the pointer fields now; without it they
    hold 0 until `KernelArgs.bind`. Raises ``TypeError`` / ``ValueError`` naming the node and the
    parameter (wrong arity or type, a buffer for a scalar parameter or the reverse, a value that
    does not fit) or the launch limit exceeded.
    """
    where = f"kernel node {node.name}"
    layout = getattr(kernel, "layout", None)
    params = layout.params if layout is not None else None
    field_names = layout.field_names if layout is not None else ()
    values, pointers, handles = [], [], []
    for i, arg in enumerate(node.args):
        param = params[i] if params is not None and i < len(params) else None
        if isinstance(arg, Condition):
            if param is not None and not param.is_handle:
                raise KernelArgumentTypeError(
                    f"{where}: argument {i} is condition {arg.name} but parameter {param.name} "
                    f"is {param.ctype}; declare it cudaGraphConditionalHandle")
            values.append(0)  # the executor writes the handle of the graph being made
            if param is not None:
                handles.append(HandleArg(i, field_names[i], arg.name))
            continue
        target = _buffer_target(arg)
        if target is not None:
            if param is not None and not param.is_pointer:
                raise KernelArgumentTypeError(
                    f"{where}: argument {i} is buffer {target.buffer.name} but "
                    f"parameter {param.name} is a scalar ({param.ctype})")
            base = addresses.get(target.buffer.name, 0) if addresses else 0
            values.append(base + target.offset)
            if param is not None:
                pointers.append(PointerArg(i, field_names[i], target.buffer.name,
                                           target.offset))
        else:
            if param is not None and param.is_pointer and not (
                    isinstance(arg, int) and not isinstance(arg, bool) and arg == 0):
                raise KernelArgumentTypeError(
                    f"{where}: parameter {param.name} ({param.ctype}) is a pointer; pass a graph "
                    f"buffer (In/Out/InOut, a Buffer or a BufferRange), not {value_text(arg)} (0 "
                    f"means NULL)")
            values.append(arg)
    try:
        packed = kernel.pack(values)
    except (TypeError, ValueError) as exc:
        raise prefixed(exc, f"{where}: ", KernelArgumentTypeError,
                       KernelArgumentValueError) from exc
    attributes = {}
    for key, value in node.attributes:
        if key not in LAUNCH_ATTRIBUTES:
            raise LaunchConfigValueError(f"{where}: unknown launch attribute {key!r}; known: "
                                         f"{', '.join(LAUNCH_ATTRIBUTES)}")
        attributes[key] = value
    try:
        config = kernel.launch_config(node.grid, node.block, node.shared_mem, **attributes)
    except (TypeError, ValueError) as exc:
        raise prefixed(exc, f"{where}: ", LaunchConfigTypeError, LaunchConfigValueError) from exc
    return KernelArgs(node, kernel, config, packed, pointers, attributes, handles)

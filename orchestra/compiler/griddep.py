"""Does a kernel wait on its grid dependency? (PDL on a consumer that never waits)

A kernel launched with the programmatic-stream-serialization attribute (PDL) may start before the
kernel ahead of it in the stream has finished, so it must execute ``griddepcontrol.wait``
(``cudaGridDependencySynchronize()``) before it reads what that kernel wrote (CUDA Programming
Guide, "Programmatic Dependent Launch"). Whether it does is visible in its PTX: this module finds
each ``.entry`` and reports whether ``griddepcontrol.wait`` appears in it or in a ``.func`` it
calls (directly or through other functions). Pure text processing: no CUDA needed.

Use it before applying ``pdl=True``: `require_grid_dependency_wait` raises `PdlWithoutWaitError`
for a kernel that never waits. The executors check every kernel node launched with the ``pdl``
attribute (and so every consumer of a programmatic edge) through their `KernelResolver`,
``orchestra bench pdl`` and the kernel tests call it directly. The PTX of a ``.cu`` kernel comes
from ``orchestra.compiler.compile(path, arch=..., ptx=True)``; a ``.ptx`` kernel is its own PTX.
SASS is not parsed (use the PTX the cubin was built from).

Limits: a wait reached only through an indirect call (function pointer) is not seen (reported as
not waiting: the safe side); a predicated ``@p griddepcontrol.wait`` counts as a wait.
"""

from __future__ import annotations

import re

from orchestra.errors import CompilerArgumentTypeError, CompilerArgumentValueError, OrchestraError

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
# ".entry name(" / ".func (.param ...) name(" ; the name is the identifier right before "(".
_HEADER = re.compile(
    r"\.(entry|func)\s+(?:\((?:[^()]*)\)\s*)?([A-Za-z_$%][\w$%]*)\s*\(")
_WAIT = re.compile(r"(?:^|[\s;{}])(?:@!?%?\w+\s+)?griddepcontrol\.wait\s*;")
_CALL = re.compile(r"\bcall(?:\.uni)?\s+(?:\([^)]*\)\s*,\s*)?([A-Za-z_$%][\w$%]*)")


class PdlWithoutWaitError(OrchestraError):
    """PDL was asked for a kernel whose code never executes ``griddepcontrol.wait``."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        super().__init__(
            f"kernel {kernel} never executes griddepcontrol.wait (cudaGridDependencySynchronize),"
            " so it must not be launched with pdl=True: under programmatic dependent launch it"
            " may start before the previous kernel's writes are visible and read stale data."
            " Add the wait before the first dependent read, or launch it without pdl")

    def __reduce__(self):
        return (type(self), (self.kernel,))


def _bodies(ptx: str) -> dict[str, tuple[str, str]]:
    """name -> (kind 'entry'|'func', body text) for every entry/function with a body."""
    text = _COMMENTS.sub(" ", ptx)
    out: dict[str, tuple[str, str]] = {}
    for m in _HEADER.finditer(text):
        kind, name = m.group(1), m.group(2)
        i, depth = m.end(), 1
        while i < len(text) and depth:  # skip the parameter list
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        j = i
        while j < len(text) and text[j] not in "{;":
            j += 1  # performance directives (.maxntid ...) sit between ")" and "{"
        if j >= len(text) or text[j] == ";":
            continue  # a prototype / declaration without a body
        depth, k = 1, j + 1
        while k < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
        out[name] = (kind, text[j + 1:k - 1])
    return out


def entry_points(ptx: str) -> dict[str, str]:
    """Every ``.entry`` (kernel) of ``ptx`` -> its body text (comments removed)."""
    return {n: body for n, (kind, body) in _bodies(_text(ptx)).items() if kind == "entry"}


def kernels_waiting_on_grid_dependency(ptx) -> dict[str, bool]:
    """Every kernel (``.entry``) in ``ptx`` -> whether it executes ``griddepcontrol.wait``,
    itself or in a function it calls (transitively)."""
    bodies = _bodies(_text(ptx))
    memo: dict[str, bool] = {}

    def waits(name: str, seen: frozenset) -> bool:
        if name in memo:
            return memo[name]
        body = bodies[name][1]
        found = bool(_WAIT.search(body)) or any(
            callee in bodies and callee not in seen and waits(callee, seen | {callee})
            for callee in _CALL.findall(body))
        memo[name] = found
        return found

    return {n: waits(n, frozenset({n})) for n, (kind, _) in bodies.items() if kind == "entry"}


def kernel_waits_on_grid_dependency(ptx, kernel: str | None = None) -> bool:
    """True when kernel ``kernel`` of ``ptx`` executes ``griddepcontrol.wait``.

    ``ptx``: PTX text (str or bytes). ``kernel``: its entry name (an ``extern "C"`` kernel's
    plain name, or a lowered name); may be omitted when the PTX holds exactly one kernel.
    Raises ``ValueError`` when the kernel is not found (the message lists the kernels) or when
    ``kernel`` is omitted and there is not exactly one.
    """
    found = kernels_waiting_on_grid_dependency(ptx)
    if kernel is None:
        if len(found) != 1:
            raise CompilerArgumentValueError(
                f"the PTX holds {len(found)} kernels ({', '.join(sorted(found))});"
                " name the one to check")
        return next(iter(found.values()))
    if kernel not in found:
        raise CompilerArgumentValueError(
            f"no kernel {kernel!r} in the PTX; it has: {', '.join(sorted(found))}")
    return found[kernel]


def require_grid_dependency_wait(ptx, kernel: str | None = None) -> None:
    """Raise `PdlWithoutWaitError` unless ``kernel`` waits on its grid dependency (call it
    before a launch with ``pdl=True``)."""
    if not kernel_waits_on_grid_dependency(ptx, kernel):
        raise PdlWithoutWaitError(kernel or next(iter(entry_points(_text(ptx))), "?"))


def _text(ptx) -> str:
    if isinstance(ptx, (bytes, bytearray, memoryview)):
        return bytes(ptx).rstrip(b"\0").decode("utf-8", errors="replace")
    if not isinstance(ptx, str):
        raise CompilerArgumentTypeError(f"PTX must be str or bytes, got {type(ptx).__name__}")
    return ptx


__all__ = ["PdlWithoutWaitError", "entry_points", "kernel_waits_on_grid_dependency",
           "kernels_waiting_on_grid_dependency", "require_grid_dependency_wait"]

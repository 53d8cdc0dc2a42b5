"""Errors the executors raise before (or after) running a plan.

They are `OrchestraError`s (the CLI prints them as one line) and also the builtin type a Python
user expects for the mistake: a bad binding is a ``ValueError``, pageable memory a ``TypeError``.
"""

from __future__ import annotations

from orchestra.errors import OrchestraError, PageableMemoryError

__all__ = [
    "BindingError", "BucketOverflowError", "ExecutorArgumentError", "ExecutorArgumentTypeError",
    "ExecutorArgumentValueError", "ExecutorDeviceError", "ExecutorUnavailable", "HostFunctionError",
    "PageableMemoryError", "PlanMismatchError",
]

PIN_HOWTO = ("allocate it pinned with orchestra.driver.PinnedBuffer.empty(shape, dtype).array, "
             "or page-lock it in place with orchestra.driver.register_host(array) (keep the "
             "registration open while runs use it)")


class BindingError(OrchestraError, ValueError):
    """A run's ``bindings`` do not fit the graph: a host buffer without an array, a name the
    graph does not use, the wrong size, a non-contiguous or read-only array. Nothing was
    enqueued."""


class HostFunctionError(OrchestraError):
    """A `HostFunc` node's function raised. The run's other work completed; ``node`` names the
    node and ``exception`` is what it raised (also the ``__cause__``). ``others`` lists further
    ``(node, exception)`` pairs when several host functions failed in one run."""

    def __init__(self, node: str, exception: BaseException, others=()):
        self.node = node
        self.exception = exception
        self.others = tuple(others)
        text = f"host function of node {node} raised {type(exception).__name__}: {exception}"
        if self.others:
            text += f" (and {len(self.others)} more: " + ", ".join(n for n, _ in self.others) + ")"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.node, self.exception, self.others))


class ExecutorUnavailable(OrchestraError, ValueError):
    """The executor asked for is unknown or not built (yet)."""


class PlanMismatchError(OrchestraError, ValueError):
    """The plan does not fit the graph in a way no executor can run (a node missing, run twice
    or unknown; a use issued before its allocation). Raised even with ``verify=False``."""


class ExecutorDeviceError(OrchestraError, ValueError):
    """A node or plan stream on a device the executor does not run on, or a node on a stream
    of another device than its own; nothing was enqueued."""


class ExecutorArgumentError(OrchestraError):
    """An executor, `GraphExec`, `GraphCache`, `GraphRunner` or `StagingPool` was given an
    argument it cannot use (not a TaskGraph / Plan, an unknown mode or kind, a bad size).
    Root of the two below; nothing was enqueued."""


class ExecutorArgumentTypeError(ExecutorArgumentError, TypeError):
    """An executor argument of the wrong type (``run(graph=...)`` given something else)."""


class ExecutorArgumentValueError(ExecutorArgumentError, ValueError):
    """An executor argument with an unusable value (``mode="global-ish"``, ``slots=0``)."""


class BucketOverflowError(ExecutorArgumentValueError):
    """A size is larger than the largest shape bucket of a `GraphCache`: pad or split the
    request, or add a larger bucket."""

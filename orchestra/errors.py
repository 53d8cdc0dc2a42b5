"""Exception types shared by every layer.

Only plain Python here: `graph` and `schedule` raise these without importing CUDA.
The CUDA-specific ones keep the call's name and the status code, and survive pickling
(so they cross process pools and `concurrent.futures` unchanged), as CuPy's errors do.
"""

from __future__ import annotations


class OrchestraError(Exception):
    """Base class of every error orchestra raises on purpose."""


class NoDeviceError(OrchestraError):
    """No NVIDIA driver library or no CUDA device is visible to this process.

    Raised by the first call that needs the driver (`cuInit`), before anything is enqueued.
    """

    def __init__(self, detail: str = ""):
        self.detail = detail
        msg = "no CUDA device: orchestra needs an NVIDIA GPU and its driver (libcuda.so) for this"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.detail,))


# CUresult names after which the context is unusable: every later call fails the same way.
# Source: CUDA Driver API, "Error Handling" (cudaErrorIllegalAddress and friends are sticky).
STICKY_RESULTS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_TRAP",  # not in every version; harmless if absent
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED",
})


class CudaError(OrchestraError):
    """A CUDA driver call failed.

    Attributes:
        call: the driver function's name, e.g. ``"cuMemAllocAsync"``.
        code: the numeric ``CUresult`` value.
        name: the ``CUresult`` name, e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``.
        message: the driver's own description (``cuGetErrorString``).
        context: optional extra words (for example the graph node being captured).

    ``str(err)`` reads ``cuMemAllocAsync: CUDA_ERROR_OUT_OF_MEMORY (out of memory)``. A sticky
    error (see `sticky`) adds that the context is unusable and the process must restart.
    """

    def __init__(self, call: str, code: int, name: str, message: str = "", context: str = ""):
        self.call = call
        self.code = int(code)
        self.name = name
        self.message = message
        self.context = context
        super().__init__(self._text())

    @property
    def sticky(self) -> bool:
        """True when the CUDA context is corrupted and every later call will fail."""
        return self.name in STICKY_RESULTS

    def _text(self) -> str:
        text = f"{self.call}: {self.name}"
        if self.message:
            text += f" ({self.message})"
        if self.context:
            text += f" [{self.context}]"
        if self.sticky:
            text += (
                "; this is a sticky error: the CUDA context is unusable and the process"
                " must be restarted"
            )
        return text

    def with_context(self, context: str) -> "CudaError":
        """A copy of this error that also names where it happened (a node, a capture)."""
        return type(self)(self.call, self.code, self.name, self.message, context)

    def __reduce__(self):
        return (type(self), (self.call, self.code, self.name, self.message, self.context))


class CompileError(OrchestraError):
    """NVRTC (or nvJitLink) refused a program.

    Attributes:
        log: the compiler's full log (file:line messages).
        options: the options the program was compiled with.
        include_dirs: the include directories that were searched.
        call: the failing NVRTC/nvJitLink call, if the failure came from one.
    """

    def __init__(self, summary: str, log: str = "", options=(), include_dirs=(), call: str = ""):
        self.summary = summary
        self.log = log
        self.options = tuple(options)
        self.include_dirs = tuple(include_dirs)
        self.call = call
        parts = [summary]
        if log.strip():
            parts.append("compiler log:\n" + log.rstrip())
        if self.options:
            parts.append("options: " + " ".join(self.options))
        if self.include_dirs:
            parts.append("include directories tried:\n  " + "\n  ".join(self.include_dirs))
        super().__init__("\n".join(parts))

    def __reduce__(self):
        return (type(self), (self.summary, self.log, self.options, self.include_dirs, self.call))


class GraphError(OrchestraError):
    """A task graph is malformed (a cycle, an unknown node or buffer, a duplicate name)."""


class HazardError(OrchestraError):
    """A plan has unordered conflicting accesses or lifetime errors; `findings` lists them."""

    def __init__(self, findings):
        self.findings = tuple(findings)
        lines = [f"the plan has {len(self.findings)} hazard(s); nothing was enqueued:"]
        lines += [f"  - {f}" for f in self.findings]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.findings,))

"""Exception types shared by every layer: one family under `OrchestraError`.

Only plain Python here: `graph` and `schedule` raise these without importing CUDA.
The CUDA-specific ones keep the call's name and the status code, and survive pickling
(so they cross process pools and `concurrent.futures` unchanged), as CuPy's errors do.

Every error orchestra raises on purpose derives from `OrchestraError`. Where the mistake is
what a Python user knows as a ``ValueError``, ``TypeError``, ``KeyError`` (and so on), that
builtin is a second base, so ``except ValueError`` keeps working (numpy's ``AxisError`` is both a
``ValueError`` and an ``IndexError`` for the same reason). A domain with both kinds of mistake has
a root without a builtin base and one leaf per builtin: ``except KernelArgumentError`` catches
every bad kernel argument, ``except TypeError`` only the wrong types. docs/errors.md lists every
class, its bases and what raises it.
"""

from __future__ import annotations

import math


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


# CUDA 13.0 is the oldest driver API orchestra is written and tested against (cuda-bindings 13
# looks entry points up at that version); R580 is the driver branch that first ships it (CUDA
# Toolkit 13.0 release notes, the minimum driver table).
REQUIRED_DRIVER_VERSION = 13000
REQUIRED_DRIVER_BRANCH = "R580"


def cuda_version_text(version: int) -> str:
    """``13000`` -> ``"13.0"`` (``cuDriverGetVersion`` encodes 1000 * major + 10 * minor)."""
    version = int(version)
    return f"{version // 1000}.{(version % 1000) // 10}"


class DriverTooOldError(NoDeviceError):
    """The NVIDIA driver supports an older CUDA than orchestra needs (``cuDriverGetVersion``).

    A `NoDeviceError`, so the CLI reports it as one line with exit code 2. Attributes: ``found``
    (the driver's CUDA version, e.g. 12040 for 12.4) and ``required`` (13000).
    """

    def __init__(self, found: int, required: int = REQUIRED_DRIVER_VERSION):
        self.found = int(found)
        self.required = int(required)
        self.detail = (f"the NVIDIA driver supports CUDA {cuda_version_text(self.found)}"
                       f" (cuDriverGetVersion = {self.found}); orchestra needs CUDA"
                       f" {cuda_version_text(self.required)} or newer, which is NVIDIA driver"
                       f" {REQUIRED_DRIVER_BRANCH} or newer: update the driver")
        OrchestraError.__init__(self, self.detail)

    def __reduce__(self):
        return (type(self), (self.found, self.required))


class DriverBindingError(NoDeviceError):
    """cuda-python's driver bindings could not reach the driver: ``cuda.bindings`` does not
    import, or the installed driver lacks an entry point the bindings look up
    (``FunctionNotFoundError``). A `NoDeviceError` (one line, exit 2 in the CLI)."""

    def __init__(self, detail: str):
        self.detail = detail
        OrchestraError.__init__(self, detail)

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


FORK_HOWTO = (
    "CUDA does not support fork(): a child process cannot use the CUDA state it inherited."
    " Start worker processes with the spawn start method instead:"
    " ctx = multiprocessing.get_context(\"spawn\") and ctx.Process(...) / ctx.Pool(...)"
    " (or ProcessPoolExecutor(mp_context=ctx)), or call"
    " multiprocessing.set_start_method(\"spawn\") once at program start")


class CudaForkError(CudaError, RuntimeError):
    """This process was forked (``os.fork()``, multiprocessing's default ``fork`` start method
    on Linux) after CUDA was initialized in its parent, and now asks for CUDA.

    Raised by the first orchestra call that needs the driver in such a child, and in place of the
    `CudaError` of a driver call that fails there. The parent is not affected. A `CudaError`
    (``.call`` etc.; ``.code`` 0 when no driver call was made) and a ``RuntimeError``.
    """

    def __init__(self, call: str = "", code: int = 0, name: str = "", message: str = "",
                 context: str = ""):
        super().__init__(call, code, name, message, context)

    def _text(self) -> str:
        head = ("this process was forked after CUDA was initialized in its parent"
                " (os.fork(), or multiprocessing's default 'fork' start method on Linux)")
        if self.code:
            head = f"{CudaError._text(self)}: {head}"
        elif self.call:
            head = f"{self.call}: {head}"
        return f"{head}. {FORK_HOWTO}"

    def with_context(self, context: str) -> "CudaForkError":
        return type(self)(self.call, self.code, self.name, self.message, context)


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


# -- usage errors by domain --------------------------------------------------------------------
# Plain-message classes: ``str(err)`` is the message, pickling uses ``args``.


class NotFoundError(OrchestraError, KeyError):
    """A lookup by name (a stream of a plan, a span of a timeline, a kernel of the catalog)
    found nothing; the message names what was asked for and what exists.

    A ``KeyError`` whose ``str()`` is the plain message (``KeyError`` itself quotes it).
    """

    def __str__(self) -> str:
        return Exception.__str__(self)


class StateError(OrchestraError):
    """An object was used in a state that does not allow the call (closed, not built yet, a
    tracer without ``begin()``). Root of `ClosedError`, `NotReadyError`, `CallOrderError`."""


class ClosedError(StateError, ValueError):
    """The object (a stream, module, exec, executor, buffer) was closed; make a new one.
    A ``ValueError``, as Python's own "I/O operation on closed file" is."""


class BuilderClosedError(ClosedError):
    """A `GraphBuilder` (or a buffer it allocates) used after the builder closed: its graph is
    built and can take no more nodes; start a new builder."""


class NotReadyError(StateError, ValueError):
    """The call needs something done first (e.g. ``GraphRunner.run()`` before ``.exec``)."""


class CallOrderError(StateError, RuntimeError):
    """Calls came in an order the object cannot follow (``before()`` twice, ``finish()``
    without ``begin()``, a traced run while another is pending)."""


class ScheduleError(OrchestraError, ValueError):
    """`orchestra.schedule.schedule` (or a cost model) was given an argument it cannot use:
    an unknown policy, a stream count that is not an int >= 1, a negative cost."""


class ScheduleArgumentTypeError(ScheduleError, TypeError):
    """`schedule()` or `verify()` given an object of the wrong type where a `TaskGraph` or a
    `Plan` belongs (for example the two arguments of ``verify(plan, graph)`` swapped)."""


class PlanError(OrchestraError, ValueError):
    """A `Plan`, `StreamSpec` or `PlanBuilder` is malformed: duplicate or unknown stream names,
    a step that is not a step, an unknown role, waits that form a cycle."""


class PlanFormatError(PlanError):
    """A plan's JSON (`Plan.from_json` / `Plan.from_dict`) is malformed; ``path`` says where,
    e.g. ``streams[1].steps[0]``, and the message what is missing or wrong."""

    def __init__(self, message: str, path: str = ""):
        self.path = path
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (self.args[0], self.path))


class NodeFieldError(GraphError):
    """A field of a graph record (a node, a buffer, a range, a `KernelRef`) has the wrong type or
    value; the message names the record, the field and what it must be. Root of
    `NodeFieldTypeError` and `NodeFieldValueError`."""


class NodeFieldTypeError(NodeFieldError, TypeError):
    """A graph record's field has the wrong Python type (``grid=1.0``, ``after=3``)."""


class NodeFieldValueError(NodeFieldError, ValueError):
    """A graph record's field has the right type but a value it cannot take (``grid=0``)."""


class NameCollisionError(GraphError, ValueError):
    """A node or buffer name that is already taken in the graph, or one that `GraphBuilder`
    keeps for the names it generates (any name containing ``#``); the message names both
    holders and says how to pick another name."""


class BufferLifetimeError(GraphError, ValueError):
    """`GraphBuilder`: a buffer whose allocation the builder owns was given its own `Alloc` /
    `Free`, or a buffer one builder allocates was used by another builder's graph (its memory
    exists only inside the first graph's runs)."""


class HostBufferUseError(GraphError, ValueError):
    """`GraphBuilder`: a host buffer used against its declared role: a host input written by a
    node or read by none, a host output that no node writes, or host bytes written twice with no
    node reading them in between (the first write is lost)."""


class KernelArgumentError(OrchestraError):
    """A kernel argument does not fit the kernel's declared parameters (count, type, range).
    Root of the four below; raised before anything is launched."""


class KernelArgumentTypeError(KernelArgumentError, TypeError):
    """A kernel argument of the wrong kind: a float for an ``int``, a buffer for a scalar,
    a numpy scalar of another dtype, the wrong number of arguments."""


class KernelArgumentValueError(KernelArgumentError, ValueError):
    """A kernel argument of the right kind whose value the parameter cannot hold exactly."""


class UnknownParameterError(KernelArgumentError, NotFoundError):
    """A kernel parameter asked for by a name the kernel does not declare (a ``KeyError``)."""


class ParameterIndexError(KernelArgumentError, IndexError):
    """A kernel parameter asked for by an index outside the kernel's parameter list."""


class ParamDeclarationError(OrchestraError):
    """A kernel's parameter declarations (``params=``, or what was parsed from the source) are
    unusable or disagree with the loaded image. Root of the two below."""


class ParamDeclarationTypeError(ParamDeclarationError, TypeError):
    """A ``params=`` entry that is neither a C declaration string nor a `Param`."""


class ParamDeclarationValueError(ParamDeclarationError, ValueError):
    """A parameter declaration orchestra cannot use (empty, unsupported type, duplicate name,
    no ``__global__`` declaration found, sizes that disagree with the cubin)."""


class LaunchConfigError(OrchestraError):
    """A launch configuration (grid, block, shared memory, cluster, cooperative, PDL, priority,
    launch attributes) is malformed or exceeds the device's or the kernel's limits; checked
    before the launch. Root of the two below."""


class LaunchConfigTypeError(LaunchConfigError, TypeError):
    """A launch dimension, shared-memory size or priority of the wrong Python type."""


class LaunchConfigValueError(LaunchConfigError, ValueError):
    """A launch configuration value out of range or above a device / kernel limit."""


class DriverArgumentError(OrchestraError):
    """An argument to an `orchestra.driver` object (device ordinal, stream, event, memory pool,
    device or pinned buffer, host registration, host <-> device copy) is unusable.
    Root of the two below."""


class DriverArgumentTypeError(DriverArgumentError, TypeError):
    """A driver-object argument of the wrong type (not a Stream, not a numpy array, ...)."""


class DriverArgumentValueError(DriverArgumentError, ValueError):
    """A driver-object argument of the right type with an unusable value (a size of 0, the
    legacy default stream, a priority outside the device's range, mismatched sizes)."""


class PageableMemoryError(DriverArgumentTypeError):
    """A host array is in pageable memory where orchestra copies asynchronously and so needs
    page-locked memory; the message says how to pin it. Nothing was enqueued."""



class InteropError(OrchestraError):
    """An object handed to orchestra through DLPack (``__dlpack__``), the CUDA Array Interface
    (``__cuda_array_interface__``) or ``__cuda_stream__`` cannot be used as asked, or an orchestra
    buffer cannot be exported as a consumer asked. Root of the four below; raised before anything
    is enqueued."""


class InteropTypeError(InteropError, TypeError):
    """An object that speaks no protocol orchestra reads, or of an unsupported or mismatched dtype
    (a structured or vector dtype, ``float32`` where ``int32`` is needed)."""


class InteropValueError(InteropError, ValueError):
    """A protocol object with the wrong device, a strided layout, too few bytes, read-only memory
    where a writer needs it, host memory where device memory is needed, or a malformed protocol
    description (an unknown version, stream 0)."""


class ArgumentNeedsStreamError(KernelArgumentTypeError):
    """A DLPack / CUDA Array Interface object was given to `Kernel.pack` or `PackedArgs.set`, which
    have no stream to order its producer's work against; pass it to `Kernel.launch` (which orders
    it on the launch stream) or pass ``device_view(obj, stream=...)``."""


class ExportError(InteropError, BufferError):
    """`DeviceBuffer` / `BufferView` cannot export as the consumer asked (``dl_device`` of another
    device, ``copy=True``, DLPack stream 0, a dtype the protocol cannot describe). A
    ``BufferError``, as the DLPack protocol asks producers to raise."""

class CompilerArgumentError(OrchestraError):
    """An argument to the compiler (`compile`, `link_ptx`, `Module.load`, ``arch=``, options,
    name expressions, a kernel source) is unusable. Root of the three below (and
    `UnsupportedArchError`, a `CompilerArgumentValueError`)."""


class CompilerArgumentTypeError(CompilerArgumentError, TypeError):
    """A compiler argument of the wrong type (options that are not strings, an image that is
    neither bytes, text nor a `CompileResult`)."""


class CompilerArgumentValueError(CompilerArgumentError, ValueError):
    """A compiler argument with an unusable value (an unknown architecture, an option that sets
    the architecture, an empty name expression, text that is not PTX)."""


class UnsupportedArchError(CompilerArgumentValueError):
    """The compiler in use (NVRTC, or nvJitLink for PTX) cannot target this architecture: too
    old for it (``sm_35`` with NVRTC 13) or too new. Attributes: ``arch`` (``"sm_35"``),
    ``supported`` (the real architectures it offers, ``("sm_75", ...)``, from
    ``nvrtcGetSupportedArchs``), ``compiler`` (``"NVRTC 13.0"``). The message lists them."""

    def __init__(self, arch: str, supported=(), compiler: str = "NVRTC", detail: str = ""):
        self.arch = arch
        self.supported = tuple(supported)
        self.compiler = compiler
        self.detail = detail
        listed = ", ".join(self.supported) or "none"
        super().__init__(
            f"{compiler} cannot compile for {arch}{f' ({detail})' if detail else ''}: it"
            f" supports {listed} (nvrtcGetSupportedArchs); pass one of those, or use a CUDA"
            f" toolkit whose NVRTC supports {arch}")

    def __reduce__(self):
        return (type(self), (self.arch, self.supported, self.compiler, self.detail))


class KernelSourceNotFoundError(CompilerArgumentError, FileNotFoundError):
    """A kernel source path that exists nowhere orchestra looked (a ``FileNotFoundError``)."""


class TraceError(OrchestraError):
    """A timeline, span or trace recorder was given something it cannot use.
    Root of the two below (lookups raise `NotFoundError`, call order `CallOrderError`)."""


class TraceTypeError(TraceError, TypeError):
    """A trace argument of the wrong type (not a Timeline, a span that is not a NodeSpan)."""


class TraceValueError(TraceError, ValueError):
    """A trace value that cannot be (a span ending before it starts, a non-finite time)."""


class MissingExtraError(OrchestraError, ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` extra."""


class JobConfigError(OrchestraError, ValueError):
    """The main job (`orchestra run` / `orchestra plan`) was configured with values it cannot
    run: batch sizes, counts, iterations, target times."""


class JobConfigTypeError(JobConfigError, TypeError):
    """A `MainJob` / `choose_policy` count or size of the wrong type (a string, a bool, a
    float that is not a whole number)."""


class JobInputError(JobConfigError):
    """An ``orchestra run --input`` file is not a usable array (not .npy, wrong dtype, empty)."""


class BenchConfigError(OrchestraError, ValueError):
    """An `orchestra bench` workload was given sizes or counts it cannot run."""


class StoppedBySignal(OrchestraError):
    """A run stopped by a signal before it finished: SIGTERM to `orchestra bench serve
    --processes`, whose worker processes are stopped with it. ``signum``: the signal's
    number; the command exits with 128 + it (143 for SIGTERM), as a shell reports a process
    the signal ended."""

    def __init__(self, message: str, signum: int = 15):
        super().__init__(message)
        self.signum = int(signum)

    def __reduce__(self):
        return (type(self), (str(self), self.signum))


class UnsupportedDeviceError(OrchestraError, RuntimeError):
    """The device cannot run what was asked (too old a compute capability, a kernel that does
    not fit on an SM with the shared memory asked for)."""


class PrebuiltCubinError(OrchestraError, RuntimeError):
    """A prebuilt cubin directory is incomplete or was built from another source or for another
    architecture; the message says how to rebuild it."""


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in the number it takes: ``counted(1, "batch")`` is ``"1 batch"``,
    ``counted(3, "batch")`` ``"3 batches"`` (``s``, or ``es`` after s/x/z/ch/sh; ``plural``
    for any other form: ``counted(2, "entry", "entries")``). For printouts and messages
    that count things, so none says "1 batches"."""
    if n == 1:
        return f"1 {noun}"
    if plural is None:
        plural = noun + ("es" if noun.endswith(("s", "x", "z", "ch", "sh")) else "s")
    return f"{n} {plural}"


def int_text(v: int) -> str:
    """``v`` in decimal, or for a huge int (over 40 digits) its magnitude and bit length
    (``1.000e+400 (a 1329-bit int)``): ``str()`` of an int over 4300 digits raises, and a
    message of hundreds of digits helps nobody. For messages about a value a user gave."""
    v = int(v)
    if -10 ** 40 < v < 10 ** 40:
        return str(v)
    lg = math.log10(abs(v))  # exact enough for four significant digits at any size
    exp = math.floor(lg)
    mantissa = 10 ** (lg - exp)
    if mantissa >= 9.9995:  # would print as 10.000
        mantissa, exp = 1.0, exp + 1
    return f"{'-' if v < 0 else ''}{mantissa:.3f}e+{exp} (a {abs(v).bit_length()}-bit int)"


def prefixed(exc: Exception, prefix: str, type_error: type, value_error: type) -> Exception:
    """A copy of ``exc`` whose message starts with ``prefix`` (e.g. ``"kernel node k: "``).

    An orchestra error keeps its class (the plain-message ones above); a builtin ``TypeError``
    or ``ValueError`` from deeper code (ctypes, numpy) becomes ``type_error`` / ``value_error``,
    so what reaches the caller is always in the family. Raise it ``from exc``.
    """
    text = f"{prefix}{exc}"
    if isinstance(exc, OrchestraError):
        return type(exc)(text)
    return (type_error if isinstance(exc, TypeError) else value_error)(text)

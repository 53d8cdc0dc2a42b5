"""The exit codes of every `orchestra` command, and which failure gives which.

A script can tell the failures apart without reading the message:

====  ==================================================================================
0     success
1     a check failed: the output did not verify, ``--check-goal`` (``bench stages``,
      ``bench pdl``, ``bench multigpu``) missed its goal, the plan has a hazard,
      ``compile --strict`` built no kernel
2     usage: a bad option, argument or input file (argparse's own code)
3     no usable GPU: no NVIDIA driver or CUDA device, or a driver too old for CUDA 13
4     compile error: NVRTC or nvJitLink refused a program
5     CUDA error: a driver call failed while running, or another runtime failure
70    internal error: a bug in orchestra (the traceback is printed; please report it)
74    the output could not be written to stdout (a full disk, ``> /dev/full``, an I/O error)
130   interrupted (Ctrl-C)
141   the output pipe was closed (``orchestra plan --json | head -1``)
143   stopped by SIGTERM (``bench serve --processes``: its worker processes stopped too)
====  ==================================================================================

`exit_code(exc)` maps an exception to its code; `UsageError` is what a command raises for an
option it refuses after parsing (the message says what to change).
"""

from __future__ import annotations

from typing import Any

from orchestra.errors import (
    CompileError, CudaError, HazardError, MissingExtraError, NoDeviceError, OrchestraError,
    StoppedBySignal, UnsupportedDeviceError,
)

OK = 0
CHECK_FAILED = 1
USAGE = 2
NO_DEVICE = 3
COMPILE_ERROR = 4
CUDA_ERROR = 5
INTERNAL_ERROR = 70  # sysexits.h EX_SOFTWARE
OUTPUT_ERROR = 74    # sysexits.h EX_IOERR: stdout could not be written
INTERRUPTED = 130    # 128 + SIGINT, what a shell reports for Ctrl-C
PIPE_CLOSED = 141    # 128 + SIGPIPE
TERMINATED = 143     # 128 + SIGTERM

#: The epilog of ``orchestra --help`` (and docs/cli.md's table).
EPILOG = """\
exit codes:
  0    success
  1    a check failed (output not verified, a hazard in the plan, compile --strict
       built no kernel, bench stages|pdl|multigpu --check-goal missed its goal)
  2    usage: a bad option, argument or input file
  3    no usable GPU: no NVIDIA driver or CUDA device, or a driver older than CUDA 13
  4    compile error: NVRTC or nvJitLink refused a program
  5    CUDA error: a driver call failed while running, or another runtime failure
  70   internal error (a bug: the traceback is printed)
  74   the output could not be written to stdout (a full disk, an I/O error)
  130  interrupted (Ctrl-C)
  141  the output pipe was closed
  143  stopped by SIGTERM (bench serve --processes stops its workers first)

Every command takes --json (errors too: {"error": {"type": ..., "message": ...}} on
stdout), -v (debug log on stderr) and -q (errors only, no progress bars), anywhere on the line."""


class UsageError(OrchestraError, ValueError):
    """An option or argument a command refuses; exit code 2.

    The message says what to change (``--output needs --input ...``). ``parser``: the
    argparse parser whose usage goes with it (set for parse errors, else None).
    """

    def __init__(self, message: str, parser: Any = None):
        super().__init__(message)
        self.parser = parser

    def __reduce__(self):
        return (type(self), (str(self),))


# Bad input from the caller (an option, a file, an argument): one line that says what to change.
_INPUT_ERRORS = (ValueError, TypeError, KeyError, OverflowError, OSError)


def exit_code(exc: BaseException) -> int:
    """The exit code for ``exc`` (see the module doc): the most specific class wins."""
    if isinstance(exc, StoppedBySignal):
        return 128 + exc.signum  # what a shell reports for a process the signal ended
    if isinstance(exc, (NoDeviceError, UnsupportedDeviceError)):
        return NO_DEVICE  # also a driver too old or without an entry point (subclasses)
    if isinstance(exc, CompileError):
        return COMPILE_ERROR
    if isinstance(exc, CudaError):
        return CUDA_ERROR
    if isinstance(exc, HazardError):
        return CHECK_FAILED
    if isinstance(exc, (*_INPUT_ERRORS, MissingExtraError)):  # an extra to install is usage too
        return USAGE  # UsageError, and OrchestraErrors that are also ValueError / TypeError
    if isinstance(exc, OrchestraError):
        return CUDA_ERROR
    return INTERNAL_ERROR


__all__ = ["CHECK_FAILED", "COMPILE_ERROR", "CUDA_ERROR", "EPILOG", "INTERNAL_ERROR",
           "INTERRUPTED", "NO_DEVICE", "OK", "OUTPUT_ERROR", "PIPE_CLOSED", "TERMINATED", "USAGE", "UsageError", "exit_code"]

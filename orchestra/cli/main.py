"""Entry point of the `orchestra` console script and of ``python -m orchestra``.

Each subcommand lives in its own module with a `register(subparsers)` function that adds its
parser and sets ``func(args) -> int`` (the exit code). What every command shares lives here:

* ``--json``, ``-v`` / ``--verbose`` and ``-q`` / ``--quiet`` on every command, accepted
  anywhere on the line (before or after the subcommand);
* a usage error shows the usage of the (sub)command it belongs to (``orchestra plan --bogus``
  prints ``plan``'s usage);
* every failure becomes one line on stderr (or, under ``--json``, one
  ``{"error": {"type": ..., "message": ...}}`` object on stdout) and a documented exit code
  (`orchestra.cli.exit_codes`), never a traceback, except for an internal error (a bug);
* a closed output pipe exits quietly with 141, Ctrl-C with 130, a stdout that cannot be
  written (a full disk, ``> /dev/full``) with one line on stderr and 74;
* logging (`orchestra.cli.logs`) and progress bars (`orchestra.cli.progress`) are set up from
  the options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from orchestra.cli import logs, progress
from orchestra.cli.exit_codes import (
    EPILOG, INTERNAL_ERROR, INTERRUPTED, OUTPUT_ERROR, PIPE_CLOSED, USAGE, UsageError, exit_code,
)
from orchestra.errors import CompileError, CudaError, HazardError, NoDeviceError, OrchestraError

log = logging.getLogger(__name__)

# Subcommand modules, in the order `orchestra --help` lists them.
_COMMANDS = ("devices", "compile_cmd", "cache_cmd", "plan_cmd", "run_cmd", "bench", "tune_cmd")


class ArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors `main` reports (text or JSON) instead
    of exiting from inside argparse: a `UsageError` whose ``parser`` is the (sub)command's."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, parser=self)


def version_text() -> str:
    """``orchestra 0.1.0 (Python 3.12.3, cuda-bindings 13.3.1)``: what ``--version`` prints."""
    from importlib import metadata

    from orchestra import __version__

    try:
        bindings = f"cuda-bindings {metadata.version('cuda-bindings')}"
    except metadata.PackageNotFoundError:
        bindings = "cuda-bindings not installed"
    return f"orchestra {__version__} (Python {platform.python_version()}, {bindings})"


def version_info() -> dict[str, str | None]:
    """What ``orchestra --version --json`` prints: ``{"orchestra": ..., "python": ...,
    "cuda_bindings": ...}`` (``cuda_bindings`` None when it is not installed)."""
    from importlib import metadata

    from orchestra import __version__

    try:
        bindings: str | None = metadata.version("cuda-bindings")
    except metadata.PackageNotFoundError:
        bindings = None
    return {"orchestra": __version__, "python": platform.python_version(),
            "cuda_bindings": bindings}


class _VersionAction(argparse.Action):
    """``--version``: print `version_text`, or `version_info` as JSON when ``--json`` is
    anywhere on the line (`main` sets the parser's ``version_json``), and exit 0 as argparse's
    own version action does."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        as_json = getattr(parser, "version_json", False)
        print(json.dumps(version_info()) if as_json else version_text())
        sys.stdout.flush()
        parser.exit(0)


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parsers directly below ``parser`` (each once, aliases or not)."""
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if id(child) not in seen:
                    seen.add(id(child))
                    yield child


def _add_common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """-v / -q / --json on every parser, so each works before or after the subcommand.

    Below the top level their defaults are SUPPRESS, so a subcommand that was not given ``-v``
    (or ``--json``) keeps the top level's value instead of resetting it."""
    own = parser._option_string_actions
    if "-v" not in own:
        parser.add_argument("-v", "--verbose", action="count",
                            default=0 if top else argparse.SUPPRESS,
                            help="log debug output to stderr (cache hits and misses, plan "
                                 "sizes, driver calls per run); show tracebacks of errors")
    if "-q" not in own:
        parser.add_argument("-q", "--quiet", action="store_true",
                            default=False if top else argparse.SUPPRESS,
                            help="print errors only: no warnings, no progress bars")
    if "--json" in own and not top:
        # a command's own --json (its help names what it prints) must not reset the top
        # level's: `orchestra --json devices`
        own["--json"].default = argparse.SUPPRESS
    elif "--json" not in own:
        parser.add_argument("--json", action="store_true",
                            default=False if top else argparse.SUPPRESS,
                            help="print the result as JSON on stdout (errors too)")


def _decorate(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    children = list(_subparsers(parser))
    leaf = not children
    _add_common(parser, top=top)
    if leaf:
        parser.set_defaults(_parser=parser)
    for child in children:
        _decorate(child)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand registered and decorated with the shared
    options (``--json``, ``-v``, ``-q``)."""
    parser = ArgumentParser(
        prog="orchestra",
        description="Orchestrate CUDA work at the driver-API level: task graphs, streams, "
                    "events and CUDA Graphs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="show orchestra's, Python's and cuda-bindings' versions and exit "
                             "(with --json: a JSON object)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"orchestra.cli.{name}").register(sub)
    _decorate(parser, top=True)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; an unknown option is reported by the subcommand it was given to."""
    args, extra = parser.parse_known_args(list(argv))
    if extra:
        getattr(args, "_parser", parser).error("unrecognized arguments: " + " ".join(extra))
    return args


# -- reporting ------------------------------------------------------------------------------------

def _details(exc: BaseException) -> dict[str, Any]:
    """Fields of the JSON error object beyond type and message, for the errors that have them."""
    if isinstance(exc, CudaError):
        return {"call": exc.call, "result": exc.name, "result_code": exc.code,
                "sticky": exc.sticky}
    if isinstance(exc, CompileError):
        return {"log": exc.log, "options": list(exc.options), "call": exc.call}
    if isinstance(exc, HazardError):
        return {"findings": [str(f) for f in exc.findings]}
    return {}


def _print_json_error(type_name: str, message: str, code: int, **details: Any) -> None:
    error = {"type": type_name, "message": message, "exit_code": code, **details}
    print(json.dumps({"error": error}, indent=1))


def _usage_failure(err: UsageError, parser: argparse.ArgumentParser, as_json: bool) -> int:
    parser = err.parser or parser
    if as_json:
        _print_json_error("UsageError", str(err), USAGE, usage=parser.format_usage().strip())
    else:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
    return USAGE


def _failure(exc: Exception, prog: str, args: argparse.Namespace | None, as_json: bool) -> int:
    if isinstance(exc, RuntimeError) and not isinstance(exc, OrchestraError):
        # cuda-bindings' own failures outside orchestra's checked calls (a driver without an
        # entry point, a driver library that does not load): a no-GPU error, one line
        from orchestra.driver.check import binding_failure

        exc = binding_failure("a driver call", exc) or exc
    code = exit_code(exc)
    message = str(exc)
    if isinstance(exc, NoDeviceError):
        message += getattr(args, "no_device_hint", "")
    if code == INTERNAL_ERROR:
        message = f"internal error ({type(exc).__name__}: {exc}); please report it with the traceback"
    verbose = bool(getattr(args, "verbose", 0))
    if code == INTERNAL_ERROR or verbose:
        traceback.print_exception(exc, file=sys.stderr)
    if as_json:
        _print_json_error(type(exc).__name__, message, code, **_details(exc))
    else:
        print(f"{prog}: {message}", file=sys.stderr)
    return code


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the flush at exit cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's captured one)
        pass


def _pipe_closed() -> int:
    """The reader went away (``| head``): exit 141 without a word."""
    _discard_stdout()
    return PIPE_CLOSED


class _WatchedStdout:
    """sys.stdout while a command runs: the same stream, except that an `OSError` from
    writing or flushing it is remembered (``failed``), so `main` can tell stdout failing
    (a full disk, ``> /dev/full``) from a command's own `OSError` (an input file)."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.failed: OSError | None = None

    def _watch(self, fn: Any, *a: Any) -> Any:
        try:
            return fn(*a)
        except BrokenPipeError:
            raise  # a closed pipe is 141, handled apart
        except OSError as exc:
            self.failed = exc
            raise

    def write(self, text: str) -> int:
        return self._watch(self._stream.write, text)

    def writelines(self, lines: Any) -> None:
        self._watch(self._stream.writelines, lines)

    def flush(self) -> None:
        self._watch(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _stdout_failure(exc: OSError, prog: str) -> int:
    """One line on stderr (stdout is what failed, so not even --json's error object goes
    there) and exit `OUTPUT_ERROR`, never a traceback."""
    _discard_stdout()
    reason = exc.strerror or str(exc)
    try:
        print(f"{prog}: could not write the output to stdout: {reason} (errno {exc.errno})",
              file=sys.stderr)
    except OSError:
        pass
    return OUTPUT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``orchestra`` command line (``argv`` without the program name; default
    ``sys.argv[1:]``) and return its exit code (`orchestra.cli.exit_codes`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv  # known before parsing: a usage error under --json is JSON too
    prog, args = "orchestra", None
    watched: _WatchedStdout | None = None
    try:
        parser = build_parser()
        parser.version_json = as_json  # type: ignore[attr-defined]
        try:
            args = parse_args(parser, argv)
        except UsageError as err:
            return _usage_failure(err, parser, as_json)
        prog = args._parser.prog
        as_json = bool(getattr(args, "json", False))
        logs.configure(args.verbose, args.quiet, prog)
        progress.configure(progress.wanted(json=as_json, quiet=args.quiet))
        log.debug("%s; %s", " ".join(["orchestra", *argv]), version_text())
        watched = _WatchedStdout(sys.stdout)
        sys.stdout = watched
        try:
            code = int(args.func(args) or 0)
        except (KeyboardInterrupt, BrokenPipeError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure gets its exit code
            if watched.failed is not None:
                return _stdout_failure(watched.failed, prog)
            code = _failure(exc, prog, args, as_json)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return code
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        return _pipe_closed()
    except OSError:  # printing an error object, or the flush above
        if watched is not None and watched.failed is not None:
            return _stdout_failure(watched.failed, prog)
        raise
    finally:
        if watched is not None and sys.stdout is watched:
            sys.stdout = watched._stream
        progress.configure(False)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

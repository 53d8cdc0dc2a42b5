"""Entry point of the `orchestra` console script.

Each subcommand lives in its own module with a `register(subparsers)` function that adds its
parser and sets `func(args) -> int` (the exit code). `NoDeviceError` anywhere becomes one line on
stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from orchestra.errors import NoDeviceError, OrchestraError

# Subcommand modules, in the order `orchestra --help` lists them.
_COMMANDS = ("devices", "compile_cmd", "cache_cmd", "plan_cmd", "run_cmd", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestra",
        description="Orchestrate CUDA work at the driver-API level: streams, events, CUDA Graphs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"orchestra.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except NoDeviceError as exc:
        hint = getattr(args, "no_device_hint", "")
        print(f"orchestra: {exc}{hint}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, KeyError, OverflowError, OSError) as exc:
        # Bad input (an option, a file, an argument): one line that says what to change.
        # orchestra's own usage errors keep these builtins as second bases, so they land here.
        if args.verbose:
            raise
        print(f"orchestra {args.command}: {exc}", file=sys.stderr)
        return 2
    except OrchestraError as exc:
        print(f"orchestra: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        # cuda-bindings' own failures outside orchestra's checked calls (a driver without an
        # entry point): one line and exit 2, like NoDeviceError.
        from orchestra.driver.check import binding_failure

        err = binding_failure("a driver call", exc)
        if err is None:
            raise
        print(f"orchestra: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

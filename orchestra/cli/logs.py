"""Logging for the command line: standard `logging`, one handler on the ``orchestra`` logger.

Library modules log through ``logging.getLogger(__name__)`` and never configure anything; the
CLI adds one handler that writes to the current ``sys.stderr`` (looked up at each record, so a
test's captured stderr sees it too):

* default: warnings and errors (``orchestra plan: warning: --batches does not apply ...``);
* ``-v``: also debug records, with the module that logged them (cache hits and misses, plan
  sizes, driver calls per run);
* ``-q``: errors only.
"""

from __future__ import annotations

import logging
import sys

_LOGGER = "orchestra"


class _CurrentStderr(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # not setStream: that flushes the old one, maybe closed
        super().emit(record)


class _Formatter(logging.Formatter):
    """``<prog>: warning: message``; debug records also name their module."""

    def __init__(self, prog: str) -> None:
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        level = record.levelname.lower()
        if record.levelno >= logging.WARNING:
            return f"{self.prog}: {level}: {text}"
        name = record.name.removeprefix(_LOGGER + ".")
        return f"{self.prog}: {level}: [{name}] {text}"


def configure(verbose: int = 0, quiet: bool = False, prog: str = "orchestra") -> logging.Logger:
    """Set the ``orchestra`` logger's level and (re)place the CLI's stderr handler.

    ``verbose`` >= 1: DEBUG; ``quiet``: ERROR; else WARNING. ``prog`` prefixes each line
    (``orchestra plan``). Returns the ``orchestra`` logger. Idempotent: calling it again (each
    `main()` call does) replaces the handler instead of adding a second one.
    """
    logger = logging.getLogger(_LOGGER)
    for h in list(logger.handlers):
        if isinstance(h, _CurrentStderr):
            logger.removeHandler(h)
    handler = _CurrentStderr()
    handler.setFormatter(_Formatter(prog))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.ERROR if quiet else logging.WARNING)
    return logger


__all__ = ["configure"]

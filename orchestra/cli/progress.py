"""Progress bars for long work (`orchestra plan`, `run`, `bench`), on a terminal only.

A bar (or, where the amount of work is not known, a spinner with the elapsed time) is drawn on
stderr when all of these hold: stderr is a terminal, the command was given neither ``--json``
nor ``-q``, and `rich` is installed (``pip install "orchestra[progress]"``). Otherwise every
function here does nothing, so piped or JSON output never carries a bar. Bars are transient:
they are erased when their work ends, and the command's own output follows.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_state = {"enabled": False}

#: `task` yields one of these: ``update(done=None, *, total=None, description=None)``.
Update = Callable[..., None]


def wanted(*, json: bool = False, quiet: bool = False) -> bool:
    """Whether bars would be drawn for a command with these options, here and now."""
    if json or quiet:
        return False
    try:
        if not sys.stderr.isatty():
            return False
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
    return importlib.util.find_spec("rich") is not None


def configure(enabled: bool) -> None:
    """Turn bars on or off for this process (the CLI calls it once per command)."""
    _state["enabled"] = bool(enabled)


def enabled() -> bool:
    return _state["enabled"]


def _noop(done: Any = None, *, total: Any = None, description: Any = None) -> None:
    return None


@contextmanager
def task(description: str, total: int | None = None) -> Iterator[Update]:
    """Show ``description`` with a bar of ``total`` steps (a spinner when None) while the block
    runs; yields ``update(done, total=..., description=...)`` to move it."""
    if not _state["enabled"]:
        yield _noop
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
    )

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        tid = bar.add_task(description, total=total)

        def update(done: int | None = None, *, total: int | None = None,
                   description: str | None = None) -> None:
            fields: dict[str, Any] = {}
            if done is not None:
                fields["completed"] = done
            if total is not None:
                fields["total"] = total
            if description is not None:
                fields["description"] = description
            bar.update(tid, **fields)

        yield update


def reporter(update: Update, what: str) -> Callable[[str, int, int], None]:
    """A ``progress(stage, done, total)`` callback for library code that reports its steps
    (`MainJob(progress=...)`, the benchmarks), drawing into the bar ``update`` belongs to."""

    def report(stage: str, done: int, total: int) -> None:
        update(done, total=total, description=f"{what}: {stage}")

    return report


__all__ = ["configure", "enabled", "reporter", "task", "wanted"]

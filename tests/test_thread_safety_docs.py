"""Every public class of orchestra says in its docstring what may be shared between threads.

A public class is a class named in some orchestra module's ``__all__``, defined in orchestra,
and not an exception. Its docstring must hold a paragraph that starts ``Thread-safety:`` (what
may be shared between threads and what may not, and why) or, for a frozen record, a sentence
that starts ``Immutable`` ("Immutable: may be shared between threads freely."). The test
imports every module of the package, so a new module or a new public class is checked without
being listed here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import orchestra


def states_thread_safety(doc: str | None) -> bool:
    """True when ``doc`` has a paragraph (text after a blank line, or the first one) that
    starts with ``Thread-safety:``, or a sentence that starts with ``Immutable`` (a frozen
    record says so where it describes itself: "... ``row_nbytes``: bytes per row. Immutable:
    may be shared between threads freely.")."""
    if not doc:
        return False
    text = inspect.cleandoc(doc)
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    if any(p.startswith("Thread-safety:") for p in paragraphs):
        return True
    return any(p.startswith("Immutable") or ". Immutable" in p for p in paragraphs)


def public_classes() -> dict[str, type]:
    """``module.Class`` -> class for every non-exception class some orchestra module exports."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(orchestra.__path__, "orchestra."):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if (inspect.isclass(obj) and obj.__module__.startswith("orchestra")
                    and not issubclass(obj, BaseException)):
                found.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
    return found


def test_the_walk_finds_the_public_classes():
    classes = public_classes()
    # a walk that imported nothing would pass the check below vacuously
    assert len(classes) > 150
    for name in ("orchestra.serve.engine.Engine", "orchestra.graph.taskgraph.TaskGraph",
                 "orchestra.execute.cuda_graph.exec.GraphExec", "orchestra.driver.stream.Stream"):
        assert name in classes


def test_every_public_class_states_its_thread_safety():
    missing = sorted(name for name, cls in public_classes().items()
                     if not states_thread_safety(cls.__doc__))
    assert not missing, (
        f"{len(missing)} public classes do not say what may be shared between threads; add a "
        "paragraph starting 'Thread-safety:' (or 'Immutable: may be shared between threads "
        "freely.' for a frozen record) to the docstring of: " + ", ".join(missing))


@pytest.mark.parametrize("doc, expected", [
    (None, False),
    ("A record.", False),
    ("A record.\n\n    Thread-safe.\n    ", False),  # says nothing of what may be shared
    ("Mentions Thread-safety: mid-paragraph only.", False),
    ("A record.\n\n    Immutable: may be shared between threads freely.\n    ", True),
    ("A pool.\n\n    Args:\n        n: size.\n\n    Thread-safety: one lock covers `get`.", True),
    ("Thread-safety: not thread-safe; use one per thread.", True),
    ("A spec: ``rows``: the row count. Immutable: may be shared between threads freely.", True),
    ("Holds mutable state (not Immutable at all).", False),
])
def test_the_check_tells_a_statement_from_none(doc, expected):
    assert states_thread_safety(doc) is expected

"""Records built without their checks, for builders that already guarantee every field.

The graph's records (buffers, ranges, accesses, nodes) check and convert each field when built,
so a wrong value raises an error naming the field (`orchestra.graph.fields`). A builder that
makes many records of one shape (`build_pipeline`: seven nodes per batch, 350,000 for a
50,000-batch plan) checks the shape once, through the public constructors, and then makes
the other records with `maker`: the fields set directly, as the checked constructor would have
left them (converted values, the node's cached ``accesses()`` and its ``device``), without
running converters, validators or ``__attrs_post_init__``. The records are the same objects in
every respect (equality, hashing, repr, pickling); `tests/test_trusted_batches.py` compares
them with checked ones field by field.

Never for values from outside the builder: the public constructors stay fully checked.
"""

from __future__ import annotations

import types
from collections import deque
from itertools import repeat
from typing import Any, Callable

import attrs

from orchestra.errors import NodeFieldTypeError


def _slot(cls: type, name: str):
    """The slot descriptor of field ``name`` of slotted attrs class ``cls``."""
    for klass in cls.__mro__:
        d = klass.__dict__.get(name)
        if d is not None:
            if not isinstance(d, types.MemberDescriptorType):
                raise NodeFieldTypeError(f"{cls.__name__}.{name} is not a slot field")
            return d
    raise NodeFieldTypeError(f"{cls.__name__} has no slot field {name!r}")


def _check_fields(cls: type, names: tuple[str, ...]) -> None:
    """`NodeFieldTypeError` unless ``names`` are every attrs field of ``cls``, once each."""
    fields = {f.name for f in attrs.fields(cls)}
    if len(names) != len(set(names)) or set(names) != fields:
        raise NodeFieldTypeError(f"maker({cls.__name__}): names {sorted(names)} are not its fields "
                        f"{sorted(fields)}")


def maker(cls: type, *names: str) -> Callable[..., Any]:
    """A function ``make(*values)`` -> an instance of attrs class ``cls`` whose field
    ``names[i]`` is ``values[i]``, set directly (no converters, validators or post-init).

    ``names`` must be every attrs field of ``cls`` (private ones by their attribute name,
    e.g. ``"_accesses"``), so a field added to the class later cannot be left unset silently:
    making the maker raises `NodeFieldTypeError` (a ``TypeError``) then. Thread-safe; the
    caller guarantees the values.
    """
    _check_fields(cls, names)
    # One straight-line function per maker (as attrs writes its own __init__): a loop over
    # the setters cost about twice as much per record.
    env = {"new": object.__new__, "cls": cls,
           **{f"set{i}": _slot(cls, n).__set__ for i, n in enumerate(names)}}
    args = ", ".join(f"v{i}" for i in range(len(names)))
    body = "".join(f"    set{i}(obj, v{i})\n" for i in range(len(names)))
    code = f"def make_{cls.__name__}({args}):\n    obj = new(cls)\n{body}    return obj\n"
    exec(compile(code, f"<trusted maker {cls.__qualname__}>", "exec"), env)
    return env[f"make_{cls.__name__}"]


def make_each(cls: type, name: str, values) -> list:
    """``[make(v) for v in values]`` for a one-field class (``name`` its only attrs field), with
    both loops in C (``object.__new__`` and the slot's setter mapped over the values): for the
    hundreds of thousands of plan steps of a long pipeline. Same contract as `maker`."""
    _check_fields(cls, (name,))
    values = values if isinstance(values, (list, tuple)) else list(values)
    objs: list = list(map(object.__new__, repeat(cls, len(values))))
    deque(map(_slot(cls, name).__set__, objs, values), 0)
    return objs


def make_columns(cls: type, names: tuple[str, ...], columns, count: int) -> list:
    """``count`` instances of attrs class ``cls``, instance ``i``'s field ``names[k]`` being
    ``columns[k][i]`` (a column is any iterable: a list, or ``itertools.repeat(value)`` for a
    value they all share): the records of many batches at once, each field set for all of
    them in one loop in C (``map`` over the slot's setter). Same contract as `maker`."""
    _check_fields(cls, names)
    objs: list = list(map(object.__new__, repeat(cls, count)))
    for name, column in zip(names, columns):
        deque(map(_slot(cls, name).__set__, objs, column), 0)
    return objs


def set_column(cls: type, name: str, objs: list, values) -> None:
    """Set field ``name`` of each of ``objs`` (instances of attrs class ``cls``) to the
    matching item of ``values``, in one loop in C (a field left unset by `make_columns`, e.g.
    a buffer's cached whole range, made after it)."""
    deque(map(_slot(cls, name).__set__, objs, values), 0)


__all__ = ["maker", "make_columns", "make_each", "set_column"]

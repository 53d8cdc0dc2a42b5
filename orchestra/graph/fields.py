"""Field checks shared by the graph records (nodes, buffers, ranges, `KernelRef`).

Each check raises `NodeFieldTypeError` (a ``TypeError``) for a value of the wrong Python type
and `NodeFieldValueError` (a ``ValueError``) for a value of the right type that the field cannot
take, always as ``<record>: <field> must be <what>, got <type> <value>``, e.g.
``KernelNode k: grid must be an int or a tuple of 1-3 ints, got float 1.0``.

attrs converters run before the record's name is known to a check, so the converters of the
records only normalize values they recognize and pass anything else through unchanged; the
record's ``__attrs_post_init__`` then calls these checks, which name the record.
"""

from __future__ import annotations

from orchestra.errors import NodeFieldTypeError, NodeFieldValueError, int_text

#: CUDA's sizes are ``size_t`` (64 bits): no buffer or range holds more bytes.
MAX_BYTES = 2**64 - 1
#: Device ordinals are C ints (``cuDeviceGet``).
MAX_DEVICE = 2**31 - 1


def got(value) -> str:
    """``"float 1.0"``: the type and the value, as the messages show them (a huge int by its
    magnitude, never its thousands of digits)."""
    if type(value) is int:
        return f"int {int_text(value)}"
    return f"{type(value).__name__} {value!r}"


def _name(record) -> str:
    # Checks run for every record built (graphs of 100k nodes): the record's name is a callable
    # when building it costs something, and is only built for a message.
    return record() if callable(record) else record


def type_error(record, field: str, expected: str, value) -> NodeFieldTypeError:
    return NodeFieldTypeError(f"{_name(record)}: {field} must be {expected}, got {got(value)}")


def value_error(record, field: str, expected: str, value) -> NodeFieldValueError:
    return NodeFieldValueError(f"{_name(record)}: {field} must be {expected}, got {got(value)}")


def is_int(value) -> bool:
    """A Python or numpy integer, never a bool."""
    if type(value) is int:  # the common case first
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") \
        and value.dtype.kind in "iu" and getattr(value, "shape", None) == ()


def as_int(value):
    """Converter: a numpy integer -> the same Python int (sizes and offsets add up without
    numpy's fixed-width overflow, and go into JSON and driver calls as ints); anything else
    unchanged (the record's check names it)."""
    if type(value) is int or not is_int(value):
        return value
    return int(value)


def check_int(record, field: str, value, *, minimum: int | None = None,
              optional: bool = False, what: str | None = None,
              maximum: int | None = None, limit: str = "") -> None:
    """``value`` is an int (or None when ``optional``) and at least ``minimum`` (at most
    ``maximum``: above it, ``limit`` says why, e.g. "below 2**64 (CUDA sizes are 64-bit)");
    ``record`` is the record's name, or a callable giving it."""
    if value is None and optional:
        return
    if type(value) is int and (minimum is None or value >= minimum) and (
            maximum is None or value <= maximum):
        return
    if minimum is None:
        expected = what or ("an int or None" if optional else "an int")
    else:
        expected = what or f"an int >= {minimum}" + (" or None" if optional else "")
    if not is_int(value):
        raise type_error(record, field, expected, value)
    if minimum is not None and value < minimum:
        raise value_error(record, field, expected, value)
    if maximum is not None and value > maximum:
        raise value_error(record, field, f"{expected} {limit or f'<= {maximum}'}", value)


def check_name(record, field: str, value) -> None:
    """A non-empty ``str``."""
    if type(value) is str and value:
        return
    if not isinstance(value, str):
        raise type_error(record, field, "a non-empty str", value)
    if not value:
        raise value_error(record, field, "a non-empty str", value)


def str_tuple(value):
    """Converter: a str -> ``(str,)``; a list/tuple -> tuple; anything else unchanged (the
    record's check names it)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def check_str_tuple(record, field: str, value, *, item: str = "a str",
                    expected: str = "a str or a list/tuple of str") -> None:
    """A tuple of ``str`` (what `str_tuple` made of a str or a list/tuple of str); ``expected``
    describes the whole field, ``item`` one entry."""
    if value == ():
        return
    if not isinstance(value, tuple):
        raise type_error(record, field, expected, value)
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise type_error(record, f"{field}[{i}]", item, v)

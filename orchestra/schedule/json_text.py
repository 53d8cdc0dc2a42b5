"""``json.dumps(obj, indent=n, sort_keys=True)``, the same text, faster on long plans.

With an indent, the standard library encodes in pure Python one value at a time (its C encoder
only runs without one), which made a 350,000-node plan's JSON take seconds. This writes the same
text for the JSON types (dict, list, tuple, str, int, float, bool, None), joining lists of strings
(a plan's steps) in one go. Anything else raises the `TypeError` ``json.dumps`` raises, a
circular structure its `ValueError`.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _enc  # the C version when available

_INF = float("inf")


def _float(o: float) -> str:
    if o != o:
        return "NaN"
    if o == _INF:
        return "Infinity"
    if o == -_INF:
        return "-Infinity"
    return float.__repr__(o)


def _key(k) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, float):
        return _float(k)
    if k is True:
        return "true"
    if k is False:
        return "false"
    if k is None:
        return "null"
    if isinstance(k, int):
        return int.__repr__(k)
    raise TypeError(f"keys must be str, int, float, bool or None, not {k.__class__.__name__}")


def dumps(obj, indent: int = 1) -> str:
    """The text of ``json.dumps(obj, indent=indent, sort_keys=True)``."""
    out: list[str] = []
    _value(obj, out, " " * indent, 0, set())
    return "".join(out)


def _value(o, out, ind, level, seen):
    t = type(o)
    if t is str:
        out.append(_enc(o))
    elif o is None:
        out.append("null")
    elif o is True:
        out.append("true")
    elif o is False:
        out.append("false")
    elif t is int:
        out.append(int.__repr__(o))
    elif t is float:
        out.append(_float(o))
    elif t is list or t is tuple:
        _list(o, out, ind, level, seen)
    elif t is dict:
        _dict(o, out, ind, level, seen)
    elif isinstance(o, str):
        out.append(_enc(o))
    elif isinstance(o, int):  # bool is handled above
        out.append(int.__repr__(o))
    elif isinstance(o, float):
        out.append(_float(o))
    elif isinstance(o, (list, tuple)):
        _list(o, out, ind, level, seen)
    elif isinstance(o, dict):
        _dict(o, out, ind, level, seen)
    else:
        json.dumps(o)  # raises the standard library's TypeError for this object
        raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def _enter(o, seen):
    if id(o) in seen:
        raise ValueError("Circular reference detected")
    seen.add(id(o))


def _list(o, out, ind, level, seen):
    if not o:
        out.append("[]")
        return
    inner = "\n" + ind * (level + 1)
    close = "\n" + ind * level + "]"
    if all(type(x) is str for x in o):
        out.append("[" + inner + ("," + inner).join(map(_enc, o)) + close)
        return
    if all(type(x) is list and x and all(type(y) is str for y in x) for x in o):
        # a list of lists of strings (a plan's steps): each item's text in one join
        inner2 = "\n" + ind * (level + 2)
        close2 = "\n" + ind * (level + 1) + "]"
        sep2 = "," + inner2
        out.append("[" + inner + ("," + inner).join(
            "[" + inner2 + sep2.join(map(_enc, x)) + close2 for x in o) + close)
        return
    _enter(o, seen)
    out.append("[" + inner)
    first = True
    for x in o:
        if not first:
            out.append("," + inner)
        first = False
        _value(x, out, ind, level + 1, seen)
    out.append(close)
    seen.discard(id(o))


def _dict(o, out, ind, level, seen):
    if not o:
        out.append("{}")
        return
    inner = "\n" + ind * (level + 1)
    out.append("{" + inner)
    first = True
    for k, v in sorted(o.items()):
        if not first:
            out.append("," + inner)
        first = False
        out.append(_enc(_key(k)) + ": ")
        _value(v, out, ind, level + 1, seen)
    out.append("\n" + ind * level + "}")
    seen.discard(id(o))

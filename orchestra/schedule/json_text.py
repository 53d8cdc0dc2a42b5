"""``json.dumps(obj, indent=n, sort_keys=True)``, the same text, faster on long plans.

With an indent, the standard library encodes in pure Python one value at a time (its C encoder
only runs without one), which made a 350,000-node plan's JSON take seconds. This writes the same
text for the JSON types (dict, list, tuple, str, int, float, bool, None), joining lists of strings
(a plan's steps) in one go. Anything else (another type, a circular structure) is left to
``json.dumps`` itself: the same text, or the same error.
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


def _key(k) -> str | None:
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
    return None  # not a JSON key: json.dumps says so


def dumps(obj, indent: int = 1) -> str:
    """The text of ``json.dumps(obj, indent=indent, sort_keys=True)``."""
    out: list[str] = []
    if _value(obj, out, " " * indent, 0, set()):
        return "".join(out)
    return json.dumps(obj, indent=indent, sort_keys=True)  # the same text, or its error


# Each writer appends to ``out`` and returns False when it meets what it leaves to json.dumps.

def _value(o, out, ind, level, seen) -> bool:
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
        return _list(o, out, ind, level, seen)
    elif t is dict:
        return _dict(o, out, ind, level, seen)
    elif isinstance(o, str):
        out.append(_enc(o))
    elif isinstance(o, int):  # bool is handled above
        out.append(int.__repr__(o))
    elif isinstance(o, float):
        out.append(_float(o))
    elif isinstance(o, (list, tuple)):
        return _list(o, out, ind, level, seen)
    elif isinstance(o, dict):
        return _dict(o, out, ind, level, seen)
    else:
        return False
    return True


def _list(o, out, ind, level, seen) -> bool:
    if not o:
        out.append("[]")
        return True
    inner = "\n" + ind * (level + 1)
    close = "\n" + ind * level + "]"
    if all(type(x) is str for x in o):
        out.append("[" + inner + ("," + inner).join(map(_enc, o)) + close)
        return True
    if all(type(x) is list and x and all(type(y) is str for y in x) for x in o):
        # a list of lists of strings (a plan's steps): each item's text in one join
        inner2 = "\n" + ind * (level + 2)
        close2 = "\n" + ind * (level + 1) + "]"
        sep2 = "," + inner2
        out.append("[" + inner + ("," + inner).join(
            "[" + inner2 + sep2.join(map(_enc, x)) + close2 for x in o) + close)
        return True
    if id(o) in seen:  # circular
        return False
    seen.add(id(o))
    out.append("[" + inner)
    first = True
    for x in o:
        if not first:
            out.append("," + inner)
        first = False
        if not _value(x, out, ind, level + 1, seen):
            return False
    out.append(close)
    seen.discard(id(o))
    return True


def _dict(o, out, ind, level, seen) -> bool:
    if not o:
        out.append("{}")
        return True
    if id(o) in seen:  # circular
        return False
    seen.add(id(o))
    inner = "\n" + ind * (level + 1)
    out.append("{" + inner)
    first = True
    for k, v in sorted(o.items()):
        key = _key(k)
        if key is None:
            return False
        if not first:
            out.append("," + inner)
        first = False
        out.append(_enc(key) + ": ")
        if not _value(v, out, ind, level + 1, seen):
            return False
    out.append("\n" + ind * level + "}")
    seen.discard(id(o))
    return True

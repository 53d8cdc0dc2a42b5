"""Checks of the main job's counts and sizes (`MainJob`, `choose_policy`): pure Python.

A count is a whole number: an int (numpy ints too) or a float with no fraction (``32.0``);
a bool, a string, ``2.5``, nan or inf is refused by name with what it must be, so nothing is
truncated silently or fails later with a bare ``int()`` error.
"""

from __future__ import annotations

import math
import operator

from orchestra.errors import JobConfigError, JobConfigTypeError, int_text

#: The burn kernel's ``iters`` parameter is a C ``int`` (cuda_src/burn.cu).
MAX_ITERS = 2**31 - 1


def whole(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int from ``minimum`` to ``maximum`` (None: no upper limit).

    Raises `JobConfigTypeError` (a ``TypeError``) for a bool, a string or another non-number,
    or a float that is not a whole number; `JobConfigError` (a ``ValueError``) for one out of
    range. ``name``: how the message names the argument. Thread-safe (pure)."""
    what = f"an int >= {minimum}" if maximum is None else f"an int from {minimum} to {maximum}"
    if isinstance(value, bool):
        raise JobConfigTypeError(f"{name} must be {what}; got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise JobConfigTypeError(f"{name} must be {what}; got {value!r}")
        n = int(value)
    else:
        try:
            n = operator.index(value)
        except TypeError:
            raise JobConfigTypeError(f"{name} must be {what}; got {value!r}") from None
    if n < minimum or (maximum is not None and n > maximum):
        raise JobConfigError(f"{name} must be {what}; got {int_text(n)}")
    return n


__all__ = ["MAX_ITERS", "whole"]

"""Owned memory for CPU tests of the executors' leases: pinned host arrays and external device
buffers that behave like `HostRegistration` / `PinnedBuffer` and `DeviceBuffer` towards the
lease machinery (a real `Owner`, a real entry in `orchestra.driver.pinned_ranges()`), with
releases that record what was released and poison the memory, so a use after the release
shows in the output.

Use them with the ``owned`` fixture (``tests/conftest.py`` does not provide it: each test file
that needs one builds it from `Owned`), which patches ``context_alive`` so releases run, and
checks at the end that every release ran exactly once.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter

import numpy as np

import orchestra.driver as od
from orchestra.driver import host as host_mod

_DEV = types.SimpleNamespace(ordinal=0, pushed=contextlib.nullcontext)


class FakeRegistration(od.Resource):
    """``array`` page-locked "in place" for the test: its range is in orchestra's pinned
    ranges, owned by this object (``what``: ``"HostRegistration"`` or ``"PinnedBuffer"``). The
    release removes the range, fills the array with NaN-like 0xFF bytes and records the name."""

    def __init__(self, owned: "Owned", name: str, array: np.ndarray,
                 what: str = "HostRegistration"):
        self.array = array
        self.name = name
        lo = array.ctypes.data
        cell: list = []
        released = owned.released

        def release(_handle):
            host_mod.pinned_ranges().discard(lo, cell[0])
            array.view(np.uint8)[:] = 0xFF
            released[name] += 1

        self._own = od.Owner(self, lo, release, _DEV, what,
                             on_close=lambda: host_mod.pinned_ranges().closing(lo))
        cell.append(self._own)
        host_mod.pinned_ranges().add(lo, array.nbytes, self._own)
        owned.all[name] = self

    @property
    def ptr(self) -> int:
        return self._own.handle

    @property
    def leases(self) -> int:
        return self._own.leases


class FakeDeviceBuffer(od.Resource):
    """An external device buffer of ``nbytes`` in a graph fake's memory (``fake.mem``), owned
    like a `DeviceBuffer`: ``.ptr``, ``.nbytes``, ``.device``, ``lease()``. The release removes
    it from the fake's memory (a later use fails the fake's range check) and records it."""

    def __init__(self, owned: "Owned", name: str, fake, nbytes: int):
        self.nbytes = nbytes
        self.device = 0
        self.name = name
        ptr = fake._new_memory(nbytes, fake.mem)
        released = owned.released
        mem = fake.mem

        def release(p):
            mem.pop(p)[:] = 0xDD
            released[name] += 1

        self._own = od.Owner(self, ptr, release, _DEV, "DeviceBuffer")
        owned.all[name] = self

    @property
    def ptr(self) -> int:
        return self._own.handle

    @property
    def leases(self) -> int:
        return self._own.leases


class Owned:
    """The owned objects of one test: ``all`` (name -> object), ``released`` (name -> how
    many times its release ran)."""

    def __init__(self):
        self.all: dict = {}
        self.released: Counter = Counter()

    def pin(self, bindings: dict, what: str = "HostRegistration") -> dict:
        """Register every numpy array of ``bindings`` (name -> array); returns name -> its
        `FakeRegistration`."""
        return {n: FakeRegistration(self, f"{n}#{len(self.all)}", a, what)
                for n, a in bindings.items() if isinstance(a, np.ndarray)}

    def device(self, fake, nbytes: int, name: str | None = None) -> FakeDeviceBuffer:
        return FakeDeviceBuffer(self, name or f"dev#{len(self.all)}", fake, nbytes)

    def leased(self) -> list[str]:
        """Names of the objects with a lease out now."""
        return sorted(n for n, o in self.all.items() if o.leases)

    def check_once(self) -> None:
        """Every object was closed and released exactly once, and no lease is out. The pinned
        ranges are cleaned up whatever the outcome (a failed test must not leave closed ranges
        for later tests' arrays at the same addresses)."""
        try:
            for o in self.all.values():
                o.close()
            assert self.leased() == []
            assert dict(self.released) == {n: 1 for n in self.all}, dict(self.released)
        finally:
            for o in self.all.values():
                if isinstance(o, FakeRegistration):
                    host_mod.pinned_ranges().discard(o.array.ctypes.data)

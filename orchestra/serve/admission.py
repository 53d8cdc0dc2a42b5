"""The two admission settings that `Engine` and `ProcessEngine` let a server change while it
serves (``on_full``, ``submit_timeout``), checked on every assignment as in the constructors."""

from __future__ import annotations

from orchestra.serve.errors import check_on_full, check_timeout


class AdmissionSettings:
    """``on_full`` and ``submit_timeout`` as checked properties over ``_block`` (True for
    ``"block"``) and ``_submit_timeout``, which the hot paths read directly. A server may
    tighten its admission under load (``engine.on_full = "raise"``) from any thread: the next
    request follows it; a bad value raises `ServeConfigValueError` / `ServeConfigTypeError`
    and changes nothing.

    Thread-safety: each assignment replaces one attribute (atomic under the GIL); a request
    reads each once."""

    _block: bool
    _submit_timeout: float | None

    def _init_admission(self, on_full, submit_timeout) -> None:
        self.on_full = on_full
        self.submit_timeout = submit_timeout

    @property
    def on_full(self) -> str:
        """``"block"`` or ``"raise"``: what a request that finds the engine full does (see the
        constructor). May be set at any time, from any thread."""
        return "block" if self._block else "raise"

    @on_full.setter
    def on_full(self, value) -> None:
        self._block = check_on_full(value) == "block"

    @property
    def submit_timeout(self) -> float | None:
        """Seconds a blocking request waits for room (None: no limit). May be set at any time,
        checked as the constructor's argument."""
        return self._submit_timeout

    @submit_timeout.setter
    def submit_timeout(self, value) -> None:
        self._submit_timeout = check_timeout(value, "submit_timeout")


__all__ = ["AdmissionSettings"]

"""What `ProcessEngine` and its engine process exchange: the slot layout of the shared memory
and the fixed-size records on the two pipes. Pure Python and numpy, no CUDA, no processes.

A request travels as data in shared memory and 16 bytes on a pipe: the client copies the
inputs into a free slot (every input and output has its own region of the slot, sized for
``max_rows`` rows) and writes ``(request id, slot, rows)``; the engine process answers with
``(request id, slot, error bytes)`` once the outputs are in the slot (no error bytes) or the
request failed (its exception, pickled). Both records are shorter than ``PIPE_BUF``, so a
write of one is atomic on Linux: any number of threads may write requests without a lock,
and a reader never sees half of a record's header.

Thread-safety: `SlotLayout` is immutable (share it freely); a `RecordReader` belongs to the
one thread that reads its pipe.
"""

from __future__ import annotations

import pickle
import struct

import attrs
import numpy as np

from orchestra.serve.errors import ServeConfigValueError, ServeError
from orchestra.serve.tensors import TensorSpec

#: (request id, slot, rows): one request, client -> engine process
REQUEST = struct.Struct("<QII")
#: (request id, slot, error bytes that follow; 0: the outputs are in the slot)
RESPONSE = struct.Struct("<QII")
#: every region of a slot starts at a multiple of this (a cache line, and 16-byte vector copies)
ALIGN = 64
#: a slot is a whole number of pages, so the engine process can page-lock them all at once
PAGE = 4096
#: at most this many slots: every request in flight fits in a pipe's buffer (64 KiB / 16 bytes),
#: so a request write never blocks on a full pipe
MAX_SLOTS = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@attrs.frozen
class SlotLayout:
    """Where each input and output of a request lies in a slot of the shared memory.

    ``inputs`` / ``outputs``: ``{name: (byte offset in the slot, TensorSpec)}``; ``max_rows``:
    the most rows a request may have; ``slot_bytes``: bytes per slot (a multiple of `PAGE`);
    ``slots``: how many.

    Immutable: may be shared between threads freely.
    """

    inputs: dict
    outputs: dict
    max_rows: int
    slot_bytes: int
    slots: int

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory for all slots."""
        return self.slot_bytes * self.slots

    def views(self, buf, slot: int, which: str) -> dict[str, np.ndarray]:
        """``{name: array of max_rows rows}`` over ``buf`` (the shared memory) for one slot's
        inputs (``which="inputs"``) or outputs; a request uses the first ``rows`` rows."""
        base = slot * self.slot_bytes
        regions = self.inputs if which == "inputs" else self.outputs
        return {name: np.ndarray(spec.shape(self.max_rows), spec.dtype, buffer=buf,
                                 offset=base + off)
                for name, (off, spec) in regions.items()}


def slot_layout(inputs: dict[str, TensorSpec], outputs: dict[str, TensorSpec], max_rows: int,
                slots: int) -> SlotLayout:
    """The layout for ``slots`` slots of requests up to ``max_rows`` rows (raises
    `ServeConfigValueError` for counts out of range)."""
    if not 1 <= slots <= MAX_SLOTS:
        raise ServeConfigValueError(f"slots must be 1..{MAX_SLOTS} (requests in flight at "
                                    f"once); got {slots}")
    if max_rows < 1:
        raise ServeConfigValueError(f"max_rows must be >= 1; got {max_rows}")
    off = 0
    regions: dict[str, dict] = {"inputs": {}, "outputs": {}}
    for which, specs in (("inputs", inputs), ("outputs", outputs)):
        for name, spec in specs.items():
            regions[which][name] = (off, spec)
            off = _round_up(off + spec.row_nbytes * max_rows, ALIGN)
    return SlotLayout(regions["inputs"], regions["outputs"], max_rows,
                      _round_up(max(off, 1), PAGE), slots)


def encode_error(exc: BaseException) -> bytes:
    """``exc`` pickled, or when it does not survive pickling (an exception class of the
    user's that takes other arguments than it stores, say) a `RemoteError` with its type and
    message. Never empty: the response's error length 0 means success."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - any failure to round-trip: send what can be said
        return pickle.dumps(RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}: "
                                        f"{exc}"))


def decode_error(data: bytes) -> BaseException:
    """The exception of a failed response (a `RemoteError` when it cannot be read back)."""
    try:
        exc = pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - the response must fail its request either way
        return RemoteError(f"the engine process failed the request with an error that could "
                           f"not be read back ({type(e).__name__}: {e})")
    if not isinstance(exc, BaseException):
        return RemoteError(f"the engine process answered with {type(exc).__name__}, not an "
                           "exception")
    return exc


class RemoteError(ServeError):
    """A request failed in the engine process with an exception that could not be pickled back
    to the client: the message names its type and says what it said."""


class RecordReader:
    """Splits the bytes read from a pipe into records of ``header`` (a `struct.Struct`); with
    ``sized`` its last field is the length of the bytes that follow, else records are just the
    header.

    ``feed(data)`` appends what one ``os.read`` returned; ``pop()`` returns the next complete
    record (the header's fields, with ``sized`` the length replaced by the trailing bytes), or
    None when the rest has not arrived yet.

    Thread-safety: one reader thread (or event loop) per instance.
    """

    __slots__ = ("_buf", "_pos", "_header", "_size", "_sized")

    def __init__(self, header: struct.Struct, sized: bool):
        self._buf = bytearray()
        self._pos = 0
        self._header = header
        self._size = header.size
        self._sized = sized

    def feed(self, data: bytes) -> None:
        if self._pos:  # drop what was read before (amortised: one move per feed)
            del self._buf[:self._pos]
            self._pos = 0
        self._buf += data

    def pop(self):
        pos, size, buf = self._pos, self._size, self._buf
        if len(buf) - pos < size:
            return None
        fields = self._header.unpack_from(buf, pos)
        if not self._sized:
            self._pos = pos + size
            return fields
        n = fields[-1]
        if len(buf) - pos - size < n:
            return None
        self._pos = pos + size + n
        return fields[:-1] + (bytes(buf[pos + size:pos + size + n]),)

    @property
    def pending(self) -> int:
        """Bytes fed but not yet returned as records."""
        return len(self._buf) - self._pos

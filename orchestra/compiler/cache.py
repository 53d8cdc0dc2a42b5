"""The on-disk cache of compiled images (cubin or PTX) with their log and lowered names.

Location: ``$ORCHESTRA_CACHE_DIR`` if set, else platformdirs' user cache directory +
``/orchestra``; created with mode 0o700. ``ORCHESTRA_NO_CACHE=1`` turns the cache off.

The key (`make_key`) is a sha256 over a namespace (``"nvrtc"``, ``"nvjitlink"``), the cache
format version and every input that changes the output, each part length-prefixed so no two
inputs collide by concatenation. One entry is one file ``<namespace>-<key>.bin``::

    header  = magic b"ORCACHE\\0" | u32 format version | 32-byte sha256 of payload |
              u64 image length | u64 log length | u64 names length        (little-endian)
    payload = image | log (UTF-8) | lowered names (JSON object, UTF-8)

Writes go to a temporary file in the same directory, then ``os.replace`` (atomic on POSIX), so a
reader sees a whole old entry or a whole new one. A reader that finds a short, oversized or
corrupted entry (wrong magic, version, lengths or checksum) deletes it and reports a miss: the
caller recompiles; a bad entry is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path

import attrs

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"ORCACHE\0"
_HEADER = struct.Struct("<8sI32sQQQ")
HEADER_SIZE = _HEADER.size


@attrs.frozen
class CacheEntry:
    """One cached compile: ``image`` (cubin or PTX bytes), ``log`` (str), ``names``
    (dict name expression -> lowered name)."""

    image: bytes
    log: str
    names: dict


def cache_enabled() -> bool:
    """False when ``$ORCHESTRA_NO_CACHE`` is set to anything but ``""``/``"0"``."""
    return os.environ.get("ORCHESTRA_NO_CACHE", "") in ("", "0")


def cache_dir(create: bool = True) -> Path:
    """The cache directory (see the module doc); created with mode 0o700 when ``create``."""
    env = os.environ.get("ORCHESTRA_CACHE_DIR")
    if env:
        d = Path(env).expanduser()
    else:
        import platformdirs

        d = Path(platformdirs.user_cache_dir()) / "orchestra"
    if create:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def make_key(namespace: str, *parts) -> str:
    """sha256 hex digest over ``namespace``, `FORMAT_VERSION` and ``parts``.

    Each part may be bytes, str, int, None or a (nested) tuple/list of those; every item is
    written with a type tag and a length so different part lists never hash alike.
    """
    h = hashlib.sha256()

    def feed(x) -> None:
        if isinstance(x, (tuple, list)):
            h.update(b"T%d:" % len(x))
            for y in x:
                feed(y)
            return
        if x is None:
            h.update(b"N;")
            return
        if isinstance(x, bool):
            x = int(x)
        if isinstance(x, int):
            b, tag = str(x).encode(), b"I"
        elif isinstance(x, str):
            b, tag = x.encode("utf-8"), b"S"
        elif isinstance(x, (bytes, bytearray, memoryview)):
            b, tag = bytes(x), b"B"
        else:
            raise TypeError(f"cache key part of unsupported type {type(x).__name__}")
        h.update(tag + b"%d:" % len(b) + b)

    feed(("orchestra-cache", FORMAT_VERSION, namespace))
    feed(tuple(parts))
    return h.hexdigest()


def entry_path(namespace: str, key: str, directory: Path | None = None) -> Path:
    """The file an entry lives in: ``<cache dir>/<namespace>-<key>.bin``."""
    return (directory or cache_dir()) / f"{namespace}-{key}.bin"


def encode_entry(image: bytes, log: str, names: dict) -> bytes:
    """The bytes of one entry file (header + payload), see the module doc."""
    log_b = log.encode("utf-8")
    names_b = json.dumps(names, sort_keys=True).encode("utf-8")
    payload = bytes(image) + log_b + names_b
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, hashlib.sha256(payload).digest(),
                          len(image), len(log_b), len(names_b))
    return header + payload


def decode_entry(data: bytes) -> CacheEntry | None:
    """Parse and verify entry bytes; None for anything short, oversized or corrupted."""
    if len(data) < HEADER_SIZE:
        return None
    magic, version, digest, n_img, n_log, n_names = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    if len(data) != HEADER_SIZE + n_img + n_log + n_names:
        return None
    payload = memoryview(data)[HEADER_SIZE:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    try:
        image = bytes(payload[:n_img])
        log = bytes(payload[n_img:n_img + n_log]).decode("utf-8")
        names = json.loads(bytes(payload[n_img + n_log:]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(names, dict):
        return None
    return CacheEntry(image, log, names)


def load(namespace: str, key: str) -> CacheEntry | None:
    """The verified entry for ``key``, or None (miss, cache off, or a bad entry, which is
    deleted)."""
    if not cache_enabled():
        return None
    path = entry_path(namespace, key)
    try:
        data = path.read_bytes()
    except OSError:
        log.debug("compile cache miss: %s", path)
        return None
    entry = decode_entry(data)
    if entry is None:
        log.debug("compile cache: bad entry %s deleted (a miss)", path)
        try:
            path.unlink()
        except OSError:
            pass
    else:
        log.debug("compile cache hit: %s (%d bytes)", path, len(data))
    return entry


def store(namespace: str, key: str, image: bytes, log: str, names: dict) -> Path | None:
    """Write an entry atomically (tempfile in the cache directory + ``os.replace``).

    Returns its path, or None when the cache is off or the directory is not writable (a cache
    that cannot be written never fails a compile).
    """
    if not cache_enabled():
        return None
    try:
        d = cache_dir()
        data = encode_entry(image, log, names)
        fd, tmp = tempfile.mkstemp(prefix=f".{namespace}-", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path = entry_path(namespace, key, d)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path
    except OSError:
        return None

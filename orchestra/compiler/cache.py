"""The on-disk cache of compiled images (cubin or PTX) with their log and lowered names.

Location: ``$ORCHESTRA_CACHE_DIR`` if set, else platformdirs' user cache directory +
``/orchestra``; created with mode 0o700. ``ORCHESTRA_NO_CACHE=1`` turns the cache off. A
location that is not a directory (a file there): a compile warns once and compiles without the
cache; `cache_info` / `cache_clear` raise `CacheDirError`.

Size cap: ``$ORCHESTRA_CACHE_MAX_BYTES`` (`max_bytes`), default `DEFAULT_MAX_BYTES` = 1 GiB:
room for thousands of cubins (an orchestra cubin is typically 10 KiB - 1 MiB, a heavily
templated one a few MiB), so a serving process that instantiates many kernels keeps them all,
while a user cache directory never grows without bound. Plain bytes (``500000000``) or a
number with a binary suffix ``K``, ``M``, ``G``, ``T`` (optionally followed by ``B`` or
``iB``, any case: ``512M``, ``2GiB``, ``1.5G``); ``0``, ``none`` or ``unlimited`` remove the
cap. Anything else raises `CacheConfigError` at the next cache access (before compiling).

Eviction is least-recently-used: a hit touches the entry's mtime (`load`), and after every write
(`store`) the oldest entries by mtime are deleted until the total is within the cap (the entry
just written is kept even when it alone is larger). Processes share the directory safely: an
entry that another process deletes or evicts under us is a miss (or is skipped), never an error.
`cache_info` reports the location, entries, bytes, cap and whether the cache is on;
`cache_clear` deletes every entry (``orchestra cache info|clear``).

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
import re
import stat
import struct
import tempfile
import time
from pathlib import Path

import attrs

from orchestra.errors import OrchestraError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"ORCACHE\0"
_HEADER = struct.Struct("<8sI32sQQQ")
HEADER_SIZE = _HEADER.size

#: The size cap without ``$ORCHESTRA_CACHE_MAX_BYTES`` (see the module doc for the choice).
DEFAULT_MAX_BYTES = 1 << 30
MAX_BYTES_ENV = "ORCHESTRA_CACHE_MAX_BYTES"
_NAMESPACES = ("nvrtc", "nvjitlink", "crossover")  # crossover: copy lowering tables
_ENTRY_RE = re.compile(r"^(?:%s)-[0-9a-f]{64}\.bin$" % "|".join(_NAMESPACES))
_TMP_RE = re.compile(r"^\.(?:%s)-.*\.tmp$" % "|".join(_NAMESPACES))
#: A temporary file older than this is debris of a writer that died; eviction removes it.
_STALE_TMP_S = 3600
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class CacheConfigError(OrchestraError, ValueError):
    """``$ORCHESTRA_CACHE_MAX_BYTES`` holds something that is not a size."""


class CacheDirError(CacheConfigError):
    """The cache location (``$ORCHESTRA_CACHE_DIR``) exists but is not a directory, or cannot
    be created there (a read-only place, no permission).

    `cache_info` and `cache_clear` raise it; a compile warns and runs without the cache."""


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


def parse_size(text: str) -> int | None:
    """``"512M"`` -> 536870912: a byte count with an optional binary suffix (see the module
    doc); None for ``0``, ``none``, ``unlimited`` (no cap). Raises `CacheConfigError`."""
    t = str(text).strip()
    if t.lower() in ("none", "unlimited"):
        return None
    m = _SIZE_RE.match(t)
    if m is None or (m.group(3) and m.group(3).upper() == "IB" and not m.group(2)):
        raise CacheConfigError(
            f"{MAX_BYTES_ENV}={text!r} is not a size: give bytes (500000000), a number with K, M,"
            " G or T (512M, 2G, 1.5GiB), or 0 / none / unlimited for no cap")
    n = int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])
    return n or None


def max_bytes() -> int | None:
    """The size cap in bytes from ``$ORCHESTRA_CACHE_MAX_BYTES`` (default `DEFAULT_MAX_BYTES`;
    an empty value counts as unset), or None for no cap. Raises `CacheConfigError`."""
    env = os.environ.get(MAX_BYTES_ENV, "")
    return DEFAULT_MAX_BYTES if not env.strip() else parse_size(env)


def _blocker(d: Path) -> Path | None:
    """The first of ``d`` and its parents that exists, when it is not a directory."""
    for p in (d, *d.parents):
        if p.exists() or p.is_symlink():
            return None if p.is_dir() else p
    return None


def _not_a_directory(d: Path) -> CacheDirError:
    where = (f"ORCHESTRA_CACHE_DIR={os.environ['ORCHESTRA_CACHE_DIR']}"
             if os.environ.get("ORCHESTRA_CACHE_DIR") else f"the compile cache location {d}")
    blocker = _blocker(d)
    what = ("a file or something else is there" if blocker is None or blocker == d
            else f"{blocker} is a file")
    return CacheDirError(
        f"{where} is not a directory ({what}): point ORCHESTRA_CACHE_DIR at a folder, move "
        "the file away, or set ORCHESTRA_NO_CACHE=1")


def cache_dir(create: bool = True) -> Path:
    """The cache directory (see the module doc); created with mode 0o700 when ``create``.

    Raises `CacheDirError` when ``create`` and the location (or a folder above it) exists but
    is not a directory, or it cannot be created."""
    env = os.environ.get("ORCHESTRA_CACHE_DIR")
    if env:
        d = Path(env).expanduser()
    else:
        import platformdirs

        d = Path(platformdirs.user_cache_dir()) / "orchestra"
    if create:
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise _not_a_directory(d) from None
        except OSError as exc:  # a read-only place, no permission, /proc: no cache there
            where = (f"ORCHESTRA_CACHE_DIR={env}" if env
                     else f"the compile cache location {d}")
            raise CacheDirError(
                f"{where} cannot be created ({exc.strerror or exc}): point ORCHESTRA_CACHE_DIR "
                "at a folder you can write, or set ORCHESTRA_NO_CACHE=1") from None
    return d


def _existing_cache_dir() -> Path:
    """`cache_dir` without creating it, for `cache_info` / `cache_clear`: raises
    `CacheDirError` when something that is not a directory is there."""
    d = cache_dir(create=False)
    if _blocker(d) is not None:
        raise _not_a_directory(d)
    return d


_warned_dirs: set[str] = set()


def _warn_no_cache(exc: CacheDirError) -> None:
    """A cache location that is not a directory never fails a compile: warn (once per
    location) and compile without the cache."""
    if str(exc) not in _warned_dirs:
        _warned_dirs.add(str(exc))
        log.warning("%s; compiling without the cache", exc)


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
    deleted). A hit touches the entry's mtime: that is its recency for eviction.

    Raises `CacheConfigError` for a bad ``$ORCHESTRA_CACHE_MAX_BYTES`` (so a compile stops
    before NVRTC runs rather than after). Thread- and process-safe: an entry deleted under us
    is a miss.
    """
    if not cache_enabled():
        return None
    max_bytes()  # validate the cap before any work is done
    try:
        path = entry_path(namespace, key)
    except CacheDirError as exc:
        _warn_no_cache(exc)
        return None
    try:
        data = path.read_bytes()
    except OSError:  # missing (never written, evicted, cleared) or unreadable: a miss
        log.debug("cache miss %s", path.name)
        return None
    entry = decode_entry(data)
    if entry is None:
        log.debug("cache entry %s is damaged: deleted", path.name)
        _unlink(path)
        return None
    try:
        os.utime(path)  # recency for least-recently-used eviction
    except OSError:
        pass  # evicted by another process meanwhile: we hold its bytes already
    log.debug("cache hit %s", path.name)
    return entry


def store(namespace: str, key: str, image: bytes, log_text: str, names: dict) -> Path | None:
    """Write an entry atomically (tempfile in the cache directory + ``os.replace``), then evict
    the least recently used entries beyond the cap (`evict`).

    Returns its path, or None when the cache is off or the directory is not writable (a cache
    that cannot be written never fails a compile). Raises `CacheConfigError` for a bad cap.
    """
    if not cache_enabled():
        return None
    cap = max_bytes()
    try:
        d = cache_dir()
        data = encode_entry(image, log_text, names)
        fd, tmp = tempfile.mkstemp(prefix=f".{namespace}-", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path = entry_path(namespace, key, d)
            os.replace(tmp, path)
        except BaseException:
            _unlink(Path(tmp))
            raise
    except OSError:
        return None
    except CacheDirError as exc:
        _warn_no_cache(exc)
        return None
    log.debug("cache store %s (%d bytes)", path.name, len(data))
    if cap is not None:
        evict(cap, keep=path, directory=d)
    return path


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:  # gone already (another process) or not ours to delete
        return False


def _scan(directory: Path) -> tuple[list[tuple[int, str, int, str]], list[tuple[float, str]]]:
    """(entries as (mtime_ns, name, size, path), temporary files as (mtime, path)); files that
    vanish while we look are skipped."""
    entries: list[tuple[int, str, int, str]] = []
    temps: list[tuple[float, str]] = []
    try:
        it = os.scandir(directory)
    except OSError:
        return entries, temps
    with it:
        for e in it:
            is_entry = _ENTRY_RE.match(e.name) is not None
            if not is_entry and _TMP_RE.match(e.name) is None:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):  # a folder or a link by an entry's name: not ours
                continue
            if is_entry:
                entries.append((st.st_mtime_ns, e.name, st.st_size, e.path))
            else:
                temps.append((st.st_mtime, e.path))
    return entries, temps


def evict(cap: int, *, keep: Path | None = None, directory: Path | None = None) -> int:
    """Delete the least recently used entries (oldest mtime first) until the entries total at
    most ``cap`` bytes; ``keep`` (the entry just written) is never deleted. Also removes
    temporary files older than an hour (left by a writer that died). Returns how many entries
    were deleted. Safe against other processes doing the same at the same time.
    """
    d = directory or cache_dir(create=False)
    entries, temps = _scan(d)
    now = time.time()
    for mtime, p in temps:
        if now - mtime > _STALE_TMP_S:
            _unlink(Path(p))
    total = sum(size for _m, _n, size, _p in entries)
    removed = 0
    keep_s = str(keep) if keep is not None else None
    for _mtime, name, size, p in sorted(entries):
        if total <= cap:
            break
        if p == keep_s:
            continue
        if _unlink(Path(p)):
            removed += 1
            log.debug("cache evict %s (%d bytes)", name, size)
        total -= size  # gone either way: deleted by us or by another process
    return removed


@attrs.frozen
class CacheInfo:
    """What `cache_info` reports: ``location`` (Path), ``entries`` (count), ``bytes`` (their
    total size), ``max_bytes`` (the cap, None for none), ``enabled`` (False with
    ``$ORCHESTRA_NO_CACHE``).

    Immutable: may be shared between threads freely.
    """

    location: Path
    entries: int
    bytes: int
    max_bytes: int | None
    enabled: bool

    def as_dict(self) -> dict:
        """JSON-ready: the fields, ``location`` as str."""
        return {"location": str(self.location), "entries": self.entries, "bytes": self.bytes,
                "max_bytes": self.max_bytes, "enabled": self.enabled}


def cache_info() -> CacheInfo:
    """The cache's location, entry count, total bytes, cap and on/off state. Creates nothing.
    Raises `CacheConfigError` for a bad ``$ORCHESTRA_CACHE_MAX_BYTES``, `CacheDirError` when
    the location is not a directory."""
    cap = max_bytes()
    d = _existing_cache_dir()
    entries, _temps = _scan(d)
    return CacheInfo(d, len(entries), sum(e[2] for e in entries), cap, cache_enabled())


def cache_clear() -> tuple[int, int]:
    """Delete every entry (and stale temporary files): returns ``(entries deleted, bytes
    freed)``. Entries another process deletes meanwhile are not counted. A compile running in
    another process at the same time may still write its entry afterwards. Raises
    `CacheDirError` when the location is not a directory."""
    d = _existing_cache_dir()
    entries, temps = _scan(d)
    removed = freed = 0
    for _m, _n, size, p in entries:
        if _unlink(Path(p)):
            removed += 1
            freed += size
    now = time.time()
    for mtime, p in temps:
        if now - mtime > _STALE_TMP_S:
            _unlink(Path(p))
    return removed, freed

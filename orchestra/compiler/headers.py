"""Every header a program can reach, for the compile cache key (`header_key`).

A cached cubin is valid only while every file NVRTC would read for it is unchanged. The key
therefore covers, besides the program text and the options, the include graph found here:

* **Search path**, taken from the final NVRTC option list itself, in its order (which is the
  order NVRTC searches): ``-I<dir>``, ``-I <dir>`` (two list items), ``-I=<dir>``,
  ``--include-path=<dir>`` and ``--include-path <dir>``. That covers ``include_dirs=``, the
  source file's directory, ``cuda_src/`` and the CCCL / cudart directories (which `nvrtc`
  appends as ``-I``), and ``-I`` given through ``options=``, ``KernelRef(options=...)`` and the
  CLI's ``-O=-I...``. A relative directory is taken relative to the working directory, as NVRTC
  takes it. ``-include <h>`` / ``--pre-include=<h>`` headers are reached too, and
  ``--use-bundled-headers=<dir>`` adds ``<dir>`` and ``<dir>/cccl`` (versioned, see below).
* **Resolution**, as NVRTC 13 resolves (checked against NVRTC 13.x on the CPU):
  ``#include "x"`` looks in the including file's directory first (the program's own directory
  for the program: the directory of its name, the working directory for inline text; neither
  with ``--no-source-include``), then the search path; ``#include <x>`` only the search path;
  ``#include_next`` the search path after the directory the current file was found in; a
  pre-include the working directory, then the search path. An absolute name is itself.
* **Scanning** is textual and conservative: every ``#include``, ``#include_next`` and
  ``__has_include`` line is followed whatever ``#if`` it sits under, so the key may name a
  header the preprocessor skips (a harmless extra dependency) but never misses one it reads.
  An include spelled with a macro (``#include HEADER``) cannot be followed; name the header in
  a literal ``#include`` or clear the cache after editing it.
* **What enters the key**: for each project file reached, its resolved path, the SHA-256 of its
  bytes and where each of its includes resolved; an include that resolves nowhere enters as its
  spelling, so a header created later anywhere on the path (also one that shadows another in a
  later directory) changes the key. Files under a *system* directory are not read: the
  directories `includes.system_include_dirs` finds (CCCL, cudart) and any search directory that
  holds CCCL or cudart version headers count by their ``CCCL_VERSION`` / ``CUDART_VERSION``
  (`versioned_dirs`), since hashing the whole CCCL tree per compile would take far longer than
  a cache hit saves; a CCCL of your own that you patch in place needs ``orchestra cache clear``.

Cost: three memos, each keyed on stat signatures ``(type, size, mtime_ns, ctime_ns, inode,
device)``: file contents (digest and include lines) per path, directory listings per directory
(adding, removing or renaming an entry changes a directory's mtime, so an include is resolved by
dict lookups in the listings, not by probing every search directory), and the whole result per
(program text, options, working directory), valid while every path it looked at has the same
signature. The key of an unchanged compile therefore costs one ``stat`` per reached header and
per consulted directory, never a re-read: about 30 us for the repository's kernels and 3-8 us per
reached header for trees of 100-1000 headers (``benchmarks/bench_cache_key.py`` prints the
table). A file or directory modified less than `SETTLE_NS` (2 s) ago is never memoized (a
same-size edit within the file system's timestamp granularity would otherwise go unseen); the
ctime catches an edit that restores an old mtime (``cp -p``).

Why not let NVRTC report the dependencies: NVRTC 13 has no dependency output. The nvcc
spellings (``-M``, ``-MM``, ``-MD``, ``-MMD``, ``--generate-dependencies``,
``--dependency-output``) are refused with ``NVRTC_ERROR_INVALID_OPTION`` ("unrecognized option",
checked with NVRTC 13.5), and ``nvrtc.h`` documents no such option or API. Even where a
compiler has one, the list arrives only after a preprocessing pass (tens of milliseconds with
CCCL headers, on every call), omits includes that failed to resolve, and a lookup key is needed
before compiling; a scan with a stat memo costs microseconds.

Thread-safety: the memos are dicts updated with whole entries (safe under the GIL); two threads
scanning the same file at once both read it and store the same entry. Each key computation keeps
its own working state (`_Scan`).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time

from orchestra.compiler.includes import cccl_version, cudart_version, _CCCL_VERSION_FILES

# Searched from the "#" (a literal prefix the regex engine finds fast); the line-start check is
# done by hand, which is several times faster than a MULTILINE "^[ \t]*#" on big files.
_INCLUDE_RE = re.compile(rb'#[ \t]*(include_next|include)[ \t]*([<"])([^>"\r\n]+)[>"]')
_HAS_INCLUDE_RE = re.compile(rb'__has_include(_next)?[ \t]*\([ \t]*([<"])([^>"\r\n]+)[>"]')
_INCLUDE_PATH_FLAGS = ("-I", "--include-path")
_PRE_INCLUDE_FLAGS = ("-include", "--pre-include")
_NO_SOURCE_INCLUDE = ("--no-source-include", "-no-source-include")
_BUNDLED_HEADERS = "--use-bundled-headers="

#: Files modified more recently than this are re-read on every key (see the module doc).
SETTLE_NS = 2_000_000_000
_MEMO_LIMIT = 16384
_GRAPH_MEMO_LIMIT = 256  # whole results, keyed by the program text: fewer
_file_memo: dict[str, tuple] = {}
_dir_memo: dict[str, tuple] = {}
_graph_memo: dict[tuple, tuple] = {}
_version_memo: dict[str, tuple] = {}


def _cwd() -> str:
    try:
        return os.getcwd()
    except OSError:  # the working directory was deleted: relative paths resolve nowhere
        return os.sep + "nonexistent-working-directory"


def _option_value(opts, i: int, flags) -> tuple[str | None, int]:
    """If ``opts[i]`` is one of ``flags`` with a value (``-Xv``, ``-X=v``, ``-X v``), return
    (value, index of the next option); else (None, i + 1)."""
    o = opts[i]
    for flag in flags:
        if o == flag:
            # NVRTC takes the next list item whatever it is; at the end, an empty value.
            return (opts[i + 1] if i + 1 < len(opts) else ""), i + 2
        if o.startswith(flag + "="):
            return o[len(flag) + 1:], i + 1
        if len(flag) == 2 and o.startswith(flag):  # -I<dir>, also -I=<dir> and -I <dir>
            v = o[2:].lstrip()
            return (v[1:] if v.startswith("=") else v), i + 1
    return None, i + 1


def search_path(options, cwd: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """From an NVRTC option list: ``(include dirs in search order, pre-include names,
    source_include)``. Directories are absolute and normalized (relative ones joined to
    ``cwd``, default the working directory); ``source_include`` is False with
    ``--no-source-include``."""
    cwd = cwd or _cwd()
    opts = list(options)
    dirs: list[str] = []
    pre: list[str] = []
    source_include = True
    i = 0
    while i < len(opts):
        o = opts[i]
        if o in _NO_SOURCE_INCLUDE:
            source_include = False
            i += 1
            continue
        if o.startswith("-I") or o.startswith("--include-path"):
            v, i = _option_value(opts, i, _INCLUDE_PATH_FLAGS)
            if v is not None:
                d = os.path.normpath(os.path.join(cwd, v.strip()))
                if d not in dirs:
                    dirs.append(d)
            continue
        if o.startswith(_BUNDLED_HEADERS):  # NVRTC adds -I<dir> and -I<dir>/cccl
            d = os.path.normpath(os.path.join(cwd, o[len(_BUNDLED_HEADERS):].strip()))
            for x in (d, os.path.join(d, "cccl")):
                if x not in dirs:
                    dirs.append(x)
            i += 1
            continue
        if o.startswith(_PRE_INCLUDE_FLAGS):
            v, i = _option_value(opts, i, _PRE_INCLUDE_FLAGS)
            if v is not None:
                pre.append(v.strip())
            continue
        i += 1
    return tuple(dirs), tuple(pre), source_include


def parse_directives(data: bytes) -> tuple[tuple[str, str], ...]:
    """Every include-like directive of a file, in order: ``(kind, name)`` with kind ``'"'``
    (``#include "x"``), ``"<"`` (``#include <x>``), ``'next"'`` / ``"next<"``
    (``#include_next``); ``__has_include`` counts as the include it tests."""
    found = [(m.start(), m.group(1) == b"include_next", m.group(2), m.group(3))
             for m in _INCLUDE_RE.finditer(data)
             if not data[data.rfind(b"\n", 0, m.start()) + 1:m.start()].strip(b" \t")]
    if b"__has_include" in data:  # rare: skip the second scan when absent
        found += [(m.start(), m.group(1) is not None, m.group(2), m.group(3))
                  for m in _HAS_INCLUDE_RE.finditer(data)]
        found.sort(key=lambda t: t[0])
    return tuple((("next" if nxt else "") + delim.decode("ascii"),
                  name.strip().decode("utf-8", errors="replace"))
                 for _pos, nxt, delim, name in found)


def _sig(path: str) -> tuple | None:
    """``(file type, size, mtime_ns, ctime_ns, inode, device)`` of a path, None if missing."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # missing, unreadable, or a name with a NUL byte
        return None
    return (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino,
            st.st_dev)


def _file_info(path: str, sig: tuple) -> tuple[str, tuple]:
    """(sha256 hex, directives) of a file, memoized on its stat signature."""
    hit = _file_memo.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1], hit[2]
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return "unreadable", ()
    info = (hashlib.sha256(data).hexdigest(), parse_directives(data))
    if sig[2] < time.time_ns() - SETTLE_NS and len(data) == sig[1]:
        _remember(_file_memo, path, (sig,) + info)
    return info


def _list_dir(directory: str, sig: tuple) -> dict[str, bool] | None:
    """``{name: is a regular file}`` of a directory, memoized on its stat signature: adding,
    removing or renaming an entry changes the directory's mtime. A directory modified within
    `SETTLE_NS` is listed again every time."""
    hit = _dir_memo.get(directory)
    if hit is not None and hit[0] == sig:
        return hit[1]
    entries: dict[str, bool] = {}
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    entries[e.name] = e.is_file()  # follows symlinks, as the compiler does
                except OSError:
                    entries[e.name] = False
    except OSError:
        return None
    if sig[2] < time.time_ns() - SETTLE_NS:
        _remember(_dir_memo, directory, (sig, entries))
    return entries


def _remember(memo: dict, key, value, limit: int = _MEMO_LIMIT) -> None:
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value


class _Scan:
    """One key computation: the stat signature of every path it looked at (to validate the
    whole result later), each directory's listing once, each distinct resolution once."""

    def __init__(self):
        self.observed: dict[str, tuple | None] = {}
        self.listings: dict[str, dict | None] = {}

    def sig(self, path: str) -> tuple | None:
        if path not in self.observed:
            self.observed[path] = _sig(path)
        return self.observed[path]

    def file_sig(self, path: str) -> tuple | None:
        s = self.sig(path)
        return s if s is not None and stat.S_ISREG(s[0]) else None

    def listing(self, directory: str) -> dict | None:
        if directory not in self.listings:
            s = self.sig(directory)
            self.listings[directory] = (_list_dir(directory, s) if s is not None
                                        and stat.S_ISDIR(s[0]) else None)
        return self.listings[directory]

    def settled(self) -> bool:
        limit = time.time_ns() - SETTLE_NS
        return all(s is None or s[2] < limit for s in self.observed.values())


def dir_versions(directory: str, scan: _Scan | None = None) -> tuple:
    """``(("CCCL", (3, 1, 0)), ("cudart", (13, 0)))``-style versions of the CCCL / cudart
    headers in ``directory`` (empty for any other directory).

    Only a directory that holds a ``cuda`` entry (CCCL) or ``cuda_runtime_api.h`` (cudart) is
    probed further, so an ordinary directory costs no ``stat`` beyond its listing; the versions
    are memoized on the version files' stat signatures."""
    scan = scan or _Scan()
    entries = scan.listing(directory)
    if not entries:
        return ()
    files = []
    if "cuda" in entries:
        files += [os.path.join(directory, rel) for rel in _CCCL_VERSION_FILES]
    if entries.get("cuda_runtime_api.h"):
        files.append(os.path.join(directory, "cuda_runtime_api.h"))
    if not files:
        return ()
    sig = tuple(scan.file_sig(f) for f in files) + (len(files),)
    hit = _version_memo.get(directory)
    if hit is not None and hit[0] == sig:
        return hit[1]
    found: list[tuple[str, tuple[int, ...]]] = []
    cccl = cccl_version(directory) if "cuda" in entries else None
    if cccl is not None:
        found.append(("CCCL", cccl))
    cudart = cudart_version(directory) if entries.get("cuda_runtime_api.h") else None
    if cudart is not None:
        found.append(("cudart", cudart))
    out = tuple(found)
    _remember(_version_memo, directory, (sig, out))
    return out


def versioned_dirs(dirs, system_dirs=(), scan: _Scan | None = None) -> tuple:
    """The directories among ``dirs`` and ``system_dirs`` that count by their header versions:
    ``((dir, versions), ...)``, ``system_dirs`` always (even with no version found)."""
    scan = scan or _Scan()
    out = []
    seen = set()
    for d in list(system_dirs) + list(dirs):
        d = os.path.normpath(d)
        if d in seen:
            continue
        seen.add(d)
        v = dir_versions(d, scan)
        if v or d in system_dirs:
            out.append((d, v))
    return tuple(out)


def header_key(text: str, name: str, options, system_dirs=(), cwd: str | None = None) -> tuple:
    """The key part for every header program ``text`` (named ``name``, as given to
    ``nvrtcCreateProgram``) reaches under NVRTC ``options`` (see the module doc).

    Returns a nested tuple of str: the versioned directories with their versions, then one
    record per file reached (the program first): ``(path, sha256, (where each include
    resolved, ...))``, where an include resolves to a path or to ``"?<kind><name>"`` (not
    found). Raises nothing for unreadable or missing files (they enter the key as such).

    When every path the last scan of the same program looked at (files, directories, version
    headers) has the same stat signature, the last result is returned without resolving again.
    """
    return _key_and_digest(text, name, tuple(options), tuple(system_dirs), cwd)[0]


def header_digest(text: str, name: str, options, system_dirs=(), cwd: str | None = None) -> str:
    """SHA-256 hex of `header_key` (what `nvrtc.prepare_compile` puts into the cache key)."""
    return _key_and_digest(text, name, tuple(options), tuple(system_dirs), cwd)[1]


def _key_and_digest(text, name, options, system_dirs, cwd) -> tuple[tuple, str]:
    cwd = cwd or _cwd()
    memo_key = (text, name, options, system_dirs, cwd)
    hit = _graph_memo.get(memo_key)
    if hit is not None and all(_sig(p) == s for p, s in hit[0]):
        return hit[1], hit[2]
    scan = _Scan()
    key = _scan_headers(scan, text, name, options, system_dirs, cwd)
    digest = hashlib.sha256(repr(key).encode("utf-8", errors="replace")).hexdigest()
    if scan.settled():
        _remember(_graph_memo, memo_key, (tuple(scan.observed.items()), key, digest),
                  _GRAPH_MEMO_LIMIT)
    return key, digest


def _scan_headers(scan: _Scan, text, name, options, system_dirs, cwd) -> tuple:
    dirs, pre_includes, source_include = search_path(options, cwd)
    dir_candidates: list[tuple[str, int | None]] = [(d, j) for j, d in enumerate(dirs)]
    resolved: dict[tuple, tuple | None] = {}  # the same include from the same place, once
    system = tuple(os.path.normpath(d) for d in system_dirs)
    versioned = versioned_dirs(dirs, system, scan)
    sys_prefixes = tuple(d.rstrip(os.sep) + os.sep for d, _v in versioned)

    def lookup(d: str, inc: str, simple: bool) -> str | None:
        """The path of file ``inc`` under directory ``d``, or None."""
        if simple:  # a bare file name: one dict lookup in the memoized listing
            entries = scan.listing(d)
            return os.path.join(d, inc) if entries is not None and entries.get(inc) else None
        p = os.path.normpath(os.path.join(d, inc))
        parent, base = os.path.split(p)
        entries = scan.listing(parent)
        return p if entries is not None and entries.get(base, False) else None

    def resolve(kind: str, inc: str, here: str | None, found_at: int | None):
        """(path, index of the search dir it was found in or None) or None."""
        memo_key = (kind, inc, here, found_at)
        if memo_key in resolved:
            return resolved[memo_key]
        simple = os.sep not in inc and inc not in (".", "..") and (
            os.altsep is None or os.altsep not in inc)
        if os.path.isabs(inc):
            candidates: list[tuple[str, int | None]] = [("", None)]
            simple = False
        elif kind.startswith("next"):
            start = found_at + 1 if found_at is not None else 0
            candidates = dir_candidates[start:]
        else:
            candidates = [(here, None)] if (kind.endswith('"') and here is not None) else []
            candidates += dir_candidates
        out = None
        for d, j in candidates:
            p = lookup(d, inc, simple)
            if p is not None:
                out = (p, j)
                break
        resolved[memo_key] = out
        return out

    order: list[str] = []  # project files, in the order first reached
    found: dict[str, list] = {}  # path -> [sha256, where its includes resolved]
    program_edges: tuple = ()
    main_dir = os.path.normpath(os.path.join(cwd, os.path.dirname(name))) if source_include \
        else None
    main_directives = tuple(('"', inc) for inc in pre_includes) + parse_directives(
        text.encode("utf-8", errors="replace"))
    # (file or None for the program, its directives, its directory for "x" includes, the
    # search dir it was found in, how many leading directives are pre-includes)
    work = [(None, main_directives, main_dir, None, len(pre_includes))]
    while work:
        path, directives, here, found_at, n_pre = work.pop()
        edges = []
        for k, (kind, inc) in enumerate(directives):
            r = resolve(kind, inc, cwd if k < n_pre else here, found_at)
            if r is None:
                edges.append(f"?{kind}{inc}")
                continue
            p, j = r
            edges.append(p)
            if p in found or p.startswith(sys_prefixes):
                continue
            s = scan.file_sig(p)
            digest, sub = _file_info(p, s) if s is not None else ("unreadable", ())
            found[p] = [digest, ()]
            order.append(p)
            work.append((p, sub, os.path.dirname(p) if source_include else None, j, 0))
        if path is None:
            program_edges = tuple(edges)
        else:
            found[path][1] = tuple(edges)
    files = (("<program>", "", program_edges),) + tuple(
        (p, found[p][0], found[p][1]) for p in order)
    return tuple((d, tuple(v)) for d, v in versioned), files


def clear_memo() -> None:
    """Forget the memoized file contents, directory listings, versions and results (the next
    key re-reads everything)."""
    _file_memo.clear()
    _dir_memo.clear()
    _version_memo.clear()
    _graph_memo.clear()

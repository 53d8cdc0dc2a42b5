"""`orchestra cache info [--json]` and `orchestra cache clear [--json]`: the on-disk compile cache
(cubins from NVRTC and nvJitLink).

``info`` prints the location, whether the cache is on, its entries and bytes, and the size cap
(``$ORCHESTRA_CACHE_MAX_BYTES``); ``clear`` deletes every entry. Neither needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("cache", help="show or clear the on-disk compile cache",
                       description="Show or clear the on-disk cache of compiled kernels. "
                                   "Location: $ORCHESTRA_CACHE_DIR or the user cache directory; "
                                   "size cap: $ORCHESTRA_CACHE_MAX_BYTES (default 1G; 0, none "
                                   "or unlimited for no cap); ORCHESTRA_NO_CACHE=1 turns it off.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("info", "location, entries, bytes, size cap"),
                       ("clear", "delete every cache entry")):
        a = actions.add_parser(name, help=text, description=text)
        # also after the action; SUPPRESS keeps a --json given before it
        a.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="print one JSON object")
        a.set_defaults(func=run)


def _error(args, kind: str, message: str, code: int) -> int:
    """The one place this command reports an error: ``{"error": {"type", "message"}}`` on
    stdout under --json, else one ``orchestra cache: ...`` line on stderr."""
    if getattr(args, "json", False):
        print(json.dumps({"error": {"type": kind, "message": message}}))
    else:
        print(f"orchestra cache: {message}", file=sys.stderr)
    return code


def human_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units; plain bytes below 1 KiB)."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


def run(args) -> int:
    from orchestra.compiler.cache import MAX_BYTES_ENV, CacheConfigError, cache_clear, cache_info

    try:
        info = cache_info()
        if args.action == "clear":
            removed, freed = cache_clear()
    except CacheConfigError as exc:
        return _error(args, type(exc).__name__, str(exc), 2)
    if args.action == "clear":
        if args.json:
            print(json.dumps({"location": str(info.location), "removed": removed,
                              "bytes_freed": freed}))
        else:
            print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} "
                  f"({human_bytes(freed)}) from {info.location}")
        return 0
    if args.json:
        print(json.dumps(info.as_dict()))
        return 0
    cap = ("none (unlimited)" if info.max_bytes is None
           else f"{human_bytes(info.max_bytes)} ({info.max_bytes} bytes)")
    print(f"location  {info.location}")
    print(f"enabled   {'yes' if info.enabled else 'no (ORCHESTRA_NO_CACHE is set)'}")
    print(f"entries   {info.entries}")
    print(f"size      {human_bytes(info.bytes)} ({info.bytes} bytes)")
    print(f"cap       {cap}; set with {MAX_BYTES_ENV}")
    return 0

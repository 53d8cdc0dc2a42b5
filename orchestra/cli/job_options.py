"""The graph options `orchestra run` and `orchestra plan` share (the same graph either way)."""

from __future__ import annotations

import argparse

from orchestra.schedule import POLICIES


def compute_iters(text: str):
    """``auto`` or an int >= 0 (argparse type)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def add_graph_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=positive_int, default=32,
                   help="number of batches (default 32)")
    p.add_argument("--batch-mib", type=positive_float, default=64.0,
                   help="MiB of float32 per batch (default 64; may be fractional)")
    p.add_argument("--streams", type=positive_int, default=3, help="streams (default 3)")
    p.add_argument("--policy", choices=POLICIES, default="by-engine",
                   help="stream placement (default by-engine)")
    p.add_argument("--compute-iters", type=compute_iters, default="auto", metavar="N|auto",
                   help="burn iterations per element; 'auto' (default) makes the kernel take "
                        "as long as the slower copy")
    p.add_argument("--block", type=positive_int, default=256,
                   help="threads per block of the kernel (default 256)")
    p.add_argument("--input", metavar="FILE.npy",
                   help="stream a float32 .npy file (memory-mapped) through pinned staging "
                        "slots instead of generated data")
    p.add_argument("--staging-slots", type=positive_int, default=4,
                   help="pinned staging slots per direction with --input (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def fmt_bytes(n: int) -> str:
    """``4.00 GiB``, ``64.0 MiB``, ``12.0 KiB``, ``100 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}"
    return f"{n} B"

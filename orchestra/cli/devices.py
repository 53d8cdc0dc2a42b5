"""`orchestra devices`: a table of the CUDA devices this process can see."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("devices", help="list CUDA devices (name, compute capability, SMs, memory)")
    p.add_argument("--json", action="store_true", help="print one JSON object per device")
    p.set_defaults(func=run)


def _rows():
    from orchestra.driver import Device, device_count

    for ordinal in range(device_count()):
        d = Device.get(ordinal)
        yield {
            "ordinal": d.ordinal,
            "name": d.name,
            "arch": d.arch,
            "compute_capability": ".".join(map(str, d.compute_capability)),
            "sms": d.sm_count,
            "copy_engines": d.async_engine_count,
            "memory_gib": round(d.total_memory / 2**30, 1),
        }


def run(args) -> int:
    rows = list(_rows())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("#", "name", "arch", "cc", "SMs", "copy engines", "memory (GiB)")
    table = [header] + [
        (r["ordinal"], r["name"], r["arch"], r["compute_capability"], r["sms"],
         r["copy_engines"], r["memory_gib"]) for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0

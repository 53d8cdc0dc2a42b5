"""Host cost of the compile cache key (no GPU needed).

    python benchmarks/bench_cache_key.py [--repeats 200]

Prints one table, one row per program: the project headers it reaches, then microseconds per
key, median over ``--repeats``:

* ``header_key warm``: `orchestra.compiler.headers.header_key` with the stat memo filled and
  nothing changed (what every compile and every `load_kernel` call pays): one ``stat`` per
  reached header plus the failed probes of the search path;
* ``header_key cold``: the same after `headers.clear_memo()` (every header read and hashed);
* ``prepare_compile``: the whole key of `orchestra.compiler.prepare_compile` (source read,
  include directories, options, header key, sha256), warm.

Programs: ``saxpy.cu`` (no project header), ``pipeline_block.cu`` (CCCL headers, counted by
version), and synthetic header trees of 100 and 1000 files in two ``-I`` directories, each
header including three others, one header of the other directory and one that exists nowhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    import orchestra  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OLD = time.time() - 3600  # older than the memo's settle window


def make_tree(root: Path, n: int) -> tuple[Path, tuple[str, ...]]:
    """``n`` headers split over root/a and root/b, and root/k.cu including the first one."""
    a, b = root / "a", root / "b"
    a.mkdir(parents=True)
    b.mkdir()
    for i in range(n):
        d = a if i % 2 == 0 else b
        incs = [f'#include "h{(3 * i + j) % n}.h"' for j in (1, 2, 3)]
        incs.append(f"#include <h{(i + 1) % n}.h>")
        incs.append('#include "does_not_exist.h"')
        body = "\n".join(["#pragma once", *incs, f"#define H{i} {i}", "// " + "x" * 200])
        p = d / f"h{i}.h"
        p.write_text(body + "\n")
        os.utime(p, (OLD, OLD))
    src = root / "k.cu"
    src.write_text('#include "h0.h"\nextern "C" __global__ void k(int* p) { p[0] = H0; }\n')
    for d in (a, b, root):  # settled directories, as in a real tree
        os.utime(d, (OLD, OLD))
    return src, (f"-I{a}", f"-I{b}")


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)

    import orchestra.compiler as oc
    from orchestra.compiler import headers
    from orchestra.compiler.includes import system_include_dirs

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("saxpy.cu", "saxpy.cu", ()), ("pipeline_block.cu", "pipeline_block.cu", ())]
        for n in (100, 1000):
            src, opts = make_tree(Path(tmp) / f"tree{n}", n)
            cases.append((f"tree of {n} headers", src, opts))
        sysdirs = system_include_dirs()
        for label, src, opts in cases:
            job = oc.prepare_compile(src, arch="sm_90", options=opts)
            text, name, full = job.source.text, job.source.name, job.options

            def key():
                return headers.header_key(text, name, full, sysdirs)

            def cold():
                headers.clear_memo()
                return key()

            files = len(key()[1]) - 1
            reps = args.repeats if files < 500 else max(5, args.repeats // 10)
            warm_us = median_us(key, reps)
            cold_us = median_us(cold, max(3, reps // 10))
            prep_us = median_us(lambda: oc.prepare_compile(src, arch="sm_90", options=opts), reps)
            rows.append((label, files, warm_us, cold_us, prep_us))

    head = ("program", "headers", "header_key warm us", "header_key cold us",
            "prepare_compile us")
    print(f"{head[0]:<22} {head[1]:>8} {head[2]:>19} {head[3]:>19} {head[4]:>19}")
    for label, files, warm, cold, prep in rows:
        print(f"{label:<22} {files:>8} {warm:>19.1f} {cold:>19.1f} {prep:>19.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

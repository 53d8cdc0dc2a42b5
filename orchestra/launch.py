"""``python -m orchestra.launch``: start one process per GPU for a NCCL program.

    python -m orchestra.launch --nproc 2 examples/data_parallel_step.py --shard-mib 1
    python -m orchestra.launch --nproc 2 --store file -m mypackage.train

Each child gets ``ORCHESTRA_RANK`` / ``ORCHESTRA_LOCAL_RANK`` (0 .. nproc-1: its rank and
its GPU), ``ORCHESTRA_WORLD_SIZE``, ``ORCHESTRA_STORE`` (where rank 0 publishes the
communicator's unique id: ``tcp://127.0.0.1:PORT`` on a free port, or ``file:///...`` in a
temporary directory) and ``NCCL_NVLS_ENABLE=0`` (NVLink SHARP off, unless set already); the
program calls `orchestra.nccl.init_from_env()` for its communicator. ``--nproc`` defaults
to the number of visible GPUs.

The launcher waits for every child. When one fails, the others are stopped (SIGTERM, then
SIGKILL after ``--grace`` seconds) so that no rank waits forever in a collective; the exit
status is the first failure's (0 when every rank succeeded). Output of each rank goes to the
launcher's stdout / stderr, each line prefixed with ``[rank N]`` unless ``--no-prefix``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(rank: int, nproc: int, store: str, base=None) -> dict:
    """The environment of rank ``rank``'s process (see the module doc)."""
    env = dict(os.environ if base is None else base)
    env.update(ORCHESTRA_RANK=str(rank), ORCHESTRA_LOCAL_RANK=str(rank),
               ORCHESTRA_WORLD_SIZE=str(nproc), ORCHESTRA_STORE=store)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def _pump(stream, out, prefix: bytes) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line)
        out.flush()
    stream.close()


def launch(command: list[str], nproc: int, *, store: str = "tcp", host: str = "127.0.0.1",
           port: int | None = None, prefix: bool = True, grace: float = 5.0,
           env=None) -> int:
    """Run ``command`` (an argv list) as ``nproc`` ranks; the exit status (module doc)."""
    tmp = None
    if store == "tcp":
        url = f"tcp://{host}:{port or free_port(host)}"
    elif store == "file":
        tmp = tempfile.mkdtemp(prefix="orchestra-launch-")
        url = "file://" + os.path.join(tmp, "nccl-id")
    else:
        from orchestra.nccl.errors import NcclUsageError

        raise NcclUsageError(f"store must be tcp or file, got {store!r}")
    procs, pumps = [], []
    try:
        for rank in range(nproc):
            p = subprocess.Popen(command, env=child_env(rank, nproc, url, env),
                                 stdout=subprocess.PIPE if prefix else None,
                                 stderr=subprocess.PIPE if prefix else None)
            procs.append(p)
            if prefix:
                tag = b"[rank %d] " % rank
                for src, dst in ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer)):
                    t = threading.Thread(target=_pump, args=(src, dst, tag), daemon=True)
                    t.start()
                    pumps.append(t)
        status = _wait(procs, grace)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in pumps:
            t.join(5.0)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return status


def _wait(procs, grace: float) -> int:
    """Wait for every process; on the first failure stop the others. The first failure's
    status (a signal -N becomes 128 + N), else 0."""
    first = 0
    while True:
        running = [p for p in procs if p.poll() is None]
        for p in procs:
            code = p.returncode
            if code not in (None, 0) and not first:
                first = code if code > 0 else 128 - code
                for q in running:
                    q.terminate()
                deadline = time.monotonic() + grace
                for q in running:
                    try:
                        q.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        q.kill()
        if not running:
            return first
        time.sleep(0.02)


def _default_nproc() -> int:
    from orchestra.driver.device import device_count

    return device_count()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m orchestra.launch",
        description="Start one process per GPU for an orchestra NCCL program (each calls "
                    "orchestra.nccl.init_from_env()).")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (ranks) to start, one per GPU (default: every visible GPU)")
    p.add_argument("--store", choices=("tcp", "file"), default="tcp",
                   help="how rank 0 hands out the NCCL unique id: a TCP store on --host "
                        "(default) or a file in a temporary directory")
    p.add_argument("--host", default="127.0.0.1", help="TCP store address (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="TCP store port (default: a free one)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds the other ranks get to stop after one failed (5)")
    p.add_argument("--no-prefix", action="store_true",
                   help="do not prefix each output line with [rank N]")
    p.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    p.add_argument("program", nargs="?", help="the script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.module is not None:
        rest = ([a.program] if a.program else []) + a.args
        command = [sys.executable, "-m", a.module, *rest]
    elif a.program:
        command = [sys.executable, a.program, *a.args]
    else:
        p.error("name a script to run (or -m MODULE)")
    nproc = a.nproc if a.nproc is not None else _default_nproc()
    if nproc < 1:
        p.error(f"--nproc must be >= 1, got {nproc}")
    return launch(command, nproc, store=a.store, host=a.host, port=a.port,
                  prefix=not a.no_prefix, grace=a.grace)


if __name__ == "__main__":
    sys.exit(main())

"""``orchestra bench serve`` with the worker processes of tests/fake_bench_workers.py, for the
signal tests of tests/test_serve_bench_processes.py: ``python bench_serve_child.py WORKER
ARGS...`` puts ``fake_bench_workers.WORKER`` in place of the real worker and runs the CLI
with ARGS (the repository root on PYTHONPATH)."""

import sys

from orchestra.cli.main import main
from orchestra.serve import bench_processes
from tests import fake_bench_workers

if __name__ == "__main__":  # not again in the spawned workers, which import this file
    bench_processes._worker = getattr(fake_bench_workers, sys.argv[1])
    sys.exit(main(sys.argv[2:]))

"""A rank for tests/test_launch.py: bootstraps its communicator from the launcher's
environment with NCCL and the driver stubbed, and prints what it got as one JSON line."""

import contextlib
import hashlib
import json
import os
import sys
import time


class Dev:
    def __init__(self, ordinal):
        self.ordinal = ordinal

    def make_current(self, force=False):
        return self

    @contextlib.contextmanager
    def pushed(self):
        yield self


class Driver:
    def as_device(self, d):
        return Dev(int(d))


class Nccl:
    def get_unique_id(self):
        return os.urandom(128)

    def comm_init_rank(self, nranks, uid, rank):
        return ("comm", rank, hashlib.sha256(uid).hexdigest())

    def comm_destroy(self, comm):
        pass


def main():
    from orchestra.nccl import init_from_env

    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    rank = int(os.environ["ORCHESTRA_RANK"])
    if mode == "fail" and rank == 1:
        sys.exit(7)
    if mode == "fail":
        time.sleep(60)  # the launcher must stop this rank
    comm = init_from_env(api=Nccl(), driver=Driver(), timeout=20)
    print(json.dumps({"rank": comm.rank, "nranks": comm.nranks, "device": comm.device,
                      "id": comm.handle[2], "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
                      "store": os.environ["ORCHESTRA_STORE"].split(":")[0]}))
    comm.close()


if __name__ == "__main__":
    main()

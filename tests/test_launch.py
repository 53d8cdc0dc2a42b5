"""One process per GPU, on the CPU: the unique-id stores (file and TCP on 127.0.0.1) with
real subprocesses and NCCL stubbed, and ``python -m orchestra.launch`` (environment, output
prefixes, exit status, stopping the other ranks when one fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestra.launch import child_env, free_port
from orchestra.nccl import BootstrapError, FileStore, NcclUsageError, TCPStore, store_from_url

ROOT = Path(__file__).resolve().parent.parent
CHILD = str(Path(__file__).with_name("launch_child.py"))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("NCCL_NVLS_ENABLE", None)
    return env


def _ids(store, nranks):
    made = []
    out = [None] * nranks

    def rank(r):
        out[r] = store.exchange(r, nranks, lambda: made.append(os.urandom(128)) or made[-1])

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(nranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return made, out


def test_a_file_store_hands_rank_zeros_id_to_every_rank(tmp_path):
    made, got = _ids(FileStore(tmp_path / "id", timeout=10), 4)
    assert len(made) == 1 and got == [made[0]] * 4


def test_a_tcp_store_hands_rank_zeros_id_to_every_rank():
    store = TCPStore("127.0.0.1", free_port(), timeout=10)
    made, got = _ids(store, 3)
    store.wait_served(10)
    assert len(made) == 1 and got == [made[0]] * 3 and store.served == 2


def test_stores_time_out_naming_what_they_waited_for(tmp_path):
    with pytest.raises(BootstrapError, match="rank 0 wrote no NCCL id to .* within 0.2 s"):
        FileStore(tmp_path / "never", timeout=0.2).exchange(1, 2, bytes)
    with pytest.raises(BootstrapError, match="no NCCL id from rank 0 at TCP store 127.0.0.1"):
        TCPStore("127.0.0.1", free_port(), timeout=0.3).exchange(1, 2, bytes)


def test_a_rank_of_another_world_size_is_refused(tmp_path):
    FileStore(tmp_path / "id").exchange(0, 2, lambda: bytes(128))
    with pytest.raises(BootstrapError, match="communicator of 2 ranks, this rank expects 3"):
        FileStore(tmp_path / "id", timeout=1).exchange(1, 3, bytes)


def test_store_urls():
    assert isinstance(store_from_url("tcp://127.0.0.1:1234"), TCPStore)
    assert store_from_url("file:///tmp/x").path == "/tmp/x"
    with pytest.raises(NcclUsageError, match="tcp://HOST:PORT"):
        store_from_url("tcp://nohost")
    with pytest.raises(NcclUsageError, match="the stores are"):
        store_from_url("http://x:1")


def test_child_environment_keeps_nvls_off():
    env = child_env(1, 2, "tcp://127.0.0.1:9", base={})
    assert env == {"ORCHESTRA_RANK": "1", "ORCHESTRA_LOCAL_RANK": "1",
                   "ORCHESTRA_WORLD_SIZE": "2", "ORCHESTRA_STORE": "tcp://127.0.0.1:9",
                   "NCCL_NVLS_ENABLE": "0"}
    assert child_env(0, 1, "x", base={"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"] == "1"


@pytest.mark.parametrize("store", ["tcp", "file"])
def test_the_launcher_bootstraps_every_rank_with_one_id(store):
    r = subprocess.run([sys.executable, "-m", "orchestra.launch", "--nproc", "3", "--store",
                        store, CHILD], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert [ln[:9] for ln in lines] == ["[rank 0] ", "[rank 1] ", "[rank 2] "]
    got = [json.loads(ln[9:]) for ln in lines]
    assert [g["rank"] for g in got] == [0, 1, 2] and [g["device"] for g in got] == [0, 1, 2]
    assert {g["nranks"] for g in got} == {3} and len({g["id"] for g in got}) == 1
    assert {g["nvls"] for g in got} == {"0"} and {g["store"] for g in got} == {store}


def test_the_launcher_stops_the_others_when_a_rank_fails():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "orchestra.launch", "--nproc", "3", "--grace",
                        "1", CHILD, "fail"], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 7, (r.stdout, r.stderr)
    assert time.monotonic() - t0 < 30  # the sleeping ranks were stopped, not waited for


def test_the_launcher_needs_a_program():
    r = subprocess.run([sys.executable, "-m", "orchestra.launch", "--nproc", "1"], env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "name a script to run" in r.stderr

"""One process per GPU: how the ranks agree on a communicator's unique id.

Rank 0 makes the id (``ncclGetUniqueId``) and every other rank must receive its 128 bytes
before it calls ``ncclCommInitRank``. Two stores carry them, both without any other library:

- `FileStore(path)`: rank 0 writes the file atomically (a temporary file renamed over it),
  the others poll until it appears. For ranks on one machine, or a shared file system.
- `TCPStore(host, port)`: rank 0 listens on ``host:port`` (``127.0.0.1`` by default) and
  answers each other rank's request with the id; the others retry the connection until rank 0
  is up. The same works across machines with rank 0's address.

Where the program already has ``torch.distributed`` or MPI, `unique_id_from_torch` and
`unique_id_from_mpi` broadcast the id through them instead. `init_process` puts it together
(id exchange, then `Communicator.init_rank`), and `init_from_env` reads what the launcher
(``python -m orchestra.launch``) sets: ``ORCHESTRA_RANK``, ``ORCHESTRA_WORLD_SIZE``,
``ORCHESTRA_LOCAL_RANK`` (the GPU) and ``ORCHESTRA_STORE`` (``tcp://host:port`` or
``file:///path``).

Every wait is bounded (``timeout`` seconds, default 120): a rank that never comes is a
`BootstrapError` naming the store, never a hang.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable
from urllib.parse import urlparse

from orchestra.nccl.api import UNIQUE_ID_BYTES
from orchestra.nccl.communicator import Communicator, unique_id
from orchestra.nccl.errors import BootstrapError, NcclUsageError

MAGIC = b"orchestra-nccl-id/1"
DEFAULT_TIMEOUT = 120.0


def _header(nranks: int) -> bytes:
    return MAGIC + b" nranks=%d\n" % nranks


def _parse(blob: bytes, nranks: int, where: str) -> bytes:
    head, sep, body = blob.partition(b"\n")
    parts = head.split()
    if not sep or not parts or parts[0] != MAGIC or len(body) != UNIQUE_ID_BYTES:
        raise BootstrapError(f"{where}: not an orchestra NCCL id ({len(blob)} bytes)")
    theirs = next((p[len(b"nranks="):] for p in parts[1:] if p.startswith(b"nranks=")), b"")
    if theirs != b"%d" % nranks:
        raise BootstrapError(f"{where}: rank 0 made a communicator of {theirs.decode() or '?'}"
                             f" ranks, this rank expects {nranks}; start every rank with the "
                             "same world size")
    return body


class FileStore:
    """The id through a file at ``path`` (see the module doc). ``poll``: seconds between
    looks; ``timeout``: seconds the other ranks wait for rank 0.

    Thread-safety: its fields are set once; `exchange` is one rank's call, made once per process by
    one thread (rank 0's temporary file is named by process id, so two threads of one process
    writing the same path would collide). Processes share the file safely: it is written whole and
    renamed into place (``os.replace``).
    """

    def __init__(self, path, *, timeout: float = DEFAULT_TIMEOUT, poll: float = 0.01):
        self.path = os.fspath(path)
        self.timeout = float(timeout)
        self.poll = float(poll)

    def exchange(self, rank: int, nranks: int, make: Callable[[], bytes]) -> bytes:
        """Rank 0: ``make()`` the id, write it, return it. Others: wait for it and return it."""
        if rank == 0:
            data = bytes(make())
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(_header(nranks) + data)
            os.replace(tmp, self.path)  # atomic: readers see nothing or all of it
            return data
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with open(self.path, "rb") as f:
                    blob = f.read()
                return _parse(blob, nranks, f"file store {self.path}")
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise BootstrapError(f"rank {rank}: rank 0 wrote no NCCL id to {self.path} "
                                     f"within {self.timeout:g} s; is rank 0 running with the "
                                     "same store?")
            time.sleep(self.poll)

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"


class TCPStore:
    """The id over TCP: rank 0 serves ``host:port``, the others ask (see the module doc).

    Thread-safety: one `exchange` per store object, from one thread: rank 0's serving thread updates
    ``served``; other ranks connect from their own processes.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 29511, *,
                 timeout: float = DEFAULT_TIMEOUT):
        self.host = host
        self.port = int(port)
        self.timeout = float(timeout)
        self.served = 0  # rank 0: how many ranks got the id
        self._thread: threading.Thread | None = None

    def exchange(self, rank: int, nranks: int, make: Callable[[], bytes]) -> bytes:
        """Rank 0: ``make()`` the id and serve it to the ``nranks - 1`` others on a background
        thread (the call returns at once, so rank 0 can go on to ``ncclCommInitRank``);
        others: fetch it."""
        if rank == 0:
            data = bytes(make())
            if nranks > 1:
                self._serve(data, nranks)
            return data
        return self._fetch(rank, nranks)

    def _serve(self, data: bytes, nranks: int) -> None:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((self.host, self.port))
        except OSError as exc:
            srv.close()
            raise BootstrapError(f"rank 0 cannot listen on {self.host}:{self.port} ({exc}); "
                                 "pick another port") from exc
        srv.listen(nranks)
        srv.settimeout(self.timeout)
        blob = _header(nranks) + data

        def serve():
            try:
                while self.served < nranks - 1:
                    try:
                        conn, _ = srv.accept()
                    except OSError:
                        return  # timed out: the waiting ranks report it
                    with conn:
                        conn.settimeout(self.timeout)
                        try:
                            _read_line(conn)  # the rank's request line
                            conn.sendall(blob)
                        except OSError:
                            continue
                    self.served += 1
            finally:
                srv.close()

        self._thread = threading.Thread(target=serve, name="orchestra-nccl-store", daemon=True)
        self._thread.start()

    def _fetch(self, rank: int, nranks: int) -> bytes:
        deadline = time.monotonic() + self.timeout
        where = f"TCP store {self.host}:{self.port}"
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=5.0) as conn:
                    conn.sendall(b"%s rank=%d nranks=%d\n" % (MAGIC, rank, nranks))
                    blob = b""
                    need = len(_header(nranks)) + UNIQUE_ID_BYTES
                    while len(blob) < need:
                        chunk = conn.recv(need - len(blob))
                        if not chunk:
                            break
                        blob += chunk
                return _parse(blob, nranks, where)
            except (ConnectionRefusedError, ConnectionResetError, socket.timeout):
                pass
            if time.monotonic() > deadline:
                raise BootstrapError(f"rank {rank}: no NCCL id from rank 0 at {where} within "
                                     f"{self.timeout:g} s; is rank 0 running with this store?")
            time.sleep(0.05)

    def wait_served(self, timeout: float | None = None) -> None:
        """Rank 0: wait until every other rank fetched the id (tests; the launcher)."""
        if self._thread is not None:
            self._thread.join(self.timeout if timeout is None else timeout)

    def __repr__(self) -> str:
        return f"TCPStore({self.host!r}, {self.port})"


def _read_line(conn) -> bytes:
    out = b""
    while not out.endswith(b"\n") and len(out) < 256:
        chunk = conn.recv(1)
        if not chunk:
            break
        out += chunk
    return out


def store_from_url(url: str, *, timeout: float = DEFAULT_TIMEOUT):
    """``tcp://host:port`` -> `TCPStore`; ``file:///path`` (or a plain path) -> `FileStore`."""
    u = urlparse(url)
    if u.scheme == "tcp":
        if not u.hostname or not u.port:
            raise NcclUsageError(f"store {url!r}: write tcp://HOST:PORT")
        return TCPStore(u.hostname, u.port, timeout=timeout)
    if u.scheme in ("file", ""):
        path = u.path if u.scheme == "file" else url
        if not path:
            raise NcclUsageError(f"store {url!r}: write file:///PATH")
        return FileStore(path, timeout=timeout)
    raise NcclUsageError(f"store {url!r}: the stores are tcp://HOST:PORT and file:///PATH")


def unique_id_from_torch(rank: int, *, group=None, api=None) -> bytes:
    """The id broadcast from rank 0 through an initialized ``torch.distributed`` group."""
    import torch.distributed as dist

    box: list = [unique_id(api=api) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return bytes(box[0])


def unique_id_from_mpi(comm, *, api=None) -> bytes:
    """The id broadcast from rank 0 through an mpi4py communicator (``comm.bcast``)."""
    return bytes(comm.bcast(unique_id(api=api) if comm.Get_rank() == 0 else None, root=0))


def init_process(rank: int, nranks: int, device=None, *, store=None, unique_id_bytes=None,
                 api=None, driver=None) -> Communicator:
    """This process's rank: the id from ``store`` (a `FileStore` / `TCPStore` / URL) or
    ``unique_id_bytes``, then `Communicator.init_rank` on ``device`` (default: ``rank``)."""
    if unique_id_bytes is None:
        if store is None:
            raise NcclUsageError("init_process needs a store (or the unique id itself)")
        if isinstance(store, str):
            store = store_from_url(store)
        unique_id_bytes = store.exchange(rank, nranks, lambda: unique_id(api=api))
    comm = Communicator.init_rank(unique_id_bytes, rank, nranks,
                                  rank if device is None else device, api=api, driver=driver)
    wait = getattr(store, "wait_served", None)
    if rank == 0 and wait is not None:
        wait()  # every rank has its id once NCCL's init returns; the server thread ends
    return comm


def env_rank() -> tuple[int, int, int, str]:
    """``(rank, world size, local rank, store URL)`` from the launcher's environment."""
    try:
        rank = int(os.environ["ORCHESTRA_RANK"])
        world = int(os.environ["ORCHESTRA_WORLD_SIZE"])
        local = int(os.environ.get("ORCHESTRA_LOCAL_RANK", rank))
        store = os.environ["ORCHESTRA_STORE"]
    except (KeyError, ValueError) as exc:
        raise NcclUsageError(
            "not started by the launcher: ORCHESTRA_RANK, ORCHESTRA_WORLD_SIZE and "
            f"ORCHESTRA_STORE must be set (run python -m orchestra.launch; missing {exc})"
        ) from None
    return rank, world, local, store


def init_from_env(*, api=None, driver=None, timeout: float = DEFAULT_TIMEOUT) -> Communicator:
    """The communicator of a process the launcher started: rank and store from the
    environment (`env_rank`), the GPU ``ORCHESTRA_LOCAL_RANK``."""
    rank, world, local, url = env_rank()
    return init_process(rank, world, local, store=store_from_url(url, timeout=timeout),
                        api=api, driver=driver)


__all__ = ["FileStore", "TCPStore", "env_rank", "init_from_env", "init_process",
           "store_from_url", "unique_id_from_mpi", "unique_id_from_torch"]

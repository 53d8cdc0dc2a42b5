"""A stand-in `NcclAPI` for CPU tests: NCCL's collectives computed on the fakes' "device
memory" (host memory at real addresses), across the threads of one process.

Every rank of a communicator is a `FakeComm` of one `Clique` (made by ``comm_init_rank`` with
one unique id, or by ``comm_init_all``). A collective call deposits the rank's input, waits at
a barrier for every rank (so, as with NCCL, the ranks must call the same collectives in the
same order, each from its own thread), then writes the rank's output. One rank needs no other
thread. Point-to-point calls go through a queue per (sender, receiver).

With ``driver`` (a `FakeGraphDriver`), a call on a capturing stream becomes a graph node of
kind ``"nccl"`` that does the work when the graph is launched (NCCL records its kernels into
the capture the same way); `NcclGraphDriver` runs those nodes and child-graph nodes. Every
call is logged in ``calls``: ``(name, rank, stream, captured)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading

import numpy as np

from tests import fake_graph_cuda as fg

DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "bfloat16"]
OPS = ["sum", "prod", "max", "min", "avg"]


def view(ptr: int, count: int, dtype: str) -> np.ndarray:
    """``count`` elements of ``dtype`` at address ``ptr`` (writable, no copy)."""
    dt = np.dtype(dtype if dtype != "bfloat16" else "uint16")
    buf = (ctypes.c_uint8 * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt)


class Clique:
    def __init__(self, nranks: int):
        self.nranks = nranks
        self.barrier = threading.Barrier(nranks, timeout=20)
        self.slots: list = [None] * nranks
        self.mail: dict = {}
        self.lock = threading.Lock()

    def exchange(self, rank: int, data):
        """Every rank's ``data``, in rank order (all ranks must call)."""
        if self.nranks == 1:
            return [data]
        self.slots[rank] = data
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def box(self, src: int, dst: int) -> queue.Queue:
        with self.lock:
            return self.mail.setdefault((src, dst), queue.Queue())


class FakeComm:
    def __init__(self, clique: Clique, rank: int, device: int | None = None):
        self.clique = clique
        self.rank = rank
        self.device = device
        self.destroyed = False


class FakeNccl:
    """An `NcclAPI` look-alike (see the module doc)."""

    def __init__(self, driver=None, version=23203):
        self.driver = driver
        self._version = version
        self.cliques: dict[bytes, Clique] = {}
        self.calls: list = []
        self.destroyed: list = []
        self.lock = threading.Lock()

    # -- communicators ----------------------------------------------------------------------

    def version(self):
        return self._version

    def available(self):
        return True

    def get_unique_id(self):
        return os.urandom(128)

    def comm_init_rank(self, nranks, unique_id, rank):
        with self.lock:
            clique = self.cliques.setdefault(bytes(unique_id), Clique(nranks))
        assert clique.nranks == nranks, "ranks disagree on the communicator size"
        self.calls.append(("comm_init_rank", rank, None, False))
        return FakeComm(clique, rank)

    def comm_init_all(self, devices):
        clique = Clique(len(devices))
        self.calls.append(("comm_init_all", None, None, False))
        return [FakeComm(clique, i, d) for i, d in enumerate(devices)]

    def comm_destroy(self, comm):
        comm.destroyed = True
        self.destroyed.append(comm)

    def group_start(self):
        self.calls.append(("group_start", None, None, False))

    def group_end(self):
        self.calls.append(("group_end", None, None, False))

    def dtype(self, name):
        return DTYPES.index(name)

    def op(self, name):
        return OPS.index(name)

    # -- operations -------------------------------------------------------------------------

    def _go(self, name, comm, stream, fn):
        captured = False
        if self.driver is not None and self.driver._capturing(stream) is not None:
            captured = True
            (err,) = self.driver._enqueue(stream, "nccl", {"fn": fn, "name": name})
            assert not err, f"capture of {name} failed: {err}"
        else:
            fn()
        self.calls.append((name, comm.rank, int(stream), captured))

    @staticmethod
    def _reduce(arrays, op):
        stack = np.stack([a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays])
        if op == "sum":
            r = stack.sum(0)
        elif op == "prod":
            r = stack.prod(0)
        elif op == "max":
            r = stack.max(0)
        elif op == "min":
            r = stack.min(0)
        else:
            r = stack.sum(0) / len(arrays)
        return r.astype(arrays[0].dtype)

    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        dt, o = DTYPES[dtype], OPS[op]

        def fn():
            mine = view(send, count, dt).copy()
            view(recv, count, dt)[:] = self._reduce(comm.clique.exchange(comm.rank, mine), o)
        self._go("all_reduce", comm, stream, fn)

    def all_gather(self, send, recv, count, dtype, comm, stream):
        dt = DTYPES[dtype]

        def fn():
            parts = comm.clique.exchange(comm.rank, view(send, count, dt).copy())
            view(recv, count * len(parts), dt)[:] = np.concatenate(parts)
        self._go("all_gather", comm, stream, fn)

    def reduce_scatter(self, send, recv, count, dtype, op, comm, stream):
        dt, o = DTYPES[dtype], OPS[op]

        def fn():
            n = comm.clique.nranks
            parts = comm.clique.exchange(comm.rank, view(send, count * n, dt).copy())
            full = self._reduce(parts, o)
            view(recv, count, dt)[:] = full[comm.rank * count:(comm.rank + 1) * count]
        self._go("reduce_scatter", comm, stream, fn)

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        dt = DTYPES[dtype]

        def fn():
            mine = view(send, count, dt).copy() if comm.rank == root else None
            parts = comm.clique.exchange(comm.rank, mine)
            view(recv, count, dt)[:] = parts[root]
        self._go("broadcast", comm, stream, fn)

    def send(self, buf, count, dtype, peer, comm, stream):
        dt = DTYPES[dtype]

        def fn():
            comm.clique.box(comm.rank, peer).put(view(buf, count, dt).copy())
        self._go("send", comm, stream, fn)

    def recv(self, buf, count, dtype, peer, comm, stream):
        dt = DTYPES[dtype]

        def fn():
            view(buf, count, dt)[:] = comm.clique.box(peer, comm.rank).get(timeout=20)
        self._go("recv", comm, stream, fn)


class NcclGraphDriver(fg.FakeGraphDriver):
    """The graph fake, plus NCCL's captured nodes (kind ``"nccl"``) and child-graph nodes
    (``cuGraphAddChildGraphNode``: the child's nodes are copied in, as the driver clones)."""

    def _run(self, kind, p, flags=0, live=None):
        if kind == "nccl":
            p["fn"]()
            return fg.OK
        if kind == "graph":
            for k, q in p["nodes"]:
                err = self._run(k, q, flags, live)
                if err:
                    return err
            return fg.OK
        return super()._run(kind, p, flags, live)

    def cuGraphAddChildGraphNode(self, hgraph, deps, n, child):
        g = self._graph(child)
        nodes = [(c.kind, dict(c.params)) for c in g.nodes]
        return self._add("cuGraphAddChildGraphNode", hgraph, deps, n, "graph", {"nodes": nodes})


def install_graph(monkeypatch) -> NcclGraphDriver:
    """A `NcclGraphDriver` made the process's default driver API for the test."""
    fake = NcclGraphDriver()
    fg.FakeStream.installed = fake
    return fake.install(monkeypatch)


@contextlib.contextmanager
def nccl(fake: FakeNccl):
    """``fake`` as the process's `NcclAPI` for a block."""
    from orchestra.nccl.api import use_nccl

    with use_nccl(fake):
        yield fake

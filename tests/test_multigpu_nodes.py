"""The PeerCopy and NCCL node records: field checks, sizes, in-place layouts, accesses."""

from __future__ import annotations

import numpy as np
import pytest

from orchestra.errors import NodeFieldTypeError, NodeFieldValueError
from orchestra.graph import (AllGather, AllReduce, Broadcast, Buffer, HostBuffer, Mode,
                             PeerCopy, ReduceScatter, Recv, Send, TaskGraph)


class Comm:
    def __init__(self, rank=0, nranks=2, device=0):
        self.rank, self.nranks, self.device = rank, nranks, device


def modes(node):
    return [(str(a.range), a.mode) for a in node.accesses()]


def test_peer_copy_defaults_to_the_source_device_and_accepts_the_destination():
    a, b = Buffer("a", 64, device=0), Buffer("b", 64, device=1)
    push = PeerCopy("p", a, b)
    pull = PeerCopy("q", a, b, device=1)
    assert (push.device, push.peer) == (0, 1) and (pull.device, pull.peer) == (1, 0)
    assert modes(push) == [("a[0:64]", Mode.READ), ("b[0:64]", Mode.WRITE)]
    same = PeerCopy("s", a.range(0, 32), a.range(32, 32))
    assert (same.device, same.peer) == (0, 0)


@pytest.mark.parametrize("make,cls,message", [
    (lambda a, b: PeerCopy("p", a, b, device=2), NodeFieldValueError,
     r"device 2 is neither the source's device \(0\) nor the destination's \(1\)"),
    (lambda a, b: PeerCopy("p", a.range(0, 32), b), NodeFieldValueError, "sizes must match"),
    (lambda a, b: PeerCopy("p", a, a), NodeFieldValueError, "overlap"),
    (lambda a, b: PeerCopy("p", HostBuffer("h", 64), b), NodeFieldTypeError,
     "src must be a device buffer"),
])
def test_peer_copy_refuses_what_it_cannot_copy(make, cls, message):
    a, b = Buffer("a", 64, device=0), Buffer("b", 64, device=1)
    with pytest.raises(cls, match=message):
        make(a, b)


def test_a_peer_copy_orders_its_readers_after_it_across_devices():
    a, b = Buffer("a", 64, device=0), Buffer("b", 64, device=1)
    g = TaskGraph()
    g.add(PeerCopy("p", a, b))
    g.add(AllReduce("r", b, b, comm=Comm(device=1)))
    assert ("p", "r") in g.edges


def test_all_reduce_in_place_and_out_of_place():
    x, y = Buffer("x", 64), Buffer("y", 64)
    inplace = AllReduce("r", x, x, comm=Comm(), op="max", dtype=np.float32)
    assert modes(inplace) == [("x[0:64]", Mode.READ_WRITE)] and inplace.count == 16
    out = AllReduce("r", x, y, comm=Comm(), dtype="int64")
    assert out.count == 8 and modes(out) == [("x[0:64]", Mode.READ), ("y[0:64]", Mode.WRITE)]
    assert AllReduce("r", x, x, comm=Comm(), dtype=np.dtype("float16")).dtype == "float16"


def test_gather_and_scatter_sizes_and_in_place_chunks():
    r = Buffer("r", 64)
    g = AllGather("g", r.range(16, 16), r, comm=Comm(rank=1, nranks=4))  # rank 1's chunk
    assert g.count == 4 and modes(g) == [("r[0:64]", Mode.READ_WRITE)]
    s = ReduceScatter("s", r, r.range(32, 16), comm=Comm(rank=2, nranks=4))
    assert s.count == 4 and modes(s) == [("r[0:64]", Mode.READ_WRITE)]
    with pytest.raises(NodeFieldValueError, match="in place, send must be chunk 1"):
        AllGather("g", r.range(0, 16), r, comm=Comm(rank=1, nranks=4))
    with pytest.raises(NodeFieldValueError, match="needs 64"):
        AllGather("g", Buffer("s", 16), Buffer("big", 48), comm=Comm(nranks=4))
    with pytest.raises(NodeFieldValueError, match="needs 64"):
        ReduceScatter("s", Buffer("s", 48), Buffer("o", 16), comm=Comm(nranks=4))


def test_broadcast_reads_only_on_the_root():
    x, y = Buffer("x", 64), Buffer("y", 64)
    assert modes(Broadcast("b", x, y, comm=Comm(rank=0), root=0)) == [
        ("x[0:64]", Mode.READ), ("y[0:64]", Mode.WRITE)]
    assert modes(Broadcast("b", x, y, comm=Comm(rank=1), root=0)) == [("y[0:64]", Mode.WRITE)]
    with pytest.raises(NodeFieldValueError, match="root 2 is not a rank"):
        Broadcast("b", x, y, comm=Comm(), root=2)


def test_send_and_recv_name_another_rank():
    x = Buffer("x", 64)
    assert modes(Send("s", x, comm=Comm(), peer=1)) == [("x[0:64]", Mode.READ)]
    assert modes(Recv("r", x, comm=Comm(), peer=1)) == [("x[0:64]", Mode.WRITE)]
    with pytest.raises(NodeFieldValueError, match="peer 0 is this rank"):
        Send("s", x, comm=Comm(), peer=0)


@pytest.mark.parametrize("kw,cls,message", [
    (dict(comm=object()), NodeFieldTypeError, "comm must be a communicator"),
    (dict(comm=Comm(rank=2, nranks=2)), NodeFieldValueError, "rank 2 of 2"),
    (dict(comm=Comm(), dtype="complex64"), NodeFieldValueError, "dtype must be one of"),
    (dict(comm=Comm(), op="xor"), NodeFieldValueError, "op must be one of"),
    (dict(comm=Comm(device=1)), NodeFieldValueError,
     "is on device 0 but the communicator \\(rank 0\\) is on device 1"),
    (dict(comm=Comm(), dtype="float64"), NodeFieldValueError, "not a whole number of float64"),
])
def test_collectives_refuse_bad_fields(kw, cls, message):
    x = Buffer("x", 68)
    with pytest.raises(cls, match=message):
        AllReduce("r", x, x, **kw)

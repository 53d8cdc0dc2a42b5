"""`Communicator`: one rank's NCCL communicator (``ncclComm_t``), owned like every handle.

A communicator is created once (``ncclCommInitRank`` with a unique id every rank shares, or
``ncclCommInitAll`` for every local GPU of one process) and then used by every collective node
of every graph of its rank. It is an `orchestra.driver.owner.Owner`-held handle: ``close()``
(idempotent, also ``with``) destroys it with ``ncclCommDestroy``, a forgotten one is destroyed
by its finalizer, and while an executor's prepared plan or a graph exec that enqueues its
collectives holds a `Lease` (``comm.lease()``), the destroy waits for the last lease. The
live-handle count names it ``nccl_comm``.

Ranks: ``rank`` in ``[0, nranks)``; ``device`` is the ordinal of the rank's GPU. ``clique``
identifies the communicator the ranks form together (the unique id's bytes, or a token shared
by one ``init_all``), so two `Communicator` objects of one clique are two ranks of one
communicator.
"""

from __future__ import annotations

import os

from orchestra.driver.api import default_api
from orchestra.driver.owner import Owner, Resource
from orchestra.nccl.api import default_nccl
from orchestra.nccl.errors import NcclUsageError


class Communicator(Resource):
    """One rank of a NCCL communicator (see the module doc).

    Attributes: ``rank``, ``nranks``, ``device`` (ordinal), ``clique``, ``api`` (the `NcclAPI`),
    ``handle`` (the binding's ``Comm``; `ResourceClosedError` once closed). Make them with
    `init_rank` or `init_all`, not directly.

    Thread-safety: a communicator may be used from one thread at a time (NCCL's rule for
    issuing operations); ``close()`` and leases are thread-safe.
    """

    def __init__(self, handle, *, rank: int, nranks: int, device, clique, api):
        self.rank = int(rank)
        self.nranks = int(nranks)
        self._device = device  # the Device object (the Owner pushes its context to destroy)
        self.device = int(device.ordinal)
        self.clique = clique
        self.api = api
        self._own = Owner(self, handle, api.comm_destroy, device, "NcclComm")

    @property
    def handle(self):
        return self._own.handle

    @classmethod
    def init_rank(cls, unique_id: bytes, rank: int, nranks: int, device=None, *, api=None,
                  driver=None) -> "Communicator":
        """Rank ``rank`` of ``nranks`` on ``device`` (a `Device`, an ordinal, None: device 0)
        with ``ncclCommInitRank``; ``unique_id``: the 128 bytes of `unique_id()` that rank 0
        made and every rank received (`orchestra.nccl.bootstrap`). Blocks until every rank
        has called it. Raises `NcclUsageError` for a rank out of range, `NcclError` when NCCL
        refuses, `MissingExtraError` without nccl4py."""
        api = api if api is not None else default_nccl()
        driver = driver if driver is not None else default_api()
        nranks, rank = _check_ranks(rank, nranks)
        dev = driver.as_device(device)
        dev.make_current()
        handle = api.comm_init_rank(nranks, bytes(unique_id), rank)
        return cls(handle, rank=rank, nranks=nranks, device=dev, clique=bytes(unique_id),
                   api=api)

    @classmethod
    def init_all(cls, devices=None, *, api=None, driver=None) -> list["Communicator"]:
        """One communicator per device of ``devices`` (ordinals or `Device` objects; None:
        every visible device), rank i on ``devices[i]``, with one ``ncclCommInitAll``: the
        one-process form. Use each from its own thread (`run_per_device`)."""
        api = api if api is not None else default_nccl()
        driver = driver if driver is not None else default_api()
        if devices is None:
            devices = range(driver.device_count())
        devs = [driver.as_device(d) for d in devices]
        ordinals = [d.ordinal for d in devs]
        if not devs:
            raise NcclUsageError("init_all needs at least one device")
        if len(set(ordinals)) != len(ordinals):
            raise NcclUsageError(f"init_all: devices {ordinals} repeat a device; a process "
                                 "has one rank per GPU")
        handles = api.comm_init_all(ordinals)
        clique = ("init_all", os.urandom(16).hex())
        return [cls(h, rank=i, nranks=len(devs), device=d, clique=clique, api=api)
                for i, (h, d) in enumerate(zip(handles, devs))]

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<Communicator rank {self.rank} of {self.nranks} on device {self.device}{state}>"


def _check_ranks(rank, nranks) -> tuple[int, int]:
    for name, value in (("rank", rank), ("nranks", nranks)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise NcclUsageError(f"{name} must be an int, got {type(value).__name__}")
    if nranks < 1 or not 0 <= rank < nranks:
        raise NcclUsageError(f"rank {rank} of {nranks}: need nranks >= 1 and 0 <= rank < nranks")
    return nranks, rank


def unique_id(*, api=None) -> bytes:
    """A new NCCL unique id (``ncclGetUniqueId``): made by rank 0, sent to every rank."""
    return (api if api is not None else default_nccl()).get_unique_id()


__all__ = ["Communicator", "unique_id"]

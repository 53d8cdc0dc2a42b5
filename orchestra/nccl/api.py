"""`NcclAPI`: the one object through which orchestra reaches NCCL.

NCCL comes from nccl4py's low-level bindings (``nccl.bindings.nccl``: NVIDIA's maintained
Cython binding, which loads the ``libnccl.so.2`` of the ``nvidia-nccl-cu13`` wheel through
cuda.pathfinder and releases the GIL in every call, so a rank blocked in NCCL never stalls
another thread). It is an optional extra: ``pip install orchestra[nccl]``. The module is
imported on first use; without it every entry raises `MissingExtraError` naming the extra.

The methods take and return plain values: ``Comm`` objects of the binding as communicator
handles, ints for device pointers and streams, NCCL's enum values for element types and
reduction operators (`dtype` / `op` map orchestra's names). Failures raise `NcclError` naming
the call. CPU tests swap the object (`use_nccl`), as executors swap the `DriverAPI`.

NVLink SHARP (NVLS) is kept off: the first use sets ``NCCL_NVLS_ENABLE=0`` unless the
environment already sets it (NVLS needs multicast objects, which orchestra never creates).
"""

from __future__ import annotations

import contextlib
import os
import threading

from orchestra.errors import MissingExtraError
from orchestra.nccl.errors import NcclError, NcclUsageError

INSTALL = "pip install 'orchestra[nccl]' (nccl4py and the nvidia-nccl-cu13 library)"
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)

_DTYPES = {"int8": "Int8", "uint8": "Uint8", "int32": "Int32", "uint32": "Uint32",
           "int64": "Int64", "uint64": "Uint64", "float16": "Float16", "float32": "Float32",
           "float64": "Float64", "bfloat16": "Bfloat16"}
_OPS = {"sum": "Sum", "prod": "Prod", "max": "Max", "min": "Min", "avg": "Avg"}
_CALLS = {"all_reduce": "ncclAllReduce", "all_gather": "ncclAllGather",
          "reduce_scatter": "ncclReduceScatter", "broadcast": "ncclBroadcast",
          "send": "ncclSend", "recv": "ncclRecv", "group_start": "ncclGroupStart",
          "group_end": "ncclGroupEnd", "comm_init_rank": "ncclCommInitRank",
          "comm_init_all": "ncclCommInitAll",
          "comm_init_rank_scalable": "ncclCommInitRankScalable", "comm_destroy": "ncclCommDestroy",
          "get_unique_id": "ncclGetUniqueId", "get_version": "ncclGetVersion",
          "comm_abort": "ncclCommAbort"}


def nvls_off() -> None:
    """``NCCL_NVLS_ENABLE=0`` unless the environment sets it already (read by NCCL when a
    communicator is created)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _result_name(code: int) -> str:
    try:
        from nccl.bindings import nccl as _n

        return "nccl" + _n.Result(code).name
    except Exception:  # noqa: BLE001 - an unknown code keeps its number
        return f"ncclResult {code}"


class NcclAPI:
    """nccl4py's bindings behind orchestra's names (see the module doc).

    Thread-safety: the object may be shared between threads (the module is imported once, under
    a lock), but the calls are NCCL's, which are not thread-safe: issue the operations of one
    communicator from one thread at a time, all of a group (``ncclGroupStart`` ..
    ``ncclGroupEnd``) from one thread (NCCL User Guide, "Thread Safety").
    """

    def __init__(self, module=None):
        self._module = module
        self._lock = threading.Lock()

    @property
    def module(self):
        """``nccl.bindings.nccl``; `MissingExtraError` (an ``ImportError``) without nccl4py."""
        m = self._module
        if m is None:
            with self._lock:
                if self._module is None:
                    try:
                        from nccl.bindings import nccl as m
                    except ImportError as exc:
                        raise MissingExtraError(
                            f"NCCL collectives need nccl4py: {INSTALL} ({exc})") from exc
                    nvls_off()
                    self._module = m
                m = self._module
        return m

    def available(self) -> bool:
        """True when nccl4py imports and loads libnccl (``ncclGetVersion`` answers)."""
        try:
            self.version()
        except Exception:  # noqa: BLE001 - any failure means "not usable here"
            return False
        return True

    def _call(self, name: str, *args):
        fn = getattr(self.module, name)
        try:
            return fn(*args)
        except Exception as exc:  # the binding's NCCLError, or a library that failed to load
            raise self._error(name, exc) from exc

    @staticmethod
    def _error(name: str, exc: Exception) -> NcclError:
        code = getattr(exc, "status", None)
        if code is None:
            code = next((a for a in getattr(exc, "args", ()) if isinstance(a, int)), -1)
        return NcclError(_CALLS.get(name, name), int(code), _result_name(int(code))
                         if int(code) >= 0 else type(exc).__name__, str(exc))

    # -- element types and operators ------------------------------------------------------

    def dtype(self, name: str) -> int:
        """NCCL's ``ncclDataType_t`` for an orchestra dtype name (``"float32"``)."""
        return int(getattr(self.module.DataType, _DTYPES[name]))

    def op(self, name: str) -> int:
        """NCCL's ``ncclRedOp_t`` for ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"avg"``."""
        return int(getattr(self.module.RedOp, _OPS[name]))

    # -- communicators ----------------------------------------------------------------------

    def version(self) -> int:
        """``ncclGetVersion``: e.g. 23203 for NCCL 2.32.3."""
        return int(self._call("get_version"))

    def get_unique_id(self) -> bytes:
        """``ncclGetUniqueId``: the 128 bytes every rank passes to `comm_init_rank`."""
        return bytes(self._call("get_unique_id"))

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int):
        """``ncclCommInitRank`` on the current device (through ``ncclCommInitRankScalable``
        with one id): the communicator handle. Blocks until every rank has called it."""
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise NcclUsageError(f"a NCCL unique id has {UNIQUE_ID_BYTES} bytes; got "
                                 f"{len(unique_id)}")
        # ncclCommInitRankScalable with one id: ncclCommInitRank's semantics, and the entry
        # nccl4py's own Communicator.init uses (a bytes-like array of ids, no config)
        return self._call("comm_init_rank_scalable", int(nranks), int(rank), 1,
                          bytearray(unique_id), 0)

    def comm_init_all(self, devices) -> list:
        """``ncclCommInitAll``: one communicator per device of ``devices`` (rank i on
        ``devices[i]``), in one call."""
        devices = [int(d) for d in devices]
        return list(self._call("comm_init_all", len(devices), devices))

    def comm_destroy(self, comm) -> None:
        """``ncclCommDestroy`` (waits for the communicator's queued operations)."""
        self._call("comm_destroy", comm)

    def group_start(self) -> None:
        self._call("group_start")

    def group_end(self) -> None:
        self._call("group_end")

    # -- operations (enqueued on ``stream``, a CUstream as an int) ----------------------------

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm,
                   stream: int) -> None:
        self._call("all_reduce", send, recv, count, dtype, op, comm, stream)

    def all_gather(self, send: int, recv: int, count: int, dtype: int, comm, stream: int) -> None:
        self._call("all_gather", send, recv, count, dtype, comm, stream)

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: int, op: int, comm,
                       stream: int) -> None:
        self._call("reduce_scatter", send, recv, count, dtype, op, comm, stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm,
                  stream: int) -> None:
        self._call("broadcast", send, recv, count, dtype, root, comm, stream)

    def send(self, buf: int, count: int, dtype: int, peer: int, comm, stream: int) -> None:
        self._call("send", buf, count, dtype, peer, comm, stream)

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm, stream: int) -> None:
        self._call("recv", buf, count, dtype, peer, comm, stream)

    def __repr__(self) -> str:
        return "<NcclAPI over nccl4py>"


_default_lock = threading.Lock()
_default: NcclAPI | None = None


def default_nccl() -> NcclAPI:
    """The process's `NcclAPI` (nccl4py unless `use_nccl` swapped it)."""
    global _default
    api = _default
    if api is None:
        with _default_lock:
            if _default is None:
                _default = NcclAPI()
            api = _default
    return api


@contextlib.contextmanager
def use_nccl(api):
    """Make ``api`` the process's `NcclAPI` inside the block (tests swap in a fake)."""
    global _default
    with _default_lock:
        previous, _default = _default, api
    try:
        yield api
    finally:
        with _default_lock:
            _default = previous


__all__ = ["INSTALL", "NcclAPI", "UNIQUE_ID_BYTES", "default_nccl", "nvls_off", "use_nccl"]

"""The NCCL layer's errors (members of the orchestra family, docs/errors.md)."""

from __future__ import annotations

from orchestra.errors import CudaError, OrchestraError


class NcclError(CudaError):
    """An NCCL call failed: ``call`` (``"ncclAllReduce"``...), ``code`` (the ``ncclResult_t``),
    ``name`` (``"ncclInvalidArgument"``...), ``message`` (NCCL's own text), ``context`` (the
    node or rank). A `CudaError`, so the executors name the node it failed on."""


class NcclUsageError(OrchestraError, ValueError):
    """A communicator used in a way NCCL cannot run: a rank or device out of range, a closed
    communicator, two ranks of one communicator in one plan (one thread would have to issue
    both: run one rank per thread or per process), a unique id of the wrong size."""


class BootstrapError(OrchestraError, RuntimeError):
    """The exchange of a communicator's unique id failed: the store timed out waiting for
    rank 0, a rank connected to a store of another size, a file store's file is malformed."""


class RankTimeoutError(OrchestraError, TimeoutError):
    """`run_per_device`: a rank's thread did not finish within the timeout (``.ranks``)."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self):
        return (type(self), (str(self), self.ranks))


__all__ = ["BootstrapError", "NcclError", "NcclUsageError", "RankTimeoutError"]

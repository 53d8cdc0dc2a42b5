"""`orchestra bench multigpu`: peer copies, NCCL all-reduce and the data-parallel step against
cuda-python and NCCL driven directly (docs/multigpu.md)."""

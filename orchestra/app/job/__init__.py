"""The main job (``orchestra run``): batches of alloc -> H2D -> kernel -> D2H -> free over
pinned host memory, three-way overlapped, timed against the fill-aware bound and verified
against numpy. `graphs` builds its task graphs without a GPU (``orchestra plan``)."""

from orchestra.app.job.graphs import (
    BURN_PARAMS,
    JobGraph,
    batch_bytes_from_mib,
    batch_sizes,
    build_job_graph,
    build_staged_graph,
    burn_grid,
    burn_kernel_ref,
    job_costs,
)
from orchestra.app.job.inputs import InputArray, open_input
from orchestra.app.job.bound import PipelineBound, Sustained, bound_warning, pipeline_bound
from orchestra.app.job.main_job import JobReport, MainJob, parse_iters
from orchestra.app.job.timing import SingleBatch, calibrate_iters

__all__ = [
    "BURN_PARAMS", "InputArray", "JobGraph", "JobReport", "MainJob", "PipelineBound",
    "SingleBatch", "Sustained", "batch_bytes_from_mib", "batch_sizes", "bound_warning",
    "build_job_graph", "build_staged_graph", "burn_grid",
    "burn_kernel_ref", "calibrate_iters", "job_costs", "open_input", "parse_iters",
    "pipeline_bound",
]

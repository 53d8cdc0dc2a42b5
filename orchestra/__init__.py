"""orchestra: orchestrate CUDA work at the driver-API level.

Layers (imports point downward only): `driver` -> `compiler`; `graph` -> `schedule` (pure
Python); `trace` (analysis in plain Python, recorders on `driver`); `execute` (uses all of
those) -> `job` -> `cli`. See docs/ARCHITECTURE.md.
"""

from orchestra.errors import (  # noqa: F401
    CompileError,
    CudaError,
    GraphError,
    HazardError,
    NoDeviceError,
    OrchestraError,
)

__version__ = "0.1.0"

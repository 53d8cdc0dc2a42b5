"""orchestra.app: the applications built on the library, which the CLI runs.

- `job`: the main job (``orchestra run`` / ``orchestra plan``): batches of alloc -> H2D ->
  kernel -> D2H -> free, timed against the overlap bound and verified against numpy.
- `kernels_bench`: the kernel library's Python side (``cuda_src/``, ``ptx/``): catalog, numpy
  references, the programmatic-dependent-launch check, ``orchestra bench``.

Nothing in the library packages (`driver`, `compiler`, `kernel`, `graph`, `schedule`,
`trace`, `execute`) imports this package.
"""

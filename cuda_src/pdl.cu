// pdl.cu - programmatic dependent launch (PDL), compute capability 9.0+.
//
// CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization": a secondary kernel
// launched with the launch attribute PROGRAMMATIC_STREAM_SERIALIZATION may start before the
// primary kernel ahead of it in the stream has finished - as soon as every block of the primary
// has executed griddepcontrol.launch_dependents (cudaTriggerProgrammaticLaunchCompletion()) or
// exited. Its blocks may therefore run before the primary's writes are visible, so a secondary
// launched that way must execute griddepcontrol.wait (cudaGridDependencySynchronize()) before it
// reads anything the primary writes: the wait blocks until the prerequisite grids have completed
// and their memory operations are performed and visible. Launched without the attribute, the
// kernel only starts after the previous one finished and the wait returns at once.
// The PTX instructions are used directly (they are what the two runtime device functions expand
// to), so the kernels need no runtime header; griddepcontrol needs sm_90 (PTX ISA 7.8).
//
// A PDL launch attribute on a consumer that never waits: a kernel's PTX either contains
// griddepcontrol.wait or not; orchestra.kernels_bench.pdl.kernel_waits_on_grid_dependency() scans
// the PTX and bench/tests apply PDL only to kernels that wait. pdl_secondary_nowait below is the
// negative example for that check and must never be launched with the PDL attribute.
//
// Kernels (all extern "C"; block: 1-D, any size up to 1024, 256 suggested; grid: 1-D,
// ceil(n / blockDim.x) blocks or fewer - the element loops are grid-stride; dynamic shared memory:
// 0; x/y/z float-aligned, not overlapping; sm_90):
//   pdl_primary(const float* x, float* y, unsigned long long n)
//       triggers its dependents first, then y[i] = 3 * x[i]. Launch normally.
//   pdl_secondary(const float* y, const float* w, float* z, unsigned long long n)
//       independent preamble (loads w), then waits on the grid dependency, then z[i] = y[i] + w[i].
//       Launch right after pdl_primary in the same stream, with or without the PDL attribute.
//   pdl_secondary_nowait(...)   same without the wait: NOT safe with the PDL attribute.
//   pdl_chain_step(const float* x, float* y, unsigned long long n)
//       trigger, wait, y[i] = x[i] + 1: one link of the `orchestra bench pdl` chain (launch k
//       reads what launch k - 1 wrote; ping-pong two buffers). PDL attribute optional. The
//       trigger comes first, before the link's own wait: legal, because the next link's
//       griddepcontrol.wait still waits for this whole grid to complete and flush; it lets the
//       next link be launched and made resident while this one waits, so only the wait's
//       release is left on the chain's critical path.
//   pdl_chain_step_after_wait(const float* x, float* y, unsigned long long n)
//       the same link with the trigger after the wait (wait, trigger, y[i] = x[i] + 1): at most
//       one dependent is launched ahead. `orchestra bench pdl` times both placements.
//   pdl_spin(unsigned long long ns)
//       one thread spins ns nanoseconds on %globaltimer: holds a stream while the host enqueues a
//       long chain, so the chain is timed on the GPU and not at the host's launch rate.
//       Launch <<<1, 1>>>.

__device__ __forceinline__ void grid_dependency_wait()
{
    asm volatile("griddepcontrol.wait;" ::: "memory");  // = cudaGridDependencySynchronize()
}

__device__ __forceinline__ void trigger_dependents()
{
    asm volatile("griddepcontrol.launch_dependents;" :::);  // = cudaTriggerProgrammaticLaunchCompletion()
}

extern "C" __global__ void pdl_primary(const float* __restrict__ x, float* __restrict__ y,
                                       unsigned long long n)
{
    // Early trigger: lets the secondary get scheduled and run its preamble now. Safe because the
    // secondary's griddepcontrol.wait still waits for this whole grid to finish and flush.
    trigger_dependents();
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        y[i] = 3.0f * x[i];
}

extern "C" __global__ void pdl_secondary(const float* __restrict__ y, const float* __restrict__ w,
                                         float* __restrict__ z, unsigned long long n)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    // Preamble that does not depend on the primary: may overlap it.
    const float w0 = first < n ? w[first] : 0.0f;
    grid_dependency_wait();  // the primary's y is complete and visible after this
    for (unsigned long long i = first; i < n; i += stride)
        z[i] = y[i] + (i == first ? w0 : w[i]);
}

extern "C" __global__ void pdl_secondary_nowait(const float* __restrict__ y,
                                                const float* __restrict__ w,
                                                float* __restrict__ z, unsigned long long n)
{
    // Deliberately no griddepcontrol.wait: correct only when launched WITHOUT the PDL attribute.
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        z[i] = y[i] + w[i];
}

extern "C" __global__ void pdl_chain_step(const float* __restrict__ x, float* __restrict__ y,
                                          unsigned long long n)
{
    trigger_dependents();    // the next link may launch now ...
    grid_dependency_wait();  // ... but this one reads x (and overwrites y) only after the previous
                             // link - which read y two launches ago - has completed
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        y[i] = x[i] + 1.0f;
}

extern "C" __global__ void pdl_chain_step_after_wait(const float* __restrict__ x,
                                                     float* __restrict__ y, unsigned long long n)
{
    grid_dependency_wait();  // the previous link has completed: x is final, y is free
    trigger_dependents();    // only now may the next link launch
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        y[i] = x[i] + 1.0f;
}

extern "C" __global__ void pdl_spin(unsigned long long ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

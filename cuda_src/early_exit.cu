// early_exit.cu - leaving a pipeline early with cuda::pipeline::quit() while the other threads
// of the block carry on (CUDA Programming Guide, "Pipelines: Early Exit": a thread that must exit
// early drops out of participation with quit(); the remaining threads proceed normally).
//
// Both kernels work on a ragged (CSR) array: segment s is x[offsets[s] .. offsets[s + 1]), so the
// owners of different segments run different numbers of pipeline iterations and leave at
// different times.
//
// What quit() does and does not do (libcu++ <cuda/pipeline>): it gives up the calling thread's
// share of the pipeline's shared state (the last thread to quit destroys the stage barriers). It
// does not lower the stage barriers' expected arrival counts. So a thread may quit once it has done
// its last operation on the pipeline, and only if nobody still needs its arrivals: true for a
// thread-scope pipeline (kernel 1: each thread leaves on its own) and for a shared pipeline whose
// whole group leaves together (kernel 2: one pipeline per warp, the warp leaves as a unit while
// other warps of the block keep going). Before leaving, a thread drains its copies so no
// asynchronous write into shared memory outlives it.
//
// Kernel 1: early_exit_segments - one thread per segment, thread-scope pipeline,
//   y[i] = inclusive prefix sum of the segment up to i (sequential float32 adds, in order).
//   params:  (const float* x, float* y, const unsigned int* offsets, unsigned int nseg)
//   block:   1-D, any size up to 1024 (128 suggested)
//   dynamic shared memory: EE_STAGES * EE_CHUNK * blockDim.x * 4 bytes (= blockDim.x * 32)
//   grid:    ceil(nseg / blockDim.x) blocks (thread t of the grid owns segment t)
//
// Kernel 2: early_exit_warps - one warp per segment, one block-scope *unified* pipeline per warp
//   (made over tiled_partition<32>, shared state per warp), sums[s] = sum of segment s. Each lane
//   adds the float its neighbour lane copied, so the per-warp pipeline's cross-thread visibility
//   is what makes the sum right.
//   params:  (const float* x, float* sums, const unsigned int* offsets, unsigned int nseg)
//   block:   1-D, a multiple of 32, up to 1024 threads (EE_MAX_WARPS warps)
//   dynamic shared memory: EE_STAGES * blockDim.x * 4 bytes
//   grid:    ceil(nseg * 32 / blockDim.x) blocks (global warp w owns segment w)
//
// Both: offsets has nseg + 1 non-decreasing entries with offsets[nseg] = number of floats;
// x/y float-aligned, not overlapping; segments of length 0 are fine. attributes: none. sm_80+.

#include <cuda/pipeline>
#include <cooperative_groups.h>

#pragma nv_diag_suppress static_var_with_dynamic_init

namespace cg = cooperative_groups;

#define EE_STAGES 2
#define EE_CHUNK 4      // floats per thread per stage in kernel 1
#define EE_MAX_WARPS 32

extern "C" __global__ void early_exit_segments(const float* __restrict__ x, float* __restrict__ y,
                                               const unsigned int* __restrict__ offsets,
                                               unsigned int nseg)
{
    extern __shared__ float ee_ring[];  // [EE_STAGES][EE_CHUNK][blockDim.x]: conflict-free
    cuda::pipeline<cuda::thread_scope_thread> pipe = cuda::make_pipeline();

    const unsigned long long s = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nseg) {  // no segment: leave at once
        pipe.quit();
        return;
    }
    const unsigned begin = offsets[s], len = offsets[s + 1] - begin;
    const unsigned chunks = (len + EE_CHUNK - 1) / EE_CHUNK;  // this thread's iteration count
    auto slot = [&](unsigned c, unsigned e) -> float& {
        return ee_ring[((c % EE_STAGES) * EE_CHUNK + e) * blockDim.x + threadIdx.x];
    };
    auto produce = [&](unsigned c) {
        pipe.producer_acquire();
        for (unsigned e = 0; e < EE_CHUNK && c < chunks && c * EE_CHUNK + e < len; ++e)
            cuda::memcpy_async(&slot(c, e), x + begin + c * EE_CHUNK + e, sizeof(float), pipe);
        pipe.producer_commit();
    };

    for (unsigned c = 0; c < EE_STAGES - 1; ++c)
        produce(c);
    float running = 0.0f;
    for (unsigned c = 0; c < chunks; ++c) {
        produce(c + EE_STAGES - 1);
        cuda::pipeline_consumer_wait_prior<EE_STAGES - 1>(pipe);
        for (unsigned e = 0; e < EE_CHUNK && c * EE_CHUNK + e < len; ++e) {
            running += slot(c, e);
            y[begin + c * EE_CHUNK + e] = running;
        }
        pipe.consumer_release();
    }
    // Early exit: this thread's segment is done; the other threads of the block carry on.
    cuda::pipeline_consumer_wait_prior<0>(pipe);  // drain (only empty batches are left)
    pipe.quit();
}

extern "C" __global__ void early_exit_warps(const float* __restrict__ x, float* __restrict__ sums,
                                            const unsigned int* __restrict__ offsets,
                                            unsigned int nseg)
{
    extern __shared__ float ee_warp_buf[];  // [EE_STAGES][blockDim.x]: one 32-float chunk per warp
    __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, EE_STAGES> states[EE_MAX_WARPS];

    const auto warp = cg::tiled_partition<32>(cg::this_thread_block());
    const unsigned wib = threadIdx.x / 32, lane = warp.thread_rank();
    const unsigned long long s = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;

    // A unified pipeline of this warp alone (never the block's: warps leave at different times).
    cuda::pipeline<cuda::thread_scope_block> pipe = cuda::make_pipeline(warp, &states[wib]);
    if (s >= nseg) {  // the whole warp has nothing to do
        pipe.quit();
        return;
    }
    const unsigned begin = offsets[s], len = offsets[s + 1] - begin;
    const unsigned chunks = (len + 31) / 32;  // warp-uniform iteration count
    auto produce = [&](unsigned c) {
        if (c >= chunks) return;
        pipe.producer_acquire();
        if (c * 32 + lane < len)
            cuda::memcpy_async(&ee_warp_buf[(c % EE_STAGES) * blockDim.x + wib * 32 + lane],
                               x + begin + c * 32 + lane, sizeof(float), pipe);
        pipe.producer_commit();
    };

    for (unsigned c = 0; c < EE_STAGES; ++c)
        produce(c);
    float partial = 0.0f;
    for (unsigned c = 0; c < chunks; ++c) {
        pipe.consumer_wait();
        const unsigned j = (lane + 1) % 32;  // the float the next lane copied
        if (c * 32 + j < len)
            partial += ee_warp_buf[(c % EE_STAGES) * blockDim.x + wib * 32 + j];
        pipe.consumer_release();
        produce(c + EE_STAGES);
    }
    // Early exit of the whole warp: every lane has done its last pipeline operation.
    pipe.quit();
    for (int off = 16; off > 0; off /= 2)
        partial += warp.shfl_down(partial, off);
    if (lane == 0)
        sums[s] = partial;
}

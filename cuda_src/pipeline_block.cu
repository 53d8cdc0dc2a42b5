// pipeline_block.cu - a block-scope *unified* cuda::pipeline with the stage count as a template
// parameter: y[i] = a * x[i] + b over a large float array.
//
// Technique (CUDA Programming Guide, "Pipelines"; libcu++ cuda::pipeline): every thread of the
// block is both producer and consumer of one pipeline made with
// cuda::make_pipeline(this_thread_block(), &shared_state). Each stage holds one tile of
// blockDim.x * PB_VEC float4 staged into shared memory with 16-byte cuda::memcpy_async
// (cp.async.cg). Prologue: fill up to STAGES stages. Steady state: wait for the oldest stage,
// compute it, release it, refill it with the tile STAGES ahead. Epilogue: the last STAGES tiles
// drain with nothing left to fetch. Blocks walk the tiles grid-stride.
//
// Launch requirements
//   kernel (NVRTC name expressions): pipeline_block<1>, pipeline_block<2>, pipeline_block<3>,
//                                    pipeline_block<4>
//   params:  (const float* x, float* y, unsigned long long n, float a, float b)
//   block:   1-D, a multiple of 32, at most 1024 threads; 256 is the tuned value. All threads of
//            the block must reach make_pipeline and run the whole loop (unified pipeline: no
//            thread may return early).
//   dynamic shared memory: STAGES * blockDim.x * PB_VEC * 16 bytes
//            (= STAGES * blockDim.x * 32 with PB_VEC = 2; 32 KiB for STAGES=4, block 256).
//            Above 48 KiB set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first.
//   grid:    1-D, any size >= 1 (grid-stride over tiles); best is SM count x the occupancy
//            (cuOccupancyMaxActiveBlocksPerMultiprocessor) for that block and shared memory.
//   x, y:    16-byte aligned (cuMemAlloc gives 256), not overlapping. Any n (ragged tail: the
//            n % 4 last floats are done by plain loads in block 0).
//   attributes: none. Target sm_80+ (cp.async); tuned for sm_90.
//
// Why the consumer reads another warp's data: the rotation below makes every thread read floats
// that a different warp copied, so the result is only right because consumer_wait() makes the
// whole block's copies of that stage visible - the property a block-scope pipeline exists for.
//
// End of life: every committed stage is waited on (consumer_wait) before the thread quits, so no
// cp.async is in flight when the last thread to quit invalidates the stage barriers; the last
// STAGES releases are never waited on (nobody refills those stages), which is not an error.
// compute-sanitizer synccheck older than 2025.4, or any version on a cubin from NVRTC 13.0,
// reports "Missing wait" at producer_commit(): a known false positive on libcu++'s
// cp.async.mbarrier.arrive without .noinc (docs/kernels.md).

#include <cuda/pipeline>
#include <cooperative_groups.h>

// A __shared__ pipeline_shared_state has a (trivial, defaulted) constructor; the guide suppresses
// this diagnostic the same way.
#pragma nv_diag_suppress static_var_with_dynamic_init

namespace cg = cooperative_groups;

// float4 per thread per stage: 32 bytes per thread, 8 KiB per stage for a 256-thread block.
// With several blocks per SM this keeps well over the ~25 KiB per SM in flight that HBM3e needs.
#define PB_VEC 2

template <int STAGES>
__global__ void pipeline_block(const float* __restrict__ x, float* __restrict__ y,
                               unsigned long long n, float a, float b)
{
    static_assert(STAGES >= 1 && STAGES <= 4, "pipeline_block supports 1..4 stages");
    extern __shared__ float4 pb_stage_buf[];  // STAGES tiles of tile_vecs float4
    __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, STAGES> state;

    auto block = cg::this_thread_block();
    cuda::pipeline<cuda::thread_scope_block> pipe = cuda::make_pipeline(block, &state);

    const unsigned tid = threadIdx.x;
    const unsigned bdim = blockDim.x;
    const unsigned tile_vecs = bdim * PB_VEC;
    const unsigned long long nvec = n / 4;  // whole float4 in x
    const unsigned long long ntiles = (nvec + tile_vecs - 1) / tile_vecs;
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
    float4* __restrict__ y4 = reinterpret_cast<float4*>(y);

    // Scalar tail (n % 4 floats): outside every tile, so no pipeline involvement.
    if (blockIdx.x == 0 && tid < (unsigned)(n & 3)) {
        const unsigned long long i = nvec * 4 + tid;
        y[i] = a * x[i] + b;
    }

    // Tiles of this block: blockIdx.x, blockIdx.x + gridDim.x, ... (block-uniform count, so
    // every thread runs the same number of pipeline operations).
    const unsigned long long my_tiles =
        blockIdx.x < ntiles ? (ntiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;

    // Producer side of one tile: acquire its stage, issue the 16-byte copies, commit.
    auto fetch = [&](unsigned long long k) {
        const unsigned long long base = (blockIdx.x + k * gridDim.x) * tile_vecs;
        float4* buf = pb_stage_buf + (k % STAGES) * tile_vecs;
        pipe.producer_acquire();
#pragma unroll
        for (int v = 0; v < PB_VEC; ++v) {
            const unsigned idx = v * bdim + tid;
            if (base + idx < nvec)
                cuda::memcpy_async(buf + idx, x4 + base + idx, cuda::aligned_size_t<16>(16), pipe);
        }
        pipe.producer_commit();
    };

    // Consumer side: read a float4 copied by the thread one warp further on (see header).
    const unsigned rot = (tid + 32) % bdim;
    auto compute = [&](unsigned long long k) {
        const unsigned long long base = (blockIdx.x + k * gridDim.x) * tile_vecs;
        const float4* buf = pb_stage_buf + (k % STAGES) * tile_vecs;
#pragma unroll
        for (int v = 0; v < PB_VEC; ++v) {
            const unsigned idx = v * bdim + rot;
            if (base + idx < nvec) {
                const float4 in = buf[idx];
                y4[base + idx] = make_float4(a * in.x + b, a * in.y + b, a * in.z + b, a * in.w + b);
            }
        }
    };

    // Prologue: put up to STAGES tiles in flight.
    unsigned long long fetched = 0;
    for (; fetched < (unsigned long long)STAGES && fetched < my_tiles; ++fetched)
        fetch(fetched);

    for (unsigned long long k = 0; k < my_tiles; ++k) {
        pipe.consumer_wait();     // oldest stage: every thread's copies have landed
        compute(k);
        pipe.consumer_release();  // its buffer may be overwritten
        if (fetched < my_tiles) { // steady state: refill the stage just released
            fetch(fetched);
            ++fetched;
        }                         // epilogue: nothing left to fetch, the stages drain
    }
    // ~pipeline() quits; the last thread to quit releases the shared state.
}

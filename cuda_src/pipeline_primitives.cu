// pipeline_primitives.cu - the primitive pipeline interface (<cuda_pipeline.h>):
// __pipeline_memcpy_async, __pipeline_commit, __pipeline_wait_prior.
//
// Computes, tile by tile (a tile = blockDim.x * 4 floats; the last tile may be shorter, length L):
//   y[t0 + j] = 0.5f * (x[t0 + j] + x[t0 + L - 1 - j])      for 0 <= j < L
// i.e. each float is averaged with its mirror image inside its tile. The mirror element was
// copied by another thread, so this is also the pattern for sharing primitive-pipeline data across
// a block: __pipeline_wait_prior only covers the calling thread's own copies, and a
// __syncthreads() after it publishes every thread's copies to the block (guide, "Tracking
// Asynchronous Memory Operations").
//
// Per block: PP_STAGES tile buffers, tiles grid-stride. Each iteration commits the tile
// PP_STAGES - 1 ahead, then __pipeline_wait_prior(PP_STAGES - 1) + __syncthreads() makes the
// current tile complete; a second __syncthreads() after the compute keeps the next refill of this
// buffer from overwriting data another thread is still reading.
// Ragged tail: whole float4 go as 16-byte copies; in the last, partial float4 of a tile each float
// is a 4-byte copy, so nothing past n is read.
//
// Launch requirements
//   kernel:  pipeline_primitives (extern "C")
//   params:  (const float* x, float* y, unsigned long long n)
//   block:   1-D, any size up to 1024 (256 suggested); every thread must run the whole loop
//            (__syncthreads inside)
//   dynamic shared memory: PP_STAGES * blockDim.x * 16 bytes (= blockDim.x * 48, PP_STAGES = 3)
//   grid:    1-D, any size >= 1 (grid-stride over tiles)
//   x, y:    16-byte aligned, not overlapping; any n.
//   attributes: none. sm_80+.

#include <cuda_pipeline.h>

#define PP_STAGES 3

extern "C" __global__ void pipeline_primitives(const float* __restrict__ x, float* __restrict__ y,
                                               unsigned long long n)
{
    extern __shared__ float4 pp_tiles[];  // [PP_STAGES][blockDim.x] float4
    const unsigned tile = blockDim.x * 4;  // floats per tile
    const unsigned long long ntiles = (n + tile - 1) / tile;
    const unsigned long long my_tiles =
        blockIdx.x < ntiles ? (ntiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;  // block-uniform

    // Issue this thread's part of the block's k-th tile into buffer k % PP_STAGES, then commit.
    auto produce = [&](unsigned long long k) {
        if (k < my_tiles) {
            const unsigned long long t0 = (blockIdx.x + k * gridDim.x) * (unsigned long long)tile;
            const unsigned long long len = n - t0 < tile ? n - t0 : tile;
            float4* dst4 = pp_tiles + (k % PP_STAGES) * blockDim.x + threadIdx.x;
            const unsigned j = threadIdx.x * 4;
            if (j + 4 <= len) {
                __pipeline_memcpy_async(dst4, x + t0 + j, 16);
            } else {
                float* dst = reinterpret_cast<float*>(dst4);
                for (unsigned e = 0; j + e < len; ++e)
                    __pipeline_memcpy_async(dst + e, x + t0 + j + e, 4);
            }
        }
        __pipeline_commit();  // empty batches keep the batch count uniform
    };

    for (unsigned long long k = 0; k < PP_STAGES - 1; ++k)  // prologue
        produce(k);

    for (unsigned long long k = 0; k < my_tiles; ++k) {
        produce(k + PP_STAGES - 1);  // that buffer was last read before the previous barrier
        __pipeline_wait_prior(PP_STAGES - 1);  // this thread's copies of tile k are done
        __syncthreads();                      // ... and so are everybody else's

        const unsigned long long t0 = (blockIdx.x + k * gridDim.x) * (unsigned long long)tile;
        const unsigned long long len = n - t0 < tile ? n - t0 : tile;
        const float* buf = reinterpret_cast<const float*>(pp_tiles + (k % PP_STAGES) * blockDim.x);
        for (unsigned j = threadIdx.x; j < len; j += blockDim.x)
            y[t0 + j] = 0.5f * (buf[j] + buf[len - 1 - j]);
        __syncthreads();  // all reads of this buffer are done before it is refilled
    }
    __pipeline_wait_prior(0);  // no copy may be in flight when the block exits
}

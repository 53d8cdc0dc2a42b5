// pipeline_thread.cu - a thread-scope cuda::pipeline (one per thread, cuda::make_pipeline())
// waited on with cuda::pipeline_consumer_wait_prior<N>: y[i] = x[i] * x[i] - c.
//
// Technique (CUDA Programming Guide, "Pipelines": consuming work with
// pipeline_consumer_wait_prior<N>): each thread streams its own float4 slots grid-stride through
// a private ring of PT_STAGES shared-memory slots. It keeps PT_STAGES - 1 batches in flight:
// every iteration it commits the batch PT_STAGES - 1 ahead, then
// pipeline_consumer_wait_prior<PT_STAGES - 1> waits for everything except the newest
// PT_STAGES - 1 batches, i.e. for the batch it is about to use. A thread only ever reads the slots
// it filled itself, so no block synchronization is needed.
//
// Warp entanglement (guide, "Warp Entanglement"): commits are kept converged - every thread of the
// grid runs the same number of iterations (a grid-uniform round count) and commits a batch every
// iteration, empty when its slot is past the end - so no thread over-waits.
//
// Launch requirements
//   kernel:  pipeline_thread (extern "C")
//   params:  (const float* x, float* y, unsigned long long n, float c)
//   block:   1-D, any size up to 1024 (256 suggested)
//   dynamic shared memory: PT_STAGES * blockDim.x * 16 bytes (= blockDim.x * 64, PT_STAGES = 4)
//   grid:    1-D, any size >= 1 (grid-stride)
//   x, y:    16-byte aligned, not overlapping; any n (the n % 4 tail floats use plain loads).
//   attributes: none. sm_80+.

#include <cuda/pipeline>

#define PT_STAGES 4

extern "C" __global__ void pipeline_thread(const float* __restrict__ x, float* __restrict__ y,
                                           unsigned long long n, float c)
{
    extern __shared__ float4 pt_ring[];  // [PT_STAGES][blockDim.x]
    cuda::pipeline<cuda::thread_scope_thread> pipe = cuda::make_pipeline();

    const unsigned long long nvec = n / 4;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long rounds = (nvec + stride - 1) / stride;  // same for every thread
    const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
    float4* __restrict__ y4 = reinterpret_cast<float4*>(y);

    if (first < (n & 3)) {  // scalar tail
        const unsigned long long i = nvec * 4 + first;
        y[i] = x[i] * x[i] - c;
    }

    // Batch r copies slot first + r * stride into ring slot r % PT_STAGES (if in range).
    auto produce = [&](unsigned long long r) {
        pipe.producer_acquire();
        const unsigned long long i = first + r * stride;
        if (r < rounds && i < nvec)
            cuda::memcpy_async(&pt_ring[(r % PT_STAGES) * blockDim.x + threadIdx.x], x4 + i,
                               cuda::aligned_size_t<16>(16), pipe);
        pipe.producer_commit();  // an empty batch keeps the per-thread count uniform
    };

    // Prologue: PT_STAGES - 1 batches in flight.
    for (unsigned long long r = 0; r < PT_STAGES - 1; ++r)
        produce(r);

    for (unsigned long long r = 0; r < rounds; ++r) {
        produce(r + PT_STAGES - 1);  // its slot was read (by this thread) in iteration r - 1
        cuda::pipeline_consumer_wait_prior<PT_STAGES - 1>(pipe);  // batch r has landed
        const unsigned long long i = first + r * stride;
        if (i < nvec) {
            const float4 v = pt_ring[(r % PT_STAGES) * blockDim.x + threadIdx.x];
            y4[i] = make_float4(v.x * v.x - c, v.y * v.y - c, v.z * v.z - c, v.w * v.w - c);
        }
        pipe.consumer_release();
    }
    // Nothing may still be writing shared memory when the block exits.
    cuda::pipeline_consumer_wait_prior<0>(pipe);
}

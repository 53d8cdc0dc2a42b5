// producer_consumer.cu - a *partitioned* block-scope cuda::pipeline: the first half of the block
// produces (asynchronous copies global -> shared), the second half consumes:
//   out[i] = 2 * in[i] + 1
//
// Technique (CUDA Programming Guide, "Producer-Consumer Pattern using Pipelines"): one
// partitioned pipeline, PC_STAGES stages, one shared buffer of buffer_len floats per stage,
// created with cuda::make_pipeline(block, &shared_state, producer_count). Producers fill the
// pipeline, then in the main loop prefetch batch b + PC_STAGES while the consumers process batch b.
//
// Unlike the guide's sketch (num_batches = N / buffer_len, which drops the remainder), the number
// of batches is ceil(N / buffer_len) and the last batch is short, so any N is handled. Batches
// are shared among blocks grid-stride (batch blockIdx.x + k * gridDim.x); each block has its own
// pipeline. Copies are 4 bytes each (cp.async.ca), so in/out need only float alignment.
//
// Launch requirements
//   kernel:  producer_consumer (extern "C")
//   params:  (const float* in, float* out, unsigned long long N, unsigned int buffer_len)
//   block:   1-D, even size, 64..1024; a multiple of 64 keeps each role warp-uniform (128 suggested)
//   dynamic shared memory: PC_STAGES * buffer_len * 4 bytes (PC_STAGES = 2)
//   grid:    1-D, any size >= 1
//   buffer_len >= 1; in/out float-aligned, not overlapping; any N.
//   attributes: none. sm_80+.

#include <cuda/pipeline>
#include <cooperative_groups.h>

#pragma nv_diag_suppress static_var_with_dynamic_init

namespace cg = cooperative_groups;

#define PC_STAGES 2

extern "C" __global__ void producer_consumer(const float* __restrict__ in, float* __restrict__ out,
                                             unsigned long long N, unsigned int buffer_len)
{
    extern __shared__ float pc_buffer[];  // [PC_STAGES][buffer_len]
    __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, PC_STAGES> shared_state;

    auto block = cg::this_thread_block();
    const unsigned producer_count = blockDim.x / 2;
    const bool is_producer = threadIdx.x < producer_count;
    cuda::pipeline<cuda::thread_scope_block> pipe =
        cuda::make_pipeline(block, &shared_state, (cuda::std::size_t)producer_count);

    const unsigned long long num_batches = (N + buffer_len - 1) / buffer_len;
    const unsigned long long my_batches =
        blockIdx.x < num_batches ? (num_batches - 1 - blockIdx.x) / gridDim.x + 1 : 0;

    // The k-th batch of this block: global offset and (possibly short) length.
    auto batch_offset = [&](unsigned long long k) {
        return (blockIdx.x + k * gridDim.x) * (unsigned long long)buffer_len;
    };
    auto batch_length = [&](unsigned long long k) {
        const unsigned long long off = batch_offset(k);
        return N - off < buffer_len ? N - off : (unsigned long long)buffer_len;
    };

    auto produce = [&](unsigned long long k) {
        if (k >= my_batches) return;
        pipe.producer_acquire();
        float* buf = pc_buffer + (k % PC_STAGES) * buffer_len;
        const unsigned long long off = batch_offset(k), len = batch_length(k);
        for (unsigned long long j = threadIdx.x; j < len; j += producer_count)
            cuda::memcpy_async(buf + j, in + off + j, sizeof(float), pipe);
        pipe.producer_commit();
    };

    auto consume = [&](unsigned long long k) {
        pipe.consumer_wait();
        const float* buf = pc_buffer + (k % PC_STAGES) * buffer_len;
        const unsigned long long off = batch_offset(k), len = batch_length(k);
        for (unsigned long long j = threadIdx.x - producer_count; j < len;
             j += blockDim.x - producer_count)
            out[off + j] = 2.0f * buf[j] + 1.0f;
        pipe.consumer_release();
    };

    if (is_producer) {  // fill the pipeline
        for (unsigned long long s = 0; s < PC_STAGES; ++s)
            produce(s);
    }
    for (unsigned long long k = 0; k < my_batches; ++k) {
        if (is_producer)
            produce(k + PC_STAGES);  // prefetch; waits in producer_acquire for a free stage
        else
            consume(k);
    }
    // ~pipeline() quits for each thread; the last one releases the shared state.
}

// warp_specialized.cu - warp specialization: loader, compute and storer warps joined by two
// partitioned block-scope cuda::pipelines.   y[i] = a * x[i] * x[i] + b
//
//   loader warp  --(load pipeline: loader produces, compute consumes)-->  compute warps
//   compute warps --(store pipeline: compute produces, storer consumes)--> storer warp
//
// Each block runs many tiles (WS_TILE floats each, grid-stride). The loader copies a tile
// global -> shared with 16-byte cuda::memcpy_async (cp.async.cg) and a 4-byte copy per float of
// the ragged tail; the compute warps read it, write the result into an output stage with plain
// shared stores and commit it; the storer writes the output stage to global with 16-byte vector
// stores and a scalar tail.
//
// Why each pipeline is made over a group of exactly the warps that use it (and not the block):
// a partitioned pipeline's stage barriers expect an arrival from every producer (produced barrier)
// or every consumer (consumed barrier) of the group it was made with. The storer has no part in
// the load pipeline; had it joined as a "consumer" and then called quit(), the loader would wait
// forever for its releases: in libcu++ quit() gives up the thread's ownership of the shared state
// (the last quitter destroys the barriers), it does not lower the barriers' expected arrival
// counts. So the load pipeline is made over {loader, compute} and the store pipeline over
// {compute, storer}, each group being a ThreadGroup (size / thread_rank / sync, the libcu++ concept)
// whose sync() is a named barrier (bar.sync id, count) covering its warps. A unified pipeline is
// never used by part of its group (DESIGN note). Every participant calls quit() when its role has
// nothing more to do; a warp that takes no part in a pipeline never joins it.
//
// Launch requirements
//   kernel:  warp_specialized (extern "C")
//   params:  (const float* x, float* y, unsigned long long n, float a, float b)
//   block:   exactly WS_THREADS = 192 threads (1 loader + 4 compute + 1 storer warp), 1-D;
//            any other size traps (the roles are fixed to warp numbers)
//   dynamic shared memory: 0 (static: 2 x WS_STAGES x WS_TILE floats = 32 KiB, + 2 pipeline states)
//   grid:    1-D, any size >= 1 (grid-stride over tiles; several tiles per block is the point)
//   x, y:    16-byte aligned, not overlapping; any n.
//   attributes: none. sm_80+. Named barriers 1 and 2 are used (0 is __syncthreads).

#include <cuda/pipeline>

#pragma nv_diag_suppress static_var_with_dynamic_init

#define WS_LOADER_WARPS 1
#define WS_COMPUTE_WARPS 4
#define WS_STORER_WARPS 1
#define WS_THREADS ((WS_LOADER_WARPS + WS_COMPUTE_WARPS + WS_STORER_WARPS) * 32)
#define WS_STAGES 2
#define WS_TILE 2048  // floats per tile (8 KiB), a multiple of 4

// A contiguous range of warps as a libcu++ ThreadGroup; sync() is named barrier `bar_id`.
struct warp_span {
    static constexpr cuda::thread_scope thread_scope = cuda::thread_scope_block;
    unsigned first_warp, num_warps, bar_id;
    __device__ unsigned long long size() const { return num_warps * 32ull; }
    __device__ unsigned long long thread_rank() const { return threadIdx.x - first_warp * 32u; }
    __device__ void sync() const
    {
        asm volatile("bar.sync %0, %1;" ::"r"(bar_id), "r"(num_warps * 32u) : "memory");
    }
};

extern "C" __global__ void __launch_bounds__(WS_THREADS)
warp_specialized(const float* __restrict__ x, float* __restrict__ y, unsigned long long n,
                 float a, float b)
{
    __shared__ __align__(16) float in_stage[WS_STAGES][WS_TILE];
    __shared__ __align__(16) float out_stage[WS_STAGES][WS_TILE];
    __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, WS_STAGES> load_state;
    __shared__ cuda::pipeline_shared_state<cuda::thread_scope_block, WS_STAGES> store_state;

    if (blockDim.x != WS_THREADS || blockDim.y != 1 || blockDim.z != 1)
        __trap();  // roles are tied to warp numbers: a different block shape would deadlock

    const unsigned warp = threadIdx.x / 32;
    const unsigned long long ntiles = (n + WS_TILE - 1) / WS_TILE;
    const unsigned long long my_tiles =
        blockIdx.x < ntiles ? (ntiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    auto tile_start = [&](unsigned long long k) {
        return (blockIdx.x + k * gridDim.x) * (unsigned long long)WS_TILE;
    };
    auto tile_len = [&](unsigned long long k) {
        const unsigned long long t0 = tile_start(k);
        return (unsigned)(n - t0 < WS_TILE ? n - t0 : WS_TILE);
    };

    const warp_span load_group{0, WS_LOADER_WARPS + WS_COMPUTE_WARPS, 1};
    const warp_span store_group{WS_LOADER_WARPS, WS_COMPUTE_WARPS + WS_STORER_WARPS, 2};

    if (warp < WS_LOADER_WARPS) {
        // ---- loader: producer of the load pipeline only ----
        auto load = cuda::make_pipeline(load_group, &load_state, cuda::pipeline_role::producer);
        const unsigned lane = threadIdx.x, lanes = WS_LOADER_WARPS * 32;
        for (unsigned long long k = 0; k < my_tiles; ++k) {
            const unsigned long long t0 = tile_start(k);
            const unsigned len = tile_len(k), nvec = len / 4;
            float* dst = in_stage[k % WS_STAGES];
            load.producer_acquire();
            for (unsigned v = lane; v < nvec; v += lanes)
                cuda::memcpy_async(reinterpret_cast<float4*>(dst) + v,
                                   reinterpret_cast<const float4*>(x + t0) + v,
                                   cuda::aligned_size_t<16>(16), load);
            for (unsigned e = nvec * 4 + lane; e < len; e += lanes)  // ragged tail, 4 bytes each
                cuda::memcpy_async(dst + e, x + t0 + e, sizeof(float), load);
            load.producer_commit();
        }
        load.quit();
    } else if (warp < WS_LOADER_WARPS + WS_COMPUTE_WARPS) {
        // ---- compute: consumer of the load pipeline, producer of the store pipeline ----
        auto load = cuda::make_pipeline(load_group, &load_state, cuda::pipeline_role::consumer);
        auto store = cuda::make_pipeline(store_group, &store_state, cuda::pipeline_role::producer);
        const unsigned ct = threadIdx.x - WS_LOADER_WARPS * 32, cthreads = WS_COMPUTE_WARPS * 32;
        for (unsigned long long k = 0; k < my_tiles; ++k) {
            const unsigned len = tile_len(k);
            const float* src = in_stage[k % WS_STAGES];
            float* dst = out_stage[k % WS_STAGES];
            load.consumer_wait();
            store.producer_acquire();
            for (unsigned j = ct; j < len; j += cthreads) {
                const float v = src[j];
                dst[j] = a * v * v + b;
            }
            store.producer_commit();  // release-publishes the plain shared stores above
            load.consumer_release();
        }
        load.quit();
        store.quit();
    } else if (warp < WS_LOADER_WARPS + WS_COMPUTE_WARPS + WS_STORER_WARPS) {
        // ---- storer: consumer of the store pipeline only ----
        auto store = cuda::make_pipeline(store_group, &store_state, cuda::pipeline_role::consumer);
        const unsigned lane = threadIdx.x - (WS_LOADER_WARPS + WS_COMPUTE_WARPS) * 32;
        const unsigned lanes = WS_STORER_WARPS * 32;
        for (unsigned long long k = 0; k < my_tiles; ++k) {
            const unsigned long long t0 = tile_start(k);
            const unsigned len = tile_len(k), nvec = len / 4;
            const float* src = out_stage[k % WS_STAGES];
            store.consumer_wait();
            for (unsigned v = lane; v < nvec; v += lanes)
                reinterpret_cast<float4*>(y + t0)[v] = reinterpret_cast<const float4*>(src)[v];
            for (unsigned e = nvec * 4 + lane; e < len; e += lanes)
                y[t0 + e] = src[e];
            store.consumer_release();
        }
        store.quit();
    }
}

// cluster_dsmem.cu - thread block clusters and distributed shared memory (compute capability 9.0+).
//
// Each block stages its tile of x (blockDim.x floats, zero past n) in its own shared memory. The
// blocks of a cluster then read each other's tiles directly: block rank r reads the tile of rank
// (r + 1) % cluster_size through cooperative_groups::this_cluster().map_shared_rank(), reversed:
//   y[b * B + t] = x[b * B + t] + 0.5f * x[nb * B + (B - 1 - t)]      (x read as 0 past n)
// where B = blockDim.x and nb is the neighbour block (same cluster, rank + 1 mod cluster size; for
// a 1-D grid the cluster rank of block b is b % cluster_size).
// cluster.sync() before the remote reads makes every block's tile written and visible across the
// cluster; cluster.sync() after them keeps every block (and its shared memory) alive until its
// neighbour has finished reading.
//
// Kernels (extern "C"), params (const float* x, float* y, unsigned long long n):
//   cluster_dsmem         cluster size from the launch attribute CLUSTER_DIMENSION (x, 1, 1),
//                         x in 1..8 (portable limit); the grid must be a multiple of x.
//   cluster_dsmem_pair    compiled with __cluster_dims__(2, 1, 1): launch with no attribute (or
//                         the same dims); the grid must be even.
// Both: block 1-D, up to 1024 threads (256 suggested); dynamic shared memory blockDim.x * 4 bytes;
// grid: ceil(n / blockDim.x) rounded up to a multiple of the cluster size (blocks past n take
// part with zero tiles); x/y float-aligned, not overlapping; sm_90.

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

__device__ __forceinline__ void neighbour_tile_sum(const float* __restrict__ x,
                                                   float* __restrict__ y, unsigned long long n)
{
    extern __shared__ float cl_tile[];
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned rank = cluster.block_rank();
    const unsigned csize = cluster.num_blocks();
    const unsigned t = threadIdx.x, B = blockDim.x;
    const unsigned long long i = (unsigned long long)blockIdx.x * B + t;

    cl_tile[t] = i < n ? x[i] : 0.0f;
    cluster.sync();  // all tiles of the cluster are written and visible

    const float* neighbour = cluster.map_shared_rank(cl_tile, (int)((rank + 1) % csize));
    const float remote = neighbour[B - 1 - t];  // distributed shared memory read
    const float own = cl_tile[t];

    cluster.sync();  // no block leaves while another still reads its shared memory
    if (i < n)
        y[i] = own + 0.5f * remote;
}

extern "C" __global__ void cluster_dsmem(const float* __restrict__ x, float* __restrict__ y,
                                         unsigned long long n)
{
    neighbour_tile_sum(x, y, n);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1)
cluster_dsmem_pair(const float* __restrict__ x, float* __restrict__ y, unsigned long long n)
{
    neighbour_tile_sum(x, y, n);
}

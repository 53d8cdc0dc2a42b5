// orchestra_copy: the copy kernel that small host <-> device copies are lowered to.
//
//     dst[0, n) = src[0, n)      (bytes; the two ranges must not overlap)
//
// One side is pinned host memory addressed through its unified (UVA) address: the SMs load or
// store it over PCIe, so a copy becomes a kernel launch (a kernel node in a CUDA graph), which
// costs the host nothing at cuGraphLaunch, where every memcpy node costs 1.3-1.9 us there
// (measured on an H200, docs/graphs.md). Large copies stay on the copy engines.
//
// Paths, chosen per launch from the two addresses (grid-stride loops, so any 1-D grid works):
//   - dst and src equally aligned modulo 16: a head of up to 15 bytes, then 16-byte words
//     (uint4 loads and stores), then a tail of up to 15 bytes;
//   - equally aligned modulo 8 or 4 only: the same with 8-byte / 4-byte words;
//   - otherwise byte by byte.
// The head and the tail are done by the first threads of the grid, one byte each.
//
// system_fence != 0 (the lowering passes it for device-to-host copies in graphs that have host
// functions): every thread ends with __threadfence_system(), so its stores to host memory are
// visible to host functions ordered after the copy. Without host functions the host reads the
// bytes only after synchronizing with the stream or an event, and they are visible by then.
//
// Launch: block 256 (any multiple of 32 works), grid ceil(sqrt(n / 256)) clamped to
// [1, SM count] (the lowering's choice: it matches the best grids measured for 4 KiB - 16 MiB).

typedef unsigned long long u64;

template <typename W>
__device__ __forceinline__ void copy_words(unsigned char* __restrict__ dst,
                                           const unsigned char* __restrict__ src, u64 n,
                                           u64 tid, u64 stride)
{
    const u64 align = sizeof(W);
    // bytes until dst (and so src, equally misaligned) reaches a W boundary
    u64 head = (align - ((u64)dst & (align - 1))) & (align - 1);
    if (head > n) head = n;
    const u64 words = (n - head) / align;
    const u64 tail_start = head + words * align;
    const u64 tail = n - tail_start;
    if (tid < head) dst[tid] = src[tid];
    W* __restrict__ d = reinterpret_cast<W*>(dst + head);
    const W* __restrict__ s = reinterpret_cast<const W*>(src + head);
    for (u64 i = tid; i < words; i += stride) d[i] = s[i];
    if (tid < tail) dst[tail_start + tid] = src[tail_start + tid];
}

extern "C" __global__ void orchestra_copy(unsigned char* __restrict__ dst,
                                          const unsigned char* __restrict__ src,
                                          unsigned long long n, unsigned int system_fence)
{
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 mis = ((u64)dst ^ (u64)src);
    if ((mis & 15ull) == 0) {
        copy_words<uint4>(dst, src, n, tid, stride);
    } else if ((mis & 7ull) == 0) {
        copy_words<u64>(dst, src, n, tid, stride);
    } else if ((mis & 3ull) == 0) {
        copy_words<unsigned int>(dst, src, n, tid, stride);
    } else {
        for (u64 i = tid; i < n; i += stride) dst[i] = src[i];
    }
    if (system_fence) __threadfence_system();
}

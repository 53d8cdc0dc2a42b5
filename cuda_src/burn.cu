// burn: the main job's compute kernel. For each i < n:
//     v = x[i]; repeat iters times: v = fmaf(v, s, t); y[i] = v;
// iters, s and t are runtime values, so nothing folds at compile time and the cost per element
// is iters dependent FMAs (about 2 * iters flops): the knob that sets the kernel's duration.
//
// Memory: 16-byte vectorized loads and stores (float4) over the first n & ~3 elements when x
// and y are both 16-byte aligned (device allocations are), then a scalar tail; when either
// pointer is not 16-byte aligned everything goes through the scalar path. Grid-stride loops, so
// any 1-D grid works.
//
// Launch: 1-D, e.g. block 256, grid min(ceil(n / 4 / 256), 4 * SMs) (each thread handles 4
// elements per step). No shared memory. x and y hold n floats and must not overlap
// (__restrict__).
//
// With s = 0.5 and t = 1 every step is exact up to one rounding of the add (v * 0.5 is exact),
// so the result is bit-exact with the numpy float32 reference:
//     v = x.copy(); for _ in range(iters): v = v * np.float32(0.5) + np.float32(1)

extern "C" __global__ void burn(const float* __restrict__ x, float* __restrict__ y, size_t n,
                                int iters, float s, float t)
{
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    size_t done = 0;

    if ((((unsigned long long)x | (unsigned long long)y) & 15ull) == 0) {
        const size_t n4 = n / 4;
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float4* y4 = reinterpret_cast<float4*>(y);
        for (size_t i = tid; i < n4; i += stride) {
            float4 v = x4[i];
            for (int k = 0; k < iters; ++k) {
                v.x = fmaf(v.x, s, t);
                v.y = fmaf(v.y, s, t);
                v.z = fmaf(v.z, s, t);
                v.w = fmaf(v.w, s, t);
            }
            y4[i] = v;
        }
        done = n4 * 4;
    }
    for (size_t i = done + tid; i < n; i += stride) {
        float v = x[i];
        for (int k = 0; k < iters; ++k) {
            v = fmaf(v, s, t);
        }
        y[i] = v;
    }
}

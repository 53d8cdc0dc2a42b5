// saxpy: out[i] = a * x[i] + y[i] for i < n (float32), grid-stride loop.
//
// Launch: any 1-D grid and block (e.g. block 256, grid min(ceil(n / 256), 4 * SMs)); every
// element is covered whatever the grid size. No shared memory. x, y and out hold n floats;
// out may alias x or y (each element is read before it is written by the same thread).
// NVRTC contracts a * x + y into one fma (its default -fmad=true), so results match the
// float64 reference to float32 rounding rather than bit for bit.
// numpy reference: out = (a * x.astype(np.float64) + y).astype(np.float32)

extern "C" __global__ void saxpy(float a, const float* x, const float* y, float* out, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = a * x[i] + y[i];
    }
}

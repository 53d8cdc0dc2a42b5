// vector_add: c[i] = a[i] + b[i] for i < n (float32), grid-stride loop.
//
// Launch: any 1-D grid and block (e.g. block 256, grid min(ceil(n / 256), 4 * SMs)). No shared
// memory. a, b and c hold n floats; c may alias a or b. One rounding per element, so the result
// is bit-exact with numpy: c = a + b (float32 arrays).

extern "C" __global__ void vector_add(const float* a, const float* b, float* c, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        c[i] = a[i] + b[i];
    }
}

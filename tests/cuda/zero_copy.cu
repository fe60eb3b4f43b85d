// Mapped page-locked host memory ("zero copy") on a device whose memory the host reaches only
// at synchronisation points: memory from cudaHostAlloc(cudaHostAllocMapped) and memory the
// program registers with cudaHostRegisterMapped, used by kernels through the device pointers
// cudart gives, read by the host after synchronisation; checked against the host's own
// computation.
#include "common.h"
__global__ void saxpy(const float* x, float* y, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
static int fail(const char* what, int i) {
    std::printf("FAIL %s at %d\n", what, i);
    return 1;
}
int main() {
    int can = 0;
    CHECK(cudaDeviceGetAttribute(&can, cudaDevAttrCanMapHostMemory, 0));
    if (!can) return fail("canMapHostMemory", 0);
    CHECK(cudaSetDeviceFlags(cudaDeviceMapHost));
    const int n = 50000;
    float *x, *y, *dx, *dy;
    CHECK(cudaHostAlloc(&x, n * sizeof(float), cudaHostAllocMapped));
    CHECK(cudaHostAlloc(&y, n * sizeof(float), cudaHostAllocMapped));
    CHECK(cudaHostGetDevicePointer(&dx, x, 0));
    CHECK(cudaHostGetDevicePointer(&dy, y, 0));
    unsigned int flags = 0;
    CHECK(cudaHostGetFlags(&flags, x));
    if (!(flags & cudaHostAllocMapped)) return fail("cudaHostGetFlags", flags);
    for (int i = 0; i < n; i++) { x[i] = i * 0.5f; y[i] = 1.0f; }
    saxpy<<<(n + 255) / 256, 256>>>(dx, dy, 2.0f, n);
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < n; i++)
        if (y[i] != 2.0f * (i * 0.5f) + 1.0f) return fail("allocated mapped", i);
    // The program's own memory, registered mapped: another device address.
    float* mine = (float*)std::malloc(n * sizeof(float));
    for (int i = 0; i < n; i++) mine[i] = 3.0f;
    CHECK(cudaHostRegister(mine, n * sizeof(float), cudaHostRegisterMapped));
    float* dmine;
    CHECK(cudaHostGetDevicePointer(&dmine, mine, 0));
    saxpy<<<(n + 255) / 256, 256>>>(dx, dmine, -1.0f, n);
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < n; i++)
        if (mine[i] != 3.0f - i * 0.5f) return fail("registered mapped", i);
    CHECK(cudaHostUnregister(mine));
    std::free(mine);
    CHECK(cudaFreeHost(x));
    CHECK(cudaFreeHost(y));
    std::printf("PASS mapped host memory coherent at each synchronisation\n");
}

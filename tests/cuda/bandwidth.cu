// copyVec4(const float4* in, float4* out, int n): out[i] = in[i] with 16-byte vector loads
// and stores (grid-stride loop); the host also times cudaMemset and cudaMemcpy.
#include "common.h"
__global__ void copyVec4(const float4* in, float4* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        out[i] = in[i];
}
int main() {
    const int n = 1 << 22;  // float4s: 64 MiB
    float4 *a, *b;
    CHECK(cudaMalloc(&a, n * 16)); CHECK(cudaMalloc(&b, n * 16));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0)); CHECK(cudaEventCreate(&t1));
    CHECK(cudaMemset(a, 0x3f, n * 16));
    CHECK(cudaEventRecord(t0));
    copyVec4<<<1024, 256>>>(a, b, n);
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    unsigned probe = 0;
    CHECK(cudaMemcpy(&probe, (char*)b + 12345 * 16, 4, cudaMemcpyDeviceToHost));
    std::printf("copy %.1f GB/s\n", 2.0 * n * 16 / ms / 1e6);
    std::printf("%s\n", probe == 0x3f3f3f3fu ? "PASS" : "FAIL");
}

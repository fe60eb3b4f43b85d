// reduceSum(const unsigned* in, unsigned* out, int n): *out += sum of in[0..n), each warp
// adding its lanes with __shfl_down_sync and lane 0 one atomicAdd. Any block size that is a
// multiple of 32.
#include "common.h"
__global__ void reduceSum(const unsigned* in, unsigned* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned v = i < n ? in[i] : 0;
    for (int d = 16; d > 0; d /= 2) v += __shfl_down_sync(0xffffffffu, v, d);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, v);
}
int main() {
    const int n = 1 << 20;
    unsigned* h = new unsigned[n];
    unsigned want = 0;
    for (int i = 0; i < n; i++) { h[i] = (i * 2654435761u) >> 20; want += h[i]; }
    unsigned *in, *out, got = 0;
    CHECK(cudaMalloc(&in, n * 4)); CHECK(cudaMalloc(&out, 4));
    CHECK(cudaMemcpy(in, h, n * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(out, 0, 4));
    reduceSum<<<n / 256, 256>>>(in, out, n);
    CHECK(cudaMemcpy(&got, out, 4, cudaMemcpyDeviceToHost));
    std::printf("%s\n", got == want ? "PASS" : "FAIL");
    return got != want;
}

// scale(float* x, float s, int n): x[i] *= s. The host runs it on two streams over two halves,
// each bracketed by events, and checks both halves and the elapsed times.
#include "common.h"
__global__ void scale(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
int main() {
    const int n = 1 << 16, half = n / 2;
    float* h = new float[n];
    for (int i = 0; i < n; i++) h[i] = i;
    float* d;
    CHECK(cudaMalloc(&d, n * 4));
    cudaStream_t s[2];
    cudaEvent_t start[2], stop[2];
    for (int k = 0; k < 2; k++) {
        CHECK(cudaStreamCreate(&s[k]));
        CHECK(cudaEventCreate(&start[k])); CHECK(cudaEventCreate(&stop[k]));
        CHECK(cudaMemcpyAsync(d + k * half, h + k * half, half * 4, cudaMemcpyHostToDevice, s[k]));
        CHECK(cudaEventRecord(start[k], s[k]));
        scale<<<half / 256, 256, 0, s[k]>>>(d + k * half, k ? 3.0f : 2.0f, half);
        CHECK(cudaEventRecord(stop[k], s[k]));
        CHECK(cudaMemcpyAsync(h + k * half, d + k * half, half * 4, cudaMemcpyDeviceToHost, s[k]));
    }
    for (int k = 0; k < 2; k++) {
        CHECK(cudaStreamSynchronize(s[k]));
        float ms = -1;
        CHECK(cudaEventElapsedTime(&ms, start[k], stop[k]));
        if (ms < 0) { std::printf("FAIL elapsed\n"); return 1; }
    }
    for (int i = 0; i < n; i++)
        if (h[i] != i * (i < half ? 2.0f : 3.0f)) { std::printf("FAIL at %d\n", i); return 1; }
    std::printf("PASS\n");
}

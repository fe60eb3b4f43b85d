// vecAdd(const float* a, const float* b, float* c, int n): c[i] = a[i] + b[i] for i < n.
#include "common.h"
__global__ void vecAdd(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
int main() {
    const int n = 100000;
    float *ha = new float[n], *hb = new float[n], *hc = new float[n];
    for (int i = 0; i < n; i++) { ha[i] = i * 0.5f; hb[i] = 1.0f / (i + 1); }
    float *a, *b, *c;
    CHECK(cudaMalloc(&a, n * 4)); CHECK(cudaMalloc(&b, n * 4)); CHECK(cudaMalloc(&c, n * 4));
    CHECK(cudaMemcpy(a, ha, n * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, hb, n * 4, cudaMemcpyHostToDevice));
    vecAdd<<<(n + 255) / 256, 256>>>(a, b, c, n);
    CHECK(cudaMemcpy(hc, c, n * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (hc[i] != ha[i] + hb[i]) { std::printf("FAIL at %d\n", i); return 1; }
    std::printf("PASS\n");
}

// scanBlocks(const int* in, int* out, int n): inclusive prefix sum within each block of 256
// (Hillis–Steele over a double buffer in shared memory); launch block 256.
#include "common.h"
#define B 256
__global__ void scanBlocks(const int* in, int* out, int n) {
    __shared__ int buf[2][B];
    int i = blockIdx.x * B + threadIdx.x, cur = 0;
    buf[0][threadIdx.x] = i < n ? in[i] : 0;
    __syncthreads();
    for (int off = 1; off < B; off *= 2) {
        int v = buf[cur][threadIdx.x];
        if (threadIdx.x >= off) v += buf[cur][threadIdx.x - off];
        buf[1 - cur][threadIdx.x] = v;
        cur = 1 - cur;
        __syncthreads();
    }
    if (i < n) out[i] = buf[cur][threadIdx.x];
}
int main() {
    const int n = 5000;
    int *h = new int[n], *r = new int[n];
    for (int i = 0; i < n; i++) h[i] = (i * 37) % 101 - 50;
    int *in, *out;
    CHECK(cudaMalloc(&in, n * 4)); CHECK(cudaMalloc(&out, n * 4));
    CHECK(cudaMemcpy(in, h, n * 4, cudaMemcpyHostToDevice));
    scanBlocks<<<(n + B - 1) / B, B>>>(in, out, n);
    CHECK(cudaMemcpy(r, out, n * 4, cudaMemcpyDeviceToHost));
    int s = 0;
    for (int i = 0; i < n; i++) {
        s = (i % B == 0) ? h[i] : s + h[i];
        if (r[i] != s) { std::printf("FAIL at %d\n", i); return 1; }
    }
    std::printf("PASS\n");
}

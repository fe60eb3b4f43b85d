// histogram(const unsigned char* data, unsigned* bins, int n): 256 bins, counted per block in
// shared memory with atomicAdd, then added to the global bins; launch block 256.
#include "common.h"
__global__ void histogram(const unsigned char* data, unsigned* bins, int n) {
    __shared__ unsigned local[256];
    local[threadIdx.x] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        atomicAdd(&local[data[i]], 1u);
    __syncthreads();
    if (local[threadIdx.x]) atomicAdd(&bins[threadIdx.x], local[threadIdx.x]);
}
int main() {
    const int n = 1 << 18;
    unsigned char* h = new unsigned char[n];
    unsigned want[256] = {0}, got[256];
    for (int i = 0; i < n; i++) { h[i] = (i * i + 7 * i) & 0xff; want[h[i]]++; }
    unsigned char* d; unsigned* bins;
    CHECK(cudaMalloc(&d, n)); CHECK(cudaMalloc(&bins, 1024));
    CHECK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(bins, 0, 1024));
    histogram<<<64, 256>>>(d, bins, n);
    CHECK(cudaMemcpy(got, bins, 1024, cudaMemcpyDeviceToHost));
    for (int b = 0; b < 256; b++)
        if (got[b] != want[b]) { std::printf("FAIL bin %d\n", b); return 1; }
    std::printf("PASS\n");
}

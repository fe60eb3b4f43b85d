// query(int* out): out[0..4) = warpSize, blockDim.x, gridDim.x, and the lane id of thread 37
// (5). The host prints the device's properties.
#include "common.h"
__global__ void query(int* out) {
    unsigned lane;
    asm("mov.u32 %0, %%laneid;" : "=r"(lane));
    if (threadIdx.x == 0) { out[0] = warpSize; out[1] = blockDim.x; out[2] = gridDim.x; }
    if (threadIdx.x == 37) out[3] = lane;
}
int main() {
    int count = 0;
    CHECK(cudaGetDeviceCount(&count));
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    std::printf("%d device(s); 0: %s, sm_%d%d, %d SMs, %zu MiB\n", count, p.name, p.major, p.minor,
                p.multiProcessorCount, p.totalGlobalMem >> 20);
    int* d; int h[4];
    CHECK(cudaMalloc(&d, 16));
    query<<<3, 64>>>(d);
    CHECK(cudaMemcpy(h, d, 16, cudaMemcpyDeviceToHost));
    std::printf("%s\n", h[0] == 32 && h[1] == 64 && h[2] == 3 && h[3] == 5 ? "PASS" : "FAIL");
}

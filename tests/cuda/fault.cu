// oob(int* p): thread 0 writes p[1 << 28], a gigabyte past a small allocation: the launch
// must fail with an illegal address (a sticky error for the context).
#include "common.h"
__global__ void oob(int* p) {
    if (threadIdx.x == 0) p[1 << 28] = 42;
}
int main() {
    int* d;
    CHECK(cudaMalloc(&d, 256));
    oob<<<1, 32>>>(d);
    cudaError_t e = cudaDeviceSynchronize();
    std::printf("%s (%s)\n", e == cudaErrorIllegalAddress ? "PASS" : "FAIL", cudaGetErrorString(e));
    return e != cudaErrorIllegalAddress;
}

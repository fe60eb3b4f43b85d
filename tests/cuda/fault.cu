// oob(int* p): thread 0 writes p[1 << 28], a gigabyte past a small allocation: the launch
// must fail with a memory fault, a sticky error for the context: an illegal address, or on a
// GPU whose address map puts that address outside global memory (seen on an H100), an invalid
// address space.
#include "common.h"
__global__ void oob(int* p) {
    if (threadIdx.x == 0) p[1 << 28] = 42;
}
int main() {
    int* d;
    CHECK(cudaMalloc(&d, 256));
    oob<<<1, 32>>>(d);
    cudaError_t e = cudaDeviceSynchronize();
    bool fault = e == cudaErrorIllegalAddress || e == cudaErrorInvalidAddressSpace;
    std::printf("%s (%s)\n", fault ? "PASS" : "FAIL", cudaGetErrorString(e));
    return !fault;
}

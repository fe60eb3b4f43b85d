// hello(int n): threads below n of every block print "block B thread T value V" with V a
// float, through the device printf.
#include "common.h"
__global__ void hello(int n) {
    if (threadIdx.x < n) printf("block %d thread %d value %.2f\n", blockIdx.x, threadIdx.x, threadIdx.x * 1.5f);
}
int main() {
    hello<<<2, 32>>>(2);
    CHECK(cudaDeviceSynchronize());
    std::printf("PASS\n");
}

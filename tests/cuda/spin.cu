// spin(volatile int* flag): every thread waits until *flag != 0. The host program makes sure
// the kernel has started (a stream query, which a real GPU answers "not ready" at once), then
// sets the flag through mapped memory after a while, so on a real GPU it ends. Behind a VM the
// device sees mapped memory only at synchronisation points (docs/CUDA-GUEST.md): the kernel
// cannot see the flag, runs into the request's deadline, and the query reports that error.
#include "common.h"
#include <unistd.h>
__global__ void spin(volatile int* flag) {
    while (*flag == 0) {}
}
int main() {
    int* h;
    CHECK(cudaHostAlloc(&h, 4, cudaHostAllocMapped));
    *h = 0;
    int* d;
    CHECK(cudaHostGetDevicePointer(&d, h, 0));
    spin<<<2, 64>>>(d);
    cudaError_t started = cudaStreamQuery(0);
    if (started != cudaSuccess && started != cudaErrorNotReady) {
        std::printf("FAIL cudaStreamQuery(0): %s\n", cudaGetErrorString(started));
        return 1;
    }
    usleep(200000);
    *(volatile int*)h = 1;
    CHECK(cudaDeviceSynchronize());
    std::printf("PASS\n");
}

// spin(volatile int* flag): every thread waits until *flag != 0. Launched with flag 0 it never
// ends: the executor's instruction budget (or the driver's watchdog) must stop it. The host
// program sets the flag from the host after a while through mapped memory, so on a real GPU it
// ends.
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
    usleep(200000);
    *(volatile int*)h = 1;
    CHECK(cudaDeviceSynchronize());
    std::printf("PASS\n");
}

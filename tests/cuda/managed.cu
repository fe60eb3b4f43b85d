// Managed memory on a device without concurrent managed access (a Turing under Linux): the
// host writes, kernels read and write, and the host sees their results after each
// synchronisation (device, stream, event, synchronous copy). Checked against the host's own
// computation, with the attributes and pointer kind cudart reports for it.
#include "common.h"
#include <vector>
__global__ void affine(int* x, int a, int b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}
static int fail(const char* what, int i) {
    std::printf("FAIL %s at %d\n", what, i);
    return 1;
}
int main() {
    int managed = 0, concurrent = 1;
    CHECK(cudaDeviceGetAttribute(&managed, cudaDevAttrManagedMemory, 0));
    CHECK(cudaDeviceGetAttribute(&concurrent, cudaDevAttrConcurrentManagedAccess, 0));
    if (managed != 1 || concurrent != 0) return fail("attributes", managed * 10 + concurrent);
    const int n = 100000;
    int* x;
    CHECK(cudaMallocManaged(&x, n * sizeof(int)));
    cudaPointerAttributes pa;
    CHECK(cudaPointerGetAttributes(&pa, x + 5));
    if (pa.type != cudaMemoryTypeManaged || pa.devicePointer != x + 5 || pa.hostPointer != x + 5)
        return fail("pointer attributes", pa.type);
    std::vector<long long> ref(n);
    for (int i = 0; i < n; i++) ref[i] = x[i] = i % 1000;
    // Device synchronisation.
    affine<<<(n + 255) / 256, 256>>>(x, 3, 1, n);
    CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < n; i++)
        if (x[i] != (ref[i] = 3 * ref[i] + 1)) return fail("after cudaDeviceSynchronize", i);
    // The host changes part of it; a stream synchronisation, with a prefetch and advice.
    for (int i = 0; i < n; i += 7) ref[i] = x[i] = -i;
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaMemLocation gpu = {cudaMemLocationTypeDevice, 0};
    CHECK(cudaMemAdvise(x, n * sizeof(int), cudaMemAdviseSetReadMostly, gpu));
    CHECK(cudaMemPrefetchAsync(x, n * sizeof(int), gpu, 0, s));
    affine<<<(n + 255) / 256, 256, 0, s>>>(x, 2, -5, n);
    CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < n; i++)
        if (x[i] != (ref[i] = 2 * ref[i] - 5)) return fail("after cudaStreamSynchronize", i);
    // An event synchronisation.
    cudaEvent_t e;
    CHECK(cudaEventCreate(&e));
    affine<<<(n + 255) / 256, 256, 0, s>>>(x, 1, 7, n);
    CHECK(cudaEventRecord(e, s));
    CHECK(cudaEventSynchronize(e));
    for (int i = 0; i < n; i++)
        if (x[i] != (ref[i] += 7)) return fail("after cudaEventSynchronize", i);
    // A synchronous copy out of it (device to host), then into device memory and back.
    affine<<<(n + 255) / 256, 256>>>(x, -1, 0, n);
    std::vector<int> out(n);
    CHECK(cudaMemcpy(out.data(), x, n * sizeof(int), cudaMemcpyDefault));
    for (int i = 0; i < n; i++)
        if (out[i] != -ref[i] || x[i] != -ref[i]) return fail("after cudaMemcpy", i);
    int* d;
    CHECK(cudaMalloc(&d, n * sizeof(int)));
    for (int i = 0; i < n; i++) x[i] = i;
    CHECK(cudaMemcpy(d, x, n * sizeof(int), cudaMemcpyDefault));
    CHECK(cudaMemcpy(out.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (out[i] != i) return fail("copied from managed memory", i);
    CHECK(cudaFree(d));
    CHECK(cudaFree(x));
    std::printf("PASS managed memory coherent at each synchronisation\n");
}

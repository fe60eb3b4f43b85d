// The device heap (malloc/free and new/delete in kernels) sized by cudaDeviceSetLimit before
// its first use: more than the default 8 MiB is handed out and every block is the thread's
// own; a block past the heap is NULL; a new size once the heap exists is refused with
// cudaErrorInvalidValue, as the driver refuses it. Checked against the host's sums.
#include "common.h"
#include <new>
// Each thread's block: 128 KiB, so 256 threads need 32 MiB of heap.
constexpr size_t kBlock = 128 << 10;
constexpr int kThreads = 256;
// Words of a block the kernel writes and reads back: one per 4 KiB page.
constexpr size_t kStride = 1024;
__global__ void fill(unsigned long long* sums, int* nulls) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned* p = static_cast<unsigned*>(malloc(kBlock));
    if (!p) { atomicAdd(nulls, 1); return; }
    for (size_t i = 0; i < kBlock / 4; i += kStride) p[i] = t * 7u + unsigned(i);
    unsigned long long s = 0;
    for (size_t i = 0; i < kBlock / 4; i += kStride) s += p[i];
    sums[t] = s;
    free(p);
}
struct Pair { int a, b; };
__global__ void objects(int* out, size_t too_big) {
    Pair* q = new Pair{int(threadIdx.x), 3};
    out[threadIdx.x] = q->a * q->b;
    delete q;
    // A block larger than the heap: NULL from malloc.
    if (threadIdx.x == 0) out[blockDim.x] = malloc(too_big) == nullptr;
}
static int fail(const char* what, long long got, long long want) {
    std::printf("FAIL %s: %lld, expected %lld\n", what, got, want);
    return 1;
}
int main() {
    size_t heap = 0;
    CHECK(cudaDeviceGetLimit(&heap, cudaLimitMallocHeapSize));
    if (heap != (8 << 20)) return fail("default heap", heap, 8 << 20);
    const size_t want = 48 << 20;
    CHECK(cudaDeviceSetLimit(cudaLimitMallocHeapSize, want));
    CHECK(cudaDeviceGetLimit(&heap, cudaLimitMallocHeapSize));
    if (heap != want) return fail("heap set", heap, want);
    unsigned long long* sums;
    int* nulls;
    CHECK(cudaMalloc(&sums, kThreads * sizeof(*sums)));
    CHECK(cudaMalloc(&nulls, sizeof(int)));
    CHECK(cudaMemset(nulls, 0, sizeof(int)));
    fill<<<kThreads / 64, 64>>>(sums, nulls);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    int got_nulls = -1;
    CHECK(cudaMemcpy(&got_nulls, nulls, sizeof(int), cudaMemcpyDeviceToHost));
    if (got_nulls != 0) return fail("NULL blocks in a 48 MiB heap", got_nulls, 0);
    unsigned long long got[kThreads];
    CHECK(cudaMemcpy(got, sums, sizeof(got), cudaMemcpyDeviceToHost));
    for (int t = 0; t < kThreads; t++) {
        unsigned long long s = 0;
        for (size_t i = 0; i < kBlock / 4; i += kStride) s += t * 7u + unsigned(i);
        if (got[t] != s) return fail("block sum", got[t], s);
    }
    int* out;
    CHECK(cudaMalloc(&out, 33 * sizeof(int)));
    objects<<<1, 32>>>(out, want + 1);
    CHECK(cudaDeviceSynchronize());
    int o[33];
    CHECK(cudaMemcpy(o, out, sizeof(o), cudaMemcpyDeviceToHost));
    for (int i = 0; i < 32; i++)
        if (o[i] != 3 * i) return fail("new/delete", o[i], 3 * i);
    if (o[32] != 1) return fail("malloc past the heap is NULL", o[32], 1);
    cudaError_t late = cudaDeviceSetLimit(cudaLimitMallocHeapSize, 64 << 20);
    if (late != cudaErrorInvalidValue) return fail("setting the heap after use", late, 1);
    CHECK(cudaDeviceGetLimit(&heap, cudaLimitMallocHeapSize));
    if (heap != want) return fail("heap kept", heap, want);
    CHECK(cudaFree(out));
    CHECK(cudaFree(sums));
    CHECK(cudaFree(nulls));
    std::printf("PASS heap: %d threads took %zu KiB each of a %zu MiB heap\n", kThreads,
                kBlock >> 10, want >> 20);
    return 0;
}

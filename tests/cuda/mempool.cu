// Stream-ordered allocation: cudaMallocAsync memory written by a kernel later on the stream
// and copied back; a pool that keeps freed memory (release threshold) and counts it; an
// explicit pool; and cudaMallocAsync captured into a graph (allocation and free nodes)
// launched twice. Every result is checked against the host's own computation.
#include "common.h"
#include <cstdint>

__global__ void fill(int* x, int base, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = base + i * 3;
}

static bool check(const int* got, int base, int n, const char* what) {
    for (int i = 0; i < n; i++)
        if (got[i] != base + i * 3) {
            std::printf("FAIL %s at %d: %d\n", what, i, got[i]);
            return false;
        }
    return true;
}

int main() {
    const int n = 2048, threads = 128;
    int* h;
    CHECK(cudaMallocHost(&h, n * 4));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    int supported = 0;
    CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, 0));
    if (!supported) { std::printf("FAIL memory pools not supported\n"); return 1; }

    // The default pool, keeping what is freed.
    cudaMemPool_t pool;
    CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t keep = UINT64_MAX;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    int* d;
    CHECK(cudaMallocAsync(&d, n * 4, s));
    fill<<<n / threads, threads, 0, s>>>(d, 7, n);
    CHECK(cudaMemcpyAsync(h, d, n * 4, cudaMemcpyDeviceToHost, s));
    CHECK(cudaFreeAsync(d, s));
    CHECK(cudaStreamSynchronize(s));
    if (!check(h, 7, n, "default pool")) return 1;
    uint64_t reserved = 0, used = 1;
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    if (reserved < uint64_t(n) * 4 || used != 0) {
        std::printf("FAIL pool counts: reserved %llu, used %llu\n", (unsigned long long)reserved,
                    (unsigned long long)used);
        return 1;
    }
    CHECK(cudaMemPoolTrimTo(pool, 0));
    CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    if (reserved != 0) { std::printf("FAIL trimmed pool keeps %llu\n", (unsigned long long)reserved); return 1; }

    // An explicit pool.
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    cudaMemPool_t mine;
    CHECK(cudaMemPoolCreate(&mine, &props));
    CHECK(cudaMallocFromPoolAsync(&d, n * 4, mine, s));
    fill<<<n / threads, threads, 0, s>>>(d, -50, n);
    CHECK(cudaMemcpyAsync(h, d, n * 4, cudaMemcpyDeviceToHost, s));
    CHECK(cudaFreeAsync(d, s));
    CHECK(cudaStreamSynchronize(s));
    if (!check(h, -50, n, "explicit pool")) return 1;
    CHECK(cudaMemPoolDestroy(mine));

    // Captured: allocation, kernel, copy out, free; the graph runs twice.
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMallocAsync(&d, n * 4, s));
    fill<<<n / threads, threads, 0, s>>>(d, 1000, n);
    CHECK(cudaMemcpyAsync(h, d, n * 4, cudaMemcpyDeviceToHost, s));
    CHECK(cudaFreeAsync(d, s));
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, g, 0));
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < n; i++) h[i] = 0;
        CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaStreamSynchronize(s));
        if (!check(h, 1000, n, "graph allocation")) return 1;
    }
    uint64_t graph_used = 0;
    CHECK(cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrUsedMemCurrent, &graph_used));
    if (graph_used < uint64_t(n) * 4) { std::printf("FAIL graph memory %llu\n", (unsigned long long)graph_used); return 1; }
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrUsedMemCurrent, &graph_used));
    if (graph_used != 0) { std::printf("FAIL graph memory kept: %llu\n", (unsigned long long)graph_used); return 1; }
    std::printf("PASS mempool: stream-ordered allocation, pools kept and trimmed, graph allocations\n");
}

// CUDA graphs: a graph captured from two streams (fork and join by events, a copy in from
// pinned memory, a memset, a host function, a copy out) launched three times with new input
// each time; a graph built node by node (memset → kernel → copy → host), launched, its kernel
// node changed in the executable graph, cloned, and updated from a graph of the same shape;
// and what CUDA refuses: a synchronisation inside a capture, a dependency cycle. Every result
// is checked against the host's own computation.
#include "common.h"
#include <cstring>

__global__ void scale(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
__global__ void add(float* x, float v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}

static int host_calls = 0;
static void CUDART_CB count_call(void* p) { ++*static_cast<int*>(p); }

static bool check(const float* got, const float* want, int n, const char* what) {
    for (int i = 0; i < n; i++)
        if (got[i] != want[i]) {
            std::printf("FAIL %s at %d: %g, expected %g\n", what, i, got[i], want[i]);
            return false;
        }
    return true;
}

int main() {
    const int n = 4096, half = n / 2, threads = 128;
    float *in, *out, *d, *flags;
    CHECK(cudaMallocHost(&in, n * 4));
    CHECK(cudaMallocHost(&out, n * 4));
    CHECK(cudaMalloc(&d, n * 4));
    CHECK(cudaMalloc(&flags, 64 * 4));
    float want[n];

    // 1. Captured from two streams.
    cudaStream_t s1, s2;
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CHECK(cudaEventCreate(&fork));
    CHECK(cudaEventCreate(&join));
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    cudaStreamCaptureStatus st;
    CHECK(cudaStreamIsCapturing(s1, &st));
    if (st != cudaStreamCaptureStatusActive) { std::printf("FAIL capture status %d\n", st); return 1; }
    CHECK(cudaMemcpyAsync(d, in, n * 4, cudaMemcpyHostToDevice, s1));
    CHECK(cudaEventRecord(fork, s1));
    CHECK(cudaStreamWaitEvent(s2, fork, 0));
    scale<<<half / threads, threads, 0, s1>>>(d, 2.0f, half);
    add<<<half / threads, threads, 0, s2>>>(d + half, 5.0f, half);
    CHECK(cudaMemsetAsync(flags, 0, 64 * 4, s2));
    CHECK(cudaEventRecord(join, s2));
    CHECK(cudaStreamWaitEvent(s1, join, 0));
    CHECK(cudaLaunchHostFunc(s1, count_call, &host_calls));
    CHECK(cudaMemcpyAsync(out, d, n * 4, cudaMemcpyDeviceToHost, s1));
    cudaGraph_t captured;
    CHECK(cudaStreamEndCapture(s1, &captured));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(captured, nullptr, &nodes));
    // copy in, scale, add, memset, host function, copy out.
    if (nodes != 6) { std::printf("FAIL captured %zu nodes\n", nodes); return 1; }
    if (host_calls != 0) { std::printf("FAIL the host function ran during capture\n"); return 1; }
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, captured, 0));
    for (int round = 0; round < 3; round++) {
        // The graph reads the host buffer when it runs, not when it was captured.
        for (int i = 0; i < n; i++) {
            in[i] = float(i + round * 7);
            want[i] = i < half ? in[i] * 2.0f : in[i] + 5.0f;
        }
        std::memset(out, 0, n * 4);
        CHECK(cudaGraphLaunch(exec, s1));
        CHECK(cudaStreamSynchronize(s1));
        if (!check(out, want, n, "captured graph")) return 1;
        if (host_calls != round + 1) { std::printf("FAIL host function ran %d times\n", host_calls); return 1; }
    }

    // 2. Built node by node.
    cudaGraph_t g;
    CHECK(cudaGraphCreate(&g, 0));
    cudaMemsetParams ms = {};
    ms.dst = d;
    ms.value = 0x3f800000;  // 1.0f
    ms.elementSize = 4;
    ms.width = n;
    ms.height = 1;
    cudaGraphNode_t set, kern, copy, host;
    CHECK(cudaGraphAddMemsetNode(&set, g, nullptr, 0, &ms));
    float factor = 3.0f;
    int count = n;
    void* args[] = {&d, &factor, &count};
    cudaKernelNodeParams kp = {};
    kp.func = (void*)scale;
    kp.gridDim = dim3(n / threads);
    kp.blockDim = dim3(threads);
    kp.kernelParams = args;
    CHECK(cudaGraphAddKernelNode(&kern, g, &set, 1, &kp));
    CHECK(cudaGraphAddMemcpyNode1D(&copy, g, &kern, 1, out, d, n * 4, cudaMemcpyDeviceToHost));
    cudaHostNodeParams hp = {count_call, &host_calls};
    CHECK(cudaGraphAddHostNode(&host, g, &copy, 1, &hp));
    // A cycle is refused, and the graph is unchanged.
    if (cudaGraphAddDependencies(g, &host, &set, nullptr, 1) != cudaErrorInvalidValue) {
        std::printf("FAIL a dependency cycle was accepted\n");
        return 1;
    }
    cudaGetLastError();
    size_t edges = 0;
    CHECK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &edges));
    if (edges != 3) { std::printf("FAIL %zu edges\n", edges); return 1; }
    cudaGraphExec_t built;
    CHECK(cudaGraphInstantiate(&built, g, 0));
    int calls = host_calls;
    CHECK(cudaGraphLaunch(built, s1));
    CHECK(cudaStreamSynchronize(s1));
    for (int i = 0; i < n; i++) want[i] = 3.0f;
    if (!check(out, want, n, "built graph")) return 1;
    if (host_calls != calls + 1) { std::printf("FAIL host node\n"); return 1; }
    // The executable graph's kernel node gets a new factor; the graph keeps its own.
    float factor2 = 4.0f;
    void* args2[] = {&d, &factor2, &count};
    kp.kernelParams = args2;
    CHECK(cudaGraphExecKernelNodeSetParams(built, kern, &kp));
    CHECK(cudaGraphLaunch(built, s1));
    CHECK(cudaStreamSynchronize(s1));
    for (int i = 0; i < n; i++) want[i] = 4.0f;
    if (!check(out, want, n, "changed kernel node")) return 1;
    cudaGraph_t clone;
    CHECK(cudaGraphClone(&clone, g));
    cudaGraphExec_t cloned;
    CHECK(cudaGraphInstantiate(&cloned, clone, 0));
    CHECK(cudaGraphLaunch(cloned, s1));
    CHECK(cudaStreamSynchronize(s1));
    for (int i = 0; i < n; i++) want[i] = 3.0f;
    if (!check(out, want, n, "cloned graph")) return 1;
    // Update the executable graph from the clone with its kernel node set to 5.
    cudaGraphNode_t ckern;
    CHECK(cudaGraphNodeFindInClone(&ckern, kern, clone));
    float factor5 = 5.0f;
    void* args5[] = {&d, &factor5, &count};
    kp.kernelParams = args5;
    CHECK(cudaGraphKernelNodeSetParams(ckern, &kp));
    cudaGraphExecUpdateResultInfo info;
    CHECK(cudaGraphExecUpdate(built, clone, &info));
    CHECK(cudaGraphLaunch(built, s1));
    CHECK(cudaStreamSynchronize(s1));
    for (int i = 0; i < n; i++) want[i] = 5.0f;
    if (!check(out, want, n, "updated graph")) return 1;

    // 3. A synchronisation inside a capture is refused and invalidates it.
    CHECK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
    add<<<1, threads, 0, s1>>>(d, 1.0f, threads);
    if (cudaStreamSynchronize(s1) != cudaErrorStreamCaptureUnsupported) {
        std::printf("FAIL synchronising a capturing stream\n");
        return 1;
    }
    cudaGraph_t broken = nullptr;
    if (cudaStreamEndCapture(s1, &broken) != cudaErrorStreamCaptureInvalidated || broken) {
        std::printf("FAIL an invalidated capture ended\n");
        return 1;
    }
    cudaGetLastError();

    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphExecDestroy(built));
    CHECK(cudaGraphExecDestroy(cloned));
    CHECK(cudaGraphDestroy(captured));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaGraphDestroy(clone));
    std::printf("PASS graphs: captured, built, changed, cloned, updated; capture misuse refused\n");
}

// Virtual memory management through the driver entry points cudart hands out
// (cudaGetDriverEntryPointByVersion): two physical allocations mapped side by side in one
// reservation and written by one kernel across the seam, then one of them unmapped and mapped
// into a second reservation where a kernel finds its contents; results checked against the
// host's own computation.
#include "common.h"
#include <cuda.h>

__global__ void ramp(int* x, int base, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = base + i;
}
__global__ void twice(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 2;
}

template <typename F> static F entry(const char* name) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    CHECK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q));
    if (!p || q != cudaDriverEntryPointSuccess) {
        std::printf("FAIL no driver entry point %s\n", name);
        std::exit(1);
    }
    return reinterpret_cast<F>(p);
}

#define DRV(call)                                                                          \
    do {                                                                                   \
        CUresult r_ = (call);                                                              \
        if (r_ != CUDA_SUCCESS) {                                                          \
            std::printf("FAIL %s: %d\n", #call, int(r_));                                  \
            return 1;                                                                      \
        }                                                                                  \
    } while (0)

int main() {
    CHECK(cudaSetDevice(0));  // the primary context, current
    CHECK(cudaDeviceSynchronize());
    auto granularity = entry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity");
    auto reserve = entry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
    auto unreserve = entry<decltype(&cuMemAddressFree)>("cuMemAddressFree");
    auto create = entry<decltype(&cuMemCreate)>("cuMemCreate");
    auto release = entry<decltype(&cuMemRelease)>("cuMemRelease");
    auto map = entry<decltype(&cuMemMap)>("cuMemMap");
    auto unmap = entry<decltype(&cuMemUnmap)>("cuMemUnmap");
    auto set_access = entry<decltype(&cuMemSetAccess)>("cuMemSetAccess");

    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t g = 0;
    DRV(granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUdeviceptr base = 0, other = 0;
    DRV(reserve(&base, 2 * g, 0, 0, 0));
    DRV(reserve(&other, g, 0, 0, 0));
    CUmemGenericAllocationHandle h[2];
    CUmemAccessDesc rw = {};
    rw.location = prop.location;
    rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int k = 0; k < 2; k++) {
        DRV(create(&h[k], g, &prop, 0));
        DRV(map(base + k * g, g, 0, h[k], 0));
        DRV(release(h[k]));  // the mapping keeps it
    }
    DRV(set_access(base, 2 * g, &rw, 1));

    // One kernel across the seam between the two physical allocations.
    const int n = 4096, threads = 128;
    int* seam = reinterpret_cast<int*>(base + g) - n / 2;
    ramp<<<n / threads, threads>>>(seam, 100, n);
    int host[n];
    CHECK(cudaMemcpy(host, seam, sizeof host, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (host[i] != 100 + i) { std::printf("FAIL across the seam at %d: %d\n", i, host[i]); return 1; }

    // The second allocation moves to the other reservation, keeping its contents: keep it
    // held while unmapped.
    CUmemGenericAllocationHandle kept;
    auto retain = entry<decltype(&cuMemRetainAllocationHandle)>("cuMemRetainAllocationHandle");
    DRV(retain(&kept, reinterpret_cast<void*>(base + g)));
    DRV(unmap(base + g, g));
    DRV(map(other, g, 0, kept, 0));
    DRV(release(kept));
    DRV(set_access(other, g, &rw, 1));
    int* moved = reinterpret_cast<int*>(other);
    twice<<<(n / 2) / threads, threads>>>(moved, n / 2);
    CHECK(cudaMemcpy(host, moved, (n / 2) * sizeof(int), cudaMemcpyDeviceToHost));
    for (int i = 0; i < n / 2; i++)
        if (host[i] != 2 * (100 + n / 2 + i)) { std::printf("FAIL moved mapping at %d: %d\n", i, host[i]); return 1; }

    DRV(unmap(base, g));
    DRV(unmap(other, g));
    DRV(unreserve(base, 2 * g));
    DRV(unreserve(other, g));
    std::printf("PASS vmm: two physical allocations mapped side by side, one moved with its contents\n");
}

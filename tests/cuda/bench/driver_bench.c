/* What a CUDA client pays per driver call, measured from the client: an empty kernel's launch
   to completion (cuLaunchKernel + cuCtxSynchronize), launches issued back to back with one
   synchronisation, and host<->device copy bandwidth. It talks to whatever libcuda.so.1 the
   loader finds (ours in a guest or on the host, or NVIDIA's), through the driver API only, so
   it needs no CUDA headers. Prints "RESULT key value" lines.
     driver_bench [LAUNCHES] [COPY_MIB] */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static const char *PTX = ".version 7.0\n.target sm_70\n.address_size 64\n"
                         ".visible .entry empty()\n{\nret;\n}\n";

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuCtxCreate)(void **, unsigned, int);
static CUresult (*cuModuleLoadData)(void **, const void *);
static CUresult (*cuModuleGetFunction)(void **, void *, const char *);
static CUresult (*cuLaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, void *, void **, void **);
static CUresult (*cuCtxSynchronize)(void);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        printf("FAIL no %s\n", name);
        exit(1);
    }
    return p;
}

static void check(CUresult r, const char *what) {
    if (r != 0) {
        printf("FAIL %s: CUresult %d\n", what, r);
        exit(1);
    }
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int launches = argc > 1 ? atoi(argv[1]) : 2000;
    size_t copy = (size_t)(argc > 2 ? atoi(argv[2]) : 16) << 20;
    if (launches < 10 || copy == 0) {
        printf("FAIL usage: driver_bench [LAUNCHES>=10] [COPY_MIB>=1]\n");
        return 2;
    }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("FAIL %s\n", dlerror());
        return 1;
    }
    cuInit = sym(lib, "cuInit");
    cuDeviceGet = sym(lib, "cuDeviceGet");
    cuCtxCreate = sym(lib, "cuCtxCreate_v2");
    cuModuleLoadData = sym(lib, "cuModuleLoadData");
    cuModuleGetFunction = sym(lib, "cuModuleGetFunction");
    cuLaunchKernel = sym(lib, "cuLaunchKernel");
    cuCtxSynchronize = sym(lib, "cuCtxSynchronize");
    cuMemAlloc = sym(lib, "cuMemAlloc_v2");
    cuMemcpyHtoD = sym(lib, "cuMemcpyHtoD_v2");
    cuMemcpyDtoH = sym(lib, "cuMemcpyDtoH_v2");

    int dev;
    void *ctx, *mod, *fn;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuCtxCreate(&ctx, 0, dev), "cuCtxCreate");
    check(cuModuleLoadData(&mod, PTX), "cuModuleLoadData");
    check(cuModuleGetFunction(&fn, mod, "empty"), "cuModuleGetFunction");

    double *t = malloc(sizeof(double) * launches);
    for (int i = 0; i < launches / 10; i++) {
        check(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "warm-up launch");
        check(cuCtxSynchronize(), "warm-up sync");
    }
    for (int i = 0; i < launches; i++) {
        double s = now_us();
        check(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "launch");
        check(cuCtxSynchronize(), "sync");
        t[i] = now_us() - s;
    }
    qsort(t, launches, sizeof(double), cmp);
    printf("RESULT launch_p50_us %.1f\n", t[launches / 2]);
    printf("RESULT launch_p99_us %.1f\n", t[launches * 99 / 100]);

    double s = now_us();
    for (int i = 0; i < launches; i++)
        check(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL), "batched launch");
    check(cuCtxSynchronize(), "batched sync");
    printf("RESULT batched_launch_us %.2f\n", (now_us() - s) / launches);

    CUdeviceptr buf;
    check(cuMemAlloc(&buf, copy), "cuMemAlloc");
    char *host = malloc(copy);
    memset(host, 0x5a, copy);
    const int rounds = 4;
    check(cuMemcpyHtoD(buf, host, copy), "warm-up HtoD");
    s = now_us();
    for (int i = 0; i < rounds; i++) check(cuMemcpyHtoD(buf, host, copy), "HtoD");
    printf("RESULT htod_gib_s %.3f\n", rounds * (double)copy / ((now_us() - s) / 1e6) / (1 << 30));
    memset(host, 0, copy);
    s = now_us();
    for (int i = 0; i < rounds; i++) check(cuMemcpyDtoH(host, buf, copy), "DtoH");
    printf("RESULT dtoh_gib_s %.3f\n", rounds * (double)copy / ((now_us() - s) / 1e6) / (1 << 30));
    for (size_t i = 0; i < copy; i += 4096)
        if (host[i] != 0x5a) {
            printf("FAIL DtoH returned wrong bytes at %zu\n", i);
            return 1;
        }
    printf("PASS\n");
    return 0;
}

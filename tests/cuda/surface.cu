// Surface objects: a kernel writes a 2D float array through surf2Dwrite, a second reads it
// back with surf2Dread in each boundary mode (trap inside, clamp and zero outside); the array
// is read by cudaMemcpy2DFromArray; every value checked against the host's.
#include "common.h"
#include <cstring>

const int W = 40, H = 12;

__global__ void paint(cudaSurfaceObject_t s) {
    int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
    if (x < W) surf2Dwrite(x * 0.5f + y * 100.0f, s, x * 4, y);
}
__global__ void probe(cudaSurfaceObject_t s, float* out) {
    int x = threadIdx.x - 4, y = blockIdx.x - 1;  // 4 columns and a row outside on each side
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float c, z = -1.0f;
    surf2Dread(&c, s, x * 4, y, cudaBoundaryModeClamp);
    surf2Dread(&z, s, x * 4, y, cudaBoundaryModeZero);
    out[2 * i] = c;
    out[2 * i + 1] = z;
}

static float value(int x, int y) { return x * 0.5f + y * 100.0f; }

int main() {
    cudaChannelFormatDesc fd = cudaCreateChannelDesc<float>();
    cudaArray_t a;
    CHECK(cudaMallocArray(&a, &fd, W, H, cudaArraySurfaceLoadStore));
    cudaResourceDesc r;
    std::memset(&r, 0, sizeof r);
    r.resType = cudaResourceTypeArray;
    r.res.array.array = a;
    cudaSurfaceObject_t s;
    CHECK(cudaCreateSurfaceObject(&s, &r));
    paint<<<dim3(2, H), 32>>>(s);
    static float back[W * H];
    CHECK(cudaMemcpy2DFromArray(back, W * 4, a, 0, 0, W * 4, H, cudaMemcpyDeviceToHost));
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            if (back[y * W + x] != value(x, y)) {
                std::printf("FAIL surf2Dwrite at (%d, %d): %g\n", x, y, back[y * W + x]);
                return 1;
            }
    const int PW = W + 8, PH = H + 2;
    float* d;
    CHECK(cudaMalloc(&d, PW * PH * 2 * sizeof(float)));
    probe<<<PH, PW>>>(s, d);
    static float got[PW * PH * 2];
    CHECK(cudaMemcpy(got, d, sizeof got, cudaMemcpyDeviceToHost));
    for (int by = 0; by < PH; by++)
        for (int tx = 0; tx < PW; tx++) {
            int x = tx - 4, y = by - 1, i = by * PW + tx;
            bool inside = x >= 0 && x < W && y >= 0 && y < H;
            int cx = x < 0 ? 0 : (x >= W ? W - 1 : x), cy = y < 0 ? 0 : (y >= H ? H - 1 : y);
            float clamp = value(cx, cy), zero = inside ? value(x, y) : 0.0f;
            if (got[2 * i] != clamp || got[2 * i + 1] != zero) {
                std::printf("FAIL surf2Dread at (%d, %d): clamp %g zero %g\n", x, y, got[2 * i], got[2 * i + 1]);
                return 1;
            }
        }
    CHECK(cudaDestroySurfaceObject(s));
    CHECK(cudaFreeArray(a));
    CHECK(cudaFree(d));
    std::printf("PASS surface writes and reads in every boundary mode\n");
}

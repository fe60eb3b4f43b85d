// Texture objects over a 2D float array (bilinear, clamp), a uchar4 array read as normalised
// floats (nearest, wrap, normalised coordinates), pitched memory (integers, border) and a
// layered array, each fetch checked bit for bit against the CUDA Programming Guide's texture
// fetching formulas computed here: linear weights in 9-bit fixed point (8 fractional bits).
#include "common.h"
#include <cmath>
#include <cstdint>
#include <cstring>

const int W = 24, H = 10, N = 64;

__global__ void fetch_float(cudaTextureObject_t t, const float2* at, float* out) {
    int i = threadIdx.x;
    out[i] = tex2D<float>(t, at[i].x, at[i].y);
}
__global__ void fetch_uchar4(cudaTextureObject_t t, const float2* at, float4* out) {
    int i = threadIdx.x;
    out[i] = tex2D<float4>(t, at[i].x, at[i].y);
}
__global__ void fetch_int(cudaTextureObject_t t, const float2* at, int* out) {
    int i = threadIdx.x;
    out[i] = tex2D<int>(t, at[i].x, at[i].y);
}
__global__ void fetch_layered(cudaTextureObject_t t, const float2* at, float* out) {
    int i = threadIdx.x;
    out[i] = tex2DLayered<float>(t, at[i].x, at[i].y, i % 3);
}

// The Guide's addressing of texel index i of n: clamp, border (-1: the border colour), wrap.
static int address(int i, int n, cudaTextureAddressMode m) {
    if (m == cudaAddressModeBorder) return (i < 0 || i >= n) ? -1 : i;
    if (m == cudaAddressModeWrap) return ((i % n) + n) % n;
    return i < 0 ? 0 : (i >= n ? n - 1 : i);
}
static float weight(float frac) { return std::round(frac * 256.0f) / 256.0f; }
static float bilinear(const float* img, int w, int h, float x, float y) {
    auto at = [&](int i, int j) { return img[address(j, h, cudaAddressModeClamp) * w + address(i, w, cudaAddressModeClamp)]; };
    float xb = x - 0.5f, yb = y - 0.5f, fi = std::floor(xb), fj = std::floor(yb);
    float a = weight(xb - fi), b = weight(yb - fj);
    int i = (int)fi, j = (int)fj;
    return (1 - a) * (1 - b) * at(i, j) + a * (1 - b) * at(i + 1, j) + (1 - a) * b * at(i, j + 1) + a * b * at(i + 1, j + 1);
}

static cudaTextureObject_t make(const cudaResourceDesc& r, cudaTextureAddressMode m, cudaTextureFilterMode f,
                                cudaTextureReadMode read, int normalized) {
    cudaTextureDesc td;
    std::memset(&td, 0, sizeof td);
    td.addressMode[0] = td.addressMode[1] = td.addressMode[2] = m;
    td.filterMode = f;
    td.readMode = read;
    td.normalizedCoords = normalized;
    cudaTextureObject_t t;
    CHECK(cudaCreateTextureObject(&t, &r, &td, nullptr));
    return t;
}

int main() {
    float img[W * H];
    for (int i = 0; i < W * H; i++) img[i] = (float)((i * 37) % 101) * 0.75f - 20.0f;
    float2 at[N];
    for (int i = 0; i < N; i++) at[i] = make_float2(-3.0f + i * 0.4791f, -1.5f + (i % 13) * 0.9137f);
    float2* d_at;
    CHECK(cudaMalloc(&d_at, sizeof at));
    CHECK(cudaMemcpy(d_at, at, sizeof at, cudaMemcpyHostToDevice));
    float* d_f;
    CHECK(cudaMalloc(&d_f, N * sizeof(float4)));

    // 1. A float array, bilinear, clamp, unnormalised.
    cudaChannelFormatDesc fd = cudaCreateChannelDesc<float>();
    cudaArray_t a;
    CHECK(cudaMallocArray(&a, &fd, W, H));
    CHECK(cudaMemcpy2DToArray(a, 0, 0, img, W * sizeof(float), W * sizeof(float), H, cudaMemcpyHostToDevice));
    cudaResourceDesc r;
    std::memset(&r, 0, sizeof r);
    r.resType = cudaResourceTypeArray;
    r.res.array.array = a;
    cudaTextureObject_t t = make(r, cudaAddressModeClamp, cudaFilterModeLinear, cudaReadModeElementType, 0);
    fetch_float<<<1, N>>>(t, d_at, d_f);
    float got[N];
    CHECK(cudaMemcpy(got, d_f, sizeof got, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) {
        float want = bilinear(img, W, H, at[i].x, at[i].y);
        if (std::memcmp(&got[i], &want, 4)) {
            std::printf("FAIL bilinear at (%g, %g): %.9g, want %.9g\n", at[i].x, at[i].y, got[i], want);
            return 1;
        }
    }
    CHECK(cudaDestroyTextureObject(t));

    // 2. uchar4 read as normalised floats, nearest, wrap, normalised coordinates.
    uchar4 px[W * H];
    for (int i = 0; i < W * H; i++) px[i] = make_uchar4(i & 255, (i * 3) & 255, 255 - (i & 255), (i * 7) & 255);
    cudaChannelFormatDesc cd = cudaCreateChannelDesc<uchar4>();
    cudaArray_t a4;
    CHECK(cudaMallocArray(&a4, &cd, W, H));
    CHECK(cudaMemcpy2DToArray(a4, 0, 0, px, W * 4, W * 4, H, cudaMemcpyHostToDevice));
    r.res.array.array = a4;
    t = make(r, cudaAddressModeWrap, cudaFilterModePoint, cudaReadModeNormalizedFloat, 1);
    float2 nat[N];
    for (int i = 0; i < N; i++) nat[i] = make_float2(at[i].x / W * 3.0f, at[i].y / H * 2.0f);
    CHECK(cudaMemcpy(d_at, nat, sizeof nat, cudaMemcpyHostToDevice));
    fetch_uchar4<<<1, N>>>(t, d_at, (float4*)d_f);
    float4 got4[N];
    CHECK(cudaMemcpy(got4, d_f, sizeof got4, cudaMemcpyDeviceToHost));
    for (int k = 0; k < N; k++) {
        int i = address((int)std::floor(nat[k].x * W), W, cudaAddressModeWrap);
        int j = address((int)std::floor(nat[k].y * H), H, cudaAddressModeWrap);
        uchar4 p = px[j * W + i];
        float4 want = make_float4(p.x / 255.0f, p.y / 255.0f, p.z / 255.0f, p.w / 255.0f);
        if (std::memcmp(&got4[k], &want, 16)) {
            std::printf("FAIL uchar4 at %d: %g %g %g %g\n", k, got4[k].x, got4[k].y, got4[k].z, got4[k].w);
            return 1;
        }
    }
    CHECK(cudaDestroyTextureObject(t));

    // 3. Pitched memory of ints, nearest, border (0 outside).
    int ints[W * H];
    for (int i = 0; i < W * H; i++) ints[i] = i * 1000 - 7;
    int* d_p;
    size_t pitch;
    CHECK(cudaMallocPitch((void**)&d_p, &pitch, W * sizeof(int), H));
    CHECK(cudaMemcpy2D(d_p, pitch, ints, W * sizeof(int), W * sizeof(int), H, cudaMemcpyHostToDevice));
    std::memset(&r, 0, sizeof r);
    r.resType = cudaResourceTypePitch2D;
    r.res.pitch2D.devPtr = d_p;
    r.res.pitch2D.desc = cudaCreateChannelDesc<int>();
    r.res.pitch2D.width = W;
    r.res.pitch2D.height = H;
    r.res.pitch2D.pitchInBytes = pitch;
    t = make(r, cudaAddressModeBorder, cudaFilterModePoint, cudaReadModeElementType, 0);
    CHECK(cudaMemcpy(d_at, at, sizeof at, cudaMemcpyHostToDevice));
    fetch_int<<<1, N>>>(t, d_at, (int*)d_f);
    int goti[N];
    CHECK(cudaMemcpy(goti, d_f, sizeof goti, cudaMemcpyDeviceToHost));
    for (int k = 0; k < N; k++) {
        int i = address((int)std::floor(at[k].x), W, cudaAddressModeBorder);
        int j = address((int)std::floor(at[k].y), H, cudaAddressModeBorder);
        int want = (i < 0 || j < 0) ? 0 : ints[j * W + i];
        if (goti[k] != want) {
            std::printf("FAIL pitched at %d: %d, want %d\n", k, goti[k], want);
            return 1;
        }
    }
    CHECK(cudaDestroyTextureObject(t));

    // 4. A layered array of 3 layers (copied with cudaMemcpy3D), nearest, clamp.
    static float layers[3 * W * H];
    for (int i = 0; i < 3 * W * H; i++) layers[i] = (float)i;
    cudaArray_t al;
    CHECK(cudaMalloc3DArray(&al, &fd, make_cudaExtent(W, H, 3), cudaArrayLayered));
    cudaMemcpy3DParms p;
    std::memset(&p, 0, sizeof p);
    p.srcPtr = make_cudaPitchedPtr(layers, W * sizeof(float), W, H);
    p.dstArray = al;
    p.extent = make_cudaExtent(W, H, 3);
    p.kind = cudaMemcpyHostToDevice;
    CHECK(cudaMemcpy3D(&p));
    std::memset(&r, 0, sizeof r);
    r.resType = cudaResourceTypeArray;
    r.res.array.array = al;
    t = make(r, cudaAddressModeClamp, cudaFilterModePoint, cudaReadModeElementType, 0);
    fetch_layered<<<1, N>>>(t, d_at, d_f);
    CHECK(cudaMemcpy(got, d_f, sizeof got, cudaMemcpyDeviceToHost));
    for (int k = 0; k < N; k++) {
        int i = address((int)std::floor(at[k].x), W, cudaAddressModeClamp);
        int j = address((int)std::floor(at[k].y), H, cudaAddressModeClamp);
        float want = layers[(k % 3) * W * H + j * W + i];
        if (got[k] != want) {
            std::printf("FAIL layered at %d: %g, want %g\n", k, got[k], want);
            return 1;
        }
    }
    CHECK(cudaDestroyTextureObject(t));
    CHECK(cudaFreeArray(a));
    CHECK(cudaFreeArray(a4));
    CHECK(cudaFreeArray(al));
    CHECK(cudaFree(d_p));
    std::printf("PASS texture fetches match the Guide's formulas\n");
}

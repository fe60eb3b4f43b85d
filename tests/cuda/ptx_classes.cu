// The classes of kernel that once ran without an error and gave wrong answers, each checked
// against the host: a bitwise CRC-64 (64-bit shifts, xors and selects), a layer normalisation
// in f32 (block reductions through shared memory and shuffles, rsqrtf, division, fma), an
// inclusive scan in one block of 1024 threads, double-precision sin/cos (the math library's
// extended-precision argument reduction, madc/addc) and the bit intrinsics that compile to
// lop3, shf, prmt, bfind, brev, dp4a and the carry chain of a 64 x 64 -> 128 multiply.
#include "common.h"
#include <cmath>
#include <cstdint>

#define CRC_BYTES 64
#define ROW 1024
#define LN_THREADS 256
#define SCAN_THREADS 1024

__global__ void crc64(const unsigned char* data, unsigned long long* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long crc = ~0ull;
    for (int k = 0; k < CRC_BYTES; k++) {
        crc ^= data[i * CRC_BYTES + k];
        for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ ((crc & 1) ? 0xC96C5795D7870F42ull : 0);
    }
    out[i] = ~crc;
}

__device__ float block_sum(float v, float* shared) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
    if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
    __syncthreads();
    float t = 0;
    for (int w = 0; w < LN_THREADS / 32; w++) t += shared[w];
    __syncthreads();
    return t;
}

__global__ void layer_norm(const float* x, const float* gamma, const float* beta, float* y) {
    __shared__ float partial[LN_THREADS / 32];
    const float* row = x + blockIdx.x * ROW;
    float s = 0;
    for (int i = threadIdx.x; i < ROW; i += LN_THREADS) s += row[i];
    float mean = block_sum(s, partial) / ROW;
    float q = 0;
    for (int i = threadIdx.x; i < ROW; i += LN_THREADS) q = fmaf(row[i] - mean, row[i] - mean, q);
    float inv = rsqrtf(block_sum(q, partial) / ROW + 1e-5f);
    for (int i = threadIdx.x; i < ROW; i += LN_THREADS)
        y[blockIdx.x * ROW + i] = fmaf((row[i] - mean) * inv, gamma[i], beta[i]);
}

__global__ void scan1024(const int* in, int* out) {
    __shared__ int buf[2][SCAN_THREADS];
    int t = threadIdx.x, cur = 0;
    buf[0][t] = in[t];
    __syncthreads();
    for (int off = 1; off < SCAN_THREADS; off *= 2) {
        int v = buf[cur][t];
        if (t >= off) v += buf[cur][t - off];
        buf[1 - cur][t] = v;
        cur = 1 - cur;
        __syncthreads();
    }
    out[t] = buf[cur][t];
}

__global__ void trig(const double* x, double* s, double* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { s[i] = sin(x[i]); c[i] = cos(x[i]); }
}

__global__ void bit_ops(const unsigned* a, const unsigned* b, unsigned long long* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned x = a[i], y = b[i];
    unsigned long long* o = out + i * 8;
    o[0] = (x & y) | (~x & (y ^ 0x5a5a5a5au));
    o[1] = __funnelshift_l(x, y, y & 63);
    o[2] = __byte_perm(x, y, y & 0x7777);
    o[3] = (unsigned)__clz(x) | (unsigned long long)(unsigned)__ffs(y) << 32;
    o[4] = __brev(x);
    o[5] = (unsigned)__dp4a((int)x, (int)y, 7);
    o[6] = __umul64hi((unsigned long long)x << 32 | y, (unsigned long long)y << 32 | x);
    o[7] = __funnelshift_rc(x, y, y & 63);
}

static unsigned long long crc64_host(const unsigned char* p) {
    unsigned long long crc = ~0ull;
    for (int k = 0; k < CRC_BYTES; k++) {
        crc ^= p[k];
        for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ ((crc & 1) ? 0xC96C5795D7870F42ull : 0);
    }
    return ~crc;
}

static int fail(const char* what, int i) {
    std::printf("FAIL %s at %d\n", what, i);
    return 1;
}

int main() {
    // CRC-64 of 256 chunks of pseudo-random bytes.
    const int chunks = 256;
    unsigned char* bytes = new unsigned char[chunks * CRC_BYTES];
    unsigned seed = 12345;
    for (int i = 0; i < chunks * CRC_BYTES; i++) bytes[i] = (seed = seed * 1103515245u + 12345u) >> 16;
    unsigned char* dbytes;
    unsigned long long *dcrc, crc[chunks];
    CHECK(cudaMalloc(&dbytes, chunks * CRC_BYTES));
    CHECK(cudaMalloc(&dcrc, sizeof crc));
    CHECK(cudaMemcpy(dbytes, bytes, chunks * CRC_BYTES, cudaMemcpyHostToDevice));
    crc64<<<chunks / 64, 64>>>(dbytes, dcrc, chunks);
    CHECK(cudaMemcpy(crc, dcrc, sizeof crc, cudaMemcpyDeviceToHost));
    for (int i = 0; i < chunks; i++)
        if (crc[i] != crc64_host(bytes + i * CRC_BYTES)) return fail("crc64", i);

    // Layer normalisation of 4 rows; the host computes in double.
    const int rows = 4;
    float *x = new float[rows * ROW], *y = new float[rows * ROW], g[ROW], be[ROW];
    for (int i = 0; i < rows * ROW; i++) x[i] = (float)((i * 7919) % 1000) / 100.0f - 3.0f + (i / ROW);
    for (int i = 0; i < ROW; i++) { g[i] = 0.5f + (i % 7) * 0.25f; be[i] = (i % 5) * 0.1f - 0.2f; }
    float *dx, *dy, *dg, *db;
    CHECK(cudaMalloc(&dx, rows * ROW * 4)); CHECK(cudaMalloc(&dy, rows * ROW * 4));
    CHECK(cudaMalloc(&dg, ROW * 4)); CHECK(cudaMalloc(&db, ROW * 4));
    CHECK(cudaMemcpy(dx, x, rows * ROW * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dg, g, ROW * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(db, be, ROW * 4, cudaMemcpyHostToDevice));
    layer_norm<<<rows, LN_THREADS>>>(dx, dg, db, dy);
    CHECK(cudaMemcpy(y, dy, rows * ROW * 4, cudaMemcpyDeviceToHost));
    for (int r = 0; r < rows; r++) {
        double m = 0, v = 0;
        for (int i = 0; i < ROW; i++) m += x[r * ROW + i];
        m /= ROW;
        for (int i = 0; i < ROW; i++) v += (x[r * ROW + i] - m) * (x[r * ROW + i] - m);
        double inv = 1.0 / std::sqrt(v / ROW + 1e-5);
        for (int i = 0; i < ROW; i++) {
            double want = (x[r * ROW + i] - m) * inv * g[i] + be[i];
            if (std::fabs(y[r * ROW + i] - want) > 1e-4 * (1 + std::fabs(want)))
                return fail("layer_norm", r * ROW + i);
        }
    }

    // An inclusive scan in one block of 1024 threads.
    int in[SCAN_THREADS], out[SCAN_THREADS];
    for (int i = 0; i < SCAN_THREADS; i++) in[i] = (i * 37) % 101 - 50;
    int *din, *dout;
    CHECK(cudaMalloc(&din, sizeof in)); CHECK(cudaMalloc(&dout, sizeof out));
    CHECK(cudaMemcpy(din, in, sizeof in, cudaMemcpyHostToDevice));
    scan1024<<<1, SCAN_THREADS>>>(din, dout);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost));
    for (int i = 0, s = 0; i < SCAN_THREADS; i++)
        if (out[i] != (s += in[i])) return fail("scan1024", i);

    // sin and cos in double, small and large arguments (the Payne-Hanek path).
    const int n = 64;
    double a[n], s[n], c[n];
    for (int i = 0; i < n; i++) a[i] = (i % 2 ? 1e6 : 0.37) * (i + 1) * (i % 3 ? 1 : -1);
    double *da, *ds, *dc;
    CHECK(cudaMalloc(&da, sizeof a)); CHECK(cudaMalloc(&ds, sizeof s)); CHECK(cudaMalloc(&dc, sizeof c));
    CHECK(cudaMemcpy(da, a, sizeof a, cudaMemcpyHostToDevice));
    trig<<<1, n>>>(da, ds, dc, n);
    CHECK(cudaMemcpy(s, ds, sizeof s, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(c, dc, sizeof c, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (std::fabs(s[i] - std::sin(a[i])) > 1e-15 || std::fabs(c[i] - std::cos(a[i])) > 1e-15)
            return fail("sin/cos", i);

    // Bit intrinsics against their definitions in the CUDA Math API.
    const int m = 128;
    unsigned ua[m], ub[m];
    unsigned long long bo[m * 8];
    for (int i = 0; i < m; i++) { ua[i] = seed = seed * 1103515245u + 12345u; ub[i] = seed = seed * 1103515245u + 12345u; }
    ua[0] = 0; ub[0] = 0; ua[1] = ~0u; ub[1] = 32;
    unsigned *dua, *dub;
    unsigned long long* dbo;
    CHECK(cudaMalloc(&dua, sizeof ua)); CHECK(cudaMalloc(&dub, sizeof ub)); CHECK(cudaMalloc(&dbo, sizeof bo));
    CHECK(cudaMemcpy(dua, ua, sizeof ua, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dub, ub, sizeof ub, cudaMemcpyHostToDevice));
    bit_ops<<<2, 64>>>(dua, dub, dbo, m);
    CHECK(cudaMemcpy(bo, dbo, sizeof bo, cudaMemcpyDeviceToHost));
    for (int i = 0; i < m; i++) {
        unsigned x = ua[i], yv = ub[i];
        unsigned long long w = (unsigned long long)yv << 32 | x;
        unsigned sh = yv & 63, shw = sh & 31, shc = sh > 32 ? 32 : sh;
        unsigned long long pool = w;
        unsigned perm = 0;
        for (int k = 0; k < 4; k++) perm |= (unsigned)((pool >> (((yv & 0x7777) >> (4 * k) & 7) * 8)) & 0xff) << (8 * k);
        unsigned clz = 0;
        while (clz < 32 && !(x >> (31 - clz) & 1)) clz++;
        unsigned ffs = 0;
        for (int k = 0; k < 32; k++) if (yv >> k & 1) { ffs = k + 1; break; }
        unsigned brev = 0;
        for (int k = 0; k < 32; k++) brev |= (x >> k & 1) << (31 - k);
        int dp = 7;
        for (int k = 0; k < 4; k++) dp += (int)(signed char)(x >> (8 * k)) * (int)(signed char)(yv >> (8 * k));
        unsigned long long p = (unsigned long long)x << 32 | yv, q = (unsigned long long)yv << 32 | x;
        unsigned long long hi = (unsigned long long)(((unsigned __int128)p * q) >> 64);
        unsigned long long want[8] = {
            (x & yv) | (~x & (yv ^ 0x5a5a5a5au)),
            (unsigned)((w << shw) >> 32),
            perm,
            clz | (unsigned long long)ffs << 32,
            brev,
            (unsigned)dp,
            hi,
            (unsigned)(w >> shc),
        };
        for (int k = 0; k < 8; k++)
            if (bo[i * 8 + k] != want[k]) return fail("bit_ops", i * 8 + k);
    }
    std::printf("PASS ptx_classes\n");
}

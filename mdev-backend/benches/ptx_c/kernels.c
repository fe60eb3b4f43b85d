/* The corpus kernels (the .cu files of tests/cuda) in C, each the same algorithm with its float
 * operations in the same order (nvcc contracts a * b + c into one fma: so do these). Blocks
 * of threads run as loops; a barrier ends one loop and starts the next. */
#include "launch.h"
#include <math.h>
#include <string.h>

#define WARP 32
#define NTHREADS (l->block[0] * l->block[1])
#define FOR_THREADS for (unsigned t = 0; t < NTHREADS; t++)

KERNEL(vecAdd)
static void vecAdd_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const float *a = l->buf[0], *b = l->buf[1];
    float* c = l->buf[2];
    int n = (int)l->i[0];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) c[i] = a[i] + b[i];
    }
}

#define TILE 16
KERNEL(matmul)
static void matmul_block(const Launch* l, unsigned bx, unsigned by) {
    const float *A = l->buf[0], *B = l->buf[1];
    float* C = l->buf[2];
    int n = (int)l->i[0];
    float As[TILE][TILE], Bs[TILE][TILE], sum[TILE][TILE] = {{0}};
    for (int t = 0; t < n; t += TILE) {
        for (int y = 0; y < TILE; y++)
            for (int x = 0; x < TILE; x++) {
                int row = by * TILE + y, col = bx * TILE + x;
                As[y][x] = A[row * n + t + x];
                Bs[y][x] = B[(t + y) * n + col];
            }
        for (int y = 0; y < TILE; y++)
            for (int x = 0; x < TILE; x++)
                for (int k = 0; k < TILE; k++) sum[y][x] = fmaf(As[y][k], Bs[k][x], sum[y][x]);
    }
    for (int y = 0; y < TILE; y++)
        for (int x = 0; x < TILE; x++) C[(by * TILE + y) * n + bx * TILE + x] = sum[y][x];
}

KERNEL(reduceSum)
static void reduceSum_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const unsigned* in = l->buf[0];
    unsigned* out = l->buf[1];
    int n = (int)l->i[0];
    for (unsigned w = 0; w < NTHREADS; w += WARP) {
        unsigned v[WARP];
        for (unsigned lane = 0; lane < WARP; lane++) {
            int i = (int)(bx * l->block[0] + w + lane);
            v[lane] = i < n ? in[i] : 0;
        }
        /* __shfl_down_sync: a lane past the warp's end reads its own value. */
        for (int d = 16; d > 0; d /= 2)
            for (int lane = 0; lane < WARP; lane++) v[lane] += v[lane + d < WARP ? lane + d : lane];
        __atomic_fetch_add(out, v[0], __ATOMIC_RELAXED);
    }
}

/* The inclusive Hillis-Steele scan over a double buffer of `count` values, in place in buf. */
static int* hillis_steele(int (*buf)[1024], unsigned count) {
    int cur = 0;
    for (unsigned off = 1; off < count; off *= 2) {
        for (unsigned t = 0; t < count; t++) {
            int v = buf[cur][t];
            if (t >= off) v += buf[cur][t - off];
            buf[1 - cur][t] = v;
        }
        cur = 1 - cur;
    }
    return buf[cur];
}

KERNEL(scanBlocks)
static void scanBlocks_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const int* in = l->buf[0];
    int* out = l->buf[1];
    int n = (int)l->i[0];
    int buf[2][1024];
    FOR_THREADS {
        int i = (int)(bx * 256 + t);
        buf[0][t] = i < n ? in[i] : 0;
    }
    int* r = hillis_steele(buf, 256);
    FOR_THREADS {
        int i = (int)(bx * 256 + t);
        if (i < n) out[i] = r[t];
    }
}

KERNEL(scan1024)
static void scan1024_block(const Launch* l, unsigned bx, unsigned by) {
    (void)bx, (void)by;
    const int* in = l->buf[0];
    int* out = l->buf[1];
    int buf[2][1024];
    FOR_THREADS buf[0][t] = in[t];
    int* r = hillis_steele(buf, 1024);
    FOR_THREADS out[t] = r[t];
}

KERNEL(histogram)
static void histogram_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const unsigned char* data = l->buf[0];
    unsigned* bins = l->buf[1];
    int n = (int)l->i[0];
    unsigned local[256];
    FOR_THREADS local[t] = 0;
    FOR_THREADS
    for (int i = (int)(bx * l->block[0] + t); i < n; i += (int)(l->block[0] * l->grid[0]))
        local[data[i]]++;
    FOR_THREADS
    if (local[t]) __atomic_fetch_add(&bins[t], local[t], __ATOMIC_RELAXED);
}

/* scale (streams_events, graphs): x[i] *= s. */
KERNEL(scale)
static void scale_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    float* x = l->buf[0];
    int n = (int)l->i[0];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) x[i] *= l->f[0];
    }
}

KERNEL(add)
static void add_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    float* x = l->buf[0];
    int n = (int)l->i[0];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) x[i] += l->f[0];
    }
}

typedef struct {
    float v[4];
} Float4;

KERNEL(copyVec4)
static void copyVec4_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const Float4* in = l->buf[0];
    Float4* out = l->buf[1];
    int n = (int)l->i[0];
    FOR_THREADS
    for (int i = (int)(bx * l->block[0] + t); i < n; i += (int)(l->block[0] * l->grid[0]))
        out[i] = in[i];
}

KERNEL(query)
static void query_block(const Launch* l, unsigned bx, unsigned by) {
    (void)bx, (void)by;
    int* out = l->buf[0];
    FOR_THREADS {
        if (t == 0) {
            out[0] = WARP;
            out[1] = (int)l->block[0];
            out[2] = (int)l->grid[0];
        }
        if (t == 37) out[3] = (int)(t % WARP);
    }
}

KERNEL(affine)
static void affine_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    int* x = l->buf[0];
    int a = (int)l->i[0], b = (int)l->i[1], n = (int)l->i[2];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) x[i] = (int)((unsigned)a * (unsigned)x[i] + (unsigned)b);
    }
}

KERNEL(fill)
static void fill_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    int* x = l->buf[0];
    int base = (int)l->i[0], n = (int)l->i[1];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) x[i] = base + i * 3;
    }
}

KERNEL(ramp)
static void ramp_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    int* x = l->buf[0];
    int base = (int)l->i[0], n = (int)l->i[1];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) x[i] = base + i;
    }
}

KERNEL(twice)
static void twice_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    int* x = l->buf[0];
    int n = (int)l->i[0];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) x[i] = (int)((unsigned)x[i] * 2u);
    }
}

KERNEL(saxpy)
static void saxpy_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const float* x = l->buf[0];
    float* y = l->buf[1];
    int n = (int)l->i[0];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i < n) y[i] = fmaf(l->f[0], x[i], y[i]);
    }
}

#define CRC_BYTES 64
KERNEL(crc64)
static void crc64_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const unsigned char* data = l->buf[0];
    unsigned long long* out = l->buf[1];
    int n = (int)l->i[0];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i >= n) continue;
        unsigned long long crc = ~0ull;
        for (int k = 0; k < CRC_BYTES; k++) {
            crc ^= data[i * CRC_BYTES + k];
            for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ ((crc & 1) ? 0xC96C5795D7870F42ull : 0);
        }
        out[i] = ~crc;
    }
}

#define ROW 1024
#define LN_THREADS 256
/* layer_norm's block_sum: a butterfly of __shfl_xor_sync in each warp, then every thread adds
 * the warps' sums in order. */
static float block_sum(float* v) {
    for (unsigned w = 0; w < LN_THREADS; w += WARP)
        for (int o = 16; o > 0; o /= 2) {
            float next[WARP];
            for (int lane = 0; lane < WARP; lane++) next[lane] = v[w + lane] + v[w + (lane ^ o)];
            memcpy(&v[w], next, sizeof next);
        }
    float t = 0;
    for (unsigned w = 0; w < LN_THREADS / WARP; w++) t += v[w * WARP];
    return t;
}

KERNEL(layer_norm)
static void layer_norm_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const float *x = l->buf[0], *gamma = l->buf[1], *beta = l->buf[2];
    float* y = l->buf[3];
    const float* row = x + bx * ROW;
    float v[LN_THREADS];
    FOR_THREADS {
        float s = 0;
        for (unsigned i = t; i < ROW; i += LN_THREADS) s += row[i];
        v[t] = s;
    }
    float mean = block_sum(v) / ROW;
    FOR_THREADS {
        float q = 0;
        for (unsigned i = t; i < ROW; i += LN_THREADS) q = fmaf(row[i] - mean, row[i] - mean, q);
        v[t] = q;
    }
    float inv = 1.0f / sqrtf(block_sum(v) / ROW + 1e-5f);
    FOR_THREADS
    for (unsigned i = t; i < ROW; i += LN_THREADS)
        y[bx * ROW + i] = fmaf((row[i] - mean) * inv, gamma[i], beta[i]);
}

/* The bit intrinsics as the CUDA Math API defines them. */
static unsigned funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
    unsigned long long w = (unsigned long long)hi << 32 | lo;
    return (unsigned)((w << (shift & 31)) >> 32);
}
static unsigned funnelshift_rc(unsigned lo, unsigned hi, unsigned shift) {
    unsigned long long w = (unsigned long long)hi << 32 | lo;
    return (unsigned)(w >> (shift > 32 ? 32 : shift));
}
static unsigned byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long pool = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int k = 0; k < 4; k++) r |= (unsigned)((pool >> ((s >> (4 * k) & 7) * 8)) & 0xff) << (8 * k);
    return r;
}
static unsigned brev(unsigned x) {
    unsigned r = 0;
    for (int k = 0; k < 32; k++) r |= (x >> k & 1) << (31 - k);
    return r;
}
static int dp4a(int x, int y, int c) {
    for (int k = 0; k < 4; k++) c += (int)(signed char)(x >> (8 * k)) * (int)(signed char)(y >> (8 * k));
    return c;
}

KERNEL(bit_ops)
static void bit_ops_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const unsigned *a = l->buf[0], *b = l->buf[1];
    unsigned long long* out = l->buf[2];
    int n = (int)l->i[0];
    FOR_THREADS {
        int i = (int)(bx * l->block[0] + t);
        if (i >= n) continue;
        unsigned x = a[i], y = b[i];
        unsigned long long* o = out + i * 8;
        unsigned long long p = (unsigned long long)x << 32 | y, q = (unsigned long long)y << 32 | x;
        o[0] = (x & y) | (~x & (y ^ 0x5a5a5a5au));
        o[1] = funnelshift_l(x, y, y & 63);
        o[2] = byte_perm(x, y, y & 0x7777);
        o[3] = (unsigned)(x ? __builtin_clz(x) : 32) | (unsigned long long)(unsigned)__builtin_ffs((int)y) << 32;
        o[4] = brev(x);
        o[5] = (unsigned)dp4a((int)x, (int)y, 7);
        o[6] = (unsigned long long)(((unsigned __int128)p * q) >> 64);
        o[7] = funnelshift_rc(x, y, y & 63);
    }
}

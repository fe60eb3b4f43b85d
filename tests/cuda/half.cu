// Half precision (cuda_fp16.h) on pairs of edge and random binary16 values: scalar and
// packed arithmetic, sign operations, comparisons and conversions in every rounding mode,
// each result compared bit for bit with a host reference built from IEEE 754 binary16's
// definition (exact values as integer counts of 2^-48, rounded by searching the encodings).
#include "common.h"
#include <cuda_fp16.h>
#include <cmath>
#include <cstdint>
#include <cstring>

// Results per pair of operands (a, b), with c = the operand of the next pair.
enum { ADD, SUB, MUL, FMA, NEG, ABS, ADD2, MUL2, FMA2, EQ, LT, GEU, TO_F32, FROM_RN, FROM_RZ,
       FROM_RD, FROM_RU, FROM_INT, TO_INT, NRESULTS };

__global__ void halves(const unsigned short* a, const unsigned short* b, const float* f,
                       const int* k, unsigned* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    __half x = __ushort_as_half(a[i]), y = __ushort_as_half(b[i]);
    __half z = __ushort_as_half(a[(i + 1) % n]);
    __half2 x2 = __halves2half2(x, y), y2 = __halves2half2(y, z), z2 = __halves2half2(z, x);
    unsigned* o = out + size_t(i) * NRESULTS;
    o[ADD] = __half_as_ushort(__hadd(x, y));
    o[SUB] = __half_as_ushort(__hsub(x, y));
    o[MUL] = __half_as_ushort(__hmul(x, y));
    o[FMA] = __half_as_ushort(__hfma(x, y, z));
    o[NEG] = __half_as_ushort(__hneg(x));
    o[ABS] = __half_as_ushort(__habs(x));
    __half2 s = __hadd2(x2, y2), p = __hmul2(x2, y2), m = __hfma2(x2, y2, z2);
    o[ADD2] = __half_as_ushort(__low2half(s)) | unsigned(__half_as_ushort(__high2half(s))) << 16;
    o[MUL2] = __half_as_ushort(__low2half(p)) | unsigned(__half_as_ushort(__high2half(p))) << 16;
    o[FMA2] = __half_as_ushort(__low2half(m)) | unsigned(__half_as_ushort(__high2half(m))) << 16;
    o[EQ] = __heq(x, y);
    o[LT] = __hlt(x, y);
    o[GEU] = __hgeu(x, y);
    float g = __half2float(x);
    std::memcpy(&o[TO_F32], &g, 4);
    o[FROM_RN] = __half_as_ushort(__float2half_rn(f[i]));
    o[FROM_RZ] = __half_as_ushort(__float2half_rz(f[i]));
    o[FROM_RD] = __half_as_ushort(__float2half_rd(f[i]));
    o[FROM_RU] = __half_as_ushort(__float2half_ru(f[i]));
    o[FROM_INT] = __half_as_ushort(__int2half_rn(k[i]));
    o[TO_INT] = unsigned(__half2int_rn(x));
}

// ---- host reference ----

static bool is_nan(uint16_t h) { return (h & 0x7fff) > 0x7c00; }
static bool is_inf(uint16_t h) { return (h & 0x7fff) == 0x7c00; }

// A finite binary16 as a signed count of 2^-24: (1.f or 0.f) * 2^(e-15).
static __int128 units24(uint16_t h) {
    int e = (h >> 10) & 31;
    __int128 m = h & 0x3ff;
    if (e) m |= 0x400;
    __int128 v = m << (e ? e - 1 : 0);
    return (h & 0x8000) ? -v : v;
}

enum Mode { RN, RZ, RD, RU };

// Rounds (-1)^neg * mag * 2^-scale (mag exact, nonzero, scale >= 24) to binary16: the
// largest encoding not above it by binary search, then the neighbour the mode picks (+inf
// standing for 2^16, where rounding to nearest overflows).
static uint16_t round_units(bool neg, unsigned __int128 mag, int scale, Mode mode) {
    auto value = [scale](unsigned k) -> unsigned __int128 {
        return k == 0x7c00 ? (unsigned __int128)1 << (16 + scale)
                           : (unsigned __int128)units24(k) << (scale - 24);
    };
    bool away = (mode == RD && neg) || (mode == RU && !neg);
    unsigned k;
    if (mag >= value(0x7c00)) {
        k = (mode == RN || away) ? 0x7c00 : 0x7bff;
    } else {
        unsigned lo = 0, hi = 0x7c00;
        while (hi - lo > 1) {
            unsigned mid = (lo + hi) / 2;
            if (mag < value(mid)) hi = mid; else lo = mid;
        }
        if (mag == value(lo)) k = lo;
        else if (mode == RN) {
            unsigned __int128 twice = mag * 2, mid2 = value(lo) + value(lo + 1);
            k = twice < mid2 ? lo : twice > mid2 ? lo + 1 : (lo & 1 ? lo + 1 : lo);
        } else k = away ? lo + 1 : lo;
    }
    return uint16_t(k | (neg ? 0x8000 : 0));
}

// a * b + c once rounded to nearest; b == 0x3c00 (1.0) gives a sum, c absent a product.
static uint16_t fma_ref(uint16_t a, uint16_t b, const uint16_t* c) {
    uint16_t cz = c ? *c : uint16_t((a ^ b) & 0x8000);
    if (is_nan(a) || is_nan(b) || is_nan(cz)) return 0x7fff;
    bool ps = (a ^ b) & 0x8000;
    bool pinf = is_inf(a) || is_inf(b);
    bool pzero = (a & 0x7fff) == 0 || (b & 0x7fff) == 0;
    if (pinf && pzero) return 0x7fff;
    if (pinf && is_inf(cz) && ps != bool(cz & 0x8000)) return 0x7fff;
    if (pinf) return ps ? 0xfc00 : 0x7c00;
    if (is_inf(cz)) return cz;
    __int128 exact = units24(a) * units24(b) + (units24(cz) << 24);
    if (exact == 0) {
        bool cs = cz & 0x8000;
        bool both_zero = units24(a) * units24(b) == 0 && units24(cz) == 0;
        return (both_zero && ps == cs) ? uint16_t(ps ? 0x8000 : 0) : 0;
    }
    return round_units(exact < 0, exact < 0 ? -exact : exact, 48, RN);
}

// A float rounded to binary16: counted in 2^-73 it is a whole number below 2^89 when
// 2^-50 <= |v| < 2^16 (24 significant bits); smaller magnitudes are far below half the
// least subnormal, larger ones past the overflow threshold.
static uint16_t from_float(float v, Mode mode) {
    if (v != v) return 0x7fff;
    bool neg = std::signbit(v);
    if (std::isinf(v)) return neg ? 0xfc00 : 0x7c00;
    if (v == 0) return neg ? 0x8000 : 0;
    double mag = std::fabs(double(v));
    if (mag >= 65536.0) return round_units(neg, (unsigned __int128)1 << 89, 73, mode);
    if (mag < 0x1p-50) return round_units(neg, 1, 73, mode);
    return round_units(neg, (unsigned __int128)(mag * 0x1p73), 73, mode);
}

static double value_of(uint16_t h) {
    if (is_nan(h)) return NAN;
    if (is_inf(h)) return (h & 0x8000) ? -INFINITY : INFINITY;
    return double(units24(h)) * 0x1p-24;
}

int main() {
    static const uint16_t edges[] = {0x0000, 0x8000, 0x3c00, 0xbc00, 0x3c01, 0x3bff, 0x4200,
                                     0x2e66, 0x0001, 0x8001, 0x03ff, 0x0400, 0x8400, 0x7bff,
                                     0xfbff, 0x7c00, 0xfc00, 0x7e00, 0x6bff, 0x1400, 0x5bff};
    const int ne = sizeof edges / sizeof edges[0];
    const int n = ne * ne + 4096;
    uint16_t *ha = new uint16_t[n], *hb = new uint16_t[n];
    float* hf = new float[n];
    int* hk = new int[n];
    uint32_t seed = 12345;
    auto next = [&] { seed = seed * 1664525u + 1013904223u; return seed; };
    for (int i = 0; i < n; i++) {
        if (i < ne * ne) {
            ha[i] = edges[i / ne];
            hb[i] = edges[i % ne];
        } else {
            // Exponents near 1 so sums and products round; some reach the subnormals.
            ha[i] = uint16_t((next() & 0x83ff) | ((6 + next() % 20) << 10));
            hb[i] = uint16_t((next() & 0x83ff) | ((6 + next() % 20) << 10));
        }
        uint32_t fb = (next() & 0x807fffff) | ((0x60 + next() % 48) << 23);
        if (i % 97 == 0) fb = 0x477ff000 + (i & 0xfff);  // around 65520 (overflow ties)
        std::memcpy(&hf[i], &fb, 4);
        hk[i] = int(next()) >> (next() % 24);
    }
    unsigned short *a, *b;
    float* f;
    int* k;
    unsigned* out;
    CHECK(cudaMalloc(&a, n * 2)); CHECK(cudaMalloc(&b, n * 2));
    CHECK(cudaMalloc(&f, n * 4)); CHECK(cudaMalloc(&k, n * 4));
    CHECK(cudaMalloc(&out, size_t(n) * NRESULTS * 4));
    CHECK(cudaMemcpy(a, ha, n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(b, hb, n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(f, hf, n * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(k, hk, n * 4, cudaMemcpyHostToDevice));
    halves<<<(n + 127) / 128, 128>>>(a, b, f, k, out, n);
    CHECK(cudaGetLastError());
    unsigned* ho = new unsigned[size_t(n) * NRESULTS];
    CHECK(cudaMemcpy(ho, out, size_t(n) * NRESULTS * 4, cudaMemcpyDeviceToHost));
    const uint16_t one = 0x3c00;
    int bad = 0;
    for (int i = 0; i < n && bad < 10; i++) {
        uint16_t x = ha[i], y = hb[i], z = ha[(i + 1) % n];
        uint16_t ny = uint16_t(y ^ 0x8000);
        double vx = value_of(x), vy = value_of(y);
        float gx;
        std::memcpy(&gx, &ho[size_t(i) * NRESULTS + TO_F32], 4);
        double rni = std::nearbyint(vx);
        int want_int = vx != vx ? 0 : rni >= 2147483647.0 ? 2147483647 :
                       rni <= -2147483648.0 ? int(-2147483647 - 1) : int(rni);
        int hk_i = hk[i];
        unsigned __int128 kmag = (unsigned __int128)(hk_i < 0 ? -(long long)hk_i : hk_i) << 48;
        uint32_t want[NRESULTS] = {
            fma_ref(x, one, &y), fma_ref(x, one, &ny), fma_ref(x, y, nullptr), fma_ref(x, y, &z),
            uint16_t(x ^ 0x8000), uint16_t(x & 0x7fff),
            fma_ref(x, one, &y) | uint32_t(fma_ref(y, one, &z)) << 16,
            fma_ref(x, y, nullptr) | uint32_t(fma_ref(y, z, nullptr)) << 16,
            fma_ref(x, y, &z) | uint32_t(fma_ref(y, z, &x)) << 16,
            vx == vy, vx < vy, !(vx < vy),
            0, from_float(hf[i], RN), from_float(hf[i], RZ), from_float(hf[i], RD),
            from_float(hf[i], RU),
            hk_i == 0 ? 0u : round_units(hk_i < 0, kmag, 48, RN), uint32_t(want_int)};
        for (int r = 0; r < NRESULTS; r++) {
            uint32_t got = ho[size_t(i) * NRESULTS + r];
            bool ok = r == TO_F32 ? (vx != vx ? gx != gx : double(gx) == vx && std::signbit(gx) == bool(x & 0x8000))
                                  : got == want[r];
            if (!ok && bad++ < 10)
                std::printf("FAIL result %d of (%#06x, %#06x, %#06x, %a, %d): got %#x, want %#x\n",
                            r, x, y, z, hf[i], hk_i, got, want[r]);
        }
    }
    if (bad) return 1;
    std::printf("PASS: %d operand pairs, %d half-precision results each, bit-exact\n", n,
                int(NRESULTS));
}

/* half.cu's `halves` in C: binary16 values as their bits, converted from float by rounding
 * the significand in each of the four modes, arithmetic done in float (sums and products of
 * binary16 values, rounded to float then to binary16, round once: float has more than twice
 * binary16's precision plus two bits) and fma in double. */
#include "launch.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { RN, RZ, RD, RU };
/* The canonical NaN a GPU's f16 arithmetic returns. */
#define NAN16 0x7fff

static float h2f(uint16_t h) {
    int e = (h >> 10) & 31;
    unsigned m = h & 0x3ff;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 0x400), e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t f2h(float f, int mode) {
    uint32_t b;
    memcpy(&b, &f, 4);
    uint16_t sign = (b >> 16) & 0x8000;
    uint32_t mag = b & 0x7fffffff;
    if (mag > 0x7f800000) return NAN16;
    if (mag == 0x7f800000) return sign | 0x7c00;
    if (mag == 0) return sign;
    int e = (int)(mag >> 23) - 127;
    uint64_t m = mag & 0x7fffff;
    if (e == -127) e = -126; /* float subnormal */
    else m |= 0x800000;
    int overflow = e > 15;
    int shift = (e < -14 ? -14 : e) - 10 - (e - 23);
    if (shift > 40) shift = 40;
    uint64_t q = overflow ? 0 : m >> shift, rem = m & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    int up = mode == RN ? (rem > half || (rem == half && (q & 1)))
           : mode == RD ? (sign && rem)
           : mode == RU ? (!sign && rem)
                        : 0;
    q += (uint64_t)up;
    uint32_t enc = e < -14 ? (uint32_t)q : (uint32_t)(((e + 15) << 10) + (int)q - 1024);
    if (overflow || enc >= 0x7c00) {
        int to_inf = mode == RN || (mode == RD && sign) || (mode == RU && !sign);
        return sign | (to_inf ? 0x7c00 : 0x7bff);
    }
    return sign | (uint16_t)enc;
}

static uint16_t hadd(uint16_t x, uint16_t y) { return f2h(h2f(x) + h2f(y), RN); }
static uint16_t hsub(uint16_t x, uint16_t y) { return f2h(h2f(x) - h2f(y), RN); }
static uint16_t hmul(uint16_t x, uint16_t y) { return f2h(h2f(x) * h2f(y), RN); }
static uint16_t hfma(uint16_t x, uint16_t y, uint16_t z) {
    return f2h((float)fma((double)h2f(x), (double)h2f(y), (double)h2f(z)), RN);
}
static unsigned pack(uint16_t lo, uint16_t hi) { return lo | (unsigned)hi << 16; }

static int half2int_rn(uint16_t h) {
    float v = h2f(h);
    if (v != v) return 0;
    if (v >= 2147483648.0f) return 2147483647;
    if (v <= -2147483648.0f) return (int)0x80000000u;
    return (int)rintf(v);
}

/* Results per element, in half.cu's order. */
enum { ADD, SUB, MUL, FMA, NEG, ABS, ADD2, MUL2, FMA2, EQ, LT, GEU, TO_F32, FROM_RN, FROM_RZ,
       FROM_RD, FROM_RU, FROM_INT, TO_INT, NRESULTS };

KERNEL(halves)
static void halves_block(const Launch* l, unsigned bx, unsigned by) {
    (void)by;
    const uint16_t *a = l->buf[0], *b = l->buf[1];
    const float* f = l->buf[2];
    const int* k = l->buf[3];
    unsigned* out = l->buf[4];
    int n = (int)l->i[0];
    for (unsigned t = 0; t < l->block[0]; t++) {
        int i = (int)(bx * l->block[0] + t);
        if (i >= n) continue;
        uint16_t x = a[i], y = b[i], z = a[(i + 1) % n];
        unsigned* o = out + (size_t)i * NRESULTS;
        float fx = h2f(x), fy = h2f(y);
        o[ADD] = hadd(x, y);
        o[SUB] = hsub(x, y);
        o[MUL] = hmul(x, y);
        o[FMA] = hfma(x, y, z);
        o[NEG] = x ^ 0x8000u;
        o[ABS] = x & 0x7fffu;
        o[ADD2] = pack(hadd(x, y), hadd(y, z));
        o[MUL2] = pack(hmul(x, y), hmul(y, z));
        o[FMA2] = pack(hfma(x, y, z), hfma(y, z, x));
        o[EQ] = fx == fy;
        o[LT] = fx < fy;
        o[GEU] = !(fx < fy);
        memcpy(&o[TO_F32], &fx, 4);
        o[FROM_RN] = f2h(f[i], RN);
        o[FROM_RZ] = f2h(f[i], RZ);
        o[FROM_RD] = f2h(f[i], RD);
        o[FROM_RU] = f2h(f[i], RU);
        o[FROM_INT] = f2h((float)k[i], RN);
        o[TO_INT] = (unsigned)half2int_rn(x);
    }
}

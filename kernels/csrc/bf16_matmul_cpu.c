// y = x @ W.T in bfloat16 on the CPU (--dtype bfloat16): W [N, K] prepacked in bf16 panels, x
// [M, K] fp32 rounded to bf16 (round to nearest even), the products summed in fp32 by AVX512_BF16's
// vdpbf16ps, y fp32 (not rounded to bf16).
//
// Panels (kernels/cpu_gemm.py Bf16PanelWeight): tile t holds outputs 32 t .. 32 t + 31 as
// P[t][kp][j][2] = W[32 t + j][2 kp + {0, 1}], K padded to even and N to a multiple of 32 with
// zeros. One vdpbf16ps takes one k pair for 16 outputs: acc[j] += x[2kp] * W[j][2kp] +
// x[2kp+1] * W[j][2kp+1] (bf16 products are exact in fp32), so every output y[m][n] is one chain
// of these over kp = 0, 1, ... in order, whatever M, the tile of rows, the thread or the call:
// a row's bits depend on nothing else in the batch (batch invariant by construction, nothing to
// calibrate), and a decoded token gets the bits it would get inside a prefill chunk.
//
// Register blocking: 8 rows x 32 outputs (16 accumulators, two panel loads and eight broadcasts
// per k pair); a single row takes 4 tiles at once (8 independent chains, since one row would
// otherwise wait on the instruction's latency). Threads take groups of tiles; within a group,
// rows go by in blocks of 64, so a block of x and the group's panels stay in L2.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_pool.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KVF_BF16 1
#define KVF_BF16_NATIVE 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX-512 without AVX512_BF16 (Skylake-SP, Cascade Lake, Ice Lake): the same products and sums
// emulated. x is rounded as vcvtneps2bf16 rounds (nearest even, denormals to signed zero, NaN
// quieted) and held as fp32; each panel load is widened to fp32 (a bf16 is the top half of
// its fp32), and each k pair takes two fmas, the odd k first as vdpbf16ps adds it (bf16
// products are exact in fp32, so fma's one rounding is the instruction's). Bits differ from
// the native kernel's only where vdpbf16ps flushes denormal sums to zero.
#include <immintrin.h>
#define KVF_BF16 1
#endif

#define NR 32          // outputs per panel
#define GROUP_TILES 4  // tiles per task
#define ROW_BLOCK 64   // rows of x per pass over a group's panels

typedef struct {
    // x as bf16 pairs: row m's pair kp at xb[m * Kp + kp] (emulated: as two fp32 values, even k
    // then odd k, at xf[2 (m * Kp + kp)])
    const uint32_t* xb;
    const float* xf;
    int M, Kp;
    const uint16_t* P;
    int N, tiles;
    float* y;
    int y_stride;
} bf16_ctx;

#ifdef KVF_BF16
static inline __mmask16 lane_mask(int n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }

#ifdef KVF_BF16_NATIVE
typedef __m512bh pairs32;  // 16 lanes of a bf16 pair
#define LOAD_PAIRS(p) ((__m512bh)_mm512_loadu_si512(p))
// acc += the pair of row r's x at pair k times the panel's pairs b
#define DOT_PAIR(acc, c, r, k, b) \
    _mm512_dpbf16_ps((acc), (__m512bh)_mm512_set1_epi32((int)(c)->xb[(size_t)(r) * (c)->Kp + (k)]), (b))
#else
typedef struct {
    __m512 even, odd;
} pairs32;
static inline pairs32 load_pairs(const uint16_t* p) {
    const __m512i v = _mm512_loadu_si512(p);
    return (pairs32){_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                     _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000)))};
}
#define LOAD_PAIRS(p) load_pairs(p)
static inline __m512 dot_pair(__m512 acc, const float* xp, pairs32 b) {
    acc = _mm512_fmadd_ps(_mm512_set1_ps(xp[1]), b.odd, acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(xp[0]), b.even, acc);
}
#define DOT_PAIR(acc, c, r, k, b) dot_pair((acc), (c)->xf + 2 * ((size_t)(r) * (c)->Kp + (k)), (b))
#endif

// Outputs [n0, n0 + nr) of one row from its 2 accumulators (nr <= 32).
static inline void store_row(float* out, __m512 lo, __m512 hi, int nr) {
    if (nr == NR) {
        _mm512_storeu_ps(out, lo);
        _mm512_storeu_ps(out + 16, hi);
    } else {
        _mm512_mask_storeu_ps(out, lane_mask(nr), lo);
        if (nr > 16) _mm512_mask_storeu_ps(out + 16, lane_mask(nr - 16), hi);
    }
}

// Rows m0 .. m0 + R - 1 (R a constant once inlined, 1..8) x one tile.
static inline __attribute__((always_inline)) void rows_x_tile(const bf16_ctx* c, int m0,
                                                              const int R, int t) {
    const int Kp = c->Kp;
    const uint16_t* panel = c->P + (size_t)t * Kp * (2 * NR);
    __m512 lo[8], hi[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int k = 0; k < Kp; k++) {
        const pairs32 b0 = LOAD_PAIRS(panel + (size_t)k * 2 * NR);
        const pairs32 b1 = LOAD_PAIRS(panel + (size_t)k * 2 * NR + NR);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            lo[r] = DOT_PAIR(lo[r], c, m0 + r, k, b0);
            hi[r] = DOT_PAIR(hi[r], c, m0 + r, k, b1);
        }
    }
    const int n0 = t * NR, nr = c->N - n0 < NR ? c->N - n0 : NR;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) store_row(c->y + (size_t)(m0 + r) * c->y_stride + n0, lo[r], hi[r], nr);
}

// One row x 4 consecutive tiles [t, t + 4): the same chains as rows_x_tile, 8 at once.
static void row_x_4_tiles(const bf16_ctx* c, int m, int t) {
    const int Kp = c->Kp;
    const size_t ts = (size_t)Kp * 2 * NR;
    const uint16_t* p0 = c->P + (size_t)t * ts;
    __m512 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
    for (int k = 0; k < Kp; k++) {
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            const uint16_t* p = p0 + q * ts + (size_t)k * 2 * NR;
            acc[2 * q] = DOT_PAIR(acc[2 * q], c, m, k, LOAD_PAIRS(p));
            acc[2 * q + 1] = DOT_PAIR(acc[2 * q + 1], c, m, k, LOAD_PAIRS(p + NR));
        }
    }
    for (int q = 0; q < 4; q++) {
        const int n0 = (t + q) * NR, nr = c->N - n0 < NR ? c->N - n0 : NR;
        store_row(c->y + (size_t)m * c->y_stride + n0, acc[2 * q], acc[2 * q + 1], nr);
    }
}

static void tile_group(void* vc, long g) {
    const bf16_ctx* c = vc;
    const int t0 = (int)g * GROUP_TILES;
    const int t1 = t0 + GROUP_TILES < c->tiles ? t0 + GROUP_TILES : c->tiles;
    for (int mb = 0; mb < c->M; mb += ROW_BLOCK) {
        const int me = mb + ROW_BLOCK < c->M ? mb + ROW_BLOCK : c->M;
        int m = mb;
        if (me - mb < 8 && t1 - t0 == 4) {  // a few rows: each one across the whole group
            for (; m < me; m++) row_x_4_tiles(c, m, t0);
            continue;
        }
        for (int t = t0; t < t1; t++) {
            m = mb;
            for (; m + 8 <= me; m += 8) rows_x_tile(c, m, 8, t);
            if (me - m >= 4) { rows_x_tile(c, m, 4, t); m += 4; }
            if (me - m >= 2) { rows_x_tile(c, m, 2, t); m += 2; }
            if (me - m >= 1) rows_x_tile(c, m, 1, t);
        }
    }
}

#ifndef KVF_BF16_NATIVE
// Row x [K] fp32 -> its values rounded to bf16 as vcvtneps2bf16 rounds them, as fp32 (K odd: a
// zero pads the last pair).
static void round_row_f32(const float* x, int K, float* out) {
    for (int k = 0; k < K; k++) {
        uint32_t b;
        memcpy(&b, &x[k], 4);
        const uint32_t e = b & 0x7f800000u;
        if (e == 0) b &= 0x80000000u;                                   // zero, denormal
        else if (e == 0x7f800000u && (b & 0x7fffffu)) b |= 0x00400000u;  // NaN: quieted
        else if (e != 0x7f800000u) b += 0x7fffu + ((b >> 16) & 1u);       // nearest even
        b &= 0xffff0000u;
        memcpy(&out[k], &b, 4);
    }
    if (K & 1) out[K] = 0.0f;
}
#endif

// Row x [K] fp32 -> bf16 pairs (round to nearest even; K odd: a zero pads the last pair).
static inline void round_row(const float* x, int K, uint16_t* out) {
#ifdef KVF_BF16_NATIVE
    int k = 0;
    for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i*)(out + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
    if (k < K) {
        const __mmask16 m = lane_mask(K - k);
        _mm256_mask_storeu_epi16(out + k, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k)));
    }
    if (K & 1) out[K] = 0;
#else
    (void)x, (void)K, (void)out;
#endif
}
#endif

// Whether this build has the kernel: 2 with AVX512_BF16, 1 emulating it (AVX-512 F/BW/VL), 0.
int kvf_bf16_available(void) {
#if defined(KVF_BF16_NATIVE)
    return 2;
#elif defined(KVF_BF16)
    return 1;
#else
    return 0;
#endif
}

// y [M, N] (row stride y_stride) = x [M, K] (row stride x_stride) @ W.T for W in panels P (see
// the top of this file). Returns 0, -1 on bad arguments, -2 without memory, -3 where this build
// has no AVX-512 (callers then use oneDNN).
int kvf_bf16_panel_matmul(const float* x, int M, int K, int x_stride, const uint16_t* P, int N,
                          float* y, int y_stride, int threads) {
    if (M < 0 || N < 0 || K <= 0 || x_stride < K || y_stride < N) return -1;
#ifdef KVF_BF16
    if (M == 0 || N == 0) return 0;
    const int Kp = (K + 1) / 2, tiles = (N + NR - 1) / NR;
#ifdef KVF_BF16_NATIVE
    uint32_t* xb = malloc((size_t)M * Kp * sizeof(uint32_t));
    if (!xb) return -2;
    for (int m = 0; m < M; m++) round_row(x + (size_t)m * x_stride, K, (uint16_t*)(xb + (size_t)m * Kp));
    bf16_ctx c = {xb, NULL, M, Kp, P, N, tiles, y, y_stride};
#else
    float* xf = malloc((size_t)M * Kp * 2 * sizeof(float));
    if (!xf) return -2;
    for (int m = 0; m < M; m++) round_row_f32(x + (size_t)m * x_stride, K, xf + (size_t)m * Kp * 2);
    void* xb = xf;
    bf16_ctx c = {NULL, xf, M, Kp, P, N, tiles, y, y_stride};
#endif
    // threads only where the work pays for waking them
    const int big = (long)tiles * Kp * (M < 4 ? 4 : M) >= (1 << 15);
    const int rc = kvf_parallel_for((tiles + GROUP_TILES - 1) / GROUP_TILES, big ? threads : 1,
                                    tile_group, &c);
    free(xb);
    return rc;
#else
    (void)x; (void)P; (void)y; (void)threads;
    return -3;
#endif
}

// y = x @ W.T with W's GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) repacked at
// load into tiles of 16 outputs, and x's rows rounded to int8 per 32 values, multiplied in
// integers with AVX-512 VNNI (vpdpbusd): llama.cpp's way of computing GGUF weights (its
// activations are rounded to 8 bits too), laid out so that one instruction takes 4 weights of
// each of 16 outputs.
//
// Every GGUF type is, per group g of 32 consecutive weights of an output row, small unsigned
// integers u (4, 5, 6 or 8 bits) with w = s * (u - off) + mn:
//   Q8_0: u = q + 128, off 128   Q4_0: off 8   Q5_0: off 16   (s = the block's fp16 d)
//   Q4_1, Q5_1: off 0, s = d, mn = m (fp16)
//   Q4_K, Q5_K: off 0, s = d * sc, mn = -(dmin * m) (fp32: each an exact product)
//   Q6_K: off 32, two scales per group (its sub-blocks of 16), s = d * sc (fp32, exact)
// which is exactly what the exact decoders compute (the same float32 operations).
//
// Tile layout (kvf_tiles_pack), per tile of 16 outputs, per group, group_bytes:
//   the integers as 8 vectors of 64 bytes: vector r, byte 4n + j = u of output n at k = 4r + j
//     (8 bits: stored as is; 4-6 bits: 4 x 64 bytes of nibbles, vector r's in the low halves of
//     the bytes for r < 4 and vector r - 4's in the high halves, then for 5 and 6 bits one
//     64-bit mask per vector of each higher bit)
//   the 16 outputs' scales (fp16 where GGUF stores them so, else fp32; Q6_K: two rows of 16)
//   their mins (types with one; same width).
// Outputs past N in the last tile are zero weights, never stored.
//
// The product: for row m and group g, x's 32 values are rounded to int8 (dx = max|x| / 127,
// q = round(x / dx) to nearest even, as kvf_quant_matmul_int8 rounds them). Per output lane, an
// int32 starts at -off * sum(q) and takes vpdpbusd(u, q) over the group's 8 vectors: the exact
// sum of q * (u - off). Then y += float(that) * dx * s, and for the types with a min
// y += mn * sum(x) (x's own sum, in fp32, in order). Each output is one chain of these operations
// over the groups in order, whatever the other rows or outputs of the call: batch invariant for
// any number of rows. Not exact like kvf_quant_matmul (x loses ~0.4 % of each group's largest
// value); kvflow bench quality measures it.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_pool.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>
#define KVF_TILES 1
#endif

#define QK 32
#define QK_K 256
#define TN 16          // outputs per tile
#define ROWS_BLOCK 256  // rows per task (256 x K int8 stays in L2 for the SmolLM2-to-8B K's)

enum { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

typedef struct {
    int bits, off, scale16, has_min, two;  // two: Q6_K's two scales per group
} tinfo;

static int type_info(int type, tinfo* t) {
    switch (type) {
        case Q8_0: *t = (tinfo){8, 128, 1, 0, 0}; return 0;
        case Q4_0: *t = (tinfo){4, 8, 1, 0, 0}; return 0;
        case Q4_1: *t = (tinfo){4, 0, 1, 1, 0}; return 0;
        case Q5_0: *t = (tinfo){5, 16, 1, 0, 0}; return 0;
        case Q5_1: *t = (tinfo){5, 0, 1, 1, 0}; return 0;
        case Q4_K: *t = (tinfo){4, 0, 0, 1, 0}; return 0;
        case Q5_K: *t = (tinfo){5, 0, 0, 1, 0}; return 0;
        case Q6_K: *t = (tinfo){6, 32, 0, 0, 1}; return 0;
        default: return -1;
    }
}

static int block_bytes(int type) {
    switch (type) {
        case Q8_0: return 34;
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}

static int block_weights(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? QK_K : QK; }

static size_t weight_bytes(const tinfo* t) {
    return t->bits == 8 ? 512 : 256 + 64 * (size_t)(t->bits - 4);
}

static size_t group_bytes(const tinfo* t) {
    const size_t w = t->scale16 ? 2 : 4;
    return weight_bytes(t) + TN * w * (size_t)(1 + t->two + t->has_min);
}

// Bytes of the tiles of an [N, K] weight of `type`; 0 for a type or K it cannot hold.
long kvf_tiles_bytes(int N, int K, int type) {
    tinfo t;
    if (type_info(type, &t) || N < 0 || K <= 0 || K % block_weights(type)) return 0;
    return (long)((N + TN - 1) / TN) * (K / QK) * (long)group_bytes(&t);
}

#ifdef KVF_TILES
static inline uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// A K-quant's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
static inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Group g (32 weights) of one output's row of blocks: its integers u, scale(s) and min, as
// fp32 (s[1]: Q6_K's second) or as the fp16 bits GGUF stores (s16, mn16).
static void read_group(const uint8_t* row, int type, int g, uint8_t* u, float* s, float* mn,
                       uint16_t* s16, uint16_t* mn16) {
    if (type == Q4_K || type == Q5_K || type == Q6_K) {
        const uint8_t* blk = row + (size_t)(g / 8) * block_bytes(type);
        const int j = g % 8;
        if (type == Q6_K) {
            const uint8_t* ql = blk;
            const uint8_t* qh = blk + QK_K / 2;
            const int8_t* sc = (const int8_t*)(blk + QK_K / 2 + QK_K / 4);
            const float d = h2f(rd16(blk + QK_K / 2 + QK_K / 4 + QK_K / 16));
            const int h = j / 4, nib = (j / 2) % 2, half = j % 2, shift = 2 * (j % 4);
            const uint8_t* l = ql + 64 * h + 32 * half;
            const uint8_t* hb = qh + 32 * h;
            for (int i = 0; i < 32; i++)
                u[i] = (uint8_t)(((l[i] >> (4 * nib)) & 0xF) | (((hb[i] >> shift) & 3) << 4));
            s[0] = d * (float)sc[2 * j];
            s[1] = d * (float)sc[2 * j + 1];
            return;
        }
        const float d = h2f(rd16(blk)), dmin = h2f(rd16(blk + 2));
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        s[0] = d * (float)sc;
        *mn = -(dmin * (float)m);
        const uint8_t* qh = blk + 16;
        const uint8_t* q = (type == Q5_K ? blk + 16 + QK_K / 8 : blk + 16) + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 32; i++)
            u[i] = (uint8_t)(((q[i] >> shift) & 0xF) |
                             (type == Q5_K ? ((qh[i] >> j) & 1) << 4 : 0));
        return;
    }
    const uint8_t* blk = row + (size_t)g * block_bytes(type);
    *s16 = rd16(blk);
    if (type == Q8_0) {
        for (int i = 0; i < 32; i++) u[i] = (uint8_t)((int)(int8_t)blk[2 + i] + 128);
        return;
    }
    const int with_min = type == Q4_1 || type == Q5_1;
    if (with_min) *mn16 = rd16(blk + 2);
    const uint8_t* p = blk + (with_min ? 4 : 2);
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) {
        qh = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
             ((uint32_t)p[3] << 24);
        p += 4;
    }
    for (int i = 0; i < 16; i++) {  // low nibbles: weights 0..15, high: 16..31
        u[i] = (uint8_t)((p[i] & 0x0f) | (((qh >> i) & 1u) << 4));
        u[i + 16] = (uint8_t)((p[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4));
    }
}

// Where output lane n's weight k (0..31) of a group lies: vector k / 4, byte 4n + k % 4.
static void put_group(uint8_t* gp, const tinfo* t, int n, const uint8_t* u, const float* s,
                      float mn, uint16_t s16, uint16_t mn16) {
    for (int k = 0; k < 32; k++) {
        const int r = k / 4, p = 4 * n + k % 4;
        if (t->bits == 8) {
            gp[64 * r + p] = u[k];
            continue;
        }
        gp[64 * (r % 4) + p] |= (uint8_t)((u[k] & 15) << (r < 4 ? 0 : 4));
        for (int b = 4; b < t->bits; b++)
            if ((u[k] >> b) & 1) {
                uint64_t* plane = (uint64_t*)(gp + 256 + 64 * (b - 4)) + r;
                *plane |= (uint64_t)1 << p;
            }
    }
    uint8_t* sp = gp + weight_bytes(t);
    if (t->scale16) {
        memcpy(sp + 2 * n, &s16, 2);
        if (t->has_min) memcpy(sp + 2 * TN + 2 * n, &mn16, 2);
        return;
    }
    memcpy(sp + 4 * n, &s[0], 4);
    if (t->two) memcpy(sp + 4 * TN + 4 * n, &s[1], 4);
    if (t->has_min) memcpy(sp + 4 * TN + 4 * n, &mn, 4);
}

typedef struct {
    const uint8_t* w;  // blocks (pack) or tiles (decode)
    int N, K, type;
    uint8_t* out;
    float* fout;
    const long* ids;
} pack_ctx;

static void pack_tile(void* vc, long t) {
    const pack_ctx* c = vc;
    tinfo ti;
    type_info(c->type, &ti);
    const int G = c->K / QK;
    const size_t gb = group_bytes(&ti), row_bytes = (size_t)(c->K / block_weights(c->type)) *
                                                    block_bytes(c->type);
    uint8_t* tile = c->out + (size_t)t * G * gb;
    memset(tile, 0, (size_t)G * gb);
    uint8_t u[32];
    for (int n = 0; n < TN && t * TN + n < c->N; n++) {
        const uint8_t* row = c->w + (size_t)(t * TN + n) * row_bytes;
        for (int g = 0; g < G; g++) {
            float s[2] = {0.0f, 0.0f}, mn = 0.0f;
            uint16_t s16 = 0, mn16 = 0;
            read_group(row, c->type, g, u, s, &mn, &s16, &mn16);
            put_group(tile + (size_t)g * gb, &ti, n, u, s, mn, s16, mn16);
        }
    }
}

// Output n's weights from the tiles, decoded exactly as the block decoders do.
static void decode_output(const uint8_t* tiles, int K, int type, long n, float* o) {
    tinfo t;
    type_info(type, &t);
    const int G = K / QK;
    const size_t gb = group_bytes(&t);
    const uint8_t* tile = tiles + (size_t)(n / TN) * G * gb;
    const int l = (int)(n % TN);
    for (int g = 0; g < G; g++) {
        const uint8_t* gp = tile + (size_t)g * gb;
        const uint8_t* sp = gp + weight_bytes(&t);
        float s0, s1 = 0.0f, mn = 0.0f;
        if (t.scale16) {
            s0 = h2f(rd16(sp + 2 * l));
            if (t.has_min) mn = h2f(rd16(sp + 2 * TN + 2 * l));
        } else {
            memcpy(&s0, sp + 4 * l, 4);
            if (t.two) memcpy(&s1, sp + 4 * TN + 4 * l, 4);
            if (t.has_min) memcpy(&mn, sp + 4 * TN + 4 * l, 4);
        }
        for (int k = 0; k < 32; k++) {
            const int r = k / 4, p = 4 * l + k % 4;
            int u;
            if (t.bits == 8) {
                u = gp[64 * r + p];
            } else {
                u = (gp[64 * (r % 4) + p] >> (r < 4 ? 0 : 4)) & 15;
                for (int b = 4; b < t.bits; b++) {
                    uint64_t plane;
                    memcpy(&plane, gp + 256 + 64 * (b - 4) + 8 * r, 8);
                    u |= (int)((plane >> p) & 1) << b;
                }
            }
            const float s = t.two && k >= 16 ? s1 : s0;
            const float v = (float)(u - t.off);
            o[(size_t)g * QK + k] = t.has_min ? s * v + mn : s * v;
        }
    }
}

static void decode_one(void* vc, long i) {
    const pack_ctx* c = vc;
    decode_output(c->w, c->K, c->type, c->ids[i], c->fout + (size_t)i * c->K);
}

// ---- the product ----

typedef struct {
    const int8_t* xq;   // [M, K]
    const float* xd;    // [M, G] scales
    const int32_t* xi;  // [M, G, 2] -off * sum(q) (of each half for Q6_K, else the whole)
    const float* xs;    // [M, G] sum(x) (types with a min)
    int M, K, G, N;
    const uint8_t* w;
    float* y;
    int y_stride;
    size_t gb;
    int type;
    long chunk;  // tiles per task
} prod_ctx;

// Round row x (K values) into q, dx per group, the -off sums and x's sums.
static void quantize_row(const float* x, int K, const tinfo* t, int8_t* q, float* xd,
                         int32_t* xi, float* xs) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int g = 0; g < K / QK; g++) {
        const float* xg = x + (size_t)g * QK;
        const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
        const __m512 a = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
        const float amax = _mm512_reduce_max_ps(a);
        xd[g] = amax / 127.0f;
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, id), rn);
        const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, id), rn);
        _mm_storeu_si128((__m128i*)(q + (size_t)g * QK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(q + (size_t)g * QK + 16), _mm512_cvtsepi32_epi8(q1));
        const int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        if (t->two) {
            xi[2 * g] = -t->off * s0;
            xi[2 * g + 1] = -t->off * s1;
        } else {
            xi[2 * g] = -t->off * (s0 + s1);
            xi[2 * g + 1] = 0;
        }
        if (t->has_min) {
            float s = 0.0f;
            for (int i = 0; i < QK; i++) s += xg[i];
            xs[g] = s;
        }
    }
}

typedef struct {
    const float* x;
    int x_stride, K;
    const tinfo* t;
    int8_t* xq;
    float* xd;
    int32_t* xi;
    float* xs;
} quant_ctx;

static void quantize_one(void* vc, long m) {
    const quant_ctx* c = vc;
    const int G = c->K / QK;
    quantize_row(c->x + (size_t)m * c->x_stride, c->K, c->t, c->xq + (size_t)m * c->K,
                 c->xd + (size_t)m * G, c->xi + (size_t)m * G * 2, c->xs + (size_t)m * G);
}

// A group's 8 vectors of integers.
static inline __attribute__((always_inline)) void unpack(const uint8_t* gp, const int bits,
                                                         __m512i* W) {
    if (bits == 8) {
        for (int r = 0; r < 8; r++) W[r] = _mm512_loadu_si512((const void*)(gp + 64 * r));
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < 4; v++) {
        const __m512i raw = _mm512_loadu_si512((const void*)(gp + 64 * v));
        W[v] = _mm512_and_si512(raw, m4);
        W[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
    for (int b = 4; b < bits; b++) {
        const uint64_t* plane = (const uint64_t*)(gp + 256 + 64 * (b - 4));
        const __m512i bit = _mm512_set1_epi8((char)(1 << b));
        for (int r = 0; r < 8; r++) W[r] = _mm512_mask_add_epi8(W[r], _cvtu64_mask64(plane[r]), W[r], bit);
    }
}

static inline __attribute__((always_inline)) __m512 load_scales(const uint8_t* p, const int s16) {
    return s16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)) : _mm512_loadu_ps(p);
}

// Rows [m0, m0 + R) of one tile's 16 outputs into out (R x 16 floats). R, bits, s16, has_min
// and two are constants once inlined. Each weight vector meets every row before the next is
// taken, so that the rows' chains of vpdpbusd run side by side: fewer than 4 rows split each
// row's chain into CH chains (integers: the sum is the same in any order), Q6_K keeps one chain
// per half of a group (each half has its own scale) and runs 4 rows at a time (8 chains).
static inline __attribute__((always_inline)) void tile_rows(const prod_ctx* c, const uint8_t* tile,
                                                            int m0, const int R, const int bits,
                                                            const int s16, const int has_min,
                                                            const int two, float* out) {
    const int G = c->G, K = c->K;
    const int CH = two ? 2 : (R >= 4 ? 1 : 4 / R), RG = two && R > 4 ? 4 : R;
    __m512 yv[8];
    for (int r = 0; r < R; r++) yv[r] = _mm512_setzero_ps();
    const size_t wb = bits == 8 ? 512 : 256 + 64 * (size_t)(bits - 4), sw = s16 ? 2 : 4;
    for (int g = 0; g < G; g++) {
        const uint8_t* gp = tile + (size_t)g * c->gb;
        __m512i W[8];
        unpack(gp, bits, W);
        const __m512 sc0 = load_scales(gp + wb, s16);
        const __m512 sc1 = two ? load_scales(gp + wb + TN * sw, s16) : sc0;
        const __m512 mn = has_min ? load_scales(gp + wb + TN * sw, s16) : sc0;
#pragma GCC unroll 2
        for (int r0 = 0; r0 < R; r0 += RG) {
            __m512i acc[8];
            size_t mg[8];
            const int32_t* xg[8];
            for (int i = 0; i < RG; i++) {
                const size_t m = (size_t)(m0 + r0 + i);
                mg[i] = m * G + g;
                xg[i] = (const int32_t*)(c->xq + m * K + (size_t)g * QK);
                acc[i * CH] = _mm512_set1_epi32(c->xi[2 * mg[i]]);
                for (int j = 1; j < CH; j++)
                    acc[i * CH + j] =
                        two ? _mm512_set1_epi32(c->xi[2 * mg[i] + 1]) : _mm512_setzero_si512();
            }
            for (int v = 0; v < 8; v++)
                for (int i = 0; i < RG; i++) {
                    const int j = i * CH + (two ? v / 4 : v % CH);
                    acc[j] = _mm512_dpbusd_epi32(acc[j], W[v], _mm512_set1_epi32(xg[i][v]));
                }
            for (int i = 0; i < RG; i++) {
                const int r = r0 + i;
                const __m512 dx = _mm512_set1_ps(c->xd[mg[i]]);
                if (two) {
                    yv[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[2 * i]), dx), sc0,
                                            yv[r]);
                    yv[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[2 * i + 1]), dx),
                                            sc1, yv[r]);
                } else {
                    __m512i a = acc[i * CH];
                    for (int j = 1; j < CH; j++) a = _mm512_add_epi32(a, acc[i * CH + j]);
                    yv[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), dx), sc0, yv[r]);
                }
                if (has_min) yv[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(c->xs[mg[i]]), yv[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + (size_t)r * TN, yv[r]);
}

// Rows [m0, m1) of one tile: eights, then a four, a two and a one as the count's bits say.
static inline __attribute__((always_inline)) void tile_all_rows(const prod_ctx* c, long t,
                                                                int m0, const int m1,
                                                                const int bits, const int s16,
                                                                const int has_min,
                                                                const int two) {
    const uint8_t* tile = c->w + (size_t)t * c->G * c->gb;
    const int n0 = (int)t * TN, nr = c->N - n0 < TN ? c->N - n0 : TN;
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    float out[8 * TN];
    while (m0 < m1) {
        const int left = m1 - m0;
        const int R = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        if (R == 8) tile_rows(c, tile, m0, 8, bits, s16, has_min, two, out);
        else if (R == 4) tile_rows(c, tile, m0, 4, bits, s16, has_min, two, out);
        else if (R == 2) tile_rows(c, tile, m0, 2, bits, s16, has_min, two, out);
        else tile_rows(c, tile, m0, 1, bits, s16, has_min, two, out);
        for (int r = 0; r < R; r++)
            _mm512_mask_storeu_ps(c->y + (size_t)(m0 + r) * c->y_stride + n0, keep,
                                  _mm512_loadu_ps(out + (size_t)r * TN));
        m0 += R;
    }
}

// Task `task`: a block of at most ROWS_BLOCK rows times a chunk of c->chunk tiles, so that both
// the block's rounded rows and the chunk's tiles stay in the core's L2 cache while each tile
// meets every row of the block (one pass over all of x per tile re-reads it from memory).
static void tiles_task(void* vc, long task) {
    const prod_ctx* c = vc;
    const long tiles = (c->N + TN - 1) / TN, chunks = (tiles + c->chunk - 1) / c->chunk;
    const long chunk = task % chunks;
    const int m0 = (int)(task / chunks) * ROWS_BLOCK;
    const int m1 = c->M - m0 < ROWS_BLOCK ? c->M : m0 + ROWS_BLOCK;
    const long t1 = (chunk + 1) * c->chunk < tiles ? (chunk + 1) * c->chunk : tiles;
    for (long t = chunk * c->chunk; t < t1; t++) {
        switch (c->type) {
            case Q8_0: tile_all_rows(c, t, m0, m1, 8, 1, 0, 0); break;
            case Q4_0: tile_all_rows(c, t, m0, m1, 4, 1, 0, 0); break;
            case Q4_1: tile_all_rows(c, t, m0, m1, 4, 1, 1, 0); break;
            case Q5_0: tile_all_rows(c, t, m0, m1, 5, 1, 0, 0); break;
            case Q5_1: tile_all_rows(c, t, m0, m1, 5, 1, 1, 0); break;
            case Q4_K: tile_all_rows(c, t, m0, m1, 4, 0, 1, 0); break;
            case Q5_K: tile_all_rows(c, t, m0, m1, 5, 0, 1, 0); break;
            default: tile_all_rows(c, t, m0, m1, 6, 0, 0, 1); break;  // Q6_K
        }
    }
}
#endif

// 1 where this build multiplies tiles (AVX-512 BW + VNNI + F16C), else 0.
int kvf_tiles_available(void) {
#ifdef KVF_TILES
    return 1;
#else
    return 0;
#endif
}

// blocks [N, K / block weights * block bytes] -> out (kvf_tiles_bytes(N, K, type) bytes).
// Returns 0, -1 on bad arguments, -3 where this build has no tiles.
int kvf_tiles_pack(const uint8_t* blocks, int N, int K, int type, uint8_t* out, int threads) {
    if (kvf_tiles_bytes(N, K, type) <= 0 && N != 0) return -1;
#ifdef KVF_TILES
    pack_ctx c = {blocks, N, K, type, out, NULL, NULL};
    return kvf_parallel_for((N + TN - 1) / TN, threads, pack_tile, &c);
#else
    (void)blocks; (void)out; (void)threads;
    return -3;
#endif
}

// The weights of outputs ids[0..n) as fp32 rows (out [n, K]): an embedding lookup, or the whole
// weight. Equal to the blocks' exact decoders. Returns 0, -1 on bad arguments, -3 without tiles.
int kvf_tiles_decode(const uint8_t* tiles, int N, int K, int type, const long* ids, long n,
                     float* out, int threads) {
    if (kvf_tiles_bytes(N, K, type) <= 0 || n < 0) return -1;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
#ifdef KVF_TILES
    pack_ctx c = {tiles, N, K, type, NULL, out, ids};
    return kvf_parallel_for(n, threads, decode_one, &c);
#else
    (void)tiles; (void)out; (void)threads;
    return -3;
#endif
}

// y [M, N] (rows y_stride apart) = x [M, K] (rows x_stride apart) @ W.T, W as tiles. Returns 0,
// -1 on bad arguments, -2 without memory, -3 without tiles.
int kvf_tiles_matmul(const float* x, int M, int K, int x_stride, const uint8_t* tiles, int N,
                     int type, float* y, int y_stride, int threads) {
    if (kvf_tiles_bytes(N, K, type) <= 0 || M < 0 || x_stride < K || y_stride < N) return -1;
#ifdef KVF_TILES
    tinfo t;
    type_info(type, &t);
    const int G = K / QK;
    int8_t* xq = malloc((size_t)M * K + 64);
    float* xd = malloc((size_t)M * G * sizeof(float) + 64);
    int32_t* xi = malloc((size_t)M * G * 2 * sizeof(int32_t) + 64);
    float* xs = malloc((size_t)M * G * sizeof(float) + 64);
    if (!xq || !xd || !xi || !xs) {
        free(xq), free(xd), free(xi), free(xs);
        return -2;
    }
    quant_ctx q = {x, x_stride, K, &t, xq, xd, xi, xs};
    // rows rounded on the threads where there are enough of them to pay for waking them
    kvf_parallel_for(M, (long)M * K >= (1 << 16) ? threads : 1, quantize_one, &q);
    // one block of rows: 4 tiles per task (enough tasks for the threads); more rows: 16 tiles,
    // whose weights are re-read once per block of rows
    const long tiles_n = (N + TN - 1) / TN, chunk = M <= ROWS_BLOCK ? 4 : 16;
    prod_ctx c = {xq, xd, xi, xs, M, K, G, N, tiles, y, y_stride, group_bytes(&t), type, chunk};
    const long tasks = (tiles_n + chunk - 1) / chunk * ((M + ROWS_BLOCK - 1) / ROWS_BLOCK);
    const int rc = kvf_parallel_for(tasks, threads, tiles_task, &c);
    free(xq), free(xd), free(xi), free(xs);
    return rc;
#else
    (void)x; (void)tiles; (void)y; (void)threads;
    return -3;
#endif
}

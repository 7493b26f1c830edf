// y = x @ W.T with W held in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1; Q5_0, Q5_1 and the
// K-quants Q4_K, Q5_K, Q6_K as "units", below), read in place.
//
// W is N rows of K/32 blocks each (one row of blocks per output feature, as GGUF stores a
// [N, K] tensor). Each block covers 32 consecutive weights of a row:
//   Q8_0: fp16 d, int8 q[32]                    w = d * q
//   Q4_0: fp16 d, uint8 nibbles[16]             w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, uint8 nibbles[16]     w = d * q + m
//   Q4_Z: fp16 d, uint8 z, pad, uint8 nibbles[16]  w = d * (q - z)   (kvflow's own, not GGUF's:
//         GPTQ and AWQ 4-bit groups with their integer zero points, shared/quantized_checkpoints.py)
// (nibble i holds element i in its low half and element i + 16 in its high half).
//   Q5_0, Q5_1: as Q4_0 / Q4_1 with a fifth bit per weight (32 bits qh): d * (q - 16), d * q + m
//   Q4_K, Q5_K: super-blocks of 256: fp16 d, dmin, 8 sub-blocks of 32 with 6-bit scale sc and
//               min m: w = (d * sc) * q - dmin * m (q 4 or 5 bits)
//   Q6_K: super-blocks of 256: 16 sub-blocks of 16 with int8 scales: w = (d * sc) * (q - 32)
// Unit types are decoded one block at a time into floats (exactly as gguf-py's dequantize:
// the same float32 operations, none fused), then multiplied by 8-lane fma chains.
//
// Every output y[m, n] is computed by the same sequence of operations whatever else is in the
// call, so a row's result never depends on the batch (batch invariant by construction); the
// sums keep their written order (compiled without -ffast-math). Threads split the N outputs.
//
// With AVX2 + FMA + F16C: per block, p = x . q in 8 lanes (4 FMAs over the block's integer
// values converted to float), acc += d * p, and for Q4_1 a separate scalar m * sum(x_block)
// (x's block sums are computed once per call); y = sum of acc's 8 lanes + the m terms. Unit
// types: each output's row of W is decoded to floats, then each x row runs four fixed 8-lane fma
// chains over it. Threads take chunks of outputs; within a chunk, rows of x go four at a time
// through every output (the four share each decoded block), so the group's rows of x stay in L1
// and the chunk's weights in cache while the groups go by. Elsewhere: each row of W
// is decoded to fp32 (exactly: d * q has at most 19 significant bits) and dotted in 32 lanes.
// Both differ from dequantize-then-matmul only in the order of the sums.
//
// kvf_quant_matmul_panel (AVX2 only) is the same product for long chunks (prefill), where compute
// sets the time: each tile of outputs is decoded once into an fp32 panel (k-major, transposed
// in registers) and every 4 rows of x go through a 4 x 24 register-blocked FMA kernel, each
// output one fma chain over k in order (so its bits depend on neither M nor the tiling).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_pool.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVF_AVX2 1
#endif

#define QK 32

enum {
    KVF_Q8_0 = 8, KVF_Q4_0 = 2, KVF_Q4_1 = 3, KVF_Q4_Z = 1000,  // GGML types; Q4_Z ours
    KVF_Q5_0 = 6, KVF_Q5_1 = 7, KVF_Q4_K = 12, KVF_Q5_K = 13, KVF_Q6_K = 14,  // "units" below
};
#define QK_K 256
#define ROWS_CHUNK 32  // outputs per task of the rows kernel (their blocks stay in L2)
#define UNIT_CHUNK 16  // ... for the unit types (decoded to floats once per task)

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal half: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) {
                mant <<= 1;
                exp--;
            }
            mant &= 0x3ff;
            bits = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static int block_bytes(int type) {
    switch (type) {
        case KVF_Q8_0: return 2 + QK;
        case KVF_Q4_0: return 2 + QK / 2;
        case KVF_Q4_1: return 4 + QK / 2;
        case KVF_Q4_Z: return 4 + QK / 2;
        case KVF_Q5_0: return 2 + 4 + QK / 2;
        case KVF_Q5_1: return 4 + 4 + QK / 2;
        case KVF_Q4_K: return 4 + 12 + QK_K / 2;
        case KVF_Q5_K: return 4 + 12 + QK_K / 8 + QK_K / 2;
        case KVF_Q6_K: return QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
        default: return 0;
    }
}

// Types decoded a whole block ("unit") at a time into floats before the products: Q5_0/Q5_1
// (32 weights) and the K-quants' super-blocks of 256 (their 6-bit sub-block scales decoded
// once per super-block). The four types above have their own vector paths.
static int is_unit_type(int type) {
    return type == KVF_Q5_0 || type == KVF_Q5_1 || type == KVF_Q4_K || type == KVF_Q5_K ||
           type == KVF_Q6_K;
}

// Weights per block.
static int block_weights(int type) {
    return type == KVF_Q4_K || type == KVF_Q5_K || type == KVF_Q6_K ? QK_K : QK;
}

static inline uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

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

#ifdef KVF_AVX2
// 32 small integers (bytes, signed) -> floats scaled: o[i] = s0 * q[i] - m0 for i < 16 and
// s1 * q[i] - m1 after (Q6_K's two 16-weight scales; Q4_K passes one scale twice), the
// scalar decoder's operations lane by lane (a product, then a difference; the types without a
// min take the product alone, as their decoders do).
static inline __attribute__((always_inline)) void scale32(__m256i q, float s0, float s1,
                                                          float m0, float m1, float* o,
                                                          const int with_min) {
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
    for (int c = 0; c < 4; c++) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[c]));
        __m256 r = _mm256_mul_ps(_mm256_set1_ps(c < 2 ? s0 : s1), v);
        if (with_min) r = _mm256_sub_ps(r, _mm256_set1_ps(c < 2 ? m0 : m1));
        _mm256_storeu_ps(o + 8 * c, r);
    }
}

static inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m);

// Q4_K and Q6_K super-blocks with AVX2 (the two types of a Q4_K_M file's layers), equal to the
// scalar decoder bit for bit.
static void decode_unit_avx2(const uint8_t* blk, int type, float* o) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (type == KVF_Q5_0 || type == KVF_Q5_1) {
        const int q1 = type == KVF_Q5_1;
        const float d = _cvtsh_ss(rd16(blk));
        const float m = q1 ? _cvtsh_ss(rd16(blk + 2)) : 0.0f;
        const uint8_t* h = blk + (q1 ? 4 : 2);
        uint32_t qh;
        memcpy(&qh, h, 4);
        // bit i of qh -> 0x10 in byte i (llama.cpp's bytes_from_bits_32)
        __m256i bits = _mm256_shuffle_epi8(
            _mm256_set1_epi32((int)qh),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
        bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                 _mm256_set1_epi64x(-1));
        const __m128i raw = _mm_loadu_si128((const __m128i*)(h + 4));
        const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
        __m256i q = _mm256_set_m128i(hi, lo);  // weights 0..15, then 16..31
        q = _mm256_or_si256(q, _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
        if (q1) {  // d * q + m (as d * q - (-m): the same rounding)
            scale32(q, d, d, -m, -m, o, 1);
        } else {  // d * (q - 16)
            scale32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, d, 0.0f, 0.0f, o, 0);
        }
        return;
    }
    if (type == KVF_Q5_K) {
        const float d = _cvtsh_ss(rd16(blk)), dmin = _cvtsh_ss(rd16(blk + 2));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
        for (int g = 0; g < 4; g++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + 48 + 32 * g));
            for (int h = 0; h < 2; h++) {
                const int j = 2 * g + h;
                int sc, m;
                scale_min_k4(j, blk + 4, &sc, &m);
                const float ds = d * (float)sc, dm = dmin * (float)m;
                __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low4);
                const __m256i b = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
                q = _mm256_or_si256(q, _mm256_slli_epi16(b, 4));
                scale32(q, ds, ds, dm, dm, o + 32 * j, 1);
            }
        }
        return;
    }
    if (type == KVF_Q4_K) {
        const float d = _cvtsh_ss(rd16(blk)), dmin = _cvtsh_ss(rd16(blk + 2));
        for (int g = 0; g < 4; g++) {  // bytes 32 g ..: sub-blocks 2 g (low) and 2 g + 1 (high)
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * g));
            for (int h = 0; h < 2; h++) {
                int sc, m;
                scale_min_k4(2 * g + h, blk + 4, &sc, &m);
                const float ds = d * (float)sc, dm = dmin * (float)m;
                const __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low4);
                scale32(q, ds, ds, dm, dm, o + 32 * (2 * g + h), 1);
            }
        }
        return;
    }
    const uint8_t* ql = blk;  // Q6_K
    const uint8_t* qh = blk + QK_K / 2;
    const int8_t* sc = (const int8_t*)(blk + QK_K / 2 + QK_K / 4);
    const float d = _cvtsh_ss(rd16(blk + QK_K / 2 + QK_K / 4 + QK_K / 16));
    for (int c = 0; c < 8; c++) {
        const int h = c / 4, nib = (c / 2) % 2, half = c % 2, shift = 2 * (c % 4);
        __m256i l = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32 * half));
        if (nib) l = _mm256_srli_epi16(l, 4);
        l = _mm256_and_si256(l, low4);
        __m256i u = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
        u = _mm256_and_si256(_mm256_srli_epi16(u, shift), _mm256_set1_epi8(3));
        __m256i q = _mm256_or_si256(l, _mm256_slli_epi16(u, 4));  // 6 bits: no byte overflow
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
        scale32(q, d * (float)sc[2 * c], d * (float)sc[2 * c + 1], 0.0f, 0.0f, o + 32 * c, 0);
    }
}
#endif

// One unit-type block as floats, each exactly gguf-py's dequantize (the same float32 operations
// in the same order: a product then a difference, never fused: built with -ffp-contract=off).
// The loops are plain so the compiler vectorizes them.
static void decode_unit(const uint8_t* blk, int type, float* o) {
#ifdef KVF_AVX2
    decode_unit_avx2(blk, type, o);
#else  // the portable decoder: the same values, operation for operation
    if (type == KVF_Q5_0 || type == KVF_Q5_1) {
        const float d = fp16_to_fp32(rd16(blk));
        const int q1 = type == KVF_Q5_1;
        const float m = q1 ? fp16_to_fp32(rd16(blk + 2)) : 0.0f;
        const uint8_t* h = blk + (q1 ? 4 : 2);
        const uint32_t qh = (uint32_t)h[0] | ((uint32_t)h[1] << 8) | ((uint32_t)h[2] << 16) |
                            ((uint32_t)h[3] << 24);
        const uint8_t* qs = h + 4;
        float v[QK];
        for (int i = 0; i < QK / 2; i++) {  // low nibbles: weights 0..15, high: 16..31
            v[i] = (float)((qs[i] & 0x0f) | (int)(((qh >> i) & 1u) << 4));
            v[i + QK / 2] = (float)((qs[i] >> 4) | (int)(((qh >> (i + QK / 2)) & 1u) << 4));
        }
        if (q1)
            for (int i = 0; i < QK; i++) o[i] = d * v[i] + m;
        else
            for (int i = 0; i < QK; i++) o[i] = d * (v[i] - 16.0f);  // q - 16: exact
        return;
    }
    if (type == KVF_Q6_K) {
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + QK_K / 2;
        const int8_t* sc = (const int8_t*)(blk + QK_K / 2 + QK_K / 4);
        const float d = fp16_to_fp32(rd16(blk + QK_K / 2 + QK_K / 4 + QK_K / 16));
        float ds[QK_K / 16];
        for (int j = 0; j < QK_K / 16; j++) ds[j] = d * (float)sc[j];
        for (int c = 0; c < 8; c++) {  // 32 weights: ql half, nibble and qh shift by chunk
            const int h = c / 4, nib = (c / 2) % 2, half = c % 2, shift = 2 * (c % 4);
            const uint8_t* l = ql + 64 * h + 32 * half;
            const uint8_t* u = qh + 32 * h;
            for (int i = 0; i < 32; i++) {
                const int q = (((l[i] >> (4 * nib)) & 0xF) | (((u[i] >> shift) & 3) << 4)) - 32;
                o[32 * c + i] = ds[(32 * c + i) / 16] * (float)q;
            }
        }
        return;
    }
    // Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of high bits)
    const float d = fp16_to_fp32(rd16(blk));
    const float dmin = fp16_to_fp32(rd16(blk + 2));
    const uint8_t* scales = blk + 4;
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = type == KVF_Q5_K ? blk + 16 + QK_K / 8 : blk + 16;
    for (int j = 0; j < 8; j++) {  // sub-block j: nibble j % 2 of bytes 32 (j / 2) ..
        int sc, m;
        scale_min_k4(j, scales, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        const uint8_t* q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        float* out = o + 32 * j;
        if (type == KVF_Q5_K) {
            for (int i = 0; i < 32; i++)
                out[i] = ds * (float)(((q[i] >> shift) & 0xF) | (((qh[i] >> j) & 1) << 4)) - dm;
        } else {
            for (int i = 0; i < 32; i++) out[i] = ds * (float)((q[i] >> shift) & 0xF) - dm;
        }
    }
#endif
}

// Decode one row of `nb` blocks into `out` (nb * block_weights floats).
static void decode_row(const uint8_t* row, int nb, int type, float* out) {
    const int bb = block_bytes(type);
    if (is_unit_type(type)) {
        const int bw = block_weights(type);
        for (int b = 0; b < nb; b++) decode_unit(row + (size_t)b * bb, type, out + (size_t)b * bw);
        return;
    }
    for (int b = 0; b < nb; b++) {
        const uint8_t* blk = row + (size_t)b * bb;
        float* o = out + (size_t)b * QK;
        const float d = fp16_to_fp32(rd16(blk));
        if (type == KVF_Q8_0) {
            const int8_t* q = (const int8_t*)(blk + 2);
            for (int i = 0; i < QK; i++) o[i] = d * (float)q[i];
        } else if (type == KVF_Q4_0) {
            const uint8_t* q = blk + 2;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)((int)(q[i] & 0x0f) - 8);
                o[i + QK / 2] = d * (float)((int)(q[i] >> 4) - 8);
            }
        } else if (type == KVF_Q4_Z) {
            const int z = blk[2];
            const uint8_t* q = blk + 4;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)((int)(q[i] & 0x0f) - z);
                o[i + QK / 2] = d * (float)((int)(q[i] >> 4) - z);
            }
        } else {
            const float m = fp16_to_fp32(rd16(blk + 2));
            const uint8_t* q = blk + 4;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = d * (float)(q[i] & 0x0f) + m;
                o[i + QK / 2] = d * (float)(q[i] >> 4) + m;
            }
        }
    }
}

static inline float dot(const float* a, const float* w, int k) {
    float acc[QK] = {0};
    for (int s = 0; s < k; s += QK)
        for (int l = 0; l < QK; l++) acc[l] += a[s + l] * w[s + l];
    float sum = 0.0f;
    for (int l = 0; l < QK; l++) sum += acc[l];
    return sum;
}

#ifdef KVF_AVX2
// The block's 32 values as 4 x 8 floats (Q4_1: q, without d and m; others: q, without d).
static inline void block_values(const uint8_t* blk, int type, __m256* v) {
    if (type == KVF_Q8_0) {
        const uint8_t* q = blk + 2;
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * j))));
        return;
    }
    const __m128i raw = _mm_loadu_si128((const __m128i*)(blk + (type == KVF_Q4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask);                     // elements 0..15
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // elements 16..31
    if (type == KVF_Q4_0 || type == KVF_Q4_Z) {  // q - 8, q - z: exact small integers
        const __m128i zero = _mm_set1_epi8((char)(type == KVF_Q4_0 ? 8 : blk[2]));
        lo = _mm_sub_epi8(lo, zero);
        hi = _mm_sub_epi8(hi, zero);
    }
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

static inline float hsum8(__m256 a) {
    float t[8];
    _mm256_storeu_ps(t, a);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// One row's share of a block: p = x . v in 8 lanes (a product, then three fmas in order), then
// acc += d * p. The same operations for a row whatever rows share the call (batch invariant).
#define KVF_ROW_BLOCK(xb, acc)                                         \
    do {                                                               \
        __m256 p_ = _mm256_mul_ps(_mm256_loadu_ps(xb), v[0]);          \
        p_ = _mm256_fmadd_ps(_mm256_loadu_ps((xb) + 8), v[1], p_);     \
        p_ = _mm256_fmadd_ps(_mm256_loadu_ps((xb) + 16), v[2], p_);    \
        p_ = _mm256_fmadd_ps(_mm256_loadu_ps((xb) + 24), v[3], p_);    \
        (acc) = _mm256_fmadd_ps(d, p_, (acc));                         \
    } while (0)

// Rows [m0, m0 + R) of y for output n, R (1, 2 or 4, a constant once inlined) sharing each
// decoded block. xs: x's block sums (Q4_1 only).
static inline __attribute__((always_inline)) void rows_for_output(
    const float* x, int x_stride, const float* xs, int nb, const uint8_t* row, int bb, int type,
    int m0, const int R, float* y, int y_stride, int n) {
    __m256 acc[4];
    float msum[4] = {0, 0, 0, 0};
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const float* x0 = x + (size_t)m0 * x_stride;
    for (int b = 0; b < nb; b++) {
        const uint8_t* blk = row + (size_t)b * bb;
        __m256 v[4];
        block_values(blk, type, v);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(blk)));
        const float* xb = x0 + (size_t)b * QK;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) KVF_ROW_BLOCK(xb + (size_t)r * x_stride, acc[r]);
        if (type == KVF_Q4_1) {
            const float m = _cvtsh_ss(rd16(blk + 2));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) msum[r] += m * xs[(size_t)(m0 + r) * nb + b];
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)(m0 + r) * y_stride + n] = hsum8(acc[r]) + msum[r];
}

// Outputs [n0, n1) for all M rows: for each group of rows (fours, then a two and a one as M's
// bits say), every output of the chunk in turn, so the group's rows of x stay in L1 and
// the chunk's blocks in L2 while the groups go by.
static void rows_for_outputs(const float* x, int x_stride, const float* xs, int nb,
                             const uint8_t* w, size_t row_bytes, int bb, int type, int M,
                             float* y, int y_stride, int n0, int n1) {
    int m0 = 0;
    for (; m0 + 4 <= M; m0 += 4)
        for (int n = n0; n < n1; n++)
            rows_for_output(x, x_stride, xs, nb, w + n * row_bytes, bb, type, m0, 4, y, y_stride, n);
    if (M - m0 >= 2) {
        for (int n = n0; n < n1; n++)
            rows_for_output(x, x_stride, xs, nb, w + n * row_bytes, bb, type, m0, 2, y, y_stride, n);
        m0 += 2;
    }
    if (M - m0 >= 1)
        for (int n = n0; n < n1; n++)
            rows_for_output(x, x_stride, xs, nb, w + n * row_bytes, bb, type, m0, 1, y, y_stride, n);
}
// Weights 8c .. 8c + 7 of a block, w = d * q (+ m), as 8 floats: exact (d * q has at most 19
// significant bits; Q4_1 adds m in one rounding, as every dequantizer does).
static inline __m256 chunk_weights(const uint8_t* blk, int type, int c) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(blk)));
    if (type == KVF_Q8_0)
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                    _mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * c)))));
    // nibble byte i holds element i (low half) and element i + 16 (high half)
    const uint8_t* q = blk + (type == KVF_Q4_0 ? 2 : 4) + 8 * (c & 1);
    __m128i b = _mm_loadl_epi64((const __m128i*)q);
    if (c >= 2) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    if (type == KVF_Q4_Z) b = _mm_sub_epi8(b, _mm_set1_epi8((char)blk[2]));
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    if (type == KVF_Q4_0) return _mm256_mul_ps(d, _mm256_sub_ps(v, _mm256_set1_ps(8.0f)));
    v = _mm256_mul_ps(d, v);
    if (type == KVF_Q4_1) v = _mm256_add_ps(v, _mm256_set1_ps(_cvtsh_ss(rd16(blk + 2))));
    return v;
}

// 8 x 8 transpose: r[i] (8 consecutive k of output i) -> r[k] (8 outputs at one k).
static inline void transpose8(__m256* r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// Decode outputs [n0, n0 + nr) (nr <= nrp, a multiple of 8) into the panel P[k * nrp + j] =
// W[n0 + j][k]; columns j >= nr are zero.
static void pack_panel(const uint8_t* w, size_t row_bytes, int bb, int type, int n0, int nr,
                       int nrp, int nb, float* P) {
    for (int j8 = 0; j8 < nrp; j8 += 8) {
        const uint8_t* rows[8];
        int live = 0;
        for (int i = 0; i < 8; i++) {
            const int n = j8 + i < nr ? n0 + j8 + i : -1;
            rows[i] = n >= 0 ? w + (size_t)n * row_bytes : NULL;
            live += n >= 0;
        }
        for (int b = 0; b < nb; b++)
            for (int c = 0; c < 4; c++) {
                __m256 r[8];
                for (int i = 0; i < 8; i++)
                    r[i] = i < live ? chunk_weights(rows[i] + (size_t)b * bb, type, c)
                                    : _mm256_setzero_ps();
                transpose8(r);
                float* dst = P + ((size_t)b * QK + 8 * c) * nrp + j8;
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (size_t)i * nrp, r[i]);
            }
    }
}

// Unit types: rows [m0, m0 + R) of y for output n (R 1, 2 or 4, a constant once inlined) from
// the output's decoded weights wv (K floats). Each row runs four 8-lane fma chains over k in
// order (lanes i, i + 8, i + 16, i + 24 of every 32 weights), summed as ((a0 + a1) + (a2 + a3))
// and then across lanes: the same operations in the same order whatever M or R, so a row's
// result never depends on the batch. The R rows share each load of wv.
static inline __attribute__((always_inline)) void unit_rows_for_output(
    const float* x, int x_stride, int m0, const int R, const float* wv, int K, float* y,
    int y_stride, int n) {
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    const float* x0 = x + (size_t)m0 * x_stride;
    for (int i = 0; i < K; i += 32) {
        const __m256 w0 = _mm256_loadu_ps(wv + i), w1 = _mm256_loadu_ps(wv + i + 8);
        const __m256 w2 = _mm256_loadu_ps(wv + i + 16), w3 = _mm256_loadu_ps(wv + i + 24);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float* xb = x0 + (size_t)r * x_stride + i;
            acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), w2, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), w3, acc[r][3]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                       _mm256_add_ps(acc[r][2], acc[r][3]));
        y[(size_t)(m0 + r) * y_stride + n] = hsum8(s);
    }
}

// Unit types, outputs [n0, n1) (at most UNIT_CHUNK) for all M rows: the chunk's rows of W are
// decoded once into dec (UNIT_CHUNK x K floats, in L2), then each group of rows (fours, then a
// two and a one as M's bits say) goes through every output of the chunk.
static void unit_rows_for_outputs(const float* x, int x_stride, int M, int nb, int bw,
                                  const uint8_t* w, size_t row_bytes, int type, float* dec,
                                  float* y, int y_stride, int n0, int n1) {
    const int K = nb * bw;
    for (int n = n0; n < n1; n++) decode_row(w + n * row_bytes, nb, type, dec + (size_t)(n - n0) * K);
    int m0 = 0;
    for (; m0 + 4 <= M; m0 += 4)
        for (int n = n0; n < n1; n++)
            unit_rows_for_output(x, x_stride, m0, 4, dec + (size_t)(n - n0) * K, K, y, y_stride, n);
    if (M - m0 >= 2) {
        for (int n = n0; n < n1; n++)
            unit_rows_for_output(x, x_stride, m0, 2, dec + (size_t)(n - n0) * K, K, y, y_stride, n);
        m0 += 2;
    }
    if (M - m0 >= 1)
        for (int n = n0; n < n1; n++)
            unit_rows_for_output(x, x_stride, m0, 1, dec + (size_t)(n - n0) * K, K, y, y_stride, n);
}

// The panel of outputs [n0, n0 + nr) for a unit type: each row decoded whole (rowbuf, K
// floats), then written k-major; columns j >= nr are zero.
static void pack_panel_units(const uint8_t* w, size_t row_bytes, int type, int n0, int nr,
                             int nrp, int nb, int K, float* P, float* rowbuf) {
    for (int j = 0; j < nrp; j++) {
        if (j < nr) decode_row(w + (size_t)(n0 + j) * row_bytes, nb, type, rowbuf);
        for (int k = 0; k < K; k++) P[(size_t)k * nrp + j] = j < nr ? rowbuf[k] : 0.0f;
    }
}

// Each output y[m][n] is one fma chain over k = 0, 1, ..., K-1, the same whatever the tile
// shape, M, the thread or the vector width: batch invariant, and the same bits with AVX-512 (16
// + 8 outputs per k: two FMA instructions per row where AVX2 takes three) as with AVX2. 4 rows
// (pointers; repeat one for fewer) x 24 outputs.
#ifdef __AVX512F__
static void micro_4x24(const float* x0, const float* x1, const float* x2, const float* x3,
                       const float* P, int K, float* out, int os) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
    for (int k = 0; k < K; k++) {
        const float* p = P + (size_t)k * 24;
        const __m512 b = _mm512_loadu_ps(p);
        const __m256 e = _mm256_loadu_ps(p + 16);
        __m512 a = _mm512_set1_ps(x0[k]);
        c0 = _mm512_fmadd_ps(a, b, c0);
        d0 = _mm256_fmadd_ps(_mm512_castps512_ps256(a), e, d0);
        a = _mm512_set1_ps(x1[k]);
        c1 = _mm512_fmadd_ps(a, b, c1);
        d1 = _mm256_fmadd_ps(_mm512_castps512_ps256(a), e, d1);
        a = _mm512_set1_ps(x2[k]);
        c2 = _mm512_fmadd_ps(a, b, c2);
        d2 = _mm256_fmadd_ps(_mm512_castps512_ps256(a), e, d2);
        a = _mm512_set1_ps(x3[k]);
        c3 = _mm512_fmadd_ps(a, b, c3);
        d3 = _mm256_fmadd_ps(_mm512_castps512_ps256(a), e, d3);
    }
    _mm512_storeu_ps(out, c0);
    _mm256_storeu_ps(out + 16, d0);
    out += os;
    _mm512_storeu_ps(out, c1);
    _mm256_storeu_ps(out + 16, d1);
    out += os;
    _mm512_storeu_ps(out, c2);
    _mm256_storeu_ps(out + 16, d2);
    out += os;
    _mm512_storeu_ps(out, c3);
    _mm256_storeu_ps(out + 16, d3);
}
#else
static void micro_4x24(const float* x0, const float* x1, const float* x2, const float* x3,
                       const float* P, int K, float* out, int os) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    for (int k = 0; k < K; k++) {
        const float* p = P + (size_t)k * 24;
        const __m256 b0 = _mm256_loadu_ps(p), b1 = _mm256_loadu_ps(p + 8);
        const __m256 b2 = _mm256_loadu_ps(p + 16);
        __m256 a = _mm256_broadcast_ss(x0 + k);
        c00 = _mm256_fmadd_ps(a, b0, c00);
        c01 = _mm256_fmadd_ps(a, b1, c01);
        c02 = _mm256_fmadd_ps(a, b2, c02);
        a = _mm256_broadcast_ss(x1 + k);
        c10 = _mm256_fmadd_ps(a, b0, c10);
        c11 = _mm256_fmadd_ps(a, b1, c11);
        c12 = _mm256_fmadd_ps(a, b2, c12);
        a = _mm256_broadcast_ss(x2 + k);
        c20 = _mm256_fmadd_ps(a, b0, c20);
        c21 = _mm256_fmadd_ps(a, b1, c21);
        c22 = _mm256_fmadd_ps(a, b2, c22);
        a = _mm256_broadcast_ss(x3 + k);
        c30 = _mm256_fmadd_ps(a, b0, c30);
        c31 = _mm256_fmadd_ps(a, b1, c31);
        c32 = _mm256_fmadd_ps(a, b2, c32);
    }
    _mm256_storeu_ps(out, c00);
    _mm256_storeu_ps(out + 8, c01);
    _mm256_storeu_ps(out + 16, c02);
    out += os;
    _mm256_storeu_ps(out, c10);
    _mm256_storeu_ps(out + 8, c11);
    _mm256_storeu_ps(out + 16, c12);
    out += os;
    _mm256_storeu_ps(out, c20);
    _mm256_storeu_ps(out + 8, c21);
    _mm256_storeu_ps(out + 16, c22);
    out += os;
    _mm256_storeu_ps(out, c30);
    _mm256_storeu_ps(out + 8, c31);
    _mm256_storeu_ps(out + 16, c32);
}
#endif

// One row x 24 outputs: the 4 x 24 kernel's chains for a single row (no wasted rows).
static void micro_1x24(const float* x, const float* P, int K, float* out) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0;
    for (int k = 0; k < K; k++) {
        const float* p = P + (size_t)k * 24;
        const __m256 a = _mm256_broadcast_ss(x + k);
        c0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p), c0);
        c1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 8), c1);
        c2 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 16), c2);
    }
    _mm256_storeu_ps(out, c0);
    _mm256_storeu_ps(out + 8, c1);
    _mm256_storeu_ps(out + 16, c2);
}

// One row x 64 outputs (8 independent chains: a single row would otherwise wait on latency).
static void micro_1x64(const float* x, const float* P, int K, float* out) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    for (int k = 0; k < K; k++) {
        const float* p = P + (size_t)k * 64;
        const __m256 a = _mm256_broadcast_ss(x + k);
        c0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p), c0);
        c1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 8), c1);
        c2 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 16), c2);
        c3 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 24), c3);
        c4 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 32), c4);
        c5 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 40), c5);
        c6 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 48), c6);
        c7 = _mm256_fmadd_ps(a, _mm256_loadu_ps(p + 56), c7);
    }
    _mm256_storeu_ps(out, c0);
    _mm256_storeu_ps(out + 8, c1);
    _mm256_storeu_ps(out + 16, c2);
    _mm256_storeu_ps(out + 24, c3);
    _mm256_storeu_ps(out + 32, c4);
    _mm256_storeu_ps(out + 40, c5);
    _mm256_storeu_ps(out + 48, c6);
    _mm256_storeu_ps(out + 56, c7);
}
#endif

// The arguments of one product, shared by the tasks of a call (each task: a range of outputs).
typedef struct {
    const float *x;
    int M, K, x_stride;
    const uint8_t *w;
    int N, type;
    float *y;
    int y_stride;
    int nb, bb, bw;
    size_t row_bytes;
    const float *xs;  // Q4_1: each row's block sums
    const float *P;   // kvf_panel_matmul_f32: the weight's panels
    int failed;       // a task could not get its scratch memory
} product_ctx;

static void set_failed(product_ctx *c) {
    __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
}

#ifdef KVF_AVX2
static void unit_chunks(void *vc, kvf_task *task, long c0, int worker) {
    (void)worker;
    product_ctx *c = vc;
    float* dec = aligned_alloc(64, (size_t)UNIT_CHUNK * c->K * sizeof(float));
    for (long t = c0; t >= 0; t = kvf_next(task)) {
        if (!dec) {
            set_failed(c);
            continue;
        }
        const int n0 = (int)t * UNIT_CHUNK, n1 = n0 + UNIT_CHUNK < c->N ? n0 + UNIT_CHUNK : c->N;
        unit_rows_for_outputs(c->x, c->x_stride, c->M, c->nb, c->bw, c->w, c->row_bytes, c->type,
                              dec, c->y, c->y_stride, n0, n1);
    }
    free(dec);
}

static void rows_chunk(void *vc, long t) {
    const product_ctx *c = vc;
    const int n0 = (int)t * ROWS_CHUNK, n1 = n0 + ROWS_CHUNK < c->N ? n0 + ROWS_CHUNK : c->N;
    rows_for_outputs(c->x, c->x_stride, c->xs, c->nb, c->w, c->row_bytes, c->bb, c->type, c->M,
                     c->y, c->y_stride, n0, n1);
}
#else
static void decoded_outputs(void *vc, kvf_task *task, long n0, int worker) {
    (void)worker;
    product_ctx *c = vc;
    const int K = c->K;
    float* wrow = aligned_alloc(64, ((size_t)K * sizeof(float) + 63) / 64 * 64);
    for (long n = n0; n >= 0; n = kvf_next(task)) {
        if (!wrow) {
            set_failed(c);
            continue;
        }
        decode_row(c->w + (size_t)n * c->row_bytes, c->nb, c->type, wrow);
        for (int m = 0; m < c->M; m++)
            c->y[(size_t)m * c->y_stride + n] = dot(c->x + (size_t)m * c->x_stride, wrow, K);
    }
    free(wrow);
}
#endif

// x [M, K] fp32 (rows x_stride apart), w [N, K/32 blocks], y [M, N] (rows y_stride apart).
// Returns 0, -1 on bad arguments, -2 when scratch memory cannot be had.
int kvf_quant_matmul(const float* x, int M, int K, int x_stride, const uint8_t* w, int N,
                     int type, float* y, int y_stride, int threads) {
    const int bb = block_bytes(type), bw = block_weights(type);
    if (bb == 0 || K % bw || M < 0 || N < 0 || x_stride < K || y_stride < N) return -1;
    const int nb = K / bw;
    product_ctx c = {x, M, K, x_stride, w, N, type, y, y_stride, nb, bb, bw,
                     (size_t)nb * bb, NULL, NULL, 0};
#ifdef KVF_AVX2
    if (is_unit_type(type)) {
        kvf_parallel((N + UNIT_CHUNK - 1) / UNIT_CHUNK, threads, unit_chunks, &c);
        return c.failed ? -2 : 0;
    }
    float* xs = NULL;
    if (type == KVF_Q4_1) {  // each row's block sums, in a fixed order
        xs = malloc((size_t)M * nb * sizeof(float) + 1);
        if (!xs) return -2;
        for (int m = 0; m < M; m++)
            for (int b = 0; b < nb; b++) {
                const float* xb = x + (size_t)m * x_stride + (size_t)b * QK;
                float s = 0.0f;
                for (int i = 0; i < QK; i++) s += xb[i];
                xs[(size_t)m * nb + b] = s;
            }
    }
    c.xs = xs;
    kvf_parallel_for((N + ROWS_CHUNK - 1) / ROWS_CHUNK, threads, rows_chunk, &c);
    free(xs);
#else
    kvf_parallel(N, threads, decoded_outputs, &c);
    if (c.failed) return -2;
#endif
    return 0;
}

#ifdef KVF_AVX2
// kvf_quant_matmul_panel's tasks: tiles of nrp outputs (a multiple of 8): M == 1 takes 64
// outputs (8 chains keep the FMA units busy), more rows 24 (4 rows x 3 vectors in registers).
static void panel_tiles(void *vc, kvf_task *task, long t0, int worker) {
    (void)worker;
    product_ctx *c = vc;
    const int M = c->M, K = c->K, N = c->N, units = is_unit_type(c->type);
    const int nrp = M == 1 ? 64 : 24;
    float* P = aligned_alloc(64, ((size_t)K * nrp * sizeof(float) + 63) / 64 * 64);
    float* tmp = aligned_alloc(64, 4 * (size_t)nrp * sizeof(float));
    float* rowbuf = units ? aligned_alloc(64, ((size_t)K * sizeof(float) + 63) / 64 * 64) : tmp;
    for (long t = t0; t >= 0; t = kvf_next(task)) {
        if (!P || !tmp || !rowbuf) {
            set_failed(c);
            continue;
        }
        const float* x = c->x;
        float* y = c->y;
        const int x_stride = c->x_stride, y_stride = c->y_stride;
        const int n0 = (int)t * nrp, nr = N - n0 < nrp ? N - n0 : nrp;
        if (units) pack_panel_units(c->w, c->row_bytes, c->type, n0, nr, nrp, c->nb, K, P, rowbuf);
        else pack_panel(c->w, c->row_bytes, c->bb, c->type, n0, nr, nrp, c->nb, P);
        const int direct = nr == nrp;  // a ragged last tile goes through tmp
        for (int m0 = 0; m0 < M;) {
            const int R = M == 1 ? 1 : (M - m0 < 4 ? M - m0 : 4);
            float* o = direct && R == (M == 1 ? 1 : 4) ? y + (size_t)m0 * y_stride + n0 : tmp;
            const int os = o == tmp ? nrp : y_stride;
            const float* xr[4];
            for (int r = 0; r < 4; r++) xr[r] = x + (size_t)(m0 + (r < R ? r : 0)) * x_stride;
            if (M == 1) micro_1x64(xr[0], P, K, o);
            else micro_4x24(xr[0], xr[1], xr[2], xr[3], P, K, o, os);
            if (o == tmp)
                for (int r = 0; r < R; r++)
                    memcpy(y + (size_t)(m0 + r) * y_stride + n0, tmp + (size_t)r * nrp,
                           (size_t)nr * sizeof(float));
            m0 += R;
        }
    }
    free(P);
    if (units) free(rowbuf);
    free(tmp);
}
#endif

// The same product for long chunks (prefill): each tile of output rows is decoded once into an
// fp32 panel held in cache and multiplied by every row of x in a register-blocked kernel, at
// ~3x the rows kernel's rate for 128+ rows. Every output is one fma chain over k in order, so
// a row's result depends on neither M nor the tiling (a different order from
// kvf_quant_matmul's: callers pick one by chunk length, never by batch). Same returns, and -3
// without AVX2 (callers then use kvf_quant_matmul).
int kvf_quant_matmul_panel(const float* x, int M, int K, int x_stride, const uint8_t* w, int N,
                           int type, float* y, int y_stride, int threads) {
    const int bb = block_bytes(type), bw = block_weights(type);
    if (bb == 0 || K % bw || M < 0 || N < 0 || x_stride < K || y_stride < N) return -1;
#ifdef KVF_AVX2
    const int nb = K / bw, nrp = M == 1 ? 64 : 24;
    product_ctx c = {x, M, K, x_stride, w, N, type, y, y_stride, nb, bb, bw,
                     (size_t)nb * bb, NULL, NULL, 0};
    kvf_parallel((N + nrp - 1) / nrp, threads, panel_tiles, &c);
    return c.failed ? -2 : 0;
#else
    (void)x; (void)w; (void)y; (void)y_stride; (void)threads;
    return -3;
#endif
}

#ifdef KVF_AVX2
static void f32_panel_tile(void *vc, long t) {
    const product_ctx *c = vc;
    const int nrp = 24, M = c->M, K = c->K, x_stride = c->x_stride, y_stride = c->y_stride;
    const float* x = c->x;
    float* y = c->y;
    const int n0 = (int)t * nrp, nr = c->N - n0 < nrp ? c->N - n0 : nrp;
    const float* panel = c->P + (size_t)t * K * nrp;
    float tmp[4 * 24];
    for (int m0 = 0; m0 < M; m0 += 4) {
        const int R = M - m0 < 4 ? M - m0 : 4;
        const float* xr[4];
        for (int r = 0; r < 4; r++) xr[r] = x + (size_t)(m0 + (r < R ? r : 0)) * x_stride;
        const int direct = nr == nrp && (R == 4 || R == 1);
        float* o = direct ? y + (size_t)m0 * y_stride + n0 : tmp;
        if (R == 1) micro_1x24(xr[0], panel, K, o);
        else micro_4x24(xr[0], xr[1], xr[2], xr[3], panel, K, o, direct ? y_stride : nrp);
        if (!direct)
            for (int r = 0; r < R; r++)
                memcpy(y + (size_t)(m0 + r) * y_stride + n0, tmp + r * nrp,
                       (size_t)nr * sizeof(float));
    }
}
#endif

// y = x @ W.T for an fp32 weight prepacked in panels (kernels/cpu_gemm.py PanelWeight):
// P[t][k][j] = W[24 t + j][k], zero past N. The same 4 x 24 kernel as the quantized panels, so
// every output is one fma chain over k in order: a row's bits depend on nothing else in the
// call (batch invariant for any M, no calibration). Returns 0, -1 on bad arguments, -3 without
// AVX2 (callers then use oneDNN).
int kvf_panel_matmul_f32(const float* x, int M, int K, int x_stride, const float* P, int N,
                         float* y, int y_stride, int threads) {
    if (M < 0 || N < 0 || K <= 0 || x_stride < K || y_stride < N) return -1;
#ifdef KVF_AVX2
    const int tiles = (N + 23) / 24;
    product_ctx c = {x, M, K, x_stride, NULL, N, 0, y, y_stride, 0, 0, 0, 0, NULL, P, 0};
    // threads only where the work pays for waking them
    const int big = (long)tiles * K * (M < 4 ? 4 : M) >= (1 << 16);
    return kvf_parallel_for(tiles, big ? threads : 1, f32_panel_tile, &c);
#else
    (void)x; (void)P; (void)y; (void)threads;
    return -3;
#endif
}

static void dequantize_row(void *vc, long n) {
    const product_ctx *c = vc;
    decode_row(c->w + (size_t)n * c->row_bytes, c->nb, c->type, c->y + (size_t)n * c->K);
}

// The whole [N, K] weight as fp32 (for long prefill chunks, which run as one dense GEMM).
int kvf_dequantize(const uint8_t* w, int N, int K, int type, float* out, int threads) {
    const int bb = block_bytes(type), bw = block_weights(type);
    if (bb == 0 || K % bw || N < 0) return -1;
    const int nb = K / bw;
    product_ctx c = {NULL, 0, K, K, w, N, type, out, K, nb, bb, bw, (size_t)nb * bb, NULL, NULL, 0};
    return kvf_parallel_for(N, threads, dequantize_row, &c);
}

// ---- int8 activations (W8A8: --quantization int8) ----
//
// y = x @ W.T with x's rows rounded to int8 per block of 32 (scale dx = max|x| / 127, values
// round(x / dx) to nearest even) and W's Q8_0 or Q4_0 blocks taken as the int8 values they
// hold: each block's dot product is an exact int32 (VNNI's vpdpbusd where the CPU has it, else
// maddubs + madd: the same 8 lanes of 4-byte groups, so the same bits on every x86 CPU), and
// the row's 8 float lanes take acc = fma(float(lanes), dx * dw, acc) block after block in
// order (even and odd blocks in two sums, added lane-wise and then by hsum8 at the end). A row's result depends on nothing else in the call (batch
// invariant). Not exact like kvf_quant_matmul: x loses bits (~0.4 % of max|x| per block).
#ifdef KVF_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVF_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define KVF_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define KVF_DPBUSD(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#endif

// The block's 32 weights as int8 (Q8_0: as stored; Q4_0: nibble - 8, byte i holding elements
// i and i + 16).
static inline __m256i block_int8(const uint8_t* blk, int type) {
    if (type == KVF_Q8_0) return _mm256_loadu_si256((const __m256i*)(blk + 2));
    const __m128i raw = _mm_loadu_si128((const __m128i*)(blk + 2));
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, m), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

// Row m of x as int8 blocks (xq, K bytes) and their scales (xd, K / 32 x 8 floats: each scale
// written 8 times, so the kernel loads a block's, or a pair's, as one vector).
static void quantize_row_int8(const float* x, int K, int8_t* xq, float* xd) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / QK; b++) {
        const float* xb = x + (size_t)b * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        float t[8];
        _mm256_storeu_ps(t, amax);
        float a = t[0];
        for (int l = 1; l < 8; l++) a = t[l] > a ? t[l] : a;
        _mm256_storeu_ps(xd + (size_t)b * 8, _mm256_set1_ps(a / 127.0f));  // 8 lanes' copies
        const __m256 id = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // pack 32 x int32 -> 32 x int8 in order (packs work within 128-bit lanes: permute back)
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(xq + (size_t)b * QK), p8);
    }
}

// One block's 8 lanes of int32 sums (4-byte groups of x . w).
static inline __m256i block_dot(__m256i xv, __m256i w) {
    return KVF_DPBUSD(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
}

// Rows [m0, m0 + R) of y for output n (R 1, 2 or 4, a constant once inlined). Even blocks
// accumulate into one 8-lane sum and odd blocks into another (AVX-512 takes a pair of blocks
// per instruction, its halves being those two sums), added lane-wise at the end.
static inline __attribute__((always_inline)) void int8_rows_for_output(
    const int8_t* xq, const float* xd, int K, int m0, const int R, const uint8_t* row, int bb,
    int type, float* y, int y_stride, int n) {
    const int nb = K / QK;
    int b = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    __m512 acc[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
        const uint8_t* b0 = row + (size_t)b * bb;
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(block_int8(b0, type)),
                                             block_int8(b0 + bb, type), 1);
        const __m512i aw = _mm512_abs_epi8(w);
        const __mmask64 neg = _mm512_movepi8_mask(w);
        const __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(rd16(b0))),
                                             _mm256_set1_ps(_cvtsh_ss(rd16(b0 + bb))), 1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const size_t m = (size_t)(m0 + r);
            const __m512i xv = _mm512_loadu_si512((const void*)(xq + m * K + (size_t)b * QK));
            const __m512i sx = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
            const __m512i lanes = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx);
            const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(xd + (m * nb + b) * 8), dw);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), s, acc[r]);
        }
    }
    __m256 even[4], odd[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        even[r] = _mm512_castps512_ps256(acc[r]);
        odd[r] = _mm512_extractf32x8_ps(acc[r], 1);
    }
#else
    __m256 even[4], odd[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
    for (; b + 2 <= nb; b += 2) {
        const uint8_t* b0 = row + (size_t)b * bb;
        const __m256i w0 = block_int8(b0, type), w1 = block_int8(b0 + bb, type);
        const __m256 dw0 = _mm256_set1_ps(_cvtsh_ss(rd16(b0)));
        const __m256 dw1 = _mm256_set1_ps(_cvtsh_ss(rd16(b0 + bb)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const size_t m = (size_t)(m0 + r);
            const int8_t* xb = xq + m * K + (size_t)b * QK;
            const float* sb = xd + (m * nb + b) * 8;
            const __m256i l0 = block_dot(_mm256_loadu_si256((const __m256i*)xb), w0);
            const __m256i l1 = block_dot(_mm256_loadu_si256((const __m256i*)(xb + QK)), w1);
            even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l0),
                                      _mm256_mul_ps(_mm256_loadu_ps(sb), dw0), even[r]);
            odd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l1),
                                     _mm256_mul_ps(_mm256_loadu_ps(sb + 8), dw1), odd[r]);
        }
    }
#endif
    if (b < nb) {  // an odd number of blocks: the last one is even
        const uint8_t* blk = row + (size_t)b * bb;
        const __m256i w = block_int8(blk, type);
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(rd16(blk)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const size_t m = (size_t)(m0 + r);
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + m * K + (size_t)b * QK));
            const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(xd + (m * nb + b) * 8), dw);
            even[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(xv, w)), sc, even[r]);
        }
    }
    for (int r = 0; r < R; r++)
        y[(size_t)(m0 + r) * y_stride + n] = hsum8(_mm256_add_ps(even[r], odd[r]));
}

static void int8_chunk(void* vc, long t) {
    const product_ctx* c = vc;
    const int8_t* xq = (const int8_t*)c->x;  // the quantized rows (see kvf_quant_matmul_int8)
    const float* xd = c->xs;
    const int n0 = (int)t * ROWS_CHUNK, n1 = n0 + ROWS_CHUNK < c->N ? n0 + ROWS_CHUNK : c->N;
    int m0 = 0;
    for (; m0 + 4 <= c->M; m0 += 4)
        for (int n = n0; n < n1; n++)
            int8_rows_for_output(xq, xd, c->K, m0, 4, c->w + n * c->row_bytes, c->bb, c->type, c->y,
                                 c->y_stride, n);
    if (c->M - m0 >= 2) {
        for (int n = n0; n < n1; n++)
            int8_rows_for_output(xq, xd, c->K, m0, 2, c->w + n * c->row_bytes, c->bb, c->type, c->y,
                                 c->y_stride, n);
        m0 += 2;
    }
    if (c->M - m0 >= 1)
        for (int n = n0; n < n1; n++)
            int8_rows_for_output(xq, xd, c->K, m0, 1, c->w + n * c->row_bytes, c->bb, c->type, c->y,
                                 c->y_stride, n);
}
#endif

// Q8_0 or Q4_0 weights [N, K] times x [M, K] with x rounded to int8 blocks (above). Returns 0,
// -1 on bad arguments or another block type, -2 without memory, -3 without AVX2 (callers then
// use kvf_quant_matmul).
int kvf_quant_matmul_int8(const float* x, int M, int K, int x_stride, const uint8_t* w, int N,
                          int type, float* y, int y_stride, int threads) {
    const int bb = block_bytes(type);
    if ((type != KVF_Q8_0 && type != KVF_Q4_0) || K % QK || M < 0 || N < 0 || x_stride < K ||
        y_stride < N)
        return -1;
#ifdef KVF_AVX2
    const int nb = K / QK;
    int8_t* xq = malloc((size_t)M * K + 1);
    float* xd = malloc((size_t)M * nb * 8 * sizeof(float) + 1);
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -2;
    }
    for (int m = 0; m < M; m++)
        quantize_row_int8(x + (size_t)m * x_stride, K, xq + (size_t)m * K, xd + (size_t)m * nb * 8);
    product_ctx c = {(const float*)xq, M, K, K, w, N, type, y, y_stride, nb, bb, QK,
                     (size_t)nb * bb, xd, NULL, 0};
    kvf_parallel_for((N + ROWS_CHUNK - 1) / ROWS_CHUNK, threads, int8_chunk, &c);
    free(xq);
    free(xd);
    return 0;
#else
    (void)x; (void)w; (void)y; (void)threads; (void)bb;
    return -3;
#endif
}

// The same rounding of x's rows, for tests: xq [M, K] int8, xd [M, K / 32, 8] (each scale 8
// times). -3 without AVX2.
int kvf_quantize_rows_int8(const float* x, int M, int K, int x_stride, int8_t* xq, float* xd) {
    if (K % QK || M < 0 || x_stride < K) return -1;
#ifdef KVF_AVX2
    for (int m = 0; m < M; m++)
        quantize_row_int8(x + (size_t)m * x_stride, K, xq + (size_t)m * K, xd + (size_t)m * (K / QK) * 8);
    return 0;
#else
    (void)x; (void)xq; (void)xd;
    return -3;
#endif
}

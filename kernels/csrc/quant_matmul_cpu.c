// y = x @ W.T with W held in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1), read in place.
//
// W is N rows of K/32 blocks each (one row of blocks per output feature, as GGUF stores a
// [N, K] tensor). Each block covers 32 consecutive weights of a row:
//   Q8_0: fp16 d, int8 q[32]                    w = d * q
//   Q4_0: fp16 d, uint8 nibbles[16]             w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, uint8 nibbles[16]     w = d * q + m
// (nibble i holds element i in its low half and element i + 16 in its high half).
//
// Every output y[m, n] is computed by the same sequence of operations whatever else is in the
// call, so a row's result never depends on the batch (batch invariant by construction); the
// sums keep their written order (compiled without -ffast-math). Threads split the N outputs.
//
// With AVX2 + FMA + F16C: per block, p = x . q in 8 lanes (4 FMAs over the block's integer
// values converted to float), acc += d * p, and for Q4_1 a separate scalar m * sum(x_block)
// (x's block sums are computed once per call); y = sum of acc's 8 lanes + the m terms. Rows go
// four at a time through each decoded block, so the decode is shared. Elsewhere: each row of W
// is decoded to fp32 (exactly: d * q has at most 19 significant bits) and dotted in 32 lanes.
// Both differ from dequantize-then-matmul only in the order of the sums.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVF_AVX2 1
#endif

#define QK 32

enum { KVF_Q8_0 = 8, KVF_Q4_0 = 2, KVF_Q4_1 = 3 };  // GGMLQuantizationType values

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
        default: return 0;
    }
}

static inline uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

// Decode one row of `nb` blocks into `out` (nb * 32 floats).
static void decode_row(const uint8_t* row, int nb, int type, float* out) {
    const int bb = block_bytes(type);
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
    const __m128i raw = _mm_loadu_si128((const __m128i*)(blk + (type == KVF_Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(raw, mask);                     // elements 0..15
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // elements 16..31
    if (type == KVF_Q4_0) {
        const __m128i eight = _mm_set1_epi8(8);
        lo = _mm_sub_epi8(lo, eight);
        hi = _mm_sub_epi8(hi, eight);
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

// Rows [m0, m0 + R) of y for output n; R <= 4. xs: x's block sums (Q4_1 only).
static inline void rows_for_output(const float* x, int x_stride, const float* xs, int nb,
                                   const uint8_t* row, int bb, int type, int m0, int R,
                                   float* y, int y_stride, int n) {
    __m256 acc[4];
    float msum[4] = {0, 0, 0, 0};
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t* blk = row + (size_t)b * bb;
        __m256 v[4];
        block_values(blk, type, v);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(blk)));
        const float m = type == KVF_Q4_1 ? _cvtsh_ss(rd16(blk + 2)) : 0.0f;
        for (int r = 0; r < R; r++) {
            const float* xb = x + (size_t)(m0 + r) * x_stride + (size_t)b * QK;
            __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xb), v[0]);
            p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), v[1], p);
            p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v[2], p);
            p = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v[3], p);
            acc[r] = _mm256_fmadd_ps(d, p, acc[r]);
            if (type == KVF_Q4_1) msum[r] += m * xs[(size_t)(m0 + r) * nb + b];
        }
    }
    for (int r = 0; r < R; r++) y[(size_t)(m0 + r) * y_stride + n] = hsum8(acc[r]) + msum[r];
}
#endif

// x [M, K] fp32 (rows x_stride apart), w [N, K/32 blocks], y [M, N] (rows y_stride apart).
// Returns 0, -1 on bad arguments, -2 when scratch memory cannot be had.
int kvf_quant_matmul(const float* x, int M, int K, int x_stride, const uint8_t* w, int N,
                     int type, float* y, int y_stride, int threads) {
    const int bb = block_bytes(type);
    if (bb == 0 || K % QK || M < 0 || N < 0 || x_stride < K || y_stride < N) return -1;
    const int nb = K / QK;
    const size_t row_bytes = (size_t)nb * bb;
#ifdef KVF_AVX2
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
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int n = 0; n < N; n++)
        for (int m0 = 0; m0 < M; m0 += 4)
            rows_for_output(x, x_stride, xs, nb, w + (size_t)n * row_bytes, bb, type, m0,
                            M - m0 < 4 ? M - m0 : 4, y, y_stride, n);
    free(xs);
#else
    int failed = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float* wrow = aligned_alloc(64, ((size_t)K * sizeof(float) + 63) / 64 * 64);
        if (!wrow) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            if (!wrow) continue;
            decode_row(w + (size_t)n * row_bytes, nb, type, wrow);
            for (int m = 0; m < M; m++)
                y[(size_t)m * y_stride + n] = dot(x + (size_t)m * x_stride, wrow, K);
        }
        free(wrow);
    }
    if (failed) return -2;
#endif
    return 0;
}

// The whole [N, K] weight as fp32 (for long prefill chunks, which run as one dense GEMM).
int kvf_dequantize(const uint8_t* w, int N, int K, int type, float* out, int threads) {
    const int bb = block_bytes(type);
    if (bb == 0 || K % QK || N < 0) return -1;
    const int nb = K / QK;
    const size_t row_bytes = (size_t)nb * bb;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int n = 0; n < N; n++) decode_row(w + (size_t)n * row_bytes, nb, type, out + (size_t)n * K);
    return 0;
}

// y = x @ W.T with W held in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1), read in place.
//
// W is N rows of K/32 blocks each (one row of blocks per output feature, as GGUF stores a
// [N, K] tensor). Each block covers 32 consecutive weights of a row:
//   Q8_0: fp16 d, int8 q[32]                    w = d * q
//   Q4_0: fp16 d, uint8 nibbles[16]             w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, uint8 nibbles[16]     w = d * q + m
// (nibble i holds element i in its low half and element i + 16 in its high half).
//
// Every output y[m, n] is one dot product of x's row m with W's decoded row n, summed in 32
// lanes over the blocks and then lane by lane, always in that order: a row's result never
// depends on how many other rows are in the call or where they are (batch invariant by
// construction). Decoding is exact (d * q has at most 19 significant bits), so the only
// difference from dequantize-then-matmul is the order of the sums. Compiled without
// -ffast-math for that reason. Threads split the N outputs.
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

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

// x [M, K] fp32 (rows x_stride apart), w [N, K/32 blocks], y [M, N] (rows y_stride apart).
// Returns 0, or -1 on bad arguments.
int kvf_quant_matmul(const float* x, int M, int K, int x_stride, const uint8_t* w, int N,
                     int type, float* y, int y_stride, int threads) {
    const int bb = block_bytes(type);
    if (bb == 0 || K % QK || M < 0 || N < 0 || x_stride < K || y_stride < N) return -1;
    const int nb = K / QK;
    const size_t row_bytes = (size_t)nb * bb;
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        float* wrow = aligned_alloc(64, ((size_t)K * sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            decode_row(w + (size_t)n * row_bytes, nb, type, wrow);
            for (int m = 0; m < M; m++)
                y[(size_t)m * y_stride + n] = dot(x + (size_t)m * x_stride, wrow, K);
        }
        free(wrow);
    }
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

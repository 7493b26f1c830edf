/* Paged decode attention for the CPU (fp32): one new query token per sequence attends to that
 * sequence's K/V where they lie in the paged cache, with no gather into a contiguous copy.
 *
 * Each query head is computed start to finish by one thread in a fixed order (scores, max, exp,
 * sum, weighted sum of V), so a sequence's output does not depend on what else is in the batch,
 * on the thread count or on how work is split: batching never changes greedy output. The
 * G = H / Hkv query heads of a KV head share each K and V row (grouped-query attention).
 *
 * Layouts (all contiguous, row-major):
 *   q        [B, H, D]
 *   k_cache  [num_blocks, block_size, Hkv, D]   (v_cache the same): fp32, or bf16 with kv_bf16
 *            (--dtype bfloat16 on the CPU: half the bytes read; each value widened to fp32
 *            exactly as it is loaded, all arithmetic in fp32)
 *   tables   [B, max_blocks] int32 block ids; only the first ceil(len / block_size) are read
 *   lens     [B] int32 context length of each sequence, including the new token (>= 1)
 *   out      [B, H, D]
 *
 * window > 0: sliding-window attention, a sequence of length L attends its keys
 * max(0, L - window) .. L - 1 only; the others (and their block-table entries) are not read.
 * softcap > 0: each score s (after scale) becomes softcap * tanh(s / softcap) (Gemma 2).
 *
 * Keys are walked a block at a time (no division per key) and the next block's rows are
 * prefetched while one block's are used: a sequence's blocks lie anywhere in the cache, and
 * at decode batch sizes the K/V reads from memory are the kernel's time (SmolLM2, 16 sequences
 * of 300 keys, 30 layers: 19.5 -> 15.4 ms per step, one sequence 1.76 -> 0.90 ms, same bits).
 *
 * Returns 0, -1 when scratch memory could not be allocated, -2 when a block id used by a
 * sequence lies outside [0, num_blocks) (nothing is read from it; that sequence's output is
 * left unwritten).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_pool.h"

/* Cache element i of a row at p: fp32, or bf16 (bf) widened to fp32 (exact: the bf16 bits are
 * the fp32's top half). bf is a constant wherever this is inlined (attend_f32 / attend_bf16). */
static inline __attribute__((always_inline)) float ld(const void *restrict p, int64_t i,
                                                      const int bf) {
    if (!bf) return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Element i of the cache (fp32 or bf16) as an address. */
static inline const void *at(const void *p, int64_t i, const int bf) {
    return (const char *)p + i * (bf ? 2 : 4);
}

static inline __attribute__((always_inline)) float dot(const float *restrict a,
                                                       const void *restrict b, int d,
                                                       const int bf) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; i++) s += a[i] * ld(b, i, bf);
    return s;
}

/* Asks for the cache lines of n elements at p (a slot row's heads) ahead of their use. */
static inline void prefetch_row(const void *p, int n, const int bf) {
    const int step = bf ? 32 : 16; /* elements per 64-byte line */
    for (int i = 0; i < n; i += step) __builtin_prefetch(at(p, i, bf), 0, 3);
}

/* Where a walk over a sequence's keys enters a block at position pos (t keys walked, L in all):
 * returns the row of pos (its offset in the block in *off) and sets *next to the next block's
 * first row when the walk goes on past this block (fetched while this one's rows are used:
 * blocks lie anywhere), else NULL. col: the first element of the walk's heads in a row. */
static inline __attribute__((always_inline)) const void *enter_block(
    const void *cache, const int32_t *table, int pos, int t, int L, int block_size, int64_t row,
    int64_t col, const int bf, int *off, const void **next) {
    const int32_t *blk = table + pos / block_size;
    *off = pos % block_size;
    *next = t + block_size - *off < L ? at(cache, (int64_t)blk[1] * block_size * row + col, bf)
                                      : NULL;
    return at(cache, ((int64_t)*blk * block_size + *off) * row + col, bf);
}

/* a[d] += p[i] * v[i * stride + d] for i in 0..n-1 in order, with a held in registers across
 * the rows (the common head sizes; the same chains, so the same bits, as the generic loop). */
#define KVF_WEIGHTED_ROWS(DIM)                                                                   \
    static inline __attribute__((always_inline)) void weighted_rows_##DIM(                       \
        float *restrict a, const float *restrict p, const void *restrict v, int64_t stride,      \
        int n, const int bf) {                                                                   \
        float r[DIM];                                                                            \
        for (int d = 0; d < DIM; d++) r[d] = a[d];                                               \
        for (int i = 0; i < n; i++) {                                                            \
            const float pi = p[i];                                                               \
            const void *vr = at(v, (int64_t)i * stride, bf);                                     \
            _Pragma("omp simd") for (int d = 0; d < DIM; d++) r[d] += pi * ld(vr, d, bf);        \
        }                                                                                        \
        for (int d = 0; d < DIM; d++) a[d] = r[d];                                               \
    }
KVF_WEIGHTED_ROWS(64)
KVF_WEIGHTED_ROWS(128)

#ifdef __AVX512F__
#include <immintrin.h>
#define KVF_FAST_HEADS 1

/* 16 cache elements from element i of p as fp32 (bf16 widened). */
static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t i, const int bf) {
    if (!bf) return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Lane i of the result = the sum of v[i]'s 16 lanes, for 16 vectors at once (a fixed tree:
 * pairs within 128-bit lanes, then across them). */
static inline __m512 sum16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d a = _mm512_castps_pd(t[2 * k]), b = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int k = 0; k < 2; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* Scores of query heads [0, NQ) over keys [t0, t0 + L), head sizes 64 and 128: each K row is
 * loaded (and widened) once for the G query heads that share it, each head's product with it
 * is one 16-lane vector (an FMA chain over the row's 16-element pieces), and every 16 keys the
 * vectors' lane sums come out 16 at a time (sum16): no horizontal sum per key. part: NQ x 16
 * x 16 floats of scratch. */
static inline __attribute__((always_inline)) void scores_fast(
    const float *restrict qb, const void *restrict k_cache, const int32_t *restrict table,
    float *restrict s, float *restrict part, int t0, int L, int NQ, int G, int64_t row, int h0,
    const int D, int block_size, float scale, const int bf) {
    const int C = D / 16, nh = NQ / G;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int t = 0, pos = t0; t < L;) {
        int off;
        const void *next;
        const void *k = enter_block(k_cache, table, pos, t, L, block_size, row, (int64_t)h0 * D,
                                    bf, &off, &next);
        for (; off < block_size && t < L; off++, t++, pos++, k = at(k, row, bf)) {
            if (next) prefetch_row(at(next, (int64_t)off * row, bf), nh * D, bf);
            const int slot = t & 15;
            for (int h = 0; h < nh; h++) {
                __m512 kv[8];
#pragma GCC unroll 8
                for (int c = 0; c < C; c++) kv[c] = ld16(k, (int64_t)h * D + 16 * c, bf);
                for (int g = 0; g < G; g++) {
                    const int j = h * G + g;
                    const float *qj = qb + (int64_t)j * D;
                    __m512 pr = _mm512_mul_ps(_mm512_loadu_ps(qj), kv[0]);
#pragma GCC unroll 8
                    for (int c = 1; c < C; c++)
                        pr = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16 * c), kv[c], pr);
                    _mm512_storeu_ps(part + ((size_t)j * 16 + slot) * 16, pr);
                }
            }
            if (slot == 15 || t + 1 == L) { /* 16 keys (or the last few): their scores */
                const int n = slot + 1;
                for (int j = 0; j < NQ; j++) {
                    float *pj = part + (size_t)j * 256;
                    for (int i = n; i < 16; i++) _mm512_storeu_ps(pj + 16 * i, _mm512_setzero_ps());
                    __m512 v[16];
                    for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_ps(pj + 16 * i);
                    _mm512_mask_storeu_ps(s + (size_t)j * L + t + 1 - n, (__mmask16)((1u << n) - 1),
                                          _mm512_mul_ps(sum16(v), sc));
                }
            }
        }
    }
}

/* acc[j][d] = sum over keys t, in order, of p[j][t] * v[t][d] for head sizes 64 and 128: each
 * V row loaded (and widened) once for up to 4 (D 64) or 2 (D 128) query heads of its KV head,
 * their 16 accumulators held in registers over all the keys. */
static inline __attribute__((always_inline)) void values_fast(
    const float *restrict s, const void *restrict v_cache, const int32_t *restrict table,
    float *restrict acc, int t0, int L, int NQ, int G, int64_t row, int h0, const int D,
    int block_size, const int bf) {
    const int C = D / 16, HC = 16 / C, nh = NQ / G;
    for (int h = 0; h < nh; h++)
        for (int g0 = 0; g0 < G; g0 += HC) {
            const int hc = G - g0 < HC ? G - g0 : HC;
            const float *pj = s + (size_t)(h * G + g0) * L;
            __m512 a[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
            for (int t = 0, pos = t0; t < L;) {
                const int32_t *blk = table + pos / block_size;
                int off = pos % block_size;
                const int n = block_size - off < L - t ? block_size - off : L - t;
                const void *v = at(v_cache, ((int64_t)*blk * block_size + off) * row + (int64_t)(h0 + h) * D, bf);
                if (t + n < L)
                    for (int i = 0; i < block_size; i++)
                        prefetch_row(at(v_cache, ((int64_t)blk[1] * block_size + i) * row + (int64_t)(h0 + h) * D, bf), D, bf);
                for (int i = 0; i < n; i++, t++, v = at(v, row, bf)) {
                    __m512 vv[8];
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++) vv[c] = ld16(v, 16 * c, bf);
#pragma GCC unroll 4
                    for (int g = 0; g < HC; g++) {
                        if (g >= hc) break;
                        const __m512 p = _mm512_set1_ps(pj[(size_t)g * L + t]);
#pragma GCC unroll 8
                        for (int c = 0; c < C; c++) a[g * C + c] = _mm512_fmadd_ps(p, vv[c], a[g * C + c]);
                    }
                }
                pos += n;
            }
            for (int g = 0; g < hc; g++)
                for (int c = 0; c < C; c++)
                    _mm512_storeu_ps(acc + (size_t)(h * G + g0 + g) * D + 16 * c, a[g * C + c]);
        }
}
#endif

/* Attention of sequence b's query heads of KV heads [h0, h1) over its keys [t0, t0 + L).
 * Scratch ``s`` holds (h1 - h0) * G * L scores, then G * D accumulators, G sums and (head sizes 64
 * and 128 with AVX-512) G * 256 floats of score vectors per KV
 * head. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
    const int32_t *restrict table, float *restrict out, float *restrict s, int b, int h0, int h1,
    int t0, int L, int H, int Hkv, int D, int block_size, float scale, float softcap,
    const int bf) {
    const int G = H / Hkv, nh = h1 - h0, NQ = nh * G; /* query heads handled here */
    const int64_t row = (int64_t)Hkv * D;             /* elements per cache slot */
    const float *qb = q + ((int64_t)b * H + (int64_t)h0 * G) * D;
    float *acc = s + (size_t)NQ * L;
    float *inv_sum = acc + (size_t)NQ * D;
#ifdef KVF_FAST_HEADS
    const int fast = D == 64 || D == 128;
    float *part = inv_sum + NQ; /* NQ x 256 floats (scores_fast) */
    if (D == 64)
        scores_fast(qb, k_cache, table, s, part, t0, L, NQ, G, row, h0, 64, block_size, scale, bf);
    else if (D == 128)
        scores_fast(qb, k_cache, table, s, part, t0, L, NQ, G, row, h0, 128, block_size, scale, bf);
#else
    const int fast = 0;
#endif
    /* scores: slot rows are read in order, all heads of a row at once (one contiguous run);
     * blocks walked in order, no division per key */
    for (int t = 0, pos = fast ? t0 + L : t0; t < L && !fast;) {
        int off;
        const void *next;
        const void *k = enter_block(k_cache, table, pos, t, L, block_size, row, (int64_t)h0 * D,
                                    bf, &off, &next);
        for (; off < block_size && t < L; off++, t++, pos++, k = at(k, row, bf)) {
            if (next) prefetch_row(at(next, (int64_t)off * row, bf), NQ / G * D, bf);
            for (int j = 0; j < NQ; j++) {
                const float *qj = qb + (int64_t)j * D;
                const void *kj = at(k, (int64_t)(j / G) * D, bf);
                /* the common head sizes as constants: the loop unrolled, no remainder code */
                const float d = D == 64    ? dot(qj, kj, 64, bf)
                                : D == 128 ? dot(qj, kj, 128, bf)
                                           : dot(qj, kj, D, bf);
                s[(size_t)j * L + t] = d * scale;
            }
        }
    }
    /* softmax per query head (unnormalised; divided by the sum at the end) */
    for (int j = 0; j < NQ; j++) {
        float *sj = s + (size_t)j * L;
        /* soft-capping as its own pass over one head's L scores: the same loop, so the same
         * (vector or scalar) tanhf for a head whatever the batch and the work split */
        if (softcap > 0.0f)
            for (int t = 0; t < L; t++) sj[t] = softcap * tanhf(sj[t] / softcap);
        float m = sj[0];
        for (int t = 1; t < L; t++) m = sj[t] > m ? sj[t] : m;
        float sum = 0.0f;
        for (int t = 0; t < L; t++) {
            sj[t] = expf(sj[t] - m);
            sum += sj[t];
        }
        inv_sum[j] = 1.0f / sum;
    }
    /* acc[j][d] = sum over t, in order, of p[j][t] * v[t][d]: each element one chain over the
     * keys (what any loop order gives); keys walked a block at a time, all heads of a slot row
     * at once */
#ifdef KVF_FAST_HEADS
    if (D == 64)
        values_fast(s, v_cache, table, acc, t0, L, NQ, G, row, h0, 64, block_size, bf);
    else if (D == 128)
        values_fast(s, v_cache, table, acc, t0, L, NQ, G, row, h0, 128, block_size, bf);
#endif
    if (!fast)
        for (int i = 0; i < NQ * D; i++) acc[i] = 0.0f;
    for (int t = 0, pos = t0; t < L && !fast;) {
        const int32_t *blk = table + pos / block_size;
        int off = pos % block_size;
        const void *v = at(v_cache, ((int64_t)*blk * block_size + off) * row + (int64_t)h0 * D, bf);
        const int n = block_size - off < L - t ? block_size - off : L - t; /* keys in this block */
        if (t + n < L)
            for (int i = 0; i < block_size; i++)
                prefetch_row(
                    at(v_cache, ((int64_t)blk[1] * block_size + i) * row + (int64_t)h0 * D, bf),
                    NQ / G * D, bf);
        for (int j = 0; j < NQ; j++) {
            const float *pj = s + (size_t)j * L + t;
            const void *vj = at(v, (int64_t)(j / G) * D, bf);
            float *a = acc + (size_t)j * D;
            if (D == 64) weighted_rows_64(a, pj, vj, row, n, bf);
            else if (D == 128) weighted_rows_128(a, pj, vj, row, n, bf);
            else
                for (int i = 0; i < n; i++) {
                    const float p = pj[i];
                    const void *vr = at(vj, (int64_t)i * row, bf);
#pragma omp simd
                    for (int d = 0; d < D; d++) a[d] += p * ld(vr, d, bf);
                }
        }
        t += n;
        pos += n;
    }
    for (int j = 0; j < NQ; j++) {
        float *o = out + ((int64_t)b * H + (int64_t)h0 * G + j) * D;
        const float inv = inv_sum[j];
        for (int d = 0; d < D; d++) o[d] = acc[(size_t)j * D + d] * inv;
    }
}

/* The two element types, each compiled with its own inlined loads. */
static void attend_f32(const float *q, const void *k_cache, const void *v_cache,
                       const int32_t *table, float *out, float *s, int b, int h0, int h1, int t0,
                       int L, int H, int Hkv, int D, int block_size, float scale, float softcap) {
    attend(q, k_cache, v_cache, table, out, s, b, h0, h1, t0, L, H, Hkv, D, block_size, scale,
           softcap, 0);
}

static void attend_bf16(const float *q, const void *k_cache, const void *v_cache,
                        const int32_t *table, float *out, float *s, int b, int h0, int h1, int t0,
                        int L, int H, int Hkv, int D, int block_size, float scale, float softcap) {
    attend(q, k_cache, v_cache, table, out, s, b, h0, h1, t0, L, H, Hkv, D, block_size, scale,
           softcap, 1);
}

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int32_t *tables, *lens;
    float *out;
    int H, Hkv, D, block_size, max_blocks, num_blocks, per_head;
    float scale, softcap;
    int window, kv_bf16;
    int bad_block, no_memory;
} attn_ctx;

static void attend_item(void *vc, long w) {
    attn_ctx *c = vc;
    const int Hkv = c->Hkv, D = c->D, block_size = c->block_size, window = c->window;
    const int b = c->per_head ? (int)(w / Hkv) : (int)w;
    const int h0 = c->per_head ? (int)(w % Hkv) : 0, h1 = c->per_head ? h0 + 1 : Hkv;
    const int len = c->lens[b];
    const int t0 = window > 0 && len > window ? len - window : 0; /* first key attended */
    const int L = len - t0;
    const int32_t *table = c->tables + (int64_t)b * c->max_blocks;
    int bad = 0;
    for (int i = t0 / block_size; i < (len + block_size - 1) / block_size; i++)
        bad |= table[i] < 0 || table[i] >= c->num_blocks;
    if (bad) {
        __atomic_store_n(&c->bad_block, 1, __ATOMIC_RELAXED);
        return;
    }
    const size_t nq = (size_t)(h1 - h0) * (c->H / Hkv);
    float *s = malloc(sizeof(float) * (nq * L + nq * D + nq + nq * 256));
    if (s == NULL) {
        __atomic_store_n(&c->no_memory, 1, __ATOMIC_RELAXED);
        return;
    }
    (c->kv_bf16 ? attend_bf16 : attend_f32)(c->q, c->k_cache, c->v_cache, table, c->out, s, b, h0,
                                            h1, t0, L, c->H, Hkv, D, block_size, c->scale,
                                            c->softcap);
    free(s);
}

int kvf_paged_decode_attention(const float *restrict q, const void *restrict k_cache,
                               const void *restrict v_cache, const int32_t *restrict tables,
                               const int32_t *restrict lens, float *restrict out, int B, int H,
                               int Hkv, int D, int block_size, int max_blocks, int num_blocks,
                               float scale, int window, float softcap, int kv_bf16,
                               int num_threads) {
    /* One work item per sequence (all its heads: each slot row is one contiguous read) when
     * there are enough sequences to keep the threads busy, else one per (sequence, KV head).
     * Either way each query head's result is computed by the same arithmetic in the same
     * order, so the split never changes a bit. */
    const int per_head = B < 2 * num_threads;
    const int items = per_head ? B * Hkv : B;
    attn_ctx c = {q, k_cache, v_cache, tables, lens, out, H, Hkv, D, block_size, max_blocks,
                  num_blocks, per_head, scale, softcap, window, kv_bf16 != 0, 0, 0};
    kvf_parallel_for(items, num_threads, attend_item, &c);
    return c.bad_block ? -2 : c.no_memory ? -1 : 0;
}

// The elementwise parts of a Llama layer for the CPU path (fp32), each one call instead of the
// eight to twelve small PyTorch ops it takes in kernels/reference.py. At decode batch sizes a
// layer's non-GEMM work is a few thousand floats, so its cost is the per-op dispatch (~5 us per
// PyTorch op, ~70 ops per layer, 30 layers): the fused calls remove most of a step's host time.
//
//   kvf_add_rms_norm   residual += x (or residual = x), out = w * (r * rsqrt(mean(r^2) + eps))
//   kvf_rope_write_kv  q rotated into q_out; k rotated and v copied into the paged KV cache
//   kvf_silu_mul       out = silu(gate) * up of a fused gate/up projection
//   kvf_gelu_tanh_mul  out = gelu_tanh(gate) * up (Gemma's fused gate/up)
//
// Every row is computed by the same sequence of operations whatever else is in the call, so a
// row's result never depends on the batch. Compiled with -ffp-contract=off and without
// -ffast-math: a multiply and an add stay two rounded IEEE operations in the vector body and in
// the scalar tail alike (as in PyTorch's own kernels), and sums keep their written order
// (-fno-trapping-math lets gcc vectorize loops with comparisons in them).
// Results follow HF's op order (RMSNorm: weight * (x * rsqrt(var + eps)); RoPE: rotate_half);
// exp is a polynomial (|error| <= 2 ulp) rather than libm's, in vectors (kvf_expf_v).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvf_pool.h"

#define LANES 8

#define PAR_MIN_FLOATS (1 << 16)

// e^x on VL floats at once, written with GCC vector extensions (AVX-512 or 2 x AVX2 here, split
// by the compiler elsewhere) and used for every value, a row's last N % VL included (through a
// zero-padded copy), so no value depends on where in a row it falls. Written out rather than
// left to gcc's vectorization of a scalar loop: for silu that if-converted the clamp into lanes
// dividing every input by 1 + exp(88), whose denormal quotients cost a microcode assist each
// (the activation ran 6-8x slower than torch's; 2,048 x 1,536 silu_mul: 40 ms -> 5 ms).
#define VL 16
typedef float kvf_fv __attribute__((vector_size(4 * VL), aligned(4)));
typedef int32_t kvf_iv __attribute__((vector_size(4 * VL), aligned(4)));

static inline kvf_fv kvf_splat(float v) {
    kvf_fv out;
    for (int i = 0; i < VL; i++) out[i] = v;
    return out;
}

static inline kvf_fv kvf_select(kvf_iv m, kvf_fv a, kvf_fv b) {  // m ? a : b, lane by lane
    return (kvf_fv)(((kvf_iv)a & m) | ((kvf_iv)b & ~m));
}

static inline kvf_fv kvf_expf_v(kvf_fv x) {
    x = kvf_select(x < kvf_splat(-87.0f), kvf_splat(-87.0f), x);
    x = kvf_select(x > kvf_splat(88.0f), kvf_splat(88.0f), x);
    // n = round(x / ln 2) by the 1.5 * 2^23 trick (exact for |x / ln 2| < 2^22)
    kvf_fv n = x * 1.44269504088896341f + 12582912.0f;
    n = n - 12582912.0f;
    // r = x - n ln 2 in two parts (Cody-Waite), |r| <= ln 2 / 2
    kvf_fv r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    kvf_fv p = kvf_splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const kvf_fv y = p * (r * r) + r + 1.0f;
    const kvf_iv bits = (__builtin_convertvector(n, kvf_iv) + 127) << 23;  // 2^n, n in [-126, 127]
    return y * (kvf_fv)bits;
}

typedef struct {
    const float *x;
    int x_stride;
    float *res;
    int has_res;
    const float *w;
    float *out;
    int N;
    float eps;
} rms_ctx;

static void rms_row(void *vc, long t) {
    const rms_ctx *c = vc;
    const int N = c->N;
    const float* xr = c->x + (size_t)t * c->x_stride;
    float* rr = c->res + (size_t)t * N;
    float* o = c->out + (size_t)t * N;
    const float* w = c->w;
    if (c->has_res) {
        for (int i = 0; i < N; i++) rr[i] = xr[i] + rr[i];
    } else if (rr != xr) {
        memcpy(rr, xr, (size_t)N * sizeof(float));
    }
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= N; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = acc[l] + rr[i + l] * rr[i + l];
    for (int l = 0; i < N; i++, l++) acc[l] = acc[l] + rr[i] * rr[i];
    const float ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    const float inv = 1.0f / sqrtf(ss / (float)N + c->eps);
    for (int j = 0; j < N; j++) o[j] = w[j] * (rr[j] * inv);
}

// Threads where the work pays for them (a decode row is a few thousand floats).
static inline int row_threads(long T, long floats_per_row, int threads) {
    return T * floats_per_row >= PAR_MIN_FLOATS ? threads : 1;
}

// x [T, N] (rows x_stride apart); res [T, N] contiguous, updated to x + res (has_res) or set to
// x; out [T, N] contiguous. Returns 0, or -1 on bad arguments.
int kvf_add_rms_norm(const float* x, int x_stride, float* res, int has_res, const float* w,
                     float* out, int T, int N, float eps, int threads) {
    if (T < 0 || N <= 0 || x_stride < N) return -1;
    rms_ctx c = {x, x_stride, res, has_res, w, out, N, eps};
    return kvf_parallel_for(T, row_threads(T, N, threads), rms_row, &c);
}

// One token's rotation of `nh` heads of D at src (heads D apart) into dst (heads dst_hs apart):
// HF's rotate_half, x1 * cos - x2 * sin | x2 * cos + x1 * sin.
static inline void rotate(const float* src, float* dst, size_t dst_hs, int nh, int D,
                          const float* cos, const float* sin) {
    const int half = D / 2;
    for (int h = 0; h < nh; h++) {
        const float* s = src + (size_t)h * D;
        float* d = dst + (size_t)h * dst_hs;
        for (int i = 0; i < half; i++) {
            const float x1 = s[i], x2 = s[i + half];
            d[i] = x1 * cos[i] - x2 * sin[i];
            d[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

// qkv [T, (H + 2 Hkv) D] rows row_stride apart (q heads, then k heads, then v heads);
// positions [T] int64 < max_pos; cos_sin [max_pos, D] (cos of the D/2 frequencies, then sin);
// q_out [T, H, D]; caches [num_slots, Hkv, D] (flat slots of the paged cache), fp32 or, with
// kv_bf16, bf16 (each value rounded to nearest even, as torch's .to(torch.bfloat16) rounds);
// slots [T] int64, -1: the token's K/V are not stored. Returns 0, -1 on bad arguments, -2 when
// a position or a slot is out of range (that token is skipped).
typedef struct {
    const float *qkv;
    int row_stride, H, Hkv, D;
    const int64_t *positions;
    const float *cos_sin;
    int max_pos;
    float *q_out;
    void *k_cache, *v_cache;
    const int64_t *slots;
    long num_slots;
    int kv_bf16, bad;
} rope_ctx;

// fp32 -> bf16, round to nearest even (NaN stays NaN), bit for bit torch's conversion.
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void store_bf16(uint16_t* dst, const float* src, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
}

static void rope_row(void *vc, long t) {
    rope_ctx *c = vc;
    const int H = c->H, Hkv = c->Hkv, D = c->D;
    const size_t kv_row = (size_t)Hkv * D;
    const int64_t p = c->positions[t], s = c->slots[t];
    if (p < 0 || p >= c->max_pos || s < -1 || s >= c->num_slots) {
        __atomic_store_n(&c->bad, 1, __ATOMIC_RELAXED);
        return;
    }
    const float* row = c->qkv + (size_t)t * c->row_stride;
    const float* cos = c->cos_sin + (size_t)p * D;
    const float* sin = cos + D / 2;
    rotate(row, c->q_out + (size_t)t * H * D, D, H, D, cos, sin);
    if (s >= 0 && !c->kv_bf16) {
        rotate(row + (size_t)H * D, (float*)c->k_cache + (size_t)s * kv_row, D, Hkv, D, cos, sin);
        memcpy((float*)c->v_cache + (size_t)s * kv_row, row + (size_t)(H + Hkv) * D,
               kv_row * sizeof(float));
    } else if (s >= 0) {  // rotated in fp32, then rounded
        float k[kv_row];
        rotate(row + (size_t)H * D, k, D, Hkv, D, cos, sin);
        store_bf16((uint16_t*)c->k_cache + (size_t)s * kv_row, k, kv_row);
        store_bf16((uint16_t*)c->v_cache + (size_t)s * kv_row, row + (size_t)(H + Hkv) * D, kv_row);
    }
}

int kvf_rope_write_kv(const float* qkv, int T, int row_stride, int H, int Hkv, int D,
                      const int64_t* positions, const float* cos_sin, int max_pos, float* q_out,
                      void* k_cache, void* v_cache, const int64_t* slots, long num_slots,
                      int kv_bf16, int threads) {
    if (T < 0 || H <= 0 || Hkv <= 0 || D <= 0 || D % 2 || row_stride < (H + 2 * Hkv) * D)
        return -1;
    rope_ctx c = {qkv, row_stride, H, Hkv, D, positions, cos_sin, max_pos,
                  q_out, k_cache, v_cache, slots, num_slots, kv_bf16 != 0, 0};
    kvf_parallel_for(T, row_threads(T, row_stride, threads), rope_row, &c);
    return c.bad ? -2 : 0;
}

typedef struct {
    const float *x;
    int N, x_stride;
    float *out;
} gate_ctx;

static inline kvf_fv silu_v(kvf_fv g) { return g / (1.0f + kvf_expf_v(-g)); }

// gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), as g / (1 + exp(-2y));
// past exp's clamp the result is below 1e-37 |g|: 0 (with g's sign), as exp overflowing to inf
// gives in the reference, even where g^3 is inf
static inline kvf_fv gelu_tanh_v(kvf_fv g) {
    const kvf_fv y2 = 1.5957691216057308f * (g + 0.044715f * (g * g * g));  // 2 sqrt(2 / pi)
    return kvf_select(y2 < kvf_splat(-88.0f), g * 0.0f, g / (1.0f + kvf_expf_v(-y2)));
}

// o = act(g) * u over a row of N
static inline __attribute__((always_inline)) void gated_row(const float* g, const float* u,
                                                             float* o, int N,
                                                             kvf_fv (*act)(kvf_fv)) {
    int i = 0;
    for (; i + VL <= N; i += VL)
        *(kvf_fv*)(o + i) = act(*(const kvf_fv*)(g + i)) * *(const kvf_fv*)(u + i);
    if (i < N) {
        const size_t rest = (size_t)(N - i) * sizeof(float);
        kvf_fv gv = kvf_splat(0.0f), uv = kvf_splat(0.0f);
        memcpy(&gv, g + i, rest);
        memcpy(&uv, u + i, rest);
        const kvf_fv ov = act(gv) * uv;
        memcpy(o + i, &ov, rest);
    }
}

static void silu_row(void *vc, long t) {
    const gate_ctx *c = vc;
    const float* g = c->x + (size_t)t * c->x_stride;
    gated_row(g, g + c->N, c->out + (size_t)t * c->N, c->N, silu_v);
}

// x [T, 2N] rows x_stride apart (gate | up), out [T, N] contiguous:
// out = gate / (1 + exp(-gate)) * up. Returns 0, or -1 on bad arguments.
int kvf_silu_mul(const float* x, int T, int N, int x_stride, float* out, int threads) {
    if (T < 0 || N <= 0 || x_stride < 2 * N) return -1;
    gate_ctx c = {x, N, x_stride, out};
    return kvf_parallel_for(T, row_threads(T, N, threads), silu_row, &c);
}

static void gelu_tanh_row(void *vc, long t) {
    const gate_ctx *c = vc;
    const float* g = c->x + (size_t)t * c->x_stride;
    gated_row(g, g + c->N, c->out + (size_t)t * c->N, c->N, gelu_tanh_v);
}

// x [T, 2N] rows x_stride apart (gate | up), out [T, N] contiguous: out = gelu_tanh(gate) * up,
// gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), computed as
// g / (1 + exp(-2y)) (the same value; one exp and no cancellation in 1 + tanh(y)), in
// reference.gelu_tanh_and_mul's op order. Returns 0, or -1 on bad arguments.
int kvf_gelu_tanh_mul(const float* x, int T, int N, int x_stride, float* out, int threads) {
    if (T < 0 || N <= 0 || x_stride < 2 * N) return -1;
    gate_ctx c = {x, N, x_stride, out};
    return kvf_parallel_for(T, row_threads(T, N, threads), gelu_tanh_row, &c);
}

/* Every layer of a float32 or bfloat16 engine step in one call: B tokens, the first n_dec one
 * decode token each of as many sessions, the rest prompt chunks over their own rows.
 *
 * Run from Python, a decode layer is ~25 small torch ops (norms, RoPE, cache writes, SwiGLU,
 * residual adds) around its GEMMs and attention, each costing microseconds of dispatch whatever
 * its size: 0.4 to 0.9 ms a layer, a quarter to a third of a step at batch 1 to 8 on SmolLM2
 * (docs/engine_speed.md). Here the same arithmetic runs as plain loops, and the GEMMs and
 * attention are the engine's own kernels, passed in as function pointers (gemv.c for one row,
 * panel_gemm.c for more, decode_attention.c, chunk_attention.c), so each C file stays
 * self-contained; a prefill step's layers likewise (their Python dispatch is a smaller share, its
 * elementwise passes over the step's tokens a larger one). Per layer,
 * as the torch path does it:
 *
 *   h = rmsnorm(x) * w_in;  q, k, v = h @ Wqkv^T (+ b);  RoPE (rotate-half) on q and k;
 *   k, v -> cache row rows[b], entry ents[b];  a = attention(q, cache);  x += a @ Wo^T;
 *   h = rmsnorm(x) * w_post;  g, u = h @ Wgu^T;  x += (silu(g) * u) @ Wdown^T
 *
 * In bfloat16 (bf16 != 0: x, weights, norms, biases, cos/sin and the cache bfloat16; gemm is
 * panel_gemm_bf16.c) every value is rounded where the torch path rounds it, as torch rounds
 * (nearest even): each projection's output (after its bias), the norm before and after its
 * weight, RoPE's two products and their sum, SiLU and its product with up, each residual sum.
 * Sums and the norm's statistics are float32, as there.
 *
 * Token b's K and V go to cache row rows[b], entry ents[b]. Decode tokens attend through the decode
 * attention kernel (lens [n_dec], longest, scratch as decode_attention.c takes them), chunks
 * through chunk_attention.c's (chunks [n_chunks, 4] as it takes them, chunk_scratch its scratch).
 * x [B, d] is updated in place. table holds SLOTS pointers per layer (see the enum); for B == 1
 * the weights are the modules' row-major ones (gate and up apart), for B >= 2 the panel kernel's
 * panels (gate and up interleaved by half panels: the kernel's SiLU(gate) * up epilogue). work is
 * laid out at the top of decode_layers(), Q = (H + 2*Hkv) * D; valid [rows, vcap] as the
 * attention kernels take it. Returns an attention kernel's error code (0: fine).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { IN_NORM, POST_NORM, QKV, QKV_BIAS, O, GATE_UP, UP, DOWN, K_CACHE, V_CACHE, SLOTS };

typedef void (*gemv_fn)(const float *, const void *, float *, int64_t, int64_t, int, int);
typedef void (*gemm_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int, int);
typedef void (*gemm16_fn)(const uint16_t *, const uint16_t *, void *, int64_t, int64_t, int64_t, int, int, int);
typedef int (*attention_fn)(const void *, int64_t, const void *, const void *, const uint8_t *, int64_t,
                            const int64_t *, const int64_t *, void *, int, int, int, int, int64_t, float,
                            int, float *, int64_t, int);
typedef int (*chunk_fn)(const void *, int64_t, const void *, const void *, const uint8_t *, int64_t,
                        const int64_t *, int, void *, int, int, int, int64_t, float, int, float *, int64_t, int);

static inline float from16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to16(float f) { /* torch's rounding: nearest even, NaN to a quiet NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* a value as the step's dtype holds it, and element i of a float32 or bfloat16 array */
#define R(v) (bf16 ? from16(to16(v)) : (v))
#define AT(p, i) (bf16 ? from16(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])

static void rmsnorm(const float *x, const void *w, float *out, int64_t B, int64_t d, float eps, int bf16) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * d;
        float ss = 0.f;
        for (int64_t i = 0; i < d; i++) ss += xb[i] * xb[i];
        float r = 1.f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) out[b * d + i] = bf16 ? R(AT(w, i) * R(xb[i] * r)) : xb[i] * r * AT(w, i);
    }
}

/* y [B, n] = x [B, k] @ W^T in float32 sums: one row by gemv.c on row-major W, more by the panel
 * kernel on panels (bfloat16: x first written as bfloat16 into x16) */
static void linear(const float *x, const void *w, float *y, int64_t B, int64_t n, int64_t k, gemv_fn gemv,
                   void *gemm, int bf16, uint16_t *x16, int threads) {
    if (B == 1) {
        gemv(x, w, y, n, k, bf16, threads);
    } else if (bf16) {
        for (int64_t i = 0; i < B * k; i++) x16[i] = to16(x[i]);
        ((gemm16_fn)gemm)(x16, w, y, B, n, k, 0, 0, threads);
    } else {
        ((gemm_fn)gemm)(x, w, y, B, n, k, 0, threads);
    }
}

static void rope(float *v, const void *cos, const void *sin, int64_t heads, int64_t D, int bf16) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++, v += D)
        for (int64_t i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = R(R(a * AT(cos, i)) - R(b * AT(sin, i)));
            v[i + half] = R(R(b * AT(cos, i + half)) + R(a * AT(sin, i + half)));
        }
}

int decode_layers(void *x, int64_t B, int64_t L, int64_t d, int64_t H, int64_t Hkv, int64_t D, int64_t F,
                  float eps, void *const *table, const void *cos, const void *sin, const int64_t *rows,
                  const int64_t *ents, const int64_t *lens, int64_t longest, const uint8_t *valid, int64_t vcap,
                  int64_t cap, float *work, float *scratch, int threads, gemv_fn gemv, void *gemm,
                  attention_fn attend, int bf16, int64_t n_dec, const int64_t *chunks, int n_chunks,
                  chunk_fn chunk_attend, float *chunk_scratch, int64_t chunk_scratch_floats) {
    /* work: floats h, proj [B, d], qkv [B, Q], att [B, H*D], gu [B, 2F]; in bfloat16 also the
     * residual stream xf [B, d] and 16-bit q16 [B, max(Q, d)], a16 [B, max(H*D, F, d)] after them */
    int64_t Q = (H + 2 * Hkv) * D, es = bf16 ? 2 : 4;
    float *h = work, *proj = h + B * d, *qkv = proj + B * d, *att = qkv + B * Q, *gu = att + B * H * D;
    float *act = gu; /* silu(g) * u written over gu, row by row behind the reads */
    float *xf = bf16 ? gu + 2 * B * F : (float *)x;
    uint16_t *q16 = (uint16_t *)(xf + B * d), *a16 = q16 + B * (Q > d ? Q : d);
    if (bf16)
        for (int64_t i = 0; i < B * d; i++) xf[i] = from16(((const uint16_t *)x)[i]);
    for (int64_t l = 0; l < L; l++) {
        void *const *t = table + l * SLOTS;
        rmsnorm(xf, t[IN_NORM], h, B, d, eps, bf16);
        linear(h, t[QKV], qkv, B, Q, d, gemv, gemm, bf16, a16, threads);
        for (int64_t b = 0; b < B; b++) {
            float *r = qkv + b * Q;
            for (int64_t i = 0; i < Q; i++) r[i] = R(t[QKV_BIAS] ? r[i] + AT(t[QKV_BIAS], i) : r[i]);
            rope(r, (const char *)cos + b * D * es, (const char *)sin + b * D * es, H + Hkv, D, bf16);
            for (int64_t j = 0; j < Hkv; j++) {
                int64_t at = ((rows[b] * Hkv + j) * cap + ents[b]) * D;
                const float *k = r + (H + j) * D, *v = r + (H + Hkv + j) * D;
                if (bf16) {
                    for (int64_t i = 0; i < D; i++) ((uint16_t *)t[K_CACHE])[at + i] = to16(k[i]);
                    for (int64_t i = 0; i < D; i++) ((uint16_t *)t[V_CACHE])[at + i] = to16(v[i]);
                } else {
                    memcpy((float *)t[K_CACHE] + at, k, D * 4);
                    memcpy((float *)t[V_CACHE] + at, v, D * 4);
                }
            }
        }
        if (bf16) /* the kernel reads bfloat16 queries and writes bfloat16 outputs */
            for (int64_t i = 0; i < B * Q; i++) q16[i] = to16(qkv[i]);
        void *qs = bf16 ? (void *)q16 : (void *)qkv, *as = bf16 ? (void *)a16 : (void *)att;
        const float scale = 1.f / sqrtf((float)D);
        int err = n_dec ? attend(qs, Q, t[K_CACHE], t[V_CACHE], valid, vcap, rows, lens, as, (int)n_dec, (int)Hkv,
                                 (int)(H / Hkv), (int)D, cap, scale, bf16, scratch, longest, threads)
                        : 0;
        if (!err && n_chunks)
            err = chunk_attend(qs, Q, t[K_CACHE], t[V_CACHE], valid, vcap, chunks, n_chunks, as, (int)Hkv,
                               (int)(H / Hkv), (int)D, cap, scale, bf16, chunk_scratch, chunk_scratch_floats,
                               threads);
        if (err) return err;
        if (bf16 && B > 1) { /* the attention's bfloat16 output is the product's input as it is */
            ((gemm16_fn)gemm)(a16, t[O], proj, B, d, H * D, 0, 0, threads);
        } else {
            if (bf16)
                for (int64_t i = 0; i < H * D; i++) att[i] = from16(a16[i]);
            linear(att, t[O], proj, B, d, H * D, gemv, gemm, bf16, a16, threads);
        }
        for (int64_t i = 0; i < B * d; i++) xf[i] = R(xf[i] + R(proj[i]));
        rmsnorm(xf, t[POST_NORM], h, B, d, eps, bf16);
        if (B == 1) { /* gate and up apart, as the modules hold them */
            gemv(h, t[GATE_UP], gu, F, d, bf16, threads);
            gemv(h, t[UP], gu + F, F, d, bf16, threads);
            for (int64_t i = 0; i < F; i++) {
                float g = R(gu[i]), u = R(gu[F + i]);
                act[i] = bf16 ? R(R(g / (1.f + expf(-g))) * u) : g / (1.f + expf(-g)) * u;
            }
            linear(act, t[DOWN], proj, B, d, F, gemv, gemm, bf16, a16, threads);
        } else if (bf16) { /* gate and up panels: SiLU(gate) * up from the kernel, bfloat16 in and out */
            for (int64_t i = 0; i < B * d; i++) q16[i] = to16(h[i]);
            ((gemm16_fn)gemm)(q16, t[GATE_UP], a16, B, 2 * F, d, 1, 1, threads);
            ((gemm16_fn)gemm)(a16, t[DOWN], proj, B, d, F, 0, 0, threads);
        } else {
            ((gemm_fn)gemm)(h, t[GATE_UP], act, B, 2 * F, d, 1, threads);
            linear(act, t[DOWN], proj, B, d, F, gemv, gemm, bf16, a16, threads);
        }
        for (int64_t i = 0; i < B * d; i++) xf[i] = R(xf[i] + R(proj[i]));
    }
    if (bf16)
        for (int64_t i = 0; i < B * d; i++) ((uint16_t *)x)[i] = to16(xf[i]);
    return 0;
}

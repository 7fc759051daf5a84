/* Every layer of a float32 decode step in one call: B sessions, one new token each.
 *
 * Run from Python, a decode layer is ~25 small torch ops (norms, RoPE, cache writes, SwiGLU,
 * residual adds) around its GEMMs and attention, each costing microseconds of dispatch whatever
 * its size: 0.4 to 0.9 ms a layer, a quarter to a third of a step at batch 1 to 8 on SmolLM2
 * (docs/engine_speed.md). Here the same arithmetic runs as plain loops, and the GEMMs and
 * attention are the engine's own kernels, passed in as function pointers (gemv.c for one row,
 * panel_gemm.c for more, decode_attention.c), so each C file stays self-contained. Per layer,
 * as the torch path does it:
 *
 *   h = rmsnorm(x) * w_in;  q, k, v = h @ Wqkv^T (+ b);  RoPE (rotate-half) on q and k;
 *   k, v -> cache row rows[b], entry ents[b];  a = attention(q, cache);  x += a @ Wo^T;
 *   h = rmsnorm(x) * w_post;  g, u = h @ Wgu^T;  x += (silu(g) * u) @ Wdown^T
 *
 * x [B, d] is updated in place. table holds SLOTS pointers per layer (see the enum); for B == 1
 * the weights are the modules' row-major ones (gate and up apart), for B >= 2 panel_gemm.c's
 * panels (gate and up stacked). work holds B * (2*d + Q + H*D + 2*F) floats, Q = (H + 2*Hkv) * D;
 * valid [rows, vcap] and scratch as decode_attention.c takes them.
 * Returns the attention kernel's error code (0: fine).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { IN_NORM, POST_NORM, QKV, QKV_BIAS, O, GATE_UP, UP, DOWN, K_CACHE, V_CACHE, SLOTS };

typedef void (*gemv_fn)(const float *, const void *, float *, int64_t, int64_t, int, int);
typedef void (*gemm_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int);
typedef int (*attention_fn)(const void *, int64_t, const void *, const void *, const uint8_t *, int64_t,
                            const int64_t *, const int64_t *, void *, int, int, int, int, int64_t, float,
                            int, float *, int64_t, int);

static void rmsnorm(const float *x, const float *w, float *out, int64_t B, int64_t d, float eps) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * d;
        float ss = 0.f;
        for (int64_t i = 0; i < d; i++) ss += xb[i] * xb[i];
        float r = 1.f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) out[b * d + i] = xb[i] * r * w[i];
    }
}

/* y [B, n] = x [B, k] @ W^T: one row by gemv.c on row-major W, more by panel_gemm.c on panels */
static void linear(const float *x, const void *w, float *y, int64_t B, int64_t n, int64_t k, gemv_fn gemv,
                   gemm_fn gemm, int threads) {
    if (B == 1)
        gemv(x, w, y, n, k, 0, threads);
    else
        gemm(x, (const float *)w, y, B, n, k, threads);
}

static void rope(float *v, const float *cos, const float *sin, int64_t heads, int64_t D) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++, v += D)
        for (int64_t i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

int decode_layers(float *x, int64_t B, int64_t L, int64_t d, int64_t H, int64_t Hkv, int64_t D, int64_t F,
                  float eps, void *const *table, const float *cos, const float *sin, const int64_t *rows,
                  const int64_t *ents, const int64_t *lens, int64_t longest, const uint8_t *valid, int64_t vcap,
                  int64_t cap,
                  float *work, float *scratch, int threads, gemv_fn gemv, gemm_fn gemm, attention_fn attend) {
    int64_t Q = (H + 2 * Hkv) * D;
    float *h = work, *proj = h + B * d, *qkv = proj + B * d, *att = qkv + B * Q, *gu = att + B * H * D;
    float *act = gu; /* silu(g) * u written over gu, row by row behind the reads */
    for (int64_t l = 0; l < L; l++) {
        void *const *t = table + l * SLOTS;
        rmsnorm(x, t[IN_NORM], h, B, d, eps);
        linear(h, t[QKV], qkv, B, Q, d, gemv, gemm, threads);
        for (int64_t b = 0; b < B; b++) {
            float *r = qkv + b * Q;
            if (t[QKV_BIAS])
                for (int64_t i = 0; i < Q; i++) r[i] += ((const float *)t[QKV_BIAS])[i];
            rope(r, cos + b * D, sin + b * D, H + Hkv, D);
            for (int64_t j = 0; j < Hkv; j++) {
                int64_t at = ((rows[b] * Hkv + j) * cap + ents[b]) * D;
                memcpy((float *)t[K_CACHE] + at, r + (H + j) * D, D * 4);
                memcpy((float *)t[V_CACHE] + at, r + (H + Hkv + j) * D, D * 4);
            }
        }
        int err = attend(qkv, Q, t[K_CACHE], t[V_CACHE], valid, vcap, rows, lens, att, (int)B, (int)Hkv,
                         (int)(H / Hkv), (int)D, cap, 1.f / sqrtf((float)D), 0, scratch, longest, threads);
        if (err) return err;
        linear(att, t[O], proj, B, d, H * D, gemv, gemm, threads);
        for (int64_t i = 0; i < B * d; i++) x[i] += proj[i];
        rmsnorm(x, t[POST_NORM], h, B, d, eps);
        if (B == 1) { /* gate and up apart, as the modules hold them */
            gemv(h, t[GATE_UP], gu, F, d, 0, threads);
            gemv(h, t[UP], gu + F, F, d, 0, threads);
        } else
            gemm(h, (const float *)t[GATE_UP], gu, B, 2 * F, d, threads);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < F; i++) {
                float g = gu[b * 2 * F + i], u = gu[b * 2 * F + F + i];
                act[b * F + i] = g / (1.f + expf(-g)) * u;
            }
        linear(act, t[DOWN], proj, B, d, F, gemv, gemm, threads);
        for (int64_t i = 0; i < B * d; i++) x[i] += proj[i];
    }
    return 0;
}

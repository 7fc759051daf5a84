/* Decode attention: one query token per session over its cache row, holes skipped.
 *
 * For each (session b, KV head h) the G query heads sharing h read the row's K and V once:
 * pass 1 scores every valid entry (K streamed), pass 2 turns the scores into softmax weights
 * in place, pass 3 sums the weighted V rows (V streamed). Evicted entries (valid == 0) are never
 * read. Accumulation is float32; float32 or bfloat16 storage (bf16 != 0), output in the same.
 *
 * Layouts (elements): q [B, Hkv*G, D] with row stride q_stride, heads contiguous; K, V one
 * layer's cache [rows, Hkv, cap, D], contiguous; valid [rows, vcap] bytes; out [B, Hkv*G, D]
 * contiguous; scratch threads * G * max_len floats. Returns 1 when G or D is past the kernel's
 * fixed bounds (the caller checks them first), 2 when a row is longer than max_len or the cache.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256
#define LANES 16

#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#else
#define THREAD_ID() 0
#endif

static inline float dot(const float *a, const float *b, int D) {
    float acc[LANES] = {0};  /* independent lanes: the compiler vectorises without reassociating */
    int d = 0;
    for (; d + LANES <= D; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[d + l] * b[d + l];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 64); /* NaN stays NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* e^x for x in [-87, 0] (a score minus its row's maximum) in plain arithmetic the compiler
 * vectorises (libm's expf is a scalar call per entry): e^x = 2^n e^r, n = round(x / ln 2),
 * |r| <= ln(2) / 2, e^r by its Taylor series to r^7. Against float64: relative error under 1.2e-7
 * (2 float32 ulps) for x >= -20, 3e-6 near -87 where e^x < 1e-37, absolute error under 5e-8. */
static inline float exp_nonpositive(float x) {
    /* compares, not fmaxf (which does not vectorise); NaN goes to -87 too, so the garbage in a
     * hole's slot stays finite until it is weighed 0 */
    x = x > -87.f ? x : -87.f;
    x = x < 0.f ? x : 0.f;
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693147181f;
    float p = 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

/* Entry j of a K or V row as float32: in place for float32, converted into buf for bfloat16. */
static inline const float *entry(const void *base, int64_t j, int D, int bf16, float *buf) {
    if (!bf16) return (const float *)base + j * D;
    const uint16_t *h = (const uint16_t *)base + j * D;
    for (int d = 0; d < D; d++) buf[d] = from_bf16(h[d]);
    return buf;
}

static void attend_row(const float *q, const void *K, const void *V, const uint8_t *valid, int64_t n,
                       int G, int D, float scale, int bf16, float *s, float *out) {
    float m[MAX_G], l[MAX_G], buf[MAX_D];
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        if (!valid[j]) continue;
        const float *k = entry(K, j, D, bf16, buf);
        for (int g = 0; g < G; g++) {
            float x = scale * dot(q + g * D, k, D);
            s[g * n + j] = x;
            if (x > m[g]) m[g] = x;
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = s + g * n, mg = m[g], lg = 0.f;
        for (int64_t j = 0; j < n; j++) {
            float p = exp_nonpositive(sg[j] - mg) * (float)valid[j]; /* a hole weighs 0 */
            sg[j] = p;
            lg += p;
        }
        l[g] = lg;
    }
    for (int i = 0; i < G * D; i++) out[i] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        if (!valid[j]) continue;
        const float *v = entry(V, j, D, bf16, buf);
        for (int g = 0; g < G; g++) {
            float p = s[g * n + j], *o = out + g * D;
            for (int d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
    for (int g = 0; g < G; g++) {
        float inv = l[g] > 0.f ? 1.f / l[g] : 0.f; /* a row with nothing valid attends to nothing */
        for (int d = 0; d < D; d++) out[g * D + d] *= inv;
    }
}

int decode_attention(const void *q, int64_t q_stride, const void *K, const void *V, const uint8_t *valid,
                     int64_t vcap, const int64_t *rows, const int64_t *lens, void *out, int B, int Hkv,
                     int G, int D, int64_t cap, float scale, int bf16, float *scratch, int64_t max_len,
                     int threads) {
    if (G > MAX_G || D > MAX_D) return 1;
    for (int b = 0; b < B; b++)
        if (lens[b] > max_len || lens[b] > cap || lens[b] > vcap) return 2;
    const size_t es = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t i = 0; i < (int64_t)B * Hkv; i++) {
        const int64_t b = i / Hkv, h = i % Hkv, r = rows[b];
        const size_t kv_at = (size_t)((r * Hkv + h) * cap) * D * es;
        const size_t q_at = (size_t)(b * q_stride + h * G * D), o_at = (size_t)i * G * D;
        float qf[MAX_G * MAX_D], of[MAX_G * MAX_D];
        for (int t = 0; t < G * D; t++)
            qf[t] = bf16 ? from_bf16(((const uint16_t *)q)[q_at + t]) : ((const float *)q)[q_at + t];
        attend_row(qf, (const char *)K + kv_at, (const char *)V + kv_at, valid + r * vcap, lens[b], G, D,
                   scale, bf16, scratch + (size_t)THREAD_ID() * G * max_len, of);
        for (int t = 0; t < G * D; t++) {
            if (bf16) ((uint16_t *)out)[o_at + t] = to_bf16(of[t]);
            else ((float *)out)[o_at + t] = of[t];
        }
    }
    return 0;
}

/* Decode attention: one query token per session over its cache row, holes skipped.
 *
 * For each (session b, KV head h) the G query heads sharing h read the row's K and V once:
 * pass 1 scores every valid entry (K streamed; on AVX-512 by blocks of 16 entries, whose 16 dot
 * products fold their vectors of partial sums together, see sums16), pass 2 turns the scores
 * into softmax weights in place, pass 3 sums the weighted V rows (V streamed, the sums held in
 * registers across the row). Evicted entries (valid == 0) never weigh; pass 3 never reads them,
 * pass 1 only within a block that has a valid one. Accumulation is float32; float32 or bfloat16
 * storage (bf16 != 0, widened in registers), output in the same.
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

#if defined(__AVX512F__)
#define VL 16 /* floats per vector register */
#define DV 4  /* vectors of a head's output per pass: 3 x 4 sums and 4 V vectors, of 32 registers */
#else
#define VL 8
#define DV 2 /* 3 x 2 sums and 2 V vectors, of AVX2's 16 */
#endif
#define MAX_GV 3 /* query heads per pass of P V */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

/* out [gs, D] columns [d0, d0 + dv VL) = sum over valid j of s [gs, n] (weights) x V_j, the sums
 * held in gs x dv vector registers across all entries (a bfloat16 V row widened in registers). */
static inline __attribute__((always_inline)) void weigh(const float *s, int64_t n, const void *V,
                                                        const uint8_t *valid, int D, int d0, int bf16,
                                                        float *out, const int gs, const int dv) {
    vf acc[MAX_GV][DV];
    for (int g = 0; g < gs; g++)
        for (int c = 0; c < dv; c++) acc[g][c] = (vf){0};
    for (int64_t j = 0; j < n; j++) {
        if (!valid[j]) continue;
        vf v[DV];
        for (int c = 0; c < dv; c++) {
            const int64_t at = j * D + d0 + c * VL;
            if (bf16) {
                vh h;
                memcpy(&h, (const uint16_t *)V + at, sizeof h);
                v[c] = (vf)(__builtin_convertvector(h, vu) << 16);
            } else {
                memcpy(&v[c], (const float *)V + at, sizeof v[c]);
            }
        }
        for (int g = 0; g < gs; g++) {
            const vf p = (vf){0} + s[g * n + j];
            for (int c = 0; c < dv; c++) acc[g][c] += p * v[c];
        }
    }
    for (int g = 0; g < gs; g++)
        for (int c = 0; c < dv; c++) memcpy(out + g * D + d0 + c * VL, &acc[g][c], sizeof acc[g][c]);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* r[t] = the sum of v[t]'s 16 lanes: pairs of vectors interleaved and added (within 128-bit
 * lanes by floats, then by pairs of floats), then 128-bit lanes folded across vectors; 45
 * operations for 16 sums where one horizontal sum each would take 8 apiece. */
static inline __m512 sums16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    } /* x[i], each 128-bit lane: entries 4i..4i+3 summed over that lane */
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Pass 1 by blocks of 16 entries: each head's 16 dot products as 16 vectors of partial sums,
 * folded by sums16; holes scored -inf (their bytes are read but never weigh), a block of holes
 * only skipped. s [G, n] and the heads' maxima m. */
static void scores16(const float *q, const void *K, const uint8_t *valid, int64_t n, int G, int D, float scale,
                     int bf16, float *s, float *m) {
    const __m512 neg = _mm512_set1_ps(-INFINITY);
    __m512 mv[MAX_G];
    for (int g = 0; g < G; g++) mv[g] = neg;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int nb = n - j0 < 16 ? (int)(n - j0) : 16;
        __mmask16 live = 0;
        for (int t = 0; t < nb; t++) live |= (__mmask16)(valid[j0 + t] != 0) << t;
        for (int g = 0; g < G; g++) {
            __m512 v[16];
            for (int t = 0; t < 16; t++) v[t] = _mm512_setzero_ps();
            for (int t = 0; t < nb && live; t++) {
                for (int c = 0; c < D / 16; c++) {
                    const int64_t at = (j0 + t) * D + c * 16;
                    const __m512 k = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                                _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                    (const __m256i *)((const uint16_t *)K + at))), 16))
                                          : _mm512_loadu_ps((const float *)K + at);
                    v[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c * 16), k, v[t]);
                }
            }
            const __m512 x = _mm512_mask_blend_ps(live, neg, _mm512_mul_ps(sums16(v), _mm512_set1_ps(scale)));
            _mm512_mask_storeu_ps(s + g * n + j0, (__mmask16)((1u << nb) - 1), x);
            mv[g] = _mm512_max_ps(mv[g], x);
        }
    }
    for (int g = 0; g < G; g++) m[g] = _mm512_reduce_max_ps(mv[g]);
}
#endif

static void attend_row(const float *q, const void *K, const void *V, const uint8_t *valid, int64_t n,
                       int G, int D, float scale, int bf16, float *s, float *out) {
    float m[MAX_G], l[MAX_G], buf[MAX_D];
    for (int g = 0; g < G; g++) m[g] = -INFINITY;
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        scores16(q, K, valid, n, G, D, scale, bf16, s, m);
    } else
#endif
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
    if (D % VL == 0) {
        for (int g0 = 0; g0 < G; g0 += MAX_GV) { /* sums in registers: up to MAX_GV heads x DV vectors */
            const int gs = G - g0 < MAX_GV ? G - g0 : MAX_GV;
            for (int d0 = 0; d0 < D; d0 += DV * VL) {
                const int dv = (D - d0) / VL < DV ? (D - d0) / VL : DV;
                if (gs == 3 && dv == DV) weigh(s + g0 * n, n, V, valid, D, d0, bf16, out + g0 * D, 3, DV);
                else weigh(s + g0 * n, n, V, valid, D, d0, bf16, out + g0 * D, gs, dv); /* other shapes */
            }
        }
    } else {
        for (int i = 0; i < G * D; i++) out[i] = 0.f;
        for (int64_t j = 0; j < n; j++) {
            if (!valid[j]) continue;
            const float *v = entry(V, j, D, bf16, buf);
            for (int g = 0; g < G; g++) {
                float p = s[g * n + j], *o = out + g * D;
                for (int d = 0; d < D; d++) o[d] += p * v[d];
            }
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

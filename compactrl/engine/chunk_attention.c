/* Attention of prompt chunks: each query token of a chunk over its session's cache row, up to its
 * own entry, holes (valid == 0) masked. The prefill half of a step (decode_attention.c is the
 * one-token half).
 *
 * First each (chunk, KV head)'s keys are packed by blocks of KB, transposed ([D, KB] a block),
 * and its values widened to float32, holes and padding zero, once for all its work items. A work
 * item is ROWS / G query tokens of one chunk and one KV head: their query rows (the G heads
 * sharing the KV head, token-major, padded to whole tiles) go over the keys block by block, flash
 * style: scores as tiles of MR rows x KB keys (NV x MR vector sums over a D-long pass, as a GEMM
 * kernel), an online softmax per row (running maximum and sum, earlier sums rescaled; maxima and
 * sums folded across lanes by shuffles, exponentials in vector arithmetic), then the block's V
 * rows weighted into the rows' float32 outputs, RV rows x DV vectors at a time. Keys past a
 * row's own entry and holes weigh exactly 0: a block's holes are one vector of 0 / -inf added to
 * every row, the causal cut touches only the keys past a row's last. torch's flash kernel runs
 * this at about 50 GFLOP/s on one core whatever the CPU (SmolLM2's shapes); these tiles keep the
 * FMA units busier. With bfloat16 storage on a CPU with AVX512-BF16 the cache's bits go to
 * vdpbf16ps as they are (scores_dot, weigh_dot): twice the products per instruction.
 *
 * Layouts (elements): q [N, Hkv*G, D] token rows of stride q_stride, heads contiguous; K, V one
 * layer's cache [rows, Hkv, cap, D], contiguous; valid [rows, vcap] bytes; chunks [C, 4] int64
 * (token offset in q and out, cache row, first entry, tokens); out [N, Hkv*G, D] contiguous.
 * float32 or bfloat16 storage (bf16 != 0), float32 sums, output rounded once; scratch
 * scratch_cap floats, at least scratch_floats() of the largest chunk: chunks go in groups whose
 * packed keys fit. Returns 1 when G, D are past the kernel's bounds (D a multiple of LANES up to
 * MAX_D), 2 when a chunk runs past the cache, 3 when one does not fit the scratch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#define DOT 1 /* bfloat16 storage: vdpbf16ps on the cache's own bits, see scores_dot */
#else
#define DOT 0
#endif

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#if LANES == 16
#define NV 4 /* vectors per score tile row: 4 x MR sums and 4 keys' vectors, 28 of 32 registers */
#else
#define NV 2 /* 2 x MR sums and 2 keys' vectors, 14 of AVX2's 16 registers */
#endif
#define KB (NV * LANES) /* keys per block: a score tile's width */
#define MR 6           /* rows per score tile: 12 vector sums */
#define RV 3           /* rows per pass of P V: 3 x DV vector sums */
#define DV 4           /* vectors of an output row summed per pass */
#define ROWS 48        /* query rows per work item (ROWS / G tokens): q, o, a block's K, V and
                          scores stay in a 48 KB L1 at D = 64 */
#define MAX_G 16
#define MAX_D 256
#define MAX_R ROWS /* a multiple of MR, RV and LANES */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf vmax(vf a, vf b) {
    vi a_wins = a > b;
    return (vf)(((vi)a & a_wins) | ((vi)b & ~a_wins));
}

/* Lane swaps of 8, 4, 2 and 1: folding a vector's halves onto each other with the last LANES / 2
 * of them leaves every lane holding all lanes' maximum (or sum), where a scalar loop would be one
 * chain of dependent operations. */
static const int32_t swaps[4][16] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                                     {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                                     {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                                     {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#define FIRST_SWAP (LANES == 16 ? 0 : LANES == 8 ? 1 : 2)

static inline vf swapped(vf v, int w) {
    vi swap;
    memcpy(&swap, swaps[w], sizeof swap);
    return __builtin_shuffle(v, swap);
}

static inline float hmax(vf v) {
    for (int w = FIRST_SWAP; w < 4; w++) v = vmax(v, swapped(v, w));
    return v[0];
}

static inline float hsum(vf v) {
    for (int w = FIRST_SWAP; w < 4; w++) v += swapped(v, w);
    return v[0];
}

/* e^r for |r| <= ln(2) / 2: its Taylor series to r^7. */
static inline vf taylor7(vf r) {
    vf p = r * (1.f / 5040) + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    return p * r + 1.f;
}

/* e^x for x <= 0 on vectors, as decode_attention.c computes it for one float (2 float32 ulps
 * against float64 for x >= -20): e^x = 2^n e^r, n = round(x / ln 2), e^r by taylor7; -inf (a
 * masked score) gives exactly 0. AVX-512 rounds n and scales by 2^n in one instruction each
 * (vrndscaleps, vscalefps) and zeroes masked lanes with the scaling: half the instructions of
 * the portable version below. */
#if defined(__AVX512F__)
static inline vf exp_nonpositive(vf v) {
    const __mmask16 visible = _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
    const __m512 x = _mm512_min_ps(_mm512_max_ps((__m512)v, _mm512_set1_ps(-87.f)), _mm512_setzero_ps());
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf r = (vf)_mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
    return (vf)_mm512_maskz_scalef_ps(visible, (__m512)taylor7(r), n);
}
#else
static inline vf exp_nonpositive(vf x) {
    const vi visible = x > -INFINITY;
    x = vmax(x, (vf){0} - 87.f);
    x = -vmax(-x, (vf){0});
    const vf t = x * 1.44269504f + 0.5f;
    vi n = __builtin_convertvector(t, vi); /* rounds toward 0: one less where t was negative */
    n += __builtin_convertvector(n, vf) > t;
    const vf nf = __builtin_convertvector(n, vf), r = x - nf * 0.693147181f;
    return (vf)((vi)(taylor7(r) * (vf)((n + 127) << 23)) & visible);
}
#endif

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

/* s [MR, KB] = q [MR, D] . kt [D, KB] (a block's keys transposed). */
static inline void scores(const float *q, const float *kt, float *s, int D) {
    vf acc[MR][NV];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NV; c++) acc[m][c] = (vf){0};
    for (int d = 0; d < D; d++) {
        vf k[NV];
        for (int c = 0; c < NV; c++) {
            k[c] = load(kt + d * KB + c * LANES);
#if defined(__x86_64__)
            __asm__("" : "+x"(k[c])); /* in registers: GCC would reload them for every row */
#endif
        }
        for (int m = 0; m < MR; m++) {
            vf x = (vf){0} + q[m * D + d];
            for (int c = 0; c < NV; c++) acc[m][c] += x * k[c];
        }
    }
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NV; c++) store(s + m * KB + c * LANES, acc[m][c]);
}

/* o [RV, D] = o * alpha + p [RV, KB] . v [nb, D], dv vectors of D at a time. */
static inline __attribute__((always_inline)) void weigh(const float *p, const float *alpha, const float *v,
                                                        int nb, float *o, int D, const int dv) {
    for (int d0 = 0; d0 < D; d0 += dv * LANES) {
        vf acc[RV][DV];
        for (int r = 0; r < RV; r++)
            for (int c = 0; c < dv; c++) acc[r][c] = load(o + r * D + d0 + c * LANES) * alpha[r];
        for (int j = 0; j < nb; j++) {
            vf vj[DV];
            for (int c = 0; c < dv; c++) {
                vj[c] = load(v + j * D + d0 + c * LANES);
#if defined(__x86_64__)
                __asm__("" : "+x"(vj[c])); /* in registers: GCC would reload them for every row */
#endif
            }
            for (int r = 0; r < RV; r++) {
                vf x = (vf){0} + p[r * KB + j];
                for (int c = 0; c < dv; c++) acc[r][c] += x * vj[c];
            }
        }
        for (int r = 0; r < RV; r++)
            for (int c = 0; c < dv; c++) store(o + r * D + d0 + c * LANES, acc[r][c]);
    }
}

#if DOT
/* The bfloat16 path. vdpbf16ps multiplies pairs of bfloat16 exactly and adds both products to a
 * float32 lane: scores of the cache's bfloat16 keys and queries at float32 accuracy (the scale
 * applied after, in float32), at twice the products per instruction. Keys are packed as pairs
 * of dimensions ([D / 2, KB, 2] a block), values as pairs of keys ([entries / 2, D, 2]); the
 * weights P are rounded to bfloat16 for P V, as torch's flash kernel rounds them for bfloat16. */
static inline uint32_t pair_at(const uint16_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

/* s [MR, KB] = scale * q [MR, D] . k [D / 2, KB, 2] (bfloat16). */
static inline void scores_dot(const uint16_t *q, const uint16_t *k, float *s, int D, float scale) {
    __m512 acc[MR][NV];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NV; c++) acc[m][c] = _mm512_setzero_ps();
    for (int d = 0; d < D / 2; d++) {
        __m512bh kv[NV];
        for (int c = 0; c < NV; c++) kv[c] = (__m512bh)_mm512_loadu_si512(k + (d * KB + c * LANES) * 2);
        for (int m = 0; m < MR; m++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair_at(q + m * D + 2 * d));
            for (int c = 0; c < NV; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], x, kv[c]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(s + m * KB + c * LANES, acc[m][c] * scale);
}

/* o [RV, D] = o * alpha + p [RV, KB] (bfloat16) . v [nb / 2, D, 2] (bfloat16), dv vectors of D at a time. */
static inline __attribute__((always_inline)) void weigh_dot(const uint16_t *p, const float *alpha, const uint16_t *v,
                                                            int nb, float *o, int D, const int dv) {
    for (int d0 = 0; d0 < D; d0 += dv * LANES) {
        __m512 acc[RV][DV];
        for (int r = 0; r < RV; r++)
            for (int c = 0; c < dv; c++) acc[r][c] = _mm512_loadu_ps(o + r * D + d0 + c * LANES) * alpha[r];
        for (int j = 0; j < (nb + 1) / 2; j++) {
            __m512bh vj[DV];
            for (int c = 0; c < dv; c++) vj[c] = (__m512bh)_mm512_loadu_si512(v + (j * D + d0 + c * LANES) * 2);
            for (int r = 0; r < RV; r++) {
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair_at(p + r * KB + 2 * j));
                for (int c = 0; c < dv; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, vj[c]);
            }
        }
        for (int r = 0; r < RV; r++)
            for (int c = 0; c < dv; c++) _mm512_storeu_ps(o + r * D + d0 + c * LANES, acc[r][c]);
    }
}
#endif

/* Vectors of an output row summed per pass of P V: the most, up to DV, that divide D's. */
static int vectors_per_pass(int D) {
    int dv = DV;
    while (D % (dv * LANES)) dv--;
    return dv;
}

/* One work item: the G * nt query rows q [R, D] (R a multiple of MR, rows past G * nt zero) of
 * nt tokens, token t at entry first + t, over entries [0, first + nt) of one KV head: kt its keys
 * packed by blocks (zero past the last), v its values. float32 (q scaled, kt [blocks, D, KB], v
 * [entries, D]) or, with dot, bfloat16 as scores_dot and weigh_dot take them (q unscaled). o [R, D]. */
static inline __attribute__((always_inline)) void attend_item(const void *q, int R, int nt, int G, int D,
                                                              const void *kt, const void *v, const uint8_t *valid,
                                                              int64_t first, float *o, const int dot, float scale) {
    float s[MAX_R * KB], m[MAX_R], l[MAX_R], alpha[MAX_R], mb[MAX_R], shift[MAX_R];
    const int64_t end = first + nt;
    const int dv = vectors_per_pass(D);
    for (int r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.f;
    memset(o, 0, sizeof(float) * R * D);
    for (int64_t j0 = 0; j0 < end; j0 += KB) {
        const int nb = end - j0 < KB ? (int)(end - j0) : KB;
        const int64_t block = j0 * D; /* elements of packed keys before this block */
#if DOT
        if (dot)
            for (int r0 = 0; r0 < R; r0 += MR)
                scores_dot((const uint16_t *)q + r0 * D, (const uint16_t *)kt + block, s + r0 * KB, D, scale);
        else
#endif
            for (int r0 = 0; r0 < R; r0 += MR) scores((const float *)q + r0 * D, (const float *)kt + block, s + r0 * KB, D);
        float hole[KB]; /* 0, or -inf at a hole or past the keys: the same for every row */
        int holes = 0;
        for (int j = 0; j < KB; j++) {
            hole[j] = j < nb && valid[j0 + j] ? 0.f : -INFINITY;
            holes |= hole[j] != 0.f;
        }
        for (int r = 0; r < R; r++) { /* mask, then each row's largest score in the block */
            float *sr = s + r * KB;
            if (holes)
                for (int c = 0; c < NV; c++) store(sr + c * LANES, load(sr + c * LANES) + load(hole + c * LANES));
            const int64_t last = first + r / G - j0; /* the row's last visible key in the block */
            for (int64_t j = last < 0 ? 0 : last + 1; j < KB; j++) sr[j] = -INFINITY;
            vf mv = load(sr);
            for (int c = 1; c < NV; c++) mv = vmax(mv, load(sr + c * LANES));
            mb[r] = hmax(mv);
        }
        for (int r = 0; r < R; r++) { /* new maxima, and by how much the rows' sums shift */
            const float mn = mb[r] > m[r] ? mb[r] : m[r];
            shift[r] = m[r] == -INFINITY ? -INFINITY : m[r] - mn; /* nothing summed yet: factor 0 */
            m[r] = mn;
        }
        for (int r = R; r % LANES; r++) shift[r] = 0.f;
        for (int r = 0; r < R; r += LANES) store(alpha + r, exp_nonpositive(load(shift + r))); /* the factors */
        for (int r = 0; r < R; r++) { /* weights; a row with nothing visible yet weighs all 0 */
            float *sr = s + r * KB;
            vf sum = (vf){0};
            for (int c = 0; c < NV; c++) {
                const vf p = exp_nonpositive(load(sr + c * LANES) - m[r]);
                store(sr + c * LANES, p);
                sum += p;
            }
            l[r] = l[r] * alpha[r] + hsum(sum);
        }
#if DOT
        if (dot) {
            uint16_t p16[MAX_R * KB]; /* the weights rounded to bfloat16, nearest even */
            for (int i = 0; i < R * KB; i += LANES)
                _mm256_storeu_si256((__m256i *)(p16 + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i)));
            const uint16_t *vj = (const uint16_t *)v + j0 * D;
            for (int r0 = 0; r0 < R; r0 += RV) {
                const uint16_t *pr = p16 + r0 * KB;
                const float *ar = alpha + r0;
                switch (dv) {
                case 4: weigh_dot(pr, ar, vj, nb, o + r0 * D, D, 4); break;
                case 3: weigh_dot(pr, ar, vj, nb, o + r0 * D, D, 3); break;
                case 2: weigh_dot(pr, ar, vj, nb, o + r0 * D, D, 2); break;
                default: weigh_dot(pr, ar, vj, nb, o + r0 * D, D, 1);
                }
            }
            continue;
        }
#endif
        const float *vj = (const float *)v + j0 * D;
        for (int r0 = 0; r0 < R; r0 += RV) {
            const float *pr = s + r0 * KB, *ar = alpha + r0;
            switch (dv) { /* constant vector counts: the loops unroll into registers */
            case 4: weigh(pr, ar, vj, nb, o + r0 * D, D, 4); break;
            case 3: weigh(pr, ar, vj, nb, o + r0 * D, D, 3); break;
            case 2: weigh(pr, ar, vj, nb, o + r0 * D, D, 2); break;
            default: weigh(pr, ar, vj, nb, o + r0 * D, D, 1);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f; /* a row with nothing visible attends to nothing */
        for (int d = 0; d < D; d++) o[r * D + d] *= inv;
    }
}

/* Floats of scratch a call of C chunks needs: each one's keys packed and values as float32. */
int64_t scratch_floats(const int64_t *chunks, int C, int Hkv, int D) {
    int64_t n = 0;
    for (int c = 0; c < C; c++) n += (chunks[4 * c + 2] + chunks[4 * c + 3] + KB - 1) / KB * KB;
    return 2 * n * Hkv * D;
}

/* The chunks of one group, their packed keys and values all in scratch at once. */
static void attend_group(const void *q, int64_t q_stride, const void *K, const void *V, const uint8_t *valid,
                         int64_t vcap, const int64_t *chunks, int C, void *out, int Hkv, int G, int D, int64_t cap,
                         float scale, int bf16, float *scratch, int threads) {
    const int QT = ROWS / G > 1 ? ROWS / G : 1, H = Hkv * G; /* query tokens per work item */
    int64_t items = 0;
    for (int c = 0; c < C; c++) items += (chunks[4 * c + 3] + QT - 1) / QT;
    /* each (chunk, KV head)'s keys packed by blocks and values widened once, for all its items;
     * holes and padding zero (a hole's stale or uninitialised bytes never meet a weight) */
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic)
    for (int64_t ph = 0; ph < (int64_t)C * Hkv; ph++) {
        const int64_t c = ph / Hkv, h = ph % Hkv, *ch = chunks + 4 * c, end = ch[2] + ch[3];
        const int64_t padded = (end + KB - 1) / KB * KB;
        float *kt = scratch + scratch_floats(chunks, c, Hkv, D) + 2 * h * padded * D, *vb = kt + padded * D;
        const uint8_t *live = valid + ch[1] * vcap;
        const size_t kv_at = (size_t)((ch[1] * Hkv + h) * cap) * D;
        if (DOT && bf16) { /* bfloat16 as it is, in scores_dot's and weigh_dot's pairs */
            static const uint16_t zeros[MAX_D];            /* what a hole or padding reads */
            const uint16_t *K16 = (const uint16_t *)K + kv_at, *V16 = (const uint16_t *)V + kv_at;
            uint16_t *k16 = (uint16_t *)kt, *v16 = (uint16_t *)vb;
            for (int64_t j = 0; j < padded; j++) { /* a key's pairs of dimensions, KB keys apart */
                const uint16_t *src = j < end && live[j] ? K16 + j * D : zeros;
                uint16_t *dst = k16 + (j / KB) * D * KB + (j % KB) * 2;
                for (int d = 0; d < D; d += 2) memcpy(dst + d * KB, src + d, 4);
            }
            for (int64_t j = 0; j < padded; j += 2) { /* two keys' values interleaved */
                const uint16_t *a = j < end && live[j] ? V16 + j * D : zeros;
                const uint16_t *b = j + 1 < end && live[j + 1] ? V16 + (j + 1) * D : zeros;
                uint16_t *dst = v16 + j * D;
                for (int d = 0; d < D; d++) dst[2 * d] = a[d], dst[2 * d + 1] = b[d];
            }
            continue;
        }
        for (int64_t j = 0; j < padded; j++)
            for (int d = 0; d < D; d++) {
                const size_t at = kv_at + j * D + d;
                const int read = j < end && live[j];
                kt[(j / KB) * D * KB + d * KB + j % KB] = !read ? 0.f : bf16 ? from_bf16(((const uint16_t *)K)[at])
                                                                             : ((const float *)K)[at];
                vb[j * D + d] = !read ? 0.f : bf16 ? from_bf16(((const uint16_t *)V)[at]) : ((const float *)V)[at];
            }
    }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic)
    for (int64_t it = 0; it < items * Hkv; it++) {
        int64_t i = it / Hkv, c = 0; /* the item's chunk: items are numbered chunk by chunk */
        while (i >= (chunks[4 * c + 3] + QT - 1) / QT) i -= (chunks[4 * c + 3] + QT - 1) / QT, c++;
        const int64_t *ch = chunks + 4 * c, h = it % Hkv, t0 = i * QT;
        const int64_t padded = (ch[2] + ch[3] + KB - 1) / KB * KB;
        const int nt = ch[3] - t0 < QT ? (int)(ch[3] - t0) : QT, R = (nt * G + MR - 1) / MR * MR;
        float qf[MAX_R * MAX_D], of[MAX_R * MAX_D];
        uint16_t *q16 = (uint16_t *)qf; /* DOT: the bfloat16 rows as they are, unscaled */
        const int dot = DOT && bf16;
        if (dot) memset(q16 + nt * G * D, 0, sizeof(uint16_t) * (R - nt * G) * D);
        else memset(qf + nt * G * D, 0, sizeof(float) * (R - nt * G) * D); /* padding rows: whole tiles */
        for (int t = 0; t < nt; t++) /* the item's query rows, token-major */
            for (int e = 0; e < G * D; e++) {
                const size_t at = (size_t)((ch[0] + t0 + t) * q_stride + h * G * D + e);
                if (dot) q16[t * G * D + e] = ((const uint16_t *)q)[at];
                else qf[t * G * D + e] = scale * (bf16 ? from_bf16(((const uint16_t *)q)[at]) : ((const float *)q)[at]);
            }
        const float *kt = scratch + scratch_floats(chunks, c, Hkv, D) + 2 * h * padded * D;
        const float *vt = kt + padded * D;
        if (dot) /* a copy of the item's code per path: each compiles as if the other were not there */
            attend_item(qf, R, nt, G, D, kt, vt, valid + ch[1] * vcap, ch[2] + t0, of, 1, scale);
        else
            attend_item(qf, R, nt, G, D, kt, vt, valid + ch[1] * vcap, ch[2] + t0, of, 0, scale);
        for (int t = 0; t < nt; t++)
            for (int e = 0; e < G * D; e++) {
                const size_t at = (size_t)((ch[0] + t0 + t) * H + h * G) * D + e;
                if (bf16) ((uint16_t *)out)[at] = to_bf16(of[t * G * D + e]);
                else ((float *)out)[at] = of[t * G * D + e];
            }
    }
}

int chunk_attention(const void *q, int64_t q_stride, const void *K, const void *V, const uint8_t *valid,
                    int64_t vcap, const int64_t *chunks, int C, void *out, int Hkv, int G, int D, int64_t cap,
                    float scale, int bf16, float *scratch, int64_t scratch_cap, int threads) {
    if (G > MAX_G || D > MAX_D || D % LANES) return 1;
    for (int c = 0; c < C; c++) {
        if (chunks[4 * c + 2] + chunks[4 * c + 3] > (cap < vcap ? cap : vcap)) return 2;
        if (scratch_floats(chunks + 4 * c, 1, Hkv, D) > scratch_cap) return 3;
    }
    for (int c0 = 0, c1; c0 < C; c0 = c1) { /* chunks in groups whose packed keys fit the scratch */
        for (c1 = c0 + 1; c1 < C && scratch_floats(chunks + 4 * c0, c1 + 1 - c0, Hkv, D) <= scratch_cap;) c1++;
        attend_group(q, q_stride, K, V, valid, vcap, chunks + 4 * c0, c1 - c0, out, Hkv, G, D, cap, scale, bf16,
                     scratch, threads);
    }
    return 0;
}

/* Floats per vector register on this CPU: head sizes must be multiples of it. */
int vector_floats(void) { return LANES; }

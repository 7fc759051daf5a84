/* panel_gemm.c for bfloat16 models on CPUs with bfloat16 dot products (AVX512-BF16):
 * y [M, N] = x [M, K] @ w [N, K]^T with x and w bfloat16, float32 sums, y float32 or rounded to
 * bfloat16 (round to nearest even, as torch rounds).
 *
 * vdpbf16ps multiplies two pairs of bfloat16 exactly and adds both products to a float32 lane, so
 * the weights are packed by pairs of k: wp [ceil(N / NR), K / 2, NR, 2], one panel of NR output
 * features a contiguous stream, one 64-byte line 16 features' pair. A tile of MR rows x NR
 * features keeps its sums in NV x MR registers and per pair of k reads NV lines and MR input
 * pairs (each broadcast to all lanes): 8 rows x 3 lines (on an EPYC, 1.63 times oneDNN's rate at
 * 8 rows and 1.03 at 1,024, where 8 x 2 ran at 1.42 and 0.96; the same at 32 and 128 rows). As in panel_gemm.c, the tiles of a panel share out
 * prefetching the next panel, so few rows (decode) read the weights at the memory's speed, and
 * many rows (prefill) read each panel once for all of them. A row's result does not depend on
 * the other rows or the thread count. K even; x and y contiguous.
 *
 * swiglu != 0: gate and up packed as one weight whose panels hold NR / 2 gate features and the
 * same NR / 2 up features, and y [M, N / 2] bfloat16 SiLU(gate) * up, rounded where the torch path
 * rounds (gate and up, SiLU, the product), computed from the tile's sums (panel_gemm.c says why).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX512BF16__)
#error "panel_gemm_bf16.c needs AVX512-BF16 (vdpbf16ps)"
#endif

#define NV 3 /* vectors of 16 float32 sums per tile row */
#define NR (16 * NV)
#define MR 8 /* 24 accumulators, 3 weight lines, 1 broadcast: 28 of AVX-512's 32 registers */

static inline uint16_t to_bf16(float f) { /* torch's rounding: nearest even, NaN to a quiet NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* SiLU(g) as panel_gemm.c computes it: sigmoid from e = e^-|g| <= 1 (2 float32 ulps). */
static inline float silu(float g) {
    float x = g < 0.f ? g : -g;
    x = x > -87.f ? x : -87.f;
    const float n = floorf(x * 1.44269504f + 0.5f), r = x - n * 0.693147181f;
    float p = 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n, e;
    memcpy(&two_n, &bits, 4);
    e = p * two_n;
    return g * (g < 0.f ? e : 1.f) / (1.f + e);
}

static inline __attribute__((always_inline)) void tile(const uint16_t *x, const uint16_t *w, void *y,
                                                       int64_t N, int64_t K, int64_t n0, const int mr,
                                                       int out_bf16, const uint16_t *next, int64_t t,
                                                       int64_t T, int swiglu) {
    __m512 a[MR][NV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) a[m][v] = _mm512_setzero_ps();
    int64_t c = t;
    for (int64_t p = 0; p < K / 2; p++) {
        __m512bh wv[NV]; /* 16 features x 2 k each */
        for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(w + (p * NV + v) * 32);
        if (next && c == 0)
            for (int v = 0; v < NV; v++) __builtin_prefetch(next + (p * NV + v) * 32, 0, 1);
        c = c ? c - 1 : T - 1;
        for (int m = 0; m < mr; m++) {
            int32_t pair;
            memcpy(&pair, x + m * K + 2 * p, 4);
            __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < NV; v++) a[m][v] = _mm512_dpbf16_ps(a[m][v], xs, wv[v]);
        }
    }
    int64_t n = N - n0 < NR ? N - n0 : NR; /* the last panel may be partly padding */
    for (int m = 0; m < mr; m++) {
        float s[NR];
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(s + 16 * v, a[m][v]);
        if (swiglu) { /* lanes [0, NR / 2) gate, [NR / 2, NR) up: up to NR / 2 outputs of a row of N / 2 */
            uint16_t *ym = (uint16_t *)y + m * (N / 2) + n0 / 2;
            const int64_t f = N / 2 - n0 / 2 < NR / 2 ? N / 2 - n0 / 2 : NR / 2; /* the last panel: padding */
            for (int64_t j = 0; j < f; j++)
                ym[j] = to_bf16(from_bf16(to_bf16(silu(from_bf16(to_bf16(s[j])))))
                                * from_bf16(to_bf16(s[NR / 2 + j])));
        } else if (out_bf16) {
            uint16_t *ym = (uint16_t *)y + m * N + n0;
            for (int64_t j = 0; j < n; j++) ym[j] = to_bf16(s[j]);
        } else {
            memcpy((float *)y + m * N + n0, s, n * 4);
        }
    }
}

void panel_gemm_bf16(const uint16_t *x, const uint16_t *wp, void *y, int64_t M, int64_t N, int64_t K,
                     int out_bf16, int swiglu, int threads) {
    int64_t P = (N + NR - 1) / NR, T = (M + MR - 1) / MR;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const uint16_t *w = wp + p * K * NR, *next = p + 1 < P ? w + K * NR : 0;
        for (int64_t r = 0; r < M; r += MR) {
            const uint16_t *xr = x + r * K;
            const int64_t n = swiglu ? N / 2 : N; /* swiglu: bfloat16 out */
            void *yr = out_bf16 || swiglu ? (void *)((uint16_t *)y + r * n) : (void *)((float *)y + r * n);
            switch (M - r < MR ? M - r : MR) { /* constant row counts: the row loop unrolls */
            case 8: tile(xr, w, yr, N, K, p * NR, 8, out_bf16, next, r / MR, T, swiglu); break;
            case 7: tile(xr, w, yr, N, K, p * NR, 7, out_bf16, next, r / MR, T, swiglu); break;
            case 6: tile(xr, w, yr, N, K, p * NR, 6, out_bf16, next, r / MR, T, swiglu); break;
            case 5: tile(xr, w, yr, N, K, p * NR, 5, out_bf16, next, r / MR, T, swiglu); break;
            case 4: tile(xr, w, yr, N, K, p * NR, 4, out_bf16, next, r / MR, T, swiglu); break;
            case 3: tile(xr, w, yr, N, K, p * NR, 3, out_bf16, next, r / MR, T, swiglu); break;
            case 2: tile(xr, w, yr, N, K, p * NR, 2, out_bf16, next, r / MR, T, swiglu); break;
            default: tile(xr, w, yr, N, K, p * NR, 1, out_bf16, next, r / MR, T, swiglu);
            }
        }
    }
}

/* Output features per panel: the packing in Python must use the same. */
int panel_width_bf16(void) { return NR; }

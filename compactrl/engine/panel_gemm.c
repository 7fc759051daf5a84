/* A linear layer on packed weights: y [M, N] = x [M, K] @ w [N, K]^T, float32, for any M (the
 * engine's float32 products of 2+ rows: decode batches and prefill chunks).
 *
 * The weights are packed once into panels of NR output features, wp [ceil(N / NR), K, NR], so
 * that one panel is one contiguous run of memory and the whole matrix one sequential stream. A
 * tile of MR rows x NR features (NR = NV vectors) keeps its sums in NV x MR vector registers and
 * reads one panel line and MR inputs per k: NV x MR FMAs for NV + MR loads, which keeps the FMA
 * units busy: 6 rows x 2 vectors on AVX2 (the tile shape BLIS uses there), 8 x 3 on AVX-512 (6 x 2
 * there ran products of 8 to 128 rows at 0.90-0.97 of oneDNN's rate on an EPYC; 8 x 3 at 1.05 to
 * 1.35). Few rows (decode) are bound by reading the weights: the tiles of a panel share out
 * prefetching the next panel (tile t asks for its lines k with k % T == t), so the reads of panel
 * p + 1 run under the arithmetic on panel p, where oneDNN's
 * kernel does one after the other. Many rows (prefill) are bound by the arithmetic: each panel is
 * read once for all of them, the inputs stay in L2. Each output sums its terms in blocks of KB in
 * k order, then the blocks' sums (one float32 chain over all K is several times further from the
 * exact product than torch's GEMM, enough to move a 30-layer model's log-probs past 5e-5), so a
 * row's result does not depend on the thread count or on the other rows of the batch. x and y
 * contiguous; panels shared out with OpenMP when threads > 1.
 *
 * swiglu != 0: an MLP's gate and up projections packed as one weight whose panels hold NR / 2 gate
 * features and the same NR / 2 up features (Python interleaves them), and y [M, N / 2] their
 * SiLU(gate) * up, computed from the tile's sums before they leave the registers' reach: the
 * [M, N] product is never written, nor read again by a separate activation pass.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define NV 3 /* 24 accumulators, 3 weight vectors and an input: 28 of AVX-512's 32 registers */
#define MR 8
#elif defined(__AVX__)
#define LANES 8
#define NV 2 /* 12 accumulators and 2 weight vectors: 14 of AVX2's 16 registers */
#define MR 6
#else
#define LANES 4
#define NV 2
#define MR 6
#endif
#define NR (NV * LANES)
#define KB 64 /* terms per block sum: float32 sums of K terms in one chain lose ~sqrt(K / KB) more */

typedef float vf __attribute__((vector_size(LANES * 4)));

/* SiLU(g) = g * sigmoid(g), sigmoid from e = e^-|g| <= 1 (1 / (1 + e), or e / (1 + e) for g < 0):
 * e^x for x <= 0 as 2^n e^r, n = round(x / ln 2), e^r by its Taylor series to r^7 (2 float32 ulps;
 * the compiler vectorises this, where libm's expf is a call per value). */
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

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y, int64_t N,
                                                       int64_t K, int64_t n0, const int mr, const float *next,
                                                       int64_t t, int64_t T, int swiglu) {
    vf a[MR][NV];
    float sums[MR][NR] = {{0}}; /* the blocks' sums: each output is a sum of KB-term sums */
    int64_t c = t; /* c == 0 exactly when k % T == t, without a division per k */
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        for (int m = 0; m < MR; m++)
            for (int v = 0; v < NV; v++) a[m][v] = (vf){0};
        for (int64_t k = k0; k < (k0 + KB < K ? k0 + KB : K); k++) {
            vf wv[NV];
            for (int v = 0; v < NV; v++) {
                wv[v] = load(w + k * NR + v * LANES);
#if defined(__AVX512F__)
                __asm__("" : "+v"(wv[v])); /* in registers: GCC would reload them for every row */
#elif defined(__x86_64__)
                __asm__("" : "+x"(wv[v]));
#endif
            }
            if (next && c == 0) /* each 64-byte line of the next panel's line k */
                for (int l = 0; l < NR; l += 16) __builtin_prefetch(next + k * NR + l, 0, 1);
            c = c ? c - 1 : T - 1;
            for (int m = 0; m < mr; m++) {
                vf xs = (vf){0} + x[m * K + k];
                for (int v = 0; v < NV; v++) a[m][v] += xs * wv[v];
            }
        }
        for (int m = 0; m < mr; m++)
            for (int v = 0; v < NV; v++) {
                vf s = load(sums[m] + v * LANES) + a[m][v];
                memcpy(sums[m] + v * LANES, &s, sizeof s);
            }
    }
    if (swiglu) { /* lanes [0, NR / 2) gate, [NR / 2, NR) up: up to NR / 2 outputs of a row of N / 2 */
        int64_t n = N / 2 - n0 / 2 < NR / 2 ? N / 2 - n0 / 2 : NR / 2; /* the last panel: padding */
        for (int m = 0; m < mr; m++)
            for (int64_t l = 0; l < n; l++)
                y[m * (N / 2) + n0 / 2 + l] = silu(sums[m][l]) * sums[m][NR / 2 + l];
        return;
    }
    int64_t n = N - n0 < NR ? N - n0 : NR; /* the last panel may be partly padding */
    for (int m = 0; m < mr; m++) memcpy(y + m * N + n0, sums[m], n * 4);
}

void panel_gemm(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K, int swiglu,
                int threads) {
    int64_t P = (N + NR - 1) / NR, T = (M + MR - 1) / MR;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        const float *w = wp + p * K * NR, *next = p + 1 < P ? w + K * NR : 0;
        for (int64_t r = 0; r < M; r += MR) {
            const float *xr = x + r * K;
            float *yr = y + r * (swiglu ? N / 2 : N);
            switch (M - r < MR ? M - r : MR) { /* constant row counts: the row loop unrolls */
#if MR > 6
            case 8: tile(xr, w, yr, N, K, p * NR, 8, next, r / MR, T, swiglu); break;
            case 7: tile(xr, w, yr, N, K, p * NR, 7, next, r / MR, T, swiglu); break;
#endif
            case 6: tile(xr, w, yr, N, K, p * NR, 6, next, r / MR, T, swiglu); break;
            case 5: tile(xr, w, yr, N, K, p * NR, 5, next, r / MR, T, swiglu); break;
            case 4: tile(xr, w, yr, N, K, p * NR, 4, next, r / MR, T, swiglu); break;
            case 3: tile(xr, w, yr, N, K, p * NR, 3, next, r / MR, T, swiglu); break;
            case 2: tile(xr, w, yr, N, K, p * NR, 2, next, r / MR, T, swiglu); break;
            default: tile(xr, w, yr, N, K, p * NR, 1, next, r / MR, T, swiglu);
            }
        }
    }
}

/* Output features per panel on this CPU (swiglu: LANES gate, then LANES up): the packing in
 * Python must use the same. */
int panel_width(void) { return NR; }

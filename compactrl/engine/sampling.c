/* One token per row from float32 logits: temperature, a draw by inverse CDF, and the float64
 * log-probs of the token, in two or three passes over the row and no [B, V] temporaries.
 *
 * The same arithmetic as the Sampler's torch path (log_softmax in float64, exp, cumsum, search),
 * which at batch 32 over a 49,152-token vocabulary spent a tenth of a decode step making and
 * walking float64 copies of the logits. Per row b, with m the row's maximum and s = 1 / temp[b]:
 *   lse_s = m s + log sum_j exp((x_j - m) s)           (float64 sums, float64 exp)
 *   token = forced[b] if >= 0, argmax if greedy[b], else the first j whose running sum of
 *           exp((x_j - m) s) exceeds u[b] times the total (searchsorted(cdf, u * cdf[-1], right))
 *   lp[b] = x_token s - lse_s,  model_lp[b] = x_token - lse_1
 * Rows are shared out with OpenMP when threads > 1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x for x <= 0 to float64 precision in arithmetic the compiler vectorises: e^x = 2^n e^r,
 * n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), e^r by Taylor to r^13 (|r| <= 0.347:
 * truncation under 2e-16). Below -708 (e^x < 3e-308, and -inf: a masked token) it returns 0. */
static inline double exp_f64(double x) {
    const double zero = x < -708.0 ? 0.0 : 1.0;
    x = x > -708.0 ? x : -708.0;
    const double n = floor(x * 1.4426950408889634 + 0.5);
    const double r = (x - n * 0.6931471803691238) - n * 1.9082149292705877e-10;
    double p = 1.0 / 6227020800.0;
    const double c[13] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                          1.0 / 40320.0,     1.0 / 5040.0,      1.0 / 720.0,      1.0 / 120.0,
                          1.0 / 24.0,        1.0 / 6.0,         0.5,              1.0,
                          1.0};
    for (int i = 0; i < 13; i++) p = p * r + c[i];
    /* 2^n from the bits of n + 1023 placed in a double's low mantissa by adding 2^52 (no
     * double-to-integer conversion, which AVX2 lacks in vector form) */
    const double biased = n + (1023.0 + 4503599627370496.0);
    uint64_t bits;
    memcpy(&bits, &biased, 8);
    bits <<= 52;
    double two_n;
    memcpy(&two_n, &bits, 8);
    return p * two_n * zero;
}

#define BLOCK 64

/* sum_j exp((x_j - m) s) over the row, and each block of BLOCK entries' sum into bs (if given) */
static double block_sums(const float *x, int64_t V, double m, double s, double *bs) {
    double total = 0.0;
    for (int64_t i = 0; i * BLOCK < V; i++) {
        const int64_t end = (i + 1) * BLOCK < V ? (i + 1) * BLOCK : V;
        double acc = 0.0;
        for (int64_t j = i * BLOCK; j < end; j++) acc += exp_f64(((double)x[j] - m) * s);
        if (bs) bs[i] = acc;
        total += acc;
    }
    return total;
}

void sample_rows(const float *logits, int64_t stride, int B, int64_t V, const double *temp,
                 const uint8_t *greedy, const double *u, const int64_t *forced, int64_t *token, double *lp,
                 double *model_lp, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int b = 0; b < B; b++) {
        const float *x = logits + (int64_t)b * stride;
        float mf = x[0];
        for (int64_t j = 1; j < V; j++) mf = x[j] > mf ? x[j] : mf;
        int64_t best = 0;
        while (best < V - 1 && x[best] != mf) best++; /* the first maximum, as argmax (NaN: bounded) */
        const double m = mf, s = greedy[b] ? 1.0 : 1.0 / temp[b];
        double bs[(V + BLOCK - 1) / BLOCK];
        const double total = block_sums(x, V, m, s, bs);
        const double total1 = s == 1.0 ? total : block_sums(x, V, m, 1.0, 0);
        int64_t t = forced[b];
        if (t < 0 && greedy[b]) t = best;
        if (t < 0) {
            /* the first j whose running sum exceeds u * total: the block first, then within it */
            const double target = u[b] * total;
            double run = 0.0;
            int64_t i = 0, blocks = (V + BLOCK - 1) / BLOCK;
            for (; i < blocks - 1 && run + bs[i] <= target; i++) run += bs[i];
            /* the block's own sum is in vector lanes, the walk in order: should rounding leave the
             * walk short of the target, the block's last token with any mass is taken */
            t = best;
            const int64_t end = (i + 1) * BLOCK < V ? (i + 1) * BLOCK : V;
            for (int64_t j = i * BLOCK; j < end; j++) {
                const double e = exp_f64(((double)x[j] - m) * s);
                if (e > 0.0) t = j;
                run += e;
                if (run > target) break;
            }
        }
        token[b] = t;
        lp[b] = ((double)x[t] - m) * s - log(total);
        model_lp[b] = ((double)x[t] - m) - log(total1);
    }
}

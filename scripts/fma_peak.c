/* The core's float32 FMA rate with no memory traffic: 12 independent chains of vector FMAs (enough
 * to cover two FMA units' latency), the most a GEMM kernel's arithmetic can reach on one core.
 * Built by compactrl.engine.kernels.compile_c with the engine's kernels' flags (-march=native). */
#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));

#if defined(__x86_64__)
#define KEEP(v) __asm__("" : "+x"(v)) /* each chain stays a chain, in its own register */
#else
#define KEEP(v)
#endif
#define STEP(v) \
    v = v * m + c; \
    KEEP(v)

/* n steps of 12 FMAs on LANES floats each: 24 * LANES * n float operations */
float fma_chains(int64_t n) {
    vf m = (vf){0} + 0.999999f, c = (vf){0} + 1e-6f, a0 = c, a1 = c + c, a2 = a1 + c, a3 = a2 + c, a4 = a3 + c,
       a5 = a4 + c, a6 = a5 + c, a7 = a6 + c, a8 = a7 + c, a9 = a8 + c, a10 = a9 + c, a11 = a10 + c;
    for (int64_t k = 0; k < n; k++) {
        STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);
        STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);
    }
    vf s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
    return s[0];
}

int fma_flops_per_step(void) { return 24 * LANES; }

/* The same for bfloat16 dot products (AVX512-BF16's vdpbf16ps: 2 multiply-adds a float32 lane):
 * n steps of 12 on 16 lanes, 12 * 64 * n operations; n = 0 returned where the CPU has none. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define DOT(v)                          \
    v = _mm512_dpbf16_ps(v, x, y); \
    __asm__("" : "+v"(v))
float dpbf16_chains(int64_t n) {
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33803380);
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0, b6 = b0, b7 = b0, b8 = b0,
           b9 = b0, b10 = b0, b11 = b0;
    for (int64_t k = 0; k < n; k++) {
        DOT(b0); DOT(b1); DOT(b2); DOT(b3); DOT(b4); DOT(b5);
        DOT(b6); DOT(b7); DOT(b8); DOT(b9); DOT(b10); DOT(b11);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(b0, b1), _mm512_add_ps(b2, b3)),
                             _mm512_add_ps(_mm512_add_ps(b4, b5), _mm512_add_ps(b6, b7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(b8, b9), _mm512_add_ps(b10, b11)));
    return _mm512_reduce_add_ps(s);
}
int dot_flops_per_step(void) { return 12 * 64; }
#else
float dpbf16_chains(int64_t n) { return 0.f * (float)n; }
int dot_flops_per_step(void) { return 0; }
#endif

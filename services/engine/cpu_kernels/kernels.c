/* CPU kernels of pdserve's quantized linears, built on first use with the host's compiler
 * (-O3 -march=native) and called through ctypes (services/engine/cpu_kernels/library.py).
 *
 * Weights stay in GGUF-style groups of 32 along K (the input dim), one output row each:
 *   q4: 16 bytes of nibbles per group (low nibble = element j, high nibble = element j + 16,
 *       as GGUF Q4_0 / Q4_1 store them), value = d * q + m, q in [0, 15]  (exact for Q4_0,
 *       Q4_1 and Q4_K, whose per-32 scales and mins are products of their fields);
 *   q8: 32 signed bytes per group, value = d * q  (exact for Q8_0).
 * Activations stay fp32: the weights are widened to fp32 in registers and multiplied exactly,
 * so results equal an fp32 product over the dequantized weights up to summation order.
 * (int8-rounded activations, as llama.cpp's dot products use, were measured 13% faster here
 * and visibly worse on SmolLM2-135M; see BENCHMARKS.md.) Every function takes row-major,
 * contiguous buffers; K is a multiple of 32; M <= MAX_ROWS.
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define QK 32
#define MAX_ROWS 8 /* rows of x per pass over the weights (callers split larger batches) */

int pdserve_kernels_abi(void) { return 2; }

int pdserve_kernels_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 2;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* sum over 32 of w[j] * x[j], two independent chains for latency */
static inline __m256 dot32(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float *x) {
    __m256 s0 = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
    __m256 s1 = _mm256_mul_ps(w1, _mm256_loadu_ps(x + 8));
    s0 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), s0);
    s1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), s1);
    return _mm256_add_ps(s0, s1);
}
#endif

/* y[m, n] = sum over groups g of d[n,g] <q4[n,g], x[m,g]> + mn[n,g] * sum(x[m,g]) */
void pdserve_q4_gemm(const float *restrict x, int M, int K, const uint8_t *restrict qs,
                     const float *restrict d, const float *restrict mn, int N,
                     float *restrict y) {
    const int G = K / QK;
    float xsum[MAX_ROWS * 512]; /* per-group sums of x: K <= 16384 */
    for (int m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int j = 0; j < QK; j++) s += x[(int64_t)m * K + g * QK + j];
            xsum[m * G + g] = s;
        }
    for (int n = 0; n < N; n++) {
        const uint8_t *q = qs + (int64_t)n * (K / 2);
        const float *dn = d + (int64_t)n * G, *mnn = mn + (int64_t)n * G;
        float am[MAX_ROWS];
#if defined(__AVX2__) && defined(__FMA__)
        const __m128i mask = _mm_set1_epi8(15);
        __m256 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) { acc[m] = _mm256_setzero_ps(); am[m] = 0.f; }
        for (int g = 0; g < G; g++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(q + g * 16));
            const __m128i lo = _mm_and_si128(raw, mask);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            const __m256 dg = _mm256_set1_ps(dn[g]);
            for (int m = 0; m < M; m++) {
                acc[m] = _mm256_fmadd_ps(dg, dot32(w0, w1, w2, w3, x + (int64_t)m * K + g * QK), acc[m]);
                am[m] += mnn[g] * xsum[m * G + g];
            }
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = hsum(acc[m]) + am[m];
#else
        float acc[MAX_ROWS];
        for (int m = 0; m < M; m++) { acc[m] = 0.f; am[m] = 0.f; }
        for (int g = 0; g < G; g++) {
            const uint8_t *qg = q + g * 16;
            for (int m = 0; m < M; m++) {
                const float *xg = x + (int64_t)m * K + g * QK;
                float s = 0.f;
                for (int j = 0; j < 16; j++) s += (float)(qg[j] & 15) * xg[j] + (float)(qg[j] >> 4) * xg[j + 16];
                acc[m] += dn[g] * s;
                am[m] += mnn[g] * xsum[m * G + g];
            }
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = acc[m] + am[m];
#endif
    }
}

/* y[m, n] = sum over groups g of d[n,g] <q8[n,g], x[m,g]> */
void pdserve_q8_gemm(const float *restrict x, int M, int K, const int8_t *restrict qs,
                     const float *restrict d, int N, float *restrict y) {
    const int G = K / QK;
    for (int n = 0; n < N; n++) {
        const int8_t *q = qs + (int64_t)n * K;
        const float *dn = d + (int64_t)n * G;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const int8_t *qg = q + g * QK;
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qg)));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + 8))));
            const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + 16))));
            const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qg + 24))));
            const __m256 dg = _mm256_set1_ps(dn[g]);
            for (int m = 0; m < M; m++)
                acc[m] = _mm256_fmadd_ps(dg, dot32(w0, w1, w2, w3, x + (int64_t)m * K + g * QK), acc[m]);
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = hsum(acc[m]);
#else
        float acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = 0.f;
        for (int g = 0; g < G; g++) {
            const int8_t *qg = q + g * QK;
            for (int m = 0; m < M; m++) {
                const float *xg = x + (int64_t)m * K + g * QK;
                float s = 0.f;
                for (int j = 0; j < QK; j++) s += (float)qg[j] * xg[j];
                acc[m] += dn[g] * s;
            }
        }
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n] = acc[m];
#endif
    }
}

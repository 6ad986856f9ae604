/* CPU kernels of pdserve's quantized linears, built on first use with the host's compiler
 * (-O3 -march=native) and called through ctypes (services/engine/cpu_kernels/library.py).
 *
 * Weights come in GGUF-style groups of 32 along K (the input dim):
 *   q4: value = d * q + m, q in [0, 15]  (exact for Q4_0, Q4_1 and Q4_K, whose per-32 scales
 *       and mins are products of their fields);
 *   q8: value = d * q, q in [-128, 127]  (exact for Q8_0).
 * The kernels read them in a blocked layout made once at load (services/engine/quant.py,
 * ``blocked``): for each block of 16 output rows and each group g, the 16 x 32 values
 * interleaved so that one 32-byte load widened to 16-bit lanes holds, for each of the 16
 * outputs, the pair of weights (2p, 2p + 1) of the group:
 *   q4: 256 bytes per (block, group); byte c * 32 + n * 2 + e holds w[n][2c + e] in its low
 *       nibble and w[n][16 + 2c + e] in its high nibble (c < 8, n < 16, e < 2);
 *   q8: 512 bytes per (block, group); byte p * 32 + n * 2 + e holds w[n][2p + e] (p < 16);
 *   d and m: 16 floats per (block, group), one per output row.
 * Rows past N in the last block are zero. Each activation row is first rounded to int16 in
 * groups of 32 (scale = max|x| / 32767: the rounding error is at most 2^-16 of the group's
 * largest value), and each (group, 16 outputs) dot product runs in integers (vpdpwssd with
 * AVX512-VNNI, vpmaddwd with AVX2: 16-bit pairs into exact 32-bit sums; a whole group's sum is
 * exact), converted and scaled once per group: acc = fma(sum, d * sx, acc), then for q4
 * acc = fma(m, sum(x_g), acc). That is far inside the weights' own 4/8-bit error (quality:
 * BENCHMARKS.md); int8-rounded activations, as llama.cpp's dot products use, were measured
 * visibly worse on SmolLM2-135M. Weights are unpacked once per (block, group) and used by
 * every row of x, so a batch of rows costs little more than one row's pass over the weights.
 * Every (row, output) pair takes the same operations in the same order whatever M and
 * whatever the SIMD path (the portable one included: fmaf), so a row's result does not depend
 * on the batch around it: a request decoded alone, in a batch, or as one of the rows of a
 * speculative verification step gets bit-identical logits. Every function takes row-major,
 * contiguous buffers; K is a multiple of 32; M <= MAX_ROWS.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PD_VNNI512 1
#endif

#define QK 32
#define MAX_ROWS 32 /* rows of x per pass over the weights (callers split larger batches) */
#define MAX_GROUPS 512 /* K <= 16384 */

int pdserve_kernels_abi(void) { return 15; }

/* KV cache row formats (services/engine/kv_quant.py: FORMAT_CODES): a (position, kv head) row
 * of D values is D fp32, D bf16 (the top halves of fp32s, rounded to nearest even), or D int8
 * followed by D / 32 fp32 scales */
#define KV_F32 0
#define KV_Q8 1
#define KV_BF16 2

static inline int64_t kv_row_bytes(int fmt, int D) {
    return fmt == KV_Q8 ? D + D / 8 : (fmt == KV_BF16 ? 2 * (int64_t)D : 4 * (int64_t)D);
}

/* bf16 <-> fp32 (bf16 is the top half of an fp32; round to nearest even, NaN kept NaN) */
static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* value i of a cache row, in fp32 */
static inline float kv_value(const uint8_t *row, int i, int D, int fmt) {
    if (fmt == KV_Q8) return (float)((const int8_t *)row)[i] * ((const float *)(row + D))[i / 32];
    if (fmt == KV_BF16) return bf16_to_f32(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}


int pdserve_kernels_simd(void) {
#if defined(PD_VNNI512)
    return 3;
#elif defined(__AVX2__) && defined(__FMA__)
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
#endif

/* x [K] -> xq [K] int16 and sx [K / 32]: x ~= xq * sx per group of 32 (round half even);
 * xsum [K / 32]: each group's sum of x (q4's min term), added in one fixed tree on every path
 * (x[i] + x[i + 16], then halves: + 8, + 4, + 2, + 1), so every build rounds it alike */
static void quantize_i16(const float *restrict x, int K, int16_t *restrict xq, float *restrict sx,
                         float *restrict xsum) {
    for (int g = 0; g < K / QK; g++) {
        const float *xg = x + g * QK;
#if defined(__AVX512F__)
        const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 t = _mm512_add_ps(a, b);
        const __m256 u = _mm256_add_ps(_mm512_castps512_ps256(t), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 a0 = _mm256_loadu_ps(xg), a1 = _mm256_loadu_ps(xg + 8);
        const __m256 b0 = _mm256_loadu_ps(xg + 16), b1 = _mm256_loadu_ps(xg + 24);
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 m8 = _mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1));
        m8 = _mm256_max_ps(m8, _mm256_max_ps(_mm256_andnot_ps(sign, b0), _mm256_andnot_ps(sign, b1)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 u = _mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        xsum[g] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
#else
        float amax = 0.f, t[16];
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xg[j]));
        for (int j = 0; j < 16; j++) t[j] = xg[j] + xg[j + 16];
        for (int h = 8; h >= 1; h /= 2)
            for (int j = 0; j < h; j++) t[j] += t[j + h];
        xsum[g] = t[0];
#endif
        const float sc = amax / 32767.f;
        const float div = sc > 0.f ? sc : 1.f;
        sx[g] = sc;
#if defined(__AVX512F__)
        const __m512 d16 = _mm512_set1_ps(div);
        _mm256_storeu_si256((__m256i *)(xq + g * QK), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(a, d16))));
        _mm256_storeu_si256((__m256i *)(xq + g * QK + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(b, d16))));
#else
        for (int j = 0; j < QK; j++) xq[g * QK + j] = (int16_t)nearbyintf(xg[j] / div);
#endif
    }
}

/* The 16 weight pairs of one (block, group) as 16-bit lanes: w[p] lane 2n + e = w[n][2p + e] */
#if defined(PD_VNNI512)
typedef __m512i pd_wvec;
typedef __m512 pd_fvec;
#define PD_LANES 16
static inline __attribute__((always_inline)) void unpack_q4(const uint8_t *q, pd_wvec *w) {
    const __m512i lo4 = _mm512_set1_epi16(15);
    for (int c = 0; c < 8; c++) {
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + c * 32)));
        w[c] = _mm512_and_si512(b, lo4);
        w[8 + c] = _mm512_srli_epi16(b, 4);
    }
}
static inline __attribute__((always_inline)) void unpack_q8(const uint8_t *q, pd_wvec *w) {
    for (int p = 0; p < 16; p++)
        w[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + p * 32)));
}
/* the exact integer dot product of the group's 32 weights with row xp's 16 int16 pairs, for
 * each of the 16 outputs (four chains: the sum is exact, so their order does not matter) */
static inline __attribute__((always_inline)) __m512 group_dot(const pd_wvec *w, const int32_t *xp) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int p = 0; p < 16; p += 4) {
        a0 = _mm512_dpwssd_epi32(a0, w[p], _mm512_set1_epi32(xp[p]));
        a1 = _mm512_dpwssd_epi32(a1, w[p + 1], _mm512_set1_epi32(xp[p + 1]));
        a2 = _mm512_dpwssd_epi32(a2, w[p + 2], _mm512_set1_epi32(xp[p + 2]));
        a3 = _mm512_dpwssd_epi32(a3, w[p + 3], _mm512_set1_epi32(xp[p + 3]));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}
#define PD_LOADF(p) _mm512_loadu_ps(p)
#define PD_SET1F(v) _mm512_set1_ps(v)
#define PD_ZEROF() _mm512_setzero_ps()
#define PD_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define PD_MULF(a, b) _mm512_mul_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: a block of 16 outputs runs as two halves of 8 (h: the half's byte offset, 0 or 16) */
typedef __m256i pd_wvec;
typedef __m256 pd_fvec;
#define PD_LANES 8
static inline __attribute__((always_inline)) void unpack_q4_half(const uint8_t *q, pd_wvec *w) {
    const __m256i lo4 = _mm256_set1_epi16(15);
    for (int c = 0; c < 8; c++) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + c * 32)));
        w[c] = _mm256_and_si256(b, lo4);
        w[8 + c] = _mm256_srli_epi16(b, 4);
    }
}
static inline __attribute__((always_inline)) void unpack_q8_half(const uint8_t *q, pd_wvec *w) {
    for (int p = 0; p < 16; p++)
        w[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + p * 32)));
}
static inline __attribute__((always_inline)) __m256 group_dot(const pd_wvec *w, const int32_t *xp) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (int p = 0; p < 16; p += 2) {
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w[p], _mm256_set1_epi32(xp[p])));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w[p + 1], _mm256_set1_epi32(xp[p + 1])));
    }
    return _mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1));
}
#define PD_LOADF(p) _mm256_loadu_ps(p)
#define PD_SET1F(v) _mm256_set1_ps(v)
#define PD_ZEROF() _mm256_setzero_ps()
#define PD_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define PD_MULF(a, b) _mm256_mul_ps(a, b)
#endif

/* y [M, N] = x @ W.T from the int16 rows (xq, sx, xsum); kind 4 or 8; see the header */
static inline __attribute__((always_inline)) void blocked_gemm(int kind, const int16_t *restrict xq, const float *restrict sx,
                         const float *restrict xsum, int M, int K, const uint8_t *restrict qb,
                         const float *restrict db, const float *restrict mb, int N,
                         float *restrict y) {
    const int G = K / QK, NB = (N + 15) / 16;
    const int64_t bytes = kind == 4 ? 256 : 512;
#if defined(PD_VNNI512) || (defined(__AVX2__) && defined(__FMA__))
    for (int nb = 0; nb < NB; nb++) {
        for (int h = 0; h < 16; h += PD_LANES) {
            pd_fvec acc[MAX_ROWS];
            for (int m = 0; m < M; m++) acc[m] = PD_ZEROF();
            for (int g = 0; g < G; g++) {
                const int64_t blk = (int64_t)nb * G + g;
                const uint8_t *q = qb + blk * bytes + (PD_LANES == 16 ? 0 : 2 * h);
                pd_wvec w[16];
#if defined(PD_VNNI512)
                if (kind == 4) unpack_q4(q, w); else unpack_q8(q, w);
#else
                if (kind == 4) unpack_q4_half(q, w); else unpack_q8_half(q, w);
#endif
                const pd_fvec dv = PD_LOADF(db + blk * 16 + h);
                const pd_fvec mv = kind == 4 ? PD_LOADF(mb + blk * 16 + h) : PD_ZEROF();
                for (int m = 0; m < M; m++) {
                    const int32_t *xp = (const int32_t *)(xq + (int64_t)m * K + g * QK);
                    const pd_fvec s = group_dot(w, xp);
                    acc[m] = PD_FMA(s, PD_MULF(dv, PD_SET1F(sx[m * G + g])), acc[m]);
                    if (kind == 4) acc[m] = PD_FMA(mv, PD_SET1F(xsum[m * G + g]), acc[m]);
                }
            }
            const int n0 = nb * 16 + h, valid = N - n0 < PD_LANES ? N - n0 : PD_LANES;
            for (int m = 0; m < M; m++) {
                float out[PD_LANES];
                memcpy(out, &acc[m], sizeof(out));
                if (valid > 0) memcpy(y + (int64_t)m * N + n0, out, (size_t)valid * sizeof(float));
            }
        }
    }
#else
    /* portable: the SIMD paths' arithmetic lane by lane (fmaf: one rounding, as their fma) */
    for (int nb = 0; nb < NB; nb++)
        for (int n = 0; n < 16 && nb * 16 + n < N; n++)
            for (int m = 0; m < M; m++) {
                float acc = 0.f;
                for (int g = 0; g < G; g++) {
                    const int64_t blk = (int64_t)nb * G + g;
                    const uint8_t *q = qb + blk * bytes;
                    const int16_t *xg = xq + (int64_t)m * K + g * QK;
                    int32_t s = 0;
                    for (int p = 0; p < 16; p++)
                        for (int e = 0; e < 2; e++) {
                            int wv;
                            if (kind == 4) {
                                const uint8_t b = q[(p & 7) * 32 + n * 2 + e];
                                wv = p < 8 ? (b & 15) : (b >> 4);
                            } else {
                                wv = (int8_t)q[p * 32 + n * 2 + e];
                            }
                            s += wv * xg[2 * p + e];
                        }
                    acc = fmaf((float)s, db[blk * 16 + n] * sx[m * G + g], acc);
                    if (kind == 4) acc = fmaf(mb[blk * 16 + n], xsum[m * G + g], acc);
                }
                y[(int64_t)m * N + nb * 16 + n] = acc;
            }
#endif
}

static inline __attribute__((always_inline)) void blocked_linear(int kind, const float *restrict x, int M, int K,
                           const uint8_t *restrict qb, const float *restrict db,
                           const float *restrict mb, int N, float *restrict y) {
    const int G = K / QK;
    int16_t stack[16384] __attribute__((aligned(64)));
    int16_t *xq = (int64_t)M * K <= 16384 ? stack : aligned_alloc(64, (((size_t)M * K * 2 + 63) / 64) * 64);
    float sx[MAX_ROWS * MAX_GROUPS], xsum[MAX_ROWS * MAX_GROUPS];
    for (int m = 0; m < M; m++)
        quantize_i16(x + (int64_t)m * K, K, xq + (int64_t)m * K, sx + m * G, xsum + m * G);
    blocked_gemm(kind, xq, sx, xsum, M, K, qb, db, mb, N, y);
    if (xq != stack) free(xq);
}

/* y[m, n] = sum over groups g of d[n,g] <q4[n,g], x[m,g]> + mn[n,g] * sum(x[m,g]) */
void pdserve_q4_gemm(const float *restrict x, int M, int K, const uint8_t *restrict qb,
                     const float *restrict db, const float *restrict mb, int N,
                     float *restrict y) {
    blocked_linear(4, x, M, K, qb, db, mb, N, y);
}

/* y[m, n] = sum over groups g of d[n,g] <q8[n,g], x[m,g]> */
void pdserve_q8_gemm(const float *restrict x, int M, int K, const int8_t *restrict qb,
                     const float *restrict db, int N, float *restrict y) {
    blocked_linear(8, x, M, K, (const uint8_t *)qb, db, NULL, N, y);
}

/* ---- the layer ops around the matmuls (fp32), for the "cpu" backend ---------------------
 * Same op order as the torch reference (services/engine/layer_ops.py); built with
 * -ffp-contract=off so a * b + c rounds twice, as torch's separate kernels do. */

/* bf16 values widened to fp32 (exact): the norm's input, bf16 cache rows, silu's input */
#if defined(__AVX2__)
static inline __m256 widen_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif
#if defined(__AVX512F__)
static inline __m512 widen_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 fp32 values rounded to bf16 as f32_to_bf16 does (nearest even; a NaN stays a NaN) */
static inline void store_bf16x16(uint16_t *p, __m512 y) {
    const __m512i yi = _mm512_castps_si512(y);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(yi, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(yi, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#endif

/* res_out = x + residual (x when residual is NULL); out = w * (r / sqrt(mean(r^2) + eps)).
 * x: fp32 rows, or bf16 (x_bf16: a packed bf16 GEMM's result, widened exactly); out: fp32,
 * or bf16 (out_bf16: rounded once, the input the next bf16 GEMM would round it to), so a
 * prompt's activations skip a conversion pass on each side of the norm. res_out is fp32.
 * The sum of squares runs in 8 lanes (lane l takes the values at l mod 8, in order), then the
 * tail, then the lanes 0..7: the same order on every build, so the same bits. */
void pdserve_add_rms_norm(const void *restrict xv, int x_bf16, const float *restrict residual,
                          const float *restrict w, int T, int N, float eps, void *restrict outv,
                          int out_bf16, float *restrict res_out) {
    for (int t = 0; t < T; t++) {
        const int64_t base = (int64_t)t * N;
        const float *xf = (const float *)xv + base;
        const uint16_t *xh = (const uint16_t *)xv + base;
        const float *rs = residual ? residual + base : NULL;
        float *rr = res_out + base;
        float acc[8] = {0};
        int i = 0;
#if defined(__AVX2__)
        __m256 a8 = _mm256_setzero_ps();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
        for (; i + 16 <= N; i += 16) {
            __m512 r = x_bf16 ? widen_bf16x16(xh + i) : _mm512_loadu_ps(xf + i);
            if (rs) r = _mm512_add_ps(r, _mm512_loadu_ps(rs + i));
            _mm512_storeu_ps(rr + i, r);
            const __m512 sq = _mm512_mul_ps(r, r);
            a8 = _mm256_add_ps(a8, _mm512_castps512_ps256(sq));
            a8 = _mm256_add_ps(a8, _mm512_extractf32x8_ps(sq, 1));
        }
#endif
        for (; i + 8 <= N; i += 8) {
            __m256 r = x_bf16 ? widen_bf16x8(xh + i) : _mm256_loadu_ps(xf + i);
            if (rs) r = _mm256_add_ps(r, _mm256_loadu_ps(rs + i));
            _mm256_storeu_ps(rr + i, r);
            a8 = _mm256_add_ps(a8, _mm256_mul_ps(r, r));
        }
        _mm256_storeu_ps(acc, a8);
#endif
        for (; i + 8 <= N; i += 8)
            for (int l = 0; l < 8; l++) {
                const float x = x_bf16 ? bf16_to_f32(xh[i + l]) : xf[i + l];
                const float r = rs ? x + rs[i + l] : x;
                rr[i + l] = r;
                acc[l] += r * r;
            }
        float ss = 0.f;
        for (; i < N; i++) {
            const float x = x_bf16 ? bf16_to_f32(xh[i]) : xf[i];
            const float r = rs ? x + rs[i] : x;
            rr[i] = r;
            ss += r * r;
        }
        for (int l = 0; l < 8; l++) ss += acc[l];
        const float inv = 1.f / sqrtf(ss / (float)N + eps);
        float *of = (float *)outv + base;
        uint16_t *oh = (uint16_t *)outv + base;
        i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 iv = _mm512_set1_ps(inv);
        for (; i + 16 <= N; i += 16) {
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(rr + i), iv));
            if (out_bf16) store_bf16x16(oh + i, y); else _mm512_storeu_ps(of + i, y);
        }
#endif
        for (; i < N; i++) {
            const float y = w[i] * (rr[i] * inv);
            if (out_bf16) oh[i] = f32_to_bf16(y); else of[i] = y;
        }
    }
}

/* rotate-half RoPE of one head vector in place: cos/sin rows of the token's position */
static inline void rope_head(float *restrict h, const float *restrict c, const float *restrict s, int D) {
    const int half = D / 2;
    float tmp[512];
    for (int i = 0; i < half; i++) {
        tmp[i] = h[i] * c[i] + (-h[i + half]) * s[i];
        tmp[i + half] = h[i + half] * c[i + half] + h[i] * s[i + half];
    }
    for (int i = 0; i < D; i++) h[i] = tmp[i];
}

/* One int8 KV row (services/engine/kv_quant.py): D int8 values, then D/32 fp32 scales, one
 * per 32 values, scale = max|x| / 127, q = round-half-even(x / scale). The same division and
 * rounding as kv_quant.quantize, so both write the same bytes. */
static inline void quantize_row(const float *restrict x, int D, uint8_t *restrict row) {
    int8_t *q = (int8_t *)row;
    float *sc = (float *)(row + D);
    for (int g = 0; g < D / 32; g++) {
        const float *xg = x + g * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xg[i]));
        const float scale = amax / 127.f;
        const float div = scale > 0.f ? scale : 1.f;
        for (int i = 0; i < 32; i++) {
            float r = nearbyintf(xg[i] / div);
            r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
            q[g * 32 + i] = (int8_t)r;
        }
        sc[g] = scale;
    }
}

/* RoPE on q and k in place, then each new token's k and v into the caches at slots[t]
 * (< 0: skipped), as rows of format fmt (int8: quantize_row; bf16: f32_to_bf16, the rounding
 * of torch's .to(torch.bfloat16), so the cpu and torch backends write the same bytes) */
static void rope_and_cache(float *restrict q, int64_t qs, float *restrict k, int64_t ks,
                           const float *restrict v, int64_t vs, int T, int H, int KVH, int D,
                           const int64_t *restrict positions, const float *restrict cos_t,
                           const float *restrict sin_t, uint8_t *restrict k_cache,
                           uint8_t *restrict v_cache, int64_t num_slots,
                           const int64_t *restrict slots, int fmt) {
    const int64_t R = kv_row_bytes(fmt, D);
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        for (int h = 0; h < H; h++) rope_head(q + t * qs + (int64_t)h * D, c, s, D);
        for (int h = 0; h < KVH; h++) {
            float *kh = k + t * ks + (int64_t)h * D;
            rope_head(kh, c, s, D);
            if (slots[t] < 0) continue;
            const float *vh = v + t * vs + (int64_t)h * D;
            uint8_t *kc = k_cache + ((int64_t)h * num_slots + slots[t]) * R;
            uint8_t *vc = v_cache + ((int64_t)h * num_slots + slots[t]) * R;
            if (fmt == KV_Q8) {
                quantize_row(kh, D, kc);
                quantize_row(vh, D, vc);
            } else if (fmt == KV_BF16) {
                for (int i = 0; i < D; i++) {
                    ((uint16_t *)kc)[i] = f32_to_bf16(kh[i]);
                    ((uint16_t *)vc)[i] = f32_to_bf16(vh[i]);
                }
            } else {
                for (int i = 0; i < D; i++) { ((float *)kc)[i] = kh[i]; ((float *)vc)[i] = vh[i]; }
            }
        }
    }
}

/* q [T, H, D] (row stride qs), k [T, KVH, D] (row stride ks), v (row stride vs): RoPE on q
 * and k in place, then k and v into the caches [KVH, slots, row] (rows of format fmt) at
 * slots[t] (< 0: skipped) */
void pdserve_rope_and_cache(float *restrict q, int64_t qs, float *restrict k, int64_t ks,
                            const float *restrict v, int64_t vs, int T, int H, int KVH, int D,
                            const int64_t *restrict positions, const float *restrict cos_t,
                            const float *restrict sin_t, uint8_t *restrict k_cache,
                            uint8_t *restrict v_cache, int64_t num_slots,
                            const int64_t *restrict slots, int fmt) {
    rope_and_cache(q, qs, k, ks, v, vs, T, H, KVH, D, positions, cos_t, sin_t, k_cache, v_cache,
                   num_slots, slots, fmt);
}


#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for x <= 88.3 (softmax after subtracting the max; silu): Cephes' expf polynomial,
 * relative error about 2e-7; x < -87.3 gives 0; callers clamp larger x */
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#if defined(__AVX512F__)
/* exp256's arithmetic, 16 lanes (the same operations, so the same results per lane) */
static inline __m512 exp512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(~under, p, _mm512_castsi512_ps(e));
}
#endif

/* 8 values of a cache row of format fmt starting at element c (a multiple of 8) */
static inline __m256 row8(const uint8_t *row, int c, int D, int fmt) {
    if (fmt == KV_F32) return _mm256_loadu_ps((const float *)row + c);
    if (fmt == KV_BF16) return widen_bf16x8((const uint16_t *)row + c);
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c))));
    return _mm256_mul_ps(v, _mm256_broadcast_ss((const float *)(row + D) + c / 32));
}
#endif

/* out [T, I] = silu(gate) * up of gate_up [T, 2I] (gate first), silu(g) = g / (1 + exp(-g)).
 * Vectorized with exp256 (relative error about 2e-7, as glibc's expf within rounding): the
 * scalar expf loop took 2.3 ms a layer for a 512-token prompt, a quarter of its TTFT. */
void pdserve_silu_and_mul(const float *restrict gu, int T, int I, float *restrict out) {
    for (int t = 0; t < T; t++) {
        const float *g = gu + (int64_t)t * 2 * I, *u = g + I;
        float *o = out + (int64_t)t * I;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv),
                                                  _mm512_set1_ps(88.3f)));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                                  _mm512_loadu_ps(u + i)));
        }
#endif
#if defined(__AVX2__) && defined(__FMA__)
        /* exp(-g) clamped at exp(88.3) (finite): g / (1 + huge) is the tiny negative it should be */
        const __m256 one = _mm256_set1_ps(1.f), top = _mm256_set1_ps(88.3f);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), top));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                                  _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* pdserve_silu_and_mul on bf16 rows (the bf16 packed GEMM's result on AMX hosts, into the
 * next bf16 GEMM): each value widened to fp32, the same arithmetic, rounded back once. */
void pdserve_silu_and_mul_bf16(const uint16_t *restrict gu, int T, int I, uint16_t *restrict out) {
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gu + (int64_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (int64_t)t * I;
        int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        for (; i + 16 <= I; i += 16) {
            const __m512 gv = widen_bf16x16(g + i), uv = widen_bf16x16(u + i);
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv),
                                                  _mm512_set1_ps(88.3f)));
            store_bf16x16(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), uv));
        }
#endif
        for (; i < I; i++) {
            const float gf = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(gf / (1.f + expf(fminf(-gf, 88.3f))) * bf16_to_f32(u[i]));
        }
    }
}

#if defined(__AVX512F__)
/* 16 values of a cache row of format fmt from element c (a multiple of 16: for int8 the 16
 * share a scale) */
static inline __attribute__((always_inline)) __m512 row16(const uint8_t *row, int c, int D, int fmt) {
    if (fmt == KV_F32) return _mm512_loadu_ps((const float *)row + c);
    if (fmt == KV_BF16) return widen_bf16x16((const uint16_t *)row + c);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
    return _mm512_mul_ps(v, _mm512_set1_ps(((const float *)(row + D))[c / 32]));
}

/* lane j of the result = the sum of a[j]'s 16 lanes: pairs of vectors interleaved and added,
 * then 64-bit pairs, then 128-bit lanes (45 operations for 16 sums, against ~8 per sum for a
 * horizontal add of each vector alone) */
static inline __attribute__((always_inline)) __m512 sum16x16(const __m512 *a) {
    __m512 s[8], u[4], v[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* lane k of u[i]: partial sums of a[4i .. 4i + 3] */
        const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#define AG_HEADS 8 /* query heads per KV head the 16-lane path takes (scratch on its stack) */
/* rows read ahead: a sequence's blocks lie anywhere in the cache, and the hardware prefetcher
 * stops at each block's end (a 16-position block of fp32 rows is one 4 KiB page per head) */
#define AG_AHEAD 16

#define prefetch_row(row, bytes, hint)                                                         \
    for (int pb_ = 0; pb_ < (bytes); pb_ += 64) _mm_prefetch((const char *)(row) + pb_, hint)

/* attend_group on 16-lane vectors (D % 16 == 0, G <= AG_HEADS). Scores: each position's key
 * row is read once for all G heads (one product chain per head, D / 16 long), 16 positions'
 * chains then summed across lanes together (sum16x16); softmax as the 8-lane path (max,
 * exp512 of the difference, sum, then the weights scaled by 1 / sum); values: each row read
 * once per 64 columns for up to 4 heads, its weights broadcast into the heads' FMA chains.
 * always_inline: the callers pass constant shapes, so the loops over heads and columns
 * unroll into registers. */
static inline __attribute__((always_inline)) void attend_group16(
    const float *restrict qg, int G, int D, const uint8_t *restrict kc, const uint8_t *restrict vc,
    int fmt, const int64_t *restrict at, int n, float scale, float *restrict out,
    float *restrict scores) {
    const int C = D / 16, row_bytes = (int)kv_row_bytes(fmt, D);
    const __m512 sc16 = _mm512_set1_ps(scale);
    __m512 part[AG_HEADS][16];
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int m = n - j0 < 16 ? n - j0 : 16;
        for (int j = 0; j < 16; j++) {
            if (j >= m) {
                for (int h = 0; h < G; h++) part[h][j] = _mm512_setzero_ps();
                continue;
            }
            const uint8_t *kr = kc + at[j0 + j];
            if (j0 + j + AG_AHEAD < n) {
                prefetch_row(kc + at[j0 + j + AG_AHEAD], row_bytes, _MM_HINT_T0);
                prefetch_row(vc + at[j0 + j + AG_AHEAD], row_bytes, _MM_HINT_T1);
            }
            __m512 acc[AG_HEADS];
            for (int c = 0; c < C; c++) {
                const __m512 k = row16(kr, 16 * c, D, fmt);
                for (int h = 0; h < G; h++) {
                    const __m512 qv = _mm512_loadu_ps(qg + (int64_t)h * D + 16 * c);
                    acc[h] = c ? _mm512_fmadd_ps(k, qv, acc[h]) : _mm512_mul_ps(k, qv);
                }
            }
            for (int h = 0; h < G; h++) part[h][j] = acc[h];
        }
        const __mmask16 valid = (__mmask16)((1u << m) - 1);
        for (int h = 0; h < G; h++)
            _mm512_mask_storeu_ps(scores + (int64_t)h * n + j0, valid,
                                  _mm512_mul_ps(sum16x16(part[h]), sc16));
    }
    for (int h = 0; h < G; h++) {
        float *sc = scores + (int64_t)h * n;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < n; j += 16) {
            const __mmask16 valid = (__mmask16)(n - j < 16 ? (1u << (n - j)) - 1 : 0xffffu);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, sc + j));
        }
        const __m512 m16 = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 s16 = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 16) {
            const __mmask16 valid = (__mmask16)(n - j < 16 ? (1u << (n - j)) - 1 : 0xffffu);
            const __m512 e = _mm512_maskz_mov_ps(
                valid, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sc + j), m16)));
            _mm512_mask_storeu_ps(sc + j, valid, e);
            s16 = _mm512_add_ps(s16, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(s16));
        for (int j = 0; j < n; j += 16) {
            const __mmask16 valid = (__mmask16)(n - j < 16 ? (1u << (n - j)) - 1 : 0xffffu);
            _mm512_mask_storeu_ps(sc + j, valid, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, sc + j), inv));
        }
    }
    for (int h0 = 0; h0 < G; h0 += 4) {
        const int hn = G - h0 < 4 ? G - h0 : 4;
        for (int c0 = 0; c0 < C; c0 += 4) {
            const int cn = C - c0 < 4 ? C - c0 : 4;
            __m512 acc[4][4];
            for (int h = 0; h < hn; h++)
                for (int c = 0; c < cn; c++) acc[h][c] = _mm512_setzero_ps();
            for (int j = 0; j < n; j++) {
                const uint8_t *vr = vc + at[j];
                __m512 v[4];
                for (int c = 0; c < cn; c++) v[c] = row16(vr, 16 * (c0 + c), D, fmt);
                for (int h = 0; h < hn; h++) {
                    const __m512 w = _mm512_set1_ps(scores[(int64_t)(h0 + h) * n + j]);
                    for (int c = 0; c < cn; c++) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
                }
            }
            for (int h = 0; h < hn; h++)
                for (int c = 0; c < cn; c++)
                    _mm512_storeu_ps(out + (int64_t)(h0 + h) * D + 16 * (c0 + c), acc[h][c]);
        }
    }
}
#endif

/* One (sequence, kv head): the G query heads sharing it attend over n positions whose rows
 * start at byte offsets at[0..n) of kc / vc (computed once per sequence: the block-table
 * division is not redone per head and pass). qg [G, D]; out [G, D]; scores: G * n floats.
 * Rows of format fmt (KV_F32, KV_Q8, KV_BF16). */
static void attend_group(const float *restrict qg, int G, int D, const uint8_t *restrict kc,
                         const uint8_t *restrict vc, int fmt, const int64_t *restrict at, int n,
                         float scale, float *restrict out, float *restrict scores) {
#if defined(__AVX512F__)
    if (D % 16 == 0 && G <= AG_HEADS) {
        /* the shapes of the models pdserve ships and tests, and the row format, as constants
         * (unrolled, no format test per row) */
#define AG_SHAPE(g, d)                                                                           \
    if (G == (g) && D == (d)) {                                                                 \
        if (fmt == KV_F32) attend_group16(qg, g, d, kc, vc, KV_F32, at, n, scale, out, scores);  \
        else if (fmt == KV_BF16) attend_group16(qg, g, d, kc, vc, KV_BF16, at, n, scale, out, scores); \
        else attend_group16(qg, g, d, kc, vc, KV_Q8, at, n, scale, out, scores);                 \
        return;                                                                                  \
    }
        AG_SHAPE(3, 64)
        AG_SHAPE(4, 64)
        AG_SHAPE(4, 128)
#undef AG_SHAPE
        attend_group16(qg, G, D, kc, vc, fmt, at, n, scale, out, scores);
        return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0 && G <= 16) {
        for (int j = 0; j < n; j++) {
            const uint8_t *kr = kc + at[j];
            __m256 acc[16];
            for (int h = 0; h < G; h++) acc[h] = _mm256_setzero_ps();
            for (int c = 0; c < D; c += 8) {
                const __m256 k = row8(kr, c, D, fmt);
                for (int h = 0; h < G; h++) acc[h] = _mm256_fmadd_ps(k, _mm256_loadu_ps(qg + h * D + c), acc[h]);
            }
            for (int h = 0; h < G; h++) scores[(int64_t)h * n + j] = hsum(acc[h]) * scale;
        }
        float inv[16];
        for (int h = 0; h < G; h++) {
            float *sc = scores + (int64_t)h * n;
            float mx = -INFINITY;
            for (int j = 0; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
            const __m256 m8 = _mm256_set1_ps(mx);
            __m256 s8 = _mm256_setzero_ps();
            int j = 0;
            for (; j + 8 <= n; j += 8) {
                const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), m8));
                _mm256_storeu_ps(sc + j, e);
                s8 = _mm256_add_ps(s8, e);
            }
            float sum = hsum(s8);
            for (; j < n; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
            inv[h] = 1.f / sum;
            for (int i = 0; i < D; i++) out[(int64_t)h * D + i] = 0.f;
        }
        if (D % 64 == 0) { /* head by head, 64 values at a time in registers; V rows re-read
                              from cache, ~2x fewer ops than accumulating in memory */
            for (int h = 0; h < G; h++) {
                const float *sc = scores + (int64_t)h * n;
                for (int c0 = 0; c0 < D; c0 += 64) {
                    __m256 acc[8];
                    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
                    for (int j = 0; j < n; j++) {
                        const uint8_t *vr = vc + at[j];
                        const __m256 w = _mm256_set1_ps(sc[j] * inv[h]);
                        for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(w, row8(vr, c0 + 8 * c, D, fmt), acc[c]);
                    }
                    for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + (int64_t)h * D + c0 + 8 * c, acc[c]);
                }
            }
            return;
        }
        for (int j = 0; j < n; j++) {
            const uint8_t *vr = vc + at[j];
            for (int c = 0; c < D; c += 8) {
                const __m256 v = row8(vr, c, D, fmt);
                for (int h = 0; h < G; h++) {
                    float *o = out + (int64_t)h * D + c;
                    const __m256 w = _mm256_set1_ps(scores[(int64_t)h * n + j] * inv[h]);
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(w, v, _mm256_loadu_ps(o)));
                }
            }
        }
        return;
    }
#endif
    for (int h = 0; h < G; h++) { /* portable path */
        const float *qh = qg + (int64_t)h * D;
        float *sc = scores + (int64_t)h * n, *o = out + (int64_t)h * D;
        float mx = -INFINITY;
        for (int j = 0; j < n; j++) {
            const uint8_t *kr = kc + at[j];
            float dot = 0.f;
            for (int i = 0; i < D; i++) dot += qh[i] * kv_value(kr, i, D, fmt);
            sc[j] = dot * scale;
            if (sc[j] > mx) mx = sc[j];
        }
        float sum = 0.f;
        for (int j = 0; j < n; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
        for (int i = 0; i < D; i++) o[i] = 0.f;
        for (int j = 0; j < n; j++) {
            const uint8_t *vr = vc + at[j];
            const float w = sc[j] / sum;
            for (int i = 0; i < D; i++) o[i] += w * kv_value(vr, i, D, fmt);
        }
    }
}

static void decode_attention(const float *restrict q, const uint8_t *restrict k_cache,
                             const uint8_t *restrict v_cache, int64_t num_slots, int fmt,
                             const int32_t *restrict tables, int table_stride,
                             const int32_t *restrict seq_lens, int B, int H, int KVH, int D,
                             int block_size, int window, float scale, float *restrict out,
                             float *restrict scores) {
    const int G = H / KVH;
    const int64_t row = kv_row_bytes(fmt, D);
    for (int b = 0; b < B; b++) {
        const int L = seq_lens[b];
        const int lo = window > 0 && L > window ? L - window : 0;
        const int n = L - lo;
        /* the rows' byte offsets, after the scores (8-byte aligned) */
        int64_t *at = (int64_t *)(scores + (((int64_t)G * n + 1) & ~(int64_t)1));
        const int32_t *tab = tables + (int64_t)b * table_stride;
        for (int j = 0; j < n; j++) {
            const int p = lo + j;
            at[j] = ((int64_t)tab[p / block_size] * block_size + p % block_size) * row;
        }
        for (int g = 0; g < KVH; g++)
            attend_group(q + ((int64_t)b * H + g * G) * D, G, D,
                         k_cache + (int64_t)g * num_slots * row, v_cache + (int64_t)g * num_slots * row,
                         fmt, at, n, scale, out + ((int64_t)b * H + g * G) * D, scores);
    }
}

/* One query token per sequence: out [B, H, D] = softmax(q k^T * scale) v over each
 * sequence's context [0, seq_lens[b]) (and the last `window` positions when window > 0),
 * read through its block table; caches [KVH, num_slots, row] of format fmt. scores: scratch
 * of (H / KVH + 2) * max_ctx + 2 floats (scores, then the rows' offsets). */
void pdserve_decode_attention(const float *restrict q, const uint8_t *restrict k_cache,
                              const uint8_t *restrict v_cache, int64_t num_slots,
                              const int32_t *restrict tables, int table_stride,
                              const int32_t *restrict seq_lens, int B, int H, int KVH, int D,
                              int block_size, int window, float scale, float *restrict out,
                              float *restrict scores, int fmt) {
    decode_attention(q, k_cache, v_cache, num_slots, fmt, tables, table_stride, seq_lens, B, H,
                     KVH, D, block_size, window, scale, out, scores);
}


/* ---- prompt attention -------------------------------------------------------------------
 * One sequence's span of n new tokens at positions [ctx - n, ctx), attending causally (and
 * within `window` when > 0) to its context [0, ctx) read through its block table; caches
 * [KVH, num_slots, row] of format fmt (widened to fp32 as they are gathered); q [n, H, D],
 * out [n, H, D]. Flash-style: per KV head the context's keys
 * are gathered once, transposed in blocks of PA_KEYS ([D][PA_KEYS] each, so 16 keys' scores are
 * one FMA chain per query row), and its values contiguous; then tiles of PA_ROWS positions x the head group's G query
 * heads walk the keys in blocks of PA_KEYS with an online softmax (running max and sum), the
 * output accumulated in fp32 and divided by the sum at the end.
 * Invariants: a query row's result depends only on its own q, position and context (the key
 * blocks start at 0 whatever the span: chunking a prompt differently gives the same bits);
 * softmax as in decode_attention (exp after subtracting the running max).
 * scratch: pdserve_prompt_attention_scratch(ctx, H, KVH, D) floats. */
#define PA_ROWS 8
#define PA_KEYS 32

int64_t pdserve_prompt_attention_scratch(int ctx, int H, int KVH, int D) {
    const int64_t padded = ((int64_t)ctx + PA_KEYS - 1) / PA_KEYS * PA_KEYS;
    const int64_t G = H / KVH;
    /* NOTE: + G * PA_ROWS * 16: the bf16 kernel's per-lane softmax sums (softmax_tile) */
    return 2 * padded * D + G * PA_ROWS * (2 * (int64_t)D + 2 + 16) + PA_ROWS * PA_KEYS
           + (int64_t)PA_KEYS * D + 64;
}

/* a cache row of format fmt as D fp32 values */
static inline void kv_row_f32(const uint8_t *restrict row, int D, int fmt, float *restrict dst) {
    if (fmt == KV_F32) memcpy(dst, row, sizeof(float) * D);
    else if (fmt == KV_BF16)
        for (int i = 0; i < D; i++) dst[i] = bf16_to_f32(((const uint16_t *)row)[i]);
    else
        for (int i = 0; i < D; i++) dst[i] = kv_value(row, i, D, KV_Q8);
}

/* A tile of query rows from t0 (both prompt kernels): how many (at most PA_ROWS), its last
 * position, and the first key position any of its rows sees (the window's start, else 0) */
static inline int prompt_tile(int t0, int n, int start, int window, int *last, int *first) {
    const int rows = n - t0 < PA_ROWS ? n - t0 : PA_ROWS;
    *last = start + t0 + rows - 1;
    *first = window > 0 && start + t0 - window + 1 > 0 ? start + t0 - window + 1 : 0;
    return rows;
}

/* A finished tile into out [n, H, D]: each row's accumulated output divided by its softmax
 * sum (acc [G][PA_ROWS][D], sum [G][PA_ROWS]; the tile's heads are g * G .. g * G + G - 1) */
static inline void prompt_tile_out(const float *restrict acc, const float *restrict sum, int rows,
                                   int t0, int g, int G, int H, int D, float *restrict out) {
    for (int h = 0; h < G; h++)
        for (int r = 0; r < rows; r++) {
            const float inv = 1.f / sum[h * PA_ROWS + r];
            const float *o = acc + ((int64_t)h * PA_ROWS + r) * D;
            float *dst = out + ((int64_t)(t0 + r) * H + g * G + h) * D;
            for (int d = 0; d < D; d++) dst[d] = o[d] * inv;
        }
}

#if defined(__AVX512F__)
/* One query row's online-softmax step over a block of PA_KEYS scores (x0: keys k0 .. k0 + 15,
 * x1: the next 16), positions outside [lo, pos] masked: 0 when the row sees none of them; else
 * the running max *mr and sum *lr updated, the block's weights exp(x - max) in *e0 / *e1 and
 * the factor the row's output so far is scaled by in *corr (both prompt kernels: one rounding) */
static inline __attribute__((always_inline)) int softmax_block(
    __m512 x0, __m512 x1, int k0, int pos, int lo, float *restrict mr, float *restrict lr,
    __m512 *e0, __m512 *e1, float *corr) {
    if (k0 + PA_KEYS - 1 > pos || k0 < lo) { /* a block the row sees in part */
        const __m512i k = _mm512_add_epi32(_mm512_set1_epi32(k0),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        const __m512i k16 = _mm512_add_epi32(k, _mm512_set1_epi32(16));
        const __m512i pv = _mm512_set1_epi32(pos), lv = _mm512_set1_epi32(lo);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        x0 = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(k, pv) & _mm512_cmpge_epi32_mask(k, lv), x0);
        x1 = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(k16, pv) & _mm512_cmpge_epi32_mask(k16, lv), x1);
    }
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
    if (m == -INFINITY) return 0; /* nothing to attend in this block */
    const float m_new = m > *mr ? m : *mr;
    *corr = *mr == -INFINITY ? 0.f : expf(*mr - m_new);
    const __m512 mv = _mm512_set1_ps(m_new);
    *e0 = exp512(_mm512_sub_ps(x0, mv));
    *e1 = exp512(_mm512_sub_ps(x1, mv));
    *lr = *lr * *corr + _mm512_reduce_add_ps(_mm512_add_ps(*e0, *e1));
    *mr = m_new;
    return 1;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* exp(x) for x <= 0, to about 3e-6 relative (a degree-5 Taylor polynomial over a single-step
 * ln 2 reduction), 0 below -87.3 (the masked keys' -inf included): for the prompt kernel's
 * softmax weights, which are rounded to bf16 (2^-9 relative) for their products */
static inline __attribute__((always_inline)) __m512 exp512_weights(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
    __m512 p = _mm512_set1_ps(1.f / 120);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(~under, p, n);
}

_Static_assert(PA_ROWS == 8, "rows_max8 reduces a tile of 8 rows");

/* lane r of the result (r < PA_ROWS = 8) = the largest of x[r]'s 16 lanes: one transposing
 * tree of shuffles for the tile's rows (max is exact: each row's maximum is the same number
 * as its own reduction gives, whatever the other rows hold) */
static inline __attribute__((always_inline)) __m512 rows_max8(const __m512 *x) {
    __m512 u[4], v[2];
    for (int i = 0; i < 4; i++) /* [row 2i: 8 lanes | row 2i + 1: 8] */
        u[i] = _mm512_max_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* [row 4i: 4 | 4i + 1: 4 | 4i + 2: 4 | 4i + 3: 4] */
        v[i] = _mm512_max_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    /* 128-bit lane k: [row k: 2 | row k + 4: 2], then [row k, row k, row k + 4, row k + 4] */
    const __m512 w = _mm512_max_ps(_mm512_shuffle_ps(v[0], v[1], 0x44), _mm512_shuffle_ps(v[0], v[1], 0xEE));
    const __m512 z = _mm512_max_ps(w, _mm512_permute_ps(w, 0xB1));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), z);
}

/* The online-softmax step of a tile's rows (row r at position pos0 + r, r < rows) over one
 * block of PA_KEYS scores (s0: keys k0 .. k0 + 15, s1: the next 16; masked in place as in
 * softmax_block), for the bf16 kernel: the rows' maxima in one tree (rows_max8), their
 * correction factors in one exp512, and each row's sum kept as 16 partial sums (ls [PA_ROWS]
 * [16], added up at the tile's end) rather than reduced per block. Each live row's weights go
 * to w[r] as 16 pairs of bf16 (keys 2j, 2j + 1) and its factor to corr[r]; returns the live
 * rows (those that see any key of the block) in live[]. A row's arithmetic depends on its own
 * scores alone. */
static inline __attribute__((always_inline)) int softmax_tile(
    __m512 *s0, __m512 *s1, int rows, int k0, int pos0, int window, float *restrict mr,
    float *restrict ls, uint32_t (*w)[16], float *restrict corr, int *live) {
    __m512 x[PA_ROWS];
    for (int r = 0; r < PA_ROWS; r++) {
        const int pos = pos0 + r, lo = window > 0 ? pos - window + 1 : 0;
        if (r < rows && (k0 + PA_KEYS - 1 > pos || k0 < lo)) { /* a block the row sees in part */
            const __m512i k = _mm512_add_epi32(_mm512_set1_epi32(k0),
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
            const __m512i k16 = _mm512_add_epi32(k, _mm512_set1_epi32(16));
            const __m512i pv = _mm512_set1_epi32(pos), lv = _mm512_set1_epi32(lo);
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            s0[r] = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(k, pv) & _mm512_cmpge_epi32_mask(k, lv), s0[r]);
            s1[r] = _mm512_mask_mov_ps(ninf, _mm512_cmple_epi32_mask(k16, pv) & _mm512_cmpge_epi32_mask(k16, lv), s1[r]);
        }
        x[r] = _mm512_max_ps(s0[r], s1[r]);
    }
    float m[16], d[16] = {0}, c[16];
    _mm512_storeu_ps(m, rows_max8(x));
    int nlive = 0;
    for (int r = 0; r < rows; r++) {
        if (m[r] == -INFINITY) continue; /* nothing to attend in this block */
        live[nlive++] = r;
        const float m_new = m[r] > mr[r] ? m[r] : mr[r];
        d[r] = mr[r] == -INFINITY ? 0.f : mr[r] - m_new;
        m[r] = m_new;
    }
    if (nlive == 0) return 0;
    _mm512_storeu_ps(c, exp512(_mm512_loadu_ps(d)));
    for (int i = 0; i < nlive; i++) {
        const int r = live[i];
        corr[r] = mr[r] == -INFINITY ? 0.f : c[r];
        mr[r] = m[r];
        const __m512 mv = _mm512_set1_ps(m[r]);
        const __m512 e0 = exp512_weights(_mm512_sub_ps(s0[r], mv));
        const __m512 e1 = exp512_weights(_mm512_sub_ps(s1[r], mv));
        _mm512_storeu_ps(ls + r * 16, _mm512_fmadd_ps(_mm512_loadu_ps(ls + r * 16),
                                                      _mm512_set1_ps(corr[r]), _mm512_add_ps(e0, e1)));
        _mm512_storeu_si512(w[r], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    return nlive;
}

/* The prompt kernel over a bf16 cache on CPUs with AVX512-BF16: the same tiles, blocks and
 * masks, the online softmax a tile at a time (softmax_tile: the weights' exp to ~3e-6, each
 * row's sum in 16 lanes), with both products as bf16 dot products (vdpbf16ps: pairs of bf16
 * products summed into fp32 lanes, twice the fp32 FMA's rate). The scaled queries and the
 * softmax weights are rounded to bf16 (nearest even) for the products, as SDPA's bf16 kernel
 * rounds them; scores, the running max and sum, and the output accumulate in fp32.
 * Layouts (32-bit words holding a pair of bf16, the lower-addressed in the low half): keys
 * [padded / PA_KEYS][D / 2][PA_KEYS], a word = dims (2i, 2i + 1) of one key; values
 * [padded / 2][D], a word = one dim of positions (2j, 2j + 1); queries [G][PA_ROWS][D / 2].
 * A row's result depends only on its own q, position and context, as in the fp32 kernel. */
static inline __attribute__((always_inline)) void prompt_attention_bf16(
                                  const float *restrict q, const uint8_t *restrict k_cache,
                                  const uint8_t *restrict v_cache, int64_t num_slots,
                                  const int32_t *restrict table, int ctx, int n, int H, int KVH,
                                  int D, int block_size, int window, float scale,
                                  float *restrict out, float *restrict scratch) {
    const int G = H / KVH, start = ctx - n, P = D / 2, C = D / 16;
    const int64_t padded = ((int64_t)ctx + PA_KEYS - 1) / PA_KEYS * PA_KEYS, R = 2 * (int64_t)D;
    uint32_t *kt = (uint32_t *)scratch, *vv = kt + padded * P;
    uint32_t *qs = vv + padded / 2 * D;
    float *acc = (float *)(qs + (int64_t)G * PA_ROWS * P);
    float *mx = acc + (int64_t)G * PA_ROWS * D, *sum = mx + G * PA_ROWS;
    float *ls = sum + G * PA_ROWS; /* [G][PA_ROWS][16]: each row's softmax sum, per lane */
    for (int g = 0; g < KVH; g++) {
        const uint8_t *kc = k_cache + (int64_t)g * num_slots * R, *vc = v_cache + (int64_t)g * num_slots * R;
        for (int64_t j0 = 0; j0 < padded; j0 += PA_KEYS) {
            uint32_t *kb = kt + j0 * P;
            for (int j = 0; j < PA_KEYS; j++) {
                const int64_t p = j0 + j;
                const int64_t slot = p < ctx ? (int64_t)table[p / block_size] * block_size + p % block_size : -1;
                const uint32_t *kr = slot >= 0 ? (const uint32_t *)(kc + slot * R) : NULL;
                const uint16_t *vr = slot >= 0 ? (const uint16_t *)(vc + slot * R) : NULL;
                for (int i = 0; i < P; i++) kb[(int64_t)i * PA_KEYS + j] = kr ? kr[i] : 0u;
                uint16_t *vp = (uint16_t *)(vv + p / 2 * D) + (p & 1);
                for (int d = 0; d < D; d++) vp[2 * d] = vr ? vr[d] : 0;
            }
        }
        for (int t0 = 0; t0 < n; t0 += PA_ROWS) {
            int last, first;
            const int rows = prompt_tile(t0, n, start, window, &last, &first);
            for (int h = 0; h < G; h++)
                for (int r = 0; r < PA_ROWS; r++) {
                    uint32_t *qr = qs + ((int64_t)h * PA_ROWS + r) * P;
                    const float *src = q + ((int64_t)(t0 + r) * H + g * G + h) * D;
                    for (int i = 0; i < P; i++)
                        qr[i] = r < rows ? (uint32_t)f32_to_bf16(src[2 * i] * scale)
                                               | (uint32_t)f32_to_bf16(src[2 * i + 1] * scale) << 16
                                         : 0u;
                    mx[h * PA_ROWS + r] = -INFINITY;
                    memset(ls + ((int64_t)h * PA_ROWS + r) * 16, 0, sizeof(float) * 16);
                    memset(acc + ((int64_t)h * PA_ROWS + r) * D, 0, sizeof(float) * D);
                }
            for (int k0 = first / PA_KEYS * PA_KEYS; k0 <= last; k0 += PA_KEYS) {
                const uint32_t *kb = kt + (int64_t)k0 * P;
                for (int h = 0; h < G; h++) {
                    const uint32_t *qh = qs + (int64_t)h * PA_ROWS * P;
                    __m512 s0[PA_ROWS], s1[PA_ROWS];
                    for (int r = 0; r < PA_ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();
                    for (int i = 0; i < P; i++) {
                        const __m512bh a = (__m512bh)_mm512_loadu_si512(kb + (int64_t)i * PA_KEYS);
                        const __m512bh b = (__m512bh)_mm512_loadu_si512(kb + (int64_t)i * PA_KEYS + 16);
                        for (int r = 0; r < PA_ROWS; r++) {
                            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)qh[(int64_t)r * P + i]);
                            s0[r] = _mm512_dpbf16_ps(s0[r], a, x);
                            s1[r] = _mm512_dpbf16_ps(s1[r], b, x);
                        }
                    }
                    /* each row's weights first (the 32 as 16 pairs of bf16: keys 2j, 2j + 1),
                     * then the value products two rows at a time: each row's sums in the same
                     * order as alone, twice the independent chains, each value load used twice */
                    uint32_t w[PA_ROWS][16];
                    float corr[PA_ROWS];
                    int live[PA_ROWS];
                    const int nlive = softmax_tile(s0, s1, rows, k0, start + t0, window, mx + h * PA_ROWS,
                                                   ls + (int64_t)h * PA_ROWS * 16, w, corr, live);
                    const uint32_t *vb = vv + (int64_t)k0 / 2 * D;
                    for (int i = 0; i < nlive; i += 2) {
                        const int ra = live[i], rb = i + 1 < nlive ? live[i + 1] : -1;
                        float *oa = acc + ((int64_t)h * PA_ROWS + ra) * D;
                        float *ob = rb >= 0 ? acc + ((int64_t)h * PA_ROWS + rb) * D : NULL;
                        __m512 va[16], vb2[16];
                        const __m512 ca = _mm512_set1_ps(corr[ra]), cb = _mm512_set1_ps(rb >= 0 ? corr[rb] : 0.f);
                        for (int c = 0; c < C; c++) {
                            va[c] = _mm512_mul_ps(_mm512_loadu_ps(oa + 16 * c), ca);
                            vb2[c] = ob ? _mm512_mul_ps(_mm512_loadu_ps(ob + 16 * c), cb) : _mm512_setzero_ps();
                        }
                        const uint32_t *vr = vb;
                        if (ob) {
                            for (int j = 0; j < 16; j++, vr += D) {
                                const __m512bh pa = (__m512bh)_mm512_set1_epi32((int)w[ra][j]);
                                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)w[rb][j]);
                                for (int c = 0; c < C; c++) {
                                    const __m512bh v = (__m512bh)_mm512_loadu_si512(vr + 16 * c);
                                    va[c] = _mm512_dpbf16_ps(va[c], v, pa);
                                    vb2[c] = _mm512_dpbf16_ps(vb2[c], v, pb);
                                }
                            }
                            for (int c = 0; c < C; c++) _mm512_storeu_ps(ob + 16 * c, vb2[c]);
                        } else { /* NOTE: its own loop: pairing an odd row with itself measured the
                                  * whole kernel 1.3x slower (the pair loop no longer kept in registers) */
                            for (int j = 0; j < 16; j++, vr += D) {
                                const __m512bh pa = (__m512bh)_mm512_set1_epi32((int)w[ra][j]);
                                for (int c = 0; c < C; c++)
                                    va[c] = _mm512_dpbf16_ps(va[c], (__m512bh)_mm512_loadu_si512(vr + 16 * c), pa);
                            }
                        }
                        for (int c = 0; c < C; c++) _mm512_storeu_ps(oa + 16 * c, va[c]);
                    }
                }
            }
            for (int h = 0; h < G; h++)
                for (int r = 0; r < rows; r++)
                    sum[h * PA_ROWS + r] = _mm512_reduce_add_ps(_mm512_loadu_ps(ls + ((int64_t)h * PA_ROWS + r) * 16));
            prompt_tile_out(acc, sum, rows, t0, g, G, H, D, out);
        }
    }
}
#endif

void pdserve_prompt_attention(const float *restrict q, const uint8_t *restrict k_cache,
                              const uint8_t *restrict v_cache, int64_t num_slots,
                              const int32_t *restrict table, int ctx, int n, int H, int KVH,
                              int D, int block_size, int window, float scale,
                              float *restrict out, float *restrict scratch, int fmt) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (fmt == KV_BF16 && D % 16 == 0 && D <= 256) {
        if (D == 64) /* the common head size as a constant: the loops over it unroll */
            prompt_attention_bf16(q, k_cache, v_cache, num_slots, table, ctx, n, H, KVH, 64,
                                  block_size, window, scale, out, scratch);
        else
            prompt_attention_bf16(q, k_cache, v_cache, num_slots, table, ctx, n, H, KVH, D,
                                  block_size, window, scale, out, scratch);
        return;
    }
#endif
    const int G = H / KVH, start = ctx - n;
    const int64_t padded = ((int64_t)ctx + PA_KEYS - 1) / PA_KEYS * PA_KEYS;
    const int64_t R = kv_row_bytes(fmt, D);
    float *kt = scratch, *vv = kt + padded * D;
    float *qs = vv + padded * D, *acc = qs + (int64_t)G * PA_ROWS * D;
    float *mx = acc + (int64_t)G * PA_ROWS * D, *sum = mx + G * PA_ROWS;
    float *sc = sum + G * PA_ROWS; /* [PA_ROWS][PA_KEYS] */
    float *kw = sc + PA_ROWS * PA_KEYS; /* [PA_KEYS][D]: one block's keys widened to fp32 */
    for (int g = 0; g < KVH; g++) {
        const uint8_t *kc = k_cache + (int64_t)g * num_slots * R, *vc = v_cache + (int64_t)g * num_slots * R;
        /* keys blocked [padded / PA_KEYS][D][PA_KEYS] (one block's columns contiguous: a
         * [D][ctx] layout strides by ctx floats, and at long contexts those rows collide in
         * the same L1 sets), values [padded][D]; zeros past the context */
        for (int64_t j0 = 0; j0 < padded; j0 += PA_KEYS) {
            float *kb = kt + j0 * D;
            const float *rows_k[PA_KEYS];
            for (int j = 0; j < PA_KEYS; j++) {
                const int64_t p = j0 + j;
                if (p < ctx) {
                    const int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    if (fmt == KV_F32) rows_k[j] = (const float *)(kc + slot * R);
                    else {
                        kv_row_f32(kc + slot * R, D, fmt, kw + (int64_t)j * D);
                        rows_k[j] = kw + (int64_t)j * D;
                    }
                    kv_row_f32(vc + slot * R, D, fmt, vv + p * D);
                } else {
                    rows_k[j] = NULL;
                    memset(vv + p * D, 0, sizeof(float) * D);
                }
            }
            for (int d = 0; d < D; d++)
                for (int j = 0; j < PA_KEYS; j++) kb[d * PA_KEYS + j] = rows_k[j] ? rows_k[j][d] : 0.f;
        }
        for (int t0 = 0; t0 < n; t0 += PA_ROWS) {
            int last, first;
            const int rows = prompt_tile(t0, n, start, window, &last, &first);
            for (int h = 0; h < G; h++)
                for (int r = 0; r < PA_ROWS; r++) {
                    float *qr = qs + ((int64_t)h * PA_ROWS + r) * D;
                    const float *src = q + ((int64_t)(t0 + r) * H + g * G + h) * D;
                    for (int d = 0; d < D; d++) qr[d] = r < rows ? src[d] * scale : 0.f;
                    mx[h * PA_ROWS + r] = -INFINITY;
                    sum[h * PA_ROWS + r] = 0.f;
                    memset(acc + ((int64_t)h * PA_ROWS + r) * D, 0, sizeof(float) * D);
                }
            for (int k0 = first / PA_KEYS * PA_KEYS; k0 <= last; k0 += PA_KEYS) {
                for (int h = 0; h < G; h++) {
                    const float *qh = qs + (int64_t)h * PA_ROWS * D;
                    /* scores [PA_ROWS][PA_KEYS] of this block */
#if defined(__AVX512F__)
                    __m512 s0[PA_ROWS], s1[PA_ROWS];
                    for (int r = 0; r < PA_ROWS; r++) s0[r] = s1[r] = _mm512_setzero_ps();
                    const float *kb = kt + (int64_t)k0 * D;
                    for (int d = 0; d < D; d++) {
                        const __m512 a = _mm512_loadu_ps(kb + d * PA_KEYS);
                        const __m512 b = _mm512_loadu_ps(kb + d * PA_KEYS + 16);
                        for (int r = 0; r < PA_ROWS; r++) {
                            const __m512 x = _mm512_set1_ps(qh[(int64_t)r * D + d]);
                            s0[r] = _mm512_fmadd_ps(x, a, s0[r]);
                            s1[r] = _mm512_fmadd_ps(x, b, s1[r]);
                        }
                    }
                    for (int r = 0; r < PA_ROWS; r++) {
                        _mm512_storeu_ps(sc + r * PA_KEYS, s0[r]);
                        _mm512_storeu_ps(sc + r * PA_KEYS + 16, s1[r]);
                    }
#else
                    for (int r = 0; r < PA_ROWS; r++)
                        for (int j = 0; j < PA_KEYS; j++) {
                            float dot = 0.f;
                            for (int d = 0; d < D; d++) dot = fmaf(qh[(int64_t)r * D + d], kt[(int64_t)k0 * D + d * PA_KEYS + j], dot);
                            sc[r * PA_KEYS + j] = dot;
                        }
#endif
                    for (int r = 0; r < rows; r++) {
                        const int pos = start + t0 + r;
                        const int lo = window > 0 ? pos - window + 1 : 0;
                        float *srow = sc + r * PA_KEYS, *mr = mx + h * PA_ROWS + r;
                        float *lr = sum + h * PA_ROWS + r, *o = acc + ((int64_t)h * PA_ROWS + r) * D;
#if defined(__AVX512F__)
                        __m512 e0, e1;
                        float corr;
                        if (!softmax_block(_mm512_loadu_ps(srow), _mm512_loadu_ps(srow + 16), k0, pos,
                                           lo, mr, lr, &e0, &e1, &corr))
                            continue;
                        _mm512_storeu_ps(srow, e0);
                        _mm512_storeu_ps(srow + 16, e1);
#else
                        float m = -INFINITY;
                        for (int j = 0; j < PA_KEYS; j++) {
                            const int key = k0 + j;
                            if (key > pos || key < lo) srow[j] = -INFINITY;
                            else if (srow[j] > m) m = srow[j];
                        }
                        if (m == -INFINITY) continue; /* nothing to attend in this block */
                        const float m_new = m > *mr ? m : *mr;
                        const float corr = *mr == -INFINITY ? 0.f : expf(*mr - m_new);
                        float l = 0.f;
                        for (int j = 0; j < PA_KEYS; j++) { srow[j] = expf(srow[j] - m_new); l += srow[j]; }
                        *lr = *lr * corr + l;
                        *mr = m_new;
#endif
                        /* o = o * corr + p . V[block] */
#if defined(__AVX512F__)
                        if (D == 64) { /* the common head size: the row's output in 4 registers */
                            const __m512 cv = _mm512_set1_ps(corr);
                            __m512 o0 = _mm512_mul_ps(_mm512_loadu_ps(o), cv);
                            __m512 o1 = _mm512_mul_ps(_mm512_loadu_ps(o + 16), cv);
                            __m512 o2 = _mm512_mul_ps(_mm512_loadu_ps(o + 32), cv);
                            __m512 o3 = _mm512_mul_ps(_mm512_loadu_ps(o + 48), cv);
                            const float *vr = vv + (int64_t)k0 * 64;
                            for (int j = 0; j < PA_KEYS; j++, vr += 64) {
                                const __m512 p = _mm512_set1_ps(srow[j]);
                                o0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr), o0);
                                o1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16), o1);
                                o2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 32), o2);
                                o3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 48), o3);
                            }
                            _mm512_storeu_ps(o, o0);
                            _mm512_storeu_ps(o + 16, o1);
                            _mm512_storeu_ps(o + 32, o2);
                            _mm512_storeu_ps(o + 48, o3);
                            continue;
                        }
                        if (D % 16 == 0 && D <= 256) {
                            __m512 ov[16];
                            const __m512 cv = _mm512_set1_ps(corr);
                            const int c16 = D / 16;
                            for (int c = 0; c < c16; c++) ov[c] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), cv);
                            for (int j = 0; j < PA_KEYS; j++) {
                                const __m512 p = _mm512_set1_ps(srow[j]);
                                const float *vr = vv + (int64_t)(k0 + j) * D;
                                for (int c = 0; c < c16; c++) ov[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * c), ov[c]);
                            }
                            for (int c = 0; c < c16; c++) _mm512_storeu_ps(o + 16 * c, ov[c]);
                            continue;
                        }
#endif
                        for (int d = 0; d < D; d++) o[d] *= corr;
                        for (int j = 0; j < PA_KEYS; j++) {
                            const float *vr = vv + (int64_t)(k0 + j) * D;
                            for (int d = 0; d < D; d++) o[d] = fmaf(srow[j], vr[d], o[d]);
                        }
                    }
                }
            }
            prompt_tile_out(acc, sum, rows, t0, g, G, H, D, out);
        }
    }
}


/* ---- a whole pure-decode step in one call -----------------------------------------------
 * Batch-1 decode of a small model is dominated by per-op dispatch when each op is its own
 * call from Python (about 10 calls a layer). This runs every layer of a pure decode step
 * (B <= MAX_ROWS sequences, one new token each) with the functions above, in the model's op
 * order (services/engine/model.py), so its results equal the per-op path bit for bit. */
typedef struct {
    int32_t kind; /* 4: q4 (qs, d, mn); 8: q8 (qs, d) */
    int32_t N, K;
    const uint8_t *qs;
    const float *d, *mn, *bias; /* mn: q4 only; bias may be NULL */
} pd_linear;

typedef struct {
    const float *attn_norm, *mlp_norm;
    pd_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [KVH, num_slots, row]: rows of format kv_format */
} pd_layer;

typedef struct {
    int32_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int32_t window, kv_format, block_size;
    int64_t num_slots;
    const float *cos, *sin, *final_norm;
    const pd_layer *layers;
} pd_model;

static void pd_apply(const pd_linear *l, const float *x, int M, float *y) {
    if (l->kind == 4) pdserve_q4_gemm(x, M, l->K, l->qs, l->d, l->mn, l->N, y);
    else pdserve_q8_gemm(x, M, l->K, (const int8_t *)l->qs, l->d, l->N, y);
    if (l->bias)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < l->N; n++) y[(int64_t)m * l->N + n] += l->bias[n];
}

/* x [B, hidden]: the tokens' embeddings (overwritten); out [B, hidden]: the final norm's
 * output, for the lm_head. work: (4 * hidden + 3 * inter + (3 * heads + 2 * kv_heads) *
 * head_dim) * B floats; scores: (heads / kv_heads + 2) * max context + 2 floats. */
void pdserve_decode_step(const pd_model *m, int B, float *restrict x,
                         const int64_t *restrict positions, const int64_t *restrict slots,
                         const int32_t *restrict tables, int table_stride,
                         const int32_t *restrict seq_lens, float *restrict work,
                         float *restrict scores, float *restrict out) {
    const int h = m->hidden, D = m->head_dim, H = m->heads, KVH = m->kv_heads;
    const int qkv_n = (H + 2 * KVH) * D;
    float *res = work, *hn = res + (int64_t)B * h, *y = hn + (int64_t)B * h;
    float *qkv = y + (int64_t)B * h, *q = qkv + (int64_t)B * qkv_n;
    float *att = q + (int64_t)B * H * D, *gu = att + (int64_t)B * H * D;
    float *act = gu + (int64_t)B * 2 * m->inter, *res2 = act + (int64_t)B * m->inter;
    const float scale = 1.f / sqrtf((float)D);
    for (int i = 0; i < m->num_layers; i++) {
        const pd_layer *L = m->layers + i;
        /* h, residual = add_rms_norm(x, residual): residual is None at layer 0 */
        pdserve_add_rms_norm(x, 0, i ? res : NULL, L->attn_norm, B, h, m->eps, hn, 0, res2);
        float *t = res; res = res2; res2 = t;
        pd_apply(&L->qkv, hn, B, qkv);
        rope_and_cache(qkv, qkv_n, qkv + H * D, qkv_n, qkv + (H + KVH) * D, qkv_n, B, H, KVH, D,
                       positions, m->cos, m->sin, L->k_cache, L->v_cache, m->num_slots, slots,
                       m->kv_format);
        for (int b = 0; b < B; b++) /* q rows contiguous [B, H, D] */
            for (int j = 0; j < H * D; j++) q[(int64_t)b * H * D + j] = qkv[(int64_t)b * qkv_n + j];
        decode_attention(q, L->k_cache, L->v_cache, m->num_slots, m->kv_format, tables, table_stride,
                         seq_lens, B, H, KVH, D, m->block_size, m->window, scale, att, scores);
        pd_apply(&L->o, att, B, y);
        pdserve_add_rms_norm(y, 0, res, L->mlp_norm, B, h, m->eps, hn, 0, res2);
        t = res; res = res2; res2 = t;
        pd_apply(&L->gate_up, hn, B, gu);
        pdserve_silu_and_mul(gu, B, m->inter, act);
        pd_apply(&L->down, act, B, x);
    }
    pdserve_add_rms_norm(x, 0, res, m->final_norm, B, h, m->eps, out, 0, res2);
}

/* ---- KV import: a request's blocks from the handoff layout into the paged cache --------
 * src: [L][2 (k, v)][n][bs][KVH][row] bytes (``KVHandle.blocks``, or n of its blocks: each
 * (layer, k/v) part starts part_stride bytes after the one before); dst: per layer, keys at
 * k_ptrs[l] and values at v_ptrs[l], each [KVH][num_slots][row] (``KVCache`` storage);
 * block ids[i] takes src block i. Byte copies of whole rows: any storage format.
 * Loop order: one head's block is bs * row contiguous bytes in the cache, so the writes go out
 * in runs of a block while the reads stride by a position (KVH rows), both sequential. */
void pdserve_write_blocks(const uint8_t *restrict src, int64_t part_stride, int L, int n,
                          int bs, int KVH, int64_t row, const int32_t *restrict ids,
                          const int64_t *restrict k_ptrs, const int64_t *restrict v_ptrs,
                          int64_t num_slots) {
    const int64_t pos = (int64_t)KVH * row, block = (int64_t)bs * pos;
    for (int l = 0; l < L; l++) {
        for (int kv = 0; kv < 2; kv++) {
            uint8_t *dst = (uint8_t *)(intptr_t)(kv ? v_ptrs[l] : k_ptrs[l]);
            const uint8_t *part = src + ((int64_t)l * 2 + kv) * part_stride;
            for (int i = 0; i < n; i++) {
                const uint8_t *b = part + (int64_t)i * block;
                for (int h = 0; h < KVH; h++) {
                    uint8_t *d = dst + ((int64_t)h * num_slots + (int64_t)ids[i] * bs) * row;
                    const uint8_t *s = b + (int64_t)h * row;
                    for (int t = 0; t < bs; t++)
                        memcpy(d + (int64_t)t * row, s + (int64_t)t * pos, (size_t)row);
                }
            }
        }
    }
}

/* GGUF block-quantized weights times fp32 activations on x86 CPUs (AVX2, FMA, F16C).
 *
 * A weight [N, K] holds a GGUF file's blocks of 32 weights along K, bytes as the file
 * has them, regrouped per row (same size as the file):
 *
 *     row n = [ values of its G = K / 32 blocks | G f16 scales d | G f16 minimums m ]
 *
 *     Q4_0  16 bytes of nibbles a block, d         w = d q - 8 d
 *     Q4_1  16 bytes of nibbles a block, d, m      w = d q + m
 *     Q8_0  32 int8 a block, d                     w = d q
 *
 * (byte j of a block's nibbles holds weight j in its low half and weight j + 16 in its
 * high half). Like llama.cpp, each 32-group of an activation row is first rounded to
 * int8 with its own scale (dx = max|x| / 127, xq = round(x / dx)), so a group's dot
 * product is one integer dot:
 *
 *     sum_k w (dx xq)  =  d dx sum_k q xq  +  z dx sum_k xq       (z = -8 d, m or 0)
 *
 * NOTE: the z term sums the rounded x too, so the result is exactly w . x~ (x~ = dx xq)
 * and its error sum_k w (x - x~) is weighted by the centred w; with the exact sum of x it
 * would be weighted by d q (0..15 d, never centred), about twice the error on SmolLM2.
 * gguf_gemm_reference in kernels/gguf_cpu.py is
 * this formula in torch, the tests' oracle. Per weight row the scales d dx and the z
 * term are computed 8 groups at a time first, so the block loop is integer dots and one
 * fma a block.
 *
 * x [M, K] fp32 and out [M, N] fp32 are row-major and contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define MAX_TILE 4
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };         /* kernels/gguf_cpu.py TYPE_CODES */

static inline int value_bytes(int type) { return type == Q8_0 ? 32 : 16; }
static inline int block_bytes(int type) { return type == Q4_1 ? 20 : type == Q8_0 ? 34 : 18; }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float f16(const uint16_t *p) { return _cvtsh_ss(*p); }

/* x [M, K] -> xq [M, K] int8, dx [M, G], xsum = dx sum(xq) [M, G]: the header's rounding. */
void gguf_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx,
                        float *xsum) {
    const int64_t G = K / QK;
    for (int64_t r = 0; r < M * G; ++r) {
        const float *xb = x + r * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; ++i)
            amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; ++i) {
            xq[r * QK + i] = (int8_t)nearbyintf(xb[i] * id);
            sum += xq[r * QK + i];
        }
        dx[r] = d;
        xsum[r] = d * (float)sum;
    }
}

/* The 32 weights of block g as bytes in k order (4 bits: 0..15; 8 bits: signed). */
static inline __m256i block_values(const uint8_t *values, int64_t g, int type) {
    if (type == Q8_0)
        return _mm256_loadu_si256((const __m256i *)(values + g * 32));
    const __m128i b = _mm_loadu_si128((const __m128i *)(values + g * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                            _mm256_set1_epi8(0x0F));
}

/* int32 x 8 partial sums of w . xq over one block; maddubs wants unsigned x signed, so
 * 8-bit weights move their sign onto the activations (|w| . sign(xq, w)). */
static inline __m256 block_dot(__m256i w, __m256i xq, int type) {
    __m256i p;
    if (type == Q8_0)
        p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
    else
        p = _mm256_maddubs_epi16(w, xq);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* For one weight row and one activation row: dd[g] = d[g] dx[g] for every block, and the
 * z term sum_g z[g] xsum[g]; 8 blocks a step. */
static inline float row_scales(const uint16_t *d, const uint16_t *m, const float *dx,
                               const float *xsum, int64_t G, int type, float *dd) {
    __m256 zacc = _mm256_setzero_ps();
    float zsum = 0.0f;
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g)));
        _mm256_storeu_ps(dd + g, _mm256_mul_ps(dv, _mm256_loadu_ps(dx + g)));
        if (type != Q8_0) {
            const __m256 zv = type == Q4_1
                ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g)))
                : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f));
            zacc = _mm256_fmadd_ps(zv, _mm256_loadu_ps(xsum + g), zacc);
        }
    }
    for (; g < G; ++g) {
        dd[g] = f16(d + g) * dx[g];
        if (type != Q8_0)
            zsum += (type == Q4_1 ? f16(m + g) : -8.0f * f16(d + g)) * xsum[g];
    }
    return type == Q8_0 ? 0.0f : hsum(zacc) + zsum;
}

/* NB weight rows x MB activation rows at once: NB * MB accumulators, each block loaded
 * once for all MB rows. Constant NB / MB / type after inlining keep them in registers.
 * dd: scratch [MAX_TILE * MAX_TILE * G] floats. */
static inline __attribute__((always_inline)) void tile(
        int NB, int MB, int type, const int8_t *xq, const float *dx, const float *xsum,
        int64_t K, const uint8_t *weight, int64_t N, int64_t n0, int64_t m0, float *dd,
        float *out) {
    const int64_t G = K / QK, row_bytes = G * block_bytes(type);
    const uint8_t *values[MAX_TILE];
    float zterm[MAX_TILE][MAX_TILE];
    __m256 acc[MAX_TILE][MAX_TILE];
    for (int i = 0; i < NB; ++i) {
        const uint8_t *row = weight + (n0 + i) * row_bytes;
        const uint16_t *d = (const uint16_t *)(row + G * value_bytes(type));
        values[i] = row;
        for (int j = 0; j < MB; ++j) {
            const int64_t r = (m0 + j) * G;
            zterm[i][j] = row_scales(d, d + G, dx + r, xsum + r, G, type,
                                     dd + (i * MAX_TILE + j) * G);
            acc[i][j] = _mm256_setzero_ps();
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        __m256i xg[MAX_TILE];
        for (int j = 0; j < MB; ++j)
            xg[j] = _mm256_loadu_si256((const __m256i *)(xq + (m0 + j) * K + g * QK));
        for (int i = 0; i < NB; ++i) {
            const __m256i w = block_values(values[i], g, type);
            for (int j = 0; j < MB; ++j)
                acc[i][j] = _mm256_fmadd_ps(block_dot(w, xg[j], type),
                                            _mm256_broadcast_ss(dd + (i * MAX_TILE + j) * G + g),
                                            acc[i][j]);
        }
    }
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < MB; ++j)
            out[(m0 + j) * N + n0 + i] = hsum(acc[i][j]) + zterm[i][j];
}

#define TILE(NB, MB) tile(NB, MB, TYPE, xq, dx, xsum, K, weight, N, n, m0, dd, out)

/* every (type, MB) pair its own copy, so the inner loops carry no branch */
static inline __attribute__((always_inline)) void rows_tile(
        const int TYPE, int MB, const int8_t *xq, const float *dx, const float *xsum,
        int64_t K, const uint8_t *weight, int64_t N, int64_t m0, float *dd, float *out) {
    int64_t n = 0;
    if (MB == 1) {      /* one row: four weight rows at once hide the fma latency */
        for (; n + 4 <= N; n += 4) TILE(4, 1);
        for (; n < N; ++n) TILE(1, 1);
    } else if (MB == 2) {
        for (; n + 4 <= N; n += 4) TILE(4, 2);
        for (; n < N; ++n) TILE(1, 2);
    } else if (MB == 3) {
        for (; n + 2 <= N; n += 2) TILE(2, 3);
        for (; n < N; ++n) TILE(1, 3);
    } else {
        for (; n + 2 <= N; n += 2) TILE(2, 4);
        for (; n < N; ++n) TILE(1, 4);
    }
}

/* out [M, N] = x [M, K] @ w^T; 0 on success, -1 when scratch memory is short, -2 for an
 * unknown type. */
int gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *weight, int64_t N,
              int type, float *out) {
    if (type != Q4_0 && type != Q4_1 && type != Q8_0)
        return -2;
    const int64_t G = K / QK;
    int8_t *xq = malloc((size_t)(M * K));
    float *scratch = malloc(sizeof(float) * (size_t)(2 * M * G + MAX_TILE * MAX_TILE * G));
    if (xq == NULL || scratch == NULL) {
        free(xq);
        free(scratch);
        return -1;
    }
    float *dx = scratch, *xsum = scratch + M * G, *dd = scratch + 2 * M * G;
    gguf_quantize_rows(x, M, K, xq, dx, xsum);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_TILE) {
        const int MB = M - m0 < MAX_TILE ? (int)(M - m0) : MAX_TILE;
        if (type == Q4_0)
            rows_tile(Q4_0, MB, xq, dx, xsum, K, weight, N, m0, dd, out);
        else if (type == Q4_1)
            rows_tile(Q4_1, MB, xq, dx, xsum, K, weight, N, m0, dd, out);
        else
            rows_tile(Q8_0, MB, xq, dx, xsum, K, weight, N, m0, dd, out);
    }
    free(xq);
    free(scratch);
    return 0;
}

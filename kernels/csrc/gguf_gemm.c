/* GGUF block-quantized weights times fp32 activations on x86 CPUs (AVX2 + FMA).
 *
 * A weight [N, K] stays in its GGUF blocks of 32 along K: per group, 4-bit values
 * q in 0..15 (Q4_0 / Q4_1) or signed 8-bit values (Q8_0), a scale d and an offset z:
 *
 *     w[n, k] = d[n, g] * q[n, k] + z[n, g]          g = k / 32
 *
 * (Q4_0: z = -8 d;  Q4_1: z = m;  Q8_0: z = 0). Like llama.cpp, each 32-group of an
 * activation row is first rounded to int8 with its own scale (dx = max|x| / 127,
 * xq = round(x / dx)), so a group's dot product is one integer dot:
 *
 *     sum_k w x  ~=  d dx sum_k q xq  +  z sum_k x
 *
 * (the second sum over the exact fp32 x). gguf_gemm_reference in kernels/gguf_cpu.py is
 * this formula in torch, the tests' oracle.
 *
 * Layouts (row-major, contiguous):
 *   x    [M, K] fp32             out  [M, N] fp32
 *   qs   [N, K / 2] uint8 for 4 bits: byte j of a group holds weights j (low nibble)
 *        and j + 16 (high nibble), GGUF's order;  [N, K] int8 for 8 bits
 *   d, z [N, K / 32] fp32
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x [M, K] -> xq [M, K] int8, dx [M, G], xsum [M, G]: the rounding the header states. */
void gguf_quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx,
                        float *xsum) {
    const int64_t G = K / QK;
    for (int64_t r = 0; r < M * G; ++r) {
        const float *xb = x + r * QK;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < QK; ++i) {
            amax = fmaxf(amax, fabsf(xb[i]));
            sum += xb[i];
        }
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < QK; ++i)
            xq[r * QK + i] = (int8_t)nearbyintf(xb[i] * id);
        dx[r] = d;
        xsum[r] = sum;
    }
}

/* 32 weights of group g of row n as bytes in k order (4 bits: 0..15; 8 bits: signed). */
static inline __m256i load_group(const uint8_t *qs, int64_t row_bytes, int64_t n, int64_t g,
                                 int bits) {
    if (bits == 8)
        return _mm256_loadu_si256((const __m256i *)(qs + n * row_bytes + g * QK));
    const __m128i b = _mm_loadu_si128((const __m128i *)(qs + n * row_bytes + g * (QK / 2)));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b),
                            _mm256_set1_epi8(0x0F));
}

/* int32 x 8 partial sums of w . xq over one group; maddubs wants unsigned x signed, so
 * 8-bit weights move their sign onto the activations (|w| . sign(xq, w)). */
static inline __m256 group_dot(__m256i w, __m256i xq, int bits) {
    __m256i p;
    if (bits == 8)
        p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
    else
        p = _mm256_maddubs_epi16(w, xq);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* NB weight rows x MB activation rows at once: NB * MB accumulators, each weight group
 * loaded once for all MB rows. Constant NB / MB after inlining keep them in registers. */
static inline __attribute__((always_inline)) void tile(
        int NB, int MB, const int8_t *xq, const float *dx, const float *xsum, int64_t K,
        const uint8_t *qs, const float *d, const float *z, int64_t N, int bits,
        int64_t n0, int64_t m0, float *out) {
    const int64_t G = K / QK, row_bytes = bits == 8 ? K : K / 2;
    __m256 acc[4][4];
    float zacc[4][4];
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < MB; ++j) {
            acc[i][j] = _mm256_setzero_ps();
            zacc[i][j] = 0.0f;
        }
    for (int64_t g = 0; g < G; ++g) {
        __m256i xg[4];
        for (int j = 0; j < MB; ++j)
            xg[j] = _mm256_loadu_si256((const __m256i *)(xq + (m0 + j) * K + g * QK));
        for (int i = 0; i < NB; ++i) {
            const int64_t n = n0 + i;
            const __m256i w = load_group(qs, row_bytes, n, g, bits);
            const float dg = d[n * G + g], zg = z[n * G + g];
            for (int j = 0; j < MB; ++j) {
                const int64_t r = (m0 + j) * G + g;
                acc[i][j] = _mm256_fmadd_ps(group_dot(w, xg[j], bits),
                                            _mm256_set1_ps(dg * dx[r]), acc[i][j]);
                zacc[i][j] += zg * xsum[r];
            }
        }
    }
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < MB; ++j)
            out[(m0 + j) * N + n0 + i] = hsum(acc[i][j]) + zacc[i][j];
}

#define TILE(NB, MB) tile(NB, MB, xq, dx, xsum, K, qs, d, z, N, BITS, n, m0, out)

/* every (bits, MB) pair its own copy, so the inner loops carry no branch */
static inline __attribute__((always_inline)) void rows_tile(
        const int BITS, int MB, const int8_t *xq, const float *dx, const float *xsum,
        int64_t K, const uint8_t *qs, const float *d, const float *z, int64_t N,
        int64_t m0, float *out) {
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

/* out [M, N] = x [M, K] @ w^T; 0 on success, -1 when scratch memory is short. */
int gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
              const float *z, int64_t N, int bits, float *out) {
    const int64_t G = K / QK;
    int8_t *xq = malloc((size_t)(M * K));
    float *dx = malloc(sizeof(float) * (size_t)(2 * M * G));
    if (xq == NULL || dx == NULL) {
        free(xq);
        free(dx);
        return -1;
    }
    float *xsum = dx + M * G;
    gguf_quantize_rows(x, M, K, xq, dx, xsum);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int MB = M - m0 < 4 ? (int)(M - m0) : 4;
        if (bits == 8)
            rows_tile(8, MB, xq, dx, xsum, K, qs, d, z, N, m0, out);
        else
            rows_tile(4, MB, xq, dx, xsum, K, qs, d, z, N, m0, out);
    }
    free(xq);
    free(dx);
    return 0;
}

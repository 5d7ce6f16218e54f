/* GGUF block-quantized weights times fp32 activations on x86 CPUs (AVX2, FMA, F16C).
 *
 * A weight [N, K] stays in the file's own blocks of 32 weights along K, as llama.cpp
 * reads them (one sequential stream per row):
 *
 *     Q4_0  18 bytes: f16 d,          16 bytes of nibbles   w = d q - 8 d
 *     Q4_1  20 bytes: f16 d, f16 m,   16 bytes of nibbles   w = d q + m
 *     Q8_0  34 bytes: f16 d,          32 int8               w = d q
 *
 * (byte j of the nibbles holds weight j in its low half and weight j + 16 in its high
 * half). Like llama.cpp, each 32-group of an activation row is first rounded to int8 with
 * its own scale (dx = max|x| / 127, xq = round(x / dx)), so a group's dot product is one
 * integer dot:
 *
 *     sum_k w x  ~=  d dx sum_k q xq  +  z sum_k x        (z = -8 d, m or 0)
 *
 * (the second sum over the exact fp32 x). gguf_gemm_reference in kernels/gguf_cpu.py is
 * this formula in torch, the tests' oracle.
 *
 * x [M, K] fp32 and out [M, N] fp32 are row-major and contiguous; blocks is [N, K / 32]
 * blocks, row-major.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };         /* kernels/gguf_cpu.py TYPE_CODES */

static inline int block_bytes(int type) { return type == Q4_1 ? 20 : type == Q8_0 ? 34 : 18; }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
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

/* The 32 weights of a block as bytes in k order (4 bits: 0..15; 8 bits: signed). */
static inline __m256i block_values(const uint8_t *blk, int type) {
    if (type == Q8_0)
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m128i b = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2)));
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

/* NB weight rows x MB activation rows at once: NB * MB accumulators, each block loaded
 * once for all MB rows. Constant NB / MB / type after inlining keep them in registers. */
static inline __attribute__((always_inline)) void tile(
        int NB, int MB, int type, const int8_t *xq, const float *dx, const float *xsum,
        int64_t K, const uint8_t *blocks, int64_t N, int64_t n0, int64_t m0, float *out) {
    const int64_t G = K / QK, row_bytes = G * block_bytes(type);
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
            const uint8_t *blk = blocks + (n0 + i) * row_bytes + g * block_bytes(type);
            const __m256i w = block_values(blk, type);
            const float d = f16(blk);
            const float z = type == Q4_1 ? f16(blk + 2) : type == Q4_0 ? -8.0f * d : 0.0f;
            for (int j = 0; j < MB; ++j) {
                const int64_t r = (m0 + j) * G + g;
                acc[i][j] = _mm256_fmadd_ps(block_dot(w, xg[j], type),
                                            _mm256_set1_ps(d * dx[r]), acc[i][j]);
                if (type != Q8_0)
                    zacc[i][j] += z * xsum[r];
            }
        }
    }
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < MB; ++j)
            out[(m0 + j) * N + n0 + i] = hsum(acc[i][j]) + zacc[i][j];
}

#define TILE(NB, MB) tile(NB, MB, TYPE, xq, dx, xsum, K, blocks, N, n, m0, out)

/* every (type, MB) pair its own copy, so the inner loops carry no branch */
static inline __attribute__((always_inline)) void rows_tile(
        const int TYPE, int MB, const int8_t *xq, const float *dx, const float *xsum,
        int64_t K, const uint8_t *blocks, int64_t N, int64_t m0, float *out) {
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
int gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *blocks, int64_t N,
              int type, float *out) {
    if (type != Q4_0 && type != Q4_1 && type != Q8_0)
        return -2;
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
        if (type == Q4_0)
            rows_tile(Q4_0, MB, xq, dx, xsum, K, blocks, N, m0, out);
        else if (type == Q4_1)
            rows_tile(Q4_1, MB, xq, dx, xsum, K, blocks, N, m0, out);
        else
            rows_tile(Q8_0, MB, xq, dx, xsum, K, blocks, N, m0, out);
    }
    free(xq);
    free(dx);
    return 0;
}

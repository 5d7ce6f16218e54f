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
 * gguf_gemm_reference in kernels/gguf_cpu.py is this formula in torch, the tests' oracle.
 *
 * How it runs (decode, one activation row, is bound by streaming the weights from DRAM):
 * - 4-bit blocks go two at a time: one 32-byte load holds blocks a and b, its low nibbles
 *   are [a 0..15 | b 0..15] and its high nibbles [a 16..31 | b 16..31], so the rounded
 *   activations of a pair are stored in that order ([a 0..15, b 0..15, a 16..31, b
 *   16..31]) and the pair costs one load, two maddubs and one int -> float convert and
 *   fma (the int16 sum of the two maddubs is at most 2 * 2 * 15 * 127, no saturation);
 * - the scales d dx (and the z term) are converted 8 blocks at a time in registers;
 * - the weight stream is prefetched PREFETCH_AHEAD bytes ahead (measured: the hardware
 *   prefetcher alone left a step's matmuls at a fraction of the read bandwidth, since
 *   the 4-row tiles read 4 streams at once); a prefetch never faults, and past the end
 *   of one weight it warms the next one when the weights are laid out in call order.
 *
 * x [M, K] fp32 and out [M, N] fp32 are row-major and contiguous.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define CHUNK 8                 /* blocks whose scales are converted at once */
#define MAX_ROWS 4              /* activation rows of a tile */
#define MAX_WROWS 4             /* weight rows of a tile */
#define PREFETCH_AHEAD 4096     /* bytes (bench/gguf_kernel_ab.py: 2-8 KB measured alike) */
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };         /* kernels/gguf_cpu.py TYPE_CODES */

static inline int value_bytes(int type) { return type == Q8_0 ? 32 : 16; }
static inline int block_bytes(int type) { return type == Q4_1 ? 20 : type == Q8_0 ? 34 : 18; }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The activations rounded to int8 (the header's rounding), one call's worth. */
typedef struct {
    const int8_t *xq;   /* [M, K]; 4-bit weights: each pair of blocks interleaved */
    const float *dx;    /* [M, G_padded] dx per group, zero past G */
    const float *xsum;  /* [M, G_padded] dx * sum(xq) per group, zero past G */
    int64_t K, G, G_padded;
} Rounded;

/* x [M, K] -> xq, dx, xsum; paired: store block pairs as [a lo | b lo | a hi | b hi]
 * (lo: its elements 0..15, hi: 16..31), a last unpaired block in order. */
static void round_rows(const float *x, int64_t M, int64_t K, int paired, int8_t *xq,
                       float *dx, float *xsum, int64_t G_padded) {
    const int64_t G = K / QK;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t g = 0; g < G; ++g) {
            const float *xb = x + r * K + g * QK;
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
            }
            const float d = hmax(amax) / 127.0f;
            const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i q[4];
            for (int i = 0; i < 4; ++i)      /* round half to even, as nearbyint / torch */
                q[i] = _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                               _mm256_add_epi32(q[2], q[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            /* |q| <= 127: the saturating packs are exact; order puts the dwords back */
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
            int8_t *dst = xq + r * K + g * QK;
            if (paired && (g % 2 == 1 || g + 1 < G)) {
                dst = xq + r * K + (g & ~(int64_t)1) * QK + (g % 2) * 16;
                _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(bytes));
                _mm_storeu_si128((__m128i *)(dst + 32), _mm256_extracti128_si256(bytes, 1));
            } else {
                _mm256_storeu_si256((__m256i *)dst, bytes);
            }
            dx[r * G_padded + g] = d;
            xsum[r * G_padded + g] = d * (float)_mm_cvtsi128_si32(s4);
        }
        for (int64_t g = G; g < G_padded; ++g)
            dx[r * G_padded + g] = xsum[r * G_padded + g] = 0.0f;
    }
}

/* n <= CHUNK f16 values as fp32, zero past n; reads no byte past them. */
static inline __m256 load_f16(const uint16_t *p, int n) {
    if (n == CHUNK)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    uint16_t tmp[CHUNK] = {0};
    memcpy(tmp, p, sizeof(uint16_t) * (size_t)n);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tmp));
}

/* int32 x 8 partial sums of a block's (or pair's) integer dot, as float */
static inline __m256 dot_q8(__m256i w, __m256i xq) {    /* maddubs is unsigned x signed */
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

static inline __m256 dot_q4_pair(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo),
                                       _mm256_maddubs_epi16(hi, xhi));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* Blocks [g, g + nblk) of NB weight rows x MB activation rows into acc, the scales
 * dd[i][j] (lane lane0 + b: block g + b) in registers. */
static inline __attribute__((always_inline)) void chunk(
        int NB, int MB, int type, int nblk, int lane0, const Rounded *a,
        const uint8_t *const *values, int64_t g, int64_t m0, __m256 dd[MAX_WROWS][MAX_ROWS],
        __m256 acc[MAX_WROWS][MAX_ROWS]) {
    const int8_t *xq = a->xq + m0 * a->K + g * QK;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    int b = 0;
    if (type == Q8_0) {
        for (; b < nblk; ++b) {
            const __m256i sel = _mm256_set1_epi32(lane0 + b);
            for (int i = 0; i < NB; ++i) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(values[i] + (g + b) * 32));
                for (int j = 0; j < MB; ++j) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + j * a->K + b * QK));
                    acc[i][j] = _mm256_fmadd_ps(dot_q8(w, x),
                                                _mm256_permutevar8x32_ps(dd[i][j], sel), acc[i][j]);
                }
            }
        }
        return;
    }
    for (; b + 2 <= nblk; b += 2) {
        const int l = lane0 + b;
        const __m256i sel = _mm256_setr_epi32(l, l, l, l, l + 1, l + 1, l + 1, l + 1);
        __m256i xlo[MAX_ROWS], xhi[MAX_ROWS];
        for (int j = 0; j < MB; ++j) {
            xlo[j] = _mm256_loadu_si256((const __m256i *)(xq + j * a->K + b * QK));
            xhi[j] = _mm256_loadu_si256((const __m256i *)(xq + j * a->K + b * QK + 32));
        }
        for (int i = 0; i < NB; ++i) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(values[i] + (g + b) * 16));
            const __m256i lo = _mm256_and_si256(v, nibble);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            for (int j = 0; j < MB; ++j)
                acc[i][j] = _mm256_fmadd_ps(dot_q4_pair(lo, hi, xlo[j], xhi[j]),
                                            _mm256_permutevar8x32_ps(dd[i][j], sel), acc[i][j]);
        }
    }
    if (b < nblk) {             /* the last block of an odd G, its activations in order */
        const __m256i sel = _mm256_set1_epi32(lane0 + b);
        for (int i = 0; i < NB; ++i) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(values[i] + (g + b) * 16));
            const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), nibble);
            for (int j = 0; j < MB; ++j) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + j * a->K + b * QK));
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x),
                                                    _mm256_set1_epi16(1));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                            _mm256_permutevar8x32_ps(dd[i][j], sel), acc[i][j]);
            }
        }
    }
}

/* NB weight rows x MB activation rows at once: NB * MB accumulators, each block loaded
 * once for all MB rows. Constant NB / MB / type after inlining keep them in registers. */
static inline __attribute__((always_inline)) void tile(
        int NB, int MB, int type, const Rounded *a, const uint8_t *weight, int64_t N,
        int64_t n0, int64_t m0, float *out) {
    const int64_t G = a->G, row_bytes = G * block_bytes(type);
    const uint8_t *values[MAX_WROWS];
    const uint16_t *d[MAX_WROWS];
    __m256 acc[MAX_WROWS][MAX_ROWS];
    for (int i = 0; i < NB; ++i) {
        values[i] = weight + (n0 + i) * row_bytes;
        d[i] = (const uint16_t *)(values[i] + G * value_bytes(type));
        for (int j = 0; j < MB; ++j)
            acc[i][j] = _mm256_setzero_ps();
    }
    const char *ahead = (const char *)(weight + n0 * row_bytes) + PREFETCH_AHEAD;
    for (int64_t g = 0; g < G; g += CHUNK) {
        const int nblk = G - g < CHUNK ? (int)(G - g) : CHUNK;
        /* NOTE: a last chunk of nblk < 8 blocks reads the scales of the last 8 (lanes
         * from lane0 = 8 - nblk on are its own, the z term masks the others): no read
         * past a row's scales, no copy; only a row of under 8 blocks copies them. */
        const int64_t base = nblk == CHUNK || G < CHUNK ? g : G - CHUNK;
        const int lane0 = (int)(g - base);
        const int64_t chunk_bytes = NB * nblk * block_bytes(type);
        for (int64_t off = 0; off < chunk_bytes; off += 64)
            _mm_prefetch(ahead + off, _MM_HINT_T0);
        ahead += chunk_bytes;
        const __m256 own = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(lane0 - 1)));
        __m256 dd[MAX_WROWS][MAX_ROWS];
        for (int i = 0; i < NB; ++i) {
            const int n = G < CHUNK ? nblk : CHUNK;
            const __m256 dv = load_f16(d[i] + base, n);
            __m256 z = type == Q4_1 ? load_f16(d[i] + G + base, n)
                                    : _mm256_mul_ps(dv, _mm256_set1_ps(-8.0f));
            if (lane0)
                z = _mm256_and_ps(z, own);
            for (int j = 0; j < MB; ++j) {
                const int64_t r = (m0 + j) * a->G_padded + base;
                dd[i][j] = _mm256_mul_ps(dv, _mm256_loadu_ps(a->dx + r));
                if (type != Q8_0)   /* the z term of all 8 blocks, summed with the rest */
                    acc[i][j] = _mm256_fmadd_ps(z, _mm256_loadu_ps(a->xsum + r), acc[i][j]);
            }
        }
        if (nblk == CHUNK)
            chunk(NB, MB, type, CHUNK, 0, a, values, g, m0, dd, acc);
        else
            chunk(NB, MB, type, nblk, lane0, a, values, g, m0, dd, acc);
    }
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < MB; ++j)
            out[(m0 + j) * N + n0 + i] = hsum(acc[i][j]);
}

#define TILE(NB, MB) tile(NB, MB, TYPE, a, weight, N, n, m0, out)

/* every (type, MB) pair its own copy, so the inner loops carry no branch */
static inline __attribute__((always_inline)) void rows_tile(
        const int TYPE, int MB, const Rounded *a, const uint8_t *weight, int64_t N,
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

/* Scratch for the rounded activations, kept per thread between calls (a decode step
 * makes ~120 calls of a few KB each; no malloc on the hot path once it has grown). */
static __thread void *scratch_memory;
static __thread size_t scratch_bytes;

static void *scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch_memory);
        scratch_bytes = (bytes + 4095) & ~(size_t)4095;
        scratch_memory = aligned_alloc(64, scratch_bytes);
        if (scratch_memory == NULL)
            scratch_bytes = 0;
    }
    return scratch_memory;
}

/* out [M, N] = x [M, K] @ w^T; 0 on success, -1 when scratch memory is short, -2 for an
 * unknown type. */
int gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *weight, int64_t N,
              int type, float *out) {
    if (type != Q4_0 && type != Q4_1 && type != Q8_0)
        return -2;
    const int64_t G = K / QK, G_padded = (G + CHUNK - 1) / CHUNK * CHUNK;
    const size_t xq_bytes = ((size_t)(M * K) + 63) & ~(size_t)63;
    char *memory = scratch(xq_bytes + sizeof(float) * (size_t)(2 * M * G_padded));
    if (memory == NULL)
        return -1;
    int8_t *xq = (int8_t *)memory;
    float *dx = (float *)(memory + xq_bytes), *xsum = dx + M * G_padded;
    round_rows(x, M, K, type != Q8_0, xq, dx, xsum, G_padded);
    const Rounded a = {xq, dx, xsum, K, G, G_padded};
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int MB = M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS;
        if (type == Q4_0)
            rows_tile(Q4_0, MB, &a, weight, N, m0, out);
        else if (type == Q4_1)
            rows_tile(Q4_1, MB, &a, weight, N, m0, out);
        else
            rows_tile(Q8_0, MB, &a, weight, N, m0, out);
    }
    return 0;
}

/* GGUF block-quantized weights times fp32 activations on x86 CPUs (AVX2, FMA, F16C; the
 * same source built a second time with AVX-512 VNNI, GGUF_VNNI defined, where dpbusd
 * does maddubs + madd in one instruction: the integer sums are the same, so are results).
 *
 * A weight [N, K] holds a GGUF file's blocks of 32 weights along K (K-quants: super-blocks
 * of 256 = 8 groups of 32), each block's bytes regrouped per row, lossless (G = K / 32
 * groups, S = G / 8 super-blocks; kernels/gguf_cpu.py writes this layout):
 *
 *     Q4_0  [nibbles 16G | d G]                 w = d q - 8 d        q 0..15
 *     Q4_1  [nibbles 16G | d G | m G]           w = d q + m
 *     Q8_0  [int8 32G | d G]                    w = d q              q -128..127
 *     Q5_0  [nibbles 16G | high bits 4G | d G]  w = d q - 16 d       q 0..31
 *     Q5_1  [nibbles 16G | high bits 4G | d G | m G]        w = d q + m
 *     Q4_K  [nibbles 16G | d S | dmin S | sc G | mn G]     w = d sc q - dmin mn (per group)
 *     Q5_K  [nibbles 16G | high bits 32S | d S | dmin S | sc G | mn G]    q 0..31
 *     Q6_K  [low nibbles 16G | high pairs 8G | int8 sc 2G | d S]  w = d sc16 (q - 32), q 0..63
 *     Q3_K  [low pairs 8G | high bits 4G | int8 sc 2G | d S]  w = d sc16 q, q -4..3
 *     Q2_K  [pairs 8G | sc16 | mn16 << 4 2G | d S | dmin S]  w = d sc16 q - dmin mn16, q 0..3
 *
 * (d, m, dmin: f16; sc, mn: the 6-bit K-quant scales unpacked to a byte each; Q6_K's int8
 * scale per 16 weights, and Q3_K's 6-bit ones unpacked to int8, less their 32). The nibble and high-bit layouts are the file's own: legacy blocks
 * hold weight j in the low half of byte j and j + 16 in its high half, bit j of their 32
 * high bits for weight j; K-quant super-blocks hold groups 2i and 2i + 1 in the low and
 * high halves of 32 bytes, Q5_K bit i of high byte l for weight l of group i, Q6_K the
 * layout of its ql / qh arrays (two halves of 128 weights).
 *
 * Like llama.cpp, each 32-group of an activation row is first rounded to int8 with its
 * own scale (dx = max|x| / 127, xq = round(x / dx)), so a group's dot product is one
 * integer dot:
 *
 *     sum_k w (dx xq)  =  s dx sum_k q xq  +  z dx sum_k xq    (s: the group's scale,
 *                                                              z: its offset, or 0)
 *
 * Q6_K's two scales of 16 multiply the two integer half-dots before the sum (exact in
 * int32), its -32 is folded into q (signed). NOTE: the z term sums the rounded x too, so
 * the result is exactly w . x~ (x~ = dx xq) and its error sum_k w (x - x~) is weighted by
 * the centred w; with the exact sum of x it would be weighted by d q (0..15 d, never
 * centred), about twice the error on SmolLM2. gguf_gemm_reference in kernels/gguf_cpu.py
 * is this formula in torch, the tests' oracle.
 *
 * INVARIANT (batch invariance): an output element's accumulation order is fixed by K
 * alone: one accumulator per (weight row, activation row), chunks of 8 groups in order,
 * the z term then the groups of a chunk, one horizontal sum at the end. The tile shape
 * (1-4 activation rows, 1-4 weight rows), the thread split and the ISA path never change
 * it, so a row's result is bit-identical whatever M it is computed in.
 *
 * How it runs (decode, one activation row, is bound by streaming the weights from DRAM):
 * - legacy 4-bit blocks go two at a time: one 32-byte load holds blocks a and b, its low
 *   nibbles are [a 0..15 | b 0..15] and its high nibbles [a 16..31 | b 16..31], so the
 *   rounded activations of a pair are stored in that order ([a 0..15, b 0..15, a 16..31,
 *   b 16..31]) and the pair costs one load, two maddubs and one int -> float convert and
 *   fma (the int16 sum of the two maddubs is at most 2 * 2 * 15 * 127, no saturation);
 *   every other type decodes one group into 32 bytes in k order (activations in order);
 * - the scales s dx (and the z term) are converted 8 groups at a time in registers;
 * - the weight stream is prefetched PREFETCH_AHEAD bytes ahead (the hardware prefetcher
 *   alone does not keep up with the 4 streams a 4-row tile reads at once;
 *   docs/performance.md); a prefetch never faults, and past the end
 *   of one weight it warms the next one when the weights are laid out in call order.
 * - Q5's high bits: AVX2 spreads them to bytes with a shuffle and compare; the VNNI build
 *   (AVX-512BW) takes 32 of them as a byte mask as they stand;
 * - prefill: a call's weight rows (every type but Q8_0, already bytes) are decoded once to
 *   bytes in the order the activations are rounded in (decode_rows), and each tile of up
 *   to 4 activation rows reads them; the caller (csrc/gguf_op.cpp) splits (row tile x
 *   weight-row chunk) over threads.
 *
 * x [M, K] fp32 and out [M, N] fp32 are row-major and contiguous.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define CHUNK 8                 /* blocks whose scales are converted at once */
#define MAX_ROWS 4              /* activation rows of a tile */
#define MAX_WROWS 4             /* weight rows of a tile */
#define PREFETCH_AHEAD 4096     /* bytes: a few pages ahead (dev/bench/gguf_kernel_ab.py) */
/* kernels/gguf_cpu.py TYPE_CODES */
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7,
       Q3_K = 8, Q2_K = 9 };

#ifdef GGUF_VNNI
#define GGUF_FN(name) name##_vnni
#else
#define GGUF_FN(name) name##_avx2
#endif

/* legacy (non-K) types: bytes a block before its scales (values, Q5's high bits), in all */
static inline int value_bytes(int type) {
    return type == Q8_0 ? 32 : type == Q5_0 || type == Q5_1 ? 20 : 16;
}
static inline int block_bytes(int type) {
    return value_bytes(type) + (type == Q4_1 || type == Q5_1 ? 4 : 2);
}
static inline int is_legacy(int type) { return type <= Q5_1; }
static inline int has_min(int type) { return type == Q4_1 || type == Q5_1; }
static inline int is_q5(int type) { return type == Q5_0 || type == Q5_1; }

/* bytes of one row of G groups (the layouts of the header) */
static inline int64_t row_bytes(int type, int64_t G) {
    const int64_t S = G / 8;
    switch (type) {
    case Q4_K: return 18 * G + 4 * S;
    case Q5_K: return 22 * G + 4 * S;
    case Q6_K: return 26 * G + 2 * S;
    case Q3_K: return 14 * G + 2 * S;
    case Q2_K: return 10 * G + 4 * S;
    default: return block_bytes(type) * G;
    }
}

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
static inline __m256i dot_u8(__m256i w, __m256i xq) {   /* w unsigned, xq signed */
#ifdef GGUF_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xq);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), _mm256_set1_epi16(1));
#endif
}

static inline __m256 dot_q8(__m256i w, __m256i xq) {    /* maddubs is unsigned x signed */
    return _mm256_cvtepi32_ps(dot_u8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w)));
}

static inline __m256 dot_q4_pair(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi) {
#ifdef GGUF_VNNI
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi));
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo),
                                       _mm256_maddubs_epi16(hi, xhi));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* Q5 high bits of one block (32 bits, weight j at bit j) -> 0x10 in byte j */
static inline __m256i high_bits(uint32_t bits) {    /* bit j -> 0x10 in byte j */
#ifdef GGUF_VNNI
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), _mm256_setr_epi64x(
        0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                            _mm256_set1_epi8(0x10));
#endif
}

/* Q5 high bits of a pair of blocks a, b (their 2 x 32 bits, a's first) -> 0x10 in the
 * bytes of [a 0..15 | b 0..15] (lo) and [a 16..31 | b 16..31] (hi), the pair's order */
static inline void pair_high_bits(uint64_t bits, __m256i *lo, __m256i *hi) {
#ifdef GGUF_VNNI    /* AVX-512BW: the bits are a byte mask as they stand */
    const __m256i sixteen = _mm256_set1_epi8(0x10);
    *lo = _mm256_maskz_mov_epi8((__mmask32)((bits & 0xFFFF) | ((bits >> 16) & 0xFFFF0000)),
                                sixteen);
    *hi = _mm256_maskz_mov_epi8((__mmask32)(((bits >> 16) & 0xFFFF) |
                                            ((bits >> 32) & 0xFFFF0000)), sixteen);
#else
    const __m256i v = _mm256_set1_epi64x((long long)bits);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i sixteen = _mm256_set1_epi8(0x10);
    const __m256i lo_idx = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0404040404040404,
                                              0x0505050505050505);
    const __m256i hi_idx = _mm256_setr_epi64x(0x0202020202020202, 0x0303030303030303,
                                              0x0606060606060606, 0x0707070707070707);
    *lo = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(
        _mm256_shuffle_epi8(v, lo_idx), bit), bit), sixteen);
    *hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(
        _mm256_shuffle_epi8(v, hi_idx), bit), bit), sixteen);
#endif
}

/* A legacy 4- or 5-bit row's pair of blocks g, g + 1 as unsigned bytes in the pair's order
 * ([g 0..15 | g+1 0..15] in lo, [g 16..31 | g+1 16..31] in hi) */
static inline __attribute__((always_inline)) void decode_pair(
        int type, const uint8_t *values, int64_t G, int64_t g, __m256i *lo, __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(values + g * 16));
    *lo = _mm256_and_si256(v, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    if (is_q5(type)) {
        uint64_t bits;
        memcpy(&bits, values + 16 * G + 4 * g, 8);
        __m256i hlo, hhi;
        pair_high_bits(bits, &hlo, &hhi);
        *lo = _mm256_or_si256(*lo, hlo);
        *hi = _mm256_or_si256(*hi, hhi);
    }
}

/* A legacy 4- or 5-bit row's block g alone as unsigned bytes in k order (an odd G's last) */
static inline __attribute__((always_inline)) __m256i decode_block(
        int type, const uint8_t *values, int64_t G, int64_t g) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(values + g * 16));
    __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                                 _mm256_set1_epi8(0x0F));
    if (is_q5(type)) {
        uint32_t bits;
        memcpy(&bits, values + 16 * G + 4 * g, 4);
        w = _mm256_or_si256(w, high_bits(bits));
    }
    return w;
}

/* Blocks [g, g + nblk) of NB weight rows x MB activation rows into acc, the scales
 * dd[i][j] (lane lane0 + b: block g + b) in registers; PRE: the 4- and 5-bit blocks come
 * decoded from decoded[i] (decode_legacy_rows), else from values[i]. */
static inline __attribute__((always_inline)) void chunk(
        int NB, int MB, int type, int PRE, int nblk, int lane0, const Rounded *a,
        const uint8_t *const *values, const int8_t *const *decoded, int64_t g, int64_t m0,
        __m256 dd[MAX_WROWS][MAX_ROWS], __m256 acc[MAX_WROWS][MAX_ROWS]) {
    const int8_t *xq = a->xq + m0 * a->K + g * QK;
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
            __m256i lo, hi;
            if (PRE) {
                lo = _mm256_loadu_si256((const __m256i *)(decoded[i] + (g + b) * QK));
                hi = _mm256_loadu_si256((const __m256i *)(decoded[i] + (g + b) * QK + 32));
            } else {
                decode_pair(type, values[i], a->G, g + b, &lo, &hi);
            }
            for (int j = 0; j < MB; ++j)
                acc[i][j] = _mm256_fmadd_ps(dot_q4_pair(lo, hi, xlo[j], xhi[j]),
                                            _mm256_permutevar8x32_ps(dd[i][j], sel), acc[i][j]);
        }
    }
    if (b < nblk) {             /* the last block of an odd G, its activations in order */
        const __m256i sel = _mm256_set1_epi32(lane0 + b);
        for (int i = 0; i < NB; ++i) {
            const __m256i w = PRE
                ? _mm256_loadu_si256((const __m256i *)(decoded[i] + (g + b) * QK))
                : decode_block(type, values[i], a->G, g + b);
            for (int j = 0; j < MB; ++j) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + j * a->K + b * QK));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8(w, x)),
                                            _mm256_permutevar8x32_ps(dd[i][j], sel), acc[i][j]);
            }
        }
    }
}

/* Legacy types: NB weight rows x MB activation rows at once, NB * MB accumulators, each
 * block loaded once for all MB rows. Constant NB / MB / type after inlining keep them in
 * registers. */
static inline __attribute__((always_inline)) void tile_legacy(
        int NB, int MB, int type, int PRE, const Rounded *a, const uint8_t *weight, int64_t N,
        int64_t n0, int64_t m0, const int8_t *dec, int64_t dec_n0, float *out) {
    const int64_t G = a->G, rb = G * block_bytes(type);
    const uint8_t *values[MAX_WROWS];
    const int8_t *decoded[MAX_WROWS];
    const uint16_t *d[MAX_WROWS];
    __m256 acc[MAX_WROWS][MAX_ROWS];
    for (int i = 0; i < NB; ++i) {
        values[i] = weight + (n0 + i) * rb;
        decoded[i] = PRE ? dec + (n0 + i - dec_n0) * a->K : NULL;
        d[i] = (const uint16_t *)(values[i] + G * value_bytes(type));
        for (int j = 0; j < MB; ++j)
            acc[i][j] = _mm256_setzero_ps();
    }
    const char *ahead = (const char *)(weight + n0 * rb) + PREFETCH_AHEAD;
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
            __m256 z = has_min(type) ? load_f16(d[i] + G + base, n)
                                     : _mm256_mul_ps(dv, _mm256_set1_ps(is_q5(type) ? -16.0f : -8.0f));
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
            chunk(NB, MB, type, PRE, CHUNK, 0, a, values, decoded, g, m0, dd, acc);
        else
            chunk(NB, MB, type, PRE, nblk, lane0, a, values, decoded, g, m0, dd, acc);
    }
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < MB; ++j)
            out[(m0 + j) * N + n0 + i] = hsum(acc[i][j]);
}


static inline __m128i shift_count(int n) { return _mm_cvtsi32_si128(n); }

/* One group (32 weights, k order) of a K-quant row as bytes: unsigned q, or for Q6_K
 * signed q - 32, for Q3_K signed q. */
static inline __attribute__((always_inline)) __m256i decode_group(
        int type, const uint8_t *row, int64_t G, int64_t g) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const int64_t s = g / 8, gi = g % 8;
    if (type == Q4_K || type == Q5_K) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + 16 * (g & ~(int64_t)1)));
        const __m256i q4 = _mm256_and_si256(_mm256_srl_epi16(v, shift_count(4 * (int)(g & 1))),
                                            nibble);
        if (type == Q4_K)
            return q4;
        const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 16 * G + 32 * s));
        const __m256i bit = _mm256_set1_epi8((char)(1 << gi));
        return _mm256_or_si256(q4, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(0x10)));
    }
    if (type == Q2_K || type == Q3_K) {
        /* group gi of super-block s: half gi / 4, quarter k = gi % 4: bits 2k, 2k + 1 of
         * the half's 32 bytes of pairs; Q3_K less 4 where bit gi of its high bytes is clear */
        const __m256i pairs = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(
            (const __m256i *)(row + 64 * s + 32 * (gi / 4))), shift_count(2 * (int)(gi % 4))),
            _mm256_set1_epi8(0x03));
        if (type == Q2_K)
            return pairs;
        const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 8 * G + 32 * s));
        const __m256i bit = _mm256_set1_epi8((char)(1 << gi));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
        return _mm256_sub_epi8(pairs, _mm256_andnot_si256(set, _mm256_set1_epi8(4)));
    }
    /* Q6_K: group gi of super-block s is half gi / 4, quarter k = gi % 4 */
    const int k = (int)(gi % 4);
    const uint8_t *ql = row + 128 * s + 64 * (gi / 4) + 32 * (k & 1);
    const uint8_t *qh = row + 16 * G + 64 * s + 32 * (gi / 4);
    const __m256i lo = _mm256_and_si256(
        _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)ql), shift_count(4 * (k >> 1))),
        nibble);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(
        _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)qh), shift_count(2 * k)),
        _mm256_set1_epi8(0x03)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
}

/* the integer dot of one decoded group with 32 rounded activations, as float */
static inline __attribute__((always_inline)) __m256 dot_group(
        int type, __m256i w, __m256i x, __m256i scales16) {
    if (type == Q6_K || type == Q3_K)  /* |q| <= 32: pairs <= 2 * 32 * 127, |sc| <= 128 */
        return _mm256_cvtepi32_ps(_mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), scales16));
    if (type == Q2_K)   /* q <= 3: pairs <= 2 * 3 * 127, sc <= 15 */
        return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), scales16));
    return _mm256_cvtepi32_ps(dot_u8(w, x));
}

/* K-quants, a chunk of 8 groups (its super-block) at a time. */
static inline __attribute__((always_inline)) void tile_groups(
        int NB, int MB, int type, int PRE, const Rounded *a, const uint8_t *weight, int64_t N,
        int64_t n0, int64_t m0, const int8_t *dec, int64_t dec_n0, float *out) {
    const int64_t G = a->G, S = G / 8, rb = row_bytes(type, G);
    const int signed_q = type == Q6_K || type == Q3_K;     /* two scales of 16, no min */
    const int has_z = !signed_q && type != Q2_K;   /* Q2_K: a min per 16, in the group loop */
    const int64_t sc_at = type == Q6_K ? 24 * G : 12 * G, d_at = sc_at + 2 * G;
    const uint8_t *row[MAX_WROWS];
    __m256 acc[MAX_WROWS][MAX_ROWS];
    for (int i = 0; i < NB; ++i) {
        row[i] = weight + (n0 + i) * rb;
        for (int j = 0; j < MB; ++j)
            acc[i][j] = _mm256_setzero_ps();
    }
    const char *ahead = (const char *)(weight + n0 * rb) + PREFETCH_AHEAD;
    for (int64_t g = 0; g < G; g += CHUNK) {
        /* a chunk is one super-block (K-quant rows hold whole super-blocks) */
        const int nblk = CHUNK, lane0 = 0;
        const int64_t base = g, chunk_bytes = NB * rb / (G / CHUNK);
        for (int64_t off = 0; off < chunk_bytes; off += 64)
            _mm_prefetch(ahead + off, _MM_HINT_T0);
        ahead += chunk_bytes;
        __m256 dd[MAX_WROWS][MAX_ROWS], dm[MAX_WROWS][MAX_ROWS];
        for (int i = 0; i < NB; ++i) {
            __m256 dv, z = _mm256_setzero_ps();
            if (type == Q2_K) {
                const uint16_t *d = (const uint16_t *)(row[i] + 10 * G);
                dv = _mm256_set1_ps(_cvtsh_ss(d[g / 8]));
                z = _mm256_set1_ps(-_cvtsh_ss(d[S + g / 8]));
            } else if (signed_q) {
                const uint16_t *d = (const uint16_t *)(row[i] + d_at);
                dv = _mm256_set1_ps(_cvtsh_ss(d[g / 8]));
            } else {
                const uint8_t *p = row[i] + (type == Q4_K ? 16 : 20) * G;
                const uint16_t *d = (const uint16_t *)p;
                const uint8_t *sc = p + 4 * S, *mn = sc + G;
                const int64_t s = g / 8;
                dv = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d[s])), _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + g)))));
                z = _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(d[S + s])), _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + g)))));
            }
            for (int j = 0; j < MB; ++j) {
                const int64_t r = (m0 + j) * a->G_padded + base;
                dd[i][j] = _mm256_mul_ps(dv, _mm256_loadu_ps(a->dx + r));
                if (type == Q2_K)
                    dm[i][j] = _mm256_mul_ps(z, _mm256_loadu_ps(a->dx + r));
                if (has_z)
                    acc[i][j] = _mm256_fmadd_ps(z, _mm256_loadu_ps(a->xsum + r), acc[i][j]);
            }
        }
        for (int b = 0; b < nblk; ++b) {
            const __m256i sel = _mm256_set1_epi32(lane0 + b);
            __m256i x[MAX_ROWS];
            for (int j = 0; j < MB; ++j)
                x[j] = _mm256_loadu_si256((const __m256i *)(a->xq + (m0 + j) * a->K + (g + b) * QK));
            for (int i = 0; i < NB; ++i) {
                const __m256i w = PRE ? _mm256_loadu_si256((const __m256i *)(
                                            dec + (n0 + i - dec_n0) * a->K + (g + b) * QK))
                                      : decode_group(type, row[i], G, g + b);
                __m256i scales16 = _mm256_setzero_si256(), mins16 = scales16;
                if (signed_q) {
                    const int8_t *sc = (const int8_t *)(row[i] + sc_at) + 2 * (g + b);
                    scales16 = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
                }
                if (type == Q2_K) {
                    const uint8_t *sc = row[i] + 8 * G + 2 * (g + b);
                    scales16 = _mm256_set_m128i(_mm_set1_epi16(sc[1] & 0x0F),
                                                _mm_set1_epi16(sc[0] & 0x0F));
                    mins16 = _mm256_set_m128i(_mm_set1_epi16(sc[1] >> 4),
                                              _mm_set1_epi16(sc[0] >> 4));
                }
                for (int j = 0; j < MB; ++j) {
                    acc[i][j] = _mm256_fmadd_ps(dot_group(type, w, x[j], scales16),
                                                _mm256_permutevar8x32_ps(dd[i][j], sel), acc[i][j]);
                    if (type == Q2_K)   /* each half's min times the half's sum of x */
                        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(
                            _mm256_maddubs_epi16(_mm256_set1_epi8(1), x[j]), mins16)),
                            _mm256_permutevar8x32_ps(dm[i][j], sel), acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < NB; ++i)
        for (int j = 0; j < MB; ++j)
            out[(m0 + j) * N + n0 + i] = hsum(acc[i][j]);
}

static inline __attribute__((always_inline)) void tile(
        int NB, int MB, int type, int PRE, const Rounded *a, const uint8_t *weight, int64_t N,
        int64_t n0, int64_t m0, const int8_t *dec, int64_t dec_n0, float *out) {
    if (is_legacy(type))
        tile_legacy(NB, MB, type, PRE, a, weight, N, n0, m0, dec, dec_n0, out);
    else
        tile_groups(NB, MB, type, PRE, a, weight, N, n0, m0, dec, dec_n0, out);
}

#define TILE(NB, MB) tile(NB, MB, TYPE, PRE, a, weight, N, n, m0, dec, n0, out)

/* weight rows [n0, n1) of activation rows [m0, m0 + MB); every (type, MB) pair its own
 * copy, so the inner loops carry no branch */
static inline __attribute__((always_inline)) void rows_tile(
        const int TYPE, const int PRE, int MB, const Rounded *a, const uint8_t *weight,
        int64_t N, int64_t n0, int64_t n1, int64_t m0, const int8_t *dec, float *out) {
    int64_t n = n0;
    if (MB == 1) {      /* one row: four weight rows at once hide the fma latency */
        for (; n + 4 <= n1; n += 4) TILE(4, 1);
        for (; n < n1; ++n) TILE(1, 1);
    } else if (MB == 2) {
        for (; n + 4 <= n1; n += 4) TILE(4, 2);
        for (; n < n1; ++n) TILE(1, 2);
    } else if (MB == 3) {
        for (; n + 2 <= n1; n += 2) TILE(2, 3);
        for (; n < n1; ++n) TILE(1, 3);
    } else {
        for (; n + 2 <= n1; n += 2) TILE(2, 4);
        for (; n < n1; ++n) TILE(1, 4);
    }
}

/* One function per type (PRE: the rows decoded once for the call's tiles; Q8_0 is bytes):
 * each is the (MB, NB) copies of one type's loops, and the compiler optimizes eight
 * functions of that size far faster than one holding all their copies. */
#define TYPE_TILES(T, NAME, WITH_PRE) \
static __attribute__((noinline)) void NAME(int MB, const Rounded *a, const uint8_t *weight, \
        int64_t N, int64_t n0, int64_t n1, int64_t m, const int8_t *dec, float *out) { \
    if (WITH_PRE && dec) rows_tile(T, 1, MB, a, weight, N, n0, n1, m, dec, out); \
    else rows_tile(T, 0, MB, a, weight, N, n0, n1, m, dec, out); \
}
TYPE_TILES(Q4_0, tiles_q4_0, 1)
TYPE_TILES(Q4_1, tiles_q4_1, 1)
TYPE_TILES(Q8_0, tiles_q8_0, 0)
TYPE_TILES(Q5_0, tiles_q5_0, 1)
TYPE_TILES(Q5_1, tiles_q5_1, 1)
TYPE_TILES(Q4_K, tiles_q4_k, 1)
TYPE_TILES(Q5_K, tiles_q5_k, 1)
TYPE_TILES(Q6_K, tiles_q6_k, 1)
TYPE_TILES(Q3_K, tiles_q3_k, 1)
TYPE_TILES(Q2_K, tiles_q2_k, 1)

#define TYPE_CASE(T, NAME) case T: NAME(MB, &a, weight, N, n0, n1, m, dec, out); break

/* Scratch for decoded weight rows, kept per thread between calls. */
static __thread int8_t *decoded_memory;
static __thread size_t decoded_bytes;

static int8_t *decoded_scratch(size_t bytes) {
    if (bytes > decoded_bytes) {
        free(decoded_memory);
        decoded_bytes = (bytes + 4095) & ~(size_t)4095;
        decoded_memory = aligned_alloc(64, decoded_bytes);
        if (decoded_memory == NULL)
            decoded_bytes = 0;
    }
    return decoded_memory;
}

/* weight rows [n0, n1) of a legacy 4- or 5-bit type decoded to bytes [n1 - n0, K], in
 * the rounded activations' order (pairs of blocks as [a lo | b lo | a hi | b hi], an odd
 * G's last block in k order) */
static void decode_legacy_rows(int type, const uint8_t *weight, int64_t K, int64_t n0,
                               int64_t n1, int8_t *dst) {
    const int64_t G = K / QK, rb = row_bytes(type, G);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *values = weight + n * rb;
        int8_t *row = dst + (n - n0) * K;
        int64_t g = 0;
        for (; g + 2 <= G; g += 2) {
            __m256i lo, hi;
            switch (type) {   /* constant types: each decode_pair inlines its own path */
            case Q4_0: case Q4_1: decode_pair(Q4_0, values, G, g, &lo, &hi); break;
            default: decode_pair(Q5_0, values, G, g, &lo, &hi); break;
            }
            _mm256_storeu_si256((__m256i *)(row + g * QK), lo);
            _mm256_storeu_si256((__m256i *)(row + g * QK + 32), hi);
        }
        if (g < G)
            _mm256_storeu_si256((__m256i *)(row + g * QK),
                                is_q5(type) ? decode_block(Q5_0, values, G, g)
                                            : decode_block(Q4_0, values, G, g));
    }
}

/* weight rows [n0, n1) decoded to bytes [n1 - n0, K]: a K-quant's in k order, a legacy
 * type's as decode_legacy_rows lays them out */
static void decode_rows(int type, const uint8_t *weight, int64_t K, int64_t n0, int64_t n1,
                        int8_t *dst) {
    if (is_legacy(type)) {
        decode_legacy_rows(type, weight, K, n0, n1, dst);
        return;
    }
    const int64_t G = K / QK, rb = row_bytes(type, G);
    for (int64_t n = n0; n < n1; ++n)
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t *row = weight + n * rb;
            __m256i w;
            switch (type) {   /* constant types: each decode_group inlines its own path */
            case Q4_K: w = decode_group(Q4_K, row, G, g); break;
            case Q5_K: w = decode_group(Q5_K, row, G, g); break;
            case Q3_K: w = decode_group(Q3_K, row, G, g); break;
            case Q2_K: w = decode_group(Q2_K, row, G, g); break;
            default: w = decode_group(Q6_K, row, G, g); break;
            }
            _mm256_storeu_si256((__m256i *)(dst + (n - n0) * K + g * QK), w);
        }
}

/* Activation rows [m0, m1) x weight rows [n0, n1) of out [M, N] = x [M, K] @ w^T from
 * the rounded activations (GGUF_FN(round_rows)); 0 on success, -2 for an unknown type. */
int GGUF_FN(gguf_tiles)(const int8_t *xq, const float *dx, const float *xsum, int64_t K,
                        const uint8_t *weight, int64_t N, int type, int64_t m0, int64_t m1,
                        int64_t n0, int64_t n1, float *out) {
    const int64_t G = K / QK, G_padded = (G + CHUNK - 1) / CHUNK * CHUNK;
    const Rounded a = {xq, dx, xsum, K, G, G_padded};
    /* prefill: the rows decoded once for every tile of activation rows (the same bytes
     * each tile would decode: results do not change); Q8_0's are bytes already */
    int8_t *dec = NULL;
    if (type != Q8_0 && m1 - m0 > MAX_ROWS && type >= 0 && type <= Q2_K) {
        dec = decoded_scratch((size_t)((n1 - n0) * K));
        if (dec != NULL)
            decode_rows(type, weight, K, n0, n1, dec);
    }
    for (int64_t m = m0; m < m1; m += MAX_ROWS) {
        const int MB = m1 - m < MAX_ROWS ? (int)(m1 - m) : MAX_ROWS;
        switch (type) {
            TYPE_CASE(Q4_0, tiles_q4_0); TYPE_CASE(Q4_1, tiles_q4_1);
            TYPE_CASE(Q8_0, tiles_q8_0); TYPE_CASE(Q5_0, tiles_q5_0);
            TYPE_CASE(Q5_1, tiles_q5_1); TYPE_CASE(Q4_K, tiles_q4_k);
            TYPE_CASE(Q5_K, tiles_q5_k); TYPE_CASE(Q6_K, tiles_q6_k);
            TYPE_CASE(Q3_K, tiles_q3_k); TYPE_CASE(Q2_K, tiles_q2_k);
            default: return -2;
        }
    }
    return 0;
}

/* x rows [0, M) -> xq, dx, xsum (the header's rounding; pairs interleaved for the legacy
 * 4-bit types); dx and xsum [M, G_padded] with G_padded = G rounded up to 8. */
void GGUF_FN(gguf_round)(const float *x, int64_t M, int64_t K, int type, int8_t *xq,
                         float *dx, float *xsum) {
    const int64_t G = K / QK, G_padded = (G + CHUNK - 1) / CHUNK * CHUNK;
    round_rows(x, M, K, is_legacy(type) && type != Q8_0, xq, dx, xsum, G_padded);
}

/* ---- float32 weights: out = x @ w^T for a few activation rows (decode) ----
 * Each output element is one dot product of an activation row and a weight row, summed in
 * 16 lanes over 16-float steps of k in order (one 512-bit register, or two 256-bit ones),
 * the lanes l and l + 8 added, one horizontal sum, then the k % 16 tail in order: fixed
 * by K alone, whatever the tile, thread split or ISA build (the same INVARIANT as above).
 * Bound by the weight stream: each weight row streams once per tile of up to 4 activation
 * rows, prefetched PREFETCH_AHEAD bytes ahead, once per cache line.
 * NOTE: one weight row at a time: the weight is read as one sequential stream (several
 * rows at once, as the quantized tiles do, read measurably slower in fp32). */
#ifdef GGUF_VNNI
/* 16 lanes: lane l holds k = l (mod 16); its halves added are the AVX2 path's lo + hi */
typedef __m512 f32_acc;
#define ACC_ZERO() _mm512_setzero_ps()
#define ACC_LOAD(p) _mm512_loadu_ps(p)
#define ACC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ACC_HALVES(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps( \
                                    _mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
#else
/* two sets of 8 lanes: lo holds k = l (mod 16), hi k = l + 8 (mod 16) */
typedef struct { __m256 lo, hi; } f32_acc;
static inline f32_acc acc_zero(void) {
    f32_acc a = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return a;
}
static inline f32_acc acc_load(const float *p) {
    f32_acc a = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return a;
}
static inline f32_acc acc_fma(f32_acc a, f32_acc b, f32_acc c) {
    f32_acc r = {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
    return r;
}
#define ACC_ZERO() acc_zero()
#define ACC_LOAD(p) acc_load(p)
#define ACC_FMA(a, b, c) acc_fma(a, b, c)
#define ACC_HALVES(v) _mm256_add_ps((v).lo, (v).hi)
#endif

/* weight row n against activation rows [m0, m0 + MB) */
static inline __attribute__((always_inline)) void f32_row(
        int MB, const float *x, int64_t K, const float *w, int64_t N, int64_t n, int64_t m0,
        float *out) {
    const float *row = w + n * K;
    f32_acc acc[MAX_ROWS];
    for (int j = 0; j < MB; ++j)
        acc[j] = ACC_ZERO();
    const int64_t K16 = K / 16 * 16;
    for (int64_t k = 0; k < K16; k += 16) {
        _mm_prefetch((const char *)(row + k) + PREFETCH_AHEAD, _MM_HINT_T0);
        const f32_acc wv = ACC_LOAD(row + k);
        for (int j = 0; j < MB; ++j)
            acc[j] = ACC_FMA(wv, ACC_LOAD(x + (m0 + j) * K + k), acc[j]);
    }
    for (int j = 0; j < MB; ++j) {
        float sum = hsum(ACC_HALVES(acc[j]));
        for (int64_t k = K16; k < K; ++k)
            sum = fmaf(row[k], x[(m0 + j) * K + k], sum);
        out[(m0 + j) * N + n] = sum;
    }
}

/* weight rows [n0, n1) against activation rows [m0, m0 + MB): each MB its own copy */
static __attribute__((noinline)) void f32_rows(int MB, const float *x, int64_t K,
                                               const float *w, int64_t N, int64_t n0,
                                               int64_t n1, int64_t m0, float *out) {
    for (int64_t n = n0; n < n1; ++n) {
        switch (MB) {
        case 1: f32_row(1, x, K, w, N, n, m0, out); break;
        case 2: f32_row(2, x, K, w, N, n, m0, out); break;
        case 3: f32_row(3, x, K, w, N, n, m0, out); break;
        default: f32_row(4, x, K, w, N, n, m0, out); break;
        }
    }
}

/* out [M, N] rows [m0, m1) x columns [n0, n1) of x [M, K] @ w [N, K]^T, both fp32 */
void GGUF_FN(f32_gemv)(const float *x, int64_t K, const float *w, int64_t N, int64_t m0,
                       int64_t m1, int64_t n0, int64_t n1, float *out) {
    for (int64_t m = m0; m < m1; m += MAX_ROWS) {
        const int MB = m1 - m < MAX_ROWS ? (int)(m1 - m) : MAX_ROWS;
        f32_rows(MB, x, K, w, N, n0, n1, m, out);
    }
}

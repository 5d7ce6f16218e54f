/* rung::paged_decode_attention's kernel: one query token per request (decode) over its
 * request's paged KV cache, read in place, block by block, up to its own length. A compiled
 * graph's traced attention (kernels/torch_backend.py paged_attention_fusable) reads every
 * block of the batch's cut table and recomputes scores inside a fused softmax; this reads
 * each request's visible keys once. The op around it is csrc/gguf_op.cpp's (one task per
 * (request, KV head) on torch's intra-op pool), its schema and Meta kernel are in
 * kernels/gguf_cpu.py, its use in kernels/cpu_attention.py, its reference in
 * kernels/torch_backend.py.
 *
 * INVARIANT (batch invariance): a task's result depends on its own query, keys and values
 * alone: keys in order, a fixed reduction per dot product; neither the batch, its padding
 * nor the thread split changes a bit of it.
 *
 * Layouts: q [g, hd] (the g query heads of one KV head), the K and V halves of the cache
 * [NB, bs, kvh, hd] each, blocks [nb] the request's block-table row, out [g, hd].
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* a . b over n floats: 8 lanes, then a fixed pairwise sum (the same order every call) */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float sum = _mm_cvtss_f32(s);
    for (; i < n; ++i)
        sum += a[i] * b[i];
    return sum;
}

/* y += a x over n floats */
static inline void axpy(float a, const float *x, float *y, int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i),
                                                _mm256_loadu_ps(y + i)));
    for (; i < n; ++i)
        y[i] += a * x[i];
}

/* Keys [first, len) of one request for KV head h: out [g, hd] = softmax(q k^T scale
 * (soft-capped where softcap > 0)) v, each query head its own row; scores [g, len - first]
 * is the caller's scratch. Returns -1 (nothing written) if a block lies outside [0, NB). */
int cpu_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *blocks, int64_t first, int64_t len, int64_t NB,
                         int64_t bs, int64_t kvh, int64_t h, int64_t hd, int64_t g,
                         float scale, float softcap, float *scores, float *out) {
    const int64_t L = len - first;
    for (int64_t b = first / bs; b <= (len - 1) / bs; ++b)   /* the blocks keys are read from */
        if (blocks[b] < 0 || blocks[b] >= NB)
            return -1;
    for (int64_t j = first; j < len; ++j) {
        const float *k = k_cache + (((int64_t)blocks[j / bs] * bs + j % bs) * kvh + h) * hd;
        for (int64_t i = 0; i < g; ++i) {
            float s = dot(q + i * hd, k, hd) * scale;
            if (softcap > 0.0f)
                s = softcap * tanhf(s / softcap);
            scores[i * L + (j - first)] = s;
        }
    }
    for (int64_t i = 0; i < g; ++i) {
        float *s = scores + i * L, top = s[0], sum = 0.0f;
        for (int64_t j = 1; j < L; ++j)
            top = s[j] > top ? s[j] : top;
        for (int64_t j = 0; j < L; ++j) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        float *o = out + i * hd;
        for (int64_t d = 0; d < hd; ++d)
            o[d] = 0.0f;
        for (int64_t j = first; j < len; ++j)
            axpy(s[j - first] / sum,
                 v_cache + (((int64_t)blocks[j / bs] * bs + j % bs) * kvh + h) * hd, o, hd);
    }
    return 0;
}

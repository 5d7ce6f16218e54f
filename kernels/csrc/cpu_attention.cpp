// rung::paged_decode_attention's CPU kernel: one query token per request (decode) over its
// request's paged KV cache, read in place, block by block, up to its own length. A compiled
// graph's traced attention (kernels/torch_backend.py paged_attention_fusable) reads every
// block of the batch's cut table and recomputes scores inside a fused softmax; this reads
// each request's visible keys once. Its schema and Meta kernel are in kernels/gguf_cpu.py,
// its use in kernels/cpu_attention.py, its reference in kernels/torch_backend.py.
//
// INVARIANT (batch invariance): a token's result depends on its own query, keys and values
// alone: one task per (request, KV head), keys in order, a fixed reduction per dot product;
// neither the batch, its padding nor the thread count changes a bit of it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// q . k over head_dim: 8 lanes, then a fixed pairwise sum (the same order every call)
__attribute__((target("avx2,fma"))) inline float dot(const float *a, const float *b,
                                                      int64_t n) {
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

// y += a x over head_dim
__attribute__((target("avx2,fma"))) inline void axpy(float a, const float *x, float *y,
                                                       int64_t n) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i),
                                                _mm256_loadu_ps(y + i)));
    for (; i < n; ++i)
        y[i] += a * x[i];
}

// query [T, H, hd] fp32 (token t: request row t), kv_cache [2, NB, bs, kvh, hd] fp32,
// block_table [T, nb] int32, seq_lens [T] int32 (0: a pad row, whose output is 0)
at::Tensor paged_decode_attention_cpu(const at::Tensor &query, const at::Tensor &kv_cache,
                                      const at::Tensor &block_table, const at::Tensor &seq_lens,
                                      double scale, int64_t sliding_window, double softcap) {
    TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_table.dim() == 2 &&
                    seq_lens.dim() == 1,
                "rung::paged_decode_attention takes query [T, H, hd], kv_cache [2, NB, bs, "
                "kvh, hd], block_table [T, nb] and seq_lens [T]");
    TORCH_CHECK(query.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat,
                "rung::paged_decode_attention takes a float32 query and KV cache");
    TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
                "rung::paged_decode_attention takes int32 block_table and seq_lens");
    const at::Tensor q = query.contiguous(), kv = kv_cache.contiguous();
    const at::Tensor table = block_table.contiguous(), lens = seq_lens.contiguous();
    const int64_t T = q.size(0), H = q.size(1), hd = q.size(2);
    const int64_t NB = kv.size(1), bs = kv.size(2), kvh = kv.size(3), nb = table.size(1);
    TORCH_CHECK(table.size(0) == T && lens.size(0) == T,
                "rung::paged_decode_attention: one block-table row and seq_len per token, got ",
                table.size(0), " and ", lens.size(0), " for ", T, " tokens");
    TORCH_CHECK(kv.size(4) == hd && H % kvh == 0, "rung::paged_decode_attention: query ",
                q.sizes(), " does not match kv_cache ", kv.sizes());
    const int64_t g = H / kvh;
    at::Tensor out = at::zeros({T, H, hd}, q.options());
    const float *qp = q.data_ptr<float>(), *kp = kv.data_ptr<float>();
    const float *vp = kp + NB * bs * kvh * hd;
    const int32_t *tp = table.data_ptr<int32_t>(), *lp = lens.data_ptr<int32_t>();
    float *op = out.data_ptr<float>();
    const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
    at::parallel_for(0, T * kvh, 1, [&](int64_t b, int64_t e) {
        std::vector<float> scores;
        for (int64_t task = b; task < e; ++task) {
            const int64_t t = task / kvh, h = task % kvh;
            const int64_t len = std::min<int64_t>(lp[t], nb * bs);
            if (len <= 0)
                continue;                               // a pad row: 0, as the reference
            const int64_t first =
                sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
            const int64_t L = len - first;
            scores.assign(static_cast<size_t>(g * L), 0.0f);
            for (int64_t j = first; j < len; ++j) {
                const int64_t block = tp[t * nb + j / bs];
                TORCH_CHECK(block >= 0 && block < NB, "rung::paged_decode_attention: block ",
                            block, " of token ", t, " is outside the cache's ", NB, " blocks");
                const float *k = kp + ((block * bs + j % bs) * kvh + h) * hd;
                for (int64_t i = 0; i < g; ++i) {
                    float s = dot(qp + (t * H + h * g + i) * hd, k, hd) * fscale;
                    if (cap > 0.0f)
                        s = cap * std::tanh(s / cap);
                    scores[i * L + (j - first)] = s;
                }
            }
            for (int64_t i = 0; i < g; ++i) {
                float *s = scores.data() + i * L;
                const float top = *std::max_element(s, s + L);
                float sum = 0.0f;
                for (int64_t j = 0; j < L; ++j) {
                    s[j] = std::exp(s[j] - top);
                    sum += s[j];
                }
                float *o = op + (t * H + h * g + i) * hd;
                for (int64_t j = first; j < len; ++j) {
                    const int64_t block = tp[t * nb + j / bs];
                    axpy(s[j - first] / sum, vp + ((block * bs + j % bs) * kvh + h) * hd, o, hd);
                }
            }
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rung, CPU, m) {
    m.impl("paged_decode_attention", paged_decode_attention_cpu);
}

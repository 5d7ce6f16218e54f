// rung::gguf_gemm's, rung::f32_linear's and rung::paged_decode_attention's CPU kernels in
// C++: the dispatcher calls csrc/gguf_gemm.c (csrc/cpu_attention.c) straight, with no
// Python in between (a compiled decode step makes ~120 of these calls, and a Python
// kernel would add its interpreter to each). gguf_gemm
// rounds the activations once per call, then splits the output over torch's intra-op
// pool (the engine's thread count; never a pool of its own): weight-row chunks for a few
// activation rows (decode), (weight-row chunk x activation-row tile) for prefill. The
// split never changes an output element's accumulation order (csrc/gguf_gemm.c's
// INVARIANT), so results do not depend on the thread count.
// The schema and the Meta kernel are defined in kernels/gguf_cpu.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <vector>

extern "C" {
int gguf_tiles_avx2(const int8_t *xq, const float *dx, const float *xsum, int64_t K,
                    const uint8_t *weight, int64_t N, int type, int64_t m0, int64_t m1,
                    int64_t n0, int64_t n1, float *out);
int gguf_tiles_vnni(const int8_t *xq, const float *dx, const float *xsum, int64_t K,
                    const uint8_t *weight, int64_t N, int type, int64_t m0, int64_t m1,
                    int64_t n0, int64_t n1, float *out);
void gguf_round_avx2(const float *x, int64_t M, int64_t K, int type, int8_t *xq, float *dx,
                     float *xsum);
void gguf_round_vnni(const float *x, int64_t M, int64_t K, int type, int8_t *xq, float *dx,
                     float *xsum);
void f32_gemv_avx2(const float *x, int64_t K, const float *w, int64_t N, int64_t m0,
                   int64_t m1, int64_t n0, int64_t n1, float *out);
void f32_gemv_vnni(const float *x, int64_t K, const float *w, int64_t N, int64_t m0,
                   int64_t m1, int64_t n0, int64_t n1, float *out);
int cpu_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                         const int32_t *blocks, int64_t first, int64_t len, int64_t NB,
                         int64_t bs, int64_t kvh, int64_t h, int64_t hd, int64_t g,
                         float scale, float softcap, float *scores, float *out);
}

namespace {

constexpr int64_t kGroup = 32, kChunk = 8;
constexpr int64_t kNumTypes = 10;            // kernels/gguf_cpu.py TYPE_CODES
constexpr int64_t kDecodeRows = 4;          // up to this many activation rows: split weight rows
constexpr int64_t kRowTile = 128;           // prefill: activation rows of a task
constexpr int64_t kWeightChunk = 16;        // prefill: weight rows of a task (stay in L1/L2)
constexpr int64_t kGemvRows = 16;           // f32_linear: activation rows through f32_gemv
constexpr int64_t kGemvBlock = 32;          // f32_linear: weight rows reused across row tiles

bool cpu_has_vnni() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
}

// -1: the best path this CPU runs; 0: AVX2 forced (rung_gguf_set_isa, RUNG_GGUF_ISA=avx2)
std::atomic<int> forced_isa{-1};

bool use_vnni() {
    static const bool has = cpu_has_vnni();
    return has && forced_isa.load(std::memory_order_relaxed) != 0;
}

// x [M, K] fp32, rows [N, row bytes] uint8 -> out [M, N] fp32
at::Tensor gguf_gemm_cpu(const at::Tensor &x, const at::Tensor &rows, int64_t code) {
    TORCH_CHECK(x.dim() == 2 && rows.dim() == 2, "rung::gguf_gemm takes 2-d x and rows, got ",
                x.sizes(), " and ", rows.sizes());
    TORCH_CHECK(rows.scalar_type() == at::kByte && rows.is_contiguous(),
                "rung::gguf_gemm takes contiguous uint8 rows");
    TORCH_CHECK(code >= 0 && code < kNumTypes, "gguf_gemm: unknown block type code ", code);
    TORCH_CHECK(x.size(1) % kGroup == 0, "gguf_gemm: K = ", x.size(1),
                " is not a multiple of ", kGroup);
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    const int64_t M = xf.size(0), K = xf.size(1), N = rows.size(0);
    const int64_t G_padded = (K / kGroup + kChunk - 1) / kChunk * kChunk;
    at::Tensor out = at::empty({M, N}, xf.options());
    if (M == 0 || N == 0)
        return out;
    const bool vnni = use_vnni();
    const auto tiles = vnni ? gguf_tiles_vnni : gguf_tiles_avx2;
    const auto round = vnni ? gguf_round_vnni : gguf_round_avx2;
    const int type = static_cast<int>(code);

    // NOTE: scratch kept per calling thread: no allocation on a decode step's hot path
    thread_local std::vector<int64_t> scratch;
    const int64_t xq_bytes = (M * K + 63) / 64 * 64;
    const int64_t bytes = xq_bytes + static_cast<int64_t>(sizeof(float)) * 2 * M * G_padded;
    scratch.resize(std::max<size_t>(scratch.size(), (bytes + 7) / 8));
    auto *xq = reinterpret_cast<int8_t *>(scratch.data());
    auto *dx = reinterpret_cast<float *>(reinterpret_cast<char *>(scratch.data()) + xq_bytes);
    float *xsum = dx + M * G_padded;

    const float *xp = xf.data_ptr<float>();
    at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
        round(xp + b * K, e - b, K, type, xq + b * K, dx + b * G_padded, xsum + b * G_padded);
    });
    // xq / dx / xsum rows start at row 0 for the tile kernel; it indexes rows itself
    const uint8_t *w = rows.data_ptr<uint8_t>();
    float *o = out.data_ptr<float>();
    std::atomic<int> status{0};
    if (M <= kDecodeRows) {
        // weight rows in fours, each thread a contiguous range (its prefetch stays ahead)
        const int64_t units = (N + 3) / 4;
        at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
            if (tiles(xq, dx, xsum, K, w, N, type, 0, M, 4 * b, std::min(N, 4 * e), o))
                status = 1;
        });
    } else {
        const int64_t m_tiles = (M + kRowTile - 1) / kRowTile;
        const int64_t n_chunks = (N + kWeightChunk - 1) / kWeightChunk;
        // task t: weight chunk t / m_tiles, row tile t % m_tiles (a chunk's weights, decoded
        // once a task, are reused across its row tiles)
        at::parallel_for(0, m_tiles * n_chunks, 1, [&](int64_t b, int64_t e) {
            for (int64_t t = b; t < e; ++t) {
                const int64_t n0 = t / m_tiles * kWeightChunk, m0 = t % m_tiles * kRowTile;
                if (tiles(xq, dx, xsum, K, w, N, type, m0, std::min(M, m0 + kRowTile), n0,
                          std::min(N, n0 + kWeightChunk), o))
                    status = 1;
            }
        });
    }
    TORCH_CHECK(status == 0, "gguf_gemm: unknown block type code ", code);
    return out;
}

// x [M, K] fp32 @ w [N, K] fp32 row-major ^T -> [M, N] fp32: up to kGemvRows activation
// rows stream the weight rows through csrc/gguf_gemm.c's f32_gemv, split like the decode
// above (BLAS's GEMV reads a [K, N] W^T well under the memory bandwidth, and its GEMM
// re-reads the weight per few rows); more rows are a GEMM, BLAS's own.
at::Tensor f32_linear_cpu(const at::Tensor &x, const at::Tensor &w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
                "rung::f32_linear takes x [M, K] and w [N, K], got ", x.sizes(), " and ",
                w.sizes());
    TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                "rung::f32_linear takes float32 x and w");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    if (M > kGemvRows)
        return at::mm(x, w.t());
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    at::Tensor out = at::empty({M, N}, xc.options());
    if (M == 0 || N == 0)
        return out;
    const auto gemv = use_vnni() ? f32_gemv_vnni : f32_gemv_avx2;
    const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
    float *o = out.data_ptr<float>();
    // NOTE: a task's weight rows stay in L2 across its tiles of 4 activation rows
    const int64_t units = (N + 3) / 4;
    at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
        for (int64_t n0 = 4 * b; n0 < std::min(N, 4 * e); n0 += kGemvBlock)
            gemv(xp, K, wp, N, 0, M, n0, std::min({N, 4 * e, n0 + kGemvBlock}), o);
    });
    return out;
}

// query [T, H, hd] fp32 (token t: block-table row t), kv_cache [2, NB, bs, kvh, hd] fp32,
// block_table [T, nb] int32, seq_lens [T] int32 (0: a pad row, whose output is 0) ->
// [T, H, hd]: csrc/cpu_attention.c per (token, KV head), split over torch's intra-op pool
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
    TORCH_CHECK(kv.size(0) == 2 && kv.size(4) == hd && H % kvh == 0,
                "rung::paged_decode_attention: query ", q.sizes(), " does not match kv_cache ",
                kv.sizes());
    const int64_t g = H / kvh;
    at::Tensor out = at::zeros({T, H, hd}, q.options());
    const float *qp = q.data_ptr<float>(), *kp = kv.data_ptr<float>();
    const float *vp = kp + NB * bs * kvh * hd;
    const int32_t *tp = table.data_ptr<int32_t>(), *lp = lens.data_ptr<int32_t>();
    float *op = out.data_ptr<float>();
    std::atomic<int64_t> bad_token{-1};
    at::parallel_for(0, T * kvh, 1, [&](int64_t b, int64_t e) {
        std::vector<float> scores;
        for (int64_t task = b; task < e; ++task) {
            const int64_t t = task / kvh, h = task % kvh;
            const int64_t len = std::min<int64_t>(lp[t], nb * bs);
            if (len <= 0)
                continue;                               // a pad row: 0, as the reference
            const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window)
                                                     : 0;
            scores.resize(static_cast<size_t>(g * (len - first)));
            if (cpu_decode_attention(qp + (t * H + h * g) * hd, kp, vp, tp + t * nb, first, len,
                                     NB, bs, kvh, h, hd, g, static_cast<float>(scale),
                                     static_cast<float>(softcap), scores.data(),
                                     op + (t * H + h * g) * hd))
                bad_token = t;
        }
    });
    TORCH_CHECK(bad_token < 0, "rung::paged_decode_attention: a block of token ",
                bad_token.load(), "'s table row is outside the cache's ", NB, " blocks");
    return out;
}

}  // namespace

// which path runs (0 AVX2, 1 AVX-512 VNNI), and forcing one: kernels/gguf_cpu.py set_isa
extern "C" int rung_gguf_isa() { return use_vnni() ? 1 : 0; }
extern "C" void rung_gguf_set_isa(int isa) { forced_isa = isa; }

TORCH_LIBRARY_IMPL(rung, CPU, m) {
    m.impl("gguf_gemm", gguf_gemm_cpu);
    m.impl("f32_linear", f32_linear_cpu);
    m.impl("paged_decode_attention", paged_decode_attention_cpu);
}

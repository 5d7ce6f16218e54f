// rung::gguf_gemm's and rung::f32_linear's CPU kernels in C++: the dispatcher calls
// csrc/gguf_gemm.c straight, with no Python in between (a compiled decode step makes ~120
// of these calls, and a Python kernel would add its interpreter to each). gguf_gemm
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

}  // namespace

// which path runs (0 AVX2, 1 AVX-512 VNNI), and forcing one: kernels/gguf_cpu.py set_isa
extern "C" int rung_gguf_isa() { return use_vnni() ? 1 : 0; }
extern "C" void rung_gguf_set_isa(int isa) { forced_isa = isa; }

TORCH_LIBRARY_IMPL(rung, CPU, m) {
    m.impl("gguf_gemm", gguf_gemm_cpu);
    m.impl("f32_linear", f32_linear_cpu);
}

// rung::gguf_gemm's CPU kernel in C++: the dispatcher calls csrc/gguf_gemm.c straight,
// with no Python in between. A compiled decode step makes ~120 of these calls; through a
// Python kernel each cost ~10 us more than an aten op's call (kernels/gguf_cpu.py).
// The schema and the Meta kernel are defined in kernels/gguf_cpu.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" int gguf_gemm(const float *x, int64_t M, int64_t K, const uint8_t *weight,
                         int64_t N, int type, float *out);

namespace {

// x [M, K] fp32, rows [N, K / 32 * block bytes] uint8 -> out [M, N] fp32
at::Tensor gguf_gemm_cpu(const at::Tensor &x, const at::Tensor &rows, int64_t code) {
    TORCH_CHECK(x.dim() == 2 && rows.dim() == 2, "rung::gguf_gemm takes 2-d x and rows, got ",
                x.sizes(), " and ", rows.sizes());
    TORCH_CHECK(rows.scalar_type() == at::kByte && rows.is_contiguous(),
                "rung::gguf_gemm takes contiguous uint8 rows");
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({xf.size(0), rows.size(0)}, xf.options());
    const int status = gguf_gemm(xf.data_ptr<float>(), xf.size(0), xf.size(1),
                                 rows.data_ptr<uint8_t>(), rows.size(0), static_cast<int>(code),
                                 out.data_ptr<float>());
    TORCH_CHECK(status != -1, "gguf_gemm: no scratch memory for ", xf.size(0), " x ",
                xf.size(1), " rows");
    TORCH_CHECK(status == 0, "gguf_gemm: unknown block type code ", code);
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rung, CPU, m) { m.impl("gguf_gemm", gguf_gemm_cpu); }

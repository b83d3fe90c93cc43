// The Python face of the CPU low-bit kernels (built, probed and called by kernels/cpu_lowbit.py).
#include <torch/extension.h>

#include "simd.h"

namespace minillm {
at::Tensor q4_1_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool reference);
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool reference);
at::Tensor paged_int8_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& k_scale,
                             const at::Tensor& v_pool, const at::Tensor& v_scale, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale);
}  // namespace minillm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_matmul", &minillm::q4_1_matmul, "x (..., K) @ repacked Q4_1 weights.T -> (..., N), x's dtype");
  m.def("int8_matmul", &minillm::int8_matmul, "x (..., K) @ repacked int8 weights.T -> (..., N), x's dtype");
  m.def("paged_int8_decode", &minillm::paged_int8_decode,
        "decode attention (one query per sequence) read from an int8 paged KV pool and its float16 scales");
  m.attr("isa") = minillm::kIsa;
  m.attr("rows") = minillm::kRows;  // weight rows per repacked group: the layout repack_* must build
}

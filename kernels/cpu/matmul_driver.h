// What the two low-bit matmuls share around their inner loops (lesson 07): quantize the activations, walk the
// repacked weight groups in parallel, hand each group up to kTile activation rows, write the outputs.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "q8_activations.h"
#include "simd.h"

namespace minillm {

struct QuantizedRows {  // x after quantize_row_q8: M rows
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K;
  int64_t blocks;
};

// f(std::integral_constant<int, MT>) for MT = mt (1..kTile): the inner loops are templates on the tile height, so
// the compiler keeps the MT accumulators in registers
template <typename F>
void with_tile(int64_t mt, F&& f) {
  switch (mt) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// y (..., N) in x's dtype = x (..., K) @ W.T, W repacked as (ceil(N / kRows), K / 32, group_bytes) uint8 (`what`
// names the repack function in errors). group(block_ptr, rows, m0, tile_of_MT) is called as
// group.template operator()<MT>(...) for every group of weight rows and tile of activation rows.
template <typename Group>
at::Tensor lowbit_matmul(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, int64_t group_bytes,
                         const char* what, Group&& group) {
  TORCH_CHECK(x_in.dim() >= 1, "x must be (..., K)");
  const int64_t K = x_in.size(-1), M = x_in.numel() / std::max<int64_t>(K, 1), groups = (N + kRows - 1) / kRows;
  TORCH_CHECK(K % kBlock == 0, "K = ", K, " must be a multiple of 32 (the blocks of 32 inputs that share a scale)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == groups && packed.size(1) == K / kBlock && packed.size(2) == group_bytes,
              "packed must be ", what, "'s contiguous uint8 (", groups, ", ", K / kBlock, ", ", group_bytes,
              "), got ", packed.sizes());
  const at::Tensor x = x_in.reshape({M, K}).to(at::kFloat).contiguous();
  const int64_t blocks = K / kBlock;
  at::Tensor xq = at::empty({M, K}, at::kChar), xd = at::empty({M, blocks}, at::kFloat);
  at::Tensor xs = at::empty({M, blocks}, at::kFloat);
  for (int64_t m = 0; m < M; ++m)
    quantize_row_q8(x.data_ptr<float>() + m * K, K, xq.data_ptr<int8_t>() + m * K, xd.data_ptr<float>() + m * blocks,
                    xs.data_ptr<float>() + m * blocks);
  const QuantizedRows rows{xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(), K, blocks};
  at::Tensor y = at::empty({M, N}, at::kFloat);
  float* out = y.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    float tile[kTile * kRows];
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* weights = w + g * blocks * group_bytes;
      const int64_t valid = std::min(kRows, N - g * kRows);  // the last group may be padding past N
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t mt = std::min<int64_t>(kTile, M - m0);
        with_tile(mt, [&](auto tile_rows) { group.template operator()<decltype(tile_rows)::value>(weights, rows, m0, tile); });
        for (int64_t t = 0; t < mt; ++t)
          std::memcpy(out + (m0 + t) * N + g * kRows, tile + t * kRows, valid * sizeof(float));
      }
    }
  });
  std::vector<int64_t> shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape).to(x_in.scalar_type());
}

}  // namespace minillm

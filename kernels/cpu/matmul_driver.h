// What the two low-bit matmuls share around their inner loops (lesson 07): the quantized activation rows, and the
// loop that hands each repacked group of weight rows up to kTile activation rows at a time. Plain C++ (no torch
// headers: the one unit that includes them is bindings.cpp), so a kernel file compiles in seconds.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

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

// y (M, N) row-major, columns of groups [g0, g1) = x (M rows) @ W.T, W repacked as (ceil(N / kRows), blocks,
// group_bytes). group(block_ptr, x, m0, tile) is called as group.template operator()<MT>(...) for every group of
// weight rows and tile of activation rows: each group's bytes are read once for every M.
template <typename Group>
void matmul_groups(const QuantizedRows& x, int64_t M, const uint8_t* w, int64_t N, int64_t group_bytes, int64_t g0,
                   int64_t g1, float* y, Group&& group) {
  float tile[kTile * kRows];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* weights = w + g * x.blocks * group_bytes;
    const int64_t valid = std::min(kRows, N - g * kRows);  // the last group may be padding past N
    for (int64_t m0 = 0; m0 < M; m0 += kTile) {
      const int64_t mt = std::min<int64_t>(kTile, M - m0);
      with_tile(mt, [&](auto rows) { group.template operator()<decltype(rows)::value>(weights, x, m0, tile); });
      for (int64_t t = 0; t < mt; ++t) std::memcpy(y + (m0 + t) * N + g * kRows, tile + t * kRows, valid * 4);
    }
  }
}

}  // namespace minillm

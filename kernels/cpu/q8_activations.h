// Activations quantized to int8 per block of 32, as llama.cpp's Q8 formats do (lesson 07).
//
// Why: an integer SIMD dot product (AVX2 maddubs, AVX-512/AVX VNNI dpbusd) multiplies 32 byte pairs in one to three
// instructions; a float kernel must first widen every 4-bit weight to a float. Quantizing the activations costs K
// roundings per row, once per call, against N*K multiply-adds that become integer ones.
//
// One row of K activations (K a multiple of 32), for each block b of 32:
//   q[b*32 .. b*32+32)  int8 codes in [-127, 127], x ~= q * d[b], d[b] = max|x| / 127 over the block
//   d[b]                float32 scale
//   s[b] = d[b] * sum(q) float32: the block sum that a Q4_1 minimum multiplies (minimum * sum(x) over the block)
#pragma once

#include <cmath>
#include <cstdint>

namespace minillm {

constexpr int64_t kBlock = 32;  // weights (and activations) per scale
constexpr int64_t kRows = 8;    // weight rows interleaved in the repacked layouts: one per int32 lane of AVX2

inline void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;  // an all-zero block: codes 0, any scale is exact
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int32_t code = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      q[b * kBlock + i] = static_cast<int8_t>(code);
      sum += code;
    }
    d[b] = amax / 127.f;
    s[b] = d[b] * static_cast<float>(sum);
  }
}

}  // namespace minillm

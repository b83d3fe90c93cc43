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
#include <limits>

#include "simd.h"

namespace minillm {

constexpr int64_t kBlock = 32;  // weights (and activations) per scale


inline void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    // written so the compiler vectorizes it (a per-token cost of the native step): a max reduction, not std::fmax
    // (a library call for its NaN rules), and the finiteness test as one sum, NaN if any value is NaN or infinite
    float amax = 0.f, poison = 0.f;
#if defined(MINILLM_SIMD)
    // in lane vectors by hand: GCC left some inlined copies of the pragma loop below scalar (a per-token cost)
    VecF top = zero_f(), nan_or_inf = zero_f();
    for (int i = 0; i < kBlock; i += kRows) {
      const VecF v = load_f(xb + i);
      top = max_f(top, abs_f(v));  // a NaN may be dropped here: nan_or_inf carries it
      nan_or_inf = fma_f(v, zero_f(), nan_or_inf);
    }
    amax = max_of(top);
    poison = sum_f(nan_or_inf);
#else
#pragma omp simd reduction(max : amax) reduction(+ : poison)
    for (int i = 0; i < kBlock; ++i) {
      const float a = std::fabs(xb[i]);
      amax = a > amax ? a : amax;
      poison += xb[i] * 0.f;
    }
#endif
    const bool finite = poison == 0.f;
    // an all-zero block: codes 0, any scale is exact; a block below ~1e-36 (127 / amax overflows) counts as zero
    const float inv = finite && amax > 0.f && std::isfinite(127.f / amax) ? 127.f / amax : 0.f;
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < kBlock; ++i) {
      const int32_t code = finite ? static_cast<int32_t>(std::nearbyint(xb[i] * inv)) : 0;
      q[b * kBlock + i] = static_cast<int8_t>(code);
      sum += code;
    }
    // a NaN or inf in the block must reach the output as NaN, as a float matmul would not hide it either
    d[b] = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    s[b] = d[b] * static_cast<float>(sum);
  }
}

}  // namespace minillm

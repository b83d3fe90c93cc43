// Arithmetic the attention kernels share (int8_kv_attention.cpp, native_step.cpp). Plain C++.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace minillm {

// e^x for x <= 0 (softmax numerators), in plain arithmetic the compiler vectorizes (std::exp is a library call it
// will not): x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (about 1 ulp), 2^n through the bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // below: 0 would do, the sum stays > 0 through the maximum's own e^0 = 1
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer (no -ffast-math here)
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts, exact n * hi
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &shifted, 4);  // the integer n sits in the low mantissa bits of `shifted`
  const int32_t scale_bits = (bits - 0x4B400000 + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &scale_bits, 4);
  return p * two_n;
}

}  // namespace minillm

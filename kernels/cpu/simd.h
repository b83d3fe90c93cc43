// The lane vector the low-bit kernels are written in, per instruction set (lesson 07).
//
// A lane vector holds one int32 or float per weight row of a repacked group: kRows = 16 lanes in a 512-bit register
// (AVX-512), 8 in a 256-bit one (AVX2, AVX-VNNI). The kernels are written once against these few operations:
//
//   dot_add(acc, u, s)  acc + per lane, the sum of 4 products (unsigned byte of u) * (signed byte of s)
//       AVX-512 VNNI / AVX-VNNI: vpdpbusd, one instruction.
//       AVX2: vpmaddubsw (byte pairs -> int16, saturating; our operands keep 2 * 127 * 127 = 32258 in range), vpmaddwd
//       by 1 (int16 pairs -> int32), vpaddd.
//   broadcast4(q)       the 4 activation bytes q[0..4) in every lane: the same inputs face every weight row
//   dot_block_u4(c, q)  eight dot_adds of one 4-bit block (32 codes < 16 per lane), with VNNI (q4_1_matmul.cpp
//                       has its own loop for AVX2 without it)
//   sign_of(x, w)       x with the sign of w moved onto it (w * x = |w| * sign_of(x, w)), for int8 weights
//
// Which one is compiled is chosen by the flags kernels/cpu_lowbit.py passes, from the CPU's own feature list: one
// build per instruction set, cached. Without AVX2 the plain loops (the reference) run, vectorized by the compiler.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define MINILLM_AVX512 1
#define MINILLM_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MINILLM_SIMD 1
#endif

namespace minillm {

#if defined(MINILLM_AVX512)
constexpr const char* kIsa = "avx512-vnni";
constexpr int64_t kRows = 16;  // weight rows per repacked group = lanes per vector
constexpr int64_t kTile = 8;   // activation rows computed together: 32 registers hold their sums and a block's codes
#elif defined(__AVXVNNI__) && defined(MINILLM_SIMD)
constexpr const char* kIsa = "avx-vnni";
constexpr int64_t kRows = 8;
constexpr int64_t kTile = 4;
#elif defined(MINILLM_SIMD)
#define MINILLM_AVX2_MADDUBS 1
constexpr const char* kIsa = "avx2";
constexpr int64_t kRows = 8;
constexpr int64_t kTile = 6;  // q4_1_matmul.cpp's AVX2 loop: 2 sums per row in registers (6 beat 4 and 8, timed)
#else
constexpr const char* kIsa = "scalar";
constexpr int64_t kRows = 8;
constexpr int64_t kTile = 4;
#endif

// IEEE float16 bits -> float (the scales of Q4_1 and the int8 KV cache): plain C++, so no kernel includes torch
inline float half_to_float(uint16_t h) {
#if defined(__F16C__) && defined(MINILLM_SIMD)
  return _cvtsh_ss(h);  // one instruction where the CPU has it (every AVX2 build)
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);  // normal: rebias 15 -> 127
  } else if (mantissa == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: normalise the mantissa
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float -> IEEE float16 bits, round to nearest even (the int8 KV cache's scales, as torch's .half() rounds them)
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7FFFFFFF;
  if (a >= 0x7F800000) return sign | 0x7C00 | (a > 0x7F800000 ? 0x200 : 0);  // inf, NaN
  if (a >= 0x477FF000) return sign | 0x7C00;  // rounds past 65504: inf
  if (a < 0x38800000) {  // below 2^-14: a float16 subnormal (or zero)
    float magnitude;
    std::memcpy(&magnitude, &a, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(magnitude * 16777216.f));  // units of 2^-24, ties to even
  }
  const uint32_t rounded = a + 0xFFF + ((a >> 13) & 1);  // ties to even on the 13 bits dropped
  return sign | static_cast<uint16_t>((rounded - 0x38000000) >> 13);
}

#if defined(MINILLM_AVX512)
using VecI = __m512i;
using VecF = __m512;
inline VecI load_i(const void* p) { return _mm512_loadu_si512(p); }
inline VecI zero_i() { return _mm512_setzero_si512(); }
inline VecI and_i(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI shift_right4(VecI a) { return _mm512_srli_epi16(a, 4); }
inline VecI set1_i8(char v) { return _mm512_set1_epi8(v); }
inline VecI add_i(VecI a, VecI b) { return _mm512_add_epi32(a, b); }
inline VecI dot_add(VecI acc, VecI u, VecI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VecI abs_i8(VecI w) { return _mm512_abs_epi8(w); }
inline VecI sign_of(VecI x, VecI w) {  // AVX-512 has no vpsignb: negate x where w < 0 (w == 0 meets |w| == 0)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline VecF to_float(VecI a) { return _mm512_cvtepi32_ps(a); }
inline VecF zero_f() { return _mm512_setzero_ps(); }
inline VecF set1_f(float v) { return _mm512_set1_ps(v); }
inline VecF mul_f(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF add_f(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF fma_f(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline float sum_f(VecF v) { return _mm512_reduce_add_ps(v); }
inline VecF max_f(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline VecF abs_f(VecF a) { return _mm512_abs_ps(a); }
inline float max_of(VecF v) { return _mm512_reduce_max_ps(v); }
// (sum of a, of b, of c, of d): each the same tree of adds over its own lanes, whichever of the four it is
inline __m128 sum4_f(VecF a, VecF b, VecF c, VecF d) {
  auto halves = [](VecF v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 ab = _mm256_hadd_ps(halves(a), halves(b)), cd = _mm256_hadd_ps(halves(c), halves(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
inline VecF load_halves(const uint16_t* p) {  // kRows fp16 -> floats
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VecF load_i8_f(const int8_t* p) {  // kRows int8 -> floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VecI broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}
// sum over j < 8 of dot_add(0, codes[j], broadcast4(q + 4 j)): one 4-bit block's 32 codes per lane against its 32
// activations. Two chains of vpdpbusd: one chain of 8 dependent ones (4-5 cycles each) bounded the loop, not memory.
inline VecI dot_block_u4(const VecI codes[8], const int8_t* q) {
  VecI even = zero_i(), odd = zero_i();
  for (int j = 0; j < 8; j += 2) {
    even = dot_add(even, codes[j], broadcast4(q + 4 * j));
    odd = dot_add(odd, codes[j + 1], broadcast4(q + 4 * j + 4));
  }
  return add_i(even, odd);
}
#elif defined(MINILLM_SIMD)
using VecI = __m256i;
using VecF = __m256;
inline VecI load_i(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecI zero_i() { return _mm256_setzero_si256(); }
inline VecI and_i(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI shift_right4(VecI a) { return _mm256_srli_epi16(a, 4); }
inline VecI set1_i8(char v) { return _mm256_set1_epi8(v); }
inline VecI add_i(VecI a, VecI b) { return _mm256_add_epi32(a, b); }
inline VecI dot_add(VecI acc, VecI u, VecI s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline VecI abs_i8(VecI w) { return _mm256_sign_epi8(w, w); }
inline VecI sign_of(VecI x, VecI w) { return _mm256_sign_epi8(x, w); }
inline VecF to_float(VecI a) { return _mm256_cvtepi32_ps(a); }
inline VecF zero_f() { return _mm256_setzero_ps(); }
inline VecF set1_f(float v) { return _mm256_set1_ps(v); }
inline VecF mul_f(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF add_f(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF fma_f(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline float sum_f(VecF v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
// (sum of a, of b, of c, of d): each the same tree of adds over its own lanes, whichever of the four it is
inline __m128 sum4_f(VecF a, VecF b, VecF c, VecF d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // (a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, ...)
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // (a0..3, b0..3, c0..3, d0..3 | a4..7, b4..7, c4..7, d4..7)
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
inline VecF max_f(VecF a, VecF b) { return _mm256_max_ps(a, b); }
inline VecF abs_f(VecF a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline float max_of(VecF v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}
inline VecF load_halves(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VecF load_i8_f(const int8_t* p) {  // kRows int8 -> floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline VecI broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}
#if !defined(MINILLM_AVX2_MADDUBS)
// as the AVX-512 one, with AVX-VNNI's vpdpbusd (without VNNI, q4_1_matmul.cpp has its own loop for vpmaddubsw)
inline VecI dot_block_u4(const VecI codes[8], const int8_t* q) {
  VecI even = zero_i(), odd = zero_i();
  for (int j = 0; j < 8; j += 2) {
    even = dot_add(even, codes[j], broadcast4(q + 4 * j));
    odd = dot_add(odd, codes[j + 1], broadcast4(q + 4 * j + 4));
  }
  return add_i(even, odd);
}
#endif
#endif

}  // namespace minillm

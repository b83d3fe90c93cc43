// The integer instruction the low-bit kernels are built on, per instruction set (lesson 07).
//
// dot_add(acc, u, s): acc + for each of 8 int32 lanes the sum of 4 products (unsigned byte of u) * (signed byte of s).
//   AVX-512 VNNI (with VL) / AVX-VNNI: vpdpbusd, one instruction.
//   AVX2: vpmaddubsw (byte pairs -> int16, saturating: our operands keep 2 * 127 * 127 = 32258 in range), vpmaddwd
//   by 1 (int16 pairs -> int32), vpaddd.
// Which one is compiled is chosen by the flags kernels/cpu_lowbit.py passes, from the CPU's own feature list: one
// build per instruction set, cached.
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MINILLM_SIMD 1
#endif

namespace minillm {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kIsa = "avx512-vnni";
#elif defined(__AVXVNNI__)
constexpr const char* kIsa = "avx-vnni";
#elif defined(MINILLM_SIMD)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

inline float half_to_float(c10::Half h) { return static_cast<float>(h); }

#if defined(MINILLM_SIMD)
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// 8 fp16 values -> 8 floats (one per weight row of a repacked group)
inline __m256 load_halves(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 4 activation codes (bytes 4j..4j+3 of a block) repeated in all 8 lanes: the same inputs for the 8 weight rows
inline __m256i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}
#endif

}  // namespace minillm

// y = x @ W.T for W in GGUF's Q4_1 format, kRows weight rows at a time from a repacked copy: lesson 07's low-bit
// matmul (a GEMV in decode, a small GEMM in verify and batches).
//
// Q4_1: per block of 32 inputs, weight = code * d + m with 4-bit codes and fp16 d, m. For block b of row n,
// with the activations quantized per block (x ~= q * dx, q8_activations.h):
//   sum_i w_i x_i ~= d * dx * sum_i code_i q_i + m * dx * sum_i q_i        (the last factor is s_x, precomputed)
// The first sum is integer SIMD; the minimum costs one multiply-add per block.
//
// Layout (kernels/cpu_lowbit.py repack_q4_1; 5 bits per weight, as in the file): rows in groups of R = kRows (16
// with AVX-512, else 8, simd.h), and for each group and block 20 * R bytes:
//   d[R] fp16 | m[R] fp16 | 4 chunks of 4 * R bytes
// In chunk c, the 4 bytes of lane r hold row r's codes 4c..4c+3 in their low nibbles and 16+4c..16+4c+3 in their
// high nibbles. So "chunk & 0x0F" is a vector whose lane r holds 4 codes of row r, every lane facing the same 4
// activations: one broadcast of those 4 activation bytes feeds one dot_add for R rows at once. The R sums stay in
// the R lanes to the end: no horizontal reduction, and the scales of R rows load as one vector.
//
// M (rows of x): a block's codes are unpacked once and used for kTile activation rows held in registers, so the
// bytes that bound decode are read once per call whatever M is.
#include "lowbit.h"
#include "matmul_driver.h"

namespace minillm {

constexpr int64_t kQ4Bytes = 20 * kRows;  // one group of rows x one block of 32

// The reference: plain loops over the same layout and the same arithmetic as the SIMD version.
template <int MT>
void q4_1_group_scalar(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
  float acc[MT][kRows] = {};
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* blk = group + b * kQ4Bytes;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(blk);  // float16 bits
    const uint16_t* m = d + kRows;
    const uint8_t* codes = blk + 4 * kRows;
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      const int8_t* q = x.q + row * x.K + b * kBlock;
      for (int r = 0; r < kRows; ++r) {
        int32_t isum = 0;
        for (int c = 0; c < 4; ++c)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = codes[c * 4 * kRows + r * 4 + k];
            isum += (byte & 15) * q[4 * c + k] + (byte >> 4) * q[16 + 4 * c + k];
          }
        acc[t][r] += half_to_float(d[r]) * x.d[row * x.blocks + b] * static_cast<float>(isum) +
                     half_to_float(m[r]) * x.s[row * x.blocks + b];
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < kRows; ++r) out[t * kRows + r] = acc[t][r];
}

#if defined(MINILLM_SIMD) && !defined(MINILLM_AVX2_MADDUBS)
template <int MT>
void q4_1_group_simd(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
  const VecI low4 = set1_i8(0x0F);
  VecF acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = zero_f();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* blk = group + b * kQ4Bytes;
    const VecF d = load_halves(reinterpret_cast<const uint16_t*>(blk));
    const VecF m = load_halves(reinterpret_cast<const uint16_t*>(blk) + kRows);
    VecI codes[8];  // codes[j]: lane r = row r's codes 4j..4j+3
    for (int c = 0; c < 4; ++c) {
      const VecI chunk = load_i(blk + 4 * kRows + c * 4 * kRows);
      codes[c] = and_i(chunk, low4);
      codes[c + 4] = and_i(shift_right4(chunk), low4);
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      const int8_t* q = x.q + row * x.K + b * kBlock;
      const VecF scale = mul_f(d, set1_f(x.d[row * x.blocks + b]));
      acc[t] = fma_f(to_float(dot_block_u4(codes, q)), scale, acc[t]);
      acc[t] = fma_f(m, set1_f(x.s[row * x.blocks + b]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) store_f(out + t * kRows, acc[t]);
}
#elif defined(MINILLM_SIMD)
// AVX2 without VNNI: a product is vpmaddubsw into int16 pairs, and the 8 of a block add up in int16 before one
// vpmaddwd widens them (|8 x 2 x 15 x 127| = 30480 < 32767: exact, no saturation). The block's chunks are the outer
// loop and the MT rows the inner one, so the registers hold MT int16 sums, MT float sums and one chunk's codes: the
// codes of a whole block (8 registers, the VNNI path's layout) left the sums no room and GCC kept them on the
// stack, each block's update a store and a reload (perf).
template <int MT>
void q4_1_group_simd(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  const int8_t* q0 = x.q + m0 * x.K;
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* blk = group + b * kQ4Bytes;
    __m256i sum[MT];
    for (int t = 0; t < MT; ++t) sum[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i chunk = load_i(blk + 4 * kRows + c * 4 * kRows);
      const __m256i lo = _mm256_and_si256(chunk, low4), hi = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low4);
      for (int t = 0; t < MT; ++t) {
        const int8_t* q = q0 + t * x.K + b * kBlock + 4 * c;
        sum[t] = _mm256_add_epi16(sum[t], _mm256_maddubs_epi16(lo, broadcast4(q)));
        sum[t] = _mm256_add_epi16(sum[t], _mm256_maddubs_epi16(hi, broadcast4(q + 16)));
        // GCC otherwise regroups the integer adds into a tree of all 8 x MT products and spills them (perf)
        asm("" : "+v"(sum[t]));
      }
    }
    const __m256 d = load_halves(reinterpret_cast<const uint16_t*>(blk));
    const __m256 m = load_halves(reinterpret_cast<const uint16_t*>(blk) + kRows);
    for (int t = 0; t < MT; ++t) {
      const int64_t at = (m0 + t) * x.blocks + b;
      const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[t], ones));
      acc[t] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(x.d[at])), acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[at]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) store_f(out + t * kRows, acc[t]);
}
#endif

template <int MT>
void q4_1_group(bool reference, const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
#if defined(MINILLM_SIMD)
  if (!reference) return q4_1_group_simd<MT>(group, x, m0, out);
#endif
  q4_1_group_scalar<MT>(group, x, m0, out);
}

struct Q4Group {  // the inner loops, as matmul_groups (matmul_driver.h) calls them
  bool reference;
  template <int MT>
  void operator()(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) const {
    q4_1_group<MT>(reference, group, x, m0, out);
  }
};

void q4_1_matmul_groups(bool reference, const QuantizedRows& x, int64_t M, const uint8_t* w, int64_t N, int64_t g0,
                        int64_t g1, float* y) {
  matmul_groups(x, M, w, N, kQ4Bytes, g0, g1, y, Q4Group{reference});
}

}  // namespace minillm

// y = x @ W.T for W in GGUF's Q4_1 format, 8 weight rows at a time from a repacked copy: lesson 07's low-bit GEMV.
//
// Q4_1: per block of 32 inputs, weight = code * d + m with 4-bit codes and fp16 d, m. For block b of row n,
// with the activations quantized per block (x ~= q * dx, q8_activations.h):
//   sum_i w_i x_i ~= d * dx * sum_i code_i q_i + m * dx * sum_i q_i        (the last factor is s_x, precomputed)
// The first sum is integer SIMD; the minimum costs one multiply-add per block.
//
// Layout (built once by kernels/cpu_lowbit.py repack_q4_1, 5 bits per weight like the file): rows in groups of 8,
// and for each group and block 160 bytes:
//   d[8] fp16 | m[8] fp16 | 4 x 32 bytes of codes
// In 32-byte chunk c, the 4 bytes of lane r hold row r's codes 4c..4c+3 in their low nibbles and 16+4c..16+4c+3
// in their high nibbles. So "chunk & 0x0F" is a register whose lane r holds 4 codes of row r, all 8 lanes facing
// the same 4 activations: one broadcast of those 4 activation bytes feeds one dot_add for 8 rows at once. The 8 sums
// stay in the 8 lanes to the end: no horizontal reduction, and the scales of 8 rows load as one vector.
//
// M (rows of x) is 1..16 in decode, batched decode and speculative verify: the codes of a block are unpacked once
// and used for up to 4 activation rows held in registers, so the bytes that bound decode are read once per call.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "q8_activations.h"
#include "simd.h"

namespace minillm {

constexpr int64_t kQ4Bytes = 160;  // one group of 8 rows x one block of 32

struct QuantizedRows {  // x after quantize_row_q8: M rows
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K;
  int64_t blocks;
};

// The reference: plain loops over the same layout and the same arithmetic as the SIMD version.
template <int MT>
void q4_1_group_scalar(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
  float acc[MT][kRows] = {};
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* blk = group + b * kQ4Bytes;
    const c10::Half* d = reinterpret_cast<const c10::Half*>(blk);
    const c10::Half* m = d + kRows;
    const uint8_t* codes = blk + 32;
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      const int8_t* q = x.q + row * x.K + b * kBlock;
      for (int r = 0; r < kRows; ++r) {
        int32_t isum = 0;
        for (int c = 0; c < 4; ++c)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = codes[c * 32 + r * 4 + k];
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

#if defined(MINILLM_SIMD)
template <int MT>
void q4_1_group_simd(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* blk = group + b * kQ4Bytes;
    const __m256 d = load_halves(reinterpret_cast<const c10::Half*>(blk));
    const __m256 m = load_halves(reinterpret_cast<const c10::Half*>(blk) + kRows);
    __m256i codes[8];  // codes[j]: lane r = row r's codes 4j..4j+3
    for (int c = 0; c < 4; ++c) {
      const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * c));
      codes[c] = _mm256_and_si256(chunk, low4);
      codes[c + 4] = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), low4);
    }
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      const int8_t* q = x.q + row * x.K + b * kBlock;
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) isum = dot_add(isum, codes[j], broadcast4(q + 4 * j));
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.d[row * x.blocks + b]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[row * x.blocks + b]), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm256_storeu_ps(out + t * kRows, acc[t]);
}
#endif

template <int MT>
void q4_1_group(bool reference, const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
#if defined(MINILLM_SIMD)
  if (!reference) return q4_1_group_simd<MT>(group, x, m0, out);
#endif
  q4_1_group_scalar<MT>(group, x, m0, out);
}

// x (..., K) float, packed (ceil(N/8), K/32, 160) uint8 -> y (..., N) in x's dtype
at::Tensor q4_1_matmul(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, bool reference) {
  TORCH_CHECK(x_in.dim() >= 1, "x must be (..., K)");
  const int64_t K = x_in.size(-1), M = x_in.numel() / std::max<int64_t>(K, 1), groups = (N + kRows - 1) / kRows;
  TORCH_CHECK(K % kBlock == 0, "K = ", K, " must be a multiple of 32 (Q4_1 blocks)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == groups && packed.size(1) == K / kBlock && packed.size(2) == kQ4Bytes,
              "packed must be repack_q4_1's contiguous uint8 (", groups, ", ", K / kBlock, ", 160), got ",
              packed.sizes());
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
    float tile[4 * kRows];
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* group = w + g * blocks * kQ4Bytes;
      const int64_t valid = std::min(kRows, N - g * kRows);  // the last group may be padding past N
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mt = std::min<int64_t>(4, M - m0);
        switch (mt) {
          case 4: q4_1_group<4>(reference, group, rows, m0, tile); break;
          case 3: q4_1_group<3>(reference, group, rows, m0, tile); break;
          case 2: q4_1_group<2>(reference, group, rows, m0, tile); break;
          default: q4_1_group<1>(reference, group, rows, m0, tile); break;
        }
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

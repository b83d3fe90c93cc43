// y = x @ W.T for int8 weights, kRows rows at a time from a repacked copy: Int8Linear (one scale per output row) and
// GGUF's Q8_0 (one fp16 scale per block of 32: the file's tied embedding / LM head). Lesson 07.
//
// Block b of row n, activations quantized per block (x ~= q * dx, q8_activations.h):
//   sum_i w_i x_i ~= scale * dx * sum_i w_i q_i
// The instruction multiplies unsigned by signed bytes, so the sign moves from the weight onto the activation:
// w * q = |w| * sign_of(q, w) (simd.h). -128 never occurs (both sides are clamped to +-127), so |w| fits a byte.
//
// Layout (kernels/cpu_lowbit.py repack_int8): rows in groups of R = kRows, for each group and block 36 * R bytes:
//   scale[R] float32 | 8 chunks of 4 * R bytes: in chunk j, the 4 bytes of lane r are row r's weights 4j..4j+3
// A per-row scale is stored in every block (9 bits per weight instead of 8: one layout, one kernel for both).
#include "lowbit.h"
#include "matmul_driver.h"

namespace minillm {

constexpr int64_t kQ8Bytes = 36 * kRows;

template <int MT>
void int8_group_scalar(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
  float acc[MT][kRows] = {};
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* blk = group + b * kQ8Bytes;
    float scale[kRows];
    std::memcpy(scale, blk, sizeof(scale));
    const int8_t* w = reinterpret_cast<const int8_t*>(blk + 4 * kRows);
    for (int t = 0; t < MT; ++t) {
      const int64_t row = m0 + t;
      const int8_t* q = x.q + row * x.K + b * kBlock;
      for (int r = 0; r < kRows; ++r) {
        int32_t isum = 0;
        for (int j = 0; j < 8; ++j)
          for (int k = 0; k < 4; ++k) isum += w[j * 4 * kRows + r * 4 + k] * q[4 * j + k];
        acc[t][r] += scale[r] * x.d[row * x.blocks + b] * static_cast<float>(isum);
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < kRows; ++r) out[t * kRows + r] = acc[t][r];
}

#if defined(MINILLM_SIMD)
// A block's chunks outer, the MT rows inner (as q4_1_matmul.cpp's AVX2 loop): the registers hold one chunk's weights
// and magnitudes and MT int32 and MT float sums. (A whole block's weights and magnitudes, 16 registers, left the sums
// on the stack on AVX2: 5 rows of the LM head took 3.45 ms against 2.40 now, 2 threads.) The asm barrier keeps GCC
// from regrouping the integer adds into a tree of spilled products.
template <int MT>
void int8_group_simd(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
  VecF acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = zero_f();
  const int8_t* q0 = x.q + m0 * x.K;
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* blk = group + b * kQ8Bytes;
    VecI sum[MT];
    for (int t = 0; t < MT; ++t) sum[t] = zero_i();
    for (int j = 0; j < 8; ++j) {
      const VecI w = load_i(blk + 4 * kRows + j * 4 * kRows), magnitude = abs_i8(w);
      for (int t = 0; t < MT; ++t) {
        sum[t] = dot_add(sum[t], magnitude, sign_of(broadcast4(q0 + t * x.K + b * kBlock + 4 * j), w));
        asm("" : "+v"(sum[t]));
      }
    }
    const VecF scale = load_f(reinterpret_cast<const float*>(blk));
    for (int t = 0; t < MT; ++t)
      acc[t] = fma_f(to_float(sum[t]), mul_f(scale, set1_f(x.d[(m0 + t) * x.blocks + b])), acc[t]);
  }
  for (int t = 0; t < MT; ++t) store_f(out + t * kRows, acc[t]);
}
#endif

template <int MT>
void int8_group(bool reference, const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) {
#if defined(MINILLM_SIMD)
  if (!reference) return int8_group_simd<MT>(group, x, m0, out);
#endif
  int8_group_scalar<MT>(group, x, m0, out);
}

struct Int8Group {  // the inner loops, as matmul_groups (matmul_driver.h) calls them
  bool reference;
  template <int MT>
  void operator()(const uint8_t* group, const QuantizedRows& x, int64_t m0, float* out) const {
    int8_group<MT>(reference, group, x, m0, out);
  }
};

void q4_1_matmul_groups(bool reference, const QuantizedRows& x, int64_t M, const uint8_t* w, int64_t N, int64_t g0,
                        int64_t g1, float* y);

int64_t group_bytes(WeightFormat format) { return format == kQ4_1 ? 20 * kRows : kQ8Bytes; }

void weight_matmul_groups(WeightFormat format, bool reference, const QuantizedRows& x, int64_t M, const uint8_t* w,
                          int64_t N, int64_t g0, int64_t g1, float* y) {
  if (format == kQ4_1) return q4_1_matmul_groups(reference, x, M, w, N, g0, g1, y);
  matmul_groups(x, M, w, N, kQ8Bytes, g0, g1, y, Int8Group{reference});
}

// rows `ids` (n) of a repacked weight as floats, out (n, blocks * 32): a tied embedding's lookup, scale * code per
// block, read from the layout the LM head multiplies (no second copy of the codes; ~70 us of numpy and torch ops a
// decode step before, a few here)
void int8_rows_float(const uint8_t* w, int64_t blocks, const int64_t* ids, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t group = ids[i] / kRows, lane = ids[i] % kRows;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + (group * blocks + b) * kQ8Bytes;
      float scale;
      std::memcpy(&scale, blk + 4 * lane, sizeof(scale));
      const int8_t* codes = reinterpret_cast<const int8_t*>(blk + 4 * kRows) + 4 * lane;
      float* row = out + (i * blocks + b) * kBlock;
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k) row[4 * j + k] = scale * static_cast<float>(codes[j * 4 * kRows + k]);
    }
  }
}

}  // namespace minillm

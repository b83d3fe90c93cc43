// The plain C++ face of the CPU kernels: what bindings.cpp (the one unit with torch's headers) and native_step.cpp
// call. Pointers and sizes only; the checks on shapes and dtypes happen once, in bindings.cpp.
#pragma once

#include <cstdint>

namespace minillm {

struct QuantizedRows;

// repack_q4_1's and repack_int8's layouts (kernels/cpu_lowbit.py), and a float32 (N, K) row-major weight as it lies
enum WeightFormat : int { kQ4_1 = 0, kInt8 = 1, kF32 = 2 };

int64_t group_bytes(WeightFormat format);  // bytes of one group of kRows rows x one block of 32 inputs

// y (M, N) columns of weight groups [g0, g1) = x @ W.T; the caller splits the groups over threads
void weight_matmul_groups(WeightFormat format, bool reference, const QuantizedRows& x, int64_t M, const uint8_t* w,
                          int64_t N, int64_t g0, int64_t g1, float* y);

// y (M, N) columns of tiles [tile0, tile1) = x (M, K) @ W.T, W float32 (N, K) row-major (f32_matmul.cpp); tiles of
// f32_tiles(N) rows, the caller splits them over threads
int64_t f32_tiles(int64_t N);
void f32_matmul_tiles(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t tile0, int64_t tile1,
                      float* y);

// y (M, N) columns [n0, n1) = x (M, K) @ W.T, W a shared-codebook weight (codebook_matmul.cpp): `bits` (3 or 4)-bit
// codes, (K + 7) / 8 * bits bytes a row, row n looking its values up in tables[n / rows_per_table] (2**bits floats)
void codebook_matmul_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, int bits, const float* tables,
                          int64_t rows_per_table, int64_t N, int64_t n0, int64_t n1, float* y);

// rows ids[0..n) of a repack_int8 weight with `blocks` blocks of 32 inputs, as floats: out (n, blocks * 32)
void int8_rows_float(const uint8_t* w, int64_t blocks, const int64_t* ids, int64_t n, float* out);

// decode attention over an int8 paged pool (int8_kv_attention.cpp), for sequences [s0, s1) x KV heads
struct Int8DecodeArgs {
  const float* q;  // (n, n_heads, D)
  const int8_t *k_codes, *v_codes;  // (num_blocks * block_size, n_kv, D)
  const uint16_t *k_scales, *v_scales;  // (num_blocks * block_size, n_kv) float16 bits
  const int32_t* tables;  // (n, width)
  const int64_t* ctx;  // (n,)
  int64_t width, block_size, n_heads, n_kv, D;
  float scale;
  float* out;  // (n, n_heads, D)
};
void int8_decode_tasks(const Int8DecodeArgs& a, int64_t task0, int64_t task1);  // task = sequence * n_kv + KV head

}  // namespace minillm

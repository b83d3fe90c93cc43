// One forward through every decoder layer in C++ (native_step.cpp): the layout of what it reads. Plain C++.
#pragma once

#include <cstdint>
#include <vector>

#include "lowbit.h"

namespace minillm {

struct NativeWeight {  // a repacked low-bit weight (kernels/cpu_lowbit.py repack_q4_1 / repack_int8)
  WeightFormat format;
  const uint8_t* packed;
  int64_t N, K;
};

struct NativeLayer {  // one decoder block after lesson 06's fusions: q|k|v in one weight, gate|up in one
  const float* attn_norm;  // (dim,)
  NativeWeight qkv;        // (n_heads + 2 n_kv_heads) * head_dim rows
  NativeWeight o;          // dim rows
  const float* mlp_norm;   // (dim,)
  NativeWeight gate_up;    // 2 * ffn_dim rows: gate, then up
  NativeWeight down;       // dim rows
};

struct NativeModel {
  int64_t dim, n_heads, n_kv_heads, head_dim, ffn_dim, max_len;
  float eps;
  const float *cos, *sin;  // RoPE tables (max_len, head_dim)
  std::vector<NativeLayer> layers;
};

// Where layer l's key (value) of position p of sequence s lives: the cache's element offset
//   l * layer_stride + slot * slot_stride + kv_head * head_stride,  slot = table[s][p / block_size] * block_size
//                                                                          + p % block_size
// A paged pool (layers, blocks, block_size, n_kv, D): slot_stride n_kv * D, head_stride D, tables = block tables.
// A contiguous cache (layers, batch, n_kv, max_len, D): block_size max_len, table[s] = {s * n_kv}, slot_stride D,
// head_stride max_len * D. An int8 cache adds float16 scales addressed the same way with their own strides.
struct NativeCache {
  bool int8;
  void *k, *v;                          // float32, or int8 codes
  uint16_t *k_scale, *v_scale;          // float16 bits (int8 only)
  int64_t layer_stride, slot_stride, head_stride;
  int64_t scale_layer_stride, scale_slot_stride, scale_head_stride;
  const int32_t* tables;  // (num_seqs, width)
  int64_t width, block_size;
};

struct NativeTokens {  // the step's new tokens, packed: token t of sequence seq[t] at position pos[t]
  int64_t T;
  const int64_t* pos;
  const int32_t* seq;
};

// h (T, dim) float32, updated in place: every layer of `model` over the new tokens, their keys and values written
// into `cache` first, each token attending to its sequence's positions 0..pos[t] (causal, any mix of decodes,
// verifies and prompt chunks). `threads` threads share each matmul and the attention; small per-token work runs on one.
// seconds[NativeStage] receives where the first thread's time went (each stage up to its closing barrier).
enum NativeStage : int { kMatmul = 0, kAttention = 1, kPointwise = 2, kTotal = 3 };
void native_layers(const NativeModel& model, const NativeCache& cache, const NativeTokens& tokens, float* h,
                   int threads, double seconds[4]);

}  // namespace minillm

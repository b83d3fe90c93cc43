// Decode attention read straight from an int8 paged KV pool (lessons 04 and 07): one query row per sequence.
//
// Why a kernel: an int8 pool stores 4x fewer bytes per cached token than float32, but reading it through torch means
// gather the int8 slots, gather the scales, widen to float, multiply by the scale -- several passes over full-size
// float copies of every sequence's context -- before attention reads it once more. Decode is bound by the bytes it
// reads, so that path lost to the float32 pool's single gather. Here each int8 key/value row is read once, widened
// in registers and scaled on the fly: x ~= code * scale with one float16 scale per token and KV head
// (minillm.kv_cache.quantize_kv_int8), so
//   score_t = (q . k_t) * scale * k_scale_t     (one scale per row: multiply the int8 dot product, not the codes)
//   out     = sum_t softmax(score)_t * v_scale_t * v_t
//
// Layouts (minillm/cache/kv_pool.py, one layer): k/v (num_blocks, block_size, n_kv_heads, head_dim) int8; k/v scales
// (num_blocks, block_size, n_kv_heads) float16. Token p of sequence s lives in slot
// table[s][p / block_size] * block_size + p % block_size (entries past its blocks may be -1, never read).
// GQA: query head h reads KV head h / group. One task per (sequence, KV head): its `group` query heads share each
// key/value row it loads. Two passes over the context: the scores (group x context floats, small: context is at
// most the model's window) and their softmax, then the values. float32 throughout; the inner loops over head_dim are
// plain C++ that -O3 vectorizes (`omp simd` lets the compiler reorder the dot product's sum).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_math.h"
#include "lowbit.h"
#include "simd.h"

namespace minillm {

namespace {

struct Int8Pool {
  const int8_t* codes;      // (num_blocks * block_size, n_kv_heads, head_dim)
  const uint16_t* scales;  // (num_blocks * block_size, n_kv_heads) float16 bits
};

struct Sequence {  // where one sequence's context lives
  const int32_t* table;
  int64_t ctx, block_size, n_kv, kv_head;
  int64_t row(int64_t t) const {  // the (slot, KV head) row of position t
    return (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * n_kv + kv_head;
  }
};

// One sequence, one KV head: q (group, D) float32 rows -> out (group, D) float32 rows. kD: head_dim known at compile
// time (the loops unroll into registers), or 0 for any head_dim D.
template <int64_t kD>
void attend_one(const float* q, const Sequence& seq, int64_t D_any, int64_t group, float scale, Int8Pool k,
                Int8Pool v, float* out, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t D = kD ? kD : D_any, ctx = seq.ctx;
  scores.resize(group * ctx);
  acc.assign(group * D, 0.f);
  float* sc = scores.data();
  float* ac = acc.data();
  float key[kD ? kD : 1], value[kD ? kD : 1];
  std::vector<float> rows(kD ? 0 : D);
  float* kf = kD ? key : rows.data();
  float* vf = kD ? value : rows.data();
  for (int64_t t = 0; t < ctx; ++t) {  // pass 1: scores, each key row widened once for the group's query rows
    const int64_t row = seq.row(t);
    const int8_t* codes = k.codes + row * D;
    for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(codes[d]);
    const float s = scale * half_to_float(k.scales[row]);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * kf[d];
      sc[g * ctx + t] = dot * s;
    }
  }
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place, and their sum
    float* p = sc + g * ctx;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) top = std::max(top, p[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      p[t] = exp_nonpositive(p[t] - top);
      sum += p[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  for (int64_t t = 0; t < ctx; ++t) {  // pass 2: the weighted sum of the values, each row widened once
    const int64_t row = seq.row(t);
    const int8_t* codes = v.codes + row * D;
    for (int64_t d = 0; d < D; ++d) vf[d] = static_cast<float>(codes[d]);
    const float s = half_to_float(v.scales[row]);
    for (int64_t g = 0; g < group; ++g) {
      const float w = sc[g * ctx + t] * s;
      float* a = ac + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * vf[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = ac[g * D + d] * inv_sum[g];
}

}  // namespace

void int8_decode_tasks(const Int8DecodeArgs& a, int64_t task0, int64_t task1) {
  std::vector<float> scores, acc;
  const Int8Pool k{a.k_codes, a.k_scales}, v{a.v_codes, a.v_scales};
  const int64_t group = a.n_heads / a.n_kv, D = a.D;
  for (int64_t task = task0; task < task1; ++task) {
    const int64_t s = task / a.n_kv, h = task % a.n_kv;
    const int64_t first = (s * a.n_heads + h * group) * D;  // query heads h * group .. h * group + group - 1
    const Sequence seq{a.tables + s * a.width, a.ctx[s], a.block_size, a.n_kv, h};
    switch (D) {  // SmolLM2 and most small models: 64; larger ones 128
      case 64: attend_one<64>(a.q + first, seq, D, group, a.scale, k, v, a.out + first, scores, acc); break;
      case 128: attend_one<128>(a.q + first, seq, D, group, a.scale, k, v, a.out + first, scores, acc); break;
      default: attend_one<0>(a.q + first, seq, D, group, a.scale, k, v, a.out + first, scores, acc); break;
    }
  }
}

}  // namespace minillm

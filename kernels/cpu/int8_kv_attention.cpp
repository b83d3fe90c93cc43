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
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace minillm {

namespace {

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

struct Int8Pool {
  const int8_t* codes;      // (num_blocks * block_size, n_kv_heads, head_dim)
  const c10::Half* scales;  // (num_blocks * block_size, n_kv_heads)
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
    const float s = scale * static_cast<float>(k.scales[row]);
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
    const float s = static_cast<float>(v.scales[row]);
    for (int64_t g = 0; g < group; ++g) {
      const float w = sc[g * ctx + t] * s;
      float* a = ac + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * vf[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = ac[g * D + d] * inv_sum[g];
}

void check_pool(const at::Tensor& codes, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4,
              name, "_pool must be int8 (num_blocks, block_size, n_kv_heads, head_dim), got ", codes.scalar_type(),
              " ", codes.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.sizes() == codes.sizes().slice(0, 3),
              name, "_scale must be float16 (num_blocks, block_size, n_kv_heads) = ", codes.sizes().slice(0, 3),
              ", got ", scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), name, "_pool and ", name,
              "_scale must be contiguous (one layer of KVBlockPool: pool.k[layer], pool.k_scale[layer])");
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), name, "_pool and ", name,
              "_scale must be on the CPU");
}

}  // namespace

// q (n, n_heads, head_dim) float32 or bfloat16; pools and scales as above; block_tables (n, max_blocks) int;
// context_lens (n,) int -> (n, n_heads, head_dim) in q's dtype.
at::Tensor paged_int8_decode(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& k_scale,
                             const at::Tensor& v_pool, const at::Tensor& v_scale, const at::Tensor& block_tables_in,
                             const at::Tensor& context_lens_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3, "q must be (num_seqs, n_heads, head_dim), got ", q_in.sizes());
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16, got ", q_in.scalar_type());
  TORCH_CHECK(q_in.device().is_cpu(), "q must be on the CPU");
  check_pool(k_pool, k_scale, "k");
  check_pool(v_pool, v_scale, "v");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "k_pool ", k_pool.sizes(), " and v_pool ", v_pool.sizes(),
              " must have one shape");
  const int64_t n = q_in.size(0), n_heads = q_in.size(1), D = q_in.size(2);
  const int64_t num_blocks = k_pool.size(0), block_size = k_pool.size(1), n_kv = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && n_kv > 0 && n_heads % n_kv == 0, "q ", q_in.sizes(), " does not match the pool ",
              k_pool.sizes(), ": head_dim must agree and n_kv_heads must divide n_heads");
  TORCH_CHECK((block_tables_in.scalar_type() == at::kInt || block_tables_in.scalar_type() == at::kLong) &&
                  block_tables_in.dim() == 2 && block_tables_in.size(0) == n,
              "block_tables must be an int (", n, ", max_blocks) tensor, got ", block_tables_in.scalar_type(), " ",
              block_tables_in.sizes());
  TORCH_CHECK((context_lens_in.scalar_type() == at::kInt || context_lens_in.scalar_type() == at::kLong) &&
                  context_lens_in.dim() == 1 && context_lens_in.size(0) == n,
              "context_lens must be an int (", n, ",) tensor, got ", context_lens_in.scalar_type(), " ",
              context_lens_in.sizes());
  const at::Tensor tables = block_tables_in.to(at::kInt).contiguous();
  const at::Tensor lens = context_lens_in.to(at::kLong).contiguous();
  const int64_t width = tables.size(1);
  const int32_t* table = tables.data_ptr<int32_t>();
  const int64_t* ctx = lens.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t s = 0; s < n; ++s) {  // every block a sequence reads must exist: checked here, not in the loops
    TORCH_CHECK(ctx[s] >= 1 && ctx[s] <= width * block_size, "sequence ", s, ": context length ", ctx[s],
                " must be in 1..", width * block_size, " (its block table's ", width, " blocks of ", block_size, ")");
    for (int64_t b = 0; b < (ctx[s] + block_size - 1) / block_size; ++b) {
      const int32_t id = table[s * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", s, " reads block ", id, " (entry ", b,
                  " of its table) but the pool has blocks 0..", num_blocks - 1);
    }
    work += ctx[s];
  }
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({n, n_heads, D}, at::kFloat);
  const int64_t group = n_heads / n_kv;
  const Int8Pool k{k_pool.data_ptr<int8_t>(), k_scale.data_ptr<c10::Half>()};
  const Int8Pool v{v_pool.data_ptr<int8_t>(), v_scale.data_ptr<c10::Half>()};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // tasks (sequence, KV head), KV head fastest: neighbouring tasks read neighbouring bytes of the same slots. A few
  // thousand tokens per chunk at least, so a short step does not pay to wake the other threads.
  const int64_t tasks = n * n_kv;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, work / n));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, acc;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t s = task / n_kv, h = task % n_kv;
      const int64_t first = (s * n_heads + h * group) * D;  // query heads h * group .. h * group + group - 1
      const Sequence seq{table + s * width, ctx[s], block_size, n_kv, h};
      const float sm = static_cast<float>(scale);
      switch (D) {  // SmolLM2 and most small models: 64; larger ones 128
        case 64: attend_one<64>(qp + first, seq, D, group, sm, k, v, op + first, scores, acc); break;
        case 128: attend_one<128>(qp + first, seq, D, group, sm, k, v, op + first, scores, acc); break;
        default: attend_one<0>(qp + first, seq, D, group, sm, k, v, op + first, scores, acc); break;
      }
    }
  });
  return out.to(q_in.scalar_type());
}

}  // namespace minillm

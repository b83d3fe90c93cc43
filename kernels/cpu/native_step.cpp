// Every decoder layer of a step in one C++ call: lesson 06's last rung, "one native step".
//
// Why: a q4 decode step of SmolLM2 runs ~2,000 torch ops from Python. Their matmuls are ~half the time; the rest is
// per-op cost (dispatch, allocation, a thread-pool wake-up for a 576-wide add) that a second thread does not
// shorten. Here one parallel region runs the whole step: per layer
//   RMSNorm -> q|k|v matmul -> RoPE -> K/V written to the cache -> attention -> O matmul -> + residual
//   -> RMSNorm -> gate|up matmul -> SiLU * up -> down matmul -> + residual
// The matmuls (the low-bit kernels of lesson 07) and the attention split over the threads; the per-token work
// (norms, RoPE, activations, quantizing a row to int8) runs on one thread, and a barrier separates the stages: the
// region's threads stay awake between them instead of being woken ~150 times a step.
//
// Numerics are the eager model's (minillm/model.py): RMSNorm in float32, RoPE's rotate-half pairing, softmax over
// positions 0..pos of the token's own sequence, an int8 cache quantized per token and head as quantize_kv_int8.
#include "native_step.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_math.h"
#include "matmul_driver.h"
#include "q8_activations.h"
#include "simd.h"

namespace minillm {

namespace {

struct Scratch {  // one step's activations, (T, width) row-major each
  std::vector<float> xn, qkv, att, proj, gate_up, act;
  std::vector<int8_t> xq;
  std::vector<float> xd, xs;
};

// the rows [t0, t1) of a (T, K) activation, quantized for the next matmul
void quantize_rows(const float* x, int64_t K, int64_t t0, int64_t t1, Scratch& s) {
  for (int64_t t = t0; t < t1; ++t)
    quantize_row_q8(x + t * K, K, s.xq.data() + t * K, s.xd.data() + t * (K / kBlock), s.xs.data() + t * (K / kBlock));
}

// this thread's share of y (T, N) = x @ W.T, x quantized in s; ends at a barrier
void matmul(const NativeWeight& w, const Scratch& s, int64_t T, float* y) {
  const QuantizedRows x{s.xq.data(), s.xd.data(), s.xs.data(), w.K, w.K / kBlock};
  const int64_t groups = (w.N + kRows - 1) / kRows, n = omp_get_num_threads(), id = omp_get_thread_num();
  weight_matmul_groups(w.format, false, x, T, w.packed, w.N, groups * id / n, groups * (id + 1) / n, y);
#pragma omp barrier
}

void rms_norm(const float* x, const float* weight, int64_t dim, float eps, float* out) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * r * weight[i];
}

void rope(float* x, const float* cos, const float* sin, int64_t D) {  // rotate half: pairs (i, i + D/2)
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

struct Where {  // one layer of the cache
  const NativeCache& c;
  int64_t layer;
  int64_t slot(int64_t seq, int64_t p) const {
    return static_cast<int64_t>(c.tables[seq * c.width + p / c.block_size]) * c.block_size + p % c.block_size;
  }
  int64_t row(int64_t slot, int64_t head) const {
    return layer * c.layer_stride + slot * c.slot_stride + head * c.head_stride;
  }
  int64_t scale_at(int64_t slot, int64_t head) const {
    return layer * c.scale_layer_stride + slot * c.scale_slot_stride + head * c.scale_head_stride;
  }
};

void write_row(const Where& at, int64_t slot, int64_t head, const float* x, int64_t D, void* base, uint16_t* scales) {
  if (!at.c.int8) {
    std::copy(x, x + D, static_cast<float*>(base) + at.row(slot, head));
    return;
  }
  float amax = 0.f;  // quantize_kv_int8: s = fp16(max(max|x| / 127, 2^-14)), code = round(x / s)
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const uint16_t s16 = float_to_half(std::max(amax / 127.f, 6.103515625e-05f));
  const float s = half_to_float(s16);
  int8_t* codes = static_cast<int8_t*>(base) + at.row(slot, head);
  for (int64_t d = 0; d < D; ++d) codes[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / s), -127.f, 127.f));
  scales[at.scale_at(slot, head)] = s16;
}

// one query head of one token over positions 0..n-1 of its sequence: out (D) = softmax(q k^T * scale) v
template <int64_t kD>
void attend(const float* q, const Where& at, int64_t seq, int64_t n, int64_t kv_head, int64_t D_any, float scale,
            float* scores, float* out) {
  const int64_t D = kD ? kD : D_any;
  const NativeCache& c = at.c;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t p0 = 0; p0 < n; p0 += c.block_size) {  // a block at a time: one table read per block_size keys
    const int64_t first = at.slot(seq, p0), len = std::min(c.block_size, n - p0);
    for (int64_t r = 0; r < len; ++r) {
      const int64_t off = at.row(first + r, kv_head);
      float dot = 0.f;
      if (c.int8) {
        const int8_t* k = static_cast<const int8_t*>(c.k) + off;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += q[d] * static_cast<float>(k[d]);
        dot *= half_to_float(c.k_scale[at.scale_at(first + r, kv_head)]);
      } else {
        const float* k = static_cast<const float*>(c.k) + off;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
      }
      scores[p0 + r] = dot * scale;
      top = std::max(top, dot * scale);
    }
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t p = 0; p < n; ++p) {
    scores[p] = exp_nonpositive(scores[p] - top);
    sum += scores[p];
  }
  float acc[kD ? kD : 1];
  std::vector<float> any(kD ? 0 : D);
  float* a = kD ? acc : any.data();
  std::fill(a, a + D, 0.f);
  for (int64_t p0 = 0; p0 < n; p0 += c.block_size) {
    const int64_t first = at.slot(seq, p0), len = std::min(c.block_size, n - p0);
    for (int64_t r = 0; r < len; ++r) {
      const int64_t off = at.row(first + r, kv_head);
      if (c.int8) {
        const float w = scores[p0 + r] * half_to_float(c.v_scale[at.scale_at(first + r, kv_head)]);
        const int8_t* v = static_cast<const int8_t*>(c.v) + off;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(v[d]);
      } else {
        const float w = scores[p0 + r];
        const float* v = static_cast<const float*>(c.v) + off;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
      }
    }
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] = a[d] * inv;
}

}  // namespace

void native_layers(const NativeModel& m, const NativeCache& cache, const NativeTokens& tok, float* h, int threads) {
  const int64_t T = tok.T, dim = m.dim, D = m.head_dim, nh = m.n_heads, nkv = m.n_kv_heads, ffn = m.ffn_dim;
  const int64_t qkv_n = (nh + 2 * nkv) * D, widest = std::max({dim, ffn, nh * D});
  Scratch s;
  s.xn.resize(T * dim), s.qkv.resize(T * qkv_n), s.att.resize(T * nh * D), s.proj.resize(T * dim);
  s.gate_up.resize(T * 2 * ffn), s.act.resize(T * ffn);
  s.xq.resize(T * widest), s.xd.resize(T * widest / kBlock), s.xs.resize(T * widest / kBlock);
  std::vector<int64_t> slots(T);
  int64_t longest = 1;
  for (int64_t t = 0; t < T; ++t) {
    slots[t] = Where{cache, 0}.slot(tok.seq[t], tok.pos[t]);
    longest = std::max(longest, tok.pos[t] + 1);
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
#pragma omp parallel num_threads(std::max(1, threads))
  {
    std::vector<float> scores(longest);
    for (size_t l = 0; l < m.layers.size(); ++l) {
      const NativeLayer& L = m.layers[l];
      const Where at{cache, static_cast<int64_t>(l)};
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        rms_norm(h + t * dim, L.attn_norm, dim, m.eps, s.xn.data() + t * dim);
        quantize_rows(s.xn.data(), dim, t, t + 1, s);
      }
      matmul(L.qkv, s, T, s.qkv.data());
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {  // RoPE on q and k, then k and v into the cache
        float* row = s.qkv.data() + t * qkv_n;
        const float *cos = m.cos + tok.pos[t] * D, *sin = m.sin + tok.pos[t] * D;
        for (int64_t head = 0; head < nh + nkv; ++head) rope(row + head * D, cos, sin, D);
        for (int64_t head = 0; head < nkv; ++head) {
          write_row(at, slots[t], head, row + (nh + head) * D, D, cache.k, cache.k_scale);
          write_row(at, slots[t], head, row + (nh + nkv + head) * D, D, cache.v, cache.v_scale);
        }
      }
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < T * nh; ++task) {  // (token, query head); head h reads KV head h / group
        const int64_t t = task / nh, head = task % nh, kvh = head / (nh / nkv), n = tok.pos[t] + 1;
        const float* q = s.qkv.data() + t * qkv_n + head * D;
        float* out = s.att.data() + (t * nh + head) * D;
        if (D == 64)
          attend<64>(q, at, tok.seq[t], n, kvh, D, scale, scores.data(), out);
        else
          attend<0>(q, at, tok.seq[t], n, kvh, D, scale, scores.data(), out);
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) quantize_rows(s.att.data(), nh * D, t, t + 1, s);
      matmul(L.o, s, T, s.proj.data());
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        float* x = h + t * dim;
        const float* o = s.proj.data() + t * dim;
        for (int64_t i = 0; i < dim; ++i) x[i] += o[i];
        rms_norm(x, L.mlp_norm, dim, m.eps, s.xn.data() + t * dim);
        quantize_rows(s.xn.data(), dim, t, t + 1, s);
      }
      matmul(L.gate_up, s, T, s.gate_up.data());
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {  // SiLU(gate) * up
        const float *g = s.gate_up.data() + t * 2 * ffn, *u = g + ffn;
        float* a = s.act.data() + t * ffn;
        for (int64_t i = 0; i < ffn; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        quantize_rows(s.act.data(), ffn, t, t + 1, s);
      }
      matmul(L.down, s, T, s.proj.data());
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        float* x = h + t * dim;
        const float* d = s.proj.data() + t * dim;
        for (int64_t i = 0; i < dim; ++i) x[i] += d[i];
      }
    }
  }
}

}  // namespace minillm

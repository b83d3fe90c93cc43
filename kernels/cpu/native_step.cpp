// Every decoder layer of a step in one C++ call: lesson 06's last rung, "one native step".
//
// Why: a q4 decode step of SmolLM2 runs ~2,000 torch ops from Python. Their matmuls are ~half the time; the rest is
// per-op cost (dispatch, allocation, a thread-pool wake-up for a 576-wide add) that a second thread does not
// shorten. Here one parallel region runs the whole step: per layer
//   RMSNorm -> q|k|v matmul -> RoPE -> K/V written to the cache -> attention -> O matmul -> + residual
//   -> RMSNorm -> gate|up matmul -> SiLU * up -> down matmul -> + residual
// The matmuls (the low-bit kernels of lesson 07, or float32 weights where they lie: f32_matmul.cpp) and the
// attention split over the threads; the per-token work (norms, RoPE, activations, quantizing a row to int8 for a
// low-bit weight) runs on one thread, and a barrier separates the stages: the
// region's threads stay awake between them instead of being woken ~150 times a step.
//
// Numerics are the eager model's (minillm/model.py): RMSNorm in float32, RoPE's rotate-half pairing, softmax over
// positions 0..pos of the token's own sequence, an int8 cache quantized per token and head as quantize_kv_int8.
#include "native_step.h"

#include <omp.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

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

// the rows [t0, t1) of a (T, K) activation, quantized for the next matmul when its weight is low-bit (a float32
// weight reads the float rows)
void quantize_rows(const NativeWeight& next, const float* x, int64_t K, int64_t t0, int64_t t1, Scratch& s) {
  if (next.format == kF32) return;
  for (int64_t t = t0; t < t1; ++t)
    quantize_row_q8(x + t * K, K, s.xq.data() + t * K, s.xd.data() + t * (K / kBlock), s.xs.data() + t * (K / kBlock));
}

// this thread's share of y (T, N) = x @ W.T, x (T, K) as floats and, for a low-bit W, quantized in s; ends at a
// barrier
void matmul(const NativeWeight& w, const float* xf, const Scratch& s, int64_t T, float* y) {
  const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
  if (w.format == kF32) {
    const int64_t tiles = f32_tiles(w.N);
    f32_matmul_tiles(xf, T, w.K, reinterpret_cast<const float*>(w.packed), w.N, tiles * id / n, tiles * (id + 1) / n,
                     y);
  } else {
    const QuantizedRows x{s.xq.data(), s.xd.data(), s.xs.data(), w.K, w.K / kBlock};
    const int64_t groups = (w.N + kRows - 1) / kRows;
    weight_matmul_groups(w.format, false, x, T, w.packed, w.N, groups * id / n, groups * (id + 1) / n, y);
  }
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

inline float dot(const float* a, const float* b, int64_t D) {
#if defined(MINILLM_SIMD)
  if (D % kRows == 0) {
    VecF acc = zero_f();
    for (int64_t d = 0; d < D; d += kRows) acc = fma_f(load_f(a + d), load_f(b + d), acc);
    return sum_f(acc);
  }
#endif
  float sum = 0.f;
  for (int64_t d = 0; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

inline void add_scaled(float w, const float* x, float* y, int64_t D) {  // y += w * x
#if defined(MINILLM_SIMD)
  if (D % kRows == 0) {
    const VecF wv = set1_f(w);
    for (int64_t d = 0; d < D; d += kRows) store_f(y + d, fma_f(wv, load_f(x + d), load_f(y + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) y[d] += w * x[d];
}

// one cached key or value row as floats (an int8 row widened and scaled)
inline const float* cached_row(const Where& at, const void* base, const uint16_t* scales, int64_t slot,
                               int64_t head, int64_t D, float* widened) {
  const int64_t off = at.row(slot, head);
  if (!at.c.int8) return static_cast<const float*>(base) + off;
  const float s = half_to_float(scales[at.scale_at(slot, head)]);
  const int8_t* codes = static_cast<const int8_t*>(base) + off;
#if defined(MINILLM_SIMD)
  if (D % kRows == 0) {  // GCC left the loop below scalar (int8 codes may alias the floats), ~D ops a row
    const VecF sv = set1_f(s);
    for (int64_t d = 0; d < D; d += kRows) store_f(widened + d, mul_f(sv, load_i8_f(codes + d)));
    return widened;
  }
#endif
  for (int64_t d = 0; d < D; ++d) widened[d] = s * static_cast<float>(codes[d]);
  return widened;
}

// While alive, this thread treats denormal floats as zero (x86 MXCSR FTZ and DAZ), as torch's own kernels can be
// told to (torch.set_flush_denormal): a softmax weight of e^-80 times a value is a denormal, and every arithmetic
// instruction on one takes a slow microcode path. Restored on exit: the thread belongs to torch's pool.
struct DenormalsAsZero {
#if defined(__SSE2__)
  unsigned saved = _mm_getcsr();
  DenormalsAsZero() { _mm_setcsr(saved | 0x8040); }
  ~DenormalsAsZero() { _mm_setcsr(saved); }
#endif
};

struct Run {  // new tokens [t0, t1) of one sequence at consecutive positions
  int64_t t0, t1;
};
// tokens per run: a verify step's k + 1 share every key and value row read; a long prompt chunk still splits into
// many runs (their scores stay small: tokens x heads x context floats)
constexpr int64_t kRunTokens = 16;
// keys per attention task at most: the flash-decoding split of a long context over threads (a multiple of kKeyChunk;
// 128 left one thread alone with a 129-key decode, 0.53 against 0.34 ms a step, int8 KV, 2 threads)
constexpr int64_t kTaskKeys = 64;

struct Partial {  // one task's share of a run's attention: every query row over keys [k0, k1)
  float* acc;     // (rows, D) sum of e^(s - m) v
  float* m;       // (rows,) the largest score seen (-inf: none)
  float* l;       // (rows,) sum of e^(s - m)
};

#if defined(MINILLM_SIMD)
// Both passes walk the keys in chunks whose rows (every KV head's) stay in L1 while each query row reads them: the
// rows of a verify step or a prompt chunk then cost arithmetic, not another trip to L2 or memory per row.
constexpr int64_t kKeyChunk = 32;

// one chunk's K or V rows as floats, (key, KV head) -> D floats: a float cache's rows where they lie, an int8
// cache's widened into `staged`; keys past the chunk's end (to a multiple of 4) point at zeros
void chunk_rows(const Where& at, bool keys, int64_t c0, int64_t c1, const int64_t* slot_of, int64_t nkv, int64_t D,
                std::vector<float>& staged, std::vector<const float*>& rows) {
  static const float zeros[8 * 16] = {};  // D <= 128
  const int64_t padded = (c1 - c0 + 3) / 4 * 4;
  const void* base = keys ? at.c.k : at.c.v;
  const uint16_t* scales = keys ? at.c.k_scale : at.c.v_scale;
  staged.resize(at.c.int8 ? kKeyChunk * nkv * D : 0);
  rows.resize(kKeyChunk * nkv);
  for (int64_t p = c0; p < c0 + padded; ++p)
    for (int64_t h = 0; h < nkv; ++h) {
      const int64_t i = (p - c0) * nkv + h;
      rows[i] = p >= c1 ? zeros : cached_row(at, base, scales, slot_of[p], h, D, staged.data() + i * D);
    }
}

// Pass 1 of attend_keys: a query row (pre-scaled, laid out once per KV head) sits in NV registers while it meets 4
// keys at a time, and one tree of adds reduces their 4 sums together (sum4_f). Every (row, key) score is the same
// products summed in the same order whatever run, chunk or task it falls in, so a verify step equals its decode
// steps bit for bit. (A layout with one row per lane, an earlier version, filled 3 of 8 lanes in a decode step and
// waited on FMA latency; one key in registers against every row, the next one, spent most of its time in the
// horizontal sums.)
template <int NV>
void scores_by_key(int64_t k0, int64_t k1, const int64_t* slot_of, int64_t first, int64_t tokens, const float* q,
                   int64_t qkv_n, const Where& at, int64_t nh, int64_t nkv, float scale, float* scores,
                   std::vector<float>& qs, std::vector<float>& staged, std::vector<const float*>& key) {
  constexpr int64_t D = NV * kRows;
  const int64_t group = nh / nkv, count = tokens * group, n = k1 - k0;
  qs.resize(nkv * count * D);  // row i of KV head h: query head h * group + i % group of token i / group
  for (int64_t h = 0; h < nkv; ++h)
    for (int64_t i = 0; i < count; ++i) {
      const float* row = q + (i / group) * qkv_n + (h * group + i % group) * D;
      float* dst = qs.data() + (h * count + i) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = row[d] * scale;
    }
  for (int64_t c0 = k0; c0 < k1; c0 += kKeyChunk) {
    const int64_t c1 = std::min(k1, c0 + kKeyChunk), len = c1 - c0;
    chunk_rows(at, true, c0, c1, slot_of, nkv, D, staged, key);
    const int64_t seen_from = std::max<int64_t>(0, c0 - first) * group;  // rows that see some key of the chunk
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t i = seen_from; i < count; ++i) {
        const float* qi = qs.data() + (h * count + i) * D;
        VecF qv[NV];
        for (int j = 0; j < NV; ++j) qv[j] = load_f(qi + j * kRows);
        // a row's scores of keys it cannot see are computed too, and never read (softmax stops at its last key)
        float* out = scores + ((i / group) * nh + h * group + i % group) * n + (c0 - k0);
        for (int64_t p = 0; p < len; p += 4) {
          const float *a = key[p * nkv + h], *b = key[(p + 1) * nkv + h], *c = key[(p + 2) * nkv + h],
                      *d = key[(p + 3) * nkv + h];
          VecF sa = mul_f(qv[0], load_f(a)), sb = mul_f(qv[0], load_f(b)), sc = mul_f(qv[0], load_f(c)),
               sd = mul_f(qv[0], load_f(d));
          for (int j = 1; j < NV; ++j) {
            sa = fma_f(qv[j], load_f(a + j * kRows), sa), sb = fma_f(qv[j], load_f(b + j * kRows), sb);
            sc = fma_f(qv[j], load_f(c + j * kRows), sc), sd = fma_f(qv[j], load_f(d + j * kRows), sd);
          }
          const __m128 four = sum4_f(sa, sb, sc, sd);
          if (p + 4 <= len) {
            _mm_storeu_ps(out + p, four);
          } else {
            alignas(16) float last[4];
            _mm_store_ps(last, four);
            std::copy(last, last + (len - p), out + p);
          }
        }
      }
  }
}

// Pass 2 of attend_keys: each output row keeps its D sums in NV registers across a chunk's keys (stored back once
// per chunk), every key in order from k0: the same sums as one pass over all keys.
template <int NV>
void values_by_row(int64_t k0, int64_t k1, const int64_t* slot_of, int64_t first, int64_t rows, int64_t nh, int64_t nkv,
                   const Where& at, const float* scores, std::vector<float>& staged, std::vector<const float*>& value,
                   float* acc) {
  constexpr int64_t D = NV * kRows;
  const int64_t n = k1 - k0, group = nh / nkv;
  for (int64_t c0 = k0; c0 < k1; c0 += kKeyChunk) {
    const int64_t c1 = std::min(k1, c0 + kKeyChunk);
    chunk_rows(at, false, c0, c1, slot_of, nkv, D, staged, value);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = (r % nh) / group, end = std::min(c1, first + r / nh + 1);  // keys 0..pos of its token
      if (end <= c0) continue;
      const float* sc = scores + r * n - k0;
      float* out = acc + r * D;
      VecF sum[NV];
      for (int j = 0; j < NV; ++j) sum[j] = load_f(out + j * kRows);
      for (int64_t p = c0; p < end; ++p) {
        const VecF w = set1_f(sc[p]);
        const float* v = value[(p - c0) * nkv + h];
        for (int j = 0; j < NV; ++j) sum[j] = fma_f(w, load_f(v + j * kRows), sum[j]);
      }
      for (int j = 0; j < NV; ++j) store_f(out + j * kRows, sum[j]);
    }
  }
}

// Pass 2 with a KV head's G query rows of one token at once (they see the same keys and read the same value rows):
// each value vector, loaded once, feeds G rows' sums; half of D at a time keeps 4 G sums, 4 value vectors and a
// weight in registers. Every (row, d) sum still adds its keys in order, one FMA each: the same numbers as
// values_by_row, bit for bit. A/B on SmolLM2 (G = 3), 2 threads: attention of a 5-token verify step 10-17% less
// over an int8 cache and 6-7% over a float one, of an int8 decode step 4-11% (128-2,048 keys).
template <int NV, int G>
void values_by_group(int64_t k0, int64_t k1, const int64_t* slot_of, int64_t first, int64_t rows, int64_t nh,
                     int64_t nkv, const Where& at, const float* scores, std::vector<float>& staged,
                     std::vector<const float*>& value, float* acc) {
  const int64_t n = k1 - k0;
  for (int64_t c0 = k0; c0 < k1; c0 += kKeyChunk) {
    const int64_t c1 = std::min(k1, c0 + kKeyChunk);
    chunk_rows(at, false, c0, c1, slot_of, nkv, NV * kRows, staged, value);
    for (int64_t r0 = 0; r0 < rows; r0 += G) {  // rows r0 .. r0 + G - 1: one token, the query heads of one KV head
      const int64_t h = (r0 % nh) / G, end = std::min(c1, first + r0 / nh + 1);
      if (end <= c0) continue;
      const float* const* v = value.data() + h;
      const float* sc = scores + r0 * n - k0;
      float* out = acc + r0 * NV * kRows;
      constexpr int kSub = 4;  // value vectors a sub-block
      for (int j = 0; j < NV; j += kSub) {
        VecF sum[G][kSub];
        for (int g = 0; g < G; ++g)
          for (int x = 0; x < kSub; ++x) sum[g][x] = load_f(out + g * NV * kRows + (j + x) * kRows);
        for (int64_t p = c0; p < end; ++p) {
          const float* row = v[(p - c0) * nkv];
          VecF a[kSub];
          for (int x = 0; x < kSub; ++x) a[x] = load_f(row + (j + x) * kRows);
          for (int g = 0; g < G; ++g) {
            const VecF w = set1_f(sc[g * n + p]);
            for (int x = 0; x < kSub; ++x) sum[g][x] = fma_f(w, a[x], sum[g][x]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int x = 0; x < kSub; ++x) store_f(out + g * NV * kRows + (j + x) * kRows, sum[g][x]);
      }
    }
  }
}
#endif

// Attention of every query head of `run`'s tokens over keys [k0, k1) of its sequence (token t sees 0..pos[t]),
// unnormalised. All heads in one task: in a paged pool a slot holds every KV head's row side by side, so a task
// reads each slot's bytes once and in order (one task per KV head read a third of every slot and ran 3x slower, the
// hardware prefetcher pulling the other heads' bytes too). A long context splits over tasks by key range: the
// flash-decoding split, merged by merge_partials.
void attend_keys(const Run& run, int64_t k0, int64_t k1, const float* qkv, int64_t qkv_n, const NativeTokens& tok,
                 const int64_t* slot_of, const Where& at, int64_t nh, int64_t nkv, int64_t D, float scale,
                 std::vector<float>& scores, std::vector<float>& widened, std::vector<float>& qt,
                 std::vector<const float*>& chunk, const Partial& out) {
  const NativeCache& c = at.c;
  const int64_t first = tok.pos[run.t0], rows = (run.t1 - run.t0) * nh, n = k1 - k0;
  const int64_t group = nh / nkv;
  scores.resize(rows * n);
  widened.resize(D);
  auto query = [&](int64_t r) { return qkv + (run.t0 + r / nh) * qkv_n + (r % nh) * D; };
  auto first_row = [&](int64_t p) { return std::max<int64_t>(0, p - first) * nh; };  // rows of tokens that see p
#if defined(MINILLM_SIMD)
  const int64_t tokens = run.t1 - run.t0;
  // every run, one token or many, takes the same arithmetic per (row, key): a verify step's logits then equal the
  // decode steps' bit for bit, and speculative decoding stays exactly the target's greedy output
  if (D == 8 * kRows)
    scores_by_key<8>(k0, k1, slot_of, first, tokens, query(0), qkv_n, at, nh, nkv, scale, scores.data(), qt, widened,
                     chunk);
  else if (D == 4 * kRows)
    scores_by_key<4>(k0, k1, slot_of, first, tokens, query(0), qkv_n, at, nh, nkv, scale, scores.data(), qt, widened,
                     chunk);
  else
#endif
    for (int64_t p = k0; p < k1; ++p) {  // pass 1: scores, one (query row, key) dot at a time
      const int64_t slot = slot_of[p];
      for (int64_t h = 0; h < nkv; ++h) {
        const float* key = cached_row(at, c.k, c.k_scale, slot, h, D, widened.data());
        for (int64_t r = first_row(p); r < rows; r += nh)
          for (int64_t g = h * group; g < (h + 1) * group; ++g)
            scores[(r + g) * n + p - k0] = dot(query(r + g), key, D) * scale;
      }
    }
  for (int64_t r = 0; r < rows; ++r) {  // softmax numerators over the row's keys in this range
    float* sc = scores.data() + r * n;
    const int64_t seen = std::min(k1, first + r / nh + 1) - k0;
    float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t i = 0; i < seen; ++i) top = std::max(top, sc[i]);
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < seen; ++i) {
      sc[i] = exp_nonpositive(sc[i] - top);
      sum += sc[i];
    }
    out.m[r] = top;
    out.l[r] = sum;  // 0 when no key of the range is visible to the row
    std::fill(out.acc + r * D, out.acc + (r + 1) * D, 0.f);
  }
#if defined(MINILLM_SIMD)
  // G rows at a time where the value rows are read from L1 more than once: an int8 chunk's widened rows, or a run
  // of several tokens. A float cache's decode step keeps the row kernel: it reads each value row once, in order (the
  // grouped one reads it in two halves, 3-5% slower at 128-2,048 keys)
  if (D == 8 * kRows && nh / nkv == 3 && (c.int8 || run.t1 - run.t0 > 1))
    return values_by_group<8, 3>(k0, k1, slot_of, first, rows, nh, nkv, at, scores.data(), widened, chunk, out.acc);
  if (D == 8 * kRows)
    return values_by_row<8>(k0, k1, slot_of, first, rows, nh, nkv, at, scores.data(), widened, chunk, out.acc);
  if (D == 4 * kRows)
    return values_by_row<4>(k0, k1, slot_of, first, rows, nh, nkv, at, scores.data(), widened, chunk, out.acc);
#endif
  for (int64_t p = k0; p < k1; ++p) {  // pass 2: the weighted sum of the values, one (row, key) pair at a time
    const int64_t slot = slot_of[p];
    for (int64_t h = 0; h < nkv; ++h) {
      const float* value = cached_row(at, c.v, c.v_scale, slot, h, D, widened.data());
      for (int64_t r = first_row(p); r < rows; r += nh)
        for (int64_t g = h * group; g < (h + 1) * group; ++g)
          add_scaled(scores[(r + g) * n + p - k0], value, out.acc + (r + g) * D, D);
    }
  }
}

// softmax(...) v of a run's rows from its tasks' partials: rescale each to the largest score, sum, divide
void merge_partials(const std::vector<Partial>& parts, int64_t rows, int64_t D, float* att_run) {
  for (int64_t r = 0; r < rows; ++r) {
    float top = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (const Partial& p : parts) top = std::max(top, p.m[r]);
    float* out = att_run + r * D;
    std::fill(out, out + D, 0.f);
    for (const Partial& p : parts) {
      if (p.l[r] == 0.f) continue;  // no key of this range is visible to the row
      const float w = std::exp(p.m[r] - top);
      total += w * p.l[r];
      add_scaled(w, p.acc + r * D, out, D);
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
  }
}

}  // namespace

// the first thread's clock: each stage's time, up to and including its closing barrier (waiting for the others)
struct StageClock {
  double* seconds;
  double last = omp_get_wtime();
  void stage(NativeStage s) {
    if (omp_get_thread_num() != 0) return;
    const double now = omp_get_wtime();
    seconds[s] += now - last;
    last = now;
  }
};

void native_layers(const NativeModel& m, const NativeCache& cache, const NativeTokens& tok, float* h, int threads,
                   double seconds[4]) {
  const double start = omp_get_wtime();
  const int64_t T = tok.T, dim = m.dim, D = m.head_dim, nh = m.n_heads, nkv = m.n_kv_heads, ffn = m.ffn_dim;
  const int64_t qkv_n = (nh + 2 * nkv) * D, widest = std::max({dim, ffn, nh * D});
  Scratch s;
  s.xn.resize(T * dim), s.qkv.resize(T * qkv_n), s.att.resize(T * nh * D), s.proj.resize(T * dim);
  s.gate_up.resize(T * 2 * ffn), s.act.resize(T * ffn);
  s.xq.resize(T * widest), s.xd.resize(T * widest / kBlock), s.xs.resize(T * widest / kBlock);
  std::vector<int64_t> slots(T);
  std::vector<Run> runs;  // up to kRunTokens consecutive tokens of one sequence
  for (int64_t t = 0; t < T; ++t) {
    slots[t] = Where{cache, 0}.slot(tok.seq[t], tok.pos[t]);
    const bool extends = !runs.empty() && runs.back().t1 == t && tok.seq[t] == tok.seq[t - 1] &&
                         tok.pos[t] == tok.pos[t - 1] + 1 && t - runs.back().t0 < kRunTokens;
    if (extends)
      runs.back().t1 = t + 1;
    else
      runs.push_back({t, t + 1});
  }
  // attention tasks: (run, key range), the keys cut at every multiple of kTaskKeys. Fixed cuts, not a share of the
  // run's keys per thread: a row's partial sums (and so their merge) are then the same whatever the run's length
  // and the thread count, and a verify step equals its decode steps bit for bit at any context (cut at a share,
  // a 5-token run and a 1-token run of the same sequence merged different partials)
  const int64_t R = static_cast<int64_t>(runs.size());
  std::vector<int64_t> task_run, task_k0, task_k1, run_first_task(R + 1);
  int64_t partial_floats = 0;
  std::vector<int64_t> task_offset;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = tok.pos[runs[r].t1 - 1] + 1, rows = (runs[r].t1 - runs[r].t0) * nh;
    run_first_task[r] = static_cast<int64_t>(task_run.size());
    for (int64_t k0 = 0; k0 < n; k0 += kTaskKeys) {
      task_run.push_back(r), task_k0.push_back(k0), task_k1.push_back(std::min(n, k0 + kTaskKeys));
      task_offset.push_back(partial_floats);
      partial_floats += rows * (D + 2);
    }
  }
  run_first_task[R] = static_cast<int64_t>(task_run.size());
  // each sequence's cache slot by key position, once per call for every layer (Where::slot divides by the block
  // size; asked per key in both attention passes of every layer, it cost nothing measurable, timed by hand)
  std::vector<std::vector<int64_t>> key_slots;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t seq = tok.seq[t];
    if (seq >= static_cast<int64_t>(key_slots.size())) key_slots.resize(seq + 1);
    std::vector<int64_t>& ks = key_slots[seq];
    for (int64_t p = static_cast<int64_t>(ks.size()); p <= tok.pos[t]; ++p) ks.push_back(Where{cache, 0}.slot(seq, p));
  }
  std::vector<float> partial_store(partial_floats);
  std::vector<Partial> partials;
  for (size_t i = 0; i < task_run.size(); ++i) {
    const int64_t rows = (runs[task_run[i]].t1 - runs[task_run[i]].t0) * nh;
    float* base = partial_store.data() + task_offset[i];
    partials.push_back({base, base + rows * D, base + rows * D + rows});
  }
  const int64_t n_tasks = static_cast<int64_t>(task_run.size());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
#pragma omp parallel num_threads(std::max(1, threads))
  {
    const DenormalsAsZero ftz;  // softmax weights far below the top make denormal products, ~100 cycles each
    std::vector<float> scores, acc, qt;  // this thread's attention scratch (scores, widened int8 rows, queries)
    std::vector<const float*> chunk;  // a key chunk's rows
    StageClock clock{seconds};
    for (size_t l = 0; l < m.layers.size(); ++l) {
      const NativeLayer& L = m.layers[l];
      const Where at{cache, static_cast<int64_t>(l)};
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        rms_norm(h + t * dim, L.attn_norm, dim, m.eps, s.xn.data() + t * dim);
        quantize_rows(L.qkv, s.xn.data(), dim, t, t + 1, s);
      }
      clock.stage(kPointwise);
      matmul(L.qkv, s.xn.data(), s, T, s.qkv.data());
      clock.stage(kMatmul);
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
      clock.stage(kPointwise);
#pragma omp for schedule(dynamic)
      for (int64_t task = 0; task < n_tasks; ++task)
        attend_keys(runs[task_run[task]], task_k0[task], task_k1[task], s.qkv.data(), qkv_n, tok,
                    key_slots[tok.seq[runs[task_run[task]].t0]].data(), at, nh, nkv, D, scale, scores, acc, qt, chunk,
                    partials[task]);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < R; ++r) {
        const std::vector<Partial> parts(partials.begin() + run_first_task[r],
                                         partials.begin() + run_first_task[r + 1]);
        merge_partials(parts, (runs[r].t1 - runs[r].t0) * nh, D, s.att.data() + runs[r].t0 * nh * D);
      }
      clock.stage(kAttention);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) quantize_rows(L.o, s.att.data(), nh * D, t, t + 1, s);
      clock.stage(kPointwise);
      matmul(L.o, s.att.data(), s, T, s.proj.data());
      clock.stage(kMatmul);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        float* x = h + t * dim;
        const float* o = s.proj.data() + t * dim;
        for (int64_t i = 0; i < dim; ++i) x[i] += o[i];
        rms_norm(x, L.mlp_norm, dim, m.eps, s.xn.data() + t * dim);
        quantize_rows(L.gate_up, s.xn.data(), dim, t, t + 1, s);
      }
      clock.stage(kPointwise);
      matmul(L.gate_up, s.xn.data(), s, T, s.gate_up.data());
      clock.stage(kMatmul);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {  // SiLU(gate) * up
        const float *g = s.gate_up.data() + t * 2 * ffn, *u = g + ffn;
        float* a = s.act.data() + t * ffn;
#pragma omp simd
        for (int64_t i = 0; i < ffn; ++i) {  // sigmoid from e^-|g| (<= 1): no overflow, and it vectorizes
          const float e = exp_nonpositive(-std::fabs(g[i]));
          a[i] = g[i] * (g[i] >= 0.f ? 1.f : e) / (1.f + e) * u[i];
        }
        quantize_rows(L.down, s.act.data(), ffn, t, t + 1, s);
      }
      clock.stage(kPointwise);
      matmul(L.down, s.act.data(), s, T, s.proj.data());
      clock.stage(kMatmul);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) {
        float* x = h + t * dim;
        const float* d = s.proj.data() + t * dim;
        for (int64_t i = 0; i < dim; ++i) x[i] += d[i];
      }
      clock.stage(kPointwise);
    }
  }
  seconds[kTotal] += omp_get_wtime() - start;  // the stages, plus this call's setup and the region's start and end
}

}  // namespace minillm

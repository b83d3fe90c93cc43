// y = x @ W.T for a float32 weight read where it lies: an nn.Linear's own (N, K) row-major tensor, no repacked copy.
// The native step's matmul over float32 weights (lesson 06's last rung without quantizing), and its LM head.
//
// A tile is 4 weight rows x up to 3 activation rows: 12 vector sums in registers, each step along K loading 4
// weight vectors and 3 activation vectors for 12 FMAs, so the weights' bytes (what bounds a decode step) are read
// once for every 3 rows, and a tile's 4 rows stay in L1 while every activation row passes them. sum4_f folds a
// row's 4 sums into one vector at the end. Each output's sum runs in the same order whatever M is and wherever the
// threads cut N: a row's result does not depend on what else is in the batch (a verify equals its decode steps).
// With 2 or more activation rows the loop computes long enough that the hardware prefetcher falls behind the 4
// weight streams: the first pass over a tile asks for the next tile's lines (timed: 11-17% off the model's matmuls
// at 2-16 rows, 2 threads, AVX2 EPYC; nothing at 1 row, which streams at the memory's rate without it).
#include <algorithm>

#include "lowbit.h"
#include "simd.h"

namespace minillm {

namespace {

constexpr int64_t kWeightRows = 4;  // per tile: sum4_f folds their sums together
constexpr int kMaxRows = 3;         // activation rows per tile: 12 sums + 3 activations + 1 weight = 16 registers

// next: the following tile's rows, whose cache lines this pass requests (nullptr: none)
template <int MT>
void f32_tile(const float* x, int64_t K, const float* const w[kWeightRows], const float* const* next,
              float out[kMaxRows][kWeightRows]) {
  int64_t k = 0;
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < kWeightRows; ++r) out[t][r] = 0.f;
#if defined(MINILLM_SIMD)
  constexpr int64_t L = sizeof(VecF) / sizeof(float);
  VecF acc[MT][kWeightRows];
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < kWeightRows; ++r) acc[t][r] = zero_f();
  for (; k + L <= K; k += L) {
    if (next != nullptr && k % 16 == 0)  // one request per 64-byte line of each row
      for (int r = 0; r < kWeightRows; ++r) _mm_prefetch(reinterpret_cast<const char*>(next[r] + k), _MM_HINT_T0);
    VecF xv[MT];
    for (int t = 0; t < MT; ++t) xv[t] = load_f(x + t * K + k);
    for (int r = 0; r < kWeightRows; ++r) {
      const VecF wv = load_f(w[r] + k);
      for (int t = 0; t < MT; ++t) acc[t][r] = fma_f(wv, xv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < MT; ++t) _mm_storeu_ps(out[t], sum4_f(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
#endif
  for (; k < K; ++k)  // the tail past the last whole vector (all of K in the plain build)
    for (int t = 0; t < MT; ++t)
      for (int r = 0; r < kWeightRows; ++r) out[t][r] += x[t * K + k] * w[r][k];
}

}  // namespace

int64_t f32_tiles(int64_t N) { return (N + kWeightRows - 1) / kWeightRows; }

void f32_matmul_tiles(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t tile0, int64_t tile1,
                      float* y) {
  float out[kMaxRows][kWeightRows];
  for (int64_t tile = tile0; tile < tile1; ++tile) {
    const int64_t n = tile * kWeightRows, valid = std::min(kWeightRows, N - n);
    const float *rows[kWeightRows], *next[kWeightRows];
    for (int64_t r = 0; r < kWeightRows; ++r) {  // past N: a row read twice
      rows[r] = w + std::min(n + r, N - 1) * K;
      next[r] = w + std::min(n + kWeightRows + r, N - 1) * K;
    }
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mt = std::min<int64_t>(kMaxRows, M - m0);
      const float* xt = x + m0 * K;
      const float* const* ahead = M > 1 && m0 == 0 && tile + 1 < tile1 ? next : nullptr;
      if (mt == 3) f32_tile<3>(xt, K, rows, ahead, out);
      else if (mt == 2) f32_tile<2>(xt, K, rows, ahead, out);
      else f32_tile<1>(xt, K, rows, ahead, out);
      for (int64_t t = 0; t < mt; ++t)
        for (int64_t r = 0; r < valid; ++r) y[(m0 + t) * N + n + r] = out[t][r];
    }
  }
}

}  // namespace minillm

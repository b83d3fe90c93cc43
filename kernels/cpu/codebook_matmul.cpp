// y = x @ W.T for a shared-codebook weight (lesson 08, compress/codebook.py): W[n, k] = table[n / rpc][code[n, k]],
// codes of 3 or 4 bits packed as CodebookLinear stores them (one little-endian bit stream per row: 8 codes in 3 or 4
// bytes), read where they lie. The dense weight is never built: a group of 8 codes is one 32-bit load, spread to 8
// lanes by a variable shift, and looked up in a table held in registers (vpermps: 8 float values, one register; a
// 16-value table is two, blended by the code's top bit). So a token reads 3-4 bits a weight instead of 32.
//
// Two activation rows share each decoded group; each row keeps 4 sums (one FMA chain waits on its own latency: by
// hand, 2 threads, a loaded machine, the model's 210 block matmuls at 1 row took 12.9 ms with one sum, 10.4 with
// four). Each output's sum runs in one order whatever M is and wherever the threads cut N.
#include <algorithm>
#include <cstring>

#include "lowbit.h"
#include "simd.h"

namespace minillm {

namespace {

constexpr int kMaxRows = 2;  // activation rows per pass: 4 x 2 sums + 2 tables + codes + weights + activations
constexpr int kSums = 4;     // sums per activation row (the same for every M: a row's result is its batch's)

template <int BITS>
inline uint32_t group_bits(const uint8_t* p, bool last) {
  uint32_t v = 0;
  if (last) std::memcpy(&v, p, BITS);  // a row's last group holds BITS bytes: reading 4 could pass the buffer
  else std::memcpy(&v, p, 4);          // one unaligned load
  return v;
}

// one weight row n against MT activation rows: out[t] = x[t] . W[n]
template <int BITS, int MT>
void codebook_row(const float* x, int64_t K, const uint8_t* codes, const float* table, float out[kMaxRows]) {
  constexpr uint32_t mask = (1u << BITS) - 1;
  const int64_t groups = (K + 7) / 8, whole = K / 8;
  int64_t g = 0;
  for (int t = 0; t < MT; ++t) out[t] = 0.f;
#if defined(MINILLM_SIMD)
  const __m256i shifts = BITS == 3 ? _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21)
                                   : _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i low = _mm256_set1_epi32(static_cast<int>(mask));
  const __m256 t0 = _mm256_loadu_ps(table), t1 = BITS == 4 ? _mm256_loadu_ps(table + 8) : t0;
  // 4 sums per activation row, group g adding into sum g % 4: one chain of FMAs would wait on each other's latency
  __m256 acc[kSums][MT];
  for (int u = 0; u < kSums; ++u)
    for (int t = 0; t < MT; ++t) acc[u][t] = _mm256_setzero_ps();
  const auto add_group = [&](int64_t gg, __m256* sums) {
    const auto v = static_cast<int32_t>(group_bits<BITS>(codes + gg * BITS, gg + 1 == groups));
    const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(v), shifts), low);
    __m256 w = _mm256_permutevar8x32_ps(t0, c);  // vpermps reads the low 3 bits of each lane's code
    if constexpr (BITS == 4)  // codes 8-15 from the second half: bit 3 moved to the sign bit picks it
      w = _mm256_blendv_ps(w, _mm256_permutevar8x32_ps(t1, c), _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
    for (int t = 0; t < MT; ++t) sums[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * K + gg * 8), sums[t]);
  };
  for (; g + kSums <= whole; g += kSums) {  // unrolled by hand: an indexed sum would live in memory
    add_group(g, acc[0]);
    add_group(g + 1, acc[1]);
    add_group(g + 2, acc[2]);
    add_group(g + 3, acc[3]);
  }
  if (g < whole) add_group(g++, acc[0]);
  if (g < whole) add_group(g++, acc[1]);
  if (g < whole) add_group(g++, acc[2]);
  for (int t = 0; t < MT; ++t) {
    const __m256 a = _mm256_add_ps(_mm256_add_ps(acc[0][t], acc[1][t]), _mm256_add_ps(acc[2][t], acc[3][t]));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
    out[t] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
#endif
  for (; g < groups; ++g) {  // the last part group (all of K in the plain build)
    const uint32_t v = group_bits<BITS>(codes + g * BITS, g + 1 == groups);
    for (int64_t j = 0; j < 8 && g * 8 + j < K; ++j) {
      const float w = table[(v >> (BITS * j)) & mask];
      for (int t = 0; t < MT; ++t) out[t] += w * x[t * K + g * 8 + j];
    }
  }
}

template <int BITS>
void codebook_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* tables,
                   int64_t rows_per_table, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t row_bytes = (K + 7) / 8 * BITS;
  float out[kMaxRows];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * row_bytes;
    const float* table = tables + n / rows_per_table * (1 << BITS);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t mt = std::min<int64_t>(kMaxRows, M - m0);
      const float* xt = x + m0 * K;
      if (mt == 2) codebook_row<BITS, 2>(xt, K, c, table, out);
      else codebook_row<BITS, 1>(xt, K, c, table, out);
      for (int64_t t = 0; t < mt; ++t) y[(m0 + t) * N + n] = out[t];
    }
  }
}

}  // namespace

void codebook_matmul_rows(const float* x, int64_t M, int64_t K, const uint8_t* codes, int bits, const float* tables,
                          int64_t rows_per_table, int64_t N, int64_t n0, int64_t n1, float* y) {
  if (bits == 3) codebook_rows<3>(x, M, K, codes, tables, rows_per_table, N, n0, n1, y);
  else codebook_rows<4>(x, M, K, codes, tables, rows_per_table, N, n0, n1, y);
}

}  // namespace minillm

// The Python face of the CPU kernels (built, probed and called by kernels/cpu_lowbit.py): tensors in, checks, raw
// pointers out to the plain C++ kernels. The only unit that includes torch's headers (they cost most of a build).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "lowbit.h"
#include "matmul_driver.h"
#include "native_step.h"
#include "q8_activations.h"
#include "simd.h"

namespace minillm {
namespace {

// x (..., K) @ W.T -> (..., N) in x's dtype, W = repack_q4_1(...) or repack_int8(...)
at::Tensor lowbit_matmul(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, WeightFormat format,
                         const char* what, bool reference) {
  TORCH_CHECK(x_in.dim() >= 1, "x must be (..., K)");
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "x and the packed weights must be on the CPU");
  const int64_t K = x_in.size(-1), M = x_in.numel() / std::max<int64_t>(K, 1), groups = (N + kRows - 1) / kRows;
  const int64_t bytes = group_bytes(format);
  TORCH_CHECK(K % kBlock == 0, "K = ", K, " must be a multiple of 32 (the blocks of 32 inputs that share a scale)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == groups && packed.size(1) == K / kBlock && packed.size(2) == bytes,
              "packed must be ", what, "'s contiguous uint8 (", groups, ", ", K / kBlock, ", ", bytes, "), got ",
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
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    weight_matmul_groups(format, reference, rows, M, packed.data_ptr<uint8_t>(), N, g0, g1, y.data_ptr<float>());
  });
  std::vector<int64_t> shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape).to(x_in.scalar_type());
}

at::Tensor q4_1_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool reference) {
  return lowbit_matmul(x, packed, N, kQ4_1, "repack_q4_1", reference);
}

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool reference) {
  return lowbit_matmul(x, packed, N, kInt8, "repack_int8", reference);
}

// x (..., K) @ W.T -> (..., N) float32, W a float32 (N, K) weight as it lies (f32_matmul.cpp): the LM head of a
// float32 model's native step. Each output's sum in one order whatever the rows and threads.
at::Tensor f32_matmul(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be a float32 CPU (..., K) tensor, got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.device().is_cpu() &&
                  w.size(1) == x_in.size(-1) && w.size(0) > 0 && w.size(1) > 0,
              "w must be a contiguous float32 CPU (N, ", x_in.size(-1), ") tensor, got ", w.scalar_type(), " ",
              w.sizes());
  const int64_t K = w.size(1), N = w.size(0), M = x_in.numel() / std::max<int64_t>(K, 1);
  const at::Tensor x = x_in.reshape({M, K}).contiguous();
  at::Tensor y = at::empty({M, N}, at::kFloat);
  at::parallel_for(0, f32_tiles(N), 16, [&](int64_t t0, int64_t t1) {
    f32_matmul_tiles(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, t0, t1, y.data_ptr<float>());
  });
  std::vector<int64_t> shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// x (..., K) @ W.T -> (..., N) float32, W given as a CodebookLinear holds it (codebook_matmul.cpp): codes uint8
// (N, (K + 7) / 8 * bits), tables float32 (groups of rows, 2**bits). The dense weight is never built.
at::Tensor codebook_matmul(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& tables, int64_t bits,
                           int64_t K) {
  TORCH_CHECK(bits == 3 || bits == 4, "the codebook kernel takes 3- or 4-bit codes, got ", bits, " bits");
  TORCH_CHECK(K > 0 && x_in.dim() >= 1 && x_in.size(-1) == K && x_in.scalar_type() == at::kFloat &&
                  x_in.device().is_cpu(),
              "x must be a float32 CPU (..., ", K, ") tensor, got ", x_in.scalar_type(), " ", x_in.sizes());
  const int64_t row_bytes = (K + 7) / 8 * bits;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu() &&
                  codes.size(1) == row_bytes && codes.size(0) > 0,
              "codes must be contiguous uint8 CPU (N, ", row_bytes, ") (", bits, "-bit codes of ", K,
              " inputs packed by pack_codes), got ", codes.scalar_type(), " ", codes.sizes());
  const int64_t N = codes.size(0);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kFloat && tables.is_contiguous() &&
                  tables.device().is_cpu() && tables.size(1) == (int64_t{1} << bits) && tables.size(0) > 0 &&
                  N % tables.size(0) == 0,
              "tables must be contiguous float32 CPU (groups of rows dividing ", N, ", ", (1 << bits), "), got ",
              tables.scalar_type(), " ", tables.sizes());
  const int64_t M = x_in.numel() / K, per_table = N / tables.size(0);
  const at::Tensor x = x_in.reshape({M, K}).contiguous();
  at::Tensor y = at::empty({M, N}, at::kFloat);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    codebook_matmul_rows(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), static_cast<int>(bits),
                         tables.data_ptr<float>(), per_table, N, n0, n1, y.data_ptr<float>());
  });
  std::vector<int64_t> shape = x_in.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

// rows `ids` (any shape, int64, each in [0, N)) of an (N, K) repack_int8 weight as float32 (*ids.shape, K)
at::Tensor int8_embedding(const at::Tensor& packed, const at::Tensor& ids_in, int64_t N, int64_t K) {
  const int64_t groups = (N + kRows - 1) / kRows;
  TORCH_CHECK(K % kBlock == 0, "K = ", K, " must be a multiple of 32 (the blocks of 32 inputs that share a scale)");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.dim() == 3 && packed.size(0) == groups && packed.size(1) == K / kBlock &&
                  packed.size(2) == group_bytes(kInt8),
              "packed must be repack_int8's contiguous uint8 (", groups, ", ", K / kBlock, ", ", group_bytes(kInt8),
              "), got ", packed.sizes());
  TORCH_CHECK(ids_in.device().is_cpu() && !at::isFloatingType(ids_in.scalar_type()), "ids must be integer, on the CPU");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "token ids must be in [0, ", N, "), got ", id[i]);
  at::Tensor out = at::empty({n, K}, at::kFloat);
  int8_rows_float(packed.data_ptr<uint8_t>(), K / kBlock, id, n, out.data_ptr<float>());
  std::vector<int64_t> shape = ids_in.sizes().vec();
  shape.push_back(K);
  return out.view(shape);
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

// q (n, n_heads, head_dim) float32 or bfloat16; k/v pools int8 (num_blocks, block_size, n_kv_heads, head_dim) and
// their float16 scales (num_blocks, block_size, n_kv_heads); block_tables (n, max_blocks) int; context_lens (n,)
// int -> (n, n_heads, head_dim) in q's dtype (int8_kv_attention.cpp).
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
  const Int8DecodeArgs args{q.data_ptr<float>(),
                            k_pool.data_ptr<int8_t>(),
                            v_pool.data_ptr<int8_t>(),
                            reinterpret_cast<const uint16_t*>(k_scale.data_ptr<at::Half>()),
                            reinterpret_cast<const uint16_t*>(v_scale.data_ptr<at::Half>()),
                            table, ctx, width, block_size, n_heads, n_kv, D, static_cast<float>(scale),
                            out.data_ptr<float>()};
  // tasks (sequence, KV head), KV head fastest: neighbouring tasks read neighbouring bytes of the same slots. A few
  // thousand tokens per chunk at least, so a short step does not pay to wake the other threads.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, work / n));
  at::parallel_for(0, n * n_kv, grain, [&](int64_t t0, int64_t t1) { int8_decode_tasks(args, t0, t1); });
  return out.to(q_in.scalar_type());
}

// ------------------------------------------------------------------------------------------ the native step

const float* float_vector(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n && t.device().is_cpu(), what,
              " must be a contiguous float32 CPU tensor of ", n, " elements, got ", t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>();
}

NativeWeight weight(const at::Tensor& packed, int64_t format, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(format == kQ4_1 || format == kInt8 || format == kF32, what,
              ": format must be 0 (Q4_1), 1 (int8) or 2 (float32), got ", format);
  if (format == kF32) {
    TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.dim() == 2 &&
                    packed.size(0) == N && packed.size(1) == K && packed.device().is_cpu(),
                what, " must be a contiguous float32 CPU (", N, ", ", K, ") weight, got ", packed.scalar_type(), " ",
                packed.sizes());
    return {kF32, reinterpret_cast<const uint8_t*>(packed.data_ptr<float>()), N, K};
  }
  const auto f = static_cast<WeightFormat>(format);
  TORCH_CHECK(K % kBlock == 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (N + kRows - 1) / kRows && packed.size(1) == K / kBlock &&
                  packed.size(2) == group_bytes(f) && packed.device().is_cpu(),
              what, " must be a repacked (", (N + kRows - 1) / kRows, ", ", K / kBlock, ", ", group_bytes(f),
              ") uint8 CPU tensor for ", N, " x ", K, " weights, got ", packed.sizes());
  return {f, packed.data_ptr<uint8_t>(), N, K};
}

// The model's layers, held once: the tensors stay referenced here as long as the pointers into them are used.
struct NativeDecoder {
  NativeModel model;
  std::vector<at::Tensor> keep;

  // sizes = (dim, n_heads, n_kv_heads, head_dim, ffn_dim); per layer, in order: attn_norm, qkv, o, mlp_norm, gate_up,
  // down; formats: the four weights' formats per layer (0 Q4_1, 1 int8, 2 float32 as it lies)
  NativeDecoder(std::vector<int64_t> sizes, double eps, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> tensors,
                std::vector<int64_t> formats) {
    TORCH_CHECK(sizes.size() == 5, "sizes must be (dim, n_heads, n_kv_heads, head_dim, ffn_dim)");
    const int64_t dim = sizes[0], nh = sizes[1], nkv = sizes[2], D = sizes[3], ffn = sizes[4];
    TORCH_CHECK(dim > 0 && nkv > 0 && nh % nkv == 0 && D % 2 == 0 && D > 0 && ffn > 0, "bad sizes");
    TORCH_CHECK(tensors.size() % 6 == 0 && formats.size() * 6 == tensors.size() * 4,
                "need 6 tensors and 4 formats per layer");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.sizes() == sin.sizes(), "cos/sin must be (max_len, head_dim)");
    model = NativeModel{dim, nh, nkv, D, ffn, cos.size(0), static_cast<float>(eps),
                        float_vector(cos, cos.numel(), "cos"), float_vector(sin, sin.numel(), "sin"), {}};
    for (size_t l = 0; l < tensors.size() / 6; ++l) {
      const at::Tensor* t = tensors.data() + 6 * l;
      const int64_t* f = formats.data() + 4 * l;
      model.layers.push_back({float_vector(t[0], dim, "attn_norm"), weight(t[1], f[0], (nh + 2 * nkv) * D, dim, "qkv"),
                              weight(t[2], f[1], dim, nh * D, "o"), float_vector(t[3], dim, "mlp_norm"),
                              weight(t[4], f[2], 2 * ffn, dim, "gate_up"), weight(t[5], f[3], dim, ffn, "down")});
    }
    keep = tensors;
    keep.push_back(cos);
    keep.push_back(sin);
  }

  // h (T, dim) float32, updated in place. positions (T,) int64; seq (T,) int32, each token's row of tables (S, W)
  // int32. k, v: the whole cache (float32, or int8 with float16 k_scale, v_scale); strides as NativeCache says.
  std::vector<double> step(at::Tensor h, const at::Tensor& positions, const at::Tensor& seq, const at::Tensor& tables,
            int64_t block_size, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_scale,
            const at::Tensor& v_scale, std::vector<int64_t> strides, int64_t threads) {
    const NativeModel& m = model;
    const int64_t T = positions.numel();
    TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 2 && h.size(0) == T &&
                    h.size(1) == m.dim && h.device().is_cpu(),
                "h must be a contiguous float32 CPU (", T, ", ", m.dim, ") tensor, got ", h.scalar_type(), " ",
                h.sizes());
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && seq.scalar_type() == at::kInt &&
                    seq.is_contiguous() && seq.numel() == T,
                "positions must be contiguous int64 (T,) and seq contiguous int32 (T,)");
    TORCH_CHECK(tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.dim() == 2 && block_size > 0,
                "tables must be contiguous int32 (num_seqs, width), block_size > 0");
    TORCH_CHECK(strides.size() == 6, "strides: layer, slot, head, and the scales' layer, slot, head");
    const bool int8 = k.scalar_type() == at::kChar;
    TORCH_CHECK((int8 || k.scalar_type() == at::kFloat) && v.scalar_type() == k.scalar_type() &&
                    k.numel() == v.numel() && k.is_contiguous() && v.is_contiguous() && k.device().is_cpu(),
                "k and v must be one contiguous float32 or int8 CPU cache each, got ", k.scalar_type(), ", ",
                v.scalar_type());
    TORCH_CHECK(!int8 || (k_scale.scalar_type() == at::kHalf && v_scale.scalar_type() == at::kHalf &&
                          k_scale.is_contiguous() && v_scale.is_contiguous() && k_scale.numel() == v_scale.numel()),
                "an int8 cache needs contiguous float16 k_scale and v_scale of one size");
    const int64_t n_layers = static_cast<int64_t>(m.layers.size()), width = tables.size(1);
    // every offset the step touches must lie inside the cache: checked once here, not in the loops
    auto last = [&](int64_t slot, int64_t layer_s, int64_t slot_s, int64_t head_s, int64_t row) {
      return (n_layers - 1) * layer_s + slot * slot_s + (m.n_kv_heads - 1) * head_s + row;
    };
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int32_t* sq = seq.data_ptr<int32_t>();
    const int32_t* tb = tables.data_ptr<int32_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(sq[t] >= 0 && sq[t] < tables.size(0), "token ", t, " belongs to sequence ", sq[t], ", the tables have ",
                  tables.size(0));
      TORCH_CHECK(pos[t] >= 0 && pos[t] < m.max_len && pos[t] < width * block_size, "token ", t, " is at position ",
                  pos[t], ": past the RoPE tables (", m.max_len, ") or its block table (", width * block_size, ")");
      for (int64_t b = 0; b <= pos[t] / block_size; ++b) {
        const int64_t id = tb[sq[t] * width + b];
        TORCH_CHECK(id >= 0 && last((id + 1) * block_size - 1, strides[0], strides[1], strides[2], m.head_dim) <=
                                   k.numel(),
                    "token ", t, " reads block ", id, " (entry ", b, " of its table): outside the cache");
        TORCH_CHECK(!int8 || last((id + 1) * block_size - 1, strides[3], strides[4], strides[5], 1) <= k_scale.numel(),
                    "token ", t, " reads block ", id, ": outside the cache's scales");
      }
    }
    const NativeCache cache{int8,
                            k.data_ptr(),
                            v.data_ptr(),
                            int8 ? reinterpret_cast<uint16_t*>(k_scale.data_ptr<at::Half>()) : nullptr,
                            int8 ? reinterpret_cast<uint16_t*>(v_scale.data_ptr<at::Half>()) : nullptr,
                            strides[0], strides[1], strides[2], strides[3], strides[4], strides[5],
                            tb, width, block_size};
    const NativeTokens tokens{T, pos, sq};
    std::vector<double> seconds(4, 0.0);
    native_layers(m, cache, tokens, h.data_ptr<float>(), static_cast<int>(threads), seconds.data());
    return seconds;  // matmul, attention, pointwise, total (native_step.h NativeStage)
  }
};

}  // namespace
}  // namespace minillm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using minillm::NativeDecoder;
  m.def("q4_1_matmul", &minillm::q4_1_matmul, "x (..., K) @ repacked Q4_1 weights.T -> (..., N), x's dtype");
  m.def("int8_matmul", &minillm::int8_matmul, "x (..., K) @ repacked int8 weights.T -> (..., N), x's dtype");
  m.def("f32_matmul", &minillm::f32_matmul, "x (..., K) float32 @ w.T, w float32 (N, K) as it lies -> (..., N)");
  m.def("codebook_matmul", &minillm::codebook_matmul,
        "x (..., K) float32 @ W.T, W as 3/4-bit codes (N, (K + 7) / 8 * bits) and float32 tables -> (..., N)");
  m.def("int8_embedding", &minillm::int8_embedding,
        "rows ids of an (N, K) repacked int8 weight as float32 (*ids.shape, K): a tied embedding's lookup");
  m.def("paged_int8_decode", &minillm::paged_int8_decode,
        "decode attention (one query per sequence) read from an int8 paged KV pool and its float16 scales");
  pybind11::class_<NativeDecoder>(m, "NativeDecoder")
      .def(pybind11::init<std::vector<int64_t>, double, at::Tensor, at::Tensor, std::vector<at::Tensor>,
                          std::vector<int64_t>>())
      .def("step", &NativeDecoder::step, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "every decoder layer over the step's packed tokens, h updated in place (native_step.cpp); returns the "
           "seconds of its matmuls, attention, pointwise work and the whole call");
  m.attr("isa") = minillm::kIsa;
  m.attr("rows") = minillm::kRows;  // weight rows per repacked group: the layout repack_* must build
}

"""The committed mutant list: named wrong implementations of exercise functions, each with the task that must fail.

A mutant is the reference solution with one bug edited into its source (`edits`: exact (old, new) snippets of the
function's code), so it stays a realistic near-miss and breaks loudly (KeyError below) if the solution it edits
changes. Most are bugs learners write and that earlier graders let through (softmax without the max subtracted, RoPE
rotated in bf16, the top-p boundary, flash's running max started at 0, skipping a blocked head-of-line
request).

tests/test_graders_meta.py runs every mutant against its task's graders and asserts the task fails. By hand:

    python -m tests.graders.mutants 05            # one line per mutant of lesson 05: killed / SURVIVED
"""

from __future__ import annotations

import importlib
import inspect
import json
import linecache
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SOFTMAX_NO_MAX = "(scores.exp() / scores.exp().sum(dim=-1, keepdim=True))"  # exp overflows for scores > 88


@dataclass(frozen=True)
class Mutant:
    name: str
    module: str  # exNN_topic
    target: str  # function name, or Class.method
    task: str  # the task marker that must fail
    edits: tuple[tuple[str, str], ...]
    why: str

    @property
    def lesson(self) -> str:
        return self.module[2:4]


MUTANTS = [
    # ---------------------------------------------------------------- ex00
    Mutant("rms_eps_outside_sqrt", "ex00_decoder", "rms_norm", "task_00_rmsnorm",
           (("torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)", "1 / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)"),),
           "eps added after the square root"),
    Mutant("rms_in_input_dtype", "ex00_decoder", "rms_norm", "task_00_rmsnorm", (("xf = x.float()", "xf = x"),),
           "statistics in float16/bf16: x^2 overflows float16"),
    Mutant("rope_in_bf16", "ex00_decoder", "apply_rope", "task_00_rope",
           (("(x.float() * cos + rotated.float() * sin).to(x.dtype)", "x * cos.to(x.dtype) + rotated * sin.to(x.dtype)"),),
           "rotation computed in the input dtype: bf16 cos/sin and products"),
    Mutant("rope_wrong_direction", "ex00_decoder", "apply_rope", "task_00_rope",
           (("torch.cat([-x2, x1], dim=-1)", "torch.cat([x2, -x1], dim=-1)"),), "rotates by -angle"),
    Mutant("attention_softmax_no_max", "ex00_decoder", "naive_attention", "task_00_attention",
           (("scores.softmax(dim=-1)", SOFTMAX_NO_MAX),), "softmax without subtracting the row max"),
    Mutant("causal_mask_excludes_self", "ex00_decoder", "causal_mask", "task_00_attention",
           (("return j <= i", "return j < i"),), "a query may not see its own key"),
    Mutant("sampler_softmax_no_max", "ex00_decoder", "logits_to_probs", "task_00_sampler",
           (("return logits.softmax(dim=-1)", "return logits.exp() / logits.exp().sum(dim=-1, keepdim=True)"),),
           "softmax without subtracting the max: overflows for large logits"),
    Mutant("top_p_strict_boundary", "ex00_decoder", "logits_to_probs", "task_00_sampler",
           (("probs.cumsum(dim=-1) - probs >= top_p", "probs.cumsum(dim=-1) - probs > top_p"),),
           "top-p keeps a token whose predecessors already reach p exactly"),
    Mutant("top_k_keeps_k_minus_1", "ex00_decoder", "logits_to_probs", "task_00_sampler",
           (("logits.masked_fill(logits < kth", "logits.masked_fill(logits <= kth"),), "top-k drops the k-th token"),
    Mutant("rope_interleaved_pairing", "ex00_decoder", "apply_rope", "task_00_real_model",
           (("x1, x2 = x.chunk(2, dim=-1)", "x1, x2 = x[..., 0::2], x[..., 1::2]"),),
           "GPT-J pairing (2i, 2i+1) on q/k weights laid out for rotate-half: runs, but SmolLM2 stops answering"),
    # ---------------------------------------------------------------- ex01
    Mutant("append_returns_start", "ex01_kv_cache", "append_kv", "task_01_cache_append",
           (("    return end", "    return start"),), "reports the old length"),
    Mutant("append_writes_before_check", "ex01_kv_cache", "append_kv", "task_01_cache_append",
           (("    if end > capacity:", "    k_cache[:, :, start:end] = k[:, :, :max(0, capacity - start)]\n    if end > capacity:"),),
           "a partial write before raising CacheFullError"),
    Mutant("decode_softmax_no_max", "ex01_kv_cache", "decode_attention", "task_01_cached_attention",
           (("scores.softmax(dim=-1)", SOFTMAX_NO_MAX),), "softmax without subtracting the row max"),
    Mutant("decode_reads_whole_buffer", "ex01_kv_cache", "decode_attention", "task_01_cached_attention",
           (("k_cache[:, :, :n_filled]", "k_cache"), ("v_cache[:, :, :n_filled]", "v_cache")),
           "attends over unwritten slots"),
    Mutant("decode_reads_whole_buffer_real", "ex01_kv_cache", "decode_attention", "task_01_real_model",
           (("k_cache[:, :, :n_filled]", "k_cache"), ("v_cache[:, :, :n_filled]", "v_cache")),
           "attends over the real cache's unwritten slots during generate()"),
    # ---------------------------------------------------------------- ex02
    Mutant("grouped_softmax_no_max", "ex02_gqa", "grouped_attention", "task_02_grouped_attention",
           (("scores.softmax(dim=-1)", SOFTMAX_NO_MAX),), "softmax without subtracting the row max"),
    Mutant("grouped_modulo_heads", "ex02_gqa", "grouped_attention", "task_02_grouped_attention",
           (("qg = q.float().reshape(b, n_kv_heads, group, q_len, d)",
             "qg = q.float().reshape(b, group, n_kv_heads, q_len, d).transpose(1, 2)"),),
           "query head h reads KV head h % n_kv_heads"),
    Mutant("mean_pool_sums", "ex02_gqa", "mean_pool_kv_heads", "task_02_mean_pool",
           ((".mean(dim=1)", ".sum(dim=1)"),), "sums the group instead of averaging it"),
    Mutant("grouped_mask_top_left", "ex02_gqa", "grouped_attention", "task_02_real_model",
           (("i = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)",
             "i = torch.arange(q_len, device=q.device)[:, None]"),),
           "causal mask aligned top-left: a decode step's one query sees only the first key"),
    # ---------------------------------------------------------------- ex03
    Mutant("merge_no_empty_guard", "ex03_flash", "merge_partials", "task_03_merge",
           (("m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)", "m_safe = m"),),
           "two empty partials give exp(-inf - -inf) = nan"),
    Mutant("flash_max_init_zero", "ex03_flash", "flash_attention", "task_03_flash",
           (('m = torch.full(rows, float("-inf"), dtype=torch.float32, device=q.device)',
             "m = torch.zeros(rows, dtype=torch.float32, device=q.device)"),),
           "running max starts at 0: rows of very negative scores underflow to 0/0"),
    Mutant("flash_no_rescale", "ex03_flash", "flash_attention", "task_03_flash",
           (("l = rescale * l + p.sum(dim=-1)", "l = l + p.sum(dim=-1)"),
            ("acc = rescale[..., None] * acc + p @ v_tile", "acc = acc + p @ v_tile")),
           "old sums are not rescaled to the new max"),
    Mutant("flash_no_rescale_real", "ex03_flash", "flash_attention", "task_03_real_model",
           (("l = rescale * l + p.sum(dim=-1)", "l = l + p.sum(dim=-1)"),
            ("acc = rescale[..., None] * acc + p @ v_tile", "acc = acc + p @ v_tile")),
           "no rescale when the max grows: wrong as soon as the prompt spans several key tiles"),
    # ---------------------------------------------------------------- ex04
    Mutant("allocate_not_all_or_nothing", "ex04_paged", "BlockAllocator.allocate", "task_04_allocator",
           (("if n > len(self._free):", "if n > len(self._free) + len(self._free):"),
            ("ids = [self._free.popleft() for _ in range(n)]", "ids = [self._free.popleft() for _ in range(min(n, len(self._free)))]")),
           "hands out what is left instead of refusing"),
    Mutant("free_allows_double_free", "ex04_paged", "BlockAllocator.free", "task_04_allocator",
           (("if n > self._ref_counts[i]:", "if False:"),), "a double free corrupts the free list"),
    Mutant("paged_softmax_no_max", "ex04_paged", "paged_attention", "task_04_paged_attention",
           (("scores.softmax(dim=-1)", SOFTMAX_NO_MAX),), "softmax without subtracting the row max"),
    Mutant("paged_masks_scores_only", "ex04_paged", "paged_attention", "task_04_paged_attention",
           (("values = torch.where(valid[:, None, :, None], values, 0)", "pass"),),
           "unused value slots (NaN) leak through 0 * NaN"),
    Mutant("free_leaks_blocks", "ex04_paged", "BlockAllocator.free", "task_04_real_model",
           (("self._free.append(i)", "pass"),),
           "freed blocks never return to the free list: the engine's small pool runs dry and it stalls"),
    # ---------------------------------------------------------------- ex05
    # "admits new work in the step that just preempted" is checked by the grader (test_ex05 drive()) but is no
    # mutant here: with FCFS admission it cannot change behaviour in this engine. The victim goes to the head of the
    # waiting queue, it needs at least the blocks it just freed, one of which went to the sequence that needed it,
    # so the head never fits and admission stops there. It matters once admission is not FCFS (next mutant).
    Mutant("preempts_oldest_first", "ex05_batching", "schedule_step", "task_05_schedule",
           (("victim = pending.pop() if pending else seq", "victim = pending.pop(0) if pending else seq"),),
           "preempts the oldest running sequence instead of the most recently admitted"),
    Mutant("skips_blocked_head_of_line", "ex05_batching", "schedule_step", "task_05_schedule",
           (("        seq = waiting[0]\n        if not block_manager.can_allocate(seq):\n            break\n        waiting.popleft()",
             "        seq = next((s for s in waiting if block_manager.can_allocate(s)), None)\n        if seq is None:\n"
             "            break\n        waiting.remove(seq)"),),
           "admits a later request that fits while the head waits: not FCFS, can starve the head"),
    Mutant("finished_keep_blocks", "ex05_batching", "postprocess_step", "task_05_schedule",
           (("block_manager.deallocate(seq)", "pass"),), "finished sequences never free their blocks"),
    Mutant("finished_keep_blocks_real", "ex05_batching", "postprocess_step", "task_05_real_model",
           (("block_manager.deallocate(seq)", "pass"),), "finished sequences keep their blocks: the real engine stalls"),
    Mutant("continuous_leaves_a_slot_idle", "ex05_batching", "continuous_batching_loop", "task_05_static_vs_continuous",
           (("while waiting and len(active) < max_batch:", "while waiting and len(active) < max_batch - 1:"),),
           "refills one slot short"),
    Mutant("static_refills", "ex05_batching", "static_batching_loop", "task_05_static_vs_continuous",
           (("active = [r for r, finished in zip(active, done) if not finished]",
             "active = [r for r, finished in zip(active, done) if not finished] + "
             "list(requests[start + max_batch:start + max_batch + sum(done)])"),),
           "a static batch that refills is continuous batching"),
    # ---------------------------------------------------------------- ex07
    Mutant("int8_per_tensor_scale", "ex07_quant", "quantize_int8", "task_07_int8",
           (("amax = w.abs().amax(dim=1)", "amax = w.abs().amax().expand(w.shape[0])"),),
           "one scale for the whole matrix: rows of small weights lose most of their bits"),
    Mutant("int8_scale_over_128", "ex07_quant", "quantize_int8", "task_07_int8",
           (("amax / 127", "amax / 128"), (".clamp(-127, 127)", ".clamp(-128, 127)")),
           "two's-complement range [-128, 127]: the negative peak is -128, the positive one clips"),
    Mutant("int8_scale_over_255", "ex07_quant", "quantize_int8", "task_07_int8",
           (("amax / 127", "amax / 255"),), "a scale for 256 levels in a symmetric code: half the range unused"),
    Mutant("int8_truncates", "ex07_quant", "quantize_int8", "task_07_int8",
           (("torch.round(w / scale[:, None])", "torch.trunc(w / scale[:, None])"),),
           "truncation instead of rounding: errors up to a whole step"),
    Mutant("int8_no_zero_row_guard", "ex07_quant", "quantize_int8", "task_07_int8",
           (("torch.where(amax > 0, amax / 127, torch.ones_like(amax))", "amax / 127"),),
           "an all-zero row divides 0 / 0 (its NaN happens to cast to 0 on x86)"),
    Mutant("int8_keeps_input_dtype", "ex07_quant", "quantize_int8", "task_07_int8",
           (("    w = w.float()\n", ""),), "bf16 weights give a bf16 scale"),
    Mutant("int8_dequant_scale_per_column", "ex07_quant", "dequantize_int8", "task_07_int8",
           (("scale.float()[:, None]", "scale.float()[None, :]"),), "scales broadcast along the wrong axis"),
    Mutant("int4_bankers_rounding", "ex07_quant", "quantize_int4", "task_07_int4",
           (("torch.floor((groups - lo[..., None]) * inv[..., None] + 0.5)",
             "torch.round((groups - lo[..., None]) * inv[..., None])"),),
           "round() sends halves to even (2.5 -> 2); Q4_1 rounds them up"),
    Mutant("int4_scale_over_16", "ex07_quant", "quantize_int4", "task_07_int4",
           (("scale = (hi - lo) / levels", "scale = (hi - lo) / (levels + 1)"),),
           "16 steps for 16 codes: the maximum lands on code 16 and clips"),
    Mutant("int4_symmetric", "ex07_quant", "quantize_int4", "task_07_int4",
           (("lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)",
             "hi = groups.abs().amax(dim=-1)\n    lo = -hi"),),
           "a zero-centred range: a group of positive weights uses half the codes"),
    Mutant("int4_groups_strided", "ex07_quant", "quantize_int4", "task_07_int4",
           (("groups = w.float().reshape(out, n_in // group_size, group_size)",
             "groups = w.float().reshape(out, group_size, n_in // group_size).transpose(1, 2)"),),
           "a group is every (in // group_size)-th input instead of group_size consecutive ones"),
    Mutant("int4_per_row", "ex07_quant", "quantize_int4", "task_07_int4",
           (("lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)",
             ("lo = groups.amin(dim=(1, 2), keepdim=True)[..., 0].expand(groups.shape[:2])\n"
              "    hi = groups.amax(dim=(1, 2), keepdim=True)[..., 0].expand(groups.shape[:2])")),),
           "one range per row, repeated for each group"),
    Mutant("int4_codes_from_fp16_scale", "ex07_quant", "quantize_int4", "task_07_int4",
           (("inv = torch.where(scale > 0, 1 / scale,", "inv = torch.where(scale > 0, 1 / scale.half().float(),"),),
           "codes from the float16-rounded scale: llama.cpp computes them before rounding"),
    Mutant("int4_dequant_in_fp16", "ex07_quant", "dequantize_int4", "task_07_int4",
           (("(groups * scale.float()[..., None] + minimum.float()[..., None])",
             "(groups.half() * scale[..., None] + minimum[..., None]).float()"),),
           "dequantized in float16: products and sums rounded to 11 bits"),
    Mutant("pack_high_nibble_first", "ex07_quant", "pack_int4", "task_07_int4",
           (("c[..., 0::2] | (c[..., 1::2] << 4)", "(c[..., 0::2] << 4) | c[..., 1::2]"),),
           "column 2j in the high nibble: not GGUF's layout"),
    Mutant("unpack_high_nibble_first", "ex07_quant", "unpack_int4", "task_07_int4",
           (("[packed & 0x0F, packed >> 4]", "[packed >> 4, packed & 0x0F]"),), "reads the high nibble first"),
    Mutant("unpack_not_interleaved", "ex07_quant", "unpack_int4", "task_07_int4",
           (("torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)",
             "torch.cat([packed & 0x0F, packed >> 4], dim=-1)"),),
           "all low nibbles, then all high ones: columns out of order"),
    Mutant("rows_per_tensor_scale", "ex07_quant", "quantize_rows_int8", "task_07_outliers",
           (("amax = x.float().abs().amax(dim=1)", "amax = x.float().abs().amax().expand(x.shape[0])"),),
           "one activation scale for all tokens"),
    Mutant("rows_no_zero_row_guard", "ex07_quant", "quantize_rows_int8", "task_07_outliers",
           (("torch.where(amax > 0, amax / 127, torch.ones_like(amax))", "amax / 127"),),
           "a token whose every column is an outlier leaves a zero row: 0 / 0"),
    Mutant("outliers_no_decomposition", "ex07_quant", "int8_matmul_with_outliers", "task_07_outliers",
           (("regular = x.masked_fill(outliers, 0.0)", "regular = x"), ("if outliers.any():", "if False:")),
           "plain int8 activations: one value of 1000 sets the token's scale and flattens the rest to 0"),
    Mutant("outliers_per_tensor_activation_scale", "ex07_quant", "int8_matmul_with_outliers", "task_07_outliers",
           (("xq, xs = quantize_rows_int8(regular)",
             ("xq, xs = quantize_rows_int8(regular.reshape(1, -1))\n"
              "    xq, xs = xq.reshape(regular.shape), xs.expand(regular.shape[0])")),),
           "one activation scale for all tokens: small tokens are quantized coarsely"),
    Mutant("outliers_threshold_inclusive", "ex07_quant", "int8_matmul_with_outliers", "task_07_outliers",
           (("(x.abs() > threshold)", "(x.abs() >= threshold)"),), "a value equal to the threshold counts"),
    Mutant("outliers_dropped", "ex07_quant", "int8_matmul_with_outliers", "task_07_outliers",
           (("y = y + x[:, outliers] @ w_cols.T", "y = y"),), "the outlier columns are taken out and never added"),
    Mutant("outliers_unscaled_weights", "ex07_quant", "int8_matmul_with_outliers", "task_07_outliers",
           (("w_cols = q[:, outliers].float() * scale.float()[:, None]", "w_cols = q[:, outliers].float()"),),
           "outliers multiplied by the raw int8 weights, without their scales"),
    Mutant("outliers_float_matmul", "ex07_quant", "int8_matmul_with_outliers", "task_07_outliers",
           (("y = _int8_mm(xq, q).float() * xs[:, None] * scale.float()[None, :]",
             "y = regular @ (q.float() * scale.float()[:, None]).T"),),
           "no int8 matmul at all: the regular columns multiplied in float"),
    Mutant("int8_per_tensor_scale_real", "ex07_quant", "quantize_int8", "task_07_real_model",
           (("amax = w.abs().amax(dim=1)", "amax = w.abs().amax().expand(w.shape[0])"),),
           "one scale per weight matrix: SmolLM2's perplexity rises ~10%"),
    # ---------------------------------------------------------------- ex08
    Mutant("wanda_scores_weight_only", "ex08_sparsity", "wanda_scores", "task_08_wanda",
           (("return weight.detach().float().abs() * act_norm.float()[None, :]",
             "return weight.detach().float().abs()"),),
           "scores by |W| alone: magnitude pruning, blind to the activations"),
    Mutant("wanda_scores_norm_squared", "ex08_sparsity", "wanda_scores", "task_08_wanda",
           (("act_norm.float()[None, :]", "act_norm.float().pow(2)[None, :]"),),
           "multiplies by the squared norm (the sum of squares the calibration hook accumulates)"),
    Mutant("wanda_scores_norm_per_output_row", "ex08_sparsity", "wanda_scores", "task_08_wanda",
           (("act_norm.float()[None, :]", "act_norm.float()[:, None]"),),
           "act_norm broadcast along the output rows: right shape only for square weights, wrong values"),
    Mutant("wanda_mask_per_matrix", "ex08_sparsity", "unstructured_mask", "task_08_wanda",
           (("flat = scores if per_row else scores.reshape(1, -1)", "flat = scores.reshape(1, -1)"),),
           "compares the whole matrix even for per_row: rows of small scores lose most of their weights"),
    Mutant("wanda_mask_drops_ceil", "ex08_sparsity", "unstructured_mask", "task_08_wanda",
           (("n_drop = int(flat.shape[1] * sparsity)", "n_drop = -int(-(flat.shape[1] * sparsity) // 1)"),),
           "rounds the drop count up"),
    Mutant("wanda_mask_drops_one_more", "ex08_sparsity", "unstructured_mask", "task_08_wanda",
           (("[:, :n_drop]", "[:, :n_drop + 1]"),), "off by one: drops one score too many per row"),
    Mutant("wanda_mask_true_means_drop", "ex08_sparsity", "unstructured_mask", "task_08_wanda",
           (("return mask.reshape(scores.shape)", "return ~mask.reshape(scores.shape)"),),
           "an inverted mask: True marks the weights to drop"),
    Mutant("wanda_mask_no_sparsity_check", "ex08_sparsity", "unstructured_mask", "task_08_wanda",
           (("    check_sparsity(sparsity)\n", ""),),
           "sparsity 1.0 zeroes every weight and a negative one slices from the end, silently"),
    Mutant("wanda_mask_no_score_check", "ex08_sparsity", "unstructured_mask", "task_08_wanda",
           (("    _check_scores(scores)\n", ""),), "NaN scores sort last and are kept, silently"),
    Mutant("two_four_keeps_smallest", "ex08_sparsity", "semi_structured_mask", "task_08_2to4",
           (("torch.topk(groups, n, dim=-1, sorted=False)", "torch.topk(groups, n, dim=-1, largest=False, sorted=False)"),),
           "keeps the 2 lowest scores of each group"),
    Mutant("two_four_groups_down_columns", "ex08_sparsity", "semi_structured_mask", "task_08_2to4",
           (("groups = scores.reshape(scores.shape[0], -1, m)", "groups = scores.T.reshape(scores.shape[1], -1, m)"),
            ("return mask.reshape(scores.shape)", "return mask.reshape(scores.shape[1], scores.shape[0]).T")),
           "groups of 4 rows within a column: not what sparse tensor cores run"),
    Mutant("two_four_top_n_per_row", "ex08_sparsity", "semi_structured_mask", "task_08_2to4",
           (("groups = scores.reshape(scores.shape[0], -1, m)", "groups = scores.reshape(scores.shape[0], 1, -1)"),),
           "keeps the 2 highest of the whole row"),
    Mutant("two_four_top_half_of_row", "ex08_sparsity", "semi_structured_mask", "task_08_2to4",
           (("groups = scores.reshape(scores.shape[0], -1, m)", "groups = scores.reshape(scores.shape[0], 1, -1)"),
            ("torch.topk(groups, n, dim=-1", "torch.topk(groups, groups.shape[-1] * n // m, dim=-1")),
           "50% unstructured per row: the right count, but a group may keep 4 or 0"),
    Mutant("two_four_no_width_check", "ex08_sparsity", "semi_structured_mask", "task_08_2to4",
           (("if scores.shape[1] % m:", "if False:"),), "a width of 6 fails inside reshape, not with a ValueError"),
    Mutant("two_four_no_score_check", "ex08_sparsity", "semi_structured_mask", "task_08_2to4",
           (("    _check_scores(scores)\n", ""),), "NaN scores pass silently"),
    Mutant("drop_blocks_config_stale", "ex08_sparsity", "drop_blocks", "task_08_drop_blocks",
           (("    model.config = model.config.with_(n_layers=len(model.layers))\n", ""),),
           "config.n_layers still counts the dropped blocks"),
    Mutant("drop_blocks_off_by_one", "ex08_sparsity", "drop_blocks", "task_08_drop_blocks",
           (("if i not in set(drop))", "if i - 1 not in set(drop))"),), "drops block i + 1 instead of block i"),
    Mutant("drop_blocks_plain_list", "ex08_sparsity", "drop_blocks", "task_08_drop_blocks",
           (("model.layers = nn.ModuleList(b for i, b in enumerate(model.layers) if i not in set(drop))",
             "model.layers = [b for i, b in enumerate(model.layers) if i not in set(drop)]"),),
           "a plain list: its blocks are no submodules (torch refuses it over a registered ModuleList)"),
    Mutant("drop_blocks_accepts_negative", "ex08_sparsity", "drop_blocks", "task_08_drop_blocks",
           (("not 0 <= i < n]", "not i < n]"),), "a negative index drops nothing, silently"),
    Mutant("drop_blocks_accepts_duplicates", "ex08_sparsity", "drop_blocks", "task_08_drop_blocks",
           (("if len(set(drop)) != len(drop):", "if False:"),), "[1, 1] drops one block without a word"),
    Mutant("wanda_scores_weight_only_real", "ex08_sparsity", "wanda_scores", "task_08_real_model",
           (("return weight.detach().float().abs() * act_norm.float()[None, :]",
             "return weight.detach().float().abs()"),),
           "magnitude compared per row: SmolLM2's perplexity at 50% sparsity goes from ~29 to ~250"),
    # ---------------------------------------------------------------- ex09
    Mutant("kd_no_t_squared", "ex09_distill", "distillation_loss", "task_09_loss",
           (("return kl.mean() * temperature**2", "return kl.mean()"),),
           "no T^2: the soft targets' gradients shrink as 1 / T^2 when the temperature rises"),
    Mutant("kd_times_t", "ex09_distill", "distillation_loss", "task_09_loss",
           (("return kl.mean() * temperature**2", "return kl.mean() * temperature"),), "scaled by T instead of T^2"),
    Mutant("kd_reverse_kl", "ex09_distill", "distillation_loss", "task_09_loss",
           (("kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)", "kl = (s_logp.exp() * (s_logp - t_logp)).sum(-1)"),),
           "KL(student || teacher): mode-seeking, not the teacher's mass"),
    Mutant("kd_log_of_softmax", "ex09_distill", "distillation_loss", "task_09_loss",
           (("F.log_softmax(student_logits.float() / temperature, dim=-1)",
             "F.softmax(student_logits.float() / temperature, dim=-1).log()"),
            ("F.log_softmax(teacher_logits.float() / temperature, dim=-1)",
             "F.softmax(teacher_logits.float() / temperature, dim=-1).log()")),
           "log of a softmax: probabilities that underflow to 0 give -inf, and 0 * -inf = nan"),
    Mutant("kd_softmax_no_max", "ex09_distill", "distillation_loss", "task_09_loss",
           (("t_logp = F.log_softmax(teacher_logits.float() / temperature, dim=-1)",
             ("t_logp = ((teacher_logits.float() / temperature).exp()\n"
              "              / (teacher_logits.float() / temperature).exp().sum(-1, keepdim=True)).log()")),),
           "a softmax without the max subtracted: exp overflows for logits / T > 88"),
    Mutant("kd_teacher_not_softened", "ex09_distill", "distillation_loss", "task_09_loss",
           (("F.log_softmax(teacher_logits.float() / temperature", "F.log_softmax(teacher_logits.float()"),),
           "only the student's logits are divided by T"),
    Mutant("kd_student_not_softened", "ex09_distill", "distillation_loss", "task_09_loss",
           (("F.log_softmax(student_logits.float() / temperature", "F.log_softmax(student_logits.float()"),),
           "only the teacher's logits are divided by T"),
    Mutant("kd_mean_over_vocab", "ex09_distill", "distillation_loss", "task_09_loss",
           ((".sum(-1)  # per position", ".mean(-1)  # per position"),),
           "the KL of a position averaged over the vocabulary instead of summed"),
    Mutant("kd_batchmean_first_dim", "ex09_distill", "distillation_loss", "task_09_loss",
           (("return kl.mean() * temperature**2", "return kl.sum() / kl.shape[0] * temperature**2"),),
           "'batchmean' on (batch, seq, vocab): divided by the batch only, seq times too large"),
    Mutant("kd_in_input_dtype", "ex09_distill", "distillation_loss", "task_09_loss",
           (("teacher_logits.float() / temperature", "teacher_logits / temperature"),
            ("student_logits.float() / temperature", "student_logits / temperature")),
           "bf16 logits (autocast) give bf16 log-probabilities: the KL off by a percent"),
    Mutant("kd_no_temperature_check", "ex09_distill", "distillation_loss", "task_09_loss",
           (("if not temperature > 0:", "if False:"),), "T = 0 divides by zero; a negative T inverts the ranking"),
    Mutant("kd_no_shape_check", "ex09_distill", "distillation_loss", "task_09_loss",
           (("if student_logits.shape != teacher_logits.shape:", "if False:"),),
           "one teacher position broadcast over four student positions, silently"),
    Mutant("lr_warmup_off_by_one", "ex09_distill", "lr_at", "task_09_schedule",
           (("cfg.lr * (step + 1) / cfg.warmup", "cfg.lr * step / cfg.warmup"),),
           "step 0 gets lr 0 (it does not train) and the peak comes one step late"),
    Mutant("lr_warmup_one_step_long", "ex09_distill", "lr_at", "task_09_schedule",
           (("if step < cfg.warmup:", "if step <= cfg.warmup:"),),
           "overshoots lr at step warmup, and divides by zero with warmup=0"),
    Mutant("lr_cosine_unfinished", "ex09_distill", "lr_at", "task_09_schedule",
           (("max(1, cfg.steps - cfg.warmup)", "max(1, cfg.steps)"),),
           "progress over all the steps: the cosine has not reached the floor at the last step"),
    Mutant("lr_decays_to_zero", "ex09_distill", "lr_at", "task_09_schedule",
           (("(cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))",
             "(0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))"),), "ignores min_lr_ratio: decays to 0"),
    Mutant("lr_linear_decay", "ex09_distill", "lr_at", "task_09_schedule",
           (("0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))", "(1 - min(progress, 1.0))"),),
           "a straight line from the peak to the floor"),
    Mutant("step_teacher_with_grad", "ex09_distill", "train_step", "task_09_step",
           (("with torch.no_grad():\n        t_logits, t_h = _forward(teacher, inp, cfg.cos > 0)",
             "t_logits, t_h = _forward(teacher, inp, cfg.cos > 0)"),),
           "the teacher runs with autograd on: backward reaches its weights"),
    Mutant("step_teacher_detached_late", "ex09_distill", "train_step", "task_09_step",
           (("with torch.no_grad():\n        t_logits, t_h = _forward(teacher, inp, cfg.cos > 0)",
             "t_logits, t_h = _forward(teacher, inp, True)\n    t_logits, t_h = t_logits.detach(), t_h.detach()"),),
           "the teacher's graph is built, then dropped: right numbers, a teacher-sized graph of memory per step"),
    Mutant("step_no_zero_grad", "ex09_distill", "train_step", "task_09_step",
           (("    optimizer.zero_grad(set_to_none=True)\n", ""),),
           "gradients accumulate across steps"),
    Mutant("step_no_clip", "ex09_distill", "train_step", "task_09_step",
           (("clip_grad_norm_(params, cfg.clip)", "clip_grad_norm_(params, float('inf'))"),),
           "the norm is measured but nothing is clipped"),
    Mutant("step_clip_after_step", "ex09_distill", "train_step", "task_09_step",
           (("    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)\n    optimizer.step()",
             "    optimizer.step()\n    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)"),),
           "clips after the update has used the raw gradients"),
    Mutant("step_clip_first_group_only", "ex09_distill", "train_step", "task_09_step",
           (("params = [p for group in optimizer.param_groups for p in group[\"params\"]]",
             "params = optimizer.param_groups[0][\"params\"]"),),
           "the norm and the clip leave out the second param group (the vectors)"),
    Mutant("step_reports_clipped_norm", "ex09_distill", "train_step", "task_09_step",
           (('"grad_norm": float(grad_norm)', '"grad_norm": min(float(grad_norm), cfg.clip)'),),
           "reports the norm after clipping"),
    Mutant("step_unweighted_terms", "ex09_distill", "train_step", "task_09_step",
           (('loss = cfg.kd * terms.get("kd", 0) + cfg.ce * terms.get("ce", 0) + cfg.cos * terms.get("cos", 0)',
             "loss = sum(terms.values())"),), "cfg.kd, cfg.ce and cfg.cos decide which terms, not how much"),
    Mutant("step_kd_only", "ex09_distill", "train_step", "task_09_step",
           (('loss = cfg.kd * terms.get("kd", 0) + cfg.ce * terms.get("ce", 0) + cfg.cos * terms.get("cos", 0)',
             'loss = cfg.kd * terms.get("kd", torch.zeros((), requires_grad=True))'),),
           "the ce and cos terms are computed and reported but never trained on"),
    Mutant("step_target_not_shifted", "ex09_distill", "train_step", "task_09_step",
           (("inp, target = x[:, :-1], x[:, 1:]", "inp, target = x[:, :-1], x[:, :-1]"),),
           "position t is scored against the token it already sees"),
    Mutant("step_zero_grad_after_backward_real", "ex09_distill", "train_step", "task_09_real_model",
           (("    optimizer.zero_grad(set_to_none=True)\n    loss.backward()",
             "    loss.backward()\n    optimizer.zero_grad(set_to_none=True)"),),
           "zero_grad between backward and step: the optimizer never sees a gradient, the student never learns"),
    # ---------------------------------------------------------------- ex10
    Mutant("greedy_no_bonus", "ex10_speculative", "verify_greedy", "task_10_greedy",
           (("return draft[:n] + [target_argmax[n]]",
             "return draft[:n] + ([target_argmax[n]] if n < len(draft) else [])"),),
           "all drafts accepted and no bonus token: the forward's last position is wasted"),
    Mutant("greedy_off_by_one", "ex10_speculative", "verify_greedy", "task_10_greedy",
           (("draft[n] == target_argmax[n]", "draft[n] == target_argmax[n + 1]"),),
           "draft[i] compared with the target's choice one position later"),
    Mutant("greedy_counts_all_matches", "ex10_speculative", "verify_greedy", "task_10_greedy",
           (("    n = 0\n    while n < len(draft) and draft[n] == target_argmax[n]:\n        n += 1\n",
             "    n = sum(d == t for d, t in zip(draft, target_argmax))\n"),),
           "matches after the first mismatch are counted too"),
    Mutant("greedy_keeps_rejected_draft", "ex10_speculative", "verify_greedy", "task_10_greedy",
           (("return draft[:n] + [target_argmax[n]]",
             "return draft[:n + 1] if n < len(draft) else draft + [target_argmax[n]]"),),
           "the first rejected draft is emitted instead of the target's correction"),
    Mutant("rej_correction_from_p", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("residual = (p[n] - q[n]).clamp_min(0)", "residual = p[n].clone()"),),
           "the replacement drawn from p: tokens the accepted drafts already supplied come too often"),
    Mutant("rej_onehot_draft_kept", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("        residual[draft[n]] = 0\n", ""),),
           "one-hot q: the rejected guess can come back as its own replacement"),
    Mutant("rej_onehot_zeroes_p", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("residual = p[n].clone()", "residual = p[n]"),),
           "one-hot q: the draft's entry zeroed in the caller's p (a view, not a copy)"),
    Mutant("rej_ratio_inverted", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("accepted = (u * q_x < p_x).tolist()", "accepted = (u * p_x < q_x).tolist()"),),
           "accepts with min(1, q/p): drafts the target dislikes pass most"),
    Mutant("rej_accept_with_p", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("accepted = (u * q_x < p_x).tolist()", "accepted = (u < p_x).tolist()"),),
           "accepts with probability p(x), as if q were one-hot"),
    Mutant("rej_accept_if_p_ge_q", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("accepted = (u * q_x < p_x).tolist()", "accepted = (q_x <= p_x).tolist()"),),
           "no uniform: a draft with p < q is always rejected"),
    Mutant("rej_residual_not_clamped", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("residual = (p[n] - q[n]).clamp_min(0)", "residual = p[n] - q[n]"),),
           "p - q has negative entries: not a distribution"),
    Mutant("rej_residual_not_normalised", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("return draft[:n] + [int(sample((residual / residual.sum())[None], generator)[0])]",
             ("u_r = torch.rand(1, generator=generator, device=p.device)\n"
              "    return draft[:n] + [int(torch.searchsorted(residual.cumsum(0), u_r)\n"
              "                                .clamp_max(len(residual) - 1))]")),),
           "inverse-CDF draw from max(0, p - q) without dividing by its sum: the mass short of 1 lands on the last "
           "token"),
    Mutant("rej_no_fallback", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("if float(residual.sum()) <= 0:", "if False:"),), "an all-zero residual divided by its sum: NaN"),
    Mutant("rej_no_bonus", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("return draft + [int(sample(p[k:k + 1], generator)[0])]", "return draft"),),
           "all drafts accepted and no bonus token"),
    Mutant("rej_bonus_wrong_row", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("sample(p[k:k + 1], generator)", "sample(p[max(k - 1, 0):max(k, 1)], generator)"),),
           "the bonus token drawn from the last draft's row of p, not from p[k]"),
    Mutant("rej_counts_all_accepted", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("n = accepted.index(False) if False in accepted else k", "n = sum(accepted)"),),
           "acceptances after the first rejection are counted too"),
    Mutant("rej_one_uniform", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("u = torch.rand(k, generator=generator, device=p.device)",
             "u = torch.rand(1, generator=generator, device=p.device).expand(k)"),),
           "one uniform shared by every draft: the acceptances are correlated"),
    Mutant("rej_ignores_generator", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("u = torch.rand(k, generator=generator, device=p.device)", "u = torch.rand(k, device=p.device)"),),
           "the uniforms from the global generator: a seeded request does not reproduce"),
    Mutant("rej_no_shape_check", "ex10_speculative", "rejection_sample", "task_10_rejection",
           (("if p.shape[0] != k + 1 or (q is not None and q.shape[0] != k):", "if False:"),),
           "p or q with the wrong number of rows goes through"),
    Mutant("ngram_oldest_occurrence", "ex10_speculative", "propose_ngram", "task_10_ngram",
           (("for i in range(len(ids) - n - 1, -1, -1):", "for i in range(len(ids) - n):"),),
           "the first occurrence in the sequence, not the most recent"),
    Mutant("ngram_shortest_first", "ex10_speculative", "propose_ngram", "task_10_ngram",
           (("for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):",
             "for n in range(min_n, min(max_n, len(ids) - 1) + 1):"),),
           "n from min_n up: a recent 1-token match beats an older 3-token one"),
    Mutant("ngram_returns_pattern", "ex10_speculative", "propose_ngram", "task_10_ngram",
           (("return ids[i + n:i + n + k]", "return ids[i:i + n][:k]"),),
           "proposes the matched tokens instead of what followed them"),
    Mutant("ngram_matches_itself", "ex10_speculative", "propose_ngram", "task_10_ngram",
           (("for i in range(len(ids) - n - 1, -1, -1):", "for i in range(len(ids) - n, -1, -1):"),),
           "the suffix finds itself at the end, with nothing after it: always []"),
    Mutant("ngram_no_k_cap", "ex10_speculative", "propose_ngram", "task_10_ngram",
           (("return ids[i + n:i + n + k]", "return ids[i + n:]"),), "everything after the match, not at most k"),
    Mutant("ngram_ignores_min_n", "ex10_speculative", "propose_ngram", "task_10_ngram",
           (("min_n - 1, -1)", "0, -1)"),), "falls back to 1-token matches below min_n"),
    Mutant("ngram_needs_two_earlier", "ex10_speculative", "propose_ngram", "task_10_ngram",
           (("range(min(max_n, len(ids) - 1),", "range(min(max_n, len(ids) - 2),"),),
           "n capped one short: the longest possible match (n = len(ids) - 1) is never tried"),
    Mutant("ngram_returns_pattern_real", "ex10_speculative", "propose_ngram", "task_10_real_model",
           (("return ids[i + n:i + n + k]", "return ids[i:i + n][:k]"),),
           "proposals that repeat the suffix: the tokens stay right (the target corrects every draft), the speed-up "
           "is gone"),
]


def build(m: Mutant, module):
    """The mutated function (or method), compiled in a copy of the solution module's namespace."""
    owner_name, _, attr = m.target.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    src = textwrap.dedent(inspect.getsource(getattr(owner, attr)))
    for old, new in m.edits:
        if src.count(old) != 1:
            raise KeyError(f"mutant {m.name}: {old!r} occurs {src.count(old)}x in {m.module}.{m.target}; update it")
        src = src.replace(old, new)
    filename = f"<mutant {m.name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # so inspect.getsource works
    namespace = dict(vars(module))
    exec(compile(src, filename, "exec"), namespace)
    return owner, attr, namespace[attr]


def run(lesson: str) -> dict[str, str]:
    """Run each mutant of `lesson` against its task's graders in this process; {mutant: 'killed' | 'survived'}."""
    import pytest
    from hypothesis import settings

    settings.register_profile("mutants", database=None, print_blob=False)
    settings.load_profile("mutants")
    results = {}
    for m in [m for m in MUTANTS if m.lesson == lesson]:
        module = importlib.import_module(f"solutions.{m.module}")
        owner, attr, fn = build(m, module)
        original = getattr(owner, attr)
        setattr(owner, attr, fn)
        try:
            code = pytest.main([str(ROOT / "tests" / "graders" / f"test_{m.module}.py"), "-m", m.task, "-x", "-q",
                                "-p", "no:cacheprovider", "--no-header", "-o", "addopts="],
                               plugins=[])
        finally:
            setattr(owner, attr, original)
        if code not in (0, 1):
            raise RuntimeError(f"mutant {m.name}: pytest exited with {code} (collection error or no tests)")
        results[m.name] = "killed" if code == 1 else "survived"
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    out = run(sys.argv[1])
    print("MUTANTS " + json.dumps(out))

"""Tiered hints for the exercises: `minillm hint NN [task] [--level 1|2|3]`.

Level 1 is a nudge (what to think about), level 2 the contract and the trap the grader checks, level 3 the recipe
(the stub's own NotImplementedError message, read from exercises/exNN_*.py; RECIPES for the real-model tasks,
which have no stub of their own).
"""

from __future__ import annotations

import ast

from minillm.course.grading import ROOT, TASKS

# task marker -> (level 1 nudge, level 2 contract and trap)
HINTS: dict[str, tuple[str, str]] = {
    "task_00_rmsnorm": ("RMSNorm divides by the root of the mean square over the last dim, then scales.",
                        "eps goes inside the square root; compute the statistics in float32 and return x's dtype "
                        "(float16 x^2 overflows at ~256)."),
    "task_00_rope": ("Each pair of dims is a 2-D vector rotated by position x frequency. Which dims form a pair?",
                     "Rotate-half pairing: dim i pairs with i + head_dim/2. Rotate in float32 and cast back once "
                     "(the grader bounds bf16 error against one rounding)."),
    "task_00_attention": ("softmax(q k^T / sqrt(d)) v, with a mask and shared KV heads.",
                          "The causal mask is bottom-right aligned (q_len may be < kv_len); query head h reads KV "
                          "head h // group; scores of hundreds must not overflow exp."),
    "task_00_sampler": ("Greedy is argmax; otherwise turn logits into a distribution, then draw from it.",
                        "Order: temperature, top-k, top-p. Top-p keeps the smallest most-likely set reaching p: "
                        "a token is dropped once the mass before it is >= p. Shift by the max before exp."),
    "task_01_cache_append": ("The cache is a preallocated buffer plus a fill position.",
                             "Write positions start..start+new-1 and return the new length; past capacity raise "
                             "CacheFullError and write nothing."),
    "task_01_cached_attention": ("One new query attends over every filled slot, and nothing else.",
                                 "Only the first n_filled slots are valid (the rest may be NaN); no causal mask for "
                                 "the newest token; GQA mapping h // group; subtract the max."),
    "task_02_grouped_attention": ("Can you attend with 3 KV heads for 9 query heads without copying K/V 3 times?",
                                  "View q as (batch, n_kv_heads, group, q_len, d) and broadcast K/V over the group; "
                                  "bottom-right causal mask; float32 softmax with the max subtracted."),
    "task_02_mean_pool": ("A KV head is a block of head_dim rows of the projection weight.",
                          "Average adjacent heads (g*r .. g*r+r-1), in float32, return w's dtype; a count that "
                          "does not divide is a ValueError."),
    "task_03_merge": ("Two partial softmaxes are relative to different maxima.",
                      "Rescale both to m = max(m1, m2) with exp(m_i - m); an empty side is (0, -inf, 0) and two "
                      "empty sides must not give nan."),
    "task_03_flash": ("Keep a running max, a running sum and a running output per query row.",
                      "Start the max at -inf (rows of very negative scores), rescale old sums when the max grows, "
                      "skip key tiles above the diagonal, never build a whole score row."),
    "task_03_triton": ("The same online-softmax step, in log2 units, on one tile of keys.",
                       "Masked tiles need masked loads and -inf scores; accumulate in float32."),
    "task_04_allocator": ("A free list and a reference count per block.",
                          "allocate is all or nothing; free validates every id before changing anything (double "
                          "free, unknown id: ValueError)."),
    "task_04_slots": ("A position p of a sequence is block p // block_size of its table, offset p % block_size in "
                      "that block. Which positions does one step write, and which does attention read?",
                      "slot_mapping returns slots for the new tokens only (positions ctx - n .. ctx - 1, which may "
                      "start mid-block in a chunk), sequence after sequence. context_slots covers positions 0 .. "
                      "width - 1: valid is position < ctx (strictly); padding positions take position 0's slot, "
                      "never -1 or slot 0, and must not index the table's -1 entries."),
    "task_05_schedule": ("Running sequences first, then admissions; blocks are the scarce resource.",
                         "When a block is missing, preempt the most recently admitted; admit strictly in arrival "
                         "order (never skip a blocked head); admit nothing in a step that preempted."),
    "task_00_real_model": ("Nothing new to write: this runs SmolLM2 on your four pieces. Fix the unit tasks first.",
                           "The logits are checked one piece at a time (the message names the piece), so a bug the "
                           "unit cases miss on random tensors shows here: e.g. RoPE's pairing, or the causal mask "
                           "at decode (q_len 1 over a longer cache)."),
    "task_01_real_model": ("Nothing new to write: generate() decodes SmolLM2 through a cache using your two functions.",
                           "The cache's unwritten slots hold NaN; each decode step passes n_filled = what append_kv "
                           "returned. If this fails after 00 changed, the message says "
                           "whether exercise 00 is at fault."),
    "task_02_real_model": ("Nothing new to write: your grouped_attention becomes SmolLM2's attention backend.",
                           "It runs at prefill (q_len == kv_len) and at every decode step (q_len 1 over the cache): "
                           "the causal mask must be bottom-right aligned; 9 query heads read 3 KV heads."),
    "task_03_real_model": ("Nothing new to write: your flash_attention becomes SmolLM2's attention backend.",
                           "It runs with 16 x 16 tiles, so the 37-token prompt spans three key tiles: the rescale "
                           "of the running sums and the decode case (one query row over the cache) both matter."),
    "task_04_real_model": ("Nothing new to write: your allocator and slots serve generate() and the engine.",
                           "The engine pool is small (6 blocks of 8), so sequences are preempted and their blocks "
                           "freed and reused: free must return blocks; every layer writes each new token's key/value "
                           "to your slot_mapping's slot and decode reads the context through your context_slots."),
    "task_05_real_model": ("Nothing new to write: minillm.LLM runs SmolLM2 with your scheduler's two functions.",
                           "6 requests on a 6-block pool: preemption has to happen, recomputed sequences must end "
                           "with the same tokens, finished ones must free their blocks or the engine stalls."),
    "task_05_static_vs_continuous": ("Static waits for the whole batch; continuous refills every step.",
                                     "Both return the busy slots at each step; continuous refills free slots from "
                                     "the waiting queue before every step, in arrival order."),
    "task_06_qkv": ("One matmul whose output rows are q's, then k's, then v's: how wide is each part with GQA?",
                    "Stack the weights along the output dim in the order q, k, v (the grader checks the layout, not "
                    "just a round trip); split sizes are n_heads*head_dim, then n_kv_heads*head_dim twice."),
    "task_06_add_norm": ("The residual stream needs the sum; the next sublayer needs its normalised version.",
                         "Return (rms_norm(x + residual), x + residual): the sum once, normalised in float32 by the "
                         "given rms_norm, in x's dtype."),
    "task_06_real_model": ("Nothing new to write: your three functions fuse SmolLM2 and it must still say Paris.",
                           "The fused model's logits must equal the unfused model's (fp32, <= 1e-4): a wrong order "
                           "or split size shows up as garbage text, not an error."),
    "task_07_int8": ("Each output row gets one number that maps its integers back to floats. Which value of the "
                     "row should land on the edge of the int8 range?",
                     "scale = max|w| / 127 per row (float32, whatever w's dtype), q = round(w / scale) in [-127, 127] "
                     "(never -128). An all-zero row must not compute 0 / 0 (NaN, then an undefined cast): "
                     "e.g. scale 1."),
    "task_07_int4": ("Sixteen codes per group: where does code 0 sit, and how far apart are the codes?",
                     "Groups are group_size consecutive inputs of a row: minimum = group min, scale = (max - min) "
                     "/ 15, code = floor((w - min) / scale + 0.5) with the float32 scale (round() differs at .5); "
                     "return scale and minimum as float16; a constant group has scale 0 and codes 0 (no 0 / 0). "
                     "Pack column 2j in the low nibble; odd widths are a ValueError."),
    "task_07_outliers": ("A few input columns hold huge values. What would one of them do to its token's int8 "
                         "scale?",
                         "Outliers: columns with any |x| > threshold (strictly). Zero them, quantize each token row "
                         "with its own scale, int8 x int8 -> int32 (_int8_mm), times the token's and the weight "
                         "row's scales; add x[:, outliers] @ the dequantized weight columns in float."),
    "task_07_real_model": ("Nothing new to write: minillm.compress.quantize.quantize builds SmolLM2's int8 and int4 "
                           "layers with your functions.",
                           "The file's weights are Q4_1 already, so your int4 must give them back to float32 "
                           "rounding; the int8 model must answer Paris, and perplexity may rise at most 2% (int8) "
                           "and 10% (int4). One real layer's input (values in the thousands) runs through your "
                           "LLM.int8() matmul."),
    "task_08_wanda": ("Zeroing W[i, j] changes output i by W[i, j] * x_j. How big is x_j on real text, and which "
                      "weights should compete with each other to survive?",
                      "scores = |W| * act_norm per input column (column j times act_norm[j]), float32; an act_norm "
                      "that is not one value per input column is a ValueError. The mask is True = keep and drops "
                      "exactly floor(sparsity * n) of the lowest scores per row (per_row=True) or of the whole "
                      "matrix. Refuse before any work: sparsity outside [0, 1) and NaN/inf scores (the given "
                      "check_sparsity and _check_scores)."),
    "task_08_2to4": ("Sparse tensor cores read each row in runs of 4 weights. How many of every run survive, and "
                     "which ones?",
                     "Exactly n kept (the n highest) in every run of m consecutive scores of a row, never counted "
                     "across the row or down a column. ValueError when m does not divide the width, when not "
                     "0 < n < m, and on NaN/inf scores."),
    "task_08_drop_blocks": ("A model is its blocks plus a config that says how many there are: both must change, "
                            "and the blocks must stay visible to .to() and state_dict().",
                            "Check every index first (0..n-1, no negatives, no repeats, not all of them: "
                            "ValueError, model untouched); then a new nn.ModuleList of the kept blocks in their "
                            "order (torch refuses a plain list there) and config.with_(n_layers=...); return the "
                            "same model."),
    "task_08_real_model": ("Nothing new to write: minillm.compress.sparsity.prune and minillm.compress.pruning run "
                           "SmolLM2 through your four functions.",
                           "Wanda at 50% must keep the perplexity within 2x the dense model's (the reference ~1.7x, "
                           "|W| alone ~15x); 2:4 must leave every block Linear 2:4 and half zeros; dropping the 4 "
                           "least important blocks must leave 26 in a ModuleList, a config that agrees, and the "
                           "engine generating what generate() does."),
    "task_09_loss": ("The teacher's distribution is the target. Which distribution weighs the log-ratio, and what "
                     "happens to exp() of a logit of 1000?",
                     "T^2 * mean over every position (all leading dims) of sum over the vocabulary of "
                     "p * (log p - log q), p = softmax(teacher / T), q = softmax(student / T); both logs from "
                     "log_softmax, in float32. A 0-dim tensor with a gradient to the student's logits. ValueError "
                     "for T <= 0 and for logits of different shapes (before broadcasting can hide it)."),
    "task_09_schedule": ("Two pieces: a ramp that starts at step 0, then half a cosine. What does each end at?",
                         "step < warmup: lr * (step + 1) / warmup (step 0 trains; step warmup - 1 reaches lr). Then "
                         "progress = (step - warmup) / (steps - warmup) and lr * (r + (1 - r) * (1 + cos(pi * "
                         "progress)) / 2) with r = min_lr_ratio: lr at step warmup, lr * r at step steps. warmup=0: "
                         "no ramp."),
    "task_09_step": ("One optimizer step, in the usual order. What may the teacher's forward keep, and when can "
                     "clipping still change the update?",
                     "Teacher under torch.no_grad(); student forward on x[:, :-1]; kd, ce (targets x[:, 1:]) and "
                     "cos each only when its weight is > 0, loss = their weighted sum; zero_grad, backward, "
                     "clip_grad_norm_ over every param group's params, optimizer.step(); return floats: loss, the "
                     "terms, the norm before clipping. Leave the lr alone."),
    "task_09_real_model": ("Nothing new to write: minillm.compress.distill.distill trains a pruned SmolLM2 with "
                           "your three functions.",
                           "Blocks dropped: the 10 least important (block_importance on 128 calibration tokens). 10 "
                           "steps of 2 x 64 tokens must lower the student's KL to the teacher on 128 held-apart "
                           "tokens by at least 10% (the reference: -22%), and the teacher's weights must not change. "
                           "A step that never updates leaves the KL where it was."),
    "task_10_greedy": ("The target scored every draft position in one forward. Where does the walk along the drafts "
                       "stop, and what does the target add whether or not it stopped early?",
                       "target_argmax[i] is the target's choice after draft[:i] (len(draft) + 1 entries). Accept while "
                       "draft[i] == target_argmax[i]; stop at the first mismatch (later matches do not count). Return "
                       "the accepted drafts + [target_argmax[n]], n = the number accepted: the correction, or the "
                       "bonus when all passed. An empty draft gives [target_argmax[0]]. A new list of ints."),
    "task_10_rejection": ("Which chance of passing makes a token drawn from q come out distributed as p, and what "
                          "part of p is still missing after the accepted drafts have supplied min(p, q)?",
                          "Per draft x = draft[i], one uniform u from the generator: accept when u < min(1, p[i, x] / "
                          "q[i, x]) (u * q < p). At the first rejection draw from normalize(max(0, p[i] - q[i])) "
                          "(one-hot q, q=None: p[i] with x zeroed, on a copy), from p[i] if that has no mass, and "
                          "stop. All k pass: a bonus from p[k]. Return accepted + [that token] as ints; p needs k + 1 "
                          "rows and q k (ValueError). The grader counts every outcome of thousands of seeded calls "
                          "against its exact probability."),
    "task_10_ngram": ("The sequence often repeats itself (a copied prompt, code): if its last few tokens occurred "
                      "before, what came after them then is a good guess now. Which occurrence, and how many tokens "
                      "long a match?",
                      "n from max_n down to min_n (the first n with a match wins, however old the match); the "
                      "pattern is ids[-n:]; its most recent occurrence starting at i <= len(ids) - n - 1 (a token "
                      "must follow it, and the suffix itself does not count; overlapping it is fine); return "
                      "ids[i + n:i + n + k]. Nothing found: []."),
    "task_10_real_model": ("Nothing new to write: minillm.generate(..., speculative=SpeculativeConfig('ngram', k=4)) "
                           "runs SmolLM2 with your three functions.",
                           "On a prompt that asks to repeat a paragraph, greedy speculation must give exactly the "
                           "target's own greedy tokens (48 at most), accept at least half the drafts (the reference: "
                           "all 36) and take fewer target forwards than tokens; a sampled run (temperature 0.8, seed "
                           "0) must finish, each verification keeping a prefix of its drafts plus one token."),
    "task_11_shard": ("y = x @ W.T: which dimension of W indexes y's features, and which one meets x's? "
                      "A rank holds one contiguous block of that dimension.",
                      "column_slice: W[r * n:(r + 1) * n] with n = out_features // degree (rows: output features; the "
                      "ranks' x @ W_r.T concatenate to y). row_slice: W[:, r * n:(r + 1) * n] with n = in_features // "
                      "degree (columns: input features; x_r @ W_r.T summed over ranks is y). Block r, not every "
                      "degree-th row or column; W's values and dtype unscaled (the all-reduce sums, it does not "
                      "average); contiguous; W left as it was; ValueError when degree does not divide the dimension "
                      "split (only that one: the other may be anything)."),
    "task_11_gpipe": ("Draw it: micro-batches enter stage 0 one per step, and each moves one stage on per step. When "
                      "does micro-batch i reach stage r, and when is the last one done?",
                      "grid[t][r] = t - r when 0 <= t - r < n_micro, else None; one row per time step (a list of "
                      "n_stages entries), n_micro + n_stages - 1 rows. Each stage then runs 0..m-1 in order, a step "
                      "after the stage before it, and p(p - 1) slots idle: the bubble (p - 1) / (m + p - 1). "
                      "ValueError for fewer than one stage or one micro-batch."),
    "task_11_real_model": ("Nothing new to write: three ranks shard SmolLM2 with your column_slice and row_slice "
                           "(minillm.parallel.tensor.shard_tensor_parallel) and decode greedily.",
                           "First your slices of block 0 run as 3 simulated ranks in the grading process (attention "
                           "by whole heads: q/k/v column, wo row; the MLP: gate/up column, down row; partials summed) "
                           "and must match the whole block; then 3 processes (gloo) decode 16 greedy tokens of 'The "
                           "capital of France is' that must equal the single-process model's (' Paris. ...'). A "
                           "strided slice mixes the dims of different heads: attention breaks although every rank "
                           "holds the right number of rows."),
    "task_12_hash": ("A block's keys and values depend on every token before it, not only its own. What must its name "
                     "depend on, what must it never depend on (the process, the container), and when is a block "
                     "finished enough to have one?",
                     "hash_block: hashlib.sha256(parent + array('i', tokens).tobytes()).digest(): 32 bytes, 4 bytes "
                     "per id (a byte per id truncates ids >= 256; Python's hash() is salted per process and easy to "
                     "collide). block_hashes: one name per full block only (len(token_ids) // block_size), block "
                     "i's parent is name i - 1 (ROOT_HASH for block 0); keep `known` as the first names and "
                     "continue from known[-1], not from ROOT_HASH."),
    "task_12_match": ("Names are chained: a cached name further on is useless once one before it is missing. Which "
                      "blocks can a request take, and what changes when it takes them?",
                      "match: look the names up in order in _block_of and stop at the first miss (break, not "
                      "continue); it changes nothing. acquire: ValueError (nothing changed) if any block has no name; "
                      "then each block leaves _evictable (an owned block must never be evicted) and gains an "
                      "owner."),
    "task_12_lru": ("A finished request's full blocks are worth keeping until the memory is needed. Which block is "
                    "the cheapest to give up, and which blocks cost nothing to hand out?",
                    "free: let super().free do the checks and ref counts, then move the blocks left without owners "
                    "to the end of _evictable if named (in the call's order), else back to _free. allocate: "
                    "OutOfBlocksError before any change if n > num_free(); _free first, then _evict(): the oldest "
                    "of _evictable, its name deleted from _block_of and _name_of, stats.evictions + 1. num_free = "
                    "len(_free) + len(_evictable)."),
    "task_12_real_model": ("Nothing new to write: LLM.from_model(..., enable_prefix_caching=True) serves SmolLM2 with "
                           "your block_hashes and your PrefixCachingAllocator.",
                           "Four phases on a 10-block pool of 16 tokens: c0; c1 and c2 (c0's system prompt) at once; "
                           "b0 (another system prompt), which evicts; c0 again. Each answer must be the engine's "
                           "without prefix caching, each phase must hit as many prompt tokens and evict as many "
                           "blocks as minillm's cache, and every block must be free at the end. More hits than "
                           "minillm's: a stale name (an evicted block still found); fewer: the wrong block evicted, "
                           "or a name lost on free."),
    "task_13_pack": ("A sequence's blocks are scattered over the sender's pool and must land in other ids of the "
                     "receiver's. What is the payload's shape, and what happens to the sender's blocks once it is "
                     "packed?",
                     "pack: ceil(num_tokens / block_size) blocks (the partly filled last one too), packed block i = "
                     "block_table[i], every layer, every tensor stored_tensors(pool) names (an int8 pool's "
                     "scales too); new memory (t[:, a:b] is a view the pool overwrites when it reuses the blocks); "
                     "ValueError for num_tokens < 1 or more than the table holds. unpack: check_payload first "
                     "(nothing written on a bad payload), then packed block i into block_table[i], in the table's "
                     "order, scales included, no other block touched."),
    "task_13_route": ("What does a replica still owe, and which replica's cache most likely holds this prompt's "
                      "prefix? When is sending it there worse than computing the prefix again elsewhere?",
                      "least_loaded: fewest outstanding_tokens (not requests) among live replicas, ties to the lowest "
                      "id, RuntimeError if none is alive. matched_blocks: the leading run of remembered hashes only. "
                      "on_dispatch: hashes tail first, each moved to the most recent end (move_to_end), then drop "
                      "the oldest beyond max_blocks: heads survive. is_imbalanced: a - b > balance_abs AND a > "
                      "balance_rel * b, both strict. choose: the longest match (then less loaded, lower id) unless "
                      "nothing matches or it is imbalanced against the lightest (then fewest remembered, lower "
                      "id); choose remembers nothing."),
    "task_13_real_model": ("Nothing new to write: SmolLM2 is prefilled on one engine and decoded on another through "
                           "your pack/unpack, and your router routes chat requests over two prefix-caching engines.",
                           "Three chats (float32 and int8 KV) go LLM.add_prefill -> pop_handoffs -> add_prefilled "
                           "into an engine whose free blocks come in a scrambled order: the greedy tokens must be a "
                           "single engine's (KV written into the wrong blocks changes them). Then four waves of "
                           "chats sharing two system prompts are routed over two engines (block_size 16, "
                           "max_blocks 24, balance_abs 64, balance_rel 1.5): every choice and each "
                           "engine's prefix-hit tokens must be minillm's router's."),
}


# level 3 of the tasks that have no stub of their own: they run the learner's other functions on the real model
_REAL_MODEL_RECIPE = ("MINILLM_GRADE=exercises python -m pytest tests/graders/{file} -m {marker} -x "
                      "shows the failing case; try it yourself "
                      "with minillm.course.ladder.use_exercises(model, exercises.{module}) around minillm.generate / "
                      "minillm.chat / LLM.from_model and compare with the same call outside the block.")
_REAL_MODEL_MODULES = {"00": "ex00_decoder", "01": "ex01_kv_cache", "02": "ex02_gqa", "03": "ex03_flash",
                       "04": "ex04_paged", "05": "ex05_batching"}
RECIPES: dict[str, str] = {
    f"task_{n}_real_model": _REAL_MODEL_RECIPE.format(file=f"test_{m}.py", marker=f"task_{n}_real_model", module=m)
    for n, m in _REAL_MODEL_MODULES.items()
}
RECIPES["task_06_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex06_fusion.py -m task_06_real_model -x shows the "
    "failing case; by hand: set minillm.compile.fusion's three functions to yours, fuse a copy of the model with "
    "minillm.compile.fusion.fuse and compare its logits with the original's.")
RECIPES["task_07_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex07_quant.py -m task_07_real_model -x -rP shows "
    "the failing case and the perplexities; by hand: set minillm.compress.quant's quantize_int8 "
    "... unpack_int4 to yours, "
    "quantize a bfloat16 copy of the model with minillm.compress.quantize.quantize(copy, 'int8') and compare "
    "minillm.compress.quality.perplexity with the float model's.")
RECIPES["task_08_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex08_sparsity.py -m task_08_real_model -x -rP shows "
    "the failing case and what your pruned model says; by hand: set minillm.compress.sparsity's wanda_scores and "
    "unstructured_mask to yours, prune a float32 copy with minillm.compress.sparsity.prune(copy, 0.5, 'wanda', "
    "calib_ids=minillm.compress.quality.calibration_ids(tok, 128), window=128) and compare "
    "minillm.compress.quality.perplexity with the dense model's.")
RECIPES["task_09_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex09_distill.py -m task_09_real_model -x -rP shows "
    "the failing case, the KL before and after and what your student says; by hand: set minillm.compress.distill's "
    "distillation_loss, lr_at and train_step to yours, drop blocks from a float32 copy of the model "
    "(minillm.compress.pruning.drop_blocks) and run minillm.compress.distill.distill on "
    "minillm.compress.distill.train_ids(tok), comparing minillm.compress.distill.evaluate before and after.")
RECIPES["task_10_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex10_speculative.py -m task_10_real_model -x -rP "
    "shows the failing case and the acceptance counts; by hand: set minillm.speculative.decoding's verify_greedy and "
    "rejection_sample and minillm.speculative.drafters' propose_ngram to yours, then compare "
    "minillm.generate(model, tok, prompt, "
    "chat=True, speculative=SpeculativeConfig('ngram', k=4), spec_stats=SpecStats()) with the same call without "
    "speculative=, and read the SpecStats.")
RECIPES["task_11_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex11_parallel.py -m task_11_real_model -x -rP shows "
    "the failing case, the ranks' time and what they said. The ranks are fresh processes: each imports your module "
    "by name and puts your two functions into minillm.parallel.tensor before "
    "minillm.parallel.launch.rank_generate (the "
    "grader's _tp_rank). In one process, _simulated_block0(model, ids, 3) from that grader, with "
    "minillm.parallel.tensor's column_slice and row_slice set to yours, runs SmolLM2's block 0 as three simulated "
    "ranks and names the part (attn or mlp) that differs.")
RECIPES["task_12_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex12_prefix_cache.py -m task_12_real_model -x -rP "
    "shows the failing phase, its hits and evictions against minillm's; by hand: set "
    "minillm.engine.block_manager.block_hashes and minillm.engine.llm.PrefixCachingAllocator to yours, "
    "serve the grader's "
    "PHASES with its serve_phases(model, tok) and compare each phase with reference_phases(model, tok), taken "
    "before yours are swapped in.")
RECIPES["task_13_real_model"] = (
    "MINILLM_GRADE=exercises python -m pytest tests/graders/test_ex13_disagg.py -m task_13_real_model -x -rP shows "
    "the failing request (tokens, or the routing choice and hits); by hand: set "
    "minillm.cache.kv_transfer's pack_kv_blocks "
    "and unpack_kv_blocks to yours and run the grader's disaggregated(model, tok, None) against "
    "single_engine(model, tok, None); run its route_stream(model, tok, YourRouterClass) against "
    "route_stream(model, tok, minillm.serving.router.PrefixAffinityRouter).")


def _recipes(lesson: str) -> dict[str, str]:
    """task marker -> the stub's NotImplementedError message ('task NN.name: ...'), or its RECIPES entry."""
    out: dict[str, str] = {m: r for m, r in RECIPES.items() if m.startswith(f"task_{lesson}_")}
    for path in sorted((ROOT / "exercises").glob(f"ex{lesson}_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                try:
                    msg = ast.literal_eval(node.exc.args[0])
                except ValueError:
                    continue
                if isinstance(msg, str) and msg.startswith("task "):
                    task, _, text = msg.partition(":")
                    marker = "task_" + task.split()[1].replace(".", "_")
                    out[marker] = (out[marker] + "\n" if marker in out else "") + text.strip()
    return out


def hint(lesson: str, task: str | None = None, level: int = 1) -> str:
    if lesson not in TASKS:
        raise ValueError(f"unknown lesson {lesson!r}; lessons with exercises: {', '.join(TASKS)}")
    markers = [m for m, _ in TASKS[lesson]]
    if task:
        wanted = task if task.startswith("task_") else f"task_{lesson}_{task.split('.')[-1]}"
        if wanted not in markers:
            raise ValueError(f"lesson {lesson} has tasks {', '.join(m.split('_', 2)[2] for m in markers)}")
        markers = [wanted]
    recipes = _recipes(lesson) if level >= 3 else {}
    lines = []
    for m in markers:
        nudge, contract = HINTS.get(m, ("(no hint written for this task yet)", "(no hint written for this task yet)"))
        lines.append(f"{m}:")
        lines.append(f"  1. {nudge}")
        if level >= 2:
            lines.append(f"  2. {contract}")
        if level >= 3:
            lines.append(f"  3. {recipes.get(m, '(no recipe in the stub)')}")
    if level < 3:
        lines.append(f"(more: minillm hint {lesson}{' ' + task if task else ''} --level {level + 1})")
    return "\n".join(lines)

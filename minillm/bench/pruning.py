"""`minillm bench pruning` (lesson 08): which KV groups and FFN channels to remove, by three papers' rules, at equal
parameters and an equal recovery budget.

SmolLM2-135M, float32: every block keeps 2 of its 3 KV groups and 1,024 of its 1,536 FFN channels (the same shape
for every method), chosen by lesson 08's activation rule (pruning.py), by LLM-Pruner's first-order Taylor
importance (element-wise and vector-wise; compress/llm_pruner.py), or by LoRAPrune's (the same estimate through the
adapters' gradients, pruned half-way through recovery); then LoRA recovery on the calibration text, the same steps
and tokens for each. Held-out perplexity, KL and top-1 agreement with the dense model, before and after recovery.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F

from minillm.bench.quant import quality, reference
from minillm.measure.harness import BenchResult
from minillm.measure.metrics import timer

SHAPE = {"kv_groups": 2, "ffn_dim": 1024}


def budget(quick: bool) -> dict:
    if quick:
        return {"eval_tokens": 64, "window": 64, "calib_tokens": 128, "grad_window": 64, "steps": 2, "batch": 1,
                "seq": 32, "lr": 1e-3, "rank": 4}
    return {"eval_tokens": 512, "window": 256, "calib_tokens": 1024, "grad_window": 128, "steps": 8, "batch": 2,
            "seq": 128, "lr": 1e-3, "rank": 8}


def recover(model, text_ids: list[int], b: dict, steps: int, seed: int = 0, on_step=None) -> float:
    """LoRA recovery: `steps` AdamW steps of next-token loss on random windows of text_ids (adapters must be on);
    on_step(i) runs before step i (LoRAPrune prunes there). Returns seconds."""
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=b["lr"], weight_decay=0.0)
    with timer() as t, torch.enable_grad():
        for i in range(steps):
            if on_step is not None and on_step(i):
                params = [p for p in model.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=b["lr"], weight_decay=0.0)  # new shapes: new state
            starts = [rng.randrange(0, len(text_ids) - b["seq"] - 1) for _ in range(b["batch"])]
            x = torch.tensor([text_ids[s:s + b["seq"] + 1] for s in starts])
            logits = model(x[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return t.seconds


def _prune(model, kv, ffn) -> None:
    from minillm.compress.pruning import prune_ffn_channels, prune_kv_groups

    prune_kv_groups(model, SHAPE["kv_groups"], kv)
    prune_ffn_channels(model, SHAPE["ffn_dim"], ffn)


def _merge_and_prune_under_lora(model, kv, ffn, rank: int) -> None:
    """Fold the adapters into their weights, prune, and put fresh adapters back (LoRAPrune's mid-training cut)."""
    from minillm.compress.lora import add_lora, merge_lora

    merge_lora(model)
    _prune(model, kv, ffn)
    add_lora(model, rank=rank, alpha=2.0 * rank)


def run(quick: bool = False) -> BenchResult:
    from minillm.compress.llm_pruner import lora_gradients, taylor_importance, weight_gradients
    from minillm.compress.lora import add_lora, merge_lora
    from minillm.compress.pruning import ffn_channel_importance, kv_group_importance, n_params
    from minillm.compress.quality import calibration_ids

    b = budget(quick)
    ref, tok, ids, chunks, ref_logits = reference(b["eval_tokens"], b["window"])
    calib = calibration_ids(tok, b["calib_tokens"])
    rows = [{"method": "dense", "params_M": n_params(ref) / 1e6, **quality(ref, ref_logits, chunks)}]

    def scored(name: str, model, prune_s: float, recover_s: float, before: dict) -> None:
        with torch.inference_mode():
            after = quality(model, ref_logits, chunks)
        rows.append({"method": name, "params_M": n_params(model) / 1e6, "ppl_pruned": before["ppl"],
                     "top1_pruned": before["top1_agree"], "ppl": after["ppl"], "kl": after["kl"],
                     "top1_agree": after["top1_agree"], "importance_s": prune_s, "recovery_s": recover_s})

    rules = {"activation (lesson 08)": lambda m: (kv_group_importance(m, calib, b["grad_window"]),
                                                  ffn_channel_importance(m, calib, b["grad_window"])),
             "LLM-Pruner element": lambda m: taylor_importance(m, weight_gradients(m, calib, b["grad_window"]),
                                                               "element"),
             "LLM-Pruner vector": lambda m: taylor_importance(m, weight_gradients(m, calib, b["grad_window"]),
                                                              "vector")}
    from minillm.compress.pruning import prune_ffn_channels, prune_kv_groups

    alone = {}  # method -> the perplexity of each structure pruned alone (no recovery): where a rule wins or loses
    for name, rule in rules.items():
        model = copy.deepcopy(ref)
        with timer() as t:
            kv, ffn = rule(model)
            _prune(model, kv, ffn)
        with torch.inference_mode():
            before = quality(model, ref_logits, chunks)
            for what, cut in (("kv", lambda m: prune_kv_groups(m, SHAPE["kv_groups"], kv)),
                              ("ffn", lambda m: prune_ffn_channels(m, SHAPE["ffn_dim"], ffn))):
                single = copy.deepcopy(ref)
                cut(single)
                alone.setdefault(name, {})[what] = quality(single, ref_logits, chunks)["ppl"]
                del single
        add_lora(model, rank=b["rank"], alpha=2.0 * b["rank"])
        secs = recover(model, calib, b, b["steps"])
        merge_lora(model)
        scored(name, model, t.seconds, secs, before)
        rows[-1].update({"ppl_kv_only": alone[name]["kv"], "ppl_ffn_only": alone[name]["ffn"]})
        print(f"  {name}: ppl {before['ppl']:.1f} pruned -> {rows[-1]['ppl']:.1f} after recovery", flush=True)

    # LoRAPrune: adapters first; half-way, importance from their gradients (no frozen weight's gradient), prune
    model, cut, state = copy.deepcopy(ref), b["steps"] // 2, {}
    add_lora(model, rank=b["rank"], alpha=2.0 * b["rank"])

    def at_step(i: int) -> bool:
        if i != cut:
            return False
        with timer() as t:
            kv, ffn = taylor_importance(model, lora_gradients(model, calib, b["grad_window"]), "element")
            _merge_and_prune_under_lora(model, kv, ffn, b["rank"])
        with torch.inference_mode():
            state["before"] = quality(model, ref_logits, chunks)
        state["s"] = t.seconds
        return True

    secs = recover(model, calib, b, b["steps"], on_step=at_step)
    merge_lora(model)
    scored("LoRAPrune (cut at half)", model, state["s"], secs - state["s"], state["before"])
    print(f"  LoRAPrune: ppl {state['before']['ppl']:.1f} at the cut -> {rows[-1]['ppl']:.1f}", flush=True)

    by = {r["method"]: r for r in rows}
    act = by["activation (lesson 08)"]
    ratios = {"llm_pruner_element_ppl_vs_activation": by["LLM-Pruner element"]["ppl"] / act["ppl"],
              "llm_pruner_vector_ppl_vs_activation": by["LLM-Pruner vector"]["ppl"] / act["ppl"],
              "llm_pruner_element_pruned_ppl_vs_activation":
                  by["LLM-Pruner element"]["ppl_pruned"] / act["ppl_pruned"],
              "loraprune_ppl_vs_llm_pruner_element": by["LoRAPrune (cut at half)"]["ppl"]
              / by["LLM-Pruner element"]["ppl"],
              "llm_pruner_element_kv_only_ppl_vs_activation": alone["LLM-Pruner element"]["kv"] / alone[
                  "activation (lesson 08)"]["kv"],
              "llm_pruner_element_ffn_only_ppl_vs_activation": alone["LLM-Pruner element"]["ffn"] / alone[
                  "activation (lesson 08)"]["ffn"],
              "params_kept": act["params_M"] / rows[0]["params_M"]}
    notes = [f"every method keeps {SHAPE['kv_groups']} of 3 KV groups and {SHAPE['ffn_dim']} of 1,536 FFN channels "
             f"per block ({ratios['params_kept']:.0%} of the parameters); recovery: {b['steps']} LoRA steps (rank "
             f"{b['rank']}) of {b['batch']} x {b['seq']} tokens of the calibration text, lr {b['lr']}",
             "gradients and activations from the same calibration text; perplexity on the held-apart text"]
    return BenchResult(name="pruning", rows=rows, ratios=ratios, settings={**b, "dtype": "float32",
                                                                          "threads": torch.get_num_threads()},
                       notes=notes)

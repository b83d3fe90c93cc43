"""`minillm bench sparsity` (lesson 08): what pruning costs in quality, and what it buys in speed, in one run.

SmolLM2-135M, float32, against the unpruned model:
1. unstructured and 2:4 curves, magnitude vs Wanda vs SparseGPT: perplexity, KL, top-1 agreement and the seconds
   the pruning takes at each sparsity (no speed column: a dense matmul multiplies the zeros);
2. structured pruning (dropped blocks, fewer KV groups, narrower FFN): parameters removed, perplexity, tok/s;
3. the 2:4 format's bytes; on CUDA, torch's semi-structured sparse matmul vs dense fp16 (CPUs have none).
"""

from __future__ import annotations

import copy
import time

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import decode_tok_s
from minillm.bench.quant import prefill_tok_s, quality, reference

SHAPES = {"wq/wo": (576, 576), "wk/wv": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}


def pruned(ref, method: str, pattern: str, s: float, calib: list[int], **kw):
    """A pruned copy of ref, and the seconds the pruning took (calibration passes included)."""
    from minillm.compress.sparsegpt import prune_sparsegpt
    from minillm.compress.sparsity import prune

    model = copy.deepcopy(ref)
    start = time.perf_counter()
    if method == "sparsegpt":
        prune_sparsegpt(model, s, pattern, calib_ids=calib, **kw)
    else:
        prune(model, s, method, pattern, calib_ids=calib)
    return model, time.perf_counter() - start


def unstructured_rows(ref, calib, ref_logits, chunks, quick: bool) -> tuple[list[dict], dict]:
    """The rows, and the 2:4 models (run() checks their masks on every layer)."""
    from minillm.compress.sparsity import sparsity_of

    levels = [0.5] if quick else [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    todo = [(m, "unstructured", s) for s in levels for m in ("magnitude", "wanda")]
    todo += [("sparsegpt", "unstructured", s) for s in ([0.5] if quick else [0.5, 0.6, 0.7])]
    todo += [("magnitude", "2:4", 0.5), ("wanda", "2:4", 0.5)] + ([] if quick else [("sparsegpt", "2:4", 0.5)])
    rows, two4 = [], []
    for method, pattern, s in todo:
        model, seconds = pruned(ref, method, pattern, s, calib)
        rows.append({"variant": f"{method} {pattern} {s:.0%}", "part": "masks", "method": method,
                     "pattern": pattern, "sparsity": sparsity_of(model), **quality(model, ref_logits, chunks),
                     "prune_s": seconds})
        if pattern == "2:4" and method != "magnitude":
            two4.append(model)
    return rows, two4


def calibration_rows(ref, tok, calib, ref_logits, chunks) -> list[dict]:
    """SparseGPT vs Wanda at 60% when the calibration budget or the dampening changes: with fewer calibration tokens
    than a layer has inputs (512 vs mlp.down's 1536), H = X X^T is singular and only the dampening holds the
    reconstruction to what the calibration text does not show. Wanda keeps one norm per channel: little to overfit."""
    from minillm.compress.quality import calibration_ids

    rows = []
    big = calibration_ids(tok, 8 * len(calib))
    for method, ids, damp in (("sparsegpt", calib, 0.1), ("sparsegpt", calib, 1.0), ("wanda", big, None),
                              ("sparsegpt", big, 0.01)):
        kw = {} if damp is None else {"damp": damp}
        model, seconds = pruned(ref, method, "unstructured", 0.6, ids, **kw)
        rows.append({"variant": f"{method} 60%, {len(ids)} calib tokens" + ("" if damp is None else f", damp {damp}"),
                     "part": "calibration", "method": method, "calib_tokens": len(ids), "damp": damp,
                     **quality(model, ref_logits, chunks), "prune_s": seconds})
    return rows


def structured_variants(quick: bool) -> dict[str, dict]:
    if quick:
        return {"drop 10 blocks": {"drop_n_blocks": 10}}
    return {"drop 4 blocks": {"drop_n_blocks": 4}, "drop 8 blocks": {"drop_n_blocks": 8},
            "drop 10 blocks": {"drop_n_blocks": 10}, "KV groups 3 -> 2": {"kv_groups": 2},
            "FFN 1536 -> 1024": {"ffn_dim": 1024},
            "drop 6 blocks + KV 2 + FFN 1280": {"drop_n_blocks": 6, "kv_groups": 2, "ffn_dim": 1280}}


def structured_rows(ref, calib, ref_logits, chunks, ids, quick: bool) -> list[dict]:
    from minillm.compress.pruning import n_params, prune_structured

    n_new, repeat = (8, 1) if quick else (64, 5)
    prompt = ids[:32]
    models, rows = {"dense": ref}, [{"variant": "dense", "part": "structured", "params_M": n_params(ref) / 1e6,
                                     "params_removed": 0.0, **quality(ref, ref_logits, chunks)}]
    for name, kw in structured_variants(quick).items():
        model = copy.deepcopy(ref)
        report = prune_structured(model, calib, **kw)
        rows.append({"variant": name, "part": "structured", "params_M": report["params_after"] / 1e6,
                     "params_removed": report["params_removed"], **quality(model, ref_logits, chunks),
                     "config": f"{model.config.n_layers} blocks, {model.config.n_kv_heads} KV groups, "
                               f"FFN {model.config.ffn_dim}"})
        models[name] = model
    by = {r["variant"]: r for r in rows}
    for name, model in models.items():
        by[name]["prefill_tok_s"] = prefill_tok_s(model, ids[:128], min(repeat, 2))
    speed = {name: [] for name in models}
    for _ in range(repeat):  # round-robin: a noisy neighbour slows every variant, not one
        for name, model in models.items():
            speed[name].append(decode_tok_s(model, prompt, n_new, 1)[0])
    for name in models:
        by[name]["decode_tok_s"] = max(speed[name])
    return rows


def semi_structured_bytes() -> list[dict]:
    from minillm.compress.sparsity import format_bytes

    rows = []
    for name, shape in SHAPES.items():
        b = format_bytes(shape, 0.5)
        rows.append({"variant": f"format, {name} {shape[0]}x{shape[1]}", "part": "format",
                     "dense_bf16_KB": b["dense"] / 1024, "2:4_KB": b["2:4"] / 1024, "csr_50%_KB": b["csr"] / 1024})
    return rows


def gpu_semi_structured(quick: bool) -> tuple[list[dict], dict]:
    """fp16 dense vs 2:4 sparse linear on CUDA (torch's to_sparse_semi_structured), for the model's shapes."""
    from torch.sparse import to_sparse_semi_structured
    from triton.testing import do_bench

    from minillm.compress.sparsity import semi_structured_mask

    rows, ratios = [], {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.float16)
        w = w * semi_structured_mask(w.abs().float()).to(w.dtype)
        sparse = to_sparse_semi_structured(w)
        for m in ([1, 2048] if quick else [1, 16, 256, 2048, 8192]):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            dense_ms = do_bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            sparse_ms = do_bench(lambda x=x, sparse=sparse: torch.nn.functional.linear(x, sparse))
            rows.append({"variant": f"cuda {name} M={m}", "part": "gpu", "dense_ms": dense_ms, "sparse_ms": sparse_ms,
                         "speedup": dense_ms / sparse_ms})
    big = [r["speedup"] for r in rows if r["variant"].endswith(("M=2048", "M=8192"))]
    ratios["gpu_2to4_speedup_prefill_best"] = max(big)
    return rows, ratios


def run(quick: bool = False) -> BenchResult:
    from minillm.compress.quality import calibration_ids
    from minillm.compress.sparsity import is_n_m_sparse

    eval_len, window = (64, 64) if quick else (512, 256)
    ref, tok, ids, chunks, ref_logits = reference(eval_len, window)
    calib = calibration_ids(tok, 128 if quick else 512)
    rows, check = unstructured_rows(ref, calib, ref_logits, chunks, quick)
    by = {r["variant"]: r for r in rows}
    ratios = {"wanda_ppl_over_magnitude_at_50":
              by["wanda unstructured 50%"]["ppl"] / by["magnitude unstructured 50%"]["ppl"],
              "wanda_2to4_ppl_over_magnitude_2to4": by["wanda 2:4 50%"]["ppl"] / by["magnitude 2:4 50%"]["ppl"]}
    for s in (50, 60, 70):
        if f"sparsegpt unstructured {s}%" in by:
            ratios[f"sparsegpt_vs_wanda_ppl_{s}"] = (by[f"sparsegpt unstructured {s}%"]["ppl"]
                                                     / by[f"wanda unstructured {s}%"]["ppl"])
    if "sparsegpt 2:4 50%" in by:
        ratios["sparsegpt_vs_wanda_ppl_2to4"] = by["sparsegpt 2:4 50%"]["ppl"] / by["wanda 2:4 50%"]["ppl"]
    ratios["sparsegpt_vs_wanda_prune_time_50"] = (by["sparsegpt unstructured 50%"]["prune_s"]
                                                  / by["wanda unstructured 50%"]["prune_s"])
    # 2:4 masks valid on every layer of the pruned models (Wanda's and, in full runs, SparseGPT's)
    linears = [m for c in check for b in c.layers for m in b.modules() if isinstance(m, torch.nn.Linear)]
    ratios["layers_2to4_valid"] = sum(is_n_m_sparse(m.weight) for m in linears) / len(linears)
    del check
    if not quick:
        c_rows = calibration_rows(ref, tok, calib, ref_logits, chunks)
        rows += c_rows
        big = {r["method"]: r for r in c_rows if r["calib_tokens"] > len(calib)}
        ratios[f"sparsegpt_vs_wanda_ppl_60_calib_{big['wanda']['calib_tokens']}"] = (big["sparsegpt"]["ppl"]
                                                                                    / big["wanda"]["ppl"])
    s_rows = structured_rows(ref, calib, ref_logits, chunks, ids, quick)
    dense = s_rows[0]
    for r in s_rows[1:]:
        r["decode_vs_dense"] = r["decode_tok_s"] / dense["decode_tok_s"]
        r["prefill_vs_dense"] = r["prefill_tok_s"] / dense["prefill_tok_s"]
    rows += s_rows
    ten = next(r for r in s_rows if r["variant"] == "drop 10 blocks")
    ratios.update({"drop10_params_removed": ten["params_removed"], "drop10_decode_vs_dense": ten["decode_vs_dense"],
                   "drop10_prefill_vs_dense": ten["prefill_vs_dense"],
                   "drop10_ppl_over_dense": ten["ppl"] / dense["ppl"]})
    rows += semi_structured_bytes()
    ratios["2to4_bytes_vs_dense_bf16"] = rows[-1]["2:4_KB"] / rows[-1]["dense_bf16_KB"]
    targets = {"wanda_ppl_over_magnitude_at_50": ("<", 1.0), "layers_2to4_valid": (">=", 1.0),
               "drop10_params_removed": (">=", 0.25), "drop10_decode_vs_dense": (">=", 1.25)}
    notes = ["float32 throughout; the reference is the unpruned model (the file's Q4_1 weights expanded)",
             "magnitude compares weights per matrix, Wanda per output row (each method's own comparison group)",
             "unstructured and 2:4 rows have no speed column: a dense matmul multiplies the zeros",
             "prune_s: seconds to prune (calibration passes included); SparseGPT damps H by 1% of its mean diagonal",
             "SparseGPT picks its mask per row in blocks of 128 columns (Wanda: over the whole row)"]
    if torch.cuda.is_available():
        g_rows, g_ratios = gpu_semi_structured(quick)
        rows += g_rows
        ratios.update(g_ratios)
        targets["gpu_2to4_speedup_prefill_best"] = (">=", 1.2)
    else:
        notes.append("no CUDA: torch's 2:4 sparse kernels (to_sparse_semi_structured) need an NVIDIA GPU of compute "
                     "capability 8.0+; scripts/gpu_check_sparsity.py times them on one")
    return BenchResult(name="sparsity", rows=rows, ratios=ratios, targets=targets,
                       settings={"eval_tokens": eval_len, "window": window, "calibration_tokens": len(calib),
                                 "threads": torch.get_num_threads(), "dtype": "float32"},
                       notes=notes)

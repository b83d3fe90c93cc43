"""`minillm bench codebook` (lesson 07): shared codebooks (k-means per output row) against uniform 4/3-bit and AWQ.

Every variant is the same SmolLM2 file (its fp32 dequantization is the reference). Per variant: held-out perplexity,
KL and top-1 agreement to the reference on the head of the pydoc text (calibration on its tail), weight bytes of its
storage format, and batch-1 decode tok/s where the format runs as stored. Which rows and how bytes count: `variants`.
"""

from __future__ import annotations

import contextlib

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import decode_tok_s

GROUP = 64  # lesson 07's uniform groups (128 does not divide SmolLM2's 576-wide inputs)
OUTLIERS = 0.005  # dense-and-sparse rows: the largest 0.5% |w| of each layer kept in float16


def variants(quick: bool, calib: list[int]) -> dict:
    """name -> (builder, format, timed?). Every row quantizes the blocks' Linears and keeps the tied embedding/LM head
    (and the norms) in float; format says how its bytes count: ("bf16",), ("uniform", bits) for `bits` per weight plus
    an fp16 scale and minimum per 64 weights (lesson 07's int4/3-bit), ("codebook",) for CodebookLinear.nbytes().
    Uniform 3-bit and AWQ rows are rounded and stored in float (quality only: no kernel); int4 RTN runs Int4Linear."""
    from minillm.api import load_model
    from minillm.compress.awq import apply_awq
    from minillm.compress.codebook import codebook_quantize
    from minillm.compress.layer_sharing import share_neighbours
    from minillm.compress.quant import fake_quantize_int4
    from minillm.compress.quantize import quantize

    def fresh():
        return load_model("smollm2-135m", dtype="float32")[0]

    def awq(bits):
        m = fresh()
        apply_awq(m, calib, group_size=GROUP, bits=bits, grid=4 if quick else 20)
        return fake_quantize_int4(m, GROUP, bits)

    def codebook(bits, sensitivity=None, **kw):
        return lambda: codebook_quantize(fresh(), bits, sensitivity, calib if sensitivity else None,
                                         max_iter=10 if quick else 100, **kw)

    out = {"fp32 (reference)": (fresh, ("bf16",), True),
           "uniform 3-bit g64 RTN": (lambda: fake_quantize_int4(fresh(), GROUP, 3), ("uniform", 3), False),
           "codebook 3-bit": (codebook(3), ("codebook",), True)}
    if quick:
        return out
    out.update({
        "int4 g64 RTN": (lambda: quantize(fresh(), "int4", GROUP, include_head=False), ("uniform", 4), True),
        "int4 g64 AWQ": (lambda: awq(4), ("uniform", 4), False),
        "uniform 3-bit g64 AWQ": (lambda: awq(3), ("uniform", 3), False),
        "codebook 4-bit": (codebook(4), ("codebook",), True),
        "codebook 4-bit Fisher": (codebook(4, "fisher"), ("codebook",), False),
        "codebook 3-bit Fisher": (codebook(3, "fisher"), ("codebook",), False),
        "codebook 3-bit E[x^2]": (codebook(3, "activation"), ("codebook",), False),
        "codebook 3-bit per layer": (codebook(3, rows_per_codebook=None), ("codebook",), False),
        "codebook 3-bit +0.5% outliers": (codebook(3, outliers=OUTLIERS), ("codebook",), False),
        "codebook 3-bit Fisher +0.5% outliers": (codebook(3, "fisher", outliers=OUTLIERS), ("codebook",), False),
        "blocks shared in pairs (mean), bf16": (lambda: share_neighbours(fresh(), 2, "mean"), ("bf16",), False),
    })
    return out


def weight_bytes(model, fmt: tuple) -> int:
    """The bytes of a variant's storage format: the blocks' Linears in that format, every other weight in bf16."""
    from minillm.compress.codebook import CodebookLinear, _targets
    from minillm.compress.quant import Int4Linear

    params = sum(p.numel() for p in model.parameters())  # a tied tensor counted once
    if fmt[0] == "codebook":
        return sum(m.nbytes() for m in model.modules() if isinstance(m, CodebookLinear)) + 2 * params
    if fmt[0] == "bf16":
        return 2 * params
    shapes = [m.weight.shape for m in _targets(model).values()]  # fake-quantized rows: nn.Linear still
    shapes += [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, Int4Linear)]
    quantized = sum(o * i for o, i in shapes)
    others = params - sum(m.weight.numel() for m in _targets(model).values())
    return round(quantized * (fmt[1] + 32 / GROUP) / 8 + 2 * others)


def run(quick: bool = False) -> BenchResult:
    from minillm.bench.quant import quality, reference
    from minillm.compress.codebook import CodebookLinear
    from minillm.compress.quant import cpu_kernels_disabled
    from minillm.compress.quality import calibration_ids

    eval_len, window, n_new, repeat = (64, 64, 4, 1) if quick else (1024, 512, 32, 3)
    ref, tok, ids, chunks, ref_logits = reference(eval_len, window)
    del ref
    calib = calibration_ids(tok, 128 if quick else 1024)
    prompt = tok.encode("The history of the printing press begins with " * 8)[:32]
    rows, timed = [], {}
    for name, (build, fmt, time_it) in variants(quick, calib).items():
        model = build()
        layers = [m for m in model.modules() if isinstance(m, CodebookLinear)]
        row = {"variant": name, "weight_MB": weight_bytes(model, fmt) / 1e6, **quality(model, ref_logits, chunks)}
        if layers:
            row["bits_per_weight"] = 8 * sum(m.nbytes() for m in layers) / sum(
                m.in_features * m.out_features for m in layers)
        elif fmt[0] == "uniform":
            row["bits_per_weight"] = fmt[1] + 32 / GROUP
        if time_it:
            timed[name] = model
        rows.append(row)
    # the codebook rows twice: the LUT kernel (codebook_matmul.cpp) and, the rung before it, the dense weight looked
    # up on every step in front of torch's matmul (what runs where our kernels do not build)
    runs = [(name, model, False) for name, model in timed.items()]
    runs += [(name, model, True) for name, model in timed.items() if name.startswith("codebook")]
    speed: dict = {(name, dense): [] for name, _, dense in runs}
    for _ in range(repeat):  # round-robin: a noisy neighbour slows every variant, not one
        for name, model, dense in runs:
            with cpu_kernels_disabled() if dense else contextlib.nullcontext():
                speed[name, dense].append(decode_tok_s(model, prompt, n_new, 1)[0])
    for row in rows:
        if (row["variant"], False) in speed:
            row["decode_tok_s"] = max(speed[row["variant"], False])
        if (row["variant"], True) in speed:
            row["decode_tok_s_dense_lookup"] = max(speed[row["variant"], True])
    del timed
    by = {r["variant"]: r for r in rows}
    u3 = by["uniform 3-bit g64 RTN"]
    ref_ppl, ref_mb = by["fp32 (reference)"]["ppl"], by["fp32 (reference)"]["weight_MB"]
    ratios = {"codebook3_vs_uniform3_ppl": by["codebook 3-bit"]["ppl"] / u3["ppl"],
              "codebook3_vs_uniform3_bytes": by["codebook 3-bit"]["weight_MB"] / u3["weight_MB"],
              "codebook3_decode_vs_fp32": by["codebook 3-bit"]["decode_tok_s"] / by["fp32 (reference)"]["decode_tok_s"],
              "codebook3_lut_vs_dense_lookup_decode": (by["codebook 3-bit"]["decode_tok_s"]
                                                       / by["codebook 3-bit"]["decode_tok_s_dense_lookup"])}
    targets = {"codebook3_vs_uniform3_ppl": ("<", 1.0)}
    if not quick:
        ratios.update({
            "codebook3_fisher_vs_uniform3_ppl": by["codebook 3-bit Fisher"]["ppl"] / u3["ppl"],
            "codebook3_fisher_vs_awq3_ppl": by["codebook 3-bit Fisher"]["ppl"] / by["uniform 3-bit g64 AWQ"]["ppl"],
            "codebook3_outliers_vs_uniform3_ppl": by["codebook 3-bit +0.5% outliers"]["ppl"] / u3["ppl"],
            "codebook3_activation_vs_uniform3_ppl": by["codebook 3-bit E[x^2]"]["ppl"] / u3["ppl"],
            "codebook4_vs_int4_ppl": by["codebook 4-bit"]["ppl"] / by["int4 g64 RTN"]["ppl"],
            "codebook4_fisher_vs_int4_ppl": by["codebook 4-bit Fisher"]["ppl"] / by["int4 g64 RTN"]["ppl"],
            "codebook4_fisher_vs_awq4_ppl": by["codebook 4-bit Fisher"]["ppl"] / by["int4 g64 AWQ"]["ppl"],
            "codebook4_decode_vs_int4": by["codebook 4-bit"]["decode_tok_s"] / by["int4 g64 RTN"]["decode_tok_s"],
            "shared_pairs_ppl_over_reference": by["blocks shared in pairs (mean), bf16"]["ppl"] / ref_ppl,
            "shared_pairs_bytes_vs_bf16": by["blocks shared in pairs (mean), bf16"]["weight_MB"] / ref_mb,
        })
        targets.update({"codebook3_fisher_vs_uniform3_ppl": ("<", 1.0), "codebook4_fisher_vs_int4_ppl": ("<", 1.0)})
    notes = [
        ("the reference is the fp32 model dequantized from the file's Q4_1 weights; every row quantizes the blocks' "
         "Linears only (the tied embedding/LM head and the norms stay float, counted at bf16 in weight_MB)"),
        (f"uniform rows: lesson 07's asymmetric min/max round-to-nearest in groups of {GROUP} (bits + 0.5 bits of fp16 "
         "scale and minimum per weight); 3-bit and AWQ rows are rounded and kept in float (no 3-bit kernel): their "
         "bytes are computed for the packed format, their speed not measured"),
        ("codebook rows: one table of 2**bits float16 values per output row (per layer: 'per layer'), indices packed "
         "at 3/4 bits (CodebookLinear.nbytes, the bytes the module holds), plus 6 bytes per kept outlier"),
        ("sensitivity: 'Fisher' = squared gradients of each calibration window's loss summed over windows "
         "(SqueezeLLM's Fisher diagonal, computed exactly: one backward per 128-token window); 'E[x^2]' = the input "
         "channel's second moment (the cheaper AWQ/GPTQ-style proxy)"),
        ("codebook decode runs the LUT kernel (kernels/cpu/codebook_matmul.cpp: each group of 8 codes is one 32-bit "
         "load, spread to lanes and looked up in a table held in registers) where our CPU kernels build; "
         "decode_tok_s_dense_lookup is the rung before, the dense fp32 weight looked up from the codes on every step "
         "in front of torch's matmul: 3-4 bits stored, more than fp32 read per token"),
        ("plain k-means minimises the unweighted squared error: it beats uniform 3-bit there but moves each layer's "
         "few largest weights far (they share a center with the bulk), and those carry the model; keeping them exactly "
         "(+0.5% outliers) or weighting by sensitivity (Fisher, E[x^2]) is what wins on perplexity"),
        ("blocks shared in pairs: ALBERT-style cross-layer sharing applied after training (compress/layer_sharing.py): "
         "blocks 2i and 2i+1 use the mean of their Linear weights, stored once; no retraining"),
    ]
    return BenchResult(name="codebook", rows=rows, ratios=ratios, targets=targets, notes=notes,
                       settings={"eval_tokens": eval_len, "window": window, "new_tokens": n_new, "repeat": repeat,
                                 "threads": torch.get_num_threads(), "calibration_tokens": len(calib),
                                 "group_size": GROUP, "outliers": OUTLIERS, "model": "smollm2-135m"})

"""`minillm bench quant` (lesson 07): bytes, speed and quality of each quantization scheme, side by side.

Every variant is the same SmolLM2 file; the reference is its fp32 dequantization (the file's Q4_1 weights
expanded), bf16 the path the quantized kernels replace. Per variant: weight bytes, batch-1 decode and prefill
tok/s, perplexity, KL to the reference and top-1 agreement on the pydoc text (AWQ calibrates on its held-apart
tail). Which weights each row quantizes, and the 3-bit rows: `variants`. Then the int8 KV cache
(`kv_int8_capacity`), torchao beside minillm when installed, and bench lowbit's parts (see `run`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minillm.measure.hardware import bf16_status
from minillm.measure.harness import BenchResult, time_fn
from minillm.measure.metrics import decode_tok_s, timer


@torch.inference_mode()
def reference(eval_tokens: int, window: int):
    """The float32 reference the compression benches score against: (model, tokenizer, the held-apart eval ids, their
    windows, the reference's logits on each window)."""
    from minillm.api import load_model
    from minillm.compress.quality import eval_ids

    ref, tok = load_model("smollm2-135m", dtype="float32")
    ids = eval_ids(tok, eval_tokens)
    chunks = [ids[i:i + window] for i in range(0, len(ids), window)]
    return ref, tok, ids, chunks, [ref(torch.tensor([c]))[0].float() for c in chunks]


@torch.inference_mode()
def quality(model, ref_logits: list[torch.Tensor], chunks: list[list[int]]) -> dict:
    """Perplexity, mean KL to the reference and top-1 agreement, over the same windows the reference saw."""
    from minillm.compress.quality import kl_divergence

    nll = kl = agree = 0.0
    n = 0
    for chunk, ref in zip(chunks, ref_logits):
        x = torch.tensor([chunk])
        logits = model(x)[0].float()
        nll += F.cross_entropy(logits[:-1], x[0, 1:], reduction="sum").item()
        kl += kl_divergence(ref, logits).sum().item()
        agree += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
        n += len(chunk)
    return {"ppl": math.exp(nll / (n - len(chunks))), "kl": kl / n, "top1_agree": agree / n}


@torch.inference_mode()
def prefill_tok_s(model, ids: list[int], repeat: int) -> float:
    x = torch.tensor([ids])
    model(x[:, :8])
    return len(ids) / time_fn(lambda: model(x, last_only=True), warmup=0, repeat=repeat).min


def variants(quick: bool, calib: list[int]):
    """name -> (builder, quality only?). Builders load a fresh model: quantization happens in place.

    Which weights a row quantizes differs: the int8/int4 rows (RTN and AWQ) quantize every Linear *and* the tied
    embedding/LM head, the file's Q4_1 row keeps the file's Q8_0 embedding/LM head, the 3-bit rows keep it in float.
    3-bit rows are quality only: rounded to 3 bits and stored in float (no 3-bit kernel), so their weight_MB is
    computed for the packed format (`packed_3bit_bytes`), not counted from the float tensors."""
    from minillm.api import load_model
    from minillm.compress.awq import apply_awq
    from minillm.compress.quant import fake_quantize_int4
    from minillm.compress.quantize import quantize

    def fresh(dtype="bfloat16", **kw):
        return load_model("smollm2-135m", dtype=dtype, **kw)[0]

    def awq(dtype, g, bits):  # calibrate in float32 (bf16 GEMMs crawl on CPUs without bf16), then cast
        m = fresh("float32")
        apply_awq(m, calib, group_size=g, bits=bits, grid=4 if quick else 20)
        return m.to(getattr(torch, dtype))

    out = {"fp32 (reference)": (lambda: fresh("float32"), False)}
    if not quick:  # quick mode (CI) skips bf16: on a CPU without bf16 instructions its prefill GEMMs crawl
        out["bf16"] = (lambda: fresh(), False)
    out.update({
        "int8 weight-only": (lambda: quantize(fresh(), "int8"), False),
        "int4 g64 RTN": (lambda: quantize(fresh(), "int4", group_size=64), False),
        "int4 g64 AWQ": (lambda: quantize(awq("bfloat16", 64, 4), "int4", group_size=64), False),
    })
    if not quick:
        out["int4 g32 RTN"] = (lambda: quantize(fresh(), "int4", group_size=32), False)
        out["Q4_1 from the file"] = (lambda: fresh(weights="q4"), False)
        out["LLM.int8() fp32"] = (lambda: quantize(fresh("float32"), "llm.int8"), False)
        # 3-bit: rounded to 3 bits and stored in float (there is no 3-bit kernel), so quality only; run() computes
        # their packed size (packed_3bit_bytes, groups of 64)
        out["3-bit g64 RTN"] = (lambda: fake_quantize_int4(fresh("float32"), 64, 3), True)
        out["3-bit g64 AWQ"] = (lambda: fake_quantize_int4(awq("float32", 64, 3), 64, 3), True)
    return out


def packed_3bit_bytes(model, group_size: int, bits: int = 3, other_bytes: int = 2) -> int:
    """Bytes a fake-quantized model would read if its format had a kernel: `bits` per weight of every block Linear
    plus an fp16 scale and minimum per group (32 bits per group), and every other weight (the embedding, tied to the
    LM head, left unquantized; the norms) at `other_bytes` per value (bf16)."""
    head = getattr(model, "lm_head", None)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    quantized = sum(m.weight.numel() for m in linears)
    others = sum(p.numel() for p in model.parameters()) - quantized  # model.parameters() counts a tied tensor once
    return round(quantized * (bits + 32 / group_size) / 8 + others * other_bytes)


def torchao_variants() -> tuple[dict, str | None]:
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        return {}, f"torchao not installed ({e.name}): pip install torchao to run it beside minillm"
    from minillm.api import load_model

    def build(config):
        def make():
            m = load_model("smollm2-135m", dtype="bfloat16")[0]
            quantize_(m, config)
            return m
        return make

    # torchao 0.18's int4 weight-only packing formats target CUDA/XPU kernels: there is no CPU one to compare with
    return {"torchao int8 weight-only": (build(Int8WeightOnlyConfig()), False)}, (
        "torchao ran beside minillm (int8 weight-only; its int4 packing formats in 0.18 are GPU-only)")


def kv_int8_capacity(quick: bool) -> tuple[list[dict], dict]:
    """The engine with a bf16 KV pool vs an int8 one, in the same byte budget: blocks, peak sequences (sequences
    admitted), tok/s."""
    from minillm.api import load_model
    from minillm.engine.llm import LLM
    from minillm.sampling import SamplingParams

    # the model computes in float32 (on a CPU without bf16 instructions bf16 GEMMs crawl); the pools *store* bf16 or
    # int8 keys/values: the bytes the comparison is about
    model, tok = load_model("smollm2-135m", dtype="float32")
    n_req, prompt_len, n_new = (4, 16, 4) if quick else (32, 64, 64)
    float_kv = "bf16 KV"
    per_token = 2 * len(model.layers) * model.config.n_kv_heads * model.config.head_dim * 2  # bf16 bytes per token
    budget = (n_req // 3) * (prompt_len + n_new + 16) * per_token  # room for ~a third of the requests in bf16
    prompts = [tok.encode(f"Request {i}: the history of the printing press " * 8)[:prompt_len] for i in range(n_req)]
    rows, out = [], {}
    for name, kv in ((float_kv, "bfloat16"), ("int8 KV", "int8")):
        llm = LLM.from_model(model, tok, kv_cache_bytes=budget, max_num_seqs=n_req, kv_cache_dtype=kv)
        with timer() as t:
            results = llm.generate(prompts, SamplingParams(max_tokens=n_new, ignore_eos=True))
        dt = t.seconds
        peak = max(s["num_seqs"] for s in llm.step_log)
        out[name] = (llm.block_manager.num_blocks, peak, sum(len(r.token_ids) for r in results) / dt,
                     [r.token_ids for r in results])
        rows.append({"variant": f"engine, {name}", "kv_blocks": out[name][0], "peak_running_seqs": peak,
                     "engine_tok_s": out[name][2]})
    f = float_kv.split()[0]
    same = sum(a == b for a, b in zip(out[float_kv][3], out["int8 KV"][3])) / n_req
    return rows, {f"int8_kv_blocks_vs_{f}": out["int8 KV"][0] / out[float_kv][0],
                  f"int8_kv_peak_seqs_vs_{f}": out["int8 KV"][1] / out[float_kv][1],
                  f"int8_kv_throughput_vs_{f}": out["int8 KV"][2] / out[float_kv][2],
                  "int8_kv_requests_same_greedy_tokens": same}


def run(quick: bool = False) -> BenchResult:
    """The variants' table, then the int8 KV cache and torchao (when installed), then bench lowbit's parts
    (minillm/bench/lowbit.py): the CPU low-bit kernels against torch's and llama.cpp's (llama-cpp-python, an
    optional extra) at 1 and 2 threads, the verify / 16-row step, and the engine with q4 weights."""
    from minillm.model import model_bytes
    from minillm.compress.quality import calibration_ids

    eval_len, window, n_new, repeat = (64, 64, 8, 1) if quick else (512, 256, 64, 3)
    ref, tok, ids, chunks, ref_logits = reference(eval_len, window)
    ref_greedy = None
    prompt = tok.encode("The history of the printing press begins with " * 8)[:32]
    calib = calibration_ids(tok, 128 if quick else 512)
    todo = variants(quick, calib)
    peers, peer_note = torchao_variants() if not quick else ({}, "peers skipped in quick mode")
    todo.update(peers)
    rows, models = [], {}
    for name, (build, quality_only) in todo.items():
        model = build()
        try:
            mb = model_bytes(model) / 1e6
        except RuntimeError:  # a peer's tensor subclass hides its storage
            mb = float("nan")
        if quality_only:  # stored in float: the bytes its packed format would take, computed
            mb = packed_3bit_bytes(model, group_size=64) / 1e6
        row = {"variant": name, "weight_MB": mb, **quality(model, ref_logits, chunks)}
        if quality_only:
            row["size"] = "computed: 3-bit g64 packed, embedding bf16"
        if not quality_only:
            row["prefill_tok_s"] = prefill_tok_s(model, ids[:128], min(repeat, 2))
            models[name] = model
        rows.append(row)
    speed = {name: [] for name in models}
    for _ in range(repeat):  # round-robin: a noisy neighbour slows every variant, not one
        for name, model in models.items():
            tps, greedy = decode_tok_s(model, prompt, n_new, 1)
            speed[name].append(tps)
            if name.startswith("fp32"):
                ref_greedy = greedy
            elif ref_greedy is not None:
                row = next(r for r in rows if r["variant"] == name)
                row["greedy_same_as_fp32"] = sum(a == b for a, b in zip(greedy, ref_greedy)) / len(ref_greedy)
    for row in rows:
        if row["variant"] in speed:
            row["decode_tok_s"] = max(speed[row["variant"]])
    del models
    by = {r["variant"]: r for r in rows}
    base = by.get("bf16", by["fp32 (reference)"])  # what the quantized kernels replace (fp32 in quick mode)
    vs = "bf16" if "bf16" in by else "fp32"
    ratios = {
        f"int8_decode_vs_{vs}": by["int8 weight-only"]["decode_tok_s"] / base["decode_tok_s"],
        "int8_ppl_over_reference": by["int8 weight-only"]["ppl"] / by["fp32 (reference)"]["ppl"],
        "int4_g64_awq_ppl_over_rtn": by["int4 g64 AWQ"]["ppl"] / by["int4 g64 RTN"]["ppl"],
        "int4_g64_decode_vs_int8": by["int4 g64 RTN"]["decode_tok_s"] / by["int8 weight-only"]["decode_tok_s"],
        f"int8_bytes_vs_{vs}": by["int8 weight-only"]["weight_MB"] / base["weight_MB"],
    }
    targets = {f"int8_decode_vs_{vs}": (">=", 1.5), "int8_ppl_over_reference": ("<=", 1.01),
               "int4_g64_awq_ppl_over_rtn": ("<", 1.0)}
    if "bf16" in by:
        ratios["bf16_kl_to_reference"] = by["bf16"]["kl"]
    if "Q4_1 from the file" in by:
        q4 = by["Q4_1 from the file"]
        ratios["q4_file_decode_vs_bf16"] = q4["decode_tok_s"] / base["decode_tok_s"]
        ratios["q4_file_kl_to_reference"] = q4["kl"]
        targets["q4_file_decode_vs_bf16"] = (">=", 2.2)
    if "3-bit g64 AWQ" in by:
        ratios["3bit_g64_awq_ppl_over_rtn"] = by["3-bit g64 AWQ"]["ppl"] / by["3-bit g64 RTN"]["ppl"]
        targets["3bit_g64_awq_ppl_over_rtn"] = ("<", 1.0)
    kv_rows, kv_ratios = kv_int8_capacity(quick)
    rows += kv_rows
    ratios.update(kv_ratios)
    targets[next(k for k in kv_ratios if k.startswith("int8_kv_peak_seqs"))] = (">=", 1.9)
    from minillm.bench import lowbit

    notes = [f"bf16 on this CPU: {bf16_status('cpu')}",
             "the reference is the fp32 model dequantized from the file's Q4_1 weights",
             "groups of 128 do not divide the model's 576-wide inputs: g64 stands in for the paper's g128",
             ("int8/int4 rows (RTN and AWQ) quantize every Linear and the tied embedding/LM head; 'Q4_1 from the "
              "file' keeps the file's Q8_0 embedding/LM head; 3-bit rows keep it in float, and their weight_MB is "
              "computed for packed 3-bit codes + fp16 scale and minimum per 64 weights, the embedding in bf16"),
             "int8/int4 g32 matmuls run minillm's CPU kernels (int8 activations per block of 32); int4 g64 runs "
             "torch's int4 kernel (bf16 activations)",
             peer_note]
    more_rows, more_ratios, more_targets, more_notes = lowbit.parts(quick)
    rows += more_rows
    ratios.update(more_ratios)
    targets.update(more_targets)
    notes += more_notes
    return BenchResult(name="quant", rows=rows, ratios=ratios, targets=targets,
                       settings={"eval_tokens": eval_len, "window": window, "new_tokens": n_new, "repeat": repeat,
                                 "threads": torch.get_num_threads(), "calibration_tokens": len(calib)},
                       notes=notes)

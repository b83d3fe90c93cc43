"""Benchmark "kv-cache" (lesson 01): what the KV cache buys, and how close cached decode gets to the hardware.

1. No cache vs contiguous cache: greedy batch-1 decode after a 32-token prompt, identical tokens checked.
2. minillm vs transformers' `generate` on the same GGUF weights, float32 and bfloat16 (full mode only).
3. Decode MBU at batch 1, beside it the same figure for bare matmuls over the model's weights: the ceiling
   torch's kernels allow on this machine.
"""

from __future__ import annotations

import torch

from minillm.measure.hardware import hardware_info
from minillm.measure.harness import BenchResult, time_fn
from minillm.measure.metrics import decode_bytes_per_token, decode_rate, mbu, timed_decode, timer, weight_bytes

PROMPT_LEN = 32


def prompt_ids(tokenizer, n: int = PROMPT_LEN) -> list[int]:
    """A fixed n-token prompt: the start of the pydoc topics text (real English, not random ids)."""
    from minillm.compress.quality import eval_ids

    return eval_ids(tokenizer, n)


def hf_model(dtype: torch.dtype):
    from minillm.measure.peers import import_transformers

    from minillm.gguf.weights import gguf_path

    transformers = import_transformers()

    transformers.logging.set_verbosity_error()
    path = gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_decode(model, ids: list[int], n_new: int) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    with timer() as t:
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist(), t.seconds


@torch.inference_mode()
def matmul_bytes_per_s(model, repeat: int = 5) -> float:
    """Bytes/s of just the decode step's matrix-vector products: every nn.Linear of the model applied to one token
    (the LM head included). The ceiling the model's own MBU can reach with torch's kernels on this machine."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(1, m.in_features, dtype=model.dtype, device=model.device) for m in linears}
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    t = time_fn(lambda: [m(inputs[m.in_features]) for m in linears], warmup=1, repeat=repeat)
    return total / t.median


def mbu_rows(model, ids: list[int], n_new: int, bandwidth: float) -> tuple[dict, float]:
    """Cached decode of n_new tokens: a table row with tok/s, bytes/token, roof and MBU; and the MBU."""
    spt = 1 / decode_rate(timed_decode(model, ids, n_new).token_times, median=True)
    bytes_per_token = decode_bytes_per_token(model, PROMPT_LEN + n_new // 2)  # K/V read at mid-generation
    achieved = mbu(bytes_per_token, spt, bandwidth)
    dtype = str(model.dtype).replace("torch.", "")
    row = {"case": f"MBU {dtype} KV cache", "new_tokens": n_new, "decode_tok_s": 1 / spt,
           "weight_MB": weight_bytes(model) / 1e6, "bytes_per_token_MB": bytes_per_token / 1e6,
           "roof_tok_s": bandwidth / bytes_per_token, "mbu": achieved,
           "matmul_only_mbu": matmul_bytes_per_s(model) / bandwidth}
    return row, achieved


def run(quick: bool = False) -> BenchResult:
    from minillm.api import load_model

    n_new = 32 if quick else 256
    n_peer = 32 if quick else 128
    rows, ratios, targets, notes = [], {}, {}, []
    bandwidth = hardware_info("cpu")["bandwidth_GBps"] * 1e9

    for dtype_name in ("float32", "bfloat16"):
        model, tok = load_model("smollm2-135m", dtype=dtype_name, device="cpu")
        ids = prompt_ids(tok)
        timed_decode(model, ids, 4, "contiguous")  # warm up (first calls allocate)

        if dtype_name == "float32":
            # 1. no cache vs cache, in float32 where both paths give the same tokens (in bfloat16 they round
            # differently, and a near-tie between two tokens can flip: same speed story, different text)
            timed_decode(model, ids, 4, "none")
            runs = {}
            for cache in ("none", "contiguous"):
                out = timed_decode(model, ids, n_new, cache)
                runs[cache], times = out.token_ids, out.token_times
                rows.append({"case": f"{'no cache' if cache == 'none' else 'KV cache'} float32", "new_tokens": n_new,
                             "ttft_ms": times[0] * 1e3, "decode_s": times[-1] - times[0],
                             "decode_tok_s": decode_rate(times),
                             "last_token_ms": (times[-1] - times[-2]) * 1e3})
            ratios["cached_vs_uncached_speedup"] = rows[0]["decode_s"] / rows[1]["decode_s"]
            targets["cached_vs_uncached_speedup"] = (">=", 5.0)
            ratios["cached_tokens_identical"] = float(runs["none"] == runs["contiguous"])
            targets["cached_tokens_identical"] = (">=", 1.0)

        # 3. MBU of cached decode at batch 1
        row, achieved = mbu_rows(model, ids, n_peer, bandwidth)
        rows.append(row)
        ratios[f"decode_mbu_{dtype_name}"] = achieved
        if dtype_name == "bfloat16":
            targets["decode_mbu_bfloat16"] = (">=", 0.60)

        # 2. minillm vs transformers on the same weights, same dtype
        if not quick:
            theirs = hf_model(model.dtype)
            hf_decode(theirs, ids, 8)  # warm-up
            ours = timed_decode(model, ids, n_peer)
            our_tokens, times = ours.token_ids, ours.token_times
            their_tokens, their_s = hf_decode(theirs, ids, n_peer)
            ours_tps, theirs_tps = n_peer / times[-1], n_peer / their_s
            same = sum(a == b for a, b in zip(our_tokens, their_tokens)) / n_peer
            rows.append({"case": f"minillm {dtype_name}", "new_tokens": n_peer, "tok_s_incl_prefill": ours_tps,
                         "same_tokens_as_hf": same})
            rows.append({"case": f"transformers {dtype_name}", "new_tokens": n_peer, "tok_s_incl_prefill": theirs_tps})
            ratios[f"minillm_vs_hf_{dtype_name}"] = ours_tps / theirs_tps
            targets[f"minillm_vs_hf_{dtype_name}"] = (">=", 1.0)
            del theirs
        del model

    if quick:
        notes.append("quick mode skips the transformers comparison (loading its copy of the model takes ~10-30 s)")
    notes += [
        "one run per side, measured back to back: on a shared machine read the ratios, not the absolute tok/s",
        ("no-cache decode recomputes the whole sequence every step (work grows with position); the cache keeps "
         "per-token work ~constant, so the speedup grows with the number of new tokens"),
        ("MBU = (all weights + K/V at mid-generation context) / time per token / measured copy bandwidth; "
         "'roof_tok_s' is the speed at 100%; 'matmul_only_mbu' is the same for the bare batch-1 matmuls of the "
         "model's weights (torch's own kernels, no model code): the ceiling for this dtype on this machine"),
        ("bfloat16 matrix-vector products on this CPU reach a lower fraction of the bandwidth than float32 ones; and "
         "with more threads than free cores they slow down many-fold (oneDNN threads spin-wait): time on an idle "
         "machine or with one thread per free core"),
        ("same_tokens_as_hf: in bfloat16 the two implementations round differently, so greedy texts part ways "
         "after a near-tie; in float32 they agree"),
    ]
    settings = {"prompt_tokens": PROMPT_LEN, "new_tokens": n_new, "peer_new_tokens": n_peer, "batch": 1,
                "greedy": True, "threads": torch.get_num_threads(), "device": "cpu"}
    return BenchResult(name="kv-cache", rows=rows, ratios=ratios, targets=targets, settings=settings, notes=notes)

"""`minillm bench lowbit` (lesson 07; also part of `bench quant`): the CPU low-bit kernels against what they replace.

Batch-1 decode reads every weight once per token, so its roof is bytes per token over memory bandwidth. Side by side
in one process, at 1 and 2 threads (round-robin, best of `repeat`): minillm fp32, bf16, int8 and the file's Q4_1
(our kernels; torch's int4/int8 kernels; fused; the native step), and llama.cpp on the same file where installed.
Then what the kernels change beyond batch 1: a q4 forward of q new tokens (the speculative verify of q-1 drafts, a
16-row step) against a decode step, and the engine's continuous batching with q4 weights beside bf16.
"""

from __future__ import annotations

import contextlib
import time

import torch

from minillm.measure.harness import BenchResult
from minillm.measure.metrics import decode_rate

PROMPT = "The history of the printing press begins with " * 4


def _llama_cpp(threads: int):
    """A greedy decode function on llama.cpp with `threads`, or None and why."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        return None, (f"llama.cpp not run: llama-cpp-python is not installed ({e.name}); it is an optional extra that "
                      "compiles from source for minutes (see FACTS.md for the AMX-off build flags)")
    from minillm.gguf.weights import gguf_path

    llm = Llama(model_path=str(gguf_path("smollm2-135m")), n_threads=threads, n_threads_batch=threads, n_ctx=512,
                verbose=False)

    def decode(ids: list[int], n_new: int) -> tuple[float, list[int]]:
        llm.reset()
        times, out = [], []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, temp=0.0, reset=True):
            times.append(time.perf_counter() - t0)
            out.append(tok)
            if len(out) == n_new:
                break
        return decode_rate(times), out

    return decode, f"llama.cpp {llm_version()} ran beside minillm on the same GGUF file (greedy, same prompt ids)"


def llm_version() -> str:
    try:
        import llama_cpp

        return getattr(llama_cpp, "__version__", "?")
    except ImportError:
        return "absent"


def _minillm_decoder(model, disabled: bool):
    from minillm.api import generate
    from minillm.compress.quant import cpu_kernels_disabled

    def decode(ids: list[int], n_new: int) -> tuple[float, list[int]]:
        with cpu_kernels_disabled() if disabled else contextlib.nullcontext():
            out = generate(model, None, ids, max_new_tokens=n_new, ignore_eos=True)
        return decode_rate(out.token_times), out.token_ids

    return decode


def decoders(quick: bool) -> dict:
    """name -> (decode function, weight bytes read per token)."""
    from minillm.api import load_model
    from minillm.compress.quant import cpu_kernels_disabled
    from minillm.compress.quantize import quantize
    from minillm.model import model_bytes

    out = {}

    def add(name, model, disabled=False):
        out[name] = (_minillm_decoder(model, disabled), model_bytes(model))

    add("fp32", load_model(dtype="float32")[0])
    if not quick:
        add("bf16", load_model(dtype="bfloat16")[0])
        add("int8 (minillm kernels)", quantize(load_model(dtype="bfloat16")[0], "int8"))
        with cpu_kernels_disabled():  # loaded there: the head stays float, as where our kernels cannot build
            add("q4 (torch int4 kernel)", load_model(dtype="float32", weights="q4")[0], disabled=True)
    add("q4 (minillm kernels)", load_model(dtype="float32", weights="q4")[0])
    if not quick:
        add("q4 fused (minillm kernels)", load_model(dtype="float32", weights="q4", fuse=True)[0])
    add("q4 native step", load_model(dtype="float32", weights="q4", native=True)[0])
    return out


def decode_rows(quick: bool, threads: list[int], n_new: int, repeat: int) -> tuple[list[dict], dict, list[str]]:
    from minillm.measure.hardware import bandwidth
    from minillm.gguf.tokenizer import Tokenizer
    from minillm.gguf.weights import gguf_path, read_gguf_metadata

    ids = Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf_path("smollm2-135m"))).encode(PROMPT)[:32]
    ours = decoders(quick)
    bw = bandwidth("cpu")
    rows, ratios, notes = [], {}, []
    old_threads = torch.get_num_threads()
    try:
        for th in threads:
            torch.set_num_threads(th)
            todo = dict(ours)
            peer, note = (None, "llama.cpp skipped in quick mode") if quick else _llama_cpp(th)
            if note not in notes:
                notes.append(note)
            if peer is not None:
                todo["llama.cpp Q4_1"] = (peer, None)
            best = {name: 0.0 for name in todo}
            tokens = {}
            for name, (decode, _) in todo.items():
                decode(ids, 4)  # warm-up (and the kernels' repack on first call)
            for _ in range(repeat):  # round-robin: a noisy neighbour slows every variant, not one
                for name, (decode, _) in todo.items():
                    rate, out = decode(ids, n_new)
                    best[name] = max(best[name], rate)
                    tokens.setdefault(name, out)
            ref = tokens["fp32"]
            for name, (_, nbytes) in todo.items():
                row = {"variant": name, "threads": th, "decode_tok_s": best[name],
                       "greedy_same_as_fp32": sum(a == b for a, b in zip(tokens[name], ref)) / len(ref)}
                if nbytes:
                    row["weight_MB"] = nbytes / 1e6
                    row["roofline_tok_s"] = bw / nbytes
                    row["of_roofline"] = best[name] / row["roofline_tok_s"]
                rows.append(row)
            q4 = best["q4 (minillm kernels)"]
            if "bf16" in best:
                ratios[f"q4_vs_bf16_{th}t"] = q4 / best["bf16"]
                ratios[f"q4_fused_vs_bf16_{th}t"] = best["q4 fused (minillm kernels)"] / best["bf16"]
                ratios[f"int8_vs_bf16_{th}t"] = best["int8 (minillm kernels)"] / best["bf16"]
                ratios[f"bf16_vs_fp32_{th}t"] = best["bf16"] / best["fp32"]
                ratios[f"q4_kernels_vs_torch_int4_{th}t"] = q4 / best["q4 (torch int4 kernel)"]
            else:
                ratios[f"q4_vs_fp32_{th}t"] = q4 / best["fp32"]
            ratios[f"q4_native_vs_eager_{th}t"] = best["q4 native step"] / q4
            if "llama.cpp Q4_1" in best:
                ratios[f"q4_vs_llama_cpp_{th}t"] = q4 / best["llama.cpp Q4_1"]
                ratios[f"q4_fused_vs_llama_cpp_{th}t"] = best["q4 fused (minillm kernels)"] / best["llama.cpp Q4_1"]
                ratios[f"q4_native_vs_llama_cpp_{th}t"] = best["q4 native step"] / best["llama.cpp Q4_1"]
    finally:
        torch.set_num_threads(old_threads)
    notes.append(f"roofline = {bw / 1e9:.1f} GB/s (this machine's copy probe) / weight bytes per token")
    return rows, ratios, notes


def row_scaling(quick: bool) -> tuple[list[dict], dict]:
    """A q4 forward of q new tokens after 128 cached ones, vs q = 1 (a decode step): the verify of q - 1 drafts."""
    from minillm.api import load_model
    from minillm.bench.speculative import verify_cost

    q_lens = [1, 5, 16] if quick else [1, 2, 3, 5, 9, 16]
    out = {}
    for name, kw in (("bf16", dict(dtype="bfloat16")), ("q4", dict(dtype="float32", weights="q4")),
                     ("q4 native", dict(dtype="float32", weights="q4", native=True))):
        if quick and name == "bf16":
            continue
        out[name] = verify_cost(load_model(**kw)[0], q_lens)
    rows = [{"variant": f"{name} forward of {c['q_tokens']} tokens", "forward_ms": c["forward_ms"],
             "vs_decode_step": c["vs_decode"]} for name, cost in out.items() for c in cost]
    q4 = {c["q_tokens"]: c["vs_decode"] for c in out["q4"]}
    native = {c["q_tokens"]: c["vs_decode"] for c in out["q4 native"]}
    ratios = {"q4_verify_k4_vs_decode": q4[5], "q4_16_rows_vs_1_row": q4[16],
              "q4_native_verify_k4_vs_decode": native[5], "q4_native_16_rows_vs_1_row": native[16],
              "q4_native_decode_step_vs_eager": out["q4"][0]["forward_ms"] / out["q4 native"][0]["forward_ms"]}
    if "bf16" in out:
        bf = {c["q_tokens"]: c["vs_decode"] for c in out["bf16"]}
        ratios.update({"bf16_verify_k4_vs_decode": bf[5], "bf16_16_rows_vs_1_row": bf[16]})
    return rows, ratios


def engine_rows(quick: bool) -> tuple[list[dict], dict]:
    """Continuous batching (lesson 05's engine), 8 requests at once: q4 weights beside bf16."""
    from minillm.api import load_model
    from minillm.engine import LLM
    from minillm.sampling import SamplingParams

    n_req, n_new = (2, 4) if quick else (8, 32)
    rows, tps = [], {}
    for name, kw in (("bf16", dict(dtype="bfloat16")), ("q4", dict(dtype="float32", weights="q4")),
                     ("q4 native", dict(dtype="float32", weights="q4", native=True))):
        model, tok = load_model(**kw)
        prompts = [tok.encode(f"Request {i}: the history of the printing press") for i in range(n_req)]
        llm = LLM.from_model(model, tok, max_num_seqs=n_req)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n_new, ignore_eos=True))
        tps[name] = n_req * n_new / (time.perf_counter() - t0)
        rows.append({"variant": f"continuous batching {name}, {n_req} requests", "engine_tok_s": tps[name]})
    return rows, {"engine_q4_vs_bf16": tps["q4"] / tps["bf16"], "engine_q4_native_vs_q4": tps["q4 native"] / tps["q4"]}


TARGETS = {"q4_vs_bf16_1t": (">=", 2.5), "q4_vs_bf16_2t": (">=", 2.5), "q4_vs_llama_cpp_1t": (">=", 0.85),
           "q4_vs_llama_cpp_2t": (">=", 0.85), "int8_vs_bf16_1t": (">=", 1.6), "int8_vs_bf16_2t": (">=", 1.6),
           "q4_16_rows_vs_1_row": ("<=", 2.0), "q4_verify_k4_vs_decode": ("<=", 1.2),
           # the native step (issue 39): one C++ call per step removes the per-op cost the eager rows pay
           "q4_native_vs_llama_cpp_1t": (">=", 1.2), "q4_native_vs_llama_cpp_2t": (">=", 1.0),
           "q4_native_verify_k4_vs_decode": ("<=", 1.1), "q4_native_16_rows_vs_1_row": ("<=", 1.5)}


def parts(quick: bool) -> tuple[list[dict], dict, dict, list[str]]:
    """rows, ratios, targets, notes of every part (bench quant merges them into its own result)."""
    from minillm.measure.hardware import native_bf16
    from minillm_kernels import cpu_lowbit

    cpu_lowbit.load()
    notes = [f"CPU low-bit kernels: {cpu_lowbit.status()}"]
    threads = [1] if quick else [1, 2]
    rows, ratios, decode_notes = decode_rows(quick, threads, 8 if quick else 96, 1 if quick else 3)
    notes += decode_notes
    more, r = row_scaling(quick)
    rows += more
    ratios.update(r)
    if not quick:
        more, r = engine_rows(quick)
        rows += more
        ratios.update(r)
    targets = {k: v for k, v in TARGETS.items() if k in ratios}
    if native_bf16("cpu"):
        for th in threads:
            if f"bf16_vs_fp32_{th}t" in ratios:
                targets[f"bf16_vs_fp32_{th}t"] = (">=", 1.0)
    return rows, ratios, targets, notes


def run(quick: bool = False) -> BenchResult:
    rows, ratios, targets, notes = parts(quick)
    return BenchResult(name="lowbit", rows=rows, ratios=ratios, targets=targets, notes=notes,
                       settings={"threads": [1] if quick else [1, 2], "prompt_tokens": 32,
                                 "new_tokens": 8 if quick else 96})

"""Benchmark "edge" (lesson 14): the smallest configuration that still serves, and what it costs in a fresh process.

The ladder (`minillm bench ladder`) stacks techniques for throughput; an edge device asks the other question, how
little memory and how few cores can still answer (EDGE_PROFILE). The lesson: a process's memory is not its weights.
Each configuration runs in a fresh Python process, so its peak RSS is that configuration's alone: torch and the
imports (the "floor" row), then the weights, the KV cache and the activations on top. What each profile measures and
what results/edge.json holds: `run`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

from minillm.measure.harness import BenchResult

# One thread, the file's 4-bit weights kept packed (q4, fused), an int8 KV cache in a paged pool that holds one
# context of at most 512 tokens; `minillm generate --profile edge` applies it too.
EDGE_PROFILE = {"threads": 1, "weights": "q4", "fuse": True, "native": "auto", "kv_cache_dtype": "int8",
                "cache": "paged", "max_context": 512}
DEFAULT_PROFILE = {"threads": 1, "weights": "dequantized", "fuse": False, "native": False, "kv_cache_dtype": None,
                   "cache": "contiguous", "max_context": None}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MARK = "EDGE_RESULT "
MiB = 2**20

# One profile in a fresh process. Imports come after the clock starts: they are part of what an edge device pays.
_CHILD = r"""
import json, pathlib, resource, sys, time
t_start = time.perf_counter()
spec = json.loads(sys.argv[1])
# the interpreter's own start, before this line: perf_counter is the system's monotonic clock, the parent's too
out = {"startup_s": t_start - spec["launched_at"]} if spec.get("launched_at") is not None else {}

def status(key):  # Linux: this process's own VmHWM (peak RSS) / VmRSS, in bytes; None elsewhere
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration):
        return None

def rss_now():  # /proc first: importing psutil to read it would add ~0.8 MiB to the RSS it reads
    rss = status("VmRSS")
    if rss is None:
        try:
            import psutil
            rss = psutil.Process().memory_info().rss
        except ImportError:
            pass
    return rss

def memory(out, prefix):
    out[prefix + "peak_rss"] = status("VmHWM")
    out[prefix + "ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin"
                                                                                       else 1024)
    out[prefix + "rss"] = rss_now()

def trimmed_rss():  # what the RSS falls to once glibc hands back the memory the load freed
    import ctypes, gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return rss_now()

ref = spec["reference_ids"]
if spec["kind"] == "llama.cpp":
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["path"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_ctx=spec["max_context"], verbose=False)
    out["load_s"], out["ready_s"] = time.perf_counter() - t0, time.perf_counter() - t_start
    memory(out, "loaded_")
    ids, times = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(spec["prompt_ids"], temp=0.0, reset=True):
        times.append(time.perf_counter() - t0)
        ids.append(int(tok))
        if len(ids) == spec["n_new"]:
            break
    out.update(token_ids=ids, token_times=times, weights_bytes=None, kv_bytes=None)
    memory(out, "")
    if ref:  # teacher-forced: the argmax after each of the reference's tokens (the last token's logits, private API)
        import numpy as np
        try:
            llm.reset()
            guesses = []
            for i, t in enumerate(spec["prompt_ids"] + ref[:-1]):
                llm.eval([t])
                if i >= len(spec["prompt_ids"]) - 1:
                    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                    guesses.append(int(logits.argmax()))
            out["forced_ids"] = guesses
        except Exception as e:  # an API that moved: the free-running agreement still stands
            out["forced_error"] = f"{type(e).__name__}: {e}"
else:
    import torch
    torch.set_num_threads(spec["threads"])
    if spec["kind"] != "torch":
        from minillm.api import generate, load_model, make_cache
        from minillm.model import model_bytes
    if spec["kind"] in ("floor", "torch"):  # imports only, no model: what every profile pays first
        out.update(load_s=0.0, ready_s=time.perf_counter() - t_start, token_ids=[], token_times=[],
                   weights_bytes=0, kv_bytes=0)
        memory(out, "loaded_")
        memory(out, "")
    else:
        gguf = pathlib.Path(spec["path"])  # is the converted q4 layout beside the file (minillm.gguf.converted)?
        if spec["weights"] == "q4" and spec.get("env", {}).get("MINILLM_CONVERTED_CACHE") != "off":
            out["converted_cached"] = any(gguf.parent.glob(gguf.name + ".kernels-*.pt.json"))
        t0 = time.perf_counter()
        model, tok = load_model("smollm2-135m", weights=spec["weights"], fuse=spec["fuse"], native=spec["native"],
                                max_context=spec["max_context"])
        out["load_s"], out["ready_s"] = time.perf_counter() - t0, time.perf_counter() - t_start
        memory(out, "loaded_")
        res = generate(model, None, spec["prompt_ids"], max_new_tokens=spec["n_new"], cache=spec["cache"],
                       kv_cache_dtype=spec["kv_cache_dtype"], ignore_eos=True)
        # the CPU kernels' repacked layout of a 4-bit/8-bit layer, built at its first call: a second copy beside the
        # stored codes (model_bytes counts only those), unless the layer keeps that layout alone (Int4Linear's
        # keep_kernel_layout_only: then it is the weights, counted once)
        packed = [m._packed[1] for m in model.modules() if getattr(m, "_packed", None) is not None
                  and m._packed[1] is not m._buffers.get("kernel_weight")]
        out.update(token_ids=res.token_ids, token_times=res.token_times, weights_bytes=model_bytes(model),
                   packed_bytes=sum(p.numel() * p.element_size() for p in packed))
        memory(out, "")
        # after the RSS was read: these allocate
        kv_dtype = torch.int8 if spec["kv_cache_dtype"] == "int8" else None
        ids = spec["prompt_ids"] + (ref or res.token_ids)
        cache = make_cache(spec["cache"], model, len(ids), kv_dtype=kv_dtype)
        out["kv_bytes"] = cache.nbytes()
        if ref:  # teacher-forced through the profile's own cache: no divergence can cascade
            with torch.inference_mode():
                logits = model(torch.tensor([ids]), kv_cache=cache)[0, len(spec["prompt_ids"]) - 1:-1]
            out["forced_ids"] = logits.argmax(-1).tolist()
        if spec["ppl_tokens"]:
            from minillm.compress.quality import perplexity
            out["ppl"] = perplexity(model, tok, max_tokens=spec["ppl_tokens"])
out["trimmed_rss"] = trimmed_rss()
print("EDGE_RESULT " + json.dumps(out), flush=True)
"""


def parse_child_output(stdout: str) -> dict:
    """The result dict a child printed on its last EDGE_RESULT line (anything else it printed is ignored)."""
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise ValueError(f"the child printed no {MARK.strip()} line; its output ends: {stdout[-500:]!r}")
    return json.loads(lines[-1][len(MARK):])


def run_child(spec: dict, timeout: float = 600) -> tuple[dict | None, str | None]:
    """Run one profile in a fresh process: (result, None), or (None, why it did not run)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
               **spec.get("env", {}))
    spec = {**spec, "launched_at": time.perf_counter()}
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], check=False, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        if proc.returncode < 0:
            import signal

            return None, f"killed by {signal.Signals(-proc.returncode).name} ({tail or 'no message'})"
        return None, f"exit status {proc.returncode}: {tail}"
    return parse_child_output(proc.stdout), None


def own_peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM on Linux (its own), else getrusage's ru_maxrss (which Linux carries
    across exec from the parent)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        from minillm.measure.metrics import peak_memory

        return peak_memory("cpu")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal over their common length)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def profile_row(name: str, config: str, res: dict, reference: list[int] | None) -> dict:
    """One table row from a child's result; quality against the reference (the float32 default's tokens)."""
    from minillm.measure.metrics import decode_rate

    def mib(key):
        return res[key] / MiB if res.get(key) is not None else None

    row = {"profile": name, "config": config, "startup_s": res.get("startup_s"), "load_s": res["load_s"],
           "ready_s": res["ready_s"],
           "peak_rss_MiB": mib("peak_rss"), "loaded_rss_MiB": mib("loaded_rss"), "end_rss_MiB": mib("rss"),
           "trimmed_rss_MiB": mib("trimmed_rss"), "ru_maxrss_MiB": mib("ru_maxrss"),
           "weights_MiB": mib("weights_bytes"), "kernel_copy_MiB": mib("packed_bytes"), "kv_MiB": mib("kv_bytes")}
    ids, times = res["token_ids"], res["token_times"]
    if "converted_cached" in res:
        row["converted_cached"] = res["converted_cached"]
    if ids:
        row["ttft_ms"] = times[0] * 1e3
        # from the process's start: the interpreter, imports, load, prefill
        row["first_token_s"] = res.get("startup_s", 0.0) + res["ready_s"] + times[0]
        row["decode_tok_s"] = decode_rate(times)
    if ids and reference is not None:
        n = min(len(ids), len(reference))
        row["agree_fp32"] = sum(a == b for a, b in zip(ids, reference)) / n
        row["first_diff"] = first_difference(ids, reference)
        forced = res.get("forced_ids")
        if forced:
            row["forced_agree_fp32"] = sum(a == b for a, b in zip(forced, reference)) / len(reference)
    if res.get("ppl") is not None:
        row["ppl"] = res["ppl"]
    return row


def run(quick: bool = False) -> BenchResult:
    """Each profile in a fresh process, the float32 default first (every other row's quality reference).

    Per profile: load time (load_model, after the imports), ready time (imports + load), the RSS (peak, after
    loading, at the end, after glibc returns freed memory), TTFT and decode tokens/s of a greedy generation of n_new
    tokens from one chat prompt, and quality against the float32 default: free-running token agreement, where it
    first differs, and teacher-forced top-1 agreement; perplexity in full mode (measured after the RSS). Beside it,
    llama.cpp (llama-cpp-python, optional) on the same GGUF file with the same thread count, prompt ids and token
    count; a missing or crashing llama.cpp (FACTS: AMX builds die with SIGILL on some VMs) is a stated skip. A trap
    measured here: the peak RSS of a child is its VmHWM, not getrusage's ru_maxrss, which Linux carries over from the
    parent across fork + exec.

    results/edge.json: rows (profile, config, startup_s (the interpreter's own start), load_s, ready_s,
    peak_rss_MiB, loaded_rss_MiB, end_rss_MiB, trimmed_rss_MiB, ru_maxrss_MiB, weights_MiB, kernel_copy_MiB (the CPU
    kernels' repacked weights), kv_MiB, ttft_ms, first_token_s (from the child's start: the interpreter, imports,
    load, prefill), decode_tok_s, agree_fp32, first_diff, forced_agree_fp32, ppl, converted_cached (the q4 layout was
    mapped from beside the file); a skipped profile has a "skipped" reason instead), ratios (edge_peak_rss_vs_fp32,
    edge_decode_vs_fp32, edge_peak_rss_vs_llama_cpp, edge_decode_vs_llama_cpp; edge_load_s, edge_first_token_s,
    edge_peak_rss_MiB against issue 39's goals), settings, notes.
    """
    from minillm.gguf.tokenizer import Tokenizer
    from minillm.gguf.weights import gguf_path, read_gguf_metadata

    n_new, ppl_tokens = (16, 0) if quick else (128, 512)
    path = gguf_path()
    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    prompt_ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    threads = EDGE_PROFILE["threads"]
    base = {"prompt_ids": prompt_ids, "n_new": n_new, "ppl_tokens": ppl_tokens, "path": str(path)}
    profiles = [  # the float32 default first: it is every other row's quality reference
        ("fp32 default", "fp32 weights, contiguous fp32 KV", "minillm", DEFAULT_PROFILE),
        ("edge", "q4 native step, paged int8 KV", "minillm", EDGE_PROFILE),
        # the same, converting the file's blocks at load (the converted layout beside the file switched off)
        ("edge, converting", "edge, MINILLM_CONVERTED_CACHE=off", "minillm",
         {**EDGE_PROFILE, "env": {"MINILLM_CONVERTED_CACHE": "off"}}),
        ("llama.cpp", "llama-cpp-python, same GGUF", "llama.cpp",
         {"threads": threads, "max_context": EDGE_PROFILE["max_context"]}),
        ("floor", "import minillm.api, no model", "floor", {"threads": threads}),
        ("torch floor", "import torch alone", "torch", {"threads": threads}),
    ]
    rows, notes, reference, results = [], [], None, {}
    # the edge row reads the converted q4 layout beside the file, as every load after the first does: written here
    # if it is not there yet (the "edge, converting" row pays the conversion instead)
    from minillm.api import load_model

    load_model("smollm2-135m", weights="q4", fuse=True)
    for name, config, kind, settings in profiles:
        spec = {**base, **DEFAULT_PROFILE, **settings, "kind": kind, "reference_ids": reference}
        if kind == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
            why = "llama-cpp-python is not installed (an optional extra that compiles llama.cpp for minutes)"
            rows.append({"profile": name, "config": config, "skipped": why})
            notes.append(f"llama.cpp did not run: {why}.")
            continue
        print(f"  {name}: a fresh process ...", flush=True)
        res, why = run_child(spec)
        if res is None:
            rows.append({"profile": name, "config": config, "skipped": why})
            notes.append(f"{name} did not run: {why}.")
            continue
        rows.append(profile_row(name, config, res, reference))
        results[name] = res
        if name == "fp32 default":
            reference = res["token_ids"]

    by = {r["profile"]: r for r in rows if "skipped" not in r}
    ratios = {}
    if "edge" in by and "fp32 default" in by:
        ratios["edge_peak_rss_vs_fp32"] = by["edge"]["peak_rss_MiB"] / by["fp32 default"]["peak_rss_MiB"]
        ratios["edge_decode_vs_fp32"] = by["edge"]["decode_tok_s"] / by["fp32 default"]["decode_tok_s"]
    if "edge" in by and "llama.cpp" in by:
        ratios["edge_peak_rss_vs_llama_cpp"] = by["edge"]["peak_rss_MiB"] / by["llama.cpp"]["peak_rss_MiB"]
        ratios["edge_decode_vs_llama_cpp"] = by["edge"]["decode_tok_s"] / by["llama.cpp"]["decode_tok_s"]
    targets = {"edge_peak_rss_vs_fp32": ("<=", 0.6)} if "edge_peak_rss_vs_fp32" in ratios else {}
    if "edge" in by:  # issue 39's absolute goals for the edge process: load, first token from its start, peak RSS
        for key, field, goal in (("edge_load_s", "load_s", 1.0), ("edge_first_token_s", "first_token_s", 2.0),
                                 ("edge_peak_rss_MiB", "peak_rss_MiB", 350.0)):
            ratios[key], targets[key] = by["edge"][field], ("<=", goal)
    parent_peak = own_peak_rss()
    notes[:0] = [
        (f"one chat prompt of {len(prompt_ids)} tokens, {n_new} greedy tokens (ignore_eos), {threads} thread in every "
         f"profile (the float32 default too, so decode rates compare); each profile in its own fresh process. Edge: "
         f"{EDGE_PROFILE}; its paged int8 pool holds the request's blocks (contexts up to "
         f"{EDGE_PROFILE['max_context']} tokens)."),
        ("peak_rss: the child's own high-water mark (VmHWM), loading included; loaded_rss: after load_model (or "
         "Llama()); end_rss: after the generation; trimmed_rss: after gc and glibc's malloc_trim(0), i.e. without the "
         "freed load buffers the allocator still held. load_s is load_model (or Llama()) alone; ready_s adds the "
         "imports."),
        ("ru_maxrss (getrusage) is not the child's peak on Linux: it is kept across fork + exec, so a child starts at "
         f"its parent's peak RSS (this bench's process: {parent_peak / MiB:.0f} MiB)"
         if parent_peak else "ru_maxrss: getrusage's peak as the child sees it"),
        ("agree_fp32: tokens equal, position by position, to the float32 default's free-running greedy tokens, which "
         "part for good at the first near-tie (first_diff; none: all equal); forced_agree_fp32: the top-1 token after "
         "each of the float32 default's own tokens (teacher-forced, through the profile's cache), which does not "
         "cascade. llama.cpp's Q4_1 matmuls round activations to 8 bits per block too (its Q8 formats)."),
    ]
    if "edge" in by and "floor" in by:
        e, f = by["edge"], by["floor"]
        held = e["end_rss_MiB"] - e["trimmed_rss_MiB"] if e.get("trimmed_rss_MiB") else None
        bare = by.get("torch floor")
        notes.append(
            f"where the edge process's memory goes: imports {f['end_rss_MiB']:.0f} MiB (floor"
            + (f"; torch alone {bare['end_rss_MiB']:.0f} MiB, minillm's imports the other "
               f"{f['end_rss_MiB'] - bare['end_rss_MiB']:.0f}" if bare else "")
            + f"), weights {e['weights_MiB']:.0f} MiB"
            + (f" plus {e['kernel_copy_MiB']:.0f} MiB more in the CPU kernels' repacked layout (a second copy, of "
               f"the layers that keep their stored codes: the Q8_0 embedding/LM head, whose lookups read rows of "
               f"them)" if e.get("kernel_copy_MiB") else "")
            + f", KV {e['kv_MiB']:.1f} MiB, the rest (tokenizer, model objects, libraries paged in) "
            f"{e['end_rss_MiB'] - f['end_rss_MiB'] - e['weights_MiB'] - e['kv_MiB']:.0f} MiB; after the generation "
            f"it holds {e['end_rss_MiB']:.0f} MiB and its peak was {e['peak_rss_MiB']:.0f} MiB"
            + (", reached while loading" if results["edge"]["loaded_peak_rss"] == results["edge"]["peak_rss"]
               else "")
            + (f"; {held:.0f} MiB of the end RSS were freed load buffers glibc had not returned" if held and held > 0
               else "")
            + (f"; loading what the first load kept beside the file (the converted layout, the tokenizer) instead "
               f"of building it: load "
               f"{by['edge, converting']['load_s']:.2f} -> {e['load_s']:.2f} s, peak "
               f"{by['edge, converting']['peak_rss_MiB']:.0f} -> {e['peak_rss_MiB']:.0f} MiB (same run)"
               if "edge, converting" in by else ""))
    return BenchResult(name="edge", rows=rows, ratios=ratios, targets=targets, notes=notes,
                       settings={"quick": quick, "model": "smollm2-135m", "device": "cpu", "threads": threads,
                                 "n_new": n_new, "prompt_tokens": len(prompt_ids), "ppl_tokens": ppl_tokens,
                                 "edge_profile": EDGE_PROFILE, "gguf": path.name})

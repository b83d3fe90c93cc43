"""`minillm generate`: stream one answer, then one line of what it cost (load, TTFT, decode rate, MBU, threads).

The stats line is the course's first measurement: what a single request costs on this machine, printed right after
the answer (no slow probe in between). `--profile edge` (lesson 14) and --tp/--pp/--sp (lesson 11) run here too.
"""

from __future__ import annotations

import math
import sys
import time

from minillm.cli.commands import UsageError, use_threads


def apply_profile(args) -> dict | None:
    """`generate --profile edge`: set the edge profile's flags (minillm.bench.edge.EDGE_PROFILE, measured by `minillm
    bench edge`), refusing flags given with other values; then fill in the plain defaults. Returns the profile."""
    from minillm.bench.edge import EDGE_PROFILE

    profile = EDGE_PROFILE if args.profile == "edge" else None
    if profile is not None:
        wanted = {"--threads": (args.threads, profile["threads"]), "--weights": (args.weights, profile["weights"]),
                  "--cache": (args.cache, profile["cache"]), "--dtype": (args.dtype, "float32"),
                  "--device": (args.device, "cpu")}
        clashes = [flag for flag, (given, want) in wanted.items() if given is not None and given != want]
        clashes += [flag for flag, on in (("--compile", args.compile), ("--tp", args.tp > 1), ("--pp", args.pp > 1),
                                          ("--sp", args.sp)) if on]
        if clashes:
            raise UsageError(f"--profile edge sets {profile['threads']} thread, --weights {profile['weights']} "
                             f"--native, --cache {profile['cache']} with an int8 KV cache, on the CPU: drop "
                             f"{', '.join(clashes)}")
        args.threads, args.weights, args.cache, args.device = (profile["threads"], profile["weights"],
                                                               profile["cache"], "cpu")
        args.fuse, args.native = profile["fuse"], profile["native"]
    args.dtype = args.dtype or "float32"
    args.weights = args.weights or "dequantized"
    args.cache = args.cache or "contiguous"
    return profile


def cmd_generate(args) -> int:
    import torch

    from minillm import generate, load_model
    from minillm.measure.hardware import bandwidth
    from minillm.measure.metrics import decode_bytes_per_token, mbu
    from minillm.sampling import validate_sampling

    profile = apply_profile(args)
    validate_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)  # fail before the slow load
    if not args.prompt.strip():
        raise UsageError("the prompt is empty: give some text to continue or a question to answer")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no CUDA GPU; use --device cpu")
    machine = use_threads(args.threads)
    if args.dtype == "bfloat16" and not torch.cuda.is_available() and args.device != "cuda":
        from minillm.measure.hardware import native_bf16

        if not native_bf16("cpu"):
            print("minillm: note: this CPU emulates bf16 (no avx512_bf16/amx_bf16): the prompt's prefill (a matrix "
                  "multiply) runs far slower than in float32; decode (matrix-vector) much less so", file=sys.stderr)
    if args.tp > 1 or args.pp > 1 or args.sp:
        return _generate_parallel(args)
    spec = None
    if args.speculative:
        from minillm.speculative.decoding import SpeculativeConfig, SpecStats

        spec = SpeculativeConfig(args.speculative, k=args.k, draft_model=args.draft_model)  # refuses bad combos
        spec_stats = SpecStats()
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, attn_backend=args.attn, fuse=args.fuse,
                            weights=args.weights, native=args.native,
                            max_context=profile["max_context"] if profile else None)
    kv_dtype = profile["kv_cache_dtype"] if profile else None
    if profile:  # the edge pool holds one context of max_context tokens
        n_prompt = len(tok.encode(args.prompt) if args.raw else tok.encode_chat([{"role": "user",
                                                                                   "content": args.prompt}]))
        if n_prompt + args.max_new_tokens > profile["max_context"]:
            raise UsageError(f"--profile edge serves contexts of at most {profile['max_context']} tokens; this prompt "
                             f"has {n_prompt} and --max-new-tokens is {args.max_new_tokens}")

    def emit(text: str) -> None:
        print(text, end="", flush=True)

    res = generate(model, tok, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, cache=args.cache, chat=not args.raw,
                   on_text=emit, compile=args.compile, speculative=spec, spec_stats=spec_stats if spec else None,
                   kv_cache_dtype=kv_dtype)
    print()
    n = len(res.token_ids)
    tps = res.decode_tokens_per_s
    stats = [
        f"load {model.load_seconds:.2f} s ({args.dtype}, {model.device.type}, attn={args.attn}, cache={args.cache})",
        f"prompt {res.prompt_tokens} tokens, generated {n}",
        f"TTFT {res.ttft_s * 1e3:.1f} ms",
    ]
    if n > 1 and not math.isnan(tps):  # nan when only one token came out
        line = f"decode {tps:.1f} tokens/s"
        if args.cache != "none" and spec is None:  # with speculation one weight read yields several tokens
            # MBU needs only the bandwidth: a bounded probe (< 1 s), measured once per machine and kept on disk
            moved = decode_bytes_per_token(model, res.prompt_tokens + n // 2)
            bw = bandwidth(model.device)
            line += (f", MBU {mbu(moved, 1 / tps, bw):.0%} "
                     f"({moved / 2**20:.0f} MiB read per token, {bw / 1e9:.0f} GB/s copy)")
        stats.append(line)
    if spec is not None:
        stats.append(f"speculative {args.speculative} k={args.k}: acceptance {spec_stats.acceptance_rate:.2f}, "
                     f"{spec_stats.tokens_per_step:.2f} tokens per target forward")
    if profile:
        from minillm.api import make_cache
        from minillm.bench.edge import own_peak_rss

        kv = make_cache(args.cache, model, res.prompt_tokens + n, kv_dtype=torch.int8).nbytes()
        stats.append(f"profile edge: {kv / 1024:.0f} KiB of int8 KV for this request, peak RSS "
                     f"{own_peak_rss() / 2**20:.0f} MiB")
    stats.append(f"{machine} at start")
    stats.append(f"finish_reason: {res.finish_reason}")
    print("--- " + " | ".join(stats))
    if args.weights != "dequantized" or args.native:
        from minillm.compress.quantize import describe_arithmetic

        print(f"--- arithmetic: {describe_arithmetic(model)}")
    return 0


def _generate_parallel(args) -> int:
    """--tp / --pp / --sp: generation on several processes (torch.distributed, gloo on CPU)."""
    from minillm.parallel.launch import ParallelConfig, generate_parallel
    from minillm.sampling import SamplingParams

    if args.speculative or args.compile or args.cache != "contiguous":
        raise UsageError("--tp/--pp/--sp decode on a contiguous cache: drop --speculative, --compile and --cache")
    ParallelConfig(args.tp, args.pp, args.sp)  # refuses bad combinations before anything loads
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    t0 = time.perf_counter()
    (out,) = generate_parallel(args.model, [args.prompt], params, tp=args.tp, pp=args.pp, sp=args.sp,
                               dtype=args.dtype, chat=not args.raw, threads=args.threads)
    print(out.text)
    m = out.metrics
    moved = sum(v["ring_bytes"] for v in m["comm_decode"].values()) / max(m["decode_steps"], 1)
    kind = f"tp={args.tp}{' + sp' if args.sp else ''}" if args.tp > 1 else f"pp={args.pp}"
    print("--- " + " | ".join([
        f"{kind}: {len(m['ranks'])} ranks, {m['threads']} thread(s) each, wall {time.perf_counter() - t0:.1f} s",
        f"prompt {out.prompt_tokens} tokens, generated {len(out.token_ids)}",
        f"prefill {m['prefill_s'] * 1e3:.1f} ms",
        f"decode {m['decode_tok_s']:.1f} tokens/s, {m['comm_decode_s'] / m['decode_s']:.0%} of it inside "
        f"collectives, {moved / 1024:.1f} KiB sent per rank per token",
        f"finish_reason: {out.finish_reason}"]))
    return 0

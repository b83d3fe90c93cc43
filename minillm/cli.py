"""The `minillm` command: generate text, run a benchmark, grade an exercise, describe the model.

    minillm generate "What is the capital of France?" --max-new-tokens 32 --dtype bfloat16 --threads 2
    minillm bench decode --quick    minillm bench --list    minillm grade 00 [--solutions]    minillm info
    minillm serve --port 8000       (an OpenAI-compatible server; needs pip install 'minillm[serve]')

Bad arguments print one line and exit with status 2; a setup problem (weights cache not writable, download
failed, pytest missing) prints one line that says what to do and exits with status 1. No tracebacks.
"""

from __future__ import annotations

import argparse
import inspect
import math
import time
import sys

EXIT_USAGE, EXIT_SETUP = 2, 1
THREADS_HELP = ("torch threads (default: torch's choice, one per core). Each measurement prints the thread count and "
                "the load average; on a busy machine use no more threads than free cores (more make bf16 matmuls "
                "many times slower)")


class UsageError(Exception):
    """A user mistake: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; we want one clear line
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from minillm.attention import backend_names
    from minillm.api import CACHE_KINDS, WEIGHTS
    from minillm.gguf.loader import DTYPES

    parser = _Parser(prog="minillm", description="LLM inference, one technique at a time, on SmolLM2-135M.",
                     epilog="generate and bench take --threads N (torch threads); see minillm generate --help")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming it, then print timing stats")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2-135m")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=_positive_int, default=None)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    # --dtype, --weights and --cache default to None so that --profile can tell a flag given from its default
    gen.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: float32")
    gen.add_argument("--weights", choices=list(WEIGHTS), default=None,
                     help="q4: keep the file's 4-bit blocks packed (lesson 07); the stats say what the matmuls "
                          "compute in (default: dequantized)")
    gen.add_argument("--fuse", action="store_true", help="lesson 06's fusions (q/k/v, gate/up, add+norm)")
    gen.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    gen.add_argument("--cache", choices=list(CACHE_KINDS), default=None, help="default: contiguous")
    gen.add_argument("--attn", choices=backend_names(), default="sdpa", help="attention backend")
    gen.add_argument("--raw", action="store_true", help="continue the prompt as plain text (no chat template)")
    gen.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    gen.add_argument("--compile", action="store_true",
                     help="run decode steps through torch.compile (lesson 06); the first call compiles for tens of "
                          "seconds")
    gen.add_argument("--speculative", choices=["ngram", "early_exit", "draft", "learned"], default=None,
                     help="speculative decoding (lesson 10): prompt lookup, the target's first blocks, "
                          "--draft-model, or the shipped learned draft head")
    gen.add_argument("--k", type=_positive_int, default=4, help="draft tokens per step with --speculative")
    gen.add_argument("--draft-model", default=None, help="with --speculative draft, e.g. smollm2-135m-student")
    gen.add_argument("--tp", type=_positive_int, default=1,
                     help="tensor-parallel ranks (lesson 11): 3 splits SmolLM2's heads; 2 splits only MLP and vocab")
    gen.add_argument("--pp", type=_positive_int, default=1, help="pipeline stages (lesson 11)")
    gen.add_argument("--sp", action="store_true", help="sequence parallelism on top of --tp (lesson 11)")
    gen.add_argument("--profile", choices=["edge"], default=None,
                     help="edge: the smallest configuration that still serves (lesson 14, minillm bench edge): 1 "
                          "thread, the file's q4 weights fused, a paged int8 KV cache, contexts up to 512 tokens; "
                          "refused beside flags that set these otherwise")

    bench = sub.add_parser("bench", help="run a benchmark (minillm bench --list)")
    bench.add_argument("name", nargs="?")
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    bench.add_argument("--quick", action="store_true",
                       help="tiny sizes, for CI; saved under <out>/quick/ so full results are never overwritten")
    bench.add_argument("--out", default="results", help="folder for <name>.json (default: results)")
    bench.add_argument("--no-save", action="store_true")
    bench.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    bench.add_argument("--url", default=None,
                       help="bench serve: load a running server at this URL (e.g. http://127.0.0.1:8000) instead "
                            "of starting one; only for benchmarks that take a server")
    bench.add_argument("--rate", type=float, action="append", default=None,
                       help="bench serve: Poisson request rate(s) in requests/s (repeat for several); only for "
                            "benchmarks that take a rate")
    bench.add_argument("--part", dest="parts", action="append", default=None,
                       help="bench disagg: run only this part (pd, routing, cascade; repeat for several)")

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (streaming) around the engine "
                                       "(pip install 'minillm[serve]')")
    srv.add_argument("--model", default="smollm2-135m")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line says which)")
    srv.add_argument("--dtype", choices=list(DTYPES), default="float32")
    srv.add_argument("--max-num-seqs", type=_positive_int, default=16, help="most sequences in one batch")
    srv.add_argument("--max-num-batched-tokens", type=_positive_int, default=512, help="token budget of one step")
    srv.add_argument("--max-waiting", type=_positive_int, default=64,
                     help="requests allowed to wait in the engine; more get HTTP 429 at once")
    srv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV blocks of a shared prompt prefix (default: on, as vLLM's server)")
    # lesson 14: the server runs any composition the engine does (load_model prunes, quantizes, fuses; the engine
    # holds the KV dtype and the drafter); pairs that cannot compose are refused by them, with the reason
    srv.add_argument("--weights", choices=list(WEIGHTS), default="dequantized",
                     help="q4: the file's 4-bit blocks; int8/int4: re-quantized from the float weights")
    srv.add_argument("--sparsity", choices=["2:4"], default=None, help="prune 2:4 (Wanda) before quantizing")
    srv.add_argument("--fuse", action="store_true", help="lesson 06's fusions")
    srv.add_argument("--kv-cache-dtype", choices=["int8"], default=None, help="an int8 KV pool (lesson 07)")
    srv.add_argument("--speculative", choices=["ngram", "learned"], default=None,
                     help="speculative decoding in the engine (lesson 10): prompt lookup or the shipped draft head")
    srv.add_argument("--k", type=_positive_int, default=3, help="draft tokens per step with --speculative")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish on shutdown before they are aborted")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINILLM_API_KEY if set, else none)")
    srv.add_argument("--allowed-hosts", default="",
                     help="comma-separated Host names to answer besides localhost/127.0.0.1/::1 and --host ('*': any, "
                          "e.g. behind a proxy); other names get 403 (DNS rebinding)")
    srv.add_argument("--allowed-origins", default="",
                     help="comma-separated browser origins (https://app.example) allowed to call, with CORS "
                          "headers; default none: requests a web page sends from another site get 403")
    srv.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info")
    srv.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)

    grade = sub.add_parser("grade", help="grade a lesson's exercises (exit 0 only if every task passes)")
    grade.add_argument("lesson", help="lesson number, e.g. 00")
    grade.add_argument("--solutions", action="store_true", help="grade the reference solutions instead")

    hint = sub.add_parser("hint", help="a hint for a lesson's exercise: a nudge (level 1) up to the recipe (3)")
    hint.add_argument("lesson", help="lesson number, e.g. 00")
    hint.add_argument("task", nargs="?", default=None, help="task name, e.g. rope (default: every task)")
    hint.add_argument("--level", type=int, choices=[1, 2, 3], default=1)

    info = sub.add_parser("info", help="model config, parameter count, bytes, KV-cache bytes per token; this "
                                       "machine's CPU, native or emulated bf16, threads and load (no timing probe)")
    info.add_argument("--model", default="smollm2-135m")
    return parser


def _use_threads(threads: int | None) -> str:
    """Apply --threads; warn (stderr) when other work leaves fewer free cores than that. Returns the line
    'N threads, load L on C cores', measured now, before our own work adds to the load."""
    import torch

    from minillm.bench.hardware import busy_warning, threads_line

    if threads is not None:
        torch.set_num_threads(threads)
    if warning := busy_warning():
        print(f"minillm: {warning}", file=sys.stderr)
    return threads_line()


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
                             f"--fuse, --cache {profile['cache']} with an int8 KV cache, on the CPU: drop "
                             f"{', '.join(clashes)}")
        args.threads, args.weights, args.cache, args.device = (profile["threads"], profile["weights"],
                                                               profile["cache"], "cpu")
        args.fuse = profile["fuse"]
    args.dtype = args.dtype or "float32"
    args.weights = args.weights or "dequantized"
    args.cache = args.cache or "contiguous"
    return profile


def cmd_generate(args) -> int:
    import torch

    from minillm import generate, load_model
    from minillm.bench.hardware import bandwidth
    from minillm.bench.metrics import decode_bytes_per_token, mbu
    from minillm.sampling import validate_sampling

    profile = apply_profile(args)
    validate_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)  # fail before the slow load
    if not args.prompt.strip():
        raise UsageError("the prompt is empty: give some text to continue or a question to answer")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but torch sees no CUDA GPU; use --device cpu")
    machine = _use_threads(args.threads)
    if args.dtype == "bfloat16" and not torch.cuda.is_available() and args.device != "cuda":
        from minillm.bench.hardware import native_bf16

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
                            weights=args.weights)
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
    if args.weights != "dequantized":
        from minillm.compress.quant import describe_arithmetic

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


def cmd_bench(args) -> int:
    from minillm.bench import ENTRIES, run_entry

    if args.list:
        width = max(map(len, ENTRIES))
        for name, target in ENTRIES.items():
            print(f"{name:<{width}s}  {target}")
        return 0
    if not args.name:
        raise UsageError(f"give a benchmark name or --list; benchmarks: {', '.join(ENTRIES)}")
    if args.name not in ENTRIES:
        raise UsageError(f"unknown benchmark {args.name!r}; available: {', '.join(ENTRIES)}")
    from minillm.bench import load_entry
    from minillm.bench.hardware import bf16_status

    # for entries that take them
    extra = {k: v for k, v in (("url", args.url), ("rate", args.rate), ("parts", args.parts)) if v is not None}
    if refused := [k for k in extra if k not in inspect.signature(load_entry(args.name)).parameters]:
        raise UsageError(f"--{refused[0]} is not an option of benchmark {args.name!r}")
    print(f"minillm bench {args.name}: {_use_threads(args.threads)} at start; {bf16_status()}")
    run_entry(args.name, quick=args.quick, save=not args.no_save, out=args.out, **extra)
    return 0


def access_policy(args):
    """`minillm serve`'s flags -> AccessPolicy: loopback names always; the bound address when it is a specific one."""
    import os

    from minillm.serving.access import LOOPBACK_HOSTS, AccessPolicy

    def names(text: str) -> list[str]:
        return [n.strip().lower() for n in text.split(",") if n.strip()]

    bound = [] if args.host in ("0.0.0.0", "::", "") else [args.host.lower()]
    hosts = tuple(dict.fromkeys([*LOOPBACK_HOSTS, *bound, *names(args.allowed_hosts)]))
    origins = tuple(o.rstrip("/") for o in names(args.allowed_origins))
    key = args.api_key if args.api_key is not None else os.environ.get("MINILLM_API_KEY") or None
    return AccessPolicy(api_key=key, allowed_hosts=hosts, allowed_origins=origins)


def cmd_serve(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("minillm: error: minillm serve needs fastapi and uvicorn: pip install 'minillm[serve]' "
              "(from a checkout: pip install -e '.[serve]')", file=sys.stderr)
        return EXIT_SETUP
    from minillm.engine import LLM
    from minillm.serving.server import serve

    if args.drain_timeout < 0:
        raise UsageError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    machine = _use_threads(args.threads)
    from minillm.speculative.decoding import SpeculativeConfig

    spec = SpeculativeConfig(args.speculative, k=args.k) if args.speculative else None
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
              weights=args.weights, sparsity=args.sparsity, fuse=args.fuse, kv_cache_dtype=args.kv_cache_dtype,
              speculative=spec)
    access = access_policy(args)
    composed = [f"weights {args.weights}"] + [x for x, on in (
        (f"sparsity {args.sparsity}", args.sparsity), ("fused", args.fuse), ("int8 KV", args.kv_cache_dtype),
        (f"speculative {args.speculative} k={args.k}", args.speculative)) if on]
    print(f"minillm serve: {args.model} ({args.dtype}; {', '.join(composed)}), {llm!r}, prefix caching "
          f"{'on' if args.enable_prefix_caching else 'off'}; {machine}", flush=True)
    print(f"minillm serve: API key {'required' if access.api_key else 'off (--api-key to require one)'}; Host "
          f"names {', '.join(access.allowed_hosts)}; web origins {', '.join(access.allowed_origins) or 'none'}; "
          f"requests without temperature are sampled at 1.0 (OpenAI's default)", flush=True)
    serve(llm, args.model, host=args.host, port=args.port, max_waiting=args.max_waiting,
          drain_timeout=args.drain_timeout, log_level=args.log_level, access=access)
    return 0


def cmd_grade(args) -> int:
    from minillm.course.grading import TASKS, print_table, run_graders

    lesson = args.lesson.zfill(2)
    if lesson not in TASKS:
        raise UsageError(f"unknown lesson {args.lesson!r}; lessons with exercises: {', '.join(TASKS)}")
    target = "solutions" if args.solutions else "exercises"
    outcomes = run_graders(lesson, target)
    print_table(lesson, outcomes, target)
    return 0 if all(v == "pass" for v in outcomes.values()) else 1


def cmd_hint(args) -> int:
    from minillm.course.hints import hint

    try:
        print(hint(args.lesson.zfill(2), args.task, args.level))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_info(args) -> int:
    from minillm.config import ModelConfig
    from minillm.kv_cache import kv_bytes, kv_bytes_per_token
    from minillm.gguf.weights import gguf_path, read_gguf_metadata

    cfg = ModelConfig.from_gguf_metadata(read_gguf_metadata(gguf_path(args.model)))
    n = cfg.n_params()
    print(f"{args.model}: llama decoder")
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "group_size", "ffn_dim",
                "rope_theta", "norm_eps", "max_seq_len", "tie_embeddings"):
        print(f"  {key:<15s} {getattr(cfg, key):g}" if isinstance(getattr(cfg, key), float)
              else f"  {key:<15s} {getattr(cfg, key)}")
    print(f"parameters       {n:,} ({n / 1e6:.1f}M): {n * 4 / 2**20:.0f} MiB float32, {n * 2 / 2**20:.0f} MiB bfloat16")
    for name, size in (("float32", 4), ("bf16/fp16", 2)):
        print(f"KV cache {name:<9s} {kv_bytes_per_token(cfg, size):,} bytes/token "
              f"(2 x {cfg.n_layers} layers x {cfg.n_kv_heads} kv heads x {cfg.head_dim} dims x {size} bytes); "
              f"{kv_bytes(cfg, cfg.max_seq_len, dtype=size) / 2**20:.0f} MiB at {cfg.max_seq_len} tokens")
    _print_machine()
    return 0


def _print_machine() -> None:
    """What this machine is, detected without timing anything (the probes belong to `minillm bench`)."""
    import torch

    from minillm.bench.hardware import bf16_status, busy_warning, cpu_name, threads_line
    from minillm_kernels.cpu_lowbit import describe as describe_cpu_kernels

    print(f"machine          CPU {cpu_name()}; torch {torch.__version__}; {threads_line()}")
    if torch.cuda.is_available():
        print(f"                 GPU {torch.cuda.get_device_name()}; {bf16_status('cuda')}")
    print(f"                 CPU {bf16_status('cpu')}")
    print(f"                 CPU low-bit kernels: {describe_cpu_kernels()}")
    if warning := busy_warning():
        print(f"                 {warning}")


def _one_line(message: str) -> str:
    # some messages carry a how-to on further lines (weights: fetch by hand); keep them, joined, on one line
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "grade": cmd_grade, "hint": cmd_hint, "info": cmd_info,
            "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    from minillm.course.grading import GradingSetupError
    from minillm.gguf.weights import WeightsError

    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (UsageError, ValueError) as e:  # ValueError: the library's checks on values (temperature, prompt...)
        print(f"minillm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (WeightsError, GradingSetupError) as e:  # the machine's setup: the message says what to do
        print(f"minillm: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_SETUP
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

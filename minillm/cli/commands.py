"""The bodies of `minillm bench`, `serve`, `grade`, `hint` and `info`, and what every command shares.

cli.py parses and dispatches; these do the work. A user mistake raises UsageError (one line, exit status 2); a
setup problem returns EXIT_SETUP with one line that says what to do. `generate` has its own module, generate.py.
"""

from __future__ import annotations

import inspect
import json
import sys

EXIT_USAGE, EXIT_SETUP = 2, 1


class UsageError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def use_threads(threads: int | None) -> str:
    """Apply --threads; warn (stderr) when other work leaves fewer free cores than that. Returns the line
    'N threads, load L on C cores', measured now, before our own work adds to the load."""
    import torch

    from minillm.measure.hardware import busy_warning, threads_line

    if threads is not None:
        torch.set_num_threads(threads)
    if warning := busy_warning():
        print(f"minillm: {warning}", file=sys.stderr)
    return threads_line()


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
    from minillm.measure.hardware import bf16_status

    # for entries that take them
    extra = {k: v for k, v in (("url", args.url), ("rate", args.rate), ("parts", args.parts),
                               ("target", getattr(args, "target", None))) if v is not None}
    if refused := [k for k in extra if k not in inspect.signature(load_entry(args.name)).parameters]:
        raise UsageError(f"--{refused[0]} is not an option of benchmark {args.name!r}")
    print(f"minillm bench {args.name}: {use_threads(args.threads)} at start; {bf16_status()}")
    run_entry(args.name, quick=args.quick, save=not args.no_save, out=args.out, runs=args.runs, **extra)
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
    from minillm.serving.connections import ConnectionLimits
    from minillm.serving.server import serve

    if args.drain_timeout < 0:
        raise UsageError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    try:
        limits = ConnectionLimits(args.max_connections, args.header_timeout, args.body_timeout,
                                  args.keep_alive_timeout)
    except ValueError as e:  # its message starts with the field's name: say the flag's
        name, rest = str(e).split(" ", 1)
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None
    machine = use_threads(args.threads)
    from minillm.speculative.decoding import SpeculativeConfig

    spec = SpeculativeConfig(args.speculative, k=args.k) if args.speculative else None
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
              weights=args.weights, sparsity=args.sparsity, fuse=args.fuse, kv_cache_dtype=args.kv_cache_dtype,
              speculative=spec, native=args.native)
    access = access_policy(args)
    composed = [f"weights {args.weights}"] + [x for x, on in (
        (f"sparsity {args.sparsity}", args.sparsity), ("fused", args.fuse), ("native step", args.native),
        ("int8 KV", args.kv_cache_dtype),
        (f"speculative {args.speculative} k={args.k}", args.speculative)) if on]
    print(f"minillm serve: {args.model} ({args.dtype}; {', '.join(composed)}), {llm!r}, prefix caching "
          f"{'on' if args.enable_prefix_caching else 'off'}; {machine}", flush=True)
    print(f"minillm serve: API key {'required' if access.api_key else 'off (--api-key to require one)'}; Host "
          f"names {', '.join(access.allowed_hosts)}; web origins {', '.join(access.allowed_origins) or 'none'}; "
          f"requests without temperature are sampled at 1.0 (OpenAI's default)", flush=True)
    print(f"minillm serve: {limits.describe()}", flush=True)
    serve(llm, args.model, host=args.host, port=args.port, max_waiting=args.max_waiting,
          drain_timeout=args.drain_timeout, log_level=args.log_level, access=access, limits=limits)
    return 0


def cmd_grade(args) -> int:
    from minillm.course.grading import TASKS, print_table, run_graders

    lesson = args.lesson.zfill(2)
    if lesson not in TASKS:
        raise UsageError(f"unknown lesson {args.lesson!r}; lessons with exercises: {', '.join(TASKS)}")
    target = "solutions" if args.solutions else "exercises"
    if args.bench:
        return _grade_bench(lesson, target, args)
    if args.pairs is not None or args.json is not None:
        raise UsageError("--pairs and --json go with --bench")
    outcomes = run_graders(lesson, target)
    print_table(lesson, outcomes, target)
    return 0 if all(v == "pass" for v in outcomes.values()) else 1


def _grade_bench(lesson: str, target: str, args) -> int:
    """`minillm grade NN --bench`: the table, the JSON; exit 0 only when every output matches minillm's."""
    from pathlib import Path

    from minillm.course.bench_exercises import (CASES, ENGINE_LESSONS, BenchSetupError, bench_lesson,
                                                print_result)

    if lesson not in CASES:
        raise UsageError(f"no --bench for lesson {lesson}; lessons: {', '.join(CASES)}")
    machine = use_threads(args.threads)
    where = "SmolLM2-135M (float32) on your pieces" if lesson in ENGINE_LESSONS else "SmolLM2's shapes"
    print(f"minillm grade {lesson} --bench: {target}/ against minillm's own, {where}; {machine}", flush=True)
    try:
        result = bench_lesson(lesson, target, pairs=args.pairs or 5)
    except BenchSetupError as e:
        print(f"minillm grade {lesson} --bench: {e}", file=sys.stderr)
        return 1
    print_result(result)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    else:
        path = result.save()
    print(f"wrote {path}")
    return 0 if all(row["output"] == "matches" for row in result.rows) else 1


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

    from minillm.measure.hardware import bf16_status, busy_warning, cpu_name, threads_line
    from minillm_kernels.cpu_lowbit import describe as describe_cpu_kernels

    print(f"machine          CPU {cpu_name()}; torch {torch.__version__}; {threads_line()}")
    if torch.cuda.is_available():
        print(f"                 GPU {torch.cuda.get_device_name()}; {bf16_status('cuda')}")
    print(f"                 CPU {bf16_status('cpu')}")
    print(f"                 CPU low-bit kernels: {describe_cpu_kernels()}")
    if warning := busy_warning():
        print(f"                 {warning}")

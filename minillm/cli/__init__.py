"""The `minillm` command: generate text, run a benchmark, grade an exercise, describe the model.

    minillm generate "What is the capital of France?" --max-new-tokens 32 --dtype bfloat16 --threads 2
    minillm bench decode --quick    minillm bench --list    minillm grade 00 [--solutions] [--bench]
    minillm serve --port 8000       (an OpenAI-compatible server; needs pip install 'minillm[serve]')

Here: the parser and the dispatch (the commands' bodies: generate.py, commands.py). A bad argument is one
line and exit status 2; a setup problem, one line that says what to do and status 1. No tracebacks.
"""

from __future__ import annotations

import argparse
import sys

from minillm.cli.commands import EXIT_SETUP, EXIT_USAGE, UsageError, cmd_bench, cmd_grade, cmd_hint, cmd_info, cmd_serve
from minillm.cli.generate import cmd_generate

THREADS_HELP = ("torch threads (default: torch's choice, one per core). Each measurement prints the thread count and "
                "the load average; on a busy machine use no more threads than free cores (more make bf16 matmuls "
                "many times slower)")


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
    gen.add_argument("--native", action="store_true",
                     help="every layer of a step in one C++ call (lesson 06's last rung; fuses; float32 or "
                          "--weights q4, int8 or int4, on the CPU)")
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
                          "thread, the file's q4 weights in the native step, a paged int8 KV cache, contexts up to "
                          "512 tokens; "
                          "refused beside flags that set these otherwise")

    bench = sub.add_parser("bench", help="run a benchmark (minillm bench --list)")
    bench.add_argument("name", nargs="?")
    bench.add_argument("--list", action="store_true", help="list the benchmarks")
    bench.add_argument("--quick", action="store_true",
                       help="tiny sizes, for CI; saved under <out>/quick/ so full results are never overwritten")
    bench.add_argument("--out", default="results", help="folder for <name>.json (default: results)")
    bench.add_argument("--no-save", action="store_true")
    bench.add_argument("--runs", type=_positive_int, default=1,
                       help="repeat the whole benchmark N times: the JSON keeps the median run's rows and every "
                            "ratio's min/median/max (the spread the lessons print)")
    bench.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    bench.add_argument("--url", default=None,
                       help="bench serve: load a running server at this URL (e.g. http://127.0.0.1:8000) instead "
                            "of starting one; only for benchmarks that take a server")
    bench.add_argument("--rate", type=float, action="append", default=None,
                       help="bench serve: Poisson request rate(s) in requests/s (repeat for several); only for "
                            "benchmarks that take a rate")
    bench.add_argument("--part", dest="parts", action="append", default=None,
                       help="bench disagg: run only this part (pd, routing, cascade; repeat for several)")
    bench.add_argument("--target", default=None,
                       help="bench speculative: the model drafts are verified by, float32 (default), q4-native "
                            "(the file's 4-bit weights on the native step) or float32-native (saved as "
                            "speculative-<target>.json)")

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
    srv.add_argument("--native", action="store_true",
                     help="every layer of a step in one C++ call (lesson 06; float32 or --weights q4/int8/int4)")
    srv.add_argument("--kv-cache-dtype", choices=["int8"], default=None, help="an int8 KV pool (lesson 07)")
    srv.add_argument("--speculative", choices=["ngram", "learned"], default=None,
                     help="speculative decoding in the engine (lesson 10): prompt lookup or the shipped draft head")
    srv.add_argument("--k", type=_positive_int, default=3, help="draft tokens per step with --speculative")
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish on shutdown before they are aborted")
    # connections (serving/connections.py): uvicorn's limits, and the header deadline uvicorn lacks (slowloris)
    srv.add_argument("--max-connections", type=_positive_int, default=256,
                     help="connections open at once; a request on one more gets HTTP 503 (default 256)")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a request's line and headers may take to arrive, else the connection is closed "
                          "(slowloris; default 10)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request's body may take to arrive; then HTTP 408 (default 30)")
    srv.add_argument("--keep-alive-timeout", type=float, default=5.0,
                     help="seconds an idle connection stays open between two requests (default 5)")
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
    grade.add_argument("--bench", action="store_true",
                       help="time your exercise beside minillm's own (interleaved pairs) and say whether its outputs "
                            "match: 00-05 run SmolLM2 on your pieces, 06-14 time the lesson's central functions")
    grade.add_argument("--pairs", type=_positive_int, default=None, help="with --bench: timed pairs (default 5)")
    grade.add_argument("--json", default=None, metavar="PATH",
                       help="with --bench: write the result here (default: results/quick/grade-bench-NN.json)")
    grade.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)

    hint = sub.add_parser("hint", help="a hint for a lesson's exercise: a nudge (level 1) up to the recipe (3)")
    hint.add_argument("lesson", help="lesson number, e.g. 00")
    hint.add_argument("task", nargs="?", default=None, help="task name, e.g. rope (default: every task)")
    hint.add_argument("--level", type=int, choices=[1, 2, 3], default=1)

    info = sub.add_parser("info", help="model config, parameter count, bytes, KV-cache bytes per token; this "
                                       "machine's CPU, native or emulated bf16, threads and load (no timing probe)")
    info.add_argument("--model", default="smollm2-135m")
    return parser


def _one_line(message: str) -> str:
    # some messages carry a how-to on further lines (weights: fetch by hand); keep them, joined, on one line
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "grade": cmd_grade, "hint": cmd_hint, "info": cmd_info,
            "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. A user mistake prints one line, status 2; a setup problem (weights cache
    not writable, download failed, pytest missing) one line that says what to do, status 1."""
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

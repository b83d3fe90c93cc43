"""One entry for parallel generation: `generate_parallel` starts the ranks and runs the prompts (lesson 11).

    outs = generate_parallel("smollm2-135m", ["The capital of France is"], SamplingParams(max_tokens=32), tp=3)
    outs[0].text, outs[0].metrics["decode_tok_s"], outs[0].metrics["comm_decode"]  # LLM's RequestOutput + comm

Prompts and results are LLM.generate's (see `generate_parallel`); what each rank does with them: `rank_generate`.
The model may also be a tiny random one ({"tiny": {...config overrides}, "seed": 0}) for tests and demos.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minillm.gguf.loader import describe_spec, load_spec
from minillm.kv_cache import KVCache
from minillm.request import RequestOutput, finish_reason, make_request, params_per_prompt
from minillm.sampling import SamplingParams, sample_from_logits


@dataclass(frozen=True)
class ParallelConfig:
    """tp: tensor-parallel degree; sp: sequence parallelism on top of tp; pp: pipeline stages (one kind at a time
    here: tp x pp grids are a product of the two process groups, left out for readability); micro_batches: GPipe
    micro-batches of the prompt."""

    tp: int = 1
    pp: int = 1
    sp: bool = False
    micro_batches: int = 4

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "micro_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.tp > 1 and self.pp > 1:
            raise ValueError("choose tensor parallelism (tp) or a pipeline (pp), not both: "
                             "2-D parallelism is not built")
        if self.sp and self.tp < 2:
            raise ValueError("sequence parallelism splits the regions between tensor-parallel matmuls: "
                             "it needs tp >= 2")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def validate(model_config, cfg: ParallelConfig) -> None:
    """Every refusal that can be decided from the config, before any process starts or any collective runs."""
    if cfg.tp > 1:
        from minillm.parallel.tensor import TPPlan

        plan = TPPlan.for_config(model_config, cfg.tp)
        if cfg.sp and not plan.split_attention:
            raise ValueError(f"sequence parallelism needs attention split too; {plan.describe(model_config)}")
    if cfg.pp > 1:
        from minillm.parallel.pipeline import stage_bounds

        stage_bounds(model_config.n_layers, cfg.pp)


@torch.inference_mode()
def rank_generate(rank: int, world_size: int, spec, requests: list[tuple[list[int], SamplingParams, frozenset[int]]],
                  cfg: ParallelConfig, dtype: str = "float32") -> list[dict]:
    """One rank's share of generation (run by `launch`): each request (prompt ids, params, stop ids) in turn.
    Returns, per request, its tokens, timings and collective counts on this rank.

    Each rank loads the same model file, checks that all ranks hold the same weights, turns it into its shard
    (tensor.py, + sequence.py; or pipeline.py) and runs the prompts one after another, batch 1; for every token the
    rank holding the full logits (rank 0 under TP, the last pipeline stage) samples it with the request's params and
    seed, and broadcasts it: every rank continues with the same token."""
    from minillm.parallel.distributed import Comm, check_same_weights, rank_device

    device = rank_device()  # its own GPU under NCCL, the CPU under gloo
    model = load_spec(spec, dtype, device)[0]
    validate(model.config, cfg)
    comm = Comm()
    check_same_weights(model, comm)
    if cfg.tp > 1:
        from minillm.parallel.tensor import shard_tensor_parallel

        shard_tensor_parallel(model, comm)
        if cfg.sp:
            from minillm.parallel.sequence import enable_sequence_parallel

            enable_sequence_parallel(model)
    return [{"rank": rank, **_rank_generate_one(model, comm, cfg, ids, params, stops)}
            for ids, params, stops in requests]


def _rank_generate_one(model, comm, cfg: ParallelConfig, prompt_ids: list[int], params: SamplingParams,
                       stop_ids: frozenset[int]) -> dict:
    """One request, batch 1, on this rank's shard: prefill (plain, sequence-parallel or a GPipe pipeline), then a
    token per step until a stop token or max_tokens."""
    device = model.device
    max_len = len(prompt_ids) + params.max_tokens
    ids = torch.tensor([prompt_ids], device=device)
    comm.reset()
    t0 = time.perf_counter()
    stage = None
    if cfg.pp > 1:
        from minillm.parallel.pipeline import PipelineStage, pipeline_prefill

        stage = PipelineStage(model, comm, max_len)
        logits = pipeline_prefill(stage, ids, min(cfg.micro_batches, len(prompt_ids)))
        step = stage.forward
        decider = comm.world_size - 1  # the last stage computes the logits
    else:
        kv = KVCache.for_model(model, 1, max_len)
        if cfg.sp:
            from minillm.parallel.sequence import prefill_sp, sp_forward

            logits = prefill_sp(model, ids, kv)
            step = lambda tok: sp_forward(model, tok, kv, last_only=True)  # noqa: E731
        else:
            logits = model(ids, kv_cache=kv, last_only=True)
            step = lambda tok: model(tok, kv_cache=kv, last_only=True)  # noqa: E731
        decider = 0  # identical logits on every rank; one decides, so a sampled token is the same everywhere
    gen = torch.Generator(device=device).manual_seed(params.seed) if params.seed is not None else None
    logprobs = [] if params.logprobs and comm.rank == decider else None

    def pick(lg) -> int:
        """The next token: sampled on the deciding rank (the request's own settings and generator), broadcast."""
        tok = torch.zeros(1, dtype=torch.long, device=device)
        if comm.rank == decider:
            last = lg[0, -1:]  # (1, vocab)
            tok[0] = sample_from_logits(last, params.temperature, params.top_k, params.top_p, gen)[0]
            if logprobs is not None:
                logprobs.append(float(last.float().log_softmax(-1)[0, tok[0]]))
        return int(comm.broadcast(tok, decider)[0])

    first_logits = logits[0, -1].float().cpu() if logits is not None else None
    prefill_s = time.perf_counter() - t0
    prefill_comm = comm.stats()
    comm.reset()
    out, times, t1 = [], [], time.perf_counter()
    tok = pick(logits)
    while True:
        out.append(tok)
        times.append(time.perf_counter() - t0)
        reason = finish_reason(out, stop_ids, params.max_tokens, len(prompt_ids) + len(out), model.config.max_seq_len)
        if reason is not None:
            break
        tok = pick(step(torch.tensor([[tok]], device=device)))
    decode_s = time.perf_counter() - t1
    events = None
    if stage is not None:
        events = [None] * comm.world_size
        dist.all_gather_object(events, stage.events)
    return {"token_ids": out, "token_times": times, "finish_reason": reason, "logprobs": logprobs,
            "prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": max(len(out) - 1, 1),
            "comm_decode": comm.stats(), "comm_prefill": prefill_comm, "comm_decode_s": comm.seconds,
            "first_logits": first_logits, "events": events, "threads": torch.get_num_threads(),
            "config": asdict(cfg)}


def generate_parallel(model: str | dict, prompts: list[str | list[int]],
                      params: SamplingParams | list[SamplingParams] | None = None, tp: int = 1, pp: int = 1,
                      sp: bool = False, micro_batches: int = 4, dtype: str = "float32", chat: bool = False,
                      timeout_s: float = 60.0, threads: int | None = None) -> list[RequestOutput]:
    """Run the prompts (text, in the chat template when `chat`, or token ids) on tp x pp ranks
    (torch.multiprocessing + gloo on CPU / NCCL on GPU), one after another; `params`: one SamplingParams or one per
    prompt; a RequestOutput each, in input order, as LLM.generate's. Its token_times and metrics (ttft, tpot, itl,
    e2e, prefill_s, decode_s, decode_tok_s, comm_prefill, comm_decode, comm_decode_s, threads, config) are rank 0's,
    timed from the request's start on the ranks (their start-up excluded); first_logits are the deciding rank's;
    metrics["ranks"] holds every rank's own. `model` may be a tiny random one ({"tiny": {...config overrides},
    "seed": 0}) for tests and demos."""
    cfg = ParallelConfig(tp, pp, sp, micro_batches)
    params = params_per_prompt(prompts, params)
    model_config, tok = describe_spec(model)  # validates the name and the file once, in this process
    validate(model_config, cfg)  # refuse before any process starts
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        try:
            req = make_request(prompt, p, tok, model_config, chat=chat)
            if req.params.max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
        except (ValueError, TypeError) as e:
            raise type(e)(f"request {i}: {e}") from None
        reqs.append(req)
    from minillm.parallel.distributed import launch

    ranks = launch(rank_generate, cfg.world_size, model, [(r.prompt_ids, r.params, r.stop_ids) for r in reqs], cfg,
                   dtype, timeout_s=timeout_s, threads=threads)
    decider = cfg.world_size - 1 if cfg.pp > 1 else 0
    outs = []
    for k, req in enumerate(reqs):
        per_rank = [r[k] for r in ranks]
        r0, t = per_rank[0], per_rank[0]["token_times"]
        n = len(t)
        metrics = {"ttft": t[0], "tpot": (t[-1] - t[0]) / (n - 1) if n > 1 else float("nan"),
                   "itl": [b - a for a, b in zip(t, t[1:])], "e2e": t[-1],
                   "decode_tok_s": r0["decode_steps"] / r0["decode_s"] if r0["decode_s"] > 0 else float("nan"),
                   **{key: r0[key] for key in ("prefill_s", "decode_s", "decode_steps", "comm_prefill", "comm_decode",
                                               "comm_decode_s", "threads", "config")},
                   "first_logits": per_rank[decider]["first_logits"], "ranks": per_rank}
        ids = r0["token_ids"]
        text = tok.decode([x for x in ids if x not in req.stop_ids]) if tok is not None else ""
        outs.append(RequestOutput(str(k), req.prompt_ids, ids, text, r0["finish_reason"], metrics, list(t),
                                  per_rank[decider]["logprobs"]))
    return outs


__all__ = ["ParallelConfig", "generate_parallel", "rank_generate", "validate"]

"""One entry for parallel generation: `generate_parallel` starts the ranks and decodes greedily (lesson 11).

    out = generate_parallel("smollm2-135m", "The capital of France is", tp=3, max_new_tokens=32)
    out["text"], out["decode_tok_s"], out["comm"]     # minillm generate's stats, plus communication

Each rank loads the same model file, checks that all ranks hold the same weights, turns it into its shard
(tensor.py, + sequence.py; or pipeline.py) and runs the greedy loop, every rank picking the same next token.
The model may also be a tiny random one ({"tiny": {...config overrides}, "seed": 0}) for tests and demos.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from minillm.gguf.loader import load_spec


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
def rank_generate(rank: int, world_size: int, spec, prompt_ids: list[int], max_new_tokens: int, cfg: ParallelConfig,
                  dtype: str = "float32", stop_ids: frozenset[int] = frozenset()) -> dict:
    """One rank's share of greedy generation (run by `launch`). Returns tokens, timings, collective counts."""
    from minillm.parallel.distributed import Comm, check_same_weights, rank_device
    from minillm.kv_cache import KVCache

    device = rank_device()  # its own GPU under NCCL, the CPU under gloo
    model = load_spec(spec, dtype, device)[0]
    validate(model.config, cfg)
    comm = Comm()
    check_same_weights(model, comm)
    max_len = len(prompt_ids) + max_new_tokens
    ids = torch.tensor([prompt_ids], device=device)
    t0 = time.perf_counter()
    stage = None
    if cfg.pp > 1:
        from minillm.parallel.pipeline import PipelineStage, pipeline_prefill

        stage = PipelineStage(model, comm, max_len)
        logits = pipeline_prefill(stage, ids, min(cfg.micro_batches, len(prompt_ids)))
        step = lambda tok: stage.forward(tok)  # noqa: E731
        pick = stage.next_token
    else:
        if cfg.tp > 1:
            from minillm.parallel.tensor import shard_tensor_parallel

            shard_tensor_parallel(model, comm)
        kv = KVCache.for_model(model, 1, max_len)
        if cfg.sp:
            from minillm.parallel.sequence import enable_sequence_parallel, prefill_sp, sp_forward

            enable_sequence_parallel(model)
            logits = prefill_sp(model, ids, kv)
            step = lambda tok: sp_forward(model, tok, kv, last_only=True)  # noqa: E731
        else:
            logits = model(ids, kv_cache=kv, last_only=True)
            step = lambda tok: model(tok, kv_cache=kv, last_only=True)  # noqa: E731

        def pick(lg):  # identical logits on every rank; rank 0's choice is broadcast all the same (cheap, safe)
            return int(comm.broadcast(lg[0, -1].argmax().reshape(1), 0)[0])
    first_logits = logits[0, -1].float().cpu() if logits is not None else None
    prefill_s = time.perf_counter() - t0
    prefill_comm = comm.stats()
    comm.reset()
    out, t1 = [], time.perf_counter()
    tok = pick(logits)
    while True:
        out.append(tok)
        if tok in stop_ids or len(out) == max_new_tokens:
            break
        tok = pick(step(torch.tensor([[tok]], device=device)))
    decode_s = time.perf_counter() - t1
    events = None
    if stage is not None:
        events = [None] * world_size
        dist.all_gather_object(events, stage.events)
    return {"rank": rank, "token_ids": out, "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_steps": max(len(out) - 1, 1), "comm_decode": comm.stats(), "comm_prefill": prefill_comm,
            "comm_decode_s": comm.seconds, "first_logits": first_logits, "events": events,
            "threads": torch.get_num_threads(), "config": asdict(cfg)}


def generate_parallel(model: str | dict = "smollm2-135m", prompt: str | list[int] = "The capital of France is",
                      tp: int = 1, pp: int = 1, sp: bool = False, max_new_tokens: int = 32, micro_batches: int = 4,
                      dtype: str = "float32", chat: bool = False, timeout_s: float = 60.0,
                      threads: int | None = None, ignore_eos: bool = False) -> dict:
    """Greedy generation on tp x pp ranks (torch.multiprocessing + gloo on CPU / NCCL on GPU). Returns rank 0's
    stats, the text (for a named model) and the per-rank results under "ranks"."""
    cfg = ParallelConfig(tp, pp, sp, micro_batches)
    tok = None
    if isinstance(model, dict):
        from minillm.config import ModelConfig

        model_config = ModelConfig.tiny(**model.get("tiny", {}))
        if not isinstance(prompt, list):
            raise ValueError("a tiny random model has no tokenizer: give the prompt as token ids")
        ids = prompt
    else:
        m, tok = load_spec(model, dtype=dtype)  # validates the name and the file once, in this process
        model_config = m.config
        del m
        ids = prompt if isinstance(prompt, list) else (
            tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt))
    validate(model_config, cfg)  # refuse before any process starts
    if not ids or max_new_tokens < 1 or len(ids) + max_new_tokens > model_config.max_seq_len:
        raise ValueError(f"need a non-empty prompt and 1 <= max_new_tokens with prompt + new <= "
                         f"{model_config.max_seq_len} tokens, got {len(ids)} + {max_new_tokens}")
    from minillm.parallel.distributed import launch

    stops = frozenset(tok.stop_ids) if tok is not None and not ignore_eos else frozenset()
    ranks = launch(rank_generate, cfg.world_size, model, ids, max_new_tokens, cfg, dtype, stops,
                   timeout_s=timeout_s, threads=threads)
    res = dict(ranks[0])
    res["ranks"] = ranks
    res["prompt_tokens"] = len(ids)
    res["text"] = tok.decode([t for t in res["token_ids"] if t not in stops]) if tok is not None else ""
    res["stop_reason"] = "stop_token" if res["token_ids"][-1] in stops else "length"
    res["decode_tok_s"] = res["decode_steps"] / res["decode_s"] if res["decode_s"] > 0 else float("nan")
    return res


__all__ = ["ParallelConfig", "generate_parallel", "rank_generate", "validate"]

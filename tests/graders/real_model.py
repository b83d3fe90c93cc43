"""Shared pieces of the real-model tasks (task_NN_real_model): the prompt, the reference run, and the engine drive.

Every reference output is computed with nothing swapped in (minillm's own code) and cached per model, so the tasks
of one grading session pay for each reference once. float32 and short outputs: a task takes a few seconds on CPU.
"""

from __future__ import annotations

import functools

import torch

import minillm

PROMPT = "What is the capital of France?"
ANSWER = "The capital of France is Paris."
N_TOKENS = 12  # at most this many greedy tokens, up to and including the end-of-turn token

_cache: dict = {}


def one_thread(fn):
    """Run fn with one torch thread: the engine's many small ops on a shared 2-core machine ran 10-20x slower with
    two threads than with one when another process held a core (threads spin-wait for each other)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapper


def chat_ids(tok) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": PROMPT}])


@one_thread
def greedy_ids(model, tok, cache: str = "contiguous", n: int = N_TOKENS) -> list[int]:
    return minillm.generate(model, tok, chat_ids(tok), max_new_tokens=n, cache=cache).token_ids


def reference_greedy(model, tok, cache: str = "contiguous", n: int = N_TOKENS) -> list[int]:
    """Call before swapping anything in (the result is cached for the session)."""
    key = ("greedy", id(model), cache, n)
    if key not in _cache:
        _cache[key] = greedy_ids(model, tok, cache, n)
    return _cache[key]


@one_thread
def reference_logits(model, tok) -> torch.Tensor:
    key = ("logits", id(model))
    if key not in _cache:
        with torch.inference_mode():
            _cache[key] = model(torch.tensor([chat_ids(tok)]))
    return _cache[key]


def close_logits(model, tok, want: torch.Tensor, what: str, atol: float = 1e-3) -> None:
    """The chat prompt's logits (every position: a prefill through the model as it is now) within atol of `want`
    (reference_logits, computed before anything was swapped in).
    Greedy tokens alone miss errors that do not flip an argmax (SmolLM2's first token draws most of the attention,
    so a flash loop that forgets to rescale is exact on most rows)."""
    with torch.inference_mode():
        got = one_thread(model)(torch.tensor([chat_ids(tok)]))
    assert got.shape == want.shape and torch.isfinite(got).all(), f"{what}: the logits are not finite"
    err = (got - want).abs().max().item()
    assert err <= atol, f"{what}: the chat prompt's logits differ from the reference by up to {err:.3g} (> {atol})"


def same_tokens(got: list[int], want: list[int], tok, what: str) -> None:
    """Assert identical greedy ids; the message shows where they part and the two texts from there."""
    if got == want:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    raise AssertionError(
        f"{what}: greedy token {i} differs (got {got[i] if i < len(got) else None}, reference "
        f"{want[i] if i < len(want) else None}); from there you wrote {tok.decode(got[i:])!r}, the reference "
        f"{tok.decode(want[i:])!r}")


# ------------------------------------------------------------------------------------------------------- engine

def workload(tok, n: int = 6, seed: int = 0):
    """A small seeded workload of real text: prompts of 6-20 tokens, 4-14 greedy tokens each (ignore_eos)."""
    from minillm.measure.workload import make_workload

    return make_workload(tok, n, prompt_len=(6, 20), output_len=(4, 14), output_dist="uniform", seed=seed)


@one_thread
def serve(model, tok, requests, num_blocks: int = 6, block_size: int = 8, max_num_seqs: int = 4,
          max_num_batched_tokens: int = 32, max_steps: int = 300) -> tuple[list[list[int]], list[dict]]:
    """Serve `requests` through minillm.LLM.from_model on a deliberately small pool (the default workload is
    preempted 3 times on the reference; a step runs at most 32 tokens); returns
    each request's generated ids (in request order) and the step log. Fails instead of looping forever."""
    llm = minillm.LLM.from_model(model, tok, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens)
    ids = [llm.add_request(r.prompt_ids, r.params()) for r in requests]
    steps = 0
    while llm.has_unfinished():
        steps += 1
        if steps > max_steps:
            done = sum(r in llm._finished for r in ids)
            raise AssertionError(f"the engine did not finish {len(ids)} requests in {max_steps} steps ({done} done, "
                                 f"{llm.block_manager.num_free()} of {num_blocks} blocks free): is a finished "
                                 f"sequence's memory freed, is everything admitted eventually?")
        llm.step()
    return [llm.pop_output(r).token_ids for r in ids], llm.step_log


def reference_serve(model, tok, requests, **kw) -> tuple[list[list[int]], list[dict]]:
    key = ("serve", id(model), tuple(tuple(r.prompt_ids) + (r.max_tokens,) for r in requests),
           tuple(sorted(kw.items())))
    if key not in _cache:
        _cache[key] = serve(model, tok, requests, **kw)
    return _cache[key]


def check_attention_backend(model, tok, impl, what: str) -> None:
    """The learner's attention (swapped in by check_on_ladder) gives the reference's chat-prompt logits within 1e-3
    and generate()'s greedy tokens; the references are taken before anything is swapped in."""
    from minillm.course.seams import check_on_ladder

    want, want_logits = reference_greedy(model, tok), reference_logits(model, tok)

    def check():
        close_logits(model, tok, want_logits, what)
        same_tokens(greedy_ids(model, tok), want, tok, what)

    check_on_ladder(model, impl, check)

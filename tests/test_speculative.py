"""Speculative decoding (lesson 10): whatever the drafts, the output is the target's.

Each check has an oracle that does not go through the code it checks: target-only greedy decoding
(generate_ids on a contiguous cache), the exact distributions p0, p0 x p1 for the sampling rule
(chi-square at p = 1e-6; each such test also runs a deliberately wrong rule that must fail the same
check at the same N, which shows the check has power), a cache that never saw the rolled-back tokens,
a brute-force prompt lookup, the draft model's own greedy run, and a Monte-Carlo simulation of the
acceptance process.

The tiny models have untied embeddings: a random model with tied ones repeats one token forever, so
every drafter would always be right; untied ones fall into cycles with branches, so n-gram drafts are
sometimes right and sometimes wrong. The "draft" model is a 2-block noisy copy of the 3-block target (a
stand-in for a distilled student): it agrees with the target about half the time, so both verification
paths run.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.cache.block_allocator import BlockAllocator, OutOfBlocksError, blocks_needed
from minillm.config import ModelConfig
from minillm.speculative.drafters import ModelDrafter, NgramDrafter, propose_ngram
from minillm.speculative.learned import DraftHead, LearnedDrafter
from minillm.speculative.train_drafter import choose_vocab, target_features, train_draft_head
from minillm.engine import LLM
from minillm.engine.block_manager import BlockManager
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Sequence
from minillm.api import generate, generate_ids
from minillm.kv_cache import KVCache
from minillm.model import Transformer
from minillm.cache.paged import PagedSequenceCache
from minillm.sampling import SamplingParams, logits_to_probs
from minillm.speculative.decoding import (
    SpecStats,
    SpeculativeConfig,
    check_budget,
    expected_tokens_per_step,
    make_drafter,
    rejection_sample,
    verify,
    verify_greedy,
)

VOCAB, CTX = 64, 128


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(n_layers: int) -> ModelConfig:
    return ModelConfig.tiny(vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=n_layers,
                            max_seq_len=CTX, tie_embeddings=False)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Transformer(tiny_cfg(3)).eval()


@pytest.fixture(scope="module")
def draft(target):
    """A different, smaller model with the target's vocabulary: the target's first 2 blocks, head and norm,
    every weight matrix perturbed by 20% noise."""
    torch.manual_seed(1)
    model = Transformer(tiny_cfg(2)).eval()
    model.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("layers.2.")})
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(0.2 * p.std() * torch.randn_like(p))
    return model


def solo(model, ids, params, stop_ids=frozenset()):
    """Target-only decoding on a contiguous cache: the reference every speculative run must equal."""
    return list(generate_ids(model, list(ids), params, set(stop_ids)))


def greedy(model, ids, k):
    return solo(model, ids, SamplingParams(max_tokens=k))


SOURCES = ("ngram", "early_exit", "draft", "self", "learned", "learned_gated")
GATE = 0.17  # learned_gated: chains stop once the head's path confidence falls below this (variable draft lengths)
_HEADS: dict = {}


def learned_head(target) -> DraftHead:
    """A DraftHead trained (a second of CPU) on the tiny target's own greedy runs: it agrees with the target often
    but not always, so both verification paths run."""
    if id(target) not in _HEADS:
        torch.manual_seed(2)
        rng = random.Random(2)
        prompts = [small_alphabet_prompt(rng, rng.choice([2, 3, 4, 5]), rng.randint(2, 12)) for _ in range(40)]
        data = target_features(target, [p + greedy(target, p, 40) for p in prompts], autocast=False)
        vocab, _ = choose_vocab(data["choice"], 48, [])
        head = DraftHead(target.config.dim, 64, vocab).bind(target)
        train_draft_head(head, data, steps=80, batch=256, lr=1e-2, autocast=False)
        _HEADS[id(target)] = head
    return _HEADS[id(target)]


def spec_config(source: str, k: int, target, draft, **kw) -> SpeculativeConfig:
    if source == "ngram":
        return SpeculativeConfig("ngram", k=k, **kw)
    if source.startswith("learned"):
        gate = GATE if source == "learned_gated" else 0.0
        return SpeculativeConfig("learned", k=k, draft_head=learned_head(target), min_confidence=gate, **kw)
    if source == "early_exit":
        return SpeculativeConfig("early_exit", k=k, exit_layer=1, **kw)
    return SpeculativeConfig("draft", k=k, draft_model=draft if source == "draft" else target, **kw)


def small_alphabet_prompt(rng: random.Random, alphabet: int, n: int) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(n)]


# ------------------------------------------------------------------------------------- 1. greedy, generate()

@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("source", SOURCES)
def test_greedy_generate_equals_target_only(target, draft, source, cache):
    rng = random.Random(0)
    stats = SpecStats()
    k, n_new, n_prompts = 3, 30, 5
    for _ in range(n_prompts):
        prompt = small_alphabet_prompt(rng, rng.choice([2, 3, 4]), rng.randint(2, 14))
        out = generate(target, None, prompt, max_new_tokens=n_new, cache=cache,
                       speculative=spec_config(source, k, target, draft), spec_stats=stats)
        assert out.token_ids == greedy(target, prompt, n_new), prompt
        assert out.finish_reason == "length"
    # the first token comes from the prefill, every other one from a verification step
    assert stats.emitted == n_prompts * (n_new - 1)
    assert stats.steps < stats.emitted, "speculation should have saved target forwards"
    if source == "self":  # the target drafting for itself is always right: every step yields k + 1 tokens
        assert stats.rejected == 0 and stats.accepted == stats.proposed > 0
        assert stats.steps == n_prompts * math.ceil((n_new - 1) / (k + 1))
    else:  # both paths of verify_greedy ran: accepted drafts and corrections
        assert stats.accepted > 0 and stats.rejected > 0, stats


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
@pytest.mark.parametrize("source", SOURCES)
@settings(max_examples=6)
@given(prompt=st.lists(st.integers(0, 4), min_size=1, max_size=20), max_tokens=st.integers(1, 40),
       k=st.integers(1, 6))
def test_greedy_generate_equals_target_only_hypothesis(target, draft, source, cache, prompt, max_tokens, k):
    out = generate(target, None, prompt, max_new_tokens=max_tokens, cache=cache,
                   speculative=spec_config(source, k, target, draft))
    assert out.token_ids == greedy(target, prompt, max_tokens)


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_generate_stop_token_and_context_end(target, draft, source):
    """A stop token ends the output where target-only decoding ends it (also when it was an accepted draft),
    and a prompt near the end of the context (fewer slots left than k + max_tokens) still decodes exactly."""
    prompt = [1, 2, 1, 0, 2, 1, 2, 0, 0, 2, 3, 0]
    ref = greedy(target, prompt, 30)
    for stop in sorted(set(ref[1:]))[:4]:
        out = generate(target, None, prompt, max_new_tokens=30, stop_ids={stop},
                       speculative=spec_config(source, 4, target, draft))
        assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    k = 4
    long_prompt = (prompt * 20)[:CTX - k - 3]  # 7 slots left: max_new_tokens is clipped to them
    out = generate(target, None, long_prompt, max_new_tokens=50, cache="paged",
                   speculative=spec_config(source, k, target, draft))
    assert out.token_ids == greedy(target, long_prompt, 50)
    assert len(out.token_ids) == k + 3 and out.finish_reason == "length"


@pytest.mark.parametrize("source", ["ngram", "draft", "learned"])
def test_sampled_generate_is_seeded(target, draft, source):
    """A seeded sampled request gives the same tokens twice (drafts, acceptances and corrections all draw from
    the request's generator), and its tokens stay inside the top-k support."""
    config, stats = spec_config(source, 3, target, draft), SpecStats()
    runs = [generate(target, None, [1, 2, 1, 2, 1], 25, temperature=1.0, top_k=3, seed=s, speculative=config,
                     spec_stats=stats) for s in (5, 5, 6)]
    assert stats.accepted > 0 and stats.rejected > 0, stats
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 25
    assert runs[0].token_ids != runs[2].token_ids
    for run in runs:
        with torch.inference_mode():
            logits = target(torch.tensor([[1, 2, 1, 2, 1] + run.token_ids]))[0, 4:-1]
        top3 = logits.topk(3, dim=-1).indices
        assert all(tok in top3[i] for i, tok in enumerate(run.token_ids))


# ------------------------------------------------------------------------------------------ 2. greedy, engine

def run_engine(llm, prompts, params, max_steps=3000):
    """llm.generate with a step limit: a bookkeeping bug that stalls a sequence fails instead of hanging."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(max_steps):
        if not llm.has_unfinished():
            return [llm.pop_output(r) for r in ids]
        llm.step()
    pytest.fail(f"the engine did not finish {len(ids)} requests in {max_steps} steps")


def check_drafter_empty(llm):
    if isinstance(llm.drafter, ModelDrafter):
        assert llm.drafter.cache.allocator.num_used() == 0 and not llm.drafter.states
    if isinstance(llm.drafter, LearnedDrafter):  # a finished request's features are dropped
        assert not llm.drafter.features


def requests_with_stops(rng, model, n, alphabet=4, max_prompt=16, max_out=20):
    """Small-alphabet prompts; about a third stop on a token that target-only decoding really produces."""
    prompts, params = [], []
    for _ in range(n):
        prompt = small_alphabet_prompt(rng, alphabet, rng.randint(1, max_prompt))
        sp = SamplingParams(max_tokens=rng.randint(1, max_out))
        if rng.random() < 0.35 and sp.max_tokens > 2:
            sp = SamplingParams(max_tokens=sp.max_tokens, stop_ids={rng.choice(solo(model, prompt, sp)[1:])})
        prompts.append(prompt)
        params.append(sp)
    return prompts, params


@pytest.mark.parametrize("source", ["ngram", "early_exit", "draft", "learned"])
@pytest.mark.parametrize("block_size,num_blocks,budget", [(1, 40, 7), (4, 11, 16), (16, 4, 512)])
def test_engine_greedy_equals_solo_under_preemption(target, draft, source, block_size, num_blocks, budget):
    rng = random.Random(block_size * 7 + len(source))
    prompts, params = requests_with_stops(rng, target, 16)
    llm = LLM.from_model(target, num_blocks=num_blocks, block_size=block_size, max_num_seqs=8,
                         max_num_batched_tokens=budget,
                         speculative=spec_config(source, 4, target, draft, max_batch=16))
    outs = run_engine(llm, prompts, params)
    for i, (p, sp, out) in enumerate(zip(prompts, params, outs)):
        ref = solo(target, p, sp)
        assert out.token_ids == ref, f"request {i} differs from its solo run"
        assert out.finish_reason == ("stop" if ref[-1] in sp.stop_ids else "length")
        assert len(out.token_ids) == sp.max_tokens or out.finish_reason == "stop"
    assert any(o.finish_reason == "stop" for o in outs)
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert any(s["num_draft_tokens"] > 0 for s in llm.step_log), "no draft was ever verified"
    stats = llm.spec_stats
    assert 0 < stats.accepted <= stats.proposed == sum(s["num_draft_tokens"] for s in llm.step_log)
    assert stats.emitted == stats.accepted + stats.steps  # a verification: accepted drafts + one target token
    assert max(s["num_tokens"] for s in llm.step_log) <= budget
    assert llm.num_free_blocks() == num_blocks and not llm.has_unfinished()
    check_drafter_empty(llm)


def test_engine_stop_token_among_accepted_drafts(target):
    """The target drafting for itself accepts every draft, so a stop token inside a step's drafts must end the
    request right there: finish_reason "stop", and none of the step's later tokens kept."""
    prompt = [2, 3, 2, 4, 5, 1, 4, 3, 3, 4, 2, 0]
    ref = greedy(target, prompt, 30)
    k = 4
    # output 0 comes from the prefill; steps then emit outputs 1..5, 6..10, ...: the last of each is the bonus
    j = next(j for j in range(2, 30) if (j - 1) % (k + 1) != k and ref[j] not in ref[:j])
    stop = ref[j]
    llm = LLM.from_model(target, num_blocks=64, block_size=4,
                         speculative=SpeculativeConfig("draft", k=k, draft_model=target))
    verified = []
    run = llm.runner.run

    def recording_run(schedule, draft_probs=None):
        sampled = run(schedule, draft_probs)
        verified.extend(tokens for item, tokens in zip(schedule.scheduled, sampled) if item.draft_ids)
        return sampled

    llm.runner.run = recording_run
    other = [5, 5, 1, 0]
    out, out_other = run_engine(llm, [prompt, other], [SamplingParams(max_tokens=30, stop_ids={stop}),
                                                       SamplingParams(max_tokens=30)])
    assert out.token_ids == ref[:j + 1] and out.finish_reason == "stop"
    assert any(stop in tokens[:-1] for tokens in verified), \
        "the stop token was meant to arrive as an accepted draft with tokens after it"
    assert out_other.token_ids == greedy(target, other, 30)
    stats = llm.spec_stats
    assert stats.rejected == 0 and stats.accepted == stats.proposed > 0  # the target agrees with itself
    assert llm.num_free_blocks() == 64
    check_drafter_empty(llm)


@pytest.mark.parametrize("source", ["ngram", "draft"])
def test_engine_max_batch_limits_speculation(target, draft, source):
    rng = random.Random(5)
    prompts = [small_alphabet_prompt(rng, 4, rng.randint(2, 12)) for _ in range(8)]
    params = [SamplingParams(max_tokens=rng.randint(5, 30)) for _ in range(7)]
    params.append(SamplingParams(max_tokens=60))
    llm = LLM.from_model(target, num_blocks=80, block_size=4, max_num_seqs=8,
                         speculative=spec_config(source, 3, target, draft, max_batch=1))
    outs = run_engine(llm, prompts, params)
    for p, sp, out in zip(prompts, params, outs):
        assert out.token_ids == solo(target, p, sp)
    assert any(s["num_decodes"] > 1 for s in llm.step_log)
    for s in llm.step_log:
        if s["num_decodes"] > 1:
            assert s["num_draft_tokens"] == 0, s
    assert any(s["num_draft_tokens"] > 0 for s in llm.step_log), "the last request, alone, should speculate"
    assert llm.num_free_blocks() == 80
    check_drafter_empty(llm)
    # max_batch=0: never speculate
    llm = LLM.from_model(target, num_blocks=80, block_size=4,
                         speculative=spec_config(source, 3, target, draft, max_batch=0))
    outs = run_engine(llm, prompts[:2], params[:2])
    assert [o.token_ids for o in outs] == [solo(target, p, sp) for p, sp in zip(prompts[:2], params[:2])]
    assert all(s["num_draft_tokens"] == 0 for s in llm.step_log) and llm.spec_stats.steps == 0


def test_engine_near_the_context_end(target, draft):
    """Lookahead never reaches past the context window: requests that end exactly at it decode exactly."""
    prompts = [([1, 2, 1, 0, 2] * 30)[:CTX - 6], ([3, 1, 0] * 50)[:CTX - 2]]
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=2)]
    for source in ("early_exit", "draft"):
        llm = LLM.from_model(target, num_blocks=40, block_size=8,
                             speculative=spec_config(source, 4, target, draft))
        outs = run_engine(llm, prompts, params)
        assert [o.token_ids for o in outs] == [solo(target, p, sp) for p, sp in zip(prompts, params)]
        assert llm.spec_stats.proposed > 0 and llm.num_free_blocks() == 40
        check_drafter_empty(llm)


def test_engine_abort_releases_the_draft_cache(target, draft):
    llm = LLM.from_model(target, num_blocks=40, block_size=4,
                         speculative=spec_config("draft", 3, target, draft))
    ids = [llm.add_request(p, SamplingParams(max_tokens=30)) for p in ([1, 2, 1, 2], [3, 0, 3, 0, 3])]
    for _ in range(3):
        llm.step()
    assert set(llm.drafter.states) == set(ids) and llm.drafter.cache.allocator.num_used() > 0
    assert llm.abort(ids[0])
    assert set(llm.drafter.states) == {ids[1]}
    while llm.has_unfinished():
        llm.step()
    assert llm.pop_output(ids[1]).token_ids == greedy(target, [3, 0, 3, 0, 3], 30)
    assert llm.num_free_blocks() == 40
    check_drafter_empty(llm)


# ------------------------------------------------------------------------------- 3. sampling: the exact rule

Z_1E6 = 4.753424308822899  # upper 1e-6 quantile of the standard normal


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at p = 1e-6 (slightly conservative)."""
    return df * (1 - 2 / (9 * df) + Z_1E6 * math.sqrt(2 / (9 * df))) ** 3


def chi2_passes(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Goodness of fit of counts (one per outcome) to probs at p = 1e-6. An outcome of probability 0 that
    occurs fails outright; outcomes expected fewer than 5 times are pooled into one cell."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = float(counts.sum())
    if n == 0 or bool((counts[probs <= 0] > 0).any()):
        return False
    expected = probs * n / probs.sum()
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum()[None]])
    exp = torch.cat([expected[big], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    if len(exp) < 2:
        return True
    return float(((obs - exp) ** 2 / exp).sum()) < chi2_critical(len(exp) - 1)


def counts_of(tokens, vocab):
    return torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=vocab)


def test_chi2_check_itself():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    good = counts_of(torch.multinomial(probs, 20000, replacement=True, generator=g), 4)
    off = counts_of(torch.multinomial(torch.tensor([0.47, 0.32, 0.16, 0.05]), 20000, replacement=True,
                                      generator=g), 4)
    assert chi2_passes(good, probs) and not chi2_passes(off, probs)
    assert not chi2_passes(torch.tensor([10, 0, 1]), torch.tensor([0.5, 0.5, 0.0]))  # an impossible outcome
    for df, exact in ((1, 23.928), (5, 35.888), (20, 65.421), (48, 109.659)):  # scipy's chi2.isf(1e-6, df)
        assert exact <= chi2_critical(df) <= 1.2 * exact


def synthetic_rows(gen: torch.Generator, rows: int, vocab: int, zero: int) -> torch.Tensor:
    """Random distributions, every probability >= 0.04 except one token per row (zero + row) at exactly 0."""
    x = 0.6 * torch.softmax(torch.randn(rows, vocab, generator=gen), dim=-1) + 0.4 / vocab
    for r in range(rows):
        x[r, (zero + r) % vocab] = 0
    return x / x.sum(dim=-1, keepdim=True)


def wrong_first_tokens(p, q, d0, gen, mistake):
    """The negative controls: the first token a rule with one deliberate mistake emits, for every first draft
    in d0 at once. "correct_from_p" draws the correction from p instead of the residual (with one-hot guesses:
    it forgets to take the rejected guess out); "accept_if_possible" accepts any draft that p allows."""
    n = len(d0)
    p_d = p[0, d0]
    q_d = torch.ones(n) if q is None else q[0, d0]
    accept = p_d > 0 if mistake == "accept_if_possible" else torch.rand(n, generator=gen) * q_d < p_d
    correction = torch.multinomial(p[0], n, replacement=True, generator=gen)
    return torch.where(accept, d0, correction)


def run_trials(p, q, drafts, gen):
    """One rejection_sample call per row of drafts; each output padded to 2 tokens by the next step's target
    draw (p[1] here: the rows are the same whatever was emitted). The outputs, the (first, second) pairs."""
    pads = torch.multinomial(p[1], len(drafts), replacement=True, generator=gen).tolist()
    outs = [rejection_sample(p, q, d, gen) for d in drafts]
    return outs, [(o[0], o[1] if len(o) > 1 else pad) for o, pad in zip(outs, pads)]


def test_rejection_sample_is_exact_with_draft_distribution():
    """k = 2 drafts drawn from q: the first token ~ p[0]; (first, second) ~ p[0] x p[1]; given an accepted
    first draft the second token ~ p[1]; given both accepted the bonus ~ p[2]. A rule that corrects from p
    instead of the residual, or accepts every possible draft, fails the very same first-token check at the
    same N."""
    V, N = 6, 20000
    gen = torch.Generator().manual_seed(1234)
    p, q = synthetic_rows(gen, 3, V, zero=0), synthetic_rows(gen, 2, V, zero=3)
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(2)], 1)
    outs, pairs = run_trials(p, q, drafts.tolist(), gen)
    assert all(1 <= len(o) <= 3 and o[:-1] == d[:len(o) - 1] for o, d in zip(outs, drafts.tolist()))
    assert chi2_passes(counts_of([o[0] for o in outs], V), p[0])
    assert chi2_passes(counts_of([a * V + b for a, b in pairs], V * V), torch.outer(p[0], p[1]))
    seconds = [o[1] for o in outs if len(o) > 1]
    bonuses = [o[2] for o in outs if len(o) > 2]
    assert len(seconds) > 5000 and len(bonuses) > 2000
    assert chi2_passes(counts_of(seconds, V), p[1]) and chi2_passes(counts_of(bonuses, V), p[2])
    for mistake in ("correct_from_p", "accept_if_possible"):  # negative controls: the check has power
        wrong = wrong_first_tokens(p, q, drafts[:, 0], gen, mistake)
        assert not chi2_passes(counts_of(wrong, V), p[0]), mistake


def test_rejection_sample_is_exact_with_one_hot_guesses():
    """q=None (n-gram guesses): whatever the guess, the first token ~ p[0], also when the guess is impossible
    under p. Forgetting to take the rejected guess out of the correction fails the same check."""
    V, N = 7, 15000
    gen = torch.Generator().manual_seed(99)
    p = synthetic_rows(gen, 3, V, zero=5)
    guesses = [int(p[0].argmax()), int(p[0].argmin()), 3]  # likely, impossible (p = 0), middling
    assert float(p[0, guesses[1]]) == 0
    firsts = random.Random(0).choices(guesses, k=N)
    outs, _ = run_trials(p, None, [[g, 2] for g in firsts], gen)
    for g in guesses:  # the first token ~ p[0] given each guess, not just on average
        assert chi2_passes(counts_of([o[0] for o, f in zip(outs, firsts) if f == g], V), p[0]), g
    assert chi2_passes(counts_of([o[1] for o in outs if len(o) > 1], V), p[1])
    likely = torch.full((firsts.count(guesses[0]),), guesses[0])
    wrong = wrong_first_tokens(p, None, likely, gen, "correct_from_p")
    assert not chi2_passes(counts_of(wrong, V), p[0])


def test_rejection_sample_and_verify_edge_cases():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    out = rejection_sample(p, q, [1])
    assert out[0] == 1 and len(out) == 2  # p == q: always accepted, then a bonus draw
    assert rejection_sample(p, None, [0]) == [1]  # an impossible guess: rejected, corrected to p's only token
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(p, q, [1, 2])
    # greedy verification: the drafts up to the first mismatch, then the target's own token
    assert verify_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert verify_greedy([5, 9, 7], [5, 6]) == [5, 9]
    assert verify_greedy([8, 9, 7], [5, 6]) == [8]
    assert verify_greedy([4], []) == [4]
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert verify(logits, [1], None, SamplingParams(temperature=0.0)) == [1, 0]
    assert verify(logits, [2], None, SamplingParams(temperature=0.0)) == [1]


@pytest.mark.parametrize("source", ["ngram", "draft", "learned", "learned_gated"])
def test_engine_speculative_sampling_has_the_targets_distribution(target, draft, source):
    """Temperature 1, top-k 4, 1500 seeded requests of one prompt through the engine: the first output token
    comes from the prefill, the second from a verification step (2 drafts: n-gram guesses, or the draft
    model's samples with its distribution q; learned_gated: 0, 1 or 2 of them, by the head's confidence).
    (x0, x1) must have target-only sampling's distribution p0(x0) p1(x1 | x0)."""
    n_req, top_k = 1500, 4
    if source == "ngram":  # every token occurs in the prompt, followed by another: 1-gram lookup always hits
        prompt = random.Random(1).sample(range(VOCAB), VOCAB)
    else:
        prompt = [1, 2, 1, 0, 2, 1, 2, 0, 0, 2, 3, 0]
    with torch.inference_mode():
        p0 = logits_to_probs(target(torch.tensor([prompt]))[0, -1:], 1.0, top_k)[0]
        joint = torch.zeros(VOCAB, VOCAB)
        for x in p0.nonzero()[:, 0].tolist():
            joint[x] = p0[x] * logits_to_probs(target(torch.tensor([prompt + [x]]))[0, -1:], 1.0, top_k)[0]
    # 64 sequences at a time, a budget above their prompts: every first decode step gets its 2 lookahead slots
    extra = {"ngram_min": 1} if source == "ngram" else {}
    llm = LLM.from_model(target, num_blocks=400, block_size=16, max_num_seqs=64,
                         max_num_batched_tokens=64 * 70,
                         speculative=spec_config(source, 2, target, draft, max_batch=64, **extra))
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=top_k, seed=i) for i in range(n_req)]
    outs = run_engine(llm, [prompt] * n_req, params)
    stats = llm.spec_stats
    assert stats.accepted > 0 and stats.rejected > 0, stats
    if source == "learned_gated":  # the gate cut some chains short, and let others through
        assert 0.2 * n_req <= stats.proposed < 1.5 * n_req, stats
    else:
        assert stats.proposed >= 1.5 * n_req, stats
    assert all(len(o.token_ids) == 4 for o in outs)
    pairs = [o.token_ids[0] * VOCAB + o.token_ids[1] for o in outs]
    assert chi2_passes(counts_of(pairs, VOCAB * VOCAB), joint)
    assert llm.num_free_blocks() == 400
    check_drafter_empty(llm)


def compressed(p, q, draft_tokens):
    """The columns where p or q has mass (top-k keeps 20 of each) and the drafts: rejection_sample never looks
    elsewhere, and on ~40 columns a call is far faster than on 49152. The column ids and the narrowed rows."""
    cols = ((p > 0).any(0) | (q > 0).any(0) if q is not None else (p > 0).any(0)).nonzero()[:, 0]
    cols = torch.unique(torch.cat([cols, torch.tensor(draft_tokens, dtype=torch.long)]))
    return cols, p[:, cols], None if q is None else q[:, cols]


@pytest.mark.parametrize("method", ["ngram", "early_exit"])
def test_real_model_speculative_sampling_first_token_is_the_targets(real_model, method):
    """SmolLM2, temperature 1, top-k 20: the first token a speculative step emits has the target's next-token
    distribution, for n-gram guesses and for an early-exit draft (exit after block 20 of 30)."""
    model, tok = real_model
    params = SamplingParams(temperature=1.0, top_k=20)
    k, N = 2, 6000
    gen = torch.Generator().manual_seed(7)
    prompts = {
        "ngram": ["The cat sat on the mat. The cat sat on the", "One, two, three, four. One, two, three,"],
        # prompts where block 20's top 20 overlaps the target's (elsewhere it can miss it entirely)
        "early_exit": ["One, two, three, four. One, two, three,", "Monday, Tuesday, Wednesday,"],
    }[method]
    drafter = make_drafter(SpeculativeConfig(method, k=k, exit_layer=20), model, num_blocks=8, block_size=16)
    for key, text in enumerate(prompts):
        ids = tok.encode(text)
        draft, q = drafter.propose([(str(key), ids, k)], [params], [gen])[0]
        assert len(draft) == k and (q is None) == (method == "ngram")
        with torch.inference_mode():
            logits = model(torch.tensor([ids + draft]))[0, len(ids) - 1:]  # the target's rows p_0 .. p_k
        p = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
        cols, pc, qc = compressed(p, q, draft)
        index = {int(c): i for i, c in enumerate(cols)}
        if method == "ngram":  # one fixed guess (what prompt lookup proposes here), q one-hot
            assert float(p[0, draft[0]]) > 0.05, "the guess should be plausible so that both paths run"
            d0 = torch.full((N,), index[draft[0]])
            first = [rejection_sample(pc, None, [index[d] for d in draft], gen)[0] for _ in range(N)]
        else:  # a fresh first draft from q[0] each time (q[0] does not depend on the draft)
            assert q.shape == (k, p.shape[1]) and torch.allclose(q.sum(-1), torch.ones(k))
            overlap = float(torch.minimum(p[0], q[0]).sum())  # the chance that the first draft is accepted
            assert 0.1 < overlap < 0.9, "accepts and rejections should both happen"
            d0 = torch.multinomial(qc[0], N, replacement=True, generator=gen)
            first = [rejection_sample(pc, qc, [d, index[draft[1]]], gen)[0] for d in d0.tolist()]
        assert chi2_passes(counts_of(first, len(cols)), pc[0]), (method, text)
        # negative control: correcting from p instead of the residual fails the same check at the same N
        wrong = wrong_first_tokens(pc, qc, d0, gen, "correct_from_p")
        assert not chi2_passes(counts_of(wrong, len(cols)), pc[0]), (method, text)
        drafter.release(str(key))
    if isinstance(drafter, ModelDrafter):
        assert drafter.cache.allocator.num_used() == 0


# ---------------------------------------------------------------------------------------------- 4. rollback

@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_rollback_equals_never_drafted_cache(target, kind):
    """Prefill, verify [last token + 4 drafts], keep 2 drafts, decode on: the same logits as a cache that only
    ever saw the kept tokens, and (paged) only the blocks the kept length needs."""
    bs = 4

    def make():
        if kind == "contiguous":
            return KVCache.for_model(target, 1, 40)
        return PagedSequenceCache.for_model(target, 1, 40, block_size=bs)

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=gen)
    last, drafts, after = (torch.randint(0, VOCAB, (1, n), generator=gen) for n in (1, 4, 3))
    kept = torch.cat([last, drafts[:, :2]], 1)
    rolled, fresh = make(), make()
    with torch.inference_mode():
        target(prompt, kv_cache=rolled)
        verify_logits = target(torch.cat([last, drafts], 1), kv_cache=rolled)  # positions 10..14
        rolled.truncate(10 + 1 + 2)  # keep the last token and 2 accepted drafts
        if kind == "paged":
            assert rolled.allocator.num_used() == blocks_needed(13, bs) == len(rolled.block_tables_host[0])
        a = [target(after[:, i:i + 1], kv_cache=rolled) for i in range(3)]
        target(prompt, kv_cache=fresh)
        b_kept = torch.cat([target(kept[:, i:i + 1], kv_cache=fresh) for i in range(3)], 1)
        b = [target(after[:, i:i + 1], kv_cache=fresh) for i in range(3)]
    torch.testing.assert_close(verify_logits[:, :3], b_kept, atol=1e-5, rtol=1e-5)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert rolled.seq_len == fresh.seq_len == 16
    if kind == "paged":
        assert rolled.allocator.num_used() == fresh.allocator.num_used() == blocks_needed(16, bs)


def make_seq(rid: str, prompt: list[int], max_tokens: int, stop_ids=frozenset()) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens), stop_ids=frozenset(stop_ids),
                    max_model_len=64)


def test_scheduler_reserves_lookahead_and_rolls_back_rejected_drafts():
    """Pure bookkeeping, no model: decodes get up to k lookahead slots (new blocks where needed); after
    verification a sequence caches its input token + the accepted drafts, and the blocks past them return to
    the pool. A tight pool makes the scheduler preempt as well."""
    rng = random.Random(0)
    for block_size in (1, 2, 4, 8):
        allocator = BlockAllocator(blocks_needed(48, block_size), block_size)
        sched = Scheduler(BlockManager(allocator), max_num_seqs=4, max_num_batched_tokens=24)
        seqs = [make_seq(str(i), small_alphabet_prompt(rng, 9, rng.randint(1, 9)), rng.randint(2, 30),
                         stop_ids={8}) for i in range(10)]
        for s in seqs:
            sched.add(s)
        k, rejections, steps = 3, 0, 0
        while sched.has_unfinished():
            steps += 1
            assert steps < 2000, "a sequence stalled"
            schedule = sched.schedule(k)
            starts = [item.start for item in schedule.scheduled]
            sampled = []
            for item in schedule.scheduled:
                seq = item.seq
                assert item.num_lookahead <= min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
                if item.num_lookahead:
                    assert item.is_decode
                    needed = blocks_needed(seq.num_tokens + item.num_lookahead, block_size)
                    assert len(seq.block_table) == needed
                    # the drafter may propose fewer than the slots it got
                    item.draft_ids = [rng.randrange(8) for _ in range(rng.randint(0, item.num_lookahead))]
                n_acc = rng.randint(0, len(item.draft_ids))
                token = 8 if rng.random() < 0.03 else rng.randrange(8)  # 8: the stop token
                sampled.append(item.draft_ids[:n_acc] + [token] if item.samples else [])
            sched.postprocess(schedule, sampled, 0.0)
            for item, start, tokens in zip(schedule.scheduled, starts, sampled):
                seq = item.seq
                if seq.is_finished:
                    assert seq.block_table == [] and seq.num_cached_tokens == 0
                elif item.num_lookahead:
                    assert seq.num_cached_tokens == start + len(tokens)  # the input token + accepted drafts
                    assert seq.num_cached_tokens == seq.num_tokens - 1  # only the newest token is uncached
                    assert len(seq.block_table) == blocks_needed(seq.num_cached_tokens, block_size)
                    rejections += len(item.draft_ids) > len(tokens) - 1
            assert allocator.num_used() == sum(len(s.block_table) for s in seqs)
        assert rejections > 5, "rejections were meant to happen"
        assert allocator.num_used() == 0 and sched.num_preemptions > 0, block_size
        for s in seqs:
            assert len(s.output_ids) == s.params.max_tokens or s.output_ids[-1] == 8
            assert 8 not in s.output_ids[:-1]


def test_block_manager_truncate():
    manager = BlockManager(BlockAllocator(10, 4))
    seq = make_seq("a", list(range(9)), 10)
    manager.allocate(seq)  # 9 tokens: 3 blocks
    seq.num_cached_tokens = 9
    manager.may_append(seq, 5)  # room for 13 tokens: 4 blocks
    assert len(seq.block_table) == 4 and manager.num_free() == 6
    manager.truncate(seq, 5)
    assert seq.num_cached_tokens == 5 and len(seq.block_table) == 2 and manager.num_free() == 8
    manager.truncate(seq, 4)
    assert len(seq.block_table) == 1 and manager.num_free() == 9
    with pytest.raises(ValueError, match=r"0\.\.4"):
        manager.truncate(seq, 5)
    manager.truncate(seq, 0)
    assert seq.block_table == [] and manager.num_free() == 10


# -------------------------------------------------------------------------------------------- 5. ModelDrafter

def test_model_drafter_proposes_the_draft_models_greedy_run_and_resyncs(draft):
    drafter = ModelDrafter(draft, None, num_blocks=64, block_size=4)
    rng = random.Random(1)
    prompts = [small_alphabet_prompt(rng, 5, n) for n in (3, 9, 14)]

    def propose(batch):
        out = drafter.propose(batch, [SamplingParams()] * len(batch), [None] * len(batch))
        for (key, ids, _), (d, _) in zip(batch, out):
            state = drafter.states[key]
            assert state.cached == ids + d[:-1]  # the draft cache holds exactly the tokens it ran
            assert len(state.block_table) == blocks_needed(len(state.cached), 4)
        assert drafter.cache.allocator.num_used() == sum(len(s.block_table) for s in drafter.states.values())
        return out

    first = propose([(str(i), p, 5) for i, p in enumerate(prompts)])
    for p, (d, q) in zip(prompts, first):
        assert d == greedy(draft, p, 5)
        assert q.shape == (5, VOCAB) and torch.equal(q.argmax(-1), torch.tensor(d))  # greedy: one-hot q
    d0, d1 = first[0][0], first[1][0]
    # the target accepted 2 of sequence 0's drafts, then corrected; all of sequence 1's, plus a bonus;
    # sequence 2 is shorter than what its cache holds (e.g. recomputed after a preemption)
    seqs = [prompts[0] + d0[:2] + [(d0[2] + 1) % VOCAB], prompts[1] + d1 + [7], prompts[2][:5] + [9]]
    again = propose([(str(i), s, n) for i, (s, n) in enumerate(zip(seqs, (3, 4, 2)))])
    assert [d for d, _ in again] == [greedy(draft, s, n) for s, n in zip(seqs, (3, 4, 2))]
    # the first draft rejected, then two plain decode steps (no speculation above max_batch): the cached
    # drafts differ from the sequence before its last token
    diverged = prompts[0] + [(d0[0] + 1) % VOCAB, d0[1], 4]
    (d, _), = propose([("0", diverged, 3)])
    assert d == greedy(draft, diverged, 3)
    for key in "012":
        drafter.release(key)
    drafter.release("never-seen")  # unknown keys are fine
    assert drafter.cache.allocator.num_used() == 0 and not drafter.states


def test_early_exit_drafter_is_the_truncated_model(target):
    """Early exit = the target's first block + its final norm and head: the same tokens as a 1-block model
    built from those weights."""
    short = Transformer(tiny_cfg(1)).eval()
    short.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith(("layers.1.", "layers.2."))})
    config = SpeculativeConfig("early_exit", k=4, exit_layer=1)
    drafter = make_drafter(config, target, num_blocks=32, block_size=4)
    assert isinstance(drafter, ModelDrafter)
    ids = [1, 2, 3, 1, 2, 0, 0, 3]
    (d, _), = drafter.propose([("x", ids, 4)], [SamplingParams()], [None])
    assert d == greedy(short, ids, 4)
    ids2 = ids + d[:1] + [(d[1] + 1) % VOCAB]
    (d2, _), = drafter.propose([("x", ids2, 4)], [SamplingParams()], [None])
    assert d2 == greedy(short, ids2, 4)


def test_model_drafter_out_of_blocks_drafts_less_and_evicts(draft):
    drafter = ModelDrafter(draft, None, num_blocks=4, block_size=4)  # room for 16 tokens in all
    gp = SamplingParams()
    rng = random.Random(2)
    seqs = {str(i): small_alphabet_prompt(rng, 4, 6) for i in range(3)}
    batch = [(key, ids, 3) for key, ids in seqs.items()]
    proposals = drafter.propose(batch, [gp] * 3, [None] * 3)  # 3 x 8 tokens do not fit in 16: one drafts less
    lengths = [len(d) for d, _ in proposals]
    assert sum(lengths) < 9 and max(lengths) == 3
    for (key, ids, _), (d, _) in zip(batch, proposals):
        assert d == greedy(draft, ids, 3)[:len(d)]  # fewer drafts, never wrong ones
    assert drafter.cache.allocator.num_used() <= 4
    # one more sequence on its own: idle ones are evicted to make room
    new = small_alphabet_prompt(rng, 4, 9)
    (d, _), = drafter.propose([("3", new, 4)], [gp], [None])
    assert d == greedy(draft, new, 4)
    assert set(drafter.states) - {"3"} != set(seqs), "an idle sequence should have been evicted"
    # an evicted sequence comes back: it re-prefills
    key = next(key for key in seqs if key not in drafter.states)
    (d, _), = drafter.propose([(key, seqs[key], 3)], [gp], [None])
    assert d == greedy(draft, seqs[key], 3)
    # a sequence longer than the whole draft cache: no drafts, no error
    (d, q), = drafter.propose([("long", [1, 2] * 12, 3)], [gp], [None])
    assert d == [] and q is None
    for key in list(drafter.states):
        drafter.release(key)
    assert drafter.cache.allocator.num_used() == 0


def test_model_drafter_never_raises_out_of_blocks(draft):
    drafter = ModelDrafter(draft, None, num_blocks=5, block_size=2)
    rng = random.Random(3)
    seqs = {str(i): small_alphabet_prompt(rng, 4, rng.randint(1, 6)) for i in range(6)}
    for _ in range(15):
        keys = rng.sample(sorted(seqs), rng.randint(1, 4))
        try:
            proposals = drafter.propose([(key, seqs[key], 3) for key in keys], [SamplingParams()] * len(keys),
                                        [None] * len(keys))
        except OutOfBlocksError:  # pragma: no cover - the failure this test is about
            pytest.fail("the drafter ran out of blocks instead of drafting less")
        for key, (d, _) in zip(keys, proposals):
            assert d == greedy(draft, seqs[key], 3)[:len(d)]
            seqs[key] = seqs[key] + d[:rng.randint(0, len(d))] + [rng.randrange(4)]
            if len(seqs[key]) > 20:
                seqs[key] = seqs[key][:3]
        assert drafter.cache.allocator.num_used() == sum(len(s.block_table) for s in drafter.states.values())
    for key in list(drafter.states):
        drafter.release(key)
    assert drafter.cache.allocator.num_used() == 0


# ----------------------------------------------------------------------------------------- 6. prompt lookup

def ngram_oracle(ids, k, max_n=3, min_n=1):
    """Brute force: for n from max_n down, every earlier window equal to the last n tokens that has a token
    after it; the most recent one wins; up to k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[len(ids) - n:]
        hits = [s for s in range(len(ids) - n) if ids[s:s + n] == suffix]  # s + n < len(ids): a token follows
        if hits:
            s = max(hits)
            return ids[s + n:s + n + k]
    return []


def test_propose_ngram_cases():
    assert propose_ngram([], 3) == [] and propose_ngram([5], 3) == []
    assert propose_ngram([1, 2, 3, 1, 2], 2) == [3, 1]
    assert propose_ngram([1, 2, 9, 3, 2, 7, 1, 2], 3) == [9, 3, 2]  # a longer match beats a more recent one
    assert propose_ngram([1, 5, 1, 6, 1], 1) == [6]  # the most recent occurrence
    assert propose_ngram([7, 7, 7], 3) == [7]  # an overlapping match; only one token follows it
    assert propose_ngram([1, 2, 3, 4, 5, 1], 2) == [2, 3]  # at most k
    assert propose_ngram([1, 2, 3, 1], 3, min_n=2) == []  # only a 1-gram matches
    assert propose_ngram([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose_ngram([4, 1, 2, 3, 1, 2, 3], 4, max_n=1) == [1, 2, 3]  # 1-grams only: the '3' at index 3
    drafter = NgramDrafter(max_n=2, min_n=1)
    assert drafter.propose([("a", [1, 2, 3, 1, 2], 2), ("b", [1], 2)]) == [([3, 1], None), ([], None)]
    drafter.release("a")


@settings(max_examples=300)
@given(ids=st.lists(st.integers(0, 3), max_size=30), k=st.integers(0, 6), max_n=st.integers(1, 4),
       min_n=st.integers(1, 4))
def test_propose_ngram_matches_brute_force(ids, k, max_n, min_n):
    min_n = min(min_n, max_n)
    got = propose_ngram(ids, k, max_n, min_n)
    assert got == ngram_oracle(ids, k, max_n, min_n)
    assert len(got) <= k


# ------------------------------------------------------------------------------------------ 7. the numbers

def test_expected_tokens_per_step_matches_simulation():
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    for k in (1, 2, 4, 7):
        for a in (0.0, 0.3, 0.6, 0.9, 1.0):
            closed = sum(a ** i for i in range(k + 1))  # 1 + a + ... + a^k
            assert expected_tokens_per_step(a, k) == pytest.approx(closed, rel=1e-12, abs=1e-12)
            # drafts accepted until the first miss, + the correction or bonus token
            tokens = (torch.rand(n, k, generator=gen) < a).int().cumprod(dim=1).sum(dim=1).double() + 1
            se = float(tokens.std()) / math.sqrt(n)
            assert abs(float(tokens.mean()) - expected_tokens_per_step(a, k)) <= 5 * se + 1e-9
    assert expected_tokens_per_step(1.0, 4) == 5.0 and expected_tokens_per_step(0.0, 4) == 1.0


def test_spec_stats_definitions():
    stats = SpecStats()
    assert math.isnan(stats.acceptance_rate) and math.isnan(stats.accepted_fraction)
    assert math.isnan(stats.tokens_per_step)
    stats.record(4, 4, 5)  # all accepted + bonus
    stats.record(4, 1, 2)  # 1 accepted, rejected at the 2nd (the last 2 never checked)
    stats.record(0, 0, 1)  # nothing proposed: a plain decode step
    stats.record(3, 0, 1)  # the first draft rejected
    assert (stats.steps, stats.proposed, stats.accepted, stats.rejected, stats.emitted) == (4, 11, 5, 2, 9)
    assert stats.acceptance_rate == pytest.approx(5 / 7)  # accepted / (accepted + rejecting steps)
    assert stats.accepted_fraction == pytest.approx(5 / 11)
    assert stats.tokens_per_step == pytest.approx(9 / 4)
    # acceptance_rate estimates the `a` of expected_tokens_per_step: simulate independent acceptances
    rng, sim, a, k = random.Random(0), SpecStats(), 0.7, 4
    for _ in range(20000):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        sim.record(k, n, n + 1)
    assert sim.acceptance_rate == pytest.approx(a, abs=0.01)
    assert sim.tokens_per_step == pytest.approx(expected_tokens_per_step(a, k), abs=0.03)


# ------------------------------------------------------------------------------------------- 8. bad input

class _Stub:
    def __init__(self, vocab_size, device):
        self.config = type("Cfg", (), {"vocab_size": vocab_size})()
        self.device = torch.device(device)


def test_bad_configs_are_refused(target):
    for k in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"k \(draft tokens per step\) must be an integer >= 1"):
            SpeculativeConfig(k=k)
    with pytest.raises(ValueError, match="unknown speculative method 'medusa'"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="method='draft' needs draft_model"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="max_batch"):
        SpeculativeConfig(max_batch=-1)
    for bad in (0, 3, -1):
        with pytest.raises(ValueError, match=r"exit_layer must be in 1\.\.2"):
            make_drafter(SpeculativeConfig("early_exit", exit_layer=bad), target)
    with pytest.raises(ValueError, match="n_layers"):
        ModelDrafter(target, 4)
    for max_n, min_n in ((1, 2), (2, 0)):
        with pytest.raises(ValueError, match="min_n"):
            NgramDrafter(max_n=max_n, min_n=min_n)


def test_draft_must_match_vocabulary_and_device(target):
    cfg = ModelConfig.tiny(vocab_size=VOCAB + 1, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=1,
                           max_seq_len=CTX)
    other_vocab = Transformer(cfg).eval()
    with pytest.raises(ValueError, match="vocabulary has 65 tokens, the target's 64"):
        make_drafter(SpeculativeConfig("draft", draft_model=other_vocab), target)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, None, [1, 2], 4, speculative=SpeculativeConfig("draft", draft_model=other_vocab))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM.from_model(target, num_blocks=8, speculative=SpeculativeConfig("draft", draft_model=other_vocab))
    drafter = ModelDrafter(target, 1, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="draft model is on cpu, the target on meta"):
        drafter.check_target(_Stub(VOCAB, "meta"))
    drafter.check_target(_Stub(VOCAB, "cpu"))  # same vocabulary, same device: fine
    with torch.device("meta"):
        on_meta = Transformer(tiny_cfg(1))
    with pytest.raises(ValueError, match="on meta, the target on cpu"):
        make_drafter(SpeculativeConfig("draft", draft_model=on_meta), target, num_blocks=2)


def test_draft_with_a_shorter_context_than_the_target(target):
    """Either refused up front with a clear error, or it simply stops drafting past its own window."""
    cfg = ModelConfig.tiny(vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=1,
                           max_seq_len=32, tie_embeddings=False)
    short_context = Transformer(cfg).eval()
    prompt = [1, 2] * 20  # 40 tokens: past the draft's 32
    try:
        out = generate(target, None, prompt, 10, speculative=SpeculativeConfig("draft", k=3,
                                                                               draft_model=short_context))
    except ValueError as e:
        assert "context" in str(e) or "max_seq_len" in str(e)
    else:
        assert out.token_ids == greedy(target, prompt, 10)


def test_bad_generate_and_engine_arguments(target):
    spec = SpeculativeConfig("ngram", k=4)
    with pytest.raises(ValueError, match="lower k"):
        generate(target, None, [1] * (CTX - 4), 10, speculative=spec)  # 4 slots left: not enough for k=4 + 1
    generate(target, None, [1] * (CTX - 5), 10, speculative=spec)  # 5 slots: fits
    with pytest.raises(ValueError, match="lower k"):
        check_budget(4, CTX - 4, CTX)
    with pytest.raises(ValueError, match="cache='contiguous' or 'paged'"):
        generate(target, None, [1, 2], 4, cache="none", speculative=spec)
    with pytest.raises(ValueError, match="compile=True"):
        generate(target, None, [1, 2], 4, compile=True, speculative=spec)
    with pytest.raises(TypeError, match="SpeculativeConfig, got dict"):
        generate(target, None, [1, 2], 4, speculative={"method": "ngram", "k": 4})
    with pytest.raises(TypeError, match="SpeculativeConfig, got str"):
        LLM.from_model(target, num_blocks=8, speculative="ngram")
    with pytest.raises(ValueError, match="unknown cache"):
        generate(target, None, [1, 2], 4, cache="ring", speculative=spec)


# ------------------------------------------------------------------------------------------ 9. the real model

PARAGRAPH = ("The lighthouse stood at the edge of the island for two hundred years. Every night its keeper "
             "climbed the narrow stairs to light the lamp, and every morning he wrote the weather in a small "
             "blue book.")
COPY_TEXTS = [
    (PARAGRAPH, 40),
    ("Paris is the capital of France. Rome is the capital of Italy. Madrid is the capital of Spain.", 24),
    ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b", 24),
]


@pytest.fixture(scope="module")
def copy_task(real_model):
    """Input-grounded chat prompts (the model copies its input: prompt lookup's best case) and their
    target-only greedy outputs, computed once for the two tests below."""
    model, tok = real_model
    prompts = [tok.encode_chat([{"role": "user", "content": "Repeat the following text exactly.\n\n" + text}])
               for text, _ in COPY_TEXTS]
    params = [SamplingParams(max_tokens=n) for _, n in COPY_TEXTS]
    return prompts, params, [solo(model, p, sp, tok.stop_ids) for p, sp in zip(prompts, params)]


def test_real_model_ngram_greedy_equals_plain_and_accepts_most(real_model, copy_task):
    model, tok = real_model
    prompts, _, refs = copy_task
    stats = SpecStats()
    out = generate(model, tok, prompts[0], max_new_tokens=40, speculative=SpeculativeConfig("ngram", k=4),
                   spec_stats=stats)
    assert out.token_ids == refs[0] and len(out.token_ids) == 40
    assert out.text.startswith("The lighthouse stood at the edge of the island")  # the copy task works
    assert stats.acceptance_rate > 0.5, stats
    assert stats.steps < len(out.token_ids) - 1, stats


def test_real_model_engine_with_ngram_equals_solo(real_model, copy_task):
    model, tok = real_model
    prompts, params, refs = copy_task
    # a 96-token budget splits the ~80-token prompts into chunks next to the others' speculative decodes
    llm = LLM.from_model(model, tok, num_blocks=48, block_size=16, max_num_seqs=4, max_num_batched_tokens=96,
                         speculative=SpeculativeConfig("ngram", k=4))
    outs = run_engine(llm, prompts, params)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, i
    assert llm.spec_stats.accepted > 0
    assert any(s["num_decodes"] > 1 and s["num_draft_tokens"] > 0 for s in llm.step_log)  # batched verifies
    assert llm.num_free_blocks() == 48


# ------------------------------------------------------------------------------------- the learned draft head


def test_learned_drafter_bad_input_and_bookkeeping(target, tmp_path):
    from minillm.speculative.learned import load_draft_head, save_draft_head

    head = learned_head(target)
    drafter = LearnedDrafter(target, head)
    assert drafter.propose([("a", [1, 2, 3], 3)], [SamplingParams()], [None]) == [([], None)]  # no features yet
    with torch.inference_mode():
        target(torch.tensor([[1, 2, 3]]))
    with pytest.raises(RuntimeError, match="feature rows"):
        drafter.observe([("a", 0, 2)])  # the forward produced 3 rows
    with torch.inference_mode():
        target(torch.tensor([[1, 2, 3]]))
    drafter.observe([("a", 0, 3)])
    (draft, q), = drafter.propose([("a", [1, 2, 3, 4], 3)], [SamplingParams()], [None])
    assert len(draft) == 3 and q is None and all(int(t) in head.vocab_ids.tolist() for t in draft)
    lengths = {}  # the gate: 0 drafts every k, near 1 drafts nothing, GATE something in between
    for gate in (0.0, GATE, 0.999):
        gated = LearnedDrafter(target, head, min_confidence=gate)
        rng = random.Random(4)
        seqs = [small_alphabet_prompt(rng, 4, 10) for _ in range(24)]
        with torch.inference_mode():
            for j, ids in enumerate(seqs):
                target(torch.tensor([ids]))
                gated.observe([(str(j), 0, len(ids))])
        props = gated.propose([(str(j), ids + [ids[-1]], 3) for j, ids in enumerate(seqs)],
                              [SamplingParams()] * len(seqs), [None] * len(seqs))
        lengths[gate] = [len(d) for d, _ in props]
        with torch.inference_mode():
            f0 = torch.stack([gated.features[str(j)][1][len(ids) - 1] for j, ids in enumerate(seqs)])
            p1 = torch.softmax(head(f0, torch.tensor([ids[-1] for ids in seqs]))[1].float(), -1).amax(-1)
        assert [n > 0 for n in lengths[gate]] == (p1 >= gate).tolist() if gate else all(n == 3 for n in lengths[gate])
    assert set(lengths[0.999]) == {0} and len(set(lengths[GATE])) > 1, lengths
    with pytest.raises(ValueError, match="min_confidence"):
        LearnedDrafter(target, head, min_confidence=1.0)
    drafter.release("a")
    assert not drafter.features
    path = tmp_path / "head.pt"
    save_draft_head(head, path, {"note": "test"})
    again = load_draft_head(path).bind(target)
    f, t = torch.randn(2, target.config.dim), torch.tensor([1, 2])
    torch.testing.assert_close(again(f, t)[1], head(f, t)[1], rtol=2e-2, atol=2e-2)  # fp16 on disk
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="sha256"):
        load_draft_head(path)
    with pytest.raises(FileNotFoundError, match="small_model drafter"):
        load_draft_head(tmp_path / "missing.pt")
    seqs = [[1, 2, 3, 4, 5], [3, 1], [2, 2, 2, 4, 1, 0, 3]]  # batched and padded == one at a time, unpadded
    batched = target_features(target, seqs, autocast=False, first=[2, 0, 3], batch=2)
    for i, ids in enumerate(seqs):
        one = target_features(target, [ids], autocast=False)
        torch.testing.assert_close(batched["features"][batched["seq"] == i].float(), one["features"].float(),
                                   rtol=2e-2, atol=2e-2)
        assert torch.equal(batched["tokens"][batched["seq"] == i], torch.tensor(ids))
    assert batched["use"].tolist() == [False, False, True, True, True, True, True, False, False, False, True, True,
                                       True, True]
    wide = Transformer(tiny_cfg(1).with_(dim=48, n_heads=4, n_kv_heads=2))
    with pytest.raises(ValueError, match="wide target"):
        DraftHead(target.config.dim, 64, head.vocab_ids).bind(wide)


def test_draft_head_training_regularisers(target):
    """concat keeps sequences apart (no start crosses from one part into the next); early stopping returns the
    head of the best held-out score it saw, and that score is what guess_accuracy measures on the returned head;
    noise is drawn from the seeded generator (two runs agree) and changes what is learned."""
    from minillm.speculative.train_drafter import concat, expected_tokens, guess_accuracy, valid_starts

    rng = random.Random(3)
    seqs = [small_alphabet_prompt(rng, 3, 6) + greedy(target, small_alphabet_prompt(rng, 3, 6), 20) for _ in range(8)]
    a = target_features(target, seqs[:4], autocast=False)
    b = target_features(target, seqs[4:], autocast=False)
    both = concat(a, b)
    assert both["seq"].unique().numel() == 8 and both["tokens"].numel() == a["tokens"].numel() + b["tokens"].numel()
    starts = valid_starts(both, 3)
    assert torch.equal(both["seq"][starts], both["seq"][starts + 4])
    vocab, _ = choose_vocab(both["choice"], 48, [])

    def fit(noise, seed=0):
        torch.manual_seed(5)
        head = DraftHead(target.config.dim, 64, vocab).bind(target)
        hist = train_draft_head(head, a, steps=40, batch=128, lr=1e-2, autocast=False, noise=noise,
                                weight_decay=0.1, eval_data=b, eval_every=10, seed=seed)
        return head, hist

    head, hist = fit(0.2)
    scores = [h["eval_tokens_per_step"] for h in hist if "step" in h and "eval_tokens_per_step" in h]
    assert len(scores) == 4 and hist[-1]["eval_tokens_per_step"] == max(scores)
    assert hist[-1]["best_step"] == 10 * (scores.index(max(scores)) + 1)
    assert expected_tokens(guess_accuracy(head, b)) == pytest.approx(max(scores))
    again, hist2 = fit(0.2)
    assert [h.get("loss") for h in hist2] == [h.get("loss") for h in hist]
    _, plain = fit(0.0)
    assert [h.get("loss") for h in plain] != [h.get("loss") for h in hist]


def test_shipped_draft_head_keeps_the_real_targets_greedy_output(real_model):
    """The head in minillm/assets drafts for SmolLM2: greedy output equals target-only, and it is accepted far more
    often than chance (an untrained head: ~0)."""
    assert_learned_drafts_keep_greedy_output(*real_model)


def assert_learned_drafts_keep_greedy_output(model, tok) -> None:
    """The shipped head drafting for `model`: greedy output equals target-only, accepted far above chance."""
    ids = tok.encode_chat([{"role": "user", "content": "Give me three tips for staying healthy."}])
    stats = SpecStats()
    out = generate(model, tok, ids, max_new_tokens=24, ignore_eos=True, speculative=SpeculativeConfig("learned", k=3),
                   spec_stats=stats)
    assert out.token_ids == generate(model, tok, ids, max_new_tokens=24, ignore_eos=True).token_ids
    assert stats.acceptance_rate > 0.15, stats


def test_beside_a_low_bit_target_the_head_runs_in_int8_and_keeps_greedy_output():
    """A 4-bit target on the native step: the drafter's head is an int8 copy (its float32 weights were a third of
    the bytes of a target step), its guesses agree with the float head's on most steps, and greedy output is still
    the target's own."""
    from minillm.api import load_model
    from minillm.compress.quant import Int8Linear
    from minillm.speculative.learned import load_draft_head

    model, tok = load_model("smollm2-135m", dtype="float32", weights="q4", native="auto")
    drafter = LearnedDrafter(model, load_draft_head())
    assert isinstance(drafter.head.fc, Int8Linear) and drafter.head.head_int8 is not None
    float_head = load_draft_head().bind(model)
    f, tokens = torch.randn(16, model.config.dim), torch.randint(0, model.config.vocab_size, (16,))
    with torch.inference_mode():
        agree = (drafter.head(f, tokens)[1].argmax(-1) == float_head(f, tokens)[1].argmax(-1)).float().mean()
    assert agree >= 0.75, f"the int8 head's first guess agrees with the float head's on {agree:.0%} of rows"
    assert_learned_drafts_keep_greedy_output(model, tok)


def test_beside_a_native_float32_target_the_head_runs_in_int8_and_beside_eager_in_float32(real_model):
    """The int8 copy follows the target's step, not its weights: a float32 target on the native step (a decode step
    of ~20 ms, the head's float32 guess 1.4 ms of it) gets the int8 head, the eager float32 target keeps the float
    head it was trained as; greedy output is the target's own with either."""
    from minillm.api import load_model
    from minillm.compress.quant import Int8Linear
    from minillm.speculative.learned import load_draft_head

    eager, _ = real_model
    assert not isinstance(LearnedDrafter(eager, load_draft_head()).head.fc, Int8Linear)
    model, tok = load_model("smollm2-135m", dtype="float32", native="auto")
    if model.native_step is None:
        pytest.skip("the native step is not built on this machine")
    head = LearnedDrafter(model, load_draft_head()).head
    assert isinstance(head.fc, Int8Linear)
    assert head.info["sha256"] == load_draft_head().info["sha256"]  # the copy still says which head it is
    assert_learned_drafts_keep_greedy_output(model, tok)

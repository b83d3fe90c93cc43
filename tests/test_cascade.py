"""The model cascade (minillm/cluster/cascade.py, lesson 13): confidence signals, the threshold's two ends (0 =
always-small, 1 = always-large, answers and costs), the sweep against a per-request simulation, the entropy hook
against a teacher-forced forward, and clear errors for bad input. Oracles: the engine run on one model alone, a full
forward."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minillm.cluster.cascade import (
    SIGNALS,
    Cascade,
    Outcome,
    analytic_flops,
    answer_kl,
    check_pair,
    common_prefix,
    default_thresholds,
    entropy_confidence,
    escalates,
    mean_logprob_confidence,
    min_prob_confidence,
    outcomes,
    sweep,
    token_entropy,
)
from minillm.engine import LLM
from minillm.sampling import SamplingParams
from minillm.speculative.drafters import early_exit_model
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 8, 7, 6, 5], [100, 200, 300], [42], [7, 7, 7, 7, 7, 7]]
PARAMS = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def pair():
    # untied heads: a random tied model repeats its input token with probability ~1, every confidence would be 1
    large = tiny_model(0, n_layers=4, tie_embeddings=False)
    return tiny_model(1, tie_embeddings=False), large


@pytest.fixture(scope="module")
def both(pair):
    small, large = pair
    cascade = Cascade(small, large, None, threshold=0.5)
    return cascade, cascade.answer("small", PROMPTS, PARAMS), cascade.answer("large", PROMPTS, PARAMS)


def engine_alone(model, prompts) -> list[list[int]]:
    return [o.token_ids for o in LLM.from_model(model, None, num_blocks=32).generate(prompts, PARAMS)]


# ------------------------------------------------------------------------------------------ confidence signals

logprobs_st = st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=20)


@given(logprobs_st, st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20))
def test_signals_are_in_unit_interval(logprobs, entropies):
    for c in (mean_logprob_confidence(logprobs), min_prob_confidence(logprobs), entropy_confidence(entropies)):
        assert 0.0 <= c <= 1.0
    assert min_prob_confidence(logprobs) <= mean_logprob_confidence(logprobs) + 1e-12  # min <= geometric mean


@given(logprobs_st, st.integers(0, 19), st.floats(0.0, 10.0))
def test_signals_rise_with_the_tokens_probability(logprobs, i, gain):
    i %= len(logprobs)
    better = list(logprobs)
    better[i] = min(0.0, better[i] + gain)
    assert mean_logprob_confidence(better) >= mean_logprob_confidence(logprobs) - 1e-12
    assert min_prob_confidence(better) >= min_prob_confidence(logprobs)
    surer = [e * 0.5 for e in (-lp / 30 for lp in logprobs)]  # lower entropies -> higher confidence
    assert entropy_confidence(surer) >= entropy_confidence([-lp / 30 for lp in logprobs]) - 1e-12


def test_one_hot_is_certain_and_uniform_is_not():
    one_hot = torch.full((2, 50), -1e4)
    one_hot[0, 3] = one_hot[1, 7] = 0.0
    assert token_entropy(one_hot).tolist() == [0.0, 0.0]
    assert entropy_confidence(token_entropy(one_hot).tolist()) == 1.0
    assert mean_logprob_confidence([0.0, 0.0]) == min_prob_confidence([0.0]) == 1.0
    uniform = torch.zeros(1, 50)
    assert token_entropy(uniform).item() == pytest.approx(1.0)
    assert entropy_confidence(token_entropy(uniform).tolist()) == pytest.approx(0.0, abs=1e-6)


@given(st.floats(0.0, 1.0))
def test_threshold_ends(confidence):
    assert not escalates(confidence, 0.0)  # always-small
    assert escalates(confidence, 1.0)  # always-large, a confidence of exactly 1.0 included
    assert escalates(1.0, 1.0)


# -------------------------------------------------------------------------------------------- the pure sweep

outcome_st = st.builds(Outcome, confidence=st.floats(0.0, 1.0), exact=st.booleans(), prefix=st.floats(0.0, 1.0),
                       small_seconds=st.floats(0.01, 5.0), large_seconds=st.floats(0.01, 5.0),
                       small_flops=st.floats(1.0, 1e9), large_flops=st.floats(1.0, 1e9), kl=st.floats(0.0, 5.0))


@given(st.lists(outcome_st, min_size=1, max_size=30), st.lists(st.floats(0.0, 1.0), max_size=10))
def test_sweep_is_monotone_and_its_ends_are_the_baselines(results, extra):
    results = [Outcome(**{**r.__dict__, "prefix": 1.0 if r.exact else min(r.prefix, 0.99)}) for r in results]
    thresholds = sorted({*default_thresholds([r.confidence for r in results]), *extra})
    curve = sweep(results, thresholds)
    n = len(results)
    for a, b in itertools.pairwise(curve):
        assert a["escalation_rate"] <= b["escalation_rate"]
        assert a["agreement"] <= b["agreement"] + 1e-12
        assert a["prefix_agreement"] <= b["prefix_agreement"] + 1e-12
        if b["threshold"] < 1.0:  # below 1, escalating more always costs more
            assert a["seconds"] <= b["seconds"] + 1e-9 and a["flops"] <= b["flops"] * (1 + 1e-12)
    small_end, large_end = curve[0], curve[-1]
    assert small_end["threshold"] == 0.0 and large_end["threshold"] == 1.0
    assert small_end["escalation_rate"] == 0.0
    assert small_end["agreement"] == pytest.approx(sum(r.exact for r in results) / n)
    assert small_end["seconds"] == pytest.approx(sum(r.small_seconds for r in results) / n)
    assert large_end["escalation_rate"] == 1.0 and large_end["agreement"] == 1.0 and large_end["kl"] == 0.0
    assert large_end["seconds"] == pytest.approx(sum(r.large_seconds for r in results) / n)  # no small run
    assert large_end["seconds_ratio"] == pytest.approx(1.0) and large_end["flops_ratio"] == pytest.approx(1.0)


@given(st.lists(outcome_st, min_size=1, max_size=20), st.floats(0.0, 1.0))
def test_sweep_matches_a_per_request_simulation(results, t):
    (point,) = sweep(results, [t])
    cost = agree = 0.0
    for r in results:  # what a cascade would have done, one request at a time
        ran_small = t < 1.0
        go_large = not ran_small or r.confidence < t
        cost += (r.small_seconds if ran_small else 0.0) + (r.large_seconds if go_large else 0.0)
        agree += 1.0 if go_large else float(r.exact)
    assert point["seconds"] == pytest.approx(cost / len(results))
    assert point["agreement"] == pytest.approx(agree / len(results))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


# -------------------------------------------------------------------------------------------- a tiny model pair


def test_threshold_zero_is_always_small(pair, both):
    small, large = pair
    _, small_answers, _ = both
    results = Cascade(small, large, None, threshold=0.0).generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == engine_alone(small, PROMPTS)
    assert all(r.answered_by == "small" and r.large is None and not r.escalated for r in results)
    assert [r.flops for r in results] == [a.flops for a in small_answers]
    assert all(0.0 <= r.confidence <= 1.0 and r.seconds == r.small.seconds for r in results)


@pytest.mark.parametrize("signal", SIGNALS)
def test_threshold_one_is_always_large(pair, both, signal):
    small, large = pair
    _, _, large_answers = both
    results = Cascade(small, large, None, signal=signal, threshold=1.0).generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == engine_alone(large, PROMPTS)
    assert all(r.answered_by == "large" and r.small is None and r.confidence is None for r in results)
    assert [r.flops for r in results] == [a.flops for a in large_answers]  # the small model never ran


def test_same_model_twice_always_agrees(pair):
    small, _ = pair
    c = Cascade(small, small, None, threshold=0.0)
    a, b = c.answer("small", PROMPTS[:3], PARAMS), c.answer("large", PROMPTS[:3], PARAMS)
    curve = sweep(outcomes(a, b, "mean_logprob", [answer_kl(small, small, p, x.token_ids) for p, x in
                                                    zip(PROMPTS, b)]), [0.0])
    assert curve[0]["agreement"] == 1.0 and curve[0]["prefix_agreement"] == 1.0
    assert curve[0]["kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("signal", SIGNALS)
def test_cascade_picks_what_the_sweep_predicts(pair, both, signal):
    small, large = pair
    _, small_answers, large_answers = both
    confidences = sorted(a.confidence(signal) for a in small_answers)
    t = confidences[len(confidences) // 2]  # escalates about half
    results = Cascade(small, large, None, signal=signal, threshold=t).generate(PROMPTS, PARAMS)
    for r, s, big in zip(results, small_answers, large_answers):
        assert r.confidence == s.confidence(signal)
        assert r.escalated == (s.confidence(signal) < t)
        assert r.token_ids == (big.token_ids if r.escalated else s.token_ids)
        assert r.flops == s.flops + (big.flops if r.escalated else 0)
    (point,) = sweep(outcomes(small_answers, large_answers, signal), [t])
    assert point["escalation_rate"] == sum(r.escalated for r in results) / len(results)
    assert point["flops"] == pytest.approx(sum(r.flops for r in results) / len(results))


@torch.inference_mode()
def test_recorded_logprobs_and_entropies_match_a_full_forward(pair, both):
    small, _ = pair
    _, small_answers, _ = both
    for prompt, a in zip(PROMPTS, small_answers):
        ids = torch.tensor([prompt + a.token_ids[:-1]])
        logits = small(ids)[0, len(prompt) - 1:]  # the rows that predicted each answer token
        logp = logits.float().log_softmax(-1)
        assert a.token_ids == logits.argmax(-1).tolist()  # greedy
        torch.testing.assert_close(torch.tensor(a.logprobs), logp.gather(1, torch.tensor(a.token_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(a.entropies), token_entropy(logits), atol=1e-4, rtol=1e-4)
        assert a.confidence("mean_logprob") == pytest.approx(math.exp(sum(a.logprobs) / len(a.logprobs)))


def test_analytic_flops_counts_parameters_times_tokens(pair, both):
    small, _ = pair
    cfg = small.config
    params = sum(p.numel() for p in small.parameters())
    head = cfg.vocab_size * cfg.dim
    body = params - 2 * head  # untied: the embedding lookup and the head are both left out of the body
    assert analytic_flops(cfg, 4, 1) == 2 * (body * 4 + head)
    assert analytic_flops(cfg, 4, 3) == 2 * (body * 6 + head * 3)
    _, small_answers, _ = both
    assert [a.flops for a in small_answers] == [analytic_flops(cfg, len(p), len(a.token_ids))
                                                 for p, a in zip(PROMPTS, small_answers)]


@torch.inference_mode()
def test_early_exit_stand_in_is_the_targets_first_blocks():
    target = tiny_model(3, n_layers=4)
    small = early_exit_model(target, 2)
    ids = torch.tensor([[5, 9, 2, 7]])
    h = target.run_layers(target.embed_tokens(ids), torch.arange(4)[None], layers=slice(0, 2))
    torch.testing.assert_close(small(ids), target.logits(h))
    assert small.embed.weight is target.embed.weight and len(target.layers) == 4


# ------------------------------------------------------------------------------------------------ bad input


class FakeTokenizer:
    def __init__(self, pieces: list[bytes]):
        self.pieces, self.special_tokens, self.stop_ids = pieces, {}, frozenset()

    def __len__(self):
        return len(self.pieces)

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]


def test_bad_input_is_refused_clearly(pair):
    small, large = pair
    with pytest.raises(ValueError, match="threshold"):
        Cascade(small, large, threshold=1.5)
    for bad in (-0.1, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="threshold"):
            sweep([Outcome(0.5, True, 1.0, 1, 1, 1, 1)], [bad])
    with pytest.raises(ValueError, match="unknown confidence signal"):
        Cascade(small, large, signal="vibes")
    with pytest.raises(ValueError, match="vocabulary"):
        Cascade(tiny_model(0, vocab_size=256), large)
    pieces = [bytes([i % 256, i // 256]) for i in range(512)]
    other = list(pieces)
    other[7] = b"x"
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_pair(small, large, FakeTokenizer(pieces), small_tokenizer=FakeTokenizer(other))
    check_pair(small, large, FakeTokenizer(pieces), small_tokenizer=FakeTokenizer(list(pieces)))  # equal: fine
    with pytest.raises(ValueError, match="tokenizer has 300 tokens"):
        check_pair(small, large, FakeTokenizer(pieces[:300]))
    cascade = Cascade(small, large)
    with pytest.raises(ValueError, match="greedy"):
        cascade.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.7))
    with pytest.raises(TypeError, match="list of prompts"):
        cascade.generate([1, 2, 3], PARAMS)
    with pytest.raises(ValueError, match="'small' or 'large'"):
        cascade.answer("medium", PROMPTS[:1], PARAMS)
    with pytest.raises(ValueError, match="at least one"):
        mean_logprob_confidence([])
    with pytest.raises(ValueError, match="same prompts"):
        outcomes([], [None], "min_prob")


def test_caller_params_are_not_changed(pair):
    small, large = pair
    params = SamplingParams(max_tokens=2)
    Cascade(small, large, threshold=0.5).generate(PROMPTS[:1], params)
    assert params.logprobs is False


# ------------------------------------------------------------------------------------------------ real models


@pytest.mark.slow
def test_real_pair_ends_match_the_engine(real_model):
    from minillm.cluster.cascade import load_small

    large, tok = real_model
    small, description = load_small(large)
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in ("What is the capital of France?",
                                                                          "What is 2 + 2?")]
    params = SamplingParams(max_tokens=10)
    always_small = Cascade(small, large, tok, threshold=0.0).generate(prompts, params)
    always_large = Cascade(small, large, tok, threshold=1.0).generate(prompts, params)
    alone = LLM.from_model(large, tok, kv_cache_bytes=32 << 20).generate(prompts, params)
    assert [r.token_ids for r in always_large] == [o.token_ids for o in alone]
    assert always_large[0].text == "The capital of France is Paris."
    alone_small = LLM.from_model(small, tok, kv_cache_bytes=32 << 20).generate(prompts, params)
    assert [r.token_ids for r in always_small] == [o.token_ids for o in alone_small], description
    for r in always_small:
        assert all(0.0 <= r.small.confidence(s) <= 1.0 for s in SIGNALS)

"""Routing a mixed workload to the specialist (minillm/cluster/domain_router.py, lesson 13): the classifier learns
and is deterministic; the routed cascade's answers equal the chosen model's own (oracle: each engine run alone),
its routes follow the classifier and the early confidence it reports; the policy arithmetic against a direct
per-request simulation; bad input."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minillm.cluster.domain_router import (
    DomainClassifier,
    Measured,
    RoutedCascade,
    early_confidence,
    mixed,
    policy_cost,
)
from minillm.engine import LLM
from minillm.sampling import SamplingParams
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 8, 7, 6, 5], [100, 200, 300], [42], [7, 7, 7, 7, 7, 7]]
PARAMS = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def pair():
    return tiny_model(1, tie_embeddings=False), tiny_model(0, n_layers=4, tie_embeddings=False)


def alone(model, prompts, logprobs=False):
    return LLM.from_model(model, None, num_blocks=32).generate(
        prompts, SamplingParams(max_tokens=6, logprobs=logprobs))


def _kinds(rng: random.Random, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """In-domain prompts use tokens 10..19 and a marker bigram (3, 4); others tokens 20..60."""
    pos = [[3, 4] + [rng.randint(10, 19) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    neg = [[rng.randint(20, 60) for _ in range(rng.randint(2, 8))] for _ in range(n)]
    return pos, neg


def test_the_classifier_learns_the_domain_and_is_deterministic():
    pos, neg = _kinds(random.Random(0), 60)
    clf = DomainClassifier(256).fit(pos, neg)
    new_pos, new_neg = _kinds(random.Random(1), 30)  # prompts it never saw
    assert all(clf.score(p) > 0.5 for p in new_pos) and all(clf.score(p) < 0.5 for p in new_neg)
    again = DomainClassifier(256).fit(pos, neg)
    assert again.weight.equal(clf.weight) and again.bias == clf.bias
    assert 0.0 < clf.score([]) < 1.0  # an empty prompt: the bias alone


def test_classifier_features_are_presence_of_hashed_unigrams_and_bigrams():
    clf = DomainClassifier(64)
    x = clf.features([5, 5, 5, 9])
    assert set(x.unique().tolist()) <= {0.0, 1.0}
    assert 2 <= int(x.sum()) <= 4  # unigrams {5, 9}, bigrams {(5, 5), (5, 9)}, buckets may collide
    assert clf.features([1, 2]).equal(clf.features([1, 2]))
    assert not clf.features([1, 2]).equal(clf.features([2, 1]))  # order matters through the bigram


def test_early_confidence_is_the_least_likely_of_the_first_k_tokens():
    lps = [math.log(0.9), math.log(0.5), math.log(0.99), math.log(0.1)]
    assert early_confidence(lps, 1) == pytest.approx(0.9)
    assert early_confidence(lps, 3) == pytest.approx(0.5)
    assert early_confidence(lps, 4) == pytest.approx(0.1)
    assert early_confidence(lps, 10) == pytest.approx(0.1)  # a shorter answer: all of it
    with pytest.raises(ValueError, match="at least one generated token"):
        early_confidence([], 2)


def test_routes_at_their_ends_equal_one_model_alone(pair):
    small, large = pair
    want_small = [o.token_ids for o in alone(small, PROMPTS)]
    want_large = [o.token_ids for o in alone(large, PROMPTS)]
    clf = DomainClassifier(64).fit([[1]], [[2]])
    cases = [("prompt", 0.0, 0.5, want_small), ("prompt", 1.0, 0.5, want_large), ("early", 0.5, 0.0, want_small),
             ("early", 0.5, 1.0, want_large), ("both", 1.0, 0.0, want_large), ("both", 0.0, 0.0, want_small)]
    for route, pt, et, want in cases:
        got = RoutedCascade(small, large, None, route, clf, pt, et, k=2).generate(PROMPTS, PARAMS)
        assert [a.token_ids for a in got] == want, (route, pt, et)
        assert all(a.answered_by == ("small" if want is want_small else "large") for a in got)


def test_early_routing_follows_the_small_models_own_confidence(pair):
    small, large = pair
    ref_small = alone(small, PROMPTS, logprobs=True)
    ref_large = alone(large, PROMPTS)
    confs = [early_confidence(o.logprobs, 3) for o in ref_small]
    threshold = sorted(confs)[len(confs) // 2]  # about half escalate
    got = RoutedCascade(small, large, None, "early", early_threshold=threshold, k=3).generate(PROMPTS, PARAMS)
    assert {a.answered_by for a in got} == {"small", "large"}
    for a, s, g, c in zip(got, ref_small, ref_large, confs):
        assert a.early == pytest.approx(c, rel=1e-6)
        escalated = c < threshold
        assert a.answered_by == ("large" if escalated else "small")
        assert a.token_ids == (g.token_ids if escalated else s.token_ids)  # the chosen model's own answer
        assert a.small_tokens == (min(3, len(s.token_ids)) if escalated else len(s.token_ids))


def test_prompt_routing_follows_the_classifier(pair):
    small, large = pair
    clf = DomainClassifier(256).fit([[1, 2, 3, 4], [9, 8, 7, 6, 5]], [[5, 6, 7], [100, 200, 300], [42]])
    want_small, want_large = alone(small, PROMPTS), alone(large, PROMPTS)
    got = RoutedCascade(small, large, None, "prompt", clf).generate(PROMPTS, PARAMS)
    for p, a, s, g in zip(PROMPTS, got, want_small, want_large):
        assert a.prompt_score == pytest.approx(clf.score(p))
        assert a.token_ids == (s.token_ids if clf.score(p) >= 0.5 else g.token_ids)
        assert a.early is None and a.seconds > 0


measured = st.builds(Measured, st.booleans(), st.floats(0, 1), st.floats(0, 1), st.booleans(),
                     st.floats(0.01, 2), st.floats(0, 0.01), st.floats(0.01, 3))


@given(st.lists(measured, min_size=1, max_size=30), st.floats(0, 1), st.floats(0, 1),
       st.sampled_from(["prompt", "early", "both", "always_large", "always_small", "oracle"]))
def test_policy_cost_equals_a_direct_simulation(rows, pt, et, route):
    got = policy_cost(rows, route, pt, et)
    agree = secs = served = 0.0
    for r in rows:  # the request's path, written out
        if route == "always_large":
            path = "large"
        elif route == "always_small":
            path = "small"
        elif route == "oracle":
            path = "small" if r.agree else "large"
        elif route == "prompt":
            path = "small" if r.prompt_score >= pt else "large"
        else:
            gate = route == "early" or r.prompt_score >= pt
            path = "large" if not gate else ("late" if r.early < et or et >= 1 else "small")
        agree += r.agree if path == "small" else 1
        secs += {"small": r.small_s, "large": r.large_s, "late": r.small_k_s + r.large_s}[path]
        served += path == "small"
    n = len(rows)
    assert got["agreement"] == pytest.approx(agree / n)
    assert got["seconds"] == pytest.approx(secs / n)
    assert got["small_share"] == pytest.approx(served / n)
    assert got["cost_ratio"] == pytest.approx(secs / sum(r.large_s for r in rows))


def test_mixed_draws_the_share_in_proportion():
    a = [Measured(True, 1, 1, True, 1, 0, 2)] * 3
    b = [Measured(False, 0, 0, False, 1, 0, 2)] * 5
    m = mixed(a, b, 0.5, n=10)
    assert sum(r.in_domain for r in m) == 5 and len(m) == 10
    assert mixed(a, b, 0.0, 10) == b * 2 and mixed(a, [], 1.0, 4) == a + a[:1]
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\]"):
        mixed(a, b, 1.5)
    with pytest.raises(ValueError, match="measured requests of that kind"):
        mixed([], b, 0.5)


def test_bad_input(pair):
    small, large = pair
    clf = DomainClassifier(64).fit([[1]], [[2]])
    with pytest.raises(ValueError, match="unknown route 'fast'"):
        RoutedCascade(small, large, None, "fast")
    with pytest.raises(ValueError, match="needs a fitted DomainClassifier"):
        RoutedCascade(small, large, None, "prompt")
    with pytest.raises(ValueError, match="needs a fitted DomainClassifier"):
        RoutedCascade(small, large, None, "both", DomainClassifier(64))
    for k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k .* must be an int >= 1"):
            RoutedCascade(small, large, None, "early", k=k)
    with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\]"):
        RoutedCascade(small, large, None, "early", early_threshold=1.5)
    with pytest.raises(ValueError, match="temperature 0"):
        RoutedCascade(small, large, None, "prompt", clf).generate(PROMPTS, SamplingParams(temperature=0.8))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        RoutedCascade(small, large, None, "prompt", clf).generate(["hello"])
    with pytest.raises(RuntimeError, match="not fitted"):
        DomainClassifier(64).score([1])
    with pytest.raises(ValueError, match="both kinds"):
        DomainClassifier(64).fit([[1]], [])
    with pytest.raises(ValueError, match="buckets must be an int >= 16"):
        DomainClassifier(8)
    with pytest.raises(ValueError, match="unknown route"):
        policy_cost([Measured(True, 1, 1, True, 1, 0, 2)], "sometimes")
    with pytest.raises(ValueError, match="at least one measured request"):
        policy_cost([], "prompt")

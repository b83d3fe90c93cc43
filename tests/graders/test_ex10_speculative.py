"""Grader for exercise 10: greedy verification, the exact rejection-sampling rule and n-gram prompt lookup.

Everything is compared with oracles written here, not with minillm.speculative.decoding or
minillm.speculative.drafters. `greedy_oracle` is the acceptance loop; `ngram_oracle` lists every earlier occurrence of
every suffix and keeps the longest n's most recent one, on short sequences and on prompts of thousands of tokens whose
only match is far back (a search of a recent window passes every short case). Rejection sampling is graded on crafted
p and q whose outcomes are certain (q = p: everything passes; disjoint supports: nothing does; a token q over-covers
is never the replacement) and by its exact distribution: `outcome_oracle` walks every accept / reject branch of the
rule as the papers state it (Leviathan et al. 2023, Chen et al. 2023) and gives each outcome (first token, second
token, ...) its probability, and thousands of seeded calls must hit every outcome's probability within a Bernstein
bound that a correct rule exceeds with probability < 1e-6 (see `bernstein_tolerance`). The real-model task runs
SmolLM2 with n-gram speculation and your three functions swapped into minillm.speculative.decoding and
minillm.speculative.drafters.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import minillm
import minillm.speculative.drafters
import minillm.speculative.decoding
from minillm.speculative.decoding import SpecStats, SpeculativeConfig
from tests.graders.conftest import forbid_calls, load_impl
from tests.graders.real_model import one_thread, same_tokens

impl = load_impl("ex10_speculative")
LIBRARY = ["minillm", "speculative", "drafters"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def must_refuse(fn, *args, what: str, **kwargs) -> None:
    """fn(*args, **kwargs) must raise ValueError (a stub's NotImplementedError goes through unchanged)."""
    try:
        fn(*args, **kwargs)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as e:  # any other error is the wrong one: say which
        raise AssertionError(f"{what}: raised {type(e).__name__} ({e}); expected a ValueError that says what is "
                             f"wrong, raised before any work is done") from e
    raise AssertionError(f"{what}: returned without an error; expected ValueError")


def check_int_list(got, what: str) -> list[int]:
    assert isinstance(got, list) and all(type(t) is int for t in got), (
        f"{what}: return a list of Python ints (the decode loop appends them to the sequence), got "
        f"{type(got).__name__}" + (f" of {sorted({type(t).__name__ for t in got})}" if isinstance(got, list) else ""))
    return got


# =============================================================================================== task 10.greedy


def greedy_oracle(target_argmax: list[int], draft: list[int]) -> list[int]:
    out = []
    for i, d in enumerate(draft):
        if d != target_argmax[i]:
            return out + [target_argmax[i]]
        out.append(d)
    return out + [target_argmax[len(draft)]]


def greedy_hint(target_argmax: list[int], draft: list[int], got: list[int], want: list[int]) -> str:
    n = len(want) - 1  # accepted drafts
    matches = sum(d == t for d, t in zip(draft, target_argmax))
    shifted = 0
    while shifted < len(draft) and draft[shifted] == target_argmax[shifted + 1]:
        shifted += 1
    candidates = [
        (draft[:n], ("the accepted drafts alone: the target always adds one token of its own (the correction at "
                     "the first mismatch, or the bonus target_argmax[len(draft)] when every draft passed)")),
        (draft[:n + 1], "the rejected draft was kept: at the first mismatch the target's own token replaces it"),
        (draft[:matches] + [target_argmax[matches]],
         "every matching draft was counted, also those after the first mismatch: acceptance stops there"),
        (draft[:shifted] + [target_argmax[shifted]],
         ("draft[i] was compared with target_argmax[i + 1]: target_argmax[i] is the target's choice for "
          "draft[i]'s own position (after draft[:i])")),
    ]
    hits = [why for value, why in candidates if got == value and value != want]
    return f" = {hits[0]}" if hits else ""


def check_greedy(target_argmax: list[int], draft: list[int], what: str) -> None:
    ta_in, draft_in = list(target_argmax), list(draft)
    got = check_int_list(impl.verify_greedy(target_argmax, draft), what)
    want = greedy_oracle(ta_in, draft_in)
    assert target_argmax == ta_in and draft == draft_in, f"{what}: the arguments were changed in place"
    assert got == want, (f"{what}: verify_greedy(target_argmax={ta_in}, draft={draft_in}) returned {got}, expected "
                         f"{want}{greedy_hint(ta_in, draft_in, got, want)}")
    assert got is not draft, f"{what}: return a new list, not the draft itself"


@pytest.mark.task_10_greedy
def test_verify_greedy_named_cases():
    check_greedy([5, 6, 7, 8], [5, 6, 7], "every draft matches: the three drafts plus the bonus token")
    check_greedy([1, 2, 3], [9, 2], "the first draft is rejected (the second one would match): only the correction")
    check_greedy([4], [], "no drafts: the target's token alone")
    check_greedy([1, 2, 3, 4], [1, 9, 3], "a mismatch in the middle, a match after it")
    check_greedy([7, 7, 7, 7, 7], [7, 7, 7, 7], "a repeated token, all accepted")
    check_greedy([3, 1, 4, 1, 5], [3, 1, 4, 2], "only the last draft is rejected")
    check_greedy([2, 3, 4, 5], [3, 4, 5], "each draft equals the target's choice one position later (off by one)")
    check_greedy([0, 49151], [0], "token ids 0 and the vocabulary's last")
    forbid_calls(impl.verify_greedy, LIBRARY)


@st.composite
def greedy_case(draw):
    k = draw(st.integers(0, 8))
    alphabet = draw(st.integers(1, 3))  # few tokens: matches are common
    draft = draw(st.lists(st.integers(0, alphabet), min_size=k, max_size=k))
    if draw(st.booleans()):  # a target that mostly agrees, with a few flips
        flips = draw(st.lists(st.booleans(), min_size=k, max_size=k))
        target = [d if not f else (d + 1) % (alphabet + 1) for d, f in zip(draft, flips)]
        target.append(draw(st.integers(0, alphabet)))
    else:
        target = draw(st.lists(st.integers(0, alphabet), min_size=k + 1, max_size=k + 1))
    return target, draft


@pytest.mark.task_10_greedy
@settings(max_examples=150, deadline=None)
@given(case=greedy_case())
def test_verify_greedy_random(case):
    target, draft = case
    check_greedy(target, draft, f"{len(draft)} random drafts")


# ============================================================================================ task 10.rejection

# The rule, as a parameterised oracle: accept(p_x, q_x) is the chance a draft x passes, correction(p, q, x) the
# distribution the replacement is drawn from after x is rejected (q one-hot at x for a drafter without
# distribution). The named wrong rules below only serve the failure messages.


def _accept_exact(p_x: float, q_x: float) -> float:
    return min(1.0, p_x / q_x)


def _residual(p: list[float], q: list[float], x: int) -> list[float]:
    r = [max(0.0, a - b) for a, b in zip(p, q)]
    s = sum(r)
    return [v / s for v in r] if s > 0 else list(p)


def _from_p(p: list[float], q: list[float], x: int) -> list[float]:
    return list(p)


WRONG_RULES = {
    "the replacement drawn from p itself: it must come from the residual max(0, p - q) (renormalised), the mass "
    "that the accepted drafts have not already supplied": (_accept_exact, _from_p),
    "a draft accepted with probability p(x): the chance is min(1, p(x) / q(x))": (lambda p_x, q_x: p_x, _residual),
    "a draft accepted with probability min(1, q(x) / p(x)): the ratio is upside down":
        (lambda p_x, q_x: min(1.0, q_x / p_x) if p_x > 0 else 1.0, _residual),
    "a draft accepted exactly when p(x) >= q(x), with no uniform draw: below that it must still pass with "
    "probability p(x) / q(x)": (lambda p_x, q_x: float(p_x >= q_x), _residual),
}


def outcome_oracle(p: Tensor, q: Tensor | None, draft: list[int] | None = None, accept=_accept_exact,
                   correction=_residual, bonus: bool = True) -> dict[tuple[int, ...], float]:
    """{emitted tokens: probability}, in float64, for one call with drafts drawn from q's rows independently (or the
    fixed `draft` when q is None, a one-hot q)."""
    k = p.shape[0] - 1
    P = p.double().tolist()
    Q = q.double().tolist() if q is not None else None
    vocab = len(P[0])
    out: Counter = Counter()

    def walk(i: int, prefix: tuple[int, ...], w: float) -> None:
        if w == 0:
            return
        if i == k:
            if not bonus:
                out[prefix] += w
                return
            for c in range(vocab):
                out[prefix + (c,)] += w * P[k][c]
            return
        if Q is None:
            row = [0.0] * vocab
            row[draft[i]] = 1.0
            xs = [(draft[i], 1.0)]
        else:
            row = Q[i]
            xs = [(x, row[x]) for x in range(vocab) if row[x] > 0]
        for x, wx in xs:
            a = accept(P[i][x], row[x])
            walk(i + 1, prefix + (x,), w * wx * a)
            if a < 1:
                for y, r in enumerate(correction(P[i], row, x)):
                    out[prefix + (y,)] += w * wx * (1 - a) * r

    walk(0, (), 1.0)
    return dict(out)


def bernstein_tolerance(n: int, prob: float, n_events: int, delta: float) -> float:
    """A count of n independent trials with success probability prob strays from n * prob by more than this with
    probability < delta / n_events (Bernstein: P(|X - n p| >= t) <= 2 exp(-t^2 / (2 (n p (1 - p) + t / 3))), solved
    for t). A union bound over n_events events gives delta for all of them together. Exact for every n: no normal
    approximation, so it holds for rare outcomes too."""
    log_term = math.log(2 * n_events / delta)
    return log_term / 3 + math.sqrt(log_term**2 / 9 + 2 * log_term * n * prob * (1 - prob))


def call_rejection(p: Tensor, q: Tensor | None, draft: list[int], generator, what: str) -> list[int]:
    """One call, with the contract checked: a list of ints, the accepted drafts (a prefix of the draft) and one
    token, p and q untouched."""
    p_in, q_in = p.clone(), None if q is None else q.clone()
    got = check_int_list(impl.rejection_sample(p, q, list(draft), generator), what)
    assert torch.equal(p, p_in) and (q is None or torch.equal(q, q_in)), (
        f"{what}: p or q was changed in place (clone a row of p before zeroing an entry of it)")
    k, vocab = len(draft), p.shape[1]
    assert 1 <= len(got) <= k + 1, (
        f"{what}: returned {got} for {k} drafts {draft}; expected the accepted drafts and then exactly one token from "
        f"the target: 1 to {k + 1} tokens" + (" (all drafts accepted and no bonus token from p[k]?)" if got == draft
                                              else ""))
    assert got[:-1] == draft[:len(got) - 1], (
        f"{what}: returned {got} for the drafts {draft}: everything before the last token must be the accepted "
        f"drafts, in order, from the first one")
    assert all(0 <= t < vocab for t in got), f"{what}: returned {got}, outside the vocabulary of {vocab}"
    return got


def one_hot_rows(rows: list[list[float]]) -> Tensor:
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.task_10_rejection
def test_rejection_sample_named_cases():
    g = _gen(0)
    delta = 1e-8  # per statistical check below; with the distribution tests' 3e-7, under 1e-6 for the task
    # q == p: a draft drawn from q passes with probability min(1, p / q) = 1, every time, and then the bonus token
    # comes from p[k]. p[3] and p[2] have disjoint supports: a bonus taken from the wrong row shows
    p = one_hot_rows([[0.1, 0.2, 0.3, 0.4, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0],
                      [0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.3, 0.7]])
    drafts = torch.stack([torch.multinomial(p[i], 200, replacement=True, generator=_gen(i)) for i in range(3)], 1)
    for d in drafts.tolist():
        what = f"q == p (the drafter is the target), drafts {d}"
        got = call_rejection(p, p[:3].clone(), d, g, what)
        assert got[:3] == d and len(got) == 4, (
            f"{what}: returned {got}; with q = p every draft passes (min(1, p(x) / q(x)) = 1) and a bonus token is "
            f"drawn from p[3]" + (": the bonus token is missing" if got == d else ""))
        assert got[3] in (4, 5), (f"{what}: the bonus token {got[3]} has probability 0 under p[3] = "
                                  f"{p[3].tolist()}: draw the bonus from the last row of p, p[k]")
    # disjoint supports: p(x) = 0 for every draft, so the first is always rejected, and the residual max(0, p - q)
    # is p itself
    p = one_hot_rows([[0.6, 0.3, 0.1, 0.0, 0.0, 0.0], [1 / 6] * 6, [1 / 6] * 6])
    q = one_hot_rows([[0.0, 0.0, 0.0, 0.2, 0.3, 0.5], [1 / 6] * 6])
    seen = Counter()
    for d0 in [3, 4, 5] * 100:
        what = f"p and q with disjoint supports (p[0] = {p[0].tolist()}, q[0] = {q[0].tolist()}), drafts [{d0}, 2]"
        got = call_rejection(p, q, [d0, 2], g, what)
        assert len(got) == 1 and got[0] in (0, 1, 2), (
            f"{what}: returned {got}; p gives the draft {d0} probability 0, so it is rejected, every time, and the "
            f"replacement comes from max(0, p - q) = p: one of 0, 1, 2")
        seen[got[0]] += 1
    check_counts(seen, {0: 0.6, 1: 0.3, 2: 0.1}, 300, delta,
                 "the replacements after a rejection, with p and q of disjoint supports (the residual is p)")
    # q has its mass where p has less: the draft 0 passes with probability 0.5 / 1; the replacement is never 0 (q
    # already supplied all of p's 0.5 there) but always 1
    p = one_hot_rows([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    q = one_hot_rows([[1.0, 0.0, 0.0, 0.0]])
    seen = Counter()
    for _ in range(400):
        what = "p[0] = [0.5, 0.5, 0, 0], q[0] = [1, 0, 0, 0] (q over-covers token 0), draft [0]"
        got = call_rejection(p, q, [0], g, what)
        assert got in ([0, 2], [1]), (
            f"{what}: returned {got}; the draft passes with probability min(1, 0.5 / 1) = 0.5 (then the bonus from "
            f"p[1] = [0, 0, 1, 0] makes it [0, 2]); rejected, the replacement comes from max(0, p - q) = "
            f"[0, 0.5, 0, 0]: [1]" + (". Token 0 cannot be the replacement: q already gave it all of p's 0.5"
                                       if got == [0] else ""))
        seen[len(got)] += 1
    check_counts(seen, {2: 0.5, 1: 0.5}, 400, delta, "acceptances of a draft with p(x) / q(x) = 0.5 (2 = accepted)")
    # p is 0 where q is not: a draft of token 0 or 3 never passes; tokens 1 and 2 (p / q = 2) always do
    p = one_hot_rows([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    q = one_hot_rows([[0.25] * 4])
    for d, want in ((0, "rejected"), (3, "rejected"), (1, "accepted"), (2, "accepted")):
        for _ in range(50):
            what = f"p[0] = [0, 0.5, 0.5, 0], q[0] = [0.25] * 4, draft [{d}]"
            got = call_rejection(p, q, [d], g, what)
            if want == "rejected":
                assert len(got) == 1 and got[0] in (1, 2), (
                    f"{what}: returned {got}; p({d}) = 0, so the draft can never pass, and the replacement comes from "
                    f"max(0, p - q) = [0, 0.25, 0.25, 0]: 1 or 2")
            else:
                assert len(got) == 2 and got[0] == d, (
                    f"{what}: returned {got}; p({d}) / q({d}) = 2, so min(1, 2) = 1: the draft always passes")
    # one-hot guesses (q is None, an n-gram drafter): the draft passes with probability p(x); a rejected draft
    # cannot come back as the replacement (p with x's entry zeroed, renormalised)
    p = one_hot_rows([[0.2, 0.3, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    seen = Counter()
    for _ in range(400):
        what = "one-hot guesses (q=None), p[0] = [0.2, 0.3, 0.5, 0], draft [2]"
        got = call_rejection(p, None, [2], g, what)
        assert got in ([2, 3], [0], [1]), (
            f"{what}: returned {got}; the draft passes with probability p(2) / 1 = 0.5 (then the bonus 3 from "
            f"p[1]); rejected, the replacement comes from p with token 2 zeroed: [0.2, 0.3, 0, 0] renormalised"
            + (". The rejected draft itself cannot be the replacement: for a one-hot q the residual max(0, p - q) "
               "is 0 at the draft token" if got == [2] else ""))
        seen[got[0]] += 1
    check_counts(seen, {2: 0.5, 0: 0.2, 1: 0.3}, 400, delta, "the first token for one-hot guesses (q=None), draft [2]")
    for _ in range(30):
        what = "one-hot guesses (q=None), p[0] = [0.2, 0.3, 0.5, 0], draft [3] (p(3) = 0)"
        got = call_rejection(p, None, [3], g, what)
        assert len(got) == 1 and got[0] in (0, 1, 2), f"{what}: returned {got}; a draft with p(x) = 0 never passes"
        what = "one-hot guesses (q=None), p[0] one-hot at the draft token"
        got = call_rejection(one_hot_rows([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]), None, [1], g, what)
        assert got == [1, 3], f"{what}: returned {got}; p(x) = 1: the draft always passes, then the bonus 3"
    # no drafts at all (generate's first token): one draw from p[0]
    p = one_hot_rows([[0.0, 0.0, 1.0, 0.0]])
    for q in (None, torch.zeros(0, 4)):
        what = f"no drafts (k = 0, q = {None if q is None else 'a (0, 4) tensor'}), p = [[0, 0, 1, 0]]"
        assert call_rejection(p, q, [], g, what) == [2], f"{what}: expected [2], the one token p allows"
    # the residual has no mass (q >= p everywhere, as rounding can make it): the replacement is drawn from p
    p = one_hot_rows([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = one_hot_rows([[0.75, 0.5, 0.0, 0.0]])
    for _ in range(100):
        what = "q >= p everywhere (p[0] = [0.5, 0.5, 0, 0], q[0] = [0.75, 0.5, 0, 0]), draft [0]"
        try:
            got = call_rejection(p, q, [0], g, what)
        except (RuntimeError, ValueError, ZeroDivisionError) as e:
            raise AssertionError(f"{what}: raised {type(e).__name__} ({e}). After a rejection max(0, p - q) is all "
                                 f"zeros here: with no mass to renormalise, draw the replacement from p itself") from e
        assert got in ([0, 3], [0], [1]), f"{what}: returned {got}; expected [0, 3] (accepted), or [0] / [1] from p"
    forbid_calls(impl.rejection_sample, LIBRARY)


def check_counts(seen: Counter, want: dict, n: int, delta: float, what: str) -> None:
    for key, prob in want.items():
        tol = bernstein_tolerance(n, prob, len(want), delta)
        assert abs(seen[key] - n * prob) <= tol, (
            f"{what}: {key} came {seen[key]} times in {n}, expected {n * prob:.0f} (p = {prob}) within {tol:.0f}. "
            f"All counts: {dict(seen)}")


@pytest.mark.task_10_rejection
def test_rejection_sample_contract():
    g = _gen(1)
    p, q = torch.full((3, 5), 0.2), torch.full((2, 5), 0.2)
    must_refuse(impl.rejection_sample, p[:2], q, [1, 2], g, what="2 drafts with p of 2 rows (it needs k + 1 = 3)")
    must_refuse(impl.rejection_sample, p, q[:1], [1, 2], g, what="2 drafts with q of 1 row (it needs k = 2)")
    must_refuse(impl.rejection_sample, torch.full((4, 5), 0.2), q, [1, 2], g,
                what="2 drafts with p of 4 rows (it needs k + 1 = 3)")
    must_refuse(impl.rejection_sample, p, None, [1], g, what="1 draft with p of 3 rows (it needs k + 1 = 2)")
    # one seed, one answer: every random number must come from the generator (seeded requests reproduce)
    p = torch.softmax(torch.randn(4, 8, generator=_gen(2)), dim=-1)
    q = torch.softmax(torch.randn(3, 8, generator=_gen(3)), dim=-1)
    drafts = [torch.multinomial(q, 1, generator=_gen(10 + i)).squeeze(1).tolist() for i in range(40)]
    runs = []
    for _ in range(2):
        torch.rand(3)  # the global generator moves between the runs (it is not the one to use)
        gen = _gen(7)
        runs.append([call_rejection(p, q, d, gen, "a seeded generator") for d in drafts])
    assert runs[0] == runs[1], (
        "rejection_sample with identically seeded generators gave different results on the same inputs: draw every "
        "random number (the uniforms and the replacement) from `generator`, e.g. torch.rand(k, generator=generator)")


# The exact distribution tests. Each call draws its drafts from q's rows (the grader's own generator), and the
# outcome of a call is its emitted tokens, cut after the second token (a third one is marked "*"): 6 + 36 + 36
# outcomes for k = 2. The test counts each outcome, each first token and each length, and compares every count
# with n * (its probability under outcome_oracle) within bernstein_tolerance for delta = 1e-7 per test: a correct
# rule fails one of the three tests with probability < 3e-7. Outcomes the rule makes impossible (a replacement that
# q over-covers, a one-hot guess replacing itself) must not occur at all.
# Power: with n = 8000 calls the tolerance of an outcome of probability 0.1 is 0.023 in frequency (0.008 at 0.01). A
# wrong rule fails whatever the seed (probability > 1 - 1e-7) once its expected count is about 2 tolerances from the
# exact one. Measured, as the largest |count - n * exact probability| / tolerance over the events, on three seeds (the
# correct rule: 0.25-0.47): accepting with probability p(x) 5x (k = 1) and 8x (k = 2); accepting with min(1, q/p)
# 25-40x; accepting exactly when p >= q 1.8x (k = 1) and 7.5x (k = 2); the bonus drawn from p[k - 1] 7x; acceptances
# counted after the first rejection 14x (k = 2); one uniform shared by every draft 3.2x (k = 2) and 2-2.4x (one-hot).
# Drawing the replacement from p, or no bonus token, gives impossible outcomes hundreds of times.

DIST_VOCAB = 6


def random_dists(rows: int, seed: int, scale: float = 1.5) -> Tensor:
    return torch.softmax(torch.randn(rows, DIST_VOCAB, generator=_gen(seed)) * scale, dim=-1)


def outcome_key(tokens: list[int] | tuple[int, ...], keep: int) -> tuple:
    return tuple(tokens[:keep]) + (("*",) if len(tokens) > keep else ())


def check_distribution(p: Tensor, q: Tensor | None, n: int, seed: int, what: str, fixed_draft: list[int] | None = None,
                       keep: int = 2, delta: float = 1e-7) -> None:
    k = p.shape[0] - 1
    if q is not None:
        drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=_gen(seed + 1000 + i))
                              for i in range(k)], dim=1).tolist()
    else:
        drafts = [fixed_draft] * n
    g = _gen(seed)
    outcomes: Counter = Counter()
    for d in drafts:
        outcomes[outcome_key(call_rejection(p, q, d, g, what), keep)] += 1
    want = outcome_oracle(p, q, fixed_draft)
    verdict = compare_outcomes(outcomes, want, n, keep, delta)
    if verdict is None:
        return
    hint = ""
    for why, (accept, correction) in WRONG_RULES.items():
        if compare_outcomes(outcomes, outcome_oracle(p, q, fixed_draft, accept, correction), n, keep, delta) is None:
            hint = f". Your frequencies fit another rule: {why}"
            break
    else:
        if compare_outcomes(outcomes, outcome_oracle(p, q, fixed_draft, bonus=False), n, keep, delta) is None:
            hint = ". Your frequencies fit a rule without the bonus token (when every draft passes, draw one from p[k])"
    raise AssertionError(f"{what} ({n} seeded calls): {verdict}{hint}")


def event_counts(outcomes: dict, keep: int) -> dict:
    """Every outcome (cut at `keep` tokens), every first token, every length class: counts or probabilities."""
    events: Counter = Counter()
    for key, value in outcomes.items():
        events[("tokens", key)] += value
        events[("first token", key[0])] += value
        events[("length", len(key) if key[-1] != "*" else f">{keep}")] += value
    return events


def compare_outcomes(seen: Counter, want: dict, n: int, keep: int, delta: float) -> str | None:
    """None when every event's count is within its tolerance, else what is off (the worst events first)."""
    cut: Counter = Counter()
    for key, prob in want.items():
        cut[outcome_key(key, keep)] += prob
    want_events = event_counts(cut, keep)
    seen_events = event_counts(seen, keep)
    impossible = sorted((e for e in seen_events if want_events.get(e, 0.0) <= 0 and seen_events[e] > 0), key=str)
    if impossible:
        e = impossible[0]
        return (f"the outcome '{describe(e)}' came {seen_events[e]} times, but the exact rule never gives it (a token "
                f"q already covers, q >= p, is never the replacement; a one-hot guess never replaces itself; the "
                f"bonus token always follows k accepted drafts); {len(impossible)} impossible outcomes occurred")
    n_events = len(want_events)
    bad = []
    for e, prob in want_events.items():
        tol = bernstein_tolerance(n, prob, n_events, delta)
        off = abs(seen_events.get(e, 0) - n * prob)
        if off > tol:
            bad.append((off / tol, e, prob))
    if not bad:
        return None
    bad.sort(key=lambda t: -t[0])
    shown = "; ".join(f"{describe(e)}: {seen_events.get(e, 0) / n:.4f} vs {prob:.4f}" for _, e, prob in bad[:4])
    return (f"{len(bad)} outcome frequencies are off from the exact ones by more than chance allows (yours vs "
            f"exact): {shown}")


def describe(event) -> str:
    kind, value = event
    if kind == "tokens":
        return "returned [" + ", ".join("..." if t == "*" else str(t) for t in value) + "]"
    if kind == "length":
        return f"{value} tokens returned"
    return f"first token {value}"


@pytest.mark.task_10_rejection
def test_rejection_sample_distribution_one_draft():
    """k = 1, drafts from q[0]: the first token must have distribution p[0], and the bonus after an accepted draft
    p[1]: P(x, b) = min(p0(x), q0(x)) * p1(b), P(y alone) = max(0, p0(y) - q0(y))."""
    p, q = random_dists(2, 11), random_dists(1, 12)
    check_distribution(p, q, 8000, 21, "k = 1 on a 6-token vocabulary, drafts drawn from q")


@pytest.mark.task_10_rejection
def test_rejection_sample_distribution_two_drafts():
    """k = 2: the second token's distribution after an accepted first draft, whether it is the second draft or the
    replacement for it, is p[1]; a third token comes only when both passed."""
    p, q = random_dists(3, 13), random_dists(2, 14)
    check_distribution(p, q, 8000, 22, "k = 2 on a 6-token vocabulary, drafts drawn from q")


@pytest.mark.task_10_rejection
def test_rejection_sample_distribution_one_hot():
    """q = None (n-gram guesses) and fixed drafts [1, 4]: P(first token y != 1) = p0(y); P(1, y != 4) =
    p0(1) p1(y); P(1, 4, c) = p0(1) p1(4) p2(c)."""
    p = random_dists(3, 15, scale=1.0)
    check_distribution(p, None, 4000, 23, "one-hot guesses (q=None), drafts [1, 4]", fixed_draft=[1, 4], keep=3)


# ================================================================================================ task 10.ngram


def ngram_match(ids: list[int], max_n: int, min_n: int) -> tuple[int, int] | None:
    """(n, start) of the occurrence the contract picks, by brute force over every start; None when none counts."""
    for n in range(max_n, min_n - 1, -1):
        if 1 <= n < len(ids):
            starts = [i for i in range(len(ids) - n) if ids[i:i + n] == ids[len(ids) - n:]]
            if starts:
                return n, max(starts)
    return None


def ngram_oracle(ids: list[int], k: int, max_n: int, min_n: int, *, oldest: bool = False,
                 shortest_first: bool = False, allow_self: bool = False, pattern: bool = False,
                 cap: bool = True, window: int | None = None) -> list[int]:
    """Every n-gram suffix, longest first; its occurrences that end before the last token (so a token follows);
    the most recent one's continuation, at most k tokens. The keywords build the named wrong answers (window: only
    occurrences starting in the last `window` tokens)."""
    ns = range(min_n, max_n + 1) if shortest_first else range(max_n, min_n - 1, -1)
    for n in ns:
        if n < 1 or n > len(ids):
            continue
        suffix = ids[len(ids) - n:]
        last_start = len(ids) - n if allow_self else len(ids) - n - 1
        first = 0 if window is None else max(0, len(ids) - window)
        starts = [i for i in range(first, last_start + 1) if ids[i:i + n] == suffix]
        if starts:
            i = min(starts) if oldest else max(starts)
            if pattern:
                return ids[i:i + n][:k]
            return ids[i + n:i + n + k] if cap else ids[i + n:]
    return []


def ngram_hint(ids, k, max_n, min_n, got, want) -> str:
    match = ngram_match(ids, max_n, min_n)
    windows = [w for w in (16, 20, 32, 40, 48, 50, 64, 100, 128, 200, 256, 500, 512, 1000, 1024, 2000, 2048)
               if match is not None and w < len(ids) - match[1]]
    if any(ngram_oracle(ids, k, max_n, min_n, window=w) == got for w in windows):
        n, i = match
        return (f" = a search of a recent window only: the {n}-token suffix's most recent earlier occurrence starts "
                f"{len(ids) - n - i} tokens before the suffix, at {i}; search the whole sequence")
    candidates = [
        ({"oldest": True}, "the oldest occurrence: take the most recent one (search from the end backwards)"),
        ({"shortest_first": True}, "the shortest n first: try n = max_n first, a longer match is better evidence"),
        ({"allow_self": True}, ("the suffix found itself at the very end (nothing follows it): only earlier "
                                "occurrences with a token after them count")),
        ({"pattern": True}, "the matched tokens themselves: propose what came after the occurrence"),
        ({"cap": False}, "everything after the occurrence: at most k tokens"),
    ]
    for kw, why in candidates:
        if ngram_oracle(ids, k, max_n, min_n, **kw) == got != want:
            return f" = {why}"
    if got and not want and max_n > 0:
        return f" (no suffix of {min_n} to {max_n} tokens occurred earlier with a token after it)"
    return ""


def show_ids(ids: list[int]) -> str:
    """ids in a message: whole when short, else its ends and its length."""
    if len(ids) <= 40:
        return str(ids)
    return f"<{len(ids)} tokens: {str(ids[:8])[:-1]}, ..., {str(ids[-8:])[1:]}>"


def check_ngram(ids: list[int], k: int, max_n: int, min_n: int, what: str) -> None:
    ids_in = list(ids)
    got = check_int_list(impl.propose_ngram(ids, k, max_n, min_n), what)
    want = ngram_oracle(ids_in, k, max_n, min_n)
    assert ids == ids_in, f"{what}: ids was changed in place"
    assert got == want, (f"{what}: propose_ngram({show_ids(ids_in)}, k={k}, max_n={max_n}, min_n={min_n}) returned "
                         f"{got}, expected {want}{ngram_hint(ids_in, k, max_n, min_n, got, want)}")


@pytest.mark.task_10_ngram
def test_propose_ngram_named_cases():
    check_ngram([5, 6, 1, 5, 6, 2, 5, 6], 3, 3, 1, "[5, 6] occurred twice: the most recent occurrence")
    check_ngram([5, 6, 1, 5, 6, 2, 5, 6], 1, 3, 1, "the same at k = 1: one token")
    check_ngram([1, 2, 3, 9, 7, 3, 8, 1, 2, 3], 2, 3, 1,
                "a 3-token match early and a more recent 1-token match: the longer match wins")
    check_ngram([1, 2, 3, 10, 9, 2, 3, 11, 1, 2, 3], 2, 2, 1, "max_n = 2: the 3-token match does not count")
    check_ngram([4, 8, 9, 4, 8], 5, 3, 1, "a match whose continuation runs into the end: fewer than k tokens")
    check_ngram([7, 7, 7], 4, 3, 1, "an occurrence overlapping the suffix: [7, 7] at 0 is followed by a 7")
    check_ngram([1, 2, 3, 4], 3, 3, 1, "nothing repeats: []")
    check_ngram([1, 2, 3, 9, 3], 2, 3, 2, "min_n = 2: the only match is 1 token long, so []")
    check_ngram([1, 2, 3, 9, 3], 2, 3, 1, "min_n = 1: the 1-token match counts")
    check_ngram([5], 2, 3, 1, "one token: nothing earlier")
    check_ngram([], 2, 3, 1, "no tokens")
    check_ngram([5, 5], 2, 3, 1, "two equal tokens: [5] at 0 is followed by 5")
    check_ngram([3, 1, 4, 1, 5, 9, 2, 6, 1, 4], 0, 3, 1, "k = 0")
    check_ngram([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4], 4, 3, 1, "a 3-token match in the middle")
    forbid_calls(impl.propose_ngram, LIBRARY)


@pytest.mark.task_10_ngram
@settings(max_examples=200, deadline=None)
@given(data=st.data(), alphabet=st.integers(1, 5), length=st.integers(0, 40), k=st.integers(0, 6),
       max_n=st.integers(1, 5))
def test_propose_ngram_random(data, alphabet, length, k, max_n):
    ids = data.draw(st.lists(st.integers(0, alphabet), min_size=length, max_size=length), label="ids")
    min_n = data.draw(st.integers(1, max_n), label="min_n")
    check_ngram(ids, k, max_n, min_n, f"{length} random tokens of {alphabet + 1}")


def distinct_filler(n: int, seed: int, low: int = 1000) -> list[int]:
    """n tokens that occur nowhere else in a test sequence (all >= low, all different)."""
    return random.Random(seed).sample(range(low, low + 20 * n + 100), n)


@pytest.mark.task_10_ngram
def test_propose_ngram_long_prompts():
    """A prompt of thousands of tokens whose only match is near its start: the whole sequence is searched, not a
    recent window (a windowed search passes every short case above)."""
    far = distinct_filler(2000, 1)
    check_ngram([1, 2, 3, 4, 5] + far + [1, 2, 3], 4, 3, 1,
                "the only earlier [1, 2, 3] is 2005 tokens before the suffix, at the start")
    check_ngram([9] + distinct_filler(300, 2) + [9], 3, 3, 1, "a 1-token match 301 tokens before the suffix")
    check_ngram([7, 8, 9, 50, 51] + distinct_filler(1500, 3) + [9, 60] + distinct_filler(30, 4) + [7, 8, 9], 3, 3, 1,
                "a 3-token match 1537 tokens before the suffix and a 1-token match 34 before: the longer one wins")
    mid = distinct_filler(3000, 5)
    ids = mid[:10] + [4, 4, 5, 6] + mid[10:700] + [4, 4, 5, 7] + mid[700:] + [4, 4, 5]
    check_ngram(ids, 2, 3, 1, "two old occurrences of [4, 4, 5], 2998 and 2304 tokens before the suffix: the more "
                              "recent one")
    check_ngram(ids, 2, 3, 3, "the same with min_n = 3")
    check_ngram(distinct_filler(2500, 6) + [3], 4, 3, 1, "2501 tokens, nothing repeats: []")
    forbid_calls(impl.propose_ngram, LIBRARY)


@pytest.mark.task_10_ngram
@settings(max_examples=60, deadline=None)
@given(data=st.data(), length=st.integers(50, 3000), k=st.integers(1, 6), max_n=st.integers(1, 5))
def test_propose_ngram_random_long(data, length, k, max_n):
    """Long prompts of distinct tokens with a pattern planted once to a few times anywhere (most often far from
    the end), ending with that pattern; or long prompts over a random alphabet (matches at every distance)."""
    min_n = data.draw(st.integers(1, max_n), label="min_n")
    if data.draw(st.booleans(), label="planted"):
        pattern = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5), label="pattern")
        ids = distinct_filler(length, data.draw(st.integers(0, 10**6), label="filler seed"))
        for at in sorted(data.draw(st.lists(st.integers(0, length - 1), min_size=1, max_size=3), label="at"),
                         reverse=True):
            ids[at:at] = pattern
        ids += pattern
        what = f"{len(ids)} tokens, the pattern {pattern} planted and repeated at the end"
    else:
        alphabet = data.draw(st.integers(2, 2 * length), label="alphabet")
        rng = random.Random(data.draw(st.integers(0, 10**6), label="ids seed"))  # hypothesis' buffer is too small
        ids = [rng.randint(0, alphabet) for _ in range(length)]
        what = f"{length} random tokens of {alphabet + 1}"
    check_ngram(ids, k, max_n, min_n, what)


# =========================================================================================== the real model

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, trimmed "
             "the wick and wrote the weather in a leather logbook. Ships passing the rocky point blinked their lamps "
             "twice to thank him.")
COPY_PROMPT = "Repeat the following text exactly.\n\n" + PARAGRAPH
N_NEW = 48
MIN_ACCEPTANCE = 0.5  # the reference accepts all 36 drafts of its 9 verification steps (46 tokens)


def counted(fn, calls: Counter, name: str, check=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        out = fn(*args, **kwargs)
        if check is not None:
            check(args, kwargs, out)
        return out

    return wrapper


def run_or_explain(broken: list[str], what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs); an error after one of your functions broke its contract names that first."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        if broken:
            raise AssertionError(f"{what}: {broken[0]}, and then the run failed with {type(e).__name__}: {e}") from e
        raise


@pytest.mark.task_10_real_model
def test_your_speculation_runs_smollm2(real_model, monkeypatch):
    """Your verify_greedy, rejection_sample and propose_ngram swapped into minillm.speculative.decoding and
    minillm.speculative.drafters; minillm.generate(..., speculative=SpeculativeConfig("ngram", k=4)) on a prompt
    that asks SmolLM2 to repeat a paragraph. Greedy: exactly the target-only greedy tokens, at least half the drafts
    accepted, fewer target forwards than tokens. Sampled (temperature 0.8, seeded): it completes, and every
    verification keeps a prefix of its drafts plus one token."""
    model, tok = real_model
    vocab = model.config.vocab_size
    gen = one_thread(minillm.generate)
    calls: Counter = Counter()
    broken: list[str] = []

    def check_verify(args, kwargs, out):
        draft = list(args[2] if len(args) > 2 else kwargs["draft"])
        if not (isinstance(out, list) and 1 <= len(out) <= len(draft) + 1 and out[:-1] == draft[:len(out) - 1]
                and all(type(t) is int and 0 <= t < vocab for t in out)):
            broken.append(f"rejection_sample returned {out!r} for the drafts {draft}")

    def check_proposal(args, kwargs, out):
        k = args[1] if len(args) > 1 else kwargs["k"]
        if not (isinstance(out, list) and len(out) <= k):
            broken.append(f"propose_ngram returned {out!r} when asked for at most {k} tokens")

    with monkeypatch.context() as m:
        m.setattr(minillm.speculative.decoding, "verify_greedy", counted(impl.verify_greedy, calls, "verify_greedy"))
        m.setattr(minillm.speculative.decoding, "rejection_sample",
                  counted(impl.rejection_sample, calls, "rejection_sample", check_verify))
        m.setattr(minillm.speculative.drafters, "propose_ngram", counted(impl.propose_ngram, calls, "propose_ngram",
                                                             check_proposal))
        stats = SpecStats()
        got = run_or_explain(broken, "greedy speculation", gen, model, tok, COPY_PROMPT, max_new_tokens=N_NEW,
                             chat=True, speculative=SpeculativeConfig("ngram", k=4), spec_stats=stats).token_ids
        # the target alone, no speculation: none of the swapped functions runs (and a stub fails above, fast)
        want = gen(model, tok, COPY_PROMPT, max_new_tokens=N_NEW, chat=True).token_ids
        assert not broken, f"greedy speculation: {broken[0]}"
        assert calls["verify_greedy"] and calls["propose_ngram"], (
            f"your functions were not called ({dict(calls)}): is minillm.speculative.decoding / "
            f"minillm.speculative.drafters unchanged?")
        same_tokens(got, want, tok, "greedy n-gram speculation (k = 4) with your functions")
        print(f"\ngreedy: {len(got)} tokens in {stats.steps} verification steps (+ the prefill), "
              f"{stats.accepted}/{stats.proposed} drafts accepted, acceptance rate {stats.acceptance_rate:.2f}, "
              f"{stats.tokens_per_step:.2f} tokens per step")
        assert stats.proposed > 0, (
            "greedy n-gram speculation on a prompt that asks to repeat a paragraph: your propose_ngram proposed "
            "nothing in any step (the reference proposes 4 tokens at every step: the reply copies the prompt)")
        assert stats.acceptance_rate >= MIN_ACCEPTANCE, (
            f"greedy n-gram speculation on a copy prompt: acceptance rate {stats.acceptance_rate:.2f} "
            f"({stats.accepted} of {stats.proposed} drafts accepted), expected >= {MIN_ACCEPTANCE} (the reference: "
            f"1.00). The tokens are right, but few drafts pass: does propose_ngram return what followed the most "
            f"recent, longest match, and does verify_greedy accept a draft equal to the target's choice at its own "
            f"position?")
        assert stats.steps < len(got), (
            f"{len(got)} tokens took {stats.steps} target forwards after the prefill: speculation saved nothing")
        sampled_stats = SpecStats()
        out = run_or_explain(broken, "sampled speculation (temperature 0.8)", gen, model, tok, COPY_PROMPT,
                             max_new_tokens=N_NEW, chat=True, temperature=0.8, seed=0,
                             speculative=SpeculativeConfig("ngram", k=4), spec_stats=sampled_stats)
        assert not broken, f"sampled speculation (temperature 0.8): {broken[0]}"
        assert calls["rejection_sample"], "sampled speculation never called your rejection_sample"
        ids = out.token_ids
        assert 1 <= len(ids) <= N_NEW and all(type(t) is int and 0 <= t < vocab for t in ids), (
            f"sampled speculation returned {len(ids)} tokens {ids[:8]}...: expected 1 to {N_NEW} token ids")
        print(f"sampled (temperature 0.8, seed 0): {sampled_stats.accepted}/{sampled_stats.proposed} drafts "
              f"accepted in {sampled_stats.steps} steps: {out.text!r}")

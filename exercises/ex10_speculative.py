"""Exercise 10: speculative decoding (lesson 10, "guess, then check in one forward").

A cheap drafter guesses the next k tokens; the target model scores all of them in one forward and keeps the longest
prefix it agrees with, plus one token of its own. Write the two verification rules and the n-gram drafter, then grade
your work:

    minillm grade 10

- 10.greedy: `verify_greedy(target_argmax, draft)`. target_argmax has len(draft) + 1 entries: target_argmax[i] is
  the target's greedy choice after the prompt and draft[:i]. Accept draft[0], draft[1], ... while each equals the
  target's choice at its position; stop at the first mismatch (later drafts are never looked at, even where they
  happen to match). Return the accepted drafts followed by exactly one token of the target's: the choice at the
  first mismatch (the correction), or target_argmax[len(draft)] when every draft passed (the bonus token). An empty
  draft returns [target_argmax[0]]. The result is a new list of ints; the arguments are left as they were.
- 10.rejection: `rejection_sample(p, q, draft, generator)`, speculative sampling. p is (k + 1, vocab): row i is
  the target's distribution for the token after the prompt and draft[:i] (row k: after every draft). q is
  (k, vocab): row i is the distribution draft[i] was drawn from, or None for a drafter without a distribution (the
  n-gram drafter), which counts as q one-hot at each draft token. It returns draft[:n] + [t]: the first n drafts
  kept (0 <= n <= k) and one token t of the target's, as a list of Python ints, so n = len(result) - 1 is the number
  of drafts accepted, and when n < k, t stands where draft[n] was and is never draft[n] itself. What it must
  guarantee:
  * exactness: with the drafts drawn from q's rows (or fixed, for q None), the result is distributed as if the
    target had sampled every one of its tokens alone: for each j, given that the result's first j tokens are
    draft[:j], its token j (when there is one) is distributed exactly as p[j], whatever q is;
  * as many drafts kept as exactness allows: once reached, draft i is kept with probability sum_x min(p[i, x],
    q[i, x]) over its draw from q[i] (the overlap of the two rows; p[i, draft[i]] for q None), the most any exact
    rule can keep; so a draft p gives no mass is never kept, and q == p keeps every draft;
  * reproducible: every random number comes from `generator` (the given `sample(probs, generator)` draws one token
    per row of a (rows, vocab) tensor of probabilities), so a seeded generator gives the same result again;
  * p and q are left unchanged; p without k + 1 rows, or q without k, is a ValueError; rows that are probability
    vectors only up to float rounding (q >= p everywhere) still give a token of the target's, never an error.
  Example, vocab 2, k = 1: p[0] = [.25, .75], q[0] = [1, 0], draft [0]: the draft is kept with probability .25 and
  [0, b] is returned with b drawn from p[1]; otherwise [1]: the first token is 0 a quarter of the time, exactly
  p[0]. With q[0] = p[0] every draft is kept and the result is draft + [a token drawn from p[1]].
- 10.ngram: `propose_ngram(ids, k, max_n, min_n)`, prompt lookup. Take the last n tokens of ids as a pattern, trying n
  = max_n first and going down to min_n (a longer match is better evidence: it wins over any shorter one, however
  recent). For a given n, find the most recent earlier occurrence of the pattern that has at least one token after it,
  anywhere in ids (a prompt of thousands of tokens is searched to its first token): the occurrence that is the suffix
  itself never counts, but one that overlaps it does (in [7, 7, 7] the pattern [7, 7] occurs at 0, followed by 7).
  Return the tokens that followed that occurrence, at most k of them (fewer when the sequence ends first). No n in
  min_n..max_n with a match (a sequence too short for n has none), or k = 0, returns [].

The graders compare with oracles written out in the grader: a loop for the greedy rule, a brute-force search over
every earlier occurrence for the n-gram lookup (on short sequences and on prompts of thousands of tokens whose only
match is far back), and for rejection sampling crafted p and q (equal, disjoint supports, zeros on either side,
one-hot) plus exact distribution tests: on a 6-token vocabulary with drafts drawn from q, 20,000 seeded calls must
give every outcome (first token, second token, ...) its exact probability within a bound that a correct rule exceeds
with probability below 1e-6. The real-model task swaps your three functions into minillm.speculative.decoding and
minillm.speculative.drafters and runs SmolLM2 with n-gram speculation (k = 4) on a "repeat this text" prompt: greedy
must give exactly the target's own greedy tokens with at least half the drafts accepted and fewer target forwards than
tokens, and a seeded sampled run must complete. Calling minillm.speculative.decoding or minillm.speculative.drafters
inside your answers is rejected.
"""

from __future__ import annotations

import torch
from torch import Tensor

# given: sample(probs, generator) -> one token id per row of a (rows, vocab) probability tensor (torch.multinomial,
# drawing from `generator`)
from minillm.sampling import sample  # noqa: F401

# task 10.greedy ----------------------------------------------------------------------------------------------


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    """target_argmax[i] is the target's choice after draft[:i] (len(draft) + 1 of them). Returns the accepted
    drafts followed by the target's own token: the first correction, or the bonus token when all pass.

    A new list of ints; the arguments are left as they were. Example: target_argmax [5, 6, 9, 2], draft [5, 6, 7]:
    [5, 6, 9] (the third draft is wrong, 9 corrects it); draft [5, 6, 9] gives [5, 6, 9, 2] (2 is the bonus); draft
    [4, 6, 9] gives [5] (later matches do not count after a mismatch); draft [] gives [5].
    """
    raise NotImplementedError("task 10.greedy: see the docstring; `minillm hint 10 greedy` for hints")


# task 10.rejection -------------------------------------------------------------------------------------------


def rejection_sample(p: Tensor, q: Tensor | None, draft: list[int],
                     generator: torch.Generator | None = None) -> list[int]:
    """The exact rule. p (k + 1, vocab): the target's distributions at the k draft positions and after them;
    q (k, vocab): the drafter's distributions the drafts were drawn from, or None for one-hot guesses.
    Returns the accepted drafts and one token from the target (in place of the first rejected draft, or a bonus).

    The result is distributed exactly as the target sampling alone would give, keeping as many drafts as that
    allows: the overlap sum_x min(p, q) of each row (the module docstring states every guarantee). All randomness
    from `generator`; p and q unchanged; a wrong row count of p or q is a ValueError. Example: vocab 2, one draft 0 with
    q[0] = [1, 0] and p[0] = [.25, .75]: [0, b] (b from p[1]) with probability .25, else [1]; the first token is 0
    a quarter of the time and 1 three quarters, exactly p[0].
    """
    raise NotImplementedError("task 10.rejection: see the docstring; `minillm hint 10 rejection` for hints")


# task 10.ngram -----------------------------------------------------------------------------------------------


def propose_ngram(ids: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that continue `ids`, found in `ids` itself: take its last n tokens (n from max_n down to
    min_n: a longer match is better evidence), find their most recent earlier occurrence that has a token after it,
    and return the (at most k) tokens that followed it. [] when no suffix of length >= min_n occurred before.

    Example: ids [1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], k 2, max_n 3: the suffix [1, 2, 3] last occurred earlier at 4,
    followed by [4, 1]: returns [4, 1] (the older occurrence at 0, followed by 9, loses). ids [7, 7, 7], k 3, max_n
    2: [7, 7] occurs at 0 (overlapping the suffix is fine), followed by [7]. ids [1, 2, 3]: [] (nothing repeats).
    """
    raise NotImplementedError("task 10.ngram: see the docstring; `minillm hint 10 ngram` for hints")

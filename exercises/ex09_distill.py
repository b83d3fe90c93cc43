"""Exercise 09: knowledge distillation (lesson 09, "teach the pruned model").

A student (SmolLM2 with 10 of its 30 blocks dropped) learns from the teacher's next-token distributions instead of
from the text's labels alone. Write the loss, the learning-rate schedule and one training step, then grade your work:

    minillm grade 09

- 09.loss: `distillation_loss` is T^2 * the mean over every position of KL(p || q), p = softmax(teacher / T) and
  q = softmax(student / T): the teacher's distribution comes first (forward KL), the KL of one position is summed
  over the vocabulary, and the mean runs over all leading dimensions ((positions, vocab) and (batch, seq, vocab)
  logits alike). Compute in float32 whatever the logits' dtype (bf16 under autocast), stay finite for logits of
  +-1000 at T = 0.5, and return a 0-dim tensor that backpropagates to the student's logits. A temperature <= 0 and
  logits of different shapes (even ones that would broadcast) are a ValueError, raised before any work.
- 09.schedule: `lr_at(step, cfg)` counts steps from 0. During warm-up (step < cfg.warmup) it rises linearly to
  cfg.lr: step 0 already trains and step cfg.warmup - 1 reaches cfg.lr; cfg.warmup = 0 means no warm-up. Then a
  cosine takes it from cfg.lr at step cfg.warmup down to cfg.lr * cfg.min_lr_ratio at step cfg.steps. A plain float.
- 09.step: `train_step` makes one optimizer step. The teacher runs with autograd off (it gets no .grad, and nothing
  of its graph is kept); the student's loss is cfg.kd * the distillation loss at cfg.temperature + cfg.ce * the
  cross-entropy of the student's prediction at position t of x[:, :-1] against x[:, t + 1] + cfg.cos * the given
  hidden_cosine_loss of the two models' last hidden states, each term computed only when its weight is > 0. Then:
  clear the gradients left from earlier steps, backpropagate, clip the gradient norm of the optimizer's parameters
  (every param group) to cfg.clip, step. Leave the learning rate alone (the caller sets it from lr_at). Return plain
  floats: "loss", one entry per computed term ("kd", "ce", "cos") and "grad_norm", the norm before clipping.

The graders compare with oracles written out in the grader (the KL in float64 with explicit sums, the schedule step
by step, and a training step done by hand on tiny random Transformers with plain SGD: the same parameters after one
step and after two, the same loss, terms and norm), on random shapes and temperatures and on logits of +-1000. They
hook the teacher to see that autograd is off while it runs. The real-model task then distils SmolLM2 with your
three functions swapped into minillm.compress.distill: 10 steps of minillm.compress.distill.distill must bring the
pruned student's KL to the teacher down by at least 10% on held-apart text, and leave the teacher's weights as they
were. Calling minillm.compress.distill's implementations inside your answers is rejected.
"""

from __future__ import annotations

import math  # noqa: F401  (you will need them)

import torch
import torch.nn.functional as F  # noqa: F401
from torch import Tensor, nn

# given: DistillConfig (the run's settings), _forward (a model's logits and, when asked, its last hidden states) and
# hidden_cosine_loss (1 - mean cosine similarity of two sets of hidden states: the cos term)
from minillm.compress.distill import DistillConfig, _forward, hidden_cosine_loss  # noqa: F401

# task 09.loss ------------------------------------------------------------------------------------------------


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """T^2 * mean over positions of KL(softmax(teacher / T) || softmax(student / T)); logits (..., vocab).

    KL(p || q) of one position is the sum over the vocabulary of p * (log p - log q), p the teacher's; the mean runs
    over every leading dim. float32 whatever the logits' dtype, finite for logits of +-1000 at T = 0.5, a 0-dim
    tensor with a gradient to the student's logits. ValueError, before any work, for T <= 0 (or NaN) and for logits
    of different shapes, even ones that would broadcast. Example: equal logits give 0; one position, vocab 2,
    teacher [0, 0] (p = [.5, .5]) and student [log 3, 0] (q = [.75, .25]), T = 1: .5 log(.5/.75) + .5 log(.5/.25)
    = 0.1438.
    """
    raise NotImplementedError("task 09.loss: see the docstring; `minillm hint 09 loss` for hints")


# task 09.schedule --------------------------------------------------------------------------------------------


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine decay from lr to lr * min_lr_ratio at cfg.steps.

    Steps count from 0. Warm-up (step < cfg.warmup) rises linearly so that step 0 already trains and step
    cfg.warmup - 1 reaches cfg.lr; cfg.warmup = 0 means none. Then a half cosine from cfg.lr at step cfg.warmup to
    cfg.lr * cfg.min_lr_ratio at step cfg.steps. A plain float. Example: lr 1.0, warmup 4, steps 12, min_lr_ratio
    0.1: steps 0..3 give 0.25, 0.5, 0.75, 1.0; step 4 gives 1.0, step 8 (half way) 0.55, step 12 gives 0.1.
    """
    raise NotImplementedError("task 09.schedule: see the docstring; `minillm hint 09 schedule` for hints")


# task 09.step ------------------------------------------------------------------------------------------------


def train_step(student: nn.Module, teacher: nn.Module, x: Tensor, optimizer: torch.optim.Optimizer,
               cfg: DistillConfig) -> dict[str, float]:
    """One optimizer step on token windows x (batch, seq_len): position t of x[:, :-1] predicts x[:, t + 1].
    The teacher runs without gradients; the student's loss is the weighted sum of the enabled terms; gradients are
    clipped to norm cfg.clip. Returns the loss, each term and the gradient norm before clipping.

    The teacher runs with autograd off (no .grad, no graph kept). Terms, each computed only when its weight is > 0:
    "kd" the distillation loss at cfg.temperature, "ce" the cross-entropy of the student's logits against the next
    tokens, "cos" the given hidden_cosine_loss of the two models' last hidden states (the given _forward returns
    them when asked); the loss is cfg.kd * kd + cfg.ce * ce + cfg.cos * cos. Then: clear old gradients,
    backpropagate, clip the norm over every param group's parameters to cfg.clip, step. The lr is left alone.
    Returns plain floats: {"loss", one key per computed term, "grad_norm"}. Example: cfg.kd 1, cfg.ce 0.5, cfg.cos 0
    returns {"loss", "kd", "ce", "grad_norm"} with loss == kd + 0.5 * ce, and a second call starts from zero
    gradients.
    """
    raise NotImplementedError("task 09.step: see the docstring; `minillm hint 09 step` for hints")

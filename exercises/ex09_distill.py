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
    """T^2 * mean over positions of KL(softmax(teacher / T) || softmax(student / T)); logits (..., vocab)."""
    raise NotImplementedError("task 09.loss: both distributions are log-probabilities first (a softmax of logits in "
                              "the thousands overflows, and log of an underflowed 0 is -inf); which one weighs the "
                              "difference, and over which axis is it summed before the mean?")


# task 09.schedule --------------------------------------------------------------------------------------------


def lr_at(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up over cfg.warmup steps, then cosine decay from lr to lr * min_lr_ratio at cfg.steps."""
    raise NotImplementedError("task 09.schedule: two pieces. Which step is the first, and what should it get? After "
                              "the warm-up, measure progress from 0 to 1 and let a half cosine period carry the "
                              "rate from the peak to the floor, not to 0")


# task 09.step ------------------------------------------------------------------------------------------------


def train_step(student: nn.Module, teacher: nn.Module, x: Tensor, optimizer: torch.optim.Optimizer,
               cfg: DistillConfig) -> dict[str, float]:
    """One optimizer step on token windows x (batch, seq_len): position t of x[:, :-1] predicts x[:, t + 1].
    The teacher runs without gradients; the student's loss is the weighted sum of the enabled terms; gradients are
    clipped to norm cfg.clip. Returns the loss, each term and the gradient norm before clipping."""
    raise NotImplementedError("task 09.step: the teacher only answers (no graph); the student's forward and the "
                              "weighted terms build the loss; then the usual order of an optimizer step, with the "
                              "clipping where it can still change the update")

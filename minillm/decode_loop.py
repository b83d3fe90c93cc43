"""The decode loop (lesson 01): prefill the prompt once, then one token per step until a stop token or the budget.

With `kv=None` every step re-runs the model over the whole sequence (lesson 00's baseline); with a cache only the new
token goes through the model. Where keys and values live (contiguous, int8, paged blocks) is the cache's business;
which cache, the compiled step or the speculative loop runs is chosen by the front door (minillm/api.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from minillm.request import Request
from minillm.sampling import sample_from_logits


@torch.inference_mode()
def decode_tokens(model, req: Request, kv=None) -> Iterator[int]:
    """Yield the new token ids of one validated request, one at a time; the stop token that ends it is yielded."""
    params = req.params
    seq = torch.tensor([req.prompt_ids], dtype=torch.long, device=model.device)
    step_input = seq
    for _ in range(params.max_tokens):
        logits = model(step_input, kv_cache=kv, last_only=True)[:, -1]  # (1, vocab)
        token = sample_from_logits(logits, params.temperature, params.top_k, params.top_p, req.generator)  # (1,)
        tok = int(token)
        yield tok
        if tok in req.stop_ids:
            return
        if kv is None:  # baseline: feed the whole sequence again next step
            seq = torch.cat([seq, token[:, None]], dim=1)
            step_input = seq
        else:  # cached: only the new token goes through the model
            step_input = token[:, None]

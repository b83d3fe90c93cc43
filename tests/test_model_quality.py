"""Quality measures (minillm.compress.quality) and the real model's quality on real text.

Oracles: a model with uniform logits has perplexity = vocabulary size exactly; torch's F.kl_div; and the weights as
stored in the GGUF file (q/k rows in llama.cpp's permuted layout), which must score far worse under our RoPE.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minillm.config import ModelConfig
from minillm.gguf.loader import unpermute_qk
from minillm.model import Transformer
from minillm.compress.quality import (
    eval_ids,
    kl_divergence,
    kl_to_reference,
    perplexity,
    perplexity_of_ids,
    pydoc_text,
)
from minillm.gguf.weights import gguf_path

N_TOKENS = 512


class UniformModel(torch.nn.Module):
    """Every next token equally likely: perplexity must come out as exactly the vocabulary size."""

    device = torch.device("cpu")

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.vocab)


def test_pydoc_text_is_there():
    text = pydoc_text()
    assert len(text) > 300_000 and "for" in text


def test_perplexity_of_uniform_model_is_vocab_size():
    ids = list(range(100))
    for window in (2, 7, 100, 1000):
        assert perplexity_of_ids(UniformModel(321), ids, window=window) == pytest.approx(321, rel=1e-5)
    with pytest.raises(ValueError, match="window"):
        perplexity_of_ids(UniformModel(321), ids, window=1)


def test_perplexity_matches_hand_computation():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny()).eval()
    ids = torch.randint(0, 512, (40,)).tolist()
    with torch.inference_mode():
        logp = model(torch.tensor([ids]))[0].log_softmax(-1)
    nll = -sum(logp[t, ids[t + 1]].item() for t in range(39)) / 39
    assert perplexity_of_ids(model, ids, window=40) == pytest.approx(math.exp(nll), rel=1e-4)


def test_kl_divergence_matches_torch():
    a, b = torch.randn(5, 7, 50), torch.randn(5, 7, 50)
    expected = F.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(kl_divergence(a, b), expected)
    assert kl_divergence(a, a).abs().max() < 1e-6


def test_kl_to_reference_is_zero_for_same_model_and_matches_hand_computation():
    # untied: a random tied LM head just predicts the input token again with probability ~1 (KL ~ 0 for any pair)
    torch.manual_seed(1)
    model = Transformer(ModelConfig.tiny(tie_embeddings=False)).eval()
    torch.manual_seed(2)
    other = Transformer(ModelConfig.tiny(tie_embeddings=False)).eval()
    ids = torch.randint(0, 512, (1, 30))
    assert kl_to_reference(model, model, ids) == pytest.approx(0.0, abs=1e-6)
    with torch.inference_mode():  # windows of 8 are scored independently: 8 + 8 + 8 + 6 positions
        per_pos = torch.cat([kl_divergence(model(c)[0], other(c)[0]) for c in ids.split(8, dim=1)])
    assert per_pos.mean() > 0.01
    assert kl_to_reference(other, model, ids, window=8) == pytest.approx(per_pos.mean().item(), rel=1e-4)


@pytest.fixture(scope="module")
def real_ppl(real_model):
    model, tok = real_model
    return perplexity(model, tok, max_tokens=N_TOKENS, window=N_TOKENS)


def test_real_model_perplexity_on_pydoc(real_ppl):
    print(f"SmolLM2-135M perplexity on the first {N_TOKENS} tokens of pydoc_data.topics: {real_ppl:.2f}")
    assert 3 < real_ppl < 30


def gguf_qk_rows_as_stored() -> dict[str, np.ndarray]:
    """Just the attn_q / attn_k tensors of the GGUF file, dequantized, rows in the order the file stores them."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = {}
    for t in GGUFReader(str(gguf_path())).tensors:
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            out[t.name] = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return out


def test_rope_convention_permuted_qk_rows_ruin_perplexity(real_model, real_ppl):
    """GGUF stores q/k rows permuted for llama.cpp's adjacent-pair RoPE; with our rotate-half RoPE they must be
    un-permuted (minillm.gguf.loader.gguf_state_dict does it). Skipping that still runs but the model falls apart."""
    model, tok = real_model
    stored = gguf_qk_rows_as_stored()
    cfg = model.config
    raw = copy.deepcopy(model)
    for i, block in enumerate(raw.layers):
        q_rows, k_rows = stored[f"blk.{i}.attn_q.weight"], stored[f"blk.{i}.attn_k.weight"]
        # the loaded model holds the un-permuted rows; the raw model gets the rows exactly as stored in the file
        torch.testing.assert_close(block.attn.wq.weight, torch.from_numpy(unpermute_qk(q_rows, cfg.n_heads)))
        torch.testing.assert_close(block.attn.wk.weight, torch.from_numpy(unpermute_qk(k_rows, cfg.n_kv_heads)))
        block.attn.wq.weight.data.copy_(torch.from_numpy(q_rows))
        block.attn.wk.weight.data.copy_(torch.from_numpy(k_rows))
    bad = perplexity_of_ids(raw, eval_ids(tok, N_TOKENS), N_TOKENS)
    print(f"perplexity with un-permuted q/k {real_ppl:.2f}, with GGUF's permuted rows {bad:.2f}")
    assert bad > 3 * real_ppl

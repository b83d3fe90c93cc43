"""Weight prepacking (minillm/compile/prepack.py) against the plain float32 matmul it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minillm.compile.prepack import PackedLinear, prepack, why_not_prepack
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(why_not_prepack() is not None, reason=str(why_not_prepack()))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.integers(1, 70), lead=st.sampled_from([(), (1,), (3,), (2, 5)]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_a_packed_linear_equals_f_linear(n, k, lead, bias, seed):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g))
    x = torch.randn(*lead, k, generator=g)
    packed = PackedLinear.from_linear(linear)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_a_prepacked_model_keeps_its_state_dict_tying_and_greedy_tokens():
    model = tiny_model(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    keys = list(model.state_dict())
    with torch.inference_mode():
        want = model(ids)
    prepack(model)
    assert list(model.state_dict()) == keys
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) > 0
    if model.config.tie_embeddings:
        assert model.lm_head.weight is model.embed.weight
    with torch.inference_mode():
        got = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_weight_changed_in_place_is_repacked():
    linear = PackedLinear.from_linear(nn.Linear(16, 8))
    x = torch.randn(3, 16)
    with torch.no_grad():
        linear.weight.mul_(2)  # as pruning or a load_state_dict would
    with torch.inference_mode():
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))


def test_autograd_and_other_dtypes_take_the_plain_matmul():
    linear = PackedLinear.from_linear(nn.Linear(16, 8))
    x = torch.randn(3, 16)
    linear(x).sum().backward()  # the packed op has no backward: the plain one ran
    assert linear.weight.grad is not None
    bf = PackedLinear.from_linear(nn.Linear(16, 8)).to(torch.bfloat16)
    xb = x.bfloat16()
    with torch.inference_mode():
        assert torch.equal(bf(xb), F.linear(xb, bf.weight, bf.bias))

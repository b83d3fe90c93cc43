"""The Triton paged decode kernel (under the interpreter on CPU) against SDPA over each sequence's own keys."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:  # not importorskip: importing triton first would fix its mode
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from minillm_kernels.paged_decode import INTERPRET, triton_paged_decode

from tests.test_paged import make_pool, sdpa_over

DEVICE = "cpu" if INTERPRET else "cuda"


def run(q, k_pool, v_pool, tables, lens, **kw):
    to = lambda t: t.to(DEVICE)
    return triton_paged_decode(to(q), to(k_pool), to(v_pool), to(tables), to(torch.tensor(lens)), **kw).cpu()


@settings(max_examples=12, deadline=None)
@given(heads=st.sampled_from([(4, 1), (4, 2), (6, 2), (9, 3), (2, 2)]), block_size=st.sampled_from([4, 16]),
       head_dim=st.sampled_from([16, 32]), lens=st.lists(st.integers(1, 50), min_size=1, max_size=3),
       splits=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_triton_paged_decode_matches_sdpa(heads, block_size, head_dim, lens, splits, seed):
    """GQA groups, shuffled block ids, lengths not multiples of the block size (and 1), NaN in every unowned slot,
    context splits (some of them empty for the shorter sequences)."""
    n_heads, n_kv_heads = heads
    k_pool, v_pool, tables, seqs = make_pool(lens, block_size, n_kv_heads, head_dim, seed)
    q = torch.randn(len(lens), n_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    out = run(q, k_pool, v_pool, tables, lens, num_splits=splits, tile=16)
    assert not out.isnan().any(), "a slot past a sequence's length leaked into the output"
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], sdpa_over(q[i:i + 1], k, v)[0], atol=2e-5, rtol=1e-4)


def test_non_power_of_two_head_dim_and_block_size():
    lens = [7, 30]
    k_pool, v_pool, tables, seqs = make_pool(lens, 6, 1, 24, seed=1)
    q = torch.randn(2, 3, 24)
    out = run(q, k_pool, v_pool, tables, lens)
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i], sdpa_over(q[i:i + 1], k, v)[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    lens = [3, 40]
    k_pool, v_pool, tables, seqs = make_pool(lens, 16, 2, 32, seed=2, dtype=dtype, junk=0.0)
    q = torch.randn(2, 4, 32).to(dtype)
    out = run(q, k_pool, v_pool, tables, lens)
    assert out.dtype == dtype
    for i, (k, v) in enumerate(seqs):
        torch.testing.assert_close(out[i].float(), sdpa_over(q[i:i + 1], k, v)[0], atol=3e-2, rtol=3e-2)


def test_cache_decode_backend_triton_equals_torch():
    from minillm.config import ModelConfig
    from minillm.model import Transformer
    from minillm.cache.paged import PagedSequenceCache

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(n_layers=1, dim=64, n_heads=4, n_kv_heads=2)).eval().to(DEVICE)
    prompt = torch.randint(0, 512, (2, 21), device=DEVICE)
    caches = {}
    with torch.no_grad():
        for backend in ("torch", "triton_paged"):
            cache = PagedSequenceCache.for_model(model, 2, 24, block_size=4)
            cache.decode_backend = backend
            model(prompt, kv_cache=cache)
            caches[backend] = model(prompt[:, :1], kv_cache=cache)  # one decode step at position 21
    torch.testing.assert_close(caches["triton_paged"], caches["torch"], atol=1e-5, rtol=1e-5)


def test_bad_inputs_have_clear_errors():
    q, pool = torch.randn(2, 4, 16), torch.randn(3, 4, 2, 16)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([1, 1])
    with pytest.raises(ValueError, match="one layer's pools"):
        triton_paged_decode(q, pool[None], pool[None], tables, lens)
    with pytest.raises(TypeError, match="cast them"):
        triton_paged_decode(q.double(), pool.double(), pool.double(), tables, lens)
    with pytest.raises(TypeError, match="share one"):
        triton_paged_decode(q, pool.half(), pool, tables, lens)
    with pytest.raises(ValueError, match="must divide"):
        triton_paged_decode(torch.randn(2, 3, 16), pool, pool, tables, lens)
    with pytest.raises(ValueError, match="block_tables"):
        triton_paged_decode(q, pool, pool, tables.float(), lens)
    with pytest.raises(ValueError, match="context_lens"):
        triton_paged_decode(q, pool, pool, tables, torch.tensor([1]))
    with pytest.raises(ValueError, match="power of 2"):
        triton_paged_decode(q, pool, pool, tables, lens, num_splits=3)
    with pytest.raises(ValueError, match="contiguous"):
        triton_paged_decode(q, pool.transpose(2, 3).contiguous().transpose(2, 3), pool, tables, lens)

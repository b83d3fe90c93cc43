"""Sparsity and pruning (lesson 08): masks against brute-force oracles, 2:4 format round trips, pruned models equal
to the unpruned model with the removed parts zeroed, every inference path on a pruned model, save/load."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minillm.config import ModelConfig
from minillm.api import generate_ids
from minillm.model import Transformer
from minillm.compress.pruning import (
    block_importance,
    drop_blocks,
    ffn_channel_importance,
    greedy_block_drop,
    kv_group_importance,
    least_important,
    n_params,
    prune_ffn_channels,
    prune_kv_groups,
    prune_structured,
)
from minillm.sampling import SamplingParams
from minillm.compress.sparsity import (
    compress_2to4,
    decompress_2to4,
    format_bytes,
    is_n_m_sparse,
    magnitude_scores,
    prune,
    semi_structured_mask,
    sparsity_of,
    unstructured_mask,
    wanda_scores,
)

TINY = ModelConfig(vocab_size=96, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128)
CALIB = [(7 * i + 3) % 96 for i in range(96)]


def tiny_model(seed=0, cfg=TINY) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(cfg).eval().requires_grad_(False)
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m


def logits(model, ids=CALIB[:40]):
    return model(torch.tensor([ids]))


# ------------------------------------------------------------------------------------------------- masks


@settings(max_examples=40)
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), s=st.floats(0, 0.99), per_row=st.booleans(),
       seed=st.integers(0, 2**16))
def test_unstructured_mask_drops_exactly_the_lowest(rows, cols, s, per_row, seed):
    scores = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed))
    mask = unstructured_mask(scores, s, per_row=per_row)
    groups = [(scores[r], mask[r]) for r in range(rows)] if per_row else [(scores.flatten(), mask.flatten())]
    for sc, mk in groups:
        assert int((~mk).sum()) == int(sc.numel() * s)  # exactly floor(s * n) zeros per comparison group
        if (~mk).any() and mk.any():
            assert sc[mk].min() >= sc[~mk].max()  # every kept score beats every dropped one


def test_per_row_and_per_matrix_differ_where_rows_differ_in_scale():
    scores = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    assert unstructured_mask(scores, 0.5, per_row=True).tolist() == [[False, False, True, True]] * 2
    assert unstructured_mask(scores, 0.5, per_row=False).tolist() == [[False] * 4, [True] * 4]


def test_wanda_scores_weight_by_activation_norm():
    w = torch.tensor([[1.0, -4.0], [2.0, 1.0]])
    norm = torch.tensor([10.0, 1.0])
    assert wanda_scores(w, norm).tolist() == [[10.0, 4.0], [20.0, 1.0]]
    assert unstructured_mask(wanda_scores(w, norm), 0.5).tolist() == [[True, False], [True, False]]
    assert unstructured_mask(magnitude_scores(w), 0.5).tolist() == [[False, True], [True, False]]


@settings(max_examples=40)
@given(rows=st.integers(1, 6), groups=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_2to4_mask_keeps_the_two_largest_of_every_four(rows, groups, seed):
    scores = torch.rand(rows, 4 * groups, generator=torch.Generator().manual_seed(seed))
    mask = semi_structured_mask(scores)
    g, mg = scores.reshape(rows, groups, 4), mask.reshape(rows, groups, 4)
    assert (mg.sum(-1) == 2).all()
    kept_min = torch.where(mg, g, torch.inf).amin(-1)
    dropped_max = torch.where(mg, -torch.inf, g).amax(-1)
    assert (kept_min >= dropped_max).all()
    assert is_n_m_sparse(scores * mask)


@settings(max_examples=40)
@given(rows=st.integers(1, 5), groups=st.integers(1, 6), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       extra_zeros=st.booleans(), seed=st.integers(0, 2**16))
def test_2to4_format_round_trips_and_counts_its_bytes(rows, groups, dtype, extra_zeros, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 8 * groups, generator=gen)
    if extra_zeros:  # groups with fewer than 2 nonzeros must survive too
        w[torch.rand(w.shape, generator=gen) < 0.4] = 0
    w = (w * semi_structured_mask(w.abs())).to(dtype)
    values, meta = compress_2to4(w)
    assert values.shape == (rows, 4 * groups) and meta.dtype == torch.uint8 and meta.shape == (rows, groups)
    assert torch.equal(decompress_2to4(values, meta), w)
    nbytes = values.numel() * values.element_size() + meta.numel()
    assert nbytes == format_bytes(tuple(w.shape), 0.5, value_bytes=w.element_size())["2:4"]


def test_format_bytes_csr_is_no_smaller_than_dense_bf16_at_half_sparsity():
    b = format_bytes((576, 1536), 0.5)
    assert b["csr"] > b["dense"] > b["2:4"] and b["2:4"] / b["dense"] == pytest.approx(0.5625)


def test_mask_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        unstructured_mask(torch.rand(2, 4), 1.0)
    for s in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="sparsity"):
            unstructured_mask(torch.rand(2, 4), s)
    with pytest.raises(ValueError, match="not divisible by 4"):
        semi_structured_mask(torch.rand(2, 6))
    with pytest.raises(ValueError, match="NaN"):
        unstructured_mask(torch.tensor([[1.0, float("nan")]]), 0.5)
    with pytest.raises(ValueError, match="NaN"):
        semi_structured_mask(torch.tensor([[1.0, float("nan"), 0.0, 2.0]]))
    with pytest.raises(ValueError, match="one entry per input channel"):
        wanda_scores(torch.rand(2, 4), torch.rand(3))
    with pytest.raises(ValueError, match="not 2:4 sparse"):
        compress_2to4(torch.ones(1, 8))


# ------------------------------------------------------------------------------------------ pruning a model


@pytest.mark.parametrize("method,pattern,s", [("magnitude", "unstructured", 0.3), ("wanda", "unstructured", 0.6),
                                              ("wanda", "2:4", 0.5), ("magnitude", "2:4", 0.5)])
def test_prune_hits_the_sparsity_on_every_block_linear(method, pattern, s):
    m = tiny_model()
    embed = m.embed.weight.clone()
    report = prune(m, s, method, pattern, calib_ids=CALIB, window=32)
    assert len(report) == 7 * TINY.n_layers
    for block in m.layers:
        for lin in (mod for mod in block.modules() if isinstance(mod, nn.Linear)):
            if pattern == "2:4":
                assert is_n_m_sparse(lin.weight)  # the constraint holds on every layer
            else:
                n = lin.in_features if method == "wanda" else lin.weight.numel()  # per row / per matrix
                assert (lin.weight == 0).float().mean() == pytest.approx(int(n * s) / n)
    assert torch.equal(m.embed.weight, embed) and sparsity_of(m) == pytest.approx(s, abs=0.02)


def test_zero_sparsity_leaves_the_model_unchanged():
    m, ref = tiny_model(), tiny_model()
    prune(m, 0.0, "wanda", calib_ids=CALIB)
    assert torch.equal(logits(m), logits(ref))


def test_wanda_first_block_uses_its_dense_input_norms():
    """Block 0 sees the embedding whatever is pruned: its mask must come from ||attn_norm(embed(x))|| per column."""
    m, ref = tiny_model(), tiny_model()
    prune(m, 0.5, "wanda", calib_ids=CALIB, window=32)
    x = ref.layers[0].attn_norm(ref.embed(torch.tensor([CALIB[i:i + 32] for i in range(0, 96, 32)])))
    norm = x.reshape(-1, TINY.dim).pow(2).sum(0).sqrt()
    want = unstructured_mask(wanda_scores(ref.layers[0].attn.wq.weight, norm), 0.5)
    assert torch.equal(m.layers[0].attn.wq.weight != 0, want)


def test_prune_bad_input():
    m = tiny_model()
    with pytest.raises(ValueError, match="calib_ids"):
        prune(m, 0.5, "wanda")
    with pytest.raises(ValueError, match="sparsity is 0.5"):
        prune(m, 0.3, "magnitude", "2:4")
    with pytest.raises(ValueError, match="unknown method"):
        prune(m, 0.5, "random")
    from minillm.compress.quantize import quantize

    with pytest.raises(ValueError, match="float model"):
        prune(quantize(tiny_model(), "int8"), 0.5, "magnitude")


# ------------------------------------------------------------------------------------------- structured


def test_drop_blocks_equals_skipping_them():
    m, ref = tiny_model(), tiny_model()
    drop_blocks(m, [1, 2])
    assert m.config.n_layers == 2 and len(m.layers) == 2
    x = torch.tensor([CALIB[:20]])
    h = ref.embed_tokens(x)
    pos = torch.arange(20)[None]
    for i in (0, 3):
        h = ref.run_layers(h, pos, layers=slice(i, i + 1))
    torch.testing.assert_close(m(x), ref.logits(h))


def _zero_heads_oracle(ref: Transformer, keep_groups: list[list[int]]) -> None:
    """Removing a KV group == zeroing its query heads' columns of wo (they contribute only through wo)."""
    hd, g = ref.config.head_dim, ref.config.group_size
    for block, keep in zip(ref.layers, keep_groups):
        for grp in range(ref.config.n_kv_heads):
            if grp not in keep:
                block.attn.wo.weight[:, grp * g * hd:(grp + 1) * g * hd] = 0


def test_prune_kv_groups_equals_zeroing_their_heads():
    m, ref = tiny_model(), tiny_model()
    imp = torch.tensor([[1.0, 2.0], [3.0, 0.5], [0.1, 0.2], [5.0, 4.0]])
    prune_kv_groups(m, 1, imp)
    assert (m.config.n_heads, m.config.n_kv_heads, m.config.head_dim) == (2, 1, 16)
    _zero_heads_oracle(ref, [[1], [0], [1], [0]])
    torch.testing.assert_close(logits(m), logits(ref))


def test_prune_ffn_channels_equals_zeroing_them():
    m, ref = tiny_model(), tiny_model()
    imp = torch.rand(TINY.n_layers, TINY.ffn_dim, generator=torch.Generator().manual_seed(1))
    prune_ffn_channels(m, 80, imp)
    assert m.config.ffn_dim == 80 and m.layers[0].mlp.down.in_features == 80
    for block, i in zip(ref.layers, imp):
        block.mlp.down.weight[:, torch.argsort(i, descending=True)[80:]] = 0
    torch.testing.assert_close(logits(m), logits(ref))


def test_keeping_everything_is_the_identity():
    m, ref = tiny_model(), tiny_model()
    prune_kv_groups(m, TINY.n_kv_heads, torch.rand(TINY.n_layers, TINY.n_kv_heads))
    prune_ffn_channels(m, TINY.ffn_dim, torch.rand(TINY.n_layers, TINY.ffn_dim))
    assert torch.equal(logits(m), logits(ref))


def test_importances_find_what_does_nothing():
    m = tiny_model()
    m.layers[2].attn.wo.weight.zero_()
    m.layers[2].mlp.down.weight.zero_()  # block 2 is now the identity
    m.layers[1].attn.wo.weight[:, 32:] = 0  # KV group 1 of block 1 contributes nothing
    m.layers[3].mlp.down.weight[:, 5] = 0
    assert least_important(block_importance(m, CALIB, 32), 1) == [2]
    assert float(block_importance(m, CALIB, 32)[2]) == pytest.approx(0, abs=1e-6)
    assert float(kv_group_importance(m, CALIB, 32)[1, 1]) == 0
    assert float(ffn_channel_importance(m, CALIB, 32)[3, 5]) == 0


def _kl_after_dropping(model, drop, x, mask):
    """Oracle: the KL the pruned copy costs, computed through the public path (drop_blocks + forward)."""
    import copy

    ref = torch.log_softmax(model(x)[mask].double(), -1)
    pruned = drop_blocks(copy.deepcopy(model), list(drop))
    logp = torch.log_softmax(pruned(x)[mask].double(), -1)
    return float((ref.exp() * (ref - logp)).sum(-1).mean())


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 1000), batch=st.integers(1, 3), seq=st.integers(2, 24), k=st.integers(1, 3),
       masked=st.booleans())
def test_greedy_block_drop_equals_brute_force_rounds(seed, batch, seq, k, masked):
    """Each round's choice is the block whose removal (given the earlier ones) has the least KL, found here by
    dropping every candidate through drop_blocks and a whole forward."""
    m = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) < 0.5 if masked else None
    if mask is not None:
        mask[0, -1] = True
    order = greedy_block_drop(m, x, k, mask)
    full = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    assert len(order) == k == len(set(order))
    for r in range(k):
        costs = {c: _kl_after_dropping(m, order[:r] + [c], x, full) for c in range(TINY.n_layers) if c not in order[:r]}
        assert costs[order[r]] == pytest.approx(min(costs.values()), abs=1e-5), (r, costs, order)


def test_greedy_block_drop_finds_a_free_block_first():
    """An identity block costs no KL to remove: round 1 takes it. k=0 removes nothing."""
    m = tiny_model()
    m.layers[2].attn.wo.weight.zero_()
    m.layers[2].mlp.down.weight.zero_()  # block 2 is the identity: free to drop, found in round 1
    x = torch.tensor([CALIB[:32]])
    order = greedy_block_drop(m, x, 2)
    assert order[0] == 2 and _kl_after_dropping(m, [2], x, torch.ones_like(x, dtype=torch.bool)) < 1e-9
    assert greedy_block_drop(m, x, 0) == []


def test_greedy_block_drop_bad_input():
    m = tiny_model()
    x = torch.tensor([CALIB[:16]])
    with pytest.raises(ValueError, match="0..3"):
        greedy_block_drop(m, x, 4)
    with pytest.raises(ValueError, match="batch, seq"):
        greedy_block_drop(m, x[0], 1)
    with pytest.raises(ValueError, match="mask"):
        greedy_block_drop(m, x, 1, torch.zeros_like(x, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        greedy_block_drop(m, x, 1, torch.ones(1, 3, dtype=torch.bool))
    from minillm.compile.fusion import fuse

    with pytest.raises(ValueError, match="unfused"):
        greedy_block_drop(fuse(tiny_model()), x, 1)


def test_pruned_model_runs_every_path_identically():
    from minillm.engine.llm import LLM

    m = tiny_model()
    report = prune_structured(m, CALIB, drop_n_blocks=1, kv_groups=1, ffn_dim=64, window=32)
    assert report["params_after"] == n_params(m) < report["params_before"]
    cfg = m.config
    assert (cfg.n_layers, cfg.n_kv_heads, cfg.n_heads, cfg.ffn_dim) == (3, 1, 2, 64)
    prompt, params = CALIB[:12], SamplingParams(max_tokens=8, ignore_eos=True)
    want = []  # greedy without a cache: the whole sequence re-run each step
    for _ in range(8):
        want.append(int(m(torch.tensor([prompt + want]))[0, -1].argmax()))
    for cache in ("contiguous", "paged"):
        assert list(generate_ids(m, prompt, params, cache=cache)) == want, cache
    engine = LLM.from_model(m, None, num_blocks=16, max_num_seqs=2)
    assert all(r.token_ids == want for r in engine.generate([prompt, prompt], params))


def test_structured_bad_input():
    m = tiny_model()
    with pytest.raises(ValueError, match="1..2"):
        prune_kv_groups(m, 3, torch.rand(4, 2))
    with pytest.raises(ValueError, match="whole number"):
        prune_kv_groups(m, 1.5, torch.rand(4, 2))
    with pytest.raises(ValueError, match=r"\(n_layers, n_kv_heads\)"):
        prune_kv_groups(m, 1, torch.rand(4, 4))
    with pytest.raises(ValueError, match="NaN"):
        prune_ffn_channels(m, 10, torch.full((4, 128), float("nan")))
    with pytest.raises(ValueError, match="1..128"):
        prune_ffn_channels(m, 0, torch.rand(4, 128))
    with pytest.raises(ValueError, match="at least one"):
        drop_blocks(m, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="0..3"):
        drop_blocks(m, [4])
    with pytest.raises(ValueError, match="duplicate"):
        drop_blocks(m, [1, 1])
    from minillm.compile.fusion import fuse

    with pytest.raises(ValueError, match="unfused"):
        kv_group_importance(fuse(tiny_model()), CALIB)


# ------------------------------------------------------------------------------------------------ save / load


def test_save_and_load_round_trip_exactly(tmp_path, monkeypatch):
    from minillm.gguf import loader, saved
    monkeypatch.setattr(saved, "saved_model_dir", lambda name: tmp_path / name)
    import minillm.gguf.tokenizer_cache

    monkeypatch.setattr(minillm.gguf.tokenizer_cache, "tokenizer_of", lambda name: "tok")
    m = tiny_model()
    prune_structured(m, CALIB, drop_n_blocks=1, kv_groups=1, ffn_dim=96, window=32)
    folder = saved.save_model(m, "pruned", info={"dropped": [2]})
    back, tok = saved.load_saved("pruned")
    assert tok == "tok" and back.config == m.config and back.saved_info == {"dropped": [2]}
    for (k, a), (k2, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    assert back.lm_head.weight is back.embed.weight
    assert torch.equal(logits(back), logits(m))
    from minillm.api import load_model

    by_name, _ = load_model("pruned")  # everything that loads a model by name finds a saved one
    assert by_name.config == m.config and torch.equal(logits(by_name), logits(m))
    assert loader.load_from_file("pruned")[0].config == m.config
    fused, _ = load_model("pruned", fuse=True)  # structured-pruned, then fused (or quantized) at load (lesson 14)
    torch.testing.assert_close(logits(fused), logits(m), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="saved float model with no file of 4-bit blocks"):
        load_model("pruned", weights="q4")
    with pytest.raises(ValueError, match="not been made on this machine yet: run lesson 08"):
        load_model("smollm2-pruned-20")  # a course model with no shipped recipe (the student has one: lesson 09)
    raw = bytearray((folder / "model.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (folder / "model.pt").write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="checksum"):
        saved.load_saved("pruned")
    with pytest.raises(FileNotFoundError, match="save one first"):
        saved.load_saved("never-saved")


def test_saved_name_must_be_a_plain_folder():
    from minillm.gguf.saved import saved_model_dir

    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="plain folder"):
            saved_model_dir(bad)


# ------------------------------------------------------------------------------------------------ real model


@pytest.mark.slow
def test_wanda_beats_magnitude_at_half_sparsity_on_smollm2(real_model):
    from minillm import load_model
    from minillm.compress.quality import calibration_ids, perplexity

    _, tok = real_model
    calib = calibration_ids(tok, 256)
    ppl = {}
    for method in ("magnitude", "wanda"):
        m, _ = load_model(dtype="float32")
        prune(m, 0.5, method, calib_ids=calib)
        ppl[method] = perplexity(m, tok, max_tokens=256, window=256)
    assert ppl["wanda"] < ppl["magnitude"] / 2


def test_dropping_a_quarter_of_smollm2_still_runs_the_engine(real_model):
    from minillm import load_model
    from minillm.engine.llm import LLM
    from minillm.compress.quality import calibration_ids

    _, tok = real_model
    m, _ = load_model(dtype="float32")
    report = prune_structured(m, calibration_ids(tok, 128), drop_n_blocks=10, window=128)
    assert report["params_removed"] >= 0.25 and m.config.n_layers == 20
    prompt = tok.encode("The capital of France is")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = list(generate_ids(m, prompt, params, cache="contiguous"))
    assert list(generate_ids(m, prompt, params, cache="paged")) == want
    assert LLM.from_model(m, tok, num_blocks=8).generate([prompt], params)[0].token_ids == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="2:4 sparse kernels need an NVIDIA GPU (compute 8.0+)")
def test_semi_structured_cuda_linear_matches_dense():
    from torch.sparse import to_sparse_semi_structured

    w = torch.randn(576, 1536, device="cuda", dtype=torch.float16)
    w = w * semi_structured_mask(w.abs().float()).to(w.dtype)
    x = torch.randn(64, 1536, device="cuda", dtype=torch.float16)
    want = x.float() @ w.float().T
    got = torch.nn.functional.linear(x, to_sparse_semi_structured(w)).float()
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()

"""The model file -> (Transformer, Tokenizer), with an explicit map from GGUF names to our parameters.

Plain loading only (lesson 00): minillm.api.load_model adds the techniques a caller asks for (fuse=True,
weights="q4"). A name that is no model file is one the course made (gguf/saved.py: lessons 08-09)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.gguf.saved import (HOW_TO_MAKE, build_from_recipe, built_from_current_recipe, empty_model, load_saved,
                                recipe_path, saved_config, saved_model_exists)
from minillm.gguf.weights import gguf_path, model_source, read_gguf, read_gguf_metadata

if TYPE_CHECKING:
    from minillm.gguf.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {list(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
    return device


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of q/k rows, back to the 'rotate half' (HF) layout.

    The converter reorders each head's rows so that llama.cpp can rotate adjacent pairs (2i, 2i+1). We rotate the
    pairs (i, i + head_dim/2) instead, so we put the rows back. Skipping this still runs, but perplexity goes ~6x
    worse: tests/test_model.py checks it.
    """
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def gguf_state_dict(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameter names -> arrays. Every GGUF tensor must be used exactly once."""
    sd = {"embed.weight": tensors["token_embd.weight"], "norm.weight": tensors["output_norm.weight"]}
    if "output.weight" in tensors:
        sd["lm_head.weight"] = tensors["output.weight"]
    names = {
        "attn_norm": "attn_norm.weight", "ffn_norm": "mlp_norm.weight",
        "attn_q": "attn.wq.weight", "attn_k": "attn.wk.weight", "attn_v": "attn.wv.weight",
        "attn_output": "attn.wo.weight",
        "ffn_gate": "mlp.gate.weight", "ffn_up": "mlp.up.weight", "ffn_down": "mlp.down.weight",
    }
    for i in range(cfg.n_layers):
        for g, ours in names.items():
            w = tensors[f"blk.{i}.{g}.weight"]
            if g == "attn_q":
                w = unpermute_qk(w, cfg.n_heads)
            elif g == "attn_k":
                w = unpermute_qk(w, cfg.n_kv_heads)
            sd[f"layers.{i}.{ours}"] = w
    return sd


def _q4_1_layers(sd: dict, make_layer) -> dict:
    """Our names -> make_layer(name, raw) for every Q4_1 tensor (removed from sd); raw: the file's blocks, uint8
    (out, in // 32 * 20), q/k rows already unpermuted (a row permutation keeps blocks whole)."""
    from minillm.gguf.reader import release_pages

    layers = {}
    for ours, arr in list(sd.items()):
        if arr.dtype != np.uint8:
            continue
        name = ours.removesuffix(".weight")
        layers[name] = make_layer(name, arr)
        release_pages(arr)  # converted: its pages of the file map may leave memory
        del sd[ours]
    return layers


def load_from_file(name: str = "smollm2-135m", dtype: str | torch.dtype = "float32", device: str | None = "cpu",
                   attn_backend: str = "sdpa", q4_1_layer=None, q8_0_tied=None):
    """(model, tokenizer) of a known model, every tensor in `dtype`; downloads and verifies the file on first use.
    q4_1_layer(name, raw) -> nn.Module keeps each Q4_1 tensor packed in the layer it builds from the file's blocks
    (the caller chooses the layer type: minillm/api.py builds lesson 07's Int4Linear; q4_1_packed reads the blocks).
    q8_0_tied(raw, dtype) -> (lm_head, embed) does the same for a Q8_0 tied embedding (the two modules share its
    storage). A name saved with save_model loads from disk (a shipped recipe is built into the cache first, once)."""
    from minillm.gguf.tokenizer_cache import tokenizer_of
    from minillm.gguf.weights import KNOWN_MODELS

    if name not in KNOWN_MODELS:
        if recipe_path(name).exists() and not built_from_current_recipe(name):
            build_from_recipe(name, load_from_file)
        if saved_model_exists(name):
            if q4_1_layer is not None or q8_0_tied is not None:
                raise ValueError(f"{name!r} is a saved float model: load it, then quantize it")
            return load_saved(name, resolve_dtype(dtype), resolve_device(device))
        if name in HOW_TO_MAKE:
            raise ValueError(f"{name!r} has not been made on this machine yet: {HOW_TO_MAKE[name]}")
    model_source(name)  # unknown names fail here, before any download
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    t0 = time.perf_counter()
    path = gguf_path(name)
    meta, tensors = read_gguf(path, keep_q4_1=q4_1_layer is not None, keep_q8_0=q8_0_tied is not None)
    cfg = ModelConfig.from_gguf_metadata(meta)
    raw_embed = tensors["token_embd.weight"]
    head = None
    if raw_embed.dtype == np.uint8:  # kept as Q8_0 blocks
        if not cfg.tie_embeddings:
            raise ValueError("q8_0_tied keeps a tied embedding packed; this model's LM head is a separate tensor")
        from minillm.gguf.reader import release_pages

        head = q8_0_tied(raw_embed, torch_dtype)  # built from the file's blocks (q8_0_blocks) in one copy
        release_pages(raw_embed)
    model = empty_model(cfg, attn_backend=attn_backend)
    sd = gguf_state_dict(tensors, cfg)
    if head is not None:
        del sd["embed.weight"]
    packed = _q4_1_layers(sd, q4_1_layer) if q4_1_layer is not None else {}
    sd = {k: torch.from_numpy(v).to(dev) for k, v in sd.items()}
    # assign: the loaded tensors become the parameters (no empty copy to fill); what stays on the meta device (the
    # tied head, the layers kept packed) is replaced below, and the check after it says if anything else is left
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")
               and m.removesuffix(".weight") not in packed and not (head is not None and m == "embed.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight map mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings and head is None:
        model.lm_head.weight = model.embed.weight
    model.rope_cos, model.rope_sin = model.rope_cos.to(dev), model.rope_sin.to(dev)  # built on the CPU (empty)
    model = model.to(torch_dtype).eval().requires_grad_(False)  # RoPE tables stay float32 (Transformer._apply)
    for full, layer in packed.items():
        parent, child = full.rsplit(".", 1)
        setattr(model.get_submodule(parent), child, layer.to(dev))
    if head is not None:
        model.lm_head, model.embed = head[0].to(dev), head[1]
    # the caller's Q4_1 layers are the caller's to fill (load_model's from the converted cache hold a shape first)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta" and n.rsplit(".", 1)[0] not in packed]
    if left:
        raise RuntimeError(f"weight map mismatch: {left} were not loaded")
    if packed:
        model.quant_scheme = "q4_1 (from the file)" + (", q8_0 embedding/head" if head is not None else "")
    model.load_seconds = time.perf_counter() - t0
    return model, tokenizer_of(name, meta)


def load_spec(spec, dtype: str = "float32", device: torch.device | str = "cpu"):
    """(model, tokenizer) for a spec any process can rebuild the same: a registered/saved name, or {"tiny":
    overrides, "seed": s} (a random model, tokenizer None: prompts are token ids), optionally with "tokenizer": a
    name (the random model then speaks that model's vocabulary: text prompts in fast tests). Worker processes load
    with it."""
    if isinstance(spec, dict):
        cfg, tok = describe_spec(spec)
        torch.manual_seed(spec.get("seed", 0))
        return Transformer(cfg).to(getattr(torch, dtype)).to(device).eval(), tok
    return load_from_file(spec, dtype=dtype, device=str(device))


def describe_spec(spec) -> tuple[ModelConfig, Tokenizer | None]:
    """(config, tokenizer) of a spec without loading its weights: what a process that only checks and tokenizes
    prompts for its workers needs."""
    from minillm.gguf.tokenizer_cache import tokenizer_of

    if isinstance(spec, dict):
        tok = describe_spec(spec["tokenizer"])[1] if spec.get("tokenizer") is not None else None
        overrides = dict(spec.get("tiny", {}))
        if tok is not None:
            overrides.setdefault("vocab_size", len(tok))
            if overrides["vocab_size"] < len(tok):
                raise ValueError(f"vocab_size {overrides['vocab_size']} is smaller than the tokenizer's {len(tok)}")
        return ModelConfig.tiny(**overrides), tok
    if not saved_model_exists(spec) and recipe_path(spec).exists():
        build_from_recipe(spec, load_from_file)  # once, as load_from_file would
    if saved_model_exists(spec):
        cfg, base = saved_config(spec)
        return cfg, describe_spec(base)[1]
    model_source(spec)  # unknown names fail here, before any download
    meta = read_gguf_metadata(gguf_path(spec))
    return ModelConfig.from_gguf_metadata(meta), tokenizer_of(spec, meta)

"""load_model: GGUF file -> (Transformer, Tokenizer), with an explicit map from GGUF names to our parameters."""

from __future__ import annotations

import time

import numpy as np
import torch

from .config import ModelConfig
from .model import Transformer
from .weights import gguf_path, model_source, read_gguf

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


WEIGHTS = {
    "dequantized": "every tensor expanded to `dtype` at load (the reference model of every lesson)",
    "q4": "the file's Q4_1 tensors kept as 4-bit Int4Linear layers, bit for bit (lesson 07); the rest in `dtype`",
}


def _int4_from_q4_1(sd: dict) -> dict:
    """Our names -> Int4Linear for every Q4_1 tensor (removed from sd): the file's codes, d and m."""
    from .quant import Int4Linear
    from .weights import q4_1_blocks

    layers = {}
    for ours, arr in list(sd.items()):
        if arr.dtype != np.uint8:
            continue
        codes, d, m = q4_1_blocks(arr)  # q/k rows were already unpermuted: a row permutation keeps blocks whole
        layers[ours.removesuffix(".weight")] = Int4Linear(
            torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(np.ascontiguousarray(d)),
            torch.from_numpy(np.ascontiguousarray(m)), group_size=32)
        del sd[ours]
    return layers


def load_model(name: str = "smollm2-135m", dtype: str | torch.dtype = "float32", device: str | None = "cpu",
               attn_backend: str = "sdpa", fuse: bool = False, weights: str = "dequantized"):
    """Load a known model: returns (model, tokenizer). Downloads and verifies the weights on first use.
    fuse=True applies lesson 06's fusions (minillm.fusion.fuse): same logits, fewer ops per step.
    weights="q4" keeps the file's 4-bit layers packed (see WEIGHTS); the tied Q8_0 embedding is expanded."""
    from .tokenizer import Tokenizer

    model_source(name)  # unknown names fail here, before any download
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights={weights!r}; choose one of {list(WEIGHTS)}")
    if weights == "q4" and fuse:
        raise ValueError("fuse=True rewrites float Linear layers; with weights='q4' they are already 4-bit. "
                         "Use one or the other.")
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    t0 = time.perf_counter()
    path = gguf_path(name)
    meta, tensors = read_gguf(path, keep_q4_1=weights == "q4")
    cfg = ModelConfig.from_gguf_metadata(meta)
    with torch.device("meta"):
        model = Transformer(cfg, attn_backend=attn_backend)
    model = model.to_empty(device=dev)
    sd = gguf_state_dict(tensors, cfg)
    packed = _int4_from_q4_1(sd) if weights == "q4" else {}
    sd = {k: torch.from_numpy(v) for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")
               and m.removesuffix(".weight") not in packed]
    if missing or unexpected:
        raise RuntimeError(f"weight map mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(torch_dtype).eval().requires_grad_(False)  # RoPE tables stay float32 (Transformer._apply)
    for full, layer in packed.items():
        parent, child = full.rsplit(".", 1)
        setattr(model.get_submodule(parent), child, layer.to(dev))
    if packed:
        model.quant_scheme = "q4_1 (from the file)"
    if fuse:
        from .fusion import fuse as fuse_model

        fuse_model(model)
    model.load_seconds = time.perf_counter() - t0
    return model, Tokenizer.from_gguf_metadata(meta)


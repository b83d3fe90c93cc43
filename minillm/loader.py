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


def load_model(name: str = "smollm2-135m", dtype: str | torch.dtype = "float32", device: str | None = "cpu",
               attn_backend: str = "sdpa", fuse: bool = False):
    """Load a known model: returns (model, tokenizer). Downloads and verifies the weights on first use.
    fuse=True applies lesson 06's fusions (minillm.fusion.fuse): same logits, fewer ops per step."""
    from .tokenizer import Tokenizer

    model_source(name)  # unknown names fail here, before any download
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    t0 = time.perf_counter()
    path = gguf_path(name)
    meta, tensors = read_gguf(path)
    cfg = ModelConfig.from_gguf_metadata(meta)
    with torch.device("meta"):
        model = Transformer(cfg, attn_backend=attn_backend)
    model = model.to_empty(device=dev)
    sd = {k: torch.from_numpy(v) for k, v in gguf_state_dict(tensors, cfg).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight map mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(torch_dtype).eval().requires_grad_(False)  # RoPE tables stay float32 (Transformer._apply)
    if fuse:
        from .fusion import fuse as fuse_model

        fuse_model(model)
    model.load_seconds = time.perf_counter() - t0
    return model, Tokenizer.from_gguf_metadata(meta)


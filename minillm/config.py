"""ModelConfig: the handful of numbers that define a Llama-style decoder, read from GGUF metadata.

Lesson 00 uses these numbers to count parameters, FLOPs per token and KV-cache bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    ffn_dim: int = 1536
    rope_theta: float = 100_000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    # explicit, not dim // n_heads: a tensor-parallel shard with a third of the heads keeps head_dim 64 (lesson 11)
    head_dim: int = 0  # 0 = dim // n_heads (the usual Llama choice)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}: give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)  # frozen dataclass: set once, here
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {self.head_dim}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads must divide n_heads: got n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads} "
                f"(valid: {[g for g in range(1, self.n_heads + 1) if self.n_heads % g == 0]})"
            )

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head: 1 is MHA, n_heads is MQA, anything between is GQA."""
        return self.n_heads // self.n_kv_heads

    def n_params(self) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * (self.n_heads * hd) * 2 + d * (self.n_kv_heads * hd) * 2
        mlp = 3 * d * self.ffn_dim
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * per_layer + d + head

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed. head_dim is re-derived from dim / n_heads unless it was given explicitly
        here or differs from dim // n_heads already (then it stays: e.g. a tensor-parallel shard's fewer heads)."""
        if "head_dim" not in changes and self.head_dim == self.dim // self.n_heads:
            changes["head_dim"] = 0
        return replace(self, **changes)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> ModelConfig:
        arch = meta["general.architecture"]
        if arch != "llama":
            raise ValueError(f"only llama-architecture GGUF files are supported, this one is {arch!r}")
        g = lambda key: meta[f"{arch}.{key}"]
        dim, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
        rope_dims = meta.get(f"{arch}.rope.dimension_count", dim // n_heads)
        if rope_dims != dim // n_heads:
            raise ValueError(f"partial RoPE ({rope_dims} of {dim // n_heads} dims) is not supported")
        return cls(
            vocab_size=int(meta.get(f"{arch}.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
            dim=dim,
            n_layers=int(g("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
            ffn_dim=int(g("feed_forward_length")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
            norm_eps=float(g("attention.layer_norm_rms_epsilon")),
            max_seq_len=int(g("context_length")),
            head_dim=int(meta.get(f"{arch}.attention.key_length", dim // n_heads)),
        )

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """A few-hundred-thousand-parameter config for fast tests: same shape rules as the real model."""
        base = {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                "max_seq_len": 512}
        base.update(overrides)
        return cls(**base)


SMOLLM2_135M = ModelConfig()
LLAMA2_7B = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                        rope_theta=10_000.0, max_seq_len=4096, tie_embeddings=False)
LLAMA2_70B = ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                         rope_theta=10_000.0, max_seq_len=4096, tie_embeddings=False)

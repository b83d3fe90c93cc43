"""minillm: LLM inference optimization, one technique at a time, on a real model (SmolLM2-135M).

    model, tok = minillm.load_model("smollm2-135m", dtype="bfloat16")
    print(minillm.generate(model, tok, "What is the capital of France?").text)
"""

import os as _os

import torch as _torch

from minillm.api import chat, generate, load_model
from minillm.config import ModelConfig
from minillm.kv_cache import KVCache, kv_bytes, kv_bytes_per_token
from minillm.request import RequestOutput
from minillm.sampling import SamplingParams
from minillm.speculative.decoding import SpecStats, SpeculativeConfig

# Triton picks its interpreter or a GPU driver when it is first imported, and torch imports it lazily (dynamo,
# flop_counter): without CUDA, choose the interpreter before anything else can (kernels/_triton_env.py, lesson 03)
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

__all__ = [
    "LLM",
    "KVCache",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SpecStats",
    "SpeculativeConfig",
    "chat",
    "generate",
    "kv_bytes",
    "kv_bytes_per_token",
    "load_model",
]


def __getattr__(name):  # the engine imports lazily: `import minillm` stays fast
    if name == "LLM":
        from minillm.engine import LLM

        return LLM
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")

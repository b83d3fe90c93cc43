"""One native step: every decoder layer of a forward in one C++ call (lesson 06's last rung).

eager -> fused -> compiled -> native: a q4 decode step in eager torch issues ~2,000 ops from Python, and what they
cost beyond their matmuls does not shrink with a second thread. `enable_native(model)` attaches a `NativeStep` that
Transformer.run_layers calls instead (kernels/cpu/native_step.cpp): the same math on the same cache, for any packed
mix of decodes, verifies and prompt chunks, so generate(), the engine and speculative verify all take it; low-bit
weights or float32 ones read where they lie (f32_matmul.cpp, also the LM head). Where it cannot run (no kernels,
bf16, a cache it does not know, autograd, torch.compile) the eager layers do.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from minillm_kernels import cpu_lowbit
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from minillm.cache.paged import PagedKVCache
from minillm.compile.fusion import FusedGateUpMLP, FusedNormBlock, FusedQKVAttention, fuse
from minillm.compress.quant import Int4Linear, Int8Linear
from minillm.kv_cache import Int8KVCache, KVCache

FORMATS = {Int4Linear: 0, Int8Linear: 1, nn.Linear: 2}  # kernels/cpu/lowbit.h WeightFormat (2: float32 as it lies)
SCOPE = "minillm::native_step"  # the profiler's name for the call (minillm.measure.breakdown splits it by stage)
HEAD_SCOPE = "minillm::native_head_matmul"  # and for a float32 LM head's kernel call (charged to "matmul")
# seconds every native call in this process spent, by stage, on its first thread (native_step.h NativeStage): the
# call is one op to the profiler, so the breakdown reads its inside here
STAGE_SECONDS = dict.fromkeys(("matmul", "attention", "pointwise", "total"), 0.0)


def why_not_native(model: nn.Module) -> str | None:
    """None if `enable_native(model)` can run this model's layers natively, else the reason it cannot."""
    if cpu_lowbit.load() is None:
        return f"the CPU kernels are not loaded ({cpu_lowbit.status()})"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"the native step runs float32 activations on the CPU; this model is {model.dtype} on {model.device}"
    for i, block in enumerate(model.layers):
        attn, mlp = block.attn, block.mlp
        qkv = attn.wqkv if isinstance(attn, FusedQKVAttention) else attn.wq
        gate_up = mlp.gate_up_proj if isinstance(mlp, FusedGateUpMLP) else mlp.gate
        for name, layer in (("attention q/k/v", qkv), ("attention output", attn.wo), ("gate/up", gate_up),
                            ("down", mlp.down)):
            if not _runs_natively(layer):
                return (f"layer {i}'s {name} projection is {type(layer).__name__}: the native step runs float32 "
                        f"nn.Linear weights or the low-bit kernels' formats (load_model(weights='q4' or 'int8'))")
    return None


def _runs_natively(layer: nn.Module) -> bool:
    if type(layer) is nn.Linear:
        return layer.bias is None and layer.weight.dtype == torch.float32
    return type(layer) in FORMATS and layer.uses_cpu_kernels()


def _native_weight(layer: nn.Module) -> Tensor:
    """What the C++ step reads: a low-bit layer's repacked bytes, a float32 Linear's own weight (no copy)."""
    return layer.weight.detach().contiguous() if type(layer) is nn.Linear else layer._kernel_pack()


# A step reads the tensors the layers held when it was built. A layer, weight or block replaced afterwards (quantize,
# LoRA, pruning) registers a module or parameter on a module the step was built from: the step then rebuilds before
# its next call, or leaves the layers to eager if they no longer run natively (said once), never the stale weights.
_BUILT_FROM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the NativeStep built from it


def _on_registration(module: nn.Module, name: str, value) -> None:
    if (step := _BUILT_FROM.get(module)) is not None:
        step.changed = f"{type(module).__name__}.{name}"


torch.nn.modules.module.register_module_module_registration_hook(_on_registration)
torch.nn.modules.module.register_module_parameter_registration_hook(_on_registration)


class NativeStep:
    """The model's layers as one C++ object (weights referenced, not copied); called by Transformer.run_layers."""

    def __init__(self, model: nn.Module):
        if (why := why_not_native(model)) is not None:
            raise ValueError(f"no native step for this model: {why}")
        self.off: str | None = None  # why the eager layers run now (a change the step cannot run)
        self._build(model)

    def _build(self, model: nn.Module) -> None:
        fuse(model)  # q|k|v and gate|up as one weight each, the layout the C++ step reads
        cfg, tensors, formats = model.config, [], []
        for block in model.layers:
            assert isinstance(block, FusedNormBlock) and isinstance(block.attn, FusedQKVAttention)
            assert isinstance(block.mlp, FusedGateUpMLP)
            weights = (block.attn.wqkv, block.attn.wo, block.mlp.gate_up_proj, block.mlp.down)
            tensors += [block.attn_norm.weight.detach().contiguous(), _native_weight(weights[0]),
                        _native_weight(weights[1]), block.mlp_norm.weight.detach().contiguous(),
                        _native_weight(weights[2]), _native_weight(weights[3])]
            formats += [FORMATS[type(w)] for w in weights]
        self.eps = model.layers[0].attn_norm.eps
        sizes = [cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim]
        self.decoder = cpu_lowbit.load().NativeDecoder(sizes, self.eps, model.rope_cos, model.rope_sin, tensors,
                                                       formats)
        self.n_layers, self.dim = len(model.layers), cfg.dim
        self.model = weakref.ref(model)
        for module in (model, model.layers, *(m for block in model.layers for m in block.modules())):
            _BUILT_FROM[module] = self
        self.changed: str | None = None  # set by _on_registration: what was replaced since this build

    def _refresh(self) -> bool:
        """After a change to the layers: rebuilt over the new ones (True), or off with the reason said once."""
        model, what = self.model(), self.changed
        self.changed = None
        if model is None:
            return False
        if (why := why_not_native(model)) is not None:
            if self.off is None:
                print(f"minillm: {what} was replaced after enable_native and the native step cannot run the new "
                      f"layers ({why}); the eager layers run", file=sys.stderr)
            self.off = why
            return False
        self.off = None
        self._build(model)
        return True

    @staticmethod
    def head(h: Tensor, weight: Tensor) -> Tensor | None:
        """A float32 LM head h @ weight.T through f32_matmul.cpp (torch took 2x its time over SmolLM2's 113 MB head
        at 1 row, 3.6x at 5: by hand, 2 threads, AVX2 EPYC), or None: the eager head then runs."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or h.dtype != torch.float32 \
                or weight.dtype != torch.float32 or not weight.is_contiguous() or h.device.type != "cpu":
            return None
        with record_function(HEAD_SCOPE):
            return cpu_lowbit.f32_matmul(h, weight)

    def rebuilt(self, model: nn.Module) -> NativeStep | None:
        """After the model moved or was cast (Transformer._apply): a step over its new tensors, or None."""
        return NativeStep(model) if why_not_native(model) is None else None

    def __call__(self, h: Tensor, positions: Tensor, kv_cache) -> Tensor | None:
        """h (batch, seq, dim) after the embedding -> after the last block, or None: run the eager layers instead."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or h.dtype != torch.float32:
            return None
        if (self.changed is not None and not self._refresh()) or self.off is not None:
            return None
        b, s, dim = h.shape
        where = cache_layout(kv_cache, b, s, self.n_layers)
        if where is None:
            return None
        seq, tables, block_size, k, v, k_scale, v_scale, strides = where
        out = h.reshape(b * s, dim).clone()  # updated in place by the step
        with record_function(SCOPE):
            seconds = self.decoder.step(out, positions.reshape(-1).contiguous(), seq, tables, block_size, k, v,
                                        k_scale, v_scale, strides, torch.get_num_threads())
        for stage, t in zip(STAGE_SECONDS, seconds):
            STAGE_SECONDS[stage] += t
        return out.view(b, s, dim)


_NO_SCALES = torch.empty(0, dtype=torch.float16)


@functools.lru_cache(maxsize=64)
def _contiguous_rows(batch: int, seq: int, n_kv: int) -> tuple[Tensor, Tensor]:
    """A contiguous cache's sequence of each token and "block table" (row b is block b * n_kv): the same few tensors
    every step of a generation, built once rather than by five small torch ops a step."""
    tables = (torch.arange(batch, dtype=torch.int32) * n_kv)[:, None]
    return torch.arange(batch, dtype=torch.int32).repeat_interleave(seq), tables


def cache_layout(cache, batch: int, seq: int, n_layers: int):
    """Where a cache keeps each token's keys and values, as native_step.h's NativeCache reads them, or None for a
    cache the native step does not know (it then leaves the forward to the eager layers)."""
    empty = _NO_SCALES
    if type(cache) in (KVCache, Int8KVCache):  # (layers, batch, n_kv, max_len, D): a "block" of max_len per row
        k, v = cache.k, cache.v
        if k.dtype not in (torch.float32, torch.int8) or k.shape[0] < n_layers:
            return None
        n_kv, max_len = k.shape[2], k.shape[3]
        seqs, tables = _contiguous_rows(batch, seq, n_kv)
        strides = [k.stride(0), k.stride(3), k.stride(2)]
        if k.dtype == torch.int8:
            ks, vs = cache.k_scale, cache.v_scale
            return seqs, tables, max_len, k, v, ks, vs, strides + [ks.stride(0), ks.stride(3), ks.stride(2)]
        return seqs, tables, max_len, k, v, empty, empty, strides + [0, 0, 0]
    if isinstance(cache, PagedKVCache) and cache._step is not None and cache.decode_backend == "auto":
        pool, (meta, _) = cache.pool, cache._step
        k, v = pool.k, pool.v  # (layers, blocks, block_size, n_kv, D)
        if k.dtype not in (torch.float32, torch.int8) or k.shape[0] < n_layers or meta.num_tokens != batch * seq:
            return None
        lens = torch.as_tensor(meta.host_query_lens)
        seqs = torch.arange(meta.num_seqs, dtype=torch.int32).repeat_interleave(lens)
        tables = meta.block_tables.to(torch.int32).contiguous()
        strides = [k.stride(0), k.stride(2), k.stride(3)]
        if k.dtype == torch.int8:
            ks, vs = pool.k_scale, pool.v_scale
            strides += [ks.stride(0), ks.stride(2), ks.stride(3)]
            return seqs, tables, cache.block_size, k, v, ks, vs, strides
        return seqs, tables, cache.block_size, k, v, empty, empty, strides + [0, 0, 0]
    return None


def enable_native(model: nn.Module) -> nn.Module:
    """Run `model`'s layers natively from now on (fusing them first, in place); raises ValueError saying why if it
    cannot (why_not_native). Returns the model."""
    model.native_step = NativeStep(model)
    return model


def disable_native(model: nn.Module) -> nn.Module:
    model.native_step = None
    return model

"""Weight-only quantization: store 8 or 4 bits per weight, dequantize inside the matmul (lesson 07).

Batch-1 decode is memory-bound, so fewer bytes per weight are fewer bytes per token, provided the kernel reads the
small integers and dequantizes in registers (torch's int8/int4 kernels on a CPU, kernels/quant_matmul.py on a GPU).
`Int8Linear`: int8 per output channel, symmetric. `Int4Linear`: int4 group-wise, asymmetric, two codes per byte;
with groups of 32 and fp16 scale/minimum it is GGUF's Q4_1, so `load_model(weights="q4")` fills it with the file's
own bytes. `quantize(model, scheme)` (compress/quantize.py) swaps them in; LLM.int8() is in llm_int8.py, AWQ in awq.py.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from minillm_kernels import cpu_lowbit, triton_available
from torch import Tensor, nn

INT4_GROUP_SIZES = (32, 64, 128)


# ------------------------------------------------------------------------------------------ the number formats

def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """w (out, in) -> (q int8 (out, in), scale float32 (out,)): symmetric per row, w ~= q * scale[:, None]."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # an all-zero row: any scale is exact
    # clamp to +-127, not -128: a symmetric range keeps -q representable and zero exactly zero
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """q int8 (out, in), scale (out,) -> float32 (out, in): q * scale per row."""
    return q.float() * scale.float()[:, None]


def quantize_int4(w: Tensor, group_size: int, bits: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """w (out, in) -> (codes uint8 (out, in) in [0, 2**bits - 1], scale (out, in // g), minimum (out, in // g)).

    Asymmetric round-to-nearest per group of `group_size` inputs, as GGUF's Q4_1: scale = (max - min) / 15
    (2**bits - 1 levels), code = floor((w - min) / scale + 0.5). scale and minimum are returned in float16 (what is
    stored); codes are computed before that rounding, as llama.cpp does. `bits` < 4 is for quality experiments (3-bit
    codes)."""
    out, n_in = w.shape
    check_group_size(n_in, group_size)
    groups = w.float().reshape(out, n_in // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    levels = 2 ** bits - 1
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))  # a constant group: every code 0, w == minimum
    codes = torch.floor((groups - lo[..., None]) * inv[..., None] + 0.5).clamp(0, levels).to(torch.uint8)
    return codes.reshape(out, n_in), scale.half(), lo.half()


def dequantize_int4(codes: Tensor, scale: Tensor, minimum: Tensor, group_size: int) -> Tensor:
    """codes (out, in), scale/minimum (out, in // g) -> float32 (out, in): code * scale + minimum, per group."""
    out, n_in = codes.shape
    groups = codes.float().reshape(out, n_in // group_size, group_size)
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).reshape(out, n_in)


def pack_int4(codes: Tensor) -> Tensor:
    """codes uint8 (..., n) in [0, 15], n even -> uint8 (..., n // 2): column 2j in the low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """The inverse of pack_int4: uint8 (..., n // 2) -> codes uint8 (..., n)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def check_group_size(n_in: int, group_size: int) -> None:
    if group_size <= 0 or n_in % group_size or group_size % 2:
        raise ValueError(f"group_size {group_size} must be even and divide the input dim {n_in}; "
                         f"try one of {[g for g in INT4_GROUP_SIZES if n_in % g == 0]}")


# ------------------------------------------------------------------------------------------ quantized layers

def _cuda_kernels():
    if not triton_available():  # dequantize-then-matmul still gives the right answer
        return None
    import minillm_kernels.quant_matmul as kernels  # imports triton: only when a CUDA tensor asks

    return kernels


def cpu_kernels():
    """The CPU low-bit kernel module (built on first use), or None where it cannot load: torch's kernels then.
    Resolved once per process (cpu_lowbit.load is cached); cpu_lowbit.status() says which and why."""
    return cpu_lowbit if cpu_lowbit.load() is not None else None


@contextlib.contextmanager
def cpu_kernels_disabled():
    """Inside the block, quantized layers (and models loaded there) take torch's kernels, as on a machine where
    ours cannot build: how benches and tests put both paths side by side in one process."""
    old = os.environ.get(cpu_lowbit.ENV)
    os.environ[cpu_lowbit.ENV] = "off"
    cpu_lowbit.load.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ[cpu_lowbit.ENV]
        else:
            os.environ[cpu_lowbit.ENV] = old
        cpu_lowbit.load.cache_clear()


def _cpu_kernels_loaded() -> bool:
    return cpu_kernels() is not None


# torch.compile must treat this as a fact of the process, not trace it: torch.compiler.assume_constant_result sets
# this one attribute (torch 2.13), but it imports torch._dynamo to do so, which costs every `import minillm` ~150 MiB
# and ~2 s (lesson 14's edge profile). tests/test_quant.py checks that the attribute is still what the decorator sets.
_cpu_kernels_loaded._dynamo_marked_constant = True


class QuantizedLinear(nn.Module):
    """Common checks: a quantized layer holds integer buffers, so loading float weights into it is refused."""

    in_features: int
    out_features: int

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        w = state_dict.get(prefix + "weight")
        if w is not None and w.is_floating_point():
            raise TypeError(f"{prefix}weight is a float tensor but this layer is {type(self).__name__}: load the "
                            "float checkpoint into the float model, then quantize(model, scheme)")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        # .to(bfloat16) on the model must move the scales, never re-round them: keep their dtype, follow the device
        kept = {name: getattr(self, name) for name in ("scale", "minimum") if hasattr(self, name)}
        self._packed = None
        super()._apply(fn, recurse)
        for name, t in kept.items():
            setattr(self, name, t.to(self.weight_storage.device))
        return self

    _packed: tuple[int, Tensor] | None = None  # (rows per group, the CPU kernels' repacked copy), built on demand

    @classmethod
    def _holding_kernel_layout(cls, packed: Tensor, out_features: int, in_features: int, block_bytes: int,
                               fmt: str) -> QuantizedLinear:
        """A bare layer of this class whose only buffer is the kernels' layout: uint8 (ceil(out / R), in // 32,
        block_bytes * R), R rows per group; the subclass sets its own attributes."""
        rows = packed.shape[-1] // block_bytes
        if packed.dtype != torch.uint8 or packed.shape != (-(-out_features // max(rows, 1)), in_features // 32,
                                                           block_bytes * rows):
            raise ValueError(f"not the kernel layout of a ({out_features}, {in_features}) {fmt} weight: "
                             f"{packed.dtype} {tuple(packed.shape)}")
        layer = cls.__new__(cls)
        QuantizedLinear.__init__(layer)
        layer.out_features, layer.in_features = out_features, in_features
        layer.register_buffer("kernel_weight", packed)
        layer._packed = (rows, packed)
        return layer

    def _repack(self, rows: int) -> Tensor:
        raise NotImplementedError

    def _kernel_pack(self) -> Tensor:
        """The weights in the loaded kernel build's layout (16 rows a group with AVX-512, else 8): built on the first
        call, not in the state dict, rebuilt if another build loads or the layer moves."""
        rows = cpu_lowbit.rows_per_group()
        if self._packed is None or self._packed[0] != rows:
            self._packed = (rows, self._repack(rows))
        return self._packed[1]

    def uses_cpu_kernels(self) -> bool:
        """Does this layer's CPU forward take minillm's kernels? For any row count: each weight block is read once
        for up to 8 rows at a time, and on a 2-core AVX-512 EPYC they ran 2.0-2.6x faster than torch's int4/int8 CPU
        kernels from 1 to 128 rows (lesson 07's table shows 1-16), so a long prefill takes them too. The subclasses
        say which formats they cover."""
        return False

    def _kernel_matmul(self, x: Tensor, matmul, matmul_op) -> Tensor:
        if torch.compiler.is_compiling() and self._packed is not None:  # an operator dynamo can trace (lesson 06)
            return matmul_op(x, self._packed[1], self.out_features)
        return matmul(x, self._kernel_pack(), self.out_features)

    @property
    def weight_storage(self) -> Tensor:
        raise NotImplementedError

    def dequantize(self) -> Tensor:
        raise NotImplementedError

    def embedding(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` of the dequantized weight: the tied embedding reads the LM head's storage."""
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """int8 weights with one float32 scale per output row (quantize(model, "int8")), or one fp16 scale per block of
    32 inputs: GGUF's Q8_0, the file's tied embedding / LM head (load_model(weights="q4") on a CPU with kernels)."""

    def __init__(self, q: Tensor, scale: Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape
        per_block = scale.dim() == 2
        if per_block and (scale.shape != (self.out_features, self.in_features // 32) or self.in_features % 32):
            want = (self.out_features, self.in_features // 32)
            raise ValueError(f"a per-block scale must be (out, in // 32) = {want}, got {tuple(scale.shape)}")
        if not per_block and scale.shape != (self.out_features,):
            raise ValueError(f"a per-row scale must be (out,) = ({self.out_features},), got {tuple(scale.shape)}")
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scale", scale.half().contiguous() if per_block else scale.float())
        self._per_block = per_block

    @property
    def per_block(self) -> bool:
        return self._per_block

    # ---- one copy: the CPU kernels' layout alone (the tied Q8_0 embedding/LM head of a q4 model: lesson 14's edge)

    @classmethod
    def from_q8_0_kernel_layout(cls, raw, chunk_rows: int = 4096) -> Int8Linear:
        """A Q8_0 layer from the file's raw rows (out, in // 32 * 34 bytes), built straight into the CPU kernels'
        layout a few thousand rows at a time: the one copy the kernels read, without a full-size int8 copy and its
        permuted twin on the way (they set the edge profile's load peak). Needs the kernels loaded."""
        import numpy as np

        from minillm.gguf.weights import q8_0_blocks

        rows, n, k = cpu_lowbit.rows_per_group(), raw.shape[0], raw.shape[1] // 34 * 32
        packed = torch.empty(-(-n // rows), k // 32, 36 * rows, dtype=torch.uint8)
        step = max(rows, chunk_rows // rows * rows)
        for r0 in range(0, n, step):
            q, d = q8_0_blocks(np.asarray(raw[r0:r0 + step]))
            packed[r0 // rows:-(-(r0 + len(q)) // rows)] = cpu_lowbit.repack_int8(torch.from_numpy(q),
                                                                                 torch.from_numpy(d), rows)
        return cls.from_kernel_layout(packed, n, k)

    @classmethod
    def from_kernel_layout(cls, packed: Tensor, out_features: int, in_features: int) -> Int8Linear:
        """A per-block layer that holds only the kernels' layout (as built by repack_int8, or mapped from a cache of
        it: minillm.gguf.converted)."""
        layer = cls._holding_kernel_layout(packed, out_features, in_features, 36, "Q8_0")
        layer._per_block = True
        return layer

    @property
    def kernel_layout_only(self) -> bool:
        return "kernel_weight" in self._buffers

    def keep_kernel_layout_only(self) -> None:
        """Keep this layer once, in the CPU kernels' layout, and drop the stored codes and scales (as
        Int4Linear.keep_kernel_layout_only): the embedding's lookups read their rows from that layout
        (cpu_lowbit.int8_rows), and weight / scale are derived when something else asks."""
        if self.kernel_layout_only or not self.uses_cpu_kernels() or self._buffers["weight"].device.type != "cpu":
            return
        packed = self._kernel_pack()
        for name in ("weight", "scale"):
            del self._buffers[name]
        self.register_buffer("kernel_weight", packed)

    def __getattr__(self, name: str):
        if name in ("weight", "scale") and "kernel_weight" in self.__dict__.get("_buffers", {}):
            q, s = cpu_lowbit.unrepack_int8(self._buffers["kernel_weight"], self.out_features, self.in_features)
            if name == "weight":
                return q
            return s.half() if self.__dict__["_per_block"] else s[:, 0].contiguous()
        return super().__getattr__(name)

    def _apply(self, fn, recurse=True):
        if not self.kernel_layout_only:
            return super()._apply(fn, recurse)
        nn.Module._apply(self, fn, recurse)  # the uint8 layout: a cast leaves it as it is
        if self._buffers["kernel_weight"].device.type != "cpu":
            raise ValueError("this 8-bit layer keeps only the CPU kernels' layout (keep_kernel_layout_only): load the "
                             "model on the device it will run on")
        self._packed = (cpu_lowbit.rows_per_group(), self._buffers["kernel_weight"])
        return self

    @classmethod
    def cat_rows(cls, layers: list[Int8Linear]) -> Int8Linear:
        """One layer whose output is the layers' outputs side by side (lesson 06's fusion on int8 weights)."""
        return cls(torch.cat([m.weight for m in layers]), torch.cat([m.scale for m in layers]))

    @property
    def weight_storage(self) -> Tensor:
        return self._buffers["kernel_weight"] if self.kernel_layout_only else self.weight

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        if linear.bias is not None:
            raise ValueError("int8 weight-only quantization here supports Linear layers without bias")
        return cls(*quantize_int8(linear.weight.detach()))

    def _repack(self, rows: int) -> Tensor:
        return cpu_lowbit.repack_int8(self.weight, self.scale, rows)

    def uses_cpu_kernels(self) -> bool:
        return self.in_features % 32 == 0 and _cpu_kernels_loaded()

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_cuda and self.uses_cpu_kernels():
            return self._kernel_matmul(x, cpu_lowbit.int8_matmul, cpu_lowbit.int8_matmul_op)
        if self.per_block:
            return F.linear(x, self.dequantize().to(x.dtype))
        if x.is_cuda and (kernels := _cuda_kernels()) is not None:
            return kernels.int8_weight_matmul(x, self.weight, self.scale.to(x.dtype))
        if x.is_cuda or self.in_features % 16:  # torch 2.13's CPU int8 kernel crashes when K % 16 != 0
            return F.linear(x, self.weight.to(x.dtype) * self.scale[:, None].to(x.dtype))
        # torch's CPU kernel is fast with bf16 activations only (FACTS): an fp32 input is rounded to bf16 for this
        # matmul, an error far below the int8 weights' own
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.weight, self.scale.to(torch.bfloat16))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _dequantize_rows(self, q: Tensor, scale: Tensor) -> Tensor:
        if self.per_block:  # Q8_0: one scale per 32 inputs
            return q.float() * scale.float().repeat_interleave(32, dim=-1)
        return dequantize_int8(q, scale)

    def dequantize(self) -> Tensor:
        return self._dequantize_rows(self.weight, self.scale)

    def embedding(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        rows = ids.reshape(-1)
        if self.kernel_layout_only:  # the rows straight from the kernels' layout (scales per block of 32)
            w = cpu_lowbit.int8_embedding(self._buffers["kernel_weight"], rows, self.out_features, self.in_features)
        else:
            w = self._dequantize_rows(self.weight[rows], self.scale[rows])
        return w.to(dtype).reshape(*ids.shape, self.in_features)


class Int4Linear(QuantizedLinear):
    """Packed 4-bit codes + fp16 scale/minimum per group: exactly the bytes GGUF's Q4_1 stores when group_size=32.

    On CPU the matmul is torch's int4 kernel, which wants its own nibble layout and a bf16 (scale, zero) table: that
    copy is built on the first CPU call (same size as the packed codes) and is not part of the state dict."""

    def __init__(self, codes: Tensor, scale: Tensor, minimum: Tensor, group_size: int, packed: bool = False):
        super().__init__()
        if packed and codes.dtype != torch.uint8:
            raise ValueError(f"packed codes must be uint8 (out, in // 2), got {codes.dtype}")
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * (2 if packed else 1)
        check_group_size(self.in_features, group_size)
        if scale.shape != (self.out_features, self.in_features // group_size) or minimum.shape != scale.shape:
            raise ValueError(f"scale and minimum must be (out, in // group_size) = "
                             f"{(self.out_features, self.in_features // group_size)}, got {tuple(scale.shape)}, "
                             f"{tuple(minimum.shape)}")
        self.group_size = group_size
        self.register_buffer("qweight", codes if packed else pack_int4(codes))
        self.register_buffer("scale", scale.half())
        self.register_buffer("minimum", minimum.half())
        self._cpu_pack: tuple[Tensor, Tensor] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> Int4Linear:
        if linear.bias is not None:
            raise ValueError("int4 quantization here supports Linear layers without bias")
        w = linear.weight.detach()
        return cls(*quantize_int4(w, group_size), group_size=group_size)

    @classmethod
    def from_packed(cls, qweight: Tensor, scale: Tensor, minimum: Tensor, group_size: int) -> Int4Linear:
        """A layer over codes already in pack_int4's layout, uint8 (out, in // 2), kept as given: a loader that packs
        the file's nibbles itself (minillm.gguf.weights.q4_1_packed) and fusion (cat_rows) skip unpacking and packing
        again, ~3 s of a q4 load in torch's byte ops."""
        return cls(qweight, scale, minimum, group_size, packed=True)

    @classmethod
    def from_kernel_layout(cls, packed: Tensor, out_features: int, in_features: int) -> Int4Linear:
        """A layer that holds only the kernels' layout (repack_q4_1's, or mapped from a cache of it:
        minillm.gguf.converted); packed may be on the meta device, a shape to fill in later (load_model)."""
        layer = cls._holding_kernel_layout(packed, out_features, in_features, 20, "Q4_1")
        layer.group_size, layer._cpu_pack = 32, None
        return layer

    @property
    def weight_storage(self) -> Tensor:
        return self._buffers["kernel_weight"] if self.kernel_layout_only else self.qweight

    # ---- one copy: the CPU kernels' layout alone (lesson 14's edge profile; issue: a second copy of every weight)

    @property
    def kernel_layout_only(self) -> bool:
        return "kernel_weight" in self._buffers

    def keep_kernel_layout_only(self) -> None:
        """Keep this layer once, in the CPU kernels' layout (the same 20 bytes per 32 weights), and drop the stored
        codes and scales: the kernels read only that layout, and holding both doubled a q4 model's weight memory.
        qweight, scale, minimum, codes() and dequantize() still work, derived from it when asked (lesson 07 reads them;
        a decode step never does). A layer the kernels do not take is left as it is."""
        if self.kernel_layout_only or not self.uses_cpu_kernels() or self.qweight.device.type != "cpu":
            return
        packed = self._kernel_pack()
        for name in ("qweight", "scale", "minimum"):
            del self._buffers[name]
        self.register_buffer("kernel_weight", packed)

    def __getattr__(self, name: str):
        if name in ("qweight", "scale", "minimum") and "kernel_weight" in self.__dict__.get("_buffers", {}):
            derived = cpu_lowbit.unrepack_q4_1(self._buffers["kernel_weight"], self.out_features, self.in_features)
            return derived[("qweight", "scale", "minimum").index(name)]
        return super().__getattr__(name)

    @classmethod
    def cat_rows(cls, layers: list[Int4Linear]) -> Int4Linear:
        """One layer whose output is the layers' outputs side by side, the same codes and scales (lesson 06's fusion
        on 4-bit weights)."""
        if len({m.group_size for m in layers}) != 1:
            raise ValueError("cat_rows needs one group size across the layers")
        if all(m.kernel_layout_only for m in layers):  # whole groups of rows stack as they are (meta ones too)
            rows = layers[0]._packed[0]
            if all(m._packed[0] == rows and m.out_features % rows == 0 for m in layers):
                parts = [m._buffers["kernel_weight"] for m in layers]
                # shapes only (load_model fills them): torch.cat on meta tensors would import torch._dynamo (~2 s)
                stacked = (torch.empty(sum(len(p) for p in parts), *parts[0].shape[1:], dtype=torch.uint8,
                                       device="meta") if parts[0].is_meta else torch.cat(parts))
                return cls.from_kernel_layout(stacked, sum(m.out_features for m in layers), layers[0].in_features)
        # packed rows are whole rows of codes: concatenating them is concatenating the codes
        return cls.from_packed(torch.cat([m.qweight for m in layers]), torch.cat([m.scale for m in layers]),
                               torch.cat([m.minimum for m in layers]), layers[0].group_size)

    def codes(self) -> Tensor:
        return unpack_int4(self.qweight)

    def dequantize(self) -> Tensor:
        return dequantize_int4(self.codes(), self.scale, self.minimum, self.group_size)

    def embedding(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        rows = ids.reshape(-1)
        w = dequantize_int4(unpack_int4(self.qweight[rows]), self.scale[rows], self.minimum[rows], self.group_size)
        return w.to(dtype).reshape(*ids.shape, self.in_features)

    def _repack(self, rows: int) -> Tensor:  # kernels/cpu/q4_1_matmul.cpp: the same 5 bits per weight
        return cpu_lowbit.repack_q4_1_packed(self.qweight, self.scale, self.minimum, rows)

    def uses_cpu_kernels(self) -> bool:  # Q4_1's blocks: group 32
        return self.group_size == 32 and self.in_features % 32 == 0 and _cpu_kernels_loaded()

    def _torch_cpu_pack(self) -> tuple[Tensor, Tensor]:
        # torch computes (code - 8) * scale + zero, so zero = minimum + 8 * scale (exact in fp32; bf16 rounds it)
        if self._cpu_pack is None:
            packed = torch._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 1)
            s, m = self.scale.float().T, self.minimum.float().T  # (groups, out)
            zeros = torch.stack([s, m + 8 * s], dim=-1).to(torch.bfloat16).contiguous()
            self._cpu_pack = (packed, zeros)
        return self._cpu_pack

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_cuda and self.uses_cpu_kernels():  # Q4_1 blocks straight into integer SIMD
            return self._kernel_matmul(x, cpu_lowbit.q4_1_matmul, cpu_lowbit.q4_1_matmul_op)
        if x.is_cuda and (kernels := _cuda_kernels()) is not None:
            return kernels.int4_group_matmul(x, self.qweight, self.scale, self.minimum, self.group_size)
        if x.is_cuda or self.out_features % 16 or self.group_size not in (32, 64, 128, 256):
            # torch's CPU kernel packs 16 rows at a time and knows these group sizes only
            return F.linear(x, self.dequantize().to(x.dtype))
        packed, zeros = self._torch_cpu_pack()
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # fast in bf16 only, as for int8
        y = torch._weight_int4pack_mm_for_cpu(x2, packed, self.group_size, zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        self._cpu_pack = None  # moved: rebuild torch's copy from the buffers on the next CPU call
        if not self.kernel_layout_only:
            return super()._apply(fn, recurse)
        if self._buffers["kernel_weight"].is_meta:  # a shape only, filled in by load_model from its converted cache
            return self
        nn.Module._apply(self, fn, recurse)  # the uint8 layout: a cast leaves it as it is
        kernel_weight = self._buffers["kernel_weight"]
        if kernel_weight.device.type != "cpu":
            raise ValueError("this 4-bit layer keeps only the CPU kernels' layout (keep_kernel_layout_only): load the "
                             "model on the device it will run on, e.g. load_model(..., device='cuda')")
        self._packed = (cpu_lowbit.rows_per_group(), kernel_weight)
        return self


class QuantizedEmbedding(nn.Module):
    """The tied embedding after quantization: it looks rows up in the quantized LM head (one storage, as before)."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype):
        super().__init__()
        self.head, self.dtype = [head], dtype  # a list: not a second submodule (the head is counted once)
        self.embedding_dim = head.in_features

    @property
    def weight(self) -> Tensor:  # Transformer.device / .dtype read embed.weight
        return torch.empty(0, dtype=self.dtype, device=self.head[0].weight_storage.device)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head[0].embedding(ids, self.dtype)


# ------------------------------------------------------------------------------------------ the transformation

def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in model.modules())


def fake_quantize_int4(model: nn.Module, group_size: int = 128, bits: int = 4) -> nn.Module:
    """Round every Linear weight to `bits`-bit groups and back, in place, keeping float storage: the quality of a
    format without a kernel for it (3-bit here). Returns the model."""
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear) and m is not getattr(model, "lm_head", None):
            codes, scale, minimum = quantize_int4(m.weight.detach(), group_size, bits)
            m.weight.data.copy_(dequantize_int4(codes, scale, minimum, group_size).to(m.weight.dtype))
    return model

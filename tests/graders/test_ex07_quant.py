"""Grader for exercise 07: int8 per-row and int4 group-wise (GGUF Q4_1) quantization, 4-bit packing, LLM.int8().

Everything is compared with oracles written here, not with minillm's code. `check_int8` bounds the round trip by
half a step and checks the range and the scale row by row (rows from 1e-30 to 1e30, a row of zeros, bf16 input).
`check_int4` compares codes, scale and minimum bit for bit on groups built so that every value is exact (constant
groups, exact halves, codes 0 and 15 at the extremes) and with the Q4_1 rule on random weights; `check_gguf`
requantizes synthetic Q4_1 blocks and must give back their codes, scale and minimum. `check_pack` runs all 256 byte
values. `check_outliers` compares LLM.int8()'s matmul with the float product (an error bound: half an activation
step per column) and, on activations built so that every int8 rounding is unambiguous, with the int8 path itself,
so that a float matmul over all columns is caught, and a TorchDispatchMode sees that the product of the int8 codes
is an integer one (a float matmul of the same codes gives the same values). `check_matvec` bounds int8_matvec by half
an activation step per column against a float64 product, and `check_matvec_speed` times it against
dequantize-then-matmul on SmolLM2's decode shapes. The real-model task quantizes SmolLM2 with your functions.
No operation of your code may make a NaN out of finite inputs (a 0 / 0 on an all-zero row).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import minillm
import minillm.compress.llm_int8
import minillm.compress.quant
import minillm.compress.quantize
from tests.graders.conftest import TARGET, forbid_calls, load_impl

impl = load_impl("ex07_quant")
grader_selftest = pytest.mark.skipif(TARGET == "exercises", reason="checks the grader itself, not your code")
LIBRARY = ["minillm", "quant", "llm_int8"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _NaNWatch(TorchDispatchMode):
    """Records the first op that returns a NaN although none of its inputs holds one (0 / 0, inf - inf, 0 * inf)."""

    def __init__(self):
        super().__init__()
        self.culprit: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.culprit is None and "empty" not in str(func):  # uninitialised memory may hold NaN bits
            def floats(tree):
                return [t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor) and t.is_floating_point()]

            made = floats(out)
            if made and any(bool(t.isnan().any()) for t in made) and \
                    not any(bool(t.isnan().any()) for t in floats((args, kwargs))):
                self.culprit = str(func)
        return out


def no_nan_made(fn, *args, what: str):
    """fn(*args), failing if one of its operations made a NaN out of NaN-free inputs."""
    with _NaNWatch() as watch:
        out = fn(*args)
    assert watch.culprit is None, (
        f"{what}: {watch.culprit} made a NaN from finite inputs (0 / 0 on an all-zero row or constant group?). "
        f"Even if it is masked or cast away later, casting NaN to an integer is undefined: guard before dividing")
    return out


# ==================================================================================================== task 07.int8


def int8_cases() -> list[tuple[str, Tensor]]:
    g = _gen(0)
    w = torch.randn(12, 40, generator=g) * torch.logspace(-6, 6, 12)[:, None]  # rows of 1e-6 .. 1e6
    w[3] = 0  # an all-zero row
    w[5] = 0
    w[5, 7] = -2.5  # one nonzero value, negative
    w[8, 11] = -2 * w[8].abs().max()  # the row's largest magnitude is negative
    extremes = torch.randn(3, 16, generator=g) * torch.tensor([1e30, 1e-30, 1.0])[:, None]
    return [
        ("float32 rows of magnitude 1e-6 .. 1e6 (row 3 all zeros)", w),
        ("bfloat16 input", (torch.randn(6, 48, generator=g) * torch.logspace(-2, 2, 6)[:, None]).bfloat16()),
        ("rows of magnitude 1e30 and 1e-30", extremes),
        ("a single column", torch.randn(5, 1, generator=g)),
    ]


def check_symmetric_rows(quantize, fname: str) -> None:
    """quantize: (rows, k) -> (int8 (rows, k), float32 scale (rows,)), one symmetric scale per row."""
    for case, w in int8_cases():
        out = no_nan_made(quantize, w, what=f"{fname}, {case}")
        assert isinstance(out, tuple) and len(out) == 2, f"{fname} returns (q, scale)"
        q, scale = out
        assert q.dtype == torch.int8 and tuple(q.shape) == tuple(w.shape), (
            f"{case}: q must be int8 of shape {tuple(w.shape)}, got {q.dtype} {tuple(q.shape)}")
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (w.shape[0],), (
            f"{case}: scale must be float32 of shape ({w.shape[0]},) (one per row, kept in float32 whatever w's "
            f"dtype), got {scale.dtype} {tuple(scale.shape)}")
        assert torch.isfinite(scale).all(), f"{case}: scale holds {scale[~torch.isfinite(scale)].tolist()[:3]}"
        wf = w.float()
        amax = wf.abs().amax(dim=1)
        nz = amax > 0
        assert (q[~nz] == 0).all(), f"{case}: an all-zero row must quantize to zeros, got {q[~nz].unique().tolist()}"
        ok = torch.isclose(scale, amax / 127, rtol=1e-6, atol=0) | ~nz
        if not ok.all():
            r = int((~ok).nonzero()[0])
            raise AssertionError(
                f"{case}: row {r} (max |w| = {amax[r].item():.6g}) has scale {scale[r].item():.6g}, expected max|w| "
                f"/ 127 = {(amax[r] / 127).item():.6g}: the row's largest magnitude maps to +-127 (the whole range)")
        assert int(q.min()) >= -127, (
            f"{case}: q holds {int(q.min())}: the range is symmetric, [-127, 127] (never -128, so that -q exists)")
        rows = torch.arange(w.shape[0])[nz]
        peak = wf.abs().argmax(dim=1)[nz]
        want = torch.where(wf[rows, peak] > 0, 127, -127)
        if not torch.equal(q[rows, peak].long(), want.long()):
            r = int(rows[(q[rows, peak].long() != want).nonzero()[0]])
            raise AssertionError(f"{case}: row {r}'s largest |w| ({wf[r].abs().max().item():.6g}) maps to "
                                 f"{int(q[r, wf[r].abs().argmax()])}, expected +-127 with its sign (w / scale is "
                                 f"+-127 up to float rounding: round to the nearest integer)")
        deq = q.float() * scale[:, None]
        err = (deq - wf).abs()
        bound = scale[:, None] / 2 * (1 + 1e-5) + wf.abs() * 1e-6
        bound[~nz] = 0
        if (err > bound).any():
            r, c = divmod(int((err - bound).argmax()), w.shape[1])
            raise AssertionError(
                f"{case}: w[{r}, {c}] = {wf[r, c].item():.6g} quantizes to q = {int(q[r, c])} (scale "
                f"{scale[r].item():.6g}): q * scale is {err[r, c].item():.3g} away, more than half a step "
                f"({(scale[r] / 2).item():.3g}). Round to the nearest integer (truncation loses up to a whole step)")


def check_dequant_int8(dequantize_int8) -> None:
    g = _gen(1)
    for shape in ((16, 16), (7, 20)):
        q = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scale = torch.rand(shape[0], generator=g) * torch.logspace(-3, 3, shape[0])
        got = dequantize_int8(q, scale)
        assert got.dtype == torch.float32 and tuple(got.shape) == shape, (
            f"dequantize_int8 returns float32 (out, in) = {shape}, got {got.dtype} {tuple(got.shape)}")
        want = q.float() * scale[:, None]
        assert torch.equal(got, want), (
            f"dequantize_int8 of a {shape} matrix differs from q * scale[row] by up to "
            f"{(got - want).abs().max().item():.3g}: each row of q is multiplied by its own row's scale")


@pytest.mark.task_07_int8
def test_int8_per_row_symmetric():
    check_symmetric_rows(impl.quantize_int8, "quantize_int8")
    check_dequant_int8(impl.dequantize_int8)
    for fn in (impl.quantize_int8, impl.dequantize_int8):
        forbid_calls(fn, LIBRARY)


# ==================================================================================================== task 07.int4


def int4_oracle(w: Tensor, group_size: int, bits: int = 4) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GGUF Q4_1, written out: (codes, scale float32, minimum float32, t = (w - min) / scale) per group."""
    out, n = w.shape
    groups = w.float().reshape(out, n // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (hi - lo) / (2 ** bits - 1)
    t = (groups - lo[..., None]) / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    t = torch.where(scale[..., None] > 0, t, torch.zeros_like(t))
    codes = torch.floor(t + 0.5).clamp(0, 2 ** bits - 1)
    return codes.reshape(out, n), scale, lo, t.reshape(out, n)


def adversarial_int4() -> tuple[Tensor, list[str]]:
    """10 groups of 8 (5 rows of 16 inputs) whose values are exact in float32 and float16: w = min + t * scale."""
    s = 1 + 2 ** -12  # not a float16: rounds to 1.0, which moves t = 7.4995 across .5 if codes used the fp16 scale
    groups = [  # (what, minimum, scale, t for each of the 8 values)
        ("a constant group (max == min)", 3.0, 0.0, [0] * 8),
        ("a group of zeros", 0.0, 0.0, [0] * 8),
        ("negative zeros", -0.0, 0.0, [0] * 8),
        ("exact halves, scale 1", 0.0, 1.0, [0, 15, 0.5, 1.5, 2.5, 13.5, 14.5, 7.5]),
        ("exact halves, negative minimum", -2.0, 0.25, [0, 15, 0.5, 5.5, 14.5, 4, 8, 10.5]),
        ("an all-negative group", -3.0, 1 / 16, [0, 15, 2.5, 6.5, 9.5, 11, 12.5, 3]),
        ("large values", -1024.0, 128.0, [15, 0, 0.5, 14.5, 7.5, 1, 2, 3]),
        ("small values (scale 2**-14)", 2 ** -10, 2 ** -14, [0, 15, 4.5, 5.5, 10.5, 1, 2, 3]),
        ("a scale that float16 rounds", 0.0, s, [0, 15, 7.4995, 7.5005, 3.2, 11.8, 1, 14]),
        ("a constant negative group", -7.25, 0.0, [0] * 8),
    ]
    vals = []
    for what, lo, scale, ts in groups:
        vals.append([lo + t * scale if scale else lo for t in ts])
    w = torch.tensor(vals, dtype=torch.float32).reshape(5, 16)
    w[0, 8:] = torch.tensor([0.0] * 8)
    w[1, :8] = torch.tensor([-0.0, 0.0] * 4)
    return w, [what for what, *_ in groups]


def _explain_code(w, r, c, t, got, want) -> str:
    msg = f"w[{r}, {c}] = {w[r, c].item():.7g}, (w - min) / scale = {t:.5g}: your code {got}, expected {want}"
    if got == round(t) and abs(t - math.floor(t) - 0.5) < 1e-6:
        msg += " (Q4_1 rounds halves up, floor(x + 0.5); round() sends 2.5 to 2)"
    return msg


def check_int4(quantize_int4, dequantize_int4) -> None:
    # adversarial groups, exact: bit for bit
    w, names = adversarial_int4()
    g = 8
    out = no_nan_made(quantize_int4, w, g, what="quantize_int4 on constant groups")
    assert isinstance(out, tuple) and len(out) == 3, "quantize_int4 returns (codes, scale, minimum)"
    codes, scale, minimum = out
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (5, 16), (
        f"codes must be uint8 (out, in) = (5, 16), got {codes.dtype} {tuple(codes.shape)}")
    for name, t in (("scale", scale), ("minimum", minimum)):
        assert t.dtype == torch.float16 and tuple(t.shape) == (5, 2), (
            f"{name} must be float16 (out, in // group_size) = (5, 2), got {t.dtype} {tuple(t.shape)}")
    want_codes, want_scale, want_min, t = int4_oracle(w, g)
    for i, what in enumerate(names):
        r, k = divmod(i, 2)
        cols = slice(k * g, (k + 1) * g)
        where = f"group {i} ({what}; row {r}, inputs {k * g}..{k * g + g - 1}, group_size {g})"
        assert scale[r, k].item() == want_scale[r, k].half().item(), (
            f"{where}: scale {scale[r, k].item()!r}, expected (max - min) / 15 = {want_scale[r, k].half().item()!r} "
            f"over those {g} consecutive inputs")
        assert minimum[r, k].item() == want_min[r, k].half().item(), (
            f"{where}: minimum {minimum[r, k].item()!r}, expected the group's min "
            f"{want_min[r, k].half().item()!r} (asymmetric: code 0 is the group's minimum)")
        bad = (codes[r, cols].long() != want_codes[r, cols].long()).nonzero()
        if len(bad):
            c = k * g + int(bad[0])
            raise AssertionError(f"{where}: " + _explain_code(
                w, r, c, t[r, c].item(), int(codes[r, c]), int(want_codes[r, c])) + (
                "; codes are computed with the float32 scale, before it is rounded to float16" if "rounds" in what
                else ""))
    deq = dequantize_int4(codes, scale, minimum, g)
    assert deq.dtype == torch.float32 and tuple(deq.shape) == (5, 16), (
        f"dequantize_int4 returns float32 (out, in), got {deq.dtype} {tuple(deq.shape)}")
    const = [0, 1, 2, 9]  # constant groups reconstruct exactly
    for i in const:
        r, k = divmod(i, 2)
        cols = slice(k * g, (k + 1) * g)
        assert torch.equal(deq[r, cols], w[r, cols]), (
            f"group {i} ({names[i]}): dequantized to {deq[r, cols].tolist()}, expected exactly {w[r, cols].tolist()}")
    want_deq = (want_codes.reshape(5, 2, g) * scale.float()[..., None] + minimum.float()[..., None]).reshape(5, 16)
    assert torch.equal(deq, want_deq), (
        f"dequantize_int4 differs from code * scale + minimum (per group, in float32) by up to "
        f"{(deq - want_deq).abs().max().item():.3g}")

    # random weights: the Q4_1 rule (ties within 1e-4 of .5 may go either way: float rounding of the division)
    gen = _gen(2)
    for case, w, g, bits in [
        ("float32 (64, 256), groups of 16", torch.randn(64, 256, generator=gen) * torch.logspace(-2, 2, 64)[:, None],
         16, 4),
        ("bfloat16 (8, 96), groups of 32", torch.randn(8, 96, generator=gen).bfloat16(), 32, 4),
        ("float32 (6, 128), groups of 64", torch.randn(6, 128, generator=gen) + 3, 64, 4),
        ("3-bit codes (bits=3), groups of 32", torch.randn(4, 64, generator=gen), 32, 3),
    ]:
        codes, scale, minimum = quantize_int4(w, g, bits) if bits != 4 else quantize_int4(w, g)
        out_f, n = w.shape
        assert codes.dtype == torch.uint8 and tuple(codes.shape) == (out_f, n), (
            f"{case}: codes must be uint8 {(out_f, n)}, got {codes.dtype} {tuple(codes.shape)}")
        assert tuple(scale.shape) == tuple(minimum.shape) == (out_f, n // g) and \
            scale.dtype == minimum.dtype == torch.float16, (
                f"{case}: scale and minimum must be float16 {(out_f, n // g)} (one per group of {g} inputs of a "
                f"row), got {scale.dtype} {tuple(scale.shape)}, {minimum.dtype} {tuple(minimum.shape)}")
        want_codes, want_scale, want_min, t = int4_oracle(w, g, bits)
        assert torch.equal(minimum.float(), want_min.half().float()), (
            f"{case}: minimum differs from each group's min (groups are {g} consecutive inputs of a row)")
        torch.testing.assert_close(
            scale.float(), want_scale.half().float(), rtol=1e-3, atol=0, msg=lambda m, case=case, bits=bits, g=g: (
                f"{case}: scale differs from (max - min) / {2 ** bits - 1} per group of {g} consecutive inputs: {m}"))
        frac = t - torch.floor(t)
        tie = (frac - 0.5).abs() < 1e-4
        wrong = (codes.long() != want_codes.long()) & ~(tie & ((codes.long() - t).abs() <= 0.5 + 1e-4))
        if wrong.any():
            r, c = (int(v) for v in wrong.nonzero()[0])
            raise AssertionError(f"{case}: {int(wrong.sum())} codes differ from the Q4_1 rule, e.g. " + _explain_code(
                w.float(), r, c, t[r, c].item(), int(codes[r, c]), int(want_codes[r, c])))
        deq = dequantize_int4(codes, scale, minimum, g)
        want_deq = (codes.float().reshape(out_f, n // g, g) * scale.float()[..., None]
                    + minimum.float()[..., None]).reshape(out_f, n)
        torch.testing.assert_close(deq, want_deq, rtol=1e-6, atol=1e-6, msg=lambda m, case=case: (
            f"{case}: dequantize_int4 differs from code * scale + minimum in float32: {m}"))


def one_rounding(w: Tensor, minimum: Tensor, group_size: int) -> Tensor:
    """What code * scale + minimum may differ by between two float32 evaluations (a fused multiply-add, another
    order): one rounding of its terms, |code * scale| + |minimum| <= |w| + 2 |minimum|."""
    m = minimum.float().abs().repeat_interleave(group_size, dim=-1)
    return 2 ** -23 * (w.abs() + 2 * m)


def check_gguf(quantize_int4, dequantize_int4) -> None:
    """Weights dequantized from synthetic Q4_1 blocks (codes * d + m, fp16 d and m) give back those blocks."""
    gen = _gen(3)
    out_f, n, g = 16, 128, 32
    codes = torch.randint(0, 16, (out_f, n // g, g), generator=gen)
    codes[..., 3], codes[..., 17] = 0, 15  # llama.cpp's scale makes the group's extremes codes 0 and 15
    d = (torch.rand(out_f, n // g, generator=gen) * 0.05 + 1e-3).half()
    m = ((torch.rand(out_f, n // g, generator=gen) - 0.8) * 16 * d.float()).half()
    w = (codes * d.float()[..., None] + m.float()[..., None]).reshape(out_f, n)
    got_codes, got_d, got_m = quantize_int4(w, g)
    assert torch.equal(got_d, d), (
        f"Q4_1 blocks: scale differs from the blocks' d by up to {(got_d.float() - d.float()).abs().max():.3g}")
    assert torch.equal(got_m, m), (
        f"Q4_1 blocks: minimum differs from the blocks' m by up to {(got_m.float() - m.float()).abs().max():.3g}")
    bad = (got_codes.reshape(out_f, n // g, g).long() != codes).sum().item()
    assert bad == 0, f"Q4_1 blocks: {bad} of {codes.numel()} codes differ from the blocks' codes"
    back = dequantize_int4(got_codes, got_d, got_m, g)
    assert ((back - w).abs() <= one_rounding(w, got_m, g)).all(), (
        f"Q4_1 blocks: dequantizing the requantized blocks does not give the weights back (off by up to "
        f"{(back - w).abs().max().item():.3g}; code * scale + minimum in float32)")


def check_pack(pack_int4, unpack_int4) -> None:
    got = pack_int4(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    assert got.dtype == torch.uint8 and tuple(got.shape) == (1, 2), (
        f"pack_int4 of (1, 4) codes returns uint8 (1, 2), got {got.dtype} {tuple(got.shape)}")
    assert got.tolist() == [[0x21, 0x0F]], (
        f"pack_int4([1, 2, 15, 0]) = {[hex(v) for v in got[0].tolist()]}, expected ['0x21', '0xf']: column 2j in the "
        f"low nibble, 2j+1 in the high nibble (GGUF's and llama.cpp's order)")
    every = torch.arange(256, dtype=torch.uint8)
    codes = unpack_int4(every)
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (512,), (
        f"unpack_int4 of 256 bytes returns uint8 (512,), got {codes.dtype} {tuple(codes.shape)}")
    low, high = torch.arange(256) % 16, torch.arange(256) // 16
    for name, got_n, want_n in (("low", codes[0::2], low), ("high", codes[1::2], high)):
        if not torch.equal(got_n.long(), want_n):
            b = int((got_n.long() != want_n).nonzero()[0])
            raise AssertionError(f"unpack_int4(byte {b:#04x}) = {codes[2 * b:2 * b + 2].tolist()}, expected "
                                 f"[{b % 16}, {b // 16}] (low nibble first)")
    assert torch.equal(pack_int4(codes), every), "pack_int4(unpack_int4(b)) is not b for every byte b"
    rand = torch.randint(0, 16, (3, 5, 32), generator=_gen(4), dtype=torch.uint8)
    packed = pack_int4(rand)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, 5, 16), (
        f"pack_int4 of (3, 5, 32) codes returns uint8 (3, 5, 16), got {packed.dtype} {tuple(packed.shape)}")
    assert torch.equal(unpack_int4(packed), rand), "unpack_int4(pack_int4(codes)) is not codes (3-D input)"
    try:
        pack_int4(torch.zeros(2, 5, dtype=torch.uint8))
    except ValueError:
        pass
    else:
        raise AssertionError("pack_int4 of 5 columns must raise ValueError: an odd column has no partner nibble")


@pytest.mark.task_07_int4
def test_int4_matches_q4_1():
    check_int4(impl.quantize_int4, impl.dequantize_int4)
    check_gguf(impl.quantize_int4, impl.dequantize_int4)
    for fn in (impl.quantize_int4, impl.dequantize_int4):
        forbid_calls(fn, LIBRARY)


@pytest.mark.task_07_int4
def test_int4_packing():
    check_pack(impl.pack_int4, impl.unpack_int4)
    for fn in (impl.pack_int4, impl.unpack_int4):
        forbid_calls(fn, LIBRARY)


# ================================================================================================ task 07.outliers


def q8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """The oracle's symmetric per-row int8 (written out here, not minillm's)."""
    amax = x.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def outlier_weights() -> tuple[Tensor, Tensor, Tensor]:
    w = torch.randn(48, 64, generator=_gen(5)) * 0.05
    q, s = q8_rows(w)
    return q, s, q.float() * s[:, None]


OUTLIER_COLS = [3, 17, 40]


def grid_activations(tokens: int, outliers: bool, seed: int) -> Tensor:
    """Activations whose int8 rounding is unambiguous: row t's scale is a power of two s_t, its largest |x| is
    127 * s_t, every other value is (k +- 0.3) * s_t. With `outliers`, OUTLIER_COLS hold values of 50..2000 in
    some tokens (the rest of those columns stays small and is computed in float too)."""
    gen = _gen(seed)
    assert tokens <= 8
    s = 2.0 ** -torch.tensor([5, 6, 7, 8, 9, 10, 5, 12][:tokens])  # per-token scales from 1/32 to 1/4096
    k = torch.randint(-120, 121, (tokens, 64), generator=gen).float()
    off = torch.where(torch.rand(tokens, 64, generator=gen) < 0.5, -0.3, 0.3)
    x = (k + off) * s[:, None]
    peak = torch.randint(0, 60, (tokens,), generator=gen)
    peak = torch.where(torch.isin(peak, torch.tensor(OUTLIER_COLS)), peak + 1, peak)
    sign = torch.where(torch.rand(tokens, generator=gen) < 0.5, -1.0, 1.0)
    x[torch.arange(tokens), peak] = sign * 127 * s
    if outliers:
        big = (torch.rand(tokens, len(OUTLIER_COLS), generator=gen) * 1950 + 50)
        big = big * torch.where(torch.rand(tokens, len(OUTLIER_COLS), generator=gen) < 0.5, -1.0, 1.0)
        hit = torch.zeros(tokens, len(OUTLIER_COLS), dtype=torch.bool)
        hit[torch.arange(tokens) % 2 == 0] = True  # every other token, the first included
        cols = torch.tensor(OUTLIER_COLS)
        x[:, cols] = torch.where(hit, big, x[:, cols])
    return x


def outlier_cases() -> list[tuple[str, Tensor, float, bool]]:
    """(what, x, threshold, exact): exact cases also compare with the int8 path itself (see grid_activations)."""
    gen = _gen(6)
    at = torch.rand(6, 64, generator=gen) * 8 - 4
    at[2, 9], at[4, 20], at[1, 33] = 6.0, -6.0, 6.5  # exactly at the threshold: not outliers; 6.5 is one
    every = torch.randn(4, 64, generator=gen)
    every[1] = torch.where(every[1] < 0, -1.0, 1.0) * (torch.rand(64, generator=gen) * 93 + 7)
    return [
        ("no outliers (8 tokens)", grid_activations(8, False, 7), 6.0, True),
        ("outlier columns 3, 17, 40 with values of 50..2000", grid_activations(8, True, 8), 6.0, True),
        ("a single token (decode) with outliers", grid_activations(1, True, 9), 6.0, True),
        ("a single token (decode), no outliers", grid_activations(1, False, 10), 6.0, True),
        ("values exactly at the threshold (+-6.0)", at, 6.0, False),
        ("every column an outlier", every, 6.0, False),
        ("threshold 2.0", torch.randn(8, 64, generator=gen), 2.0, False),
        ("bfloat16 activations with outliers", grid_activations(8, True, 11).bfloat16(), 6.0, False),
    ]


def int8_path(x: Tensor, q: Tensor, s: Tensor, mask: Tensor) -> Tensor:
    """The oracle: regular columns as int8 (per-token scale) x int8 weights, outlier columns in float."""
    xf = x.float()
    xq, xs = q8_rows(xf.masked_fill(mask, 0.0))
    y = (xq.long() @ q.long().T).float() * xs[:, None] * s[None, :]
    return y + xf[:, mask] @ (q[:, mask].float() * s[:, None]).T


_PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "_int_mm", "mv", "addmv", "dot", "vdot", "matmul", "linear"}


class _Products(TorchDispatchMode):
    """Records every matrix product torch runs (aten level, after any alias, method or operator was resolved):
    (op name, its matrix operands). `integer()`: those whose operands are all integer tensors."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, list[Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _PRODUCTS:
            self.seen.append((name, [a for a in args if isinstance(a, Tensor) and a.dim() >= 1][-2:]))
        return out

    def integer(self) -> list[tuple[str, list[Tensor]]]:
        return [(n, ts) for n, ts in self.seen
                if ts and all(not t.is_floating_point() and t.dtype != torch.bool for t in ts)]

    def describe(self) -> str:
        return ", ".join(f"{n}({', '.join(f'{t.dtype} {tuple(t.shape)}' for t in ts)})" for n, ts in self.seen) \
            or "none"


def _same_values(a: Tensor, b: Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.equal(a.long(), b.long())


def check_integer_product(int8_matmul_with_outliers, case: str, x: Tensor, q: Tensor, s: Tensor, threshold: float,
                          mask: Tensor) -> None:
    """The regular columns must go through an integer product of their per-token int8 codes with q (int32
    accumulation): a float matmul of the same codes gives the same numbers on small inputs (float32 adds integers
    exactly below 2**24), so the values cannot tell; the op that ran can."""
    xq = q8_rows(x.float().masked_fill(mask, 0.0))[0]
    if not xq.any():
        return  # no regular values: nothing for the integer path to do
    with _Products() as products:
        int8_matmul_with_outliers(x, q, s, threshold)
    found = products.integer()
    assert found, (
        f"{case}: no integer matrix product ran (products seen: {products.describe()}): the regular columns were "
        f"multiplied in floating point. The contract is int8 x int8 with int32 accumulation: the given _int8_mm of "
        f"the per-token int8 codes and q")
    ok = any(len(ts) == 2 and any(_same_values(a, xq) and (_same_values(b, q) or _same_values(b, q.T))
                                  for a, b in (ts, ts[::-1])) for _, ts in found)
    assert ok, (
        f"{case}: the integer products ({', '.join(n for n, _ in found)}) did not multiply the regular columns' "
        f"per-token int8 codes (outlier columns zeroed, each token's max |x| / 127 as its scale) by q")


def check_rows(quantize_rows_int8) -> None:
    check_symmetric_rows(quantize_rows_int8, "quantize_rows_int8")


def check_outliers(int8_matmul_with_outliers) -> None:
    q, s, wd = outlier_weights()
    for case, x, threshold, exact in outlier_cases():
        out = no_nan_made(int8_matmul_with_outliers, x, q, s, threshold, what=case)
        assert isinstance(out, tuple) and len(out) == 2, "int8_matmul_with_outliers returns (y, outlier mask)"
        y, mask = out
        xf = x.float()
        want_mask = (xf.abs() > threshold).any(dim=0)
        assert mask.dtype == torch.bool and tuple(mask.shape) == (x.shape[1],), (
            f"{case}: the mask is bool (in,) = ({x.shape[1]},), one per input column; got {mask.dtype} "
            f"{tuple(mask.shape)}")
        if not torch.equal(mask, want_mask):
            c = int((mask != want_mask).nonzero()[0])
            peak = xf[:, c].abs().max().item()
            raise AssertionError(
                f"{case}: column {c} (max |x| = {peak:.6g}, threshold {threshold}): outlier = {bool(mask[c])}, "
                f"expected {bool(want_mask[c])}" + (" (strictly greater: a value equal to the threshold is not "
                                                    "an outlier)" if peak == threshold else ""))
        assert y.dtype == torch.float32 and tuple(y.shape) == (x.shape[0], q.shape[0]), (
            f"{case}: y must be float32 (tokens, out) = {(x.shape[0], q.shape[0])}, got {y.dtype} {tuple(y.shape)}")
        assert torch.isfinite(y).all(), f"{case}: y is not finite"
        # 1. close to the float product: each regular column is off by at most half its token's int8 step
        ref = xf @ wd.T
        xs = q8_rows(xf.masked_fill(want_mask, 0.0))[1]
        mag = xf.abs() @ wd.abs().T
        bound = xs[:, None] / 2 * (wd.abs() * ~want_mask).sum(dim=1)[None, :] + 1e-5 * mag + 1e-6
        err = (y - ref).abs()
        if (err > bound).any():
            i = int((err - bound).argmax())
            t, n = divmod(i, y.shape[1])
            raise AssertionError(
                f"{case}: y[{t}, {n}] = {y[t, n].item():.6g}, the float product x @ dequantize(q, scale).T gives "
                f"{ref[t, n].item():.6g}: off by {err[t, n].item():.3g}, more than half an int8 step per regular "
                f"column allows ({bound[t, n].item():.3g}). Outlier columns: {int(want_mask.sum())}; they are "
                f"multiplied in float with the scaled weight columns, and each token row gets its own int8 scale "
                f"computed without them")
        # 2. the regular columns really went through int8 (exact cases: every rounding is unambiguous)
        if exact:
            path = int8_path(x, q, s, want_mask)
            off = (y - path).abs()
            if (off > 1e-5 * mag + 1e-7).any():
                floaty = ((y - ref).abs() <= 1e-5 * mag + 1e-7).all()
                raise AssertionError(
                    f"{case}: y differs from the int8 path by up to {off.max().item():.3g}" + (
                        ": it equals the float product x @ W.T. The non-outlier columns must be quantized per token "
                        "and multiplied as int8 x int8 with int32 accumulation" if floaty else
                        ": quantize each token's regular columns with its own scale (max |x| / 127 over the "
                        "non-outlier columns), int8 x int8 -> int32, then scale by the token's and the output "
                        "row's scales"))
        # 3. ... in an integer product
        check_integer_product(int8_matmul_with_outliers, case, x, q, s, threshold, want_mask)


@pytest.mark.task_07_outliers
def test_quantize_rows_int8():
    check_rows(impl.quantize_rows_int8)
    forbid_calls(impl.quantize_rows_int8, LIBRARY)


@pytest.mark.task_07_outliers
def test_int8_matmul_with_outliers():
    check_outliers(impl.int8_matmul_with_outliers)
    forbid_calls(impl.int8_matmul_with_outliers, LIBRARY)


# ================================================================================================== task 07.matvec

# SmolLM2's (out, in) weights a decode row meets: one layer's q, k, v, o, gate, up, down, then the LM head (its
# 49152 x 576 is 8x a layer's weights: most of what makes a decode step's matvecs slow)
MATVEC_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (49152, 576)]
MATVEC_FLOOR = 0.35  # see check_matvec_speed


def _matvec_oracle(x: Tensor, q: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(x @ dequantize(q, s).T in float64, the allowed error: half of each row's int8 step per |weight|)."""
    wd = q.double() * s.double()[:, None]
    xd = x.double()
    step = xd.abs().amax(dim=1) / 127
    bound = step[:, None] / 2 * wd.abs().sum(dim=1)[None, :] * (1 + 1e-5) + 1e-5 * (xd.abs() @ wd.abs().T) + 1e-7
    return xd @ wd.T, bound


def matvec_cases() -> list[tuple[str, Tensor, Tensor, Tensor]]:
    gen = _gen(12)
    out = []
    for rows, (n_out, n_in), what in [(1, (1536, 576), "one decode row, 576 -> 1536"),
                                      (1, (576, 1536), "one decode row, 1536 -> 576"),
                                      (4, (192, 576), "4 decode rows of magnitude 1e-3 .. 1e3, 576 -> 192"),
                                      (3, (7, 40), "3 rows, 40 -> 7 (no multiple of 8 or 16)"),
                                      (2, (5, 1), "a single input column")]:
        q, s = q8_rows(torch.randn(n_out, n_in, generator=gen) * torch.logspace(-2, 1, n_out)[:, None])
        x = torch.randn(rows, n_in, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
        out.append((what, x, q, s))
    q, s = q8_rows(torch.randn(64, 96, generator=gen))
    x = torch.randn(3, 96, generator=gen)
    x[1] = 0
    x[2, 7] = 500.0  # one large value sets its row's step
    out.append(("a row of zeros and a row with one value of 500", x, q, s))
    out.append(("bfloat16 rows", torch.randn(2, 96, generator=gen).bfloat16(), q, s))
    return out


def check_matvec(int8_matvec) -> None:
    for case, x, q, s in matvec_cases():
        y = no_nan_made(int8_matvec, x, q, s, what=case)
        assert isinstance(y, Tensor) and y.dtype == torch.float32 and tuple(y.shape) == (x.shape[0], q.shape[0]), (
            f"{case}: y must be float32 (rows, out) = {(x.shape[0], q.shape[0])}, got "
            f"{getattr(y, 'dtype', type(y))} {tuple(getattr(y, 'shape', ()))}")
        want, bound = _matvec_oracle(x, q, s)
        err = (y.double() - want).abs()
        if (err > bound).any():
            t, n = divmod(int((err - bound).argmax()), y.shape[1])
            raise AssertionError(
                f"{case}: y[{t}, {n}] = {y[t, n].item():.6g}, x @ dequantize_int8(q, scale).T (float64) gives "
                f"{want[t, n].item():.6g}: off by {err[t, n].item():.3g}, more than half of row {t}'s int8 step per "
                f"|weight| allows ({bound[t, n].item():.3g}). Scale each row of x by its own max |x| / 127, and "
                f"multiply the integer result by the scales of x's row and of q's row")
        zero = (x.float().abs().amax(dim=1) == 0)
        assert not y[zero].any(), f"{case}: a row of zeros must give zeros, got {y[zero].abs().max().item():.3g}"
    q, s = q8_rows(torch.randn(6, 16, generator=_gen(13)))
    x = torch.randn(2, 16, generator=_gen(14))
    for what, args in [("x 1-D", (x[0], q, s)), ("x wider than q", (torch.randn(2, 17), q, s)),
                       ("q in float32", (x, q.float(), s)), ("q in int32", (x, q.int(), s)),
                       ("a scale per column", (x, q, torch.ones(16))), ("a (out, 1) scale", (x, q, s[:, None]))]:
        try:
            int8_matvec(*args)
        except ValueError:
            continue
        raise AssertionError(f"int8_matvec accepted {what}: bad shapes or dtypes must raise ValueError")


def _naive_matvec(x, q, s):
    """Dequantize the whole weight, then a float matmul: right, and 4 bytes of weight written and read per call."""
    return x.float() @ (q.float() * s.float()[:, None]).T


def check_matvec_speed(int8_matvec) -> None:
    """One row through each weight of MATVEC_SHAPES, one torch thread, against dequantize-then-matmul in interleaved
    pairs (a noisy machine slows both halves of a pair): the median ratio must be <= MATVEC_FLOOR, and the timed
    outputs right (a fast wrong answer does not pass)."""
    from minillm.measure.harness import paired_ratio
    from tests.graders.real_model import one_thread

    gen = _gen(15)
    layers = [(torch.randn(1, n_in, generator=gen), *q8_rows(torch.randn(n_out, n_in, generator=gen) * 0.05))
              for n_out, n_in in MATVEC_SHAPES]
    for x, q, s in layers:
        want, bound = _matvec_oracle(x, q, s)
        assert ((int8_matvec(x, q, s).double() - want).abs() <= bound).all(), (
            f"int8_matvec is off on a {tuple(q.shape)} weight (see the correctness test)")

    def step(fn):
        return lambda: [fn(x, q, s) for x, q, s in layers]

    ratio = one_thread(paired_ratio)(step(int8_matvec), step(_naive_matvec), pairs=11, warmup=1)
    assert ratio.median <= MATVEC_FLOOR, (
        f"your int8_matvec took {ratio} the time of dequantize-then-matmul on one decode row through SmolLM2's "
        f"(out, in) weights {MATVEC_SHAPES} (allowed: {MATVEC_FLOOR}x). A decode matvec reads each weight once: "
        f"building a float32 copy of q (q.float(), or q times its scales) writes and reads 4 bytes a weight; an int8 "
        f"x int8 product reads 1 and applies the scales to the (rows, out) result")


@pytest.mark.task_07_matvec
def test_int8_matvec(monkeypatch):
    monkeypatch.setattr(impl, "quantize_rows_int8", q8_rows)  # 07.outliers' function, should yours call it
    check_matvec(impl.int8_matvec)
    forbid_calls(impl.int8_matvec, LIBRARY)


@pytest.mark.task_07_matvec
def test_int8_matvec_beats_dequantize_then_matmul(monkeypatch):
    monkeypatch.setattr(impl, "quantize_rows_int8", q8_rows)
    forbid_calls(impl.int8_matvec, LIBRARY)
    check_matvec_speed(impl.int8_matvec)


# ============================================================================================ the real model


_PPL_TOKENS = 256
_ref: dict = {}


def _swap_in(monkeypatch) -> None:
    """Your functions, where minillm's quantized layers call them (Int8Linear, Int4Linear, LLMInt8Linear)."""
    for name in ("quantize_int8", "dequantize_int8", "quantize_int4", "dequantize_int4", "pack_int4", "unpack_int4"):
        monkeypatch.setattr(minillm.compress.quant, name, getattr(impl, name))
    for name in ("quantize_int8", "quantize_rows_int8", "int8_matmul_with_outliers"):
        monkeypatch.setattr(minillm.compress.llm_int8, name, getattr(impl, name))


@pytest.mark.task_07_real_model
def test_your_int4_gives_back_the_model_file(real_model):
    """SmolLM2's file stores its Linear layers as Q4_1 (groups of 32, fp16 scale and minimum): the loaded float
    weights requantized with your quantize_int4 and dequantized with your dequantize_int4 are exactly the same."""
    from tests.graders.real_model import one_thread

    model, _ = real_model

    @one_thread
    def check():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and name != "lm_head":  # the LM head is tied to the Q8_0 embedding
                w = m.weight.detach()
                codes, scale, minimum = impl.quantize_int4(w, 32)
                back = impl.dequantize_int4(codes, scale, minimum, 32)
                if not ((back - w).abs() <= one_rounding(w, minimum, 32)).all():
                    raise AssertionError(
                        f"{name}: its Q4_1 weights requantized with group_size 32 and dequantized differ by up to "
                        f"{(back - w).abs().max().item():.3g} at {int((back != w).sum())} of {w.numel()} weights "
                        f"(the file's own codes should come back exactly)")

    check()


@pytest.mark.task_07_real_model
def test_your_quantized_smollm2(real_model, monkeypatch):
    """quantize(model, 'int8') and quantize(model, 'int4', group_size=32) on the bfloat16 model, with your
    functions: the int8 model still answers Paris; perplexity on 256 tokens within 2% (int8) and 10% (int4) of
    the unquantized model's."""
    from minillm.model import model_bytes
    from minillm.compress.quality import eval_ids, perplexity_of_ids
    from tests.graders.real_model import N_TOKENS, chat_ids, one_thread

    model, tok = real_model
    ids = eval_ids(tok, _PPL_TOKENS)

    @one_thread  # copying and quantizing too: two threads crawl when another process holds a core
    @torch.inference_mode()
    def run(scheme: str):
        qm = minillm.compress.quantize.quantize(copy.deepcopy(model).to(torch.bfloat16), scheme, group_size=32)
        text = minillm.generate(qm, tok, chat_ids(tok), max_new_tokens=N_TOKENS).text
        return perplexity_of_ids(qm, ids), text, model_bytes(qm)

    if "ppl" not in _ref:
        _ref["ppl"] = one_thread(torch.inference_mode()(perplexity_of_ids))(model, ids)
        _ref["bytes"] = model_bytes(model)
    base = _ref["ppl"]
    _swap_in(monkeypatch)
    got = {scheme: (*run(scheme), limit) for scheme, limit in (("int8", 1.02), ("int4", 1.10))}
    print("\n" + "; ".join(
        [f"float32 {_ref['bytes'] / 2 ** 20:.0f} MiB, perplexity {base:.3f}"] +
        [f"{k} {b / 2 ** 20:.0f} MiB, perplexity {p:.3f} ({p / base - 1:+.1%}), answers {t.strip()!r}"
         for k, (p, t, b, _) in got.items()]))
    for scheme, (ppl, text, _, limit) in got.items():
        assert math.isfinite(ppl) and ppl <= base * limit, (
            f"{scheme}: perplexity {ppl:.3f} on {_PPL_TOKENS} tokens, the unquantized model's {base:.3f}: more than "
            f"{limit - 1:.0%} worse (per-row scales for int8, per-group ranges for int4 keep it close)")
    assert "Paris" in got["int8"][1], f"the int8 model answered {got['int8'][1]!r}"


@pytest.mark.task_07_real_model
def test_your_llm_int8_on_real_activations(real_model):
    """The input of the SmolLM2 layer with the largest activation (values in the thousands, the outliers LLM.int8()
    is about), multiplied by that layer's int8 weights with your functions: within 0.3% of the float product."""
    from tests.graders.real_model import chat_ids, one_thread

    model, tok = real_model
    if "act" not in _ref:
        seen: dict[str, Tensor] = {}
        hooks = [m.register_forward_pre_hook(lambda mod, a, name=name: seen.__setitem__(
                     name, a[0].reshape(-1, a[0].shape[-1]).detach().clone()))
                 for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
        try:
            with torch.inference_mode():
                one_thread(model)(torch.tensor([chat_ids(tok)]))
        finally:
            for h in hooks:
                h.remove()
        name = max(seen, key=lambda n: seen[n].abs().max().item())
        _ref["act"] = (name, seen[name], model.get_submodule(name).weight.detach())
    name, x, w = _ref["act"]
    q, s = one_thread(impl.quantize_int8)(w)
    wd = q.float() * s.float()[:, None]
    y, mask = one_thread(impl.int8_matmul_with_outliers)(x, q, s)
    ref = x @ wd.T
    plain = int8_path(x, q, s, torch.zeros_like(mask))  # no decomposition: the outliers set the tokens' scales
    rel = ((y - ref).norm() / ref.norm()).item()
    rel_plain = ((plain - ref).norm() / ref.norm()).item()
    print(f"\n{name}: {int(mask.sum())} of {mask.numel()} input columns above 6.0 (max |x| "
          f"{x.abs().max().item():.0f}); relative error {rel:.3%} with the decomposition, {rel_plain:.3%} without")
    assert torch.equal(mask, (x.abs() > 6.0).any(dim=0)), f"{name}: the outlier mask is wrong on real activations"
    assert rel <= 0.003, f"{name}: relative error {rel:.3%} against the float product (> 0.3%)"


# ================================================================================================ grader self-test


def _pack_high_first(codes):
    c = codes.to(torch.uint8)
    return (c[..., 0::2] << 4) | c[..., 1::2]


def _unpack_high_first(packed):
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).flatten(-2)


@grader_selftest
def test_pack_rejects_a_consistent_nibble_swap():
    """Swapped in both functions, the round trip still works: only the layout check can tell."""
    with pytest.raises(AssertionError):
        check_pack(_pack_high_first, _unpack_high_first)


@grader_selftest
def test_outlier_checks_tell_the_decomposition_apart():
    """Without the decomposition (the outliers set every token's scale), the error bound is far exceeded; a float
    matmul over all columns is far from the int8 path (the exact cases)."""
    q, s, wd = outlier_weights()
    x = grid_activations(8, True, 8)
    mask = (x.abs() > 6.0).any(dim=0)
    ref = x @ wd.T
    xs = q8_rows(x.masked_fill(mask, 0.0))[1]
    bound = xs[:, None] / 2 * (wd.abs() * ~mask).sum(dim=1)[None, :] + 1e-5 * (x.abs() @ wd.abs().T) + 1e-6
    plain = int8_path(x, q, s, torch.zeros_like(mask))
    assert ((plain - ref).abs() / bound).max() > 10
    tight = 1e-5 * (x.abs() @ wd.abs().T) + 1e-7
    assert ((ref - int8_path(x, q, s, mask)).abs() / tight).max() > 10
    with pytest.raises(AssertionError, match="float product x @ W.T"):
        check_outliers(lambda x, q, s, threshold=6.0: (x.float() @ (q.float() * s[:, None]).T,
                                                        (x.float().abs() > threshold).any(dim=0)))


def _outliers_float_codes(x, q, s, threshold=6.0):
    """The right numbers, int8 codes and all, but the codes multiplied in float32 (exact on these sizes)."""
    x = x.float()
    mask = (x.abs() > threshold).any(dim=0)
    xq, xs = q8_rows(x.masked_fill(mask, 0.0))
    y = (xq.float() @ q.float().T) * xs[:, None] * s[None, :]
    return y + x[:, mask] @ (q[:, mask].float() * s[:, None]).T, mask


def _outliers_int_product_of_wrong_codes(x, q, s, threshold=6.0):
    """An integer product, but of codes quantized with one scale for all tokens; y itself from the float path."""
    x = x.float()
    mask = (x.abs() > threshold).any(dim=0)
    xq, _ = q8_rows(x.masked_fill(mask, 0.0).reshape(1, -1))
    _ = xq.reshape(x.shape).long() @ q.long().T  # computed, then unused
    return _outliers_float_codes(x, q, s, threshold)


@grader_selftest
def test_outlier_checks_see_the_integer_product():
    """Both wrong answers give int8_path's values bit for bit on every case; only the op that ran tells."""
    q, s, _ = outlier_weights()
    x = grid_activations(8, True, 8)
    mask = (x.abs() > 6.0).any(dim=0)
    assert torch.equal(_outliers_float_codes(x, q, s)[0], int8_path(x, q, s, mask))
    check_outliers(lambda x, q, s, threshold=6.0: (int8_path(x, q, s, (x.float().abs() > threshold).any(dim=0)),
                                                    (x.float().abs() > threshold).any(dim=0)))
    with pytest.raises(AssertionError, match="no integer matrix product"):
        check_outliers(_outliers_float_codes)
    with pytest.raises(AssertionError, match="did not multiply the regular columns"):
        check_outliers(_outliers_int_product_of_wrong_codes)


@grader_selftest
def test_matvec_checks_accept_the_integer_path_and_reject_wrong_scales():
    def right(x, q, s):
        if x.dim() != 2 or q.dtype != torch.int8 or x.shape[1] != q.shape[1] or s.shape != (q.shape[0],):
            raise ValueError("bad input")
        xq, xs = q8_rows(x)
        return (xq.long() @ q.long().T).float() * xs[:, None] * s[None, :]

    def one_activation_scale(x, q, s):  # one scale for all rows: a small row loses its bits
        xq, xs = q8_rows(x.reshape(1, -1))
        return right(x, q, s) if x.shape[0] == 1 else \
            (xq.reshape(x.shape).long() @ q.long().T).float() * xs * s[None, :]

    check_matvec(right)
    with pytest.raises(AssertionError, match="off by"):
        check_matvec(one_activation_scale)
    with pytest.raises(AssertionError, match="ValueError"):
        check_matvec(lambda x, q, s: _naive_matvec(x, q, s))


@grader_selftest
def test_matvec_speed_floor_rejects_dequantize_then_matmul():
    def naive(x, q, s):
        return _naive_matvec(x, q, s)

    with pytest.raises(AssertionError, match="allowed"):
        check_matvec_speed(naive)


"""minillm.measure.breakdown: a step's wall time split into matmul / attention / elementwise / sampling / else.

Tiny random models and hand-built steps whose ops are known; no tight timing asserts (the machine is shared)."""

from __future__ import annotations

import math
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import ModelConfig
from minillm.kv_cache import KVCache
from minillm.measure.breakdown import (
    KINDS,
    TERMS,
    Breakdown,
    attention_scope,
    breakdown_of,
    classify,
    sampling_scope,
    step_breakdown,
)
from minillm.model import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

ROOFS = {"bandwidth": 10e9, "flops_per_s": 50e9}  # given, so no test spends time probing the machine


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Transformer(ModelConfig.tiny()).eval()


def assert_consistent(bd: Breakdown) -> None:
    assert set(bd.terms) == set(TERMS)
    assert all(v >= 0 and math.isfinite(v) for v in bd.terms.values()), bd.terms
    assert sum(bd.terms.values()) == pytest.approx(bd.wall_ms, rel=1e-6)
    assert sum(bd.shares.values()) == pytest.approx(1.0, rel=1e-6)
    assert bd.wall_ms > 0 and bd.profiled_wall_ms > 0
    assert bd.largest() in TERMS


# ------------------------------------------------------------------------------------------- the model's steps


@pytest.mark.parametrize("kind, batch", [("decode", 1), ("verify", 1), ("verify", 2), ("batch", 3)])
def test_terms_are_non_negative_and_sum_to_the_wall(tiny, kind, batch):
    bd = step_breakdown(tiny, kind, batch=batch, k=3, context=16, repeat=3, **ROOFS)
    assert_consistent(bd)
    # every linear of every block plus the LM head, however the head computes its few rows
    assert bd.op_counts["matmul"] == 7 * tiny.config.n_layers + 1
    assert bd.op_counts["attention"] >= tiny.config.n_layers  # one backend call per layer, inside its scope
    assert bd.op_counts["sampling"] >= 1
    assert bd.n_ops == sum(bd.op_counts.values())
    assert bd.settings["new_tokens"] == (4 if kind == "verify" else 1)
    assert bd.byte_floor_ms > 0 and bd.compute_floor_ms > 0


def test_floors_follow_the_step(tiny):
    one = step_breakdown(tiny, "batch", batch=1, context=32, repeat=1, **ROOFS)
    four = step_breakdown(tiny, "batch", batch=4, context=32, repeat=1, **ROOFS)
    verify = step_breakdown(tiny, "verify", k=4, context=32, repeat=1, **ROOFS)
    assert four.byte_floor_ms > one.byte_floor_ms  # more sequences' K/V, the same weights
    assert four.compute_floor_ms == pytest.approx(4 * one.compute_floor_ms, rel=0.05)
    assert verify.compute_floor_ms == pytest.approx(5 * one.compute_floor_ms, rel=0.05)


def test_an_int8_cache_reads_a_quarter_of_the_float32_bytes(tiny):
    from minillm.model import model_bytes

    f32 = step_breakdown(tiny, "decode", context=32, repeat=1, **ROOFS)
    i8 = step_breakdown(tiny, "decode", context=32, repeat=1, kv_dtype=torch.int8, **ROOFS)
    cfg, layers = tiny.config, len(tiny.layers)
    values = 2 * layers * cfg.n_kv_heads * 33 * cfg.head_dim  # K and V of the 32 cached tokens and the new one
    assert f32.settings["kv_dtype"] == "float32" and f32.settings["kv_bytes"] == 4 * values
    scales = 2 * values // cfg.head_dim  # a float16 scale per token, head and K or V
    assert i8.settings["kv_dtype"] == "int8" and i8.settings["kv_bytes"] == values + scales
    for bd in (f32, i8):
        assert bd.settings["bytes_read"] == model_bytes(tiny) + bd.settings["kv_bytes"]
    assert i8.byte_floor_ms < f32.byte_floor_ms


def test_the_naive_backend_is_charged_to_attention_not_matmul(tiny):
    tiny.set_attention("naive")
    try:
        bd = step_breakdown(tiny, "verify", k=2, context=8, repeat=1, **ROOFS)
    finally:
        tiny.set_attention("sdpa")
    assert bd.op_counts["matmul"] == 7 * tiny.config.n_layers + 1  # its q @ k^T and p @ v are not weight matmuls
    assert bd.op_counts["attention"] >= 2 * tiny.config.n_layers


def test_attention_scope_restores_the_backend_even_on_error(tiny):
    original = tiny._attn
    with pytest.raises(RuntimeError), attention_scope(tiny):
        assert tiny._attn is not original
        raise RuntimeError("boom")
    assert tiny._attn is original


def test_wall_agrees_with_a_hand_timed_step(tiny):
    context = 32
    bd = step_breakdown(tiny, "decode", context=context, repeat=15, **ROOFS)
    kv = KVCache.for_model(tiny, 1, context + 1)
    kv.seq_len = context
    ids = torch.tensor([[5]])
    runs = []
    with torch.inference_mode():
        for i in range(16):
            start = time.perf_counter()
            tiny(ids, kv_cache=kv).argmax(-1).tolist()
            if i:  # the first is a warmup
                runs.append((time.perf_counter() - start) * 1e3)
            kv.truncate(context)
    hand = statistics.median(runs)
    assert hand / 4 < bd.wall_ms < hand * 4, (bd.wall_ms, hand)


# ---------------------------------------------------------------------------------- hand-built steps: the oracle


def test_a_matmul_only_step_is_all_matmul():
    x, w = torch.randn(8, 64), torch.randn(64, 64)
    bd = breakdown_of(lambda: torch.mm(x, w), repeat=2)
    assert_consistent(bd)
    assert bd.op_counts == {"matmul": 1, "attention": 0, "elementwise": 0, "sampling": 0}
    assert bd.terms["attention"] == bd.terms["elementwise"] == bd.terms["sampling"] == 0


def test_linear_counts_once_although_it_calls_mm_inside():
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    bd = breakdown_of(lambda: F.linear(x, w), repeat=2)
    assert bd.op_counts["matmul"] == 1 and bd.n_ops == 1


def test_an_elementwise_step_is_all_elementwise():
    a, b = torch.randn(256), torch.randn(256)
    bd = breakdown_of(lambda: torch.relu(a * b + a).sum(), repeat=2)
    assert_consistent(bd)
    assert bd.op_counts == {"matmul": 0, "attention": 0, "elementwise": 4, "sampling": 0}
    assert bd.terms["matmul"] == 0


def test_sdpa_is_attention_and_the_sampling_scope_is_sampling():
    q = torch.randn(1, 2, 4, 8)
    logits = torch.randn(3, 100)

    def step():
        F.scaled_dot_product_attention(q, q, q)
        with sampling_scope():
            logits.argmax(-1)  # an elementwise op by name, sampling by scope

    bd = breakdown_of(step, repeat=2)
    assert bd.op_counts == {"matmul": 0, "attention": 1, "elementwise": 0, "sampling": 1}


def test_classify_table():
    assert classify("aten::mm") == classify("aten::linear") == classify("minillm::int8_matmul") == "matmul"
    assert classify("aten::scaled_dot_product_attention") == "attention"
    assert classify("minillm::paged_int8_decode") == "attention"
    assert classify("aten::mul") == classify("aten::copy_") == classify("aten::embedding") == "elementwise"


@settings(max_examples=8)
@given(n_mm=st.integers(0, 3), n_ew=st.integers(0, 4), sampled=st.booleans(), rows=st.integers(1, 4),
       dim=st.sampled_from([8, 32]))
def test_classification_sums_over_small_shapes(n_mm, n_ew, sampled, rows, dim):
    x, w = torch.randn(rows, dim), torch.randn(dim, dim)

    def step():
        for _ in range(n_mm):
            torch.mm(x, w)
        for _ in range(n_ew):
            torch.add(x, 1.0)
        if sampled:
            with sampling_scope():
                x.argmax(-1)

    bd = breakdown_of(step, repeat=1, profile_repeat=1, warmup=0)
    assert_consistent(bd)
    assert bd.op_counts == {"matmul": n_mm, "attention": 0, "elementwise": n_ew, "sampling": int(sampled)}
    assert (bd.terms["matmul"] > 0) == (n_mm > 0)


# ------------------------------------------------------------------------------------------- output and inputs


def test_printing():
    bd = Breakdown(label="decode b=1", wall_ms=10.0, n_ops=100, byte_floor_ms=2.0, compute_floor_ms=0.5,
                   terms={"matmul": 6.0, "attention": 1.0, "elementwise": 1.0, "sampling": 0.0, "else": 2.0})
    assert bd.largest() == "matmul" and bd.floor_ms == 2.0
    assert "decode b=1: 10.00 ms" in bd.line() and "matmul 6.00 ms (60%)" in bd.line()
    assert "floor 2.00 ms (bytes)" in bd.line()
    assert all(t in bd.table() for t in TERMS) and "byte floor" in bd.table()
    row = bd.as_row()
    assert row["matmul_share"] == pytest.approx(0.6) and row["ops"] == 100
    assert "floor" not in Breakdown(label="s", wall_ms=1.0, n_ops=0, terms={"else": 1.0}).line()


def test_the_profilers_native_trace_lines_are_kept_out_of_the_output(capfd):
    """Only what is written to fd 2 while the profiler starts and stops is dropped; stderr works again after."""
    import os

    from minillm.measure.breakdown import _no_native_stderr

    with _no_native_stderr():
        os.write(2, b"USDT: profiler_start\n")
    os.write(2, b"after\n")
    breakdown_of(lambda: torch.ones(8) * 2, repeat=1)
    assert capfd.readouterr().err == "after\n"


def test_the_gap_over_the_byte_floor_is_split_by_term():
    """The gap (wall - byte floor) is the matmuls' time past the floor plus every other term; the largest is named,
    and an overhead-light step names the matmuls, not 'else' (the line cannot say a cause the terms do not show)."""
    bd = Breakdown(label="decode b=1", wall_ms=10.5, n_ops=100, byte_floor_ms=4.0,
                   terms={"matmul": 6.0, "attention": 1.0, "elementwise": 1.0, "sampling": 0.0, "else": 2.5})
    gap = bd.gap()
    assert sum(gap.values()) == pytest.approx(10.5 - 4.0) and gap["matmul"] == pytest.approx(2.0)
    assert "6.5 ms gap" in bd.gap_line() and bd.gap_line().endswith("largest: else")
    matmul_bound = Breakdown(label="s", wall_ms=10.0, n_ops=10, byte_floor_ms=2.0,
                             terms={"matmul": 9.0, "attention": 0.2, "elementwise": 0.3, "sampling": 0.0, "else": 0.5})
    assert matmul_bound.gap_line().endswith("largest: matmul")
    with pytest.raises(ValueError, match="no byte floor"):
        Breakdown(label="s", wall_ms=1.0, n_ops=0, terms={"else": 1.0}).gap()


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "prefill"}, "unknown step kind 'prefill'; choose one of decode, verify, batch"),
    ({"kind": "batch", "batch": 0}, "batch >= 1"),
    ({"kind": "verify", "k": 0}, "k >= 1"),
    ({"kind": "decode", "context": -1}, "context >= 0"),
    ({"kind": "decode", "batch": 4}, "kind='batch'"),
    ({"kind": "verify", "context": 510}, "past the context window"),
    ({"kind": "decode", "repeat": 0}, "repeat >= 1"),
])
def test_bad_input_is_a_clear_error(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        step_breakdown(tiny, **kwargs, **ROOFS)


def test_kinds_are_the_documented_three():
    assert KINDS == ("decode", "verify", "batch")


def test_bench_notes_are_computed_from_the_rows(tiny):
    from minillm.bench.breakdown import _notes

    by = {("float32", kind, batch): step_breakdown(tiny, kind, batch=batch, context=8, repeat=1, **ROOFS)
          for kind, batch in (("decode", 1), ("verify", 1), ("batch", 2))}
    notes = _notes(by, ["float32"], context=8)
    assert len(notes) >= 4  # a fifth when the machine was too busy for the profiled and timed steps to agree
    assert f"{by['float32', 'decode', 1].wall_ms:.1f} ms" in notes[0]
    # the native step's rows (here the same tiny model's steps standing in): a note of their own, from their terms
    q4 = {("q4 native", kind, 1): by["float32", kind, 1] for kind in ("decode", "verify")}
    native = [n for n in _notes(by | q4, ["float32"], context=8) if n.startswith("q4 native decode")]
    d, v = q4["q4 native", "decode", 1], q4["q4 native", "verify", 1]
    assert len(native) == 1 and f"{d.wall_ms:.2f} ms" in native[0] and f"{v.wall_ms / d.wall_ms:.2f}x" in native[0]
    kv, read = d.settings["kv_bytes"], d.settings["bytes_read"]
    assert f"{kv / 1e6:.1f} MB of the {read / 1e6:.1f} MB" in native[0] and f"({kv / read:.0%})" in native[0]
    excess = (v.terms["matmul"] - d.terms["matmul"]) / d.wall_ms  # the verify's extra matmul time, in decode steps
    assert f"its matmuls add {excess:.2f}x" in native[0] and f"alone would put it at {1 + excess:.2f}x" in native[0]


def test_ops_under_a_callers_own_scope_still_count():
    from torch.autograd.profiler import record_function

    x = torch.randn(4, 16)

    def step():
        with record_function("my::part"):
            torch.mm(x, x.t())
            x.exp()

    bd = breakdown_of(step, repeat=1)
    assert bd.op_counts == {"matmul": 1, "attention": 0, "elementwise": 2, "sampling": 0}  # x.t() is an op too


def test_breakdown_of_rejects_bad_counts():
    with pytest.raises(ValueError, match="profile_repeat >= 1"):
        breakdown_of(lambda: None, profile_repeat=0)
    with pytest.raises(ValueError, match="repeat >= 1"):
        breakdown_of(lambda: None, repeat=0)


def test_cpu_kernel_matmuls_are_charged_to_matmul_not_to_python():
    """The low-bit CPU kernels are called through pybind, which the profiler does not see as an op: without the
    kernel scope their time landed in 'else' (a q4 step read as 87% Python)."""
    from minillm.compress.quant import Int4Linear, quantize_int4
    from minillm_kernels import cpu_lowbit

    if cpu_lowbit.load() is None:
        pytest.skip("the CPU kernels are not built here")
    torch.manual_seed(0)
    layers = [Int4Linear(*quantize_int4(torch.randn(512, 512), 32), group_size=32) for _ in range(4)]
    x = torch.randn(1, 512)

    def step():
        y = x
        for layer in layers:
            y = layer(y)
        return y

    bd = breakdown_of(step, repeat=3)
    assert_consistent(bd)
    assert bd.op_counts["matmul"] == len(layers)
    assert bd.terms["matmul"] > bd.terms["else"], bd.line()

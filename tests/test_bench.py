"""The benchmark harness: timing, hardware probe, results table/JSON/plot, inference metrics, the entry registry."""

from __future__ import annotations

import json
import math
import re
import sys
import time

import pytest
import torch

from minillm import bench
from minillm.measure import hardware
from minillm.measure.hardware import hardware_info
from minillm.measure.harness import BenchResult, time_fn
from minillm.measure.metrics import (
    decode_bytes_per_token,
    decode_rate,
    decode_tok_s,
    mbu,
    mfu,
    model_flops_per_token,
    peak_memory,
    prefill_flops,
    timed_decode,
    timer,
)
from minillm.config import LLAMA2_7B, ModelConfig
from minillm.model import Transformer

# ---------------------------------------------------------------------------------------------------- time_fn


def test_time_fn_counts_warmup_and_repeats():
    calls = []
    t = time_fn(lambda: calls.append(1), warmup=2, repeat=7)
    assert len(calls) == 9 and len(t.runs) == 7
    assert t.min <= t.median <= t.max and t.min >= 0
    assert t.spread >= 0


def test_time_fn_measures_elapsed_time():
    import time

    t = time_fn(lambda: time.sleep(0.01), warmup=0, repeat=3)
    assert 0.009 <= t.min < 0.5


@pytest.mark.parametrize("kw", [{"repeat": 0}, {"warmup": -1}])
def test_time_fn_rejects_bad_counts(kw):
    with pytest.raises(ValueError, match="repeat"):
        time_fn(lambda: None, **kw)


def test_timer_measures_a_block():
    with timer() as t:
        time.sleep(0.01)
    assert 0.009 <= t.seconds < 0.5


def test_decode_rate_counts_the_tokens_after_the_first():
    """The first token carries the prefill: tokens at 0, 1, 3, 6, 10 s are 4 decode tokens in 10 s; their gaps
    1, 2, 3, 4 s have the (upper) median 3 s."""
    assert decode_rate([0.0, 1.0, 3.0, 6.0, 10.0]) == pytest.approx(0.4)
    assert decode_rate([0.0, 1.0, 3.0, 6.0, 10.0], median=True) == pytest.approx(1 / 3)
    assert math.isnan(decode_rate([1.0])) and math.isnan(decode_rate([]))


def test_the_decode_timer_on_a_tiny_model():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny()).eval().requires_grad_(False)
    out = timed_decode(model, [5, 6, 7], 6)
    assert len(out.token_ids) == len(out.token_times) == 6 and out.token_times == sorted(out.token_times)
    tps, ids = decode_tok_s(model, [5, 6, 7], 6, repeat=3)
    assert tps > 0 and ids == out.token_ids  # greedy: the same ids every run


# ------------------------------------------------------------------------------------------------- hardware


def test_hardware_info_measures_and_caches(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "_HARDWARE", {})  # measure now, even if another test already did
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))  # leave the user's cache alone
    t0 = time.perf_counter()
    info = hardware_info("cpu")
    # bounded: a CPU that emulates bf16 once spent minutes here on a fixed 2048^3 bf16 probe
    assert time.perf_counter() - t0 < 20
    for key in ("device", "cpu", "threads", "torch", "python", "bandwidth_GBps", "flops_float32", "flops_bfloat16",
                "native_bf16", "cpu_capability", "load_avg", "cpu_count"):
        assert key in info
    assert info["device"] == "cpu" and info["torch"] == torch.__version__
    assert 0.1 < info["bandwidth_GBps"] < 1e5
    assert 1e8 < info["flops_float32"] < 1e16
    assert hardware_info("cpu") == info  # cached: the same measurement, not a new one
    info["bandwidth_GBps"] = -1.0  # callers get a copy
    assert hardware_info("cpu")["bandwidth_GBps"] > 0


def test_probe_stops_before_a_size_that_would_not_fit_its_budget():
    """A fake op whose time grows as n^3 (like a matmul): 10 ms, 80 ms, 640 ms, 5 s. With a 1 s budget the probe
    must not try n=8, which alone would take 5 s."""
    tried = []

    def make(n):
        tried.append(n)
        return lambda: time.sleep(0.01 * n**3)

    t0 = time.perf_counter()
    rate = hardware._bounded_best_rate([1, 2, 4, 8], make, lambda n: n**3, budget_s=1.0)
    assert time.perf_counter() - t0 < 2.5 and 8 not in tried and tried[:2] == [1, 2]
    assert 50 < rate < 110  # n^3 / (0.01 n^3 s) = 100 per second, less the sleep's overshoot


def test_native_bf16_follows_the_cpu_flags(monkeypatch):
    if sys.platform == "darwin":
        pytest.skip("macOS asks sysctl, not /proc/cpuinfo")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not hardware.native_bf16("cpu") and hardware.preferred_dtype("cpu") == "float32"
    assert "emulated" in hardware.bf16_status("cpu") and "float32" in hardware.bf16_status("cpu")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert hardware.native_bf16("cpu") and hardware.preferred_dtype("cpu") == "bfloat16"
    assert "native (avx512_bf16" in hardware.bf16_status("cpu")


def test_this_machine_reports_its_bf16_support():
    info_flags = hardware.cpu_flags()
    if info_flags:  # Linux
        assert hardware.native_bf16("cpu") == bool(info_flags & {"avx512_bf16", "amx_bf16", "bf16"})
    summary = hardware.hardware_summary({**FAKE_HW, "flops_bfloat16": 1e9, "native_bf16": False})
    assert "emulated" in summary


def test_busy_warning_when_load_leaves_fewer_free_cores_than_threads(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_count", lambda: 2)
    monkeypatch.setattr(hardware, "load_average", lambda: 3.5)
    warning = hardware.busy_warning(threads=2)
    assert warning and "3.5" in warning and "--threads 1" in warning
    assert "2 threads, load 3.5 on 2 cores" == hardware.threads_line(2)
    assert "--threads" not in hardware.busy_warning(threads=1)  # already the fewest: no advice to repeat
    monkeypatch.setattr(hardware, "load_average", lambda: 0.2)
    assert hardware.busy_warning(threads=2) is None and hardware.busy_warning(threads=1) is None


def test_bandwidth_is_measured_once_per_machine_and_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setattr(hardware, "_BANDWIDTH", {})
    monkeypatch.setattr(hardware, "probe_bandwidth", lambda device, budget_s=0.5: 12.5e9)
    assert hardware.bandwidth("cpu") == 12.5e9
    assert (tmp_path / "hardware.json").exists()
    monkeypatch.setattr(hardware, "_BANDWIDTH", {})  # a new process on the same machine: no probe this time

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again")

    monkeypatch.setattr(hardware, "probe_bandwidth", no_probe)
    assert hardware.bandwidth("cpu") == pytest.approx(12.5e9)


def test_bandwidth_with_an_unwritable_cache_still_works(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("MINILLM_CACHE", str(blocker / "sub"))  # can never be created
    monkeypatch.setattr(hardware, "_BANDWIDTH", {})
    monkeypatch.setattr(hardware, "probe_bandwidth", lambda device, budget_s=0.5: 3e9)
    assert hardware.bandwidth("cpu") == 3e9


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_hardware_info_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA"):
        hardware_info("cuda")


# ------------------------------------------------------------------------------------------------- results

FAKE_HW = {"device": "cpu", "cpu": "test cpu", "gpu": None, "threads": 1, "torch": torch.__version__,
           "python": "3", "platform": "test", "bandwidth_GBps": 10.0, "flops_float32": 1e11, "flops_bfloat16": None}


def _result(**kw) -> BenchResult:
    base = {"name": "unit", "rows": [{"method": "slow", "ms": 10.0, "n": 1}, {"method": "fast-one", "ms": 2.5, "n": 2}],
            "ratios": {"speedup": 4.0, "saving": 0.5, "info_only": 1.0},
            "targets": {"speedup": (">=", 3.0), "saving": ("<=", 0.25)}, "settings": {"device": "cpu"},
            "notes": ["a note"], "hardware": dict(FAKE_HW)}
    base.update(kw)
    return BenchResult(**base)


def test_print_table_aligns_rows_and_reports_targets(capsys):
    r = _result()
    r.print_table()
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("method"))
    assert header.split() == ["method", "ms", "n"]
    slow, fast = (next(line for line in lines if line.startswith(m)) for m in ("slow", "fast-one"))
    assert len(slow) == len(fast) and slow.index("10") < fast.index("2.5") + 3  # right-aligned numbers
    assert "speedup" in out and ">= 3" in out
    assert next(line for line in lines if "speedup" in line).rstrip().endswith("PASS")
    assert next(line for line in lines if "saving" in line).rstrip().endswith("MISS")
    assert "no target" in next(line for line in lines if "info_only" in line)
    assert "a note" in out
    assert r.status() == {"speedup": "PASS", "saving": "MISS", "info_only": "-"} and not r.passed


def test_save_writes_json_with_hardware_versions_and_flags(tmp_path):
    r = _result(quick=True)
    path = r.save(tmp_path / "res")
    assert path == tmp_path / "res" / "quick" / "unit.json"  # quick runs go aside, never over full results
    data = json.loads(path.read_text())
    assert data["name"] == "unit" and data["quick"] is True
    assert data["hardware"]["cpu"] == "test cpu" and data["hardware"]["bandwidth_GBps"] == 10.0
    assert data["versions"]["torch"] == torch.__version__ and "python" in data["versions"]
    assert data["timestamp"][:2] == "20"
    assert data["rows"][1] == {"method": "fast-one", "ms": 2.5, "n": 2}
    assert data["ratios"]["speedup"] == 4.0 and data["targets"]["speedup"] == [">=", 3.0]
    assert data["status"]["saving"] == "MISS"


def test_plot_saves_png_next_to_json(tmp_path):
    r = _result(rows=[{"len": n, "ms": n * 0.5, "kind": k} for n in (1, 2, 4) for k in ("a", "b")])
    r.save(tmp_path)
    fig = r.plot("len", "ms", series="kind", logy=True)
    assert (tmp_path / "unit.png").stat().st_size > 1000
    assert len(fig.axes[0].lines) == 2
    with pytest.raises(ValueError, match="no row has"):
        r.plot("len", "missing_column", path=tmp_path / "x.png")


@pytest.mark.parametrize("targets, match", [({"nope": (">=", 1.0)}, "not reported"),
                                            ({"speedup": ("=>", 1.0)}, "op in")])
def test_bad_targets_are_rejected(targets, match):
    with pytest.raises(ValueError, match=match):
        _result(targets=targets)


# --------------------------------------------------------------------------------------------------- metrics


def test_decode_bytes_per_token_counts_tied_weights_once_plus_kv():
    cfg = ModelConfig.tiny()
    model = Transformer(cfg)
    assert model.lm_head.weight is model.embed.weight
    kv_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # fp32
    assert decode_bytes_per_token(model, 0) == cfg.n_params() * 4
    assert decode_bytes_per_token(model, 100) == cfg.n_params() * 4 + 100 * kv_per_token
    # a batch shares one read of the weights; every sequence reads its own cache
    assert decode_bytes_per_token(model, 100, batch=4) == (cfg.n_params() * 4 + 4 * 100 * kv_per_token) // 4
    assert decode_bytes_per_token(model.to(torch.bfloat16), 0) == cfg.n_params() * 2


def test_utilisation_formulas():
    assert mbu(bytes_per_token=1e9, seconds_per_token=0.1, bandwidth=20e9) == pytest.approx(0.5)
    assert mfu(flops=1e12, seconds=2.0, peak=1e12) == pytest.approx(0.5)


def test_flops_formulas():
    cfg = ModelConfig.tiny()
    attn_per_key = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim
    assert model_flops_per_token(cfg, 0) == 2 * cfg.n_params()  # tied head: the embedding matmul counted once
    assert model_flops_per_token(cfg, 10) == 2 * cfg.n_params() + 10 * attn_per_key
    # prefill = sum of per-token costs, token i seeing i + 1 keys
    assert prefill_flops(cfg, 5) == sum(model_flops_per_token(cfg, i + 1) for i in range(5))
    head = 2 * cfg.vocab_size * cfg.dim
    assert prefill_flops(cfg, 5, logits_for=1) == prefill_flops(cfg, 5) - 4 * head  # LM head on the last row only
    # untied model: the input embedding is a lookup, not a matmul
    assert model_flops_per_token(LLAMA2_7B, 0) == 2 * (LLAMA2_7B.n_params() - 32000 * 4096)


def test_peak_memory_is_at_least_a_live_tensor():
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert peak_memory("cpu") >= x.numel()


# ---------------------------------------------------------------------------------------------------- entries


def test_entries_are_registered():
    for name in ("decode", "kv-cache", "gqa", "attention", "paged", "batching"):
        assert name in bench.ENTRIES and ":" in bench.ENTRIES[name]


def test_run_entry_unknown_name_lists_entries():
    with pytest.raises(ValueError, match="unknown benchmark 'nope'.*decode"):
        bench.run_entry("nope")


def test_run_entry_missing_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(bench.ENTRIES, "ghost", "minillm.bench.no_such_module:run")
    with pytest.raises(ValueError, match="does not exist yet"):
        bench.run_entry("ghost")


def _fake_run(quick: bool = False) -> BenchResult:
    return _result(name="fake", settings={"device": "cpu", "quick_arg": quick})


def test_run_entry_prints_and_saves(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(bench.ENTRIES, "fake", f"{__name__}:_fake_run")
    result = bench.run_entry("fake", quick=False, out=tmp_path)
    assert not result.quick and result.settings["quick_arg"] is False
    out = capsys.readouterr().out
    assert "PASS" in out and re.search(r"\d+ threads?, load", out)
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["quick"] is False and data["threads"] >= 1 and "load_avg_end" in data
    bench.run_entry("fake", save=False, out=tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_quick_results_never_replace_full_ones(monkeypatch, tmp_path):
    monkeypatch.setitem(bench.ENTRIES, "fake", f"{__name__}:_fake_run")
    monkeypatch.chdir(tmp_path)  # `minillm bench` writes to ./results, as in a checkout
    full = tmp_path / "results" / "fake.json"
    full.parent.mkdir()
    full.write_text('{"committed": true}')
    from minillm.cli import main

    threads = torch.get_num_threads()
    try:
        assert main(["bench", "fake", "--quick", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert json.loads(full.read_text()) == {"committed": True}
    assert json.loads((tmp_path / "results" / "quick" / "fake.json").read_text())["quick"] is True


class _IdsTokenizer:
    """Just what generate() needs when given token ids and no streaming."""

    stop_ids = frozenset({2})

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_decode_entry_quick_on_a_tiny_model(monkeypatch):
    import minillm.api

    def tiny_load_model(name, dtype="float32", device="cpu", attn_backend="sdpa"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig.tiny()).eval().requires_grad_(False)
        model.load_seconds = 0.01
        return model, _IdsTokenizer()

    monkeypatch.setattr(minillm.api, "load_model", tiny_load_model)
    result = bench.load_entry("decode")(quick=True)
    assert result.name == "decode"
    phases = {(r["dtype"], r["phase"]) for r in result.rows}
    assert {("float32", "load"), ("float32", "prefill"), ("float32", "decode"), ("float32", "decode, no cache"),
            ("bfloat16", "prefill"), ("bfloat16", "decode")} <= phases
    for r in result.rows:
        if r["phase"] == "decode":
            assert r["tokens_per_s"] > 0 and 0 < r["MBU"]
        if r["phase"] == "prefill":
            assert r["tokens_per_s"] > 0
            # MFU needs a compute roof; emulated bf16 has none
            if r["dtype"] == "float32" or hardware.native_bf16("cpu"):
                assert 0 < r["MFU"]
            else:
                assert r["MFU"] is None and any("emulat" in n for n in result.notes)
    assert set(result.targets) <= set(result.ratios)
    assert {"prefill_vs_decode_tokens_per_s", "bf16_vs_fp32_decode_speedup",
            "cached_vs_nocache_decode_speedup", "decode_mbu_float32"} <= set(result.ratios)


@pytest.mark.slow
def test_decode_entry_quick_on_the_real_model(tmp_path):
    result = bench.run_entry("decode", quick=True, out=tmp_path)
    data = json.loads((tmp_path / "quick" / "decode.json").read_text())
    assert data["quick"] and data["settings"]["model"] == "smollm2-135m"
    assert result.ratios["cached_vs_nocache_decode_speedup"] > 1


def test_cast_model_keeps_rope_tables_float32():
    from minillm.bench.decode import cast_model

    model = Transformer(ModelConfig.tiny())
    cast = cast_model(model, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert cast.rope_cos.dtype == torch.float32 and torch.equal(cast.rope_cos, model.rope_cos)
    assert cast.lm_head.weight is cast.embed.weight



def test_disagg_parts_are_checked_before_anything_runs():
    from minillm.bench import disagg

    assert set(disagg.PARTS) == {"pd", "routing", "cascade"}
    for bad in (("routng",), ()):
        with pytest.raises(ValueError, match="choose from"):
            disagg.run(quick=True, parts=bad)
    for module in disagg.PARTS.values():  # each part exists and has the contract the combiner calls
        import importlib
        import inspect

        assert list(inspect.signature(importlib.import_module(module).measure).parameters)[:2] == ["quick", "threads"]


# ------------------------------------------------------------------------------------------- the roofline model


def test_roofline_adds_the_op_cost_on_a_cpu_and_overlaps_it_on_a_gpu():
    """A CPU dispatches and computes on the same core (the op cost adds); a GPU runs kernels while the next launches
    queue (the largest term sets the time)."""
    import dataclasses

    from minillm.measure.roofline import Machine, Step

    cpu = Machine("test cpu", bandwidth=1e10, flops=1e11, op_seconds=1e-6, bytes_per_weight=4, overlaps_ops=False,
                  source="made up")
    gpu = dataclasses.replace(cpu, overlaps_ops=True)
    step = Step(bytes=1e8, flops=5e8, ops=2000)  # 10 ms of bytes, 5 ms of FLOPs, 2 ms of ops
    assert cpu.seconds(step) == pytest.approx(0.012) and cpu.bound(step) == "memory"
    assert gpu.seconds(step) == pytest.approx(0.010)
    launches = Step(bytes=1e6, flops=1e6, ops=20_000)  # 20 ms of launches, next to almost no work
    assert gpu.seconds(launches) == pytest.approx(0.020) and gpu.bound(launches) == "ops"


def test_forward_step_reads_the_weights_once_and_does_the_flops_per_token():
    from minillm.measure.roofline import H100_SXM, forward_step

    cfg = ModelConfig()  # SmolLM2-135M: the LM head is the embedding, read whole
    one, eight = forward_step(cfg, H100_SXM, tokens=1), forward_step(cfg, H100_SXM, tokens=8)
    assert one.bytes == eight.bytes == cfg.n_params() * 2  # bf16, no context: the weights only
    assert one.flops == model_flops_per_token(cfg, 0) and eight.flops == pytest.approx(8 * one.flops)
    assert forward_step(cfg, H100_SXM, weight_scale=0.5).bytes == pytest.approx(one.bytes / 2)
    untied = forward_step(LLAMA2_7B, H100_SXM)  # an untied embedding is looked up, not read
    assert untied.bytes == (LLAMA2_7B.n_params() - LLAMA2_7B.vocab_size * LLAMA2_7B.dim) * 2
    with_kv = forward_step(cfg, H100_SXM, context=100, batch=2)
    assert with_kv.bytes - one.bytes == 2 * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 100 * 2


def test_packed_3bit_bytes_counts_the_codes_and_group_scales_of_the_block_matrices():
    from minillm.bench.quant import packed_3bit_bytes

    model = Transformer(ModelConfig.tiny())
    blocks = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head)
    others = sum(p.numel() for p in model.parameters()) - blocks
    assert packed_3bit_bytes(model, group_size=64) == round(blocks * (3 + 32 / 64) / 8 + others * 2)


# ------------------------------------------------------------------------------------ the capstone: ladder, edge


@pytest.fixture(scope="module")
def real_tokenizer():
    from minillm.gguf.tokenizer import Tokenizer
    from minillm.gguf.weights import gguf_path, read_gguf_metadata

    return Tokenizer.from_gguf_metadata(read_gguf_metadata(gguf_path()))


def test_ladder_workload_is_seeded_chats_over_two_system_prompts_and_long_documents(real_tokenizer):
    from minillm.bench.ladder import ladder_workload

    args = (real_tokenizer, 6, 2, 48, 300, 8, 4.0)
    reqs, kinds = ladder_workload(*args)
    again, kinds_again = ladder_workload(*args)
    assert [(r.prompt_ids, r.max_tokens, r.arrival_time) for r in reqs] == \
        [(r.prompt_ids, r.max_tokens, r.arrival_time) for r in again] and kinds == kinds_again
    assert sorted(kinds) == ["chat"] * 6 + ["doc"] * 2 and all(r.max_tokens == 8 for r in reqs)
    times = [r.arrival_time for r in reqs]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0  # Poisson gaps, the first at t=0
    chats = [r.prompt_ids for r, k in zip(reqs, kinds) if k == "chat"]
    docs = [r.prompt_ids for r, k in zip(reqs, kinds) if k == "doc"]
    assert min(map(len, docs)) > max(map(len, chats)) and min(map(len, docs)) >= 300
    prefixes = {tuple(c[:40]) for c in chats}  # the shared system prompt opens every chat: two of them
    assert len(prefixes) == 2
    assert ladder_workload(*args, seed=1)[0][-1].arrival_time != reqs[-1].arrival_time


def test_waterfall_chains_rung0_through_the_subset_and_interference_compares_with_the_product():
    from minillm.bench.ladder_gains import interference, waterfall

    # rungs 1..3 at 10, 30, 45 tok/s; rung 0 ran 2 tok/s on a subset where rung 1 ran 8 tok/s: rung 1 is 4x rung 0
    steps = waterfall([10.0, 30.0, 45.0], 2.0, rung1_subset=8.0)
    assert steps == [pytest.approx((4.0, 4.0)), pytest.approx((12.0, 3.0)), pytest.approx((18.0, 1.5))]
    assert waterfall([10.0, 20.0], 5.0) == [pytest.approx((2.0, 2.0)), pytest.approx((4.0, 2.0))]
    p = interference(10.0, 20.0, 15.0, 24.0)  # A doubles, B x1.5, together x2.4 where the product says x3
    assert p["gain_a"] == 2.0 and p["gain_b"] == 1.5 and p["product"] == 3.0 and p["interference"] == pytest.approx(0.8)


def test_interference_pairs_explain_themselves_from_the_logged_runs():
    """Full mode only reaches this after ~10 minutes of serving: check its bookkeeping on made-up runs."""
    from minillm.bench.ladder_gains import interference_pairs
    from minillm.speculative.decoding import SpecStats

    def run(tok_per_s, prefill=100, steps=4, width=4.0, accepted=0):
        spec = SpecStats()
        spec.record(3, accepted, accepted + 1)
        log = [{"num_prefill_tokens": prefill, "num_decodes": 0, "num_seqs": 1, "num_tokens": prefill}] + \
              [{"num_prefill_tokens": 0, "num_decodes": 4, "num_seqs": 4, "num_tokens": width}] * (steps - 1)
        return {"tok_per_s": tok_per_s, "steps": log, "spec": spec, "hit_rate": 0.5}

    runs = {"2": run(10.0), "2 + q4 weights": run(20.0), "2 + int8 KV": run(11.0),
            "2 + q4 weights + int8 KV": run(24.0), "2 + prefix caching": run(12.0, prefill=50),
            "2 + chunked prefill": run(9.0, steps=6), "2 + prefix caching + chunked prefill": run(11.0, 50, 5),
            "2 at max_num_seqs 1": run(4.0, width=1.0), "2 at max_num_seqs 1 + speculation": run(6.0, 100, 4, 4.0, 2),
            "2 + speculation": run(9.0, 100, 4, 16.0, 1)}
    by = {"2": {"weights_MiB": 513.0}, "4": {"weights_MiB": 92.0}}
    pairs = interference_pairs(runs, mean_ctx=300.0, kv_per_token_fp32=46_080, by=by, budget=128)
    assert pairs["q4_weights_x_int8_kv"]["interference"] == pytest.approx(24 / 10 / (2.0 * 1.1))
    assert pairs["prefix_caching_x_chunked_prefill"]["interference"] == pytest.approx(1.1 / (1.2 * 0.9))
    spec = pairs["speculation_x_batching"]  # over max_num_seqs 1: batching x2.5, speculation x1.5, both x2.25
    assert spec["gain_a"] == 2.5 and spec["gain_b"] == 1.5 and spec["interference"] == pytest.approx(0.6)
    assert "less than the product" in spec["why"] and "1.0 -> 4.0 alone, 4.0 -> 16.0 in the batch" in spec["why"]
    assert "more than the product" in pairs["q4_weights_x_int8_kv"]["why"]


def test_one_at_a_time_serving_replays_arrivals_and_counts_ttft_from_arrival(monkeypatch):
    from minillm.bench.ladder import serve_one_at_a_time
    from minillm.bench.ladder_gains import agreement
    from minillm.measure.workload import Request

    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny()).eval().requires_grad_(False)
    reqs = [Request([5, 6, 7], 4, 0.0), Request([8, 9], 3, 0.0), Request([10, 11, 12], 2, 0.3)]
    outs, wall = serve_one_at_a_time(model, reqs, "contiguous")
    assert [len(o.token_ids) for o in outs] == [4, 3, 2] and wall >= 0.3  # the last one waited for its arrival
    m0, m1 = outs[0].metrics, outs[1].metrics
    assert m1["ttft"] >= m0["e2e"]  # FIFO: the second request queued behind the whole first one
    assert outs[2].token_times[0] == pytest.approx(outs[2].metrics["ttft"]) and len(m0["itl"]) == 3
    none, _ = serve_one_at_a_time(model, reqs, "none")  # lesson 00's loop: the same greedy tokens
    assert agreement(none, outs) == 1.0
    assert agreement([type(outs[0])("0", [], [1, 2, 3, 4], "", None)], outs[:1]) == 0.0


def test_edge_child_output_is_parsed_from_its_last_result_line():
    from minillm.bench.edge import MARK, parse_child_output, profile_row

    res = {"load_s": 1.0, "ready_s": 3.0, "peak_rss": 512 * 2**20, "loaded_rss": 500 * 2**20, "rss": 400 * 2**20,
           "trimmed_rss": None, "ru_maxrss": 900 * 2**20, "weights_bytes": 92 * 2**20, "kv_bytes": 2**20,
           "token_ids": [1, 2, 3, 9, 5], "token_times": [0.5, 0.6, 0.7, 0.8, 0.9], "forced_ids": [1, 2, 3, 4, 9]}
    noise = f"a warning\n{MARK}{{\"old\": 1}}\n{MARK}" + json.dumps(res) + "\ntrailing text\n"
    assert parse_child_output(noise) == res
    with pytest.raises(ValueError, match="no EDGE_RESULT"):
        parse_child_output("Illegal instruction\n")
    row = profile_row("edge", "q4", res, reference=[1, 2, 3, 4, 5])
    assert row["peak_rss_MiB"] == 512 and row["trimmed_rss_MiB"] is None and row["kv_MiB"] == 1
    assert row["ttft_ms"] == pytest.approx(500) and row["decode_tok_s"] == pytest.approx(10)
    assert row["agree_fp32"] == 0.8 and row["first_diff"] == 3 and row["forced_agree_fp32"] == 0.8


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM is Linux's")
def test_edge_child_measures_its_own_peak_not_the_parents():
    """Linux keeps ru_maxrss across fork + exec: a child of a big process reports the parent's peak there. The edge
    bench reads the child's own VmHWM instead."""
    from minillm.bench.edge import run_child

    ballast = torch.ones(512 << 20, dtype=torch.uint8)  # this process: at least 512 MiB resident
    res, why = run_child({"kind": "torch", "threads": 1, "reference_ids": None}, timeout=120)
    assert why is None, why
    assert res["ru_maxrss"] >= ballast.numel() > res["peak_rss"] > 0


@pytest.mark.slow
def test_ladder_and_edge_quick_on_the_real_model(tmp_path):
    result = bench.run_entry("ladder", quick=True, out=tmp_path)
    rungs = {r["rung"]: r for r in result.rows}
    assert {"0", "1", "2", "3", "4", "5", "6", "7", "8", "q4 serial"} <= set(rungs)
    assert rungs["0"]["agree_fp32"] == 1.0 and rungs["2"]["agree_fp32"] == 1.0  # float32: the same greedy tokens
    assert rungs["5"]["kv_MiB"] < rungs["4"]["kv_MiB"] and rungs["4"]["weights_MiB"] < rungs["3"]["weights_MiB"] / 4
    assert rungs["8"]["gain_vs_rung0"] == pytest.approx(result.ratios["all_on_vs_no_cache"])
    data = json.loads((tmp_path / "quick" / "ladder.json").read_text())
    assert data["series"]["waterfall"]["8"]["tok_per_s"] == rungs["8"]["tok_per_s"]
    edge = bench.run_entry("edge", quick=True, out=tmp_path)
    rows = {r["profile"]: r for r in edge.rows}
    assert rows["edge"]["weights_MiB"] < rows["fp32 default"]["weights_MiB"] / 4
    assert rows["edge"]["peak_rss_MiB"] < rows["fp32 default"]["peak_rss_MiB"]


def test_median_run_keeps_the_median_headline_and_the_spread_of_every_ratio():
    from minillm.bench import median_run

    runs = [BenchResult(name="x", rows=[{"run": i}], ratios={"speedup": s, "other": o},
                        targets={"speedup": (">=", 1.0)})
            for i, (s, o) in enumerate([(1.5, 9.0), (1.1, float("nan")), (1.3, 7.0)])]
    chosen = median_run(runs)
    assert chosen.rows == [{"run": 2}]  # the median of 1.5, 1.1, 1.3 is the third run
    assert chosen.spread["speedup"] == {"min": 1.1, "median": 1.3, "max": 1.5, "runs": [1.5, 1.1, 1.3]}
    assert chosen.spread["other"]["min"] == 7.0 and chosen.spread["other"]["max"] == 9.0  # NaN left out of the spread
    assert "spread" in chosen.to_dict()


def test_median_run_skips_a_check_every_run_passes_alike():
    from minillm.bench import median_key, median_run

    runs = [BenchResult(name="x", rows=[{"run": i}], ratios={"identical": 1.0, "speedup": s, "other": o},
                        targets={"identical": (">=", 1.0), "speedup": (">=", 1.3), "other": (">=", 0.9)})
            for i, (s, o) in enumerate([(1.35, 1.0), (1.29, 2.0), (1.31, 0.5)])]
    assert median_key(runs) == "speedup" and median_run(runs).rows == [{"run": 2}]
    # the kept run's other = 0.5 misses, but the claim is its median over the runs, 1.0
    assert median_run(runs).status()["other"] == "PASS"
    runs[0].ratios["identical"] = 0.0  # once it differs, the headline picks again
    assert median_key(runs) == "identical"


def test_run_entry_refuses_zero_runs():
    from minillm.bench import run_entry

    with pytest.raises(ValueError, match="runs must be >= 1"):
        run_entry("decode", runs=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quant", "sparsity", "distill", "speculative", "cascade", "drafter-domains"])
def test_quick_runs_the_lessons_read_recorded(name, tmp_path):
    """Lessons 07, 08, 09, 10 and 13 show these benches' recorded full runs in quick mode too (their quick runs alone
    took 20-60 s of each CI run): the quick runs still run here, and give rows."""
    result = bench.run_entry(name, quick=True, out=tmp_path)
    assert result.quick and result.rows


def test_the_speculative_loop_clock_splits_a_run_into_forwards_and_the_rest():
    """bench speculative times each target forward inside a generate() (forward_clock) and reads lesson 10's rule
    off the loop's own costs (_in_loop): checked on a tiny model and on made-up seconds."""
    from tests.conftest import tiny_model
    from minillm.bench.speculative import _in_loop, forward_clock
    from minillm.kv_cache import KVCache
    from minillm.speculative.decoding import SpecStats

    model = tiny_model(0)
    cache = KVCache.for_model(model, 1, 16)
    with torch.inference_mode(), forward_clock(model) as calls:
        model(torch.tensor([[1, 2, 3, 4]]), kv_cache=cache)
        model(input_ids=torch.tensor([[5, 6]]), kv_cache=cache)
    assert [q for q, _ in calls] == [4, 2] and all(dt > 0 for _, dt in calls)
    with torch.inference_mode():
        model(torch.tensor([[7]]), kv_cache=cache)
    assert len(calls) == 2  # the hooks are gone after the block

    stats = SpecStats()
    for _ in range(10):
        stats.record(2, 1, 2)  # 2 tokens a step
    # decode steps of 10 ms (20 of them), a token's other work 1 ms; verify steps of 12 ms, 3 ms of drafting each
    loop = {"decode_s": 0.2, "decode_n": 20, "base_rest_s": 0.02, "verify_s": 0.12, "rest_s": 0.03}
    got = _in_loop(loop, stats)
    assert got["loop_decode_ms"] == pytest.approx(10.0) and got["loop_v"] == pytest.approx(1.2)
    assert got["loop_rest"] == pytest.approx(0.3) and got["loop_base_rest"] == pytest.approx(0.1)
    # a target-only token costs 1 + 0.1 decode steps, a speculative step 1.2 + 0.3 for 2 tokens
    assert got["loop_predicted_speedup"] == pytest.approx(2 * 1.1 / 1.5)
    assert "loop_head" not in got  # no draft head timed: no head terms
    got = _in_loop(loop | {"head_s": 0.01, "head_n": 20}, stats)  # 20 guesses of 0.5 ms, 1 ms a step
    assert got["loop_head"] == pytest.approx(0.1) and got["loop_head_ms"] == pytest.approx(0.5)
    assert got["loop_guesses_per_step"] == pytest.approx(2.0)
    assert _in_loop(loop, SpecStats()) == {}


def test_bench_speculative_names_its_targets_when_given_another():
    """--target takes float32, q4-native or float32-native; anything else is refused with the list, before any
    model loads."""
    from minillm.bench.speculative import TARGETS, run

    assert set(TARGETS) == {"float32", "q4-native", "float32-native"}
    with pytest.raises(ValueError, match="target must be one of .*float32-native"):
        run(quick=True, target="bf16-native")

"""Workload generation (minillm/measure/workload.py) and serving metrics (minillm/measure/metrics.py), checked
against numpy and hand counts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from minillm.measure import workload as wl
from minillm.measure.metrics import percentiles, summarize
class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode())


@pytest.fixture(autouse=True)
def fresh_corpus(monkeypatch):
    monkeypatch.setattr(wl, "_CORPUS", None)


@pytest.mark.parametrize("dist", wl.DISTRIBUTIONS)
def test_lengths_stay_in_range_and_long_tails_are_skewed(dist):
    rng = random.Random(0)
    xs = [wl.draw_length(rng, dist, 8, 256) for _ in range(4000)]
    assert min(xs) >= 8 and max(xs) <= 256
    if dist != "uniform":  # long-tailed: the mean sits well above the median
        assert np.mean(xs) > 1.2 * np.median(xs)
    with pytest.raises(ValueError, match="unknown length distribution"):
        wl.draw_length(rng, "zipf", 1, 2)


def test_make_workload_is_seeded_and_uses_real_text():
    tok = ByteTokenizer()
    a = wl.make_workload(tok, 20, prompt_len=(5, 9), output_len=(3, 7), seed=1)
    b = wl.make_workload(tok, 20, prompt_len=(5, 9), output_len=(3, 7), seed=1)
    assert [(r.prompt_ids, r.max_tokens) for r in a] == [(r.prompt_ids, r.max_tokens) for r in b]
    assert all(5 <= len(r.prompt_ids) <= 9 and 3 <= r.max_tokens <= 7 and r.arrival_time == 0 for r in a)
    assert bytes(a[0].prompt_ids).decode(errors="replace").isprintable() or b"\n" in bytes(a[0].prompt_ids)
    p = wl.make_workload(tok, 200, arrival="poisson", rate=10.0, seed=2)
    times = [r.arrival_time for r in p]
    assert times == sorted(times) and 10 < times[-1] < 30  # ~200 / 10 s
    with pytest.raises(ValueError, match="rate"):
        wl.make_workload(tok, 2, arrival="poisson")
    assert a[0].params().ignore_eos and a[0].params().max_tokens == a[0].max_tokens


def test_summarize_percentiles_and_goodput():
    rng = np.random.default_rng(0)
    outs = []
    for i in range(50):
        ttft, n = float(rng.uniform(0, 2)), int(rng.integers(1, 6))
        itl = [float(x) for x in rng.uniform(0.01, 0.5, n - 1)]
        tpot = sum(itl) / len(itl) if itl else float("nan")
        outs.append(SimpleNamespace(token_ids=[0] * n, metrics={"ttft": ttft, "tpot": tpot, "itl": itl,
                                                                 "e2e": ttft + sum(itl)}))
    s = summarize(outs, wall_s=10.0, slo_ttft_s=1.0, slo_tpot_s=0.3)
    ttfts = [o.metrics["ttft"] for o in outs]
    assert s["ttft_p90"] == pytest.approx(np.percentile(ttfts, 90))
    assert s["output_tokens"] == sum(len(o.token_ids) for o in outs)
    assert s["output_tok_per_s"] == pytest.approx(s["output_tokens"] / 10)
    ok = sum(o.metrics["ttft"] <= 1.0 and not o.metrics["tpot"] > 0.3 for o in outs)
    assert s["goodput_req_per_s"] == pytest.approx(ok / 10) and 0 < ok < 50
    t, occ = wl.occupancy_timeline([{"t_start": 5.0, "occupancy": 0.5}, {"t_start": 5.5, "occupancy": 1.0}])
    assert t == [0.0, 0.5] and occ == [0.5, 1.0]


def test_percentiles_interpolate_linearly_between_ranks():
    """One rule for every bench: p sits at rank p/100 * (n - 1) of the sorted values, interpolated."""
    assert percentiles([4.0, 1.0, 3.0, 2.0], (0, 50, 90, 100)) == pytest.approx(
        {"p0": 1.0, "p50": 2.5, "p90": 3.7, "p100": 4.0})  # rank 2.7 of 4: 3 + 0.7 x (4 - 3)
    assert percentiles([1.0, float("nan"), 3.0], (50,)) == {"p50": 2.0}  # NaN (a one-token TPOT) dropped
    assert all(np.isnan(v) for v in percentiles([float("nan")]).values())


def test_summarize_counts_what_a_client_saw():
    """A client that saw usage counts, not ids: output_tokens given; slo_attained over every request sent."""
    m = {"ttft": 0.5, "tpot": 0.1, "itl": [0.1], "e2e": 0.6}
    done = [SimpleNamespace(metrics=m), SimpleNamespace(metrics={**m, "ttft": 3.0})]
    s = summarize(done, 2.0, slo_ttft_s=1.0, slo_tpot_s=0.5, output_tokens=10, sent=4)
    assert (s["requests"], s["output_tokens"]) == (2, 10)
    assert (s["output_tok_per_s"], s["requests_per_s"]) == (5.0, 1.0)
    assert (s["goodput_req_per_s"], s["slo_attained"]) == (0.5, 0.25)
    assert "goodput_req_per_s" not in summarize(done, 2.0, output_tokens=10)  # no SLO, no goodput

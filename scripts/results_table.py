"""Rewrite the README's results table from results/*.json (written by `minillm bench NAME`).

    python scripts/results_table.py          # updates README.md between the results markers
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from minillm.measure.harness import check_target

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["decode", "kv-cache", "gqa", "attention", "paged", "batching", "fusion", "quant", "lowbit", "sparsity",
         "pruning", "codebook", "distill", "speculative", "speculative-q4-native", "speculative-float32-native",
         "drafter-domains", "parallel", "prefix-cache", "chunked-prefill", "serve", "disagg", "cascade", "http-router"]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def table() -> str:
    lines = ["| benchmark | measure | value | target | met | hardware |", "|---|---|---|---|---|---|"]
    runs = [json.loads(p.read_text()) for p in (ROOT / "results").glob("*.json")]
    found = {r["name"]: r for r in runs if "name" in r}  # a bench's result; a recipe's own report has no name
    for name in ORDER + sorted(set(found) - set(ORDER)):
        r = found.get(name)
        if r is None or r.get("quick"):
            continue
        hw = r.get("hardware", {})
        where = hw.get("gpu") or f"{hw.get('cpu', '?')}, {hw.get('threads', '?')} threads"
        if not hw.get("gpu") and hw.get("native_bf16") is not None:  # machines of one kind differ in bf16 support
            where += ", native bf16" if hw["native_bf16"] else f", {hw.get('cpu_capability', '')} (bf16 emulated)"
        targets = r.get("targets", {})
        for key, value in r.get("ratios", {}).items():
            t = targets.get(key)
            target = f"{t[0]} {_fmt(t[1])}" if t else ""
            met = {"PASS": "yes", "MISS": "**no**"}.get(r.get("status", {}).get(key, ""), "")
            spread = r.get("spread", {}).get(key)
            if spread:  # a --runs N record: its claim is the median over the runs (its rows are one run's), as
                value = spread["median"]  # BenchResult.status judges it; records saved before it did are re-judged
                if t:
                    met = "yes" if check_target(value, t) else "**no**"
            shown = _fmt(value) + (f" (median; {_fmt(spread['min'])}-{_fmt(spread['max'])} over "
                                   f"{len(spread['runs'])} runs)" if spread else "")
            lines.append(f"| `minillm bench {name}` | {key} | {shown} | {target} | {met} | {where} |")
    return "\n".join(lines)


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = re.sub(f"{re.escape(BEGIN)}.*?{re.escape(END)}", f"{BEGIN}\n{table()}\n{END}", text, flags=re.DOTALL)
    readme.write_text(new)
    print(table())


if __name__ == "__main__":
    main()

"""GPU check of lesson 08: fp16 dense vs 2:4 semi-structured sparse linear (torch's to_sparse_semi_structured).

    python scripts/gpu_check_sparsity.py          # writes $OUT/sparsity.json (default results/gpu/sparsity.json)

For SmolLM2-135M's linear shapes and M = 1, 16, 256, 2048, 8192 tokens: the median time of one call
(triton.testing.do_bench) and the speedup of the sparse layer; the lesson's target is >= 1.2x at prefill sizes.
Sparse tensor cores need compute capability 8.0+ (Ampere, Hopper). Without CUDA it writes a 'skipped' report.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def main() -> None:
    out = Path(os.environ.get("OUT", ROOT / "results" / "gpu"))
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        report = {"skipped": "no CUDA device"}
    else:
        from minillm.bench.sparsity import gpu_semi_structured

        try:
            rows, ratios = gpu_semi_structured(quick=False)
            report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                      "ratios": ratios}
            for r in rows:
                print(f"{r['variant']:<28} dense {r['dense_ms'] * 1e3:8.1f} us  2:4 {r['sparse_ms'] * 1e3:8.1f} us  "
                      f"{r['speedup']:.2f}x")
            print(ratios)
        except Exception:  # the report says what failed; the rest of gpu_check.sh still runs
            report = {"error": traceback.format_exc()}
            print(report["error"])
    (out / "sparsity.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

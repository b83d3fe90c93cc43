#!/usr/bin/env bash
# One prepared run for a GPU machine (the device tool, or your own CUDA box): CUDA/Triton-native tests and the GPU
# benchmarks, results under $OUT (default results/gpu). The device machine has torch, triton, transformers, einops
# and tiktoken preinstalled but no network: the model weights travel in the working tree's cache folder if needed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/test_triton_flash.py tests/test_triton_paged.py tests/test_triton_quant.py tests/test_sparsity.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 5
python3 scripts/gpu_check_flash.py 2>&1 | tee "$OUT/flash.log" | tail -n 20
python3 scripts/gpu_check_paged.py 2>&1 | tee "$OUT/paged.log" | tail -n 20
python3 scripts/gpu_check_fusion.py 2>&1 | tee "$OUT/fusion.log" | tail -n 20
python3 scripts/gpu_check_quant.py 2>&1 | tee "$OUT/quant.log" | tail -n 40
python3 scripts/gpu_check_sparsity.py 2>&1 | tee "$OUT/sparsity.log" | tail -n 30
python3 scripts/gpu_check_speculative.py 2>&1 | tee "$OUT/speculative.log" | tail -n 40
ls -la "$OUT"

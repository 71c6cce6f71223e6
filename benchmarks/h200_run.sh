#!/usr/bin/env bash
# The GPU run behind benchmarks/results/: the kernel tests on the GPU, then `flashmax bench`.
# Run from the repository root on a GPU machine without registry access, with the peers' wheels
# in .whl/ (see benchmarks/NOTES.md) and FLASHMAX_COMMIT set to the commit being measured.
# Writes under $OUT: fp32/ (JSON, markdown, plots), bf16/ and rand/ (JSON, markdown): 8 files,
# as many as the device tool brings back (more: archive them, as h200_entmax15_run.sh does).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
FLASHMAX_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    2>&1 | tail -n 3
timeout 330 python3 -m flashmax.bench --dtype fp32 --out "$OUT/fp32" | tail -n 40
timeout 150 python3 -m flashmax.bench --dtype bf16 --impls flashmax torch-sort liger adasplash \
    --out "$OUT/bf16" | tail -n 5
timeout 120 python3 -m flashmax.bench --dist rand --impls flashmax liger adasplash \
    --out "$OUT/rand" | tail -n 5
rm -f "$OUT"/bf16/*.png "$OUT"/rand/*.png

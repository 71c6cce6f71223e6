#!/usr/bin/env bash
# The GPU run for entmax-1.5 and the losses: their tests on the GPU, then `flashmax bench --op
# entmax15` at 2048 tokens (fp32 with every peer, bf16) and on the long rows. Run as
# benchmarks/h200_run.sh is (repository root, peers' wheels in .whl/, FLASHMAX_COMMIT set; on
# an H200 alone, `require_h200.sh`).
# Writes $OUT/entmax15.tgz: fp32/ (JSON, markdown, plots), bf16/ and long-*/ (JSON, markdown),
# in one archive because the device tool brings back at most 8 files from $OUT.
set -uo pipefail
source benchmarks/require_h200.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
out=/tmp/entmax15
FLASHMAX_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/test_entmax.py tests/test_losses.py 2>&1 | tail -n 5
timeout 330 python3 -m flashmax.bench --op entmax15 --dtype fp32 --out "$out/fp32" | tail -n 40
timeout 150 python3 -m flashmax.bench --op entmax15 --dtype bf16 --impls flashmax torch-sort adasplash \
    --out "$out/bf16" | tail -n 20
for shape in "512 131072" "128 262144" "32 1048576"; do
    read -r tokens features <<< "$shape"
    timeout 120 python3 -m flashmax.bench --op entmax15 --dtype fp32 bf16 --tokens "$tokens" \
        --features "$features" --impls flashmax --out "$out/long-$features" | tail -n 12
done
rm -f "$out"/bf16/*.png "$out"/long-*/*.png
tar czf "$OUT/entmax15.tgz" -C "$out" .

#!/usr/bin/env bash
# The GPU run behind benchmarks/results/, in stages that each fit one device call (600 s):
#   benchmarks/h200_run.sh peers   `flashmax bench` fp32 with every peer, then bf16 (~560 s)
#   benchmarks/h200_run.sh rand    the same on uniform rows (`--dist rand`)
#   benchmarks/h200_run.sh tests   the GPU test suite (`gpu_tests.sh`, ~210 s on an H100)
# Run from the repository root on a GPU machine without registry access, with the peers'
# wheels in .whl/ (README, "The benchmark") and FLASHMAX_COMMIT set to the commit being
# measured. The GPU's name comes first, and any GPU but an H200 stops the run
# (`require_h200.sh`). Writes under $OUT at most 8 files a stage, as many as
# the device tool brings back: peers fp32/ (JSON, markdown, plots) and bf16/ (JSON,
# markdown); rand rand/ (JSON, markdown).
set -uo pipefail
stage=${1:-}
[[ $stage =~ ^(peers|rand|tests)$ ]] || { echo "stage: peers, rand or tests" >&2; exit 2; }
source benchmarks/require_h200.sh
if [[ $stage == tests ]]; then
    JOBS=12 bash benchmarks/gpu_tests.sh 330
    exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
case $stage in
    peers)
        timeout 330 python3 -m flashmax.bench --dtype fp32 --out "$OUT/fp32" | tail -n 40
        timeout 230 python3 -m flashmax.bench --dtype bf16 \
            --impls flashmax torch-sort liger adasplash --out "$OUT/bf16" | tail -n 12
        rm -f "$OUT"/bf16/*.png ;;
    rand)
        timeout 300 python3 -m flashmax.bench --dist rand --impls flashmax liger adasplash \
            --out "$OUT/rand" | tail -n 12
        rm -f "$OUT"/rand/*.png ;;
esac

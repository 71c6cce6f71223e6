#!/usr/bin/env bash
# The test suite on the GPU (FLASHMAX_TEST_DEVICE=cuda): one pytest process per test file, at
# most JOBS at once, each keeping to 2 CPU threads, each with its own time limit. Triton's
# compiles and the fp64 oracles are CPU-bound and the machine has 16 cores: in session 34, nine
# files at once, each with torch's default threads, left test_kernels unfinished after 250 s
# (alone: 78 s); in session 37, with JOBS=8, test_kernels ran past 270 s (alone: 116 s), hence
# the default limit of 360 s. The logs come back as one file, $OUT/tests.tar.gz (a call
# returns at most 8 files); each file's summary line and its failures are printed last.
# Usage: JOBS=8 bash benchmarks/gpu_tests.sh [LIMIT_S] [test files...]   (default: every tests/test_*.py)
set -uo pipefail
limit="${1:-360}"; shift || true
files=("$@"); [ ${#files[@]} -gt 0 ] || files=(tests/test_*.py)
logs=$(mktemp -d)
export PYTHONPATH="${PYTHONPATH:-}:$PWD/src" FLASHMAX_TEST_DEVICE=cuda OMP_NUM_THREADS=2
for f in "${files[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-8}" ]; do wait -n; done
    timeout "$limit" python3 -m pytest -q -rf -p no:cacheprovider "$f" >"$logs/$(basename "$f" .py).log" 2>&1 &
done
wait
tar -czf "$OUT/tests.tar.gz" -C "$logs" .
for f in "${files[@]}"; do
    log="$logs/$(basename "$f" .py).log"
    printf '%-24s %s\n' "$(basename "$f" .py)" "$(grep -E '(passed|failed|error)' "$log" | tail -n 1 || true)"
    grep -E '^(FAILED|ERROR) ' "$log" | head -n 5 | sed 's/^/    /'
    [ -n "$(grep -E '(passed|failed)' "$log")" ] || echo "    (no summary: timed out after ${limit}s?)"
done

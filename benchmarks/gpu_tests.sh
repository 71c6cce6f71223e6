#!/usr/bin/env bash
# The test suite on the GPU (FLASHMAX_TEST_DEVICE=cuda): one pytest process per test file, all
# at once (Triton's compiles are CPU-bound and the machine has 16 cores), each with its own time
# limit. Logs go to $OUT/tests/; the summary line of each file is printed last.
# Usage: bash benchmarks/gpu_tests.sh [LIMIT_S] [test files...]   (default: every tests/test_*.py)
set -uo pipefail
limit="${1:-300}"; shift || true
files=("$@"); [ ${#files[@]} -gt 0 ] || files=(tests/test_*.py)
mkdir -p "$OUT/tests"
export PYTHONPATH="${PYTHONPATH:-}:$PWD/src" FLASHMAX_TEST_DEVICE=cuda
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$f" >"$OUT/tests/$name.log" 2>&1 &
done
wait
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    printf '%-24s %s\n' "$name" "$(grep -E '(passed|failed|error)' "$OUT/tests/$name.log" | tail -n 1 || true)"
    [ -n "$(grep -E '(passed|failed)' "$OUT/tests/$name.log")" ] || echo "    (no summary: timed out after ${limit}s?)"
done

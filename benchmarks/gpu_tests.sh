#!/usr/bin/env bash
# The test suite on the GPU (FLASHMAX_TEST_DEVICE=cuda): one pytest process per test file, at
# most JOBS at once, each keeping to 2 CPU threads, each with its own time limit; the files in
# SOLO run alone after the others. Triton's compiles and the fp64 oracles are CPU-bound and the
# machine has 16 cores: test_kernels, the largest, ran past 250-360 s beside the other files
# (sessions 34, 37, 38) and takes 78-183 s alone, hence SOLO's default. The logs come back as
# one file, $OUT/tests.tar.gz (a call returns at most 8 files); each file's summary line and
# its failures are printed last.
# Usage: JOBS=8 [SOLO="tests/test_kernels.py"] bash benchmarks/gpu_tests.sh [LIMIT_S] [test files...]
# (default: every tests/test_*.py; limit 360 s a file)
set -uo pipefail
limit="${1:-360}"; shift || true
files=("$@"); [ ${#files[@]} -gt 0 ] || files=(tests/test_*.py)
solo=" ${SOLO-tests/test_kernels.py} "
logs=$(mktemp -d)
export PYTHONPATH="${PYTHONPATH:-}:$PWD/src" FLASHMAX_TEST_DEVICE=cuda OMP_NUM_THREADS=2
run() {
    timeout "$limit" python3 -m pytest -q -rf -p no:cacheprovider "$1" >"$logs/$(basename "$1" .py).log" 2>&1
}
for f in "${files[@]}"; do
    [[ "$solo" == *" $f "* ]] && continue
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-8}" ]; do wait -n; done
    run "$f" &
done
wait
for f in "${files[@]}"; do
    [[ "$solo" == *" $f "* ]] && run "$f"
done
tar -czf "$OUT/tests.tar.gz" -C "$logs" .
for f in "${files[@]}"; do
    log="$logs/$(basename "$f" .py).log"
    printf '%-24s %s\n' "$(basename "$f" .py)" "$(grep -E '(passed|failed|error)' "$log" | tail -n 1 || true)"
    grep -E '^(FAILED|ERROR) ' "$log" | head -n 5 | sed 's/^/    /'
    [ -n "$(grep -E '(passed|failed)' "$log")" ] || echo "    (no summary: timed out after ${limit}s?)"
done

#!/usr/bin/env bash
# The test suite on the GPU (FLASHMAX_TEST_DEVICE=cuda): one pytest process per test file, at
# most JOBS at once, each keeping to 2 CPU threads, each with its own time limit. Triton's
# compiles and the fp64 oracles are CPU-bound and the machine has 16 cores: test_kernels, the
# largest, ran past 300 s even alone (session 39), so the files in SPLIT run as SHARDS processes
# each (tests/conftest.py's FLASHMAX_TEST_SHARD), every SHARDS-th test apiece. The logs come
# back as one file, $OUT/tests.tar.gz (a call returns at most 8 files); each process's summary
# line and its failures are printed last.
# Usage: JOBS=8 [SPLIT="tests/test_kernels.py"] [SHARDS=4] bash benchmarks/gpu_tests.sh [LIMIT_S]
#        [test files...]   (default: every tests/test_*.py; limit 360 s a process)
set -uo pipefail
limit="${1:-360}"; shift || true
files=("$@"); [ ${#files[@]} -gt 0 ] || files=(tests/test_*.py)
split=" ${SPLIT-tests/test_kernels.py} "
shards="${SHARDS:-4}"
logs=$(mktemp -d)
export PYTHONPATH="${PYTHONPATH:-}:$PWD/src" FLASHMAX_TEST_DEVICE=cuda OMP_NUM_THREADS=2
run() {  # run FILE LOG [SHARD]
    FLASHMAX_TEST_SHARD="${3:-}" timeout "$limit" python3 -m pytest -q -rf -p no:cacheprovider \
        "$1" >"$logs/$2.log" 2>&1
}
queue() {  # queue FILE LOG [SHARD]: run it once fewer than JOBS are running
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-8}" ]; do wait -n; done
    run "$@" &
}
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    if [[ "$split" == *" $f "* ]]; then
        for ((i = 0; i < shards; i++)); do queue "$f" "$name.$i" "$i/$shards"; done
    else
        queue "$f" "$name"
    fi
done
wait
tar -czf "$OUT/tests.tar.gz" -C "$logs" .
for log in "$logs"/*.log; do
    printf '%-24s %s\n' "$(basename "$log" .log)" "$(grep -E '(passed|failed|error)' "$log" | tail -n 1 || true)"
    grep -E '^(FAILED|ERROR) ' "$log" | head -n 5 | sed 's/^/    /'
    [ -n "$(grep -E '(passed|failed)' "$log")" ] || echo "    (no summary: timed out after ${limit}s?)"
done

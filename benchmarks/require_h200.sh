# Sourced first by the H200 runs (h200_run.sh, h200_entmax15_run.sh): prints the GPU, then
# stops the run (exit 3) on any GPU but an H200, unless FLASHMAX_ANY_GPU=1. The device may lend
# an H100 for an H200 call, whose ratios do not stand for the H200's.
gpu=$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader)
echo "$gpu"
if [[ ${FLASHMAX_ANY_GPU:-0} != 1 && $gpu != *H200* ]]; then
    echo "not an H200: nothing run (FLASHMAX_ANY_GPU=1 runs it anyway)" >&2
    exit 3
fi

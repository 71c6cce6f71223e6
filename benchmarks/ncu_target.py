"""A program for Nsight Compute to profile: flashmax's sparsemax or entmax-1.5 (`--op`) forward
(or backward) on each shape, a warm-up call then one profiled call per shape, between NVTX
ranges named after the shape.

    ncu --clock-control none --nvtx --nvtx-include 'regex:^profile/' \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python benchmarks/ncu_target.py 2048x4096 512x131072 --dist randn

Warp-state statistics (why warps stall) and occupancy are what the timings alone cannot say
(NOTES, "Where the remaining time is").
"""

import argparse
import json

import torch

from flashmax.kernels import load

DISTRIBUTIONS = {
    "randn": lambda shape, dtype: torch.randn(shape, device="cuda", dtype=dtype),
    "rand": lambda shape, dtype: torch.rand(shape, device="cuda", dtype=dtype),
    "randn0.01": lambda shape, dtype: torch.randn(shape, device="cuda", dtype=dtype) * 0.01,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", metavar="ROWSxN")
    parser.add_argument("--dist", choices=DISTRIBUTIONS, default="randn")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--op", choices=("sparsemax", "entmax15"), default="sparsemax")
    parser.add_argument("--launch", default="{}",
                        help="keyword overrides for the op's forward launcher, as JSON")
    args = parser.parse_args()
    kernels = load({"sparsemax": "sparsemax", "entmax15": "entmax"}[args.op])
    forward = getattr(kernels, f"{args.op}_forward")
    backward = getattr(kernels, f"{args.op}_backward")
    overrides = json.loads(args.launch)
    for shape in args.shapes:
        rows, n = (int(v) for v in shape.split("x"))
        x = DISTRIBUTIONS[args.dist]((rows, n), getattr(torch, args.dtype))
        y = forward(x, 1, **overrides)
        grad = torch.randn_like(x)
        for name in ("warmup", "profile"):
            torch.cuda.nvtx.range_push(f"{name}/{shape}")
            if args.backward:
                backward(y, grad, 1)
            else:
                forward(x, 1, **overrides)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()

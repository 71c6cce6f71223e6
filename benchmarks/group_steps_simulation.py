"""How many Newton steps the whole-row forward's group maxima phase takes from a given start:
a CPU simulation in fp64 (the prediction behind NOTES v54 and v55).

    python benchmarks/group_steps_simulation.py [--rows 300]

For each width (and the GROUP its one-row launch uses in bf16), rows of randn, uniform and
randn x 0.01 values: the group maxima (the max down each of GROUP strided slices, as the
kernel's [GROUP, WIDTH] tile), then Newton from the exact tau of the largest k of them less
2^-20 (k = 1: from -1), counting steps as `_newton_threshold` does: a step is final when every
entry of its support stays above the new tau. Prints the mean steps per row for each k.
"""

import argparse

import torch


def steps(values: torch.Tensor, tau: float) -> int:
    """Newton steps from the lower bound tau to the exact threshold of values (<= 0)."""
    count, step, pivot = 0, 0.0, tau
    while True:
        count += 1
        tau = pivot + step
        d = values[values > tau] - tau
        new_step = ((d.sum() - 1) / len(d)).item()
        pivot, step = tau, new_step
        if d.min().item() > new_step:
            return count


def top_tau(values: torch.Tensor, k: int) -> float:
    """The exact threshold of the largest k values: the largest (sum of the top j - 1) / j."""
    top = values.sort(descending=True).values[:k]
    return ((top.cumsum(0) - 1) / torch.arange(1, len(top) + 1, dtype=top.dtype)).max().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=300)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    starts = (1, 2, 3, 4, 8)
    for n, group in [(1024, 2), (2048, 4), (4096, 8), (8192, 8), (16384, 8), (32768, 8)]:
        for dist in ("randn", "rand", "randn0.01"):
            totals = dict.fromkeys(starts, 0)
            for _ in range(args.rows):
                if dist == "rand":
                    x = torch.rand(n, generator=g, dtype=torch.float64)
                else:
                    x = torch.randn(n, generator=g, dtype=torch.float64)
                    x = x * 0.01 if dist == "randn0.01" else x
                group_max = x.reshape(group, -1).amax(0)
                group_max = group_max - group_max.max()
                for k in starts:
                    start = -1.0 if k == 1 else max(top_tau(group_max, k) - 2.0**-20, -1.0)
                    totals[k] += steps(group_max, start)
            means = " ".join(f"top{k} {totals[k] / args.rows:.2f}" for k in starts)
            print(f"{n:6} GROUP {group} {dist:9} {means}", flush=True)


if __name__ == "__main__":
    main()

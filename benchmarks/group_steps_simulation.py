"""How many Newton steps the whole-row forward's group maxima phase takes from a given start:
a CPU simulation in fp64 (the prediction behind NOTES v54 and v55).

    python benchmarks/group_steps_simulation.py [--rows 300] [--groups | --short]

For each width (and the GROUP its one-row launch uses in bf16), rows of randn, uniform and
randn x 0.01 values: the group maxima (the max down each of GROUP strided slices, as the
kernel's [GROUP, WIDTH] tile), then Newton from the exact tau of the largest k of them less
2^-20 (k = 1: from -1), counting steps as `_newton_threshold` does: a step is final when every
entry of its support stays above the new tau. Prints the mean steps per row for each k.

With --groups (NOTES v61), the whole of `_tile_threshold` for fp32 rows held one a program at
GROUP 8 and at the widest group that spans the layout: the group steps from the top two's
tau, the count that confirms their support (when at most sqrt(WIDTH) group maxima are in it),
and the full-row steps otherwise; and the values each thread goes over, in entries (a group
step over its group maxima, a count or a full step over its share of the row).

With --short (NOTES v63), short rows (8-1000 entries, many a tile), whose steps go over the
whole row (GROUP 1): from -1 and from the top two's tau.
"""

import argparse

import torch


def newton(values: torch.Tensor, tau: float) -> tuple[int, float, int]:
    """(Newton steps, the exact threshold, its support's size) of values (<= 0) from the lower
    bound tau."""
    count, step, pivot = 0, 0.0, tau
    while True:
        count += 1
        tau = pivot + step
        d = values[values > tau] - tau
        new_step = ((d.sum() - 1) / len(d)).item()
        pivot, step = tau, new_step
        if d.min().item() > new_step:
            return count, tau + new_step, len(d)


def steps(values: torch.Tensor, tau: float) -> int:
    """Newton steps from the lower bound tau to the exact threshold of values (<= 0)."""
    return newton(values, tau)[0]


def sample(dist: str, n: int, g: torch.Generator) -> torch.Tensor:
    if dist == "rand":
        return torch.rand(n, generator=g, dtype=torch.float64)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    return x * 0.01 if dist == "randn0.01" else x


def tile_threshold_work(x: torch.Tensor, group: int, threads: int) -> tuple[int, int, int, int]:
    """(group steps, counts, full steps, entries a thread goes over) of `_tile_threshold` on
    one row x."""
    z = x - x.max()
    group_max = z.reshape(group, -1).amax(0)
    width = group_max.numel()
    start = max(top_tau(group_max, 2) - 2.0**-20, -1.0)
    group_steps, tau, size = newton(group_max, start)
    counts = full_steps = 0
    if size * size <= width:
        counts = 1
        found = int((z > tau).sum()) == size
    else:
        found = False
    if not found:
        full_steps = newton(z, tau)[0]
    work = (group_steps * width + (counts + full_steps) * z.numel()) // threads
    return group_steps, counts, full_steps, work


def compare_groups(rows: int):
    """GROUP 8 against the widest spanning group (fp32: 4 entries a thread's vector), v61."""
    g = torch.Generator().manual_seed(0)
    for n, warps in [(2048, 1), (4096, 2), (8192, 4), (16384, 4), (32768, 8)]:
        threads = 32 * warps
        spanning = n // (4 * threads)
        for dist in ("randn", "rand", "randn0.01"):
            totals = {group: [0, 0, 0, 0] for group in (8, spanning)}
            for _ in range(rows):
                x = sample(dist, n, g)
                for group, total in totals.items():
                    for i, value in enumerate(tile_threshold_work(x, group, threads)):
                        total[i] += value
            line = "  ".join(f"GROUP {group:2}: group steps {t[0] / rows:.2f} counts "
                             f"{t[1] / rows:.2f} full steps {t[2] / rows:.2f} entries a thread "
                             f"{t[3] / rows:.0f}" for group, t in totals.items())
            print(f"{n:6} {dist:9} {line}", flush=True)


def top_tau(values: torch.Tensor, k: int) -> float:
    """The exact threshold of the largest k values: the largest (sum of the top j - 1) / j."""
    top = values.sort(descending=True).values[:k]
    return ((top.cumsum(0) - 1) / torch.arange(1, len(top) + 1, dtype=top.dtype)).max().item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--groups", action="store_true",
                        help="GROUP 8 against the widest spanning group (NOTES v61)")
    parser.add_argument("--short", action="store_true",
                        help="short rows' steps over the whole row (NOTES v63)")
    args = parser.parse_args()
    if args.groups:
        compare_groups(args.rows)
        return
    g = torch.Generator().manual_seed(0)
    starts = (1, 2) if args.short else (1, 2, 3, 4, 8)
    widths = [(1024, 2), (2048, 4), (4096, 8), (8192, 8), (16384, 8), (32768, 8)]
    if args.short:
        widths = [(n, 1) for n in (8, 16, 64, 256, 512, 1000)]
    for n, group in widths:
        for dist in ("randn", "rand", "randn0.01"):
            totals = dict.fromkeys(starts, 0)
            for _ in range(args.rows):
                x = sample(dist, n, g)
                group_max = x.reshape(group, -1).amax(0)
                group_max = group_max - group_max.max()
                for k in starts:
                    start = -1.0 if k == 1 else max(top_tau(group_max, k) - 2.0**-20, -1.0)
                    totals[k] += steps(group_max, start)
            means = " ".join(f"top{k} {totals[k] / args.rows:.2f}" for k in starts)
            print(f"{n:6} GROUP {group} {dist:9} {means}", flush=True)


if __name__ == "__main__":
    main()

"""flashmax.entmax_bisect against its peers at one shape: time, accuracy, CUDA-graph capture.

    PYTHONPATH=src python benchmarks/entmax_bisect_speed.py [--tokens 2048] [--features 4096]
        [--alphas 1.5 1.25 2 3] [--dtype fp32] [--warps 1 2 4 8 16]

Peers, when installed: the entmax package's `entmax_bisect` (its default 50 bisection steps) and
AdaSplash's `triton_entmax` (a fixed number of Halley/bisection steps, inexact by design).
Forward, and forward + backward (w.r.t. x), median GPU time over many runs with CUDA events and
the L2 cache flushed before each (flashmax.bench.timing). Relative error against the entmax
package in float64 with 200 steps (or flashmax in float64 when entmax is absent) on the first
256 rows. Prints a table and the entmax/flashmax ratio; writes entmax_bisect_speed.json under
$OUT when it is set. On a CPU it runs the same on a small shape (the CPU path), and says so.
--warps also times flashmax's forward kernel at each of those num_warps (tuning the launch
heuristic, `kernels.entmax_bisect._warps`). `flashmax bench --op entmax_bisect --alpha A` times
the same peers over the bench's shapes, one α per run; this script keeps the several α of one
run, the row sums and the --warps sweep.
"""

import argparse
import json
import os
import sys

import torch

import flashmax
from flashmax.bench.timing import Budget, describe_error, measure, measure_graph_replay

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
CHECK_ROWS = 256


def peers():
    """name -> (x, alpha) -> y, for every implementation installed here."""
    impls = {"flashmax": lambda x, a: flashmax.entmax_bisect(x, a)}
    try:
        import entmax

        impls["entmax"] = lambda x, a: entmax.entmax_bisect(x, a)
    except ImportError:
        pass
    try:
        from adasplash import triton_entmax

        impls["adasplash"] = lambda x, a: triton_entmax(x, alpha=a)
    except ImportError:
        pass
    return impls


def reference(x, alpha):
    try:
        import entmax

        return entmax.entmax_bisect(x.double(), alpha, n_iter=200)
    except ImportError:
        return flashmax.entmax_bisect(x.double(), alpha, n_iter=200)


def relative_error(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens, features = (args.tokens, args.features) if device.type == "cuda" else (64, 1024)
    if device.type != "cuda":
        print(f"no GPU: timing the CPU path at {tokens} x {features}", file=sys.stderr)
    budget = Budget(gpu_ms=args.gpu_ms, cpu_runs=3)
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, features, generator=g, device=device).to(dtype)
    grad = torch.randn(tokens, features, generator=g, device=device).to(dtype)
    copy = measure(lambda: x.clone(), device, budget).median_us
    records = []
    for alpha in args.alphas:
        ref = reference(x[:CHECK_ROWS], alpha)
        for name, fn in peers().items():
            record = {"impl": name, "alpha": alpha, "tokens": tokens, "features": features,
                      "dtype": args.dtype, "device": torch.cuda.get_device_name(device)
                      if device.type == "cuda" else "cpu", "copy_us": copy}
            try:
                y = fn(x[:CHECK_ROWS], alpha)
                record["relative_error"] = relative_error(y, ref)
                record["max_row_sum_error"] = float((y.double().sum(-1) - 1).abs().max())
                record["forward_us"] = measure(lambda: fn(x, alpha), device, budget).median_us
                xg = x.detach().requires_grad_()

                def forward_backward():
                    return torch.autograd.grad(fn(xg, alpha), xg, grad)

                record["forward_backward_us"] = measure(forward_backward, device,
                                                        budget).median_us
                if device.type == "cuda":
                    timing, why = measure_graph_replay(lambda: fn(x, alpha), device, budget)
                    record["graph_replay_us"] = timing.median_us if timing else None
                    record["graph_capture"] = why or "ok"
            except Exception as error:  # a peer that fails here is reported, not fatal
                record["error"] = describe_error(error)
            records.append(record)
        if device.type == "cuda":
            records += warps_sweep(x, alpha, args.warps, budget, copy)
    return records


def warps_sweep(x, alpha, warps, budget, copy):
    from flashmax.kernels import entmax_bisect as kernels

    alpha_rows = x.new_full((), alpha, dtype=torch.float64).expand(x.shape[0], 1)
    records = []
    for num_warps in warps:
        def forward():
            return kernels.entmax_bisect_forward(x, alpha_rows, 1, 50, True, num_warps=num_warps)

        timing = measure(forward, x.device, budget)
        records.append({"impl": f"flashmax-warps{num_warps}", "alpha": alpha,
                        "forward_us": timing.median_us, "copy_us": copy})
        print(f"alpha={alpha} num_warps={num_warps}: {timing.median_us:.1f} us")
    return records


def report(records):
    print(f"{'impl':<10} {'alpha':>5} {'fwd us':>9} {'x copy':>7} {'fwd+bwd us':>11} "
          f"{'graph us':>9} {'rel err':>9} {'sum err':>8}")
    for r in records:
        if "forward_backward_us" not in r and "error" not in r:
            continue  # the warps sweep, printed as it ran
        if "error" in r:
            print(f"{r['impl']:<10} {r['alpha']:>5} error: {r['error']}")
            continue
        graph = r.get("graph_replay_us")
        print(f"{r['impl']:<10} {r['alpha']:>5} {r['forward_us']:>9.1f} "
              f"{r['forward_us'] / r['copy_us']:>7.2f} {r['forward_backward_us']:>11.1f} "
              f"{graph if graph is None else round(graph, 1)!s:>9} "
              f"{r['relative_error']:>9.2e} {r['max_row_sum_error']:>8.1e}")
    by_key = {(r["impl"], r["alpha"]): r for r in records if "forward_backward_us" in r}
    for (impl, alpha), r in by_key.items():
        ours = by_key.get(("flashmax", alpha))
        if impl != "flashmax" and ours:
            print(f"alpha={alpha}: {impl} / flashmax = {r['forward_us'] / ours['forward_us']:.1f}x "
                  f"forward, {r['forward_backward_us'] / ours['forward_backward_us']:.1f}x "
                  f"forward+backward")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--alphas", type=float, nargs="+", default=[1.5, 1.25, 2.0, 3.0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--warps", type=int, nargs="*", default=[],
                        help="also time flashmax's forward kernel at these num_warps")
    parser.add_argument("--gpu-ms", type=float, default=200.0, help="GPU time per measurement")
    args = parser.parse_args()
    records = run(args)
    report(records)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "entmax_bisect_speed.json"), "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

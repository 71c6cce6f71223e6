"""`flashmax bench`: parse the options, pick the device and workload, run, report."""

import argparse
import math
from pathlib import Path

import torch

from . import files, report
from .peers import DEFAULT_ALPHA, NAMES, OPS
from .runner import Settings, format_bytes, run_bench
from .timing import Budget
from .workloads import (CPU_FEATURES, CPU_SWEEP_MAX_FEATURES, CPU_SWEEP_MIN_BYTES, CPU_TOKENS, DISTRIBUTIONS, DTYPES,
                        GPU_FEATURES, GPU_QUICK_FEATURES, GPU_SWEEP_MIN_BYTES, GPU_TOKENS, LAYOUTS, LOSS_OPS,
                        MODES, SWEEP_FEATURES, SWEEP_QUICK_FEATURES)

FULL_BUDGET = Budget(gpu_ms=100, cpu_runs=5)
QUICK_BUDGET = Budget(gpu_ms=20, cpu_runs=3)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def alpha_above_1(text: str) -> float:
    value = float(text)
    if not 1 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number > 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashmax", description="flashmax: exact sparsemax on GPUs.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench", help="time sparsemax implementations against a memory-copy floor",
        description="Time sparsemax implementations side by side, each against the floor of a clone "
                    "moving the same bytes; writes bench.json, bench.md and plots to --out.")
    bench.add_argument("--op", choices=OPS, default="sparsemax",
                       help="the normaliser timed: sparsemax (default), entmax15 (its peers: the "
                            "entmax package's entmax15 and entmax_bisect(alpha=1.5), AdaSplash's "
                            "triton_entmax15, the sort baseline), entmax_bisect at --alpha (its peers: "
                            "the entmax package's entmax_bisect, AdaSplash's triton_entmax), or the losses "
                            "sparsemax_loss and entmax15_loss against fixed random targets (their peers: the "
                            "entmax package's, the loss of the sort baseline; floors: forward 1 tensor, "
                            "backward 2)")
    bench.add_argument("--alpha", type=alpha_above_1,
                       help=f"with --op entmax_bisect: α > 1 (default: {DEFAULT_ALPHA})")
    bench.add_argument("--dtype", dest="dtypes", nargs="+", choices=list(DTYPES), metavar="DTYPE",
                       help=f"input dtypes: {', '.join(DTYPES)} (default: fp32; fp32 bf16 with --sweep)")
    bench.add_argument("--features", nargs="+", type=positive_int,
                       help=f"row lengths (default: {' '.join(map(str, GPU_FEATURES))} on a GPU, "
                            f"{' '.join(map(str, CPU_FEATURES))} on a CPU)")
    bench.add_argument("--tokens", type=positive_int,
                       help=f"rows (default: {GPU_TOKENS} on a GPU, {CPU_TOKENS} on a CPU)")
    bench.add_argument("--modes", nargs="+", choices=MODES, default=["forward", "backward"], metavar="MODE",
                       help="forward, backward (the backward pass alone), full (both), or eager (both "
                            "by the wall clock, host included, against torch.softmax's forward + backward "
                            "timed in turn: issue #4's end-to-end target); default: forward backward")
    bench.add_argument("--dist", choices=list(DISTRIBUTIONS), default="randn",
                       help="input values: randn (default), rand, randn0.01 and randn10 (randn scaled), "
                            "ties (multiples of 1/8 in [0, 1))")
    bench.add_argument("--layout", choices=LAYOUTS, default="rows",
                       help="rows (default): tokens × features over the last dim; columns: features × tokens "
                            "over dim 0, a reduced dim that is not the last (an [N, C, H, W] tensor over C)")
    bench.add_argument("--impls", nargs="+", choices=NAMES, metavar="IMPL",
                       help=f"implementations to run, of {', '.join(NAMES)} (default: all, flashmax alone "
                            "with --sweep; torch-sort-compiled runs on a CPU only when named here)")
    bench.add_argument("--out", type=Path, default=Path("bench-out"),
                       help="output folder (default: ./bench-out)")
    bench.add_argument("--quick", action="store_true", help="a run of about a minute: fewer features and runs")
    bench.add_argument("--sweep", action="store_true",
                       help=f"flashmax's shape coverage: features {SWEEP_FEATURES[0]} to {SWEEP_FEATURES[-1]} "
                            f"(powers of two and {', '.join(str(f) for f in SWEEP_FEATURES if f & (f - 1))}; "
                            f"on a CPU up to {CPU_SWEEP_MAX_FEATURES}), each with the rows that fill --min-bytes; "
                            "plots percent of copy bandwidth to bench-sweep.png")
    bench.add_argument("--min-bytes", type=positive_int,
                       help=f"with --sweep: the least bytes of each input tensor (default: "
                            f"{format_bytes(GPU_SWEEP_MIN_BYTES)} on a GPU, "
                            f"{format_bytes(CPU_SWEEP_MIN_BYTES)} on a CPU)")
    bench.add_argument("--device", choices=["cuda", "cpu"],
                       help="default: cuda when a GPU is present, else cpu")
    return parser


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    has_gpu = torch.cuda.is_available()
    if args.device == "cuda" and not has_gpu:
        parser.error("--device cuda: no CUDA GPU is available")
    if args.sweep and args.tokens:
        parser.error("--sweep picks the tokens of each width from --min-bytes: drop --tokens")
    if args.sweep and "eager" in args.modes:
        parser.error("--sweep plots the copy bandwidth; mode eager compares with torch.softmax: drop one")
    if args.min_bytes and not args.sweep:
        parser.error("--min-bytes goes with --sweep")
    if args.alpha and args.op != "entmax_bisect":
        parser.error("--alpha goes with --op entmax_bisect")
    if args.layout != "rows" and args.op in LOSS_OPS:
        parser.error("the losses take rows over the last dim: drop --layout")
    device = torch.device(args.device or ("cuda" if has_gpu else "cpu"))
    where = "No GPU found" if not has_gpu else "On the CPU"
    tokens, min_bytes = args.tokens, None
    if args.sweep:
        features = SWEEP_QUICK_FEATURES if args.quick else SWEEP_FEATURES
        if device.type == "cuda":
            min_bytes = args.min_bytes or GPU_SWEEP_MIN_BYTES
        else:
            features = tuple(f for f in features if f <= CPU_SWEEP_MAX_FEATURES)
            min_bytes = args.min_bytes or CPU_SWEEP_MIN_BYTES
            print(f"{where}: sweeping on a smaller scale (features up to {max(args.features or features)}, "
                  f"tensors of ≥ {format_bytes(min_bytes)})")
    elif device.type == "cuda":
        tokens, features = tokens or GPU_TOKENS, GPU_QUICK_FEATURES if args.quick else GPU_FEATURES
    else:
        tokens, features = tokens or CPU_TOKENS, CPU_FEATURES
        print(f"{where}: timing the CPU implementations on a smaller workload "
              f"({tokens} tokens × {', '.join(map(str, args.features or features))})")
    return Settings(
        device=device,
        tokens=tokens,
        features=args.features or features,
        dtypes=args.dtypes or (["fp32", "bf16"] if args.sweep else ["fp32"]),
        modes=args.modes,
        dist=args.dist,
        requested_impls=args.impls or (["flashmax"] if args.sweep else None),
        budget=QUICK_BUDGET if args.quick else FULL_BUDGET,
        sweep_min_bytes=min_bytes,
        op=args.op,
        alpha=args.alpha or DEFAULT_ALPHA,
        layout=args.layout,
    )


def main(argv: list[str] | None = None) -> int:
    """The console script `flashmax`; also the entry of `python -m flashmax.bench`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = settings_from_args(args, parser)
    result = run_bench(settings)
    report.print_tables(result)
    for path in files.write_all(result, args.out):
        print(f"wrote {path}")
    return 0

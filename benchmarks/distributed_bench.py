"""Sparsemax over features split across ranks (issue 7) against one device holding whole rows.

    torchrun --nproc-per-node 2 benchmarks/distributed_bench.py    # GPUs, NCCL: 2048 x 1048576
    python benchmarks/distributed_bench.py --quick                 # CPU, gloo, 2 processes, tiny

Every rank builds the same x (same seed) and keeps its contiguous slice of the features. The
baseline is `flashmax.sparsemax` on whole rows on rank 0's device alone (the other ranks wait);
the sharded run is `flashmax.sparsemax(x_slice, group=...)` on every rank (with one rank, the
split loop itself: its overhead on one device, `torchrun --nproc-per-node 1`), timed as the
slowest rank's wall time of each call (host syncs included: one per Newton step). Times
are medians. The collectives of one call are counted, and replayed alone (same ops, sizes and
host syncs) to give their share of the call's time. Correctness: each rank's slice against the
single-device result of its own copy of the whole rows, and against a float64 oracle on a few
rows. Writes distributed.json under --out (default $OUT, else .) and prints a table last.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashmax
from flashmax import distributed
from flashmax.reference import sparsemax_sort

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
ORACLE_ROWS = 4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, help="default 2048 (--quick: 64)")
    parser.add_argument("--features", type=int, help="default 1048576 (--quick: 4096)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--reps", type=int, help="timed calls after 2 warm-ups: default 10 "
                                                 "(--quick: 3)")
    parser.add_argument("--world", type=int, default=2,
                        help="processes to start when not run under torchrun")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--lookaheads", type=int, nargs="*", default=[],
                        help="also time the split forward with these Newton steps queued ahead "
                             "of the host's check (CUDA)")
    parser.add_argument("--ladders", type=int, nargs="*", default=[],
                        help="also time the split forward with these points per step")
    parser.add_argument("--profile", action="store_true",
                        help="print the split forward's kernels and GPU busy time (rank 0)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU and gloo, small and few: checks that it runs")
    args = parser.parse_args(argv)
    defaults = (64, 4096, 3) if args.quick else (2048, 1048576, 10)
    for name, default in zip(("rows", "features", "reps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_times(op, device, reps, group=None) -> list[float]:
    """Seconds of each of `reps` calls after 2 warm-ups; with a group, all ranks start each
    call together and each time is the slowest rank's."""
    times = []
    for _ in range(2 + reps):
        _sync(device)
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - start)
    if group is None:
        return times[2:]
    slowest = torch.tensor(times[2:], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.tolist()


def _replay(trace, device, group):
    """The traced collectives alone, each followed by a host sync as in the call."""
    tensors = [(kind, torch.zeros(shape, dtype=dtype, device=device))
               for kind, shape, dtype in trace]
    comm = distributed.Collectives(group)

    def op():
        for kind, t in tensors:
            if kind == "all_gather":
                comm.all_gather(t).sum().item()
            else:
                op = dist.ReduceOp.MAX if kind == "all_reduce_max" else dist.ReduceOp.SUM
                comm.all_reduce(t, op).sum().item()

    return op


def _profile(op, device, group, rank, calls=3):
    """Rank 0 prints each GPU kernel's time per call and the GPU's busy time against the wall
    time: whether the split call waits on its kernels or on the host."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            op()
        _sync(device)
        wall = (time.perf_counter() - start) / calls
    if rank:
        return
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name[:60], []).append(event.device_time)
    busy = sum(sum(t) for t in kernels.values()) / calls
    print(f"profile (rank 0, {calls} calls): wall {wall * 1e6:.0f} us/call, GPU busy "
          f"{busy:.0f} us/call", flush=True)
    for name, t in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(t) / calls:9.1f} us/call  x{len(t) / calls:4.1f}  {name}", flush=True)


def _step_rates(x_local, device, group, rank, steps=20):
    """Rank 0 prints the host's and the device's time per Newton step, from steps queued
    back to back with no flag read (which of the two bounds the loop), and the host's time of
    each part of a step alone."""
    local = distributed._local_work(x_local, 1)
    comm = distributed.Collectives(group)
    row_max, bound = distributed.combine(comm.all_gather(local.summary()))
    state = [bound, torch.zeros_like(bound), ~torch.isfinite(row_max), torch.zeros_like(bound)]
    points = distributed.next_points(*state[:2], state[3], state[2], distributed.LADDER)
    centre = torch.zeros_like(bound)
    everyone = comm.all_gather(local.sums(row_max, points, centre))
    parts = {
        "sums kernel": lambda: local.sums(row_max, points, centre),
        "all_gather": lambda: comm.all_gather(everyone[rank]),
        "update kernel": lambda: local.advance(everyone, points, *[t.clone() for t in state]),
        "done flag": lambda: distributed._all_done(state[2]),
    }
    parts["whole step"] = lambda: [parts[name]() for name in list(parts)[:4]]
    times = {}
    for name, part in parts.items():
        _sync(device)
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(steps):
            part()
        queued = time.perf_counter()
        _sync(device)
        times[name] = ((queued - start) / steps * 1e6, (time.perf_counter() - start) / steps * 1e6)
    # Where a chained step's device time goes: events between its parts, on this stream.
    marks = {name: [] for name in list(parts)[:4]} if device.type == "cuda" else {}
    _sync(device)
    dist.barrier(group)
    for _ in range(steps):
        for name in marks:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            parts[name]()
            end.record()
            marks[name].append((begin, end))
    _sync(device)
    if rank:
        return
    print("per Newton step, host / device us (queued back to back, no flag read): " +
          ", ".join(f"{name} {h:.0f} / {d:.0f}" for name, (h, d) in times.items()), flush=True)
    if marks:
        print("chained step, device us per part (median): " + ", ".join(
            f"{name} {statistics.median(b.elapsed_time(e) * 1e3 for b, e in pairs):.0f}"
            for name, pairs in marks.items()), flush=True)


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _widths(features, world):
    return [len(part) for part in torch.arange(features).tensor_split(world)]


def run(args, group) -> dict:
    """Every rank's part of the benchmark; rank 0 writes and returns the record."""
    median = statistics.median
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    generator = torch.Generator(device).manual_seed(0)
    x = torch.randn(args.rows, args.features, generator=generator, device=device).to(dtype)
    widths = _widths(args.features, world)
    lo, hi = sum(widths[:rank]), sum(widths[:rank + 1])
    x_local = x[:, lo:hi].clone()

    # One device, whole rows: the baseline's time on rank 0, and every rank's reference.
    y_whole = flashmax.sparsemax(x)
    y_ref = y_whole[:, lo:hi].clone()
    oracle = sparsemax_sort(x[:ORACLE_ROWS].double())[:, lo:hi]
    if rank == 0:
        g = torch.randn_like(y_whole)
        whole_fwd = _wall_times(lambda: flashmax.sparsemax(x), device, args.reps)
        whole_bwd = _wall_times(
            lambda: torch.ops.flashmax.sparsemax_backward(y_whole, g, 1), device, args.reps)
        del g
    del x, y_whole
    dist.barrier(group)

    comm = distributed.Collectives(group, trace=[])
    distributed.agree(x_local, -1, comm)
    y_local, steps = distributed.sharded_forward(x_local, 1, comm, args.features)
    g_local = torch.randn_like(y_local)

    def split_forward():
        if world == 1:
            # A group of one is the plain call: time the split loop itself (its overhead
            # against the whole rows, measurable on one GPU).
            loop_comm = distributed.Collectives(group)
            distributed.agree(x_local, -1, loop_comm)
            return distributed.sharded_forward(x_local, 1, loop_comm, args.features)[0]
        return flashmax.sparsemax(x_local, -1, group=group)

    def split_forward_ms_with(owner, knob, values):
        """{value: median ms of the split forward with owner.knob = value}, knob restored."""
        default, times = getattr(owner, knob), {}
        for value in values:
            setattr(owner, knob, value)
            times[value] = median(_wall_times(split_forward, device, args.reps, group)) * 1e3
        setattr(owner, knob, default)
        return times

    sharded_fwd = _wall_times(split_forward, device, args.reps, group)
    sharded_bwd = _wall_times(
        lambda: distributed.sharded_backward(y_local, g_local, 1, distributed.Collectives(group)),
        device, args.reps, group)
    comm_fwd = _wall_times(_replay(comm.trace, device, group), device, args.reps, group)
    by_lookahead = {}
    if distributed.kernels is not None and device.type == "cuda":
        by_lookahead = split_forward_ms_with(distributed.kernels.TritonShard, "lookahead",
                                             args.lookaheads)
    by_ladder = split_forward_ms_with(distributed, "LADDER", args.ladders)
    if args.profile:
        _profile(split_forward, device, group, rank)
        _step_rates(x_local, device, group, rank)

    max_diff = torch.tensor([(y_local.float() - y_ref.float()).abs().max().item()
                             if y_local.numel() else 0.0], device=device)
    squares = torch.tensor([(y_local[:ORACLE_ROWS].double() - oracle).norm().item() ** 2,
                            oracle.norm().item() ** 2], dtype=torch.float64, device=device)
    row_sums = y_local.sum(-1, dtype=torch.float64)
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(squares, group=group)
    dist.all_reduce(row_sums, group=group)
    if rank:
        return {}
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(group),
        "world": world,
        "widths": widths,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "commit": os.environ.get("FLASHMAX_COMMIT"),
        "rows": args.rows,
        "features": args.features,
        "dtype": args.dtype,
        "reps": args.reps,
        "whole_rows_forward_ms": median(whole_fwd) * 1e3,
        "whole_rows_backward_ms": median(whole_bwd) * 1e3,
        "sharded_forward_ms": median(sharded_fwd) * 1e3,
        "sharded_backward_ms": median(sharded_bwd) * 1e3,
        "forward_speedup": median(whole_fwd) / median(sharded_fwd),
        "backward_speedup": median(whole_bwd) / median(sharded_bwd),
        "newton_steps": steps,
        "ladder": distributed.LADDER,
        "forward_collectives": len(comm.trace),
        "forward_collectives_kinds": [kind for kind, _, _ in comm.trace],
        "forward_collectives_ms": median(comm_fwd) * 1e3,
        "forward_collectives_share": median(comm_fwd) / median(sharded_fwd),
        "backward_collectives": 1,
        "sharded_forward_ms_by_lookahead": by_lookahead,
        "sharded_forward_ms_by_ladder": by_ladder,
        "max_abs_diff_vs_whole_rows": max_diff.item(),
        "relative_error_vs_fp64_oracle": (squares[0] / squares[1]).sqrt().item(),
        "max_row_sum_error": (row_sums - 1).abs().max().item(),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "distributed.json"), "w") as f:
        json.dump(record, f, indent=2)
    return record


def _table(record) -> str:
    r = record
    lines = [
        f"{r['rows']} x {r['features']} {r['dtype']}, {r['world']} ranks ({r['backend']}, "
        f"{r['device']}), median of {r['reps']}",
        "| | whole rows, 1 device | split | speed-up |",
        "|---|---:|---:|---:|",
        f"| forward ms | {r['whole_rows_forward_ms']:.3f} | {r['sharded_forward_ms']:.3f} | "
        f"{r['forward_speedup']:.2f}x |",
        f"| backward ms | {r['whole_rows_backward_ms']:.3f} | {r['sharded_backward_ms']:.3f} | "
        f"{r['backward_speedup']:.2f}x |",
        f"forward: {r['forward_collectives']} collectives ({r['newton_steps']} steps of "
        f"{r['ladder']} points), {r['forward_collectives_ms']:.3f} ms = "
        f"{100 * r['forward_collectives_share']:.1f}% of the call; backward: 1 all-reduce",
        *(f"split forward with {k} steps queued ahead: {v:.3f} ms"
          for k, v in r["sharded_forward_ms_by_lookahead"].items()),
        *(f"split forward with {k} points per step: {v:.3f} ms"
          for k, v in r["sharded_forward_ms_by_ladder"].items()),
        f"max |split - whole rows| {r['max_abs_diff_vs_whole_rows']:.2e}, relative error vs "
        f"fp64 oracle {r['relative_error_vs_fp64_oracle']:.2e}, max |row sum - 1| "
        f"{r['max_row_sum_error']:.2e}",
    ]
    return "\n".join(lines)


def _process(args, local_rank, **init):
    """One rank: NCCL on its own GPU, or gloo on the CPU (--quick, or no GPU)."""
    backend = "gloo" if args.quick or not torch.cuda.is_available() else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300), **init)
    try:
        record = run(args, dist.group.WORLD)
        if record:
            print(_table(record), flush=True)
        dist.barrier()  # no rank tears gloo down while another still uses it
    finally:
        dist.destroy_process_group()


def _spawned(rank, world, port, args):
    _process(args, rank, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun, which set the rendezvous up
        _process(args, int(os.environ.get("LOCAL_RANK", 0)))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    sys.exit(main())

"""Timing one operation: quantiles over many runs, with the GPU's L2 cache flushed before each run.

On a GPU, CUDA events time each run (host time included), and a CUDA-graph replay gives the GPU
time alone. On a CPU, time.perf_counter times a few runs; there is no cache to flush worth the cost.
An eager call against a reference (`measure_alternating`) is timed by the wall clock instead.
"""

import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

Op = Callable[[], object]

# Larger than any GPU's L2 (H100/H200: 50-60 MB); triton.testing.do_bench flushes with 256 MB too.
FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float


@dataclass(frozen=True)
class Budget:
    gpu_ms: float  # GPU time given to the timed runs of one operation
    cpu_runs: int  # timed runs of one operation on a CPU


def measure(op: Op, device: torch.device, budget: Budget) -> Timing:
    if device.type == "cuda":
        return _measure_cuda(op, device, budget)
    op()  # warm up: first-call allocations and lazy initialisation
    runs = []
    for _ in range(budget.cpu_runs):
        start = time.perf_counter()
        op()
        runs.append((time.perf_counter() - start) * 1e6)
    return _quantiles(runs)


def _measure_cuda(op: Op, device: torch.device, budget: Budget) -> Timing:
    op()  # first call: compilation, autotuning, allocator growth
    runs = _gpu_runs(budget, sum(_cuda_runs_us(op, device, 5)) / 5)
    _cuda_runs_us(op, device, max(runs // 4, 1))  # warm up clocks and caches
    return _quantiles(_cuda_runs_us(op, device, runs))


def measure_alternating(op: Op, reference: Op, device: torch.device, budget: Budget) -> tuple[Timing, Timing]:
    """Wall time of one call of op and of reference, host included, call for call in turn.

    Each call waits for the GPU to finish, and no flush runs before it: the flush's GPU time would hide
    the host time of the call queued behind it. Alternating makes both sides see the same host: on the
    H200 machines a host's speed drifts within seconds (torch.softmax forward + backward at 2048 × 1024
    measured 62-111 µs between runs, benchmarks/NOTES.md), which timing one after the other would
    put into the ratio."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def once(fn: Op) -> float:
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) * 1e6

    estimate_us = max(once(op), once(reference))  # the first calls: compiling, allocator growth
    runs = _gpu_runs(budget, estimate_us) if device.type == "cuda" else budget.cpu_runs
    for _ in range(max(runs // 4, 1)):  # warm up clocks and caches
        once(op)
        once(reference)
    pairs = [(once(op), once(reference)) for _ in range(runs)]
    return _quantiles([ours for ours, _ in pairs]), _quantiles([theirs for _, theirs in pairs])


def _gpu_runs(budget: Budget, estimate_us: float) -> int:
    """Timed runs that fill the budget's GPU time at estimate_us a run: 10 to 1000."""
    return min(max(int(budget.gpu_ms * 1e3 / max(estimate_us, 1.0)), 10), 1000)


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)


def _cuda_runs_us(op: Op, device: torch.device, runs: int) -> list[float]:
    flush = _flush_buffer(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for start, end in zip(starts, ends):
        flush.zero_()  # evict the inputs from L2: a real layer reads them from memory
        start.record()
        op()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends)]


def _quantiles(runs_us: list[float]) -> Timing:
    levels = torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)
    p20, median, p80 = torch.tensor(runs_us, dtype=torch.float64).quantile(levels).tolist()
    return Timing(median_us=median, p20_us=p20, p80_us=p80)


def measure_graph_replay(op: Op, device: torch.device, budget: Budget) -> tuple[Timing | None, str | None]:
    """GPU time alone: op captured once in a CUDA graph, then replays timed (one launch each).

    Returns (timing, None), or (None, why) when the op cannot be captured, e.g. it syncs the host.
    """
    _spend_first_backward_capture(device)
    _warm_up_on_side_stream(op, device)
    try:
        graph = _capture(op)
    except Exception as error:  # host syncs, CPU tensors, unsupported calls
        _recover_from_failed_capture(device)
        return None, f"capture failed: {describe_error(error)}"
    return measure(graph.replay, device, budget), None


def _warm_up_on_side_stream(op: Op, device: torch.device) -> None:
    """Capture wants the op's lazy work (compiling, autotuning, autograd's threads) done off-stream."""
    side_stream = torch.cuda.Stream(device)
    side_stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side_stream):
        for _ in range(3):
            op()
    torch.cuda.current_stream(device).wait_stream(side_stream)


def _capture(op: Op) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        # A capture that fails before its first kernel also warns that the graph is empty.
        warnings.filterwarnings("ignore", "The CUDA Graph is empty")
        with torch.cuda.graph(graph):
            op()
    return graph


def _recover_from_failed_capture(device: torch.device) -> None:
    """A failed capture leaves the default CUDA generator mid-capture (the next torch.randn on the
    GPU raises); any capture that succeeds resets it."""
    torch.cuda.synchronize(device)
    _capture(lambda: torch.ones(1, device=device).add_(1))


@functools.cache
def _spend_first_backward_capture(device: torch.device) -> None:
    """PyTorch (2.11 at least) fails a process's first capture of an autograd backward, whatever the
    op, and every later capture of that same autograd graph; other graphs then capture fine. Spend
    that failure on a throwaway graph rather than on the first implementation measured."""
    x = torch.ones(8, device=device, requires_grad=True)
    y = x.exp()

    def backward() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)

    _warm_up_on_side_stream(backward, device)
    try:
        _capture(backward)
    except Exception:
        _recover_from_failed_capture(device)


def describe_error(error: BaseException) -> str:
    """One line for a table or a JSON field: the type and the first line of the message."""
    first_line = next(iter(str(error).splitlines()), "")
    return f"{type(error).__name__}: {first_line}".rstrip(": ")


def peak_extra_mb(op: Op, device: torch.device) -> float | None:
    """Memory one run allocates beyond what is already held, output included; None on a CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device)
    op()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - held) / 2**20

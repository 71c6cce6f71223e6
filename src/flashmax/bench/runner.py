"""The measurement loop: each workload x implementation x mode timed, checked against an oracle and
recorded next to the floor, a clone moving the same bytes."""

import datetime
import math
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import flashmax
from flashmax import reference_bisect
from flashmax.reference import sparsemax_sort
from flashmax.reference_entmax import entmax15_sort

from . import peers
from .report import progress
from .timing import (Budget, Timing, describe_error, measure, measure_alternating, measure_graph_replay,
                     peak_extra_mb)
from .workloads import LOSS_OPS, TENSORS_MOVED, Workload, eager_reference, sweep_tokens, tensors_moved

# Datasheet memory bandwidth in bytes/s, matched against the GPU's name.
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}

EXACT_BELOW = 1e-4


def inexact_above(dtype: torch.dtype) -> float:
    """The relative error that flags an implementation inexact.

    Half types round the result once at the end, which alone costs up to eps/2: their bar is eps.
    """
    return max(EXACT_BELOW, torch.finfo(dtype).eps)


@dataclass(frozen=True)
class Settings:
    device: torch.device
    tokens: int | None  # None in a sweep: each workload has its own
    features: Sequence[int]
    dtypes: Sequence[str]
    modes: Sequence[str]
    dist: str
    requested_impls: Sequence[str] | None  # None: every implementation
    budget: Budget
    sweep_min_bytes: int | None = None  # a sweep: rows per workload for input tensors of at least this
    op: str = "sparsemax"  # one of peers.OPS
    alpha: float = peers.DEFAULT_ALPHA  # entmax_bisect's α
    layout: str = "rows"  # one of workloads.LAYOUTS

    @property
    def sweep(self) -> bool:
        return self.sweep_min_bytes is not None

    def workloads(self) -> list[Workload]:
        return [Workload(self._tokens(f, dtype), f, dtype, self.dist, self.layout)
                for dtype in self.dtypes for f in self.features]

    def _tokens(self, features: int, dtype: str) -> int:
        return sweep_tokens(features, dtype, self.sweep_min_bytes) if self.sweep else self.tokens

    @property
    def title(self) -> str:
        """The op, with its α where that is a setting."""
        return f"{self.op} (α = {self.alpha})" if self.op == "entmax_bisect" else self.op

    @property
    def inputs(self) -> str:
        """The rows, for titles: a count, or in a sweep how each workload's count is chosen."""
        rows = (f"tokens for ≥ {format_bytes(self.sweep_min_bytes)} per tensor" if self.sweep
                else f"{self.tokens} tokens")
        return rows + (" (features × tokens, over dim 0)" if self.layout == "columns" else "")


def format_bytes(size: int) -> str:
    """262144 -> '256 KiB'; 67108864 -> '64 MiB'; other sizes in bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


@dataclass(frozen=True)
class Record:
    impl: str
    impl_version: str
    tokens: int
    features: int
    dtype: str
    mode: str
    dist: str
    op: str
    alpha: float | None  # entmax_bisect's α; None for the other ops
    layout: str  # workloads.LAYOUTS: rows over the last dim, or features × tokens over dim 0
    median_us: float | None
    p20_us: float | None
    p80_us: float | None
    graph_us: float | None  # GPU time alone, from CUDA-graph replay
    graph_note: str | None  # why graph_us is missing on a GPU
    floor_us: float  # the same bytes moved by x.clone(), timed the same way; eager: eager_reference's op
    floor_graph_us: float | None  # the same, GPU time alone (CUDA-graph replay)
    datasheet_floor_us: float | None  # the same bytes at the GPU's datasheet bandwidth
    ratio_to_floor: float | None
    graph_ratio_to_floor: float | None  # graph_us / floor_graph_us: the GPU kernels' own ratio
    gbps: float | None
    rel_error: float | None  # against the float64 oracle on the same input
    inexact: bool | None
    peak_mb: float | None  # memory allocated beyond the inputs, output included
    error: str | None  # why the measurement failed, if it did
    device: str
    torch: str
    triton: str
    flashmax_commit: str
    date: str


@dataclass(frozen=True)
class Result:
    settings: Settings
    impls: list[peers.Impl]
    records: list[Record]


@dataclass(frozen=True)
class Measurement:
    timing: Timing | None = None
    graph: Timing | None = None
    graph_note: str | None = None
    rel_error: float | None = None
    peak_mb: float | None = None
    error: str | None = None
    reference: Timing | None = None  # mode eager: eager_reference's op, timed in turn with this one


def run_bench(settings: Settings) -> Result:
    impls = peers.discover(settings.device, settings.requested_impls, settings.op, settings.alpha)
    runnable = [impl for impl in impls if impl.available]
    workloads = settings.workloads()
    environment = describe_environment(settings.device)
    records = []
    with progress(len(workloads) * (1 + len(runnable) * len(settings.modes))) as advance:
        for workload in workloads:
            # torch.compile keeps a limited number of compiled shapes, then silently runs eager.
            torch.compiler.reset()
            advance(f"{workload.dtype} × {workload.features}: floor")
            clone = workload.input(settings.device).clone
            clone_us = measure(clone, settings.device, settings.budget).median_us
            clone_graph_us = None
            if settings.device.type == "cuda":
                clone_graph = measure_graph_replay(clone, settings.device, settings.budget)[0]
                clone_graph_us = clone_graph.median_us if clone_graph else None
            oracle = Oracle(workload, settings.device, settings.op, settings.alpha)
            for impl in runnable:
                for mode in settings.modes:
                    advance(f"{workload.dtype} × {workload.features}: {impl.name} {mode}")
                    measured = measure_one(impl.fn, workload, mode, settings, oracle)
                    records.append(to_record(impl, workload, mode, (clone_us, clone_graph_us), measured, settings,
                                             environment))
    return Result(settings, impls, records)


def forward_op(fn: peers.SparsemaxFn, x: torch.Tensor, g: torch.Tensor, dim: int) -> Callable[[], torch.Tensor]:
    return lambda: fn(x, dim)


def backward_op(fn: peers.SparsemaxFn, x: torch.Tensor, g: torch.Tensor, dim: int) -> Callable[[], torch.Tensor]:
    """The backward pass alone: y is computed once, its graph kept for every timed run."""
    x.requires_grad_()
    y = fn(x, dim)
    return lambda: torch.autograd.grad(y, x, g, retain_graph=True)[0]


def full_op(fn: peers.SparsemaxFn, x: torch.Tensor, g: torch.Tensor, dim: int) -> Callable[[], tuple]:
    x.requires_grad_()

    def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
        y = fn(x, dim)
        return y, torch.autograd.grad(y, x, g)[0]

    return forward_backward


MODE_OPS = {"forward": forward_op, "backward": backward_op, "full": full_op, "eager": full_op}


def with_target(loss: Callable, target: torch.Tensor) -> peers.SparsemaxFn:
    return lambda x, dim: loss(x, target)


def measure_one(fn: peers.SparsemaxFn, workload: Workload, mode: str, settings: Settings,
                oracle: "Oracle") -> Measurement:
    device, budget = settings.device, settings.budget
    try:
        x, g = workload.input(device), workload.grad(device)
        reference = eager_reference(settings.op)[1]
        if settings.op in LOSS_OPS:  # (x, target) -> a loss a row, and its gradient one a row
            target = workload.target(device)
            fn, reference, g = with_target(fn, target), with_target(reference, target), workload.loss_grad(device)
        op = MODE_OPS[mode](fn, x, g, workload.dim)
        rel_error = oracle.error(mode, op())
        peak_mb = peak_extra_mb(op, device)
        if mode == "eager":
            reference_op = full_op(reference, workload.input(device), g, workload.dim)
            timing, reference_timing = measure_alternating(op, reference_op, device, budget)
            no_graph = "eager: wall time, host included" if device.type == "cuda" else None
            return Measurement(timing, None, no_graph, rel_error, peak_mb, reference=reference_timing)
        timing = measure(op, device, budget)
        graph, graph_note = measure_graph_replay(op, device, budget) if device.type == "cuda" else (None, None)
    except Exception as error:  # one failing implementation must not end the run
        return Measurement(error=describe_error(error))
    return Measurement(timing, graph, graph_note, rel_error, peak_mb)


def relative_error(output: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """||output - ref|| / ||ref||; scale stands in for ||ref|| where ref is all zeros."""
    norm = ref.norm()
    return float((output.detach().double() - ref).norm() / (norm if norm > 0 else scale))


class Oracle:
    """The op in float64 on the workload's input, on the same device: sparsemax and entmax-1.5 by
    sorting, α-entmax by flashmax's pure-torch solver (the CPU path, checked against plain
    bisection by the tests) run to convergence. And its gradient: dx = s * g - (sum(s * g) /
    sum(s)) * s with s = y^(2 - α) on the support (1 for sparsemax: g minus its mean over the
    support; sqrt(y) for entmax-1.5). A loss: <p - onehot(target), x> + omega(p) with p by
    sorting, and g (one a row) times p - onehot(target)."""

    def __init__(self, workload: Workload, device: torch.device, op: str = "sparsemax",
                 alpha: float = peers.DEFAULT_ALPHA):
        # Rows along the last dim here; results go back to the workload's layout at the end.
        x, g = workload.input(device).double(), workload.grad(device).double()
        x, g = x.movedim(workload.dim, -1), g.movedim(workload.dim, -1)
        if op in LOSS_OPS:
            target, g = workload.target(device), workload.loss_grad(device).double()
            entmax15 = op == "entmax15_loss"
            p = (entmax15_sort if entmax15 else sparsemax_sort)(x, -1)
            self.y = peers.loss_of(p, x, target, entmax15)
            onehot = torch.nn.functional.one_hot(target, x.shape[-1]).double()
            self.dx = g.unsqueeze(-1) * (p - onehot)
            self.g_norm = g.norm()
            return
        if op == "entmax_bisect":
            self.y = reference_bisect.entmax_bisect_forward(x, x.new_full((x.shape[0], 1), alpha), 200, True)
        else:
            self.y = (sparsemax_sort if op == "sparsemax" else entmax15_sort)(x, -1)
            alpha = 2.0 if op == "sparsemax" else 1.5  # the α these ops are
        s = torch.where(self.y > 0, self.y ** (2 - alpha), 0.0)
        self.dx = s * g - (s * g).sum(-1, keepdim=True) / s.sum(-1, keepdim=True) * s
        self.y, self.dx = self.y.movedim(-1, workload.dim), self.dx.movedim(-1, workload.dim)
        # dx is all zeros when every support is one entry (randn10, wide rows): measure against g.
        self.g_norm = g.norm()

    def error(self, mode: str, output) -> float:
        if mode == "forward":
            return relative_error(output, self.y, self.y.norm())
        if mode == "backward":
            return relative_error(output, self.dx, self.g_norm)
        y, dx = output
        return max(relative_error(y, self.y, self.y.norm()), relative_error(dx, self.dx, self.g_norm))


def to_record(impl: peers.Impl, workload: Workload, mode: str, clone_us: tuple[float, float | None],
              measured: Measurement, settings: Settings, environment: dict) -> Record:
    """clone_us: the clone's (median, graph-replay) times; a clone moves 2 tensors."""
    scale = tensors_moved(settings.op, mode) / TENSORS_MOVED["forward"]
    floor_us = clone_us[0] * scale
    floor_graph_us = clone_us[1] * scale if clone_us[1] else None
    if mode == "eager":
        floor_us = measured.reference.median_us if measured.reference else math.nan
        floor_graph_us = None
    graph_us = measured.graph.median_us if measured.graph else None
    bandwidth = datasheet_bandwidth(settings.device)
    median_us = measured.timing.median_us if measured.timing else None
    rel_error = measured.rel_error
    return Record(
        impl=impl.name,
        impl_version=impl.version,
        tokens=workload.tokens,
        features=workload.features,
        dtype=workload.dtype,
        mode=mode,
        dist=workload.dist,
        op=settings.op,
        alpha=settings.alpha if settings.op == "entmax_bisect" else None,
        layout=workload.layout,
        median_us=median_us,
        p20_us=measured.timing.p20_us if measured.timing else None,
        p80_us=measured.timing.p80_us if measured.timing else None,
        graph_us=graph_us,
        graph_note=measured.graph_note,
        floor_us=floor_us,
        floor_graph_us=floor_graph_us,
        datasheet_floor_us=(workload.bytes_moved(mode, settings.op) / bandwidth * 1e6
                            if bandwidth and mode != "eager" else None),
        ratio_to_floor=median_us / floor_us if median_us else None,
        graph_ratio_to_floor=graph_us / floor_graph_us if graph_us and floor_graph_us else None,
        gbps=workload.bytes_moved(mode, settings.op) / median_us / 1e3 if median_us else None,
        rel_error=rel_error,
        # NaN compares false: a NaN error is inexact.
        inexact=None if rel_error is None else not rel_error <= inexact_above(workload.torch_dtype),
        peak_mb=measured.peak_mb,
        error=measured.error,
        **environment,
    )


def datasheet_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bandwidth for gpu, bandwidth in DATASHEET_BANDWIDTH.items() if gpu in name), None)


def describe_environment(device: torch.device) -> dict:
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        torch=torch.__version__,
        triton=peers.package_version("triton") or "not installed",
        flashmax_commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def git_commit() -> str:
    """HEAD of the checkout flashmax runs from, with "+dirty" if tracked files are modified;
    FLASHMAX_COMMIT where the checkout has no .git (a copy of the tree on a GPU machine); else
    "unknown"."""
    if os.environ.get("FLASHMAX_COMMIT"):
        return os.environ["FLASHMAX_COMMIT"]
    here = Path(flashmax.__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")

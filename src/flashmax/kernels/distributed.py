"""Triton local work of one rank for `flashmax.distributed`, without temporaries the size of
the rank's slice.

The forward is the split passes of `flashmax.kernels.sparsemax` over the slice, into the output
allocated up front: pass 1 reads the slice once (per chunk: max, a lower bound on tau, and the
candidates, stored in the output's chunk when they fit); each Newton step, taken across ranks,
reads only the candidates (and chunks that stored none); the write reads nothing else again.
The backward is the split backward of `flashmax.kernels.sparsemax` (per-chunk support sums,
then dx), with the rows' sums all-reduced across ranks in between.
"""

import math

import torch
import triton
import triton.language as tl

from .launch import LaunchCache, on_tensor_device
from ..reference import ZERO_BELOW
from .sparsemax import (PART_SIZE, STATE_MAX, STATE_PIVOT, STATE_SIZE, STATE_STEP,
                        STATE_ZERO_BELOW, SplitBackward, SplitRows, _rows, _wide)


STEP_ROWS = 256  # rows per program of the step's update


@triton.jit
def _rank_sums(EVERYONE, point, rows, mask, n_rows, world, POINTS: tl.constexpr):
    """One point's (sum, count, smallest) over every rank's [world, POINTS, 3, rows] sums, in
    rank order: the same numbers in the same order on every rank."""
    total = tl.zeros(rows.shape, tl.float64)
    count = tl.zeros(rows.shape, tl.float64)
    smallest = tl.full(rows.shape, float("inf"), tl.float64)
    for rank in range(world):
        at = EVERYONE + (rank * POINTS + point) * 3 * n_rows + rows
        total += tl.load(at, mask=mask, other=0.0)
        count += tl.load(at + n_rows, mask=mask, other=0.0)
        smallest = tl.minimum(smallest, tl.load(at + 2 * n_rows, mask=mask, other=0.0))
    return total, count, smallest


@triton.jit
def _newton_step(total, count, smallest, tau):
    """Newton's step from tau (sums of z - tau over z > tau) and whether it is final: the
    support held, and the step is small next to tau (else refine once more), as
    `flashmax.reference.newton_update` decides."""
    step = ((total - 1) / count).to(tau.dtype)
    final = (smallest > step.to(tl.float64)) & (tl.abs(step) <= tl.abs(tau + step))
    return step, final


@triton.jit
def shard_ladder_step_kernel(
    EVERYONE, POINTS, PIVOT, STEP, DONE, HI, CENTRE, NEXT_POINTS, n_rows, world,
    LADDER: tl.constexpr, BLOCK: tl.constexpr,
):
    """`flashmax.distributed`'s update after one step, in place: the torch ops of
    `TorchShard.advance` in one launch. Of each row's ascending points, the prefix with
    f >= 0 are lower bounds: Newton from the highest, and the next (f < 0) becomes HI. The
    step is exact once no float is left between the Newton point and HI."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n_rows
    pivot = tl.load(PIVOT + rows, mask=mask, other=0.0)
    step = tl.load(STEP + rows, mask=mask, other=0.0)
    hi = tl.load(HI + rows, mask=mask, other=0.0)
    done = tl.load(DONE + rows, mask=mask, other=1) != 0
    first = tl.load(POINTS + rows, mask=mask, other=0.0)
    start = first
    total, count, smallest = _rank_sums(EVERYONE, 0, rows, mask, n_rows, world, LADDER)
    lower = rows == rows  # every point so far is a lower bound
    above = hi
    for j in tl.static_range(1, LADDER):
        point = tl.load(POINTS + j * n_rows + rows, mask=mask, other=0.0)
        point_total, point_count, point_smallest = _rank_sums(EVERYONE, j, rows, mask, n_rows,
                                                              world, LADDER)
        below = lower & (point_total >= 1)
        above = tl.where(lower & ~below, point, above)
        start = tl.where(below, point, start)
        total = tl.where(below, point_total, total)
        count = tl.where(below, point_count, count)
        smallest = tl.where(below, point_smallest, smallest)
        lower = below
    new_step, final = _newton_step(total, count, smallest, start)
    new_pivot = tl.where(done, pivot, start)
    new_step = tl.where(done, step, new_step)
    new_done = done | final | ~(point > first)  # the last point is the bracket's midpoint
    hi = tl.where(done, hi, above)
    tl.store(PIVOT + rows, new_pivot, mask=mask)
    tl.store(STEP + rows, new_step, mask=mask)
    tl.store(HI + rows, hi, mask=mask)
    tl.store(DONE + rows, new_done, mask=mask)
    tl.store(CENTRE + rows, tl.where(count > 0, 1 / count, 0).to(pivot.dtype), mask=mask)
    tau = new_pivot + new_step
    for j in tl.static_range(LADDER):
        point = tau + (hi - tau) * (0.0 if j == 0 else 2.0 ** (j - LADDER))  # ladder_fractions
        tl.store(NEXT_POINTS + j * n_rows + rows, tl.where(new_done, float("nan"), point),
                 mask=mask)


STEP_LAUNCHES = LaunchCache(shard_ladder_step_kernel)  # once per Newton step


class TritonShard:
    """One rank's slice, read once; the interface of `flashmax.distributed.TorchShard`.
    `chunk` and the other keyword arguments override the split launch (tests)."""

    # Newton steps queued before the driver reads whether an earlier one finished every row.
    # Measured on two H200s at 2048 x 1048576 (benchmarks/NOTES.md, distributed v3): the host
    # takes longer to queue a step than the device to run it, so 1 only added a step (0.11
    # and 0.17 ms slower than 0 in two runs).
    lookahead = 0

    def __init__(self, x: torch.Tensor, dim: int, chunk=None, **launch):
        self.y, x, self.n_rows, n, inner, x_strides, y_strides, chunk = _rows(x, None, dim, chunk)
        self.ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.split = None
        if x.numel():
            # A narrow slice is one chunk of its own width.
            self.split = SplitRows(x, self.y, self.n_rows, n, inner, x_strides, y_strides,
                                   min(chunk, n), _wide(n, x_strides[2], y_strides[2]), **launch)

    def summary(self) -> torch.Tensor:
        """As TorchShard.summary: pass 1 over the slice, then the row pass over its candidates
        (no second read of the slice)."""
        if self.split is None:
            return torch.full((2, self.n_rows), -torch.inf, dtype=self.ctype, device=self.y.device)
        self.split.bounds()
        state = self.split.threshold()
        local_max = state[:, STATE_MAX.value]
        tau = state[:, STATE_PIVOT.value] + state[:, STATE_STEP.value]
        return torch.stack([local_max, torch.where(local_max.isfinite(), tau, -torch.inf)])

    def sums(self, row_max: torch.Tensor, taus: torch.Tensor, centre: torch.Tensor):
        """As TorchShard.sums, over the candidates: exact at points at or above every chunk's
        bound, as the driver's are (Newton rises from the reduced bound, bisection above it)."""
        if self.split is None:
            zero = torch.zeros((taus.shape[0], 1, self.n_rows), dtype=torch.float64,
                               device=taus.device)
            return torch.cat([zero, zero, zero + torch.inf], 1)
        return self.split.sums(row_max, taus, centre)

    @staticmethod
    def advance(everyone, points, pivot, step, done, hi):
        """As TorchShard.advance, in one launch that updates pivot, step, done and hi in place."""
        ladder, n_rows = points.shape
        centre = torch.empty_like(pivot)
        following = torch.empty_like(points)
        # No fused multiply-adds: the same roundings as the torch ops it replaces.
        STEP_LAUNCHES.run((triton.cdiv(n_rows, STEP_ROWS),),
                          (everyone, points, pivot, step, done, hi, centre, following),
                          (n_rows, everyone.shape[0]),
                          dict(LADDER=ladder, BLOCK=STEP_ROWS, enable_fp_fusion=False))
        return pivot, step, done, hi, centre, following

    def write(self, row_max: torch.Tensor, pivot: torch.Tensor, step: torch.Tensor):
        if self.split is not None:
            state = self.split.part.new_empty((self.n_rows, STATE_SIZE.value))
            # Ties by the rule: a tiny row's fp64 step would need every rank's candidates.
            zero_below = (pivot + step).abs() * ZERO_BELOW[state.dtype]
            for field, value in ((STATE_MAX, row_max), (STATE_PIVOT, pivot), (STATE_STEP, step),
                                 (STATE_ZERO_BELOW, zero_below)):
                state[:, field.value] = value
            self.split.write(state)
        return self.y


@on_tensor_device
def support_sums(y: torch.Tensor, grad: torch.Tensor, dim: int, chunk=None) -> torch.Tensor:
    """[2, rows] float64: sum of grad and count over the support y > 0 of each row."""
    if not y.numel():
        rows = math.prod(y.shape[:dim] + y.shape[dim + 1:])
        return torch.zeros((2, rows), dtype=torch.float64, device=y.device)
    split = SplitBackward(y, grad, dim, chunk=chunk)
    part = split.sums().view(split.n_rows, split.n_splits, PART_SIZE.value)
    return part[..., :2].double().sum(1).T.contiguous()


@on_tensor_device
def backward_write(y: torch.Tensor, grad: torch.Tensor, mean: torch.Tensor, dim: int,
                   chunk=None) -> torch.Tensor:
    """dx = s * (g - mean) with each row's mean over the whole row's support."""
    if not y.numel():
        return y.new_empty(y.shape)
    split = SplitBackward(y, grad, dim, chunk=chunk)
    # Each row's sums as one partial result: (mean, count 1).
    part = torch.zeros((split.n_rows, PART_SIZE.value), dtype=split.part.dtype, device=y.device)
    part[:, 0] = mean
    part[:, 1] = 1
    return split.write(part, 1)

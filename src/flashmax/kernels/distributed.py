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

from .sparsemax import (PART_MAX, PART_SIZE, STATE_MAX, STATE_PIVOT, STATE_SIZE, STATE_STEP,
                        SplitBackward, SplitRows, _rows, _wide)


class TritonShard:
    """One rank's slice, read once; the interface of `flashmax.distributed.TorchShard`.
    `chunk` and the other keyword arguments override the split launch (tests)."""

    def __init__(self, x: torch.Tensor, dim: int, chunk=None, **launch):
        self.y, x, self.n_rows, n, inner, x_strides, y_strides, chunk = _rows(x, None, dim, chunk)
        self.ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.split = None
        if x.numel():
            # A narrow slice is one chunk of its own width.
            self.split = SplitRows(x, self.y, self.n_rows, n, inner, x_strides, y_strides,
                                   min(chunk, n), _wide(n, x_strides[2], y_strides[2]), **launch)

    def _part(self, field) -> torch.Tensor:
        """[rows, chunks]: one field of pass 1's per-chunk results."""
        return self.split.part.view(self.n_rows, -1, PART_SIZE.value)[..., field.value]

    def row_max(self) -> torch.Tensor:
        """The rows' maxima over this slice (NaN where it holds one), from pass 1."""
        if self.split is None:
            return torch.full((self.n_rows,), -torch.inf, dtype=self.ctype, device=self.y.device)
        self.split.bounds()
        return self._part(PART_MAX).amax(-1)

    def bound(self, row_max: torch.Tensor) -> torch.Tensor:
        """The exact tau of this slice in the whole rows' coordinates (-inf for no finite entry):
        the tau of a subset of the row, so a lower bound on the row's tau, found by the row pass
        over the candidates alone (no read of the slice). Tighter than the best chunk's bound:
        fewer Newton steps, each a collective."""
        if self.split is None:
            return torch.full_like(row_max, -torch.inf)
        state = self.split.threshold()
        local_max = state[:, STATE_MAX.value]
        taus = (local_max - row_max) + (state[:, STATE_PIVOT.value] + state[:, STATE_STEP.value])
        return torch.where(local_max.isfinite(), taus, -torch.inf)

    def sums(self, row_max: torch.Tensor, taus: torch.Tensor, centre: torch.Tensor):
        """As TorchShard.sums, over the candidates: exact at points at or above every chunk's
        bound, as the driver's are (Newton rises from the reduced bound, bisection above it)."""
        if self.split is None:
            zero = torch.zeros((taus.shape[0], 1, self.n_rows), dtype=torch.float64,
                               device=taus.device)
            return torch.cat([zero, zero, zero + torch.inf], 1)
        return self.split.sums(row_max, taus, centre)

    def write(self, row_max: torch.Tensor, pivot: torch.Tensor, step: torch.Tensor):
        if self.split is not None:
            state = self.split.part.new_empty((self.n_rows, STATE_SIZE.value))
            for field, value in ((STATE_MAX, row_max), (STATE_PIVOT, pivot), (STATE_STEP, step)):
                state[:, field.value] = value
            self.split.write(state)
        return self.y


def support_sums(y: torch.Tensor, grad: torch.Tensor, dim: int, chunk=None) -> torch.Tensor:
    """[2, rows] float64: sum of grad and count over the support y > 0 of each row."""
    if not y.numel():
        rows = math.prod(y.shape[:dim] + y.shape[dim + 1:])
        return torch.zeros((2, rows), dtype=torch.float64, device=y.device)
    split = SplitBackward(y, grad, dim, chunk=chunk)
    part = split.sums().view(split.n_rows, split.n_splits, PART_SIZE.value)
    return part[..., :2].double().sum(1).T.contiguous()


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

"""Triton local work of one rank for `flashmax.distributed`, without temporaries the size of
the rank's slice.

The forward is the split passes of `flashmax.kernels.sparsemax` over the slice, into the output
allocated up front: pass 1 reads the slice once (per chunk: max, a lower bound on tau, and the
candidates, stored in the output's chunk when they fit); each Newton step, taken across ranks,
reads only the candidates (and chunks that stored none); the write reads nothing else again.
The backward cuts each row into chunks, one program per (row, chunk), whose partial sums torch
reduces over the chunks, so that a long row spreads over the whole GPU.
"""

import math

import torch
import triton
import triton.language as tl

from .sparsemax import (PART_MAX, PART_SIZE, STATE_MAX, STATE_PIVOT, STATE_SIZE,
                        STATE_STEP, SplitRows, _backward_tile, _row_offsets, _rows, _strided,
                        _support_sums, _wide, launch_config, rows_view)


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


# Entries per program of the backward: several programs per row keep every SM busy on few rows.
CHUNK = {torch.float64: 4096}
DEFAULT_CHUNK = 8192


@triton.jit
def _chunk_y_g(Yp, G, row, chunk, n_rows, n, inner, y_stride_outer, y_stride_inner, y_stride_n,
               g_stride_outer, g_stride_inner, g_stride_n, CHUNK: tl.constexpr,
               WIDE: tl.constexpr):
    """y and grad over one chunk of a row as [1, 1, CHUNK] tiles in the compute dtype."""
    y_off, mask = _row_offsets(row, chunk * CHUNK, n_rows, n, inner, y_stride_outer,
                               y_stride_inner, y_stride_n, 1, 1, CHUNK, WIDE)
    g_off, _ = _row_offsets(row, chunk * CHUNK, n_rows, n, inner, g_stride_outer, g_stride_inner,
                            g_stride_n, 1, 1, CHUNK, WIDE)
    compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
    y = tl.load(Yp + y_off, mask=mask, other=0.0).to(compute)
    g = tl.load(G + g_off, mask=mask, other=0.0).to(compute)
    return y, g, mask


@triton.jit
def shard_support_sums_kernel(Yp, G, SUMS, n_rows, n, inner,
                              y_stride_outer, y_stride_inner, y_stride_n,
                              g_stride_outer, g_stride_inner, g_stride_n,
                              CHUNK: tl.constexpr, WIDE: tl.constexpr):
    """SUMS[(sum of grad, count), row, chunk] over the support y > 0."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    y, g, _ = _chunk_y_g(Yp, G, row, chunk, n_rows, n, inner, y_stride_outer, y_stride_inner,
                         y_stride_n, g_stride_outer, g_stride_inner, g_stride_n, CHUNK, WIDE)
    total, count = _support_sums(y, g)
    n_chunks = tl.num_programs(1)
    out = SUMS + row.to(tl.int64) * n_chunks + chunk + tl.arange(0, 1)
    tl.store(out, total.to(tl.float64))
    tl.store(out + tl.num_programs(0).to(tl.int64) * n_chunks, count.to(tl.float64))


@triton.jit
def shard_backward_kernel(Yp, G, MEAN, DX, n_rows, n, inner,
                          y_stride_outer, y_stride_inner, y_stride_n,
                          g_stride_outer, g_stride_inner, g_stride_n,
                          dx_stride_outer, dx_stride_inner, dx_stride_n,
                          CHUNK: tl.constexpr, WIDE: tl.constexpr):
    """dx = s * (g - mean) over one chunk of a row, the mean over the whole row's support."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    y, g, mask = _chunk_y_g(Yp, G, row, chunk, n_rows, n, inner, y_stride_outer, y_stride_inner,
                            y_stride_n, g_stride_outer, g_stride_inner, g_stride_n, CHUNK, WIDE)
    mean = tl.load(MEAN + row + tl.arange(0, 1)).to(y.dtype)
    dx_off, _ = _row_offsets(row, chunk * CHUNK, n_rows, n, inner, dx_stride_outer,
                             dx_stride_inner, dx_stride_n, 1, 1, CHUNK, WIDE)
    tl.store(DX + dx_off, _backward_tile(y, g, mean).to(DX.dtype.element_ty), mask=mask)


def _chunking(n: int, dtype: torch.dtype, chunk=None):
    """(grid's chunks per row, CHUNK, num_warps) for rows of n entries."""
    chunk = CHUNK.get(dtype, DEFAULT_CHUNK) if chunk is None else chunk
    _, block_n, num_warps = launch_config(1, min(n, chunk), None, 1)
    return -(-n // block_n), block_n, num_warps


def _backward_rows(y, grad, dim, chunk):
    """y and grad with [outer, n, inner] views, and the launch set-up of the backward kernels."""
    y, (outer, inner, y_strides) = _strided(y, dim)
    grad, (_, _, g_strides) = _strided(grad, dim)
    n = y.shape[dim]
    n_chunks, chunk, num_warps = _chunking(max(n, 1), y.dtype, chunk)
    wide = _wide(n, y_strides[2], g_strides[2], math.prod(y.shape[dim + 1:]))  # dx contiguous
    launch = dict(CHUNK=chunk, WIDE=wide, num_warps=num_warps)
    view = (outer * inner, n, inner, *y_strides, *g_strides)
    return y, grad, (outer * inner, n_chunks), view, launch


def support_sums(y: torch.Tensor, grad: torch.Tensor, dim: int, chunk=None) -> torch.Tensor:
    """[2, rows] float64: sum of grad and count over the support y > 0 of each row."""
    y, grad, grid, view, launch = _backward_rows(y, grad, dim, chunk)
    sums = torch.zeros((2, *grid), dtype=torch.float64, device=y.device)
    if y.numel():
        shard_support_sums_kernel[grid](y, grad, sums, *view, **launch)
    return sums.sum(-1)


def backward_write(y: torch.Tensor, grad: torch.Tensor, mean: torch.Tensor, dim: int,
                   chunk=None) -> torch.Tensor:
    """dx = s * (g - mean) with each row's mean over the whole row's support."""
    dx = y.new_empty(y.shape)
    y, grad, grid, view, launch = _backward_rows(y, grad, dim, chunk)
    if y.numel():
        _, _, dx_strides = rows_view(dx, dim)
        shard_backward_kernel[grid](y, grad, mean.contiguous(), dx, *view, *dx_strides, **launch)
    return dx

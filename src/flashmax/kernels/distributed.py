"""Triton local work of one rank for `flashmax.distributed`: each pass reads the rank's slice
once, without temporaries its size.

The slice is an [outer, n, inner] strided view (as in `flashmax.kernels.sparsemax`), cut into
chunks of CHUNK entries; one program per (row, chunk) writes per-chunk partial results that
torch reduces over the chunks (rows x chunks scalars), so that a long row spreads over the
whole GPU rather than over one program. The first pass finds each chunk's maximum and its
exact tau in its own max-shifted coordinates: the local maxima, and, once the whole rows'
maxima are known, a lower bound on tau without another pass. The other passes shift entries
by the whole row's maximum, the per-row scalar every rank agreed on.
"""

import math

import torch
import triton
import triton.language as tl

from .sparsemax import (_backward_tile, _group_max, _is_bad, _row_max, _row_offsets,
                        _sparsemax_tile, _step_sums, _strided, _support_sums, _tile_threshold,
                        _wide, group_size, launch_config, rows_view)

# Entries per program: several programs per row keep every SM busy on few long rows.
CHUNK = {torch.float64: 4096}
DEFAULT_CHUNK = 8192


@triton.jit
def _chunk_z(X, ROW_MAX, row, chunk, n_rows, n, inner, stride_outer, stride_inner, stride_n,
             active, CHUNK: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr):
    """z = x - row max over one chunk of a row, as a [1, GROUP, CHUNK // GROUP] tile (-inf
    padding); nothing is read for an inactive row."""
    off, mask = _row_offsets(row, chunk * CHUNK, n_rows, n, inner, stride_outer, stride_inner,
                             stride_n, 1, GROUP, CHUNK // GROUP, WIDE)
    row_max = tl.load(ROW_MAX + row + tl.arange(0, 1))
    x = tl.load(X + off, mask=mask & active, other=-float("inf")).to(row_max.dtype)
    return x - row_max[:, None, None], mask


@triton.jit
def shard_summary_kernel(X, MAXIMA, TAUS, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                         CHUNK: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr):
    """MAXIMA[row, chunk] and TAUS[row, chunk]: the chunk's maximum (NaN if it holds one), and
    the chunk's exact tau in its own max-shifted coordinates: one read for both."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    off, mask = _row_offsets(row, chunk * CHUNK, n_rows, n, inner, stride_outer, stride_inner,
                             stride_n, 1, GROUP, CHUNK // GROUP, WIDE)
    compute: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    x = tl.load(X + off, mask=mask, other=-float("inf")).to(compute)
    group_max = _group_max(x)
    chunk_max = _row_max(group_max)
    pivot, step = _tile_threshold(x - chunk_max[:, None, None], group_max - chunk_max[:, None],
                                  GROUP)
    out = row.to(tl.int64) * tl.num_programs(1) + chunk + tl.arange(0, 1)
    tl.store(MAXIMA + out, chunk_max)
    tl.store(TAUS + out, pivot + step)


@triton.jit
def shard_sums_kernel(X, ROW_MAX, TAUS, CENTRE, STATS, n_rows, n, inner, stride_outer,
                      stride_inner, stride_n, POINTS: tl.constexpr, CHUNK: tl.constexpr,
                      GROUP: tl.constexpr, WIDE: tl.constexpr):
    """STATS[point, (sum of d - centre, count, smallest d), row, chunk] over d = z - tau > 0,
    for each row's tau at each point (TAUS[point, row]; NaN at point 0: a finished row, not
    read) and centre (CENTRE[row], near 1 / count: the terms nearly cancel, see _step_sums)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    first_tau = tl.load(TAUS + row + tl.arange(0, 1))
    active = first_tau == first_tau
    z, _ = _chunk_z(X, ROW_MAX, row, chunk, n_rows, n, inner, stride_outer, stride_inner,
                    stride_n, active[:, None, None], CHUNK, GROUP, WIDE)
    n_chunks = tl.num_programs(1)
    out = STATS + row.to(tl.int64) * n_chunks + chunk + tl.arange(0, 1)
    plane = tl.num_programs(0).to(tl.int64) * n_chunks  # num_programs(0) is n_rows
    centre = tl.load(CENTRE + row + tl.arange(0, 1))
    for point in tl.static_range(POINTS):
        tau = tl.load(TAUS + point * n_rows + row + tl.arange(0, 1))
        total, count, smallest = _step_sums(z, tau, centre)
        tl.store(out + (3 * point) * plane, total.to(tl.float64))
        tl.store(out + (3 * point + 1) * plane, count.to(tl.float64))
        tl.store(out + (3 * point + 2) * plane, smallest.to(tl.float64))


@triton.jit
def shard_write_kernel(X, Y, ROW_MAX, PIVOT, STEP, n_rows, n, inner,
                       x_stride_outer, x_stride_inner, x_stride_n,
                       y_stride_outer, y_stride_inner, y_stride_n,
                       CHUNK: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr):
    """y = max((z - pivot) - step, 0) over one chunk of a row; NaN for a bad row (not read)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    bad = _is_bad(tl.load(ROW_MAX + row + tl.arange(0, 1)))
    z, mask = _chunk_z(X, ROW_MAX, row, chunk, n_rows, n, inner, x_stride_outer,
                       x_stride_inner, x_stride_n, ~bad[:, None, None], CHUNK, GROUP, WIDE)
    pivot = tl.load(PIVOT + row + tl.arange(0, 1))
    step = tl.load(STEP + row + tl.arange(0, 1))
    y = _sparsemax_tile(z, pivot, step, bad)
    y_off, _ = _row_offsets(row, chunk * CHUNK, n_rows, n, inner, y_stride_outer, y_stride_inner,
                            y_stride_n, 1, GROUP, CHUNK // GROUP, WIDE)
    tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=mask)


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


class TritonShard:
    """One rank's slice, read in place; the interface of `flashmax.distributed.TorchShard`."""

    def __init__(self, x: torch.Tensor, dim: int, chunk=None):
        self.dim = dim
        self.x, (outer, self.inner, self.strides) = _strided(x, dim)
        self.n_rows, self.n = outer * self.inner, x.shape[dim]
        self.ctype = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.n_chunks, self.chunk, self.num_warps = _chunking(self.n, x.dtype, chunk)
        self.group = group_size(self.chunk, x.element_size(), self.num_warps)
        # The output is contiguous: its stride along dim is that of the dims after dim.
        self.wide = _wide(self.n, self.strides[2], math.prod(x.shape[dim + 1:]))
        self.view = (self.n_rows, self.n, self.inner, *self.strides)

    def _launch(self, kernel, *args, **constants):
        kernel[(self.n_rows, self.n_chunks)](
            *args, CHUNK=self.chunk, WIDE=self.wide, num_warps=self.num_warps, **constants)

    def row_max(self) -> torch.Tensor:
        """The rows' maxima over this slice, from one pass that also finds each chunk's tau."""
        if not self.n:
            return torch.full((self.n_rows,), -torch.inf, dtype=self.ctype, device=self.x.device)
        self.maxima = torch.empty((self.n_rows, self.n_chunks), dtype=self.ctype,
                                  device=self.x.device)
        self.chunk_taus = torch.empty_like(self.maxima)
        self._launch(shard_summary_kernel, self.x, self.maxima, self.chunk_taus, *self.view,
                     GROUP=self.group)
        return self.maxima.amax(-1)

    def bound(self, row_max: torch.Tensor) -> torch.Tensor:
        """The best chunk's tau in the whole rows' coordinates (no pass over x): a lower bound
        on the row's tau, up to the rounding of (chunk max - row max) + tau, ~1 ulp of 1."""
        if not self.n:
            return torch.full_like(row_max, -torch.inf)
        return ((self.maxima - row_max.unsqueeze(-1)) + self.chunk_taus).amax(-1)

    def sums(self, row_max: torch.Tensor, taus: torch.Tensor, centre: torch.Tensor):
        points = taus.shape[0]
        if not self.n:
            zero = torch.zeros((points, 1, self.n_rows), dtype=torch.float64, device=taus.device)
            return torch.cat([zero, zero, zero + torch.inf], 1)
        stats = torch.empty((points, 3, self.n_rows, self.n_chunks), dtype=torch.float64,
                            device=taus.device)
        self._launch(shard_sums_kernel, self.x, row_max, taus.contiguous(), centre, stats,
                     *self.view, POINTS=points, GROUP=self.group)
        # Each chunk's sum of d, in fp64 from its nearly exact sum of d - centre.
        stats[:, 0] += stats[:, 1] * centre.double().unsqueeze(-1)
        return torch.cat([stats[:, :2].sum(-1), stats[:, 2:].amin(-1)], 1)

    def write(self, row_max: torch.Tensor, pivot: torch.Tensor, step: torch.Tensor):
        y = self.x.new_empty(self.x.shape)
        if self.n:
            _, _, y_strides = rows_view(y, self.dim)
            self._launch(shard_write_kernel, self.x, y, row_max, pivot, step, *self.view,
                         *y_strides, GROUP=self.group)
        return y


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

"""Triton sparsemax: one read and one write per element, exact, sort-free.

Each program holds BLOCK_M whole rows in registers. In max-shifted coordinates z = x - max the
threshold tau lies in [-1, 0) and is the root of the convex piecewise-linear
f(t) = sum(max(z - t, 0)) - 1. Newton from a lower bound rises monotonically to the exact root;
a step is final when every entry of the support it used stays above the new tau, so one fused
(sum, count, min) reduction per step both advances and checks. The lower bound comes cheaply
from a subset of the row (the tau of any subset is <= the row's tau): the maxima of GROUP
entries hold nearly all of the large entries, so the expensive full-row steps are usually one or
two. A row is loaded as a [GROUP, WIDTH] tile of GROUP contiguous chunks, so that the group
maxima (down the tile's columns) are a reduction inside each thread's registers.

Every step is a chain of reductions whose latency, not the arithmetic, bounds short rows:
the launch heuristics give each row as few warps as its registers allow (one warp up to 2048
entries), so that most reductions are warp shuffles and many rows are in flight per SM.
"""

import torch
import triton
import triton.language as tl

# Rows longer than this (in elements) do not fit one program's registers.
MAX_BLOCK_N = {torch.float64: 16384}
DEFAULT_MAX_BLOCK_N = 32768
ELEMENTS_PER_PROGRAM = 2048  # short rows are batched BLOCK_M at a time up to this many elements
ELEMENTS_PER_THREAD = 128  # registers per thread for the row; more spill, fewer add latency


@triton.jit
def _add_add_min(total_a, count_a, min_a, total_b, count_b, min_b):
    return total_a + total_b, count_a + count_b, tl.minimum(min_a, min_b)


@triton.jit
def _newton_threshold(z, tau, WIDE_SUM: tl.constexpr):
    """Exact threshold of each row of z [BLOCK_M, A, B] (-inf padding allowed) from lower
    bounds tau [BLOCK_M].

    Returns (pivot, step) with tau = pivot + step and |step| <= |tau|: (z - pivot) - step
    rounds each output nearly relative to itself, where z - tau would round tau first.
    The step is
    (sum - 1) / count with sum close to 1, so the sum's rounding error becomes the outputs'
    relative error; WIDE_SUM accumulates it in float64.
    """
    pivot = tau
    step = tl.zeros_like(tau)
    done = tau != tau
    pending = tl.sum((~done).to(tl.int32), axis=0)
    while pending > 0:
        tau = pivot + step
        # Summing z - tau rather than z keeps the terms small: no cancellation when all of a
        # row lies close together (scales of 1e-3).
        d = z - tau[:, None, None]
        support = d > 0
        positive = tl.maximum(d, 0.0)
        if WIDE_SUM:
            positive = positive.to(tl.float64)
        total, count, smallest = tl.reduce(
            (positive, support.to(z.dtype), tl.where(support, d, float("inf"))), 2, _add_add_min)
        total, count, smallest = tl.reduce((total, count, smallest), 1, _add_add_min)
        new_step = ((total - 1.0) / count).to(z.dtype)
        pivot = tl.where(done, pivot, tau)
        step = tl.where(done, step, new_step)
        # Final once the support holds, and the step was small: a large step was computed
        # from z - tau with tau far away, rounded to ~|tau| ulps, so refine it once more.
        small = tl.abs(new_step) <= tl.abs(tau + new_step)
        done = done | ((smallest > new_step) & small)
        pending = tl.sum((~done).to(tl.int32), axis=0)
    return pivot, step


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_offsets(block, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                 BLOCK_M: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr,
                 WIDE: tl.constexpr):
    """Offsets and mask of BLOCK_M rows of an [outer, n, inner] view, each as a [GROUP, WIDTH]
    tile of contiguous chunks: a [BLOCK_M, GROUP, WIDTH] block."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, GROUP)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    rows64 = rows.to(tl.int64)
    base = (rows64 // inner) * stride_outer + (rows64 % inner) * stride_inner
    if WIDE:
        cols_off = cols.to(tl.int64) * stride_n
    else:
        cols_off = cols * stride_n
    mask = (rows < n_rows)[:, None, None] & (cols < n)[None, :, :]
    return base[:, None, None] + cols_off[None, :, :], mask


@triton.jit
def sparsemax_forward_kernel(
    X, Y, n_rows, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    WIDE: tl.constexpr, WIDE_SUM: tl.constexpr,
):
    block = tl.program_id(0)
    WIDTH: tl.constexpr = BLOCK_N // GROUP
    x_off, mask = _row_offsets(block, n_rows, n, inner, x_stride_outer, x_stride_inner, x_stride_n,
                               BLOCK_M, GROUP, WIDTH, WIDE)
    x = tl.load(X + x_off, mask=mask, other=-float("inf"))
    compute = tl.float64 if x.dtype == tl.float64 else tl.float32
    x = x.to(compute)
    row_max = tl.reduce(tl.reduce(x, 2, _nan_max), 1, _nan_max)
    # NaN or +inf anywhere, or every entry -inf: the whole row is NaN (as torch.softmax).
    bad = (row_max != row_max) | (row_max == float("inf")) | (row_max == -float("inf"))
    z = x - row_max[:, None, None]
    tau = tl.full([BLOCK_M], -1.0, compute)
    if GROUP > 1:
        pivot, step = _newton_threshold(tl.expand_dims(tl.max(z, axis=1), 1), tau, False)
        tau = pivot + step
    pivot, step = _newton_threshold(z, tau, WIDE_SUM)
    y = tl.maximum((z - pivot[:, None, None]) - step[:, None, None], 0.0)
    y = tl.where(bad[:, None, None], float("nan"), y)
    y_off, _ = _row_offsets(block, n_rows, n, inner, y_stride_outer, y_stride_inner, y_stride_n,
                            BLOCK_M, GROUP, WIDTH, WIDE)
    tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_add(total_a, count_a, total_b, count_b):
    return total_a + total_b, count_a + count_b


@triton.jit
def sparsemax_backward_kernel(
    Yp, G, DX, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    dx_stride_outer, dx_stride_inner, dx_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr,
):
    block = tl.program_id(0)
    y_off, mask = _row_offsets(block, n_rows, n, inner, y_stride_outer, y_stride_inner, y_stride_n,
                               BLOCK_M, 1, BLOCK_N, WIDE)
    g_off, _ = _row_offsets(block, n_rows, n, inner, g_stride_outer, g_stride_inner, g_stride_n,
                            BLOCK_M, 1, BLOCK_N, WIDE)
    y = tl.load(Yp + y_off, mask=mask, other=0.0)
    g = tl.load(G + g_off, mask=mask, other=0.0)
    compute = tl.float64 if y.dtype == tl.float64 else tl.float32
    g = g.to(compute)
    support = y.to(compute) > 0
    total, count = tl.reduce((tl.where(support, g, 0.0), support.to(compute)), 2, _add_add)
    dx = tl.where(support, g - (total / count)[:, :, None], 0.0)
    dx_off, _ = _row_offsets(block, n_rows, n, inner, dx_stride_outer, dx_stride_inner,
                             dx_stride_n, BLOCK_M, 1, BLOCK_N, WIDE)
    tl.store(DX + dx_off, dx.to(DX.dtype.element_ty), mask=mask)


def _merge(sizes, strides):
    """One (size, stride) for a run of dims, or None if they are not evenly strided."""
    kept = [(s, st) for s, st in zip(sizes, strides) if s != 1]
    if not kept:
        return 1, 0
    for (_, outer_stride), (size, stride) in zip(kept, kept[1:]):
        if outer_stride != size * stride:
            return None
    return _prod(s for s, _ in kept), kept[-1][1]


def _prod(values):
    result = 1
    for v in values:
        result *= v
    return result


def rows_view(t: torch.Tensor, dim: int):
    """t as an [outer, n, inner] strided view: (outer, inner, (stride_outer, stride_inner,
    stride_n)), or None when the dims around `dim` cannot be merged without a copy."""
    before = _merge(t.shape[:dim], t.stride()[:dim])
    after = _merge(t.shape[dim + 1:], t.stride()[dim + 1:])
    if before is None or after is None:
        return None
    return before[0], after[0], (before[1], after[1], t.stride(dim))


def _strided(t: torch.Tensor, dim: int):
    """t itself if it has an [outer, n, inner] view, else a contiguous copy; and the view."""
    view = rows_view(t, dim)
    if view is None:
        t = t.contiguous()
        view = rows_view(t, dim)
    return t, view


def _next_power_of_2(n: int) -> int:
    # Plain Python: triton's helpers are jit functions, microseconds per call on the host.
    return 1 << (n - 1).bit_length()


def launch_config(n_rows: int, n: int, num_warps=None, block_m=None):
    """(BLOCK_M, BLOCK_N, num_warps): rows per program, padded row width, warps."""
    block_n = _next_power_of_2(n)
    if block_m is None:
        block_m = max(1, min(_next_power_of_2(n_rows), ELEMENTS_PER_PROGRAM // block_n))
    if num_warps is None:
        elements = block_m * block_n
        # Measured on an H200 (benchmarks/NOTES.md): 128 entries per thread, but two warps
        # from 4096 entries on.
        num_warps = min(16, max(1, elements // (32 * ELEMENTS_PER_THREAD), min(2, elements // 2048)))
    return block_m, block_n, num_warps


def group_size(block_n: int, itemsize: int, num_warps: int, group=None) -> int:
    """Largest GROUP <= 8 whose chunks still span the layout's width (16-byte vectors per
    thread across all threads), so that group maxima stay inside each thread."""
    if group is not None:
        return group
    layout_width = 16 // itemsize * 32 * num_warps
    return max(1, min(8, block_n // layout_width))


def fits(n: int, dtype: torch.dtype) -> bool:
    return n <= MAX_BLOCK_N.get(dtype, DEFAULT_MAX_BLOCK_N)


def _wide(n: int, *stride_ns: int) -> bool:
    return any(n * abs(s) >= 2**31 for s in stride_ns)


def sparsemax_forward(x: torch.Tensor, dim: int, out=None, group=None, num_warps=None,
                      block_m=None, wide_sum=True) -> torch.Tensor:
    """Launch the forward kernel into `out` (new if None, else contiguous of x's shape and dtype).

    The other keyword arguments override the launch heuristics (for benchmarks and tests).
    """
    y = x.new_empty(x.shape) if out is None else out
    n = x.shape[dim]
    if x.numel() == 0:
        return y
    x, (outer, inner, x_strides) = _strided(x, dim)
    _, _, y_strides = rows_view(y, dim)
    n_rows = outer * inner
    block_m, block_n, num_warps = launch_config(n_rows, n, num_warps, block_m)
    group = group_size(block_n, x.element_size(), num_warps, group)
    grid = (-(-n_rows // block_m),)
    sparsemax_forward_kernel[grid](
        x, y, n_rows, n, inner, *x_strides, *y_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group,
        WIDE=_wide(n, x_strides[2], y_strides[2]), WIDE_SUM=wide_sum, num_warps=num_warps,
    )
    return y


def sparsemax_backward(y: torch.Tensor, grad: torch.Tensor, dim: int, out=None, num_warps=None,
                       block_m=None) -> torch.Tensor:
    """Launch the backward kernel into `out`, as `sparsemax_forward` does."""
    dx = y.new_empty(y.shape) if out is None else out
    n = y.shape[dim]
    if y.numel() == 0:
        return dx
    y, (outer, inner, y_strides) = _strided(y, dim)
    grad, (_, _, g_strides) = _strided(grad, dim)
    _, _, dx_strides = rows_view(dx, dim)
    n_rows = outer * inner
    block_m, block_n, num_warps = launch_config(n_rows, n, num_warps, block_m)
    grid = (-(-n_rows // block_m),)
    sparsemax_backward_kernel[grid](
        y, grad, dx, n_rows, n, inner, *y_strides, *g_strides, *dx_strides,
        BLOCK_M=block_m, BLOCK_N=block_n,
        WIDE=_wide(n, y_strides[2], g_strides[2], dx_strides[2]), num_warps=num_warps,
    )
    return dx

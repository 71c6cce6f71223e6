"""Triton α-entmax: rows in registers, safeguarded Newton on τ, one read and one write.

The iteration is `flashmax.reference_bisect`'s (its docstring argues why it converges for every
α > 1), run on BLOCK_M whole rows per program: each step is one fused (Σp, Σp/d) reduction over
the registers, rows stop when converged, and the loop ends when every row of the program is
done or after n_iter steps: no host synchronisation, so capturable in a CUDA graph. A first
solve on the rows' group maxima (as sparsemax's kernel and the CPU path do) gives the full
rows a starting τ from which they need about half the steps; n_iter bounds each solve.

Precision: float32 rows keep z = (α−1)(x − max) and τ in float64, so that d = z − τ is exact to
float32 precision even for entries just above τ (for α > 2 they get d^k with k < 1, where an
absolute error in d shows); the powers and sums are float32, via exp2/log2. float64 rows are
float64 throughout; float16/bfloat16 are computed as float32 and rounded once.

Rows longer than the in-register limit are streamed in chunks by one program each: one pass
for the max, one per step, one that writes.
"""

import triton
import triton.language as tl

from .launch import on_tensor_device
from .sparsemax import (_add_add, _is_bad, _load_rows, _load_y_g, _nan_max, _row_offsets, _rows,
                        _store_rows, _strided, _tile_max, _wide, group_size, launch_config,
                        row_align, rows_view)
from ..reference_bisect import TOLERANCE_ULPS

_TOLERANCE_ULPS = tl.constexpr(TOLERANCE_ULPS)  # jit functions read only constexpr globals


@triton.jit
def _add5(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4


@triton.jit
def _row_alpha(A, block, n_rows, inner, a_stride_outer, a_stride_inner, BLOCK_M: tl.constexpr):
    """α of BLOCK_M rows, from its [outer, 1, inner] view (stride 0 where broadcast)."""
    off, mask = _row_offsets(block, 0, n_rows, 1, inner, a_stride_outer, a_stride_inner, 0,
                             BLOCK_M, 1, 1, False)
    return tl.reshape(tl.load(A + off, mask=mask, other=2.0), [BLOCK_M])


@triton.jit
def _powers(z, tau, k):
    """(p, p / d) over a [BLOCK_M, A, B] tile, d = z − τ in the powers' dtype k.dtype:
    p = d_+^k, exactly d for k = 1 (α = 2 is sparsemax to the last bit of d).

    With float64 z and float32 powers, log2(d) gets the first-order correction for d's
    rounding to float32: k log2(d) amplifies it by k, which grows without bound as α → 1.
    """
    d_wide = z - tau[:, None, None]
    d = d_wide.to(k.dtype)
    support = d > 0
    d_safe = tl.where(support, d, 1.0)
    inv_d = 1.0 / d_safe
    log2_d = tl.log2(d_safe)
    if d_wide.dtype != d.dtype:
        rounding = (d_wide - d_safe.to(d_wide.dtype)).to(d.dtype)
        log2_d += tl.where(support, rounding * inv_d * 1.4426950408889634, 0.0)
    kk = k[:, None, None]
    p = tl.where(kk == 1.0, d_safe, tl.exp2(kk * log2_d))
    p = tl.where(support, p, 0.0)
    return p, p * inv_d


@triton.jit
def _power_sums(z, tau, k):
    """(Σp, Σp/d) per row of a [BLOCK_M, A, B] tile."""
    p, slope = _powers(z, tau, k)
    total, slope_total = tl.reduce((p, slope), 2, _add_add)
    return tl.reduce((total, slope_total), 1, _add_add)


@triton.jit
def _setup(row_max, alpha, n, ZTYPE: tl.constexpr, PTYPE: tl.constexpr):
    """Per row: (bad, α − 1 in ZTYPE, k and tolerance in PTYPE, lower and upper bound on τ
    in ZTYPE)."""
    bad = _is_bad(row_max) | ~((alpha > 1) & (alpha < float("inf")))
    am1 = tl.where(bad, 1.0, alpha - 1).to(ZTYPE)
    k = (1 / am1).to(PTYPE)
    eps: tl.constexpr = 2.220446049250313e-16 if PTYPE == tl.float64 else 1.1920928955078125e-07
    tol = _TOLERANCE_ULPS * eps * tl.maximum(k, 1.0)
    lo = tl.full(am1.shape, -1.0, ZTYPE)
    hi = -tl.exp2(-am1 * tl.log2(tl.zeros_like(am1) + n))  # n may be a constexpr 1
    return bad, am1, k, tol, lo, hi


@triton.jit
def _start(tol, lo, bad):
    """The iteration's state before the first step: (τ, f before, τ out, Σp out, done)."""
    f_before = tl.full(tol.shape, float("inf"), tol.dtype)
    return lo, f_before, lo, tl.full(tol.shape, 1.0, tol.dtype), bad


@triton.jit
def _advance(total, slope_total, k, tol, tau, lo, hi, f_before, tau_out, sum_out, done):
    """One safeguarded step (`reference_bisect.newton_bisect_step`) for the rows not done;
    records the evaluated τ and Σp of each row still running."""
    f = total - 1
    below_root = f > 0
    tau_out = tl.where(done, tau_out, tau)
    sum_out = tl.where(done, sum_out, total)
    new_lo = tl.where(below_root, tau, lo)
    new_hi = tl.where(below_root, hi, tau)
    newton = tau + (f / (k * slope_total)).to(tau.dtype)
    mid = new_lo + (new_hi - new_lo) * 0.5
    use_newton = (newton > new_lo) & (newton < new_hi) & (2 * tl.abs(f) <= tl.abs(f_before))
    converged = (tl.abs(f) <= tol) | (mid == new_lo) | (mid == new_hi)
    lo = tl.where(done, lo, new_lo)
    hi = tl.where(done, hi, new_hi)
    f_before = tl.where(done, f_before, f)
    done = done | converged
    tau = tl.where(done, tau, tl.where(use_newton, newton, mid))
    return tau, lo, hi, f_before, tau_out, sum_out, done


@triton.jit
def _remaining(done, it, n_iter):
    return tl.where(it < n_iter, tl.sum((~done).to(tl.int32), axis=0), 0)


@triton.jit
def _solve(z, k, tol, lo, hi, done, n_iter):
    """At most n_iter steps from τ = lo on each row of a [BLOCK_M, A, B] tile in registers:
    (τ last evaluated, Σp there, lo). lo is the largest τ seen with Σp > 1: a lower bound on
    the root of any superset of each row (more terms, larger Σp)."""
    tau, f_before, tau_out, sum_out, done = _start(tol, lo, done)
    it = tl.full([], 0, tl.int32)
    while _remaining(done, it, n_iter) > 0:
        total, slope_total = _power_sums(z, tau, k)
        tau, lo, hi, f_before, tau_out, sum_out, done = _advance(
            total, slope_total, k, tol, tau, lo, hi, f_before, tau_out, sum_out, done)
        it += 1
    return tau_out, sum_out, lo


@triton.jit
def _output_tile(z, tau_out, sum_out, k, bad, ENSURE_SUM_ONE: tl.constexpr):
    p, _ = _powers(z, tau_out, k)
    if ENSURE_SUM_ONE:
        p = p / sum_out[:, None, None]
    return tl.where(bad[:, None, None], float("nan"), p)


@triton.jit
def entmax_bisect_forward_kernel(
    X, A, Y, n_rows, n, inner, n_iter,
    x_stride_outer, x_stride_inner, x_stride_n,
    a_stride_outer, a_stride_inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr,
    ENSURE_SUM_ONE: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    """BLOCK_M whole rows per program, held in registers as [GROUP, WIDTH] tiles: one read,
    one write. As on the CPU path, τ is first bounded from below by solving on the maxima of
    the GROUP chunks (down axis 1, inside each thread), at 1/GROUP of a full step's cost; the
    steps over the full rows then start from that bound."""
    block = tl.program_id(0)
    WIDTH: tl.constexpr = BLOCK_N // GROUP
    PTYPE: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    x = _load_rows(X, block, n_rows, n, inner, x_stride_outer, x_stride_inner, x_stride_n,
                   BLOCK_M, GROUP, WIDTH, WIDE, ROW_ALIGN)
    alpha = _row_alpha(A, block, n_rows, inner, a_stride_outer, a_stride_inner, BLOCK_M)
    row_max = _tile_max(x)
    bad, am1, k, tol, lo, hi = _setup(row_max, alpha, n, tl.float64, PTYPE)
    z = am1[:, None, None] * (x.to(tl.float64) - row_max.to(tl.float64)[:, None, None])
    if GROUP > 1:
        _, _, lo = _solve(tl.expand_dims(tl.max(z, axis=1), 1), k, tol, lo, hi, bad, n_iter)
    tau_out, sum_out, _ = _solve(z, k, tol, lo, hi, bad, n_iter)
    y = _output_tile(z, tau_out, sum_out, k, bad, ENSURE_SUM_ONE)
    _store_rows(Y, y, block, n_rows, n, inner, y_stride_outer, y_stride_inner, y_stride_n,
                BLOCK_M, GROUP, WIDTH, WIDE, ROW_ALIGN)


@triton.jit
def entmax_bisect_forward_streamed_kernel(
    X, A, Y, n_rows, n, inner, n_iter,
    x_stride_outer, x_stride_inner, x_stride_n,
    a_stride_outer, a_stride_inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    CHUNK: tl.constexpr, WIDE: tl.constexpr, ENSURE_SUM_ONE: tl.constexpr,
):
    """One row per program, streamed CHUNK entries at a time: a pass for the max, a pass per
    step, and a pass that writes."""
    row = tl.program_id(0)
    PTYPE: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    row_max = tl.full([1], -float("inf"), PTYPE)
    for start in range(0, n, CHUNK):
        off, mask = _row_offsets(row, start, n_rows, n, inner, x_stride_outer, x_stride_inner,
                                 x_stride_n, 1, 1, CHUNK, WIDE)
        x = tl.load(X + off, mask=mask, other=-float("inf")).to(PTYPE)
        row_max = _nan_max(row_max, _tile_max(x))
    alpha = _row_alpha(A, row, n_rows, inner, a_stride_outer, a_stride_inner, 1)
    bad, am1, k, tol, lo, hi = _setup(row_max, alpha, n, tl.float64, PTYPE)
    shift = row_max.to(tl.float64)[:, None, None]
    tau, f_before, tau_out, sum_out, done = _start(tol, lo, bad)
    it = tl.full([], 0, tl.int32)
    while _remaining(done, it, n_iter) > 0:
        total = tl.zeros([1], PTYPE)
        slope_total = tl.zeros([1], PTYPE)
        for start in range(0, n, CHUNK):
            off, mask = _row_offsets(row, start, n_rows, n, inner, x_stride_outer,
                                     x_stride_inner, x_stride_n, 1, 1, CHUNK, WIDE)
            x = tl.load(X + off, mask=mask, other=-float("inf")).to(tl.float64)
            chunk_sums = _power_sums(am1[:, None, None] * (x - shift), tau, k)
            total, slope_total = _add_add(total, slope_total, *chunk_sums)
        tau, lo, hi, f_before, tau_out, sum_out, done = _advance(
            total, slope_total, k, tol, tau, lo, hi, f_before, tau_out, sum_out, done)
        it += 1
    for start in range(0, n, CHUNK):
        off, mask = _row_offsets(row, start, n_rows, n, inner, x_stride_outer, x_stride_inner,
                                 x_stride_n, 1, 1, CHUNK, WIDE)
        x = tl.load(X + off, mask=mask, other=-float("inf")).to(tl.float64)
        y = _output_tile(am1[:, None, None] * (x - shift), tau_out, sum_out, k, bad,
                         ENSURE_SUM_ONE)
        y_off, _ = _row_offsets(row, start, n_rows, n, inner, y_stride_outer, y_stride_inner,
                                y_stride_n, 1, 1, CHUNK, WIDE)
        tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gradient_sums(y, g, alpha):
    """Per row of a [BLOCK_M, A, B] tile, with s = y^(2−α) on the support y > 0:
    (Σs, Σgs, Σgy, Σ g y ln y, Σ y ln y)."""
    support = y > 0
    y_safe = tl.where(support, y, 1.0)
    log2_y = tl.log2(y_safe)
    s = tl.where(support, tl.exp2((2 - alpha[:, None, None]) * log2_y), 0.0)
    g = tl.where(support, g, 0.0)
    y_ln_y = y_safe * log2_y * 0.6931471805599453
    sums = tl.reduce((s, g * s, g * y, g * y_ln_y, tl.where(support, y_ln_y, 0.0)), 2, _add5)
    return tl.reduce(sums, 1, _add5)


@triton.jit
def _gradient_tile(y, g, alpha, q):
    """dx = s (g − q) on the support, 0 elsewhere."""
    support = y > 0
    s = tl.exp2((2 - alpha[:, None, None]) * tl.log2(tl.where(support, y, 1.0)))
    return tl.where(support, s * (g - q[:, None, None]), 0.0)


@triton.jit
def _alpha_gradient(alpha, s_total, gs_total, gy_total, gylny_total, ylny_total):
    """(q = Σgs / Σs, dα) per row; rows without support (NaN rows) get zeros."""
    has_support = s_total > 0
    q = gs_total / tl.where(has_support, s_total, 1.0)
    am1 = alpha - 1
    d_alpha = (gy_total - q) / (am1 * am1) - (gylny_total - q * ylny_total) / am1
    return tl.where(has_support, q, 0.0), tl.where(has_support, d_alpha, 0.0)


@triton.jit
def entmax_bisect_backward_kernel(
    Yp, G, A, DX, DA, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    a_stride_outer, a_stride_inner,
    dx_stride_outer, dx_stride_inner, dx_stride_n,
    da_stride_outer, da_stride_inner,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    """The entmax package's gradients w.r.t. x and α: BLOCK_M whole rows per program."""
    block = tl.program_id(0)
    compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
    y, g, _ = _load_y_g(Yp, G, block, 0, n_rows, n, inner, y_stride_outer, y_stride_inner,
                         y_stride_n, g_stride_outer, g_stride_inner, g_stride_n, BLOCK_M,
                         BLOCK_N, WIDE, ROW_ALIGN)
    alpha = _row_alpha(A, block, n_rows, inner, a_stride_outer, a_stride_inner,
                       BLOCK_M).to(compute)
    q, d_alpha = _alpha_gradient(alpha, *_gradient_sums(y, g, alpha))
    _store_rows(DX, _gradient_tile(y, g, alpha, q), block, n_rows, n, inner,
                dx_stride_outer, dx_stride_inner, dx_stride_n, BLOCK_M, 1, BLOCK_N, WIDE,
                ROW_ALIGN)
    da_off, da_mask = _row_offsets(block, 0, n_rows, 1, inner, da_stride_outer,
                                   da_stride_inner, 0, BLOCK_M, 1, 1, False)
    tl.store(DA + da_off, tl.reshape(d_alpha, [BLOCK_M, 1, 1]).to(DA.dtype.element_ty),
             mask=da_mask)


@triton.jit
def entmax_bisect_backward_streamed_kernel(
    Yp, G, A, DX, DA, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    a_stride_outer, a_stride_inner,
    dx_stride_outer, dx_stride_inner, dx_stride_n,
    da_stride_outer, da_stride_inner,
    CHUNK: tl.constexpr, WIDE: tl.constexpr,
):
    """The same, one row per program streamed CHUNK entries at a time: a pass for the sums, a
    pass that writes."""
    row = tl.program_id(0)
    compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
    alpha = _row_alpha(A, row, n_rows, inner, a_stride_outer, a_stride_inner, 1).to(compute)
    s_total = tl.zeros([1], compute)
    gs_total = tl.zeros([1], compute)
    gy_total = tl.zeros([1], compute)
    gylny_total = tl.zeros([1], compute)
    ylny_total = tl.zeros([1], compute)
    for start in range(0, n, CHUNK):
        y, g, mask = _load_y_g(Yp, G, row, start, n_rows, n, inner, y_stride_outer,
                               y_stride_inner, y_stride_n, g_stride_outer, g_stride_inner,
                               g_stride_n, 1, CHUNK, WIDE)
        s_total, gs_total, gy_total, gylny_total, ylny_total = _add5(
            s_total, gs_total, gy_total, gylny_total, ylny_total, *_gradient_sums(y, g, alpha))
    q, d_alpha = _alpha_gradient(alpha, s_total, gs_total, gy_total, gylny_total, ylny_total)
    for start in range(0, n, CHUNK):
        y, g, mask = _load_y_g(Yp, G, row, start, n_rows, n, inner, y_stride_outer,
                               y_stride_inner, y_stride_n, g_stride_outer, g_stride_inner,
                               g_stride_n, 1, CHUNK, WIDE)
        dx_off, _ = _row_offsets(row, start, n_rows, n, inner, dx_stride_outer,
                                 dx_stride_inner, dx_stride_n, 1, 1, CHUNK, WIDE)
        tl.store(DX + dx_off, _gradient_tile(y, g, alpha, q).to(DX.dtype.element_ty), mask=mask)
    da_off, da_mask = _row_offsets(row, 0, n_rows, 1, inner, da_stride_outer, da_stride_inner,
                                   0, 1, 1, 1, False)
    tl.store(DA + da_off, tl.reshape(d_alpha, [1, 1, 1]).to(DA.dtype.element_ty), mask=da_mask)


# Compute-bound (exp2/log2 per entry per step): more warps than sparsemax's copy-like kernels.
ELEMENTS_PER_THREAD = 32


def _warps(n_rows: int, n: int, num_warps, block_m):
    block_m, block_n, default_warps = launch_config(n_rows, n, num_warps, block_m)
    if num_warps is None:
        num_warps = min(16, max(default_warps, block_m * block_n // (32 * ELEMENTS_PER_THREAD)))
    return block_m, block_n, num_warps


def _alpha_strides(alpha, dim: int):
    alpha, (_, _, (stride_outer, stride_inner, _)) = _strided(alpha, dim)
    return alpha, (stride_outer, stride_inner)


@on_tensor_device
def entmax_bisect_forward(x, alpha, dim: int, n_iter: int, ensure_sum_one: bool, out=None,
                          num_warps=None, block_m=None, chunk=None, group=None):
    """Launch the forward kernel into `out` (new if None, else contiguous of x's shape/dtype).

    alpha: x's shape with size 1 along dim (any strides, 0 where broadcast), one α per row.
    Rows longer than `chunk` (default: the dtype's in-register limit) are streamed. The other
    keyword arguments override the launch heuristics (for benchmarks and tests).
    """
    if x.numel() == 0:
        return x.new_empty(x.shape) if out is None else out
    y, x, n_rows, n, inner, x_strides, y_strides, chunk = _rows(x, out, dim, chunk)
    alpha, a_strides = _alpha_strides(alpha, dim)
    args = (x, alpha, y, n_rows, n, inner, n_iter, *x_strides, *a_strides, *y_strides)
    wide = _wide(n, x_strides[2], y_strides[2])
    if n > chunk:
        _, block_n, num_warps = _warps(1, chunk, num_warps, 1)
        entmax_bisect_forward_streamed_kernel[(n_rows,)](
            *args, CHUNK=block_n, WIDE=wide, ENSURE_SUM_ONE=ensure_sum_one, num_warps=num_warps)
        return y
    block_m, block_n, num_warps = _warps(n_rows, n, num_warps, block_m)
    group = min(group_size(block_n, x.element_size(), num_warps, group), block_n)
    entmax_bisect_forward_kernel[(-(-n_rows // block_m),)](
        *args, BLOCK_M=block_m, BLOCK_N=block_n, GROUP=group, WIDE=wide,
        ENSURE_SUM_ONE=ensure_sum_one, ROW_ALIGN=row_align(x, n, x_strides, y_strides),
        num_warps=num_warps)
    return y


@on_tensor_device
def entmax_bisect_backward(y, grad, alpha, dim: int, out=None, num_warps=None, block_m=None,
                           chunk=None):
    """Launch the backward kernel: (dx of y's shape and dtype, dα of alpha's shape and dtype)."""
    d_alpha = alpha.new_empty(alpha.shape)
    if y.numel() == 0:
        return (y.new_empty(y.shape) if out is None else out), d_alpha.zero_()
    dx, y, n_rows, n, inner, y_strides, dx_strides, chunk = _rows(y, out, dim, chunk)
    grad, (_, _, g_strides) = _strided(grad, dim)
    alpha, a_strides = _alpha_strides(alpha, dim)
    _, _, (da_outer, da_inner, _) = rows_view(d_alpha, dim)
    args = (y, grad, alpha, dx, d_alpha, n_rows, n, inner, *y_strides, *g_strides, *a_strides,
            *dx_strides, da_outer, da_inner)
    wide = _wide(n, y_strides[2], g_strides[2], dx_strides[2])
    if n > chunk:
        _, block_n, num_warps = launch_config(1, chunk, num_warps, 1)
        entmax_bisect_backward_streamed_kernel[(n_rows,)](
            *args, CHUNK=block_n, WIDE=wide, num_warps=num_warps)
        return dx, d_alpha
    block_m, block_n, num_warps = launch_config(n_rows, n, num_warps, block_m)
    entmax_bisect_backward_kernel[(-(-n_rows // block_m),)](
        *args, BLOCK_M=block_m, BLOCK_N=block_n, WIDE=wide,
        ROW_ALIGN=row_align(y, n, y_strides, g_strides, dx_strides), num_warps=num_warps)
    return dx, d_alpha

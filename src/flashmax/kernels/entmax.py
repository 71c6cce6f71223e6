"""Triton entmax-1.5: one read and one write per element, exact, sort-free.

The layout, launch heuristics and strided [outer, n, inner] views are sparsemax's (imported from
`flashmax.kernels.sparsemax`). In z = (x - max) / 2 the threshold tau lies in [-1, 0) and is the
root of sum(max(z - t, 0)^2) = 1. Newton from a lower bound (on the convex, decreasing
F(t) = ||max(z - t, 0)||_2 - 1) rises monotonically but only converges, so it serves to find
the support: each step's fused reduction (sums of d and of centred d^2, count, smallest of
d = z - tau over d > 0) also gives the set's closed-form tau (the smaller root of a quadratic),
which is final when every entry of the set stays above it. The lower bound is the exact tau of
the group maxima, as for sparsemax. The sums are in the compute dtype, fp32 for fp32/fp16/bf16
(`_entmax_sums` says why that is exact enough).

Rows longer than one program's registers run sparsemax's split passes (`SplitRows`,
`SplitBackward`) with entmax-1.5's parts: a chunk's bound is twice the exact tau of its group
maxima in x - max, the row pass runs the Newton above over the chunks' candidates, and the
backward's per-chunk sums are those of s g and s.

The same threshold also drives the fused losses (`loss_kernel`): the forward reads x once and
writes one loss per row; the backward reads x again and writes p - onehot(target), recomputing
the threshold in registers rather than storing p (the same memory traffic as storing tau, and
no state to keep).
"""

import functools

import torch
import triton
import triton.language as tl

from .launch import LaunchCache, on_tensor_device
from .sparsemax import (GRADIENT_ROW_STRIDES, MAX_DRIFT, ROW_THREAD_ENTRIES, SPLIT_MANY_ROWS,
                        STATE_MAX, STATE_PIVOT, STATE_SIZE, STATE_STEP, STATE_ZERO_BELOW,
                        SplitBackward, SplitRows, TOP_TWO_MARGIN, WIDE_GROUPS_FROM, _add_add,
                        _candidate_extent, _candidate_values, _compute_dtype, _dense_chunk,
                        _entry_offsets, _group_max, _held_candidates, _is_bad, _load_raw_rows,
                        _load_y_g, _map_rows, _next_power_of_2, _row_max_and_start, _row_partials,
                        _sparsemax_top_two_start, _split_gradient_chunk, _split_row_start,
                        _split_y_g_chunk, _store_partials, _store_rows, _strided, _support_found,
                        _tile_threshold, _wide, kept_launch, launch_backward, launch_forward,
                        max_block_n, row_align, rows_launch)

# Rows of at least this many entries, by entry size, held one a program take sparsemax's
# spanning groups (`rows_launch`'s wide_groups_from: 32 in fp32). H200 (NOTES, v62): fp32
# 16384 uniform and randn x 0.01 rows 7-9% faster, randn 2-3% slower; 32768 2-4% faster on every
# distribution. 2-byte rows (16 spanning groups) lost 7-8% on uniform rows, gained 6% at 32768
# randn.
WIDE_GROUPS_FROM_BY_SIZE = {4: 16384}
# 2-byte rows of these widths (block_n) held one a program take this many warps (`rows_launch`'s
# half_warps). H100 (NOTES v79): bf16 16384 over 8 warps (128 registers) against 4 (254),
# forward 6-10% faster at 256-8192 rows on randn and uniform rows; 4096 and 8192 keep 2 and 4
# (2, 8 and 16 warps slower there), 32768 its 8; fp32 16384 within 3% either way, so it keeps 4.
HALF_ONE_ROW_WARPS = {16384: 8}
# Newton finds the support in a few steps; the cap guards against rounding cycles (no hang).
MAX_STEPS = tl.constexpr(64)
# 2-byte rows of at least this many entries (block_n) held one a program sum the Newton steps
# with selects on the mask (`_entmax_sums`' SELECT_FREE off), the others without. H100 (NOTES
# v80, v82): bf16 16384 without selects took 182 registers, one 8-warp program a SM, forward
# 59.5 -> 81 us on randn rows (every cap and warp count tried was slower than the selects),
# 32768 alike either way. Without selects, against with: fp32 12000-32768 uniform rows 10-15%
# faster, bf16 rows of 16-256 entries 4-19%, 1024-2048 entries 3-10%, split rows up to 10%.
SELECTS_FROM_2BYTE_WIDTH = tl.constexpr(16384)
# entmax-1.5's forward caps the registers of rows of these widths (`launch_rows`' register_caps:
# (entry bytes, block_n): (cap, from programs a SM)). H100 (NOTES v80, v82), sums without
# selects, 2048 rows: uncapped 2-14% slower than with selects; at 168 registers uniform rows
# 4-7% faster (fp32 4096 30.6 -> 28.5 us), randn 1-4%; 128, 152 and 184, or other warps, no
# better (v83). bf16 short rows at 80, as sparsemax's (v83): 1048576 x 16 2.7-3.6% faster,
# 1048576 x 64 1.4%, 262144 x 256 1-2%; one-warp programs (2048 x 1024) 5-50% slower, so
# only in launches of many programs.
ENTMAX_REGISTER_CAPS = {(size, block_n): (168, 0) for size in (2, 4) for block_n in (4096, 8192)}
ENTMAX_REGISTER_CAPS.update({(2, block_n): (80, 64) for block_n in (16, 64, 256)})
# The fused loss (no register caps) sums with selects from this width (block_n) on. H100 (NOTES
# v82), without selects against with: 2048 x 1024-2048 and 16384 x 128 4-12% faster; from 4096
# mixed (bf16 randn 4-6% slower at 4096-8192, fp32 randn 5% at 32768, fp32 uniform 3-10%
# faster at 4096-16384).
LOSS_SELECTS_FROM_WIDTH = tl.constexpr(4096)
# The split row pass's tile (`SplitRows`), by n_rows >= THRESHOLD_TILE_ROWS: entries of
# candidates, or of a chunk that stored none, summed at a time over tile / 1024 warps, one
# program a row. H200 (NOTES, v37c): with few rows 8192 beat 4096 on rows of large supports
# (8-32 x 1048576 and 128 x 262144: rand 6-20%, randn x 0.01 23-34% faster) and lost 3-7% on
# randn; at 512 x 131072 4096 won on every distribution (7-9%). The boundary lies between.
THRESHOLD_TILE = {False: 8192, True: 4096}
THRESHOLD_TILE_ROWS = 256
# Split pass 1's bound (`_entmax_chunk_bound`): a Newton iterate for the chunk's group maxima's
# tau stopped once at most this many of them lie above it (0: their exact tau). H200 (NOTES,
# v39): on randn rows 7-12% faster than exact from 8 x 1048576 to 512 x 131072, fp32 and
# bf16; 512 is faster still at 512 rows but slower at 32; rand and randn x 0.01 unchanged.
ENTMAX_BOUND_GROUPS = 128
# Pass 1's Newton steps towards a chunk's share of the row (as sparsemax's SPLIT_SHARE_STEPS,
# each a reduction over the group maxima, on dense chunks only since v74), by n_rows >=
# SPLIT_MANY_ROWS; from there none for 2-byte entries
# (`Entmax15SplitRows.default_share_steps`). H200 (NOTES v45, v46): below 8
# rows 3 steps took uniform and randn x 0.01 rows 28-42% lower (1 x 4194304 randn x 0.01
# 5.25 -> 3.02 ms) for randn +5%; from 8 rows 1 step takes those 4-26% lower (32 x 1048576
# randn x 0.01 1.60 -> 1.18 ms) for randn 0-2% in fp32 but 5-7% in bf16, whose chunks take
# half the time to read.
ENTMAX_SHARE_STEPS = {False: 3, True: 1}


@triton.jit
def _add4_min(s1_a, s2_a, count_a, min_a, s1_b, s2_b, count_b, min_b):
    return s1_a + s1_b, s2_a + s2_b, count_a + count_b, tl.minimum(min_a, min_b)


@triton.jit
def _nonnegative_key(d):
    """d's bits, unsigned: ordered as the non-negative d are, with the negatives and NaN after
    them all, so that an unsigned minimum finds the smallest d >= 0 with no select
    (`_entmax_sums`). One instruction an entry fewer than keying on the positive d alone
    (bits less one): H100 (NOTES v88), bf16 short rows 5-7% faster, the rest -4% to +1%."""
    if d.dtype.primitive_bitwidth == 64:
        return d.to(tl.uint64, bitcast=True)
    else:
        return d.to(tl.uint32, bitcast=True)


@triton.jit
def _smallest_nonnegative(key, dtype: tl.constexpr):
    """The smallest d >= 0 from the minimum of `_nonnegative_key`s (inf where none is): the
    smallest positive d, or 0 where an entry lies at tau itself, never above the smallest
    positive d, so the exactness test that uses it can only fail, never pass, for it."""
    d = key.to(dtype, bitcast=True)
    return tl.where(d >= 0, d, float("inf"))


@triton.jit
def _entmax_sums(z, tau, centre, SELECT_FREE: tl.constexpr = True):
    """Over a [BLOCK_M, GROUP, WIDTH] tile, for d = z - tau: (sum of d, sum of d^2 - a, count,
    smallest d) over d > 0, per row, with a = centre (without selects the smallest d >= 0:
    `_smallest_nonnegative`).

    A step rests on s2 - 1, s2 = sum of d^2 close to 1 near the root (its absolute error becomes
    about the outputs' relative error), and on s1 = sum of d (relative error only: a sum of
    positive terms). With a = 1 / (the previous count), s2 - 1 = sum(d^2 - a) + (count a - 1).
    Near the root of a nearly tied row every d is close to 1 / sqrt(count): the terms d^2 - a
    are nearly zero and their compute-dtype sum nearly exact, with no widening to fp64 (1/64 of
    the fp32 rate on an H200). Each d^2 - a is one fma, rounded once relative to itself;
    `_entmax_update` adds the correction back. Axis 1 lies inside a thread, so it goes first.
    SELECT_FREE: no term selects on the mask d > 0: it is a 0/1 float, a product or a maximum
    instead, and the smallest d an unsigned minimum (`_nonnegative_key`). Selects on the mask made
    LLVM pack it into bits and unpack them at each use (NOTES v80). Otherwise the terms are
    selected, s1 summed centred too (d - sqrt(a)) and the centring undone on the total: fewer
    registers (`SELECTS_FROM_2BYTE_WIDTH`).
    """
    d = z - tau[:, None, None]
    if SELECT_FREE:
        inside = (d > 0).to(z.dtype)
        positive = tl.maximum(d, 0.0)
        s1, s2, count, key = tl.reduce(
            (positive, tl.fma(positive, positive, -centre[:, None, None]) * inside, inside,
             _nonnegative_key(d)), 1, _add4_min)
        s1, s2, count, key = tl.reduce((s1, s2, count, key), 1, _add4_min)
        smallest = _smallest_nonnegative(key, z.dtype)
    else:
        support = d > 0
        a = centre[:, None, None]
        s1, s2, count, smallest = tl.reduce(
            (tl.where(support, d - tl.sqrt(a), 0.0), tl.where(support, tl.fma(d, d, -a), 0.0),
             support.to(z.dtype), tl.where(support, d, float("inf"))), 1, _add4_min)
        s1, s2, count, smallest = tl.reduce((s1, s2, count, smallest), 1, _add4_min)
        s1 = tl.fma(count, tl.sqrt(centre), s1)  # s1 needs only relative accuracy
    return s1, s2, count, smallest


@triton.jit
def _entmax_update(s1, s2, count, smallest, pivot, step, centre, done):
    """Advance (pivot, step, centre, done) from the centred sums (`_entmax_sums`) at
    tau = pivot + step.

    The set's closed form, the smaller root delta of count d^2 - 2 s1 d + s2 - 1 (written
    without cancellation), is the set's exact tau when every entry of the set stays above it,
    taken if it is also small (a large one came from d rounded to ~|tau| ulps: refined once
    more), and final if the sums drifted little as well. Otherwise a Newton step on the convex
    norm form F(t) = sqrt(s2(t)) - 1 (a lower bound; see `reference_entmax.entmax15_threshold`);
    one too small to move tau ends the search as well.
    """
    tau = pivot + step
    has_support = count > 0
    drift = tl.abs(s2) * tl.sqrt(count)
    # The centring undone: the fma's product is exact, count centre - 1 is rounded relative to
    # itself (small once the count settles).
    excess = s2 + tl.fma(count, centre, -1.0)
    disc = s1 * s1 - count * excess
    closed = excess / (s1 + tl.sqrt(tl.maximum(disc, 0.0)))
    root = tl.sqrt(excess + 1.0)
    newton = root * excess / ((root + 1.0) * s1)
    exact = (disc >= 0) & (smallest >= closed) & (tl.abs(closed) <= tl.abs(tau + closed))
    stuck = (tau + newton) == tau
    new_step = tl.where(has_support, tl.where(exact, closed, newton), 0.0)
    pivot = tl.where(done, pivot, tau)
    step = tl.where(done, step, new_step)
    centre = tl.where(has_support, 1.0 / count, centre)
    # A closed form is final only from sums that drifted little (sparsemax's MAX_DRIFT, here of
    # sum(d^2 - centre)); else it is only a step, and the next one is centred on its count.
    done = done | (exact & (drift <= MAX_DRIFT)) | stuck | ~has_support
    return pivot, step, centre, done


@triton.jit
def _pending(done, steps):
    return tl.where(steps < MAX_STEPS, tl.sum((~done).to(tl.int32), axis=0), 0)


@triton.jit
def _entmax_threshold(z, tau, centre, FEW: tl.constexpr = 0, SELECT_FREE: tl.constexpr = True):
    """Exact threshold (pivot, step) of each row of a [BLOCK_M, A, B] tile (-inf padding
    allowed) from lower bounds tau [BLOCK_M], the last step's centre (`_entmax_sums`) and the
    size of its support (-1 in a row stopped by MAX_STEPS).

    With FEW > 0 a row stops as soon as at most FEW entries lie above its pivot + step, as
    sparsemax's `_newton_threshold` does: every iterate (a closed form that holds or a Newton
    step from below) is a lower bound on the threshold. SELECT_FREE: `_entmax_sums`'."""
    pivot = tau
    step = tl.zeros_like(tau)
    size = tl.zeros_like(tau)
    done = tau != tau
    steps = 0
    pending = _pending(done, steps)
    while pending > 0:
        s1, s2, count, smallest = _entmax_sums(z, pivot + step, centre, SELECT_FREE)
        size = tl.where(done, size, count)
        pivot, step, centre, done = _entmax_update(s1, s2, count, smallest, pivot, step, centre,
                                                   done)
        if FEW > 0:
            done = done | (count <= FEW)
        steps += 1
        pending = _pending(done, steps)
    return pivot, step, centre, tl.where(done, size, -1.0)


@triton.jit
def _entmax_tile_threshold(z, group_z, GROUP: tl.constexpr, CONFIRM: tl.constexpr, start,
                           SELECT_FREE: tl.constexpr):
    """Exact threshold (pivot, step) and centre of each row of a [BLOCK_M, GROUP, WIDTH] tile of
    z <= 0, starting from the exact tau of its group maxima group_z [BLOCK_M, WIDTH] (down
    axis 1, inside each thread), found by Newton from lower bounds `start` [BLOCK_M] on it.

    The row's first step is centred on the group maxima's count: at their tau their squares
    average 1 / that count, and so do the row's when its support is about theirs (few large
    entries share a group) or when the row is nearly tied, so that this step can be final
    (MAX_DRIFT). With CONFIRM, in a tile of one row, the full-row steps are skipped when no
    other entry lies above the group maxima's tau (`_support_found`, as sparsemax's
    `_tile_threshold`). Measured on an H200 (NOTES, v28): 9-11% faster on randn rows at 16384
    and 32768 entries, fp32 and bf16; 3-5% in fp32 from 2048 to 8192 but 5-17% slower in bf16
    where the program holds the next row too, so prefetching programs keep the full steps.
    SELECT_FREE: `_entmax_sums`'."""
    tau = start
    centre = tl.zeros_like(tau)
    if GROUP > 1:
        pivot, step, centre, size = _entmax_threshold(tl.expand_dims(group_z, 1), tau, centre,
                                                      0, SELECT_FREE)
        if CONFIRM and z.shape[0] == 1:  # both constexpr
            if tl.min(_support_found(z, pivot, step, size).to(tl.int32), axis=0) == 0:
                pivot, step, centre, _ = _entmax_threshold(z, pivot + step, centre, 0,
                                                           SELECT_FREE)
        else:
            pivot, step, centre, _ = _entmax_threshold(z, pivot + step, centre, 0, SELECT_FREE)
    else:
        pivot, step, centre, _ = _entmax_threshold(z, tau, centre, 0, SELECT_FREE)
    return pivot, step, centre


@triton.jit
def _entmax_top_two_start(d2):
    """`_row_max_and_start`'s start for entmax-1.5: with z_2 = d2 / 2 the second largest in
    z = (x - max) / 2, the exact tau of the row's largest two, the root of t^2 + (z_2 - t)^2 = 1
    below z_2, (z_2 - sqrt(2 - z_2^2)) / 2 where z_2 > -1 (else the largest alone: -1), less
    TOP_TWO_MARGIN."""
    z2 = d2 * 0.5
    two = (z2 - tl.sqrt(tl.maximum(2.0 - z2 * z2, 0.0))) * 0.5
    return tl.where(z2 > -1.0, tl.maximum(two - TOP_TWO_MARGIN, -1.0), -1.0)


@triton.jit
def _entmax_subset_bound(d):
    """sparsemax's `_sparsemax_subset_bound` for entmax-1.5, in d = x - max (its tau in
    z = d / 2, doubled): a lower bound on the row's tau from a subset of its entries."""
    largest, start = _row_max_and_start(tl.reshape(d, [1, d.shape[2]]), True,
                                        _entmax_top_two_start)
    start += largest * 0.5  # in z, relative to the subset's own largest
    pivot, step = _entmax_threshold(d * 0.5, start, tl.zeros_like(start))[:2]
    tau = 2.0 * (pivot + step)
    return tl.where(tau == tau, tau - TOP_TWO_MARGIN, -float("inf"))


@triton.jit
def _entmax_tile(z, pivot, step, bad):
    t = tl.maximum((z - pivot[:, None, None]) - step[:, None, None], 0.0)
    return tl.where(bad[:, None, None], float("nan"), t * t)


@triton.jit
def _entmax15_rows(x, GROUP: tl.constexpr, PREFETCHING: tl.constexpr):
    """entmax-1.5 of each row of a [BLOCK_M, GROUP, WIDTH] tile of the input's dtype, in the
    compute dtype (the same code whether the program holds the next tile, PREFETCHING, or
    not)."""
    # Tiles of several 2-byte rows start from their largest two too: H100 (NOTES v66), bf16
    # randn rows of 16-512 entries 2.5-4.6% faster, uniform rows within 1.4%.
    top_two: tl.constexpr = (x.shape[0] == 1 and GROUP > 1) or x.dtype.primitive_bitwidth == 16
    select_free: tl.constexpr = (x.dtype.primitive_bitwidth != 16
                                 or x.shape[1] * x.shape[2] < SELECTS_FROM_2BYTE_WIDTH)
    x = _compute_dtype(x)
    group_max = _group_max(x)
    row_max, start = _row_max_and_start(group_max, top_two, _entmax_top_two_start)
    z = (x - row_max[:, None, None]) * 0.5
    pivot, step, _ = _entmax_tile_threshold(z, (group_max - row_max[:, None]) * 0.5, GROUP,
                                            not PREFETCHING, start, select_free)
    return _entmax_tile(z, pivot, step, _is_bad(row_max))


@triton.jit(do_not_specialize_on_alignment=["x_stride_outer", "y_stride_outer"])  # as sparsemax's
def entmax15_forward_kernel(
    X, Y, n_rows, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    WIDE: tl.constexpr, PREFETCH: tl.constexpr, THREAD_ROWS: tl.constexpr,
    ROW_ALIGN: tl.constexpr, ADJACENT: tl.constexpr,
):
    """Whole rows held in registers (`_map_rows`)."""
    _map_rows(X, Y, n_rows, n, inner, x_stride_outer, x_stride_inner, x_stride_n,
              y_stride_outer, y_stride_inner, y_stride_n, _entmax15_rows,
              BLOCK_M, BLOCK_N, GROUP, WIDE, PREFETCH, THREAD_ROWS, ROW_ALIGN, ADJACENT)


@triton.jit
def _entmax_chunk_bound(group_d, start, BOUND_GROUPS: tl.constexpr, share,
                        SHARE_STEPS: tl.constexpr):
    """`SplitRows`' pass-1 bounds for entmax-1.5, from a chunk's group maxima less the chunk's
    max (d = x - max, [1, 1, W]), in d: twice a Newton iterate for their tau in z = d / 2 from
    start (in z: the tau of their largest two, `_entmax_top_two_start`), stopped once at most
    BOUND_GROUPS of them lie above it, or exact with 0 (as sparsemax's), a lower bound on the
    row's tau; and twice SHARE_STEPS Newton steps on from there towards the root of
    sum(max(z - t, 0)^2) = share, on its convex norm form, on dense chunks only
    (`_dense_chunk`)."""
    z = group_d * 0.5
    pivot, step, _, size = _entmax_threshold(z, start, tl.zeros_like(start), BOUND_GROUPS)
    bound = pivot + step
    share_bound = bound
    if SHARE_STEPS > 0:
        if _dense_chunk(size, BOUND_GROUPS):
            for _step in tl.static_range(SHARE_STEPS):
                d = tl.maximum(z - share_bound[:, None, None], 0.0)
                # One reduction of both sums (as sparsemax's share steps, v46).
                s1, s2 = tl.reduce((d, d * d), 2, _add_add)
                s1, s2 = tl.reduce((s1, s2), 1, _add_add)
                norm = tl.sqrt(s2)
                share_bound += tl.where(s1 > 0, (norm - tl.sqrt(share)) * norm / s1, 0.0)
    return 2.0 * bound, 2.0 * share_bound


@triton.jit
def _entmax_split_outputs(d, pivot, step, bad, zero_below):
    """`SplitRows`' pass-3 outputs for entmax-1.5 from d = x - max (zero_below unused)."""
    return _entmax_tile(d * 0.5, pivot, step, bad)


@triton.jit
def entmax15_split_threshold_kernel(
    X, Y, PART, STATE, n_splits, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    CHUNK: tl.constexpr, SPLITS: tl.constexpr, WIDTH: tl.constexpr, WIDE: tl.constexpr,
    HELD_WIDTH: tl.constexpr, PREFILTERED: tl.constexpr,
):
    """Split pass 2 (`Entmax15SplitRows`), one program per row: the row's max and exact tau
    in z = (x - max) / 2, by Newton from the best chunk bound over the chunks' candidates.

    When a [SPLITS, HELD_WIDTH] tile holds the row's candidates (`_held_candidates`), it
    stays in registers across the steps. Else the stored candidates are read SPLITS chunks
    times WIDTH at a time; a chunk that stored none (over half of it are candidates: supports
    of a large share of the row, as nearly tied rows have) is read whole, in contiguous
    pieces of as many entries, and only where a group of SPLITS chunks holds one. H200 (NOTES, v37-v37c, 32 x 1048576
    randn x 0.01): read through the candidates' [SPLITS, WIDTH] tiles, 51.4 x clone; in
    pieces, 23.7."""
    row = tl.program_id(0)
    compute: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    # In d = x - max, tau >= -2.
    row_max, bound = _split_row_start(PART, row, n_splits, SPLITS, compute, -2.0,
                                      _entmax_subset_bound)
    pivot = bound * 0.5
    step = tl.zeros_like(pivot)
    centre = tl.zeros_like(pivot)
    done = _is_bad(row_max)
    held, held_d = _held_candidates(X, Y, PART, row, n_splits, n, inner, x_stride_outer,
                                    x_stride_inner, x_stride_n, y_stride_outer, y_stride_inner,
                                    y_stride_n, row_max, CHUNK, SPLITS, HELD_WIDTH, WIDE,
                                    PREFILTERED)
    steps = 0
    pending = _pending(done, steps)
    while pending > 0:
        s1 = tl.zeros_like(pivot)
        s2 = tl.zeros_like(pivot)
        count = tl.zeros_like(pivot)
        smallest = tl.full(pivot.shape, float("inf"), compute)
        if held:
            sums = _entmax_sums(held_d * 0.5, pivot + step, centre)
            s1, s2, count, smallest = _add4_min(s1, s2, count, smallest, *sums)
        else:
            for first in range(0, n_splits, SPLITS):
                splits = first + tl.arange(0, SPLITS)
                first_col, width, stored = _candidate_extent(PART, row, splits, n_splits, n,
                                                             CHUNK, PREFILTERED)
                width = tl.where(stored, width, 0)
                for offset in range(0, tl.max(width, 0), WIDTH):
                    x = _candidate_values(X, Y, row, splits, stored, width, offset, inner,
                                          x_stride_outer, x_stride_inner, x_stride_n,
                                          y_stride_outer, y_stride_inner, y_stride_n, CHUNK,
                                          WIDTH, WIDE, first_col[:, None])
                    z = (x.to(compute) - row_max) * 0.5
                    sums = _entmax_sums(tl.expand_dims(z, 0), pivot + step, centre)
                    s1, s2, count, smallest = _add4_min(s1, s2, count, smallest, *sums)
                if tl.min(stored.to(tl.int32), 0) == 0:
                    for split in range(first, first + SPLITS):
                        if _candidate_extent(PART, row, split, n_splits, n, CHUNK,
                                             PREFILTERED)[2] == 0:
                            for start in range(0, CHUNK, SPLITS * WIDTH):
                                piece = start + tl.arange(0, SPLITS * WIDTH)
                                cols = split * CHUNK + piece
                                x = tl.load(X + _entry_offsets(row, cols, inner,
                                                               x_stride_outer, x_stride_inner,
                                                               x_stride_n, WIDE),
                                            mask=(piece < CHUNK) & (cols < n),
                                            other=-float("inf"))
                                z = (x.to(compute) - row_max) * 0.5
                                sums = _entmax_sums(z[None, None, :], pivot + step, centre)
                                s1, s2, count, smallest = _add4_min(s1, s2, count, smallest,
                                                                    *sums)
        pivot, step, centre, done = _entmax_update(s1, s2, count, smallest, pivot, step, centre,
                                                   done)
        steps += 1
        pending = _pending(done, steps)
    state = STATE + row * STATE_SIZE
    tl.store(state + STATE_MAX, tl.reshape(row_max, []))
    tl.store(state + STATE_PIVOT, tl.reshape(pivot, []))
    tl.store(state + STATE_STEP, tl.reshape(step, []))
    tl.store(state + STATE_ZERO_BELOW, tl.reshape(tl.zeros_like(pivot), []))


class Entmax15SplitRows(SplitRows):
    """Sparsemax's three split passes (`SplitRows`) with entmax-1.5's chunk bound, row pass
    and outputs."""

    chunk_bound = _entmax_chunk_bound
    top_two_start = _entmax_top_two_start
    bound_groups_by_rows = {False: ENTMAX_BOUND_GROUPS, True: ENTMAX_BOUND_GROUPS}
    threshold_kernel = entmax15_split_threshold_kernel
    lowest_threshold = -2.0
    subset_bound = _entmax_subset_bound
    compact_tiles = {}  # its row pass does not compact
    # Nor step over the chunks' maxima alone: its supports are larger than sparsemax's, so
    # fewer lie one to a chunk (NOTES v75).
    maxima_support = frozenset()
    # By (entry bytes, n_rows >= SPLIT_MANY_ROWS). H100 (NOTES v72 measured), forward fp32:
    # 1 x 4194304 uniform 3.5x and randn x 0.01 10.7x faster, randn 26% (its rows not held
    # whole before); 8-32 rows' dense ones 1.3-2.4x, randn within 3%. bf16 (NOTES v73):
    # 1 x 4194304 uniform 3.3x and randn 33% faster, 2-4 rows uniform 1.8-2.3x faster and randn
    # 2-5% slower; from 8 rows uniform 4% slower.
    prefilter_tiles = {(4, False): 8192, (4, True): 8192, (2, False): 8192}
    held_tile = max(THRESHOLD_TILE.values())  # as large as its tile (not measured smaller)
    outputs = _entmax_split_outputs

    @staticmethod
    def default_threshold_tile(n_rows: int) -> int:
        return THRESHOLD_TILE[n_rows >= THRESHOLD_TILE_ROWS]

    def threshold_options(self) -> dict:
        return dict(HELD_WIDTH=self.held_width, PREFILTERED=self.prefilter_tile > 0)

    @staticmethod
    def default_share_steps(n_rows: int, element_size: int) -> int:
        many = n_rows >= SPLIT_MANY_ROWS
        return 0 if many and element_size == 2 else ENTMAX_SHARE_STEPS[many]


@triton.jit
def _weighted_sums(y, g):
    """(sum of s g, sum of s) with s = sqrt(y), per row of a [BLOCK_M, 1, B] tile."""
    s = tl.sqrt(y)
    total, norm = tl.reduce((s * g, s), 2, _add_add)
    return tl.reshape(total, [total.shape[0]]), tl.reshape(norm, [norm.shape[0]])


@triton.jit
def _backward_tile(y, g, q):
    s = tl.sqrt(y)
    return s * g - q[:, None, None] * s


@triton.jit(do_not_specialize_on_alignment=GRADIENT_ROW_STRIDES)
def entmax15_backward_kernel(
    Yp, G, DX, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    dx_stride_outer, dx_stride_inner, dx_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr, ROW_ALIGN: tl.constexpr,
    ADJACENT: tl.constexpr,
):
    """dx = s g - (sum(s g) / sum(s)) s, s = sqrt(y): BLOCK_M whole rows per program."""
    block = tl.program_id(0)
    y, g, _ = _load_y_g(Yp, G, block, 0, n_rows, n, inner,
                         y_stride_outer, y_stride_inner, y_stride_n,
                         g_stride_outer, g_stride_inner, g_stride_n, BLOCK_M, BLOCK_N, WIDE,
                         ROW_ALIGN, ADJACENT)
    total, norm = _weighted_sums(y, g)
    _store_rows(DX, _backward_tile(y, g, total / norm), block, n_rows, n, inner,
                dx_stride_outer, dx_stride_inner, dx_stride_n, BLOCK_M, 1, BLOCK_N, WIDE,
                ROW_ALIGN, ADJACENT)


@triton.jit
def entmax15_split_backward_sums_kernel(
    Yp, G, PART, n_splits, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    CHUNK: tl.constexpr, WIDE: tl.constexpr,
):
    """Split backward pass 1 (`Entmax15SplitBackward`): each chunk's (sum of s g, sum of s),
    s = sqrt(y). g is read everywhere, as the whole-row kernel reads it: a NaN in g where y is
    0 makes the row NaN (0 x NaN), as in the entmax package."""
    pid = tl.program_id(0)
    _, y_off, g_off, mask = _split_y_g_chunk(pid, n_splits, n_rows, n, inner, y_stride_outer,
                                             y_stride_inner, y_stride_n, g_stride_outer,
                                             g_stride_inner, g_stride_n, CHUNK, WIDE)
    compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
    y = tl.load(Yp + y_off, mask=mask, other=0.0).to(compute)
    g = tl.load(G + g_off, mask=mask, other=0.0).to(compute)
    _store_partials(PART, pid, *_weighted_sums(y, g))


@triton.jit
def entmax15_split_backward_kernel(
    Yp, G, DX, PART, part_splits, n_splits, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    dx_stride_outer, dx_stride_inner, dx_stride_n,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, WIDE: tl.constexpr,
):
    """Split backward pass 2: every program adds up its row's part_splits partial sums in PART
    (the same sums in the same order in each) and writes its chunk of dx."""
    pid = tl.program_id(0)
    row, y_off, g_off, dx_off, mask = _split_gradient_chunk(
        pid, n_splits, n_rows, n, inner, y_stride_outer, y_stride_inner, y_stride_n,
        g_stride_outer, g_stride_inner, g_stride_n, dx_stride_outer, dx_stride_inner,
        dx_stride_n, CHUNK, WIDE)
    total, norm = _row_partials(PART, row, part_splits, SPLITS)
    compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
    y = tl.load(Yp + y_off, mask=mask, other=0.0).to(compute)
    g = tl.load(G + g_off, mask=mask, other=0.0).to(compute)
    q = tl.full([1], 0.0, compute) + total / norm
    tl.store(DX + dx_off, _backward_tile(y, g, q).to(DX.dtype.element_ty), mask=mask)


class Entmax15SplitBackward(SplitBackward):
    """Sparsemax's split backward (`SplitBackward`) with entmax-1.5's sums and dx."""

    sums_kernel = entmax15_split_backward_sums_kernel

    def write(self, part: torch.Tensor, part_splits: int) -> torch.Tensor:
        entmax15_split_backward_kernel[self.grid](
            *self.tensors, self.dx, part, part_splits, *self.rows, *self.strides,
            *self.dx_strides, SPLITS=_next_power_of_2(part_splits), **self.tile)
        return self.dx


@triton.jit
def loss_kernel(
    X, T, GL, OUT, n_rows, n, x_stride_row, x_stride_n, ignore_index,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    ENTMAX15: tl.constexpr, BACKWARD: tl.constexpr, WIDE: tl.constexpr,
    THREAD_ROWS: tl.constexpr, ROW_ALIGN: tl.constexpr,
):
    """The sparsemax (ENTMAX15=False) or entmax-1.5 loss of BLOCK_M rows of a [rows, n] view.

    With p the prediction and z = x - max: loss = sum(p z) - z[target] + omega(p), omega(p) =
    (1 - sum(p^2)) / 2 for sparsemax and (1 - sum(p^1.5)) / 0.75 for entmax-1.5 (the entmax
    package's definitions; sum(p) = 1 makes the shift exact). The forward writes one loss per
    row to OUT; BACKWARD writes GL[row] * (p - onehot(target)) to OUT, laid out as x. Rows whose
    target is ignore_index give 0, rows whose target is out of range NaN. Laid out as the
    forward (`rows_launch`, `_map_rows`: THREAD_ROWS, ROW_ALIGN).
    """
    block = tl.program_id(0)
    WIDTH: tl.constexpr = BLOCK_N // GROUP
    SEARCH_GROUP: tl.constexpr = 1 if THREAD_ROWS else GROUP
    x = _load_raw_rows(X, block, n_rows, n, 1, x_stride_row, 0, x_stride_n, BLOCK_M, GROUP,
                       WIDTH, WIDE, ROW_ALIGN)
    # The rows' own loads are issued with x's, not after the threshold's search (3-5% faster at
    # 10 and 100 classes, NOTES v32).
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    target = tl.load(T + rows, mask=rows < n_rows, other=ignore_index)
    if BACKWARD:
        scale = tl.load(GL + rows, mask=rows < n_rows, other=0.0)
    x = _compute_dtype(x)
    group_max = _group_max(x)
    # The entmax-1.5 loss starts from -1: from its rows' largest two it lost 3-9% in fp32 at
    # 16384 and 32768 classes for 1-3% on bf16 randn rows (NOTES, v57).
    row_max, start = _row_max_and_start(group_max, not ENTMAX15 and BLOCK_M == 1
                                        and SEARCH_GROUP > 1, _sparsemax_top_two_start)
    bad = _is_bad(row_max)
    z = x - row_max[:, None, None]
    if ENTMAX15:
        z = z * 0.5  # entmax-1.5's coordinates; one tile live, not two
        # The group maxima again, not group_max's: from those, 2-11% slower in fp32 at 16384
        # and 32768 classes, bf16 unchanged (NOTES, v60).
        select_free: tl.constexpr = BLOCK_N < LOSS_SELECTS_FROM_WIDTH
        pivot, step, _ = _entmax_tile_threshold(z, tl.max(z, axis=1), SEARCH_GROUP, True, start,
                                                select_free)
        t = tl.maximum((z - pivot[:, None, None]) - step[:, None, None], 0.0)
        p = t * t
    else:
        # The loss keeps v68's drift check in every dtype (v69 drops it for 16-bit outputs).
        pivot, step, _ = _tile_threshold(z, group_max - row_max[:, None], SEARCH_GROUP, start,
                                         CHECK_DRIFT=True)
        p = tl.maximum((z - pivot[:, None, None]) - step[:, None, None], 0.0)
    ignored = target == ignore_index
    # A target outside the classes makes its row NaN: a check on the host would cost a sync.
    bad = bad | (((target < 0) | (target >= n)) & ~ignored)
    cols = tl.arange(0, GROUP)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    is_target = cols[None, :, :] == target[:, None, None]
    if BACKWARD:
        dx = scale.to(x.dtype)[:, None, None] * (p - is_target.to(x.dtype))
        dx = tl.where(bad[:, None, None], float("nan"), dx)
        dx = tl.where(ignored[:, None, None], 0.0, dx)
        _store_rows(OUT, dx, block, n_rows, n, 1, n, 0, 1, BLOCK_M, GROUP, WIDTH, WIDE, ROW_ALIGN)
    else:
        # With omega(p) = (1 - sum(p w)) / c, the loss is (sum(p (c x' - w)) - c x'[target] + 1) / c
        # for x' = x - max: one reduction of one tile, constants exact in any dtype. entmax-1.5:
        # c = 0.75, w = t, and c x' = 1.5 z; sparsemax: c = 2, w = p, c x' = 2 z. -inf entries
        # have p = 0 and take no part (0 * -inf would be NaN); a target at -inf gives +inf.
        if ENTMAX15:
            a, c = 1.5, 0.75
            terms = tl.where(p > 0, p * (a * z - t), 0.0)
        else:
            a, c = 2.0, 2.0
            terms = tl.where(p > 0, p * (a * z - p), 0.0)
        terms -= tl.where(is_target, a * z, 0.0)
        loss = (tl.sum(tl.sum(terms, axis=2), axis=1) + 1.0) / c
        loss = tl.where(bad, float("nan"), loss)
        loss = tl.where(ignored, 0.0, loss)
        tl.store(OUT + rows, loss.to(OUT.dtype.element_ty), mask=rows < n_rows)


FORWARD_LAUNCHES = LaunchCache(entmax15_forward_kernel)
BACKWARD_LAUNCHES = LaunchCache(entmax15_backward_kernel)


@on_tensor_device
def entmax15_forward(x: torch.Tensor, dim: int, out=None, group=None, num_warps=None,
                     block_m=None, chunk=None, programs_per_sm=None, row_threads=None,
                     threshold_tile=None, bound_groups=None, early_zeros=None,
                     share_steps=None, max_registers=None, prefilter_tile=None) -> torch.Tensor:
    """Launch the forward kernel into `out` (new if None, else contiguous of x's shape and dtype).

    Rows longer than `chunk` (default: the dtype's MAX_BLOCK_N) are split into chunks, in
    sparsemax's three passes (`Entmax15SplitRows`; `threshold_tile`, default THRESHOLD_TILE's,
    as in `sparsemax_forward`, `bound_groups`, default ENTMAX_BOUND_GROUPS, `early_zeros`,
    `share_steps` and `prefilter_tile`).
    `programs_per_sm` and `row_threads` as in `rows_launch`, `max_registers` as in
    `sparsemax_forward` (default ENTMAX_REGISTER_CAPS'). The other keyword arguments override
    the launch heuristics (for benchmarks and tests).
    """
    defaults = (out is None and group is None and num_warps is None and block_m is None
                and chunk is None and programs_per_sm is None and row_threads is None
                and threshold_tile is None and bound_groups is None and early_zeros is None
                and share_steps is None and max_registers is None and prefilter_tile is None)
    out, key, replayed = kept_launch(FORWARD_LAUNCHES, defaults, dim, out, x)
    if replayed:
        return out
    split_rows = functools.partial(
        Entmax15SplitRows, group=group, num_warps=num_warps, threshold_tile=threshold_tile,
        programs_per_sm=programs_per_sm, bound_groups=bound_groups, early_zeros=early_zeros,
        share_steps=share_steps, max_registers=max_registers, prefilter_tile=prefilter_tile)
    return launch_forward(FORWARD_LAUNCHES, key, x, dim, out, chunk, split_rows, group=group,
                          num_warps=num_warps, block_m=block_m, programs_per_sm=programs_per_sm,
                          row_threads=row_threads,
                          thread_entries=None, half_warps=HALF_ONE_ROW_WARPS,
                          wide_groups_from=WIDE_GROUPS_FROM_BY_SIZE.get(x.element_size()),
                          max_registers=max_registers, register_caps=ENTMAX_REGISTER_CAPS)


@on_tensor_device
def entmax15_backward(y: torch.Tensor, grad: torch.Tensor, dim: int, out=None, num_warps=None,
                      block_m=None, chunk=None) -> torch.Tensor:
    """Launch the backward kernel into `out`, as `entmax15_forward` does."""
    return launch_backward(BACKWARD_LAUNCHES, Entmax15SplitBackward, y, grad, dim, out,
                           num_warps, block_m, chunk)


def loss_fits(n: int, dtype: torch.dtype, chunk=None) -> bool:
    """Whether rows of n entries fit the fused loss kernel (one program's registers). Rows of
    no classes do not: the loss's torch path (`losses._loss_rows`) says what they give."""
    return 0 < n <= (max_block_n(dtype) if chunk is None else chunk)


@on_tensor_device
def loss(x: torch.Tensor, target: torch.Tensor, ignore_index: int, entmax15: bool,
         grad_loss=None, out=None, group=None, num_warps=None, block_m=None,
         row_threads=None) -> torch.Tensor:
    """The fused loss of each row of a 2-D x (classes last) against target [rows], into `out`;
    with grad_loss [rows], its gradient grad_loss * (p - onehot(target)) instead (contiguous,
    x's shape). Rows must fit one program (`loss_fits`); a target out of range gives its row
    NaN. The launch is the forward's (`rows_launch`, whose overrides the keyword arguments
    are)."""
    backward = grad_loss is not None
    n_rows, n = x.shape
    if not loss_fits(n, x.dtype):
        raise ValueError(f"rows of {n} classes do not fit the fused loss kernel (`loss_fits`)")
    if out is None:
        out = x.new_empty(x.shape if backward else (n_rows,))
    if n_rows == 0:
        return out
    x, _ = _strided(x, 1)
    align = row_align(x, n, (x.stride(0), 0, x.stride(1)), (n, 0, 1))
    launch = rows_launch(x, n_rows, n, num_warps, block_m, group=group, row_threads=row_threads,
                         thread_entries=None if entmax15 else ROW_THREAD_ENTRIES, align=align,
                         wide_groups_from=None if entmax15 else WIDE_GROUPS_FROM)
    loss_kernel[(launch.programs,)](
        x, target, grad_loss if backward else x, out, n_rows, n, x.stride(0), x.stride(1),
        ignore_index, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, GROUP=launch.group,
        ENTMAX15=entmax15, BACKWARD=backward, WIDE=_wide(n, x.stride(1)),
        THREAD_ROWS=launch.thread_rows, ROW_ALIGN=align, num_warps=launch.num_warps,
    )
    return out


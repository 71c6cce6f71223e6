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

Every step is a chain of reductions along each row: the launch heuristics give each row few
threads (rows of up to 1 KB 1-8 threads, 32 rows a warp; longer ones one warp up to 2048
entries, 64 entries a thread up to 8192, 128 beyond), so that most reductions are a thread's own
additions or warp shuffles and many rows are in flight per SM.

Rows longer than MAX_BLOCK_N are split into chunks, one program each, in three passes that
meet through a few scalars per chunk in a small scratch. Pass 1 reads each chunk once: its max,
a lower bound on tau (the tau of its group maxima), and its candidates, the entries above that
bound, which hold the chunk's part of the support; few of them (a chunk's support is small
next to the chunk) are stored, with their indices, in the output's own chunk. Pass 2, one
program per row, finds the exact tau by Newton over the candidates alone. Pass 3 writes zeros
and the candidates' outputs. A long row is thus read once and written once, like a copy;
chunks whose candidates do not fit (rows of ties) are read again by passes 2 and 3. A rank's
slice of rows split across ranks (`flashmax.distributed`) runs the same passes, but its Newton
steps are taken across ranks, each a launch of the sums kernel over the candidates. entmax-1.5
runs them too, with its own chunk bound, row pass and outputs (`SplitRows`' parts).
"""

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import LaunchCache, on_tensor_device, tensor_key

# Rows up to this many entries are held in one program's registers; longer rows are split into
# chunks of this size (several passes over memory, but no host synchronisation).
MAX_BLOCK_N = {torch.float64: 16384}
DEFAULT_MAX_BLOCK_N = 32768
ELEMENTS_PER_PROGRAM = 2048  # short rows are batched BLOCK_M at a time up to this many elements
ELEMENTS_PER_THREAD = 128  # registers per thread for the row; more spill, fewer add latency
# Tiles of rows shorter than this zero the outputs tied with tau by a bound per row, not by a
# test of the whole tile (`_sparsemax_tile`; NOTES, v23).
SHORT_ROW = tl.constexpr(256)
# A forward holds rows of up to ONE_ROW_WIDEST entries one a program at ONE_ROW_ENTRIES_PER_THREAD
# (1 warp at 2048 entries, 4 at 8192): measured on an H200 (benchmarks/NOTES.md, v30), 8192 over 4
# warps (152 registers) beat 2 (255, spilling) by 2-5% in fp32 and 0-6% in bf16; longer rows
# take ELEMENTS_PER_THREAD (16384 over 8 warps lost 26-44%).
ONE_ROW_WIDEST = 8192
ONE_ROW_ENTRIES_PER_THREAD = 64
# Sparsemax's forward holds 2-byte rows of 4096 entries over 4 warps, not 2: measured on an H200
# (NOTES, v58), bf16 randn rows 13% faster (72 registers a thread against 158), uniform rows 6%
# slower; fp32 rows gained nothing and entmax-1.5's forward lost 10%, so they keep 2.
HALF_ONE_ROW_WARPS = {4096: 4}
# Sparsemax's forward caps the registers of 2-byte rows of these widths (block_n) held by
# `rows_launch`'s programs: (cap, from programs a SM), the cap taken only in launches of at
# least that many programs a SM. H100 (NOTES v65 measured), 2048 rows bf16: 8192 151 -> 128
# registers, forward 3% faster on randn, 6% on uniform rows; 16384 255 (62 spill instructions)
# -> 168 (12), 2.5% and 14%. fp32 gained nothing (slower from 16384); 2-byte 2048 and 32768
# neither. Short bf16 rows at 80 (NOTES v73, three runs alike): 64-1024 entries randn 3-9%,
# uniform 5-9% faster; 16 and 32 alike, 2048 19% slower; fp32 16-256 alike, 2048 1.8x slower.
# Those one-warp programs pay for the cap's spills by fitting more a SM (25 against 18
# uncapped) only where they take several waves: H100 (NOTES v77), capped against uncapped,
# 2048 programs (2048 x 1024) +4 to +22%, 4096 -4 to +11%, 8192 -6 to +4%, 12288-32768 -1
# to -9%.
ROW_REGISTER_CAPS = {(2, 64): (80, 64), (2, 128): (80, 64), (2, 256): (80, 64),
                     (2, 512): (80, 64), (2, 1024): (80, 64), (2, 8192): (128, 0),
                     (2, 16384): (168, 0)}
# A row's group maxima lie inside each thread when its chunks (the row's GROUP parts) span the
# layout: GROUP is the widest that does, up to GROUP_WIDEST. Sparsemax's forward and loss hold
# rows of WIDE_GROUPS_FROM entries or more one a program with up to SPANNING_GROUP_WIDEST
# (each thread's group maxima one vector: fp32 16 groups at 4096-8192 entries, 32 at
# 16384-32768; bf16 16 at 16384-32768). Measured on an H200 (NOTES, v61): forward fp32
# uniform rows 1.28/1.30/1.31/1.54 -> 1.24/1.24/1.19/1.50 x clone at 4096-32768, bf16 randn
# 1.36/1.39 -> 1.30/1.35 and uniform 1.97/2.15 -> 1.82/1.96 at 16384/32768; at 2048 fp32
# (one warp) 5-12% slower, so shorter rows keep 8. entmax-1.5's forward takes it for fp32
# rows of 16384+ entries only (its `WIDE_GROUPS_FROM_BY_SIZE`, v62): bf16 lost up to 8%.
GROUP_WIDEST = 8
SPANNING_GROUP_WIDEST = 32
WIDE_GROUPS_FROM = 4096
# A forward spreads rows of up to 1 KB over few threads each (by the row's bytes: threads a row),
# one warp a program (`_load_raw_rows`): a row's reductions are then mostly each thread's own
# instructions, with few shuffles, and fewer threads repeat its Newton update. Longer rows take
# one row a program. Measured on an H200 (benchmarks/NOTES.md, v31): against 2048-entry
# programs spreading each row over up to 32 threads, 1.8-2.6x faster from 16 to 256 entries.
ROW_THREADS = {16: 1, 32: 1, 64: 1, 128: 2, 256: 4, 512: 8, 1024: 8}
ROW_THREADS_WARPS = 1
# ... but no sparsemax thread holds more entries than this: 512 bf16 entries over 16 threads,
# 1.54x copy against 1.76 over 8 (v32; entmax-1.5 lost 9% so, and keeps ROW_THREADS').
ROW_THREAD_ENTRIES = 32
# Rows adjacent in memory (a reduced dim that is not the last, `adjacent_rows`) are read with a
# warp's threads along the rows, one entry of a row a thread (Triton's layout once it sees them
# adjacent, with vectors of one entry, as the forward kernels leave the row strides' alignment to
# ROW_ALIGN). Rows of up to ADJACENT_THREAD_VALUES entries lie one a thread, 32 a warp, over
# ADJACENT_ROW_WARPS warps; longer ones over as many threads as keep that many values a thread
# (fewer rows a warp, but a 32-byte sector of them), up to 16 warps; rows needing more than
# ADJACENT_MAX_VALUES a thread take the row layout.
ADJACENT_THREAD_VALUES = 32
ADJACENT_ROW_WARPS = 4
ADJACENT_MAX_VALUES = 64
# The whole-row backward takes that launch from this many entries a row (padded), by element
# size; shorter adjacent rows keep `launch_config`'s tiles. Measured on an H200 (NOTES, v34c),
# adjacent against those tiles, × the 3-tensor floor: fp32 128 entries 1.37 / 1.22, 256 1.70 /
# 1.51, 512 1.52 / 4.04, 1024 1.52 / 5.89; bf16 128 1.71 / 1.42, 256 1.44 / 3.30, 1024 2.04 / 9.57.
ADJACENT_GRADIENT_ENTRIES = {2: 256, 4: 512, 8: 512}
# Rows longer than one program's registers are split over programs, one chunk each, that
# communicate through a small scratch: per chunk PART_SIZE values, per row STATE_SIZE. Programs
# are numbered row * n_splits + split. PART_SIZE is a power of two: its offsets are shifts.
PART_SIZE = tl.constexpr(8)
PART_MAX, PART_BOUND, PART_COUNT, PART_SHARE, PART_KEPT_AT, PART_KEPT, PART_SECOND = (
    tl.constexpr(i) for i in range(7))
STATE_SIZE = tl.constexpr(4)
STATE_MAX, STATE_PIVOT, STATE_STEP, STATE_ZERO_BELOW = (tl.constexpr(i) for i in range(4))
CANDIDATE_MARGIN = tl.constexpr(2.0**-20)
# How far below a Newton step's tau (in x - max) split pass 2 keeps candidates when it compacts
# them (`_candidate_sums`, `split_prefilter_kernel`): later steps may go below a tau by their
# sums' rounding (~1e-7).
COMPACT_MARGIN = tl.constexpr(2.0**-16)
# fp32 rows of GROUPWISE_EXACT_FROM to _TO entries held one a program sum a tiny row's
# fp64 step one group at a time (`_exact_outputs`). The branch is rarely taken, but its widened
# tile takes registers from every row: measured on an H200 (NOTES, v52), 152 -> 128 registers
# there and uniform and randn x 0.01 rows 4-7% faster, randn unchanged; 2-byte rows lost up to
# 20% with it (4096 bf16), fp32 at 32768 entries 5% on randn, other widths unchanged.
GROUPWISE_EXACT_FROM = tl.constexpr(4096)
GROUPWISE_EXACT_TO = tl.constexpr(8192)
# The group maxima's Newton steps start this far below the exact tau of a row's largest two
# (`_row_max_and_start`): at least 8 of its ulps (tau lies in [-1, 0]), so that the start's
# rounding never puts it above the row's tau, from where Newton could stop short of it.
TOP_TWO_MARGIN = tl.constexpr(2.0**-20)
# A tiny fp32 row's outputs again in fp64 (`_exact_outputs`): those at most this much of |tau|
# are ties with tau (`reference.EXACT_ZERO_BELOW`).
EXACT_ZERO_BELOW = tl.constexpr(2.0**-44)
# A Newton step (entmax-1.5's closed form too) is final only from a centred sum that drifted
# little: |sum of d - centre| (entmax-1.5: of d^2 - centre) times sqrt(count) at most this.
# Terms whose mean is not near 0 (a centre made for another count, a tau far from the root)
# pile up in the partial sums, whose roundings then grow with the sum and the count (about
# u |sum| sqrt(count) / 6 summed in sequence, as the interpreter does), and the step's rounding
# becomes the outputs' relative error: an uncentred sparsemax step over hundreds of nearly tied
# entries (sum ~2) left fp32 outputs 1e-6 to 3e-5 off under the interpreter (NOTES, v68).
MAX_DRIFT = tl.constexpr(4.0)
# The split row pass's fp64 step for a tiny row starts this much of |tau| below it: within the
# chunks' candidate margin (CANDIDATE_MARGIN), above which every entry is a candidate.
EXACT_LOWER = tl.constexpr(2.0**-21)
# Split rows are cut into chunks of (entries, warps) (fp64: half the entries): at most half the
# registers of a whole row, as the first pass keeps its candidates' slots and offsets live too.
# Measured on an H200 (benchmarks/NOTES.md, v10): from SPLIT_MANY_ROWS rows on, smaller
# programs (several per SM, one's loads overlapping another's arithmetic) are faster; fewer rows
# keep larger chunks, whose fewer candidates shorten the row pass (v42: with the row pass's
# candidates held in registers, 8 x 1048576 randn took 8192 entries and early zeros from
# 2.28 to 1.91 x clone, 1 x 4194304 lost 26%).
SPLIT_LAUNCH = {False: (16384, 16), True: (8192, 4)}
SPLIT_MANY_ROWS = 8
# The split backward's (entries, warps) per chunk (fp64: half the entries). Measured on an H200
# (benchmarks/NOTES.md, v11): 8192 over 4 warps beat 32768 over 8 (235 registers, one program
# per SM) by 7-13% from 8 x 1048576 to 512 x 131072.
SPLIT_BACKWARD_LAUNCH = (8192, 4)
# Pass 1 stops refining a chunk's bound once at most this many of its group maxima lie above
# it (0: the exact tau of the group maxima); the row pass finishes from its candidates, so
# rows too few to spread the row pass over the GPU take tighter bounds. Measured on an H200
# (benchmarks/NOTES.md, v19): on randn, 32 beat exact bounds by 7% (512 x 131072, 32 x 1048576,
# 8 x 1048576) but lost 10% on 1 x 4194304, where 8 won 1%.
SPLIT_BOUND_GROUPS = {False: 8, True: 32}  # by n_rows >= SPLIT_MANY_ROWS
# Pass 1's Newton steps on a chunk's group maxima towards its even share of the row
# (`_chunk_bounds`' share bound: a better start for the row pass on rows whose chunks are
# alike, as nearly tied rows' are), by n_rows >= SPLIT_MANY_ROWS; 0: none. The first step
# costs nothing (`_sparsemax_chunk_bound`), each other one a reduction over the group maxima,
# taken on dense chunks only (`_dense_chunk`; NOTES v74: randn rows below 8 rows 6.7-9%
# faster).
# Measured on an H200 (NOTES v45, v46): below 8 rows 4 steps took uniform and randn x 0.01 rows
# 16-36% lower (1 x 4194304 rand 134 -> 100 µs) and randn 9% higher (28.7 -> 31.2 µs; 31.0
# with v46's fused sums); from 32 rows one more step costs randn 3% (bf16 10%) and gains at
# most 4%.
SPLIT_SHARE_STEPS = {False: 4, True: 1}
# The share asked of each of a row's C chunks is SHARE_SLACK / C: the slack covers the
# roundings of the chunks' sums, so that all chunks together still hold the whole row's 1.
SHARE_SLACK = tl.constexpr(1.125)
# Programs per SM of split pass 1, each walking chunks and loading the next before working on
# this one (NOTES v19: 1-4% faster than a program per chunk at every long-row shape measured).
SPLIT_PROGRAMS_PER_SM = 2
# A chunk with at most this many candidates writes its outputs without reading its input again.
SPARSE_WRITE = 1024
# Split pass 1 writes the zeros of chunks that stored at most this many candidates (a power of
# two at most SPARSE_WRITE, or 0), by n_rows >= SPLIT_MANY_ROWS, so that the write pass writes
# only their candidates' slots and outputs. Measured on an H200 (benchmarks/NOTES.md, v40),
# forward x clone on randn rows: 512 x 131072 1.78 -> 1.55, 128 x 262144 1.65 -> 1.40,
# 32 x 1048576 1.82 -> 1.56; rows with more candidates within 2%. Every chunk of at most
# SPARSE_WRITE candidates lost 3-14% on those (rand, randn x 0.01), and rows of 16384-entry
# chunks (8 x 1048576 before v42, one program a SM) lost 7-13% whatever the cap.
SPLIT_EARLY_ZEROS = {False: 0, True: 64}
# Split pass 2 on rows whose candidates do not fit its held tile: the tile of those above its
# tau that it compacts and keeps across its Newton steps (`_compacted_tile`), by (entry bytes,
# n_rows >= SPLIT_MANY_ROWS); none where absent. H100 (NOTES v72 measured), forward fp32:
# uniform and randn x 0.01 rows 19-47% faster at 1-2 rows, 9-31% at 8 rows, 1.5-19% at 32-128
# rows; randn rows (held whole, never compacted) within 0.3% from 2 rows, +4.5% at 1 row.
# bf16 (NOTES v73) lost at 1-32 rows: randn 4-7%, rand 0.3-27% (2-byte uniform rows tie
# ~n * 2^-8 entries at their max, a support no tile holds).
SPLIT_COMPACT_TILE = {(4, False): 8192, (4, True): 8192}
# Split rows whose candidates the row pass cannot hold: the tile of the candidates above the
# start that `split_prefilter_kernel` keeps, all chunks at once, for the row pass to hold (the
# alternative to SPLIT_COMPACT_TILE's compaction by the row pass alone), keyed as it; none
# where absent. Not sparsemax's default (H100, NOTES v72, a tile of 8192): its launch and
# larger held tile cost fp32 randn rows (the bench's) 14-19% at 1-2 rows and 9-17% from 8;
# dense rows take 16-42% less than with the compaction at 1-2 rows, mostly more from 8; bf16
# randn rows 11-18% more at 1-32 rows (NOTES v73).
SPLIT_PREFILTER_TILE = {}
# Split rows, keyed as SPLIT_COMPACT_TILE, whose pass 1 also stores each chunk's second largest
# entry, so that the row pass steps over the chunks' maxima alone where they hold the row's
# support (`_held_candidates`). H100 (NOTES v78), forward: 1 x 4194304 fp32 randn 4.4% faster
# (the row pass reads none of its ~1240 candidates), 2-4 rows within +1.3%; 2-byte entries,
# or 8 rows and more, paid more in pass 1 (its third reduced value) than they gained: bf16
# +0.7 to +1.9% below 8 rows, +5 to +20% from 8.
SPLIT_MAXIMA_SUPPORT = {(4, False)}
# The prefilter reads a chunk's candidates this many at a time.
PREFILTER_PIECE = 1024
# The row-wise Newton pass sums this many candidates at a time (chunks x entries per chunk),
# by n_rows >= SPLIT_MANY_ROWS, and keeps a row's candidates in registers across its steps
# when a tile of HELD_TILE holds them (v42). H200 (NOTES v42b, v44): with a held tile as
# large, 8192 or 16384 were slower on randn; with 4096 held, few rows' dense candidates
# (uniform, randn x 0.01) are read 8192 at a time.
THRESHOLD_TILE = {False: 8192, True: 4096}
HELD_TILE = 4096
# Bits of a stored candidate's index, per output dtype.
INDEX_TYPE = {2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _add_add_min(total_a, count_a, min_a, total_b, count_b, min_b):
    return total_a + total_b, count_a + count_b, tl.minimum(min_a, min_b)


@triton.jit
def _step_sums(z, tau, centre):
    """One Newton step's sums over a [BLOCK_M, GROUP, WIDTH] tile: for d = z - tau, (sum of
    d - centre over d > 0, count of d > 0, smallest d > 0) per row.

    Summing z - tau rather than z keeps the terms small: no cancellation when all of a row lies
    close together (scales of 1e-3). The step is (sum of d - 1) / count, so the sum's rounding
    error becomes the outputs' relative error. Near the root every d is close to 1 / count:
    the terms d - centre, with centre = 1 / (the previous count), are nearly zero and their sum
    is nearly exact in fp32 (exactly zero for tied rows), without widening to fp64, whose
    conversions run at 1/8 of the fp32 rate. Axis 1 lies inside a thread, so it goes first.
    """
    d = z - tau[:, None, None]
    support = d > 0
    total, count, smallest = tl.reduce(
        (tl.where(support, d - centre[:, None, None], 0.0), support.to(z.dtype),
         tl.where(support, d, float("inf"))), 1, _add_add_min)
    return tl.reduce((total, count, smallest), 1, _add_add_min)


@triton.jit
def _newton_update(total, count, smallest, pivot, step, centre, done,
                   CHECK_DRIFT: tl.constexpr):
    """Advance (pivot, step, centre, done) by one Newton step from its sums at
    tau = pivot + step.

    A step is final when every entry of the support it used stays above the new tau, it was
    small (a large step was computed from z - tau with tau far away, rounded to ~|tau| ulps),
    and, with CHECK_DRIFT, its sum was well centred: it drifted little (MAX_DRIFT), or it was
    centred on this very support's count, as no further step would centre it better. Otherwise
    it is refined once more. Then |step| <= |tau|, and (z - pivot) - step rounds each output
    nearly relative to itself, where z - tau would round tau first. Outputs of 16 bits skip
    the drift check: the drift's rounding (at most 3e-5 of the outputs, NOTES v68) lies far
    below theirs (up to 2^-8 for bf16), and its steps cost 2-5% on bf16 uniform rows (v69).
    """
    tau = pivot + step
    # No entry above tau (a streamed chunk whose entries are all <= -1, a NaN or padding row):
    # keep tau, which is then already a lower bound at least as good as this subset's.
    has_support = count > 0
    # sum of d - 1 = total + (count * centre - 1); one fma keeps the small second term exact.
    excess = total + tl.fma(count, centre, -1.0)
    new_step = tl.where(has_support, excess / count, 0.0)
    small = tl.abs(new_step) <= tl.abs(tau + new_step)
    new_centre = 1.0 / count
    final = (smallest > new_step) & small
    if CHECK_DRIFT:
        final = final & ((tl.abs(total) * tl.sqrt(count) <= MAX_DRIFT) | (new_centre == centre))
    pivot = tl.where(done, pivot, tau)
    step = tl.where(done, step, new_step)
    centre = tl.where(has_support, new_centre, centre)
    done = done | final | ~has_support
    return pivot, step, centre, done


@triton.jit
def _newton_threshold(z, tau, centre, CHECK_DRIFT: tl.constexpr, FEW: tl.constexpr = 0):
    """Exact threshold (pivot, step) of each row of a [BLOCK_M, A, B] tile (-inf padding
    allowed) from lower bounds tau [BLOCK_M] and a first centre (`_step_sums`; 0 for none;
    CHECK_DRIFT: `_newton_update`), with the last step's centre, the smallest z - pivot of its
    support (so the smallest positive output is that minus step) and the support's size.

    With FEW > 0 a row stops as soon as at most FEW entries lie above its pivot + step: every
    Newton iterate from below is a lower bound on the threshold, and one that leaves few
    entries above it bounds them as well as the exact one would need to.
    """
    pivot = tau
    step = tl.zeros_like(tau)
    smallest = tl.full(tau.shape, float("inf"), tau.dtype)
    size = tl.zeros_like(tau)
    done = tau != tau
    pending = tl.sum((~done).to(tl.int32), axis=0)
    while pending > 0:
        total, count, step_smallest = _step_sums(z, pivot + step, centre)
        smallest = tl.where(done, smallest, step_smallest)
        size = tl.where(done, size, count)
        pivot, step, centre, done = _newton_update(total, count, step_smallest, pivot, step,
                                                   centre, done, CHECK_DRIFT)
        if FEW > 0:
            done = done | (count <= FEW)
        pending = tl.sum((~done).to(tl.int32), axis=0)
    return pivot, step, centre, smallest, size


@triton.jit
def _support_found(z, pivot, step, size):
    """Whether each row's support is the `size` entries of its group maxima above tau = pivot
    + step (their exact threshold), judged when they are few (at most sqrt(WIDTH)) by one
    count of the row's entries above tau; else False (`_tile_threshold`)."""
    found = tl.zeros_like(size) != 0.0
    if tl.max(size * size, axis=0) <= z.shape[2]:
        # Entries within rounding of tau count too, and send the row to the full steps, which
        # tell a tie from a tiny output (`_tiny`).
        bound = (pivot + step) - 2.0 * _zero_below(pivot + step)
        above = tl.sum(tl.sum((z > bound[:, None, None]).to(z.dtype), axis=1), axis=1)
        found = above == size
    return found


@triton.jit
def _tile_threshold(z, group_z, GROUP: tl.constexpr, start, CHECK_DRIFT: tl.constexpr):
    """Exact threshold (pivot, step) of each row of a [BLOCK_M, GROUP, WIDTH] tile of z <= 0,
    starting from the exact tau of its group maxima group_z [BLOCK_M, WIDTH], found by Newton
    from lower bounds `start` [BLOCK_M] on it, and the smallest entry of the last step's
    support (`_newton_threshold`). The row's first step is centred on the group maxima's count:
    at their tau the row's entries above it lie near 1 / that count when they are nearly tied
    (as entmax-1.5's `_entmax_tile_threshold`), where an uncentred sum of hundreds of them
    would round to ~1e-6 of the outputs.

    In a tile of one row, when that tau leaves few group maxima above it (at most
    sqrt(WIDTH): then two of them share a group, leaving one out, in less than ~40% of rows),
    one count over the row says whether any other entry lies above it too; if none does, the
    row's support is theirs and so is its tau. A count is ~2 instructions an entry, a full-row
    step ~9: randn rows (4-5 entries in their support) mostly take none, rows with many
    entries in theirs (uniform values) skip the count. Measured on an H200 (NOTES, v28): 6-16%
    faster on randn rows from 16384 fp32 and 4096 bf16, 0-3% slower on uniform rows; tiles of
    several rows (up to 1024 entries) lost 4% on randn and 10% on uniform rows at 256 entries,
    so they keep the full steps.
    """
    tau = start
    centre = tl.zeros_like(tau)
    if GROUP > 1:
        pivot, step, centre, smallest, size = _newton_threshold(tl.expand_dims(group_z, 1), tau,
                                                                centre, CHECK_DRIFT)
        if z.shape[0] == 1:
            if tl.min(_support_found(z, pivot, step, size).to(tl.int32), axis=0) == 0:
                pivot, step, _, smallest, _ = _newton_threshold(z, pivot + step, centre,
                                                                CHECK_DRIFT)
        else:
            pivot, step, _, smallest, _ = _newton_threshold(z, pivot + step, centre, CHECK_DRIFT)
    else:
        pivot, step, _, smallest, _ = _newton_threshold(z, tau, centre, CHECK_DRIFT)
    return pivot, step, smallest


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _group_max(x):
    """Maxima down axis 1 of a [BLOCK_M, GROUP, WIDTH] tile (inside each thread), NaN-propagating:
    the group maxima, and on the way to the row's maximum."""
    return tl.reduce(x, 1, _nan_max)


@triton.jit
def _row_max(group_max):
    return tl.reduce(group_max, 1, _nan_max)


@triton.jit
def _top_two(first_a, second_a, first_b, second_b):
    # A NaN anywhere makes the first NaN (a bad row); the second is then unused.
    return (_nan_max(first_a, first_b),
            tl.maximum(tl.minimum(first_a, first_b), tl.maximum(second_a, second_b)))


@triton.jit
def _row_max_and_start(group_max, TOP_TWO: tl.constexpr, top_two_start: tl.constexpr):
    """The max of each row's group maxima [BLOCK_M, WIDTH] and a lower bound on the tau of
    their steps (`_tile_threshold`'s start), -1 unless TOP_TWO (programs of one row whose
    group maxima are searched first; sparsemax's tiles of 2-byte rows): top_two_start(second -
    max), the op's exact tau of the row's largest two less a margin over its rounding
    (`_sparsemax_top_two_start`, entmax's `_entmax_top_two_start`).

    The second rides along the max's own reduction. On randn rows it is worth ~1.8 of the
    group maxima's ~4 steps (a simulation, fp64, 400 rows, 2048-32768 entries); dense rows'
    many group maxima near the max leave theirs (5-8) unchanged (NOTES, v54). Starts from
    their largest four (1.1-1.3 steps left in the simulation) measured no faster (NOTES, v55).
    Short randn rows' full-row steps fall alike (16-1000 entries: 1.8-3.2 -> 1.2-1.8 in the
    simulation; NOTES, v63)."""
    if not TOP_TWO:
        row_max = _row_max(group_max)
        return row_max, tl.full(row_max.shape, -1.0, row_max.dtype)
    row_max, second = _row_max_and_second(group_max)
    return row_max, top_two_start(second - row_max)


@triton.jit
def _sparsemax_top_two_start(d2):
    """The exact tau in x - max of a row's largest two, d2 = second - max below the max:
    (d2 - 1) / 2, or -1 (the max alone), less TOP_TWO_MARGIN."""
    return tl.maximum((d2 - 1.0) * 0.5 - TOP_TWO_MARGIN, -1.0)


@triton.jit
def _top_two_beside_second(first_a, groups_a, second_a, first_b, groups_b, second_b):
    # `_top_two` of the group maxima (first, groups), and the second largest of all entries
    # from each side's own second.
    first, groups = _top_two(first_a, groups_a, first_b, groups_b)
    return first, groups, tl.maximum(tl.minimum(first_a, first_b), tl.maximum(second_a, second_b))


@triton.jit
def _chunk_top(x):
    """A [1, GROUP, WIDTH] tile's group maxima [1, WIDTH], its max [1], the second largest of
    its group maxima [1] and the second largest of its entries [1] (the max's tie, if any), in
    one reduction across the threads."""
    lowest = tl.full(x.shape, -float("inf"), x.dtype)
    group_max, group_second = tl.reduce((x, lowest), 1, _top_two)
    chunk_max, maxima_second, chunk_second = tl.reduce(
        (group_max, tl.full(group_max.shape, -float("inf"), x.dtype), group_second), 1,
        _top_two_beside_second)
    return group_max, chunk_max, maxima_second, chunk_second


@triton.jit
def _row_max_and_second(group_max):
    """The largest two of each row's group maxima [BLOCK_M, WIDTH], in one reduction."""
    return tl.reduce((group_max, tl.full(group_max.shape, -float("inf"), group_max.dtype)), 1,
                     _top_two)


@triton.jit
def _tile_max(x):
    """The max of each row of a [BLOCK_M, GROUP, WIDTH] tile, NaN-propagating."""
    return _row_max(_group_max(x))


@triton.jit
def _is_bad(row_max):
    # NaN or +inf anywhere, or every entry -inf: the whole row is NaN (as torch.softmax).
    return (row_max != row_max) | (row_max == float("inf")) | (row_max == -float("inf"))


@triton.jit
def _zero_below(tau):
    """Outputs at most this are 0 (`reference.ZERO_BELOW`): 4 ulps of |tau| (fp32; 2 in fp64)."""
    return tl.abs(tau) * (2.0**-22 if tau.dtype == tl.float32 else 2.0**-51)


@triton.jit
def _tiny(pivot, step, smallest):
    """Whether a row's smallest positive output (smallest - step, `_newton_threshold`) is
    within rounding of tau: an entry tied with tau, as entries on a coarse grid (bf16) often
    are, or a true output that small."""
    return smallest - step <= _zero_below(pivot + step)


@triton.jit
def _above_tau(z, pivot, step):
    """z - tau per entry of a [BLOCK_M, A, B] tile, as (z - pivot) - step: each output rounds
    nearly relative to itself (`_newton_update`)."""
    return (z - pivot[:, None, None]) - step[:, None, None]


@triton.jit
def _outputs_within(z, pivot, step, bad, zero_below):
    """max(z - tau, 0) with tau = pivot + step and outputs at most zero_below [rows] 0 too (ties
    with tau); a bad row's outputs NaN."""
    y = _above_tau(z, pivot, tl.where(bad, float("nan"), step))
    return tl.where(y <= zero_below[:, None, None], 0.0, y)


@triton.jit
def _zero_at_tau(y, tau):
    """y = z - tau with the entries within rounding of tau (and below) 0; NaN stays NaN."""
    return tl.where(y <= _zero_below(tau)[:, None, None], 0.0, y)


@triton.jit
def _exact_outputs(z, pivot, step, tiny, tied, GROUPWISE: tl.constexpr):
    """max(z - tau, 0) of each row of an fp32 tile of z; in `tiny` rows, whose fp32 threshold
    (pivot, step), rounded by up to ~4 ulps of tau, cannot tell an entry tied with tau from a
    true output that small, with tau refined in fp64 (`reference.exact_outputs`); in other
    `tied` rows, outputs within rounding of tau are 0 (`_zero_at_tau`).

    One Newton step in fp64 from 2^-20 of tau below (pivot, step): its support holds the
    row's, entries tied with tau (which leave tau as it is) and entries within that much below
    tau (which lower it by at most that over the support's size, and stay below it), so the
    step lands on tau. z - lower is exact in fp64. tau goes back as (pivot, step) in fp32,
    ~48 bits; outputs within EXACT_ZERO_BELOW of it are ties. The branch's registers count
    where it is not taken too (NOTES, v23: up to 13% at 256 entries); GROUPWISE widens and sums
    one group of the tile at a time, in a loop that is not unrolled (GROUPWISE_EXACT_FROM)."""
    tau = pivot.to(tl.float64) + step.to(tl.float64)
    lower = tau - tl.abs(tau) * 2.0**-20
    if GROUPWISE:
        total = tl.zeros_like(lower)
        count = tl.zeros_like(lower)
        groups = tl.arange(0, z.shape[1])[None, :, None]
        for group in range(z.shape[1]):
            # This group's entries exactly: the others add zeros.
            d = tl.sum(tl.where(groups == group, z, 0.0), axis=1).to(tl.float64) - lower[:, None]
            support = d > 0
            total += tl.sum(tl.where(support, d, 0.0), axis=1)
            count += tl.sum(support.to(tl.float64), axis=1)
    else:
        d = z.to(tl.float64) - lower[:, None, None]
        support = d > 0
        total, count = tl.reduce((tl.where(support, d, 0.0), support.to(tl.float64)), 1,
                                 _add_add)
        total, count = tl.reduce((total, count), 1, _add_add)
    exact = lower + (total - 1.0) / count
    exact_pivot = exact.to(tl.float32)
    tol = tl.where(tied, _zero_below(pivot + step), 0.0)
    pivot = tl.where(tiny, exact_pivot, pivot)
    step = tl.where(tiny, (exact - exact_pivot.to(tl.float64)).to(tl.float32), step)
    tol = tl.where(tiny, (tl.abs(exact) * EXACT_ZERO_BELOW).to(tl.float32), tol)
    # NaN (a bad row's step) stays NaN: NaN <= tol is false.
    y = _above_tau(z, pivot, step)
    return tl.where(y <= tol[:, None, None], 0.0, y)


@triton.jit
def _sparsemax_tile(z, pivot, step, bad, tiny, GROUPWISE: tl.constexpr):
    """max(z - tau, 0) with tau = pivot + step; in a tile where a row is `tiny` (`_tiny`) or
    its last step negative (which may leave entries at the pivot just above 0), outputs within
    rounding of tau are 0 too, so that an entry tied with tau is outside the support, as in
    exact arithmetic. Other tiles skip that test per entry. In fp32, a tiny row's outputs are
    computed again in fp64 instead (`_exact_outputs`): fp32's rounding alone cannot tell a tie
    from a true output of a few ulps of tau. (A negative last step is common, ~20% of randn
    rows, and its entries at the pivot rare: those rows keep the rule, which costs a compare
    per entry where fp64 would cost a pass.)

    Each branch makes its outputs from z, so that one tile is live (NOTES, v16: no spills at
    16384 and 32768 entries, 7-11% faster there on randn rows than making z - tau once before
    the branch).
    """
    # A bad row's step is NaN: the NaN-propagating maximum, and `y <= tol` (false), keep it.
    step = tl.where(bad, float("nan"), step)
    tied = tiny | (step < 0)
    exact: tl.constexpr = z.dtype == tl.float32
    if z.shape[1] * z.shape[2] < SHORT_ROW:
        # Short rows, many a tile, spread over the warps: whether any is tied would take a
        # reduction across warps (3 barriers a tile at 8-64 entries, triton 3.6); a per-row
        # bound costs one compare-and-select an entry in place of the maximum instead. Only
        # whether any row is tiny (rare) still takes one.
        tol = tl.where(tied, _zero_below(pivot + step), 0.0)
        y = _above_tau(z, pivot, step)
        out = tl.where(y <= tol[:, None, None], 0.0, y)
        if exact:
            if tl.max(tiny.to(tl.int32), axis=0) > 0:
                out = _exact_outputs(z, pivot, step, tiny, tied, False)
        return out
    # One reduction says both: the worst row is 2 if tiny (a tiny row is tied), 1 if tied.
    worst = tl.max(tied.to(tl.int32) + tiny.to(tl.int32), axis=0)
    any_tied = worst > 0
    any_tiny = worst > 1
    if any_tied:
        if exact and any_tiny:
            out = _exact_outputs(z, pivot, step, tiny, tied, GROUPWISE)
        else:
            out = _zero_at_tau(_above_tau(z, pivot, step), pivot + step)
    else:
        out = tl.maximum(_above_tau(z, pivot, step), 0.0, propagate_nan=tl.PropagateNan.ALL)
    return out


@triton.jit
def _row_offsets(block, start, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                 BLOCK_M: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr,
                 WIDE: tl.constexpr, ROW_ALIGN: tl.constexpr = 1, ADJACENT: tl.constexpr = False):
    """Offsets and mask of entries start ... start + GROUP * WIDTH of BLOCK_M rows of an
    [outer, n, inner] view, each as a [GROUP, WIDTH] tile of contiguous chunks. ROW_ALIGN: a
    number of entries that divides n and both row strides (`row_align`), said so to Triton,
    which knows an integer's divisibility only by 16: each thread's vectors are then one
    access each, under one mask bit.

    ADJACENT (stride_inner 1, `adjacent_rows`): block b holds BLOCK_M consecutive inner indices
    of one outer index (cdiv(inner, BLOCK_M) blocks an outer index), rows whose entries are
    adjacent in memory. Triton then sees that and lays a load's threads along the rows, each
    access reading neighbouring rows' same entry: a reduced dim that is not the last, read
    coalesced."""
    if ROW_ALIGN > 1:
        # Identities here, which Triton cannot fold away (`tl.multiple_of` on the offsets would
        # be, with the op it marks).
        n = n // ROW_ALIGN * ROW_ALIGN
        stride_outer = stride_outer // ROW_ALIGN * ROW_ALIGN
        stride_inner = stride_inner // ROW_ALIGN * ROW_ALIGN
    cols = start + tl.arange(0, GROUP)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    if ADJACENT:
        blocks_per_outer = tl.cdiv(inner, BLOCK_M)
        at = (block % blocks_per_outer) * BLOCK_M + tl.arange(0, BLOCK_M)
        base = (block // blocks_per_outer).to(tl.int64) * stride_outer + at
        row_ok = at < inner
    else:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        base = (rows64 // inner) * stride_outer + (rows64 % inner) * stride_inner
        row_ok = rows < n_rows
    if WIDE:
        cols_off = cols.to(tl.int64) * stride_n
    else:
        cols_off = cols * stride_n
    mask = row_ok[:, None, None] & (cols < n)[None, :, :]
    return base[:, None, None] + cols_off[None, :, :], mask


@triton.jit
def _load_raw_rows(X, block, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                   BLOCK_M: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr,
                   WIDE: tl.constexpr, ROW_ALIGN: tl.constexpr = 1,
                   ADJACENT: tl.constexpr = False):
    """BLOCK_M whole rows of X as a [BLOCK_M, GROUP, WIDTH] tile in X's dtype, -inf beyond the
    rows' ends (rows at or past n_rows are not read).

    Triton lays a load's threads along the contiguous axis first (WIDTH, as many entries a
    thread as one access reads: ROW_ALIGN's, a 16-byte vector at most), then along the others
    in order: the rows, then the chunks. With WIDTH one access, a warp's threads thus hold 32
    rows, one each, a row's chunks in its thread's registers. ADJACENT: `_row_offsets`."""
    off, mask = _row_offsets(block, 0, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                             BLOCK_M, GROUP, WIDTH, WIDE, ROW_ALIGN, ADJACENT)
    return tl.load(X + off, mask=mask, other=-float("inf"))


@triton.jit
def _compute_dtype(x):
    """fp64 stays fp64, the rest become fp32."""
    return x.to(tl.float64 if x.dtype == tl.float64 else tl.float32)


@triton.jit
def _load_rows(X, block, n_rows, n, inner, stride_outer, stride_inner, stride_n,
               BLOCK_M: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr,
               WIDE: tl.constexpr, ROW_ALIGN: tl.constexpr = 1):
    """`_load_raw_rows` in the compute dtype."""
    return _compute_dtype(_load_raw_rows(X, block, n_rows, n, inner, stride_outer, stride_inner,
                                         stride_n, BLOCK_M, GROUP, WIDTH, WIDE, ROW_ALIGN))


@triton.jit
def _store_rows(Y, tile, block, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                BLOCK_M: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr,
                WIDE: tl.constexpr, ROW_ALIGN: tl.constexpr = 1, ADJACENT: tl.constexpr = False):
    """A tile laid out as `_load_raw_rows`' into BLOCK_M whole rows of Y, in Y's dtype."""
    off, mask = _row_offsets(block, 0, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                             BLOCK_M, GROUP, WIDTH, WIDE, ROW_ALIGN, ADJACENT)
    tl.store(Y + off, tile.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sparsemax_rows(x, GROUP: tl.constexpr, PREFETCHING: tl.constexpr):
    """Sparsemax of each row of a [BLOCK_M, GROUP, WIDTH] tile of the input's dtype, in the
    compute dtype; the same code whether the program holds the next tile (PREFETCHING,
    `_map_rows`) or not."""
    entries: tl.constexpr = x.shape[0] * x.shape[1] * x.shape[2]
    groupwise: tl.constexpr = (x.dtype == tl.float32 and GROUPWISE_EXACT_FROM <= entries
                               and entries <= GROUPWISE_EXACT_TO)
    # Tiles of several 2-byte rows start from their largest two too (v63: 16-512 bf16 entries
    # 6-14% faster on randn rows, fp32's no faster).
    half: tl.constexpr = x.dtype.primitive_bitwidth == 16
    top_two: tl.constexpr = (x.shape[0] == 1 and GROUP > 1) or half
    x = _compute_dtype(x)
    group_max = _group_max(x)
    row_max, start = _row_max_and_start(group_max, top_two, _sparsemax_top_two_start)
    z = x - row_max[:, None, None]
    pivot, step, smallest = _tile_threshold(z, group_max - row_max[:, None], GROUP, start,
                                            not half)
    return _sparsemax_tile(z, pivot, step, _is_bad(row_max), _tiny(pivot, step, smallest),
                           groupwise)


@triton.jit
def _map_rows(X, Y, n_rows, n, inner, x_stride_outer, x_stride_inner, x_stride_n,
              y_stride_outer, y_stride_inner, y_stride_n, ROWS_FN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
              WIDE: tl.constexpr, PREFETCH: tl.constexpr, THREAD_ROWS: tl.constexpr,
              ROW_ALIGN: tl.constexpr, ADJACENT: tl.constexpr):
    """Y = ROWS_FN(X tile in X's dtype, GROUP, PREFETCHING), BLOCK_M whole rows at a time held
    in registers: one read, one write.

    Without PREFETCH a program does one block. With it, program p does blocks p, p + programs,
    ... and issues the next block's load before working on this one: when all blocks fit in
    about one wave, the programs would otherwise all load, then all compute with memory idle,
    then all store. THREAD_ROWS: chunks (WIDTH) of one access, so that each row lies in one
    thread (`_load_raw_rows`); ROWS_FN's reductions along a row are then that thread's own
    instructions, and it gets GROUP = 1, as a search over group maxima would only add steps.
    ROW_ALIGN (`row_align`) lets a thread's chunk be one access of up to a 16-byte vector also
    when rows are not 16-entry multiples long and apart (the only alignment Triton sees by
    itself). ADJACENT (`_row_offsets`): rows adjacent in memory, a block each program.
    """
    block = tl.program_id(0)
    WIDTH: tl.constexpr = BLOCK_N // GROUP
    SEARCH_GROUP: tl.constexpr = 1 if THREAD_ROWS else GROUP
    x = _load_raw_rows(X, block, n_rows, n, inner, x_stride_outer, x_stride_inner, x_stride_n,
                       BLOCK_M, GROUP, WIDTH, WIDE, ROW_ALIGN, ADJACENT)
    if PREFETCH:
        programs = tl.num_programs(0)
        for next_block in tl.range(block + programs, tl.cdiv(n_rows, BLOCK_M) + programs,
                                   programs, num_stages=1):
            x_next = _load_raw_rows(X, next_block, n_rows, n, inner, x_stride_outer,
                                    x_stride_inner, x_stride_n, BLOCK_M, GROUP, WIDTH, WIDE,
                                    ROW_ALIGN)
            _store_rows(Y, ROWS_FN(x, SEARCH_GROUP, True), block, n_rows, n,
                        inner, y_stride_outer, y_stride_inner, y_stride_n, BLOCK_M, GROUP, WIDTH,
                        WIDE, ROW_ALIGN)
            x = x_next
            block = next_block
    else:
        _store_rows(Y, ROWS_FN(x, SEARCH_GROUP, False), block, n_rows, n, inner,
                    y_stride_outer, y_stride_inner, y_stride_n, BLOCK_M, GROUP, WIDTH, WIDE,
                    ROW_ALIGN, ADJACENT)


# The row strides' alignment is left to ROW_ALIGN (`_row_offsets`), so that adjacent rows
# (ADJACENT) are read one entry a thread rather than in vectors of several rows.
@triton.jit(do_not_specialize_on_alignment=["x_stride_outer", "y_stride_outer"])
def sparsemax_forward_kernel(
    X, Y, n_rows, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
    WIDE: tl.constexpr, PREFETCH: tl.constexpr, THREAD_ROWS: tl.constexpr,
    ROW_ALIGN: tl.constexpr, ADJACENT: tl.constexpr,
):
    """Whole rows held in registers (`_map_rows`)."""
    _map_rows(X, Y, n_rows, n, inner, x_stride_outer, x_stride_inner, x_stride_n,
              y_stride_outer, y_stride_inner, y_stride_n, _sparsemax_rows,
              BLOCK_M, BLOCK_N, GROUP, WIDE, PREFETCH, THREAD_ROWS, ROW_ALIGN, ADJACENT)


@triton.jit
def _split_chunk(pid, n_splits, n_rows, n, inner, stride_outer, stride_inner, stride_n,
                 CHUNK: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr):
    """Program pid's row, and the offsets and mask of its chunk as a [1, GROUP, WIDTH] tile."""
    row = pid // n_splits
    off, mask = _row_offsets(row, (pid % n_splits) * CHUNK, n_rows, n, inner, stride_outer,
                             stride_inner, stride_n, 1, GROUP, CHUNK // GROUP, WIDE)
    return row, off, mask


@triton.jit
def _entry_offsets(row, cols, inner, stride_outer, stride_inner, stride_n, WIDE: tl.constexpr):
    """Offsets of the entries `cols` (any shape) of row `row` of an [outer, n, inner] view."""
    row64 = row.to(tl.int64)
    base = (row64 // inner) * stride_outer + (row64 % inner) * stride_inner
    if WIDE:
        return base + cols.to(tl.int64) * stride_n
    return base + cols * stride_n


@triton.jit
def _chunk_extent(PART, row, splits, n_splits, n, CHUNK: tl.constexpr):
    """Per chunk `splits` of a row: its length, its candidates' count, whether they are stored
    (in the output, as values then chunk-relative indices: room for both)."""
    valid = splits < n_splits
    length = tl.where(valid, tl.minimum(n - splits * CHUNK, CHUNK), 0)
    count = tl.load(PART + (row * n_splits + splits) * PART_SIZE + PART_COUNT, mask=valid,
                    other=0.0).to(tl.int32)
    return length, count, 2 * count <= length


@triton.jit
def _candidate_extent(PART, row, splits, n_splits, n, CHUNK: tl.constexpr,
                      PREFILTERED: tl.constexpr):
    """Per chunk `splits` of a row, where split pass 2 reads its candidates: (first column in
    the chunk, how many, whether in the output): those pass 1 stored, or the whole chunk of x
    where it stored none; with PREFILTERED, those above the row's start where
    `split_prefilter_kernel` kept them."""
    length, count, stored = _chunk_extent(PART, row, splits, n_splits, n, CHUNK)
    first = tl.zeros_like(count)
    width = tl.where(stored, count, length)
    if PREFILTERED:
        part = PART + (row * n_splits + splits) * PART_SIZE
        valid = splits < n_splits
        kept = tl.load(part + PART_KEPT, mask=valid, other=0.0).to(tl.int32)
        filtered = kept >= 0
        first = tl.where(filtered, tl.load(part + PART_KEPT_AT, mask=valid, other=0.0).to(
            tl.int32), first)
        width = tl.where(filtered, kept, width)
        stored = stored | filtered
    return first, width, stored


def store_ptx(element_size: int) -> tuple[str, str]:
    """(PTX, constraints) of `_scatter`'s store of one element of that many bytes: st.global
    under the element's predicate, from the register that holds it."""
    register, bits = {2: ("h", 16), 4: ("r", 32), 8: ("l", 64)}[element_size]
    return (f"{{ .reg .pred %p; setp.ne.s32 %p, $3, 0; @%p st.global.b{bits} [$1], $2; "
            f"mov.b32 $0, 0; }}", f"=r,l,{register},r")


def scatter_ptx(element_size: int) -> tuple[str, str]:
    """`store_ptx`, or ("", "") under Triton's interpreter, which runs no assembly."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "", ""
    return store_ptx(element_size)


@triton.jit
def _scatter(pointers, bits, keep, PTX: tl.constexpr, CONSTRAINTS: tl.constexpr):
    """tl.store(pointers, bits as the pointers' type, mask=keep != 0) for scattered pointers,
    with bits integers of the stored element's width.

    A tl.store whose addresses are not contiguous makes Triton first re-lay the pointers, the
    values and the mask as one element per thread, through shared memory in pieces with a
    barrier each (pass 1's [1, 8, 1024] tile over 4 warps: 89 barriers a program, 17 without;
    sm_90, triton 3.9). With PTX (`store_ptx`) each thread stores the elements it holds, one
    predicated st.global each, in the tile's own layout.
    """
    if PTX != "":
        tl.inline_asm_elementwise(PTX, CONSTRAINTS, [pointers, bits, keep], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.store(pointers, bits.to(pointers.dtype.element_ty, bitcast=True), mask=keep != 0)


@triton.jit
def _dense_chunk(size, BOUND_GROUPS: tl.constexpr):
    """Whether a chunk takes the share steps that cost a reduction each (`_chunk_bounds`'
    BOUND): where more than BOUND_GROUPS of its group maxima lie above its bound (size; -1:
    entmax-1.5's Newton stopped by its step cap, which only large supports reach). Those
    chunks' entries crowd below their max (uniform rows: NOTES v74), and alike chunks make the
    share bound the row pass's start (`_split_row_start`); elsewhere (randn rows) the largest
    chunk bound is, and the steps would be idle."""
    return (tl.max(size, 0) > BOUND_GROUPS) | (tl.min(size, 0) < 0)


@triton.jit
def _sparsemax_chunk_bound(group_d, start, BOUND_GROUPS: tl.constexpr, share,
                           SHARE_STEPS: tl.constexpr):
    """Lower bounds from a chunk's group maxima less the chunk's max ([1, 1, W]): on the row's
    tau, a Newton iterate for their tau from start (a lower bound on it: the tau of their
    largest two, `_chunk_bounds`), stopped once at most BOUND_GROUPS of them lie above it (at
    most GROUP x BOUND_GROUPS candidates), or exact with 0; and on the root of
    sum(max(d - t, 0)) = share <= 1, up to SHARE_STEPS Newton steps towards it.
    The first of these is free: from the last iterate `pivot`, whose sum of d - pivot is
    1 + step x size, it lands (1 - share) / size above the bound; the others are taken on
    dense chunks only (`_dense_chunk`)."""
    # A lower bound, not an output: no drift check.
    pivot, step, _, _, size = _newton_threshold(group_d, start, tl.zeros_like(start), False,
                                                BOUND_GROUPS)
    bound = pivot + step
    share_bound = bound
    if SHARE_STEPS > 0:
        share_bound += tl.where(size > 0, (1.0 - share) / size, 0.0)
    if SHARE_STEPS > 1:
        if _dense_chunk(size, BOUND_GROUPS):
            for _step in tl.static_range(SHARE_STEPS - 1):
                above = group_d > share_bound[:, None, None]
                # One reduction of both sums: pass 1 is bound by its chain of barriers (v46).
                total, count = tl.reduce(
                    (tl.where(above, group_d - share_bound[:, None, None], 0.0),
                     above.to(group_d.dtype)), 2, _add_add)
                total, count = tl.reduce((total, count), 1, _add_add)
                share_bound += tl.where(count > 0, (total - share) / count, 0.0)
    return bound, share_bound


@triton.jit
def _chunk_bounds(x_in, pid, Y, PART, n_splits, n_rows, n, inner,
                  y_stride_outer, y_stride_inner, y_stride_n,
                  CHUNK: tl.constexpr, GROUP: tl.constexpr, INDEX: tl.constexpr,
                  WIDE: tl.constexpr, SCATTER_PTX: tl.constexpr,
                  SCATTER_CONSTRAINTS: tl.constexpr, BOUND_GROUPS: tl.constexpr,
                  BOUND: tl.constexpr, TOP_TWO_START: tl.constexpr, EARLY_ZEROS: tl.constexpr,
                  SHARE_STEPS: tl.constexpr, SECOND: tl.constexpr):
    """Split pass 1's work on chunk pid, loaded as x_in: the chunk's max, a lower bound on the
    row's threshold relative to that max (BOUND: the op's, `_sparsemax_chunk_bound` or
    entmax-1.5's, from the chunk's group maxima, starting from TOP_TWO_START's tau of the
    largest two of them), and its candidates: the entries above that bound, a superset of the
    chunk's part of the row's support. When they fill at most half the chunk, they are stored
    in the output's chunk (values, then their indices as INDEX bits), so that later passes need
    not read the chunk again; when they are at most EARLY_ZEROS, every other output of the
    chunk is 0, written here. With SECOND the chunk's second largest entry goes to PART too:
    where no chunk's second lies above the row's start, the row pass needs only the chunks'
    maxima (`_held_candidates`).

    BOUND also gives a share bound: a t at which the chunk's part of the op's sum (F_c(t),
    sum(max(x - t, 0)) for sparsemax) is at least SHARE_SLACK / C of the 1 the row's C chunks
    sum to at tau. As F = sum of F_c falls with t, the smallest share bound of a row's chunks
    is a lower bound on its tau (`_split_row_start`): near tau on rows whose chunks are alike."""
    row = pid // n_splits
    x = x_in.to(tl.float64 if x_in.dtype == tl.float64 else tl.float32)
    if SECOND:
        group_max, chunk_max, maxima_second, chunk_second = _chunk_top(x)
        # The group maxima's steps start from their own largest two: the chunk's second may
        # lie in the max's group, and their tau below that of the chunk's largest two.
        start = TOP_TWO_START(maxima_second - chunk_max)
    else:
        group_max = _group_max(x)
        chunk_max, start = _row_max_and_start(group_max, True, TOP_TWO_START)
    share = tl.minimum(SHARE_SLACK / n_splits, 1.0)
    bound, share_bound = BOUND(tl.expand_dims(group_max - chunk_max[:, None], 1), start,
                               BOUND_GROUPS, share, SHARE_STEPS)
    # A margin of a few ulps: the later passes compare in the row's coordinates, rounded
    # differently, and must never find a support entry that is not a candidate.
    keep = (x - chunk_max[:, None, None]) > (bound - tl.abs(bound) * CANDIDATE_MARGIN)[:, None, None]
    keep = keep.to(tl.int32)
    column_count = tl.sum(keep, axis=1)  # inside each thread
    count = tl.sum(column_count)
    start = (pid % n_splits) * CHUNK
    if 2 * count <= tl.minimum(n - start, CHUNK):
        # Slots in (column, group) order: one scan across the threads, of the columns' counts;
        # down a column (inside a thread) a running count.
        column_start = tl.cumsum(column_count, axis=1) - column_count
        slot = column_start[:, None, :] + tl.cumsum(keep, axis=1) - 1
        index = tl.arange(0, GROUP)[:, None] * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
        y_row = Y + _entry_offsets(row, start + slot, inner, y_stride_outer, y_stride_inner,
                                   y_stride_n, WIDE)
        _scatter(y_row, x_in.to(Y.dtype.element_ty).to(INDEX, bitcast=True), keep, SCATTER_PTX,
                 SCATTER_CONSTRAINTS)
        _scatter(y_row + count * y_stride_n, index[None, :, :].to(INDEX), keep, SCATTER_PTX,
                 SCATTER_CONSTRAINTS)
        if count <= EARLY_ZEROS:
            # Stores while the chunk is in flight: the write pass then writes only the
            # candidates' slots and outputs, not the whole chunk.
            y_off, y_mask = _split_chunk(pid, n_splits, n_rows, n, inner, y_stride_outer,
                                         y_stride_inner, y_stride_n, CHUNK, GROUP, WIDE)[1:]
            tl.store(Y + y_off, tl.zeros(y_mask.shape, Y.dtype.element_ty),
                     mask=y_mask & (index >= 2 * count)[None, :, :])
    part = PART + pid * PART_SIZE
    tl.store(part + PART_MAX, tl.reshape(chunk_max, []))
    tl.store(part + PART_BOUND, tl.reshape(bound, []))
    tl.store(part + PART_COUNT, count.to(chunk_max.dtype))
    tl.store(part + PART_SHARE, tl.reshape(share_bound, []))
    if SECOND:
        tl.store(part + PART_SECOND, tl.reshape(chunk_second, []))


@triton.jit
def split_bounds_kernel(
    X, Y, PART, n_splits, n_rows, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, INDEX: tl.constexpr, WIDE: tl.constexpr,
    SCATTER_PTX: tl.constexpr, SCATTER_CONSTRAINTS: tl.constexpr, PREFETCH: tl.constexpr,
    BOUND_GROUPS: tl.constexpr, BOUND: tl.constexpr, TOP_TWO_START: tl.constexpr,
    EARLY_ZEROS: tl.constexpr, SHARE_STEPS: tl.constexpr, SECOND: tl.constexpr,
):
    """Split pass 1 (`_chunk_bounds`), one chunk per program; with PREFETCH program p does
    chunks p, p + programs, ... and loads the next one before working on this one, as
    `_map_rows` does with rows."""
    pid = tl.program_id(0)
    off, mask = _split_chunk(pid, n_splits, n_rows, n, inner, x_stride_outer, x_stride_inner,
                             x_stride_n, CHUNK, GROUP, WIDE)[1:]
    x_in = tl.load(X + off, mask=mask, other=-float("inf"))
    if PREFETCH:
        programs = tl.num_programs(0)
        for following in tl.range(pid + programs, n_rows * n_splits + programs, programs,
                                   num_stages=1):
            # Past the last chunk the rows are masked: nothing is read.
            off, mask = _split_chunk(following, n_splits, n_rows, n, inner, x_stride_outer,
                                     x_stride_inner, x_stride_n, CHUNK, GROUP, WIDE)[1:]
            x_next = tl.load(X + off, mask=mask, other=-float("inf"))
            _chunk_bounds(x_in, pid, Y, PART, n_splits, n_rows, n, inner, y_stride_outer,
                          y_stride_inner, y_stride_n, CHUNK, GROUP, INDEX, WIDE, SCATTER_PTX,
                          SCATTER_CONSTRAINTS, BOUND_GROUPS, BOUND, TOP_TWO_START, EARLY_ZEROS,
                          SHARE_STEPS, SECOND)
            x_in = x_next
            pid = following
    else:
        _chunk_bounds(x_in, pid, Y, PART, n_splits, n_rows, n, inner, y_stride_outer,
                      y_stride_inner, y_stride_n, CHUNK, GROUP, INDEX, WIDE, SCATTER_PTX,
                      SCATTER_CONSTRAINTS, BOUND_GROUPS, BOUND, TOP_TWO_START, EARLY_ZEROS,
                      SHARE_STEPS, SECOND)


@triton.jit
def _candidate_values(X, Y, row, splits, stored, width, offset, inner,
                      x_stride_outer, x_stride_inner, x_stride_n,
                      y_stride_outer, y_stride_inner, y_stride_n,
                      CHUNK: tl.constexpr, WIDTH: tl.constexpr, WIDE: tl.constexpr, first=0):
    """Candidates offset ... offset + WIDTH of the chunks `splits` [SPLITS] of a split row
    (`_candidate_extent`'s stored, width and first [SPLITS, 1]: in the output from each chunk's
    column `first` on, or the whole chunk of x where none were stored), as x's values
    [SPLITS, WIDTH], -inf past each chunk's width."""
    slot = offset + tl.arange(0, WIDTH)[None, :]
    cols = splits[:, None] * CHUNK + slot
    live = slot < width[:, None]
    cand = tl.load(Y + _entry_offsets(row, cols + first, inner, y_stride_outer, y_stride_inner,
                                      y_stride_n, WIDE),
                   mask=live & stored[:, None], other=-float("inf"))
    whole = tl.load(X + _entry_offsets(row, cols, inner, x_stride_outer, x_stride_inner,
                                       x_stride_n, WIDE),
                    mask=live & ~stored[:, None], other=-float("inf"))
    return tl.where(stored[:, None], cand.to(X.dtype.element_ty), whole)


@triton.jit
def _store_kept(Y, row, x, keep, kept, column, room, inner, y_stride_outer, y_stride_inner,
                y_stride_n, WIDE: tl.constexpr):
    """Stores the entries of x [N] that `keep` marks, in order, after the `kept` [1] stored
    before them from the row's column `column` on, those that fall within its first `room`
    slots; returns how many are kept now (more than `room` once they overflow)."""
    slot = kept + tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(Y + _entry_offsets(row, column + slot, inner, y_stride_outer, y_stride_inner,
                                y_stride_n, WIDE),
             x.to(Y.dtype.element_ty), mask=keep & (slot < room))
    return kept + tl.sum(keep.to(tl.int32), 0)


@triton.jit
def _candidate_sums(X, Y, PART, row, n_splits, n, inner,
                    x_stride_outer, x_stride_inner, x_stride_n,
                    y_stride_outer, y_stride_inner, y_stride_n, row_max, tau, centre,
                    CHUNK: tl.constexpr, SPLITS: tl.constexpr, WIDTH: tl.constexpr,
                    WIDE: tl.constexpr, scratch=0, room=0, COMPACT: tl.constexpr = 0,
                    PREFILTERED: tl.constexpr = False):
    """`_step_sums` of a split row at each of the taus [P] (centre [P]) over its chunks'
    candidates (`_candidate_values`), SPLITS chunks times WIDTH entries at a time. With
    COMPACT, also how many lie above tau [1] less COMPACT_MARGIN (else 0), the first `room` of
    them stored in turn at the row's column `scratch` on (`_compaction_scratch`); once they
    overflow it, the rest are neither stored nor counted (the count is then only more than
    `room`)."""
    total = tl.zeros_like(tau)
    count = tl.zeros_like(tau)
    smallest = tl.full(tau.shape, float("inf"), tau.dtype)
    kept = tl.zeros([1], tl.int32)
    for first in range(0, n_splits, SPLITS):
        splits = first + tl.arange(0, SPLITS)
        first_col, width, stored = _candidate_extent(PART, row, splits, n_splits, n, CHUNK,
                                                     PREFILTERED)
        for offset in range(0, tl.max(width, 0), WIDTH):
            x = _candidate_values(X, Y, row, splits, stored, width, offset, inner,
                                  x_stride_outer, x_stride_inner, x_stride_n, y_stride_outer,
                                  y_stride_inner, y_stride_n, CHUNK, WIDTH, WIDE,
                                  first_col[:, None])
            z = x.to(tau.dtype) - row_max
            sums = _step_sums(tl.expand_dims(z, 0), tau, centre)
            total, count, smallest = _add_add_min(total, count, smallest, *sums)
            if COMPACT > 0:
                if tl.sum((kept <= room).to(tl.int32), 0) > 0:
                    keep = tl.reshape(z, [SPLITS * WIDTH]) > tau - COMPACT_MARGIN
                    kept = _store_kept(Y, row, tl.reshape(x, [SPLITS * WIDTH]), keep, kept,
                                       scratch, room, inner, y_stride_outer, y_stride_inner,
                                       y_stride_n, WIDE)
    return total, count, smallest, kept


@triton.jit
def _held_candidates(X, Y, PART, row, n_splits, n, inner,
                     x_stride_outer, x_stride_inner, x_stride_n,
                     y_stride_outer, y_stride_inner, y_stride_n, row_max,
                     CHUNK: tl.constexpr, SPLITS: tl.constexpr, WIDTH: tl.constexpr,
                     WIDE: tl.constexpr, PREFILTERED: tl.constexpr = False, start=None,
                     MAXIMA: tl.constexpr = False):
    """Whether one of `_candidate_sums`' tiles holds all of a split row's entries that its
    Newton steps can sum, and if so that tile as z = x - max [1, SPLITS, WIDTH] (else not
    read): a row pass can keep it in registers across its steps instead of reading at each.
    That tile holds the candidates, where every chunk stored its own, at most WIDTH, and
    SPLITS covers the chunks.

    With MAXIMA (pass 1 stored each chunk's second largest entry, PART_SECOND), where none
    lies above start (x - max, the steps' lower bound on tau), less COMPACT_MARGIN for their
    roundings, every entry above it is a chunk's max: the tile holds the maxima, one a chunk,
    and no candidate is read (randn rows of millions of entries, whose supports of 5-15 lie
    one to a chunk: NOTES, v78)."""
    splits = tl.arange(0, SPLITS)
    first_col, width, stored = _candidate_extent(PART, row, splits, n_splits, n, CHUNK,
                                                 PREFILTERED)
    covered = n_splits <= SPLITS
    held = covered & (tl.max(width, 0) <= WIDTH)
    if MAXIMA:
        valid = splits < n_splits
        part = PART + (row * n_splits + splits) * PART_SIZE
        second = tl.load(part + PART_SECOND, mask=valid, other=-float("inf")).to(row_max.dtype)
        maxima_only = covered & (tl.max(second - row_max - start, 0) <= -COMPACT_MARGIN)
    else:
        maxima_only = held & False
    x = _candidate_values(X, Y, row, splits, stored, tl.where(held & ~maxima_only, width, 0),
                          0, inner, x_stride_outer, x_stride_inner, x_stride_n, y_stride_outer,
                          y_stride_inner, y_stride_n, CHUNK, WIDTH, WIDE, first_col[:, None])
    z = x.to(row_max.dtype)
    if MAXIMA:
        chunk_max = tl.load(part + PART_MAX, mask=valid, other=-float("inf")).to(row_max.dtype)
        z = tl.where(maxima_only,
                     tl.where(tl.arange(0, WIDTH)[None, :] == 0, chunk_max[:, None],
                              -float("inf")), z)
    return held | maxima_only, tl.expand_dims(z - row_max, 0)


@triton.jit
def _held_sums(z, tau, centre):
    """`_candidate_sums` over candidates held in one tile (`_held_candidates`), the same sums
    to the bit."""
    zero = tl.zeros_like(tau)
    return _add_add_min(zero, zero, tl.full(tau.shape, float("inf"), tau.dtype),
                        *_step_sums(z, tau, centre))


@triton.jit
def _free_slots(length, count, stored, EARLY_ZEROS: tl.constexpr):
    """Per chunk (`_chunk_extent`'s length, count, stored): its first column past its stored
    candidates, and how many of its slots from there pass 3 rewrites, free as scratch until
    then: all of them in chunks it writes whole (more than EARLY_ZEROS candidates, or none
    stored), none in the others (pass 1 wrote their zeros; pass 3 writes only their slots)."""
    first = tl.where(stored, 2 * count, 0)
    return first, tl.where((count > EARLY_ZEROS) | ~stored, length - first, 0)


@triton.jit
def _compaction_scratch(PART, row, n_splits, n, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
                        COMPACT: tl.constexpr, EARLY_ZEROS: tl.constexpr):
    """Where a split row pass may compact the candidates above its start (`_candidate_sums`):
    the free slots of the row's chunk with the most of them, past its stored candidates,
    among the chunks that pass 3 writes whole (more than EARLY_ZEROS candidates, or none
    stored): (its first free column [1], how many of them to use, at most COMPACT)."""
    scratch = tl.zeros([1], tl.int32)
    room = tl.zeros([1], tl.int32)
    for first in range(0, n_splits, SPLITS):
        splits = first + tl.arange(0, SPLITS)
        used, free = _free_slots(*_chunk_extent(PART, row, splits, n_splits, n, CHUNK),
                                 EARLY_ZEROS)
        most = tl.max(free, 0)
        # The first chunk of this group with the most free slots, if more than so far.
        at = tl.min(tl.where(free == most, splits, n_splits), 0)
        start = at * CHUNK + tl.sum(tl.where(splits == at, used, 0), 0)
        scratch = tl.where(most > room, start, scratch)
        room = tl.maximum(room, most)
    return scratch, tl.minimum(room, COMPACT)


@triton.jit
def _compacted_tile(Y, row, scratch, kept, room, inner, y_stride_outer, y_stride_inner,
                    y_stride_n, row_max, COMPACT: tl.constexpr, WIDE: tl.constexpr):
    """Whether the `kept` candidates compacted at column `scratch` on fit its `room`, and if
    so the tile of them as z = x - max [1, 1, COMPACT], -inf past them.

    Dense rows have tens of thousands of candidates, of which a few thousand lie above the
    row pass's start (1 x 4194304 uniform: 4614 of 47143, NOTES v70): its Newton steps then
    go over those, in registers, instead of reading all of them each step."""
    fits = kept <= room
    # The compacting stores by every thread, before any thread reads them back.
    tl.debug_barrier()
    slot = tl.arange(0, COMPACT)
    x = tl.load(Y + _entry_offsets(row, scratch + slot, inner, y_stride_outer, y_stride_inner,
                                   y_stride_n, WIDE),
                mask=(slot < kept) & fits, other=-float("inf"))
    return tl.max(fits.to(tl.int32), 0) > 0, tl.reshape(x.to(row_max.dtype) - row_max,
                                                       [1, 1, COMPACT])


@triton.jit
def _sparsemax_subset_bound(d):
    """The exact tau of a subset of a row, d = its entries less the row's max [1, 1, SPLITS]
    (-inf padding), less TOP_TWO_MARGIN against its rounding: a lower bound on the row's tau
    (`_split_row_start`); -inf where d holds a NaN."""
    largest, start = _row_max_and_start(tl.reshape(d, [1, d.shape[2]]), True,
                                        _sparsemax_top_two_start)
    start += largest  # relative to the subset's own largest
    pivot, step = _newton_threshold(d, start, tl.zeros_like(start), False)[:2]
    tau = pivot + step
    return tl.where(tau == tau, tau - TOP_TWO_MARGIN, -float("inf"))


@triton.jit
def _split_row_start(PART, row, n_splits, SPLITS: tl.constexpr, compute: tl.constexpr,
                     FLOOR: tl.constexpr, SUBSET_BOUND: tl.constexpr):
    """A split row's max [1] from its chunks' (PART), and their best bound on its threshold
    relative to that max, at least FLOOR (the op's lowest threshold: -1 for sparsemax): the
    largest of their bounds and of SUBSET_BOUND's (the op's, `_sparsemax_subset_bound`) on
    each SPLITS of their maxima, or the smallest of their share bounds (`_chunk_bounds`) if
    that is larger.

    The chunk maxima's: on randn rows the largest chunk bound is often FLOOR (the chunk that
    holds the row's max, far above its own group maxima, stops its Newton at once), from where
    the row pass took 3-7 Newton steps at 1 x 4194304; the few entries of such a row's support
    lie one to a chunk, so from their maxima's tau it takes about one (NOTES v75)."""
    row_max = tl.full([1], -float("inf"), compute)
    for first in range(0, n_splits, SPLITS):
        splits = first + tl.arange(0, SPLITS)
        part = PART + (row * n_splits + splits) * PART_SIZE
        chunk_max = tl.load(part + PART_MAX, mask=splits < n_splits, other=-float("inf"))
        row_max = _nan_max(row_max, tl.reduce(chunk_max, 0, _nan_max))
    bound = tl.full([1], FLOOR, compute)
    shared = tl.full([1], 0.0, compute)
    for first in range(0, n_splits, SPLITS):
        splits = first + tl.arange(0, SPLITS)
        valid = splits < n_splits
        part = PART + (row * n_splits + splits) * PART_SIZE
        chunk_max = tl.load(part + PART_MAX, mask=valid, other=-float("inf"))
        # A chunk's bounds in the row's coordinates; chunks with no finite entry bound nothing
        # and hold no share of the row (their bounds, NaN, count as FLOOR).
        finite = chunk_max > -float("inf")
        offset = chunk_max - row_max
        chunk_bound = offset + tl.load(part + PART_BOUND, mask=valid, other=0.0)
        bound = tl.maximum(bound, tl.max(tl.where(finite, chunk_bound, FLOOR), 0))
        maxima = tl.where(finite, offset, -float("inf"))
        bound = tl.maximum(bound, SUBSET_BOUND(tl.reshape(maxima, [1, 1, SPLITS])))
        share_bound = offset + tl.load(part + PART_SHARE, mask=valid, other=0.0)
        share_bound = tl.where(finite, tl.maximum(share_bound, FLOOR), FLOOR)
        shared = tl.minimum(shared, tl.min(tl.where(valid, share_bound, 0.0), 0))
    # A margin against the roundings of the shift to the row's coordinates.
    return row_max, tl.maximum(bound, shared + shared * CANDIDATE_MARGIN)


@triton.jit
def split_prefilter_kernel(
    X, Y, PART, n_splits, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    CHUNK: tl.constexpr, SPLITS: tl.constexpr, PIECE: tl.constexpr, WIDE: tl.constexpr,
    HELD_WIDTH: tl.constexpr, EARLY_ZEROS: tl.constexpr, FLOOR: tl.constexpr,
    SUBSET_BOUND: tl.constexpr,
):
    """Before split pass 2, one program per chunk: the chunk's candidates above its row's
    start (`_split_row_start` with the op's lowest threshold FLOOR and SUBSET_BOUND, less
    COMPACT_MARGIN),
    kept in order in the output's chunk past its stored candidates (the whole chunk where
    none were stored), their column and count in PART (PART_KEPT -1: pass 2 reads the
    chunk's candidates as pass 1 left them).

    Dense rows have tens of thousands of candidates, a tenth of them above the start
    (1 x 4194304 uniform: 4614 of 47143, NOTES v70): kept here by all chunks at once, they fit
    the row pass's held tile, which then takes its Newton steps in registers. Left as pass 1
    left them: rows whose candidates a tile of HELD_WIDTH holds already, and chunks whose
    kept ones do not fit past their stored ones, or whose other outputs pass 1 wrote (at most
    EARLY_ZEROS candidates): pass 3 writes only their candidates' slots."""
    pid = tl.program_id(0)
    row = pid // n_splits
    split = pid % n_splits + tl.arange(0, 1)
    compute: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    length, count, stored = _chunk_extent(PART, row, split, n_splits, n, CHUNK)
    width = tl.where(stored, count, length)
    chunks = tl.arange(0, SPLITS)
    row_widths = _candidate_extent(PART, row, chunks, n_splits, n, CHUNK, False)[1]
    held = (n_splits <= SPLITS) & (tl.max(row_widths, 0) <= HELD_WIDTH)
    first_col, room = _free_slots(length, count, stored, EARLY_ZEROS)
    kept = tl.zeros([1], tl.int32)
    fits = kept < 0
    if ~held:
        # The row's start only where the row pass cannot hold the row already (randn rows
        # stop here: one read of the row's PART, not three).
        row_max, start = _split_row_start(PART, row, n_splits, SPLITS, compute, FLOOR,
                                          SUBSET_BOUND)
        filtering = ~_is_bad(row_max)
        if tl.sum(filtering.to(tl.int32), 0) > 0:
            for offset in range(0, tl.max(width, 0), PIECE):
                x = tl.reshape(_candidate_values(X, Y, row, split, stored, width, offset, inner,
                                                 x_stride_outer, x_stride_inner, x_stride_n,
                                                 y_stride_outer, y_stride_inner, y_stride_n,
                                                 CHUNK, PIECE, WIDE), [PIECE])
                keep = x.to(compute) - row_max > start - COMPACT_MARGIN
                kept = _store_kept(Y, row, x, keep, kept, split * CHUNK + first_col, room,
                                   inner, y_stride_outer, y_stride_inner, y_stride_n, WIDE)
        fits = filtering & (kept <= room)
    part = PART + pid * PART_SIZE
    tl.store(part + PART_KEPT_AT + tl.arange(0, 1), first_col.to(PART.dtype.element_ty))
    tl.store(part + PART_KEPT + tl.arange(0, 1), tl.where(fits, kept, -1).to(
        PART.dtype.element_ty))


@triton.jit
def sparsemax_split_threshold_kernel(
    X, Y, PART, STATE, n_splits, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    CHUNK: tl.constexpr, SPLITS: tl.constexpr, WIDTH: tl.constexpr, WIDE: tl.constexpr,
    HELD_WIDTH: tl.constexpr, COMPACT: tl.constexpr, EARLY_ZEROS: tl.constexpr,
    PREFILTERED: tl.constexpr, MAXIMA: tl.constexpr,
):
    """Split pass 2, one program per row: the row's max and exact tau, by Newton from the best
    chunk bound over the chunks' candidates (with PREFILTERED, those above the start that
    `split_prefilter_kernel` kept): held in registers when a [SPLITS, HELD_WIDTH] tile holds
    them, else read at each step; with COMPACT > 0 each such read also keeps those above its
    tau, and once a tile of COMPACT holds them (`_compacted_tile`) the later steps go over that
    tile. With MAXIMA, only the chunks' maxima where they hold the support (`_held_candidates`)."""
    row = tl.program_id(0)
    compute: tl.constexpr = tl.float64 if X.dtype.element_ty == tl.float64 else tl.float32
    half: tl.constexpr = X.dtype.element_ty.primitive_bitwidth == 16
    row_max, tau = _split_row_start(PART, row, n_splits, SPLITS, compute, -1.0,
                                    _sparsemax_subset_bound)
    pivot = tau
    step = tl.zeros_like(tau)
    centre = tl.zeros_like(tau)
    smallest = tl.full(tau.shape, float("inf"), compute)
    done = _is_bad(row_max)
    held, z = _held_candidates(X, Y, PART, row, n_splits, n, inner, x_stride_outer,
                               x_stride_inner, x_stride_n, y_stride_outer, y_stride_inner,
                               y_stride_n, row_max, CHUNK, SPLITS, HELD_WIDTH, WIDE,
                               PREFILTERED, tau, MAXIMA)
    pending = tl.sum((~done).to(tl.int32), axis=0)
    if held:
        while pending > 0:
            total, count, smallest = _held_sums(z, pivot + step, centre)
            pivot, step, centre, done = _newton_update(total, count, smallest, pivot, step,
                                                       centre, done, not half)
            pending = tl.sum((~done).to(tl.int32), axis=0)
    else:
        # Rows not held: the compacted tile's registers are not live in the held rows' loop.
        compacted = held  # False here, as held's [1] bool
        COMPACT_WIDTH: tl.constexpr = COMPACT if COMPACT > 0 else 1
        compact_z = tl.full([1, 1, COMPACT_WIDTH], -float("inf"), compute)
        if COMPACT > 0:
            # Each read also keeps the candidates above its tau, until they fit the tile.
            scratch, room = _compaction_scratch(PART, row, n_splits, n, CHUNK, SPLITS, COMPACT,
                                                EARLY_ZEROS)
            kept = room + 1
            while (pending > 0) & (tl.sum((kept > room).to(tl.int32), axis=0) > 0):
                total, count, smallest, kept = _candidate_sums(
                    X, Y, PART, row, n_splits, n, inner, x_stride_outer, x_stride_inner,
                    x_stride_n, y_stride_outer, y_stride_inner, y_stride_n, row_max,
                    pivot + step, centre, CHUNK, SPLITS, WIDTH, WIDE, scratch, room, COMPACT)
                pivot, step, centre, done = _newton_update(total, count, smallest, pivot, step,
                                                           centre, done, not half)
                pending = tl.sum((~done).to(tl.int32), axis=0)
            compacted, compact_z = _compacted_tile(Y, row, scratch, kept, room, inner,
                                                   y_stride_outer, y_stride_inner, y_stride_n,
                                                   row_max, COMPACT, WIDE)
        while pending > 0:
            if compacted:
                total, count, smallest = _held_sums(compact_z, pivot + step, centre)
            else:
                total, count, smallest, _ = _candidate_sums(
                    X, Y, PART, row, n_splits, n, inner, x_stride_outer, x_stride_inner,
                    x_stride_n, y_stride_outer, y_stride_inner, y_stride_n, row_max,
                    pivot + step, centre, CHUNK, SPLITS, WIDTH, WIDE, PREFILTERED=PREFILTERED)
            pivot, step, centre, done = _newton_update(total, count, smallest, pivot, step,
                                                       centre, done, not half)
            pending = tl.sum((~done).to(tl.int32), axis=0)
    zero_below = _zero_below(pivot + step)
    if compute == tl.float32:
        if tl.sum(_tiny(pivot, step, smallest).to(tl.int32), axis=0) > 0:
            # As `_exact_outputs` does in registers: one fp64 Newton step, over the candidates,
            # from just below tau; ties at EXACT_ZERO_BELOW of it.
            tau64 = pivot.to(tl.float64) + step.to(tl.float64)
            lower = tau64 - tl.abs(tau64) * EXACT_LOWER
            total, count, _, _ = _candidate_sums(
                X, Y, PART, row, n_splits, n, inner, x_stride_outer, x_stride_inner,
                x_stride_n, y_stride_outer, y_stride_inner, y_stride_n, row_max.to(tl.float64),
                lower, tl.zeros_like(lower), CHUNK, SPLITS, WIDTH, WIDE,
                PREFILTERED=PREFILTERED)
            exact = lower + (total - 1.0) / count
            pivot = exact.to(tl.float32)
            step = (exact - pivot.to(tl.float64)).to(tl.float32)
            zero_below = (tl.abs(exact) * EXACT_ZERO_BELOW).to(tl.float32)
    state = STATE + row * STATE_SIZE
    tl.store(state + STATE_MAX, tl.reshape(row_max, []))
    tl.store(state + STATE_PIVOT, tl.reshape(pivot, []))
    tl.store(state + STATE_STEP, tl.reshape(step, []))
    tl.store(state + STATE_ZERO_BELOW, tl.reshape(zero_below, []))


@triton.jit
def sparsemax_split_sums_kernel(
    X, Y, PART, ROW_MAX, TAUS, CENTRE, STATS, n_splits, n_rows, n, inner, n_points,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    CHUNK: tl.constexpr, SPLITS: tl.constexpr, WIDTH: tl.constexpr, POINTS: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Pass 2 of a row split across ranks (`flashmax.distributed`), one program per row:
    STATS[point, (sum, count, smallest), row] of d = z - tau over d > 0 at each of the row's
    n_points taus TAUS[point, row] (NaN: a finished row, not read), over the row's candidates,
    read once for all points. The sum is that of d - CENTRE[row] plus count * centre in
    float64 (see _step_sums)."""
    row = tl.program_id(0)
    points = tl.arange(0, POINTS)
    tau = tl.load(TAUS + points * n_rows + row, mask=points < n_points, other=float("nan"))
    centre = tl.load(CENTRE + row) + tl.zeros_like(tau)
    total = tl.zeros_like(tau)
    count = tl.zeros_like(tau)
    smallest = tl.full(tau.shape, float("inf"), tau.dtype)
    if tl.max((tau == tau).to(tl.int32), 0) > 0:
        row_max = tl.load(ROW_MAX + row + tl.arange(0, 1))
        total, count, smallest, _ = _candidate_sums(
            X, Y, PART, row, n_splits, n, inner, x_stride_outer, x_stride_inner, x_stride_n,
            y_stride_outer, y_stride_inner, y_stride_n, row_max, tau, centre, CHUNK, SPLITS,
            WIDTH, WIDE)
    count = count.to(tl.float64)
    out = STATS + points * 3 * n_rows + row
    live = points < n_points
    tl.store(out, total.to(tl.float64) + count * centre.to(tl.float64), mask=live)
    tl.store(out + n_rows, count, mask=live)
    tl.store(out + 2 * n_rows, smallest.to(tl.float64), mask=live)


@triton.jit
def _write_stored_chunk(Y, pid, row, split, count, row_max, pivot, step, bad, zero_below,
                        n_splits, n_rows, n, inner, y_stride_outer, y_stride_inner, y_stride_n,
                        CHUNK: tl.constexpr, GROUP: tl.constexpr, WIDTH: tl.constexpr,
                        INDEX: tl.constexpr, WIDE: tl.constexpr, OUTPUTS: tl.constexpr,
                        SLOTS_ONLY: tl.constexpr):
    """Split pass 3 on a chunk that stored its `count` (at most WIDTH) candidates, reading
    nothing else: zeros over the chunk (NaN in a bad row; SLOTS_ONLY: zeros over the
    candidates' slots alone, pass 1 having written the others), then the candidates'
    outputs."""
    slot = tl.arange(0, WIDTH)
    live = slot < count
    cand_off = _entry_offsets(row, split * CHUNK + slot, inner, y_stride_outer, y_stride_inner,
                              y_stride_n, WIDE)
    cand = tl.load(Y + cand_off, mask=live, other=-float("inf"))
    index = tl.load(Y + cand_off + count * y_stride_n, mask=live, other=0.0)
    index = index.to(INDEX, bitcast=True).to(tl.int32)
    # The candidates are read from the chunk the zeros overwrite, and some outputs land
    # where zeros were written: every thread's accesses must be done before the next step.
    tl.debug_barrier()
    if SLOTS_ONLY:
        slots = tl.arange(0, 2 * WIDTH)
        tl.store(Y + _entry_offsets(row, split * CHUNK + slots, inner, y_stride_outer,
                                    y_stride_inner, y_stride_n, WIDE),
                 tl.zeros(slots.shape, Y.dtype.element_ty), mask=slots < 2 * count)
    else:
        y_off, mask = _split_chunk(pid, n_splits, n_rows, n, inner, y_stride_outer,
                                   y_stride_inner, y_stride_n, CHUNK, GROUP, WIDE)[1:]
        zero = tl.where(bad, float("nan"), 0.0)[:, None, None] + tl.zeros(mask.shape, tl.float32)
        tl.store(Y + y_off, zero.to(Y.dtype.element_ty), mask=mask)
    tl.debug_barrier()
    cand_d = cand.to(row_max.dtype)[None, None, :] - row_max[:, None, None]
    cand_y = tl.reshape(OUTPUTS(cand_d, pivot, step, bad, zero_below), [WIDTH])
    tl.store(Y + _entry_offsets(row, split * CHUNK + index, inner, y_stride_outer,
                                y_stride_inner, y_stride_n, WIDE),
             cand_y.to(Y.dtype.element_ty), mask=live)


@triton.jit
def split_write_kernel(
    X, Y, PART, STATE, n_splits, n_rows, n, inner,
    x_stride_outer, x_stride_inner, x_stride_n,
    y_stride_outer, y_stride_inner, y_stride_n,
    CHUNK: tl.constexpr, GROUP: tl.constexpr, SPARSE: tl.constexpr, INDEX: tl.constexpr,
    WIDE: tl.constexpr, OUTPUTS: tl.constexpr, EARLY_ZEROS: tl.constexpr,
):
    """Split pass 3, one chunk per program: the outputs OUTPUTS(x - max, pivot, step, bad,
    zero_below) (the op's, `_outputs_within` or entmax-1.5's). A chunk that stored at most
    SPARSE candidates writes them alone (`_write_stored_chunk`; with at most EARLY_ZEROS, a
    power of two or 0, pass 1 wrote its other zeros); the other chunks are read again."""
    pid = tl.program_id(0)
    row = pid // n_splits
    state = STATE + row * STATE_SIZE
    row_max = tl.load(state + STATE_MAX + tl.arange(0, 1))
    pivot = tl.load(state + STATE_PIVOT + tl.arange(0, 1))
    step = tl.load(state + STATE_STEP + tl.arange(0, 1))
    zero_below = tl.load(state + STATE_ZERO_BELOW + tl.arange(0, 1))
    bad = _is_bad(row_max)
    split = pid % n_splits
    count, stored = _chunk_extent(PART, row, split, n_splits, n, CHUNK)[1:]
    EARLY_WIDTH: tl.constexpr = EARLY_ZEROS if EARLY_ZEROS > 0 else 1
    if stored & (count <= EARLY_ZEROS) & (tl.sum(bad.to(tl.int32), axis=0) == 0):
        _write_stored_chunk(Y, pid, row, split, count, row_max, pivot, step, bad, zero_below,
                            n_splits, n_rows, n, inner, y_stride_outer, y_stride_inner,
                            y_stride_n, CHUNK, GROUP, EARLY_WIDTH, INDEX, WIDE, OUTPUTS, True)
    elif stored & (count <= SPARSE):
        _write_stored_chunk(Y, pid, row, split, count, row_max, pivot, step, bad, zero_below,
                            n_splits, n_rows, n, inner, y_stride_outer, y_stride_inner,
                            y_stride_n, CHUNK, GROUP, SPARSE, INDEX, WIDE, OUTPUTS, False)
    else:
        x_off, mask = _split_chunk(pid, n_splits, n_rows, n, inner, x_stride_outer,
                                   x_stride_inner, x_stride_n, CHUNK, GROUP, WIDE)[1:]
        y_off = _split_chunk(pid, n_splits, n_rows, n, inner, y_stride_outer, y_stride_inner,
                             y_stride_n, CHUNK, GROUP, WIDE)[1]
        x = tl.load(X + x_off, mask=mask, other=-float("inf"))
        d = x.to(row_max.dtype) - row_max[:, None, None]
        tl.store(Y + y_off, OUTPUTS(d, pivot, step, bad, zero_below).to(Y.dtype.element_ty),
                 mask=mask)


@triton.jit
def _add_add(total_a, count_a, total_b, count_b):
    return total_a + total_b, count_a + count_b


@triton.jit
def _support_sums(y, g):
    """(sum of g, count) over the support y > 0 of each row of a [BLOCK_M, 1, B] tile."""
    support = y > 0
    total, count = tl.reduce((tl.where(support, g, 0.0), support.to(g.dtype)), 2, _add_add)
    return tl.reshape(total, [total.shape[0]]), tl.reshape(count, [count.shape[0]])


@triton.jit
def _load_y_g(Yp, G, block, start, n_rows, n, inner,
              y_stride_outer, y_stride_inner, y_stride_n,
              g_stride_outer, g_stride_inner, g_stride_n,
              BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, WIDE: tl.constexpr,
              ROW_ALIGN: tl.constexpr = 1, ADJACENT: tl.constexpr = False):
    """Entries start ... start + WIDTH of BLOCK_M rows of y and g as [BLOCK_M, 1, WIDTH] tiles
    in y's compute dtype, and the mask (ROW_ALIGN, ADJACENT as `_row_offsets`'). Both loads
    are issued at once: reading g on the support alone (masked by y > 0) made whole rows wait
    for y first, 12-68% slower at 1024 and 32768 entries (NOTES, v35)."""
    compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
    y_off, mask = _row_offsets(block, start, n_rows, n, inner, y_stride_outer, y_stride_inner,
                               y_stride_n, BLOCK_M, 1, WIDTH, WIDE, ROW_ALIGN, ADJACENT)
    g_off, _ = _row_offsets(block, start, n_rows, n, inner, g_stride_outer, g_stride_inner,
                            g_stride_n, BLOCK_M, 1, WIDTH, WIDE, ROW_ALIGN, ADJACENT)
    y = tl.load(Yp + y_off, mask=mask, other=0.0).to(compute)
    g = tl.load(G + g_off, mask=mask, other=0.0).to(compute)
    return y, g, mask


@triton.jit
def _backward_tile(y, g, mean):
    return tl.where(y > 0, g - mean[:, None, None], 0.0)


# The row strides' alignment as the forward's (`sparsemax_forward_kernel`).
GRADIENT_ROW_STRIDES = ["y_stride_outer", "g_stride_outer", "dx_stride_outer"]
# Whole-row backward warps where measured faster than `launch_config`'s, by (element size,
# padded width). H200 (NOTES, v36): 2048 x 32768 bf16 1.24-1.29 -> 1.02-1.03 x floor over 16
# warps (no spills: 93 registers, 160 over 8); fp32 there and 16384 in either dtype gained
# nothing.
GRADIENT_ROW_WARPS = {(2, 32768): 16}


@triton.jit(do_not_specialize_on_alignment=GRADIENT_ROW_STRIDES)
def sparsemax_backward_kernel(
    Yp, G, DX, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    dx_stride_outer, dx_stride_inner, dx_stride_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDE: tl.constexpr, ROW_ALIGN: tl.constexpr,
    ADJACENT: tl.constexpr,
):
    """dx = s * (g - mean of g over s), s = (y > 0): BLOCK_M whole rows per program in
    registers, one read of y and g, one write."""
    block = tl.program_id(0)
    y, g, _ = _load_y_g(Yp, G, block, 0, n_rows, n, inner,
                         y_stride_outer, y_stride_inner, y_stride_n,
                         g_stride_outer, g_stride_inner, g_stride_n, BLOCK_M, BLOCK_N, WIDE,
                         ROW_ALIGN, ADJACENT)
    total, count = _support_sums(y, g)
    _store_rows(DX, _backward_tile(y, g, total / count), block, n_rows, n, inner,
                dx_stride_outer, dx_stride_inner, dx_stride_n, BLOCK_M, 1, BLOCK_N, WIDE,
                ROW_ALIGN, ADJACENT)


@triton.jit
def _split_y_g_chunk(pid, n_splits, n_rows, n, inner,
                     y_stride_outer, y_stride_inner, y_stride_n,
                     g_stride_outer, g_stride_inner, g_stride_n,
                     CHUNK: tl.constexpr, WIDE: tl.constexpr):
    """A split backward program's row, its chunk's offsets in y and g as [1, 1, CHUNK] tiles,
    and their mask."""
    row, y_off, mask = _split_chunk(pid, n_splits, n_rows, n, inner, y_stride_outer,
                                    y_stride_inner, y_stride_n, CHUNK, 1, WIDE)
    _, g_off, _ = _split_chunk(pid, n_splits, n_rows, n, inner, g_stride_outer,
                               g_stride_inner, g_stride_n, CHUNK, 1, WIDE)
    return row, y_off, g_off, mask


@triton.jit
def _store_partials(PART, pid, first, second):
    """Split backward pass 1's two sums [1] of chunk pid into PART (`_row_partials` adds them
    up per row)."""
    tl.store(PART + pid * PART_SIZE + tl.arange(0, 1), first)
    tl.store(PART + pid * PART_SIZE + 1 + tl.arange(0, 1), second)


@triton.jit
def sparsemax_split_backward_sums_kernel(
    Yp, G, PART, n_splits, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    CHUNK: tl.constexpr, WIDE: tl.constexpr,
):
    """Split backward pass 1: each chunk's sum of g over the support, and its size. A chunk
    outside the support (most of a long randn row's) does not read g: y is counted first, and
    g read in full only where the count is not 0 (reading g masked by y > 0 instead was 8-12%
    slower on dense supports, NOTES v35), and summed alone: the count is already known."""
    pid = tl.program_id(0)
    _, y_off, g_off, mask = _split_y_g_chunk(pid, n_splits, n_rows, n, inner, y_stride_outer,
                                             y_stride_inner, y_stride_n, g_stride_outer,
                                             g_stride_inner, g_stride_n, CHUNK, WIDE)
    compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
    y = tl.load(Yp + y_off, mask=mask, other=0.0).to(compute)
    count = tl.sum(tl.sum((y > 0).to(compute), axis=2), axis=1)
    total = tl.zeros_like(count)
    if tl.sum(count, axis=0) > 0:
        g = tl.load(G + g_off, mask=mask, other=0.0).to(compute)
        total = tl.sum(tl.sum(tl.where(y > 0, g, 0.0), axis=2), axis=1)
    _store_partials(PART, pid, total, count)


@triton.jit
def _split_gradient_chunk(pid, n_splits, n_rows, n, inner,
                          y_stride_outer, y_stride_inner, y_stride_n,
                          g_stride_outer, g_stride_inner, g_stride_n,
                          dx_stride_outer, dx_stride_inner, dx_stride_n,
                          CHUNK: tl.constexpr, WIDE: tl.constexpr):
    """A split backward pass 2 program's row, its chunk's offsets in y, g and dx as
    [1, 1, CHUNK] tiles, and their mask."""
    row, y_off, g_off, mask = _split_y_g_chunk(pid, n_splits, n_rows, n, inner, y_stride_outer,
                                               y_stride_inner, y_stride_n, g_stride_outer,
                                               g_stride_inner, g_stride_n, CHUNK, WIDE)
    _, dx_off, _ = _split_chunk(pid, n_splits, n_rows, n, inner, dx_stride_outer,
                                dx_stride_inner, dx_stride_n, CHUNK, 1, WIDE)
    return row, y_off, g_off, dx_off, mask


@triton.jit
def _row_partials(PART, row, part_splits, SPLITS: tl.constexpr):
    """A split row's two sums, each over its part_splits partials in PART: the same sums in the
    same order in every program of the row."""
    splits = tl.arange(0, SPLITS)
    part = PART + (row * part_splits + splits) * PART_SIZE
    valid = splits < part_splits
    return (tl.sum(tl.load(part, mask=valid, other=0.0), axis=0),
            tl.sum(tl.load(part + 1, mask=valid, other=0.0), axis=0))


@triton.jit
def sparsemax_split_backward_kernel(
    Yp, G, DX, PART, part_splits, n_splits, n_rows, n, inner,
    y_stride_outer, y_stride_inner, y_stride_n,
    g_stride_outer, g_stride_inner, g_stride_n,
    dx_stride_outer, dx_stride_inner, dx_stride_n,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, WIDE: tl.constexpr, OWN_COUNTS: tl.constexpr,
):
    """Split backward pass 2: every program adds up its row's part_splits partial sums in PART
    (the same sum in the same order in each) and writes its chunk of dx. OWN_COUNTS: PART holds
    a partial per chunk (part_splits == n_splits); a chunk whose own count is 0 lies outside
    the support, and writes zeros without reading y or g (most of a long randn row's)."""
    pid = tl.program_id(0)
    row, y_off, g_off, dx_off, mask = _split_gradient_chunk(
        pid, n_splits, n_rows, n, inner, y_stride_outer, y_stride_inner, y_stride_n,
        g_stride_outer, g_stride_inner, g_stride_n, dx_stride_outer, dx_stride_inner,
        dx_stride_n, CHUNK, WIDE)
    total, count = _row_partials(PART, row, part_splits, SPLITS)
    outside = False
    if OWN_COUNTS:
        outside = tl.load(PART + pid * PART_SIZE + 1) == 0
    if outside:
        tl.store(DX + dx_off, tl.zeros(dx_off.shape, DX.dtype.element_ty), mask=mask)
    else:
        compute: tl.constexpr = tl.float64 if Yp.dtype.element_ty == tl.float64 else tl.float32
        y = tl.load(Yp + y_off, mask=mask, other=0.0).to(compute)
        g = tl.load(G + g_off, mask=mask, other=0.0).to(compute)
        mean = tl.full([1], 0.0, compute) + total / count
        tl.store(DX + dx_off, _backward_tile(y, g, mean).to(DX.dtype.element_ty), mask=mask)


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
    if dim < 0:  # the slices below count dims from the front
        dim += t.dim()
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
    elements = block_m * block_n
    if num_warps is None:
        # Measured on an H200 (benchmarks/NOTES.md): 128 entries per thread, but two warps
        # from 4096 entries on.
        num_warps = min(16, max(1, elements // (32 * ELEMENTS_PER_THREAD), min(2, elements // 2048)))
    return block_m, block_n, num_warps


def group_size(block_n: int, itemsize: int, num_warps: int, group=None,
               widest=GROUP_WIDEST) -> int:
    """Largest GROUP <= widest whose chunks still span the layout's width (16-byte vectors per
    thread across all threads), so that group maxima stay inside each thread."""
    if group is not None:
        return group
    layout_width = 16 // itemsize * 32 * num_warps
    return max(1, min(widest, block_n // layout_width))


def max_block_n(dtype: torch.dtype) -> int:
    return MAX_BLOCK_N.get(dtype, DEFAULT_MAX_BLOCK_N)


def _wide(n: int, *stride_ns: int) -> bool:
    return any(n * abs(s) >= 2**31 for s in stride_ns)


def _rows(x: torch.Tensor, out, dim: int, chunk):
    """Common launch set-up: the output, x (copied only if it has no strided row view), row
    count, row length, their strides, and the chunk that decides in-register or split."""
    y = x.new_empty(x.shape) if out is None else out
    x, (outer, inner, x_strides) = _strided(x, dim)
    _, _, y_strides = rows_view(y, dim)
    chunk = max_block_n(x.dtype) if chunk is None else chunk
    return y, x, outer * inner, x.shape[dim], inner, x_strides, y_strides, chunk


def _split_launch(n_rows: int, n: int, chunk: int, num_warps, x: torch.Tensor):
    """(grid, n_splits, CHUNK, num_warps, per-chunk scratch) of a split launch."""
    _, block_n, num_warps = launch_config(1, chunk, num_warps, 1)
    n_splits = -(-n // block_n)
    part = torch.empty((n_rows * n_splits, PART_SIZE.value), device=x.device,
                       dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    return (n_rows * n_splits,), n_splits, block_n, num_warps, part


class SplitRows:
    """The three split passes over rows of x into y, with their launch choices made once:
    `sparsemax_forward`'s long rows, and a rank's slice in `flashmax.kernels.distributed`
    (which runs Newton across ranks, one `sums` per step, in place of `threshold`).
    The keyword arguments override the launch heuristics (benchmarks, tests); with
    `programs_per_sm` (default SPLIT_PROGRAMS_PER_SM; 0: one program per chunk), pass 1 runs
    that many programs per multiprocessor, each walking chunks and prefetching the next;
    `bound_groups` overrides the op's `bound_groups_by_rows` (by n_rows >= SPLIT_MANY_ROWS),
    `early_zeros` its `early_zeros_by_rows` (by n_rows >= SPLIT_MANY_ROWS; `split_write_kernel`),
    `threshold_tile` its `default_threshold_tile(n_rows)` (a held tile is at most `held_tile`),
    `share_steps` its `default_share_steps(n_rows, element_size)`, `max_registers` caps pass
    1's registers a thread (Triton's maxnreg; None or 0: as ptxas chooses), `compact_tile`
    (default the op's `compact_tiles`, by entry bytes and n_rows >= SPLIT_MANY_ROWS; 0: none)
    the tile of candidates above its tau that the row pass keeps when they are too many to
    hold whole (`_compacted_tile`),
    `prefilter_tile` (default its `prefilter_tiles`, keyed alike; 0: none; not with
    `compact_tile`) the row pass's held tile of the candidates above its start that
    `split_prefilter_kernel` keeps before it, `maxima` (default: whether the op's
    `maxima_support` holds (entry bytes, n_rows >= SPLIT_MANY_ROWS)) whether pass 1 stores
    each chunk's second largest entry for the row pass to step over the chunks' maxima alone
    where they hold the support (`_held_candidates`).
    Another op (entmax-1.5) subclasses it with its own chunk bound and its defaults, row pass
    and outputs."""

    chunk_bound = _sparsemax_chunk_bound
    top_two_start = _sparsemax_top_two_start
    bound_groups_by_rows = SPLIT_BOUND_GROUPS
    early_zeros_by_rows = SPLIT_EARLY_ZEROS
    threshold_kernel = sparsemax_split_threshold_kernel
    lowest_threshold = -1.0  # in x - max (`_split_row_start`'s FLOOR)
    subset_bound = _sparsemax_subset_bound  # `_split_row_start`'s SUBSET_BOUND
    compact_tiles = SPLIT_COMPACT_TILE
    prefilter_tiles = SPLIT_PREFILTER_TILE
    maxima_support = SPLIT_MAXIMA_SUPPORT
    held_tile = HELD_TILE
    outputs = _outputs_within

    def __init__(self, x, y, n_rows, n, inner, x_strides, y_strides, chunk, wide, group=None,
                 num_warps=None, sparse_write=None, threshold_tile=None, programs_per_sm=None,
                 bound_groups=None, early_zeros=None, share_steps=None, max_registers=None,
                 compact_tile=None, prefilter_tile=None, maxima=None):
        entries, warps = SPLIT_LAUNCH[n_rows >= SPLIT_MANY_ROWS]
        chunk = min(chunk, entries // 2 if x.dtype == torch.float64 else entries)
        if num_warps is None:
            num_warps = max(1, min(warps, chunk // 256))
        self.grid, self.n_splits, self.chunk, self.num_warps, self.part = _split_launch(
            n_rows, n, chunk, num_warps, x)
        self.x, self.y, self.n_rows, self.n, self.inner = x, y, n_rows, n, inner
        self.strides = (*x_strides, *y_strides)
        self.tile = dict(CHUNK=self.chunk, GROUP=group_size(self.chunk, x.element_size(),
                                                            self.num_warps, group),
                         INDEX=INDEX_TYPE[y.element_size()], WIDE=wide, num_warps=self.num_warps)
        chunks = self.grid[0]
        programs = walking_programs(
            chunks, SPLIT_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm, x.device)
        self.bounds_grid = (programs,)
        self.sparse = _next_power_of_2(SPARSE_WRITE if sparse_write is None else sparse_write)
        if early_zeros is None:
            early_zeros = self.early_zeros_by_rows[n_rows >= SPLIT_MANY_ROWS]
        self.early_zeros = min(self.sparse, _next_power_of_2(early_zeros) if early_zeros else 0)
        size_and_rows = (x.element_size(), n_rows >= SPLIT_MANY_ROWS)
        self.maxima = size_and_rows in self.maxima_support if maxima is None else maxima
        self.bounds_options = dict(zip(("SCATTER_PTX", "SCATTER_CONSTRAINTS"),
                                       scatter_ptx(y.element_size())), PREFETCH=programs < chunks,
                                   BOUND_GROUPS=self.bound_groups_by_rows[
                                       n_rows >= SPLIT_MANY_ROWS]
                                   if bound_groups is None else bound_groups,
                                   BOUND=self.chunk_bound, TOP_TWO_START=self.top_two_start,
                                   EARLY_ZEROS=self.early_zeros,
                                   SHARE_STEPS=self.default_share_steps(n_rows, x.element_size())
                                   if share_steps is None else share_steps,
                                   SECOND=self.maxima, maxnreg=max_registers or None)
        tile = self.default_threshold_tile(n_rows) if threshold_tile is None else threshold_tile
        splits = min(_next_power_of_2(self.n_splits), tile)
        self.tile_entries = tile
        self.row_pass = dict(CHUNK=self.chunk, SPLITS=splits, WIDTH=self._width(splits),
                             WIDE=wide, num_warps=max(1, min(16, tile // 1024)))
        self.held_width = self._width(splits, tile=min(tile, self.held_tile))
        # Either one given turns the other's default off.
        if compact_tile is None:
            compact_tile = 0 if prefilter_tile else self.compact_tiles.get(size_and_rows, 0)
        self.compact_tile = compact_tile
        if prefilter_tile is None:
            prefilter_tile = 0 if compact_tile else self.prefilter_tiles.get(size_and_rows, 0)
        if prefilter_tile and compact_tile:
            raise ValueError("prefilter_tile and compact_tile are alternatives: set one")
        self.prefilter_tile = prefilter_tile
        if prefilter_tile:
            self.held_width = self._width(splits, tile=prefilter_tile)

    @staticmethod
    def default_threshold_tile(n_rows: int) -> int:
        """The op's default row-pass tile (`threshold_tile`) for n_rows rows."""
        return THRESHOLD_TILE[n_rows >= SPLIT_MANY_ROWS]

    @staticmethod
    def default_share_steps(n_rows: int, element_size: int) -> int:
        """The op's default pass-1 share steps (`share_steps`) for n_rows rows of that many
        bytes an entry."""
        return SPLIT_SHARE_STEPS[n_rows >= SPLIT_MANY_ROWS]

    def _width(self, splits: int, points: int = 1, tile=None) -> int:
        """A row pass's candidates per chunk at a time: the tile (default the row pass's)
        holds points x splits x that."""
        tile = self.tile_entries if tile is None else tile
        return max(1, min(tile // (splits * points), self.chunk // 2))

    def bounds(self):
        """Pass 1: PART (per chunk: max, bound, candidates), and the candidates stored in y."""
        split_bounds_kernel[self.bounds_grid](
            self.x, self.y, self.part, self.n_splits, self.n_rows, self.n, self.inner,
            *self.strides, **self.tile, **self.bounds_options)

    def threshold(self) -> torch.Tensor:
        """Pass 2: STATE [rows, STATE_SIZE], each row's max, exact (pivot, step) and the
        outputs at most which are ties."""
        state = self.part.new_empty((self.n_rows, STATE_SIZE.value))
        if self.prefilter_tile:
            split_prefilter_kernel[self.grid](
                self.x, self.y, self.part, self.n_splits, self.n, self.inner, *self.strides,
                CHUNK=self.chunk, SPLITS=self.row_pass["SPLITS"],
                PIECE=min(PREFILTER_PIECE, self.chunk), WIDE=self.row_pass["WIDE"],
                HELD_WIDTH=self.held_width, EARLY_ZEROS=self.early_zeros,
                FLOOR=self.lowest_threshold, SUBSET_BOUND=self.subset_bound, num_warps=4)
        self.threshold_kernel[(self.n_rows,)](
            self.x, self.y, self.part, state, self.n_splits, self.n, self.inner, *self.strides,
            **self.row_pass, **self.threshold_options())
        return state

    def threshold_options(self) -> dict:
        """The row pass's options beside `row_pass`."""
        return dict(HELD_WIDTH=self.held_width, COMPACT=_next_power_of_2(self.compact_tile)
                    if self.compact_tile else 0, EARLY_ZEROS=self.early_zeros,
                    PREFILTERED=self.prefilter_tile > 0, MAXIMA=self.maxima)

    def sums(self, row_max: torch.Tensor, taus: torch.Tensor, centre: torch.Tensor):
        """[points, 3, rows] float64: one Newton step's (sum, count, smallest) of each row at
        each point's tau (`taus` [points, rows], each at or above the row's chunk bounds)."""
        n_points = taus.shape[0]
        stats = torch.empty((n_points, 3, self.n_rows), dtype=torch.float64,
                            device=taus.device)
        points = _next_power_of_2(n_points)
        launch = dict(self.row_pass, POINTS=points, WIDTH=self._width(self.row_pass["SPLITS"],
                                                                       points))
        SUMS_LAUNCHES.run((self.n_rows,),
                          (self.x, self.y, self.part, row_max, taus.contiguous(), centre, stats),
                          (self.n_splits, self.n_rows, self.n, self.inner, n_points,
                           *self.strides), launch)
        return stats

    def write(self, state: torch.Tensor):
        """Pass 3: y from STATE [rows, STATE_SIZE]."""
        split_write_kernel[self.grid](
            self.x, self.y, self.part, state, self.n_splits, self.n_rows, self.n, self.inner,
            *self.strides, SPARSE=self.sparse, OUTPUTS=self.outputs,
            EARLY_ZEROS=self.early_zeros, **self.tile)


FORWARD_LAUNCHES = LaunchCache(sparsemax_forward_kernel)
SUMS_LAUNCHES = LaunchCache(sparsemax_split_sums_kernel)  # once per Newton step across ranks
BACKWARD_LAUNCHES = LaunchCache(sparsemax_backward_kernel)


@functools.lru_cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def walking_programs(blocks: int, programs_per_sm, device: torch.device) -> int:
    """Programs of a launch over `blocks`: one each, or with programs_per_sm that many per
    multiprocessor (one multiprocessor off CUDA), each walking several blocks."""
    if not programs_per_sm:
        return blocks
    return min(blocks, programs_per_sm * _multiprocessors(device))


class RowsLaunch(NamedTuple):
    """A `_map_rows` launch: its grid's programs and its constexprs."""
    programs: int
    block_m: int
    block_n: int
    num_warps: int
    prefetch: bool
    group: int
    thread_rows: bool


def rows_launch(x, n_rows, n, num_warps=None, block_m=None, programs_per_sm=None,
                group=None, row_threads=None, thread_entries=ROW_THREAD_ENTRIES, align=None,
                half_warps=None, wide_groups_from=None) -> RowsLaunch:
    """The launch of a `_map_rows` kernel over rows of x.
    programs_per_sm: None or 0 for one program per block, else that many programs per
    multiprocessor (one multiprocessor off CUDA) walking the blocks, each loading the next
    before working on this one (`_map_rows`' PREFETCH). Neither forward walks by default: one
    block a program with more programs a SM was faster, for sparsemax since its steps got fewer
    (v28; NOTES v30: 7-14% in fp32 from 4096 to 8192 entries, 0-7% in bf16) and for
    entmax-1.5 at 1024-2048 entries since (NOTES v89, H100: bf16 1-17% faster, fp32 3-14%
    from 4096 rows; fp32 at 2048-3072 rows randn up to 7% slower, uniform rows 1-5% faster).
    row_threads: threads a row is spread over, in chunks of one access, `align` entries (the
    rows' `row_align`; None: a 16-byte vector) (None: ROW_THREADS' for rows of up to 1 KB, at
    most thread_entries entries a thread where given, unless block_m or group is given; longer
    rows one a program); then ROW_THREADS_WARPS warps and a row a thread-group by default.
    Chunks of one access: Triton lays a load's threads along the entries one access covers,
    so wider chunks would spread a row over more threads than row_threads.
    half_warps: {row width: warps} for 2-byte rows held one a program, over the default's;
    wide_groups_from: rows of at least this many entries held one a program take groups up to
    SPANNING_GROUP_WIDEST (None: never)."""
    block_n = _next_power_of_2(n)
    chunk = min(block_n, align or 16 // x.element_size())
    if row_threads is None and block_m is None and group is None:
        row_threads = ROW_THREADS.get(max(16, block_n * x.element_size()))
        if row_threads is not None and thread_entries:
            row_threads = max(row_threads, block_n // thread_entries)
    if row_threads is not None:
        width = min(block_n, row_threads * chunk)
        num_warps = num_warps or ROW_THREADS_WARPS
        block_m = block_m or 32 * num_warps * chunk // width
        blocks = -(-n_rows // block_m)
        programs = walking_programs(blocks, programs_per_sm, x.device)
        return RowsLaunch(programs, block_m, block_n, num_warps, programs < blocks,
                          block_n // width, width == chunk)
    if block_m is None and group is None:
        block_m = 1
    block_m, block_n, default_warps = launch_config(n_rows, n, num_warps, block_m)
    if num_warps is None:
        num_warps = default_warps
        if block_m == 1 and block_n <= ONE_ROW_WIDEST:
            num_warps = max(1, block_n // (32 * ONE_ROW_ENTRIES_PER_THREAD))
        if block_m == 1 and x.element_size() == 2 and half_warps:
            num_warps = half_warps.get(block_n, num_warps)
    blocks = -(-n_rows // block_m)
    programs = walking_programs(blocks, programs_per_sm, x.device)
    return RowsLaunch(programs, block_m, block_n, num_warps, programs < blocks,
                      group_size(block_n, x.element_size(), num_warps, group,
                                 widest_group(block_m, block_n, wide_groups_from)), False)


def widest_group(block_m: int, block_n: int, wide_groups_from) -> int:
    """`group_size`'s widest for `rows_launch`'s tiles (wide_groups_from as there)."""
    if block_m == 1 and wide_groups_from is not None and block_n >= wide_groups_from:
        return SPANNING_GROUP_WIDEST
    return GROUP_WIDEST


def adjacent_rows(n_rows: int, inner: int, *strides):
    """(inner, strides) of an [outer, n, inner] view equal to the given one's whose rows are
    adjacent in memory (stride_inner 1), in every tensor, for `_row_offsets`' ADJACENT; None
    when they are not. Rows of a 2-D tensor's transpose (inner 1, stride_outer 1) become one
    outer index of n_rows inner ones."""
    if inner == 1 and all(stride_outer == 1 and stride_n != 1
                          for stride_outer, _, stride_n in strides):
        return n_rows, tuple((0, 1, stride_n) for _, _, stride_n in strides)
    if inner > 1 and all(stride_inner == 1 and stride_n != 1
                         for _, stride_inner, stride_n in strides):
        return inner, strides
    return None


def adjacent_launch(x, n_rows: int, n: int, inner: int,
                    values: int = ADJACENT_THREAD_VALUES) -> RowsLaunch | None:
    """The launch of a `_map_rows` kernel over adjacent rows (`adjacent_rows`; ADJACENT), or
    None for rows too long for it: each program BLOCK_M rows of one outer index, whole
    (THREAD_ROWS: no group search; GROUP the whole row, WIDTH 1), about `values` entries of a
    row a thread. Triton lays a warp's threads along min(32, BLOCK_M) rows, then along the row;
    warps along the rows, then along the row."""
    block_n = _next_power_of_2(n)
    row_threads = max(1, block_n // values)
    if row_threads == 1:
        block_m, num_warps = 32 * ADJACENT_ROW_WARPS, ADJACENT_ROW_WARPS
    else:
        block_m = max(32 // x.element_size(), 32 // row_threads)
        num_warps = min(16, max(1, row_threads * block_m // 32))
        if block_n > ADJACENT_MAX_VALUES * num_warps * 32 // block_m:
            return None
    programs = (n_rows // inner) * -(-inner // block_m)
    return RowsLaunch(programs, block_m, block_n, num_warps, False, block_n, True)


def adjacent_rows_launch(x, n_rows: int, n: int, inner: int, strides,
                         values: int = ADJACENT_THREAD_VALUES):
    """(launch, inner, strides): `adjacent_launch` over rows adjacent in memory in every tensor
    (`adjacent_rows`, strides one (outer, inner, n) triple a tensor), with the view's inner and
    strides it takes; None where the rows are not adjacent or too long for it."""
    adjacent = adjacent_rows(n_rows, inner, *strides)
    if adjacent is None:
        return None
    launch = adjacent_launch(x, n_rows, n, adjacent[0], values)
    return None if launch is None else (launch, *adjacent)


def launch_rows(launches: LaunchCache, key, x, y, n_rows, n, inner, x_strides, y_strides, wide,
                group=None, num_warps=None, block_m=None, programs_per_sm=None,
                row_threads=None, thread_entries=ROW_THREAD_ENTRIES,
                adjacent_values=ADJACENT_THREAD_VALUES, half_warps=None,
                wide_groups_from=None, max_registers=None, register_caps=None):
    """Launch a `_map_rows` kernel from x into y with `rows_launch`'s choices (or, for rows
    adjacent in memory and none of rows_launch's overrides, `adjacent_launch`'s with
    adjacent_values), kept under key; rows_launch's with at most max_registers registers a
    thread (None: register_caps' (cap, from programs a SM) by (entry bytes, block_n), the cap
    if any and the launch has that many programs a SM, else as ptxas chooses; 0: as ptxas
    chooses)."""
    align = row_align(x, n, x_strides, y_strides)
    adjacent = None
    if group is None and num_warps is None and block_m is None and row_threads is None:
        adjacent = adjacent_rows_launch(x, n_rows, n, inner, (x_strides, y_strides),
                                        adjacent_values)
    if adjacent is None:
        launch = rows_launch(x, n_rows, n, num_warps, block_m, programs_per_sm, group,
                             row_threads, thread_entries, align, half_warps, wide_groups_from)
        if max_registers is None and register_caps:
            cap, from_programs = register_caps.get((x.element_size(), launch.block_n), (None, 0))
            if launch.programs >= from_programs * _multiprocessors(x.device):
                max_registers = cap
    else:
        launch, inner, (x_strides, y_strides) = adjacent
        max_registers = None
    launches.launch(key, (launch.programs,), (x, y), (n_rows, n, inner, *x_strides, *y_strides),
                    dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, GROUP=launch.group,
                         WIDE=wide, PREFETCH=launch.prefetch, THREAD_ROWS=launch.thread_rows,
                         ROW_ALIGN=align, ADJACENT=adjacent is not None,
                         num_warps=launch.num_warps, maxnreg=max_registers or None))


def row_align(x: torch.Tensor, n: int, *strides) -> int:
    """The most entries, up to a 16-byte vector's, that divide n and every row's start, of rows
    of n entries with (outer, inner, n) strides in tensors of x's dtype (`_row_offsets`): the
    entries one access can read. Rows of 8 entries would otherwise be read and written an entry
    at a time. 1 where a row's entries are not adjacent (every access is one entry then)."""
    align = 16 // x.element_size()
    for outer, inner, stride_n in strides:
        if stride_n != 1:
            return 1
        while n % align or outer % align or inner % align:
            align //= 2
    return align


def kept_launch(launches: LaunchCache, defaults: bool, dim: int, out, *tensors):
    """(out, key, replayed). With the launchers' defaults (`defaults`: no out, no overrides), a
    new output of tensors[0]'s shape and dtype and the key its launch is kept under; replayed
    when a launch kept under that key has already computed it. Otherwise (out, None, False)."""
    if not defaults:
        return out, None, False
    key = (dim, *tensor_key(*tensors))
    # empty_like: half the host time of torch.empty(shape, dtype=, device=) on the H200's host.
    out = torch.empty_like(tensors[0], memory_format=torch.contiguous_format)
    return out, key, launches.replay(key, *tensors, out)


def launch_forward(launches: LaunchCache, key, x, dim, out, chunk, split_rows,
                   **row_launch) -> torch.Tensor:
    """A forward launcher's work once `kept_launch` has not replayed it: rows longer than chunk
    (None: the dtype's MAX_BLOCK_N) in the three passes of split_rows(rows, y, n_rows, n, inner,
    x_strides, y_strides, chunk, wide) (a `SplitRows`), shorter ones by `launch_rows` with
    row_launch's options, kept under key."""
    if x.numel() == 0:
        return x.new_empty(x.shape) if out is None else out
    y, rows, n_rows, n, inner, x_strides, y_strides, chunk = _rows(x, out, dim, chunk)
    wide = _wide(n, x_strides[2], y_strides[2])
    if n > chunk:
        split = split_rows(rows, y, n_rows, n, inner, x_strides, y_strides, chunk, wide)
        split.bounds()
        split.write(split.threshold())
        return y
    launch_rows(launches, key if rows is x else None, rows, y, n_rows, n, inner, x_strides,
                y_strides, wide, **row_launch)
    return y


@on_tensor_device
def sparsemax_forward(x: torch.Tensor, dim: int, out=None, group=None, num_warps=None,
                      block_m=None, chunk=None, sparse_write=None, threshold_tile=None,
                      programs_per_sm=None, bound_groups=None, row_threads=None,
                      adjacent_values=None, early_zeros=None, share_steps=None,
                      max_registers=None, compact_tile=None, prefilter_tile=None,
                      maxima=None) -> torch.Tensor:
    """Launch the forward kernel into `out` (new if None, else of x's shape and dtype, not
    overlapping x).

    Rows longer than `chunk` (default: the dtype's MAX_BLOCK_N) are split into chunks of that
    size (at most SPLIT_LAUNCH's), in three passes: the chunks' bounds and candidates, each
    row's tau from them, the outputs.
    `sparse_write` (default SPARSE_WRITE) caps the candidates of a chunk written without
    reading it again; `threshold_tile` (default THRESHOLD_TILE's) is the row pass's tile.
    `programs_per_sm` as in `rows_launch` (split rows: pass 1's, `SplitRows`), and
    `bound_groups`, `early_zeros`, `share_steps`, `compact_tile`, `prefilter_tile` and `maxima`
    (`SplitRows`),
    `row_threads` (`rows_launch`), `adjacent_values` (`adjacent_launch`'s values),
    `max_registers` (`launch_rows`, default ROW_REGISTER_CAPS'; split rows: pass 1's,
    `SplitRows`, default none; 0: none). The other keyword arguments override the launch
    heuristics (benchmarks, tests).
    """
    defaults = (out is None and group is None and num_warps is None and block_m is None
                and chunk is None and sparse_write is None and threshold_tile is None
                and programs_per_sm is None and bound_groups is None and row_threads is None
                and adjacent_values is None and early_zeros is None and share_steps is None
                and max_registers is None and compact_tile is None and prefilter_tile is None
                and maxima is None)
    out, key, replayed = kept_launch(FORWARD_LAUNCHES, defaults, dim, out, x)
    if replayed:
        return out
    split_rows = functools.partial(
        SplitRows, group=group, num_warps=num_warps, sparse_write=sparse_write,
        threshold_tile=threshold_tile, programs_per_sm=programs_per_sm, bound_groups=bound_groups,
        early_zeros=early_zeros, share_steps=share_steps, max_registers=max_registers,
        compact_tile=compact_tile, prefilter_tile=prefilter_tile, maxima=maxima)
    return launch_forward(FORWARD_LAUNCHES, key, x, dim, out, chunk, split_rows, group=group,
                          num_warps=num_warps, block_m=block_m, programs_per_sm=programs_per_sm,
                          row_threads=row_threads,
                          adjacent_values=adjacent_values or ADJACENT_THREAD_VALUES,
                          half_warps=HALF_ONE_ROW_WARPS, wide_groups_from=WIDE_GROUPS_FROM,
                          max_registers=max_registers, register_caps=ROW_REGISTER_CAPS)


class SplitBackward:
    """The backward of split rows into dx: the support's sums per chunk, then dx from each row's
    sums; `sparsemax_backward`'s long rows, and a rank's slice in `flashmax.kernels.distributed`
    (whose rows' sums are all-reduced across ranks in between). `out`, `chunk` and `num_warps`
    as in `sparsemax_backward`. entmax-1.5 subclasses it with its own kernels."""

    sums_kernel = sparsemax_split_backward_sums_kernel

    def __init__(self, y, grad, dim, out=None, chunk=None, num_warps=None):
        self.dx, y, self.n_rows, n, inner, y_strides, dx_strides, chunk = _rows(y, out, dim, chunk)
        grad, (_, _, g_strides) = _strided(grad, dim)
        entries, warps = SPLIT_BACKWARD_LAUNCH
        chunk = min(chunk, entries // 2 if y.dtype == torch.float64 else entries)
        if num_warps is None:
            num_warps = max(1, min(warps, chunk // 256))
        self.grid, self.n_splits, block_n, num_warps, self.part = _split_launch(
            self.n_rows, n, min(chunk, n), num_warps, y)
        self.tensors = (y, grad)
        self.rows = (self.n_splits, self.n_rows, n, inner)
        self.strides = (*y_strides, *g_strides)
        self.dx_strides = dx_strides
        self.tile = dict(CHUNK=block_n, WIDE=_wide(n, y_strides[2], g_strides[2], dx_strides[2]),
                         num_warps=num_warps)

    def sums(self) -> torch.Tensor:
        """PART [rows * chunks, PART_SIZE]: each chunk's (sum of grad, count) over y > 0."""
        self.sums_kernel[self.grid](*self.tensors, self.part, *self.rows, *self.strides,
                                    **self.tile)
        return self.part

    def write(self, part: torch.Tensor, part_splits: int) -> torch.Tensor:
        """dx, each row's support sums being the sum of its part_splits entries of `part`."""
        sparsemax_split_backward_kernel[self.grid](
            *self.tensors, self.dx, part, part_splits, *self.rows, *self.strides,
            *self.dx_strides, SPLITS=_next_power_of_2(part_splits),
            OWN_COUNTS=part_splits == self.n_splits, **self.tile)
        return self.dx


def launch_gradient_rows(launches: LaunchCache, key, y, grad, dim, out, num_warps,
                         block_m) -> torch.Tensor:
    """Launch a backward kernel over whole rows in registers, (Y, G, DX, rows, strides, BLOCK_M,
    BLOCK_N, WIDE, ROW_ALIGN, ADJACENT), into out (new if None); kept under key unless y or
    grad had to be copied. Rows adjacent in memory in all three tensors, of at least
    ADJACENT_GRADIENT_ENTRIES, without overrides, take `adjacent_launch`'s launch."""
    dx, y_rows, n_rows, n, inner, y_strides, dx_strides, _ = _rows(y, out, dim, None)
    g_rows, (_, _, g_strides) = _strided(grad, dim)
    if y_rows is not y or g_rows is not grad:
        key = None
    adjacent = None
    if (num_warps is None and block_m is None
            and _next_power_of_2(n) >= ADJACENT_GRADIENT_ENTRIES[y.element_size()]):
        adjacent = adjacent_rows_launch(y, n_rows, n, inner, (y_strides, g_strides, dx_strides))
    if adjacent is None:
        if num_warps is None:
            num_warps = GRADIENT_ROW_WARPS.get((y.element_size(), _next_power_of_2(n)))
        block_m, block_n, num_warps = launch_config(n_rows, n, num_warps, block_m)
        programs = -(-n_rows // block_m)
    else:
        launch, inner, (y_strides, g_strides, dx_strides) = adjacent
        programs, block_m, block_n, num_warps = launch[:4]
    launches.launch(key, (programs,), (y_rows, g_rows, dx),
                    (n_rows, n, inner, *y_strides, *g_strides, *dx_strides),
                    dict(BLOCK_M=block_m, BLOCK_N=block_n,
                         WIDE=_wide(n, y_strides[2], g_strides[2], dx_strides[2]),
                         ROW_ALIGN=row_align(y, n, y_strides, g_strides, dx_strides),
                         ADJACENT=adjacent is not None, num_warps=num_warps))
    return dx


def launch_backward(launches: LaunchCache, split_backward, y, grad, dim, out, num_warps,
                    block_m, chunk) -> torch.Tensor:
    """A backward launcher: rows longer than chunk (None: the dtype's MAX_BLOCK_N) by
    split_backward (a `SplitBackward`), shorter ones by `launch_gradient_rows`; with the
    defaults (no out, num_warps, block_m or chunk) kept and replayed (`kept_launch`)."""
    defaults = out is None and num_warps is None and block_m is None and chunk is None
    out, key, replayed = kept_launch(launches, defaults, dim, out, y, grad)
    if replayed:
        return out
    if y.numel() == 0:
        return y.new_empty(y.shape) if out is None else out
    if y.shape[dim] > (max_block_n(y.dtype) if chunk is None else chunk):
        split = split_backward(y, grad, dim, out, chunk, num_warps)
        return split.write(split.sums(), split.n_splits)
    return launch_gradient_rows(launches, key, y, grad, dim, out, num_warps, block_m)


@on_tensor_device
def sparsemax_backward(y: torch.Tensor, grad: torch.Tensor, dim: int, out=None, num_warps=None,
                       block_m=None, chunk=None) -> torch.Tensor:
    """Launch the backward kernel into `out`, as `sparsemax_forward` does."""
    return launch_backward(BACKWARD_LAUNCHES, SplitBackward, y, grad, dim, out, num_warps,
                           block_m, chunk)

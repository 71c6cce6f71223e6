"""Exact pure-torch sparsemax: the CPU path, and the fallback on any device without Triton.

Every function here works on the last dimension of a tensor already in its compute dtype
(float32 or float64); `flashmax.sparsemax` moves `dim` there with a view, not a copy.

The threshold tau solves sum(max(z - tau, 0)) = 1 for z = x - max(x), with tau in [-1, 0). The
forward pass finds a lower bound on tau cheaply, packs the few entries above it into a narrow
matrix and runs the Michelot/Newton iteration there: the full row is never sorted and is passed
over a fixed number of times.
"""

import torch


def bad_rows(row_max: torch.Tensor) -> torch.Tensor:
    """Rows whose result is NaN: a NaN or +inf entry, or every entry -inf (max is -inf)."""
    return ~torch.isfinite(row_max)


def newton_threshold(z: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact threshold of each row of z (z <= 0, -inf padding allowed) from a lower bound tau.

    Newton on the convex piecewise-linear f(t) = sum(max(z - t, 0)) - 1 rises monotonically; a
    step is final when every entry of the support it used stays above the new tau. Returns
    (pivot, step) with tau = pivot + step and |step| <= |tau|: (z - pivot) - step rounds
    each output nearly relative to itself, where z - tau would round tau first.
    """
    pivot, step = tau, torch.zeros_like(tau)
    done = torch.zeros_like(tau, dtype=torch.bool)
    while not bool(done.all()):
        tau = pivot + step
        # Summing z - tau rather than z keeps the terms small: no cancellation at small scales.
        d = z - tau.unsqueeze(-1)
        support = d > 0
        total = d.clamp_min(0).sum(-1)
        count = support.sum(-1, dtype=torch.int32)
        smallest = torch.where(support, d, torch.inf).amin(-1)
        pivot, step, done = newton_update(total, count, smallest, pivot, step, done)
    return pivot, step


def newton_update(total, count, smallest, pivot, step, done):
    """Advance (pivot, step, done) by one Newton step from its sums at tau = pivot + step:
    the sum, count and smallest of z - tau over the support z > tau."""
    tau = pivot + step
    new_step = ((total - 1) / count).to(pivot.dtype)  # total may be accumulated wider
    pivot = torch.where(done, pivot, tau)
    step = torch.where(done, step, new_step)
    # Final once the support holds, and the step was small: a large step was computed
    # from z - tau with tau far away, rounded to ~|tau| ulps, so refine it once more.
    small = new_step.abs() <= (tau + new_step).abs()
    done = done | ((smallest > new_step) & small)
    return pivot, step, done


GROUP = 8


def _groups(z: torch.Tensor) -> torch.Tensor:
    """View the rows of z as (rows, groups, GROUP), padding the last group with -inf if needed."""
    short = -z.shape[-1] % GROUP
    if short:
        z = torch.nn.functional.pad(z, (0, short), value=-torch.inf)
    return z.view(z.shape[0], -1, GROUP)


def _pack_groups(groups: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The kept groups of each row, packed left into a (rows, (widest + 1) * GROUP) matrix.

    The padding is -inf, and at least one padding group per row keeps every row non-empty.
    """
    rows, index = keep.nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=groups.shape[0])
    width = int(counts.amax()) if rows.numel() else 0
    position = torch.arange(rows.numel(), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    packed = groups.new_full((groups.shape[0], width + 1, GROUP), -torch.inf)
    packed[rows, position] = groups[rows, index]
    return packed.view(groups.shape[0], -1)


def threshold(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact threshold (pivot, step) of each row of z <= 0 (rows (rows, n), -inf allowed).

    A row whose maximum is below 0 (a subset of a larger row, in that row's coordinates) gets
    a lower bound on its own threshold instead where that threshold is below -1: Newton from
    above lands below the root.
    """
    groups = _groups(z)
    maxima = groups.amax(-1)
    pivot, step = newton_threshold(maxima, z.new_full(maxima.shape[:1], -1.0))
    lower = (pivot + step).clamp_min(-1.0)  # -inf for NaN rows, whose maxima have no support
    return newton_threshold(_pack_groups(groups, maxima > lower.unsqueeze(-1)), lower)


# Outputs at most this fraction of |tau| are 0 (per compute dtype: 4 and 2 ulps of tau's own
# magnitude). Inputs on a coarse grid (bf16) often lie exactly at tau, and tau's rounding leaves
# such an entry a few 1e-9 above 0 in fp32: inside the support the backward takes from y > 0,
# which then differs from exact arithmetic's by that entry (NOTES, "bf16 ties with tau").
ZERO_BELOW = {torch.float32: 2.0**-22, torch.float64: 2.0**-51}
# An fp32 row with an output within that of tau is computed again in fp64, from z exact in fp64,
# where a tie is ~2^-50 of tau from 0 and a true output as small as fp32 holds is far above this
# (NOTES v22: fp32's rule alone zeroed an exact output of 2^-24).
EXACT_ZERO_BELOW = 2.0**-44


def sparsemax_outputs(z: torch.Tensor, pivot: torch.Tensor, step: torch.Tensor,
                      zero_below: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """max(z - tau, 0) over the last dim, tau = pivot + step per row, with outputs within
    rounding of tau (|tau| * zero_below, default ZERO_BELOW) set to 0, in place on z; and the
    rows where that zeroed an output above 0 (a tie with tau, or a true output too small for
    the rule to tell from one)."""
    zero_below = ZERO_BELOW[z.dtype] if zero_below is None else zero_below
    tol = (pivot + step).abs().mul_(zero_below).unsqueeze(-1)
    y = z.sub_(pivot.unsqueeze(-1)).sub_(step.unsqueeze(-1))
    zeroed = y <= tol
    tiny = (zeroed & (y > 0)).any(-1)
    return y.masked_fill_(zeroed, 0), tiny


def exact_outputs(rows: torch.Tensor) -> torch.Tensor:
    """Sparsemax of fp32 rows (no bad rows) computed in fp64, ties with tau zeroed at
    EXACT_ZERO_BELOW: x - max is exact in fp64, so ties and tiny outputs come apart."""
    x = rows.double()
    z = x - x.amax(-1, keepdim=True)
    return sparsemax_outputs(z, *threshold(z), EXACT_ZERO_BELOW)[0].to(rows.dtype)


def sparsemax_forward(x: torch.Tensor) -> torch.Tensor:
    """Sparsemax over the last dim of x (float32/float64, at least one feature); contiguous.

    A lower bound on tau comes from the row's group maxima: the tau of any subset of a row is
    <= the row's tau, and the maxima of groups of GROUP entries hold nearly all of the large
    entries at 1/GROUP of the size. Only groups whose maximum exceeds the bound can hold support,
    so Newton finishes exactly on those few groups.
    """
    rows = x.reshape(-1, x.shape[-1])
    row_max = rows.amax(-1, keepdim=True)
    bad = bad_rows(row_max)
    any_bad = bool(bad.any())
    z = rows - row_max
    if any_bad:
        z.masked_fill_(bad, -torch.inf)
    y, tiny = sparsemax_outputs(z, *threshold(z))
    if z.dtype == torch.float32 and bool(tiny.any()):
        y[tiny] = exact_outputs(rows[tiny])
    if any_bad:
        y.masked_fill_(bad, torch.nan)
    return y.view(x.shape)


def sparsemax_backward(y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dx = s * (g - mean of g over the support s = (y > 0)), over the last dim."""
    support = y > 0
    g = torch.where(support, grad, 0)
    mean = g.sum(-1, keepdim=True) / support.sum(-1, keepdim=True)
    return torch.where(support, grad - mean, 0)


def sparsemax_sort(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The classic sort + cumsum sparsemax (Martins & Astudillo, 2016): the peers' baseline.

    Sort descending, cumsum, k = max{j : 1 + j z_j > cumsum_j}, tau = (cumsum_k - 1) / k.
    """
    z = x - x.amax(dim, keepdim=True)
    z_sorted = z.sort(dim, descending=True).values
    cumsum = z_sorted.cumsum(dim)
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    j = torch.arange(1, x.shape[dim] + 1, device=x.device, dtype=x.dtype).view(shape)
    k = (1 + j * z_sorted > cumsum).sum(dim, keepdim=True)
    tau = (cumsum.gather(dim, k - 1) - 1) / k
    return (z - tau).clamp_min(0)

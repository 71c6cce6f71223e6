"""Exact pure-torch entmax-1.5: the CPU path, and the fallback on any device without Triton.

entmax15(x) = max(z - tau, 0)^2 with z = (x - max(x)) / 2 and tau chosen so that each row sums
to 1; tau lies in [-1, 0) (the max entry alone gives 1 at tau = -1). Every function works on the
last dimension of a tensor already in its compute dtype (float32 or float64).

tau is the root of F(t) = ||max(z - t, 0)||_2 - 1, which is convex (a norm, monotone on the
non-negative orthant, of convex functions of t) and decreasing. Newton on F from a lower bound
rises monotonically; on a fixed support F is a hyperbola, nearly straight, so it takes fewer
steps than Newton on sum(max(z - t, 0)^2) - 1 (about half, from tau = -1), and with one entry
it is exact. Still, Newton only converges: it is used to find the support, and tau then comes
in closed form from the support's sums. The closed form of a superset of the support is no
lower bound (its extra entries add squares), so it is accepted only when every entry of the set
it used stays above it. As for sparsemax, the tau of any subset of a row is a lower bound on the
row's, so the group-maxima bound carries over.
"""

import torch

from .reference import _groups, _pack_groups, bad_rows

# Newton reaches the support in a few steps (quadratic convergence); the cap only guards against
# a rounding cycle, so that no input can hang.
MAX_STEPS = 64


def quadratic_step(s1: torch.Tensor, s2: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The root delta of sum((d - delta)^2) = 1 over a set with sum(d) = s1, sum(d^2) = s2,
    count entries: the smaller root of count * delta^2 - 2 s1 delta + s2 - 1, written without
    cancellation. NaN when the set has no root (it is not the support)."""
    excess = s2 - 1
    return excess / (s1 + torch.sqrt(s1 * s1 - count * excess))


def support_sums(d: torch.Tensor):
    """(sum of d, sum of d^2, count, smallest d) over d > 0 in each row of d; the sums in
    float64, the count int32, the smallest inf where no entry is positive (or none at all)."""
    support = d > 0
    positive = d.clamp_min(0)
    s1 = positive.sum(-1, dtype=torch.float64)
    s2 = positive.square().sum(-1, dtype=torch.float64)
    count = support.sum(-1, dtype=torch.int32)
    if not d.shape[-1]:
        return s1, s2, count, d.new_full(d.shape[:-1], torch.inf)
    return s1, s2, count, torch.where(support, d, torch.inf).amin(-1)


def threshold_step(s1, s2, count, smallest, tau):
    """One step from a set's sums at tau (sum of d = z - tau and of d^2, count, smallest d,
    over d > 0; the sums in float64): (step, done).

    The set's closed form is final when it keeps every entry of the set (so the set is the
    support) and is small (a large one came from d rounded to ~|tau| ulps: refine once more);
    otherwise the step is Newton's on F, which stays below the root. A row is also done when
    Newton converged without passing an entry at tau, or with no entry above tau (a NaN row:
    tau is kept).
    """
    closed = quadratic_step(s1, s2, count).to(tau.dtype)
    # Newton on F: (sqrt(s2) - 1) sqrt(s2) / s1, with sqrt(s2) - 1 without cancellation.
    root = s2.sqrt()
    newton = (root * (s2 - 1) / ((root + 1) * s1)).to(tau.dtype)
    final = (smallest >= closed) & (closed.abs() <= (tau + closed).abs())
    stuck = (tau + newton) == tau
    step = torch.where(final, closed, newton).masked_fill_(count == 0, 0)
    return step, final | stuck | (count == 0)


def entmax15_threshold(z: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact threshold of each row of z (z <= 0, -inf padding allowed) from a lower bound tau.

    Returns (pivot, step) with tau = pivot + step: pivot is the last Newton iterate (a lower
    bound), step the closed-form remainder, so (z - pivot) - step rounds each output nearly
    relative to itself. The sums are taken of d = z - pivot (small terms) in float64.
    """
    pivot, step = tau.clone(), torch.zeros_like(tau)
    # Only the rows still searching are stepped: most rows finish in a step or two.
    active = torch.arange(z.shape[0], device=z.device)
    for _ in range(MAX_STEPS):
        tau = pivot[active] + step[active]
        s1, s2, count, smallest = support_sums(z - tau.unsqueeze(-1))
        pivot[active] = tau
        step[active], done = threshold_step(s1, s2, count, smallest, tau)
        searching = ~done
        if not bool(searching.any()):
            break
        active, z = active[searching], z[searching]
    return pivot, step


def entmax15_forward(x: torch.Tensor) -> torch.Tensor:
    """entmax-1.5 over the last dim of x (float32/float64, at least one feature); contiguous.

    A lower bound on tau from the group maxima, then the exact threshold on the few groups whose
    maximum exceeds it, as `reference.sparsemax_forward` does.
    """
    rows = x.reshape(-1, x.shape[-1])
    row_max = rows.amax(-1, keepdim=True)
    bad = bad_rows(row_max)
    any_bad = bool(bad.any())
    z = (rows - row_max).mul_(0.5)
    if any_bad:
        z.masked_fill_(bad, -torch.inf)
    groups = _groups(z)
    maxima = groups.amax(-1)
    pivot, step = entmax15_threshold(maxima, z.new_full(maxima.shape[:1], -1.0))
    lower = (pivot + step).clamp_min(-1.0)
    pivot, step = entmax15_threshold(_pack_groups(groups, maxima > lower.unsqueeze(-1)), lower)
    y = entmax15_outputs(z, pivot, step)
    if any_bad:
        y.masked_fill_(bad, torch.nan)
    return y.view(x.shape)


def entmax15_outputs(z: torch.Tensor, pivot: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """max(z - tau, 0)^2 over the last dim, tau = pivot + step per row; in place on z."""
    return z.sub_(pivot.unsqueeze(-1)).sub_(step.unsqueeze(-1)).clamp_min_(0).square_()


def entmax15_backward(y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dx = s * g - (sum(s * g) / sum(s)) * s with s = sqrt(y), over the last dim."""
    s = y.sqrt()
    sg = s * grad
    q = sg.sum(-1, keepdim=True) / s.sum(-1, keepdim=True)
    return sg - q * s


def entmax15_sort(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The sort-based entmax-1.5 of Peters et al. (2019), as the entmax package computes it: the
    peers' baseline and, in float64, the tests' oracle.

    Sort z = (x - max) / 2 descending; for each prefix of j entries, the closed-form tau_j; the
    support is the entries >= their prefix's tau. tau is then recomputed from the support's
    sums without cancellation.
    """
    z = (x - x.amax(dim, keepdim=True)) / 2
    z_sorted = z.sort(dim, descending=True).values
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    j = torch.arange(1, x.shape[dim] + 1, device=x.device, dtype=x.dtype).view(shape)
    s1, s2 = z_sorted.cumsum(dim), (z_sorted * z_sorted).cumsum(dim)
    mean = s1 / j
    delta = ((1 - (s2 - s1 * mean)) / j).clamp_min(0)
    k = ((mean - delta.sqrt()) <= z_sorted).sum(dim, keepdim=True)
    s1, s2, k = s1.gather(dim, k - 1), s2.gather(dim, k - 1), k.to(x.dtype)
    tau = (s1 - torch.sqrt(s1 * s1 - k * (s2 - 1))) / k  # the smaller root; s1 <= 0: no cancellation
    return (z - tau).clamp_min(0).square()

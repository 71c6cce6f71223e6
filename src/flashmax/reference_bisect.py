"""Pure-torch α-entmax by safeguarded Newton: the CPU path, and the fallback without Triton.

Every function here works on the rows of a 2-D float32 or float64 tensor, with one α per row;
`flashmax.entmax_bisect` hands it float64 rows (see the last paragraph).

α-entmax is p_i = [(α−1)x_i − τ]_+^k with k = 1/(α−1) and τ such that Σp = 1. In shifted
coordinates z = (α−1)(x − max) ≤ 0 the root lies in [−1, −n^−(α−1)]: at τ = −1 the largest
entry alone gives 1, at −n^−(α−1) every entry gives at most 1/n. f(τ) = Σ(z − τ)_+^k − 1 is
decreasing; each step evaluates f and its slope in one pass, keeps [lo, hi] bracketing the root,
and takes the Newton step when it lands strictly inside the bracket and the last step at least
halved |f|, else the bracket's midpoint.

Why this works for every α > 1: for k ≥ 1 (α ≤ 2) f is convex, so Newton from τ = −1 (where
f ≥ 0) rises monotonically and never leaves the bracket; far from the root a step leaves about
(1 − 1/k)^k < 1/e of f (exactly so for a single term), so the halving test seldom forces a
bisection, and near the root convergence is quadratic. For k < 1 (α > 2)
f is concave between entries but has a vertical tangent where an entry joins the support, so
Newton may overshoot (the bracket catches it) or crawl towards such a kink without reaching the
root (the halving test catches it). Every two steps either |f| or the bracket halves, so the
iteration converges for every α, and quadratically once Newton takes over near the root.

A row is done when |f| <= tolerance (a few ulps of 1, times k: each term's rounding is
amplified by k), or when the bracket has no float left inside it. The output is p at the last
evaluated τ, divided by its sum when ensure_sum_one (as the entmax package does).

The CPU path computes in float64 whatever the input dtype and rounds once: for α > 2 an entry
just above τ gets (z − τ)^k with k < 1, so float32 rounding of z − τ would show in the output.
"""

import math

import torch

from . import reference as sparsemax_reference

# |Σp − 1| below this many ulps of 1, times max(k, 1), ends a row's iteration.
TOLERANCE_ULPS = 8


def tolerance(k: torch.Tensor) -> torch.Tensor:
    return TOLERANCE_ULPS * torch.finfo(k.dtype).eps * k.clamp_min(1.0)


def bad_rows(row_max: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Rows whose result is NaN: a NaN or +inf entry, every entry -inf, or α not in (1, inf)."""
    return ~torch.isfinite(row_max) | ~((alpha > 1) & torch.isfinite(alpha))


def initial_bracket(alpha_minus_1: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[−1, −n^−(α−1)]: bounds on τ in the shifted coordinates."""
    return -torch.ones_like(alpha_minus_1), -torch.exp2(-alpha_minus_1 * math.log2(n))


def powers(z: torch.Tensor, tau: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, p / d) for d = z − τ: p = d_+^k, and p / d (0 off the support) for the slope."""
    d = z - tau
    support = d > 0
    d_safe = torch.where(support, d, 1.0)
    p = torch.where(support, d_safe.pow(k), 0.0)
    return p, p / d_safe


def newton_bisect_step(f, f_before, slope_sum, k, tau, lo, hi, tol):
    """One safeguarded step from f and Σ p/d at τ, and f at the step before: (next τ, lo, hi,
    converged)."""
    below_root = f > 0
    lo = torch.where(below_root, tau, lo)
    hi = torch.where(below_root, hi, tau)
    newton = tau + f / (k * slope_sum)
    mid = lo + (hi - lo) * 0.5
    use_newton = (newton > lo) & (newton < hi) & (2 * f.abs() <= f_before.abs())
    converged = (f.abs() <= tol) | (mid == lo) | (mid == hi)
    return torch.where(use_newton, newton, mid), lo, hi, converged


def solve(z: torch.Tensor, k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
          done: torch.Tensor, n_iter: int):
    """At most n_iter safeguarded steps from τ = lo for the rows not done, on z (rows, m),
    -inf padding allowed. Returns (τ last evaluated, Σp there, lo): lo is the largest τ seen
    with Σp > 1, a lower bound on the root of any superset of each row."""
    tol = tolerance(k)
    tau, tau_out, sum_out = lo, lo, torch.ones_like(lo)
    f_before = torch.full_like(lo, torch.inf)
    for _ in range(n_iter):
        if bool(done.all()):
            break
        p, slope_terms = powers(z, tau, k)
        total = p.sum(-1, keepdim=True)
        next_tau, next_lo, next_hi, converged = newton_bisect_step(
            total - 1, f_before, slope_terms.sum(-1, keepdim=True), k, tau, lo, hi, tol)
        tau_out = torch.where(done, tau_out, tau)
        sum_out = torch.where(done, sum_out, total)
        f_before = total - 1
        lo, hi = torch.where(done, lo, next_lo), torch.where(done, hi, next_hi)
        done = done | converged
        tau = torch.where(done, tau, next_tau)
    return tau_out, sum_out, lo


def entmax_bisect_forward(x: torch.Tensor, alpha: torch.Tensor, n_iter: int,
                          ensure_sum_one: bool) -> torch.Tensor:
    """α-entmax of each row of x (rows, n >= 1) with alpha (rows, 1); at most n_iter steps
    over the row's candidates.

    As in sparsemax's CPU path, the root for a subset of a row is a lower bound on the row's
    (fewer terms, smaller f): solving first on the maxima of groups of entries (1/GROUP of the
    row) bounds τ from below, and only the groups whose maximum exceeds that bound can hold
    support, usually a small part of the row.
    """
    row_max = x.amax(-1, keepdim=True)
    bad = bad_rows(row_max, alpha)
    alpha_minus_1 = torch.where(bad, 1.0, alpha - 1)
    k = 1 / alpha_minus_1
    z = alpha_minus_1 * (x - torch.where(bad, 0.0, row_max))
    z = z.masked_fill(bad, -torch.inf)  # NaN rows: no candidates, done from the start
    lo, hi = initial_bracket(alpha_minus_1, x.shape[-1])
    groups = sparsemax_reference._groups(z)
    maxima = groups.amax(-1)
    _, _, lo = solve(maxima, k, lo, hi, bad, n_iter)
    candidates = sparsemax_reference._pack_groups(groups, maxima > lo)
    tau, total, _ = solve(candidates, k, lo, hi, bad, n_iter)
    y, _ = powers(z, tau, k)
    if ensure_sum_one:
        y = y / total
    return y.masked_fill(bad, torch.nan)


def entmax_bisect_backward(y: torch.Tensor, grad: torch.Tensor,
                           alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entmax package's gradients, per row: (dx, dα) with dα of shape (rows, 1).

    With s = y^(2−α) on the support (Correia et al., 2019): dx = s (g − Σ g s / Σ s), and
    dα = (Σ g y − Σ g s / Σ s) / (α−1)² − (Σ g y ln y − (Σ g s / Σ s) Σ y ln y) / (α−1).
    Rows without support (NaN rows) get zeros, as sparsemax's backward gives them.
    """
    support = y > 0
    y_safe = torch.where(support, y, 1.0)
    s = torch.where(support, y_safe.pow(2 - alpha), 0.0)
    g = torch.where(support, grad, 0.0)
    s_total = s.sum(-1, keepdim=True)
    has_support = s_total > 0
    q = (g * s).sum(-1, keepdim=True) / torch.where(has_support, s_total, 1.0)
    dx = torch.where(support, s * (grad - q), 0.0)
    y_log_y = torch.where(support, y_safe * y_safe.log(), 0.0)
    am1 = alpha - 1
    d_alpha = ((g * y).sum(-1, keepdim=True) - q) / am1**2 - (
        (g * y_log_y).sum(-1, keepdim=True) - q * y_log_y.sum(-1, keepdim=True)) / am1
    return dx, torch.where(has_support, d_alpha, 0.0)

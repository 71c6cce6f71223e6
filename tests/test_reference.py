"""The oracle against the optimality (KKT) conditions, and `flashmax.reference` against the oracle.

sparsemax(x) is the Euclidean projection of x onto the simplex; y is that projection iff
    y >= 0,  sum(y) = 1,  and for some tau:  x_i - y_i = tau where y_i > 0,  x_i <= tau where y_i = 0.
These conditions are checked independently of how the oracle computes y.
"""

import math

import pytest
import torch

from flashmax import reference
from oracle import assert_close_to_oracle, oracle, relative_error

INF = math.inf
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def kkt_violations(x: torch.Tensor, y: torch.Tensor, tol: float) -> list[str]:
    """Reasons why y (1-D, fp64) is not the sparsemax of x (1-D, fp64, finite or -inf)."""
    problems = []
    scale = max(1.0, float(x[torch.isfinite(x)].abs().max()))
    if bool((y < 0).any()):
        problems.append(f"negative entry {float(y.min())}")
    if abs(float(y.sum()) - 1) > tol:
        problems.append(f"sum {float(y.sum())!r} != 1")
    support = y > 0
    if not bool(support.any()):
        return problems + ["empty support"]
    gaps = x[support] - y[support]
    tau = float(gaps.mean())
    if float(gaps.max() - gaps.min()) > tol * scale:
        problems.append(f"x - y not constant on the support (spread {float(gaps.max() - gaps.min()):.3g})")
    off = x[~support]
    if off.numel() and float(off.max()) > tau + tol * scale:
        problems.append(f"entry {float(off.max())!r} off the support is above tau {tau!r}")
    if bool((y[x == -INF] != 0).any()):
        problems.append("-inf entry with non-zero weight")
    return problems


def assert_kkt(x: torch.Tensor, y: torch.Tensor, tol: float = 1e-12) -> None:
    for r in range(x.shape[0]):
        problems = kkt_violations(x[r], y[r], tol)
        assert not problems, f"row {r} (n={x.shape[1]}): " + "; ".join(problems)


def random_rows(n: int, seed: int, kind: str, rows: int = 16, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        scale = 10.0 ** torch.randint(-3, 4, (rows, 1), generator=g).double()
        x = torch.randn(rows, n, generator=g, dtype=torch.float64) * scale
    elif kind == "uniform":  # every entry within 1 of the max
        x = 5 + torch.rand(rows, n, generator=g, dtype=torch.float64) * 0.99
    elif kind == "tiny_spread":  # every entry in the support
        x = torch.rand(rows, n, generator=g, dtype=torch.float64) / (4 * n)
    elif kind == "ties":
        x = torch.tensor([-1.0, -0.25, 0.0, 0.5, 1.0], dtype=torch.float64)[
            torch.randint(5, (rows, n), generator=g)
        ]
    elif kind == "spike":
        x = torch.rand(rows, n, generator=g, dtype=torch.float64) * (2.0 / n) - 1
        x[:, n // 2] = 0.0
    elif kind == "masked":
        x = torch.randn(rows, n, generator=g, dtype=torch.float64) * 2
        mask = torch.rand(rows, n, generator=g) < 0.6
        mask[:, 0] = False
        x = x.masked_fill(mask, -INF)
    elif kind == "offset":
        x = 1e4 + torch.randn(rows, n, generator=g, dtype=torch.float64)
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = ["randn", "uniform", "tiny_spread", "ties", "spike", "masked", "offset"]
SIZES = [1, 2, 7, 8, 9, 16, 17, 63, 1000]


# ----------------------------------------------------------------------------------------------
# The oracle is right
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_oracle_satisfies_kkt(kind, n):
    x = random_rows(n, seed=n, kind=kind)
    y = oracle(x)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert_kkt(x, y)


def test_kkt_check_rejects_wrong_answers():
    """The KKT check is not vacuous: near misses of the right answer fail it, each for the
    reason it was built to miss."""

    def fails_with(x, y, reason):
        problems = kkt_violations(x, y, 1e-12)
        return any(problem.startswith(reason) for problem in problems)

    x = torch.tensor([0.3, 0.1, 0.25, -0.4, 0.05, -1.0, 0.2], dtype=torch.float64)
    y = oracle(x)
    assert not kkt_violations(x, y, 1e-12)
    assert fails_with(x, torch.softmax(x, 0), "x - y not constant on the support")
    shifted = y.clone()
    support = (y > 0).nonzero().flatten()
    assert len(support) >= 2, "the test needs a support of two or more"
    shifted[support[0]] += 1e-6
    shifted[support[1]] -= 1e-6  # still sums to 1, still >= 0
    assert fails_with(x, shifted, "x - y not constant on the support")
    dropped = torch.zeros_like(y)
    dropped[int(x.argmax())] = 1.0  # argmax one-hot: feasible but not optimal
    assert fails_with(x, dropped, "entry 0.25 off the support is above tau")
    wrong_inf = y.clone()
    x_inf = x.clone()
    x_inf[support[0]] = -INF
    assert fails_with(x_inf, wrong_inf, "-inf entry with non-zero weight")


def test_oracle_known_values():
    x = torch.tensor(
        [[1.0, 0.0, -1.0], [0.5, 0.5, 0.5], [3.0, 0.0, 0.0], [0.2, 0.1, -INF]], dtype=torch.float64
    )
    want = torch.tensor(
        [[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.55, 0.45, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(oracle(x), want, rtol=0, atol=1e-15)
    want = torch.tensor([0.25, 0.75], dtype=torch.float64)
    torch.testing.assert_close(oracle(torch.tensor([0.0, 0.5])), want)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_oracle_along_dims_and_bad_slices(dim):
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(dim), dtype=torch.float64)
    y = oracle(x, dim)
    rows_x = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    assert_kkt(rows_x, y.movedim(dim, -1).reshape(rows_x.shape))
    bad = x.clone()
    bad.select(dim, 0).fill_(math.nan)  # a NaN in every slice
    assert bool(torch.isnan(oracle(bad, dim)).all())
    all_inf = torch.full((2, 3), -INF)
    assert bool(torch.isnan(oracle(all_inf, 1)).all())


# ----------------------------------------------------------------------------------------------
# flashmax.reference.sparsemax_forward
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_reference_forward_matches_oracle(dtype, kind, n):
    x = random_rows(n, seed=100 + n, kind=kind, dtype=dtype)
    x0 = x.clone()
    y = reference.sparsemax_forward(x)
    assert torch.equal(x, x0), "reference.sparsemax_forward modified its input"
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert y.data_ptr() != x.data_ptr()
    assert_close_to_oracle(y, x, -1, RTOL[dtype])
    assert float((y.double().sum(-1) - 1).abs().max()) <= (1e-5 if dtype == torch.float32 else 1e-12)
    if dtype == torch.float64:
        assert_kkt(x.double(), y, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_forward_mixed_support_sizes(dtype):
    """Rows needing very different numbers of packed groups in one batch; each row as if alone."""
    n = 1000
    g = torch.Generator().manual_seed(3)
    x = torch.stack(
        [
            torch.rand(n, generator=g, dtype=torch.float64) / (4 * n),  # all 1000 in the support
            torch.randn(n, generator=g, dtype=torch.float64) * 10,  # a handful
            torch.full((n,), 2.0, dtype=torch.float64),  # all tied
            torch.rand(n, generator=g, dtype=torch.float64) * 0.3,  # hundreds
            torch.cat([torch.tensor([1.0]), torch.full((n - 1,), -5.0)]).double(),  # one
        ]
    ).to(dtype)
    y = reference.sparsemax_forward(x)
    assert_close_to_oracle(y, x, -1, RTOL[dtype])
    for r in range(x.shape[0]):
        assert torch.equal(y[r], reference.sparsemax_forward(x[r : r + 1])[0]), f"row {r}"
    assert int((y[0] > 0).sum()) == n and int((y[4] > 0).sum()) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_forward_views_and_batches(dtype):
    """The public op hands in movedim views (non-contiguous) and leading batch dims."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(9, 6, 17, generator=g).to(dtype)
    for x in (base, base.transpose(0, 2), base[:, ::2, 1::2]):
        y = reference.sparsemax_forward(x)
        assert y.shape == x.shape and y.is_contiguous()
        assert_close_to_oracle(y, x, -1, RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_forward_bad_rows(dtype):
    x = torch.tensor(
        [[1.0, 2.0, 3.0], [math.nan, 0.0, 1.0], [-INF, -INF, -INF], [INF, 0.0, 0.0], [0.0, -INF, 1.0]],
        dtype=dtype,
    )
    y = reference.sparsemax_forward(x)
    assert bool(torch.isnan(y[1:4]).all())
    assert not bool(torch.isnan(y[[0, 4]]).any())
    assert torch.equal(y[0], reference.sparsemax_forward(x[:1])[0])
    assert torch.equal(y[4], reference.sparsemax_forward(x[4:])[0])
    assert_close_to_oracle(y, x, -1, RTOL[dtype])


# ----------------------------------------------------------------------------------------------
# flashmax.reference.sparsemax_backward
# ----------------------------------------------------------------------------------------------


def backward_by_hand(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(y.shape, dtype=torch.float64)
    for r in range(y.shape[0]):
        s = y[r] > 0
        out[r][s] = g[r][s].double() - g[r][s].double().sum() / s.sum()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["randn", "uniform", "tiny_spread", "ties", "masked"])
@pytest.mark.parametrize("n", [1, 7, 9, 1000])
def test_reference_backward_matches_formula(dtype, kind, n):
    x = random_rows(n, seed=7 * n, kind=kind, dtype=dtype, rows=8)
    y = reference.sparsemax_forward(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(dtype)
    g0 = g.clone()
    dx = reference.sparsemax_backward(y, g)
    assert torch.equal(g, g0)
    assert dx.dtype == dtype and dx.shape == y.shape
    want = backward_by_hand(y, g)
    atol = (1e-6 if dtype == torch.float32 else 1e-12) * float(g.abs().max())
    torch.testing.assert_close(dx.double(), want, rtol=0, atol=atol)
    assert bool((dx[y == 0] == 0).all())
    sums = dx.double().sum(-1)  # the gradient is orthogonal to the all-ones direction
    assert float(sums.abs().max()) <= atol * n


@pytest.mark.parametrize("n", [2, 7, 9, 64])
def test_reference_backward_is_the_jacobian_of_the_sort_formula(n):
    """Autograd through the differentiable sort-based sparsemax (fp64) gives the same vjp."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randperm(8 * n, generator=g)[:n * 4].double().reshape(4, n) / (2 * n)).requires_grad_()
    grad = torch.randn(4, n, generator=g, dtype=torch.float64)
    y_sort = reference.sparsemax_sort(x, -1)
    (want,) = torch.autograd.grad(y_sort, x, grad)
    dx = reference.sparsemax_backward(reference.sparsemax_forward(x.detach()), grad)
    torch.testing.assert_close(dx, want, rtol=0, atol=1e-12)
    assert float(relative_error(dx, want)) <= 1e-12


def test_reference_sort_baseline_along_dims():
    x = torch.randn(5, 6, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for dim in (0, 1, 2):
        y = reference.sparsemax_sort(x, dim)
        rows_x = x.movedim(dim, -1).reshape(-1, x.shape[dim])
        assert_kkt(rows_x, y.movedim(dim, -1).reshape(rows_x.shape))

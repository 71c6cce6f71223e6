"""`flashmax.entmax_bisect` / `flashmax.EntmaxBisect`: the contract on the CPU path, the Triton
kernels (under TRITON_INTERPRET=1 on the CPU, compiled with FLASHMAX_TEST_DEVICE=cuda), and
agreement with the entmax package when it is installed.

The oracle is plain bisection on τ in float64 with far more iterations than float64 needs,
independent of flashmax's safeguarded Newton; α = 2 is also checked against the sort-based
sparsemax oracle and α = 1.5 against the sort-based closed form of 1.5-entmax.
"""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashmax
from flashmax import EntmaxBisect, entmax_bisect
from oracle import oracle as sparsemax_oracle
from oracle import relative_error
from test_sparsemax import (FLOAT_DTYPES, HALF_DTYPES, PROPERTY_SETTINGS, assert_bitwise_equal,
                            assert_equal_to_precision, assert_within_ulps, inputs, make_input,
                            noncontiguous_copy, separated_input)

DEVICE = os.environ.get("FLASHMAX_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
INF = math.inf
ALPHAS = [1.1, 1.25, 1.5, 2.0, 3.0]
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
SUM_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
POISON = 12345.0  # finite: outputs expected to be NaN must be written too


# ----------------------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------------------


def alpha_rows(alpha, x: torch.Tensor, dim: int) -> torch.Tensor:
    """One float64 α per slice of x along dim, as a column (rows, 1)."""
    shape = list(x.shape)
    shape[dim] = 1
    a = torch.as_tensor(alpha, dtype=torch.float64, device="cpu").expand(shape)
    return a.movedim(dim, -1).reshape(-1, 1)


def oracle(x: torch.Tensor, alpha, dim: int = -1, ensure_sum_one: bool = True) -> torch.Tensor:
    """α-entmax in float64 by 100 bisection steps on τ in [−1, 0] (float64 has no number left
    between the ends after about 60 for |τ| >= 1e-2, 90 for 1e-11); NaN slices per the contract."""
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, max(x.shape[dim], 1)).double().cpu()
    a = alpha_rows(alpha, x.cpu(), dim)
    row_max = rows.amax(-1, keepdim=True)
    bad = ~torch.isfinite(row_max)
    z = (a - 1) * (rows - torch.where(bad, 0.0, row_max))
    lo, hi = -torch.ones_like(a), torch.zeros_like(a)
    for _ in range(100):
        mid = (lo + hi) / 2
        f = (z - mid).clamp_min(0).pow(1 / (a - 1)).sum(-1, keepdim=True) - 1
        lo, hi = torch.where(f > 0, mid, lo), torch.where(f > 0, hi, mid)
    p = (z - lo).clamp_min(0).pow(1 / (a - 1))
    if ensure_sum_one:
        p = p / p.sum(-1, keepdim=True)
    p = p.masked_fill(bad, torch.nan)
    return p.reshape(moved.shape).movedim(-1, dim)


def entmax15_sort(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The closed form of 1.5-entmax by sorting (Peters et al., 2019), float64."""
    z = (x.double() - x.double().amax(dim, keepdim=True)) / 2
    zs = z.sort(dim, descending=True).values
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    k = torch.arange(1, x.shape[dim] + 1, dtype=torch.float64).view(shape)
    mean = zs.cumsum(dim) / k
    mean_sq = (zs**2).cumsum(dim) / k
    tau = mean - ((1 - k * (mean_sq - mean**2)) / k).clamp_min(0).sqrt()
    support = (tau <= zs).sum(dim, keepdim=True)
    return (z - tau.gather(dim, support - 1)).clamp_min(0) ** 2


def check_against_oracle(y, x, alpha, dim, rtol=None, ensure_sum_one=True):
    """fp32/fp64 within rtol of the oracle (norm-wise), NaN slices in place, sums one;
    fp16/bf16 within 2 ulps of the oracle on the same (fp32) input, rounded once.

    y and x (the input that gave y) may be on different devices: the oracle runs on the CPU,
    and y is compared there (test_fresh_output_input_untouched checks y's device)."""
    assert y.shape == x.shape and y.dtype == x.dtype
    y, x = y.cpu(), x.cpu()
    if x.dtype in HALF_DTYPES:
        want = oracle(x.float(), alpha, dim, ensure_sum_one).to(x.dtype)
        assert_within_ulps(y, want, 2, f"entmax_bisect({x.dtype})")
        return
    ref = oracle(x, alpha, dim, ensure_sum_one)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN slices differ from the oracle"
    err = relative_error(y, ref)
    assert err <= (rtol or RTOL[x.dtype]), f"relative error {err:.3g} against the oracle"
    sums = y.double().sum(dim)
    finite = ~torch.isnan(sums)
    if finite.any() and ensure_sum_one:
        worst = float((sums[finite] - 1).abs().max())
        assert worst <= SUM_TOL[x.dtype], f"row sums off by {worst:.3g}"


def test_check_against_oracle_can_fail():
    """The helper compares on the CPU whatever y's device, but still rejects wrong results."""
    x = make_input((4, 20), -1, torch.float32, seed=1)
    y = entmax_bisect(x.to(DEVICE), 1.5)
    check_against_oracle(y, x, 1.5, -1)
    wrong = [y.flip(-1), y * (1 + 1e-4), y.double(), y[:, 1:], y.masked_fill(y == 0, math.nan)]
    for bad in wrong:
        with pytest.raises(AssertionError):
            check_against_oracle(bad, x, 1.5, -1)
    with pytest.raises(AssertionError):
        check_against_oracle(y, x, 1.6, -1)


def test_oracle_is_sparsemax_at_2_and_entmax15_at_1_5():
    """The oracle itself against the two sort-based closed forms (it must be able to fail)."""
    x = make_input((7, 33), -1, torch.float64, seed=1)
    assert relative_error(oracle(x, 2.0), sparsemax_oracle(x)) <= 1e-13
    assert relative_error(oracle(x, 1.5), entmax15_sort(x)) <= 1e-13
    assert relative_error(oracle(x, 1.6), entmax15_sort(x)) > 1e-3


# ----------------------------------------------------------------------------------------------
# Accuracy (CPU path; on GPU runs the same through the kernels)
# ----------------------------------------------------------------------------------------------

KINDS = [("randn", 1.0, 0.0), ("randn", 1e-3, 0.0), ("randn", 1e3, 0.0), ("randn", 1.0, 1e4),
         ("near_max", 0.0, 0.0), ("ties", 0.3, 0.0), ("spike", 1.0, 0.0)]


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_oracle(alpha, dtype):
    for seed, (kind, scale, offset) in enumerate(KINDS):
        x = make_input((6, 97), -1, dtype, seed, kind, scale, offset, mask_p=0.2 * (seed % 2))
        check_against_oracle(entmax_bisect(x.to(DEVICE), alpha), x, alpha, -1)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_dtypes_are_rounded_once(dtype):
    for seed, alpha in enumerate(ALPHAS):
        x = make_input((8, 64), -1, dtype, seed, scale=2.0)
        check_against_oracle(entmax_bisect(x.to(DEVICE), alpha), x, alpha, -1)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_every_dim_with_per_slice_alpha(dim):
    x = make_input((4, 5, 6), dim, torch.float32, seed=dim % 3, scale=1.5)
    shape = list(x.shape)
    shape[dim] = 1
    g = torch.Generator().manual_seed(3)
    alpha = 1.05 + 2 * torch.rand(shape, generator=g, dtype=torch.float64)
    y = entmax_bisect(x.to(DEVICE), alpha.to(DEVICE), dim)
    check_against_oracle(y, x, alpha, dim)


def test_alpha_broadcasts_like_the_entmax_package():
    x = make_input((3, 4, 9), 1, torch.float64, seed=4)
    for shape in [(), (1,), (9,), (1, 1, 9), (3, 1, 1), (3, 1, 9)]:
        alpha = torch.linspace(1.2, 2.5, math.prod(shape) or 1, dtype=torch.float64).reshape(shape)
        check_against_oracle(entmax_bisect(x.to(DEVICE), alpha.to(DEVICE), 1), x,
                             alpha.expand(3, 1, 9), 1)


def test_alpha_2_is_sparsemax_and_1_5_is_entmax15():
    x = make_input((16, 200), -1, torch.float32, seed=5)
    y2 = entmax_bisect(x.to(DEVICE), 2.0).cpu()
    assert relative_error(y2, sparsemax_oracle(x)) <= 1e-6
    assert relative_error(y2, flashmax.sparsemax(x).double()) <= 1e-6
    assert relative_error(entmax_bisect(x.to(DEVICE), 1.5).cpu(), entmax15_sort(x)) <= 1e-6


def test_alpha_near_1_tends_to_softmax():
    x = make_input((8, 50), -1, torch.float64, seed=6)
    y = entmax_bisect(x.to(DEVICE), 1 + 1e-4).cpu()
    check_against_oracle(y, x, 1 + 1e-4, -1, rtol=1e-9)
    assert relative_error(y, torch.softmax(x, -1)) <= 1e-3
    assert relative_error(entmax_bisect(x.to(DEVICE), 1.3).cpu(), torch.softmax(x, -1)) > 1e-2


@pytest.mark.parametrize("alpha", [5.0, 10.0])
def test_large_alpha_is_as_exact_as_floats_allow(alpha):
    """For α > 2 an entry δ above τ gets δ^(1/(α−1)): ill-conditioned near τ, where float64
    cannot tell δ = 0 from δ = a few ulps of τ (at α = 10, 1e-15 gives 0.02). So each entry
    may differ from the oracle by (64 eps)^(1/(α−1)) (|τ| <= 1), and by no more."""
    x = make_input((6, 80), -1, torch.float64, seed=7)
    y = entmax_bisect(x.to(DEVICE), alpha).cpu()
    allowed = 1e-12 + (64 * torch.finfo(torch.float64).eps) ** (1 / (alpha - 1))
    assert (y - oracle(x, alpha)).abs().max() <= allowed
    assert torch.allclose(y.sum(-1), torch.ones(6, dtype=torch.float64), atol=1e-12)
    assert torch.equal(y.argmax(-1), x.argmax(-1))


def test_ensure_sum_one_false_and_few_iterations():
    x = make_input((6, 120), -1, torch.float64, seed=8)
    y = entmax_bisect(x.to(DEVICE), 1.5, ensure_sum_one=False).cpu()
    check_against_oracle(y, x, 1.5, -1, ensure_sum_one=False)
    assert (y.sum(-1) - 1).abs().max() <= 1e-13
    # One step leaves τ at its lower bound −1: normalised, but not yet the answer.
    y1 = entmax_bisect(x.to(DEVICE), 1.5, n_iter=1).cpu()
    assert torch.allclose(y1.sum(-1), torch.ones(6, dtype=torch.float64), atol=1e-12)
    assert relative_error(y1, oracle(x, 1.5)) > 1e-3


@pytest.mark.parametrize("offset", [100.0, 1e4, -1e4])
def test_max_shifted_coordinates(offset):
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-256, 256, (10, 30), generator=g).float() / 256  # exact under + offset
    ref = oracle(x, 1.5)
    assert relative_error(entmax_bisect((x + offset).to(DEVICE), 1.5).cpu(), ref) <= 1e-6


# ----------------------------------------------------------------------------------------------
# Contract: output, -inf / NaN / +inf, degenerate shapes, errors, determinism
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_fresh_output_input_untouched(dtype, layout):
    x = noncontiguous_copy(make_input((5, 6), 1, dtype, seed=10), layout, axis=1).to(DEVICE)
    x0 = x.clone()
    for dim in (0, 1):
        y = entmax_bisect(x, 1.7, dim)
        assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
        assert y.is_contiguous()
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        y.fill_(3.0)
        assert_bitwise_equal(x, x0, "x changed")
    one = torch.ones(4, 1, dtype=dtype, device=DEVICE)
    assert entmax_bisect(one).untyped_storage().data_ptr() != one.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.25, 2.0, 3.0])
def test_neg_inf_entries_take_no_part(dtype, alpha):
    g = torch.Generator().manual_seed(11)
    for _ in range(5):
        x = (torch.randn(40, generator=g) * 2).to(dtype)
        mask = torch.rand(40, generator=g) < 0.5
        mask[0] = False
        y = entmax_bisect(x.masked_fill(mask, -INF).to(DEVICE), alpha).cpu()
        assert bool((y[mask] == 0).all()) and not bool(torch.signbit(y[mask]).any())
        alone = entmax_bisect(x[~mask].to(DEVICE), alpha).cpu()
        if dtype == torch.bfloat16:
            assert_within_ulps(y[~mask], alone, 1, "-inf entries took part")
        else:
            assert relative_error(y[~mask], alone.double()) <= RTOL[dtype]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bad_slices_are_nan_and_others_unaffected(dtype):
    """Bad slices are NaN; the others are bit for bit what they are without them, in the same
    memory layout. Across layouts only to the dtype's precision: a compiled kernel sums a row
    in an order that follows the register layout Triton picks for its loads (Triton 3.6 on an
    H200: one row per thread for these slices along dim 1, strided by 9; a row across 8 lanes
    for contiguous rows)."""
    x = make_input((6, 7, 9), 1, dtype, seed=12, mask_p=0.3)
    poisoned = x.clone()
    rows = poisoned.movedim(1, -1)  # a view: writes poison the slices of x's layout
    rows[0, 0] = -INF
    rows[1, 2, 3] = math.nan
    rows[2, 1, 0] = INF
    rows[3, 3, -1] = INF
    rows[3, 3, 0] = -INF
    bad = torch.zeros(rows.shape[:-1], dtype=torch.bool)
    for idx in [(0, 0), (1, 2), (2, 1), (3, 3)]:
        bad[idx] = True
    y_rows = entmax_bisect(poisoned.to(DEVICE), 1.5, 1).movedim(1, -1).cpu()
    assert bool(torch.isnan(y_rows[bad]).all())
    assert not bool(torch.isnan(y_rows[~bad]).any())
    clean = entmax_bisect(x.to(DEVICE), 1.5, 1).movedim(1, -1).cpu()
    assert_bitwise_equal(y_rows[~bad], clean[~bad], "good slices changed by bad ones")
    # Contiguous rows: the good ones move to other positions, among other neighbours.
    flat, good = rows.reshape(-1, 7), ~bad.flatten()
    y_flat = entmax_bisect(flat.to(DEVICE), 1.5).cpu()
    alone = entmax_bisect(flat[good].to(DEVICE), 1.5).cpu()
    assert_bitwise_equal(y_flat[good], alone, "good rows changed by bad ones")
    assert_equal_to_precision(y_rows[~bad], alone, "strided and contiguous rows")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "shape,dim", [((0, 5), 0), ((0, 5), 1), ((5, 0), 1), ((0,), 0), ((2, 0, 3), 2)])
def test_empty(dtype, shape, dim):
    x = torch.empty(shape, dtype=dtype, device=DEVICE, requires_grad=True)
    alpha_shape = list(shape)
    alpha_shape[dim] = 1
    alpha = torch.full(alpha_shape, 1.5, dtype=torch.float64, requires_grad=True)
    y = entmax_bisect(x, alpha.to(DEVICE), dim)
    assert y.shape == x.shape and y.dtype == dtype
    y.sum().backward()
    assert x.grad.shape == x.shape and alpha.grad.shape == alpha.shape


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("value", [0.0, -3.5, 1e4])
def test_one_feature_and_zero_d(dtype, value):
    x = torch.full((4, 1, 3), value, dtype=dtype, device=DEVICE)
    assert bool((entmax_bisect(x, 1.3, 1) == 1).all())
    x0 = torch.tensor(value, dtype=dtype, device=DEVICE, requires_grad=True)
    y = entmax_bisect(x0, 2.5)
    assert y.shape == () and y.item() == 1.0
    y.backward()
    assert x0.grad.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_unsupported_dtype_is_type_error(dtype):
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        entmax_bisect(torch.ones(3, 4, dtype=dtype))


@pytest.mark.parametrize("shape,dim", [((3, 4), 2), ((3, 4), -3), ((), 1)])
def test_dim_out_of_range_is_index_error(shape, dim):
    with pytest.raises(IndexError):
        entmax_bisect(torch.randn(shape), 1.5, dim)


@pytest.mark.parametrize("alpha", [1.0, 0.5, -2.0, math.nan, math.inf,
                                   torch.tensor([[1.5], [1.0]]), torch.tensor(math.nan)])
def test_alpha_not_above_1_is_value_error(alpha):
    with pytest.raises(ValueError, match="alpha"):
        entmax_bisect(torch.randn(2, 5), alpha)


def test_bad_arguments():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="broadcast"):
        entmax_bisect(x, torch.full((2, 5), 1.5))  # one α per slice, not per entry
    with pytest.raises(ValueError, match="broadcast"):
        entmax_bisect(x, torch.full((1, 2, 1), 1.5))
    with pytest.raises(ValueError, match="broadcast"):
        entmax_bisect(x, torch.full((3, 1), 1.5))  # 3 slices' α for 2 slices
    with pytest.raises(TypeError):
        entmax_bisect(x, "1.5")
    with pytest.raises(TypeError):
        entmax_bisect(x, torch.tensor([1.5j]))
    with pytest.raises(ValueError, match="n_iter"):
        entmax_bisect(x, 1.5, n_iter=0)
    with pytest.raises(TypeError, match="n_iter"):
        entmax_bisect(x, 1.5, n_iter=2.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_deterministic(dtype):
    x = make_input((17, 130), -1, dtype, seed=13, scale=0.5, mask_p=0.1).to(DEVICE)
    first = entmax_bisect(x, 1.4)
    for _ in range(2):
        assert_bitwise_equal(entmax_bisect(x.clone(), 1.4), first, "not deterministic")


# ----------------------------------------------------------------------------------------------
# Gradients w.r.t. x and α
# ----------------------------------------------------------------------------------------------


def expected_grads(y, g, alpha, dim):
    """The entmax package's formulas, slice by slice in float64 (a loop, not vectorised)."""
    y_rows = y.double().movedim(dim, -1).reshape(-1, y.shape[dim]).cpu()
    g_rows = g.double().movedim(dim, -1).reshape(-1, y.shape[dim]).cpu()
    a_rows = alpha_rows(alpha.detach().cpu(), y.cpu(), dim).flatten()
    dx, da = torch.zeros_like(y_rows), torch.zeros(len(a_rows), dtype=torch.float64)
    for r, a in enumerate(a_rows.tolist()):
        on = y_rows[r] > 0
        yr, gr = y_rows[r][on], g_rows[r][on]
        s = yr ** (2 - a)
        q = (gr * s).sum() / s.sum()
        dx[r][on] = s * (gr - q)
        ent = (yr * yr.log()).sum()
        skew = s / s.sum()
        da[r] = ((gr * (yr - skew)).sum() / (a - 1) ** 2
                 - (gr * (yr * yr.log() - skew * ent)).sum() / (a - 1))
    return dx.reshape(y.movedim(dim, -1).shape).movedim(-1, dim), da


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_formula(dtype, dim):
    x = make_input((5, 6, 7), dim, dtype, seed=14 + dim, scale=0.7).to(DEVICE).requires_grad_()
    shape = list(x.shape)
    shape[dim] = 1
    alpha = (1.2 + torch.rand(shape, generator=torch.Generator().manual_seed(dim),
                              dtype=torch.float64)).to(DEVICE).requires_grad_()
    g = make_input((5, 6, 7), dim, dtype, seed=99).to(DEVICE)
    y = entmax_bisect(x, alpha, dim)
    dx, da = torch.autograd.grad(y, (x, alpha), g)
    want_dx, want_da = expected_grads(y.detach(), g, alpha, dim)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert dx.dtype == dtype and da.dtype == torch.float64 and da.shape == alpha.shape
    torch.testing.assert_close(dx.cpu().double(), want_dx, rtol=tol, atol=tol)
    torch.testing.assert_close(da.cpu().flatten(), want_da, rtol=tol, atol=tol)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_x_and_alpha(dim):
    x = separated_input((3, 4, 5), seed=dim % 3).to(DEVICE).requires_grad_()
    shape = [3, 4, 5]
    shape[dim] = 1
    alpha = torch.linspace(1.3, 2.6, math.prod(shape), dtype=torch.float64).reshape(shape)
    alpha = alpha.to(DEVICE).requires_grad_()
    assert torch.autograd.gradcheck(lambda t, a: entmax_bisect(t, a, dim), (x, alpha),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_float_alpha_module_noncontiguous():
    x = separated_input((5, 4), seed=7).t().to(DEVICE).requires_grad_()
    assert torch.autograd.gradcheck(EntmaxBisect(1.5, dim=1), (x,), eps=1e-6, atol=1e-7)


def test_alpha_gradient_reaches_a_broadcast_parameter():
    alpha = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float32))
    layer = EntmaxBisect(alpha, dim=-1)
    assert [p is alpha for p in layer.parameters()] == [True]
    x = make_input((6, 10), -1, torch.float32, seed=15).to(DEVICE)
    g = make_input((6, 10), -1, torch.float32, seed=16).to(DEVICE)
    (layer(x) * g).sum().backward()
    _, want_da = expected_grads(entmax_bisect(x, 1.5).detach(), g, torch.tensor(1.5), -1)
    assert alpha.grad.dtype == torch.float32
    assert abs(alpha.grad.item() - want_da.sum().item()) <= 1e-5 * max(1, abs(want_da.sum().item()))


# ----------------------------------------------------------------------------------------------
# Custom ops, torch.compile, module
# ----------------------------------------------------------------------------------------------


def _opcheck_inputs():
    g = torch.Generator().manual_seed(17)
    base = torch.randn(4, 6, 10, generator=g)
    return [("fp32", base, 2), ("fp32-dim0", base, 0), ("fp32-transposed", base.transpose(0, 2), 1),
            ("fp64", base.double(), 1), ("bf16", base.bfloat16()[..., ::2], 0),
            ("1feature", base[..., :1], 2)]


def _alpha_for(x, dim, requires_grad=False):
    shape = list(x.shape)
    shape[dim] = 1
    return torch.full(shape, 1.6, dtype=torch.float64, requires_grad=requires_grad)


@pytest.mark.parametrize("name,x,dim", _opcheck_inputs(), ids=[c[0] for c in _opcheck_inputs()])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(name, x, dim, requires_grad):
    x = x.detach().requires_grad_(requires_grad)
    alpha = _alpha_for(x, dim, requires_grad)
    torch.library.opcheck(torch.ops.flashmax.entmax_bisect.default, (x, alpha, dim, 50, True))
    y = entmax_bisect(x.detach(), alpha.detach(), dim)
    grad = torch.randn(x.shape).to(x.dtype)
    torch.library.opcheck(torch.ops.flashmax.entmax_bisect_backward.default,
                          (y, grad, alpha.detach(), dim))


def _f(x, alpha, dim):
    return entmax_bisect(x * 2, alpha, dim) + 1


def test_compile_inductor_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    x = torch.randn(6, 9, 5)
    alpha = torch.linspace(1.2, 2.5, 6 * 5, dtype=torch.float64).reshape(6, 1, 5)
    g = torch.randn(6, 9, 5)
    compiled = torch.compile(_f, fullgraph=True)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ae, ac = alpha.clone().requires_grad_(), alpha.clone().requires_grad_()
    ye, yc = _f(xe, ae, 1), compiled(xc, ac, 1)
    torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-7)
    ye.backward(g)
    yc.backward(g)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ac.grad, ae.grad, rtol=1e-6, atol=1e-6)


def test_compile_single_graph_float_alpha_and_module():
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_f)(torch.randn(4, 7), 1.5, -1)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    module = EntmaxBisect(alpha=1.25, dim=0, n_iter=30)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    for shape in [(3, 5), (4, 11)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)


def test_module_and_entmax_names():
    m = EntmaxBisect(alpha=1.3, dim=1, n_iter=40)
    assert repr(m) == "EntmaxBisect(alpha=1.3, dim=1, n_iter=40)"
    assert "alpha=1.5, dim=-1, n_iter=50" in repr(EntmaxBisect())
    x = torch.randn(3, 4, 5)
    assert_bitwise_equal(m(x), entmax_bisect(x, 1.3, 1, 40), "module differs from function")
    assert "tensor of shape (3, 1, 5)" in repr(EntmaxBisect(torch.full((3, 1, 5), 1.5), dim=1))
    import flashmax as entmax  # the entmax package's names and keywords

    y = entmax.entmax_bisect(X=x, alpha=1.5, dim=-1, n_iter=50, ensure_sum_one=True)
    assert_bitwise_equal(y, entmax.EntmaxBisect(alpha=1.5, dim=-1, n_iter=50)(x), "names")


# ----------------------------------------------------------------------------------------------
# Against the entmax package (optional; the same properties are checked above on the oracle)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", ALPHAS)
def test_matches_entmax_package(alpha):
    entmax = pytest.importorskip("entmax")
    x = make_input((8, 300), -1, torch.float32, seed=18, scale=2.0)
    ref = entmax.entmax_bisect(x.double(), alpha, n_iter=200)
    y = entmax_bisect(x.to(DEVICE), alpha).cpu()
    assert relative_error(y, ref) <= 1e-5
    assert (y.double().sum(-1) - 1).abs().max() <= 1e-6
    a = torch.full((8, 1), alpha, dtype=torch.float64, requires_grad=True)
    xd = x.double().requires_grad_()
    g = torch.randn(8, 300, dtype=torch.float64)
    want = torch.autograd.grad(entmax.entmax_bisect(xd, a, n_iter=200), (xd, a), g)
    got = torch.autograd.grad(entmax_bisect(xd.to(DEVICE), a.to(DEVICE)), (xd, a), g.to(DEVICE))
    for w, o in zip(want, got):
        torch.testing.assert_close(o.cpu(), w, rtol=1e-9, atol=1e-10)


# ----------------------------------------------------------------------------------------------
# The Triton kernels directly, outputs poisoned first
# ----------------------------------------------------------------------------------------------

try:
    from flashmax.kernels import entmax_bisect as kernels
except ImportError:  # no Triton: the public tests above still run on the reference path
    kernels = None
needs_triton = pytest.mark.skipif(kernels is None, reason="Triton is not installed")


def kernel_forward(x, alpha, dim=-1, n_iter=50, ensure_sum_one=True, **config):
    alpha = torch.as_tensor(alpha, dtype=torch.float64, device=x.device)
    shape = list(x.shape)
    shape[dim] = 1
    out = torch.full(x.shape, POISON, dtype=x.dtype, device=x.device)
    y = kernels.entmax_bisect_forward(x, alpha.expand(shape), dim % x.dim(), n_iter,
                                      ensure_sum_one, out=out, **config)
    assert y is out
    assert not (y == POISON).any(), "some outputs were never written"
    return y


def make_rows(dist, rows, n, dtype=torch.float32, seed=0):
    kind, scale, offset = {"randn": ("randn", 1.0, 0.0), "tiny": ("randn", 1e-3, 0.0),
                           "huge": ("randn", 1e3, 0.0), "offset": ("randn", 1.0, 1e4),
                           "near_max": ("near_max", 0.0, 0.0), "ties": ("ties", 0.25, 0.0),
                           "masked": ("randn", 1.0, 0.0)}[dist]
    return make_input((rows, n), -1, dtype, seed, kind, scale, offset,
                      mask_p=0.5 if dist == "masked" else 0.0).to(DEVICE)


K_ROWS = 64 if ON_GPU else 5
K_WIDTHS = [1, 7, 100, 4096, 40000] if ON_GPU else [1, 7, 100]


@needs_triton
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dist", ["randn", "tiny", "huge", "offset", "near_max", "ties", "masked"])
def test_kernel_matches_oracle(dist, alpha):
    for n in K_WIDTHS:
        x = make_rows(dist, K_ROWS if n <= 4096 else 8, n, seed=n)  # the oracle runs on the CPU
        x0 = x.clone()
        y = kernel_forward(x, alpha)
        assert torch.equal(x, x0)
        check_against_oracle(y, x, alpha, -1, rtol=1e-5 if alpha > 2 else 1e-6)


@needs_triton
@pytest.mark.parametrize("alpha", [1.1, 1.5, 3.0])
@pytest.mark.parametrize("group", [4, 8])
def test_kernel_group_maxima_bound(alpha, group):
    """The first solve, on group maxima, must give the full rows a valid lower bound."""
    for seed, dist in enumerate(["randn", "near_max", "ties", "masked", "huge"]):
        x = make_rows(dist, K_ROWS, 100, seed=31 + seed)
        x[0, 1:] = -INF  # one entry: a single group holds the support
        check_against_oracle(kernel_forward(x, alpha, group=group), x, alpha, -1,
                             rtol=1e-5 if alpha > 2 else 1e-6)


@needs_triton
@pytest.mark.parametrize("alpha", [1.0001, 1.001, 1.01])
def test_kernel_alpha_near_1(alpha):
    """float32 d = z − τ is raised to k = 1/(α−1): its rounding must not grow with k."""
    x = make_rows("randn", K_ROWS, 300, seed=30)
    check_against_oracle(kernel_forward(x, alpha), x, alpha, -1, rtol=2e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_kernel_dtypes(dtype):
    for alpha in (1.25, 3.0):
        x = make_rows("randn", K_ROWS, 60, dtype, seed=19)
        check_against_oracle(kernel_forward(x, alpha), x, alpha, -1,
                             rtol=1e-12 if dtype == torch.float64 else None)


@needs_triton
@pytest.mark.parametrize("config", [{"chunk": 32}, {"chunk": 16, "num_warps": 1},
                                    {"block_m": 2, "group": 4}, {"num_warps": 1, "block_m": 1}],
                         ids=["streamed", "streamed-one-warp", "two-rows-groups", "one-row"])
def test_kernel_launch_paths(config):
    for alpha in (1.5, 3.0):
        x = make_rows("randn", 2 * K_ROWS + 1, 100, seed=20)
        x[0, 40:] = -INF  # whole chunks without support
        x[1, :60] -= 20
        check_against_oracle(kernel_forward(x, alpha, **config), x, alpha, -1, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("config", [{}, {"group": 8}, {"chunk": 16}],
                         ids=["in-registers", "groups", "streamed"])
def test_kernel_per_row_alpha_bad_rows_and_dims(config):
    x = make_rows("randn", 6, 40, seed=21)
    x[0, 3] = math.nan
    x[1, 5] = INF
    x[2] = -INF
    x[3, :30] = -INF
    alpha = torch.tensor([[1.5], [2.0], [1.2], [2.5], [1.0], [math.nan]], dtype=torch.float64)
    y = kernel_forward(x, alpha.to(DEVICE), **config).cpu()
    assert torch.isnan(y[:3]).all() and torch.isnan(y[4:]).all()  # α <= 1 or NaN: NaN rows
    assert (y[3, :30] == 0).all()
    check_against_oracle(y[3:4], x[3:4], 2.5, -1)
    for dim in (0, 1, 2):  # strided rows of a 3-D view, per-slice α
        x3 = make_rows("randn", 4, 5 * 6, seed=22 + dim).reshape(4, 5, 6)
        shape = [4, 5, 6]
        shape[dim] = 1
        a3 = torch.linspace(1.1, 3.0, math.prod(shape), dtype=torch.float64).reshape(shape)
        y3 = kernel_forward(x3, a3.to(DEVICE), dim, **config)
        check_against_oracle(y3, x3, a3, dim, rtol=1e-5)
    view = make_rows("randn", 8, 3 * 50, seed=25).reshape(8, 3, 50)[::2, 1, ::3]
    check_against_oracle(kernel_forward(view, 1.5, **config), view, 1.5, -1)


@needs_triton
@pytest.mark.parametrize("config", [{}, {"block_m": 4, "num_warps": 1},
                                    {"block_m": 4, "group": 4, "num_warps": 1}],
                         ids=["default", "four-rows", "four-rows-groups"])
def test_kernel_rows_do_not_depend_on_their_program(config):
    """Rows converge after different numbers of steps (α from near 1 to 4, ties, bad rows),
    and the loop runs until the last row of a program is done: the others must stay frozen.
    Permuting the rows regroups them into other programs and keeps the layout, so each row
    must come out bit for bit the same."""
    x = make_rows("ties", 16, 50, seed=32)
    x[::2] = make_rows("randn", 8, 50, seed=33)
    x[3, 7] = math.nan
    x[9] = -INF
    x[12, :45] = -INF
    alpha = torch.linspace(1.001, 4.0, 16, dtype=torch.float64).reshape(16, 1).to(DEVICE)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(34)).to(DEVICE)
    for n_iter in (3, 50):  # some rows stop at the bound, others converge
        y = kernel_forward(x, alpha, n_iter=n_iter, **config)
        permuted = kernel_forward(x[perm], alpha[perm], n_iter=n_iter, **config)
        assert_bitwise_equal(permuted, y[perm], f"a row depends on its program (n_iter={n_iter})")


@needs_triton
def test_kernel_n_iter_bounds_the_steps_and_ensure_sum_one():
    x = make_rows("randn", K_ROWS, 50, seed=23)
    y1 = kernel_forward(x, 1.5, n_iter=1).cpu()
    assert (y1.double().sum(-1) - 1).abs().max() <= 1e-6
    assert relative_error(y1, oracle(x.cpu(), 1.5)) > 1e-3
    y = kernel_forward(x, 1.5, ensure_sum_one=False)
    check_against_oracle(y, x, 1.5, -1, ensure_sum_one=False)
    assert torch.equal(kernel_forward(x, 1.5), kernel_forward(x.clone(), 1.5))


@needs_triton
@pytest.mark.parametrize("chunk", [None, 16], ids=["in-registers", "streamed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kernel_backward(dtype, chunk):
    x = make_rows("near_max", K_ROWS, 50, dtype, seed=24)  # large supports
    alpha = torch.linspace(1.2, 2.8, K_ROWS, dtype=torch.float64).reshape(K_ROWS, 1).to(DEVICE)
    y = kernel_forward(x, alpha)
    g = make_rows("randn", K_ROWS, 50, dtype, seed=26)
    out = torch.full(x.shape, POISON, dtype=dtype, device=x.device)
    dx, da = kernels.entmax_bisect_backward(y, g, alpha, 1, out=out, chunk=chunk)
    assert dx is out and not (dx == POISON).any(), "some gradients were never written"
    assert not torch.isnan(dx).any() and not torch.isnan(da).any()
    want_dx, want_da = expected_grads(y, g, alpha, 1)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    scale = want_dx.abs().max().item()
    assert torch.allclose(dx.cpu().double(), want_dx, rtol=0,
                          atol=max(tol, 4 * torch.finfo(dtype).eps) * scale)
    assert torch.allclose(da.cpu().flatten(), want_da, rtol=tol, atol=tol * want_da.abs().max())


@pytest.mark.skipif(not ON_GPU, reason="the public op runs the kernels on CUDA tensors only")
def test_eager_path_matches_custom_op_and_entmax_speed_shape():
    x = make_rows("randn", 2048, 4096, seed=27).requires_grad_()
    alpha = torch.full((2048, 1), 1.5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    y_fast = entmax_bisect(x, alpha)
    y_op = torch.ops.flashmax.entmax_bisect(x, alpha, 1, 50, True)
    assert torch.equal(y_fast, y_op)
    g = torch.randn_like(x)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y_fast, (x, alpha), g),
                                                 torch.autograd.grad(y_op, (x, alpha), g)))
    for a in ALPHAS:
        check_against_oracle(entmax_bisect(x[:256].detach(), a), x[:256].detach(), a, -1,
                             rtol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    x = make_rows("randn", 256, 4096, seed=28)
    alpha = torch.full((256, 1), 1.5, dtype=torch.float64, device=DEVICE)
    entmax_bisect(x, alpha)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = entmax_bisect(x, alpha)
        y_float = entmax_bisect(x, 3.0)  # a float α is a fill, not a host-to-device copy
    x.copy_(make_rows("tiny", 256, 4096, seed=29))
    alpha.fill_(1.25)
    graph.replay()
    torch.cuda.synchronize()
    check_against_oracle(y, x, 1.25, -1, rtol=1e-5)
    check_against_oracle(y_float, x, 3.0, -1, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Property tests (sparsemax's input strategy: shapes, dims, dtypes, scales, offsets, masks,
# layouts), with a drawn α per call or per slice
# ----------------------------------------------------------------------------------------------


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(inputs(), st.floats(1.05, 4.0), st.booleans(), st.integers(0, 2**32 - 1))
def test_property_matches_oracle(case, alpha, per_slice, seed):
    x, dim = case
    if per_slice:
        shape = list(x.shape)
        shape[dim] = 1
        g = torch.Generator().manual_seed(seed)
        alpha = 1.05 + 3 * torch.rand(shape, generator=g, dtype=torch.float64)
    x0 = x.clone()
    y = entmax_bisect(x.to(DEVICE), alpha, dim).cpu()
    assert_bitwise_equal(x, x0, "x was modified")
    assert not bool(torch.isnan(y).any()) and bool((y >= 0).all()) and bool((y <= 1).all())
    assert bool((y[x == -INF] == 0).all()), "-inf entries must be 0"
    # The oracle's float64 τ is itself only exact to an ulp: for α > 2 an entry at τ can get
    # (ulp)^(1/(α−1)), so compare on α <= 2.5 tightly and loosely above.
    tight = float(torch.as_tensor(alpha).max()) <= 2.5
    check_against_oracle(y, x, alpha, dim, rtol=None if tight else 1e-4)

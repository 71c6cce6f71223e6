"""The public contract of `flashmax.sparsemax` / `flashmax.Sparsemax` on CPU tensors.

Every CPU tensor runs the pure-torch reference path. The sections below follow the lines of the
contract in the README; the property tests at the end check accuracy on generated inputs. The
oracle (tests/oracle.py) is a textbook sort-based sparsemax in float64.
"""

import importlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashmax
from flashmax import Sparsemax, sparsemax
from flashmax import reference
from oracle import (ROW_JUST_ABOVE_TAU, ROWS_AT_TAU, assert_close_to_oracle, oracle, relative_error,
                    support_gradient)

HALF_DTYPES = [torch.float16, torch.bfloat16]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
INF = math.inf
# The public ops' tests run on the CPU; those that say so also on a GPU (FLASHMAX_TEST_DEVICE=cuda).
DEVICE = os.environ.get("FLASHMAX_TEST_DEVICE", "cpu")


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |values| (float32 tensor), never below the subnormal spacing."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(values.float().abs())
    spacing = torch.ldexp(torch.full(exponent.shape, info.eps), exponent - 1)
    return spacing.clamp_min(info.smallest_normal * info.eps)


# An fp32 computation of values in [0, 1] is off by a few 2^-24 in absolute terms; where the
# exact result is 0 or tiny (an entry on the threshold), that is many ulps of fp16/bf16 near 0.
FP32_ABS_ERROR = 4 * 2.0**-24


def assert_within_ulps(y: torch.Tensor, want: torch.Tensor, ulps: float, what: str = "") -> None:
    """y and want (same half dtype) agree to `ulps` units in the last place, NaNs in place.

    want is the exact result rounded to y's dtype; y may also be FP32_ABS_ERROR away from it
    (an fp32 result rounded once cannot be closer than its own fp32 error).
    """
    assert y.dtype == want.dtype and y.shape == want.shape
    assert torch.equal(torch.isnan(y), torch.isnan(want)), f"{what}: NaN positions differ"
    yf, wf = y.float().nan_to_num(0.0), want.float().nan_to_num(0.0)
    diff = (yf - wf).abs()
    allowed = ulps * ulp(torch.maximum(yf.abs(), wf.abs()), y.dtype) + FP32_ABS_ERROR
    excess = diff / allowed
    if bool((excess > 1).any()):
        worst = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int((excess > 1).sum())} element(s) differ by more than {ulps} ulp(s) of "
            f"{y.dtype}; worst element {worst}: got {yf.flatten()[worst].item()!r} want "
            f"{wf.flatten()[worst].item()!r} (difference {diff.flatten()[worst].item():.3g}, "
            f"allowed {allowed.flatten()[worst].item():.3g})"
        )


def check_against_oracle(y: torch.Tensor, x: torch.Tensor, dim: int, half_ulps: float = 2) -> None:
    """The accuracy contract: fp16/bf16 in fp32 then rounded; fp32 <= 1e-6; fp64 <= 1e-12."""
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    if x.dtype in HALF_DTYPES:
        want = oracle(x.float(), dim).to(x.dtype)
        assert_within_ulps(y, want, half_ulps, f"sparsemax({x.dtype})")
    else:
        assert_close_to_oracle(y, x, dim, RTOL[x.dtype])


def check_row_sums(y: torch.Tensor, dim: int) -> None:
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(y.dtype, 1e-2)
    sums = y.double().sum(dim)
    finite = ~torch.isnan(sums)
    err = (sums[finite] - 1).abs()
    if err.numel():
        assert float(err.max()) <= tol, f"row sums off by {float(err.max()):.3g} > {tol}"


def assert_equal_to_precision(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """a == b up to the rounding of a's dtype: 1 ulp (fp16/bf16), 1e-6 (fp32), 1e-12 (fp64)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype in HALF_DTYPES:
        assert_within_ulps(a, b, 1, what)
    else:
        err = relative_error(a, b.double())
        assert err <= RTOL[a.dtype], f"{what}: relative difference {err:.3g} > {RTOL[a.dtype]}"


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits (NaN counts as equal to NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}\n{m}")


def noncontiguous_copy(x: torch.Tensor, layout: str, axis: int = 0) -> torch.Tensor:
    """A non-contiguous tensor with x's values.

    "transposed": a transposed view of a contiguous buffer; "strided": every other element along
    `axis` of a NaN-filled buffer twice as long (reading between the elements would leak NaN).
    """
    if layout == "contiguous":
        return x.contiguous()
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    shape = list(x.shape)
    shape[axis] *= 2
    buf = torch.full(shape, math.nan, dtype=x.dtype)
    index = [slice(None)] * x.dim()
    index[axis] = slice(None, None, 2)
    buf[tuple(index)] = x
    return buf[tuple(index)]


def make_input(
    shape,
    dim: int,
    dtype: torch.dtype,
    seed: int,
    kind: str = "randn",
    scale: float = 1.0,
    offset: float = 0.0,
    mask_p: float = 0.0,
) -> torch.Tensor:
    """A contiguous tensor built from a seeded generator (values made in fp64, then cast).

    kind: "randn" (scale * N(0, 1)), "ties" (values from a small set, times scale), "near_max"
    (every entry within 0.9 of the slice max: scale + U[0, 0.9)), "spike" (one entry 0, the
    others in [-1, -1 + 2/n): tau near -1 with a large support). offset is added to everything.
    mask_p: probability of an entry being -inf; one entry per slice is always kept finite.
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        v = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    elif kind == "ties":
        choices = torch.tensor([-1.5, -1.0, -0.5, 0.25, 1.0, 2.0], dtype=torch.float64)
        v = choices[torch.randint(len(choices), shape, generator=g)] * scale
    elif kind == "near_max":
        v = scale + torch.rand(shape, generator=g, dtype=torch.float64) * 0.9
    elif kind == "spike":  # one entry per slice at 0, the rest just above -1: tau near -1, big support
        n = shape[dim]
        v = torch.rand(shape, generator=g, dtype=torch.float64) * (2.0 / n) - 1.0
        top = torch.randint(n, (*v.movedim(dim, -1).shape[:-1], 1), generator=g)
        v = v.movedim(dim, -1).scatter(-1, top, 0.0).movedim(-1, dim)
    else:
        raise ValueError(kind)
    x = (v + offset).to(dtype)
    if mask_p > 0 and x.numel():
        mask = torch.rand(shape, generator=g) < mask_p
        n = shape[dim]
        keep = torch.randint(n, (*mask.movedim(dim, -1).shape[:-1], 1), generator=g)
        mask = mask.movedim(dim, -1).scatter(-1, keep, False).movedim(-1, dim)
        x = x.masked_fill(mask, -INF)
    return x


# ----------------------------------------------------------------------------------------------
# Shape, dtype, device, fresh output, input untouched
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_shape_dtype_device_and_fresh_output(dtype, dim):
    x = make_input((3, 4, 5), dim, dtype, seed=1)
    x0 = x.clone()
    y = sparsemax(x, dim)
    assert y.shape == x.shape
    assert y.dtype == dtype
    assert y.device == x.device
    assert y.is_contiguous()
    assert y is not x
    assert y.data_ptr() != x.data_ptr()
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert_bitwise_equal(x, x0, "x was modified by sparsemax")
    y.fill_(7.0)  # writing to y must leave x alone
    assert_bitwise_equal(x, x0, "writing to y changed x")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "case", ["one_feature", "one_feature_rows", "already_simplex", "zero_d", "transposed", "strided"]
)
def test_output_never_aliases_input(dtype, case):
    """Inputs for which a lazy implementation could hand back x itself or a view of it."""
    if case == "one_feature":
        x = torch.ones(1, dtype=dtype)
    elif case == "one_feature_rows":
        x = torch.randn(6, 1).to(dtype)
    elif case == "already_simplex":  # sparsemax(e_1) == e_1
        x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=dtype)
    elif case == "zero_d":
        x = torch.tensor(1.0, dtype=dtype)
    elif case == "transposed":
        x = noncontiguous_copy(torch.randn(5, 6).to(dtype), "transposed")
    else:
        x = noncontiguous_copy(torch.randn(5, 6).to(dtype), "strided", axis=1)
    x0 = x.clone()
    for dim in range(-max(x.dim(), 1), max(x.dim(), 1)):
        y = sparsemax(x, dim)
        assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        y.fill_(-3.0)
        assert_bitwise_equal(x, x0, f"writing to y changed x (dim={dim})")


def test_input_never_modified_with_special_values():
    x = torch.tensor(
        [[1.0, -INF, 0.5, 2.0], [math.nan, 1.0, 2.0, 3.0], [-INF] * 4, [INF, 0.0, 1.0, -INF]]
    )
    for dtype in FLOAT_DTYPES:
        xd = x.to(dtype)
        x0 = xd.clone()
        for dim in (0, 1):
            sparsemax(xd, dim)
            assert_bitwise_equal(xd, x0, f"x modified ({dtype}, dim={dim})")


# ----------------------------------------------------------------------------------------------
# Precision: fp16/bf16 in fp32 rounded once, fp32 in fp32, fp64 in fp64
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("n", [5, 64, 333])
def test_half_dtypes_are_fp32_result_rounded_once(dtype, n):
    """Equal to oracle(x.float()).to(dtype), or 1 ulp away where fp32 lands near a tie.

    Computing in the half dtype itself (or rounding twice) makes far more than a few elements
    differ, so we also ask that almost all elements are bit-identical.
    """
    mismatches = total = 0
    for seed in range(4):
        for kind, scale in [("randn", 1.0), ("randn", 0.05), ("near_max", 0.0), ("ties", 0.3)]:
            x = make_input((16, n), -1, dtype, seed=seed, kind=kind, scale=scale)
            y = sparsemax(x)
            want = oracle(x.float()).to(dtype)
            assert_within_ulps(y, want, 1, f"{dtype} n={n} {kind}")
            mismatches += int((y != want).sum())
            total += y.numel()
    assert mismatches <= max(2, total // 200), f"{mismatches}/{total} elements not bit-identical"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_compute_dtype(dtype, monkeypatch):
    """The reference path receives fp32 for fp16/bf16/fp32 and fp64 for fp64, forward and back."""
    seen = []
    forward, backward = reference.sparsemax_forward, reference.sparsemax_backward

    def spy_forward(x):
        seen.append(("forward", x.dtype))
        return forward(x)

    def spy_backward(y, g):
        seen.append(("backward", y.dtype, g.dtype))
        return backward(y, g)

    monkeypatch.setattr(reference, "sparsemax_forward", spy_forward)
    monkeypatch.setattr(reference, "sparsemax_backward", spy_backward)
    x = torch.randn(4, 6).to(dtype).requires_grad_()
    y = sparsemax(x)
    y.backward(torch.randn(4, 6).to(dtype))
    want = torch.float64 if dtype == torch.float64 else torch.float32
    assert {call for call in seen} == {("forward", want), ("backward", want, want)}, seen
    assert y.dtype == dtype and x.grad.dtype == dtype


def test_fp32_accuracy_on_mixed_rows():
    """fp32 meets 1e-6 against the fp64 oracle on a broad mix of rows."""
    for seed in range(6):
        for kind, scale, offset in [
            ("randn", 1.0, 0.0),
            ("randn", 1e-3, 0.0),
            ("randn", 1e3, 0.0),
            ("near_max", 3.0, 0.0),
            ("ties", 0.2, 0.0),
            ("randn", 0.5, -7.0),
        ]:
            x = make_input((8, 257), -1, torch.float32, seed, kind, scale, offset)
            assert_close_to_oracle(sparsemax(x), x, -1, 1e-6)


def test_fp64_matches_oracle_to_1e_12():
    for seed in range(6):
        kinds = [("randn", 1.0), ("randn", 1e-3), ("randn", 1e3), ("near_max", 0.0), ("ties", 0.1)]
        for kind, scale in kinds:
            for n in (1, 7, 9, 200):
                x = make_input((5, n), -1, torch.float64, seed, kind, scale)
                y = sparsemax(x)
                assert_close_to_oracle(y, x, -1, 1e-12)
                check_row_sums(y, -1)


@pytest.mark.parametrize("offset", [1.0, 100.0, 1e4, -1e4])
@pytest.mark.parametrize("n", [6, 100])
def test_max_shifted_coordinates(offset, n):
    """x + offset (|offset| <= 1e4) gives the same result as x to fp32 precision.

    The fp32 inputs are exact in both forms (multiples of 2^-8 with small magnitude), so the
    fp64 oracle's answer is the same for x and x + offset; a kernel that subtracts tau in raw
    coordinates loses ~|offset| * 2^-24 absolute and fails the 1e-6 bound.
    """
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-256, 256, (10, n), generator=g).float() / 256  # exact under + offset
    shifted = x + offset
    assert torch.equal(shifted - offset, x)
    ref = oracle(x)
    y, y_shifted = sparsemax(x), sparsemax(shifted)
    assert relative_error(y, ref) <= 1e-6
    assert relative_error(y_shifted, ref) <= 1e-6, relative_error(y_shifted, ref)
    assert_close_to_oracle(y_shifted, shifted, -1, 1e-6)


# ----------------------------------------------------------------------------------------------
# -inf, NaN, +inf
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [2, 9, 40, 300])
def test_neg_inf_entries_are_zero_and_take_no_part(dtype, n):
    g = torch.Generator().manual_seed(n)
    for trial in range(10):
        x = (torch.randn(n, generator=g) * 2).to(dtype)
        mask = torch.rand(n, generator=g) < (0.2 + 0.07 * trial)
        mask[int(torch.randint(n, (1,), generator=g))] = False
        xm = x.masked_fill(mask, -INF)
        y = sparsemax(xm)
        assert bool((y[mask] == 0).all()), "-inf entries must get exactly 0"
        assert not bool(torch.signbit(y[mask]).any()), "-inf entries must get +0"
        alone = sparsemax(x[~mask])
        # Equal to the precision of the dtype, not bitwise: the sums run in a different order
        # once the -inf entries are gone (see the report on this test file).
        assert_equal_to_precision(y[~mask], alone, f"-inf entries changed the rest ({dtype}, n={n})")
        assert torch.equal(y[~mask] > 0, alone > 0), "-inf entries changed the support"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_bad_slices_are_nan_and_others_unaffected(dtype, dim):
    """All -inf, or holding NaN or +inf: all-NaN slice; others bitwise equal to computed alone."""
    shape = (5, 6, 7)
    x = make_input(shape, dim, dtype, seed=dim, scale=2.0, mask_p=0.3)
    rows = x.movedim(dim, -1).clone()  # (a, b, n)
    rows[0, 0] = -INF
    rows[1, 2, 3] = math.nan
    rows[2, 1, 0] = INF
    rows[3, 3, -1] = INF
    rows[3, 3, 0] = -INF
    rows[4, 5, 1] = math.nan
    rows[4, 5, 2] = INF
    bad = torch.zeros(rows.shape[:-1], dtype=torch.bool)
    for idx in [(0, 0), (1, 2), (2, 1), (3, 3), (4, 5)]:
        bad[idx] = True
    x = rows.movedim(-1, dim)
    y_rows = sparsemax(x, dim).movedim(dim, -1)
    assert bool(torch.isnan(y_rows[bad]).all()), "bad slices must be all NaN"
    good = y_rows[~bad]
    assert not bool(torch.isnan(good).any()), "NaN leaked into good slices"
    alone = sparsemax(rows[~bad], -1)  # the good slices, without the bad ones
    assert_bitwise_equal(good, alone, "good slices changed by bad ones in the batch")
    for r in range(0, good.shape[0], 7):
        assert_bitwise_equal(good[r], sparsemax(rows[~bad][r]), f"slice {r} alone")
    check_against_oracle(y_rows.movedim(-1, dim), x, dim)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "row", [[-INF], [-INF, -INF, -INF], [math.nan], [INF], [1.0, math.nan], [INF, INF], [INF, -INF, 0.0]]
)
def test_bad_single_slices(dtype, row):
    y = sparsemax(torch.tensor(row, dtype=dtype))
    assert y.dtype == dtype and bool(torch.isnan(y).all())


# ----------------------------------------------------------------------------------------------
# Degenerate shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "shape,dim",
    [((0, 5), 0), ((0, 5), 1), ((5, 0), 0), ((5, 0), 1), ((0,), 0), ((2, 0, 3), 1), ((2, 0, 3), 2)],
)
def test_empty(dtype, shape, dim):
    x = torch.empty(shape, dtype=dtype, requires_grad=True)
    y = sparsemax(x, dim)
    assert y.shape == x.shape and y.dtype == dtype and y.numel() == 0
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("value", [0.0, -3.5, 1e4, -1e4])
def test_one_feature_is_one(dtype, value):
    x = torch.full((4, 1, 3), value, dtype=dtype)
    y = sparsemax(x, 1)
    assert y.dtype == dtype
    assert bool((y == 1).all())
    assert bool((sparsemax(torch.tensor([value], dtype=dtype)) == 1).all())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dim", [0, -1])
def test_zero_d(dtype, dim):
    x = torch.tensor(-2.5, dtype=dtype, requires_grad=True)
    y = sparsemax(x, dim)
    assert y.shape == () and y.dtype == dtype
    assert y.item() == 1.0
    y.backward()
    assert x.grad.item() == 0.0
    assert Sparsemax(dim)(x).item() == 1.0


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
    + [torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2],
)
def test_unsupported_dtype_is_type_error(dtype):
    x = torch.ones(3, 4, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        sparsemax(x)
    with pytest.raises(TypeError, match=str(dtype).replace(".", r"\.")):
        Sparsemax(0)(x)


@pytest.mark.parametrize(
    "shape,dim", [((3, 4), 2), ((3, 4), -3), ((5,), 1), ((5,), -2), ((), 1), ((), -2), ((2, 3, 4), 3)]
)
def test_dim_out_of_range_is_index_error(shape, dim):
    with pytest.raises(IndexError):
        sparsemax(torch.randn(shape), dim)


@pytest.mark.parametrize("dim", [1.0, "1", None, torch.tensor([1, 0])])
def test_dim_not_an_int_is_type_error(dim):
    x = torch.randn(3, 4)
    for call in (sparsemax, flashmax.entmax15, flashmax.entmax_bisect):
        with pytest.raises(TypeError, match="dim must be an int"):
            call(x, dim=dim)


def test_dim_as_an_integer_tensor_is_that_int():
    x = torch.randn(3, 4)
    torch.testing.assert_close(sparsemax(x, torch.tensor(0)), sparsemax(x, 0), rtol=0, atol=0)


@pytest.mark.parametrize("shape,dim", [((3, 4), 1), ((3, 4), -2), ((5,), 0), ((5,), -1), ((2, 3, 4), -3)])
def test_dim_in_range_is_fine(shape, dim):
    x = torch.randn(shape)
    assert_close_to_oracle(sparsemax(x, dim), x, dim, 1e-6)


# ----------------------------------------------------------------------------------------------
# Determinism
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_deterministic(dtype):
    x = make_input((33, 517), -1, dtype, seed=3, scale=0.2, mask_p=0.1)
    x[0, :] = x[0, 0]  # a row of ties
    x[1, 5] = math.nan
    first = sparsemax(x)
    for _ in range(3):
        assert_bitwise_equal(sparsemax(x), first, "not deterministic")
        assert_bitwise_equal(sparsemax(x.clone()), first, "not deterministic (a copy of x)")
    xg = x[2:].clone().requires_grad_()
    g = torch.randn(xg.shape).to(dtype)
    sparsemax(xg).backward(g)
    grad1 = xg.grad.clone()
    xg.grad = None
    sparsemax(xg).backward(g)
    assert_bitwise_equal(xg.grad, grad1, "backward not deterministic")


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def expected_grad(y: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """dx = s * (g - mean of g over s), s = (y > 0), in fp64 by hand (a loop over slices)."""
    y_rows = y.double().movedim(dim, -1).reshape(-1, y.shape[dim])
    g_rows = g.double().movedim(dim, -1).reshape(-1, y.shape[dim])
    out = torch.zeros_like(g_rows)
    for r in range(y_rows.shape[0]):
        s = y_rows[r] > 0
        mean = g_rows[r][s].sum() / s.sum()
        out[r][s] = g_rows[r][s] - mean
    moved = y.movedim(dim, -1).shape
    return out.reshape(moved).movedim(-1, dim)


def check_grad(dx: torch.Tensor, ref: torch.Tensor, g: torch.Tensor, what: str) -> None:
    assert dx.dtype == g.dtype and dx.shape == ref.shape
    gmax = float(g.double().abs().max())
    if dx.dtype == torch.float64:
        torch.testing.assert_close(dx, ref, rtol=0, atol=1e-12 * gmax, msg=lambda m: f"{what}\n{m}")
    elif dx.dtype == torch.float32:
        torch.testing.assert_close(dx.double(), ref, rtol=0, atol=1e-6 * gmax, msg=lambda m: f"{what}\n{m}")
    else:
        # fp32 arithmetic (error ~ 2^-24 * |g|) rounded once to the half dtype.
        allowed = ulp(ref, dx.dtype).double() + 4 * 2.0**-24 * gmax
        diff = (dx.double() - ref).abs()
        worst = int((diff / allowed).argmax())
        assert bool((diff <= allowed).all()), (
            f"{what}: element {worst} got {dx.flatten()[worst].item()} want {ref.flatten()[worst].item()}"
        )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_backward_formula(dtype, dim, layout):
    x = make_input((6, 7, 9), dim, dtype, seed=10 + dim, scale=0.7)
    x = noncontiguous_copy(x, layout, axis=dim).requires_grad_()
    g = make_input((6, 7, 9), dim, dtype, seed=99)
    y = sparsemax(x, dim)
    assert int((y > 0).sum()) > x.numel() // 63, "the test needs non-trivial supports"
    (dx,) = torch.autograd.grad(y, x, g)
    check_grad(dx, expected_grad(y.detach(), g, dim), g, f"backward {dtype} dim={dim} {layout}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_entries_at_tau_are_outside_the_support(dtype):
    # An entry exactly at tau has y = 0, so the gradient leaves it out, as exact arithmetic does.
    x = torch.tensor(ROWS_AT_TAU, dtype=dtype, requires_grad=True)
    y = sparsemax(x)
    assert torch.equal(y > 0, oracle(x.detach()) > 0)
    g = make_input(tuple(x.shape), -1, dtype, seed=98)
    (dx,) = torch.autograd.grad(y, x, g)
    want = support_gradient(x.detach(), g)
    atol = {torch.float16: 1e-2, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
    assert torch.allclose(dx.double(), want, rtol=0, atol=atol)


def test_an_entry_just_above_tau_stays_in_the_support():
    # Its exact output, 2^-24, lies within the fp32 tie rule of tau: the row is computed again
    # in fp64, where a tie and an output that small come apart (NOTES v22).
    x = torch.tensor([ROW_JUST_ABOVE_TAU], requires_grad=True)
    y = sparsemax(x)
    assert y[0, 6].item() == 2.0**-24, y
    g = make_input((1, 8), -1, torch.float32, seed=97)
    (dx,) = torch.autograd.grad(y, x, g)
    assert torch.allclose(dx.double(), support_gradient(x.detach(), g), rtol=0, atol=1e-6)


def test_backward_with_broadcast_grad():
    """y.sum().backward() hands in an expanded (stride 0) gradient: dx must be exactly 0."""
    x = torch.randn(5, 8, requires_grad=True)
    sparsemax(x, 1).sum().backward()
    assert bool((x.grad == 0).all())
    x.grad = None
    weights = torch.arange(8.0)
    (sparsemax(x, 0) * weights).sum().backward()  # grad: weights expanded over dim 0
    want = expected_grad(sparsemax(x, 0).detach(), weights.expand(5, 8), 0)
    check_grad(x.grad, want, weights, "broadcast grad")


def test_backward_leaves_inputs_alone():
    x = torch.randn(4, 9, requires_grad=True)
    g = torch.randn(4, 9)
    g0 = g.clone()
    y = sparsemax(x)
    y0 = y.detach().clone()
    y.backward(g)
    assert_bitwise_equal(g, g0, "backward modified the incoming gradient")
    assert_bitwise_equal(y.detach(), y0, "backward modified the saved output")


def separated_input(shape, seed: int) -> torch.Tensor:
    """fp64 values spaced >= 2/numel apart (a scaled permutation plus small jitter): no ties."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    perm = torch.randperm(n, generator=g).double()
    jitter = torch.rand(n, generator=g, dtype=torch.float64) * 0.5
    return ((perm + jitter) * (3.0 / n)).reshape(shape)


def distance_to_kink(x: torch.Tensor, dim: int) -> float:
    """min over entries of |x_i - tau| for each slice: how far the input is from a kink."""
    y = oracle(x, dim)
    on = y > 0
    tau = torch.where(on, x - y, 0).sum(dim, keepdim=True) / on.sum(dim, keepdim=True)
    return float((x - tau).abs().min())


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_gradcheck_fp64(dim):
    x = separated_input((3, 4, 5), seed=dim % 3).requires_grad_()
    assert distance_to_kink(x.detach(), dim) > 1e-4
    y = sparsemax(x, dim)
    assert bool(((y > 0).sum(dim) > 1).any()), "want slices with more than one support entry"
    assert torch.autograd.gradcheck(lambda t: sparsemax(t, dim), (x,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_fp64_module_noncontiguous():
    x = separated_input((5, 4), seed=7).t().requires_grad_()
    assert torch.autograd.gradcheck(Sparsemax(dim=1), (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dim", [0, 2])
def test_gradgradcheck_fp64(dim):
    x = separated_input((3, 4, 5), seed=dim + 3).requires_grad_()
    assert distance_to_kink(x.detach(), dim) > 1e-4
    assert torch.autograd.gradgradcheck(lambda t: sparsemax(t, dim), (x,), eps=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# Custom-op registration
# ----------------------------------------------------------------------------------------------


def _opcheck_inputs():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 6, 10, generator=g)
    return [
        ("fp32", base, 2),
        ("fp32-dim0", base, 0),
        ("fp32-transposed", base.transpose(0, 2), 1),
        ("fp32-strided", base[:, ::2, 1::3], -1),
        ("fp64", base.double(), 1),
        ("fp16", base.half(), -1),
        ("bf16", base.bfloat16()[..., ::2], 0),
        ("fp32-1feature", base[..., :1], 2),
    ]


@pytest.mark.parametrize("name,x,dim", _opcheck_inputs(), ids=[c[0] for c in _opcheck_inputs()])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_forward(name, x, dim, requires_grad):
    if requires_grad:
        x = x.detach().requires_grad_()
    torch.library.opcheck(torch.ops.flashmax.sparsemax.default, (x, dim))


@pytest.mark.parametrize("name,x,dim", _opcheck_inputs(), ids=[c[0] for c in _opcheck_inputs()])
def test_opcheck_backward(name, x, dim):
    y = sparsemax(x, dim)
    grad = torch.randn(x.shape).to(x.dtype)
    op = torch.ops.flashmax.sparsemax_backward.default
    torch.library.opcheck(op, (y, grad, dim))
    transposed_dim = dim if dim in (2, -1) else 1 - dim  # dims 0 and 1 swap places
    torch.library.opcheck(op, (y.transpose(0, 1), grad.transpose(0, 1), transposed_dim))


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def _f(x, dim):
    return sparsemax(x * 2, dim) + 1


def test_compile_inductor_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    x = torch.randn(6, 9, 5, dtype=torch.float32)
    g = torch.randn(6, 9, 5)
    compiled = torch.compile(_f, fullgraph=True)
    for dim in (1,):
        xe = x.clone().requires_grad_()
        xc = x.clone().requires_grad_()
        ye, yc = _f(xe, dim), compiled(xc, dim)
        torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-7)
        ye.backward(g)
        yc.backward(g)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dim", [0, -1])
def test_compile_single_graph_with_opaque_op(dim):
    """Dynamo puts the custom op itself in one graph (no break, not traced through)."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(_f, backend=backend, fullgraph=True)
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    y = compiled(x, dim)
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert torch.ops.flashmax.sparsemax.default in targets
    torch.testing.assert_close(y, _f(x, dim), rtol=0, atol=0)
    g = torch.randn(4, 7, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx_eager,) = torch.autograd.grad(_f(x, dim), x, g)
    torch.testing.assert_close(dx, dx_eager, rtol=0, atol=0)
    explanation = torch._dynamo.explain(_f)(x, dim)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compile_dynamic_shapes_and_module():
    torch._dynamo.reset()
    module = Sparsemax(dim=1)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    for shape in [(3, 5), (4, 11), (2, 1)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), module(x), rtol=0, atol=0)


class _EveryOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sparsemax, self.entmax15 = Sparsemax(dim=-1), flashmax.Entmax15(dim=0)
        self.bisect = flashmax.EntmaxBisect(alpha=1.7, dim=-1)

    def forward(self, x, target):
        return (self.sparsemax(x), self.entmax15(x), self.bisect(x),
                flashmax.sparsemax_loss(x, target), flashmax.entmax15_loss(x, target))


def test_export_with_a_dynamic_batch_keeps_every_op():
    """torch.export keeps each op as one custom op node (their fake implementations give the
    shapes) and the exported program equals eager at another batch size."""
    batch = torch.export.Dim("batch", min=2)
    x, target = torch.randn(6, 9), torch.randint(0, 9, (6,))
    exported = torch.export.export(_EveryOp(), (x, target), dynamic_shapes=({0: batch}, {0: batch}))
    names = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {f"flashmax.{op}.default" for op in (
        "sparsemax", "entmax15", "entmax_bisect", "sparse_loss")} <= names
    x, target = torch.randn(11, 9), torch.randint(0, 9, (11,))
    for got, want in zip(exported.module()(x, target), _EveryOp()(x, target), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# torch.func.vmap (on DEVICE)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "entmax_bisect"])
@pytest.mark.parametrize("in_dim,dim", [(0, -1), (1, 0), (2, 1)])
def test_vmap_matches_the_op_on_each_slice(name, in_dim, dim):
    """vmap over any dim, forward and backward, equals the op on each slice, stacked."""
    op = getattr(flashmax, name)
    x = make_input((5, 4, 30), 2, torch.float32, seed=40 + in_dim, scale=0.5).to(DEVICE)
    x.requires_grad_()
    y = torch.func.vmap(lambda t: op(t, dim=dim), in_dims=in_dim)(x)
    want = torch.stack([op(t, dim=dim) for t in x.unbind(in_dim)])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)
    g = make_input(y.shape, -1, torch.float32, seed=50).to(DEVICE)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx_want,) = torch.autograd.grad(want, x, g)
    # One launch over the batch and one a slice may sum in different orders: the backward's
    # contract (1e-6 of |g|'s max), not bit equality. On the H100 entmax_bisect's differed by
    # 1.5e-7 on one entry of 600.
    torch.testing.assert_close(dx, dx_want, rtol=0, atol=1e-6 * float(g.abs().max()))


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "entmax_bisect"])
def test_nested_vmap(name):
    op = getattr(flashmax, name)
    x = make_input((3, 4, 5, 6), -1, torch.float32, seed=44).to(DEVICE)
    y = torch.func.vmap(torch.func.vmap(op, in_dims=1), in_dims=2)(x)
    want = torch.stack([torch.stack([op(x[:, j, i]) for j in range(4)]) for i in range(5)])
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)


def test_vmap_of_alpha_per_sample():
    """entmax_bisect under vmap with α batched alongside x: values and both gradients."""
    x = make_input((3, 4, 20), -1, torch.float32, seed=60).to(DEVICE).requires_grad_()
    alpha = (1.2 + torch.rand(3, 4, 1, generator=torch.Generator().manual_seed(61))).to(DEVICE)
    alpha.requires_grad_()
    y = torch.func.vmap(flashmax.entmax_bisect)(x, alpha)
    want = flashmax.entmax_bisect(x, alpha)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)
    g = make_input(y.shape, -1, torch.float32, seed=62).to(DEVICE)
    for got, expected in zip(torch.autograd.grad(y, (x, alpha), g),
                             torch.autograd.grad(want, (x, alpha), g)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["sparsemax", "entmax15", "entmax_bisect"])
def test_vectorized_jacobian(name):
    """Batched gradients (autograd's own vmap): jacobian(vectorize=True) equals the row by row
    one (on a GPU through the eager autograd.Functions' backward)."""
    op = getattr(flashmax, name)
    x = make_input((3, 12), -1, torch.float32, seed=64, scale=0.3).to(DEVICE)
    fast = torch.autograd.functional.jacobian(op, x, vectorize=True)
    slow = torch.autograd.functional.jacobian(op, x)
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(importlib.import_module("flashmax.sparsemax").kernels is None,
                    reason="the eager autograd.Functions wrap the Triton launchers")
@pytest.mark.parametrize("module,function,extra", [
    ("flashmax.sparsemax", "_EagerSparsemax", ()),
    ("flashmax.entmax", "_EagerEntmax15", ()),
    ("flashmax.entmax_bisect", "_EagerEntmaxBisect", (50, True)),
])
def test_eager_functions_take_batched_gradients(module, function, extra):
    """The eager CUDA path's autograd.Functions (called here on DEVICE, the Triton interpreter
    on the CPU) send batched gradients (autograd's legacy vmap, storage-less tensors) to the
    backward custom op, whose dispatch serves them, not to the launchers."""
    apply = getattr(importlib.import_module(module), function).apply
    x = make_input((3, 40), -1, torch.float32, seed=65).to(DEVICE).requires_grad_()
    alpha = (torch.full((3, 1), 1.5, dtype=torch.float64, device=DEVICE),) if extra else ()
    y = apply(x, *alpha, 1, *extra)
    v = make_input((5, 3, 40), -1, torch.float32, seed=66).to(DEVICE)
    (batched,) = torch.autograd.grad(y, x, v, is_grads_batched=True, retain_graph=True)
    one_by_one = torch.stack([torch.autograd.grad(y, x, vi, retain_graph=True)[0] for vi in v])
    torch.testing.assert_close(batched, one_by_one, rtol=1e-5, atol=1e-6)


def test_fake_cuda_tensors_take_the_custom_ops():
    """Tensors without data (FakeTensorMode's, as tracing and memory planning make them) on a
    CUDA device get the custom ops' fake results, not the kernels' launchers, with or without
    a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda")
        alpha = torch.full((4, 1), 1.5, device="cuda")
        target = torch.zeros(4, dtype=torch.long, device="cuda")
        for y in (sparsemax(x), flashmax.entmax15(x), flashmax.entmax_bisect(x),
                  flashmax.entmax_bisect(x, alpha), flashmax.sparsemax_loss(x, target)):
            assert y.device.type == "cuda" and y.shape[0] == 4


def test_vmap_is_one_call_for_the_batch(monkeypatch):
    """The ops' vmap rule runs one call over the batch, not torch's fallback of one a sample
    (the pure-torch path's on the CPU, the kernels' on a GPU)."""
    module = importlib.import_module("flashmax.sparsemax")
    calls = []
    targets = [(module.reference, "sparsemax_forward")]
    if module.kernels is not None:
        targets.append((module.kernels, "sparsemax_forward"))

    def counted(original):
        def call(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)
        return call

    for owner, attribute in targets:
        monkeypatch.setattr(owner, attribute, counted(getattr(owner, attribute)))
    x = make_input((6, 3, 10), -1, torch.float32, seed=63).to(DEVICE)
    y = torch.func.vmap(sparsemax)(x)
    assert len(calls) == 1
    assert_close_to_oracle(y.cpu(), x.cpu(), -1, 1e-6)


# ----------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------


def test_module():
    m = Sparsemax(dim=1)
    assert "dim=1" in repr(m)
    assert isinstance(m, torch.nn.Module)
    assert list(m.parameters()) == []
    x = torch.randn(3, 4, 5)
    assert_bitwise_equal(m(x), sparsemax(x, 1), "module differs from function")
    assert_close_to_oracle(m(x), x, 1, 1e-6)
    assert "dim=-1" in repr(Sparsemax())
    assert_bitwise_equal(Sparsemax()(x), sparsemax(x, -1), "default dim")
    assert flashmax.Sparsemax is Sparsemax and flashmax.sparsemax is sparsemax


def test_default_dim_is_last():
    x = torch.randn(3, 4, 5)
    assert_bitwise_equal(sparsemax(x), sparsemax(x, 2), "default dim is not -1")


# ----------------------------------------------------------------------------------------------
# Property tests
# ----------------------------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def inputs(draw, max_dims=3, max_size=9, big_last=False):
    """(x, dim): x built from a drawn seed and drawn parameters, never all zero."""
    ndim = draw(st.integers(1, max_dims))
    shape = [draw(st.integers(1, max_size)) for _ in range(ndim)]
    dim = draw(st.integers(-ndim, ndim - 1))
    if big_last:
        shape[dim] = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    kind = draw(st.sampled_from(["randn", "ties", "near_max", "spike"]))
    scale = 10.0 ** draw(st.integers(-3, 3))
    offset = draw(st.sampled_from([0.0, 0.0, 1.0, -3.0, 100.0, 1e4, -1e4]))
    mask_p = draw(st.sampled_from([0.0, 0.0, 0.3, 0.8]))
    layout = draw(st.sampled_from(["contiguous", "contiguous", "transposed", "strided"]))
    axis = draw(st.integers(0, ndim - 1))
    seed = draw(st.integers(0, 2**32 - 1))
    x = make_input(tuple(shape), dim, dtype, seed, kind, scale, offset, mask_p)
    if not bool((x != 0).any()):
        x = x + 1  # never all zero
    return noncontiguous_copy(x, layout, axis), dim


def check_property(x: torch.Tensor, dim: int) -> None:
    x0 = x.clone()
    y = sparsemax(x, dim)
    assert_bitwise_equal(x, x0, "x was modified")
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert not bool(torch.isnan(y).any()), "NaN although every slice has a finite entry"
    assert bool((y >= 0).all()) and bool((y <= 1).all())
    assert bool((y[x == -INF] == 0).all()), "-inf entries must be 0"
    check_against_oracle(y, x, dim)
    check_row_sums(y, dim)


@PROPERTY_SETTINGS
@given(inputs())
def test_property_matches_oracle(case):
    check_property(*case)


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(inputs(max_dims=2, max_size=4, big_last=True))
def test_property_matches_oracle_long_slices(case):
    check_property(*case)


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(inputs(max_dims=3, max_size=6), st.integers(0, 2**32 - 1))
def test_property_backward(case, gseed):
    x, dim = case
    x = x.detach().requires_grad_()
    y = sparsemax(x, dim)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(gseed)).to(x.dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    check_grad(dx, expected_grad(y.detach(), g, dim), g, "property backward")


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(inputs(max_dims=2, max_size=9, big_last=True), st.integers(0, 2**32 - 1))
def test_property_neg_inf_removal(case, seed):
    """A slice with some entries set to -inf equals sparsemax of the slice without them."""
    x, dim = case
    row = x.movedim(dim, -1).reshape(-1, x.shape[dim])[0]
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(row.shape, generator=g) < 0.5
    mask[int(torch.argmax(row.float()))] = False
    y = sparsemax(row.masked_fill(mask, -INF))
    assert bool((y[mask] == 0).all())
    assert_equal_to_precision(y[~mask], sparsemax(row[~mask]), "-inf entries took part")


@settings(PROPERTY_SETTINGS, max_examples=60)
@given(inputs(max_dims=3, max_size=6), st.integers(0, 2**32 - 1))
def test_property_bad_slices(case, seed):
    """Poisoned slices are all NaN; the rest are bitwise what they are without the poison."""
    x, dim = case
    moved_shape = x.movedim(dim, -1).shape
    flat = x.movedim(dim, -1).reshape(-1, x.shape[dim]).clone()
    g = torch.Generator().manual_seed(seed)
    bad = torch.rand(flat.shape[0], generator=g) < 0.4
    poison = torch.randint(3, (flat.shape[0],), generator=g)
    pos = torch.randint(flat.shape[1], (flat.shape[0],), generator=g)
    for r in bad.nonzero().flatten().tolist():
        if poison[r] == 0:
            flat[r] = -INF
        else:
            flat[r, pos[r]] = math.nan if poison[r] == 1 else INF
    poisoned = flat.reshape(moved_shape).movedim(-1, dim)
    y_rows = sparsemax(poisoned, dim).movedim(dim, -1).reshape(flat.shape)
    assert bool(torch.isnan(y_rows[bad]).all())
    assert not bool(torch.isnan(y_rows[~bad]).any())
    if bool((~bad).any()):
        assert_bitwise_equal(y_rows[~bad], sparsemax(flat[~bad]), "good slices affected")

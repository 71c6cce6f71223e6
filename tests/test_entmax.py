"""`flashmax.entmax15` / `flashmax.Entmax15`: the reference path's contract and accuracy on CPU
tensors, the custom ops (autograd, opcheck, compile), and the Triton kernels under the
interpreter (or compiled, with FLASHMAX_TEST_DEVICE=cuda). The oracle is the sort-based
entmax-1.5 in float64 (tests/oracle.py); the entmax package, when installed, is a second one.
"""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashmax
from flashmax import Entmax15, entmax15
from flashmax import reference_entmax as reference
from oracle import assert_close_to_oracle, entmax15_oracle, relative_error
from test_sparsemax import (FLOAT_DTYPES, HALF_DTYPES, assert_bitwise_equal, assert_within_ulps,
                            make_input, noncontiguous_copy)

INF = math.inf
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
DEVICE = os.environ.get("FLASHMAX_TEST_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"


def check_against_oracle(y: torch.Tensor, x: torch.Tensor, dim: int) -> None:
    """fp16/bf16: the fp32 result rounded once (2 ulps); fp32 <= 1e-6; fp64 <= 1e-12."""
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    if x.dtype in HALF_DTYPES:
        want = entmax15_oracle(x.float().cpu(), dim).to(x.dtype)
        assert_within_ulps(y.cpu(), want, 2, f"entmax15({x.dtype})")
    else:
        assert_close_to_oracle(y.cpu(), x.cpu(), dim, RTOL[x.dtype], entmax15_oracle)


def check_sums_to_one(y: torch.Tensor, dim: int) -> None:
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(y.dtype, 1e-2)
    sums = y.double().sum(dim)
    finite = ~torch.isnan(sums)
    err = (sums[finite] - 1).abs()
    assert not err.numel() or float(err.max()) <= tol, f"sums off by {float(err.max()):.3g}"


# ----------------------------------------------------------------------------------------------
# The oracle itself: KKT conditions, and the entmax package when installed
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,scale", [("randn", 1.0), ("randn", 1e-3), ("near_max", 0.0), ("ties", 0.5)])
def test_oracle_satisfies_kkt(kind, scale):
    """y = max(z - tau, 0)^2 with one tau per row, sum 1, and every zero entry at or below tau."""
    x = make_input((20, 50), -1, torch.float64, seed=1, kind=kind, scale=scale)
    y = entmax15_oracle(x)
    z = (x - x.amax(-1, keepdim=True)) / 2
    support = y > 0
    tau_each = torch.where(support, z - y.sqrt(), torch.nan)
    tau = tau_each.nanmean(-1, keepdim=True)
    assert float((torch.where(support, tau_each - tau, 0)).abs().max()) < 1e-12
    assert bool((z[~support] <= (tau.expand_as(z))[~support] + 1e-12).all())
    check_sums_to_one(y, -1)


def test_oracle_matches_entmax_package():
    entmax = pytest.importorskip("entmax")
    for seed, (kind, scale) in enumerate([("randn", 1.0), ("randn", 30.0), ("near_max", 0.0)]):
        x = make_input((30, 70), -1, torch.float64, seed=seed, kind=kind, scale=scale)
        for dim in (0, 1):
            torch.testing.assert_close(entmax15_oracle(x, dim), entmax.entmax15(x, dim=dim),
                                       rtol=0, atol=1e-13)


def test_matches_entmax_package_and_oracle():
    """The same values as entmax.entmax15 (and the fp64 oracle, which CI always has)."""
    x = make_input((40, 123), -1, torch.float32, seed=2, scale=2.0)
    y = entmax15(x)
    check_against_oracle(y, x, -1)
    entmax = pytest.importorskip("entmax")
    assert relative_error(y, entmax.entmax15(x.double())) <= 1e-6


# ----------------------------------------------------------------------------------------------
# Accuracy
# ----------------------------------------------------------------------------------------------

KINDS = [("randn", 1.0, 0.0), ("randn", 1e-3, 0.0), ("randn", 1e3, 0.0), ("randn", 1.0, 1e4),
         ("near_max", 0.0, 0.0), ("ties", 0.3, 0.0), ("spike", 1.0, 0.0)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind,scale,offset", KINDS)
@pytest.mark.parametrize("n", [1, 2, 9, 300])
def test_matches_oracle(dtype, kind, scale, offset, n):
    x = make_input((12, n), -1, dtype, seed=n, kind=kind, scale=scale, offset=offset)
    y = entmax15(x)
    check_against_oracle(y, x, -1)
    check_sums_to_one(y, -1)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_every_dim_and_layout(dim, layout):
    x = noncontiguous_copy(make_input((5, 6, 7), dim, torch.float32, seed=3), layout, axis=dim % 3)
    x0 = x.clone()
    y = entmax15(x, dim)
    assert y.is_contiguous() and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    check_against_oracle(y, x, dim)
    assert_bitwise_equal(x, x0, "x was modified")


@pytest.mark.parametrize("n", [40, 3000])
def test_fp32_wide_rows_and_masks(n):
    x = make_input((6, n), -1, torch.float32, seed=n, scale=0.3, mask_p=0.5)
    check_against_oracle(entmax15(x), x, -1)


# ----------------------------------------------------------------------------------------------
# -inf, NaN, +inf, degenerate shapes, errors, determinism
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_neg_inf_entries_take_no_part(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(60, generator=g) * 2).to(dtype)
    mask = torch.rand(60, generator=g) < 0.5
    mask[0] = False
    y = entmax15(x.masked_fill(mask, -INF))
    assert bool((y[mask] == 0).all()) and not bool(torch.signbit(y[mask]).any())
    alone = entmax15(x[~mask])
    if dtype in HALF_DTYPES:
        assert_within_ulps(y[~mask], alone, 1)
    else:
        assert relative_error(y[~mask], alone.double()) <= RTOL[dtype]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bad_slices_are_nan_and_others_unaffected(dtype):
    x = make_input((7, 9), -1, dtype, seed=5)
    x[0] = -INF
    x[1, 3] = math.nan
    x[2, 0] = INF
    x[3, :2] = torch.tensor([INF, -INF])
    y = entmax15(x)
    assert bool(torch.isnan(y[:4]).all()) and not bool(torch.isnan(y[4:]).any())
    assert_bitwise_equal(y[4:], entmax15(x[4:].clone()), "good rows changed by bad ones")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape,dim", [((0, 5), 0), ((0, 5), 1), ((5, 0), 1), ((0,), 0), ((2, 0, 3), 2)])
def test_empty(dtype, shape, dim):
    x = torch.empty(shape, dtype=dtype, requires_grad=True)
    y = entmax15(x, dim)
    assert y.shape == x.shape and y.dtype == dtype
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("value", [0.0, -3.5, 1e4])
def test_one_feature_and_zero_d(dtype, value):
    assert bool((entmax15(torch.full((4, 1, 3), value, dtype=dtype), 1) == 1).all())
    x = torch.tensor(value, dtype=dtype, requires_grad=True)
    y = entmax15(x)
    assert y.shape == () and y.item() == 1.0
    y.backward()
    assert x.grad.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtype_is_type_error(dtype):
    with pytest.raises(TypeError, match="entmax15"):
        entmax15(torch.ones(3, 4, dtype=dtype))


@pytest.mark.parametrize("shape,dim", [((3, 4), 2), ((3, 4), -3), ((), 1)])
def test_dim_out_of_range_is_index_error(shape, dim):
    with pytest.raises(IndexError):
        entmax15(torch.randn(shape), dim)


def test_deterministic():
    x = make_input((33, 517), -1, torch.float32, seed=6, scale=0.2, mask_p=0.1)
    first = entmax15(x)
    assert_bitwise_equal(entmax15(x.clone()), first, "not deterministic")


def test_module_and_entmax_compatible_signature():
    layer = Entmax15(dim=0, k=10)
    assert "dim=0" in repr(layer)
    x = torch.randn(5, 3)
    assert_bitwise_equal(layer(x), entmax15(x, dim=0, k=10), "module differs from the function")
    assert_bitwise_equal(flashmax.entmax15(x), entmax15(x, -1), "default dim is not the last")


# ----------------------------------------------------------------------------------------------
# Backward, double backward, custom ops, compile
# ----------------------------------------------------------------------------------------------


def expected_grad(y: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """dx = s g - (sum(s g) / sum(s)) s, s = sqrt(y), in fp64."""
    s, g = y.double().sqrt(), g.double()
    return s * g - (s * g).sum(dim, keepdim=True) / s.sum(dim, keepdim=True) * s


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_backward_formula(dtype, dim):
    x = make_input((6, 7, 9), dim, dtype, seed=7 + dim, scale=0.7).requires_grad_()
    g = make_input((6, 7, 9), dim, dtype, seed=8)
    y = entmax15(x, dim)
    (dx,) = torch.autograd.grad(y, x, g)
    want = expected_grad(y.detach(), g, dim)
    tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 4 * torch.finfo(dtype).eps)
    assert dx.dtype == dtype
    torch.testing.assert_close(dx.double(), want, rtol=0, atol=tol * float(g.abs().max()))


def test_backward_matches_entmax_package():
    entmax = pytest.importorskip("entmax")
    x = torch.randn(6, 20, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 20, dtype=torch.float64)
    (ours,) = torch.autograd.grad(entmax15(x), x, g)
    (theirs,) = torch.autograd.grad(entmax.entmax15(x), x, g)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_gradcheck_and_gradgradcheck_fp64(dim):
    x = (make_input((3, 4, 5), dim, torch.float64, seed=9 + dim) * 2).requires_grad_()
    fn = lambda t: entmax15(t, dim)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)
    assert torch.autograd.gradgradcheck(fn, (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dim", [0, 1])
def test_opcheck(dim):
    x = torch.randn(4, 6, requires_grad=True)
    torch.library.opcheck(torch.ops.flashmax.entmax15.default, (x, dim))
    y = entmax15(x.detach(), dim).requires_grad_()
    g = torch.randn(4, 6, requires_grad=True)
    torch.library.opcheck(torch.ops.flashmax.entmax15_backward.default, (y, g, dim))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    """One graph holding the opaque op, forward and backward equal to eager."""
    torch._dynamo.reset()

    def f(t):
        return (entmax15(t * 2, 0) * torch.arange(5.0)[:, None]).sum()

    x = torch.randn(5, 4, requires_grad=True)
    xc = x.detach().clone().requires_grad_()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(xc), f(x), rtol=1e-6, atol=1e-7)
    compiled(xc).backward()
    f(x).backward()
    torch.testing.assert_close(xc.grad, x.grad, rtol=1e-6, atol=1e-7)
    explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# ----------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 5), n=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 0.1, 1.0, 10.0, 1e3]), mask_p=st.sampled_from([0.0, 0.3]),
       kind=st.sampled_from(["randn", "ties", "near_max", "spike"]))
def test_property_matches_oracle(rows, n, seed, scale, mask_p, kind):
    x = make_input((rows, n), -1, torch.float32, seed, kind, scale, mask_p=mask_p)
    check_against_oracle(entmax15(x), x, -1)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 30), seed=st.integers(0, 2**31 - 1))
def test_property_reference_fp64(n, seed):
    x = make_input((4, n), -1, torch.float64, seed, scale=3.0)
    assert_close_to_oracle(reference.entmax15_forward(x), x, -1, 1e-12, entmax15_oracle)


# ----------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU, compiled with FLASHMAX_TEST_DEVICE=cuda)
# ----------------------------------------------------------------------------------------------

POISON = 12345.0
ROWS = 64 if ON_GPU else 5
KERNEL_WIDTHS = ([1, 3, 16, 100, 1000, 4096, 16384, 32768, 100000] if ON_GPU
                 else [1, 3, 16, 100, 1000])  # 16: one thread a row


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    from flashmax.kernels import entmax

    return entmax


def kernel_forward(kernels, x: torch.Tensor, dim: int = -1, **config) -> torch.Tensor:
    out = torch.full(x.shape, POISON, dtype=x.dtype, device=x.device)
    y = kernels.entmax15_forward(x, dim % x.dim(), out=out, **config)
    assert y is out and not bool((y == POISON).any()), "some outputs were never written"
    return y


@pytest.mark.parametrize("n", KERNEL_WIDTHS)
@pytest.mark.parametrize("kind,scale,offset", [("randn", 1.0, 0.0), ("near_max", 0.0, 0.0),
                                               ("randn", 1e-3, 0.0), ("randn", 1.0, 1e4),
                                               ("ties", 0.25, 0.0)])
def test_kernel_forward_matches_oracle(kernels, n, kind, scale, offset):
    x = make_input((ROWS, n), -1, torch.float32, seed=n, kind=kind, scale=scale, offset=offset)
    x = x.to(DEVICE)
    x0 = x.clone()
    check_against_oracle(kernel_forward(kernels, x), x, -1)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("config", [{"group": 1}, {"group": 4}, {"group": 32}, {"block_m": 4},
                                    {"chunk": 64}, {"chunk": 32, "group": 1},
                                    {"chunk": 64, "threshold_tile": 32},
                                    {"programs_per_sm": 1}, {"programs_per_sm": 1, "block_m": 4},
                                    {"chunk": 64, "bound_groups": 2}, {"chunk": 64, "bound_groups": 0},
                                    {"chunk": 64, "early_zeros": 16}, {"chunk": 64, "early_zeros": 0}],
                         ids=["no-groups", "four-groups", "thirty-two-groups", "four-rows",
                              "split", "split-no-groups", "split-pieces", "prefetching",
                              "prefetching-four-rows", "split-bounds-stopped-early",
                              "split-exact-bounds", "split-early-zeros", "split-no-early-zeros"])
def test_kernel_every_launch_path(kernels, config):
    # split-pieces: the row pass reads chunks that stored no candidates (nearly tied rows) in
    # pieces smaller than a chunk.
    # More rows than programs, even on a GPU, so the prefetching programs walk several blocks.
    rows = 2 * ROWS + 1 + (2 * torch.cuda.get_device_properties(0).multi_processor_count * 4
                           if ON_GPU else 0)
    x = make_input((rows, 200), -1, torch.float32, seed=10, kind="near_max").to(DEVICE)
    check_against_oracle(kernel_forward(kernels, x, **config), x, -1)


def test_kernel_launch_groups(kernels, record_launches):
    # fp32 rows of 16384+ entries held one a program take the groups spanning the layout (32);
    # shorter rows, 2-byte and fp64 rows at most 8 (`WIDE_GROUPS_FROM_BY_SIZE`). Nothing runs:
    # the launch is recorded.
    launched = record_launches(kernels.FORWARD_LAUNCHES)
    for dtype, n, want_group in [(torch.float32, 8192, 8), (torch.float32, 16384, 32),
                                 (torch.float32, 32768, 32), (torch.bfloat16, 16384, 8),
                                 (torch.bfloat16, 32768, 8), (torch.float64, 16384, 8)]:
        x = torch.randn(2, n, dtype=dtype, device=DEVICE)
        kernels.entmax15_forward(x, 1, out=torch.empty_like(x))
        assert launched[-1]["GROUP"] == want_group, (dtype, n, launched[-1])


def test_kernel_launch_holds_one_row_a_program(kernels, one_multiprocessor, record_launches):
    # Rows of 1024 and 2048 entries, as every width held in registers: one row a program, none
    # walking several rows and prefetching the next (that needs programs_per_sm, and more rows
    # than programs: of one multiprocessor here; NOTES v89). Nothing runs: the launch is
    # recorded.
    launched = record_launches(kernels.FORWARD_LAUNCHES)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1024, 2048):
            x = torch.randn(64, n, dtype=dtype, device=DEVICE)
            kernels.entmax15_forward(x, 1, out=torch.empty_like(x))
            assert not launched[-1]["PREFETCH"] and launched[-1]["BLOCK_M"] == 1, (dtype, n)
            kernels.entmax15_forward(x, 1, out=torch.empty_like(x), programs_per_sm=1)
            assert launched[-1]["PREFETCH"], (dtype, n)


def test_kernel_register_caps_reach_the_launch(kernels, one_multiprocessor, record_launches):
    """ENTMAX_REGISTER_CAPS go to Triton as maxnreg (NOTES v82, v83): rows of 4096-8192
    entries (block) at 168 in both dtypes; bf16 rows of 16, 64 and 256 entries at 80 from 64
    programs a SM (of one multiprocessor here); max_registers=0 uncaps. Nothing runs: the
    launch is recorded."""
    launched = record_launches(kernels.FORWARD_LAUNCHES)
    for dtype, n_rows, n, cap, want in [(torch.float32, 2, 4096, None, 168),
                                        (torch.bfloat16, 2, 6000, None, 168),
                                        (torch.float32, 2, 4096, 0, None),
                                        (torch.float32, 2, 2048, None, None),
                                        (torch.bfloat16, 2, 16384, None, None),
                                        (torch.bfloat16, 2048, 16, None, 80),
                                        (torch.bfloat16, 2016, 16, None, None),
                                        (torch.bfloat16, 1024, 64, None, 80),
                                        (torch.bfloat16, 1024, 64, 0, None),
                                        (torch.float32, 1024, 64, None, None),
                                        (torch.bfloat16, 256, 256, None, 80),
                                        (torch.bfloat16, 252, 256, None, None),
                                        (torch.bfloat16, 2048, 32, None, None)]:
        x = torch.randn(n_rows, n, device=DEVICE).to(dtype)
        kernels.entmax15_forward(x, 1, out=torch.empty_like(x), max_registers=cap)
        assert launched[-1]["maxnreg"] == want, (dtype, n_rows, n, cap, launched[-1])


# Register caps that fit one more program a SM without spilling (NOTES, v65); they take
# effect on the GPU, the interpreter ignores them.
@pytest.mark.parametrize("n", [4096, 8192] if ON_GPU else [300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_register_capped_launch_is_bit_identical(kernels, dtype, n):
    x = make_input((ROWS, n), -1, dtype, seed=n, kind="near_max").to(DEVICE)
    assert torch.equal(kernel_forward(kernels, x, max_registers=128), kernel_forward(kernels, x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_kernel_dtypes(kernels, dtype):
    x = make_input((ROWS, 150), -1, dtype, seed=11, scale=2.0).to(DEVICE)
    check_against_oracle(kernel_forward(kernels, x), x, -1)


@pytest.mark.parametrize("config", [{}, {"chunk": 16}], ids=["in-registers", "split"])
def test_kernel_bad_rows_and_masks(kernels, config):
    x = make_input((6, 40), -1, torch.float32, seed=12, mask_p=0.4).to(DEVICE)
    x[0, 3] = math.nan
    x[1, 5] = INF
    x[2] = -INF
    y = kernel_forward(kernels, x, **config)
    assert bool(torch.isnan(y[:3]).all()) and not bool(torch.isnan(y[3:]).any())
    check_against_oracle(y[3:], x[3:], -1)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_kernel_every_dim_and_strided_views(kernels, dim):
    x = make_input((4, 5, 6), dim, torch.float32, seed=13).to(DEVICE)
    check_against_oracle(kernel_forward(kernels, x, dim), x, dim)
    view = noncontiguous_copy(x.cpu(), "strided", axis=dim).to(DEVICE)
    check_against_oracle(kernel_forward(kernels, view, dim, chunk=4), view, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [10, 200, 1000])
@pytest.mark.parametrize("kind", ["randn", "near_max"])
def test_kernel_adjacent_rows(kernels, kind, n, dtype):
    """[2, n, inner] contiguous over dim 1: rows adjacent in memory (`adjacent_rows`), more of
    them than a program's and not a multiple; forward and backward."""
    from flashmax.kernels import sparsemax as rows

    inner = {10: 130, 200: 37, 1000: 9}[n]
    x = make_input((2 * inner, n), -1, dtype, seed=n, kind=kind)
    x = x.reshape(2, inner, n).transpose(1, 2).contiguous().to(DEVICE)
    outer, inner, strides = rows.rows_view(x, 1)
    assert rows.adjacent_rows_launch(x, outer * inner, n, inner, (strides, strides)) is not None
    y = kernel_forward(kernels, x, 1)
    check_against_oracle(y, x, 1)
    g = make_input(x.shape, 1, dtype, seed=n + 1).to(DEVICE)
    dx = kernels.entmax15_backward(y, g, 1, out=torch.full_like(y, POISON))
    want = expected_grad(y.cpu(), g.cpu(), 1)
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(dx.cpu().double(), want, rtol=0, atol=tol * float(g.abs().max()))


@pytest.mark.parametrize("chunk", [None, 32], ids=["in-registers", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kernel_backward(kernels, chunk, dtype):
    x = make_input((ROWS, 100), -1, dtype, seed=14, kind="near_max").to(DEVICE)
    y = kernel_forward(kernels, x)
    g = make_input((ROWS, 100), -1, dtype, seed=15).to(DEVICE)
    out = torch.full(x.shape, POISON, dtype=dtype, device=DEVICE)
    dx = kernels.entmax15_backward(y, g, 1, out=out, chunk=chunk)
    assert dx is out and not bool((dx == POISON).any())
    want = expected_grad(y.cpu(), g.cpu(), 1)
    tol = 1e-12 if dtype == torch.float64 else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(dx.cpu().double(), want, rtol=0, atol=tol * float(g.abs().max()))


@pytest.mark.parametrize("chunk", [None, 32], ids=["in-registers", "split"])
def test_kernel_backward_nan_grad_off_the_support(kernels, chunk):
    # As the entmax package's formula: s g with s = sqrt(y) = 0 and g NaN is NaN, so a NaN in g
    # where y is 0 makes its row's gradient NaN, on either path (the split backward reads g in
    # every chunk, with or without support); the other rows are unaffected.
    x = make_input((4, 100), -1, torch.float32, seed=30).to(DEVICE)
    y = kernel_forward(kernels, x)
    g = make_input((4, 100), -1, torch.float32, seed=31).to(DEVICE)
    off = int((y[1] == 0).nonzero()[-1])
    g[1, off] = math.nan
    dx = kernels.entmax15_backward(y, g, 1, out=torch.full_like(y, POISON), chunk=chunk)
    assert bool(torch.isnan(dx[1]).all())
    want = expected_grad(y[[0, 2, 3]].cpu(), g[[0, 2, 3]].cpu(), 1)
    torch.testing.assert_close(dx[[0, 2, 3]].cpu().double(), want, rtol=0, atol=1e-6)


def test_kernel_long_rows(kernels):
    """A couple of rows of 4096 (the interpreter is slow): in registers and split."""
    x = make_input((2, 4096), -1, torch.float32, seed=22, kind="near_max").to(DEVICE)
    check_against_oracle(kernel_forward(kernels, x), x, -1)
    check_against_oracle(kernel_forward(kernels, x, chunk=1024), x, -1)


@pytest.mark.parametrize("n", [1024, 2048])
def test_kernel_two_support_entries_in_one_group(kernels, n):
    """As sparsemax's: a support of two entries of one group (columns w and w + 3n/8 at
    GROUP = 8) among randn rows, which take the group maxima's tau (2048: one row a tile)."""
    x = make_input((4, n), -1, torch.float32, seed=24).to(DEVICE)
    x[1] = x[1] * 0.01 - 5.0
    x[1, 5] = 1.0
    x[1, 5 + 3 * n // 8] = 0.875
    y = kernel_forward(kernels, x)
    assert float(y[1, 5 + 3 * n // 8]) > 0.4, y[1, [5, 5 + 3 * n // 8]]
    check_against_oracle(y, x, -1)


@pytest.mark.parametrize("n", KERNEL_WIDTHS[1:])
@pytest.mark.parametrize("chunk", [None, 64], ids=["in-registers", "split"])
def test_kernel_entries_exactly_at_the_threshold(kernels, n, chunk):
    """Rows of k tied maxima over entries that lie at the threshold: in z = (x - max) / 2 tau is
    -1 / sqrt(k), so the entries x = max - 2 / sqrt(k) are exactly at it (k = 2: within a
    rounding), zero in the output, and d = 0 for a step that lands on tau."""
    rows = []
    for k, offset in [(1, 0.0), (2, 3.0), (4, 0.0), (16, -7.0)]:
        row = torch.full((n,), offset - 2.0 / k**0.5)
        row[:k] = offset
        rows.append(row[torch.randperm(n, generator=torch.Generator().manual_seed(k))])
    x = torch.stack(rows).to(DEVICE)
    check_against_oracle(kernel_forward(kernels, x, chunk=chunk), x, -1)


# Long rows, most with large supports of nearly tied entries: Newton's fp32 sums stay exact only
# centred (`kernels.entmax._entmax_sums`), and the interpreter sums in sequence, the worst order.
HARD_ROWS = [("near_max", 0.0, 0.0, 0.0), ("near_max", 1e4, 0.0, 0.0), ("ties", 0.01, 0.0, 0.0),
             ("randn", 1e-3, 0.0, 0.0), ("randn", 0.01, 0.0, 0.5), ("randn", 1.0, 1e4, 0.0),
             ("spike", 1.0, 0.0, 0.0), ("randn", 1.0, 0.0, 0.0)]


@pytest.mark.parametrize("chunk,median", [(None, 1e-7), (512, 2e-7)],
                         ids=["in-registers", "split"])
@pytest.mark.parametrize("kind,scale,offset,mask_p", HARD_ROWS)
def test_kernel_centred_sums_on_long_rows(kernels, chunk, median, kind, scale, offset, mask_p):
    """Every row within 1e-6 of the oracle, the median row within `median`. Rounding the
    outputs alone, ((z - pivot) - step)^2 in fp32 from the exact tau, costs up to ~9e-8 on
    these rows; split, a first step from the best chunk's bound may be final from ~|tau|
    away, where the fp32 closed form costs about 2 ulps more (fp64 sums gave 1.0-1.3e-7 there
    too)."""
    x = make_input((ROWS, 2048), -1, torch.float32, seed=23, kind=kind, scale=scale,
                   offset=offset, mask_p=mask_p).to(DEVICE)
    ref = entmax15_oracle(x.cpu())
    diff = kernel_forward(kernels, x, chunk=chunk).cpu().double() - ref
    errors = diff.norm(dim=-1) / ref.norm(dim=-1)
    assert float(errors.max()) <= RTOL[torch.float32], f"worst row {float(errors.max()):.3g}"
    assert float(errors.median()) <= median, f"median row {float(errors.median()):.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,scale,offset,mask_p", HARD_ROWS)
def test_kernel_sums_with_selects(kernels, monkeypatch, dtype, kind, scale, offset, mask_p):
    """2-byte rows of SELECTS_FROM_2BYTE_WIDTH or more entries held one a program sum with
    selects on the mask, s1 centred too (`_entmax_sums`' other form): the GPU takes it on rows
    that wide, the interpreter on short rows with the width lowered to theirs."""
    n = 16384 if ON_GPU else 1000
    if not ON_GPU:
        monkeypatch.setattr(kernels, "SELECTS_FROM_2BYTE_WIDTH", 1024)
    x = make_input((ROWS, n), -1, dtype, seed=25, kind=kind, scale=scale, offset=offset,
                   mask_p=mask_p).to(DEVICE)
    check_against_oracle(kernel_forward(kernels, x), x, -1)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 4), n=st.integers(1, 70), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), mask_p=st.sampled_from([0.0, 0.4]),
       kind=st.sampled_from(["randn", "ties", "near_max", "spike"]), chunk=st.sampled_from([None, 16]))
def test_kernel_property(kernels, rows, n, seed, scale, mask_p, kind, chunk):
    x = make_input((rows, n), -1, torch.float32, seed, kind, scale, mask_p=mask_p).to(DEVICE)
    check_against_oracle(kernel_forward(kernels, x, chunk=chunk), x, -1)


def test_kernel_deterministic(kernels):
    x = make_input((ROWS, 500), -1, torch.float32, seed=16, kind="near_max").to(DEVICE)
    assert torch.equal(kernel_forward(kernels, x), kernel_forward(kernels, x))


@pytest.mark.skipif(not ON_GPU, reason="the public op runs the kernels on CUDA tensors only")
def test_public_op_uses_kernels_and_eager_path_matches_op(kernels):
    x = make_input((64, 1000), -1, torch.float32, seed=17).to(DEVICE).requires_grad_()
    g = torch.randn_like(x)
    y_fast, y_op = entmax15(x), torch.ops.flashmax.entmax15(x, 1)
    assert torch.equal(y_fast, y_op) and torch.equal(y_fast, kernel_forward(kernels, x.detach()))
    assert type(y_fast.grad_fn).__name__ == "_EagerEntmax15Backward"
    (dx_fast,) = torch.autograd.grad(y_fast, x, g)
    (dx_op,) = torch.autograd.grad(y_op, x, g)
    assert torch.equal(dx_fast, dx_op)
    xd = make_input((3, 20), -1, torch.float64, seed=18).to(DEVICE).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: entmax15(t, 1), (xd,))
    # Without a graph to record (no grad wanted, or grad mode off) the launcher runs alone.
    for y_bare in (entmax15(x.detach()), torch.no_grad()(entmax15)(x)):
        assert y_bare.grad_fn is None and not y_bare.requires_grad
        assert torch.equal(y_bare, y_op)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    x = make_input((256, 8192), -1, torch.float32, seed=19).to(DEVICE)
    entmax15(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = entmax15(x)
    x.copy_(make_input((256, 8192), -1, torch.float32, seed=20, kind="near_max").to(DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    check_against_oracle(y, x, -1)


def test_import_flashmax_as_entmax():
    """The shared names take the entmax package's arguments, k included (accepted, ignored)."""
    import flashmax as entmax

    x = make_input((4, 9), -1, torch.float32, seed=21)
    for fn, module in ((entmax.sparsemax, entmax.Sparsemax), (entmax.entmax15, entmax.Entmax15)):
        assert_bitwise_equal(fn(x, dim=0, k=3), fn(x, 0), "k changed the result")
        assert_bitwise_equal(module(dim=0, k=3)(x), fn(x, 0), "module differs")
    assert entmax.Entmax15Loss(k=100, ignore_index=-100, reduction="sum").reduction == "sum"
    assert entmax.SparsemaxLoss(k=None).reduction == "elementwise_mean"
